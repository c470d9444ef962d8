//! CUDA device memory as transport memory: [`RdmaMemory::alloc_cuda`] and
//! [`RdmaMemory::register_cuda`]. The CUDA driver is loaded at run time
//! (`rmacomm-cuda`): a machine without one gets an error naming it.
//!
//! On the verbs provider the memory is registered through DMA-BUF
//! (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`), else by address
//! (nvidia-peermem), and the HCA moves it. On the soft provider every byte
//! goes through the driver: received from the connection into pinned chunks
//! and copied to the GPU (or copied from the GPU and sent), pipelined, one
//! chunk's DMA beside the other's CPU copy; peers on the same host reach it
//! through the connection as well (a window maps same-host GPU memory with
//! CUDA IPC instead).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ibverbx::{DeviceMemory, MemoryRegion};
use rmacomm_cuda::device::MemoryType;
use rmacomm_cuda::driver::{Context, DevicePtr};
use rmacomm_cuda::staging::Staging;

use crate::domain::Domain;
use crate::{RdmaMemory, TransportError};

/// One CUDA device's memory, reached through pinned staging.
#[derive(Debug)]
pub(crate) struct CudaMemory {
    ordinal: u32,
    staging: Staging,
}

impl DeviceMemory for CudaMemory {
    fn describe(&self) -> String {
        format!("CUDA device {} ({})", self.ordinal, self.staging.context().name())
    }

    fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        // SAFETY: the range lies in a region registered on this device's
        // memory (register_cuda checked it; the provider checked the range).
        unsafe { self.staging.download(src, dst) }.map_err(|e| e.to_string())
    }

    fn write(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        // SAFETY: as in read.
        unsafe { self.staging.upload(dst, src) }.map_err(|e| e.to_string())
    }

    fn dmabuf(&self, addr: u64, len: usize) -> Option<Result<(std::os::fd::OwnedFd, u64), String>> {
        self.staging.context().dmabuf(addr, len).map(|r| r.map_err(|e| e.to_string()))
    }
}

/// The device's memory object, shared by every region on it (and its
/// staging buffers with them).
fn device(op: &'static str, ordinal: u32) -> Result<Arc<CudaMemory>, TransportError> {
    static DEVICES: Mutex<Option<HashMap<u32, Arc<CudaMemory>>>> = Mutex::new(None);
    let mut g = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let ctx = Context::open_shared(ordinal).map_err(|e| TransportError::Unsupported(format!("{op}: {e}")))?;
    let d = Arc::new(CudaMemory { ordinal, staging: Staging::new(ctx) });
    map.insert(ordinal, d.clone());
    Ok(d)
}

const ACCESS: ibverbx::AccessFlags = ibverbx::AccessFlags::LOCAL_WRITE
    .union(ibverbx::AccessFlags::REMOTE_WRITE)
    .union(ibverbx::AccessFlags::REMOTE_READ)
    .union(ibverbx::AccessFlags::REMOTE_ATOMIC);

/// Allocates `len` zeroed bytes on CUDA device `ordinal` and registers them.
pub(crate) fn alloc(d: Arc<Domain>, len: usize, ordinal: u32) -> Result<RdmaMemory, TransportError> {
    const OP: &str = "RdmaMemory::alloc_cuda";
    if len == 0 {
        return Err(TransportError::invalid(OP, "length 0"));
    }
    let dev = device(OP, ordinal)?;
    let mem = dev.staging.context().alloc_shared(len).map_err(|e| TransportError::Unsupported(format!("{OP}: {e}")))?;
    let ptr = mem.ptr();
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::new(mem);
    // SAFETY: `len` bytes of this device's memory, owned by `owner`, which
    // the region keeps alive as long as it or a WR needs them.
    let mr = unsafe { MemoryRegion::register_device(&d.pd, dev, ptr, len, ACCESS, Some(owner))? };
    Ok(RdmaMemory::from_parts(Arc::new(mr), d))
}

/// Registers `len` bytes of CUDA device memory at `ptr` on device `ordinal`.
///
/// # Safety
/// The memory must stay allocated until the returned value is dropped and
/// every operation that used it has finished.
pub(crate) unsafe fn register(
    d: Arc<Domain>,
    ptr: DevicePtr,
    len: usize,
    ordinal: u32,
) -> Result<RdmaMemory, TransportError> {
    const OP: &str = "RdmaMemory::register_cuda";
    if len == 0 {
        return Err(TransportError::invalid(OP, "length 0"));
    }
    let dev = device(OP, ordinal)?;
    let info =
        dev.staging.context().pointer_info(ptr).map_err(|e| {
            TransportError::invalid(OP, format!("{ptr:#x} is not CUDA memory of device {ordinal}: {e}"))
        })?;
    let end = info.base + info.size as u64;
    if info.memory_type != MemoryType::Device
        || info.device != ordinal as i32
        || ptr.checked_add(len as u64).is_none_or(|e| e > end)
    {
        return Err(TransportError::invalid(
            OP,
            format!(
                "{len} bytes at {ptr:#x} are not device memory of CUDA device {ordinal} (the driver reports {:?} on \
                 device {}, allocation {:#x}+{})",
                info.memory_type, info.device, info.base, info.size
            ),
        ));
    }
    // SAFETY: checked device memory of this context; its lifetime is the
    // caller's promise.
    let mr = unsafe { MemoryRegion::register_device(&d.pd, dev, ptr, len, ACCESS, None)? };
    Ok(RdmaMemory::from_parts(Arc::new(mr), d))
}
