//! Registered memory and bounds-checked views of it.

use std::fmt;
use std::sync::Arc;

use ibverbx::{AccessFlags, MemoryRegion, OwnedBuffer, ProviderKind};

use crate::domain::{domain, Domain};
use crate::{RdmaRemoteBuffer, RdmaTransport, TransportError};

/// Memory registered for RDMA, deregistered when dropped and no operation
/// of this process still uses it (a write or read whose future was dropped
/// keeps it until the provider is done with it). Registrations
/// belong to a device (shared by every transport on it), so one buffer
/// serves all peers. Peers may read and write it at any time through its
/// [`remote_buffer`](Self::remote_buffer).
pub struct RdmaMemory {
    /// Shared with the operations in flight on it: the registration (and
    /// the bytes) outlive this value until they have completed.
    mr: Arc<MemoryRegion>,
    pub(crate) domain: Arc<Domain>,
    /// What keeps the memory allocated, when the caller handed it over
    /// ([`keep_alive`](Self::keep_alive)); shared with the operations in
    /// flight on it, as `mr` is ([`Held`]).
    owner: Option<Owner>,
}

/// What keeps a registration's memory allocated (a tensor, an allocation).
type Owner = Arc<dyn std::any::Any + Send + Sync>;

/// A registration as an operation in flight holds it: the registration and
/// what keeps its memory allocated, so that a caller who drops its future
/// and its [`RdmaMemory`] (a cancellation, a timeout) frees neither while
/// the provider may still read or write the bytes. Deregistered first,
/// then the owner goes (fields drop in order).
pub(crate) struct Held {
    _mr: Arc<MemoryRegion>,
    _owner: Option<Owner>,
}

impl fmt::Debug for RdmaMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaMemory")
            .field("addr", &format_args!("{:#x}", self.mr.addr()))
            .field("len", &self.mr.len())
            .field("device", &self.domain.device)
            .finish()
    }
}

const ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

impl RdmaMemory {
    /// Allocates and registers at least `len` zeroed bytes on the default
    /// device (`RMACOMM_PROVIDER`). The memory is a shared segment, so
    /// same-host peers write it with one copy and no CPU of this process.
    /// A segment is whole pages: [`len`](Self::len) (and the remote
    /// buffer peers get) is `len` rounded up to the page size, all of it
    /// this memory's, so views and peers' writes up to there are inside it.
    pub fn alloc(len: usize) -> Result<RdmaMemory, TransportError> {
        let d = domain(ProviderKind::from_env().unwrap_or_default(), None, None)?;
        Self::alloc_in(d, len)
    }

    /// Registers a buffer on the device `transport` uses (needed when the
    /// transport was configured in code with a device or soft settings of
    /// its own).
    pub fn register_for<B: OwnedBuffer>(transport: &RdmaTransport, buf: B) -> Result<RdmaMemory, TransportError> {
        let d = transport.domain().clone();
        let mr = MemoryRegion::register(&d.pd, buf, ACCESS)?;
        Ok(RdmaMemory { mr: Arc::new(mr), domain: d, owner: None })
    }

    /// Allocates on the device `transport` uses.
    pub fn alloc_for(transport: &RdmaTransport, len: usize) -> Result<RdmaMemory, TransportError> {
        Self::alloc_in(transport.domain().clone(), len)
    }

    pub(crate) fn alloc_in(d: Arc<Domain>, len: usize) -> Result<RdmaMemory, TransportError> {
        if len == 0 {
            return Err(TransportError::invalid("RdmaMemory::alloc", "length 0"));
        }
        let mr = MemoryRegion::alloc(&d.pd, len, ACCESS)?;
        Ok(RdmaMemory { mr: Arc::new(mr), domain: d, owner: None })
    }

    /// Registers a buffer the caller hands over (`Vec<u8>`, `Box<[u8]>`,
    /// `bytes::BytesMut`, `ibverbx::ShmBuffer`) on the default device.
    pub fn register<B: OwnedBuffer>(buf: B) -> Result<RdmaMemory, TransportError> {
        let d = domain(ProviderKind::from_env().unwrap_or_default(), None, None)?;
        let mr = MemoryRegion::register(&d.pd, buf, ACCESS)?;
        Ok(RdmaMemory { mr: Arc::new(mr), domain: d, owner: None })
    }

    /// Registers memory the caller owns, e.g. GPU or foreign memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until this value is dropped and every
    /// operation that used it has finished; peers may write it at any time.
    pub unsafe fn register_raw(ptr: *mut u8, len: usize) -> Result<RdmaMemory, TransportError> {
        let d = domain(ProviderKind::from_env().unwrap_or_default(), None, None)?;
        // SAFETY: forwarded to the caller.
        let mr = unsafe { MemoryRegion::register_raw(&d.pd, ptr, len, ACCESS)? };
        Ok(RdmaMemory { mr: Arc::new(mr), domain: d, owner: None })
    }

    /// [`register_raw`](Self::register_raw) on the device `transport`
    /// uses. Memory inside a shared segment of this process (what
    /// [`alloc`](Self::alloc) gives) is registered as part of that segment:
    /// same-host peers write it with one copy.
    ///
    /// # Safety
    /// As for [`register_raw`](Self::register_raw).
    pub unsafe fn register_raw_for(
        transport: &RdmaTransport,
        ptr: *mut u8,
        len: usize,
    ) -> Result<RdmaMemory, TransportError> {
        let d = transport.domain().clone();
        // SAFETY: forwarded to the caller.
        let mr = unsafe { MemoryRegion::register_raw(&d.pd, ptr, len, ACCESS)? };
        Ok(RdmaMemory { mr: Arc::new(mr), domain: d, owner: None })
    }

    /// Allocates `len` zeroed bytes of CUDA device memory on GPU `device`
    /// and registers them on the default device (`RMACOMM_PROVIDER`).
    /// Writes, reads and atomics move it as they move host memory: the
    /// verbs provider's HCA reaches it (DMA-BUF, else nvidia-peermem); the
    /// soft provider copies through the CUDA driver, staged in pinned
    /// chunks (see the crate's docs). No CUDA driver or device: an
    /// [`Unsupported`](TransportError::Unsupported) error naming what is
    /// missing.
    pub fn alloc_cuda(len: usize, device: u32) -> Result<RdmaMemory, TransportError> {
        let d = domain(ProviderKind::from_env().unwrap_or_default(), None, None)?;
        crate::cuda::alloc(d, len, device)
    }

    /// [`alloc_cuda`](Self::alloc_cuda) on the device `transport` uses.
    pub fn alloc_cuda_for(transport: &RdmaTransport, len: usize, device: u32) -> Result<RdmaMemory, TransportError> {
        crate::cuda::alloc(transport.domain().clone(), len, device)
    }

    /// Registers CUDA device memory the caller owns (a tensor's
    /// `data_ptr()`): `len` bytes at device address `ptr` on GPU `device`,
    /// checked with the driver (device memory of that GPU, inside one
    /// allocation).
    ///
    /// # Safety
    /// The memory must stay allocated until this value is dropped and every
    /// operation that used it has finished; peers may write it at any time.
    pub unsafe fn register_cuda(ptr: u64, len: usize, device: u32) -> Result<RdmaMemory, TransportError> {
        let d = domain(ProviderKind::from_env().unwrap_or_default(), None, None)?;
        // SAFETY: forwarded to the caller.
        unsafe { crate::cuda::register(d, ptr, len, device) }
    }

    /// [`register_cuda`](Self::register_cuda) on the device `transport`
    /// uses.
    ///
    /// # Safety
    /// As for [`register_cuda`](Self::register_cuda).
    pub unsafe fn register_cuda_for(
        transport: &RdmaTransport,
        ptr: u64,
        len: usize,
        device: u32,
    ) -> Result<RdmaMemory, TransportError> {
        // SAFETY: forwarded to the caller.
        unsafe { crate::cuda::register(transport.domain().clone(), ptr, len, device) }
    }

    pub(crate) fn from_parts(mr: Arc<MemoryRegion>, domain: Arc<Domain>) -> RdmaMemory {
        RdmaMemory { mr, domain, owner: None }
    }

    /// Keeps `owner` (what keeps the memory allocated: a tensor object, an
    /// allocation) alive as long as this value, e.g. while an operation
    /// that holds it runs after the caller let go.
    pub fn keep_alive(mut self, owner: impl std::any::Any + Send + Sync) -> RdmaMemory {
        self.owner = Some(Arc::new(owner));
        self
    }

    /// The registration and its owner, for an operation posted on them.
    pub(crate) fn hold(&self) -> Held {
        Held { _mr: self.mr.clone(), _owner: self.owner.clone() }
    }

    /// What device memory this is ("CUDA device 0 (NVIDIA H100 80GB
    /// HBM3)"), `None` for host memory. [`as_ptr`](Self::as_ptr) is then a
    /// device address, and [`read_into`](Self::read_into) /
    /// [`write_from`](Self::write_from) copy through the driver.
    pub fn device(&self) -> Option<String> {
        self.mr.device().map(|d| d.describe())
    }

    /// Whether this is device memory ([`device`](Self::device) without
    /// describing it).
    pub fn is_device(&self) -> bool {
        self.mr.device().is_some()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mr.as_ptr()
    }

    /// Whether `ptr..ptr+len` lies inside this registration.
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let (start, p) = (self.mr.addr() as usize, ptr as usize);
        p >= start && p.checked_add(len).is_some_and(|end| end <= start + self.mr.len())
    }

    /// Whether `transport` can move this memory: both are on one device
    /// (memory from [`alloc`](Self::alloc) or [`register`](Self::register)
    /// and transports of the default configuration always are; a transport
    /// configured with a device or soft settings of its own needs memory
    /// from [`alloc_for`](Self::alloc_for) or
    /// [`register_for`](Self::register_for)).
    pub fn is_usable_with(&self, transport: &RdmaTransport) -> bool {
        Arc::ptr_eq(&self.domain, transport.domain())
    }

    /// A read-only view of `len` bytes at `offset` (the source of a write).
    pub fn view(&self, offset: usize, len: usize) -> Result<View<'_>, TransportError> {
        self.check("view", offset, len)?;
        Ok(View { mem: self, offset, len })
    }

    /// A writable view (the destination of a read).
    pub fn view_mut(&self, offset: usize, len: usize) -> Result<ViewMut<'_>, TransportError> {
        self.check("view_mut", offset, len)?;
        Ok(ViewMut { mem: self, offset, len })
    }

    /// What a peer needs to access this memory.
    pub fn remote_buffer(&self) -> RdmaRemoteBuffer {
        RdmaRemoteBuffer { addr: self.mr.addr(), len: self.mr.len() as u64, key: self.mr.rkey() }
    }

    /// Copies bytes out (safe against concurrent remote writes).
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        self.mr.read(offset, dst).map_err(Into::into)
    }

    /// Copies bytes in.
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        self.mr.write(offset, src).map_err(Into::into)
    }

    /// Copies the bytes of `src` (registered host memory, this memory's
    /// own included) to `offset`, as `memmove`: they may overlap. For
    /// copies within one process that need no transport (a window rank's
    /// puts to itself); device memory is refused.
    pub fn copy_from(&self, offset: usize, src: View<'_>) -> Result<(), TransportError> {
        const OP: &str = "copy_from";
        self.check(OP, offset, src.len)?;
        if self.is_device() || src.mem.is_device() {
            return Err(TransportError::invalid(OP, "device memory is moved by the transport, not by host copies"));
        }
        // SAFETY: both ranges lie in live registrations of host memory
        // (the view was checked when made, the target above), written
        // through raw pointers only; `copy` allows them to overlap.
        unsafe { std::ptr::copy(src.mem.as_ptr().add(src.offset), self.as_ptr().add(offset), src.len) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` into `dst` (registered host
    /// memory, this memory's own included), as `memmove` (see
    /// [`copy_from`](Self::copy_from)).
    pub fn copy_into(&self, offset: usize, dst: ViewMut<'_>) -> Result<(), TransportError> {
        const OP: &str = "copy_into";
        self.check(OP, offset, dst.len)?;
        if self.is_device() || dst.mem.is_device() {
            return Err(TransportError::invalid(OP, "device memory is moved by the transport, not by host copies"));
        }
        // SAFETY: as in `copy_from`, directions swapped.
        unsafe { std::ptr::copy(self.as_ptr().add(offset), dst.mem.as_ptr().add(dst.offset), dst.len) };
        Ok(())
    }

    /// The 64-bit word at `offset` (8-byte aligned) as an atomic, e.g. a
    /// signal slot that peers update (RDMA atomics, or through a
    /// [`MappedBuffer`](crate::MappedBuffer)).
    pub fn atomic_u64(&self, offset: usize) -> Result<&std::sync::atomic::AtomicU64, TransportError> {
        self.mr.atomic_u64(offset).map_err(Into::into)
    }

    /// The 32-bit word at `offset` (4-byte aligned) as an atomic (a futex
    /// word shared with same-host peers).
    pub fn atomic_u32(&self, offset: usize) -> Result<&std::sync::atomic::AtomicU32, TransportError> {
        self.mr.atomic_u32(offset).map_err(Into::into)
    }

    pub(crate) fn mr(&self) -> &Arc<MemoryRegion> {
        &self.mr
    }

    fn check(&self, op: &'static str, offset: usize, len: usize) -> Result<(), TransportError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() && len <= u32::MAX as usize => Ok(()),
            Some(end) if end <= self.len() => Err(TransportError::invalid(
                op,
                format!("{len} bytes is more than one operation carries ({} at most)", u32::MAX),
            )),
            _ => Err(TransportError::invalid(
                op,
                format!("{offset}+{len} is outside the registered memory of {} bytes", self.len()),
            )),
        }
    }
}

/// A read-only slice of registered memory.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub(crate) mem: &'a RdmaMemory,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

/// A writable slice of registered memory.
#[derive(Debug)]
pub struct ViewMut<'a> {
    pub(crate) mem: &'a RdmaMemory,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl<'a> View<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The registered memory this is a slice of (for code that batches
    /// views: two views of one memory that touch can become one).
    pub fn memory(&self) -> &'a RdmaMemory {
        self.mem
    }
    /// Where the slice starts, in bytes from the start of [`memory`](Self::memory).
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl<'a> ViewMut<'a> {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The registered memory this is a slice of.
    pub fn memory(&self) -> &'a RdmaMemory {
        self.mem
    }
    /// Where the slice starts, in bytes from the start of [`memory`](Self::memory).
    pub fn offset(&self) -> usize {
        self.offset
    }
}
