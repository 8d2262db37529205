//! The meeting itself (see the module docs of `rendezvous`): rank 0 publishes its hello, admits the
//! ranks whose knocks prove themselves, and publishes its verdict; every other rank checks rank 0's
//! hello, knocks, and believes only a verdict that proves itself.
//!
//! Keys, under the meeting's prefix: `rank0` (rank 0's hello), `knocks` (a counter: each rank takes a
//! slot with `add`, so no one can overwrite another's knock), `knock/<slot>`, `verdict`, and `failed`
//! (why a rank could not use the verdict's body).

use std::time::{Duration, Instant};

use super::hello::{Hello, Verdict, MAX_HOST};
use super::secret::{self, JobSecret, TAG};
use super::KeyValueStore;
use crate::config::RENDEZVOUS_SLICE;
use crate::error::{Error, Result};

/// Knock slots rank 0 reads at most: far more than ranks, so strangers' knocks cannot crowd a rank out
/// unnoticed (past it, rank 0 times out saying so).
const MAX_KNOCKS: usize = 4096;

const RANK0: &[u8] = b"axonml rendezvous rank 0";
const KNOCK: &[u8] = b"axonml rendezvous knock";
const VERDICT: &[u8] = b"axonml rendezvous verdict";

/// One rank's part in a meeting.
pub struct Meeting<'a> {
    /// Where the ranks meet.
    pub store: &'a dyn KeyValueStore,
    /// Key prefix: meetings under different prefixes share a store without meeting.
    pub prefix: String,
    /// This rank.
    pub rank: usize,
    /// Ranks in the meeting.
    pub world: usize,
    /// The job secret every rank must prove it knows; `None` for a job without one.
    pub secret: Option<&'a JobSecret>,
    /// How long the meeting may last.
    pub timeout: Duration,
    /// What the ranks of one world share: this host's name and boot id (`this_host`).
    pub host: String,
}

/// Why a rank was not admitted, or what a rank found wrong: said once, the same on every store.
fn secret_mismatch(rank: usize) -> Error {
    Error::Usage(format!(
        "rank {rank}: rank 0 does not prove that it knows this rank's AXONML_JOB_SECRET: the ranks were \
         started with different job secrets (or with and without one), or the store is shared with \
         another job"
    ))
}

impl<'a> Meeting<'a> {
    /// A meeting of `world` ranks in `store` under the prefix `axonml/`, on this host.
    pub fn new(
        store: &'a dyn KeyValueStore,
        rank: usize,
        world: usize,
        secret: Option<&'a JobSecret>,
        timeout: Duration,
    ) -> Meeting<'a> {
        Meeting { store, prefix: "axonml/".into(), rank, world, secret, timeout, host: this_host() }
    }

    /// Meet: rank 0 admits every rank, then publishes what `made` returns (called once all are admitted)
    /// and returns it; every other rank returns what rank 0 published. Blocks until then, the timeout,
    /// or Ctrl-C.
    pub fn run(&self, made: impl FnOnce() -> Result<Vec<u8>>) -> Result<Vec<u8>> {
        if self.rank >= self.world || u32::try_from(self.world).is_err() {
            return Err(Error::invalid(format!("rank {} is not in a world of {}", self.rank, self.world)));
        }
        let deadline = Instant::now() + self.timeout;
        if self.rank == 0 {
            self.admit(deadline, made)
        } else {
            self.knock(deadline)
        }
    }

    /// Rank 0, once every rank has what it published: remove the meeting's keys, so a later meeting
    /// in the same store (torchrun keeps one per agent) starts clean.
    pub fn clear(&self) -> Result<()> {
        let knocks = self.store.add(&self.key("knocks"), 0)?;
        for slot in 1..=usize::try_from(knocks).unwrap_or(0).min(MAX_KNOCKS) {
            self.store.delete(&self.key(&format!("knock/{slot}")))?;
        }
        for key in ["knocks", "rank0", "verdict", "failed"] {
            self.store.delete(&self.key(key))?;
        }
        Ok(())
    }

    /// A rank that cannot use what rank 0 handed out tells rank 0 why (best effort: it fails anyway).
    pub fn report(&self, problem: &Error) {
        let why = format!("rank {} could not use what rank 0 handed out: {problem}", self.rank);
        let _ = self.store.set(&self.key("failed"), why.as_bytes());
    }

    /// After the meeting: fails with what a rank [`report`](Meeting::report)ed, if one did. A store
    /// that cannot be asked reports nothing (rank 0 closes its own once every rank is in).
    pub fn reported(&self) -> Result<()> {
        match self.store.get(&self.key("failed")).ok().flatten() {
            None => Ok(()),
            Some(why) => {
                Err(Error::invalid(String::from_utf8_lossy(&why[..why.len().min(1024)]).into_owned()))
            }
        }
    }

    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn hello(&self, proof_over: Option<&[u8]>) -> Result<Hello> {
        let mut h = Hello {
            rank: self.rank as u32,
            world: self.world as u32,
            host: self.host.clone(),
            nonce: secret::random::<TAG>()?,
            proof: None,
        };
        if let Some(key) = self.secret {
            // The flag that a proof follows is part of what the proof covers.
            h.proof = Some([0; TAG]);
            let unsigned = h.unsigned();
            h.proof = Some(match proof_over {
                None => secret::tag(key, RANK0, &[&unsigned]),
                Some(rank0) => secret::tag(key, KNOCK, &[&unsigned, rank0]),
            });
        }
        Ok(h)
    }

    fn timeout_error(&self, missing: Vec<usize>, waited_for: &str, note: &str) -> Error {
        Error::Timeout {
            rank: self.rank,
            op: format!("rendezvous through {} (waiting for {waited_for}){note}", self.store.name()),
            waited: self.timeout,
            missing,
            group: (0..self.world).collect(),
            progress: String::new(),
        }
    }

    /// Rank 0: publish the hello, admit a proven knock for every rank, publish the verdict.
    fn admit(&self, deadline: Instant, made: impl FnOnce() -> Result<Vec<u8>>) -> Result<Vec<u8>> {
        // An earlier meeting's verdict or report must not greet this one's ranks (they also check the
        // verdict's nonce).
        self.store.delete(&self.key("verdict"))?;
        self.store.delete(&self.key("failed"))?;
        let hello = self.hello(None)?.encode();
        let mine = Hello::decode(&hello).expect("our own hello");
        self.store.set(&self.key("rank0"), &hello)?;
        let mut knocks: Vec<Option<Vec<u8>>> = vec![None; self.world];
        knocks[0] = Some(hello.clone());
        let (mut seen, mut pending, mut notes) = (0usize, Vec::new(), Vec::<String>::new());
        let mut note = |n: String| {
            if !notes.contains(&n) {
                notes.push(n);
            }
        };
        while knocks.iter().any(Option::is_none) {
            interrupted()?;
            let claimed = usize::try_from(self.store.add(&self.key("knocks"), 0)?).unwrap_or(0);
            if claimed > MAX_KNOCKS {
                note(format!("more than {MAX_KNOCKS} knocks: the rest were not read"));
            }
            pending.extend(seen + 1..=claimed.min(MAX_KNOCKS));
            seen = seen.max(claimed.min(MAX_KNOCKS));
            let mut unread = Vec::new();
            for slot in pending.drain(..) {
                match self.store.get(&self.key(&format!("knock/{slot}")))? {
                    None => unread.push(slot),
                    Some(v) => match self.judge(&mine, &hello, &v, &knocks) {
                        Ok(r) => knocks[r] = Some(v),
                        Err(Judged::Note(n)) => note(n),
                        Err(Judged::Fatal(problem)) => {
                            // Every rank hears it (unproven: it can only stop a rank, never admit one).
                            let verdict = Verdict {
                                nonce: mine.nonce,
                                admitted: false,
                                body: problem.clone().into(),
                                tags: vec![],
                            };
                            self.store.set(&self.key("verdict"), &verdict.encode())?;
                            return Err(Error::Usage(problem));
                        }
                    },
                }
            }
            pending = unread;
            if knocks.iter().all(Option::is_some) {
                break;
            }
            if Instant::now() >= deadline {
                let missing = (1..self.world).filter(|&r| knocks[r].is_none()).collect();
                let note = if notes.is_empty() {
                    String::new()
                } else {
                    format!(" (refused: {})", notes.join("; "))
                };
                return Err(self.timeout_error(missing, "the other ranks' knocks", &note));
            }
            let next = self.key(&format!("knock/{}", seen + 1));
            self.store.wait(&[&next], remaining(deadline))?;
        }
        let made = made();
        let mut verdict = Verdict {
            nonce: mine.nonce,
            admitted: made.is_ok(),
            body: match &made {
                Ok(body) => body.clone(),
                Err(e) => format!("rank 0 could not start the world: {e}").into_bytes(),
            },
            tags: vec![],
        };
        if let Some(key) = self.secret {
            let unsigned = verdict.unsigned();
            verdict.tags = knocks[1..]
                .iter()
                .map(|k| secret::tag(key, VERDICT, &[&hello, k.as_deref().expect("admitted"), &unsigned]))
                .collect();
        }
        self.store.set(&self.key("verdict"), &verdict.encode())?;
        made
    }

    /// Whether the knock `value` admits a rank (which), or what it says.
    fn judge(
        &self,
        mine: &Hello,
        hello: &[u8],
        value: &[u8],
        knocks: &[Option<Vec<u8>>],
    ) -> std::result::Result<usize, Judged> {
        let Some(k) = Hello::decode(value) else {
            return Err(Judged::Note("a knock that is not a rank's hello".into()));
        };
        let r = k.rank as usize;
        let proven = match (self.secret, &k.proof) {
            (Some(key), Some(proof)) => {
                let unsigned = k.unsigned();
                secret::verifies(key, KNOCK, &[&unsigned, hello], proof)
            }
            (None, None) => true,
            _ => false,
        };
        if !proven {
            return Err(Judged::Note(format!(
                "a process claiming rank {r} does not prove that it knows rank 0's AXONML_JOB_SECRET"
            )));
        }
        let n = self.world;
        if k.world as usize != n {
            return Err(Judged::Note(format!(
                "rank {r} was started with world_size {}, but rank 0 has {n}",
                k.world
            )));
        }
        if r == 0 || r >= n {
            return Err(Judged::Note(format!("a process claims rank {r}, outside 1..{n}")));
        }
        if knocks[r].is_some() {
            return Err(Judged::Note(format!("two processes claim rank {r}")));
        }
        if k.host != mine.host {
            return Err(Judged::Fatal(one_host_only(&mine.host, r, &k.host)));
        }
        Ok(r)
    }

    /// Ranks 1..world: check rank 0's hello, knock, and wait for a verdict that proves itself.
    fn knock(&self, deadline: Instant) -> Result<Vec<u8>> {
        let rank0 = self.read(&self.key("rank0"), "rank 0's hello", deadline, "", |_| true)?;
        let zero = Hello::decode(&rank0)
            .ok_or_else(|| Error::invalid("rendezvous: the store holds a malformed hello of rank 0"))?;
        let proven = match (self.secret, &zero.proof) {
            (Some(key), Some(proof)) => secret::verifies(key, RANK0, &[&zero.unsigned()], proof),
            (None, None) => true,
            _ => false,
        };
        // A rank with a problem knocks all the same: rank 0 then names it in its own error.
        let mine = self.hello(Some(&rank0))?.encode();
        let slot = self.store.add(&self.key("knocks"), 1)?;
        self.store.set(&self.key(&format!("knock/{slot}")), &mine)?;
        if !proven {
            return Err(secret_mismatch(self.rank));
        }
        if zero.world as usize != self.world {
            return Err(Error::invalid(format!(
                "rank {} was started with world_size {}, but rank 0 has {}",
                self.rank, self.world, zero.world
            )));
        }
        if zero.host != clip(&self.host) {
            return Err(Error::Usage(one_host_only(&zero.host, self.rank, &self.host)));
        }
        let note = " (rank 0 has not admitted this rank: do all ranks run as one user, with the same \
                    AXONML_JOB_SECRET and world size?)";
        let fresh = |v: &[u8]| Verdict::decode(v).is_none_or(|d| d.nonce == zero.nonce);
        let value = self.read(&self.key("verdict"), "rank 0's verdict", deadline, note, fresh)?;
        let verdict = Verdict::decode(&value)
            .ok_or_else(|| Error::invalid("rendezvous: the store holds a malformed verdict of rank 0"))?;
        let proven = |key: &JobSecret| {
            let tag = verdict.tags.get(self.rank - 1);
            tag.is_some_and(|t| secret::verifies(key, VERDICT, &[&rank0, &mine, &verdict.unsigned()], t))
        };
        // An unproven refusal is still reported: it can only stop this rank, never admit it.
        if verdict.admitted && self.secret.is_some_and(|key| !proven(key)) {
            return Err(secret_mismatch(self.rank));
        }
        if !verdict.admitted {
            return Err(Error::Usage(String::from_utf8_lossy(&verdict.body).into_owned()));
        }
        Ok(verdict.body)
    }

    /// The value of `key` once it is set and `current` takes it (a stale one is waited past), in slices
    /// that see Ctrl-C, until `deadline`.
    fn read(
        &self,
        key: &str,
        what: &str,
        deadline: Instant,
        note: &str,
        current: impl Fn(&[u8]) -> bool,
    ) -> Result<Vec<u8>> {
        loop {
            interrupted()?;
            if let Some(v) = self.store.get(key)? {
                if v.len() > super::MAX_VALUE {
                    return Err(Error::invalid(format!(
                        "rendezvous: {what} in the store is {} bytes long",
                        v.len()
                    )));
                }
                if current(&v) {
                    return Ok(v);
                }
                // A stale value: `wait` would return at once.
                std::thread::sleep(remaining(deadline).min(Duration::from_millis(10)));
            } else {
                self.store.wait(&[key], remaining(deadline))?;
            }
            if Instant::now() >= deadline {
                return Err(self.timeout_error(vec![0], &format!("{what}, key {key:?}"), note));
            }
        }
    }
}

enum Judged {
    /// Not a member of this job (or not one rank 0 can take): noted, and the meeting goes on.
    Note(String),
    /// A proven member that cannot join: the meeting fails.
    Fatal(String),
}

fn one_host_only(rank0_host: &str, r: usize, host: &str) -> String {
    format!(
        "the shared-memory world runs the ranks of one host only (rank 0 on {rank0_host}, rank {r} on \
         {host}); jobs over several hosts come with the hierarchical (multi-host) issue: use gloo or MPI \
         for them until then"
    )
}

/// Ctrl-C while waiting for the other ranks ends the rendezvous.
fn interrupted() -> Result<()> {
    if crate::sync::wait::interrupted() {
        return Err(Error::Interrupted { op: "rendezvous".into() });
    }
    Ok(())
}

/// One slice of waiting, never past `deadline` (and never zero: a store may take 0 as "forever").
fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(1), RENDEZVOUS_SLICE)
}

/// `host` cut to what a hello carries (at a character boundary).
pub(crate) fn clip(host: &str) -> &str {
    let mut end = host.len().min(MAX_HOST);
    while !host.is_char_boundary(end) {
        end -= 1;
    }
    &host[..end]
}

/// This host, as the ranks of one world must share it: its name and its boot id (containers share
/// the kernel's boot id, not the name).
pub(crate) fn this_host() -> String {
    let read =
        |path| std::fs::read_to_string(path).map_or_else(|_| "?".to_string(), |s| s.trim().to_string());
    let (name, boot) = (read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"));
    clip(&format!("{name} (boot {boot})")).to_string()
}

#[cfg(test)]
mod tests;
