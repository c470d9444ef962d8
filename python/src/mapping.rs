//! A private mapping of a peer's window memory: what arrays returned by
//! `map_remote_tensor` / `get_tensor` view.
//!
//! The window maps a same-host peer's tensor once and unmaps it at
//! `tensor_deregister` or when the window goes. A numpy array or torch
//! tensor over that mapping could outlive both (Python code keeps
//! references as long as it likes), and would then point at unmapped
//! memory: a crash on access. So each array views a mapping of its own of
//! the same shared pages, made with `mremap(addr, 0, len, MREMAP_MAYMOVE)`
//! (which duplicates a shared mapping), and unmapped when the array's
//! owner is collected. After the peer deregisters, the array still reads
//! and writes valid memory — the segment's pages — but no longer what the
//! peer calls its tensor.

use std::ffi::c_void;
use std::io;
use std::ptr::NonNull;

use rustix::mm::{mremap, munmap, MremapFlags};

/// A mapping this module made and unmaps on drop.
#[derive(Debug)]
pub(crate) struct DupMapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a DupMapping is an owned address range; it is only unmapped on
// drop, and the bytes are reached by raw pointers (numpy), never through
// references this type hands out.
unsafe impl Send for DupMapping {}
// SAFETY: as above.
unsafe impl Sync for DupMapping {}

impl DupMapping {
    /// Maps the pages holding `ptr..ptr+len` again; returns the mapping and
    /// where `ptr`'s byte lies in it.
    ///
    /// # Safety
    /// `ptr..ptr+len` lies inside one live shared (`MAP_SHARED`) mapping
    /// of this process, which stays mapped during the call.
    pub(crate) unsafe fn of(ptr: *mut u8, len: usize) -> io::Result<(DupMapping, *mut u8)> {
        let page = rustix::param::page_size();
        let start = ptr as usize & !(page - 1);
        let off = ptr as usize - start;
        let maplen = (off + len.max(1)).div_ceil(page) * page;
        // SAFETY: `start` is page-aligned and inside the live shared
        // mapping (the contract); an old size of 0 asks for a second
        // mapping of the same pages and moves nothing: no Rust reference
        // is affected.
        let p = unsafe { mremap(start as *mut c_void, 0, maplen, MremapFlags::MAYMOVE)? };
        let base = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mremap returned null"))?;
        Ok((DupMapping { base, len: maplen }, base.as_ptr().wrapping_add(off)))
    }
}

impl Drop for DupMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, unmapped once; the holder that
        // owns this value is gone, so no array views it any more.
        let _ = unsafe { munmap(self.base.as_ptr().cast(), self.len) };
    }
}
