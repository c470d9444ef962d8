//! Shared-memory buffers: memfd-backed, page-aligned allocations that
//! same-host peers of the soft provider map and write directly.
//!
//! Every live segment is recorded in a process-wide table so that a
//! registration of any address range inside one is recognised as shared
//! (whoever allocated it).
//!
//! Segments are sealed against resizing (`F_SEAL_SHRINK | F_SEAL_GROW`) as
//! soon as they are sized: a peer that maps one can never be made to fault
//! (SIGBUS) by a truncation, and a peer refuses a descriptor without those
//! seals (`soft::attach`).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::{Error, Result};

/// A page-aligned buffer in a memfd shared-memory segment.
pub struct ShmBuffer {
    seg: Arc<ShmSegment>,
}

/// One memfd mapping.
pub(crate) struct ShmSegment {
    ptr: NonNull<u8>,
    len: usize,
    fd: OwnedFd,
    uid: u64,
}

// SAFETY: the mapping is plain shared memory; access is by raw pointer and
// synchronised by the users of the buffer (as for any RDMA buffer).
unsafe impl Send for ShmSegment {}
// SAFETY: as above.
unsafe impl Sync for ShmSegment {}

/// A live segment as the table records it: its extent and a weak handle.
#[derive(Debug)]
struct Entry {
    len: usize,
    seg: Weak<ShmSegment>,
}

fn table() -> &'static Mutex<BTreeMap<usize, Entry>> {
    static T: OnceLock<Mutex<BTreeMap<usize, Entry>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// The segment that wholly contains `addr..addr+len`, if any, with the
/// offset of `addr` in it.
pub(crate) fn find_segment(addr: usize, len: usize) -> Option<(Arc<ShmSegment>, usize)> {
    let t = table().lock().unwrap_or_else(|e| e.into_inner());
    let (base, e) = t.range(..=addr).next_back()?;
    let end = addr.checked_add(len)?;
    if end > base + e.len {
        return None;
    }
    Some((e.seg.upgrade()?, addr - base))
}

/// Seals a segment may carry to be mapped by a peer: it can never shrink
/// (a mapper would fault) nor grow.
pub(crate) const REQUIRED_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

/// The name a segment's memfd carries; peers check it before mapping.
pub(crate) fn segment_name(uid: u64) -> String {
    format!("rmacomm-seg-{uid:016x}")
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

impl ShmSegment {
    pub(crate) fn create(len: usize) -> Result<Arc<ShmSegment>> {
        let page = page_size();
        let map_len =
            len.max(1).checked_add(page - 1).ok_or_else(|| Error::invalid("shm_alloc", "length overflows"))? / page
                * page;
        let uid: u64 = rand::random::<u64>() | 1;
        let name = CString::new(segment_name(uid)).expect("no NUL in segment name");
        // SAFETY: name is a valid C string; flags are valid.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(Error::last_os("memfd_create"));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is valid.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), map_len as libc::off_t) } != 0 {
            return Err(Error::last_os("ftruncate(memfd)"));
        }
        // SAFETY: fd is a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, REQUIRED_SEALS | libc::F_SEAL_SEAL) } != 0 {
            return Err(Error::last_os("fcntl(F_ADD_SEALS)"));
        }
        // SAFETY: mapping a fresh fd of map_len bytes; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap(memfd)"));
        }
        let ptr = NonNull::new(p as *mut u8).expect("mmap returned null");
        let seg = Arc::new(ShmSegment { ptr, len: map_len, fd, uid });
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ptr.as_ptr() as usize, Entry { len: map_len, seg: Arc::downgrade(&seg) });
        Ok(seg)
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The descriptor, to pass to a peer.
    pub(crate) fn borrow_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    pub(crate) fn uid(&self) -> u64 {
        self.uid
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        table().lock().unwrap_or_else(|e| e.into_inner()).remove(&(self.ptr.as_ptr() as usize));
        // SAFETY: ptr/len are the mapping made in create; nothing refers to it
        // any more (the Arc is gone).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

impl ShmBuffer {
    /// Allocates `len` zeroed bytes (rounded up to whole pages) in a new
    /// memfd segment.
    pub fn new(len: usize) -> Result<ShmBuffer> {
        Ok(ShmBuffer { seg: ShmSegment::create(len)? })
    }

    /// Usable length (a whole number of pages, at least the length asked for).
    pub fn len(&self) -> usize {
        self.seg.len()
    }

    /// Always false: a buffer has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Start of the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.seg.ptr()
    }

    /// The buffer as a slice.
    // The owner holds the buffer exclusively: once registered, the region
    // owns it and nobody can call this.
    #[allow(clippy::disallowed_methods)]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is len bytes, alive while self is.
        unsafe { std::slice::from_raw_parts(self.seg.ptr(), self.seg.len()) }
    }

    /// The buffer as a mutable slice.
    // As for `as_slice`.
    #[allow(clippy::disallowed_methods)]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access in this process.
        unsafe { std::slice::from_raw_parts_mut(self.seg.ptr(), self.seg.len()) }
    }
}

impl fmt::Debug for ShmBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmBuffer").field("ptr", &self.seg.ptr()).field("len", &self.seg.len()).finish()
    }
}

impl fmt::Debug for ShmSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmSegment").field("len", &self.len).field("uid", &self.uid).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_table_finds_inner_ranges() {
        let mut b = ShmBuffer::new(10_000).unwrap();
        assert_eq!(b.len() % page_size(), 0);
        assert!(b.len() >= 10_000);
        b.as_mut_slice()[9_999] = 7;
        let base = b.as_ptr() as usize;
        assert_eq!(find_segment(base + 100, 200).map(|(_, off)| off), Some(100));
        assert!(find_segment(base, b.len()).is_some());
        assert!(find_segment(base, b.len() + 1).is_none());
        drop(b);
        assert!(find_segment(base + 100, 200).is_none());
    }

    #[test]
    fn segments_are_sealed_against_resizing() {
        let b = ShmBuffer::new(8192).unwrap();
        let fd = b.seg.fd();
        // SAFETY: fd is the segment's live descriptor.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        assert_eq!(seals & REQUIRED_SEALS, REQUIRED_SEALS, "seals {seals:#x}");
        // SAFETY: as above; a sealed memfd refuses both.
        assert_ne!(unsafe { libc::ftruncate(fd, 4096) }, 0, "a sealed segment must not shrink");
        // SAFETY: as above.
        assert_ne!(unsafe { libc::ftruncate(fd, 1 << 20) }, 0, "a sealed segment must not grow");
    }
}
