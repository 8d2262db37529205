//! Every kernel set this CPU has against the baseline (the scalar reference, which `tests` checks against
//! hand-computed results), bit for bit, NaN payloads included: edge values, every 16-bit pattern,
//! random data, lengths that end in the vector body and in every tail.

use half::{bf16, f16};
use proptest::prelude::*;

use super::convert;
use super::kernels::{reduce_raw_on, TILE};
use super::*;

/// The sets to check: every one above the baseline that this CPU has (on others, none: the tests pass
/// without checking, and say so).
fn vector_sets() -> Vec<Kernels> {
    let sets: Vec<Kernels> =
        Kernels::ALL.into_iter().filter(|k| *k != Kernels::Baseline && k.available()).collect();
    if sets.is_empty() {
        eprintln!("no vector kernel set on this CPU: only the baseline runs");
    }
    sets
}

/// Lengths ending in the 8- and 16-wide bodies, every kind of tail, 64-element blocks and the tile.
const LENGTHS: [usize; 14] = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, TILE - 1, TILE + 1, 3 * TILE + 37];

/// Scalings: none, a prescale with a postscale, a postscale alone.
const SCALES: [Scale; 3] = [Scale::NONE, Scale { pre: 0.5, post: 3.0 }, Scale { pre: 1.0, post: 1e-3 }];

/// `op` over `inputs` (raw bytes of `dtype`) on `kernels`: the output's bytes.
fn run(kernels: Kernels, dtype: DType, op: ReduceOp, scale: Scale, inputs: &[Vec<u8>]) -> Vec<u8> {
    let count = inputs[0].len() / dtype.size();
    // u64 storage, so every dtype's alignment holds.
    let mut out = vec![0u64; (count * dtype.size()).div_ceil(8)];
    let staged: Vec<Vec<u64>> = inputs
        .iter()
        .map(|b| {
            let mut v = vec![0u64; b.len().div_ceil(8)];
            bytemuck_copy(b, &mut v);
            v
        })
        .collect();
    let ptrs: Vec<*const u8> = staged.iter().map(|v| v.as_ptr().cast()).collect();
    // SAFETY: every buffer holds `count` elements of `dtype`, aligned to 8; `out` is disjoint.
    unsafe { reduce_raw_on(kernels, dtype, op, scale, &ptrs, &[out.as_mut_ptr().cast()], count) };
    let mut bytes = vec![0u8; count * dtype.size()];
    bytes.iter_mut().zip(out.iter().flat_map(|w| w.to_ne_bytes())).for_each(|(d, s)| *d = s);
    bytes
}

fn bytemuck_copy(src: &[u8], dst: &mut [u64]) {
    for (w, chunk) in dst.iter_mut().zip(src.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_ne_bytes(b);
    }
}

/// Every set gives the baseline's bytes for `op`, every scaling (floating types) and 1 to 4 of `inputs`.
fn assert_sets_agree(dtype: DType, inputs: &[Vec<u8>]) {
    for kernels in vector_sets() {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.check(dtype).is_ok()) {
            for scale in SCALES.into_iter().filter(|s| s.check(dtype).is_ok()) {
                for n in 1..=inputs.len() {
                    let want = run(Kernels::Baseline, dtype, op, scale, &inputs[..n]);
                    let got = run(kernels, dtype, op, scale, &inputs[..n]);
                    if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) {
                        let e = i / dtype.size() * dtype.size();
                        let ins: Vec<&[u8]> = inputs[..n].iter().map(|b| &b[e..e + dtype.size()]).collect();
                        panic!(
                            "{kernels} {dtype} {op} {scale:?} {n} inputs, element {}: inputs {ins:02x?} \
                             baseline {:02x?} got {:02x?}",
                            i / dtype.size(),
                            &want[e..e + dtype.size()],
                            &got[e..e + dtype.size()]
                        );
                    }
                }
            }
        }
    }
}

fn bytes_of<T: Copy, const N: usize>(xs: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    xs.iter().flat_map(|x| to(*x)).collect()
}

/// f32 values at the edges: NaNs of both signs, quiet and signalling, with payloads; infinities; both
/// zeros; subnormals; the extremes; values whose sums round on a tie in f32, float16 and bfloat16.
fn f32_edges() -> Vec<f32> {
    let bits = [
        0x7fc0_0000u32,
        0xffc0_0000,
        0x7f80_0001,
        0xff80_0001,
        0x7fa5_a5a5,
        0xffd2_3456,
        0x7fff_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x0000_0000,
        0x8000_0000,
        0x0000_0001,
        0x8000_0001,
        0x007f_ffff,
        0x807f_ffff,
        0x0040_0000,
        0x0000_c000,
        0x0000_8000,
        0x0001_8000,
        0x0080_0000,
        0x7f7f_ffff,
        0xff7f_ffff,
        0x3f80_0000,
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_1000,
        0x3f80_3000,
        0x3380_0000,
        0x3b80_0000,
        0x4b00_0000,
        0x477f_f000,
        0x477f_e000,
        0x3880_0000,
        0x3380_0001,
        0x3300_0000,
    ];
    bits.into_iter().map(f32::from_bits).collect()
}

/// Every pair of `edges` as two inputs (and a third, the first reversed), long enough for the
/// vector bodies.
fn pairs<T: Copy>(edges: &[T]) -> Vec<Vec<T>> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for x in edges {
        for y in edges {
            a.push(*x);
            b.push(*y);
        }
    }
    let c = a.iter().rev().copied().collect();
    vec![a, b, c]
}

#[test]
fn float_edges_agree_on_every_set() {
    let f = f32_edges();
    let p = pairs(&f);
    assert_sets_agree(DType::F32, &p.iter().map(|v| bytes_of(v, f32::to_ne_bytes)).collect::<Vec<_>>());
    let d: Vec<f64> = f
        .iter()
        .map(|x| *x as f64)
        .chain([f64::from_bits(1), f64::from_bits(0x7ff4_0000_0000_0001)])
        .collect();
    let p = pairs(&d);
    assert_sets_agree(DType::F64, &p.iter().map(|v| bytes_of(v, f64::to_ne_bytes)).collect::<Vec<_>>());
    let h: Vec<f16> =
        f.iter().map(|x| f16::from_f32(*x)).chain([f16::from_bits(0x7d01), f16::from_bits(1)]).collect();
    let p = pairs(&h);
    assert_sets_agree(DType::F16, &p.iter().map(|v| bytes_of(v, f16::to_ne_bytes)).collect::<Vec<_>>());
    let b: Vec<bf16> =
        f.iter().map(|x| bf16::from_f32(*x)).chain([bf16::from_bits(0x7f81), bf16::from_bits(1)]).collect();
    let p = pairs(&b);
    assert_sets_agree(DType::BF16, &p.iter().map(|v| bytes_of(v, bf16::to_ne_bytes)).collect::<Vec<_>>());
}

#[test]
fn every_16_bit_pattern_agrees_on_every_set() {
    // Each pattern against a scrambled other, and itself: every NaN payload, subnormal and tie input.
    let a: Vec<u16> = (0..=u16::MAX).collect();
    let b: Vec<u16> = a.iter().map(|x| x.wrapping_mul(40_503).wrapping_add(12_345)).collect();
    let inputs: Vec<Vec<u8>> =
        [&a, &b, &a].iter().map(|v| v.iter().flat_map(|x| x.to_ne_bytes()).collect()).collect();
    for dtype in [DType::F16, DType::BF16, DType::I16, DType::U16] {
        assert_sets_agree(dtype, &inputs);
    }
}

#[test]
fn every_bfloat16_pair_sums_as_half_converts_on_every_set() {
    // Every set, the baseline too, converts bfloat16 with `convert`'s bit arithmetic: checked here
    // against the `half` crate's own conversions around the f32 sum (the first NaN wins, quieted).
    let a: Vec<u16> = (0..=u16::MAX).collect();
    let b: Vec<u16> = a.iter().map(|x| x.wrapping_mul(40_503).wrapping_add(12_345)).collect();
    let want: Vec<u16> = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| {
            let (x, y) = (bf16::from_bits(x).to_f32(), bf16::from_bits(y).to_f32());
            let sum = if x.is_nan() { f32::from_bits(x.to_bits() | 0x0040_0000) } else { x + y };
            bf16::from_f32(sum).to_bits()
        })
        .collect();
    let inputs: Vec<Vec<u8>> =
        [&a, &b].iter().map(|v| v.iter().flat_map(|x| x.to_ne_bytes()).collect()).collect();
    for kernels in Kernels::ALL.into_iter().filter(|k| k.available()) {
        let got = run(kernels, DType::BF16, ReduceOp::Sum, Scale::NONE, &inputs);
        let got: Vec<u16> = got.chunks(2).map(|c| u16::from_ne_bytes([c[0], c[1]])).collect();
        if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) {
            panic!("{kernels}: {:04x} + {:04x} gave {:04x}, half {:04x}", a[i], b[i], got[i], want[i]);
        }
    }
}

#[test]
fn sixteen_bit_conversions_match_half() {
    // Widening, every pattern.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let b: Vec<bf16> = all.iter().map(|x| bf16::from_bits(*x)).collect();
    let mut wide = vec![0f32; all.len()];
    convert::bf16_widen(&b, &mut wide);
    for (x, w) in b.iter().zip(&wide) {
        assert_eq!(w.to_bits(), x.to_f32().to_bits(), "bf16 {:04x}", x.to_bits());
    }
    // Narrowing: every high half with the low halves that decide rounding (below, at and above a tie,
    // the extremes), and a stride through all other f32 bits.
    let lows = [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff];
    let xs: Vec<f32> = (0..=0xffffu32)
        .flat_map(|hi| lows.iter().map(move |lo| hi << 16 | lo))
        .chain((0..u32::MAX / 4093).map(|i| i * 4093))
        .map(f32::from_bits)
        .collect();
    let mut narrow = vec![bf16::ZERO; xs.len()];
    convert::bf16_narrow(&xs, &mut narrow);
    for (x, n) in xs.iter().zip(&narrow) {
        assert_eq!(n.to_bits(), bf16::from_f32(*x).to_bits(), "f32 {:08x}", x.to_bits());
    }
    #[cfg(target_arch = "x86_64")]
    for kernels in vector_sets() {
        let h: Vec<f16> = all.iter().map(|x| f16::from_bits(*x)).collect();
        let mut narrow = vec![f16::ZERO; xs.len()];
        // SAFETY: `vector_sets` holds only sets this CPU has.
        unsafe {
            match kernels {
                Kernels::Avx2 => {
                    convert::f16_widen_avx2(&h, &mut wide);
                    convert::f16_narrow_avx2(&xs, &mut narrow);
                }
                _ => {
                    convert::f16_widen_avx512(&h, &mut wide);
                    convert::f16_narrow_avx512(&xs, &mut narrow);
                }
            }
        }
        for (x, w) in h.iter().zip(&wide) {
            assert_eq!(w.to_bits(), x.to_f32_const().to_bits(), "{kernels} f16 {:04x}", x.to_bits());
        }
        for (x, n) in xs.iter().zip(&narrow) {
            let want = f16::from_f32_const(*x);
            assert_eq!(n.to_bits(), want.to_bits(), "{kernels} f32 {:08x}", x.to_bits());
        }
    }
}

#[test]
#[ignore = "every f32: about 35 s in release; run with --ignored"]
fn every_f32_narrows_like_half() {
    let mut xs = vec![0f32; 1 << 20];
    let mut b = vec![bf16::ZERO; 1 << 20];
    let mut h = vec![f16::ZERO; 1 << 20];
    for block in 0..(1u64 << 12) {
        let base = (block << 20) as u32;
        xs.iter_mut().enumerate().for_each(|(i, x)| *x = f32::from_bits(base | i as u32));
        convert::bf16_narrow(&xs, &mut b);
        assert!(xs.iter().zip(&b).all(|(x, n)| n.to_bits() == bf16::from_f32(*x).to_bits()), "block {block}");
        #[cfg(target_arch = "x86_64")]
        for kernels in vector_sets() {
            // SAFETY: `vector_sets` holds only sets this CPU has.
            unsafe {
                match kernels {
                    Kernels::Avx2 => convert::f16_narrow_avx2(&xs, &mut h),
                    _ => convert::f16_narrow_avx512(&xs, &mut h),
                }
            }
            let ok = xs.iter().zip(&h).all(|(x, n)| n.to_bits() == f16::from_f32_const(*x).to_bits());
            assert!(ok, "{kernels} block {block}");
        }
    }
}

#[test]
fn every_length_and_dtype_agrees_on_every_set() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed as u8
    };
    for len in LENGTHS {
        for dtype in DType::ALL {
            let inputs: Vec<Vec<u8>> =
                (0..3).map(|_| (0..len * dtype.size()).map(|_| next()).collect()).collect();
            assert_sets_agree(dtype, &inputs);
        }
    }
}

#[test]
fn division_agrees_on_every_set() {
    let f = f32_edges();
    for kernels in vector_sets() {
        for n in [2usize, 3, 7] {
            for len in LENGTHS {
                let xs: Vec<f32> = (0..len).map(|i| f[i % f.len()] * (1.0 + i as f32)).collect();
                let (mut want, mut got) = (xs.clone(), xs.clone());
                scale_on(Kernels::Baseline, &mut want, n).unwrap();
                scale_on(kernels, &mut got, n).unwrap();
                assert!(
                    want.iter().zip(&got).all(|(w, g)| w.to_bits() == g.to_bits()),
                    "{kernels} f32 / {n}"
                );
                let hs: Vec<f16> =
                    (0..len).map(|i| f16::from_bits((i as u16).wrapping_mul(40_503))).collect();
                let (mut want, mut got) = (hs.clone(), hs.clone());
                scale_on(Kernels::Baseline, &mut want, n).unwrap();
                scale_on(kernels, &mut got, n).unwrap();
                assert!(
                    want.iter().zip(&got).all(|(w, g)| w.to_bits() == g.to_bits()),
                    "{kernels} f16 / {n}"
                );
                let bs: Vec<bf16> = hs.iter().map(|h| bf16::from_bits(h.to_bits())).collect();
                let (mut want, mut got) = (bs.clone(), bs.clone());
                scale_on(Kernels::Baseline, &mut want, n).unwrap();
                scale_on(kernels, &mut got, n).unwrap();
                assert!(
                    want.iter().zip(&got).all(|(w, g)| w.to_bits() == g.to_bits()),
                    "{kernels} bf16 / {n}"
                );
            }
        }
    }
}

#[test]
fn the_choice_is_clamped_to_the_cpu() {
    assert_eq!(Kernels::Baseline.clamped(), Kernels::Baseline);
    for k in Kernels::ALL {
        assert!(k.clamped() <= k && k.clamped().available());
    }
    assert!(Kernels::active().available());
    assert_eq!(Kernels::active(), Kernels::active());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_data_agrees_on_every_set(
        dtype in proptest::sample::select(DType::ALL.to_vec()),
        len in 0usize..2 * TILE + 100,
        n in 1usize..5,
        seed in any::<u64>(),
    ) {
        let mut s = seed | 1;
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|_| {
                (0..len * dtype.size())
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        s as u8
                    })
                    .collect()
            })
            .collect();
        assert_sets_agree(dtype, &inputs);
    }
}

#[test]
fn the_first_nan_wins_quieted_on_every_set() {
    // Two NaNs with different signs and payloads (the second signalling): the first input's, quieted,
    // whichever input order and set; one NaN: that one, quieted.
    let (a, b) = (f32::from_bits(0xffc0_1234), f32::from_bits(0x7f80_0042));
    let len = 37;
    for kernels in Kernels::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Average] {
            let mut out = vec![0f32; len];
            reduce_slices_on(kernels, op, Scale::NONE, &[&vec![a; len], &vec![b; len]], &mut out).unwrap();
            assert!(
                out.iter().all(|x| x.to_bits() == 0xffc0_1234),
                "{kernels} {op}: {:08x}",
                out[0].to_bits()
            );
            reduce_slices_on(kernels, op, Scale::NONE, &[&vec![b; len], &vec![a; len]], &mut out).unwrap();
            assert!(
                out.iter().all(|x| x.to_bits() == 0x7fc0_0042),
                "{kernels} {op}: {:08x}",
                out[0].to_bits()
            );
            reduce_slices_on(kernels, op, Scale::NONE, &[&vec![1.0; len], &vec![b; len]], &mut out).unwrap();
            assert!(
                out.iter().all(|x| x.to_bits() == 0x7fc0_0042),
                "{kernels} {op}: {:08x}",
                out[0].to_bits()
            );
        }
        // bfloat16 and float16 keep the payload's top bits through f32.
        let (a, b) = (bf16::from_bits(0xffc5), bf16::from_bits(0x7f81));
        let mut out = vec![bf16::ZERO; len];
        reduce_slices_on(kernels, ReduceOp::Sum, Scale::NONE, &[&vec![a; len], &vec![b; len]], &mut out)
            .unwrap();
        assert!(out.iter().all(|x| x.to_bits() == 0xffc5), "{kernels} bf16: {:04x}", out[0].to_bits());
        let (a, b) = (f16::from_bits(0x7c01), f16::from_bits(0xfe07));
        let mut out = vec![f16::ZERO; len];
        reduce_slices_on(kernels, ReduceOp::Sum, Scale::NONE, &[&vec![a; len], &vec![b; len]], &mut out)
            .unwrap();
        assert!(out.iter().all(|x| x.to_bits() == 0x7e01), "{kernels} f16: {:04x}", out[0].to_bits());
    }
}
