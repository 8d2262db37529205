//! The reduce kernels: per-type arithmetic and the tiled loop every collective runs. The inner loops
//! are plain slice loops with the operator (and whether to scale) chosen outside them, which the
//! compiler vectorises.

use half::{bf16, f16};
use num_complex::{Complex, Complex32, Complex64};

use super::{ReduceOp, Scale};
use crate::dtype::DType;

/// Per-type arithmetic of the element types (`crate::dtype::Element`), which the kernels reach by the
/// buffers' [`DType`] tags. The operators a type does not take (`ReduceOp::check`) keep their default,
/// which is never called.
pub(super) trait Arith: Sized + Copy {
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
    fn min(a: Self::Acc, _b: Self::Acc) -> Self::Acc {
        a
    }
    /// max(a, b).
    fn max(a: Self::Acc, _b: Self::Acc) -> Self::Acc {
        a
    }
    /// a & b.
    fn band(a: Self::Acc, _b: Self::Acc) -> Self::Acc {
        a
    }
    /// a | b.
    fn bor(a: Self::Acc, _b: Self::Acc) -> Self::Acc {
        a
    }
    /// a ^ b.
    fn bxor(a: Self::Acc, _b: Self::Acc) -> Self::Acc {
        a
    }
    /// a / n.
    fn div(a: Self::Acc, _n: usize) -> Self::Acc {
        a
    }
    /// a * f, with f converted to the accumulator's precision.
    fn scale(a: Self::Acc, _f: f64) -> Self::Acc {
        a
    }
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
            #[inline(always)]
            fn scale(a: $acc, f: f64) -> $acc {
                a * (f as $acc)
            }
        }
    };
}
float_arith!(f32, f32, |x| x, |x| x);
float_arith!(f64, f64, |x| x, |x| x);
float_arith!(f16, f32, f16::to_f32, f16::from_f32);
float_arith!(bf16, f32, bf16::to_f32, bf16::from_f32);

macro_rules! complex_arith {
    ($($t:ty => $part:ty),*) => {$(
        impl Arith for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(self) -> $t { self }
            #[inline(always)]
            fn store(acc: $t) -> Self { acc }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t { a + b }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t { a * b }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t { a / (n as $part) }
            // Each part times the real factor (not a complex product with f + 0i, whose 0 * inf would
            // turn an infinite part into NaN).
            #[inline(always)]
            fn scale(a: $t, f: f64) -> $t { Complex::new(a.re * f as $part, a.im * f as $part) }
        }
    )*};
}
complex_arith!(Complex32 => f32, Complex64 => f64);

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
            fn band(a: $t, b: $t) -> $t { a & b }
            #[inline(always)]
            fn bor(a: $t, b: $t) -> $t { a | b }
            #[inline(always)]
            fn bxor(a: $t, b: $t) -> $t { a ^ b }
        }
    )*};
}
int_arith!(i8, u8, i16, u16, i32, u32, i64, u64);

/// A [`DType::Bool`] element as the byte it is: loading normalises (nonzero is true), so a byte that
/// is not 0 or 1 (a numpy view of other data) is never read as a Rust `bool`.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct BoolByte(u8);

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
    fn band(a: bool, b: bool) -> bool {
        a & b
    }
    #[inline(always)]
    fn bor(a: bool, b: bool) -> bool {
        a | b
    }
    #[inline(always)]
    fn bxor(a: bool, b: bool) -> bool {
        a ^ b
    }
}

/// Elements per tile: small enough that the inputs of one tile stay in L1/L2 while the result is written
/// back, so the stores hit lines just read.
pub(super) const TILE: usize = 1024;

#[inline(always)]
fn combine<T: Arith>(
    acc: &mut [T::Acc],
    src: &[T],
    load: impl Fn(T) -> T::Acc,
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
) {
    for (a, s) in acc.iter_mut().zip(src) {
        *a = f(*a, load(*s));
    }
}

#[inline(always)]
fn accumulate<T: Arith>(op: ReduceOp, acc: &mut [T::Acc], src: &[T], load: impl Fn(T) -> T::Acc) {
    match op {
        ReduceOp::Sum | ReduceOp::Average => combine(acc, src, load, T::add),
        ReduceOp::Product => combine(acc, src, load, T::mul),
        ReduceOp::Min => combine(acc, src, load, T::min),
        ReduceOp::Max => combine(acc, src, load, T::max),
        ReduceOp::BAnd => combine(acc, src, load, T::band),
        ReduceOp::BOr => combine(acc, src, load, T::bor),
        ReduceOp::BXor => combine(acc, src, load, T::bxor),
    }
}

/// Reduce `count` elements of `inputs` (in order) and store the result into every output.
///
/// # Safety
/// Every input must be valid for reading and every output for writing `count` values of `T`, and no
/// other thread may touch these ranges during the call. Inputs and outputs may be the same memory.
unsafe fn reduce_typed<T: Arith>(
    op: ReduceOp,
    scale: Scale,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    let n = inputs.len();
    let (pre, post) = (scale.pre != 1.0, scale.post != 1.0);
    let mut acc = [T::Acc::default(); TILE];
    let mut start = 0;
    while start < count {
        let len = TILE.min(count - start);
        let acc = &mut acc[..len];
        for (j, &p) in inputs.iter().enumerate() {
            // SAFETY: the caller guarantees `count` readable values; this slice ends before any write.
            let src = unsafe { std::slice::from_raw_parts(p.cast::<T>().add(start), len) };
            match (j, pre) {
                (0, false) => acc.iter_mut().zip(src).for_each(|(a, s)| *a = s.load()),
                (0, true) => acc.iter_mut().zip(src).for_each(|(a, s)| *a = T::scale(s.load(), scale.pre)),
                (_, false) => accumulate(op, acc, src, T::load),
                (_, true) => accumulate(op, acc, src, |s| T::scale(s.load(), scale.pre)),
            }
        }
        if op == ReduceOp::Average {
            if n.is_power_of_two() {
                // x / 2^k and x * 2^-k round the same exact value, so the bits are those of the division,
                // at the cost of a multiply (2 ranks, all_reduce AVERAGE of 1 MiB: 137 us dividing, 113
                // multiplying, 96 for SUM).
                acc.iter_mut().for_each(|a| *a = T::scale(*a, 1.0 / n as f64));
            } else {
                acc.iter_mut().for_each(|a| *a = T::div(*a, n));
            }
        }
        if post {
            acc.iter_mut().for_each(|a| *a = T::scale(*a, scale.post));
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

/// `$f::<T>($args)` with `T` the Rust type of `$dtype` (bool as [`BoolByte`]).
macro_rules! typed {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F16 => $f::<f16>($($arg),*),
            DType::F32 => $f::<f32>($($arg),*),
            DType::F64 => $f::<f64>($($arg),*),
            DType::BF16 => $f::<bf16>($($arg),*),
            DType::C64 => $f::<Complex32>($($arg),*),
            DType::C128 => $f::<Complex64>($($arg),*),
            DType::I8 => $f::<i8>($($arg),*),
            DType::U8 => $f::<u8>($($arg),*),
            DType::I16 => $f::<i16>($($arg),*),
            DType::U16 => $f::<u16>($($arg),*),
            DType::I32 => $f::<i32>($($arg),*),
            DType::U32 => $f::<u32>($($arg),*),
            DType::I64 => $f::<i64>($($arg),*),
            DType::U64 => $f::<u64>($($arg),*),
            DType::Bool => $f::<BoolByte>($($arg),*),
        }
    };
}

/// Type-erased [`reduce_typed`], dispatched on `dtype`.
///
/// # Safety
/// As for [`reduce_typed`], with `T` the type of `dtype`; `op.check(dtype)` and `scale.check(dtype)`
/// must have passed and `inputs` must not be empty.
pub(crate) unsafe fn reduce_raw(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    debug_assert!(!inputs.is_empty());
    // SAFETY: forwarded from the caller.
    unsafe { typed!(dtype, reduce_typed(op, scale, inputs, outputs, count)) }
}

/// Divide `count` values of `T` at `buf` by `n` in place, as AVERAGE does.
///
/// # Safety
/// `buf` must be valid for reads and writes of `count` values of `T`, untouched by anyone else.
unsafe fn divide_typed<T: Arith>(buf: *mut u8, count: usize, n: usize) {
    // SAFETY: forwarded from the caller.
    let buf = unsafe { std::slice::from_raw_parts_mut(buf.cast::<T>(), count) };
    for x in buf {
        *x = T::store(T::div(x.load(), n));
    }
}

/// Type-erased [`divide_typed`], dispatched on `dtype`.
///
/// # Safety
/// As for [`divide_typed`], with `T` the type of `dtype`; `ReduceOp::Average.check(dtype)` must have
/// passed.
pub(super) unsafe fn divide_raw(dtype: DType, buf: *mut u8, count: usize, n: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { typed!(dtype, divide_typed(buf, count, n)) }
}
