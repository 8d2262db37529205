//! The reduce kernels: per-type arithmetic and the tiled loop every collective runs. The inner loops
//! are plain slice loops with the operator (and whether to scale) chosen outside them, which the
//! compiler vectorises for the instruction set of the function they are inlined into: the baseline
//! here, AVX2 or AVX-512 in `super::x86`. Generic over that set ([`Isa`]), which chooses how float16
//! widens to f32 and narrows back (`super::convert`; bfloat16 converts in the loops themselves, with
//! branch-free bit arithmetic every set vectorises); every other step is the same code, so the same
//! operations in the same order, on every set.

use half::{bf16, f16};
use num_complex::{Complex, Complex32, Complex64};

use super::dispatch::{Baseline, Isa, Kernels};
use super::{convert, ReduceOp, Scale};
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
    /// True when the kernel set `I` converts this type to and from its accumulator a vector at a time
    /// ([`Arith::widen`], [`Arith::narrow`]) instead of by `load` and `store`.
    fn widens<I: Isa>() -> bool {
        false
    }
    /// `load` of every element of `src` into `dst`, as `I` vectorises it.
    fn widen<I: Isa>(_src: &[Self], _dst: &mut [Self::Acc]) {}
    /// `store` of every element of `src` into `dst`, as `I` vectorises it.
    fn narrow<I: Isa>(_src: &[Self::Acc], _dst: &mut [Self]) {}
}

/// Which NaN an arithmetic result carries: both x86 and Arm return the first operand's NaN (quieted)
/// when both operands are NaN, but the compiler may swap the operands of a commutative add or multiply,
/// and does so differently for each instruction set (the baseline's float32 sum kept the second
/// input's NaN, its float16 sum the first's). So the kernels say it: a NaN first operand wins, quieted;
/// otherwise the result as computed (one NaN operand: that NaN, quieted; none: the CPU's default NaN).
/// The same bits on every kernel set and every rank.
pub(super) trait NanFirst: Copy {
    /// `r`, the result of an operation whose first operand is `self`, or `self` quieted if it is NaN.
    fn nan_first(self, r: Self) -> Self;
}

impl NanFirst for f32 {
    #[inline(always)]
    fn nan_first(self, r: f32) -> f32 {
        if self.is_nan() {
            f32::from_bits(self.to_bits() | 0x0040_0000)
        } else {
            r
        }
    }
}

impl NanFirst for f64 {
    #[inline(always)]
    fn nan_first(self, r: f64) -> f64 {
        if self.is_nan() {
            f64::from_bits(self.to_bits() | 0x0008_0000_0000_0000)
        } else {
            r
        }
    }
}

macro_rules! float_arith {
    ($t:ty, $acc:ty, $load:expr, $store:expr $(, { $($wide:tt)* })?) => {
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
                a.nan_first(a + b)
            }
            #[inline(always)]
            fn mul(a: $acc, b: $acc) -> $acc {
                a.nan_first(a * b)
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
                a.nan_first(a * (f as $acc))
            }
            $($($wide)*)?
        }
    };
}
float_arith!(f32, f32, |x| x, |x| x);
float_arith!(f64, f64, |x| x, |x| x);
float_arith!(f16, f32, f16::to_f32, f16::from_f32, {
    #[inline(always)]
    fn widens<I: Isa>() -> bool {
        I::KERNELS != Kernels::Baseline
    }
    #[inline(always)]
    fn widen<I: Isa>(src: &[f16], dst: &mut [f32]) {
        match I::KERNELS {
            // SAFETY: `I` is only entered (`super::x86`) when the CPU has its features.
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2 => unsafe { convert::f16_widen_avx2(src, dst) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512 => unsafe { convert::f16_widen_avx512(src, dst) },
            _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32()),
        }
    }
    #[inline(always)]
    fn narrow<I: Isa>(src: &[f32], dst: &mut [f16]) {
        match I::KERNELS {
            // SAFETY: `I` is only entered (`super::x86`) when the CPU has its features.
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2 => unsafe { convert::f16_narrow_avx2(src, dst) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512 => unsafe { convert::f16_narrow_avx512(src, dst) },
            _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = f16::from_f32(*s)),
        }
    }
});
// Converted element by element in the loops themselves, which vectorise the branch-free conversions
// (2 inputs of 128 KiB on AVX-512: 15 us, against 18 us widening each input into a buffer first; the
// same on AVX2).
float_arith!(bf16, f32, convert::bf16_to_f32, convert::f32_to_bf16);

macro_rules! complex_arith {
    ($($t:ty => $part:ty),*) => {$(
        impl Arith for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(self) -> $t { self }
            #[inline(always)]
            fn store(acc: $t) -> Self { acc }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                Complex::new(a.re.nan_first(a.re + b.re), a.im.nan_first(a.im + b.im))
            }
            // num_complex's product, each step with its NaN said (`NanFirst`).
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                let (rr, ii) = (a.re.nan_first(a.re * b.re), a.im.nan_first(a.im * b.im));
                let (ri, ir) = (a.re.nan_first(a.re * b.im), a.im.nan_first(a.im * b.re));
                Complex::new(rr.nan_first(rr - ii), ri.nan_first(ri + ir))
            }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t { a / (n as $part) }
            // Each part times the real factor (not a complex product with f + 0i, whose 0 * inf would
            // turn an infinite part into NaN).
            #[inline(always)]
            fn scale(a: $t, f: f64) -> $t {
                let f = f as $part;
                Complex::new(a.re.nan_first(a.re * f), a.im.nan_first(a.im * f))
            }
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
fn combine<T: Arith, S: Copy>(
    acc: &mut [T::Acc],
    src: &[S],
    load: impl Fn(S) -> T::Acc,
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
) {
    for (a, s) in acc.iter_mut().zip(src) {
        *a = f(*a, load(*s));
    }
}

#[inline(always)]
fn accumulate<T: Arith, S: Copy>(op: ReduceOp, acc: &mut [T::Acc], src: &[S], load: impl Fn(S) -> T::Acc) {
    match op {
        ReduceOp::Sum | ReduceOp::Average => combine::<T, S>(acc, src, load, T::add),
        ReduceOp::Product => combine::<T, S>(acc, src, load, T::mul),
        ReduceOp::Min => combine::<T, S>(acc, src, load, T::min),
        ReduceOp::Max => combine::<T, S>(acc, src, load, T::max),
        ReduceOp::BAnd => combine::<T, S>(acc, src, load, T::band),
        ReduceOp::BOr => combine::<T, S>(acc, src, load, T::bor),
        ReduceOp::BXor => combine::<T, S>(acc, src, load, T::bxor),
    }
}

/// `acc = f(a, b)`, the first two inputs in one pass.
#[inline(always)]
fn combine_pair<T: Arith>(
    acc: &mut [T::Acc],
    a: &[T],
    b: &[T],
    load: impl Fn(T) -> T::Acc,
    f: impl Fn(T::Acc, T::Acc) -> T::Acc,
) {
    for (r, (x, y)) in acc.iter_mut().zip(a.iter().zip(b)) {
        *r = f(load(*x), load(*y));
    }
}

#[inline(always)]
fn accumulate_pair<T: Arith>(op: ReduceOp, acc: &mut [T::Acc], a: &[T], b: &[T], load: impl Fn(T) -> T::Acc) {
    match op {
        ReduceOp::Sum | ReduceOp::Average => combine_pair::<T>(acc, a, b, load, T::add),
        ReduceOp::Product => combine_pair::<T>(acc, a, b, load, T::mul),
        ReduceOp::Min => combine_pair::<T>(acc, a, b, load, T::min),
        ReduceOp::Max => combine_pair::<T>(acc, a, b, load, T::max),
        ReduceOp::BAnd => combine_pair::<T>(acc, a, b, load, T::band),
        ReduceOp::BOr => combine_pair::<T>(acc, a, b, load, T::bor),
        ReduceOp::BXor => combine_pair::<T>(acc, a, b, load, T::bxor),
    }
}

/// Reduce `count` elements of `inputs` (in order) and store the result into every output, with the
/// conversions of kernel set `I`. Inlined into each set's entry point, which compiles it for that set.
///
/// # Safety
/// Every input must be valid for reading and every output for writing `count` values of `T`, and no
/// other thread may touch these ranges during the call. Inputs and outputs may be the same memory.
/// The CPU must have the features of `I`.
#[inline(always)]
unsafe fn reduce_typed<T: Arith, I: Isa>(
    op: ReduceOp,
    scale: Scale,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    let n = inputs.len();
    let (pre, post) = (scale.pre != 1.0, scale.post != 1.0);
    let mut acc = [T::Acc::default(); TILE];
    // A widened input beside the tile, when the set widens `T` in vectors: one buffer for the whole call
    // (per chunk of a few vectors, filling a fresh buffer and looping over it cost float16 and bfloat16
    // 2-2.6x: 2 inputs of 128 KiB on AVX-512, bfloat16 39 against 19 us, float16 36 against 14).
    let mut wide = [T::Acc::default(); TILE];
    let mut start = 0;
    while start < count {
        let len = TILE.min(count - start);
        let acc = &mut acc[..len];
        // SAFETY (both slices): the caller guarantees `count` readable values; they end before any write.
        let src = |j: usize| unsafe { std::slice::from_raw_parts(inputs[j].cast::<T>().add(start), len) };
        // The first two inputs in one pass (the same operations, one pass fewer over the tile).
        let paired = if n >= 2 && !T::widens::<I>() {
            if pre {
                accumulate_pair::<T>(op, acc, src(0), src(1), |s| T::scale(s.load(), scale.pre));
            } else {
                accumulate_pair::<T>(op, acc, src(0), src(1), T::load);
            }
            2
        } else {
            0
        };
        for j in paired..n {
            let src = src(j);
            if T::widens::<I>() {
                // Widened by vectors, then the same operations on the f32 values: the first input
                // straight into the tile, the others into `wide`.
                if j == 0 {
                    T::widen::<I>(src, acc);
                    if pre {
                        acc.iter_mut().for_each(|a| *a = T::scale(*a, scale.pre));
                    }
                    continue;
                }
                let wide = &mut wide[..len];
                T::widen::<I>(src, wide);
                if pre {
                    accumulate::<T, T::Acc>(op, acc, wide, |s| T::scale(s, scale.pre));
                } else {
                    accumulate::<T, T::Acc>(op, acc, wide, |s| s);
                }
                continue;
            }
            match (j, pre) {
                (0, false) => acc.iter_mut().zip(src).for_each(|(a, s)| *a = s.load()),
                (0, true) => acc.iter_mut().zip(src).for_each(|(a, s)| *a = T::scale(s.load(), scale.pre)),
                (_, false) => accumulate::<T, T>(op, acc, src, T::load),
                (_, true) => accumulate::<T, T>(op, acc, src, |s| T::scale(s.load(), scale.pre)),
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
            if T::widens::<I>() {
                T::narrow::<I>(acc, dst);
            } else {
                for (d, a) in dst.iter_mut().zip(acc.iter()) {
                    *d = T::store(*a);
                }
            }
        }
        start += len;
    }
}

/// `$f::<T, I>($args)` with `T` the Rust type of `$dtype` (bool as [`BoolByte`]).
macro_rules! typed {
    ($dtype:expr, $f:ident::<$i:ty>($($arg:expr),*)) => {
        match $dtype {
            DType::F16 => $f::<f16, $i>($($arg),*),
            DType::F32 => $f::<f32, $i>($($arg),*),
            DType::F64 => $f::<f64, $i>($($arg),*),
            DType::BF16 => $f::<bf16, $i>($($arg),*),
            DType::C64 => $f::<Complex32, $i>($($arg),*),
            DType::C128 => $f::<Complex64, $i>($($arg),*),
            DType::I8 => $f::<i8, $i>($($arg),*),
            DType::U8 => $f::<u8, $i>($($arg),*),
            DType::I16 => $f::<i16, $i>($($arg),*),
            DType::U16 => $f::<u16, $i>($($arg),*),
            DType::I32 => $f::<i32, $i>($($arg),*),
            DType::U32 => $f::<u32, $i>($($arg),*),
            DType::I64 => $f::<i64, $i>($($arg),*),
            DType::U64 => $f::<u64, $i>($($arg),*),
            DType::Bool => $f::<BoolByte, $i>($($arg),*),
        }
    };
}

/// [`reduce_typed`] for kernel set `I`, dispatched on `dtype`; `super::x86` inlines it into each
/// set's entry point.
///
/// # Safety
/// As for [`reduce_typed`], with `T` the type of `dtype`.
#[inline(always)]
pub(super) unsafe fn reduce_dtype<I: Isa>(
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    // SAFETY: forwarded from the caller.
    unsafe { typed!(dtype, reduce_typed::<I>(op, scale, inputs, outputs, count)) }
}

/// Type-erased [`reduce_typed`] on the process's kernel set ([`Kernels::active`]).
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
    // SAFETY: forwarded from the caller.
    unsafe { reduce_raw_on(Kernels::active(), dtype, op, scale, inputs, outputs, count) }
}

/// [`reduce_raw`] on kernel set `kernels`, or the fastest below it that the CPU has.
///
/// # Safety
/// As for [`reduce_raw`].
pub(super) unsafe fn reduce_raw_on(
    kernels: Kernels,
    dtype: DType,
    op: ReduceOp,
    scale: Scale,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    count: usize,
) {
    debug_assert!(!inputs.is_empty());
    // SAFETY: forwarded from the caller; a vector set is entered only when the CPU has it (clamped).
    unsafe {
        match kernels.clamped() {
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512 => super::x86::reduce_avx512(dtype, op, scale, inputs, outputs, count),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2 => super::x86::reduce_avx2(dtype, op, scale, inputs, outputs, count),
            _ => reduce_dtype::<Baseline>(dtype, op, scale, inputs, outputs, count),
        }
    }
}

/// Divide `count` values of `T` at `buf` by `n` in place, as AVERAGE does, with the conversions of
/// kernel set `I`.
///
/// # Safety
/// `buf` must be valid for reads and writes of `count` values of `T`, untouched by anyone else; the
/// CPU must have the features of `I`.
#[inline(always)]
unsafe fn divide_typed<T: Arith, I: Isa>(buf: *mut u8, count: usize, n: usize) {
    // SAFETY: forwarded from the caller.
    let buf = unsafe { std::slice::from_raw_parts_mut(buf.cast::<T>(), count) };
    if T::widens::<I>() {
        let mut wide = [T::Acc::default(); TILE];
        for chunk in buf.chunks_mut(TILE) {
            let wide = &mut wide[..chunk.len()];
            T::widen::<I>(chunk, wide);
            wide.iter_mut().for_each(|x| *x = T::div(*x, n));
            T::narrow::<I>(wide, chunk);
        }
        return;
    }
    for x in buf {
        *x = T::store(T::div(x.load(), n));
    }
}

/// [`divide_typed`] for kernel set `I`, dispatched on `dtype`.
///
/// # Safety
/// As for [`divide_typed`], with `T` the type of `dtype`.
#[inline(always)]
pub(super) unsafe fn divide_dtype<I: Isa>(dtype: DType, buf: *mut u8, count: usize, n: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { typed!(dtype, divide_typed::<I>(buf, count, n)) }
}

/// Type-erased [`divide_typed`] on kernel set `kernels`, or the fastest below it that the CPU has.
///
/// # Safety
/// As for [`divide_typed`], with `T` the type of `dtype`; `ReduceOp::Average.check(dtype)` must have
/// passed.
pub(super) unsafe fn divide_raw_on(kernels: Kernels, dtype: DType, buf: *mut u8, count: usize, n: usize) {
    // SAFETY: forwarded from the caller; a vector set is entered only when the CPU has it (clamped).
    unsafe {
        match kernels.clamped() {
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx512 => super::x86::divide_avx512(dtype, buf, count, n),
            #[cfg(target_arch = "x86_64")]
            Kernels::Avx2 => super::x86::divide_avx2(dtype, buf, count, n),
            _ => divide_dtype::<Baseline>(dtype, buf, count, n),
        }
    }
}
