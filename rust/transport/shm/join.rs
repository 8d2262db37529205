//! How a rank joins the shared-memory world, through whatever key-value store the job has (see
//! `crate::rendezvous`: rank 0's TCP store, or torch's): the ranks meet ([`Meeting`]); once every rank
//! is admitted, rank 0 creates the segment and hands out its [`token`](SegmentToken::token) (segment
//! name, session nonce, world size) as the meeting's verdict; every rank (rank 0 too) attaches it,
//! records its pid, and waits until every rank has; then the name is removed (from then on no crash
//! can leak it).
//!
//! Whoever can read the store learns the segment's name, but the segment is a 0600 file of this user
//! that `segment::attach` owner-checks, and the nonce ties it to this job.

use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use super::layout::{check_member, Layout, Params};
use super::liveness::Liveness;
use super::segment::{self, Mapping};
use super::ShmOptions;
use crate::error::{Error, Result};
use crate::rendezvous::{KeyValueStore, Meeting};
use crate::sync::wait::{may_spin, Stop, Wait};

/// Longest token a store may hand a rank (what [`token`] writes is far shorter).
const MAX_TOKEN: usize = 512;

/// What a rank has once it joined: the mapped segment, its layout, and pidfds of its peers.
pub(crate) struct Joined {
    pub mapping: Mapping,
    pub layout: Layout,
    pub liveness: Liveness,
}

/// Join the world `opts` describes through `store` (blocks until every rank has joined, the timeout
/// passes, or Ctrl-C).
pub(crate) fn through(store: &dyn KeyValueStore, opts: &ShmOptions) -> Result<Joined> {
    check_member(opts.rank, opts.world_size)?;
    let started = Instant::now();
    let meeting = Meeting::new(store, opts.rank, opts.world_size, opts.secret.as_ref(), opts.timeout);
    let mut created = None;
    let body = meeting.run(|| {
        let segment = SegmentToken::create(opts)?;
        let token = segment.token();
        created = Some(segment);
        Ok(token.into_bytes())
    })?;
    let token = std::str::from_utf8(&body)
        .ok()
        .filter(|t| t.len() <= MAX_TOKEN)
        .ok_or_else(|| Error::invalid("rendezvous: rank 0's verdict is not a shared-memory token"))?;
    let left = opts.timeout.saturating_sub(started.elapsed());
    // Rank 0 hears at once why a rank could not attach, instead of at its timeout.
    let joined = attach(token, opts.rank, opts.world_size, left, || meeting.reported()).inspect_err(|e| {
        // Only what this rank found wrong: every rank sees a timeout or a death itself.
        if matches!(e, Error::Os { .. } | Error::InvalidArgument(_)) {
            meeting.report(e)
        }
    })?;
    drop(created);
    if opts.rank == 0 {
        // Every rank has attached, so every rank has read the verdict.
        meeting.clear()?;
    }
    Ok(joined)
}

/// A segment rank 0 created for a job whose ranks have not all joined yet. Dropping it removes the
/// name (the ranks that attached keep their mappings), so a failed start leaves nothing behind.
pub(crate) struct SegmentToken {
    name: String,
    nonce: [u8; 16],
    world: usize,
    /// Keeps the creator's mapping (and so the file's memory) until every rank has attached its own.
    _mapping: Mapping,
}

impl Drop for SegmentToken {
    fn drop(&mut self) {
        segment::unlink(&self.name);
    }
}

impl SegmentToken {
    /// Create the segment of the world `opts` describes: named after its job id (so the launcher can
    /// remove it after a crash during start-up), else under a fresh random name.
    pub(crate) fn create(opts: &ShmOptions) -> Result<SegmentToken> {
        let world = opts.world_size;
        check_member(0, world)?;
        let mut params = Params::new(world, opts.arena_bytes);
        // The others learn the round size from the header.
        if let Some(bytes) = opts.chunk_bytes {
            params.chunk = bytes;
        }
        let layout = Layout::checked(params)?;
        let nonce = crate::rendezvous::secret::random::<16>()?;
        let (name, mapping) = match segment_name(opts.job_id.as_deref())? {
            Some(name) => (name.clone(), segment::create(&name, &layout, nonce)?),
            None => segment::create_random(&layout, nonce)?,
        };
        Ok(SegmentToken { name, nonce, world, _mapping: mapping })
    }

    /// What the other ranks need: `"<name> <nonce hex> <world size>"`.
    pub(crate) fn token(&self) -> String {
        token(&self.name, self.nonce, self.world)
    }
}

fn segment_name(job: Option<&str>) -> Result<Option<String>> {
    let Some(job) = job else {
        return Ok(None);
    };
    if job.is_empty()
        || job.len() > 64
        || !job.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Error::invalid(format!("job id {job:?} must be 1-64 letters, digits, '-' or '_'")));
    }
    Ok(Some(segment::name_for(job)))
}

fn me() -> u32 {
    rustix::process::getpid().as_raw_nonzero().get() as u32
}

/// Record this rank in the header: where it holds the cross-memory probe word, its pid, then one more
/// attached rank.
pub(crate) fn register(m: &Mapping, rank: usize) {
    let h = m.header();
    h.probes[rank].store(crate::algo::process_vm::PROBE.as_ptr() as u64, SeqCst);
    h.pids[rank].store(me(), SeqCst);
    h.attached.fetch_add(1, SeqCst);
}

pub(crate) fn pids(m: &Mapping, world: usize) -> Vec<u32> {
    m.header().pids[..world].iter().map(|p| p.load(SeqCst)).collect()
}

/// The token of segment `name` with `nonce` for `world` ranks.
pub(crate) fn token(name: &str, nonce: [u8; 16], world: usize) -> String {
    let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    format!("{name} {hex} {world}")
}

/// Parse a token from the store: it came through a channel others may write, so check everything.
/// Only what [`token`] writes is accepted (lower-case hex, a plain decimal world size).
pub(crate) fn parse(token: &str, world: usize) -> Result<(String, [u8; 16])> {
    let bad = || Error::invalid(format!("malformed shared-memory token {token:?} in the store"));
    let mut parts = token.split(' ');
    let (Some(name), Some(hex), Some(digits), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if !segment::plausible_name(name) {
        return Err(bad());
    }
    if hex.len() != 32 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(bad());
    }
    let mut nonce = [0u8; 16];
    for (i, b) in nonce.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    // `parse` also takes "+2" and "02": not what `token` writes.
    let n: usize = digits.parse().ok().filter(|n: &usize| n.to_string() == digits).ok_or_else(bad)?;
    if n != world {
        return Err(Error::invalid(format!(
            "this rank was started with world_size {world}, but rank 0 created the world for {n}"
        )));
    }
    Ok((name.to_string(), nonce))
}

/// Attach the segment named by `token` as `rank` of `world` and wait (until `timeout`, Ctrl-C, or a
/// registered rank's death) until every rank has attached; then the name is removed.
fn attach(
    token: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
    mut reported: impl FnMut() -> Result<()>,
) -> Result<Joined> {
    check_member(rank, world)?;
    let (name, nonce) = parse(token, world)?;
    let (mapping, layout) = segment::attach(&name, world, nonce)?;
    let h = mapping.header();
    if h.pids[rank].load(SeqCst) != 0 {
        return Err(Error::invalid(format!("two processes claim rank {rank}")));
    }
    register(&mapping, rank);
    h.event.notify(true);
    let op = "init (attaching the shared-memory segment)";
    let w = Wait { event: &h.event, shared: true, spin: may_spin(world), timeout, op: &op };
    let all = || h.attached.load(SeqCst) as usize >= world;
    // Every rank is watched from when its pid shows: one that attached and then exited while a rank
    // had yet to attach is reported at once, with its exit status, instead of after the timeout. One
    // that exited once every rank had attached (a fast rank that finished its work) fails nobody's
    // start-up: its absence is for the collectives to report. So a death counts only if, asked after
    // it was seen, not every rank has attached yet.
    let mut liveness = Liveness::new(world);
    let everyone: Vec<usize> = (0..world).collect();
    let slow = || {
        watch_registered(&mut liveness, &mapping, world, rank)?;
        match liveness.first_dead(&everyone) {
            Some(dead) if !all() => Err(liveness.exited(dead, op)),
            _ => reported(),
        }
    };
    let waited = w.until(all, || Ok(()), slow);
    match waited {
        Ok(()) => {}
        Err(Stop::Failed(e)) => return Err(e),
        Err(Stop::TimedOut) => {
            let missing =
                pids(&mapping, world).into_iter().enumerate().filter(|&(_, p)| p == 0).map(|(r, _)| r);
            return Err(Error::timeout(rank, op, timeout, missing.collect(), (0..world).collect()));
        }
    }
    // Everyone has it mapped: from now on no crash can leak the name.
    segment::unlink(&name);
    // Whoever is not watched yet (every rank, when this one attached last) is watched now; one that
    // has exited since every rank attached is recorded as dead, for the collectives to report.
    watch_registered(&mut liveness, &mapping, world, rank)?;
    Ok(Joined { mapping, layout, liveness })
}

/// Watch every other rank that has registered its pid and is not watched yet.
fn watch_registered(liveness: &mut Liveness, m: &Mapping, world: usize, me: usize) -> Result<()> {
    for (r, pid) in pids(m, world).into_iter().enumerate() {
        if r != me && pid != 0 && !liveness.watches(r) {
            liveness.watch(r, pid)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::MemoryStore;

    fn opts(rank: usize, world: usize) -> ShmOptions {
        let mut o = ShmOptions::new(rank, world, "127.0.0.1", 0);
        o.arena_bytes = 0;
        o.timeout = Duration::from_secs(20);
        o
    }

    #[test]
    fn tokens_round_trip_and_bad_ones_are_refused() {
        let t = SegmentToken::create(&opts(0, 2)).unwrap();
        let (name, nonce) = parse(&t.token(), 2).unwrap();
        assert_eq!((name.as_str(), nonce), (t.name.as_str(), t.nonce));
        assert!(parse(&t.token(), 3).unwrap_err().to_string().contains("world_size 3"));
        let hex = "00".repeat(16);
        for bad in [
            String::new(),
            format!("/etc/passwd {hex} 2"),
            format!("/axonml-1/../x {hex} 2"),
            format!("/axonml-1-x {} 2", "zz".repeat(16)),
            format!("/axonml-1-x {hex} 2 extra"),
            format!("/axonml-1-x {hex} two"),
        ] {
            assert!(parse(&bad, 2).is_err(), "{bad:?}");
        }
    }

    /// Found by `fuzzing::token`: tokens `token` never writes (upper-case hex, "+2", "02") were taken.
    #[test]
    fn only_canonical_tokens_are_taken() {
        let hex = "0a".repeat(16);
        assert!(parse(&format!("/axonml-1-x {hex} 2"), 2).is_ok());
        for bad in [
            format!("/axonml-1-x {} 2", "0A".repeat(16)),
            format!("/axonml-1-x {hex} +2"),
            format!("/axonml-1-x {hex} 02"),
        ] {
            assert!(parse(&bad, 2).is_err(), "{bad:?}");
        }
        // libFuzzer's input (one upper-case digit).
        assert!(parse("/axonml-l2511 eeeeeeeeee5eeeeE5eeeeeee1eeee1ee 0", 0).is_err());
        assert!(parse("/axonml-l2511 eeeeeeeeee5eeeee5eeeeeee1eeee1ee 0", 0).is_ok());
    }

    #[test]
    fn every_rank_joins_and_the_name_is_gone_afterwards() {
        let t = SegmentToken::create(&opts(0, 3)).unwrap();
        let token = &t.token();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| s.spawn(move || attach(token, r, 3, Duration::from_secs(20), || Ok(()))))
                .collect();
            for h in hs {
                assert!(h.join().unwrap().is_ok());
            }
        });
        assert!(!std::path::Path::new(&format!("/dev/shm{}", t.name)).exists());
    }

    #[test]
    fn a_missing_rank_times_out_naming_it_and_drop_removes_the_name() {
        let t = SegmentToken::create(&opts(0, 2)).unwrap();
        let path = format!("/dev/shm{}", t.name);
        let e = attach(&t.token(), 0, 2, Duration::from_millis(200), || Ok(())).err().unwrap();
        assert!(matches!(&e, Error::Timeout { missing, .. } if missing == &vec![1]), "{e}");
        assert!(std::path::Path::new(&path).exists());
        drop(t);
        assert!(!std::path::Path::new(&path).exists());
    }

    /// A child process that has exited: reaped (its pid names no process), or a zombie until the
    /// caller reaps it.
    fn dead_child(reaped: bool) -> std::process::Child {
        let mut child = std::process::Command::new("sh").args(["-c", "exit 0"]).spawn().unwrap();
        if reaped {
            child.wait().unwrap();
        } else {
            use rustix::process::{waitid, Pid, WaitId, WaitIdOptions};
            let p = Pid::from_raw(child.id() as i32).unwrap();
            waitid(WaitId::Pid(p), WaitIdOptions::EXITED | WaitIdOptions::NOWAIT).unwrap();
        }
        child
    }

    /// A world of 3 whose rank 1 registered `pid` (a process that has exited since) and whose rank 2
    /// has attached or not: what rank 0 gets when it attaches.
    fn attach_beside_a_dead_rank_1(pid: u32, rank2_attached: bool) -> Result<Joined> {
        let t = SegmentToken::create(&opts(0, 3)).unwrap();
        let (m, _) = segment::attach(&t.name, 3, t.nonce).unwrap();
        let h = m.header();
        h.pids[1].store(pid, SeqCst);
        h.attached.fetch_add(1, SeqCst);
        if rank2_attached {
            register(&m, 2);
        }
        attach(&t.token(), 0, 3, Duration::from_secs(20), || Ok(()))
    }

    /// The start-up race seen in CI: a fast rank joins, finishes its work and exits while a slower one
    /// is still in the last step of its join. Every rank had attached: the slower one's start-up
    /// succeeds, and its liveness names the dead rank for the first collective that waits for it.
    #[test]
    fn a_rank_that_exits_once_every_rank_attached_fails_no_one_s_start_up() {
        for reaped in [true, false] {
            let mut child = dead_child(reaped);
            let pid = child.id();
            let joined = attach_beside_a_dead_rank_1(pid, true).unwrap_or_else(|e| panic!("{reaped}: {e}"));
            assert_eq!(joined.liveness.first_dead(&[1, 2]), Some(1), "reaped: {reaped}");
            assert_eq!(joined.liveness.first_dead(&[2]), None, "reaped: {reaped}");
            let e = joined.liveness.exited(1, "barrier");
            assert!(matches!(e, Error::PeerExited { peer: 1, pid: p, .. } if p == pid), "{e}");
            child.wait().unwrap();
        }
    }

    /// A rank that attached and exited while another has yet to attach will never make its
    /// collectives: the start-up fails naming it (not at the timeout, for the missing rank).
    #[test]
    fn a_rank_that_exits_before_every_rank_attached_fails_the_start_up_naming_it() {
        for reaped in [true, false] {
            let mut child = dead_child(reaped);
            let pid = child.id();
            let e = attach_beside_a_dead_rank_1(pid, false).err().unwrap();
            assert!(matches!(&e, Error::PeerExited { peer: 1, pid: p, .. } if *p == pid), "{reaped}: {e}");
            assert!(e.to_string().starts_with("peer rank 1 died during init"), "{e}");
            child.wait().unwrap();
        }
    }

    #[test]
    fn ranks_meet_through_a_store_and_leave_nothing_in_it() {
        let store = MemoryStore::new();
        let key = crate::rendezvous::JobSecret::new(vec![5; 32]).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let (store, key) = (&store, key.clone());
                    s.spawn(move || {
                        let mut o = opts(r, 3);
                        o.secret = Some(key);
                        through(store, &o).map(|j| j.layout.params.world)
                    })
                })
                .collect();
            for h in hs {
                assert_eq!(h.join().unwrap().unwrap(), 3);
            }
        });
        for k in ["axonml/rank0", "axonml/verdict", "axonml/knocks", "axonml/knock/1", "axonml/knock/2"] {
            assert_eq!(store.get(k).unwrap(), None, "{k}");
        }
    }
}
