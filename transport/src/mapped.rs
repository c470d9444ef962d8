//! A same-host peer's buffer mapped into this process ([`MappedBuffer`]):
//! the UNIFIED path, where a put is a copy by the calling thread.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64};

use ibverbx::RemoteMapping;

use crate::{RdmaRemoteBuffer, TransportError, View, ViewMut};

/// A peer's registered buffer mapped here, from
/// [`RdmaTransport::map_remote`](crate::RdmaTransport::map_remote): copies
/// into and out of it are plain loads and stores by the calling thread (no
/// post, no completion, no CPU of the peer), and its words can be used as
/// atomics shared with the peer.
///
/// Every copy first checks that the peer still registers the buffer (and
/// holds off the peer's deregistration while it copies): after the owner
/// dropped its memory a copy fails and moves nothing. Offsets are bytes
/// from the start of the mapped buffer.
///
/// The atomics ([`atomic_u64`](Self::atomic_u64), [`atomic_u32`](Self::atomic_u32))
/// are the exception: the key is checked on the first of them only (they
/// carry signals, which pay no key lookup), and a word handed out stays
/// valid in this mapping. They are for words the owner keeps for that use
/// as long as peers may map them (signal slots); an owner that
/// deregisters a range of a segment it goes on using (`register_raw_for`
/// of part of its memory) must not have handed its words out as atomics.
pub struct MappedBuffer {
    map: RemoteMapping,
    remote: RdmaRemoteBuffer,
}

impl fmt::Debug for MappedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MappedBuffer").field("remote", &self.remote).finish()
    }
}

/// A mapped copy that fails (a revoked key, bounds) leaves the transport
/// whole: it is reported as the argument it was, never as a broken link.
fn err(e: ibverbx::Error) -> TransportError {
    match e {
        ibverbx::Error::InvalidState { verb, reason } => TransportError::InvalidArgument { op: verb, reason },
        e => e.into(),
    }
}

impl MappedBuffer {
    pub(crate) fn new(map: RemoteMapping, remote: RdmaRemoteBuffer) -> Self {
        MappedBuffer { map, remote }
    }

    pub(crate) fn map(&self) -> &RemoteMapping {
        &self.map
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The peer's buffer this maps.
    pub fn remote_buffer(&self) -> RdmaRemoteBuffer {
        self.remote
    }

    /// The first byte here (see [`RemoteMapping::as_ptr`]: raw access only).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// True while the peer still registers the buffer.
    pub fn is_registered(&self) -> bool {
        self.map.is_registered()
    }

    /// Copies `src` (registered memory) into the peer's buffer at `offset`.
    pub fn put(&self, src: View<'_>, offset: usize) -> Result<(), TransportError> {
        self.map.write_from(offset, src.mem.mr(), src.offset, src.len).map_err(err)
    }

    /// Copies from the peer's buffer at `offset` into `dst`.
    pub fn get(&self, dst: ViewMut<'_>, offset: usize) -> Result<(), TransportError> {
        self.map.read_into(offset, dst.mem.mr(), dst.offset, dst.len).map_err(err)
    }

    /// [`put`](Self::put) with non-temporal (cache-bypassing) stores: for
    /// data sets larger than the cache (a request of many MiB), where
    /// reading each destination line for ownership first costs more than
    /// keeping it cached saves.
    pub fn put_streaming(&self, src: View<'_>, offset: usize) -> Result<(), TransportError> {
        self.map.write_from_with(offset, src.mem.mr(), src.offset, src.len, true).map_err(err)
    }

    /// [`get`](Self::get) with non-temporal stores (see
    /// [`put_streaming`](Self::put_streaming)).
    pub fn get_streaming(&self, dst: ViewMut<'_>, offset: usize) -> Result<(), TransportError> {
        self.map.read_into_with(offset, dst.mem.mr(), dst.offset, dst.len, true).map_err(err)
    }

    /// Copies plain bytes (any memory) into the peer's buffer at `offset`.
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        self.map.write(offset, src).map_err(err)
    }

    /// Copies from the peer's buffer at `offset` into plain bytes.
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        self.map.read(offset, dst).map_err(err)
    }

    /// The 64-bit word at `offset` (8-byte aligned) as an atomic.
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64, TransportError> {
        self.map.atomic_u64(offset).map_err(err)
    }

    /// The 32-bit word at `offset` (4-byte aligned) as an atomic.
    pub fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32, TransportError> {
        self.map.atomic_u32(offset).map_err(err)
    }
}
