//! How a dead peer's process ended, as a rank can learn it: the first thing a user needs when a rank
//! dies (a SIGKILL is often the OOM killer, a SIGSEGV a crash in native code, an exit code the script's
//! own `sys.exit`).

use std::fmt;

/// How a peer's process ended, as far as this rank can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It exited with this code.
    Exited(i32),
    /// A signal killed it.
    Killed {
        /// The signal's number.
        signal: i32,
        /// Whether it left a core dump.
        core_dumped: bool,
    },
    /// This rank cannot tell, for this reason.
    Unknown(Unknown),
}

/// Why a peer's exit status is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unknown {
    /// The kernel tells a pidfd's holder the status only once the process's parent has reaped it
    /// (waited for it), and the parent had not within the grace.
    NotReaped,
    /// This kernel does not tell exit statuses through pidfds (`PIDFD_INFO_EXIT` needs Linux 6.15).
    Unsupported,
    /// The process was gone before this rank could watch it.
    Unwatched,
}

impl ExitStatus {
    /// The status a wait status (as `waitpid` returns it) encodes.
    pub fn from_wait_status(status: i32) -> ExitStatus {
        if libc::WIFSIGNALED(status) {
            ExitStatus::Killed { signal: libc::WTERMSIG(status), core_dumped: libc::WCOREDUMP(status) }
        } else {
            ExitStatus::Exited(libc::WEXITSTATUS(status))
        }
    }
}

/// Reads after "pid N ": "exited with code 3", "was killed by SIGKILL (...)", "exited; its exit
/// status is unknown (...)".
impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ExitStatus::Exited(code) => write!(f, "exited with code {code}"),
            ExitStatus::Killed { signal, core_dumped } => {
                let name = signal_name(signal);
                match name {
                    Some(name) => write!(f, "was killed by {name}")?,
                    None => write!(f, "was killed by signal {signal}")?,
                }
                let number = format!("signal {signal}");
                let notes: Vec<&str> = [
                    name.map(|_| number.as_str()),
                    (signal == libc::SIGKILL)
                        .then_some("sent by kill -9, and by the kernel's OOM killer when memory runs out"),
                    core_dumped.then_some("core dumped"),
                ]
                .into_iter()
                .flatten()
                .collect();
                if notes.is_empty() {
                    Ok(())
                } else {
                    write!(f, " ({})", notes.join("; "))
                }
            }
            ExitStatus::Unknown(why) => {
                let why = match why {
                    Unknown::NotReaped => {
                        "its parent had not reaped it yet; the kernel tells the status once it has"
                    }
                    Unknown::Unsupported => {
                        "this kernel does not tell exit statuses through pidfds; Linux 6.15 and later do"
                    }
                    Unknown::Unwatched => "it was gone before this rank could watch it",
                };
                write!(f, "exited; its exit status is unknown ({why})")
            }
        }
    }
}

/// `SIGKILL` for 9, ...: the names of the signals that end processes, from libc's numbers (which vary
/// by architecture). libc's own table (`sigabbrev_np`) needs glibc 2.32, newer than wheels may assume.
fn signal_name(signal: i32) -> Option<&'static str> {
    macro_rules! names {
        ($($sig:ident),*) => {
            match signal {
                $(libc::$sig => Some(stringify!($sig)),)*
                _ => None,
            }
        };
    }
    names!(
        SIGHUP, SIGINT, SIGQUIT, SIGILL, SIGTRAP, SIGABRT, SIGBUS, SIGFPE, SIGKILL, SIGUSR1, SIGSEGV,
        SIGUSR2, SIGPIPE, SIGALRM, SIGTERM, SIGSTKFLT, SIGCHLD, SIGCONT, SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU,
        SIGURG, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF, SIGWINCH, SIGIO, SIGPWR, SIGSYS
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_statuses_decode_and_read_as_the_shell_would_name_them() {
        // Wait statuses as the kernel encodes them (`waitpid(2)`): code << 8, or the signal, | 0x80 for
        // a core dump.
        assert_eq!(ExitStatus::from_wait_status(3 << 8), ExitStatus::Exited(3));
        assert_eq!(ExitStatus::from_wait_status(0), ExitStatus::Exited(0));
        let segv = ExitStatus::from_wait_status(11 | 0x80);
        assert_eq!(segv, ExitStatus::Killed { signal: 11, core_dumped: true });
        assert_eq!(segv.to_string(), "was killed by SIGSEGV (signal 11; core dumped)");
        let kill = ExitStatus::from_wait_status(9).to_string();
        assert!(
            kill.starts_with("was killed by SIGKILL (signal 9; ") && kill.contains("OOM killer"),
            "{kill}"
        );
        assert_eq!(ExitStatus::Exited(3).to_string(), "exited with code 3");
        assert_eq!(ExitStatus::from_wait_status(40).to_string(), "was killed by signal 40");
    }
}
