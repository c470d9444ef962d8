//! Kernels for `f16` and `bf16`: blocks are widened to `f32`, combined in
//! `f32` and rounded (to nearest, ties to even) once when stored. An
//! N-input reduction therefore accumulates all N inputs in `f32` and rounds
//! once, and `Avg` divides the `f32` sum before rounding.
//!
//! `f16` widens and narrows through the `half` crate's slice conversions
//! (F16C `vcvtph2ps`/`vcvtps2ph` when the CPU has it, detected at run time);
//! `bf16` is the top half of an `f32`, converted by shifts in loops that
//! vectorise.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::arith::{Map, Op, Params};
use crate::native::BLOCK;
use crate::nontemporal;

/// How a 16-bit float type moves between memory and `f32` blocks.
pub(crate) trait Half: 'static {
    /// Widens `dst.len()` elements at `src` into `dst`.
    ///
    /// # Safety
    ///
    /// `src` readable for `dst.len()` 2-byte elements (no alignment needed).
    unsafe fn load(src: *const u8, dst: &mut [f32]);

    /// Rounds `src` and stores it at `dst`, streaming when `nt`.
    ///
    /// # Safety
    ///
    /// `dst` writable for `src.len()` 2-byte elements (no alignment needed).
    unsafe fn store(dst: *mut u8, src: &[f32], nt: bool);
}

/// IEEE binary16.
#[derive(Debug)]
pub(crate) struct F16;

impl Half for F16 {
    #[inline]
    unsafe fn load(src: *const u8, dst: &mut [f32]) {
        let mut bits = [f16::ZERO; BLOCK];
        let bits = &mut bits[..dst.len()];
        // SAFETY: the contract gives dst.len() * 2 readable bytes; `bits` is
        // a distinct local of that size.
        unsafe { std::ptr::copy_nonoverlapping(src, bits.as_mut_ptr().cast::<u8>(), size_of_val(bits)) };
        bits.convert_to_f32_slice(dst);
    }

    #[inline]
    unsafe fn store(dst: *mut u8, src: &[f32], nt: bool) {
        let mut bits = [f16::ZERO; BLOCK];
        let bits = &mut bits[..src.len()];
        bits.convert_from_f32_slice(src);
        // SAFETY: the contract gives src.len() * 2 writable bytes at dst.
        unsafe { nontemporal::store(dst, bits.as_ptr().cast::<u8>(), size_of_val(bits), nt) };
    }
}

/// bfloat16.
#[derive(Debug)]
pub(crate) struct BF16;

impl Half for BF16 {
    #[inline]
    unsafe fn load(src: *const u8, dst: &mut [f32]) {
        let src = src.cast::<u16>();
        for (j, d) in dst.iter_mut().enumerate() {
            // SAFETY: j < dst.len(), the contract.
            *d = f32::from_bits(u32::from(unsafe { src.add(j).read_unaligned() }) << 16);
        }
    }

    #[inline]
    unsafe fn store(dst: *mut u8, src: &[f32], nt: bool) {
        let mut bits = [0u16; BLOCK];
        let bits = &mut bits[..src.len()];
        for (b, &x) in bits.iter_mut().zip(src) {
            *b = f32_to_bf16_bits(x);
        }
        // SAFETY: the contract gives src.len() * 2 writable bytes at dst.
        unsafe { nontemporal::store(dst, bits.as_ptr().cast::<u8>(), size_of_val(bits), nt) };
    }
}

/// `bf16::from_f32(x).to_bits()` without the branches, so that it
/// vectorises: round to nearest, ties to even; NaN stays a quiet NaN with
/// the top of its payload.
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) | 0x0040) as u16;
    if x.is_nan() {
        quiet_nan
    } else {
        rounded
    }
}

/// `dst[i] = O(dst[i], src[i])` for `i` in `range`, in `f32`.
///
/// # Safety
///
/// As `native::inplace` with 2-byte elements.
pub(crate) unsafe fn inplace<H: Half, O: Op<f32>>(dst: *mut u8, src: *const u8, range: Range<usize>) {
    let (mut acc, mut tmp) = ([0f32; BLOCK], [0f32; BLOCK]);
    let mut start = range.start;
    while start < range.end {
        let len = (range.end - start).min(BLOCK);
        let (acc, tmp) = (&mut acc[..len], &mut tmp[..len]);
        // SAFETY: start + len <= range.end, the contract.
        unsafe {
            H::load(dst.add(2 * start), acc);
            H::load(src.add(2 * start), tmp);
            for (a, &x) in acc.iter_mut().zip(tmp.iter()) {
                *a = O::apply(*a, x);
            }
            H::store(dst.add(2 * start), acc, false);
        }
        start += len;
    }
}

/// `buf[i] = M(buf[i])` for `i` in `range`, in `f32`.
///
/// # Safety
///
/// As `native::map` with 2-byte elements.
pub(crate) unsafe fn map<H: Half, M: Map<f32>>(buf: *mut u8, range: Range<usize>, params: &Params) {
    let m = M::new(params);
    let mut acc = [0f32; BLOCK];
    let mut start = range.start;
    while start < range.end {
        let len = (range.end - start).min(BLOCK);
        let acc = &mut acc[..len];
        // SAFETY: start + len <= range.end, the contract.
        unsafe {
            H::load(buf.add(2 * start), acc);
            for a in acc.iter_mut() {
                *a = m.map(*a);
            }
            H::store(buf.add(2 * start), acc, false);
        }
        start += len;
    }
}

/// `out[i] = Q(O(P(in0[i]), ..., P(in_{n-1}[i])))` for `i` in `range`, in
/// `f32`, rounding once; streams when `nt` (then fences).
///
/// # Safety
///
/// As `native::reduce` with 2-byte elements; `out` may equal any input
/// (each block is read from every input before it is stored).
pub(crate) unsafe fn reduce<H: Half, O: Op<f32>, P: Map<f32>, Q: Map<f32>>(
    out: *mut u8,
    inputs: &[*const u8],
    range: Range<usize>,
    nt: bool,
    params: &Params,
) {
    let (pre, post) = (P::new(params), Q::new(params));
    let (first, rest) = inputs.split_first().expect("inputs is not empty");
    let (mut acc, mut tmp) = ([0f32; BLOCK], [0f32; BLOCK]);
    let mut start = range.start;
    while start < range.end {
        let len = (range.end - start).min(BLOCK);
        let (acc, tmp) = (&mut acc[..len], &mut tmp[..len]);
        // SAFETY: start + len <= range.end, the contract.
        unsafe {
            H::load(first.add(2 * start), acc);
            for a in acc.iter_mut() {
                *a = pre.map(*a);
            }
            for &input in rest {
                H::load(input.add(2 * start), tmp);
                for (a, &x) in acc.iter_mut().zip(tmp.iter()) {
                    *a = O::apply(*a, pre.map(x));
                }
            }
            for a in acc.iter_mut() {
                *a = post.map(*a);
            }
            H::store(out.add(2 * start), acc, nt);
        }
        start += len;
    }
    if nt {
        nontemporal::fence();
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        let specials = [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN_POSITIVE, 1e-45, f32::INFINITY, f32::NEG_INFINITY];
        let mut bits: Vec<u32> = specials.iter().map(|x| x.to_bits()).collect();
        bits.extend([0x3F80_8000, 0x3F81_8000, 0x3F80_8001, 0x7F7F_FFFF, 0x7FC0_0001, 0xFF80_0001, 0x7F80_0001]);
        bits.extend((0..100_000u32).map(|i| i.wrapping_mul(2_654_435_761)));
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits(), "{b:#x}");
        }
    }
}
