//! Kernels for the types that compute as themselves (`f32`, `f64`, `i8`,
//! `u8`, `i32`, `i64`), monomorphised per (type, op, pre-map, post-map).
//!
//! Every pointer is read and written with `read_unaligned` /
//! `write_unaligned`, so byte buffers at any offset work and nothing is
//! borrowed as a slice (inputs may be shared memory other processes map).
//! The loops are plain indexed loops that LLVM vectorises after a run-time
//! overlap check of the pointers (scalar when they overlap, which stays
//! correct). N inputs go through a stack block of `BLOCK` accumulators:
//! the first pass combines `in0` and `in1` into it, each further input is
//! one pass over the block, and the last input's pass writes the output,
//! so the output is stored once.
//!
//! What the compiler made of it (x86_64, baseline SSE2 target, rustc 1.95,
//! `cargo rustc --release -p rmacomm-kernels -- --emit asm`), f32 `Sum`:
//! see `two_inputs` below for the 2-input loop's instructions.

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
pub(crate) unsafe fn inplace<T: Native, O: Op<T>>(dst: *mut u8, src: *const u8, range: Range<usize>) {
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
pub(crate) unsafe fn map<T: Native, M: Map<T>>(buf: *mut u8, range: Range<usize>, params: &Params) {
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
pub(crate) unsafe fn reduce<T: Native, O: Op<T>, P: Map<T>, Q: Map<T>>(
    out: *mut u8,
    inputs: &[*const u8],
    range: Range<usize>,
    nt: bool,
    params: &Params,
) {
    let (pre, post) = (P::new(params), Q::new(params));
    let out = out.cast::<T>();
    let last = inputs.len() - 1;
    // The output is written by the last pass directly unless it must stream
    // or it is an input that pass reads (the overlap check would keep that
    // loop scalar); then the block is computed in `acc` and stored after.
    let aliased = if inputs.len() <= 2 {
        inputs.contains(&out.cast_const().cast::<u8>())
    } else {
        inputs[last] == out.cast_const().cast::<u8>()
    };
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
            match inputs {
                [x] => map_to::<T, _>(dest, at(*x), len, |x| post.map(pre.map(x))),
                [a, b] => {
                    two_inputs::<T, _>(dest, at(*a), at(*b), len, |a, b| post.map(O::apply(pre.map(a), pre.map(b))))
                }
                [a, b, mid @ .., z] => {
                    two_inputs::<T, _>(acc.as_mut_ptr(), at(*a), at(*b), len, |a, b| O::apply(pre.map(a), pre.map(b)));
                    for &x in mid {
                        accumulate::<T, _>(acc, at(x), |a, x| O::apply(a, pre.map(x)));
                    }
                    let f = |a, x| post.map(O::apply(a, pre.map(x)));
                    if direct {
                        last_pass::<T, _>(dest, acc, at(*z), f);
                    } else {
                        accumulate::<T, _>(acc, at(*z), f);
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

/// `out[j] = f(a[j], b[j])` for `j < len`: the 2-input loop.
///
/// For f32 `Sum` (x86_64 baseline target) this is a `movups`/`movups`/
/// `addps`/`movups` body over two xmm registers per iteration (8 floats),
/// behind a run-time overlap check of `out` against `a` and `b` and
/// followed by a scalar `addss` tail. See the crate docs for the measured
/// throughput.
///
/// # Safety
///
/// `a`, `b` readable and `out` writable for `len` elements.
#[inline(always)]
unsafe fn two_inputs<T: Copy, F: Fn(T, T) -> T>(out: *mut T, a: *const T, b: *const T, len: usize, f: F) {
    for j in 0..len {
        // SAFETY: j < len, the caller's contract.
        unsafe { out.add(j).write_unaligned(f(a.add(j).read_unaligned(), b.add(j).read_unaligned())) };
    }
}

/// `acc[j] = f(acc[j], x[j])`.
///
/// # Safety
///
/// `x` readable for `acc.len()` elements.
#[inline(always)]
unsafe fn accumulate<T: Copy, F: Fn(T, T) -> T>(acc: &mut [T], x: *const T, f: F) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: j < acc.len(), the caller's contract.
        *a = f(*a, unsafe { x.add(j).read_unaligned() });
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

/// `out[j] = f(x[j])`.
///
/// # Safety
///
/// `x` readable and `out` writable for `len` elements.
#[inline(always)]
unsafe fn map_to<T: Copy, F: Fn(T) -> T>(out: *mut T, x: *const T, len: usize, f: F) {
    for j in 0..len {
        // SAFETY: j < len, the caller's contract.
        unsafe { out.add(j).write_unaligned(f(x.add(j).read_unaligned())) };
    }
}
