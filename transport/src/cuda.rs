//! CUDA device memory as transport memory: [`RdmaMemory::alloc_cuda`] and
//! [`RdmaMemory::register_cuda`]. The CUDA driver is loaded at run time
//! (`rmacomm-cuda`): a machine without one gets an error naming it.
//!
//! On the verbs provider the memory is registered through DMA-BUF
//! (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`), else by address
//! (nvidia-peermem), and the HCA moves it. On the soft provider every byte
//! goes through the driver: received from the connection into pinned chunks
//! and copied to the GPU (or copied from the GPU and sent), pipelined, one
//! chunk's DMA beside the other's CPU copy. Peers on the same host open
//! it through CUDA IPC (the region publishes its allocation's handle; see
//! `ibverbx::DeviceIpc`) and copy into and out of it themselves, through
//! their own pinned chunks, without this process's engine. cuMem/VMM
//! memory (PyTorch's expandable segments) exports its mappings'
//! descriptors instead of an IPC handle (`rmacomm_cuda::vmm`); memory
//! that exports neither is reached through the connection.

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
    /// The GPU's UUID (exports name the GPU by it: ordinals are per
    /// process, `CUDA_VISIBLE_DEVICES` renumbers them).
    uuid: [u8; 16],
    staging: Staging,
}

impl DeviceMemory for CudaMemory {
    fn describe(&self) -> String {
        format!("CUDA device {} ({})", self.ordinal, self.staging.context().name())
    }

    unsafe fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        // SAFETY: the range lies in a region registered on this device's
        // memory (the caller's contract; register_cuda checked the region).
        unsafe { self.staging.download(src, dst) }.map_err(|e| e.to_string())
    }

    unsafe fn write(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        // SAFETY: as in read.
        unsafe { self.staging.upload(dst, src) }.map_err(|e| e.to_string())
    }

    fn dmabuf(&self, addr: u64, len: usize) -> Option<Result<(std::os::fd::OwnedFd, u64), String>> {
        self.staging.context().dmabuf(addr, len).map(|r| r.map_err(|e| e.to_string()))
    }

    unsafe fn copy_device(&self, dst: u64, src: u64, len: usize) -> Option<Result<(), String>> {
        // SAFETY: the caller's contract: a range of a region registered on
        // this device and one of a peer's region opened in this process.
        Some(unsafe { self.staging.copy_device(dst, src, len) }.map_err(|e| e.to_string()))
    }

    unsafe fn copy_device_queue(&self, dst: u64, src: u64, len: usize) -> Option<Result<(), String>> {
        // SAFETY: as in copy_device; the caller keeps both ranges live
        // until its copy_device_wait.
        Some(unsafe { self.staging.copy_device_queue(dst, src, len) }.map_err(|e| e.to_string()))
    }

    fn copy_device_wait(&self) -> Result<(), String> {
        self.staging.wait_queued().map_err(|e| e.to_string())
    }

    fn ipc_export(&self, addr: u64, len: usize) -> Option<Result<Vec<u8>, String>> {
        let ctx = self.staging.context();
        Some((|| {
            // cuMemAlloc memory: its IPC handle; VMM memory: its mappings'
            // descriptors, from this process's descriptor server.
            let (export, offset) = ctx.export_range(addr, len).map_err(|e| e.to_string())?;
            Ok(format!(
                "{IPC_MAGIC} {} {} {} {offset} {addr} {len}",
                std::process::id(),
                hex(&self.uuid),
                export.to_text()
            )
            .into_bytes())
        })())
    }
}

/// What an export starts with (and its version).
const IPC_MAGIC: &str = "rmacomm-cuda-ipc/2";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Opens same-host peers' CUDA memory exports (installed for the soft
/// provider when this process first uses CUDA memory).
#[derive(Debug)]
struct CudaIpc;

/// A peer's region opened here: `len` bytes at `ptr` in this process
/// (its IPC mapping, or the address itself for this process's own memory).
#[derive(Debug)]
struct PeerCuda {
    dev: Arc<CudaMemory>,
    ptr: DevicePtr,
    len: u64,
    map: Option<rmacomm_cuda::device::IpcMapping>,
}

impl ibverbx::DeviceIpc for CudaIpc {
    fn open(&self, export: &[u8], pid: u32) -> Result<Arc<dyn ibverbx::PeerDevice>, String> {
        let text = std::str::from_utf8(export).map_err(|_| "the export is not text".to_string())?;
        let f: Vec<&str> = text.split(' ').collect();
        let parsed = (f.len() == 7 && f[0] == IPC_MAGIC)
            .then(|| {
                Some((
                    f[1].parse::<u32>().ok()?,
                    f[2].to_string(),
                    rmacomm_cuda::vmm::Export::from_text(f[3])?,
                    f[4].parse::<u64>().ok()?,
                    f[5].parse::<u64>().ok()?,
                    f[6].parse::<u64>().ok()?,
                ))
            })
            .flatten();
        let Some((owner, gpu, export, offset, addr, len)) = parsed else {
            return Err(format!("not an export this build reads: {text:?}"));
        };
        if owner != pid {
            return Err(format!("the export names pid {owner}, the peer is pid {pid}"));
        }
        // Opened in a context this process has already: the memory's own
        // GPU where this process uses it, else the first GPU it uses (peer
        // access reaches the memory from there). Never a new context here:
        // this runs on an engine thread, which a stream may be waiting for,
        // and a context on a GPU this process does not use costs that GPU
        // memory (every rank of an 8-GPU host would hold one on each).
        let dev = opener(&gpu).ok_or("this process uses no CUDA device to open it with")?;
        // The export comes from a segment peers can write: what it names is
        // checked with the driver (device memory, the whole range inside
        // one allocation) before any copy may use it.
        let check = |ptr: DevicePtr| -> Result<(), String> {
            let info = dev.staging.context().pointer_info(ptr).map_err(|e| e.to_string())?;
            let fits = ptr.checked_add(len).is_some_and(|end| end <= info.base + info.size as u64);
            if info.memory_type != MemoryType::Device || !fits {
                return Err(format!("{len} bytes at {ptr:#x} are not device memory of one allocation"));
            }
            Ok(())
        };
        if owner == std::process::id() {
            // This process's own memory (contexts of one process): its
            // address works as it is (IPC refuses it); one allocation or
            // contiguous VMM mappings.
            let ext = dev.staging.context().device_extent(addr, len as usize).map_err(|e| e.to_string())?;
            if usize::try_from(len).is_err() || ext.info.memory_type != MemoryType::Device {
                return Err(format!("{len} bytes at {addr:#x} are not device memory"));
            }
            return Ok(Arc::new(PeerCuda { dev, ptr: addr, len, map: None }));
        }
        let map = dev.staging.context().open_export(&export, owner).map_err(|e| e.to_string())?;
        let ptr = map.ptr().checked_add(offset).ok_or("the export's offset overflows")?;
        match map.mapped_len() {
            // VMM memory, mapped here whole: the range must lie in it.
            Some(mapped) => {
                if offset.checked_add(len).is_none_or(|end| end > mapped as u64) {
                    return Err(format!("{len} bytes at offset {offset} run past the {mapped} bytes mapped"));
                }
            }
            None => check(ptr)?,
        }
        Ok(Arc::new(PeerCuda { ptr, dev, len, map: Some(map) }))
    }
}

impl Drop for PeerCuda {
    fn drop(&mut self) {
        // The last user of a peer's region may be a soft engine thread,
        // which stream operations wait for (a window's stream proxy):
        // closing the mapping may synchronize the device, so it is closed
        // on the reaper's thread.
        if let Some(map) = self.map.take() {
            rmacomm_cuda::reaper::defer(map);
        }
    }
}

impl ibverbx::PeerDevice for PeerCuda {
    fn len(&self) -> u64 {
        self.len
    }

    fn device_addr(&self) -> Option<u64> {
        Some(self.ptr)
    }

    unsafe fn write(&self, offset: u64, src: *const u8, len: usize) -> Result<(), String> {
        // SAFETY: the peer's region (offset + len within it, the caller
        // checked), mapped while `self` lives; the source is the caller's.
        unsafe { self.dev.staging.upload_raw(self.ptr + offset, src, len) }.map_err(|e| e.to_string())
    }

    unsafe fn read(&self, offset: u64, dst: *mut u8, len: usize) -> Result<(), String> {
        // SAFETY: as in write, directions swapped.
        unsafe { self.dev.staging.download_raw(self.ptr + offset, dst, len) }.map_err(|e| e.to_string())
    }
}

/// The devices this process registered memory on, in the order it first
/// did.
static DEVICES: Mutex<Vec<Arc<CudaMemory>>> = Mutex::new(Vec::new());

/// The device to open a peer's export of GPU `uuid` (hex) with: that GPU
/// where this process uses it, else the first it used; `None` before any.
fn opener(uuid: &str) -> Option<Arc<CudaMemory>> {
    let devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    devices.iter().find(|d| hex(&d.uuid) == uuid).or_else(|| devices.first()).cloned()
}

/// The device's memory object, shared by every region on it (and its
/// staging buffers with them).
fn device(op: &'static str, ordinal: u32) -> Result<Arc<CudaMemory>, TransportError> {
    let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(d) = devices.iter().find(|d| d.ordinal == ordinal) {
        return Ok(d.clone());
    }
    let ctx = Context::open_shared(ordinal).map_err(|e| TransportError::Unsupported(format!("{op}: {e}")))?;
    let uuid = ctx.uuid().map_err(|e| TransportError::Unsupported(format!("{op}: {e}")))?;
    // The staging buffers are registered here, on the thread registering
    // memory, never on an engine thread a stream may be waiting for.
    let staging = Staging::new(ctx).map_err(|e| TransportError::Unsupported(format!("{op}: staging buffers: {e}")))?;
    let d = Arc::new(CudaMemory { ordinal, uuid, staging });
    devices.push(d.clone());
    // Same-host peers' CUDA memory opens here from now on.
    ibverbx::set_device_ipc(Arc::new(CudaIpc));
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
    // One allocation (cuMemAlloc), or contiguous VMM mappings (PyTorch's
    // expandable segments), of this device.
    let ext = dev.staging.context().device_extent(ptr, len).map_err(|e| {
        TransportError::invalid(OP, format!("{len} bytes at {ptr:#x} are not CUDA memory of device {ordinal}: {e}"))
    })?;
    if ext.info.device != ordinal as i32 {
        return Err(TransportError::invalid(
            OP,
            format!("{len} bytes at {ptr:#x} are memory of CUDA device {}, not {ordinal}", ext.info.device),
        ));
    }
    // SAFETY: checked device memory of this context; its lifetime is the
    // caller's promise.
    let mr = unsafe { MemoryRegion::register_device(&d.pd, dev, ptr, len, ACCESS, None)? };
    Ok(RdmaMemory::from_parts(Arc::new(mr), d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ibverbx::DeviceIpc;

    /// An export names what a peer may have rewritten: opening it checks
    /// with the driver (the CUDA stand-in here) that the range is device
    /// memory of one allocation.
    #[test]
    fn an_export_is_checked_before_it_is_used() {
        let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
        std::env::set_var("RMACOMM_CUDA_LIB", &lib);
        let dev = device("test", 0).unwrap();
        let mem = dev.staging.context().alloc_shared(8192).unwrap();
        let me = std::process::id();
        let export = |addr: u64, len: u64| {
            let handle = dev.staging.context().ipc_handle(mem.ptr()).unwrap();
            format!("{IPC_MAGIC} {me} {} {} 0 {addr} {len}", hex(&dev.uuid), handle.to_hex()).into_bytes()
        };
        let ok = CudaIpc.open(&export(mem.ptr(), 8192), me).unwrap();
        assert_eq!(ok.len(), 8192);
        let host = vec![0u8; 8192];
        for (addr, len, why) in [
            (host.as_ptr() as u64, 8192, "host memory"),
            (mem.ptr(), 8193, "past the allocation"),
            (mem.ptr() + 4096, 8192, "past the allocation"),
        ] {
            let e = CudaIpc.open(&export(addr, len), me).unwrap_err();
            assert!(
                e.contains("not device memory of one allocation") || e.contains("cuPointerGetAttribute"),
                "{why}: {e}"
            );
        }
        let e = CudaIpc.open(&export(mem.ptr(), 8192), me + 1).unwrap_err();
        assert!(e.contains("the peer is pid"), "{e}");
        assert!(CudaIpc.open(b"something else", me).is_err());
        // VMM memory in 2 MiB mappings: a range over several of them is
        // one region (exported by descriptors); past the mappings it is not.
        let ctx = dev.staging.context();
        let vmm = ctx.alloc_vmm(5 << 20, 2 << 20).unwrap();
        let ipc = dev.ipc_export(vmm.ptr() + 4096, 5 << 20).unwrap().unwrap();
        assert!(String::from_utf8_lossy(&ipc).contains(" vmm:"), "{}", String::from_utf8_lossy(&ipc));
        let region = CudaIpc.open(&ipc, me).unwrap();
        assert_eq!((region.len(), region.device_addr()), (5 << 20, Some(vmm.ptr() + 4096)));
        let e = dev.ipc_export(vmm.ptr() + (2 << 20), 5 << 20).unwrap().unwrap_err();
        assert!(e.contains("run past mapped device memory"), "{e}");
    }

    /// The staging buffers are made when the device is first used, on
    /// that thread, and copies only ever take them: more copies at once
    /// than there are stages wait for one instead of registering more
    /// host memory (which may hang on a thread a stream waits for:
    /// `rmacomm_cuda::staging::POOL`).
    #[test]
    fn copies_use_the_stages_made_up_front() {
        use rmacomm_cuda::staging::POOL;
        let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
        std::env::set_var("RMACOMM_CUDA_LIB", &lib);
        let dev = device("test", 0).unwrap();
        assert_eq!(dev.staging.free_stages(), POOL);
        let len = 3 * rmacomm_cuda::staging::STAGE_CHUNK + 5;
        let mem = dev.staging.context().alloc_shared(len * 3 * POOL).unwrap();
        std::thread::scope(|s| {
            for t in 0..3 * POOL {
                let (dev, at) = (&dev, mem.ptr() + (t * len) as u64);
                s.spawn(move || {
                    let data: Vec<u8> = (0..len).map(|i| (i * 7 + t) as u8).collect();
                    // SAFETY: this thread's own range of the allocation.
                    unsafe { dev.write(at, &data) }.unwrap();
                    let mut back = vec![0u8; len];
                    // SAFETY: as above.
                    unsafe { dev.read(at, &mut back) }.unwrap();
                    assert!(back == data, "thread {t}: what came back differs");
                });
            }
        });
        assert_eq!(dev.staging.free_stages(), POOL);
    }
}
