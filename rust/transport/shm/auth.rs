//! Who may join a job's rendezvous: the hello a rank sends, and how rank 0 and the rank prove to each
//! other that they belong to the same job.
//!
//! With a job secret (AXONML_JOB_SECRET) both sides prove that they know it without sending it. The
//! rank's hello carries a fresh random challenge; rank 0 answers with one of its own; the rank returns
//! HMAC-SHA256(secret, "client" ‖ hello ‖ rank 0's challenge); rank 0's answer (the segment's name and
//! nonce, or why the rank cannot join) carries HMAC-SHA256(secret, "server" ‖ both challenges ‖ the
//! rank's tag ‖ the answer). Each tag covers both fresh challenges, so a recorded exchange never
//! verifies again, and the two labels keep one side's tag from passing for the other's. Tags are
//! compared in constant time (`Mac::verify_slice`).
//!
//! Without a secret rank 0 admits a connection only when the kernel lists its other end as a socket
//! of rank 0's own uid (/proc/net/tcp and tcp6): any process of the same user may join, no one else.

use std::net::{IpAddr, SocketAddr};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// A job's shared secret. Its `Debug` never shows the bytes.
#[derive(Clone)]
pub struct JobSecret(Vec<u8>);

impl JobSecret {
    /// Shortest secret accepted: 128 bits.
    pub const MIN_BYTES: usize = 16;

    /// A secret of at least [`JobSecret::MIN_BYTES`] bytes (the launcher makes 32 random ones).
    pub fn new(bytes: Vec<u8>) -> Result<JobSecret> {
        if bytes.len() < Self::MIN_BYTES {
            return Err(Error::invalid(format!(
                "the job secret has {} bytes; it must have at least {} (AXONML_JOB_SECRET: 64 hex digits, \
                 e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`)",
                bytes.len(),
                Self::MIN_BYTES
            )));
        }
        Ok(JobSecret(bytes))
    }
}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(..)")
    }
}

const MAGIC: &[u8; 8] = b"AXONRDV2";
/// Bytes of a challenge, and of a tag.
pub(crate) const NONCE: usize = 32;
/// Bytes of an encoded hello.
pub(crate) const HELLO: usize = 8 + 3 * 4 + NONCE;

/// What a rank says first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// Whether the rank has a job secret (then it expects a challenge).
    pub secret: bool,
    pub rank: usize,
    pub world: usize,
    pub challenge: [u8; NONCE],
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO] {
        let mut b = [0u8; HELLO];
        b[..8].copy_from_slice(MAGIC);
        for (i, w) in [u32::from(self.secret), self.rank as u32, self.world as u32].into_iter().enumerate() {
            b[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        b[20..].copy_from_slice(&self.challenge);
        b
    }

    /// `None` for anything that is not a hello of this protocol.
    pub(crate) fn decode(b: &[u8; HELLO]) -> Option<Hello> {
        let word = |i: usize| u32::from_le_bytes(b[8 + 4 * i..12 + 4 * i].try_into().expect("4 bytes"));
        let secret = match word(0) {
            0 => false,
            1 => true,
            _ => return None,
        };
        (&b[..8] == MAGIC).then(|| Hello {
            secret,
            rank: word(1) as usize,
            world: word(2) as usize,
            challenge: b[20..].try_into().expect("32 bytes"),
        })
    }
}

fn mac(secret: &JobSecret, label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&secret.0).expect("HMAC takes keys of any length");
    m.update(label);
    for p in parts {
        // Length-prefixed, so no two different sequences of parts hash alike.
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

/// The rank's proof: its hello and rank 0's challenge, under the secret.
fn client_mac(secret: &JobSecret, hello: &[u8], challenge: &[u8]) -> Hmac<Sha256> {
    mac(secret, b"axonml rendezvous client", &[hello, challenge])
}

/// The rank's proof, to send.
pub(crate) fn client_tag(secret: &JobSecret, hello: &[u8], challenge: &[u8]) -> [u8; NONCE] {
    client_mac(secret, hello, challenge).finalize().into_bytes().into()
}

/// Whether `tag` is the rank's proof (constant time).
pub(crate) fn client_ok(secret: &JobSecret, hello: &[u8], challenge: &[u8], tag: &[u8]) -> bool {
    client_mac(secret, hello, challenge).verify_slice(tag).is_ok()
}

/// What rank 0 answers (`status`, `body`) to the rank that sent `hello` and proved itself with
/// `their_tag`, after rank 0's `challenge`: everything rank 0's proof covers.
pub(crate) struct Answer<'a> {
    pub hello: &'a [u8],
    pub challenge: &'a [u8],
    pub their_tag: &'a [u8],
    pub status: u8,
    pub body: &'a [u8],
}

/// Rank 0's proof over its answer.
fn server_mac(secret: &JobSecret, a: &Answer<'_>) -> Hmac<Sha256> {
    mac(secret, b"axonml rendezvous server", &[a.hello, a.challenge, a.their_tag, &[a.status], a.body])
}

/// Rank 0's proof, to send.
pub(crate) fn server_tag(secret: &JobSecret, a: &Answer<'_>) -> [u8; NONCE] {
    server_mac(secret, a).finalize().into_bytes().into()
}

/// Whether `tag` is rank 0's proof over its answer (constant time).
pub(crate) fn server_ok(secret: &JobSecret, a: &Answer<'_>, tag: &[u8]) -> bool {
    server_mac(secret, a).verify_slice(tag).is_ok()
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
    use std::net::{TcpListener, TcpStream};

    use super::*;

    #[test]
    fn hellos_round_trip_and_anything_else_is_refused() {
        let h = Hello { secret: true, rank: 3, world: 8, challenge: [9; NONCE] };
        assert_eq!(Hello::decode(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert_eq!(Hello::decode(&bad), None);
        let mut bad = h.encode();
        bad[8] = 2;
        assert_eq!(Hello::decode(&bad), None);
    }

    #[test]
    fn tags_verify_only_with_the_same_secret_and_transcript() {
        let (k, other) = (JobSecret::new(vec![1; 32]).unwrap(), JobSecret::new(vec![2; 32]).unwrap());
        let t = client_tag(&k, b"hello", b"challenge");
        assert!(client_ok(&k, b"hello", b"challenge", &t));
        assert!(!client_ok(&other, b"hello", b"challenge", &t));
        assert!(!client_ok(&k, b"hello", b"challengf", &t));
        assert!(!client_ok(&k, b"hello", b"challenge", &t[..31]));
        let answer =
            |status, body| Answer { hello: b"hello", challenge: b"challenge", their_tag: &t, status, body };
        let s = server_tag(&k, &answer(1, b"/axonml-1-x"));
        assert!(server_ok(&k, &answer(1, b"/axonml-1-x"), &s));
        assert!(!server_ok(&k, &answer(2, b"/axonml-1-x"), &s));
        assert!(!server_ok(&k, &answer(1, b"/axonml-1-y"), &s));
        // The labels differ: a rank's tag never passes for rank 0's, nor the reverse.
        let empty = Answer { hello: b"hello", challenge: b"challenge", their_tag: b"", status: 1, body: b"" };
        assert_ne!(&t[..], &server_tag(&k, &empty)[..]);
        assert!(JobSecret::new(vec![0; 15]).is_err());
        assert_eq!(format!("{k:?}"), "JobSecret(..)");
    }

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
}
