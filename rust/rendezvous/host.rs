//! Rank 0's side of the TCP store: it listens on MASTER_ADDR:MASTER_PORT (so two jobs with different
//! ports never meet, and a port already in use is a clear error) and serves its [`MemoryStore`] to the
//! connections that pass its door: those the kernel says are of rank 0's own user (/proc/net/tcp and
//! tcp6 list each socket's owner), and, with a job secret, those whose first frame is a pass made with
//! it (`tcp::door_opens`: from any user or network namespace). Any other is closed unanswered.
//! Connections are served concurrently, each by a thread (at most `config::MAX_PENDING`; more are
//! closed at once), so a port scanner or a silent socket costs the job nothing; a malformed request
//! closes its connection. The door only keeps strangers out of the store: whether a rank belongs to
//! the job is the meeting's question, asked the same way on every store (`meet`).

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::memory::MemoryStore;
use super::secret::JobSecret;
use super::tcp::{door_opens, frame, parse_request, read_frame, Request, FAILED, NONE, OK, PASS};
use super::KeyValueStore;
use crate::config::{MAX_PENDING, RENDEZVOUS_WRITE};
use crate::error::{Error, Result};

/// The store rank 0 serves while it is held; dropping it closes the port and every connection.
pub struct StoreHost {
    store: Arc<MemoryStore>,
    open: Arc<AtomicBool>,
    accepting: Option<JoinHandle<()>>,
    name: String,
}

struct Shared {
    store: Arc<MemoryStore>,
    open: Arc<AtomicBool>,
    uid: u32,
    secret: Option<JobSecret>,
    pending: AtomicUsize,
    /// How long a connection may stay silent: the job's rendezvous timeout.
    idle: Duration,
}

impl StoreHost {
    /// Listen on `addr:port` and serve a fresh store to the connections that pass the door (see the
    /// module docs; `secret` opens it too); a connection silent for `idle` is closed.
    pub fn start(addr: &str, port: u16, idle: Duration, secret: Option<&JobSecret>) -> Result<StoreHost> {
        let listener = TcpListener::bind((addr, port)).map_err(|e| {
            Error::os(
                format!("rank 0 cannot listen on {addr}:{port} (is another job using this MASTER_PORT?)"),
                e,
            )
        })?;
        listener.set_nonblocking(true).map_err(|e| Error::os("rendezvous: listener", e))?;
        let store = Arc::new(MemoryStore::new());
        let open = Arc::new(AtomicBool::new(true));
        let shared = Arc::new(Shared {
            store: store.clone(),
            open: open.clone(),
            uid: rustix::process::geteuid().as_raw(),
            secret: secret.cloned(),
            pending: AtomicUsize::new(0),
            idle,
        });
        let accepting = std::thread::Builder::new()
            .name("axonml-store".into())
            .spawn(move || accept(&listener, &shared))
            .map_err(|e| Error::os("starting the store's thread", e))?;
        Ok(StoreHost {
            store,
            open,
            accepting: Some(accepting),
            name: format!("the TCP store of rank 0 at {addr}:{port}"),
        })
    }

    /// The store itself, which rank 0 uses directly.
    pub fn store(&self) -> HostedStore<'_> {
        HostedStore(self)
    }
}

impl Drop for StoreHost {
    fn drop(&mut self) {
        self.open.store(false, SeqCst);
        if let Some(t) = self.accepting.take() {
            let _ = t.join();
        }
    }
}

/// Rank 0's own view of the store it hosts: its memory, named as the ranks name it.
pub struct HostedStore<'a>(&'a StoreHost);

impl KeyValueStore for HostedStore<'_> {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.0.store.set(key, value)
    }
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.0.store.get(key)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<bool> {
        self.0.store.wait(keys, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.0.store.add(key, delta)
    }
    fn delete(&self, key: &str) -> Result<()> {
        self.0.store.delete(key)
    }
    fn name(&self) -> String {
        self.0.name.clone()
    }
}

fn accept(listener: &TcpListener, shared: &Arc<Shared>) {
    while shared.open.load(SeqCst) {
        match listener.accept() {
            // Over the limit the connection is just closed.
            Ok((s, _)) if shared.pending.fetch_add(1, SeqCst) < MAX_PENDING => {
                let sh = shared.clone();
                let spawned = std::thread::Builder::new().name("axonml-store-conn".into()).spawn(move || {
                    serve(&sh, s);
                    sh.pending.fetch_sub(1, SeqCst);
                });
                if spawned.is_err() {
                    shared.pending.fetch_sub(1, SeqCst);
                }
            }
            Ok(_) => {
                shared.pending.fetch_sub(1, SeqCst);
            }
            // Nothing waiting, or a transient failure (a reset connection, no file descriptor left):
            // nothing a stranger does ends the store.
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// Serve one connection until it closes, misbehaves, stays silent too long, or the host closes.
fn serve(shared: &Shared, mut s: TcpStream) {
    if s.set_nonblocking(false).is_err() || s.set_write_timeout(Some(RENDEZVOUS_WRITE)).is_err() {
        return;
    }
    let _ = s.set_nodelay(true);
    let closing = || !shared.open.load(SeqCst);
    // A pass made with the job secret opens the door (it may come first, once); else the kernel must
    // say the socket is of rank 0's user.
    let mut admitted = false;
    let mut first = true;
    loop {
        let Ok((op, body)) = read_frame(&mut s, Instant::now() + shared.idle, &closing) else { return };
        if op == PASS && first {
            first = false;
            admitted = shared.secret.as_ref().is_some_and(|key| door_opens(key, &body));
            continue;
        }
        first = false;
        if !admitted {
            let (Ok(peer), Ok(local)) = (s.peer_addr(), s.local_addr()) else { return };
            admitted = socket_owner(peer, local) == Some(shared.uid);
            if !admitted {
                return;
            }
        }
        let Some(request) = parse_request(op, &body) else { return };
        let (status, reply) = match answer(&shared.store, request) {
            Ok(r) => r,
            Err(e) => (FAILED, e.to_string().into_bytes()),
        };
        if std::io::Write::write_all(&mut s, &frame(status, &reply)).is_err() {
            return;
        }
    }
}

fn answer(store: &MemoryStore, r: Request) -> Result<(u8, Vec<u8>)> {
    Ok(match r {
        Request::Set(k, v) => store.set(&k, &v).map(|()| (OK, vec![]))?,
        Request::Get(k) => store.get(&k)?.map_or((NONE, vec![]), |v| (OK, v)),
        Request::Add(k, d) => (OK, store.add(&k, d)?.to_le_bytes().to_vec()),
        Request::Delete(k) => store.delete(&k).map(|()| (OK, vec![]))?,
        Request::Check(k) => (if store.get(&k)?.is_some() { OK } else { NONE }, vec![]),
    })
}

/// An address as /proc/net/tcp{,6} prints it: the raw (network order) words in hex, then the port.
fn proc_form(ip: IpAddr, port: u16) -> String {
    let words: Vec<String> = match ip {
        IpAddr::V4(a) => vec![format!("{:08X}", u32::from_ne_bytes(a.octets()))],
        IpAddr::V6(a) => a
            .octets()
            .chunks(4)
            .map(|c| format!("{:08X}", u32::from_ne_bytes(c.try_into().expect("4 bytes"))))
            .collect(),
    };
    format!("{}:{port:04X}", words.concat())
}

/// Both spellings of an address: an IPv4 peer of a dual-stack socket shows as `::ffff:a.b.c.d`.
fn forms(a: SocketAddr) -> Vec<String> {
    let ip = a.ip().to_canonical();
    let mut v = vec![proc_form(ip, a.port())];
    if let IpAddr::V4(v4) = ip {
        v.push(proc_form(IpAddr::V6(v4.to_ipv6_mapped()), a.port()));
    }
    v
}

/// The uid that owns the socket whose local end is `local` and remote end `remote`, as the kernel
/// lists it, or `None` when no socket of this host's network namespace has that pair (a peer on
/// another host or in another namespace).
pub(crate) fn socket_owner(local: SocketAddr, remote: SocketAddr) -> Option<u32> {
    let (locals, remotes) = (forms(local), forms(remote));
    ["/proc/net/tcp", "/proc/net/tcp6"].into_iter().find_map(|path| {
        let table = std::fs::read_to_string(path).ok()?;
        table.lines().skip(1).find_map(|line| {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            let f: Vec<&str> = line.split_whitespace().collect();
            let hit = f.len() > 7 && locals.iter().any(|l| l == f[1]) && remotes.iter().any(|r| r == f[2]);
            hit.then(|| f[7].parse().ok()).flatten()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::secret::{self, TAG};
    use crate::rendezvous::tcp::DOOR;
    use crate::rendezvous::TcpStore;

    #[test]
    fn the_owner_of_a_loopback_peer_socket_is_our_uid() {
        for host in ["127.0.0.1", "[::1]"] {
            let Ok(l) = TcpListener::bind(format!("{host}:0")) else { continue }; // no IPv6 here
            let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (s, peer) = l.accept().unwrap();
            let me = rustix::process::geteuid().as_raw();
            // Rank 0's view: the peer's socket has local = peer, remote = our end.
            assert_eq!(socket_owner(peer, s.local_addr().unwrap()), Some(me), "{host}");
            assert_eq!(socket_owner(c.local_addr().unwrap(), c.peer_addr().unwrap()), Some(me));
            let nowhere: SocketAddr = "127.0.0.1:1".parse().unwrap();
            assert_eq!(socket_owner(nowhere, s.local_addr().unwrap()), None);
        }
    }

    #[test]
    fn a_client_sees_what_the_host_holds() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let host = StoreHost::start("127.0.0.1", port, Duration::from_secs(20), None).unwrap();
        let c = TcpStore::connect("127.0.0.1", port, 1, 2, Duration::from_secs(20), None).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(host.store().get("k").unwrap().as_deref(), Some(&b"v"[..]));
        assert_eq!(c.get("k").unwrap().as_deref(), Some(&b"v"[..]));
        assert_eq!(c.get("none").unwrap(), None);
        assert_eq!((c.add("n", 3).unwrap(), host.store().add("n", 4).unwrap()), (3, 7));
        assert!(!c.wait(&["k", "late"], Duration::from_millis(30)).unwrap());
        host.store().set("late", b"").unwrap();
        assert!(c.wait(&["k", "late"], Duration::from_millis(30)).unwrap());
        c.delete("k").unwrap();
        assert_eq!(host.store().get("k").unwrap(), None);
        // The store's own limits reach the client as errors, and the connection stays usable.
        assert!(c.set("big", &vec![0; crate::rendezvous::MAX_VALUE + 1]).is_err());
        assert!(c.set("k", b"again").is_ok());
        drop(host);
        assert!(matches!(c.get("k"), Err(Error::PeerDied { peer: 0, .. })));
    }

    #[test]
    fn a_pass_made_with_the_secret_opens_the_door() {
        let (key, other) = (JobSecret::new(vec![1; 32]).unwrap(), JobSecret::new(vec![2; 32]).unwrap());
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let host = StoreHost::start("127.0.0.1", port, Duration::from_secs(20), Some(&key)).unwrap();
        host.store().set("k", b"v").unwrap();
        let t = Duration::from_secs(20);
        let ours = TcpStore::connect("127.0.0.1", port, 1, 2, t, Some(&key)).unwrap();
        assert_eq!(ours.get("k").unwrap().as_deref(), Some(&b"v"[..]));
        // This process's user passes the door anyway: the meeting refuses a wrong secret (`meet`).
        let mine = TcpStore::connect("127.0.0.1", port, 1, 2, t, Some(&other)).unwrap();
        assert_eq!(mine.get("k").unwrap().as_deref(), Some(&b"v"[..]));
        let (nonce, tag) = ([7; TAG], secret::tag(&key, DOOR, &[&[7; TAG]]));
        assert!(door_opens(&key, &[&nonce[..], &tag].concat()));
        assert!(!door_opens(&other, &[&nonce[..], &tag].concat()));
        assert!(!door_opens(&key, &[&nonce[..], &tag[..31]].concat()));
    }
}
