//! A same-host peer's registered region mapped into this process: the
//! UNIFIED path of one-sided windows (loads, stores and atomics by the
//! calling thread, no post, no progress thread, no peer CPU).
//!
//! Obtained from a connected QP ([`QueuePair::map_remote`](crate::QueuePair::map_remote),
//! [`VirtualQp::map_remote`](crate::VirtualQp::map_remote)): the soft
//! provider maps the peer's sealed segment through the same authenticated
//! attach socket its direct copies use (never from numbers the peer
//! reported). Every copy checks the peer's key table first and holds the
//! peer's deregistration fence for the key while it copies, as the soft
//! provider's own copies do: once the owner's deregistration has returned, a
//! copy fails with an error naming the key, and nothing is written. The
//! mapping itself keeps the peer's segment mapped here, so no access can
//! touch memory that is not the peer's region, whatever the peer does.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

use crate::soft::remote::MapTarget;
use crate::soft::remote::PeerRegion;
use crate::{AccessFlags, Error, MemoryRegion, Result};

/// A peer's registered region mapped here (see the module docs).
pub struct RemoteMapping {
    region: PeerRegion,
}

impl fmt::Debug for RemoteMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteMapping")
            .field("remote_addr", &format_args!("{:#x}", self.region.addr))
            .field("len", &self.region.len)
            .field("rkey", &format_args!("{:#x}", self.region.rkey))
            .finish()
    }
}

impl RemoteMapping {
    pub(crate) fn new(region: PeerRegion) -> Self {
        RemoteMapping { region }
    }

    /// Maps `len` bytes at `addr` under `rkey` through `target` (with no
    /// `len`: the whole region holding `addr`), or `None` when the region is
    /// not in a segment the peer shares.
    pub(crate) async fn map(target: Arc<MapTarget>, rkey: u32, addr: u64, len: Option<u64>) -> Result<Option<Self>> {
        Ok(PeerRegion::map(target, rkey, addr, len).await?.map(Self::new))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// The region's address in the peer (what its key covers).
    pub fn remote_addr(&self) -> u64 {
        self.region.addr
    }

    /// The peer's key for the region.
    pub fn rkey(&self) -> u32 {
        self.region.rkey
    }

    /// The region's first byte in this process. Peers (and the owner) write
    /// it at any time: access it through raw pointers or atomics, never as
    /// a Rust reference to plain bytes. It stays mapped while `self` lives,
    /// but once the owner deregisters the region what is written there is
    /// lost to it.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.base as *mut u8
    }

    /// True while the owner still registers the region.
    pub fn is_registered(&self) -> bool {
        self.region.check("is_registered", 0, 0, AccessFlags::REMOTE_READ).is_ok()
    }

    /// Copies `src` into the region at `offset` (a store by this thread).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        // SAFETY: src is a live slice of src.len() bytes.
        unsafe { self.region.copy_in("write to a mapped peer region", offset, src.as_ptr(), src.len(), false) }
    }

    /// Copies `len` bytes at `src_offset` of the local region `src` into the
    /// peer's region at `offset`.
    pub fn write_from(&self, offset: usize, src: &MemoryRegion, src_offset: usize, len: usize) -> Result<()> {
        self.write_from_with(offset, src, src_offset, len, false)
    }

    /// [`write_from`](Self::write_from), with non-temporal (cache-bypassing)
    /// stores when `stream`: for data sets larger than the cache, whose
    /// destination lines are not worth reading for ownership first.
    pub fn write_from_with(
        &self,
        offset: usize,
        src: &MemoryRegion,
        src_offset: usize,
        len: usize,
        stream: bool,
    ) -> Result<()> {
        const OP: &str = "write to a mapped peer region";
        let p = local_span(OP, src, src_offset, len)?;
        // SAFETY: p..p+len lies in `src`, a live registration borrowed for
        // the call.
        unsafe { self.region.copy_in(OP, offset, p, len, stream) }
    }

    /// Copies from the region at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        // SAFETY: dst is a live, exclusive slice of dst.len() bytes.
        unsafe { self.region.copy_out("read from a mapped peer region", offset, dst.as_mut_ptr(), dst.len(), false) }
    }

    /// Copies `len` bytes from the region at `offset` into the local region
    /// `dst` at `dst_offset`.
    pub fn read_into(&self, offset: usize, dst: &MemoryRegion, dst_offset: usize, len: usize) -> Result<()> {
        self.read_into_with(offset, dst, dst_offset, len, false)
    }

    /// [`read_into`](Self::read_into), with non-temporal stores when
    /// `stream` (see [`write_from_with`](Self::write_from_with)).
    pub fn read_into_with(
        &self,
        offset: usize,
        dst: &MemoryRegion,
        dst_offset: usize,
        len: usize,
        stream: bool,
    ) -> Result<()> {
        const OP: &str = "read from a mapped peer region";
        let p = local_span(OP, dst, dst_offset, len)?;
        // SAFETY: p..p+len lies in `dst`, a live registration borrowed for
        // the call (shared memory: written through raw pointers only).
        unsafe { self.region.copy_out(OP, offset, p as *mut u8, len, stream) }
    }

    /// The 64-bit word at `offset` (8-byte aligned), for atomics shared with
    /// the owner (signal slots). Needs remote-atomic access.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        let p = self.region.word("atomic_u64 on a mapped peer region", offset, 8)?;
        // SAFETY: p is 8-byte aligned, inside the mapping, which lives as
        // long as `self`; AtomicU64 is valid for any bit pattern.
        Ok(unsafe { &*(p as *const AtomicU64) })
    }

    /// The 32-bit word at `offset` (4-byte aligned), e.g. a futex word.
    pub fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32> {
        let p = self.region.word("atomic_u32 on a mapped peer region", offset, 4)?;
        // SAFETY: as in atomic_u64, with 4-byte alignment.
        Ok(unsafe { &*(p as *const AtomicU32) })
    }
}

/// The address of `len` bytes at `offset` of `mr`, checked.
fn local_span(op: &'static str, mr: &MemoryRegion, offset: usize, len: usize) -> Result<*const u8> {
    if let Some(d) = mr.device() {
        return Err(Error::invalid(
            op,
            format!("the local region is device memory ({}): the host cannot copy it directly", d.describe()),
        ));
    }
    mr.host_only(op)?;
    match offset.checked_add(len) {
        Some(end) if end <= mr.len() => Ok(mr.as_ptr().wrapping_add(offset) as *const u8),
        _ => Err(Error::invalid(op, format!("{offset}+{len} is outside the local region of {} bytes", mr.len()))),
    }
}
