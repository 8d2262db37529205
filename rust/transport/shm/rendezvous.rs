//! How the ranks of a job find its segment.
//!
//! Rank 0 listens on MASTER_ADDR:MASTER_PORT (so two jobs with different ports never meet, and a port
//! already in use is a clear error) and creates the segment. It answers a connecting rank with the
//! segment's name and session nonce only once the rank has proved it belongs to the job (`auth`: the
//! job secret, or without one the socket's owner). Connections are served concurrently, each by a
//! thread with a short deadline ([`HANDSHAKE`]): a port scanner, a stranger without the secret or a
//! silent socket is dropped unanswered and costs the job nothing. A rank that is not admitted tries
//! again until the job's timeout; a rank rank 0 cannot take (wrong world size, a rank already taken)
//! is told why. Each rank attaches, checks the segment, records its pid and reports back; once every
//! rank has attached, rank 0 unlinks the name (from then on no crash can leak it) and releases
//! everyone. The TCP connection carries only these few messages and is closed afterwards; collective
//! data never touches it.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::auth::{self, Hello, JobSecret, NONCE};
use super::layout::{Layout, Params, MAX_RANKS, NAME_PREFIX};
use super::liveness::Liveness;
use super::segment::{self, Mapping};
use super::ShmOptions;
use crate::error::{Error, Result};

const OK: u8 = 1;
const FAILED: u8 = 2;
/// How long rank 0 gives one connection to prove itself.
const HANDSHAKE: Duration = Duration::from_secs(2);
/// Connections rank 0 serves at once; more are closed at once (a rank among them tries again).
const MAX_PENDING: usize = 64;
/// How long a rank waits for rank 0's answer on one connection before it tries again.
const ATTEMPT: Duration = Duration::from_secs(5);
/// Reads wait in slices this long, so Ctrl-C is seen.
const SLICE: Duration = Duration::from_millis(100);

/// What a rank has once it joined: the mapped segment, its layout, and pidfds of its peers.
pub(crate) struct Joined {
    pub mapping: Mapping,
    pub layout: Layout,
    pub liveness: Liveness,
}

/// Join the job described by `opts` (blocks until every rank has joined or the timeout passes).
pub(crate) fn join(opts: &ShmOptions) -> Result<Joined> {
    if opts.world_size == 0 || opts.world_size > MAX_RANKS {
        return Err(Error::invalid(format!("world_size must be 1..={}, got {}", MAX_RANKS, opts.world_size)));
    }
    if opts.rank >= opts.world_size {
        return Err(Error::invalid(format!(
            "rank {} is out of range for a world of {} ranks",
            opts.rank, opts.world_size
        )));
    }
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
    Ok(Some(format!("{NAME_PREFIX}{}-{job}", rustix::process::geteuid().as_raw())))
}

fn me() -> u32 {
    rustix::process::getpid().as_raw_nonzero().get() as u32
}

/// Record this rank in the header: its pid, then one more attached rank.
pub(crate) fn register(m: &Mapping, rank: usize) {
    let h = m.header();
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

/// Why an exchange on a rendezvous connection ended early.
enum Cut {
    /// The other side closed, misbehaved or failed to prove itself.
    Lost,
    /// The deadline passed.
    Late,
    /// Stop rendezvousing (Ctrl-C, or a final answer).
    Stop(Error),
}

/// Ctrl-C while waiting for the other ranks ends the rendezvous.
fn interrupted() -> Result<()> {
    if crate::transport::wait::interrupted() {
        return Err(Error::Interrupted { op: "rendezvous".into() });
    }
    Ok(())
}

/// Read exactly `buf.len()` bytes before `deadline`, in slices so that, when `watch`, Ctrl-C is seen.
fn read_full(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    watch: bool,
) -> std::result::Result<(), Cut> {
    let mut got = 0;
    while got < buf.len() {
        if watch {
            interrupted().map_err(Cut::Stop)?;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Cut::Late);
        }
        s.set_read_timeout(Some(left.min(SLICE))).map_err(|_| Cut::Lost)?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(Cut::Lost),
            Ok(k) => got += k,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return Err(Cut::Lost),
        }
    }
    Ok(())
}

fn send_frame(s: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let len = u16::try_from(body.len()).unwrap_or(u16::MAX);
    let mut msg = vec![status];
    msg.extend_from_slice(&len.to_le_bytes());
    msg.extend_from_slice(&body[..len as usize]);
    s.write_all(&msg)
}

fn read_frame(s: &mut TcpStream, deadline: Instant, watch: bool) -> std::result::Result<(u8, Vec<u8>), Cut> {
    let mut head = [0u8; 3];
    read_full(s, &mut head, deadline, watch)?;
    let mut body = vec![0u8; u16::from_le_bytes([head[1], head[2]]) as usize];
    read_full(s, &mut body, deadline, watch)?;
    Ok((head[0], body))
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

/// What rank 0's connection threads share with it.
struct Door {
    secret: Option<JobSecret>,
    world: usize,
    uid: u32,
    /// The segment's name and nonce: what an admitted rank is told.
    answer: Vec<u8>,
    /// Ranks admitted so far (bit r).
    taken: AtomicU64,
    /// Cleared once rank 0 stops admitting.
    open: AtomicBool,
    /// Connections being served.
    pending: AtomicUsize,
}

/// What a connection thread reports to rank 0.
enum Knock {
    Admitted(usize, TcpStream),
    /// A member of the job that cannot join, and why (it was told).
    Refused(String),
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
    let layout = Layout::new(params)
        .map_err(|p| Error::invalid(format!("unusable shared-memory layout parameter: {p}")))?;
    let nonce = segment::random::<16>()?;
    let (name, mapping) = match segment_name(opts)? {
        Some(name) => (name.clone(), segment::create(&name, &layout, nonce)?),
        None => {
            // A random name collides only with a planted file: try a fresh one rather than use it.
            let mut tries = 0;
            loop {
                let name = segment::random_name()?;
                match segment::create(&name, &layout, nonce) {
                    Ok(m) => break (name, m),
                    Err(e)
                        if tries < 4
                            && matches!(&e, Error::Os { source, .. } if source.kind() == ErrorKind::AlreadyExists) =>
                    {
                        tries += 1
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    };
    register(&mapping, 0);
    let mut answer = name.as_bytes().to_vec();
    answer.extend_from_slice(&nonce);
    let door = Arc::new(Door {
        secret: opts.secret.clone(),
        world: n,
        uid: rustix::process::geteuid().as_raw(),
        answer,
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

/// One connection to rank 0, on its own thread: the rank must prove itself within [`HANDSHAKE`], or
/// it is dropped without a word. Returns what rank 0 must know.
fn greet(door: &Door, mut s: TcpStream) -> Option<Knock> {
    let deadline = Instant::now() + HANDSHAKE;
    s.set_nonblocking(false).ok()?;
    s.set_write_timeout(Some(HANDSHAKE)).ok()?;
    let _ = s.set_nodelay(true);
    let mut raw = [0u8; auth::HELLO];
    read_full(&mut s, &mut raw, deadline, false).ok()?;
    let hello = Hello::decode(&raw)?;
    let proof = match &door.secret {
        Some(key) if hello.secret => {
            let challenge = segment::random::<NONCE>().ok()?;
            s.write_all(&challenge).ok()?;
            let mut tag = [0u8; NONCE];
            read_full(&mut s, &mut tag, deadline, false).ok()?;
            if !auth::client_ok(key, &raw, &challenge, &tag) {
                return None;
            }
            Some((key, challenge, tag))
        }
        None if !hello.secret => {
            let owner = auth::socket_owner(s.peer_addr().ok()?, s.local_addr().ok()?)?;
            if owner != door.uid {
                return None;
            }
            None
        }
        // One side has a secret, the other none: not the same job.
        _ => return None,
    };
    if !door.open.load(SeqCst) {
        return None;
    }
    // A proven member of the job from here on: it hears why it cannot join.
    let (r, n) = (hello.rank, door.world);
    let bit = 1u64.checked_shl(r as u32).filter(|_| r < n).unwrap_or(0);
    let problem = if hello.world != n {
        Some(format!("rank {r} was started with world_size {}, but rank 0 has {n}", hello.world))
    } else if r == 0 || r >= n {
        Some(format!("a process claims rank {r}, outside 1..{n}"))
    } else if door.taken.fetch_or(bit, SeqCst) & bit != 0 {
        Some(format!("two processes claim rank {r}"))
    } else {
        None
    };
    let (status, mut body) = match &problem {
        Some(p) => (FAILED, p.as_bytes().to_vec()),
        None => (OK, door.answer.clone()),
    };
    if let Some((key, challenge, tag)) = proof {
        let answer =
            auth::Answer { hello: &raw, challenge: &challenge, their_tag: &tag, status, body: &body };
        let t = auth::server_tag(key, &answer);
        body.extend_from_slice(&t);
    }
    let sent = send_frame(&mut s, status, &body).is_ok();
    match problem {
        Some(p) => Some(Knock::Refused(p)),
        None if sent => Some(Knock::Admitted(r, s)),
        None => {
            // It never heard it was admitted: it tries again, and must find its rank free.
            door.taken.fetch_and(!bit, SeqCst);
            None
        }
    }
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

/// One attempt at being admitted: hello, proofs, and rank 0's answer, the segment's name and nonce.
/// A refusal from a rank 0 that proved itself is final.
fn knock(
    s: &mut TcpStream,
    opts: &ShmOptions,
    deadline: Instant,
) -> std::result::Result<(String, [u8; 16]), Cut> {
    let until = deadline.min(Instant::now() + ATTEMPT);
    let _ = s.set_nodelay(true);
    s.set_write_timeout(Some(ATTEMPT)).map_err(|_| Cut::Lost)?;
    let hello = Hello {
        secret: opts.secret.is_some(),
        rank: opts.rank,
        world: opts.world_size,
        challenge: segment::random::<NONCE>().map_err(Cut::Stop)?,
    }
    .encode();
    s.write_all(&hello).map_err(|_| Cut::Lost)?;
    let proof = match &opts.secret {
        Some(key) => {
            let mut challenge = [0u8; NONCE];
            read_full(s, &mut challenge, until, true)?;
            let tag = auth::client_tag(key, &hello, &challenge);
            s.write_all(&tag).map_err(|_| Cut::Lost)?;
            Some((key, challenge, tag))
        }
        None => None,
    };
    let (status, mut body) = read_frame(s, until, true)?;
    if let Some((key, challenge, tag)) = proof {
        // Rank 0 must prove it knows the secret too before we believe a word of its answer.
        let theirs = body.split_off(body.len().checked_sub(NONCE).ok_or(Cut::Lost)?);
        let answer =
            auth::Answer { hello: &hello, challenge: &challenge, their_tag: &tag, status, body: &body };
        if !auth::server_ok(key, &answer, &theirs) {
            return Err(Cut::Lost);
        }
    }
    if status != OK {
        let why = String::from_utf8_lossy(&body);
        return Err(Cut::Stop(Error::invalid(format!("rendezvous refused by rank 0: {why}"))));
    }
    let split = body.len().checked_sub(16).ok_or(Cut::Lost)?;
    let name = std::str::from_utf8(&body[..split]).map_err(|_| Cut::Lost)?;
    let valid = name.starts_with(NAME_PREFIX) && !name[1..].contains('/') && name.len() < 250;
    if !valid {
        return Err(Cut::Stop(Error::invalid("rendezvous: malformed answer from rank 0")));
    }
    Ok((name.to_string(), body[split..].try_into().expect("16 bytes")))
}
