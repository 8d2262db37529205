//! The small TCP store rank 0 hosts on MASTER_ADDR:MASTER_PORT while a job starts (`host`), and a
//! rank's connection to it ([`TcpStore`]). The wire: frames of a status byte, a 16-bit body length and
//! the body, so whatever a peer says, a frame costs at most 64 KiB; a request's status is its
//! operation, its body the key (16-bit length first) and the operand; every reply is one frame.
//! Reads wait in slices that see Ctrl-C, and every call has a deadline. Only these few messages cross
//! the socket; collective data never does.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::secret::{self, JobSecret, TAG};
use super::KeyValueStore;
use crate::config::{RENDEZVOUS_SLICE, RENDEZVOUS_WRITE};
use crate::error::{Error, Result};

/// Longest frame body.
pub(crate) const MAX_BODY: usize = u16::MAX as usize;

pub(crate) const OK: u8 = 1;
pub(crate) const NONE: u8 = 2;
pub(crate) const FAILED: u8 = 3;

/// One request to the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Request {
    Set(String, Vec<u8>),
    Get(String),
    Add(String, i64),
    Delete(String),
    Check(String),
}

/// A request's frame status and body.
pub(crate) fn request(r: &Request) -> (u8, Vec<u8>) {
    let (op, key, rest): (u8, &str, &[u8]) = match r {
        Request::Set(k, v) => (1, k, v),
        Request::Get(k) => (2, k, &[]),
        Request::Add(k, d) => return (3, [key_part(k), d.to_le_bytes().to_vec()].concat()),
        Request::Delete(k) => (4, k, &[]),
        Request::Check(k) => (5, k, &[]),
    };
    (op, [key_part(key), rest.to_vec()].concat())
}

fn key_part(key: &str) -> Vec<u8> {
    let key = &key.as_bytes()[..key.len().min(MAX_BODY)];
    [&(key.len() as u16).to_le_bytes()[..], key].concat()
}

/// The request a frame carries, or `None` for anything [`request`] does not write.
pub(crate) fn parse_request(op: u8, body: &[u8]) -> Option<Request> {
    let (len, rest) = body.split_first_chunk::<2>()?;
    let (key, operand) = rest.split_at_checked(usize::from(u16::from_le_bytes(*len)))?;
    let key = std::str::from_utf8(key).ok()?.to_string();
    let bare = |r: Request| operand.is_empty().then_some(r);
    match op {
        1 => Some(Request::Set(key, operand.to_vec())),
        2 => bare(Request::Get(key)),
        3 => Some(Request::Add(key, i64::from_le_bytes(operand.try_into().ok()?))),
        4 => bare(Request::Delete(key)),
        5 => bare(Request::Check(key)),
        _ => None,
    }
}

/// A frame: status, body length (16 bits, little endian), body. A longer body is cut at [`MAX_BODY`]
/// (only an error's text could be that long).
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

pub(crate) const DOOR: &[u8] = b"axonml rendezvous store door";
/// The status of a door pass's frame (no request has it).
pub(crate) const PASS: u8 = 6;

/// What a connection with a job secret says first, in a frame of its own: a fresh nonce and its tag
/// under the secret. It opens the store's door to ranks of other users or network namespaces; whether
/// a rank belongs to the job is still the meeting's question.
fn door_pass(key: &JobSecret) -> Result<Vec<u8>> {
    let nonce = secret::random::<TAG>()?;
    Ok(frame(PASS, &[&nonce[..], &secret::tag(key, DOOR, &[&nonce])].concat()))
}

/// Whether `body` is a door pass under `key` (constant time).
pub(crate) fn door_opens(key: &JobSecret, body: &[u8]) -> bool {
    body.len() == 2 * TAG && secret::verifies(key, DOOR, &[&body[..TAG]], &body[TAG..])
}

/// Why reading a frame ended early.
pub(crate) enum Cut {
    /// The other side closed or failed.
    Lost,
    /// The deadline passed.
    Late,
    /// `stop` said so (Ctrl-C, or the host closing).
    Stopped,
}

/// Read one frame before `deadline`, in slices between which `stop` is asked.
pub(crate) fn read_frame(
    s: &mut TcpStream,
    deadline: Instant,
    stop: &dyn Fn() -> bool,
) -> std::result::Result<(u8, Vec<u8>), Cut> {
    let mut head = [0u8; 3];
    read_full(s, &mut head, deadline, stop)?;
    let (status, len) = frame_head(head);
    let mut body = vec![0u8; len];
    read_full(s, &mut body, deadline, stop)?;
    Ok((status, body))
}

fn read_full(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    stop: &dyn Fn() -> bool,
) -> std::result::Result<(), Cut> {
    let mut got = 0;
    while got < buf.len() {
        if stop() {
            return Err(Cut::Stopped);
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

/// A rank's connection to the store rank 0 hosts, for one rendezvous.
pub struct TcpStore {
    conn: Mutex<TcpStream>,
    name: String,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// No call waits past the rendezvous' deadline.
    deadline: Instant,
}

impl TcpStore {
    /// Connect to the store rank 0 hosts at `addr:port`, trying again until `timeout` (rank 0 may not
    /// listen yet) or Ctrl-C; later calls wait for a reply until the same deadline. With the job's
    /// `secret` the connection passes the store's door by it (see `host`). `rank` and `world` name this
    /// rank in a timeout.
    pub fn connect(
        addr: &str,
        port: u16,
        rank: usize,
        world: usize,
        timeout: Duration,
        secret: Option<&JobSecret>,
    ) -> Result<TcpStore> {
        let deadline = Instant::now() + timeout;
        let name = format!("the TCP store of rank 0 at {addr}:{port}");
        let addrs: Vec<_> = (addr, port)
            .to_socket_addrs()
            .map_err(|e| Error::os(format!("resolving MASTER_ADDR {addr}"), e))?
            .collect();
        loop {
            if crate::sync::wait::interrupted() {
                return Err(Error::Interrupted { op: "rendezvous".into() });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let op = format!("rendezvous (reaching {name})");
                return Err(Error::timeout(rank, op, timeout, vec![0], (0..world).collect()));
            }
            let slice = left.min(Duration::from_secs(1));
            if let Some(mut s) = addrs.iter().find_map(|a| TcpStream::connect_timeout(a, slice).ok()) {
                let _ = s.set_nodelay(true);
                s.set_write_timeout(Some(RENDEZVOUS_WRITE))
                    .map_err(|e| Error::os("rendezvous: socket", e))?;
                if let Some(key) = secret {
                    // A refused pass shows as a closed connection at the first call.
                    let _ = s.write_all(&door_pass(key)?);
                }
                return Ok(TcpStore { conn: Mutex::new(s), name, rank, world, timeout, deadline });
            }
            std::thread::sleep(left.min(Duration::from_millis(20)));
        }
    }

    /// One request and its reply, before the deadline.
    fn call(&self, r: Request) -> Result<(u8, Vec<u8>)> {
        let lost = || Error::PeerDied {
            peer: 0,
            op: "rendezvous".into(),
            detail: Some(format!(
                "{} closed the connection: rank 0 gave up (see its error) or died, or does not admit this \
                 process (a process of another user or network namespace must pass its door with the job's \
                 AXONML_JOB_SECRET)",
                self.name
            )),
            progress: String::new(),
        };
        let mut s = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let (op, body) = request(&r);
        if body.len() > MAX_BODY {
            return Err(Error::invalid(format!("a store request of {} bytes is too long", body.len())));
        }
        s.write_all(&frame(op, &body)).map_err(|_| lost())?;
        let watch = crate::sync::wait::interrupted;
        match read_frame(&mut s, self.deadline, &watch) {
            Ok((FAILED, why)) => {
                Err(Error::invalid(format!("{}: {}", self.name, String::from_utf8_lossy(&why))))
            }
            Ok(reply) => Ok(reply),
            Err(Cut::Lost) => Err(lost()),
            Err(Cut::Late) => {
                let op = format!("rendezvous (waiting for a reply from {})", self.name);
                Err(Error::timeout(self.rank, op, self.timeout, vec![0], (0..self.world).collect()))
            }
            Err(Cut::Stopped) => Err(Error::Interrupted { op: "rendezvous".into() }),
        }
    }
}

impl KeyValueStore for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(Request::Set(key.into(), value.to_vec())).map(drop)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let (status, value) = self.call(Request::Get(key.into()))?;
        Ok((status == OK).then_some(value))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut all = true;
            for k in keys {
                all &= self.call(Request::Check((*k).into()))?.0 == OK;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if all || left.is_zero() {
                return Ok(all);
            }
            // Polling: rank 0 answers each poll from memory, and only until the last rank has started.
            std::thread::sleep(left.min(Duration::from_millis(10)));
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let (_, sum) = self.call(Request::Add(key.into(), delta))?;
        let sum: [u8; 8] =
            sum.try_into().map_err(|_| Error::invalid(format!("{}: a malformed sum", self.name)))?;
        Ok(i64::from_le_bytes(sum))
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.call(Request::Delete(key.into())).map(drop)
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}
