//! Gradient buckets: many gradients packed into one flat buffer, so one collective serves them all, and
//! the layout that assigns parameters to buckets.
//!
//! The buffer is allocated once and never moves afterwards: views handed out over it (the Python
//! `data_mut()`, the DDPs' gradient views) stay valid for the bucket's whole life, and `clear()` only
//! forgets the contents. A bucket grows as gradients are added (allocated at its capacity when the first
//! one fixes the dtype), or is laid out whole up front ([`GradientBucket::laid_out`]), in memory the
//! group's members share when the backend has some, so that its all-reduce copies nothing through staging.

use std::collections::HashMap;
use std::hash::Hash;

use crate::backend::{Backend, SharedMem};
use crate::dtype::{Buf, BufMut, DType, Element};
use crate::error::{Error, Result};

/// Group parameters into buckets, in the order the buckets are reduced: `nbytes[i]` and `dtypes[i]`
/// (any key: a dtype, or whatever stands for one) describe parameter i.
///
/// Parameters are taken in reverse order (backward produces gradients roughly last layer first), one open
/// bucket per dtype; a bucket is closed before it would pass `cap_bytes`, so only a single parameter
/// larger than the cap makes a bucket exceed it. The bucket whose first parameter comes latest (whose
/// gradients are ready first) comes first. Unlike torch there is no smaller first bucket, nor a rebuild
/// in the order the first backward produced gradients.
pub fn assign_buckets<K: Hash + Eq + Clone>(
    nbytes: &[usize],
    dtypes: &[K],
    cap_bytes: usize,
) -> Vec<Vec<usize>> {
    let mut open: HashMap<K, (Vec<usize>, usize)> = HashMap::new();
    // Open buckets in the order their dtype first appeared, so the result does not depend on hashing.
    let mut order: Vec<K> = Vec::new();
    let mut closed: Vec<Vec<usize>> = Vec::new();
    for i in (0..nbytes.len().min(dtypes.len())).rev() {
        let (members, size) = open.entry(dtypes[i].clone()).or_insert_with(|| {
            order.push(dtypes[i].clone());
            (Vec::new(), 0)
        });
        if !members.is_empty() && size.saturating_add(nbytes[i]) > cap_bytes {
            closed.push(std::mem::take(members));
            *size = 0;
        }
        members.push(i);
        *size = size.saturating_add(nbytes[i]);
    }
    closed.extend(order.iter().filter_map(|k| open.remove(k)).map(|(members, _)| members));
    closed.sort_by_key(|members| std::cmp::Reverse(members[0]));
    closed
}

/// One gradient's place in the bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// First element in the flat buffer.
    pub offset: usize,
    /// The gradient's shape (its element count is the product).
    pub shape: Vec<usize>,
}

impl Entry {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// True for a zero-element gradient.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a bucket's elements live.
enum Storage {
    /// 8-byte words so every dtype is aligned.
    Private(Vec<u64>),
    /// Memory the group's members share (see [`Backend::alloc`]).
    Shared(SharedMem),
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Storage::Private(_) => "Private",
            Storage::Shared(_) => "Shared",
        })
    }
}

impl Storage {
    fn as_ptr(&self) -> *mut u8 {
        match self {
            Storage::Private(v) => v.as_ptr().cast_mut().cast(),
            Storage::Shared(m) => m.as_ptr(),
        }
    }
}

/// A fixed-capacity flat buffer of gradients of one dtype.
#[derive(Debug)]
pub struct GradientBucket {
    capacity: usize,
    dtype: Option<DType>,
    /// `capacity` elements once the dtype is known.
    storage: Storage,
    len: usize,
    entries: Vec<Entry>,
    /// When its last all-reduce returned (the synchronizer's step figures and the timeline read it).
    pub(crate) reduced_at: Option<std::time::Instant>,
}

impl GradientBucket {
    /// A bucket for up to `capacity` elements. Nothing is allocated until the first gradient.
    pub fn new(capacity: usize) -> Self {
        GradientBucket {
            capacity,
            dtype: None,
            storage: Storage::Private(Vec::new()),
            len: 0,
            entries: Vec::new(),
            reduced_at: None,
        }
    }

    /// A full bucket of zeros for gradients of `dtype` and `shapes`, one after the other, in memory
    /// `backend` shares with its peers when it has some (else private memory).
    pub fn laid_out(dtype: DType, shapes: Vec<Vec<usize>>, backend: Option<&dyn Backend>) -> Result<Self> {
        let mut entries = Vec::with_capacity(shapes.len());
        let mut len = 0usize;
        for shape in shapes {
            let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let end = n.and_then(|n| len.checked_add(n)).ok_or_else(|| {
                Error::invalid(format!(
                    "a bucket of gradients of shape {shape:?} is larger than any address space"
                ))
            })?;
            entries.push(Entry { offset: len, shape });
            len = end;
        }
        let shared = match (backend, len.checked_mul(dtype.size())) {
            (Some(b), Some(bytes)) if bytes > 0 => b.alloc(bytes)?,
            _ => None,
        };
        let storage = match shared {
            Some(mem) => {
                // SAFETY: the allocation holds `len * dtype.size()` bytes, owned by this bucket alone.
                unsafe { std::ptr::write_bytes(mem.as_ptr(), 0, len * dtype.size()) };
                Storage::Shared(mem)
            }
            None => Storage::Private(storage(len, dtype)?),
        };
        Ok(GradientBucket { capacity: len, dtype: Some(dtype), storage, len, entries, reduced_at: None })
    }

    /// True when the buffer lives in memory the group's members share.
    pub fn is_shared(&self) -> bool {
        matches!(self.storage, Storage::Shared(_))
    }

    /// Capacity in elements.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Elements in use.
    pub fn size(&self) -> usize {
        self.len
    }
    /// True when no gradient is in the bucket.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// True when not one more element fits.
    pub fn is_full(&self) -> bool {
        self.len == self.capacity
    }
    /// The dtype, once the first gradient fixed it.
    pub fn dtype(&self) -> Option<DType> {
        self.dtype
    }
    /// The gradients' places, in the order they were added.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Copy `grad` (with `shape`) in. Returns false, adding nothing, when it does not fit; fails when its
    /// dtype differs from the bucket's or its length from the shape.
    pub fn add_buf(&mut self, grad: Buf<'_>, shape: &[usize]) -> Result<bool> {
        if shape.iter().product::<usize>() != grad.len() {
            return Err(Error::invalid(format!(
                "a gradient of shape {shape:?} must have {} elements, not {}",
                shape.iter().product::<usize>(),
                grad.len()
            )));
        }
        match self.dtype {
            Some(d) if d != grad.dtype() => {
                return Err(Error::invalid(format!(
                    "this bucket holds {d} gradients; a {} gradient needs a bucket of its own",
                    grad.dtype()
                )))
            }
            Some(_) => {}
            None => {
                self.storage = Storage::Private(storage(self.capacity, grad.dtype())?);
                self.dtype = Some(grad.dtype());
            }
        }
        if self.len.checked_add(grad.len()).is_none_or(|end| end > self.capacity) {
            return Ok(false);
        }
        let start = self.len * grad.dtype().size();
        // SAFETY: `start + byte_len` is within the capacity (checked above) of the storage allocated for
        // this dtype. Only the new range is touched: a view of the used part may be in a collective.
        unsafe {
            let dst = self.storage.as_ptr().add(start);
            std::ptr::copy_nonoverlapping(grad.as_ptr(), dst, grad.byte_len());
        }
        self.entries.push(Entry { offset: self.len, shape: shape.to_vec() });
        self.len += grad.len();
        Ok(true)
    }

    /// Copy a 1-D gradient in (see [`GradientBucket::add_buf`]).
    pub fn add<T: Element>(&mut self, grad: &[T]) -> Result<bool> {
        self.add_buf(Buf::new(grad), &[grad.len()])
    }

    /// The used part of the flat buffer.
    pub fn data(&self) -> Buf<'_> {
        let dtype = self.dtype.unwrap_or(DType::F32);
        // SAFETY: `len` elements of `dtype` were written into the aligned storage (none when empty).
        unsafe { Buf::from_raw(dtype, self.storage.as_ptr(), self.len) }
    }

    /// The used part of the flat buffer, writable (e.g. to all-reduce it in place).
    pub fn data_mut(&mut self) -> BufMut<'_> {
        let dtype = self.dtype.unwrap_or(DType::F32);
        // SAFETY: as for `data`, with the unique borrow of `self`.
        unsafe { BufMut::from_raw(dtype, self.storage.as_ptr(), self.len) }
    }

    /// Address of the flat buffer; stable for the bucket's life once the dtype is set.
    pub fn as_ptr(&self) -> *const u8 {
        self.storage.as_ptr()
    }

    /// Zero the elements of entry `i` (a gradient this rank does not have counts as zeros).
    pub fn zero_entry(&mut self, i: usize) {
        let (Some(e), Some(dtype)) = (self.entries.get(i), self.dtype) else { return };
        let size = dtype.size();
        // SAFETY: the entry lies within the `len` elements written into the storage.
        unsafe { std::ptr::write_bytes(self.storage.as_ptr().add(e.offset * size), 0, e.len() * size) };
    }

    /// The gradients back, as (shape, values), in the order they were added.
    pub fn extract<T: Element>(&self) -> Result<Vec<(Vec<usize>, Vec<T>)>> {
        let data = match self.dtype {
            None => return Ok(Vec::new()),
            Some(_) => self.data().typed::<T>().ok_or_else(|| {
                Error::invalid(format!("extract: the bucket holds {}, not {}", self.data().dtype(), T::DTYPE))
            })?,
        };
        Ok(self
            .entries
            .iter()
            .map(|e| (e.shape.clone(), data[e.offset..e.offset + e.len()].to_vec()))
            .collect())
    }

    /// Forget every gradient (the allocation and dtype stay, so views remain valid).
    pub fn clear(&mut self) {
        self.len = 0;
        self.entries.clear();
    }
}

/// Zeroed 8-byte words for `capacity` elements of `dtype`: a clear error, never a wrapped size or an
/// allocation failure that aborts the process. Zeroed by the allocator, so pages are touched only
/// as gradients fill them.
fn storage(capacity: usize, dtype: DType) -> Result<Vec<u64>> {
    let too_large = || {
        Error::invalid(format!("a bucket of {capacity} {dtype} elements is larger than any address space"))
    };
    let bytes = capacity.checked_mul(dtype.size()).ok_or_else(too_large)?;
    let words = bytes.div_ceil(8);
    if words == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u64>(words).map_err(|_| too_large())?;
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u64>();
    if ptr.is_null() {
        return Err(Error::OutOfMemory(format!(
            "cannot allocate a bucket of {capacity} {dtype} elements ({bytes} bytes)"
        )));
    }
    // SAFETY: allocated by the global allocator with the layout of `words` u64s, all zero (valid u64s).
    Ok(unsafe { Vec::from_raw_parts(ptr, words, words) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_overflow_and_dtype_mixing() {
        let mut b = GradientBucket::new(5);
        assert!(b.add(&[0.1f32, 0.2]).unwrap());
        assert!(b.add(&[0.3f32, 0.4, 0.5]).unwrap());
        assert!(b.is_full());
        assert!(!b.add(&[1.0f32]).unwrap(), "overflow adds nothing");
        assert!(b.add(&[1.0f64]).is_err(), "one dtype per bucket");
        let got = b.extract::<f32>().unwrap();
        assert_eq!(got, vec![(vec![2], vec![0.1, 0.2]), (vec![3], vec![0.3, 0.4, 0.5])]);
        let before = b.as_ptr();
        b.clear();
        assert!(b.is_empty() && b.add(&[7.0f32]).unwrap());
        assert_eq!(b.as_ptr(), before, "the buffer never moves");
    }

    #[test]
    fn layout_is_reverse_order_per_dtype_under_the_cap() {
        assert_eq!(
            assign_buckets(&[8, 4, 8, 4], &["f8", "f4", "f8", "f4"], 1 << 20),
            vec![vec![3, 1], vec![2, 0]]
        );
        assert_eq!(assign_buckets(&[4, 4, 4, 4], &[0, 0, 0, 0], 8), vec![vec![3, 2], vec![1, 0]]);
        assert_eq!(assign_buckets(&[4, 100, 4], &[0, 0, 0], 8), vec![vec![2], vec![1], vec![0]]);
        assert!(assign_buckets::<u8>(&[], &[], 8).is_empty());
    }

    #[test]
    fn laid_out_buckets_are_zeroed_and_full() {
        let mut b = GradientBucket::laid_out(DType::F64, vec![vec![2, 3], vec![0], vec![4]], None).unwrap();
        assert!(b.is_full() && !b.is_shared());
        assert_eq!(b.entries().iter().map(|e| e.offset).collect::<Vec<_>>(), vec![0, 6, 6]);
        assert!(b.data().typed::<f64>().unwrap().iter().all(|&x| x == 0.0));
        b.data_mut().bytes_mut().fill(0xff);
        b.zero_entry(2);
        assert_eq!(b.data().bytes()[5 * 8..].iter().map(|&x| x as u32).sum::<u32>(), 0xff * 8);
    }
}
