//! Element types the collectives carry, and type-erased buffer views over them.
//!
//! The backend trait is object-safe, so buffers cross it as bytes tagged with a [`DType`]; the typed
//! [`Element`] trait is how Rust callers (and the reduce kernels) get back to real types.

use std::fmt;
use std::marker::PhantomData;

use half::{bf16, f16};
use num_complex::{Complex32, Complex64};

use crate::error::{Error, Result};

/// The element types every backend supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// IEEE half precision; reduced in f32 and rounded once.
    F16 = 1,
    /// IEEE single precision.
    F32 = 2,
    /// IEEE double precision.
    F64 = 3,
    /// Signed 8-bit integer (wrapping arithmetic, like numpy).
    I8 = 4,
    /// Unsigned 8-bit integer (wrapping arithmetic, like numpy).
    U8 = 5,
    /// Signed 32-bit integer (wrapping arithmetic, like numpy).
    I32 = 6,
    /// Signed 64-bit integer (wrapping arithmetic, like numpy).
    I64 = 7,
    /// bfloat16 (torch's); reduced in f32 and rounded once, like float16.
    BF16 = 8,
    /// Booleans, one byte each (any nonzero byte is true): SUM and MAX are OR, PRODUCT and MIN are
    /// AND, as in torch and numpy; AVERAGE is refused. Carried as bytes, so no Rust `bool` is read
    /// from memory that might hold another value; Rust callers pass them with `Buf::from_raw`.
    Bool = 9,
    /// Signed 16-bit integer (wrapping arithmetic, like numpy).
    I16 = 10,
    /// Unsigned 16-bit integer (wrapping arithmetic, like numpy).
    U16 = 11,
    /// Unsigned 32-bit integer (wrapping arithmetic, like numpy).
    U32 = 12,
    /// Unsigned 64-bit integer (wrapping arithmetic, like numpy).
    U64 = 13,
    /// Complex of two f32 (real, imaginary): SUM, PRODUCT and AVERAGE only.
    C64 = 14,
    /// Complex of two f64 (real, imaginary): SUM, PRODUCT and AVERAGE only.
    C128 = 15,
}

impl DType {
    /// Every supported dtype.
    pub const ALL: [DType; 15] = [
        DType::F16,
        DType::F32,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::BF16,
        DType::Bool,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::C64,
        DType::C128,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    /// numpy's (and, for bfloat16, torch's) name for it.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::BF16 => "bfloat16",
            DType::Bool => "bool",
            DType::I16 => "int16",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
        }
    }

    /// True for the real floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::F32 | DType::F64 | DType::BF16)
    }

    /// True for the complex types.
    pub const fn is_complex(self) -> bool {
        matches!(self, DType::C64 | DType::C128)
    }

    /// The alignment its elements need (a complex one: that of its parts, as in numpy).
    pub const fn align(self) -> usize {
        match self {
            DType::C64 => 4,
            DType::C128 => 8,
            d => d.size(),
        }
    }

    /// The dtype with this `repr(u8)` code (used by the shared-memory wire format).
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| *d as u8 == code)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that is one of the supported [`DType`]s. Sealed (users cannot implement it): its tag
/// tells every kernel what the memory behind a [`Buf`] holds.
pub trait Element: sealed::Sealed + Copy + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// Its dtype tag.
    const DTYPE: DType;
}

mod sealed {
    /// Implemented for the [`super::Element`] types only; not nameable outside this module.
    pub trait Sealed {}
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(
    f16 => F16, f32 => F32, f64 => F64, i8 => I8, u8 => U8, i32 => I32, i64 => I64, bf16 => BF16,
    i16 => I16, u16 => U16, u32 => U32, u64 => U64, Complex32 => C64, Complex64 => C128
);

/// A read-only, type-erased view of a contiguous buffer.
#[derive(Clone, Copy)]
pub struct Buf<'a> {
    dtype: DType,
    ptr: *const u8,
    len: usize,
    _life: PhantomData<&'a [u8]>,
}

/// A writable, type-erased view of a contiguous buffer.
pub struct BufMut<'a> {
    dtype: DType,
    ptr: *mut u8,
    len: usize,
    _life: PhantomData<&'a mut [u8]>,
}

// SAFETY: both are plain borrows of `[T]` with `T: Send + Sync`, carried as pointers to erase `T`.
unsafe impl Send for Buf<'_> {}
// SAFETY: as above.
unsafe impl Sync for Buf<'_> {}
// SAFETY: as above; a `BufMut` is a unique borrow.
unsafe impl Send for BufMut<'_> {}

impl<'a> Buf<'a> {
    /// View a typed slice.
    pub fn new<T: Element>(s: &'a [T]) -> Self {
        Buf { dtype: T::DTYPE, ptr: s.as_ptr().cast(), len: s.len(), _life: PhantomData }
    }

    /// View raw memory as `len` elements of `dtype`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len * dtype.size()` bytes, aligned for `dtype`, and not written
    /// by anyone else for `'a`.
    pub unsafe fn from_raw(dtype: DType, ptr: *const u8, len: usize) -> Self {
        Buf { dtype, ptr, len, _life: PhantomData }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * self.dtype.size()
    }
    /// Start of the data.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    /// The data as bytes.
    pub fn bytes(&self) -> &'a [u8] {
        // SAFETY: constructed from a valid borrow of `byte_len` bytes (or a zero-length dangling pointer).
        unsafe { std::slice::from_raw_parts(self.ptr, self.byte_len()) }
    }
    /// Back to a typed slice, if `T` is this buffer's type.
    pub fn typed<T: Element>(&self) -> Option<&'a [T]> {
        // SAFETY: the dtype tag says the memory holds `len` values of `T`.
        (T::DTYPE == self.dtype).then(|| unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len) })
    }
}

impl<'a> BufMut<'a> {
    /// View a typed mutable slice.
    pub fn new<T: Element>(s: &'a mut [T]) -> Self {
        BufMut { dtype: T::DTYPE, ptr: s.as_mut_ptr().cast(), len: s.len(), _life: PhantomData }
    }

    /// View raw memory as `len` writable elements of `dtype`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len * dtype.size()` bytes, aligned for `dtype`, and
    /// not accessed by anyone else for `'a`.
    pub unsafe fn from_raw(dtype: DType, ptr: *mut u8, len: usize) -> Self {
        BufMut { dtype, ptr, len, _life: PhantomData }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * self.dtype.size()
    }
    /// Start of the data. Writing through it is how peers deliver results.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    /// A read-only view of the same memory, for as long as this borrow lives.
    pub fn as_buf(&self) -> Buf<'_> {
        Buf { dtype: self.dtype, ptr: self.ptr, len: self.len, _life: PhantomData }
    }
    /// The data as mutable bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: constructed from a valid unique borrow of `byte_len` bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.byte_len()) }
    }
}

/// Fails unless `buf` holds `dtype`; the message names the argument.
pub(crate) fn expect_dtype(what: &str, got: DType, want: DType) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::invalid(format!("{what} has dtype {got} but the operation needs {want}")))
    }
}
