//! Copies between this process's memory and another's with Linux's cross-memory attach
//! (`process_vm_readv` / `process_vm_writev`, as MPICH's and Open MPI's CMA paths do): each byte moves
//! once, by the kernel, from the owner's memory to the reader's. A copy within this process (a
//! member's own buffer, or a peer's in the shm segment) is a plain copy.
//!
//! Addresses come from peers: a bad one makes the kernel fail the copy (EFAULT, or a short count),
//! which is an error here, never a crash; the lengths are this member's own (the agreed signature).

use super::stream;
use crate::error::{Error, Result};

/// Where a member's buffer is: in this process (`pid` None), or at `addr` in process `pid`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loc {
    pub pid: Option<i32>,
    pub addr: usize,
    /// The member's global rank, for errors.
    pub rank: usize,
}

impl Loc {
    pub(super) fn at(self, off: usize) -> Loc {
        Loc { addr: self.addr.wrapping_add(off), ..self }
    }
}

/// One copy of `len` bytes between this process and `remote` (another process's buffer, or one in
/// this process: a member's own, or a peer's in the segment); `read` from `remote` into `local`, else
/// the other way. A copy within this process streams when `stream` (`stream::worth` of the transfer).
pub(super) fn transfer(
    remote: Loc,
    local: *mut u8,
    len: usize,
    read: bool,
    stream: bool,
    op: &str,
) -> Result<()> {
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

pub(super) fn read(from: Loc, to: *mut u8, len: usize, op: &str) -> Result<()> {
    transfer(from, to, len, true, stream::worth(len), op)
}

pub(super) fn write(from: *const u8, to: Loc, len: usize, op: &str) -> Result<()> {
    transfer(to, from.cast_mut(), len, false, stream::worth(len), op)
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
