//! The soft provider's direct copies, and when they stream.
//!
//! A message larger than the fragment size reaches the soft provider as a
//! run of WRs over consecutive remote addresses, each copied with its own
//! `memcpy` call. glibc switches to non-temporal (cache-bypassing) stores
//! only for a *single* call above a threshold tied to the cache size, so a
//! 256 MiB message in 1 MiB fragments is copied through the cache — every
//! destination line read for ownership, then written back — at ~0.6 of
//! what one 256 MiB `memcpy` reaches. [`StreamDetector`] notices such runs
//! per QP and, past [`STREAM_AFTER`] contiguous bytes, the copies use
//! non-temporal stores ([`copy`] with `stream`), as one big `memcpy` would.
//! Repeated messages to the same buffer restart the run, so data sets that
//! fit in the cache keep being copied through it.

use std::sync::atomic::{AtomicU64, Ordering};

/// Contiguous bytes after which copies of a run stream: about where a
/// copy stops fitting in one core's share of the cache on the machines we
/// measured (2-core VM: memcpy 14 GB/s at 32 MiB, 7 GB/s at 64 MiB).
pub(crate) const STREAM_AFTER: u64 = 32 << 20;
/// Copies shorter than this never stream (their lines are worth caching).
const STREAM_MIN_COPY: u64 = 64 << 10;

/// Watches a QP's direct copies for long runs over consecutive remote
/// addresses. Relaxed atomics: a race only changes a heuristic.
#[derive(Debug, Default)]
pub(crate) struct StreamDetector {
    next: AtomicU64,
    run: AtomicU64,
}

impl StreamDetector {
    /// Records a copy of `len` bytes at remote address `raddr`; true when
    /// it should stream.
    pub(crate) fn observe(&self, raddr: u64, len: u64) -> bool {
        let run = if self.next.load(Ordering::Relaxed) == raddr { self.run.load(Ordering::Relaxed) } else { 0 };
        let run = run.saturating_add(len);
        self.run.store(run, Ordering::Relaxed);
        self.next.store(raddr.wrapping_add(len), Ordering::Relaxed);
        len >= STREAM_MIN_COPY && run > STREAM_AFTER
    }
}

/// Copies `len` bytes from `src` to `dst`, with non-temporal stores when
/// `stream` (and the CPU has them); the stores are fenced before return,
/// so whatever the caller publishes afterwards is ordered after the data.
///
/// Ranges that overlap in this address space (a source that is a view of
/// the very mapping written: a peer's mapped tensor put back into that
/// peer) are moved, as `memmove` does.
///
/// # Safety
/// Both ranges valid for the call.
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize, stream: bool) {
    let (d, s) = (dst as usize, src as usize);
    if d < s.wrapping_add(len) && s < d.wrapping_add(len) {
        // SAFETY: forwarded from the caller; `copy` allows the overlap.
        return unsafe { std::ptr::copy(src, dst, len) };
    }
    #[cfg(target_arch = "x86_64")]
    if stream {
        // SAFETY: forwarded from the caller.
        return unsafe { copy_stream_x86(dst, src, len) };
    }
    let _ = stream;
    // SAFETY: forwarded from the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn copy_stream_x86(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_prefetch, _mm_sfence, _mm_stream_si128, _MM_HINT_T0};
    // Head: plain copy up to 16-byte alignment of the destination.
    let head = dst.align_offset(16).min(len);
    // SAFETY: head <= len: within the caller's ranges.
    let (mut d, mut s, mut n) = unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        (dst.add(head), src.add(head), len - head)
    };
    while n >= 64 {
        // SAFETY: d is 16-byte aligned; d..d+64 and s..s+64 lie in the
        // caller's ranges; SSE2 is part of x86-64.
        unsafe {
            // Prefetching never faults, also past the end of the source.
            _mm_prefetch(s.wrapping_add(512) as *const i8, _MM_HINT_T0);
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            d = d.add(64);
            s = s.add(64);
        }
        n -= 64;
    }
    // SAFETY: orders the streaming stores before anything stored later;
    // the tail is within the caller's ranges.
    unsafe {
        _mm_sfence();
        std::ptr::copy_nonoverlapping(s, d, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copies_equal_memcpy_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
        for len in [0usize, 1, 15, 16, 17, 63, 64, 65, 127, 200, 1000, 3000] {
            for so in 0..17 {
                for d_off in 0..17 {
                    let mut dst = vec![0xEEu8; 4096 + 64];
                    // SAFETY: both ranges lie inside their vectors.
                    unsafe { copy(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len, true) };
                    assert_eq!(&dst[d_off..d_off + len], &src[so..so + len], "len {len} src+{so} dst+{d_off}");
                    assert!(dst[..d_off].iter().all(|&b| b == 0xEE), "wrote before the range");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xEE), "wrote after the range");
                }
            }
        }
    }

    #[test]
    fn overlapping_ranges_are_moved() {
        let orig: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
        for stream in [false, true] {
            for shift in [1usize, 16, 64, 4096] {
                // Forward (the destination after the source) and back.
                let mut buf = orig.clone();
                let len = buf.len() - shift;
                // SAFETY: both ranges lie inside buf.
                unsafe { copy(buf.as_mut_ptr().add(shift), buf.as_ptr(), len, stream) };
                assert!(buf[shift..] == orig[..len], "forward by {shift}, stream {stream}");
                let mut buf = orig.clone();
                // SAFETY: as above.
                unsafe { copy(buf.as_mut_ptr(), buf.as_ptr().add(shift), len, stream) };
                assert!(buf[..len] == orig[shift..], "back by {shift}, stream {stream}");
            }
        }
    }

    #[test]
    fn runs_over_consecutive_addresses_stream_after_the_threshold() {
        let d = StreamDetector::default();
        let mb = 1u64 << 20;
        let mut streamed_at = None;
        for i in 0..100u64 {
            if d.observe(0x10_0000_0000 + i * mb, mb) && streamed_at.is_none() {
                streamed_at = Some(i);
            }
        }
        assert_eq!(streamed_at, Some(STREAM_AFTER / mb), "streams once the run passes the threshold");
        // The same buffer again: the run restarts.
        assert!(!d.observe(0x10_0000_0000, mb));
        // Small copies never stream, however long the run.
        let d = StreamDetector::default();
        assert!((0..20_000u64).all(|i| !d.observe(i * 4096, 4096)));
    }
}
