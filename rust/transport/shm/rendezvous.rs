//! How the ranks of a job find its segment.
//!
//! Rank 0 listens on MASTER_ADDR:MASTER_PORT (so two jobs with different ports never meet, and a port
//! already in use is a clear error), creates the segment, and answers each connecting rank's hello
//! (rank, world size, uid) with the segment's name and session nonce. Each rank attaches, checks the
//! segment, records its pid and reports back; once every rank has attached, rank 0 unlinks the name
//! (from then on no crash can leak it) and releases everyone. The TCP connection carries only these
//! few messages and is closed afterwards; collective data never touches it.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use super::layout::{Layout, Params, MAX_RANKS};
use super::liveness::Liveness;
use super::segment::{self, Mapping};
use super::ShmOptions;
use crate::error::{Error, Result};

const HELLO: &[u8; 8] = b"AXONRDV1";
const OK: u8 = 1;
const FAILED: u8 = 2;

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
    Ok(Some(format!("/axonml-{}-{job}", rustix::process::geteuid().as_raw())))
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

fn send_frame(s: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let len = u16::try_from(body.len()).unwrap_or(u16::MAX);
    let mut msg = vec![status];
    msg.extend_from_slice(&len.to_le_bytes());
    msg.extend_from_slice(&body[..len as usize]);
    s.write_all(&msg)
}

fn read_frame(s: &mut TcpStream, deadline: Instant) -> std::io::Result<(u8, Vec<u8>)> {
    s.set_read_timeout(Some(remaining(deadline)))?;
    let mut head = [0u8; 3];
    s.read_exact(&mut head)?;
    let mut body = vec![0u8; u16::from_le_bytes([head[1], head[2]]) as usize];
    s.read_exact(&mut body)?;
    Ok((head[0], body))
}

/// Ctrl-C while waiting for the other ranks ends the rendezvous.
fn interrupted() -> Result<()> {
    if crate::transport::wait::interrupted() {
        return Err(Error::Interrupted { op: "rendezvous".into() });
    }
    Ok(())
}

fn timeout(opts: &ShmOptions, missing: Vec<usize>) -> Error {
    Error::Timeout {
        rank: opts.rank,
        op: format!("rendezvous on {}:{}", opts.master_addr, opts.master_port),
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
    // A tuning knob for benchmarks: the pipeline round size (the others learn it from the header).
    if let Some(kib) = std::env::var("AXONML_SHM_CHUNK_KIB").ok().and_then(|v| v.parse::<usize>().ok()) {
        params.chunk = kib << 10;
    }
    let layout = Layout::new(params)
        .map_err(|p| Error::invalid(format!("unusable shared-memory layout parameter: {p}")))?;
    let nonce = segment::nonce()?;
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
    // From here on the name must go, whatever happens.
    let admitted = admit(opts, listener.as_ref(), &name, nonce, &mapping, deadline);
    segment::unlink(&name);
    let mut conns = admitted?;
    for c in conns.iter_mut().flatten() {
        // A rank that vanished now fails at its first collective (its pidfd says so).
        let _ = send_frame(c, OK, b"go");
    }
    let liveness = Liveness::open(&pids(&mapping, n), 0)?;
    Ok(Joined { mapping, layout, liveness })
}

/// Accept every rank's hello, answer with the segment, and wait until each has attached.
fn admit(
    opts: &ShmOptions,
    listener: Option<&TcpListener>,
    name: &str,
    nonce: [u8; 16],
    mapping: &Mapping,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>> {
    let n = opts.world_size;
    register(mapping, 0);
    let mut conns: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let Some(listener) = listener else {
        return Ok(conns);
    };
    let mut reply = name.as_bytes().to_vec();
    reply.extend_from_slice(&nonce);
    let uid = rustix::process::geteuid().as_raw();
    let mut joined = 1;
    while joined < n {
        let mut s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                interrupted()?;
                if Instant::now() >= deadline {
                    return Err(timeout(opts, (1..n).filter(|&r| conns[r].is_none()).collect()));
                }
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(io_err("accept")(e)),
        };
        // Anything that is not a well-formed hello (a port scanner, a health check) is dropped unanswered.
        let mut hello = [0u8; 24];
        let ok = s.set_nonblocking(false).is_ok()
            && s.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(5)))).is_ok()
            && s.read_exact(&mut hello).is_ok()
            && &hello[..8] == HELLO;
        if !ok {
            continue;
        }
        let word = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes")) as usize;
        let (rank, world, their_uid) = (word(8), word(12), word(16) as u32);
        let problem = if world != n {
            Some(format!("rank {rank} was started with world_size {world}, but rank 0 has {n}"))
        } else if rank == 0 || rank >= n {
            Some(format!("a process claims rank {rank}, outside 1..{n}"))
        } else if conns[rank].is_some() {
            Some(format!("two processes claim rank {rank}"))
        } else if their_uid != uid {
            Some(format!(
                "rank {rank} runs as uid {their_uid}, rank 0 as uid {uid}: all ranks must be one user"
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            let _ = send_frame(&mut s, FAILED, p.as_bytes());
            return Err(Error::invalid(format!("rendezvous: {p}")));
        }
        send_frame(&mut s, OK, &reply).map_err(io_err("answering a rank"))?;
        conns[rank] = Some(s);
        joined += 1;
    }
    for (rank, c) in conns.iter_mut().enumerate() {
        let Some(c) = c else { continue };
        match read_frame(c, deadline) {
            Ok((OK, _)) => {}
            Ok((_, msg)) => {
                return Err(Error::invalid(format!(
                    "rank {rank} could not attach the segment: {}",
                    String::from_utf8_lossy(&msg)
                )))
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(timeout(opts, vec![rank]))
            }
            Err(e) => return Err(io_err(&format!("waiting for rank {rank} to attach"))(e)),
        }
    }
    Ok(conns)
}

/// Ranks 1..n: reach rank 0 (retrying until it listens), attach, report, wait for the go.
fn connect(opts: &ShmOptions, deadline: Instant) -> Result<Joined> {
    let n = opts.world_size;
    let addrs: Vec<_> = (opts.master_addr.as_str(), opts.master_port)
        .to_socket_addrs()
        .map_err(|e| Error::os(format!("resolving MASTER_ADDR {}", opts.master_addr), e))?
        .collect();
    let mut s = loop {
        if let Some(s) = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, remaining(deadline).min(Duration::from_secs(1))).ok())
        {
            break s;
        }
        interrupted()?;
        if Instant::now() >= deadline {
            return Err(timeout(opts, vec![0]));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = s.set_nodelay(true);
    let mut hello = HELLO.to_vec();
    for w in [opts.rank as u32, n as u32, rustix::process::geteuid().as_raw(), me()] {
        hello.extend_from_slice(&w.to_le_bytes());
    }
    s.write_all(&hello).map_err(io_err("sending hello to rank 0"))?;
    let lost = |e: std::io::Error| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            timeout(opts, vec![0])
        } else {
            Error::os("rendezvous: rank 0 closed the connection (it failed; see its error)", e)
        }
    };
    let (status, body) = read_frame(&mut s, deadline).map_err(lost)?;
    if status != OK {
        return Err(Error::invalid(format!(
            "rendezvous refused by rank 0: {}",
            String::from_utf8_lossy(&body)
        )));
    }
    let reply = || -> Option<(String, [u8; 16])> {
        let split = body.len().checked_sub(16)?;
        let name = std::str::from_utf8(&body[..split]).ok()?;
        let valid = name.starts_with("/axonml-") && !name[1..].contains('/') && name.len() < 250;
        valid.then(|| (name.to_string(), body[split..].try_into().expect("16 bytes")))
    };
    let (name, nonce) = reply().ok_or_else(|| Error::invalid("rendezvous: malformed answer from rank 0"))?;
    let (mapping, layout) = match segment::attach(&name, n, nonce) {
        Ok(x) => x,
        Err(e) => {
            let _ = send_frame(&mut s, FAILED, e.to_string().as_bytes());
            return Err(e);
        }
    };
    register(&mapping, opts.rank);
    send_frame(&mut s, OK, b"attached").map_err(io_err("reporting to rank 0"))?;
    let (status, _) = read_frame(&mut s, deadline).map_err(lost)?;
    if status != OK {
        return Err(Error::invalid("rendezvous: rank 0 gave up"));
    }
    let liveness = Liveness::open(&pids(&mapping, n), opts.rank)?;
    Ok(Joined { mapping, layout, liveness })
}
