//! Storing a computed block to its destination, with ordinary or
//! non-temporal (streaming) stores.
//!
//! Streaming stores (`movntdq`) write whole lines to memory without first
//! reading them into the cache and without evicting what is there: for a
//! large output nobody reads soon that saves the read-for-ownership traffic
//! (a quarter of a 2-input reduction's memory traffic) and keeps the inputs'
//! lines cached. They are weakly ordered, so a call that streamed ends with
//! [`fence`] before it returns. Off x86_64 they are ordinary stores.

/// Copies `len` bytes from the block at `src` to `dst`, streaming when `nt`.
///
/// The destination needs no alignment: bytes up to the first 16-byte
/// boundary and after the last are stored ordinarily.
///
/// # Safety
///
/// `src` is valid for reads and `dst` for writes of `len` bytes, and they
/// do not overlap.
#[inline]
pub(crate) unsafe fn store(dst: *mut u8, src: *const u8, len: usize, nt: bool) {
    #[cfg(target_arch = "x86_64")]
    if nt {
        // SAFETY: the caller's contract.
        unsafe { stream_x86_64(dst, src, len) };
        return;
    }
    let _ = nt;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(target_arch = "x86_64")]
unsafe fn stream_x86_64(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY: within the caller's ranges (head <= len).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    while i + 64 <= len {
        // SAFETY: dst + i is 16-byte aligned (head reached the boundary and
        // i advances by 64); the 64 bytes from i are within both ranges.
        // SSE2 is part of the x86_64 baseline.
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            _mm_stream_si128(d, _mm_loadu_si128(s));
            _mm_stream_si128(d.add(1), _mm_loadu_si128(s.add(1)));
            _mm_stream_si128(d.add(2), _mm_loadu_si128(s.add(2)));
            _mm_stream_si128(d.add(3), _mm_loadu_si128(s.add(3)));
        }
        i += 64;
    }
    while i + 16 <= len {
        // SAFETY: as above, for 16 bytes.
        unsafe { _mm_stream_si128(dst.add(i).cast::<__m128i>(), _mm_loadu_si128(src.add(i).cast::<__m128i>())) };
        i += 16;
    }
    // SAFETY: the remaining bytes are within both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) };
}

/// Orders the streaming stores issued so far before later stores (x86's
/// `sfence`), so that whoever is told "done" after this sees the data.
#[inline]
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions; SSE is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copies_every_byte_at_any_alignment() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        for offset in 0..17 {
            for len in [0, 1, 15, 16, 17, 63, 64, 65, 200, 283] {
                let mut dst = vec![0xAAu8; 300 + 17];
                // SAFETY: both ranges are within their vectors and distinct.
                unsafe { store(dst.as_mut_ptr().add(offset), src.as_ptr(), len, true) };
                fence();
                assert_eq!(&dst[offset..offset + len], &src[..len], "offset {offset} len {len}");
                assert!(dst[..offset].iter().chain(&dst[offset + len..]).all(|&b| b == 0xAA));
            }
        }
    }
}
