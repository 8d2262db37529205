//! How the ranks of a job find its segment.
//!
//! Rank 0 listens on MASTER_ADDR:MASTER_PORT (so two jobs with different ports never meet, and a port
//! already in use is a clear error) and creates the segment. It answers a connecting rank with the
//! segment's name and session nonce only once the rank has proved it belongs to the job (`auth`: the
//! job secret, or without one the socket's owner). Connections are served concurrently, each by a
//! thread with a short deadline (`config::HANDSHAKE`; the exchange itself is `handshake`): a port
//! scanner, a stranger without the secret or a silent socket is dropped unanswered and costs the job
//! nothing. A rank that is not admitted tries again until the job's timeout; a rank rank 0 cannot
//! take (wrong world size, a rank already taken) is told why. Each rank attaches, checks the segment, records its pid and reports back; once every
//! rank has attached, rank 0 unlinks the name (from then on no crash can leak it) and releases
//! everyone. The TCP connection carries only these few messages and is closed afterwards; collective
//! data never touches it.

use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::handshake::{
    answer, greet, interrupted, knock, read_frame, send_frame, Cut, Door, Knock, FAILED, OK,
};
use super::layout::{check_member, Layout, Params};
use super::liveness::Liveness;
use super::segment::{self, Mapping};
use super::ShmOptions;
use crate::config::MAX_PENDING;
use crate::error::{Error, Result};

/// What a rank has once it joined: the mapped segment, its layout, and pidfds of its peers.
pub(crate) struct Joined {
    pub mapping: Mapping,
    pub layout: Layout,
    pub liveness: Liveness,
}

/// Join the job described by `opts` (blocks until every rank has joined or the timeout passes).
pub(crate) fn join(opts: &ShmOptions) -> Result<Joined> {
    check_member(opts.rank, opts.world_size)?;
    let deadline = Instant::now() + opts.timeout;
    if opts.rank == 0 {
        serve(opts, deadline)
    } else {
        connect(opts, deadline)
    }
}

fn segment_name(opts: &ShmOptions) -> Result<Option<String>> {
    let Some(job) = &opts.job_id else {
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

fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::os(format!("rendezvous: {what}"), e)
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))
}

fn timeout(opts: &ShmOptions, missing: Vec<usize>, note: &str) -> Error {
    Error::Timeout {
        rank: opts.rank,
        op: format!("rendezvous on {}:{}{note}", opts.master_addr, opts.master_port),
        waited: opts.timeout,
        missing,
        group: (0..opts.world_size).collect(),
        progress: String::new(),
    }
}

/// Rank 0: create the segment and admit every other rank.
fn serve(opts: &ShmOptions, deadline: Instant) -> Result<Joined> {
    let n = opts.world_size;
    let listener = if n > 1 {
        let l = TcpListener::bind((opts.master_addr.as_str(), opts.master_port)).map_err(|e| {
            Error::os(
                format!(
                    "rank 0 cannot listen on {}:{} (is another job using this MASTER_PORT?)",
                    opts.master_addr, opts.master_port
                ),
                e,
            )
        })?;
        l.set_nonblocking(true).map_err(io_err("listener"))?;
        Some(l)
    } else {
        None
    };
    let mut params = Params::new(n, opts.arena_bytes);
    // The others learn the round size from the header.
    if let Some(bytes) = opts.chunk_bytes {
        params.chunk = bytes;
    }
    let layout = Layout::checked(params)?;
    let nonce = segment::random::<16>()?;
    let (name, mapping) = match segment_name(opts)? {
        Some(name) => (name.clone(), segment::create(&name, &layout, nonce)?),
        None => segment::create_random(&layout, nonce)?,
    };
    register(&mapping, 0);
    let door = Arc::new(Door {
        secret: opts.secret.clone(),
        world: n,
        uid: rustix::process::geteuid().as_raw(),
        answer: answer(&name, nonce),
        taken: AtomicU64::new(1),
        open: AtomicBool::new(true),
        pending: AtomicUsize::new(0),
    });
    // From here on the name must go, whatever happens.
    let admitted = match &listener {
        Some(l) => admit(opts, l, &door, deadline),
        None => Ok(vec![]),
    };
    door.open.store(false, SeqCst);
    segment::unlink(&name);
    for (_, c) in admitted?.iter_mut() {
        // A rank that vanished now fails at its first collective (its pidfd says so).
        let _ = send_frame(c, OK, b"go");
    }
    let liveness = Liveness::open(&pids(&mapping, n), 0)?;
    Ok(Joined { mapping, layout, liveness })
}

/// Serve connections until every rank is admitted, then wait until each has attached.
fn admit(
    opts: &ShmOptions,
    listener: &TcpListener,
    door: &Arc<Door>,
    deadline: Instant,
) -> Result<Vec<(usize, TcpStream)>> {
    let n = opts.world_size;
    let (tx, rx) = mpsc::channel();
    let mut conns: Vec<(usize, TcpStream)> = vec![];
    let mut notes: Vec<String> = vec![];
    while conns.len() + 1 < n {
        interrupted()?;
        while let Ok(k) = rx.try_recv() {
            match k {
                Knock::Admitted(r, s) => conns.push((r, s)),
                Knock::Refused(why) if !notes.contains(&why) => notes.push(why),
                Knock::Refused(_) => {}
            }
        }
        if conns.len() + 1 == n {
            break;
        }
        if Instant::now() >= deadline {
            let missing = (1..n).filter(|r| !conns.iter().any(|(c, _)| c == r)).collect();
            let note =
                if notes.is_empty() { String::new() } else { format!(" (refused: {})", notes.join("; ")) };
            return Err(timeout(opts, missing, &note));
        }
        match listener.accept() {
            Ok((s, _)) => {
                // Over the limit the connection is just closed; a rank among them tries again.
                if door.pending.fetch_add(1, SeqCst) < MAX_PENDING {
                    let (d, tx) = (door.clone(), tx.clone());
                    let spawned =
                        std::thread::Builder::new().name("axonml-rendezvous".into()).spawn(move || {
                            if let Some(k) = greet(&d, s) {
                                let _ = tx.send(k);
                            }
                            d.pending.fetch_sub(1, SeqCst);
                        });
                    if spawned.is_err() {
                        door.pending.fetch_sub(1, SeqCst);
                    }
                } else {
                    door.pending.fetch_sub(1, SeqCst);
                }
            }
            // Nothing waiting, or a transient failure (a reset connection, no file descriptor left):
            // nothing a stranger does ends the rendezvous.
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    for (rank, c) in conns.iter_mut() {
        match read_frame(c, deadline, true) {
            Ok((OK, _)) => {}
            Ok((_, msg)) => {
                return Err(Error::invalid(format!(
                    "rank {rank} could not attach the segment: {}",
                    String::from_utf8_lossy(&msg)
                )))
            }
            Err(Cut::Late) => return Err(timeout(opts, vec![*rank], "")),
            Err(Cut::Lost) => {
                return Err(Error::PeerDied {
                    peer: *rank,
                    op: "init".into(),
                    detail: Some("it closed its rendezvous connection before attaching the segment".into()),
                })
            }
            Err(Cut::Stop(e)) => return Err(e),
        }
    }
    Ok(conns)
}

/// Ranks 1..n: reach rank 0 and be admitted (retrying until the deadline), attach, report, wait for
/// the go.
fn connect(opts: &ShmOptions, deadline: Instant) -> Result<Joined> {
    let n = opts.world_size;
    let addrs: Vec<_> = (opts.master_addr.as_str(), opts.master_port)
        .to_socket_addrs()
        .map_err(|e| Error::os(format!("resolving MASTER_ADDR {}", opts.master_addr), e))?
        .collect();
    // Whether something listened but did not admit us: then the timeout says what to check.
    let mut turned_away = false;
    let (mut s, name, nonce) = loop {
        interrupted()?;
        if Instant::now() >= deadline {
            let note = if turned_away {
                " (something listens there but did not admit this rank: do all ranks run as one user \
                 with the same AXONML_JOB_SECRET?)"
            } else {
                ""
            };
            return Err(timeout(opts, vec![0], note));
        }
        let reached = addrs.iter().find_map(|a| {
            TcpStream::connect_timeout(a, remaining(deadline).min(Duration::from_secs(1))).ok()
        });
        let Some(mut s) = reached else {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        match knock(&mut s, opts, deadline) {
            Ok((name, nonce)) => break (s, name, nonce),
            Err(Cut::Stop(e)) => return Err(e),
            Err(Cut::Lost | Cut::Late) => {
                turned_away = true;
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let (mapping, layout) = match segment::attach(&name, n, nonce) {
        Ok(x) => x,
        Err(e) => {
            let _ = send_frame(&mut s, FAILED, e.to_string().as_bytes());
            return Err(e);
        }
    };
    register(&mapping, opts.rank);
    send_frame(&mut s, OK, b"attached").map_err(io_err("reporting to rank 0"))?;
    match read_frame(&mut s, deadline, true) {
        Ok((OK, _)) => {}
        Ok(_) | Err(Cut::Lost) => return Err(Error::invalid("rendezvous: rank 0 gave up (see its error)")),
        Err(Cut::Late) => return Err(timeout(opts, vec![0], "")),
        Err(Cut::Stop(e)) => return Err(e),
    }
    let liveness = Liveness::open(&pids(&mapping, n), opts.rank)?;
    Ok(Joined { mapping, layout, liveness })
}
