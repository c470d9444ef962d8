//! Kernels for the types that compute as themselves (`f32`, `f64`, `i8`,
//! `u8`, `i32`, `i64`), monomorphised per (type, op, pre-map, post-map).
//!
//! Every pointer is read and written with `read_unaligned` /
//! `write_unaligned`, so byte buffers at any offset work and nothing is
//! borrowed as a slice (inputs may be shared memory other processes map).
//! The loops are plain indexed loops that LLVM vectorises after a run-time
//! overlap check of the pointers (scalar when they overlap, which stays
//! correct).
//!
//! Up to 4 inputs are combined in one fused pass straight into the output.
//! More inputs go through a stack block of `BLOCK` accumulators: the first
//! pass combines 4 inputs into it, each further pass folds in up to 3
//! more, and the last input's pass writes the output, so the output is
//! stored once and the block stays in L1.
//!
//! Each kernel is compiled twice on x86_64: for the baseline target (SSE2)
//! and, in [`avx2`], with AVX2 enabled; [`Kernels`](crate::dispatch::Kernels)
//! picks the AVX2 copy once when the CPU has it.
//!
//! What the compiler made of it (rustc 1.95, `cargo rustc --release -p
//! rmacomm-kernels --lib -- --emit asm -C symbol-mangling-version=v0`), the
//! 2-input f32 `Sum` loop: baseline, `movups` ×2 / `addps` / `movups` on two
//! xmm registers per iteration (8 floats, unrolled ×2); AVX2 copy, see
//! [`avx2`]. Both sit behind a run-time overlap check (`out - a >= 32`) and
//! end in a scalar `addss` tail unrolled ×4.

use std::ops::Range;

use crate::arith::{Map, Native, Op, Params};
use crate::nontemporal;

/// Elements per accumulator block: 2 KiB of `f32`, 4 KiB of `f64`, small
/// enough to stay in L1 beside the lines of several inputs.
pub(crate) const BLOCK: usize = 512;

/// `dst[i] = O(dst[i], src[i])` for `i` in `range`.
///
/// # Safety
///
/// `dst` is valid for reads and writes and `src` for reads of
/// `range.end` elements of `T` (no alignment needed), and nothing else
/// writes them during the call. `src` may equal `dst`.
#[inline(always)]
unsafe fn inplace_impl<T: Native, O: Op<T>>(dst: *mut u8, src: *const u8, range: Range<usize>) {
    let (dst, src) = (dst.cast::<T>(), src.cast::<T>());
    for i in range {
        // SAFETY: i < range.end, within both ranges by the contract.
        unsafe {
            let d = dst.add(i);
            d.write_unaligned(O::apply(d.read_unaligned(), src.add(i).read_unaligned()));
        }
    }
}

/// `buf[i] = M(buf[i])` for `i` in `range` (`prepare` and `finish`).
///
/// # Safety
///
/// `buf` is valid for reads and writes of `range.end` elements of `T`, and
/// nothing else accesses them during the call.
#[inline(always)]
unsafe fn map_impl<T: Native, M: Map<T>>(buf: *mut u8, range: Range<usize>, params: &Params) {
    let (buf, m) = (buf.cast::<T>(), M::new(params));
    for i in range {
        // SAFETY: i < range.end, within the range by the contract.
        unsafe {
            let p = buf.add(i);
            p.write_unaligned(m.map(p.read_unaligned()));
        }
    }
}

/// `out[i] = Q(O(P(in0[i]), P(in1[i]), ..., P(in_{n-1}[i])))` for `i` in
/// `range`, combining left to right; streams the output when `nt` (and
/// then fences before returning).
///
/// # Safety
///
/// `inputs` is not empty; every input is valid for reads and `out` for
/// writes of `range.end` elements of `T`; nothing else writes them during
/// the call. `out` may equal an input; other overlaps give unspecified
/// output values.
#[inline(always)]
unsafe fn reduce_impl<T: Native, O: Op<T>, P: Map<T>, Q: Map<T>>(
    out: *mut u8,
    inputs: &[*const u8],
    range: Range<usize>,
    nt: bool,
    params: &Params,
) {
    let (pre, post) = (P::new(params), Q::new(params));
    let out = out.cast::<T>();
    let n = inputs.len();
    // The output is written by the pass that reads the last inputs, unless
    // it must stream or it is one of the inputs that pass reads (the overlap
    // check would keep the loop scalar); then the block is computed in
    // `acc` and stored after.
    let out_u8 = out.cast_const().cast::<u8>();
    let aliased = if n <= 4 { inputs.contains(&out_u8) } else { inputs[n - 1] == out_u8 };
    let direct = !nt && !aliased;
    let mut acc = [T::default(); BLOCK];
    let mut start = range.start;
    while start < range.end {
        let len = (range.end - start).min(BLOCK);
        let acc = &mut acc[..len];
        // SAFETY: start + len <= range.end: every pointer below is within
        // its range by the contract, `acc` is ours.
        unsafe {
            let at = |p: *const u8| p.cast::<T>().add(start);
            let dest = if direct { out.add(start) } else { acc.as_mut_ptr() };
            let p = |x| pre.map(x);
            match *inputs {
                [a] => pass1::<T, _>(dest, at(a), len, |a| post.map(p(a))),
                [a, b] => pass2::<T, _>(dest, at(a), at(b), len, |a, b| post.map(O::apply(p(a), p(b)))),
                [a, b, c] => pass3::<T, _>(dest, [at(a), at(b), at(c)], len, |a, b, c| {
                    post.map(O::apply(O::apply(p(a), p(b)), p(c)))
                }),
                [a, b, c, d] => pass4::<T, _>(dest, [at(a), at(b), at(c), at(d)], len, |a, b, c, d| {
                    post.map(O::apply(O::apply(O::apply(p(a), p(b)), p(c)), p(d)))
                }),
                [a, b, c, d, ref rest @ .., z] => {
                    pass4::<T, _>(acc.as_mut_ptr(), [at(a), at(b), at(c), at(d)], len, |a, b, c, d| {
                        O::apply(O::apply(O::apply(p(a), p(b)), p(c)), p(d))
                    });
                    for group in rest.chunks(3) {
                        match *group {
                            [x] => fold1::<T, _>(acc, at(x), |a, x| O::apply(a, p(x))),
                            [x, y] => fold2::<T, _>(acc, [at(x), at(y)], |a, x, y| O::apply(O::apply(a, p(x)), p(y))),
                            [x, y, w] => fold3::<T, _>(acc, [at(x), at(y), at(w)], |a, x, y, w| {
                                O::apply(O::apply(O::apply(a, p(x)), p(y)), p(w))
                            }),
                            _ => unreachable!("chunks of 1 to 3"),
                        }
                    }
                    let f = |a, x| post.map(O::apply(a, p(x)));
                    if direct {
                        last_pass::<T, _>(dest, acc, at(z), f);
                    } else {
                        fold1::<T, _>(acc, at(z), f);
                    }
                }
                [] => unreachable!("inputs is not empty"),
            }
            if !direct {
                nontemporal::store(out.add(start).cast::<u8>(), acc.as_ptr().cast::<u8>(), len * size_of::<T>(), nt);
            }
        }
        start += len;
    }
    if nt {
        nontemporal::fence();
    }
}

/// `out[j] = f(x[j])` for `j < len`.
///
/// # Safety
///
/// `x` readable and `out` writable for `len` elements.
#[inline(always)]
unsafe fn pass1<T: Copy, F: Fn(T) -> T>(out: *mut T, x: *const T, len: usize, f: F) {
    for j in 0..len {
        // SAFETY: j < len, the caller's contract.
        unsafe { out.add(j).write_unaligned(f(x.add(j).read_unaligned())) };
    }
}

/// `out[j] = f(a[j], b[j])` for `j < len`: the 2-input loop.
///
/// # Safety
///
/// `a`, `b` readable and `out` writable for `len` elements.
#[inline(always)]
unsafe fn pass2<T: Copy, F: Fn(T, T) -> T>(out: *mut T, a: *const T, b: *const T, len: usize, f: F) {
    for j in 0..len {
        // SAFETY: j < len, the caller's contract.
        unsafe { out.add(j).write_unaligned(f(a.add(j).read_unaligned(), b.add(j).read_unaligned())) };
    }
}

/// `out[j] = f(x0[j], x1[j], x2[j])`.
///
/// # Safety
///
/// Every `x` readable and `out` writable for `len` elements.
#[inline(always)]
unsafe fn pass3<T: Copy, F: Fn(T, T, T) -> T>(out: *mut T, x: [*const T; 3], len: usize, f: F) {
    for j in 0..len {
        // SAFETY: j < len, the caller's contract.
        unsafe {
            let v = f(x[0].add(j).read_unaligned(), x[1].add(j).read_unaligned(), x[2].add(j).read_unaligned());
            out.add(j).write_unaligned(v);
        }
    }
}

/// `out[j] = f(x0[j], x1[j], x2[j], x3[j])`.
///
/// # Safety
///
/// Every `x` readable and `out` writable for `len` elements.
#[inline(always)]
unsafe fn pass4<T: Copy, F: Fn(T, T, T, T) -> T>(out: *mut T, x: [*const T; 4], len: usize, f: F) {
    for j in 0..len {
        // SAFETY: j < len, the caller's contract.
        unsafe {
            let v = f(
                x[0].add(j).read_unaligned(),
                x[1].add(j).read_unaligned(),
                x[2].add(j).read_unaligned(),
                x[3].add(j).read_unaligned(),
            );
            out.add(j).write_unaligned(v);
        }
    }
}

/// `acc[j] = f(acc[j], x[j])`.
///
/// # Safety
///
/// `x` readable for `acc.len()` elements.
#[inline(always)]
unsafe fn fold1<T: Copy, F: Fn(T, T) -> T>(acc: &mut [T], x: *const T, f: F) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: j < acc.len(), the caller's contract.
        *a = f(*a, unsafe { x.add(j).read_unaligned() });
    }
}

/// `acc[j] = f(acc[j], x0[j], x1[j])`.
///
/// # Safety
///
/// Every `x` readable for `acc.len()` elements.
#[inline(always)]
unsafe fn fold2<T: Copy, F: Fn(T, T, T) -> T>(acc: &mut [T], x: [*const T; 2], f: F) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: j < acc.len(), the caller's contract.
        *a = unsafe { f(*a, x[0].add(j).read_unaligned(), x[1].add(j).read_unaligned()) };
    }
}

/// `acc[j] = f(acc[j], x0[j], x1[j], x2[j])`.
///
/// # Safety
///
/// Every `x` readable for `acc.len()` elements.
#[inline(always)]
unsafe fn fold3<T: Copy, F: Fn(T, T, T, T) -> T>(acc: &mut [T], x: [*const T; 3], f: F) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: j < acc.len(), the caller's contract.
        *a = unsafe { f(*a, x[0].add(j).read_unaligned(), x[1].add(j).read_unaligned(), x[2].add(j).read_unaligned()) };
    }
}

/// `out[j] = f(acc[j], x[j])`.
///
/// # Safety
///
/// `x` readable and `out` writable for `acc.len()` elements.
#[inline(always)]
unsafe fn last_pass<T: Copy, F: Fn(T, T) -> T>(out: *mut T, acc: &[T], x: *const T, f: F) {
    for (j, &a) in acc.iter().enumerate() {
        // SAFETY: j < acc.len(), the caller's contract.
        unsafe { out.add(j).write_unaligned(f(a, x.add(j).read_unaligned())) };
    }
}

/// Defines the entry points `dispatch` points at, each an outlined copy of
/// its `*_impl`: `$attr` is empty for the baseline copy and
/// `#[target_feature(enable = "avx2")]` for the AVX2 one, so that the
/// inlined loops are compiled for that instruction set.
macro_rules! entry_points {
    ($(#[$attr:meta])*) => {
        /// `dst[i] = O(dst[i], src[i])` for `i` in `range`.
        ///
        /// # Safety
        ///
        /// As `inplace_impl` (and the CPU has the enabled features).
        $(#[$attr])*
        pub(crate) unsafe fn inplace<T: Native, O: Op<T>>(dst: *mut u8, src: *const u8, range: Range<usize>) {
            // SAFETY: the caller's contract.
            unsafe { super::inplace_impl::<T, O>(dst, src, range) }
        }

        /// `buf[i] = M(buf[i])` for `i` in `range`.
        ///
        /// # Safety
        ///
        /// As `map_impl` (and the CPU has the enabled features).
        $(#[$attr])*
        pub(crate) unsafe fn map<T: Native, M: Map<T>>(buf: *mut u8, range: Range<usize>, params: &Params) {
            // SAFETY: the caller's contract.
            unsafe { super::map_impl::<T, M>(buf, range, params) }
        }

        /// The N-input reduction over `range`.
        ///
        /// # Safety
        ///
        /// As `reduce_impl` (and the CPU has the enabled features).
        $(#[$attr])*
        pub(crate) unsafe fn reduce<T: Native, O: Op<T>, P: Map<T>, Q: Map<T>>(
            out: *mut u8,
            inputs: &[*const u8],
            range: Range<usize>,
            nt: bool,
            params: &Params,
        ) {
            // SAFETY: the caller's contract.
            unsafe { super::reduce_impl::<T, O, P, Q>(out, inputs, range, nt, params) }
        }
    };
}

/// The kernels compiled for the baseline target.
pub(crate) mod baseline {
    use super::*;
    entry_points!();
}

/// The kernels compiled with AVX2, for CPUs that have it.
///
/// The 2-input f32 `Sum` loop here is `vmovups` / `vaddps` (memory operand)
/// / `vmovups` on four ymm registers per iteration (32 floats, unrolled
/// ×4), then a 4-wide xmm epilogue and a scalar `vaddss` tail; the fused
/// 4-input loop is the same with three `vaddps` per register.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    entry_points!(#[target_feature(enable = "avx2")]);
}
