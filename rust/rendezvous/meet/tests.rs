//! The meeting on every outcome: ranks meet with and without a secret; another secret, world size or
//! a stranger's knock; a report after the meeting; a store that never answers.

use super::*;
use crate::rendezvous::MemoryStore;

fn key(b: u8) -> JobSecret {
    JobSecret::new(vec![b; 32]).unwrap()
}

/// Every rank of `ranks.len()` meets in `store` with its own secret and world size; rank 0
/// hands out "body". The results in rank order.
fn meet_all(
    store: &dyn KeyValueStore,
    ranks: &[(Option<JobSecret>, usize)],
    timeout: Duration,
) -> Vec<Result<Vec<u8>>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(r, (k, world))| {
                s.spawn(move || {
                    Meeting::new(store, r, *world, k.as_ref(), timeout).run(|| Ok(b"body".to_vec()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_meet_with_and_without_a_secret() {
    for k in [Some(key(1)), None] {
        let store = MemoryStore::new();
        let got = meet_all(&store, &vec![(k.clone(), 4); 4], Duration::from_secs(20));
        assert!(got.iter().all(|r| r.as_deref().ok() == Some(&b"body"[..])), "{got:?}");
    }
}

#[test]
fn a_rank_with_another_secret_or_none_is_refused_and_rank_0_times_out_naming_it() {
    for other in [Some(key(2)), None] {
        let store = MemoryStore::new();
        let got = meet_all(&store, &[(Some(key(1)), 2), (other.clone(), 2)], Duration::from_millis(500));
        let e1 = got[1].as_ref().unwrap_err().to_string();
        assert_eq!(e1, secret_mismatch(1).to_string());
        let Err(Error::Timeout { missing, op, .. }) = &got[0] else { panic!("{:?}", got[0]) };
        assert_eq!(missing, &vec![1]);
        assert!(op.contains("rank 1 does not prove that it knows rank 0's AXONML_JOB_SECRET"), "{op}");
    }
    // Rank 0 without one, the rank with one: the same refusal.
    let store = MemoryStore::new();
    let got = meet_all(&store, &[(None, 2), (Some(key(1)), 2)], Duration::from_millis(500));
    assert_eq!(got[1].as_ref().unwrap_err().to_string(), secret_mismatch(1).to_string());
}

#[test]
fn another_world_size_is_named_on_both_sides() {
    let store = MemoryStore::new();
    let got = meet_all(&store, &[(Some(key(1)), 2), (Some(key(1)), 3)], Duration::from_millis(500));
    let e1 = got[1].as_ref().unwrap_err().to_string();
    assert!(e1.contains("rank 1 was started with world_size 3, but rank 0 has 2"), "{e1}");
    let e0 = got[0].as_ref().unwrap_err().to_string();
    assert!(e0.contains("[1]") && e0.contains("world_size 3"), "{e0}");
}

#[test]
fn strangers_knocks_and_an_old_verdict_do_not_stop_the_meeting() {
    let store = MemoryStore::new();
    let old = Verdict { nonce: [0; TAG], admitted: true, body: b"old".to_vec(), tags: vec![] };
    store.set("axonml/verdict", &old.encode()).unwrap();
    let strangers = |store: &MemoryStore| {
        while store.get("axonml/rank0").unwrap().is_none() {
            std::thread::sleep(Duration::from_millis(1));
        }
        for junk in [b"junk".to_vec(), vec![0; 100]] {
            let slot = store.add("axonml/knocks", 1).unwrap();
            store.set(&format!("axonml/knock/{slot}"), &junk).unwrap();
        }
        // A hello claiming rank 1 with a made-up proof, and a slot claimed and never written.
        let h = Hello { rank: 1, world: 3, host: this_host(), nonce: [3; TAG], proof: Some([4; TAG]) };
        let slot = store.add("axonml/knocks", 1).unwrap();
        store.set(&format!("axonml/knock/{slot}"), &h.encode()).unwrap();
        store.add("axonml/knocks", 1).unwrap();
    };
    std::thread::scope(|s| {
        s.spawn(|| strangers(&store));
        let got = meet_all(&store, &vec![(Some(key(1)), 3); 3], Duration::from_secs(20));
        assert!(got.iter().all(|r| r.as_deref().ok() == Some(&b"body"[..])), "{got:?}");
    });
}

#[test]
fn a_rank_reports_what_it_could_not_use_and_the_others_hear_it() {
    let store = MemoryStore::new();
    let (zero, one) =
        (Meeting::new(&store, 0, 2, None, Duration::ZERO), Meeting::new(&store, 1, 2, None, Duration::ZERO));
    assert!(zero.reported().is_ok());
    one.report(&Error::invalid("bad segment"));
    let e = zero.reported().unwrap_err().to_string();
    assert_eq!(e, "rank 1 could not use what rank 0 handed out: bad segment");
    zero.clear().unwrap();
    assert!(zero.reported().is_ok());
}

/// A store that holds nothing and never sees a key arrive.
struct Silent;

impl KeyValueStore for Silent {
    fn set(&self, _: &str, _: &[u8]) -> Result<()> {
        Ok(())
    }
    fn get(&self, _: &str) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }
    fn wait(&self, _: &[&str], timeout: Duration) -> Result<bool> {
        std::thread::sleep(timeout);
        Ok(false)
    }
    fn add(&self, _: &str, _: i64) -> Result<i64> {
        Ok(0)
    }
    fn delete(&self, _: &str) -> Result<()> {
        Ok(())
    }
    fn name(&self) -> String {
        "the silent store".into()
    }
}

#[test]
fn a_store_that_never_answers_times_out_naming_what_was_awaited() {
    let got = meet_all(&Silent, &[(None, 2), (None, 2)], Duration::from_millis(300));
    let Err(Error::Timeout { missing, op, .. }) = &got[1] else { panic!("{:?}", got[1]) };
    assert_eq!(missing, &vec![0]);
    assert!(op.contains("the silent store (waiting for rank 0's hello, key \"axonml/rank0\")"), "{op}");
    let Err(Error::Timeout { missing, op, .. }) = &got[0] else { panic!("{:?}", got[0]) };
    assert_eq!(missing, &vec![1]);
    assert!(op.contains("the silent store (waiting for the other ranks' knocks)"), "{op}");
}
