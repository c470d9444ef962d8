//! What a request names: the operation, local slices and remote blocks.

use rmacomm_transport::{RdmaMemory, View, ViewMut};

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
pub trait LocalBlock<'a>: sealed::Sealed {
    /// The memory, the offset in it and the length.
    fn parts(&self) -> (&'a RdmaMemory, usize, usize);
}

impl<'a> LocalBlock<'a> for View<'a> {
    fn parts(&self) -> (&'a RdmaMemory, usize, usize) {
        (self.memory(), self.offset(), self.len())
    }
}

impl<'a> LocalBlock<'a> for ViewMut<'a> {
    fn parts(&self) -> (&'a RdmaMemory, usize, usize) {
        (self.memory(), self.offset(), self.len())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for rmacomm_transport::View<'_> {}
    impl Sealed for rmacomm_transport::ViewMut<'_> {}
}
