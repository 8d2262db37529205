//! The job secret (AXONML_JOB_SECRET) and the one way it is checked: HMAC-SHA256 tags over
//! length-prefixed parts under a label, compared in constant time (`Mac::verify_slice`). Every
//! rendezvous path proves membership through [`tag`] and [`verifies`], and the shortest secret is
//! refused here alone ([`JobSecret::new`]).

use std::io::Read;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// Bytes of a tag (and of the fresh nonces the tags cover).
pub(crate) const TAG: usize = 32;

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
                "AXONML_JOB_SECRET has {} bytes ({} hex digits); it must have at least {} ({} hex digits), \
                 e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`",
                bytes.len(),
                2 * bytes.len(),
                Self::MIN_BYTES,
                2 * Self::MIN_BYTES
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

/// The tag of `parts` under `label` (labels keep one role's tag from passing for another's).
pub(crate) fn tag(secret: &JobSecret, label: &[u8], parts: &[&[u8]]) -> [u8; TAG] {
    mac(secret, label, parts).finalize().into_bytes().into()
}

/// Whether `tag` is the tag of `parts` under `label` (constant time).
pub(crate) fn verifies(secret: &JobSecret, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    mac(secret, label, parts).verify_slice(tag).is_ok()
}

/// `N` bytes from the kernel's random source (nonces, segment names).
pub(crate) fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::os("reading /dev/urandom", e))?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_verify_only_with_the_same_secret_label_and_parts() {
        let (k, other) = (JobSecret::new(vec![1; 32]).unwrap(), JobSecret::new(vec![2; 32]).unwrap());
        let t = tag(&k, b"a", &[b"hello", b"challenge"]);
        assert!(verifies(&k, b"a", &[b"hello", b"challenge"], &t));
        assert!(!verifies(&other, b"a", &[b"hello", b"challenge"], &t));
        assert!(!verifies(&k, b"b", &[b"hello", b"challenge"], &t));
        assert!(!verifies(&k, b"a", &[b"hello", b"challengf"], &t));
        // Length prefixes: moving a byte between parts changes the tag.
        assert!(!verifies(&k, b"a", &[b"hell", b"ochallenge"], &t));
        assert!(!verifies(&k, b"a", &[b"hello", b"challenge"], &t[..31]));
        // An independent HMAC-SHA256 (RFC 4231 test case 2) pins the construction.
        let jefe = JobSecret(b"Jefe".to_vec());
        let want = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
        let got = mac(&jefe, b"what do ya want for nothing?", &[]).finalize().into_bytes();
        assert_eq!(got.iter().map(|b| format!("{b:02x}")).collect::<String>(), want);
    }

    #[test]
    fn short_secrets_are_refused_and_never_printed() {
        let e = JobSecret::new(vec![0; 15]).unwrap_err().to_string();
        assert!(
            e.contains("AXONML_JOB_SECRET has 15 bytes (30 hex digits); it must have at least 16"),
            "{e}"
        );
        assert_eq!(format!("{:?}", JobSecret::new(vec![7; 16]).unwrap()), "JobSecret(..)");
    }
}
