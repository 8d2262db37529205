//! Is a peer process still alive? One pidfd per peer, opened right after the handshake while every
//! peer is known to be alive, so a recycled pid can never pass for a live peer (and a zombie, which
//! still answers `kill(pid, 0)`, reads as dead: its pidfd is readable once it has exited).

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::fd::OwnedFd;
use rustix::process::{pidfd_open, Pid, PidfdFlags};

use crate::error::{Error, Result};

/// Pidfds of every other rank of the world.
pub(crate) struct Liveness {
    fds: Vec<Option<OwnedFd>>,
    pids: Vec<u32>,
}

impl Liveness {
    /// Open a pidfd for every rank but `me`. A peer that is already gone is reported as dead.
    pub(crate) fn open(pids: &[u32], me: usize) -> Result<Liveness> {
        let mut fds = Vec::with_capacity(pids.len());
        for (r, &pid) in pids.iter().enumerate() {
            if r == me {
                fds.push(None);
                continue;
            }
            let p = Pid::from_raw(pid as i32)
                .filter(|_| pid <= i32::MAX as u32)
                .ok_or_else(|| Error::invalid(format!("rank {r} published an invalid pid {pid}")))?;
            match pidfd_open(p, PidfdFlags::empty()) {
                Ok(fd) => fds.push(Some(fd)),
                Err(rustix::io::Errno::SRCH) => {
                    return Err(Error::PeerDied {
                        peer: r,
                        op: "init".into(),
                        detail: Some(format!("pid {pid} exited during the handshake")),
                    })
                }
                Err(e) => return Err(Error::os(format!("pidfd_open of rank {r} (pid {pid})"), e.into())),
            }
        }
        Ok(Liveness { fds, pids: pids.to_vec() })
    }

    /// The pid of `rank`'s process, as it registered it (a pidfd was opened for it while it lived).
    pub(crate) fn pid(&self, rank: usize) -> u32 {
        self.pids[rank]
    }

    /// The first of `ranks` whose process has exited, with its pid.
    pub(crate) fn first_dead(&self, ranks: &[usize]) -> Option<(usize, u32)> {
        let watched: Vec<usize> =
            ranks.iter().copied().filter(|&r| self.fds.get(r).is_some_and(Option::is_some)).collect();
        let mut polls: Vec<PollFd<'_>> = watched
            .iter()
            .filter_map(|&r| self.fds[r].as_ref())
            .map(|fd| PollFd::new(fd, PollFlags::IN))
            .collect();
        let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
        // An interrupted or failed poll just means no verdict this slice; the next slice asks again.
        if poll(&mut polls, Some(&zero)).unwrap_or(0) == 0 {
            return None;
        }
        polls.iter().zip(&watched).find(|(p, _)| !p.revents().is_empty()).map(|(_, &r)| (r, self.pids[r]))
    }
}
