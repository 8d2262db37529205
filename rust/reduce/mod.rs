//! Reduction operators, which dtypes each one takes, and Horovod's scaling factors; the kernels are in
//! `kernels`, compiled once per vector instruction set (`x86`, with `convert` for float16 and
//! bfloat16), and `dispatch` chooses the set once per process.
//!
//! Every reduction combines its inputs in the order given (rank order in the collectives), one tile at a
//! time, so every rank computes bitwise-identical results run after run. float16 and bfloat16 are
//! accumulated in f32 and rounded once; bool reads any nonzero byte as true (OR for SUM/MAX, AND for
//! PRODUCT/MIN). MIN/MAX propagate NaN like `numpy.minimum`/`numpy.maximum`; where two NaNs meet in
//! SUM, PRODUCT or AVERAGE the first (in rank order) wins, quieted, on every kernel set (the hardware
//! would let the compiler's operand order decide); integer arithmetic wraps like numpy's.

mod convert;
mod dispatch;
mod kernels;
#[cfg(test)]
mod sets_tests;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::fmt;
use std::hash::{Hash, Hasher};

pub use dispatch::Kernels;
pub(crate) use kernels::reduce_raw;

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};

/// How values from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    /// Elementwise sum (OR for bool).
    Sum = 1,
    /// Elementwise product (AND for bool).
    Product = 2,
    /// Elementwise minimum (NaN wins; AND for bool).
    Min = 3,
    /// Elementwise maximum (NaN wins; OR for bool).
    Max = 4,
    /// Sum divided by the number of ranks (floating-point and complex types only).
    Average = 5,
    /// Bitwise AND (integers and bool).
    BAnd = 6,
    /// Bitwise OR (integers and bool).
    BOr = 7,
    /// Bitwise XOR (integers and bool).
    BXor = 8,
}

impl ReduceOp {
    /// Every operator.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Average,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];

    /// The upper-case name used in Python and error messages.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "SUM",
            ReduceOp::Product => "PRODUCT",
            ReduceOp::Min => "MIN",
            ReduceOp::Max => "MAX",
            ReduceOp::Average => "AVERAGE",
            ReduceOp::BAnd => "BAND",
            ReduceOp::BOr => "BOR",
            ReduceOp::BXor => "BXOR",
        }
    }

    /// The operator with this `repr(u8)` code (used by the shared-memory wire format).
    pub fn from_code(code: u8) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| *o as u8 == code)
    }

    /// Fails when this operator cannot reduce `dtype`. The one table of op/dtype rules:
    /// real floats take SUM, PRODUCT, MIN, MAX, AVERAGE; complex SUM, PRODUCT, AVERAGE; integers and
    /// bool SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR.
    pub fn check(self, dtype: DType) -> Result<()> {
        use ReduceOp::*;
        let bitwise = matches!(self, BAnd | BOr | BXor);
        let why = if dtype.is_float() && bitwise {
            "bitwise operators are defined for integers and bool only"
        } else if dtype.is_complex() && (bitwise || matches!(self, Min | Max)) {
            "complex numbers have no order and no bits to combine: use SUM, PRODUCT or AVERAGE"
        } else if self == Average && !(dtype.is_float() || dtype.is_complex()) {
            "use SUM and divide, or a floating-point dtype"
        } else {
            return Ok(());
        };
        Err(Error::UnsupportedDtype(format!("{self} is not defined for {dtype}: {why}")))
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Horovod's scaling of a reduction: every input is multiplied by `pre` as it is read, the result by
/// `post` before it is stored (after AVERAGE's division), in the accumulator's type (f32 for float16
/// and bfloat16), so no extra pass over the data. Floating-point and complex types only.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Factor applied to each input.
    pub pre: f64,
    /// Factor applied to the result.
    pub post: f64,
}

impl Scale {
    /// No scaling.
    pub const NONE: Scale = Scale { pre: 1.0, post: 1.0 };

    /// True when both factors are 1.
    pub fn is_none(&self) -> bool {
        *self == Scale::NONE
    }

    /// Fails when these factors cannot scale `dtype` (integers and bool: a factor other than 1).
    pub fn check(&self, dtype: DType) -> Result<()> {
        if self.is_none() || dtype.is_float() || dtype.is_complex() {
            return Ok(());
        }
        Err(Error::UnsupportedDtype(format!(
            "prescale_factor and postscale_factor are defined for floating-point and complex dtypes only, \
             not {dtype}: scale the integers yourself, or leave both factors at 1"
        )))
    }
}

// Factors compare (and hash) by their bits, so a signature is equal only to the very same call.
impl PartialEq for Scale {
    fn eq(&self, other: &Self) -> bool {
        self.pre.to_bits() == other.pre.to_bits() && self.post.to_bits() == other.post.to_bits()
    }
}
impl Eq for Scale {}
impl Hash for Scale {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (self.pre.to_bits(), self.post.to_bits()).hash(h);
    }
}

/// Reduce equally long slices, in order, into `out`: the kernel every collective uses, for Rust callers.
pub fn reduce_slices<T: Element>(op: ReduceOp, inputs: &[&[T]], out: &mut [T]) -> Result<()> {
    reduce_slices_scaled(op, Scale::NONE, inputs, out)
}

/// [`reduce_slices`] with Horovod's scaling factors.
pub fn reduce_slices_scaled<T: Element>(
    op: ReduceOp,
    scale: Scale,
    inputs: &[&[T]],
    out: &mut [T],
) -> Result<()> {
    reduce_slices_on(Kernels::active(), op, scale, inputs, out)
}

/// [`reduce_slices_scaled`] on kernel set `kernels` (or the fastest below it that this CPU has)
/// instead of the process's: to compare the sets, which give bitwise the same results.
pub fn reduce_slices_on<T: Element>(
    kernels: Kernels,
    op: ReduceOp,
    scale: Scale,
    inputs: &[&[T]],
    out: &mut [T],
) -> Result<()> {
    op.check(T::DTYPE)?;
    scale.check(T::DTYPE)?;
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
    unsafe {
        kernels::reduce_raw_on(kernels, T::DTYPE, op, scale, &ptrs, &[out.as_mut_ptr().cast()], out.len())
    };
    Ok(())
}

/// Divide every element by `divisor` in place: AVERAGE for backends that can only sum (e.g. MPI).
pub fn scale<T: Element>(buf: &mut [T], divisor: usize) -> Result<()> {
    scale_on(Kernels::active(), buf, divisor)
}

/// [`scale`] on kernel set `kernels` (or the fastest below it that this CPU has).
pub fn scale_on<T: Element>(kernels: Kernels, buf: &mut [T], divisor: usize) -> Result<()> {
    ReduceOp::Average.check(T::DTYPE)?;
    // SAFETY: a unique borrow of `buf.len()` values of `T`, whose tag is `T::DTYPE`; checked above.
    unsafe { kernels::divide_raw_on(kernels, T::DTYPE, buf.as_mut_ptr().cast(), buf.len(), divisor) };
    Ok(())
}
