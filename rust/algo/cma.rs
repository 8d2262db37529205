//! Collectives on private buffers of processes, copied straight between them with Linux's cross-memory
//! attach (`process_vm_readv` / `process_vm_writev`, as MPICH's and Open MPI's CMA paths do): each byte
//! moves once, by the kernel, from the owner's memory to the reader's, with no staging copy and no
//! pipeline sync. Members touch disjoint memory, so the engine's done-sync (its drain) is the only wait.
//!
//! Members share the work in tiles they claim one at a time ([`Claims`]), so a member whose core is
//! taken by another process does less of it instead of holding every member back:
//! * broadcast: the root writes a tile it claims into every other member's buffer; any other member
//!   reads it from the root, then writes it on to the rest (at 2 ranks in step, each copies half);
//! * all_gather: a member copies each tile of its own part into its own slot and writes it to its
//!   peers, then helps with parts whose owners are behind; gather: each member writes its part into
//!   the root's buffer; scatter: each member reads its part from the root;
//! * all_reduce, reduce, reduce_scatter: for each tile it claims, a member reads the tile of every
//!   peer's input into local scratch, reduces in rank order (own input read in place), then writes the
//!   result into every peer's output (all_reduce), the root's (reduce) or the block owner's
//!   (reduce_scatter, where members take their own blocks first). Tiles keep the scratch in cache
//!   between the read and the reduction. Whoever computes a tile, the order of the reduction is the
//!   same, so results are bitwise identical.
//!
//! Addresses come from peers: a bad one makes the kernel fail the copy (EFAULT, or a short count),
//! which is an error here, never a crash; the lengths are this member's own (the agreed signature).

use std::cell::RefCell;

use super::claims::Claims;
use super::layout::Plan;
use super::route_times::RouteTimes;
use super::stream;
use crate::call::Call;
use crate::config::{cma_forced_by_env, CMA_MIN, CMA_REDUCE_CROWDED};
use crate::error::{Error, Result};
use crate::reduce::{reduce_raw, ReduceOp};
use crate::signature::{CollKind, Signature};

/// Where a member's buffer is: in this process (`pid` None), or at `addr` in process `pid`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loc {
    pub pid: Option<i32>,
    pub addr: usize,
    /// The member's global rank, for errors.
    pub rank: usize,
}

impl Loc {
    fn at(self, off: usize) -> Loc {
        Loc { addr: self.addr.wrapping_add(off), ..self }
    }
}

/// A member's send and receive buffers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Member {
    pub send: Loc,
    pub recv: Loc,
}

/// Whether this route runs `kind` (the others, reduce_scatter_v, go through staging).
pub(crate) fn handles(kind: CollKind) -> bool {
    !matches!(kind, CollKind::ReduceScatterV)
}

/// When a member lets its peers copy its private buffers straight from its memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Policy {
    /// Never (`AXONML_SHM_CMA=0`, or the kernel refused a peer: `probe`); every call stages.
    Never,
    /// Calls that took less time crossing than staging lately, or large enough ([`offer`]): the
    /// default.
    Timed,
    /// Every buffer of at least `CMA_MIN` bytes (`AXONML_SHM_CMA=1`).
    Always,
}

impl Policy {
    /// The policy `AXONML_SHM_CMA` asks for (`config::cma_forced_by_env`).
    pub(crate) fn from_env() -> Policy {
        match cma_forced_by_env() {
            Some(false) => Policy::Never,
            Some(true) => Policy::Always,
            None => Policy::Timed,
        }
    }
}

/// What a member offers its peers for a private buffer of a call, under its `Policy`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Offer {
    /// Nothing: peers cannot copy from or to it, and the call stages.
    Withheld,
    /// Its address, that peers may copy from and to it if the call crosses.
    Address,
    /// Its address, asking the call to cross: it does when any member asks and every member offered
    /// every buffer (`transport::shm::store`).
    Cross,
}

/// What a member offers for a private buffer of `bytes` of call `sig` (in a group of `n`) under
/// `policy`: by default it asks the call to cross when crossing took it less time than staging lately
/// (`routes`, for the calls it times), else by [`by_size`]. `routes` is `None` where the world's ranks
/// outnumber the cores (crowded): timings there say more about who held a core than about the route,
/// so nothing is timed and [`by_size`] decides. A call crosses when any member asks, so a
/// member with other settings (`AXONML_SHM_CMA=1`) or other timings can make it cross; one that
/// withholds makes it stage. The policy is asked only for buffers of at least [`CMA_MIN`] bytes, so
/// smaller ones never make a process probe its peers (`Policy::Never` after a refused probe).
pub(crate) fn offer(
    policy: impl FnOnce() -> Policy,
    sig: &Signature,
    n: usize,
    bytes: usize,
    routes: Option<&RouteTimes>,
) -> Offer {
    if bytes < CMA_MIN {
        return Offer::Withheld;
    }
    let ask = match policy() {
        Policy::Never => return Offer::Withheld,
        Policy::Always => true,
        Policy::Timed => match routes {
            Some(routes) => routes.ask(sig, n).unwrap_or_else(|| by_size(sig, n, false)),
            None => by_size(sig, n, true),
        },
    };
    if ask {
        Offer::Cross
    } else {
        Offer::Address
    }
}

/// Whether a member asks a call it does not time to cross: calls of `ROUTE_TIMED_BELOW` or more, or
/// of the pairwise kinds, or any call when the world's ranks outnumber the cores (`crowded`: there a
/// member's time depends mostly on when the scheduler ran it, and the samples of both routes spread
/// over the same range). Then the pairwise kinds always cross; the reductions cross from
/// [`CMA_REDUCE_CROWDED`] when crowded, always otherwise; the copy kinds never cross when crowded,
/// where the staged copies run at user-space speed and stream their output (4 ranks on 2 cores,
/// all_gather 16 MiB 4.3-4.8 ms staged against 5.2-6.2 ms through the kernel; broadcast 64 MiB beside
/// a CPU-bound process 19 against 28 ms), and always otherwise (2 ranks: all_reduce 8 MiB 1.34 ms
/// staged against 1.18 crossing).
fn by_size(sig: &Signature, n: usize, crowded: bool) -> bool {
    let (send, recv) = super::spans(sig, n, true);
    match sig.kind {
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter => {
            !crowded || send.max(recv) >= CMA_REDUCE_CROWDED
        }
        CollKind::Broadcast | CollKind::AllGather | CollKind::Gather | CollKind::Scatter => !crowded,
        _ => true,
    }
}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

thread_local! {
    /// Scratch tiles of the reductions, kept across calls (a fresh allocation per call would fault
    /// its pages in every time).
    static SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// One copy of `len` bytes between this process and `remote` (another process's buffer, or one in
/// this process: a member's own, or a peer's in the segment); `read` from `remote` into `local`, else
/// the other way. A copy within this process streams when `stream` (`stream::worth` of the transfer).
fn transfer(remote: Loc, local: *mut u8, len: usize, read: bool, stream: bool, op: &str) -> Result<()> {
    let Some(pid) = remote.pid else {
        let (from, to) = if read {
            (remote.addr as *const u8, local)
        } else {
            (local.cast_const(), remote.addr as *mut u8)
        };
        // SAFETY: the caller guarantees both ranges; `copy` tolerates all_gather's in-place overlap.
        unsafe { stream::copy(from, to, len, stream) };
        return Ok(());
    };
    let mut done = 0;
    while done < len {
        let l = libc::iovec { iov_base: local.wrapping_add(done).cast(), iov_len: len - done };
        let r = libc::iovec {
            iov_base: remote.addr.wrapping_add(done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `l` is this process's memory, valid for `len` bytes (caller); the kernel checks `r`
        // against the peer's address space and fails the call instead of faulting.
        let got = unsafe {
            if read {
                libc::process_vm_readv(pid, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_writev(pid, &l, 1, &r, 1, 0)
            }
        };
        match got {
            n if n > 0 => done += n as usize,
            _ => {
                // 0 bytes moved sets no errno: the peer's mapping ends there.
                let errno = if got == 0 {
                    "no bytes moved".to_string()
                } else {
                    std::io::Error::last_os_error().to_string()
                };
                let what = if read { "reading from" } else { "writing to" };
                return Err(Error::invalid(format!(
                    "{op}: {what} rank {}'s buffer ({} bytes at {:#x}, pid {pid}) failed after {done} bytes: \
                     {errno} (a peer published an address it does not own, or exited)",
                    remote.rank,
                    len,
                    remote.addr,
                )));
            }
        }
    }
    Ok(())
}

fn read(from: Loc, to: *mut u8, len: usize, op: &str) -> Result<()> {
    transfer(from, to, len, true, stream::worth(len), op)
}

fn write(from: *const u8, to: Loc, len: usize, op: &str) -> Result<()> {
    transfer(to, from.cast_mut(), len, false, stream::worth(len), op)
}

/// Member `me`'s share of `call` (reducing with `op`) over every member's buffers: the tiles it
/// claims (`claims`), or for scatter, gather and the pairwise kinds, its own part.
///
/// # Safety
/// Every member validated its buffers for the same call and keeps them alive and untouched by itself
/// until the done-sync; `members[me]` are this process's own buffers (`pid` None).
pub(crate) unsafe fn run(
    call: &Call,
    op: ReduceOp,
    members: &[Member],
    me: usize,
    plan: Option<&Plan>,
    claims: &Claims<'_>,
    name: &str,
) -> Result<()> {
    if let Some(plan) = plan {
        // The pairwise kinds but reduce_scatter_v (`handles`): read every piece from its sender.
        let to = members[me].recv.addr as *mut u8;
        return plan.pieces(me).try_for_each(|(j, src, dst, len)| {
            read(members[j].send.at(src), to.wrapping_add(dst), len, name)
        });
    }
    let (e, count, n) = (call.dtype.size(), call.count, members.len());
    let (bytes, root) = (count * e, call.root.unwrap_or(0));
    let mine = members[me];
    let local = |l: Loc| l.addr as *mut u8;
    let stream = stream::worth(bytes);
    // Tiles of the message (of each part, for all_gather; of each block, for reduce_scatter).
    let owned = matches!(call.sig.kind, CollKind::AllGather | CollKind::ReduceScatter);
    let unit = claims.unit(bytes, n, owned);
    let tiles = bytes.div_ceil(unit);
    let tile = |t: usize| Claims::tile(t, unit, bytes);
    // Copy `len` bytes at `from` (in this process) to `to(j)` for every member j but those in `skip`:
    // itself first (that copy brings the tile into cache for the rest), then its peers from the next
    // one (members do not all write to the same peer at once).
    let deliver = |from: *const u8, to: &dyn Fn(usize) -> Loc, skip: &[usize], len: usize| {
        (0..n)
            .map(|d| (me + d) % n)
            .filter(|j| !skip.contains(j))
            .try_for_each(|j| transfer(to(j), from.cast_mut(), len, false, stream, name))
    };
    // Bring bytes `off..off + len` of member `src`'s input to offset `at` of every member's output:
    // the source copies from its input (into its own output too, unless `kept`: its input is its
    // output); any other member reads them into its own output, then copies them on from there.
    let relay = |src: usize, off: usize, at: usize, len: usize, kept: bool| {
        let from = if me == src {
            local(mine.send).wrapping_add(off).cast_const()
        } else {
            read(members[src].send.at(off), local(mine.recv).wrapping_add(at), len, name)?;
            local(mine.recv).wrapping_add(at).cast_const()
        };
        // Skip who has the bytes already: a reader itself, and a source whose input is its output.
        let both = [me, src];
        let skip = match (me == src, kept) {
            (true, false) => &both[..0],
            (false, true) => &both[..],
            _ => &both[..1],
        };
        deliver(from, &|j| members[j].recv.at(at), skip, len)
    };
    match call.sig.kind {
        CollKind::Broadcast => claims.share(me, tiles, |t| {
            let (off, len) = tile(t);
            relay(root, off, off, len, true)
        }),
        // Tile t of member j's part goes into slot j of every member.
        CollKind::AllGather => claims.owned_first(me, tiles, |j, t| {
            let (off, len) = tile(t);
            relay(j, off, j * bytes + off, len, false)
        }),
        CollKind::Scatter => read(members[root].send.at(me * bytes), local(mine.recv), bytes, name),
        CollKind::Gather if me == root => {
            // SAFETY: this member's own buffers (slot `me` of its output).
            unsafe {
                stream::copy(local(mine.send), local(mine.recv).wrapping_add(me * bytes), bytes, stream)
            };
            Ok(())
        }
        CollKind::Gather => write(local(mine.send), members[root].recv.at(me * bytes), bytes, name),
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter => {
            // Tiles of elements: `per` of the message, or of each destination's block (reduce_scatter).
            let et = (unit / e).max(1);
            let per = count.div_ceil(et);
            let blocks = call.sig.kind == CollKind::ReduceScatter;
            SCRATCH.with_borrow_mut(|scratch| {
                let lines = (n * et * e).div_ceil(64);
                if scratch.len() < lines {
                    scratch.resize(lines, Line([0; 64]));
                }
                let buf = scratch.as_mut_ptr().cast::<u8>();
                // Slot j holds member j's tile; slot `me` the result when it is not kept here.
                let slot = |j: usize| buf.wrapping_add(j * et * e);
                let reduce_tile = |d: usize, t: usize| {
                    let (lo, len) = (t * et, et.min(count - t * et));
                    let src = if blocks { d * bytes + lo * e } else { lo * e };
                    let nb = len * e;
                    for j in (1..n).map(|x| (me + x) % n) {
                        read(members[j].send.at(src), slot(j), nb, name)?;
                    }
                    let inputs: Vec<*const u8> = (0..n)
                        .map(|j| {
                            if j == me {
                                local(mine.send).wrapping_add(src).cast_const()
                            } else {
                                slot(j).cast_const()
                            }
                        })
                        .collect();
                    // Who receives the result: every member, the root, or block d's owner.
                    let keep = match call.sig.kind {
                        CollKind::AllReduce => true,
                        CollKind::Reduce => me == root,
                        _ => me == d,
                    };
                    let out = lo * e;
                    let result = if keep { local(mine.recv).wrapping_add(out) } else { slot(me) };
                    // SAFETY: every input holds `len` elements (own input in place, peers' in scratch);
                    // the output is this member's own buffer or its scratch slot, aligned (64-byte lines).
                    unsafe { reduce_raw(call.dtype, op, call.sig.scale, &inputs, &[result], len) };
                    match call.sig.kind {
                        CollKind::AllReduce => {
                            deliver(result.cast_const(), &|j| members[j].recv.at(out), &[me], nb)
                        }
                        CollKind::Reduce if !keep => write(result, members[root].recv.at(out), nb, name),
                        CollKind::ReduceScatter if !keep => write(result, members[d].recv.at(out), nb, name),
                        _ => Ok(()),
                    }
                };
                if blocks {
                    // The result of its own block stays here; a helper writes it to the owner.
                    claims.owned_first(me, per, reduce_tile)
                } else {
                    claims.share(me, per, |t| reduce_tile(usize::MAX, t))
                }
            })
        }
        // The pairwise kinds come with their plan (above).
        CollKind::Barrier
        | CollKind::AllToAll
        | CollKind::AllToAllSingle
        | CollKind::AllGatherV
        | CollKind::GatherV
        | CollKind::ScatterV
        | CollKind::ReduceScatterV => Ok(()),
    }
}

/// What [`probe`] reads in a peer: a word every process of this library holds at an address it tells
/// its peers (the segment header).
pub(crate) static PROBE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(PROBE_WORD);
const PROBE_WORD: u64 = 0x6178_6f6e_6d6c_434d;

/// Whether this process may read and write the memory of process `pid` (which holds [`PROBE`] at
/// `addr`): false when the kernel or a sandbox refuses (EPERM, ENOSYS, a seccomp filter, Yama).
pub(crate) fn probe(pid: i32, addr: usize) -> bool {
    let remote = Loc { pid: Some(pid), addr, rank: 0 };
    let mut word = 0u64;
    let at = (&raw mut word).cast::<u8>();
    // Writing the word back as it was leaves the peer unchanged.
    read(remote, at, 8, "probe").is_ok() && word == PROBE_WORD && write(at, remote, 8, "probe").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> i32 {
        std::process::id() as i32
    }

    #[test]
    fn a_process_may_probe_itself() {
        assert!(probe(me(), PROBE.as_ptr() as usize));
    }

    #[test]
    fn a_bad_address_is_an_error_naming_the_peer() {
        let mut got = [0u8; 16];
        let bad = Loc { pid: Some(me()), addr: 16, rank: 3 };
        let e = read(bad, got.as_mut_ptr(), 16, "all_reduce").unwrap_err().to_string();
        assert!(e.contains("rank 3") && e.contains("after 0 bytes"), "{e}");
        assert!(!probe(me(), 16));
        let e = write(got.as_ptr(), bad, 16, "broadcast").unwrap_err().to_string();
        assert!(e.contains("writing to rank 3"), "{e}");
    }

    #[test]
    fn calls_cross_by_timing_or_size_and_every_member_of_a_call_decides_alike() {
        use crate::algo::spans;
        use crate::config::{ROUTE_LEARN, ROUTE_PROBE_EVERY, ROUTE_RUN, ROUTE_TIMED_BELOW};
        use crate::dtype::DType;
        use std::time::Duration;
        // A call of `count` float32 per part on `n` members: what the root and any other member offer
        // for their buffers, and whether the call crosses: when every buffer is offered and any member
        // asks. The root and the others must ask alike (their timings alike).
        let decide_with = |p: Policy, kind, count: usize, n: usize, routes: Option<&RouteTimes>| {
            let s = Signature::new(kind, 1, count).dtype(DType::F32);
            let member = |is_root| {
                let (send, recv) = spans(&s, n, is_root);
                let offers: Vec<Offer> = [send, recv]
                    .into_iter()
                    .filter(|&b| b > 0)
                    .map(|b| offer(|| p, &s, n, b, routes))
                    .collect();
                (offers.iter().all(|&o| o != Offer::Withheld), offers.contains(&Offer::Cross))
            };
            let ((root_offers, root_asks), (other_offers, other_asks)) = (member(true), member(false));
            assert_eq!(root_asks, other_asks, "{kind:?} {count}: the root and the others disagree");
            root_offers && other_offers && root_asks
        };
        let fresh = RouteTimes::default();
        let decide = |p: Policy, kind, count: usize, n: usize, crowded: bool| {
            decide_with(p, kind, count, n, (!crowded).then_some(&fresh))
        };
        // float32 elements of the smallest call not timed, and per MiB.
        let (big, mib) = (ROUTE_TIMED_BELOW / 4, (1 << 20) / 4);
        // Calls too large to time: reductions cross, copies cross unless ranks outnumber the cores.
        for kind in [CollKind::AllReduce, CollKind::Reduce] {
            assert!(decide(Policy::Timed, kind, big, 2, false) && decide(Policy::Timed, kind, big, 4, true));
        }
        // Where ranks outnumber cores nothing is timed: reductions cross from CMA_REDUCE_CROWDED by
        // their largest buffer, copies never.
        let crowded = CMA_REDUCE_CROWDED / 4;
        assert!(!decide(Policy::Timed, CollKind::AllReduce, crowded - 1, 4, true));
        assert!(decide(Policy::Timed, CollKind::AllReduce, crowded, 4, true));
        assert!(!decide(Policy::Timed, CollKind::ReduceScatter, crowded / 4 - 1, 4, true));
        assert!(decide(Policy::Timed, CollKind::ReduceScatter, crowded / 4, 4, true));
        // reduce_scatter by its input (count per member, n parts), all_gather and gather by their
        // output, scatter by its input: the call's largest buffer.
        assert!(decide(Policy::Timed, CollKind::ReduceScatter, big / 2, 2, false));
        for kind in [CollKind::Broadcast, CollKind::AllGather, CollKind::Gather, CollKind::Scatter] {
            let part = if kind == CollKind::Broadcast { big } else { big / 2 };
            assert!(decide(Policy::Timed, kind, part, 2, false), "{kind:?}");
            assert!(!decide(Policy::Timed, kind, part, 2, true), "{kind:?}");
            assert!(decide(Policy::Always, kind, part, 2, true), "{kind:?}");
        }
        // A fresh member stages a timed call first (learning, no samples yet).
        for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::Broadcast, CollKind::AllGather] {
            assert!(!decide(Policy::Timed, kind, mib / 2, 2, false), "{kind:?}");
            assert!(decide(Policy::Always, kind, mib / 2, 2, false), "{kind:?}");
        }
        // Once crossing took less than staging, timed calls of every kind cross, but for the probe
        // calls, and never when the policy forbids it.
        for kind in [CollKind::AllReduce, CollKind::ReduceScatter, CollKind::Broadcast, CollKind::AllGather] {
            let routes = RouteTimes::default();
            let s = Signature::new(kind, 1, mib / 2).dtype(DType::F32);
            let mut crossed = Vec::new();
            for _ in 0..2 * ROUTE_LEARN + 2 * ROUTE_PROBE_EVERY {
                let cross = decide_with(Policy::Timed, kind, mib / 2, 2, Some(&routes));
                let took = Duration::from_micros(if cross { 10 } else { 30 });
                routes.record(&s, 2, cross, took);
                crossed.push(cross);
            }
            let learning = 2 * ROUTE_LEARN as usize;
            let crossings = crossed[..learning].iter().filter(|&&c| c).count();
            assert!(!crossed[0] && crossings as u64 == ROUTE_LEARN, "{kind:?} learns both, staging first");
            let staged = crossed[learning..].iter().filter(|&&c| !c).count() as u64;
            assert_eq!(staged, 2 * ROUTE_RUN, "{kind:?}: one staged probe run per {ROUTE_PROBE_EVERY} calls");
            assert!(!decide_with(Policy::Never, kind, mib / 2, 2, Some(&routes)), "{kind:?}");
        }
        // A large call whose parts are under CMA_MIN stages (64 members, 2 MiB gathered).
        assert!(!decide(Policy::Always, CollKind::AllGather, 2 * mib / 64, 64, false));
        assert!(decide(Policy::Always, CollKind::AllReduce, CMA_MIN / 4, 2, false));
        assert!(!decide(Policy::Always, CollKind::AllReduce, CMA_MIN / 4 - 1, 2, false));
        assert!(!decide(Policy::Never, CollKind::AllReduce, big, 2, false));
        // The kinds with per-member sizes go by each buffer alone (their spans come from the plan).
        let v = Signature::new(CollKind::AllToAll, 1, 0).dtype(DType::F32);
        assert_eq!(offer(|| Policy::Timed, &v, 4, CMA_MIN, None), Offer::Cross);
        assert_eq!(offer(|| Policy::Timed, &v, 4, CMA_MIN - 1, Some(&fresh)), Offer::Withheld);
        // Buffers under CMA_MIN never ask for the policy (which may probe the peers).
        assert_eq!(offer(|| unreachable!("asked"), &v, 4, CMA_MIN - 1, Some(&fresh)), Offer::Withheld);
    }

    /// Members of a world of 3 in this process run their shares one after another, each of them first
    /// in turn, so the first takes every tile it may (all of a shared counter; its own part and all but
    /// the spare tiles of the others') and later ones take what is left: every result must still be
    /// the reference, bitwise.
    #[test]
    fn tiles_claimed_by_any_member_give_the_reference_results() {
        use crate::call;
        use crate::dtype::{Buf, BufMut};
        use crate::reduce::Scale;
        use std::sync::atomic::AtomicU64;
        const N: usize = 3;
        let count = 40_000 * N + 3; // many tiles, uneven ones
        let given: Vec<Vec<f32>> =
            (0..N).map(|j| (0..count).map(|i| (i % 977) as f32 * 0.1 + j as f32 * 0.37).collect()).collect();
        let sum = |i: usize| (given[0][i] + given[1][i]) + given[2][i];
        let same = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        // Run every member's share, in the order first, first + 1, ...
        let run_all = |calls: &[Call], members: &[Member], first: usize| {
            let words: Vec<AtomicU64> = (0..N).map(|_| AtomicU64::new(0)).collect();
            words.iter().for_each(|w| Claims::open(w, 7));
            let word = |j: usize| &words[j];
            for me in (0..N).map(|d| (first + d) % N) {
                let claims = Claims::new(&word, N, 7, true);
                // SAFETY: every buffer lives until the end of the test; members run one at a time.
                unsafe { run(&calls[me], ReduceOp::Sum, members, me, None, &claims, "t") }.unwrap();
            }
        };
        let loc = |p: *const f32, rank| Loc { pid: None, addr: p as usize, rank };
        let peers = |send: &[Vec<f32>], recv: &[Vec<f32>]| -> Vec<Member> {
            (0..N)
                .map(|j| Member { send: loc(send[j].as_ptr(), j), recv: loc(recv[j].as_ptr(), j) })
                .collect()
        };
        for first in 0..N {
            // all_reduce, reduce (root 2) and broadcast (root 1), in place.
            for kind in [CollKind::AllReduce, CollKind::Reduce, CollKind::Broadcast] {
                let mut bufs = given.clone();
                let calls: Vec<Call> = bufs
                    .iter_mut()
                    .map(|b| {
                        let mut b = BufMut::new(&mut b[..]);
                        match kind {
                            CollKind::AllReduce => call::all_reduce(None, &mut b, ReduceOp::Sum, Scale::NONE),
                            CollKind::Reduce => {
                                call::reduce(&[0, 1, 2], None, &mut b, 2, ReduceOp::Sum, Scale::NONE)
                            }
                            _ => call::broadcast(&[0, 1, 2], &mut b, 1),
                        }
                    })
                    .collect::<Result<_>>()
                    .unwrap();
                run_all(&calls, &peers(&bufs, &bufs), first);
                let total: Vec<f32> = (0..count).map(sum).collect();
                for (j, b) in bufs.iter().enumerate() {
                    let want = match kind {
                        CollKind::AllReduce => &total,
                        CollKind::Reduce if j == 2 => &total,
                        CollKind::Reduce => &given[j],
                        _ => &given[1],
                    };
                    assert!(same(b, want), "{kind:?} member {j}, member {first} first");
                }
            }
            // all_gather and reduce_scatter, out of place.
            let mut outs: Vec<Vec<f32>> = (0..N).map(|_| vec![0.0; N * count]).collect();
            let calls: Vec<Call> = (0..N)
                .map(|j| call::all_gather(N, &Buf::new(&given[j][..]), &mut BufMut::new(&mut outs[j][..])))
                .collect::<Result<_>>()
                .unwrap();
            run_all(&calls, &peers(&given, &outs), first);
            assert!(outs.iter().all(|o| same(o, &given.concat())), "all_gather, member {first} first");
            let part = count / N;
            let mut blocks: Vec<Vec<f32>> = (0..N).map(|_| vec![0.0; part]).collect();
            let ins: Vec<Vec<f32>> = given.iter().map(|g| g[..N * part].to_vec()).collect();
            let calls: Vec<Call> = (0..N)
                .map(|j| {
                    let (send, mut recv) = (Buf::new(&ins[j][..]), BufMut::new(&mut blocks[j][..]));
                    call::reduce_scatter(N, &send, &mut recv, ReduceOp::Sum)
                })
                .collect::<Result<_>>()
                .unwrap();
            run_all(&calls, &peers(&ins, &blocks), first);
            for (d, b) in blocks.iter().enumerate() {
                let want: Vec<f32> = (d * part..(d + 1) * part).map(sum).collect();
                assert!(same(b, &want), "reduce_scatter block {d}, member {first} first");
            }
        }
    }

    #[test]
    fn copies_between_processes_move_every_byte() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let from = Loc { pid: Some(me()), addr: src.as_ptr() as usize, rank: 1 };
        read(from, dst.as_mut_ptr(), src.len(), "t").unwrap();
        assert_eq!(src, dst);
    }
}
