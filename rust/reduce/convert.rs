//! float16 and bfloat16 to and from their f32 accumulator a vector at a time, with bitwise the results
//! of the `half` crate's element-by-element conversions.
//!
//! bfloat16 is bit arithmetic on one element, written without branches so the compiler vectorises it
//! in the kernel loop it is inlined into (every set, the baseline too: it is the type's `load` and
//! `store`, so a bfloat16 reduction runs the float32 loops, two inputs in one pass). AVX-512 BF16's `vcvtneps2bf16` is not used: it
//! flushes subnormal results to zero (f32 bits 0x0000_c000 give 0x0000, `half` gives 0x0001), and the
//! fix-up would cost what the bit arithmetic does. float16 uses F16C's `vcvtph2ps`/`vcvtps2ph` (the
//! instructions `half` runs one element at a time when the CPU has F16C), 8 or 16 at a time.

use half::{bf16, f16};

/// `half`'s `bf16::to_f32`: the bits shifted up, a NaN quieted (its top mantissa bit set).
#[inline(always)]
pub(super) fn bf16_to_f32(s: bf16) -> f32 {
    let b = s.to_bits() as u32;
    let nan = b & 0x7fff > 0x7f80;
    f32::from_bits((b | if nan { 0x40 } else { 0 }) << 16)
}

/// `half`'s `bf16::from_f32`: round to nearest, ties to even (adding 0x7fff plus the kept lowest bit
/// carries exactly when the dropped half is above a tie, or a tie with an odd kept part); a NaN keeps
/// its top bits, quieted.
#[inline(always)]
pub(super) fn f32_to_bf16(s: f32) -> bf16 {
    let x = s.to_bits();
    let nan = x & 0x7fff_ffff > 0x7f80_0000;
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
    bf16::from_bits(if nan { (x >> 16) | 0x40 } else { rounded } as u16)
}

/// [`bf16_to_f32`] of every element.
#[cfg(test)]
pub(super) fn bf16_widen(src: &[bf16], dst: &mut [f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = bf16_to_f32(*s));
}

/// [`f32_to_bf16`] of every element.
#[cfg(test)]
pub(super) fn bf16_narrow(src: &[f32], dst: &mut [bf16]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d = f32_to_bf16(*s));
}

/// float16 to f32, 8 at a time, then the tail one by one (`half` runs F16C there too).
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn f16_widen_avx2(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let body = n - n % 8;
    for i in (0..body).step_by(8) {
        // SAFETY: i + 8 <= n, within both slices; unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    for i in body..n {
        dst[i] = src[i].to_f32();
    }
}

/// f32 to float16 rounded to nearest even, 8 at a time, then the tail one by one.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn f16_narrow_avx2(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let body = n - n % 8;
    for i in (0..body).step_by(8) {
        // SAFETY: i + 8 <= n, within both slices; unaligned loads and stores.
        unsafe {
            let x = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(x);
            _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    for i in body..n {
        dst[i] = f16::from_f32(src[i]);
    }
}

/// float16 to f32, 16 at a time, then the tail one by one.
///
/// # Safety
/// The CPU must have AVX-512 F and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
pub(super) unsafe fn f16_widen_avx512(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let body = n - n % 16;
    for i in (0..body).step_by(16) {
        // SAFETY: i + 16 <= n, within both slices; unaligned loads and stores.
        unsafe {
            let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
    }
    for i in body..n {
        dst[i] = src[i].to_f32();
    }
}

/// f32 to float16 rounded to nearest even, 16 at a time, then the tail one by one.
///
/// # Safety
/// The CPU must have AVX-512 F and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
pub(super) unsafe fn f16_narrow_avx512(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let body = n - n % 16;
    for i in (0..body).step_by(16) {
        // SAFETY: i + 16 <= n, within both slices; unaligned loads and stores.
        unsafe {
            let x = _mm512_loadu_ps(src.as_ptr().add(i));
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(x);
            _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), h);
        }
    }
    for i in body..n {
        dst[i] = f16::from_f32(src[i]);
    }
}
