//! Signatures as plain numbers for the pages, and back. Decoding never trusts the bytes: an
//! unknown code is `None`, which the caller reports as a corrupt page.

use crate::dtype::DType;
use crate::reduce::{ReduceOp, Scale};
use crate::signature::{CollKind, Signature};

const NONE: u64 = u64::MAX;

/// Words of an encoded signature.
pub(crate) const WORDS: usize = 6;

pub(crate) fn encode(s: &Signature) -> [u64; WORDS] {
    let codes = s.kind as u64 | (s.dtype.map_or(0, |d| d as u64) << 8) | (s.op.map_or(0, |o| o as u64) << 16);
    let (pre, post) = (s.scale.pre.to_bits(), s.scale.post.to_bits());
    [s.seq, s.count, s.root.map_or(NONE, u64::from), codes, pre, post]
}

/// The signature `w` encodes, if it is one: exactly the words [`encode`] writes, so two pages that
/// decode alike hold the same words (a corrupted bit never passes for the call it was).
pub(crate) fn decode(w: [u64; WORDS]) -> Option<Signature> {
    let [seq, count, root, codes, pre, post] = w;
    if codes >> 24 != 0 {
        return None;
    }
    let byte = |shift: u32| (codes >> shift) as u8;
    let opt = |code: u8| (code != 0).then_some(code);
    let root = match root {
        NONE => None,
        r => Some(u32::try_from(r).ok()?),
    };
    Some(Signature {
        seq,
        count,
        root,
        kind: CollKind::from_code(byte(0))?,
        dtype: match opt(byte(8)) {
            None => None,
            Some(c) => Some(DType::from_code(c)?),
        },
        op: match opt(byte(16)) {
            None => None,
            Some(c) => Some(ReduceOp::from_code(c)?),
        },
        scale: Scale { pre: f64::from_bits(pre), post: f64::from_bits(post) },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_round_trip_and_garbage_is_refused() {
        let sigs = [
            Signature::new(CollKind::Barrier, 1, 0),
            Signature::new(CollKind::AllReduce, 7, 1023).dtype(DType::F16).op(ReduceOp::Average),
            Signature::new(CollKind::Scatter, u64::MAX - 1, 5).dtype(DType::I64).root(63),
            Signature::new(CollKind::AllReduce, 2, 9)
                .dtype(DType::C128)
                .op(ReduceOp::BXor)
                .scale(Scale { pre: 0.5, post: -3.0 }),
        ];
        for s in sigs {
            assert_eq!(decode(encode(&s)), Some(s));
        }
        let one = 1f64.to_bits();
        assert_eq!(decode([1, 1, NONE, 99, one, one]), None);
        assert_eq!(decode([1, 1, NONE, 1 | 99 << 8, one, one]), None);
        assert_eq!(decode([1, 1, 1 << 40, 1, one, one]), None);
    }

    /// Found by `fuzzing::signature`: bits above the three codes were ignored, so a page whose code word
    /// was corrupted there decoded as the very call it had been (and compared equal to it).
    #[test]
    fn codes_with_stray_high_bits_are_refused() {
        let s = Signature::new(CollKind::AllReduce, 3, 8).dtype(DType::F32).op(ReduceOp::Sum);
        let mut w = encode(&s);
        w[3] |= 1 << 24;
        assert_eq!(decode(w), None);
        w[3] = encode(&s)[3] | 1 << 63;
        assert_eq!(decode(w), None);
        // libFuzzer's input: all_to_all_single, dtype 13, op 1, and 0x24 above them.
        assert_eq!(decode([u64::MAX, u64::MAX, NONE, 0x2401_0d0a, 0, 0]), None);
        assert!(decode([u64::MAX, u64::MAX, NONE, 0x01_0d0a, 0, 0]).is_some());
    }
}
