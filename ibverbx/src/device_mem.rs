//! Device memory (a GPU's) as registrable memory.
//!
//! The host cannot load or store device memory, so a region of it carries
//! the [`DeviceMemory`] that can copy its bytes: the soft provider moves
//! every byte of such a region through those copies (its peers, also on the
//! same host, reach it through the connection: [`Placement::Staged`](crate::Placement::Staged)),
//! and the verbs provider registers it through DMA-BUF
//! ([`DeviceMemory::dmabuf`], `ibv_reg_dmabuf_mr`) or, where the memory's
//! driver exports none, by address (a peer-memory kernel module such as
//! nvidia-peermem resolves it). `rmacomm-transport`'s CUDA memory is one
//! implementation; tests use memory at addresses no host mapping has.

use std::fmt;
use std::os::fd::OwnedFd;

/// Memory a device owns, reached by copies. Implementations are shared by
/// every region registered on them.
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// What the memory is, for errors and logs ("CUDA device 0 (NVIDIA H100 80GB HBM3)").
    fn describe(&self) -> String;

    /// Copies the device bytes at `src` into `dst`: done when this returns.
    /// `src..src + dst.len()` lies in a registered region (the caller
    /// checked it).
    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), String>;

    /// Copies `src` to the device bytes at `dst`: when this returns, device
    /// work queued afterwards on any stream sees them.
    fn write(&self, dst: u64, src: &[u8]) -> Result<(), String>;

    /// A DMA-BUF that exports `len` bytes at `addr`, and the offset of
    /// `addr` in it, for registration with hardware. `None` where the
    /// memory's driver has no DMA-BUF export (the default).
    fn dmabuf(&self, addr: u64, len: usize) -> Option<Result<(OwnedFd, u64), String>> {
        let _ = (addr, len);
        None
    }
}
