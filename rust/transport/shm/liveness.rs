//! Is a peer process still alive, and if not, how did it end? One pidfd per peer, opened as soon as
//! this rank sees the peer registered in the segment (a peer already gone by then counts as dead), so
//! a pid recycled later can never pass for a live peer (and a zombie, which still answers
//! `kill(pid, 0)`, reads as dead: its pidfd is readable once it has exited). The same pidfd tells its exit status
//! once its parent has reaped it (`PIDFD_GET_INFO`, Linux 6.15), whoever the parent is: `axonml-run`,
//! torchrun, mpiexec or a shell.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::fd::OwnedFd;
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use crate::config::EXIT_STATUS_GRACE;
use crate::error::{Error, ExitStatus, Result, Unknown};

/// Pidfds of the other ranks of the world.
pub(crate) struct Liveness {
    fds: Vec<Option<OwnedFd>>,
    /// Ranks whose registered process was gone before a pidfd could be opened: dead, status unknown.
    gone: Vec<bool>,
    pids: Vec<u32>,
    /// Each dead peer's status, once learned or given up on: every later error about it says the same
    /// at once, however many waits find it dead.
    statuses: Vec<OnceLock<ExitStatus>>,
}

impl Liveness {
    /// Watching nobody yet, in a world of `world` ranks.
    pub(crate) fn new(world: usize) -> Liveness {
        Liveness {
            fds: (0..world).map(|_| None).collect(),
            gone: vec![false; world],
            pids: vec![0; world],
            statuses: (0..world).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Whether `rank`'s process is watched (or was found gone).
    pub(crate) fn watches(&self, rank: usize) -> bool {
        self.fds.get(rank).is_some_and(Option::is_some) || self.gone.get(rank) == Some(&true)
    }

    /// Watch `rank`, whose process registered `pid`. A process already gone is recorded as dead
    /// ([`first_dead`](Liveness::first_dead) names it), its status unknown: without a pidfd opened
    /// before it was reaped, nothing tells it. Whether that death fails the caller is the caller's
    /// question (a peer that exits once every rank has joined fails no one's start-up).
    pub(crate) fn watch(&mut self, rank: usize, pid: u32) -> Result<()> {
        let p = Pid::from_raw(pid as i32)
            .filter(|_| pid <= i32::MAX as u32)
            .ok_or_else(|| Error::invalid(format!("rank {rank} published an invalid pid {pid}")))?;
        self.pids[rank] = pid;
        match pidfd_open(p, PidfdFlags::empty()) {
            Ok(fd) => self.fds[rank] = Some(fd),
            Err(rustix::io::Errno::SRCH) => self.gone[rank] = true,
            Err(e) => return Err(Error::os(format!("pidfd_open of rank {rank} (pid {pid})"), e.into())),
        }
        Ok(())
    }

    /// The pid of `rank`'s process, as it registered it (a pidfd was opened for it while it lived).
    pub(crate) fn pid(&self, rank: usize) -> u32 {
        self.pids[rank]
    }

    /// The first of `ranks` whose process has exited.
    pub(crate) fn first_dead(&self, ranks: &[usize]) -> Option<usize> {
        if let Some(&r) = ranks.iter().find(|&&r| self.gone[r]) {
            return Some(r);
        }
        let watched: Vec<(usize, &OwnedFd)> =
            ranks.iter().filter_map(|&r| Some((r, self.fds[r].as_ref()?))).collect();
        let mut polls: Vec<PollFd<'_>> =
            watched.iter().map(|(_, fd)| PollFd::new(*fd, PollFlags::IN)).collect();
        let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
        // An interrupted or failed poll just means no verdict this slice; the next slice asks again.
        if poll(&mut polls, Some(&zero)).unwrap_or(0) == 0 {
            return None;
        }
        polls.iter().zip(&watched).find(|(p, _)| !p.revents().is_empty()).map(|(_, &(r, _))| r)
    }

    /// The error for `peer`'s exit, found during `op`: with its exit status, for which the first such
    /// error waits up to [`EXIT_STATUS_GRACE`] (until its parent reaps it).
    pub(crate) fn exited(&self, peer: usize, op: &str) -> Error {
        let status = *self.statuses[peer].get_or_init(|| self.exit_status(peer));
        Error::PeerExited { peer, pid: self.pids[peer], op: op.to_string(), status, progress: String::new() }
    }

    fn exit_status(&self, rank: usize) -> ExitStatus {
        let Some(fd) = self.fds[rank].as_ref() else {
            return ExitStatus::Unknown(Unknown::Unwatched);
        };
        let deadline = Instant::now() + EXIT_STATUS_GRACE;
        loop {
            match reaped_status(fd.as_fd()) {
                Ok(Some(status)) => return status,
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
                Ok(None) => return ExitStatus::Unknown(Unknown::NotReaped),
                Err(()) => return ExitStatus::Unknown(Unknown::Unsupported),
            }
        }
    }
}

/// The exit status of the process behind `pidfd` once it has been reaped; `Ok(None)` while it has
/// not (it runs, or is a zombie); `Err` where the kernel does not tell: `PIDFD_GET_INFO` is unknown
/// before Linux 6.13 (ENOTTY or EINVAL), and 6.13 and 6.14 answer ESRCH for a reaped process.
fn reaped_status(pidfd: BorrowedFd<'_>) -> std::result::Result<Option<ExitStatus>, ()> {
    // SAFETY: `pidfd_info` is plain integers, for which all zeroes is a value.
    let mut info: libc::pidfd_info = unsafe { std::mem::zeroed() };
    info.mask = u64::from(libc::PIDFD_INFO_EXIT);
    // SAFETY: the request encodes `size_of::<pidfd_info>()` (the kernel's first version, 64 bytes),
    // and the kernel writes at most that many bytes into `info`, which outlives the call.
    let r =
        unsafe { libc::ioctl(pidfd.as_raw_fd(), libc::PIDFD_GET_INFO, &mut info as *mut libc::pidfd_info) };
    if r < 0 {
        return Err(());
    }
    Ok((info.mask & u64::from(libc::PIDFD_INFO_EXIT) != 0)
        .then(|| ExitStatus::from_wait_status(info.exit_code)))
}

#[cfg(test)]
mod tests {
    use std::process::{Child, Command};

    use super::*;

    /// Whether this kernel tells a reaped process's exit status through its pidfd (Linux 6.15).
    fn kernel_tells() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut parts = release.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap(), parts.next().unwrap()) >= (6, 15)
    }

    /// A world of this process (rank 0) and `child` (rank 1), once the child has exited.
    fn watch_until_dead(child: &Child) -> Liveness {
        let mut liveness = Liveness::new(2);
        liveness.watch(1, child.id()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while liveness.first_dead(&[1]).is_none() {
            assert!(Instant::now() < deadline, "the child never exited");
            std::thread::sleep(Duration::from_millis(5));
        }
        liveness
    }

    /// How rank 0 names the end of a child running `shell`, reaped before it asks or not; and the
    /// child's status as its parent sees it.
    fn status_of(shell: &str, reap: bool) -> (ExitStatus, std::process::ExitStatus) {
        let mut child = Command::new("sh").args(["-c", shell]).spawn().unwrap();
        let liveness = watch_until_dead(&child);
        if reap {
            child.wait().unwrap();
        }
        let Error::PeerExited { peer: 1, pid, status, .. } = liveness.exited(1, "test") else { panic!() };
        assert_eq!(pid, child.id());
        let reference = child.wait().unwrap(); // reaps it now, if it was not
                                               // The status is learned once: a later error says the same, even after the reap.
        assert!(matches!(liveness.exited(1, "test"), Error::PeerExited { status: s, .. } if s == status));
        (status, reference)
    }

    #[test]
    fn a_reaped_peer_is_named_with_how_it_ended_where_the_kernel_tells() {
        use std::os::unix::process::ExitStatusExt;
        let unsupported = ExitStatus::Unknown(Unknown::Unsupported);
        for shell in ["exit 3", "kill -9 $$", "kill -11 $$"] {
            let (status, reference) = status_of(shell, true);
            let expected = match reference.code() {
                Some(code) => ExitStatus::Exited(code),
                None => ExitStatus::Killed {
                    signal: reference.signal().unwrap(),
                    core_dumped: reference.core_dumped(),
                },
            };
            assert_eq!(status, if kernel_tells() { expected } else { unsupported }, "{shell}");
        }
    }

    #[test]
    fn a_peer_gone_before_it_was_watched_is_dead_with_an_unknown_status() {
        let mut child = Command::new("sh").args(["-c", "exit 0"]).spawn().unwrap();
        child.wait().unwrap();
        let mut liveness = Liveness::new(3);
        liveness.watch(1, child.id()).unwrap();
        assert!(liveness.watches(1));
        assert_eq!(liveness.first_dead(&[0, 1, 2]), Some(1));
        assert_eq!(liveness.first_dead(&[0, 2]), None);
        let unwatched = ExitStatus::Unknown(Unknown::Unwatched);
        let e = liveness.exited(1, "test");
        assert!(
            matches!(e, Error::PeerExited { peer: 1, pid, status, .. } if pid == child.id() && status == unwatched)
        );
    }

    #[test]
    fn a_zombie_peer_has_an_unknown_status_once_the_grace_has_passed() {
        let (status, _) = status_of("kill -9 $$", false);
        assert!(
            matches!(status, ExitStatus::Unknown(Unknown::NotReaped | Unknown::Unsupported)),
            "{status:?}"
        );
        if kernel_tells() {
            assert_eq!(status, ExitStatus::Unknown(Unknown::NotReaped));
        }
    }
}
