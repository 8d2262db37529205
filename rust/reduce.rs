//! Reduction operators and their kernels.
//!
//! Every reduction combines its inputs in the order given (rank order in the collectives), one tile at a
//! time, so every rank computes bitwise-identical results run after run. float16 and bfloat16 are
//! accumulated in f32 and rounded once; bool reads any nonzero byte as true (OR for SUM/MAX, AND for
//! PRODUCT/MIN). MIN/MAX propagate NaN like `numpy.minimum`/`numpy.maximum`; integer arithmetic wraps
//! like numpy's. The inner loops are plain slice loops with the operator chosen outside them, which the
//! compiler vectorises.

use std::fmt;

use half::{bf16, f16};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// How values from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum = 1,
    /// Elementwise product.
    Product = 2,
    /// Elementwise minimum (NaN wins).
    Min = 3,
    /// Elementwise maximum (NaN wins).
    Max = 4,
    /// Sum divided by the number of ranks (floating-point types only).
    Average = 5,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 5] =
        [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Average];

    /// The upper-case name used in Python and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::Average => "AVERAGE",
        }
    }

    /// The operator with this `repr(u8)` code (used by the shared-memory wire format).
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| *o as u8 == code)
    }

    /// Fails when this operator cannot reduce `dtype` (AVERAGE of integers).
    pub fn check(self, dtype: DType) -> Result<()> {
        if self == ReduceOp::Average && !dtype.is_float() {
            return Err(Error::UnsupportedDtype(format!(
                "AVERAGE is not defined for {dtype}: use SUM and divide, or a floating-point dtype"
            )));
        }
        Ok(())
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-type arithmetic behind [`Element`]. Public only so it can bound `Element`; it is not nameable
/// outside the crate, which seals `Element`.
pub trait Arith: Sized + Copy {
    /// The type values are accumulated in.
    type Acc: Copy + Default;
    /// Widen to the accumulator.
    fn load(self) -> Self::Acc;
    /// Narrow the final accumulator (rounds once for f16).
    fn store(acc: Self::Acc) -> Self;
    /// a + b.
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// a * b.
    fn mul(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// min(a, b).
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// max(a, b).
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// a / n (only called for floats).
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! float_arith {
    ($t:ty, $acc:ty, $load:expr, $store:expr) => {
        impl Arith for $t {
            type Acc = $acc;
            #[inline(always)]
            fn load(self) -> $acc {
                $load(self)
            }
            #[inline(always)]
            fn store(acc: $acc) -> Self {
                $store(acc)
            }
            #[inline(always)]
            fn add(a: $acc, b: $acc) -> $acc {
                a + b
            }
            #[inline(always)]
            fn mul(a: $acc, b: $acc) -> $acc {
                a * b
            }
            #[inline(always)]
            fn min(a: $acc, b: $acc) -> $acc {
                // numpy.minimum: NaN in either input gives NaN.
                if a.is_nan() || b < a {
                    if a.is_nan() {
                        a
                    } else {
                        b
                    }
                } else if b.is_nan() {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn max(a: $acc, b: $acc) -> $acc {
                if a.is_nan() || b > a {
                    if a.is_nan() {
                        a
                    } else {
                        b
                    }
                } else if b.is_nan() {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn div(a: $acc, n: usize) -> $acc {
                a / (n as $acc)
            }
        }
    };
}
float_arith!(f32, f32, |x| x, |x| x);
float_arith!(f64, f64, |x| x, |x| x);
float_arith!(f16, f32, f16::to_f32, f16::from_f32);
float_arith!(bf16, f32, bf16::to_f32, bf16::from_f32);

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(self) -> $t { self }
            #[inline(always)]
            fn store(acc: $t) -> Self { acc }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t { a.wrapping_add(b) }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t { a.wrapping_mul(b) }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t { a.min(b) }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t { a.max(b) }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t { a / (n as $t) }
        }
    )*};
}
int_arith!(i8, u8, i32, i64);

/// A [`DType::Bool`] element as the byte it is: loading normalises (nonzero is true), so a byte that
/// is not 0 or 1 (a numpy view of other data) is never read as a Rust `bool`.
#[derive(Clone, Copy)]
#[repr(transparent)]
struct BoolByte(u8);

impl Arith for BoolByte {
    type Acc = bool;
    #[inline(always)]
    fn load(self) -> bool {
        self.0 != 0
    }
    #[inline(always)]
    fn store(acc: bool) -> Self {
        BoolByte(acc as u8)
    }
    #[inline(always)]
    fn add(a: bool, b: bool) -> bool {
        a | b
    }
    #[inline(always)]
    fn mul(a: bool, b: bool) -> bool {
        a & b
    }
    #[inline(always)]
    fn min(a: bool, b: bool) -> bool {
        a & b
    }
    #[inline(always)]
    fn max(a: bool, b: bool) -> bool {
        a | b
    }
    #[inline(always)]
    fn div(a: bool, _: usize) -> bool {
        // AVERAGE is refused for bool before any kernel runs.
        a
    }
}

/// Elements per tile: small enough that the inputs of one tile stay in L1/L2 while the result is written
/// back, so the stores hit lines just read.
const TILE: usize = 1024;

#[inline(always)]
fn combine<T: Arith>(acc: &mut [T::Acc], src: &[T], f: impl Fn(T::Acc, T::Acc) -> T::Acc) {
    for (a, s) in acc.iter_mut().zip(src) {
        *a = f(*a, s.load());
    }
}

fn accumulate<T: Arith>(op: ReduceOp, acc: &mut [T::Acc], src: &[T]) {
    match op {
        ReduceOp::Sum | ReduceOp::Average => combine(acc, src, T::add),
        ReduceOp::Product => combine(acc, src, T::mul),
        ReduceOp::Min => combine(acc, src, T::min),
        ReduceOp::Max => combine(acc, src, T::max),
    }
}

/// Reduce `count` elements of `inputs` (in order) and store the result into every output.
///
/// # Safety
/// Every input must be valid for reading and every output for writing `count` values of `T`, and no
/// other thread may touch these ranges during the call. Inputs and outputs may be the same memory.
unsafe fn reduce_typed<T: Arith>(op: ReduceOp, inputs: &[*const u8], outputs: &[*mut u8], count: usize) {
    let n = inputs.len();
    let mut acc = [T::Acc::default(); TILE];
    let mut start = 0;
    while start < count {
        let len = TILE.min(count - start);
        let acc = &mut acc[..len];
        for (j, &p) in inputs.iter().enumerate() {
            // SAFETY: the caller guarantees `count` readable values; this slice ends before any write.
            let src = unsafe { std::slice::from_raw_parts(p.cast::<T>().add(start), len) };
            if j == 0 {
                for (a, s) in acc.iter_mut().zip(src) {
                    *a = s.load();
                }
            } else {
                accumulate(op, acc, src);
            }
        }
        if op == ReduceOp::Average {
            for a in acc.iter_mut() {
                *a = T::div(*a, n);
            }
        }
        for &p in outputs {
            // SAFETY: the caller guarantees `count` writable values; no input slice is alive now.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.cast::<T>().add(start), len) };
            for (d, a) in dst.iter_mut().zip(acc.iter()) {
                *d = T::store(*a);
            }
        }
        start += len;
    }
}

/// Type-erased [`reduce_typed`], dispatched on `dtype`.
///
/// # Safety
/// As for [`reduce_typed`], with `T` the type of `dtype`; `op.check(dtype)` must have passed and
/// `inputs` must not be empty.
pub(crate) unsafe fn reduce_raw(
    dtype: DType,
    op: ReduceOp,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    debug_assert!(!inputs.is_empty());
    // SAFETY: forwarded from the caller.
    unsafe {
        match dtype {
            DType::F16 => reduce_typed::<f16>(op, inputs, outputs, count),
            DType::F32 => reduce_typed::<f32>(op, inputs, outputs, count),
            DType::F64 => reduce_typed::<f64>(op, inputs, outputs, count),
            DType::I8 => reduce_typed::<i8>(op, inputs, outputs, count),
            DType::U8 => reduce_typed::<u8>(op, inputs, outputs, count),
            DType::I32 => reduce_typed::<i32>(op, inputs, outputs, count),
            DType::I64 => reduce_typed::<i64>(op, inputs, outputs, count),
            DType::BF16 => reduce_typed::<bf16>(op, inputs, outputs, count),
            DType::Bool => reduce_typed::<BoolByte>(op, inputs, outputs, count),
        }
    }
}

/// Reduce equally long slices, in order, into `out`: the kernel every collective uses, for Rust callers.
pub fn reduce_slices<T: Element>(op: ReduceOp, inputs: &[&[T]], out: &mut [T]) -> Result<()> {
    op.check(T::DTYPE)?;
    if inputs.is_empty() {
        return Err(Error::invalid("reduce_slices needs at least one input"));
    }
    if let Some(bad) = inputs.iter().find(|s| s.len() != out.len()) {
        return Err(Error::invalid(format!(
            "reduce_slices: an input has {} elements but the output has {}",
            bad.len(),
            out.len()
        )));
    }
    let ptrs: Vec<*const u8> = inputs.iter().map(|s| s.as_ptr().cast()).collect();
    // SAFETY: lengths checked above; `out` is a unique borrow, so it cannot alias the shared inputs.
    unsafe { reduce_raw(T::DTYPE, op, &ptrs, &[out.as_mut_ptr().cast()], out.len()) };
    Ok(())
}

/// Divide every element by `divisor` in place: AVERAGE for backends that can only sum (e.g. MPI).
pub fn scale<T: Element>(buf: &mut [T], divisor: usize) -> Result<()> {
    ReduceOp::Average.check(T::DTYPE)?;
    for x in buf {
        *x = T::store(T::div(x.load(), divisor));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
            unsafe { reduce_raw(DType::Bool, op, &ins, &[out.as_mut_ptr()], 6) };
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
        assert!(matches!(
            reduce_slices(ReduceOp::Average, &[&a, &b], &mut out),
            Err(Error::UnsupportedDtype(_))
        ));
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
}
