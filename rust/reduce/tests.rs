//! The kernels against hand-computed results.

use half::{bf16, f16};
use num_complex::Complex32;

use super::kernels::{reduce_raw, TILE};
use super::*;

#[test]
fn nan_propagates_like_numpy() {
    let a = [f32::NAN, 1.0, 2.0];
    let b = [1.0, f32::NAN, 0.5];
    let mut out = [0.0f32; 3];
    reduce_slices(ReduceOp::Min, &[&a, &b], &mut out).unwrap();
    assert!(out[0].is_nan() && out[1].is_nan());
    assert_eq!(out[2], 0.5);
    reduce_slices(ReduceOp::Max, &[&a, &b], &mut out).unwrap();
    assert!(out[0].is_nan() && out[1].is_nan());
    assert_eq!(out[2], 2.0);
}

#[test]
fn f16_accumulates_in_f32_and_rounds_once() {
    // 2048 + 1 + 1: rounding after each add in f16 would lose both ones.
    let xs = [f16::from_f32(2048.0), f16::from_f32(1.0), f16::from_f32(1.0)];
    let inputs: Vec<[f16; 1]> = xs.iter().map(|x| [*x]).collect();
    let refs: Vec<&[f16]> = inputs.iter().map(|x| &x[..]).collect();
    let mut out = [f16::ZERO];
    reduce_slices(ReduceOp::Sum, &refs, &mut out).unwrap();
    assert_eq!(out[0].to_f32(), 2050.0);
}

#[test]
fn bf16_accumulates_in_f32_and_rounds_once() {
    // 256 + 1 + 1: bfloat16 has 8 significant bits, so rounding after each add would lose both ones.
    let xs = [bf16::from_f32(256.0), bf16::from_f32(1.0), bf16::from_f32(1.0)];
    let inputs: Vec<[bf16; 1]> = xs.iter().map(|x| [*x]).collect();
    let refs: Vec<&[bf16]> = inputs.iter().map(|x| &x[..]).collect();
    let mut out = [bf16::ZERO];
    reduce_slices(ReduceOp::Sum, &refs, &mut out).unwrap();
    assert_eq!(out[0].to_f32(), 258.0);
    // Rounded to nearest even once: 1 + 2^-8 (not representable) -> 1.
    let a = [bf16::ONE];
    let b = [bf16::from_f32(2f32.powi(-8))];
    reduce_slices(ReduceOp::Sum, &[&a, &b], &mut out).unwrap();
    assert_eq!(out[0], bf16::ONE);
}

#[test]
fn bools_are_or_and_and_of_bytes_and_average_is_refused() {
    // Every pair of (false, true, and a non-canonical true byte 2) under each op.
    let a = [0u8, 0, 1, 1, 2, 0];
    let b = [0u8, 1, 0, 1, 0, 2];
    let run = |op| {
        let mut out = [7u8; 6];
        let ins = [a.as_ptr(), b.as_ptr()];
        // SAFETY: six readable bytes per input and six writable in `out`, disjoint.
        unsafe { reduce_raw(DType::Bool, op, Scale::NONE, &ins, &[out.as_mut_ptr()], 6) };
        out
    };
    let or = [0, 1, 1, 1, 1, 1];
    let and = [0, 0, 0, 1, 0, 0];
    assert_eq!(run(ReduceOp::Sum), or);
    assert_eq!(run(ReduceOp::Max), or);
    assert_eq!(run(ReduceOp::Product), and);
    assert_eq!(run(ReduceOp::Min), and);
    assert!(matches!(ReduceOp::Average.check(DType::Bool), Err(Error::UnsupportedDtype(_))));
}

#[test]
fn integers_wrap_and_average_is_refused() {
    let a = [i8::MAX];
    let b = [1i8];
    let mut out = [0i8];
    reduce_slices(ReduceOp::Sum, &[&a, &b], &mut out).unwrap();
    assert_eq!(out[0], i8::MIN);
    assert!(matches!(reduce_slices(ReduceOp::Average, &[&a, &b], &mut out), Err(Error::UnsupportedDtype(_))));
}

#[test]
fn long_inputs_cross_tiles_in_order() {
    let n = TILE * 3 + 7;
    let a: Vec<f64> = (0..n).map(|i| i as f64 * 0.1).collect();
    let b: Vec<f64> = (0..n).map(|i| 1.0 / (i as f64 + 1.0)).collect();
    let mut out = vec![0.0; n];
    reduce_slices(ReduceOp::Average, &[&a, &b], &mut out).unwrap();
    for i in 0..n {
        assert_eq!(out[i], (a[i] + b[i]) / 2.0);
    }
}

#[test]
fn the_op_table_refuses_what_it_must() {
    use ReduceOp::*;
    let refused = |op: ReduceOp, d: DType| matches!(op.check(d), Err(Error::UnsupportedDtype(_)));
    for d in DType::ALL {
        for op in ReduceOp::ALL {
            let bitwise = matches!(op, BAnd | BOr | BXor);
            let want = if d.is_complex() {
                bitwise || matches!(op, Min | Max)
            } else if d.is_float() {
                bitwise
            } else {
                op == Average
            };
            assert_eq!(refused(op, d), want, "{op} on {d}");
        }
    }
}

#[test]
fn bitwise_ops_on_integers_and_bools() {
    let a = [0b1100u16, 0xffff];
    let b = [0b1010u16, 0x0f0f];
    let mut out = [0u16; 2];
    reduce_slices(ReduceOp::BAnd, &[&a, &b], &mut out).unwrap();
    assert_eq!(out, [0b1000, 0x0f0f]);
    reduce_slices(ReduceOp::BOr, &[&a, &b], &mut out).unwrap();
    assert_eq!(out, [0b1110, 0xffff]);
    reduce_slices(ReduceOp::BXor, &[&a, &b], &mut out).unwrap();
    assert_eq!(out, [0b0110, 0xf0f0]);
    let (x, y) = ([0u8, 0, 1, 2], [0u8, 3, 1, 0]);
    let run = |op| {
        let mut out = [7u8; 4];
        // SAFETY: four readable bytes per input and four writable in `out`, disjoint.
        unsafe {
            reduce_raw(DType::Bool, op, Scale::NONE, &[x.as_ptr(), y.as_ptr()], &[out.as_mut_ptr()], 4)
        };
        out
    };
    assert_eq!(run(ReduceOp::BAnd), [0, 0, 1, 0]);
    assert_eq!(run(ReduceOp::BOr), [0, 1, 1, 1]);
    assert_eq!(run(ReduceOp::BXor), [0, 1, 0, 1]);
}

#[test]
fn averages_over_powers_of_two_have_the_bits_of_the_division() {
    // Values across the whole range, subnormals, infinities and NaN included.
    let mut xs: Vec<f32> = (0..2000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))).collect();
    xs.extend([f32::MIN_POSITIVE, 1e-45, -1e-45, f32::MAX, f32::INFINITY, f32::NAN, 0.1, 1.0 / 3.0]);
    let ys: Vec<f32> = xs.iter().map(|x| x * 0.7 + 1e-40).collect();
    for n in [2usize, 3, 4, 8, 16] {
        let inputs: Vec<&[f32]> = (0..n).map(|j| if j % 2 == 0 { &xs[..] } else { &ys[..] }).collect();
        let mut out = vec![0.0f32; xs.len()];
        reduce_slices(ReduceOp::Average, &inputs, &mut out).unwrap();
        for (i, o) in out.iter().enumerate() {
            // The kernel's order: the first input, then each next one added.
            let want = inputs[1..].iter().fold(inputs[0][i], |acc, s| acc + s[i]) / n as f32;
            assert!(
                o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                "n {n} i {i}: {o} != {want}"
            );
        }
    }
    // float64, and bfloat16 (accumulated in float32, rounded once).
    let xs: Vec<f64> = (0..2000u64).map(|i| f64::from_bits(i.wrapping_mul(0x9e37_79b9_7f4a_7c15))).collect();
    let ys: Vec<f64> = xs.iter().map(|x| x * 0.7 + 1e-310).collect();
    let mut out = vec![0.0f64; xs.len()];
    reduce_slices(ReduceOp::Average, &[&xs[..], &ys[..], &xs[..], &ys[..]], &mut out).unwrap();
    for (i, o) in out.iter().enumerate() {
        let want = (xs[i] + ys[i] + xs[i] + ys[i]) / 4.0;
        assert!(o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()), "f64 {i}: {o} != {want}");
    }
    let hs: Vec<bf16> = (0..2000u16).map(|i| bf16::from_bits(i.wrapping_mul(40_503))).collect();
    let mut out = vec![bf16::ZERO; hs.len()];
    reduce_slices(ReduceOp::Average, &[&hs[..], &hs[..]], &mut out).unwrap();
    for (i, o) in out.iter().enumerate() {
        let want = bf16::from_f32((hs[i].to_f32() + hs[i].to_f32()) / 2.0);
        assert!(o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()), "bf16 {i}: {o} != {want}");
    }
    let c = [Complex32::new(3.0, 1e-45)];
    let mut out = [Complex32::default()];
    reduce_slices(ReduceOp::Average, &[&c, &c, &c, &c], &mut out).unwrap();
    assert_eq!(out[0], (c[0] + c[0] + c[0] + c[0]) / 4.0);
}

#[test]
fn complex_sums_products_and_averages() {
    let a = [Complex32::new(1.0, 2.0)];
    let b = [Complex32::new(3.0, -1.0)];
    let mut out = [Complex32::default()];
    reduce_slices(ReduceOp::Product, &[&a, &b], &mut out).unwrap();
    assert_eq!(out[0], Complex32::new(5.0, 5.0));
    reduce_slices(ReduceOp::Average, &[&a, &b], &mut out).unwrap();
    assert_eq!(out[0], Complex32::new(2.0, 0.5));
    assert!(reduce_slices(ReduceOp::Max, &[&a, &b], &mut out).is_err());
}

#[test]
fn scaling_multiplies_each_input_and_the_result_in_the_accumulator() {
    // f16: (2048 + 1 + 1) * 0.5 each, then * 2, rounded once: 2050 (in f16 steps the halves would be
    // lost: 2048).
    let a = [f16::from_f32(2048.0)];
    let b = [f16::from_f32(1.0)];
    let mut out = [f16::ZERO];
    let scale = Scale { pre: 0.5, post: 2.0 };
    reduce_slices_scaled(ReduceOp::Sum, scale, &[&a, &b, &b], &mut out).unwrap();
    assert_eq!(out[0].to_f32(), 2050.0);
    // AVERAGE divides before postscaling: (2 * 3 + 4 * 3) / 2 * 0.25.
    let mut out = [0.0f64];
    reduce_slices_scaled(ReduceOp::Average, Scale { pre: 3.0, post: 0.25 }, &[&[2.0], &[4.0]], &mut out)
        .unwrap();
    assert_eq!(out[0], 2.25);
    // A complex part that is infinite stays infinite (each part is scaled by the real factor).
    let c = [Complex32::new(f32::INFINITY, 1.0)];
    let mut out = [Complex32::default()];
    reduce_slices_scaled(ReduceOp::Sum, Scale { pre: 2.0, post: 1.0 }, &[&c], &mut out).unwrap();
    assert_eq!(out[0], Complex32::new(f32::INFINITY, 2.0));
    // Integers take no factor.
    let mut out = [0i32];
    let err = reduce_slices_scaled(ReduceOp::Sum, Scale { pre: 2.0, post: 1.0 }, &[&[1]], &mut out);
    assert!(matches!(err, Err(Error::UnsupportedDtype(_))));
    let mut out = [bf16::ZERO];
    reduce_slices_scaled(ReduceOp::Sum, Scale::NONE, &[&[bf16::ONE]], &mut out).unwrap();
    assert_eq!(out[0], bf16::ONE);
}

#[test]
fn scale_divides_in_place_as_average_does_and_refuses_integers() {
    // Three ranks: the bits of AVERAGE over inputs that sum to x are those of x / 3.
    let mut x = [1.0f32, 2.0, -7.5, f32::NAN];
    scale(&mut x, 3).unwrap();
    assert_eq!(x[..3], [1.0 / 3.0, 2.0 / 3.0, -2.5]);
    assert!(x[3].is_nan());
    // float16 divides in f32 and rounds once.
    let mut h = [f16::from_f32(1.0)];
    scale(&mut h, 3).unwrap();
    assert_eq!(h[0], f16::from_f32(1.0 / 3.0));
    let mut c = [Complex32::new(3.0, -6.0)];
    scale(&mut c, 3).unwrap();
    assert_eq!(c[0], Complex32::new(1.0, -2.0));
    assert!(matches!(scale(&mut [6i32], 3), Err(Error::UnsupportedDtype(_))));
}
