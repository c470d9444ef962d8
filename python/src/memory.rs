//! Registered memory: rmacomm's own shared-memory allocations
//! (`rmacomm.empty`, `comm.empty`), registrations of Python tensors, and
//! the table that finds the registration an address lies in.
//!
//! Why a table: a put needs its source as registered memory (a `View`),
//! and a Python caller hands over an array, often a slice or a torch view
//! of a buffer rmacomm allocated. Looking the address up finds the
//! allocation's registration in ~100 ns, instead of registering again per
//! call.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ibverbx::OwnedBuffer;
use pyo3::prelude::*;
use rmacomm_transport::{RdmaMemory, TransportError};

/// Registered memory, listed in the table while alive (when published).
#[derive(Debug)]
pub(crate) struct Registered {
    /// In an `Arc`: agent requests hold it (`OwnedBlock`) until their
    /// pieces are done.
    pub(crate) mem: Arc<RdmaMemory>,
    id: u64,
    /// What keeps device memory allocated (a CUDA tensor) as long as the
    /// registration lives; host memory's owner is inside `mem`.
    _keep: Option<Py<PyAny>>,
}

type Table = BTreeMap<(usize, u64), (usize, Weak<Registered>)>;

static TABLE: Mutex<Table> = Mutex::new(BTreeMap::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn table() -> std::sync::MutexGuard<'static, Table> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registered {
    fn wrap(mem: RdmaMemory) -> Arc<Registered> {
        Arc::new(Registered { mem: Arc::new(mem), id: NEXT_ID.fetch_add(1, Ordering::Relaxed), _keep: None })
    }

    /// Registers a CUDA tensor's memory (`t`, kept alive by the
    /// registration). Not published: the table holds host memory only.
    pub(crate) fn cuda(t: crate::cuda_tensor::CudaTensor) -> Result<Arc<Registered>, TransportError> {
        // SAFETY: the tensor, kept in `_keep` as long as the registration
        // (and every transfer holding it) lives, keeps its memory allocated.
        let mem = unsafe { RdmaMemory::register_cuda(t.ptr, t.nbytes, t.device)? };
        Ok(Arc::new(Registered { mem: Arc::new(mem), id: NEXT_ID.fetch_add(1, Ordering::Relaxed), _keep: Some(t.obj) }))
    }

    /// `len` bytes of CUDA device memory of GPU `gpu` at device address
    /// `ptr` (checked with the driver), kept alive by nobody.
    ///
    /// # Safety
    /// The memory must stay allocated until the registration (and every
    /// transfer holding it) is dropped.
    pub(crate) unsafe fn cuda_address(ptr: u64, len: usize, gpu: u32) -> Result<Arc<Registered>, TransportError> {
        // SAFETY: forwarded to the caller.
        let mem = unsafe { RdmaMemory::register_cuda(ptr, len, gpu)? };
        Ok(Arc::new(Registered { mem: Arc::new(mem), id: NEXT_ID.fetch_add(1, Ordering::Relaxed), _keep: None }))
    }

    /// `len` zeroed bytes of shared memory (a memfd segment that same-host
    /// peers map), registered and published in the table.
    pub(crate) fn alloc(len: usize) -> Result<Arc<Registered>, TransportError> {
        let r = Self::wrap(RdmaMemory::alloc(len.max(1))?);
        r.publish();
        Ok(r)
    }

    /// Registers memory owned by `owner` (not published: a registration
    /// made for one operation or handed to a window).
    pub(crate) fn register(owner: Borrowed) -> Result<Arc<Registered>, TransportError> {
        Ok(Self::wrap(RdmaMemory::register(owner)?))
    }

    /// Lists it in the table, so that operations on arrays inside it use
    /// this registration.
    pub(crate) fn publish(self: &Arc<Self>) {
        let start = self.mem.as_ptr() as usize;
        table().insert((start, self.id), (self.mem.len(), Arc::downgrade(self)));
    }

    /// Byte offset of `ptr` in this registration.
    pub(crate) fn offset_of(&self, ptr: *mut u8) -> usize {
        ptr as usize - self.mem.as_ptr() as usize
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        table().remove(&(self.mem.as_ptr() as usize, self.id));
    }
}

/// The published registration holding `ptr..ptr+len`, if any.
pub(crate) fn find(ptr: *mut u8, len: usize) -> Option<Arc<Registered>> {
    let (p, end) = (ptr as usize, (ptr as usize).checked_add(len)?);
    let t = table();
    // Nested registrations are rare: a few entries below `p` suffice.
    for (&(start, _), (l, w)) in t.range(..=(p, u64::MAX)).rev().take(16) {
        if start + l >= end {
            if let Some(r) = w.upgrade() {
                return Some(r);
            }
        }
    }
    None
}

/// What keeps registered Python memory alive.
#[derive(Debug)]
pub(crate) enum Owner {
    /// A numpy array or torch tensor.
    Py(#[allow(dead_code)] Py<PyAny>),
    /// An rmacomm allocation (registered again, e.g. by a window).
    Mem(#[allow(dead_code)] Arc<Registered>),
    /// Nothing: memory named by its address, which the caller promised to
    /// keep allocated until the registration is dropped (NIXL's
    /// registration of raw addresses, `TransferAgent.register_address`).
    Caller,
}

/// Memory owned elsewhere (a Python tensor or an rmacomm allocation),
/// handed to a registration together with what keeps it alive. The
/// registration (the transport's memory region) holds it until it is
/// deregistered and every operation that used it has completed.
#[derive(Debug)]
pub(crate) struct Borrowed {
    ptr: *mut u8,
    len: usize,
    _owner: Owner,
}

impl Borrowed {
    /// `ptr..ptr+len`, kept alive by `owner`.
    ///
    /// # Safety
    /// The range is valid for reads and writes, and stays allocated at the
    /// same address while `owner` lives (a Python object keeps its buffer;
    /// the caller has checked it is a numpy array, whose memory cannot be
    /// resized while referenced, or a torch tensor, which the user promises
    /// not to resize while registered).
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize, owner: Owner) -> Borrowed {
        Borrowed { ptr, len, _owner: owner }
    }
}

// SAFETY: the owner is Send (a Py reference or an Arc); the pointer is an
// address of memory that owner keeps, reached only through the
// registration.
unsafe impl Send for Borrowed {}
// SAFETY: as above; `&Borrowed` gives nothing but the address.
unsafe impl Sync for Borrowed {}

// SAFETY: `new`'s contract makes the range valid and stable for the
// owner's life, which is this value's; the registration, once it owns the
// value, reaches the bytes only through raw pointers, and this type hands
// out no reference to them.
unsafe impl OwnedBuffer for Borrowed {
    fn buf_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn buf_len(&self) -> usize {
        self.len
    }
}
