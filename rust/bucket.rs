//! Gradient buckets: many gradients packed into one flat buffer, so one collective serves them all.
//!
//! The buffer is allocated once, at the bucket's capacity, when the first gradient fixes the dtype, and
//! never moves afterwards: views handed out over it (the Python `data_mut()`) stay valid for the bucket's
//! whole life, and `clear()` only forgets the contents.

use crate::dtype::{Buf, BufMut, DType, Element};
use crate::error::{Error, Result};

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

/// A fixed-capacity flat buffer of gradients of one dtype.
#[derive(Debug)]
pub struct GradientBucket {
    capacity: usize,
    dtype: Option<DType>,
    /// 8-byte words so every dtype is aligned; `capacity` elements once the dtype is known.
    storage: Vec<u64>,
    len: usize,
    entries: Vec<Entry>,
}

impl GradientBucket {
    /// A bucket for up to `capacity` elements. Nothing is allocated until the first gradient.
    pub fn new(capacity: usize) -> Self {
        GradientBucket { capacity, dtype: None, storage: Vec::new(), len: 0, entries: Vec::new() }
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
                self.storage = storage(self.capacity, grad.dtype())?;
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
            let dst = self.storage.as_mut_ptr().cast::<u8>().add(start);
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
        unsafe { Buf::from_raw(dtype, self.storage.as_ptr().cast(), self.len) }
    }

    /// The used part of the flat buffer, writable (e.g. to all-reduce it in place).
    pub fn data_mut(&mut self) -> BufMut<'_> {
        let dtype = self.dtype.unwrap_or(DType::F32);
        // SAFETY: as for `data`, with the unique borrow of `self`.
        unsafe { BufMut::from_raw(dtype, self.storage.as_mut_ptr().cast(), self.len) }
    }

    /// Address of the flat buffer; stable for the bucket's life once the dtype is set.
    pub fn as_ptr(&self) -> *const u8 {
        self.storage.as_ptr().cast()
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
}
