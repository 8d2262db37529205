//! numpy arrays (and CPU torch tensors, by their DLPack description or through their zero-copy numpy view) in
//! and out: dtype dispatch, borrow-checked views, and the checks in-place operations need (C-contiguous,
//! writable, aligned). Errors: TypeError for a dtype or type we cannot take, ValueError for a layout or borrow
//! we cannot use. numpy has no bfloat16 of its own: a bfloat16 tensor, or a numpy array of
//! `ml_dtypes.bfloat16` (when ml_dtypes is loaded), travels as a zero-copy int16 view of its bits,
//! tagged bfloat16.

use half::f16;
use numpy::ndarray::{ArrayViewD, IxDyn};
use numpy::{
    BorrowError, Complex32, Complex64, PyArrayDescr, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods,
    PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCapsule, PyType};

use crate::dtype::{Buf, BufMut, DType};

/// Run `$body` with `$t` bound to the Rust type of `$dtype`: the one table from dtype to Rust type.
/// bfloat16 is its bits: numpy arrays of it are int16 views (see `ndarray_of`).
macro_rules! with_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        with_type!(@ $dtype, $t, $body, F16 f16, F32 f32, F64 f64, I8 i8, U8 u8, I32 i32, I64 i64,
            BF16 i16, Bool bool, I16 i16, U16 u16, U32 u32, U64 u64, C64 Complex32, C128 Complex64)
    };
    (@ $dtype:expr, $t:ident, $body:expr, $($d:ident $ty:ty),*) => {
        match $dtype {
            $(DType::$d => {
                type $t = $ty;
                $body
            })*
        }
    };
}

/// The address and extent of an array's data, for work that outlives the borrow guard (async jobs,
/// detached closures). Whoever uses it must keep the array alive.
#[derive(Clone, Copy)]
pub(crate) struct RawArray {
    pub dtype: DType,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain address; the users below document how they keep the memory alive.
unsafe impl Send for RawArray {}
// SAFETY: as above; sharing the address does not access the memory.
unsafe impl Sync for RawArray {}

impl RawArray {
    /// Its elements.
    pub fn len(self) -> usize {
        self.len
    }
    /// # Safety
    /// The array must be alive, and not accessed by anyone else while the view is used.
    pub unsafe fn buf_mut<'a>(self) -> BufMut<'a> {
        // SAFETY: forwarded.
        unsafe { BufMut::from_raw(self.dtype, self.ptr, self.len) }
    }
    /// # Safety
    /// The array must be alive and not written while the view is used.
    pub unsafe fn buf<'a>(self) -> Buf<'a> {
        // SAFETY: forwarded.
        unsafe { Buf::from_raw(self.dtype, self.ptr, self.len) }
    }
}

/// Anything kept alive only for its `Drop` (a typed numpy borrow guard, whatever its element type).
trait Held {}
impl<T> Held for T {}

/// A borrowed array: the numpy borrow flag is held until this is dropped.
pub(crate) struct Array<'py> {
    pub raw: RawArray,
    pub obj: Bound<'py, PyAny>,
    pub shape: Vec<usize>,
    _guard: Box<dyn Held + 'py>,
}

/// The collective dtype of a numpy dtype (an int16 array is not bfloat16: torch's bfloat16 only ever
/// comes tagged, see `ndarray_of`; ml_dtypes' is recognised by its descriptor).
pub(crate) fn dtype_of(d: &Bound<'_, PyArrayDescr>) -> Option<DType> {
    // By kind and size (what numpy's equivalence of these plain types comes down to), rather than by
    // comparing with each candidate: this is on every call's path.
    if d.is_native_byteorder() == Some(false) || d.has_fields() || d.has_subarray() {
        return None;
    }
    let found = match (d.kind(), d.itemsize()) {
        (b'f', 2) => DType::F16,
        (b'f', 4) => DType::F32,
        (b'f', 8) => DType::F64,
        (b'i', 1) => DType::I8,
        (b'u', 1) => DType::U8,
        (b'i', 4) => DType::I32,
        (b'i', 8) => DType::I64,
        (b'b', 1) => DType::Bool,
        (b'i', 2) => DType::I16,
        (b'u', 2) => DType::U16,
        (b'u', 4) => DType::U32,
        (b'u', 8) => DType::U64,
        (b'c', 8) => DType::C64,
        (b'c', 16) => DType::C128,
        (b'V', 2) if ml_bfloat16(d.py()).is_some_and(|b| d.is_equiv_to(b)) => return Some(DType::BF16),
        _ => return None,
    };
    debug_assert!(with_type!(found, T => d.is_equiv_to(&numpy::dtype::<T>(d.py()))));
    Some(found)
}

/// `ml_dtypes.bfloat16`'s descriptor, once ml_dtypes is loaded (never imported here).
fn ml_bfloat16(py: Python<'_>) -> Option<&Bound<'_, PyArrayDescr>> {
    static BF16: PyOnceLock<Py<PyArrayDescr>> = PyOnceLock::new();
    if let Some(d) = BF16.get(py) {
        return Some(d.bind(py));
    }
    let m = py.import("sys").ok()?.getattr("modules").ok()?.get_item("ml_dtypes").ok()?;
    let descr = PyArrayDescr::new(py, m.getattr("bfloat16").ok()?).ok()?.unbind();
    Some(BF16.get_or_init(py, || descr).bind(py))
}

/// The TypeError for a dtype no collective takes, naming those they do.
pub(crate) fn unsupported(what: &str, d: &Bound<'_, PyAny>) -> PyErr {
    let names: Vec<&str> = DType::ALL.iter().filter(|d| **d != DType::BF16).map(|d| d.name()).collect();
    PyTypeError::new_err(format!(
        "{what} has dtype {d}, which is not supported; use one of {} (native byte order), or bfloat16 \
         (a torch tensor, or numpy with ml_dtypes)",
        names.join(", ")
    ))
}

/// torch's objects we compare against, looked up once torch is loaded (never imported here: without
/// torch loaded, nothing is a tensor).
struct Torch {
    tensor: Py<PyType>,
    bfloat16: Py<PyAny>,
    int16: Py<PyAny>,
    /// `torch._C._to_dlpack` (what `torch.utils.dlpack.to_dlpack` is), if this torch has it.
    to_dlpack: Option<Py<PyAny>>,
    /// torch's dtype objects, one per collective dtype (torch names them as the core does).
    dtypes: Vec<(Py<PyAny>, DType)>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn torch(py: Python<'_>) -> PyResult<Option<&Torch>> {
    if let Some(t) = TORCH.get(py) {
        return Ok(Some(t));
    }
    let Ok(m) = py.import("sys")?.getattr("modules")?.get_item("torch") else {
        return Ok(None);
    };
    let t = Torch {
        tensor: m.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
        bfloat16: m.getattr("bfloat16")?.unbind(),
        int16: m.getattr("int16")?.unbind(),
        to_dlpack: m.getattr("_C").and_then(|c| c.getattr("_to_dlpack")).ok().map(Bound::unbind),
        dtypes: DType::ALL
            .iter()
            .map(|&d| Ok((m.getattr(d.name())?.unbind(), d)))
            .collect::<PyResult<_>>()?,
    };
    Ok(Some(TORCH.get_or_init(py, || t)))
}

/// True when `obj` is a torch tensor.
pub(crate) fn is_tensor(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if obj.cast::<PyUntypedArray>().is_ok() {
        return Ok(false); // the common case, without looking for torch
    }
    match torch(obj.py())? {
        Some(t) => obj.is_instance(t.tensor.bind(obj.py())),
        None => Ok(false),
    }
}

/// DLPack's C structs (`dlpack.h`, the unversioned ABI that `torch._C._to_dlpack` exports in a capsule
/// named "dltensor"): fixed by the DLPack spec, so read here rather than through a crate.
mod dlpack {
    use std::ffi::c_void;

    /// `kDLCPU`.
    pub const CPU: i32 = 1;

    #[repr(C)]
    pub struct Device {
        pub device_type: i32,
        pub device_id: i32,
    }

    #[repr(C)]
    pub struct DataType {
        pub code: u8,
        pub bits: u8,
        pub lanes: u16,
    }

    #[repr(C)]
    pub struct Tensor {
        pub data: *mut c_void,
        pub device: Device,
        pub ndim: i32,
        pub dtype: DataType,
        pub shape: *const i64,
        /// In elements; null means C-contiguous.
        pub strides: *const i64,
        pub byte_offset: u64,
    }

    /// Only its first field is read; the capsule's destructor calls its deleter.
    #[repr(C)]
    pub struct ManagedTensor {
        pub dl_tensor: Tensor,
    }
}

/// The C-contiguous shape and data address of the tensor a DLPack capsule describes, if it is in CPU
/// memory, holds elements of `dtype`'s size, and is C-contiguous as torch's `is_contiguous()` means it
/// (a dimension of size 1 may have any stride).
fn dlpack_dense(capsule: &Bound<'_, PyAny>, dtype: DType) -> Option<(Vec<usize>, usize)> {
    let capsule = capsule.cast::<PyCapsule>().ok()?;
    let ptr = capsule.pointer_checked(Some(c"dltensor")).ok()?;
    // SAFETY: a capsule named "dltensor" holds a DLManagedTensor (the DLPack protocol), alive while the
    // capsule is, and not consumed: its name would have changed.
    let t = unsafe { &ptr.cast::<dlpack::ManagedTensor>().as_ref().dl_tensor };
    let elem_bits = dtype.size().checked_mul(8)?;
    if t.device.device_type != dlpack::CPU || t.dtype.lanes != 1 || usize::from(t.dtype.bits) != elem_bits {
        return None;
    }
    let ndim = usize::try_from(t.ndim).ok()?;
    let dims = |p: *const i64| -> Option<Vec<usize>> {
        if ndim == 0 {
            return Some(vec![]);
        }
        // SAFETY: a non-null `shape` (or `strides`) holds `ndim` values, alive with the capsule.
        let v = unsafe { std::slice::from_raw_parts(p, ndim) };
        v.iter().map(|&d| usize::try_from(d).ok()).collect()
    };
    if ndim > 0 && t.shape.is_null() {
        return None;
    }
    let shape = dims(t.shape)?;
    if !t.strides.is_null() {
        let strides = dims(t.strides)?;
        let mut expected = 1usize;
        for (&size, &stride) in shape.iter().zip(&strides).rev() {
            if size != 1 && stride != expected {
                return None;
            }
            expected = expected.checked_mul(size)?;
        }
    }
    let addr = (t.data as usize).checked_add(usize::try_from(t.byte_offset).ok()?)?;
    Some((shape, addr))
}

/// A plain CPU tensor's memory, taken by its data pointer: making a numpy view costs more than the rest
/// of a small collective. One call (`torch._C._to_dlpack`) gives its device, element size, shape,
/// strides and address; the rest is what DLPack does not say. None for anything else (not a tensor;
/// another device or layout, which DLPack refuses; a lazily conjugated or negated view, whose memory
/// does not hold its values; not contiguous or aligned; empty): the numpy-view path takes those, or says
/// why not. Like the view, it shares the memory of a tensor that requires grad (as `detach()` does).
fn tensor_array<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Option<Array<'py>>> {
    if !is_tensor(obj)? {
        return Ok(None);
    }
    let py = obj.py();
    let t = torch(py)?.expect("a tensor means torch is loaded");
    let Some(to_dlpack) = &t.to_dlpack else {
        return Ok(None);
    };
    let dt = obj.getattr(intern!(py, "dtype"))?;
    let Some(dtype) = t.dtypes.iter().find(|(d, _)| d.bind(py).is(&dt)).map(|&(_, d)| d) else {
        return Ok(None);
    };
    // DLPack exports the memory as stored: a lazy negation (any dtype) or conjugation (complex only)
    // is torch's to apply on read. Each must answer plainly (a tensor that cannot is not taken here).
    let says =
        |method, yes: bool| obj.call_method0(method).and_then(|v| v.is_truthy()).is_ok_and(|v| v == yes);
    let complex = matches!(dtype, DType::C64 | DType::C128);
    if !says(intern!(py, "is_neg"), false) || (complex && !says(intern!(py, "is_conj"), false)) {
        return Ok(None);
    }
    let Ok(storage) = obj.call_method0(intern!(py, "untyped_storage")) else {
        return Ok(None);
    };
    // Last: `_to_dlpack` runs no Python code (the calls above may, in a subclass's
    // `__torch_function__`), so the address read here is in the storage just taken. A tensor with no
    // plain memory of its own (sparse, mkldnn, a wrapper subclass, a nested tensor) has no DLPack
    // capsule, or no storage: the numpy-view path then says why it cannot be taken.
    let Some((shape, ptr)) = to_dlpack.bind(py).call1((obj,)).ok().and_then(|c| dlpack_dense(&c, dtype))
    else {
        return Ok(None);
    };
    let len = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    match len {
        // What is kept alive is the storage, not the tensor: `t.data = ...` or `t.set_(...)` while
        // queued work still uses the memory must not free it.
        Some(len) if len > 0 && ptr != 0 && ptr % dtype.align() == 0 => {
            let raw = RawArray { dtype, ptr: ptr as *mut u8, len };
            Ok(Some(Array { raw, obj: storage, shape, _guard: Box::new(()) }))
        }
        _ => Ok(None),
    }
}

/// `obj` as a numpy array and whether its elements are bfloat16: itself, or a CPU tensor's zero-copy
/// view (which keeps the tensor alive; a bfloat16 tensor's view is int16, as numpy has no bfloat16).
fn ndarray_of<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<(Bound<'py, PyAny>, bool)> {
    if !is_tensor(obj)? {
        return Ok((obj.clone(), false));
    }
    let py = obj.py();
    let t = torch(py)?.expect("a tensor means torch is loaded");
    let mut view = obj.call_method0("detach")?;
    let bf16 = view.getattr("dtype")?.is(t.bfloat16.bind(py));
    if bf16 {
        view = view.call_method1("view", (t.int16.bind(py),))?;
    }
    // A tensor on another device, or of a dtype numpy lacks, has no numpy view: torch says why.
    let arr = view.call_method0("numpy").map_err(|e| {
        PyTypeError::new_err(format!(
            "{what}: this torch tensor has no CPU numpy view ({e}); use a supported dtype"
        ))
    })?;
    Ok((arr, bf16))
}

/// `obj` as a numpy array: itself, or a CPU tensor's zero-copy view (bfloat16 as int16 bits).
pub(crate) fn as_ndarray<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyAny>> {
    Ok(ndarray_of(obj, what)?.0)
}

/// `out` (a numpy array) as the caller's type: a torch tensor sharing its memory when `like` is one.
pub(crate) fn like<'py>(out: Bound<'py, PyAny>, like: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if out.cast::<PyUntypedArray>().is_ok() && is_tensor(like)? {
        return out.py().import("torch")?.call_method1("from_numpy", (out,));
    }
    Ok(out)
}

/// `obj` as a C-contiguous numpy array, with the dtype its elements carry.
fn untyped<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<(Bound<'py, PyUntypedArray>, DType)> {
    let (arr, bf16) = ndarray_of(obj, what)?;
    let arr = arr.cast_into::<PyUntypedArray>().map_err(|e| {
        let obj = e.into_inner();
        let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        PyTypeError::new_err(format!("{what} must be a numpy.ndarray or a CPU torch.Tensor, got {ty}"))
    })?;
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what} must be C-contiguous (got strides {:?}); pass numpy.ascontiguousarray(a) or \
             t.contiguous() and copy the result back",
            arr.strides()
        )));
    }
    let dtype = match bf16 {
        true => DType::BF16,
        false => dtype_of(&arr.dtype()).ok_or_else(|| unsupported(what, arr.dtype().as_any()))?,
    };
    if dtype == DType::BF16 && !bf16 {
        // ml_dtypes' bfloat16: its bits as int16, zero-copy (the view keeps the array alive).
        let bits = arr.call_method1("view", (numpy::dtype::<i16>(arr.py()),))?;
        return Ok((bits.cast_into::<PyUntypedArray>()?, dtype));
    }
    Ok((arr, dtype))
}

fn borrow_error(what: &str, e: BorrowError) -> PyErr {
    match e {
        BorrowError::NotWriteable => PyValueError::new_err(format!(
            "{what} is read-only; an in-place collective needs a writable array"
        )),
        _ => PyValueError::new_err(format!(
            "{what} is already in use (the same array passed twice, or used by another running operation)"
        )),
    }
}

fn misaligned(what: &str) -> PyErr {
    PyValueError::new_err(format!("{what} is not aligned for its dtype; copy it into a fresh array"))
}

/// Borrow `obj` for reading and writing.
pub(crate) fn writable<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Array<'py>> {
    if let Some(t) = tensor_array(obj)? {
        return Ok(t);
    }
    let (arr, dtype) = untyped(obj, what)?;
    let shape = arr.shape().to_vec();
    with_type!(dtype, T => {
        let typed = arr.cast::<PyArrayDyn<T>>()?;
        let mut guard: PyReadwriteArrayDyn<'py, T> = typed.try_readwrite().map_err(|e| borrow_error(what, e))?;
        let slice = guard.as_slice_mut().map_err(|_| misaligned(what))?;
        let raw = RawArray { dtype, ptr: slice.as_mut_ptr().cast(), len: slice.len() };
        Ok(Array { raw, obj: arr.into_any(), shape, _guard: Box::new(guard) })
    })
}

/// Borrow `obj` for reading.
pub(crate) fn readable<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Array<'py>> {
    if let Some(t) = tensor_array(obj)? {
        return Ok(t);
    }
    let (arr, dtype) = untyped(obj, what)?;
    let shape = arr.shape().to_vec();
    with_type!(dtype, T => {
        let typed = arr.cast::<PyArrayDyn<T>>()?;
        let guard: PyReadonlyArrayDyn<'py, T> = typed.try_readonly().map_err(|e| borrow_error(what, e))?;
        let slice = guard.as_slice().map_err(|_| misaligned(what))?;
        let raw = RawArray { dtype, ptr: slice.as_ptr().cast_mut().cast(), len: slice.len() };
        Ok(Array { raw, obj: arr.into_any(), shape, _guard: Box::new(guard) })
    })
}

/// A new zero-filled array of `dtype` and `shape`, like `t` (numpy's own size checks: a ValueError or
/// MemoryError for a shape too large, never a wrapped size). bfloat16 gets a torch tensor when `t` is
/// one (numpy arrays of it cannot become tensors), else ml_dtypes' numpy array.
pub(crate) fn zeros<'py>(
    py: Python<'py>,
    dtype: DType,
    shape: &[usize],
    t: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    if dtype == DType::BF16 && !is_tensor(t)? {
        let descr = ml_bfloat16(py).ok_or_else(|| PyTypeError::new_err("bfloat16 arrays need ml_dtypes"))?;
        return py.import("numpy")?.call_method1("zeros", (shape.to_vec(), descr));
    }
    if dtype == DType::BF16 {
        let torch = py.import("torch")?;
        let kw = pyo3::types::PyDict::new(py);
        kw.set_item("dtype", torch.getattr("bfloat16")?)?;
        return torch.call_method("zeros", (shape.to_vec(),), Some(&kw));
    }
    let descr = with_type!(dtype, T => numpy::dtype::<T>(py));
    py.import("numpy")?.call_method1("zeros", (shape.to_vec(), descr))
}

/// A numpy array of `shape` over the elements of `dtype` at `ptr`, keeping `owner` alive as its base.
///
/// # Safety
/// `ptr` must hold product(shape) elements of `dtype`, aligned for it, valid and unmoved for as long as
/// `owner` lives, and used by nothing else than this array while it is writable.
pub(crate) unsafe fn view<'py>(
    owner: Bound<'py, PyAny>,
    dtype: DType,
    ptr: *const u8,
    shape: &[usize],
    writable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let arr = with_type!(dtype, T => {
        // SAFETY: the caller guarantees the elements at `ptr` for the owner's lifetime.
        let v = unsafe { ArrayViewD::<T>::from_shape_ptr(IxDyn(shape), ptr.cast::<T>()) };
        // SAFETY: as above; `owner` becomes the array's base and keeps the memory alive.
        unsafe { PyArrayDyn::<T>::borrow_from_array(&v, owner) }.into_any()
    });
    if !writable {
        arr.call_method1("setflags", (false,))?;
    }
    Ok(arr)
}
