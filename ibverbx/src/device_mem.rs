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
/// every region registered on them. The copies take addresses the caller
/// vouches for (`unsafe`): with unified addressing a device address can
/// also name host memory.
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// What the memory is, for errors and logs ("CUDA device 0 (NVIDIA H100 80GB HBM3)").
    fn describe(&self) -> String;

    /// Copies the device bytes at `src` into `dst`: done when this returns.
    ///
    /// # Safety
    /// `src..src + dst.len()` must lie in a live region registered on this
    /// memory (the caller checked the bounds).
    unsafe fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), String>;

    /// Copies `src` to the device bytes at `dst`: when this returns, device
    /// work queued afterwards on any stream sees them.
    ///
    /// # Safety
    /// As for [`read`](Self::read), for `dst..dst + src.len()`.
    unsafe fn write(&self, dst: u64, src: &[u8]) -> Result<(), String>;

    /// A DMA-BUF that exports `len` bytes at `addr`, and the offset of
    /// `addr` in it, for registration with hardware. `None` where the
    /// memory's driver has no DMA-BUF export (the default).
    fn dmabuf(&self, addr: u64, len: usize) -> Option<Result<(OwnedFd, u64), String>> {
        let _ = (addr, len);
        None
    }

    /// A description of the `len` bytes at `addr` that another process on
    /// this host opens with its [`DeviceIpc`] (CUDA IPC: the allocation's
    /// handle and the offset): the soft provider publishes it, and same-host
    /// peers then copy into and out of the region themselves, without this
    /// process's engine. At most [`IPC_EXPORT_MAX`] bytes. `None` (the
    /// default): peers go through the connection.
    fn ipc_export(&self, addr: u64, len: usize) -> Option<Result<Vec<u8>, String>> {
        let _ = (addr, len);
        None
    }

    /// Copies `len` bytes from device address `src` to `dst`, both valid in
    /// this process (this memory's, or a peer's opened here: a
    /// [`PeerDevice::device_addr`]), device to device: done (visible to
    /// later device work) when it returns. `None` (the default) where it
    /// cannot: the caller copies through host memory.
    ///
    /// # Safety
    /// Both ranges must be live device memory valid in this process: one in
    /// a region registered on this memory, the other in a peer's region
    /// opened here (bounds checked by the caller).
    unsafe fn copy_device(&self, dst: u64, src: u64, len: usize) -> Option<Result<(), String>> {
        let _ = (dst, src, len);
        None
    }

    /// Queues [`copy_device`](Self::copy_device)'s copy without waiting
    /// for it: placed once a later [`copy_device_wait`](Self::copy_device_wait)
    /// returns `Ok`. Copies queued on one memory run in the order they
    /// were queued (one stream), whichever thread queued them. The soft
    /// provider queues a run of WRs' copies this way and waits once for
    /// all of them, instead of once per WR. `None` (the default): no queue
    /// (the caller copies with `copy_device`).
    ///
    /// # Safety
    /// As for `copy_device`, and both ranges stay live until the wait
    /// returns.
    unsafe fn copy_device_queue(&self, dst: u64, src: u64, len: usize) -> Option<Result<(), String>> {
        let _ = (dst, src, len);
        None
    }

    /// Waits until every copy [`queued`](Self::copy_device_queue) on this
    /// memory so far (by any thread) is done, visible to later device
    /// work. An error: any of them may not have been placed.
    fn copy_device_wait(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The longest [`DeviceMemory::ipc_export`] description.
pub const IPC_EXPORT_MAX: usize = 1024;

/// Opens same-host peers' device memory (their
/// [`DeviceMemory::ipc_export`] descriptions), for the soft provider's
/// direct copies. One per process, installed with [`set_device_ipc`] by
/// whatever brings device memory (`rmacomm-transport`'s CUDA memory does
/// when it is first used); without one, transfers to peers' device memory
/// go through the connection.
pub trait DeviceIpc: Send + Sync + fmt::Debug {
    /// Opens a peer's description (`pid`: the peer process, as the kernel
    /// reported it): the result keeps the mapping while it lives. The
    /// description comes from memory peers can write: an implementation
    /// checks, with its driver, that what it names is device memory
    /// covering the whole [`PeerDevice::len`] before it returns it.
    fn open(&self, export: &[u8], pid: u32) -> Result<std::sync::Arc<dyn PeerDevice>, String>;
}

/// A same-host peer's device memory, opened here.
pub trait PeerDevice: Send + Sync + fmt::Debug {
    /// Bytes it covers (the exported region).
    fn len(&self) -> u64;

    /// Whether it covers nothing.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the region starts in this process's device address space, for
    /// [`DeviceMemory::copy_device`] (`None`, the default: host copies
    /// only).
    fn device_addr(&self) -> Option<u64> {
        None
    }

    /// Copies `len` bytes of host memory at `src` to byte `offset` of the
    /// peer's region: placed (visible to the device's later work) when this
    /// returns.
    ///
    /// # Safety
    /// `src..src + len` must be readable for the call; `offset + len` must
    /// not exceed [`len`](Self::len) (the caller checked the peer's key).
    unsafe fn write(&self, offset: u64, src: *const u8, len: usize) -> Result<(), String>;

    /// Copies `len` bytes at byte `offset` of the peer's region into host
    /// memory at `dst`: done when this returns.
    ///
    /// # Safety
    /// `dst..dst + len` must be writable for the call and not borrowed;
    /// `offset + len` within [`len`](Self::len).
    unsafe fn read(&self, offset: u64, dst: *mut u8, len: usize) -> Result<(), String>;
}

static DEVICE_IPC: std::sync::OnceLock<std::sync::Arc<dyn DeviceIpc>> = std::sync::OnceLock::new();

/// Installs this process's [`DeviceIpc`] (the first one installed stays;
/// returns whether this one was).
pub fn set_device_ipc(ipc: std::sync::Arc<dyn DeviceIpc>) -> bool {
    DEVICE_IPC.set(ipc).is_ok()
}

/// This process's [`DeviceIpc`], if one was installed.
pub(crate) fn device_ipc() -> Option<&'static std::sync::Arc<dyn DeviceIpc>> {
    DEVICE_IPC.get()
}
