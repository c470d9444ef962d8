//! What a request names: the operation, local slices and remote blocks.

use std::sync::Arc;

use rmacomm_transport::{RdmaMemory, View, ViewMut};

use crate::AgentError;

/// The direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Local slices into the peer's blocks (RDMA WRITE).
    Write,
    /// The peer's blocks into local slices (RDMA READ).
    Read,
}

/// A block of a peer's registered memory: `len` bytes at `offset` in the
/// region the peer's agent numbered `region` (see
/// [`TransferAgent::register`](crate::TransferAgent::register) and
/// [`TransferAgent::peer_regions`](crate::TransferAgent::peer_regions)).
/// Checked against the peer's published regions before anything moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteBlock {
    /// The peer's region id.
    pub region: u32,
    /// Byte offset in the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl RemoteBlock {
    /// `len` bytes at `offset` of the peer's region `region`.
    pub fn new(region: u32, offset: u64, len: u64) -> Self {
        RemoteBlock { region, offset, len }
    }
}

/// A local slice of registered memory that a piece moves: a [`View`] (the
/// source of a write, by convention) or a [`ViewMut`] (the destination of
/// a read). Either serves either direction: registered memory is shared
/// with peers and never borrowed as a Rust slice, so the direction is the
/// request's [`Op`], not the view's type.
///
/// An [`OwnedBlock`] (memory held by an `Arc`) makes the request's
/// [`Transfer`](crate::Transfer) `'static`: for engines that keep requests
/// in a table or hand them to other tasks.
pub trait LocalBlock<'a>: sealed::Sealed {
    /// The memory, the offset in it and the length.
    fn parts(&self) -> (LocalMem<'a>, usize, usize);
}

/// The memory a [`LocalBlock`] lies in: borrowed for the request's
/// lifetime, or shared through an `Arc` the request keeps.
#[derive(Debug, Clone)]
pub enum LocalMem<'a> {
    /// Borrowed: the request borrows it (`Transfer<'a>`).
    Borrowed(&'a RdmaMemory),
    /// Owned: the request holds a clone of the `Arc` until its pieces are
    /// done.
    Owned(Arc<RdmaMemory>),
}

impl LocalMem<'_> {
    /// The memory.
    pub fn get(&self) -> &RdmaMemory {
        match self {
            LocalMem::Borrowed(m) => m,
            LocalMem::Owned(m) => m,
        }
    }
}

impl<'a> LocalBlock<'a> for View<'a> {
    fn parts(&self) -> (LocalMem<'a>, usize, usize) {
        (LocalMem::Borrowed(self.memory()), self.offset(), self.len())
    }
}

impl<'a> LocalBlock<'a> for ViewMut<'a> {
    fn parts(&self) -> (LocalMem<'a>, usize, usize) {
        (LocalMem::Borrowed(self.memory()), self.offset(), self.len())
    }
}

/// `len` bytes at `offset` of memory held by an `Arc`: a local block whose
/// request ([`Transfer<'static>`](crate::Transfer)) borrows nothing.
#[derive(Debug, Clone)]
pub struct OwnedBlock {
    mem: Arc<RdmaMemory>,
    offset: usize,
    len: usize,
}

impl OwnedBlock {
    /// `len` bytes at `offset` of `mem`; an error when they are not inside it.
    pub fn new(mem: Arc<RdmaMemory>, offset: usize, len: usize) -> Result<OwnedBlock, AgentError> {
        if offset.checked_add(len).is_none_or(|e| e > mem.len()) {
            return Err(AgentError::invalid(
                "OwnedBlock::new",
                format!("{len} bytes at {offset} do not lie in the {} bytes of the memory", mem.len()),
            ));
        }
        Ok(OwnedBlock { mem, offset, len })
    }
}

impl LocalBlock<'static> for OwnedBlock {
    fn parts(&self) -> (LocalMem<'static>, usize, usize) {
        (LocalMem::Owned(self.mem.clone()), self.offset, self.len)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for rmacomm_transport::View<'_> {}
    impl Sealed for rmacomm_transport::ViewMut<'_> {}
    impl Sealed for super::OwnedBlock {}
}
