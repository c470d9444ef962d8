//! Memory regions: registered memory with its keys.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::access::AccessFlags;
use crate::provider::{MrOps, Placement};
use crate::shm::ShmBuffer;
use crate::wr::Sge;
use crate::{Error, ProtectionDomain, Result};

/// Memory that a [`MemoryRegion`] can own: its bytes stay put while the
/// value lives (heap or mapped memory, never inline).
///
/// # Safety
/// [`MemoryRegion::register`] hands `buf_ptr()..buf_ptr() + buf_len()` to
/// the provider, which reads and writes it (and lets peers holding the rkey
/// do so) until the region and every WR naming it are gone. An implementor
/// promises that:
/// - the pointer returned by `buf_ptr` is valid for reads and writes of
///   `buf_len()` bytes, and both values are the same on every call;
/// - the bytes stay allocated and at the same address for as long as the
///   value lives, also when the value itself is moved (the region keeps it
///   behind an `Arc`), and are freed no earlier than its drop;
/// - nothing else owns, frees or reallocates them while the value lives,
///   and no safe code can reach them through a Rust reference while they
///   are registered: the type hands out no shared or mutable slices of
///   them through `&self` methods, interior mutability or shared ownership
///   (so `bytes::Bytes` or `Arc<[u8]>`, whose clones alias the bytes, must
///   not implement it).
///
/// ```compile_fail,E0200
/// // A safe impl could expose any memory: the trait refuses it.
/// struct Anywhere;
/// impl ibverbx::OwnedBuffer for Anywhere {
///     fn buf_ptr(&mut self) -> *mut u8 {
///         0x1000 as *mut u8
///     }
///     fn buf_len(&self) -> usize {
///         4096
///     }
/// }
/// ```
pub unsafe trait OwnedBuffer: Send + Sync + 'static {
    /// Start of the bytes.
    fn buf_ptr(&mut self) -> *mut u8;
    /// Number of bytes.
    fn buf_len(&self) -> usize;
}

// SAFETY: the heap block of a Vec does not move when the Vec does, and the
// Vec is the only owner; `register` takes it by value, so nobody can grow
// it (which would reallocate) while it is registered.
unsafe impl OwnedBuffer for Vec<u8> {
    fn buf_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn buf_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: as for Vec<u8>: a uniquely owned heap block that moves with the box.
unsafe impl OwnedBuffer for Box<[u8]> {
    fn buf_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn buf_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: a mapping owned by the buffer, unmapped only on its drop; its
// slice accessors are unreachable once the region owns the value.
unsafe impl OwnedBuffer for ShmBuffer {
    fn buf_ptr(&mut self) -> *mut u8 {
        self.as_ptr()
    }
    fn buf_len(&self) -> usize {
        self.len()
    }
}

// SAFETY: a BytesMut uniquely owns its view of the block (it cannot be
// frozen or split once the region owns it) and the block does not move
// with the handle.
unsafe impl OwnedBuffer for bytes::BytesMut {
    fn buf_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    fn buf_len(&self) -> usize {
        self.len()
    }
}

/// A registered memory region. Deregistered on drop; the keys stop working
/// at once. Work requests already posted keep the region's memory alive
/// until they complete.
///
/// The memory is shared with the peers that hold its rkey: they may read or
/// write it at any time. Access it through [`read`](Self::read) and
/// [`write`](Self::write) (copies), or through the raw pointer when the
/// application knows no remote access is in flight.
pub struct MemoryRegion {
    ops: Arc<dyn MrOps>,
    pd: ProtectionDomain,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.ops.addr()))
            .field("len", &self.ops.len())
            .field("lkey", &format_args!("{:#x}", self.ops.lkey()))
            .field("placement", &self.ops.placement())
            .finish()
    }
}

impl MemoryRegion {
    /// Allocates `len` bytes of shared memory (zeroed, page-aligned) and
    /// registers them: the fastest kind of region for same-host peers.
    pub fn alloc(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        Self::register(pd, ShmBuffer::new(len)?, access)
    }

    /// Registers a buffer the region then owns (and keeps alive while any WR
    /// uses it).
    pub fn register<B: OwnedBuffer>(pd: &ProtectionDomain, mut buf: B, access: AccessFlags) -> Result<MemoryRegion> {
        let ptr = buf.buf_ptr();
        let len = buf.buf_len();
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(buf);
        // SAFETY: `OwnedBuffer`'s contract makes ptr..ptr+len valid, stable
        // and unaliased while `owner` lives; the provider keeps `owner` alive
        // for as long as the registration or any WR needs the bytes.
        let ops = unsafe { pd.inner.ops.reg_mr(ptr, len, access, Some(owner))? };
        Ok(MemoryRegion { ops, pd: pd.clone() })
    }

    /// Registers memory the caller owns (GPU or foreign memory, a buffer
    /// shared with other code).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until this region is dropped **and**
    /// every WR posted with its keys has completed; peers holding the rkey
    /// may write it whenever the access flags allow.
    pub unsafe fn register_raw(
        pd: &ProtectionDomain,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded to the caller.
        let ops = unsafe { pd.inner.ops.reg_mr(ptr, len, access, None)? };
        Ok(MemoryRegion { ops, pd: pd.clone() })
    }

    /// Registers a DMA-BUF (GPU memory exported by its driver) through the
    /// PD's provider ([`PdOps::reg_dmabuf`](crate::provider::PdOps::reg_dmabuf):
    /// the verbs provider's `ibv_reg_dmabuf_mr`); `iova` is the address peers
    /// use. Other providers refuse it with an error.
    ///
    /// # Safety
    /// The DMA-BUF range must stay allocated until this region is dropped and
    /// every WR naming it has completed.
    pub unsafe fn register_dmabuf(
        pd: &ProtectionDomain,
        fd: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded to the caller.
        let ops = unsafe { pd.inner.ops.reg_dmabuf(fd, offset, len, iova, access)? };
        Ok(MemoryRegion { ops, pd: pd.clone() })
    }

    /// Registers `len` bytes of device memory at `addr`, an address of
    /// `dev`'s (GPU memory: the host cannot load or store it). On the soft
    /// provider every byte moves through `dev`'s copies (peers on this host
    /// too: the region's placement is [`Staged`](Placement::Staged)); on
    /// the verbs provider it is registered through DMA-BUF where `dev`
    /// exports one, else by address (nvidia-peermem). [`read`](Self::read)
    /// and [`write`](Self::write) copy through `dev`; the slice and atomic
    /// accessors refuse it. `owner`, when given, is kept alive as long as
    /// the registration or any WR needs the memory.
    ///
    /// # Safety
    /// `addr..addr+len` must be device memory that `dev` reaches, allocated
    /// until this region is dropped **and** every WR posted with its keys
    /// has completed (or until `owner` drops, when it owns the memory).
    pub unsafe fn register_device(
        pd: &ProtectionDomain,
        dev: Arc<dyn crate::DeviceMemory>,
        addr: u64,
        len: usize,
        access: AccessFlags,
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded to the caller.
        let ops = unsafe { pd.inner.ops.reg_device_mr(dev, addr, len, access, owner)? };
        Ok(MemoryRegion { ops, pd: pd.clone() })
    }

    /// The device memory the region lies in (`None`: host memory).
    pub fn device(&self) -> Option<&Arc<dyn crate::DeviceMemory>> {
        self.ops.device()
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ops.addr()
    }

    /// Start as a pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ops.addr() as usize as *mut u8
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.ops.len() == 0
    }

    /// Local key.
    pub fn lkey(&self) -> u32 {
        self.ops.lkey()
    }

    /// Remote key: give it (with the address) to peers that may access this
    /// region.
    pub fn rkey(&self) -> u32 {
        self.ops.rkey()
    }

    /// Access flags.
    pub fn access(&self) -> AccessFlags {
        self.ops.access()
    }

    /// How same-host peers reach this region.
    pub fn placement(&self) -> Placement {
        self.ops.placement()
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// A scatter/gather element for `len` bytes at `offset`, bounds-checked.
    pub fn sge(&self, offset: usize, len: usize) -> Result<Sge> {
        self.check(offset, len, "sge")?;
        Ok(Sge { addr: self.addr() + offset as u64, length: len as u32, lkey: self.lkey() })
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len(), "read")?;
        if let Some(dev) = self.device() {
            // SAFETY: in bounds of this live registration (checked above).
            return unsafe { dev.read(self.addr() + offset as u64, dst) }.map_err(|e| device_error("read", &**dev, e));
        }
        self.host_only("read")?;
        // SAFETY: in bounds of a live registration; the region is shared
        // memory, so it is copied with raw pointers and never borrowed.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len(), "write")?;
        if let Some(dev) = self.device() {
            // SAFETY: as in `read`.
            return unsafe { dev.write(self.addr() + offset as u64, src) }
                .map_err(|e| device_error("write", &**dev, e));
        }
        self.host_only("write")?;
        // SAFETY: as in `read`; `copy`, as `src` may be a view of this
        // very memory (through another mapping of it, or unsafely made).
        unsafe { std::ptr::copy(src.as_ptr(), self.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// The region as a slice.
    ///
    /// # Safety
    /// No peer may write the region (and no local WR scatter into it) while
    /// the slice lives, and it must be host memory (not a region of
    /// [`register_device`](Self::register_device)).
    // The slice is what the caller asked for, under that contract.
    #[allow(clippy::disallowed_methods)]
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: live registration of len bytes; exclusivity is the caller's.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }

    /// The region as a mutable slice.
    ///
    /// # Safety
    /// No peer may access the region, and no other reference to it may exist,
    /// while the slice lives; host memory only, as for [`as_slice`](Self::as_slice).
    // The slice is what the caller asked for, under that contract.
    #[allow(clippy::mut_from_ref, clippy::disallowed_methods)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) }
    }

    /// The 64-bit word at `offset` (8-byte aligned) as an atomic: for words
    /// peers update with RDMA atomics or through a
    /// [`RemoteMapping`](crate::RemoteMapping) (signal slots).
    pub fn atomic_u64(&self, offset: usize) -> Result<&std::sync::atomic::AtomicU64> {
        let p = self.word(offset, 8, "atomic_u64")?;
        // SAFETY: aligned, inside the live registration borrowed by the
        // result; AtomicU64 is valid for any bit pattern.
        Ok(unsafe { &*(p as *const std::sync::atomic::AtomicU64) })
    }

    /// The 32-bit word at `offset` (4-byte aligned) as an atomic (e.g. a
    /// futex word shared with same-host peers).
    pub fn atomic_u32(&self, offset: usize) -> Result<&std::sync::atomic::AtomicU32> {
        let p = self.word(offset, 4, "atomic_u32")?;
        // SAFETY: as in atomic_u64.
        Ok(unsafe { &*(p as *const std::sync::atomic::AtomicU32) })
    }

    fn word(&self, offset: usize, size: usize, verb: &'static str) -> Result<usize> {
        self.check(offset, size, verb)?;
        if let Some(dev) = self.device() {
            return Err(Error::invalid(
                verb,
                format!("the region is device memory ({}): the host has no atomic view of it", dev.describe()),
            ));
        }
        self.host_only(verb)?;
        let p = self.as_ptr() as usize + offset;
        if !p.is_multiple_of(size) {
            return Err(Error::invalid(verb, format!("offset {offset} is not {size}-byte aligned")));
        }
        Ok(p)
    }

    /// Refuses a region whose address is not this process's memory (a
    /// DMA-BUF registration: an IOVA), which the host must not copy with
    /// pointers.
    pub(crate) fn host_only(&self, verb: &'static str) -> Result<()> {
        if self.ops.host_accessible() {
            return Ok(());
        }
        Err(Error::invalid(
            verb,
            format!(
                "the region at {:#x} is not host memory (a DMA-BUF registration: its address is an IOVA); the \
                 host cannot copy it",
                self.addr()
            ),
        ))
    }

    fn check(&self, offset: usize, len: usize, verb: &'static str) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() && len <= u32::MAX as usize => Ok(()),
            _ => Err(Error::invalid(
                verb,
                format!("range {offset}+{len} is outside the memory region of {} bytes", self.len()),
            )),
        }
    }

    /// The provider's MR object.
    pub fn ops(&self) -> &Arc<dyn MrOps> {
        &self.ops
    }
}

fn device_error(verb: &'static str, dev: &dyn crate::DeviceMemory, e: String) -> Error {
    Error::state(verb, format!("copy through {} failed: {e}", dev.describe()))
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Err(e) = self.ops.deregister() {
            tracing::warn!("dereg_mr failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::soft::{SoftConfig, SoftProvider};

    /// A registration whose address is not this process's memory (what a
    /// verbs DMA-BUF registration is: an IOVA).
    #[derive(Debug)]
    struct Iova;

    impl MrOps for Iova {
        fn addr(&self) -> u64 {
            // Mapped nowhere: a copy through it would fault.
            0x10
        }
        fn len(&self) -> usize {
            4096
        }
        fn lkey(&self) -> u32 {
            1
        }
        fn rkey(&self) -> u32 {
            1
        }
        fn access(&self) -> AccessFlags {
            AccessFlags::LOCAL_WRITE
        }
        fn placement(&self) -> Placement {
            Placement::Hardware
        }
        fn deregister(&self) -> Result<()> {
            Ok(())
        }
        fn host_accessible(&self) -> bool {
            false
        }
    }

    #[test]
    fn a_region_that_is_not_host_memory_is_never_copied_with_pointers() {
        // Safe read/write/atomics on a DMA-BUF region copied through its
        // IOVA as if it were a host pointer.
        let ctx = SoftProvider::new(SoftConfig::default()).device().open().unwrap();
        let mr = MemoryRegion { ops: Arc::new(Iova), pd: ctx.alloc_pd().unwrap() };
        let mut buf = [0u8; 8];
        for e in [
            mr.read(0, &mut buf).unwrap_err(),
            mr.write(0, &buf).unwrap_err(),
            mr.atomic_u64(0).unwrap_err(),
            mr.atomic_u32(0).unwrap_err(),
        ] {
            assert!(e.to_string().contains("not host memory"), "{e}");
        }
    }
}
