//! Joining the shared-memory world through someone else's key-value store, in two phases: rank 0
//! creates the segment and hands out a [`token`](SegmentToken::token) (segment name, session nonce,
//! world size) by whatever store the job already has (torch's TCPStore or FileStore); every rank
//! (rank 0 too) then [`join`]s with it. No socket of ours is opened.
//!
//! The store is the trust boundary: whoever can read it learns the segment's name, but the segment is
//! a 0600 file of this user that `segment::attach` owner-checks, and the nonce ties it to this job.

use std::time::{Duration, Instant};

use super::layout::{check_member, Layout, Params};
use super::liveness::Liveness;
use super::rendezvous::{pids, register, Joined};
use super::segment::{self, Mapping};
use crate::error::{Error, Result};
use crate::sync::wait::{may_spin, Stop, Wait};

/// A segment rank 0 created for a job whose ranks have not all joined yet. Dropping it removes the
/// name (the ranks that attached keep their mappings), so a failed start leaves nothing behind.
pub struct SegmentToken {
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
    /// Create the segment for `world` ranks with `arena_bytes` of segment arrays per rank, under a
    /// fresh random name.
    pub fn create(world: usize, arena_bytes: usize) -> Result<SegmentToken> {
        check_member(0, world)?;
        let layout = Layout::checked(Params::new(world, arena_bytes))?;
        let nonce = segment::random::<16>()?;
        let (name, mapping) = segment::create_random(&layout, nonce)?;
        Ok(SegmentToken { name, nonce, world, _mapping: mapping })
    }

    /// What the other ranks need: `"<name> <nonce hex> <world size>"`.
    pub fn token(&self) -> String {
        token(&self.name, self.nonce, self.world)
    }
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
pub(crate) fn join(token: &str, rank: usize, world: usize, timeout: Duration) -> Result<Joined> {
    check_member(rank, world)?;
    let (name, nonce) = parse(token, world)?;
    let (mapping, layout) = segment::attach(&name, world, nonce)?;
    let h = mapping.header();
    if h.pids[rank].load(std::sync::atomic::Ordering::SeqCst) != 0 {
        return Err(Error::invalid(format!("two processes claim rank {rank}")));
    }
    register(&mapping, rank);
    h.event.notify(true);
    let op = "init (shared-memory join through the store)";
    let w =
        Wait { event: &h.event, shared: true, spin: may_spin(world), deadline: Instant::now() + timeout, op };
    let all = || h.attached.load(std::sync::atomic::Ordering::SeqCst) as usize >= world;
    // Every rank is watched from when its pid shows: one that attached and then exited is reported at
    // once, with its exit status, instead of after the timeout.
    let mut liveness = Liveness::new(world);
    let waited = w.until(all, || Ok(()), || watch_registered(&mut liveness, &mapping, world, rank, op));
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
    watch_registered(&mut liveness, &mapping, world, rank, op)?;
    Ok(Joined { mapping, layout, liveness })
}

/// Watch every other rank that has registered its pid; fails when a watched one has exited (it will
/// never make its collectives).
fn watch_registered(liveness: &mut Liveness, m: &Mapping, world: usize, me: usize, op: &str) -> Result<()> {
    for (r, pid) in pids(m, world).into_iter().enumerate() {
        if r != me && pid != 0 && !liveness.watches(r) {
            liveness.watch(r, pid, op)?;
        }
    }
    let everyone: Vec<usize> = (0..world).collect();
    match liveness.first_dead(&everyone) {
        Some(dead) => Err(liveness.exited(dead, op)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_bad_ones_are_refused() {
        let t = SegmentToken::create(2, 0).unwrap();
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
        let t = SegmentToken::create(3, 0).unwrap();
        let token = &t.token();
        std::thread::scope(|s| {
            let hs: Vec<_> =
                (0..3).map(|r| s.spawn(move || join(token, r, 3, Duration::from_secs(20)))).collect();
            for h in hs {
                assert!(h.join().unwrap().is_ok());
            }
        });
        assert!(!std::path::Path::new(&format!("/dev/shm{}", t.name)).exists());
    }

    #[test]
    fn a_missing_rank_times_out_naming_it_and_drop_removes_the_name() {
        let t = SegmentToken::create(2, 0).unwrap();
        let path = format!("/dev/shm{}", t.name);
        let e = join(&t.token(), 0, 2, Duration::from_millis(200)).err().unwrap();
        assert!(matches!(&e, Error::Timeout { missing, .. } if missing == &vec![1]), "{e}");
        assert!(std::path::Path::new(&path).exists());
        drop(t);
        assert!(!std::path::Path::new(&path).exists());
    }
}
