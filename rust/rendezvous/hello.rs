//! What the ranks write into the store: hellos (rank 0's, and each rank's knock) and rank 0's
//! verdict. Each value is read from a store anyone with access may write, so it decodes only from
//! exactly what [`Hello::encode`] / [`Verdict::encode`] write, and every length is bounded.

use super::secret::TAG;

const HELLO_MAGIC: &[u8; 8] = b"AXONHI03";
const VERDICT_MAGIC: &[u8; 8] = b"AXONVD03";
/// Longest host identity a hello carries.
pub(crate) const MAX_HOST: usize = 255;

/// What a rank says of itself: rank 0's hello, or a rank's knock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub rank: u32,
    pub world: u32,
    /// This host (its name and boot id): the ranks of one world must share it.
    pub host: String,
    /// Fresh for every meeting: the proofs and the verdict's tags cover it.
    pub nonce: [u8; TAG],
    /// The proof that the writer knows the job secret; `None` for a job without one.
    pub proof: Option<[u8; TAG]>,
}

impl Hello {
    /// Everything but the proof: what the proof covers.
    pub(crate) fn unsigned(&self) -> Vec<u8> {
        let host = super::meet::clip(&self.host).as_bytes();
        let mut b = HELLO_MAGIC.to_vec();
        b.extend_from_slice(&self.rank.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.push(u8::from(self.proof.is_some()));
        b.push(host.len() as u8);
        b.extend_from_slice(host);
        b.extend_from_slice(&self.nonce);
        b
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = self.unsigned();
        if let Some(p) = &self.proof {
            b.extend_from_slice(p);
        }
        b
    }

    /// `None` for anything but an encoded hello.
    pub(crate) fn decode(b: &[u8]) -> Option<Hello> {
        let mut r = Reader(b);
        if r.take(8)? != HELLO_MAGIC {
            return None;
        }
        let rank = u32::from_le_bytes(r.array()?);
        let world = u32::from_le_bytes(r.array()?);
        let signed = match r.take(1)?[0] {
            0 => false,
            1 => true,
            _ => return None,
        };
        let len = usize::from(r.take(1)?[0]);
        let host = std::str::from_utf8(r.take(len)?).ok()?.to_string();
        let nonce = r.array()?;
        let proof = if signed { Some(r.array()?) } else { None };
        r.0.is_empty().then_some(Hello { rank, world, host, nonce, proof })
    }
}

/// Rank 0's answer to the ranks it admitted, or why the job cannot start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Rank 0's hello's nonce: a verdict of an earlier meeting in the same store is told apart.
    pub nonce: [u8; TAG],
    pub admitted: bool,
    /// What the caller hands out (the segment's token), or the refusal's text.
    pub body: Vec<u8>,
    /// With a job secret, one tag for each rank 1..world, over both hellos and the rest.
    pub tags: Vec<[u8; TAG]>,
}

impl Verdict {
    /// Everything but the tags: what each tag covers.
    pub(crate) fn unsigned(&self) -> Vec<u8> {
        let body = &self.body[..self.body.len().min(usize::from(u16::MAX))];
        let mut b = VERDICT_MAGIC.to_vec();
        b.extend_from_slice(&self.nonce);
        b.push(if self.admitted { 1 } else { 2 });
        b.extend_from_slice(&(body.len() as u16).to_le_bytes());
        b.extend_from_slice(body);
        b
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let tags = &self.tags[..self.tags.len().min(usize::from(u16::MAX))];
        let mut b = self.unsigned();
        b.extend_from_slice(&(tags.len() as u16).to_le_bytes());
        for t in tags {
            b.extend_from_slice(t);
        }
        b
    }

    /// `None` for anything but an encoded verdict.
    pub(crate) fn decode(b: &[u8]) -> Option<Verdict> {
        let mut r = Reader(b);
        if r.take(8)? != VERDICT_MAGIC {
            return None;
        }
        let nonce = r.array()?;
        let admitted = match r.take(1)?[0] {
            1 => true,
            2 => false,
            _ => return None,
        };
        let len = usize::from(u16::from_le_bytes(r.array()?));
        let body = r.take(len)?.to_vec();
        let count = usize::from(u16::from_le_bytes(r.array()?));
        // Bounded by the value's length before anything is allocated for it.
        if r.0.len() != count.checked_mul(TAG)? {
            return None;
        }
        let tags = r.0.chunks_exact(TAG).map(|c| c.try_into().expect("TAG bytes")).collect();
        Some(Verdict { nonce, admitted, body, tags })
    }
}

/// Reads fields off the front of a value; `None` once it runs out.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N).map(|b| b.try_into().expect("N bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hellos_and_verdicts_round_trip_and_anything_else_is_refused() {
        let h =
            Hello { rank: 3, world: 8, host: "h (boot x)".into(), nonce: [9; TAG], proof: Some([4; TAG]) };
        assert_eq!(Hello::decode(&h.encode()), Some(h.clone()));
        let unsigned = Hello { proof: None, ..h.clone() };
        assert_eq!(Hello::decode(&unsigned.encode()), Some(unsigned));
        let good = h.encode();
        for cut in 0..good.len() {
            assert_eq!(Hello::decode(&good[..cut]), None, "{cut}");
        }
        for (at, to) in [(0, b'X'), (16, 2)] {
            let mut bad = good.clone();
            bad[at] = to;
            assert_eq!(Hello::decode(&bad), None);
        }
        assert_eq!(Hello::decode(&[good.as_slice(), b"!"].concat()), None);
        let v = Verdict { nonce: [1; TAG], admitted: true, body: b"token".to_vec(), tags: vec![[2; TAG]; 3] };
        assert_eq!(Verdict::decode(&v.encode()), Some(v.clone()));
        let good = v.encode();
        for cut in 0..good.len() {
            assert_eq!(Verdict::decode(&good[..cut]), None, "{cut}");
        }
        let mut bad = good.clone();
        bad[8 + TAG] = 3;
        assert_eq!(Verdict::decode(&bad), None);
    }
}
