//! The vector kernel sets' entry points: the generic kernels (`super::kernels`) compiled for AVX2 +
//! FMA + F16C and for AVX-512, beside the baseline the wheel is built for. Entered only through
//! `super::dispatch::Kernels::clamped`, which checked that the CPU has the features. (No floating-point
//! contraction: Rust never fuses a multiply and an add, so FMA changes no result.)

use super::dispatch::{Avx2, Avx512};
use super::kernels::{divide_dtype, reduce_dtype};
use super::{ReduceOp, Scale};
use crate::dtype::DType;

/// `reduce_raw` compiled for AVX2, FMA and F16C.
///
/// # Safety
/// As for `reduce_raw`; the CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn reduce_avx2(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { reduce_dtype::<Avx2>(dtype, op, scale, inputs, outputs, count) }
}

/// `reduce_raw` compiled for AVX-512 F, BW, DQ and VL (with AVX2, FMA and F16C).
///
/// # Safety
/// As for `reduce_raw`; the CPU must have those features.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn reduce_avx512(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { reduce_dtype::<Avx512>(dtype, op, scale, inputs, outputs, count) }
}

/// `divide_raw` compiled for AVX2, FMA and F16C.
///
/// # Safety
/// As for `divide_raw`; the CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn divide_avx2(dtype: DType, buf: *mut u8, count: usize, n: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { divide_dtype::<Avx2>(dtype, buf, count, n) }
}

/// `divide_raw` compiled for AVX-512 F, BW, DQ and VL (with AVX2, FMA and F16C).
///
/// # Safety
/// As for `divide_raw`; the CPU must have those features.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn divide_avx512(dtype: DType, buf: *mut u8, count: usize, n: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { divide_dtype::<Avx512>(dtype, buf, count, n) }
}
