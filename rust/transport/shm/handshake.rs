//! One rendezvous connection: the frames rank 0 and a rank exchange, how rank 0 greets a connecting
//! rank ([`greet`]: its hello, the proofs of `auth`, the answer) and how a rank knocks ([`knock`]).
//! Reads wait in slices so that Ctrl-C is seen, and every exchange has a deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::time::Instant;

use super::auth::{self, Hello, JobSecret, NONCE};
use super::segment;
use super::ShmOptions;
use crate::config::{ATTEMPT, HANDSHAKE, RENDEZVOUS_SLICE};
use crate::error::{Error, Result};

pub(super) const OK: u8 = 1;
pub(super) const FAILED: u8 = 2;

/// Why an exchange on a rendezvous connection ended early.
pub(super) enum Cut {
    /// The other side closed, misbehaved or failed to prove itself.
    Lost,
    /// The deadline passed.
    Late,
    /// Stop rendezvousing (Ctrl-C, or a final answer).
    Stop(Error),
}

/// Ctrl-C while waiting for the other ranks ends the rendezvous.
pub(super) fn interrupted() -> Result<()> {
    if crate::sync::wait::interrupted() {
        return Err(Error::Interrupted { op: "rendezvous".into() });
    }
    Ok(())
}

/// Read exactly `buf.len()` bytes before `deadline`, in slices so that, when `watch`, Ctrl-C is seen.
pub(super) fn read_full(
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
        s.set_read_timeout(Some(left.min(RENDEZVOUS_SLICE))).map_err(|_| Cut::Lost)?;
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

/// Longest frame body: its length travels in 16 bits, so whatever a peer says, a frame costs at most
/// 64 KiB.
pub(crate) const MAX_BODY: usize = u16::MAX as usize;

/// A frame: status, body length (16 bits, little endian), body. A longer body is cut at [`MAX_BODY`]
/// (only a refusal's text could be that long).
pub(crate) fn frame(status: u8, body: &[u8]) -> Vec<u8> {
    let body = &body[..body.len().min(MAX_BODY)];
    let mut msg = vec![status];
    msg.extend_from_slice(&(body.len() as u16).to_le_bytes());
    msg.extend_from_slice(body);
    msg
}

/// The status and body length (at most [`MAX_BODY`]) that a frame's first three bytes announce.
pub(crate) fn frame_head(head: [u8; 3]) -> (u8, usize) {
    (head[0], usize::from(u16::from_le_bytes([head[1], head[2]])))
}

pub(super) fn send_frame(s: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    s.write_all(&frame(status, body))
}

pub(super) fn read_frame(
    s: &mut TcpStream,
    deadline: Instant,
    watch: bool,
) -> std::result::Result<(u8, Vec<u8>), Cut> {
    let mut head = [0u8; 3];
    read_full(s, &mut head, deadline, watch)?;
    let (status, len) = frame_head(head);
    let mut body = vec![0u8; len];
    read_full(s, &mut body, deadline, watch)?;
    Ok((status, body))
}

/// Rank 0's answer to an admitted rank: the segment's name, then its session nonce.
pub(crate) fn answer(name: &str, nonce: [u8; 16]) -> Vec<u8> {
    [name.as_bytes(), &nonce].concat()
}

/// The segment name and nonce of rank 0's [`answer`], or a clear error for anything else.
pub(crate) fn parse_answer(body: &[u8]) -> Result<(String, [u8; 16])> {
    let malformed = || Error::invalid("rendezvous: malformed answer from rank 0");
    let split = body.len().checked_sub(16).ok_or_else(malformed)?;
    let name = std::str::from_utf8(&body[..split]).map_err(|_| malformed())?;
    if !segment::plausible_name(name) {
        return Err(malformed());
    }
    Ok((name.to_string(), body[split..].try_into().expect("16 bytes")))
}

/// What rank 0's connection threads share with it.
pub(super) struct Door {
    pub secret: Option<JobSecret>,
    pub world: usize,
    pub uid: u32,
    /// The segment's name and nonce: what an admitted rank is told.
    pub answer: Vec<u8>,
    /// Ranks admitted so far (bit r).
    pub taken: AtomicU64,
    /// Cleared once rank 0 stops admitting.
    pub open: AtomicBool,
    /// Connections being served.
    pub pending: AtomicUsize,
}

/// What a connection thread reports to rank 0.
pub(super) enum Knock {
    Admitted(usize, TcpStream),
    /// A member of the job that cannot join, and why (it was told).
    Refused(String),
}

/// One connection to rank 0, on its own thread: the rank must prove itself within [`HANDSHAKE`], or
/// it is dropped without a word. Returns what rank 0 must know.
pub(super) fn greet(door: &Door, mut s: TcpStream) -> Option<Knock> {
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

/// One attempt at being admitted: hello, proofs, and rank 0's answer, the segment's name and nonce.
/// A refusal from a rank 0 that proved itself is final.
pub(super) fn knock(
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
    parse_answer(&body).map_err(Cut::Stop)
}
