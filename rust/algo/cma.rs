//! Collectives on private buffers of processes, copied straight between them with Linux's cross-memory
//! attach (`process_vm_readv` / `process_vm_writev`, as MPICH's and Open MPI's CMA paths do): each byte
//! moves once, by the kernel, from the owner's memory to the reader's, with no staging copy and no
//! pipeline sync. Members touch disjoint memory, so the engine's done-sync (its drain) is the only wait.
//!
//! * broadcast: every member copies (n − 1)/n of the message, so the root's core works too: the root
//!   writes its owned slice into every other member's buffer, each of them reads the rest from the
//!   root (half the time of a lone reader at 2 ranks);
//! * all_gather: each member pushes its part into every member's slot for it, tile by tile, so each
//!   tile is read once for all its destinations; gather: the same into the root's buffer alone;
//! * scatter: read this member's part from the root.
//! * all_reduce, reduce: owner-computes ([`owned`]): tile by tile, read the owned slice of every peer's
//!   input into local scratch, reduce in rank order (own input read in place), then write the result
//!   into every peer's output (all_reduce) or the root's (reduce). reduce_scatter: the same, with the
//!   result kept. Tiles keep the scratch in cache between the read and the reduction.
//!
//! Addresses come from peers: a bad one makes the kernel fail the copy (EFAULT, or a short count),
//! which is an error here, never a crash; the lengths are this member's own (the agreed signature).

use std::cell::RefCell;

use super::layout::Plan;
use super::owner::owned;
use super::stream;
use crate::call::Call;
use crate::config::CMA_TILE;
use crate::error::{Error, Result};
use crate::reduce::{reduce_raw, ReduceOp};
use crate::signature::CollKind;

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

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

thread_local! {
    /// Scratch tiles of the reductions, kept across calls (a fresh allocation per call would fault
    /// its pages in every time).
    static SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// One cross-process copy of `len` bytes; `read` from `remote` into `local`, else the other way.
fn transfer(remote: Loc, local: *mut u8, len: usize, read: bool, op: &str) -> Result<()> {
    let Some(pid) = remote.pid else {
        let (from, to) = if read {
            (remote.addr as *const u8, local)
        } else {
            (local.cast_const(), remote.addr as *mut u8)
        };
        // SAFETY: the caller guarantees both ranges; `copy` tolerates all_gather's in-place overlap.
        unsafe { stream::copy(from, to, len, stream::worth(len)) };
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
    transfer(from, to, len, true, op)
}

fn write(from: *const u8, to: Loc, len: usize, op: &str) -> Result<()> {
    transfer(to, from.cast_mut(), len, false, op)
}

/// Member `me`'s share of `call` (reducing with `op`) over every member's buffers.
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
    // Peers in turn from the next one, so members do not all read the same peer at once.
    let others = (1..n).map(|d| (me + d) % n);
    match call.sig.kind {
        CollKind::Broadcast => {
            let piece = owned(bytes, 1, n, root);
            if me == root {
                let from = local(mine.send).wrapping_add(piece.start).cast_const();
                others
                    .clone()
                    .try_for_each(|j| write(from, members[j].recv.at(piece.start), piece.len(), name))
            } else {
                let (head, tail) = (piece.start, bytes - piece.end);
                read(members[root].send, local(mine.recv), head, name)?;
                read(members[root].send.at(piece.end), local(mine.recv).wrapping_add(piece.end), tail, name)
            }
        }
        CollKind::Scatter => read(members[root].send.at(me * bytes), local(mine.recv), bytes, name),
        CollKind::AllGather | CollKind::Gather => {
            let to: Vec<Loc> = match call.sig.kind {
                CollKind::Gather if me != root => vec![members[root].recv],
                CollKind::Gather => vec![mine.recv],
                _ => (0..n).map(|d| members[(me + d) % n].recv).collect(),
            };
            let stream = stream::worth(bytes);
            let mut lo = 0;
            while lo < bytes {
                let len = CMA_TILE.min(bytes - lo);
                let from = local(mine.send).wrapping_add(lo).cast_const();
                for dst in &to {
                    let at = dst.at(me * bytes + lo);
                    match at.pid {
                        // SAFETY: this member's own slot; `copy` tolerates the in-place overlap.
                        None => unsafe { stream::copy(from, local(at), len, stream) },
                        Some(_) => write(from, at, len, name)?,
                    }
                }
                lo += len;
            }
            Ok(())
        }
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter => {
            let (range, base) = match call.sig.kind {
                CollKind::ReduceScatter => (0..count, me * bytes),
                _ => (owned(count, e, n, me), 0),
            };
            let tile = (CMA_TILE / e).max(1);
            SCRATCH.with_borrow_mut(|scratch| {
                let lines = (n * tile * e).div_ceil(64);
                if scratch.len() < lines {
                    scratch.resize(lines, Line([0; 64]));
                }
                let buf = scratch.as_mut_ptr().cast::<u8>();
                // Slot j holds peer j's tile; slot `me` the result of a reduce off the root.
                let slot = |j: usize| buf.wrapping_add(j * tile * e);
                let mut lo = range.start;
                while lo < range.end {
                    let len = tile.min(range.end - lo);
                    let (src, out, nb) = (base + lo * e, lo * e, len * e);
                    for j in others.clone() {
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
                    let keep = call.sig.kind != CollKind::Reduce || me == root;
                    let result = if keep { local(mine.recv).wrapping_add(out) } else { slot(me) };
                    // SAFETY: every input holds `len` elements (own input in place, peers' in scratch);
                    // the output is this member's own buffer or its scratch slot, aligned (64-byte lines).
                    unsafe { reduce_raw(call.dtype, op, call.sig.scale, &inputs, &[result], len) };
                    match call.sig.kind {
                        CollKind::AllReduce => {
                            for j in others.clone() {
                                write(result, members[j].recv.at(out), nb, name)?;
                            }
                        }
                        CollKind::Reduce if !keep => write(result, members[root].recv.at(out), nb, name)?,
                        _ => {}
                    }
                    lo += len;
                }
                Ok(())
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
    fn copies_between_processes_move_every_byte() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let from = Loc { pid: Some(me()), addr: src.as_ptr() as usize, rank: 1 };
        read(from, dst.as_mut_ptr(), src.len(), "t").unwrap();
        assert_eq!(src, dst);
    }
}
