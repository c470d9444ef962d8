//! cuMem/VMM device memory between processes of one host: what CUDA IPC
//! handles cannot export.
//!
//! Memory from `cuMemCreate` mapped with `cuMemMap` (PyTorch's
//! `expandable_segments`, NCCL's `ncclMemAlloc`, [`Context::alloc_vmm`])
//! has no `cuIpcGetMemHandle`; a process shares it by exporting each
//! allocation as a POSIX file descriptor (`cuMemExportToShareableHandle`,
//! for allocations created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`
//! requested), which the other process imports and maps at an address of
//! its own. A descriptor crosses processes only by `SCM_RIGHTS`: each
//! process that exports runs a small descriptor server on an abstract unix
//! socket (per network namespace: exactly the scope of rmacomm's "same
//! host"), started at its first export.
//!
//! An [`Export`] names what a range needs: the CUDA IPC handle of a
//! `cuMemAlloc` allocation, or, for VMM memory, the server, a per-process
//! secret, and the contiguous mappings that hold the range (a tensor of
//! PyTorch's expandable segments may span several). Opening it
//! ([`Context::open_export`]) maps the same bytes here. The server checks
//! that the client runs as the same user and knows the secret, and hands
//! out only the whole mapping the request names, exportable, of a device
//! whose memory this process exported; the client checks with
//! `SO_PEERCRED` that the process answering is the owner the export names.

use std::ffi::{c_int, c_void};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage};

use crate::device::{DeviceMemory, IpcHandle, IpcMapping, MemoryType, PointerInfo};
use crate::driver::{Context, CuResult, DevicePtr, SPEC};
use crate::{CudaError, Result};

/// The driver's VMM calls (CUDA 10.2+), resolved with the rest of the API;
/// `None` where the driver lacks any of them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct VmmApi {
    pub(crate) create: unsafe extern "C" fn(*mut u64, usize, *const AllocProp, u64) -> CuResult,
    pub(crate) release: unsafe extern "C" fn(u64) -> CuResult,
    pub(crate) reserve: unsafe extern "C" fn(*mut DevicePtr, usize, usize, DevicePtr, u64) -> CuResult,
    pub(crate) address_free: unsafe extern "C" fn(DevicePtr, usize) -> CuResult,
    pub(crate) map: unsafe extern "C" fn(DevicePtr, usize, usize, u64, u64) -> CuResult,
    pub(crate) unmap: unsafe extern "C" fn(DevicePtr, usize) -> CuResult,
    pub(crate) set_access: unsafe extern "C" fn(DevicePtr, usize, *const AccessDesc, usize) -> CuResult,
    pub(crate) granularity: unsafe extern "C" fn(*mut usize, *const AllocProp, c_int) -> CuResult,
    pub(crate) retain: unsafe extern "C" fn(*mut u64, *mut c_void) -> CuResult,
    pub(crate) export: unsafe extern "C" fn(*mut c_void, u64, c_int, u64) -> CuResult,
    pub(crate) import: unsafe extern "C" fn(*mut u64, *mut c_void, c_int) -> CuResult,
}

impl VmmApi {
    /// Resolves the calls; `None` if any is missing.
    pub(crate) fn load(lib: &crate::loader::Opened) -> Option<VmmApi> {
        // SAFETY: each type is the C signature in cuda.h (CUmemGeneric-
        // AllocationHandle is an unsigned long long; the property and access
        // structures are laid out as below).
        unsafe {
            Some(VmmApi {
                create: lib.get("cuMemCreate\0").ok()?,
                release: lib.get("cuMemRelease\0").ok()?,
                reserve: lib.get("cuMemAddressReserve\0").ok()?,
                address_free: lib.get("cuMemAddressFree\0").ok()?,
                map: lib.get("cuMemMap\0").ok()?,
                unmap: lib.get("cuMemUnmap\0").ok()?,
                set_access: lib.get("cuMemSetAccess\0").ok()?,
                granularity: lib.get("cuMemGetAllocationGranularity\0").ok()?,
                retain: lib.get("cuMemRetainAllocationHandle\0").ok()?,
                export: lib.get("cuMemExportToShareableHandle\0").ok()?,
                import: lib.get("cuMemImportFromShareableHandle\0").ok()?,
            })
        }
    }
}

/// `CUmemAllocationProp` (32 bytes on 64-bit Linux).
#[repr(C)]
#[derive(Debug)]
pub(crate) struct AllocProp {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_metadata: *mut c_void,
    compression: u8,
    gpu_direct_rdma: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct AccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

// The driver's layouts (cuda.h, CUDA 12 and 13).
const _: () = assert!(std::mem::size_of::<AllocProp>() == 32 && std::mem::size_of::<AccessDesc>() == 12);

/// `CU_MEM_ALLOCATION_TYPE_PINNED`, `CU_MEM_LOCATION_TYPE_DEVICE`,
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`,
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`,
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
const PINNED: c_int = 1;
const LOCATION_DEVICE: c_int = 1;
const PROT_READWRITE: c_int = 3;
pub(crate) const POSIX_FD: c_int = 1;
const GRANULARITY_MINIMUM: c_int = 0;
/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
const ATTR_GDR_WITH_VMM: c_int = 110;

/// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`, `_ALLOWED_HANDLE_TYPES`,
/// `_MAPPING_SIZE`, `_MAPPING_BASE_ADDR`.
const PA_LEGACY_IPC: c_int = 10;
const PA_HANDLE_TYPES: c_int = 14;
const PA_MAPPING_SIZE: c_int = 18;
const PA_MAPPING_BASE: c_int = 19;

/// A descriptor request and its reply must be done within this long.
const DEADLINE: Duration = Duration::from_secs(10);
/// Connections served at once; more are closed at once.
const MAX_CONCURRENT: usize = 32;
/// At most this many mappings in one export (a 1 TiB range of 2 MiB
/// mappings would need 512 Ki: such a range is refused, naming this).
const MAX_MAPPINGS: usize = 65536;

fn invalid(call: &'static str, why: String) -> CudaError {
    CudaError::Call { lib: SPEC.lib, call, code: 1, name: why }
}

/// How another process on this host maps a range of this process's device
/// memory ([`Context::export_range`]); travels as text
/// ([`to_text`](Export::to_text), no spaces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Export {
    /// A `cuMemAlloc` allocation: its CUDA IPC handle.
    Ipc(IpcHandle),
    /// VMM memory: contiguous mappings whose descriptors the owner's server
    /// hands out.
    Vmm(VmmExport),
}

/// The VMM half of an [`Export`].
#[derive(Clone, PartialEq, Eq)]
pub struct VmmExport {
    /// The owner's descriptor server (an abstract socket name).
    server: String,
    /// The owner's secret, which requests must carry.
    secret: [u8; 16],
    /// The device the memory is on (the owner's ordinal).
    device: i32,
    /// The owner's address of the first mapping.
    base: DevicePtr,
    /// The mappings' lengths, in address order, contiguous from `base`.
    sizes: Vec<usize>,
}

impl std::fmt::Debug for VmmExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret is never printed.
        f.debug_struct("VmmExport")
            .field("server", &self.server)
            .field("device", &self.device)
            .field("base", &format_args!("{:#x}", self.base))
            .field("mappings", &self.sizes.len())
            .field("len", &self.len())
            .finish()
    }
}

impl VmmExport {
    /// The mappings' total length.
    pub fn len(&self) -> usize {
        self.sizes.iter().sum()
    }

    /// True when no mapping is named (never for an export this crate made).
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }
}

impl Export {
    /// The text form: the IPC handle's 128 hex digits, or
    /// `vmm:<server>:<secret>:<device>:<base>:<len>*<count>,...`.
    pub fn to_text(&self) -> String {
        match self {
            Export::Ipc(h) => h.to_hex(),
            Export::Vmm(v) => {
                let mut runs: Vec<(usize, usize)> = Vec::new();
                for &s in &v.sizes {
                    match runs.last_mut() {
                        Some((len, n)) if *len == s => *n += 1,
                        _ => runs.push((s, 1)),
                    }
                }
                let runs: Vec<String> = runs.iter().map(|(len, n)| format!("{len}*{n}")).collect();
                let secret: String = v.secret.iter().map(|b| format!("{b:02x}")).collect();
                format!("vmm:{}:{secret}:{}:{:x}:{}", v.server, v.device, v.base, runs.join(","))
            }
        }
    }

    /// Parses [`to_text`](Export::to_text)'s form; `None` for anything
    /// else (it comes from peers: every field is checked).
    pub fn from_text(s: &str) -> Option<Export> {
        let Some(rest) = s.strip_prefix("vmm:") else { return IpcHandle::from_hex(s).map(Export::Ipc) };
        let f: Vec<&str> = rest.split(':').collect();
        let [server, secret, device, base, runs] = f[..] else { return None };
        if server.is_empty() || server.len() > 100 || !server.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
            return None;
        }
        // Hex digits only, as written (from_str_radix also takes a '+').
        if secret.len() != 32 || !secret.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        if base.is_empty() || !base.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut key = [0u8; 16];
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(&secret[2 * i..2 * i + 2], 16).ok()?;
        }
        let mut sizes = Vec::new();
        for run in runs.split(',') {
            let (len, n) = run.split_once('*')?;
            let (len, n) = (len.parse::<usize>().ok()?, n.parse::<usize>().ok()?);
            if len == 0 || n == 0 || n > MAX_MAPPINGS - sizes.len() {
                return None;
            }
            sizes.extend(std::iter::repeat_n(len, n));
        }
        let v = VmmExport {
            server: server.to_string(),
            secret: key,
            device: device.parse().ok()?,
            base: u64::from_str_radix(base, 16).ok()?,
            sizes,
        };
        // The whole range must be addressable.
        v.sizes.iter().try_fold(v.base, |at, &s| at.checked_add(s as u64))?;
        Some(Export::Vmm(v))
    }
}

impl Context {
    fn vmm_api(&self, call: &'static str) -> Result<VmmApi> {
        self.api.vmm.ok_or_else(|| {
            invalid(call, "this CUDA driver has no virtual memory management calls (cuMemCreate and friends)".into())
        })
    }

    /// `cuPointerGetAttribute(attr, ptr)`.
    ///
    /// # Safety
    /// `T` must be the attribute's C type (the driver writes that many
    /// bytes).
    unsafe fn attr<T: Default>(&self, attr: c_int, ptr: DevicePtr) -> std::result::Result<T, CuResult> {
        let mut v = T::default();
        // SAFETY: a valid out-pointer of the attribute's type (the caller's
        // contract).
        let st = unsafe { (self.api.ptr_attr)((&raw mut v).cast(), attr, ptr) };
        if st == 0 {
            Ok(v)
        } else {
            Err(st)
        }
    }

    /// What holds the `len` bytes at `ptr`: the allocation (`cuMemAlloc`),
    /// or the contiguous VMM mappings (their lengths) that cover them; an
    /// error naming what is wrong for anything else (host memory, a range
    /// running past its allocation or past mapped memory, or VMM memory
    /// whose mappings cannot be exported as descriptors).
    pub fn device_extent(&self, ptr: DevicePtr, len: usize) -> Result<Extent> {
        const CALL: &str = "cuPointerGetAttribute";
        // Bound for every attribute below (a thread with no context current
        // may get CUDA_ERROR_INVALID_CONTEXT).
        let _bound = self.bind()?;
        let info = self.pointer_info(ptr)?;
        if info.memory_type != MemoryType::Device {
            return Err(invalid(CALL, format!("{ptr:#x} is {:?} memory, not device memory", info.memory_type)));
        }
        let end = ptr
            .checked_add(len.max(1) as u64)
            .ok_or_else(|| invalid(CALL, format!("{len} bytes at {ptr:#x} wrap around")))?;
        // Drivers without the attribute know only cuMemAlloc memory.
        // SAFETY: the attribute is an int (a boolean).
        let legacy = unsafe { self.attr::<c_int>(PA_LEGACY_IPC, ptr) }.unwrap_or(1) != 0;
        if legacy {
            if end > info.base + info.size as u64 {
                return Err(invalid(
                    CALL,
                    format!("{len} bytes at {ptr:#x} run past its allocation ({:#x}+{})", info.base, info.size),
                ));
            }
            return Ok(Extent { info, vmm: None });
        }
        let mapping = |at: DevicePtr| -> Result<(DevicePtr, usize, c_int)> {
            let gone = |st| crate::driver::call_error(self.api.err_name, CALL, st);
            // SAFETY: a CUdeviceptr, a size_t and a CUmemAllocationHandleType
            // (an int-sized enum), as cuda.h declares them.
            let (base, size, types) = unsafe {
                (
                    self.attr::<u64>(PA_MAPPING_BASE, at).map_err(gone)?,
                    self.attr::<usize>(PA_MAPPING_SIZE, at).map_err(gone)?,
                    self.attr::<c_int>(PA_HANDLE_TYPES, at).map_err(gone)?,
                )
            };
            Ok((base, size, types))
        };
        let (base, size, types) = mapping(ptr)?;
        let mut sizes = vec![size];
        let mut types_all = types;
        let mut at = base + size as u64;
        while at < end {
            let next = mapping(at).ok().filter(|(b, s, _)| *b == at && *s > 0 && self.pointer_info(at).is_ok());
            let Some((_, s, t)) = next else {
                return Err(invalid(
                    CALL,
                    format!("{len} bytes at {ptr:#x} run past mapped device memory (VMM mappings end at {at:#x})"),
                ));
            };
            if sizes.len() == MAX_MAPPINGS {
                return Err(invalid(CALL, format!("{len} bytes at {ptr:#x} span more than {MAX_MAPPINGS} mappings")));
            }
            sizes.push(s);
            types_all &= t;
            at += s as u64;
        }
        if types_all & POSIX_FD == 0 {
            return Err(invalid(
                "cuMemExportToShareableHandle",
                format!(
                    "the memory at {ptr:#x} has no CUDA IPC handle and does not allow \
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (VMM memory created without that handle type, or \
                     stream-ordered pool memory from cudaMallocAsync, e.g. PyTorch's backend:cudaMallocAsync), so \
                     no other process can map it; use cudaMalloc/cuMemAlloc memory, or VMM memory with that type \
                     (PyTorch's expandable segments)"
                ),
            ));
        }
        let total = sizes.iter().sum();
        Ok(Extent { info: PointerInfo { base, size: total, ..info }, vmm: Some(sizes) })
    }

    /// How another process on this host maps the `len` bytes at `ptr`
    /// ([`open_export`](Self::open_export)), and `ptr`'s offset from the
    /// start of what the export maps. VMM memory starts this process's
    /// descriptor server (once).
    pub fn export_range(self: &Arc<Self>, ptr: DevicePtr, len: usize) -> Result<(Export, u64)> {
        let _bound = self.bind()?;
        let ext = self.device_extent(ptr, len)?;
        let offset = ptr - ext.info.base;
        let Some(sizes) = ext.vmm else {
            return Ok((Export::Ipc(self.ipc_handle(ext.info.base)?), offset));
        };
        self.vmm_api("cuMemExportToShareableHandle")?;
        let srv = server(self)?;
        Ok((
            Export::Vmm(VmmExport {
                server: srv.name.clone(),
                secret: srv.secret,
                device: self.ordinal(),
                base: ext.info.base,
                sizes,
            }),
            offset,
        ))
    }

    /// Maps another process's export here until the mapping drops: a CUDA
    /// IPC handle through [`open_ipc`](Self::open_ipc); VMM memory by
    /// fetching each mapping's descriptor from `owner`'s server (which must
    /// be process `owner`), importing it, and mapping the whole range at
    /// one address of this process, readable and writable by this device.
    pub fn open_export(self: &Arc<Self>, export: &Export, owner: u32) -> Result<IpcMapping> {
        const CALL: &str = "cuMemImportFromShareableHandle";
        let v = match export {
            Export::Ipc(h) => return self.open_ipc(h),
            Export::Vmm(v) => v,
        };
        let api = self.vmm_api(CALL)?;
        let _bound = self.bind()?;
        // Imported handles, released on every path below (a mapping keeps
        // its allocation).
        struct Handles(VmmApi, Vec<u64>);
        impl Drop for Handles {
            fn drop(&mut self) {
                for h in &self.1 {
                    // SAFETY: a handle imported below, released once.
                    unsafe { (self.0.release)(*h) };
                }
            }
        }
        let mut handles = Handles(api, Vec::with_capacity(v.sizes.len()));
        // Each descriptor is imported as it arrives and closed (a large
        // tensor in small mappings must not hold thousands open).
        fetch(v, owner, |fd| {
            let mut h = 0u64;
            // SAFETY: a valid out-pointer; the descriptor (ours, open) is
            // passed as the driver's POSIX handle, by value in a pointer.
            let st = unsafe { (api.import)(&mut h, fd.as_raw_fd() as usize as *mut c_void, POSIX_FD) };
            self.check(CALL, st).map_err(|e| e.to_string())?;
            handles.1.push(h);
            Ok(())
        })
        .map_err(|why| invalid(CALL, format!("VMM memory of pid {owner}: {why}")))?;
        let total = v.len();
        let mut ptr = 0;
        // SAFETY: a valid out-pointer; default alignment, any address.
        self.check("cuMemAddressReserve", unsafe { (api.reserve)(&mut ptr, total, 0, 0, 0) })?;
        let mut mapping = IpcMapping::vmm(self.clone(), ptr, total);
        for (h, &size) in handles.1.iter().zip(&v.sizes) {
            let at = ptr + mapping.vmm_mapped() as u64;
            // SAFETY: a whole imported allocation at the next free part of
            // the reservation made above.
            self.check("cuMemMap", unsafe { (api.map)(at, size, 0, *h, 0) })?;
            mapping.vmm_push(size);
        }
        let desc = AccessDesc { location_type: LOCATION_DEVICE, location_id: self.dev, flags: PROT_READWRITE };
        // SAFETY: the fully mapped range; one descriptor.
        self.check("cuMemSetAccess", unsafe { (api.set_access)(ptr, total, &desc, 1) })?;
        Ok(mapping)
    }

    /// `len` zeroed bytes of VMM memory (`cuMemCreate`), exportable to other
    /// processes as descriptors: allocations of `segment` bytes (rounded up
    /// to the device's granularity) mapped one after another, as PyTorch's
    /// expandable segments are; `segment >= len` gives one allocation.
    /// Freed on drop.
    pub fn alloc_vmm(self: &Arc<Self>, len: usize, segment: usize) -> Result<DeviceMemory> {
        self.alloc_vmm_typed(len, segment, POSIX_FD)
    }

    /// VMM memory allocated with no shareable handle type requested (what
    /// [`export_range`](Self::export_range) must refuse): for tests.
    #[doc(hidden)]
    pub fn alloc_vmm_unexportable(self: &Arc<Self>, len: usize) -> Result<DeviceMemory> {
        self.alloc_vmm_typed(len, len, 0)
    }

    fn alloc_vmm_typed(self: &Arc<Self>, len: usize, segment: usize, types: c_int) -> Result<DeviceMemory> {
        let api = self.vmm_api("cuMemCreate")?;
        let _bound = self.bind()?;
        let prop = AllocProp {
            kind: PINNED,
            handle_types: types,
            location_type: LOCATION_DEVICE,
            location_id: self.dev,
            win32_metadata: std::ptr::null_mut(),
            compression: 0,
            gpu_direct_rdma: 0,
            usage: 0,
            reserved: [0; 4],
        };
        let mut gran = 0usize;
        // SAFETY: a valid out-pointer and properties.
        self.check("cuMemGetAllocationGranularity", unsafe {
            (api.granularity)(&mut gran, &prop, GRANULARITY_MINIMUM)
        })?;
        let gran = gran.max(1);
        let too_big = || invalid("cuMemCreate", format!("{len} bytes in {segment}-byte mappings overflow"));
        let seg = segment.max(1).div_ceil(gran).checked_mul(gran).ok_or_else(too_big)?;
        let total = len.max(1).div_ceil(seg).checked_mul(seg).ok_or_else(too_big)?;
        // GPUDirect RDMA on VMM memory must be asked for at creation (as
        // PyTorch does where the device allows it): an HCA can then
        // register the memory.
        let mut gdr: c_int = 0;
        // SAFETY: a valid out-pointer and device.
        let st = unsafe { (self.api.device_attr)(&mut gdr, ATTR_GDR_WITH_VMM, self.dev) };
        let prop = AllocProp { gpu_direct_rdma: u8::from(st == 0 && gdr != 0), ..prop };
        let mut ptr = 0;
        // SAFETY: a valid out-pointer.
        self.check("cuMemAddressReserve", unsafe { (api.reserve)(&mut ptr, total, 0, 0, 0) })?;
        let mut mapping = IpcMapping::vmm(self.clone(), ptr, total);
        while mapping.vmm_mapped() < total {
            let mut h = 0u64;
            // SAFETY: a valid out-pointer and properties.
            self.check("cuMemCreate", unsafe { (api.create)(&mut h, seg, &prop, 0) })?;
            // SAFETY: the new allocation, whole, at the next free part of
            // the reservation; released after (the mapping keeps it).
            let st = unsafe { (api.map)(ptr + mapping.vmm_mapped() as u64, seg, 0, h, 0) };
            // SAFETY: created above, released once.
            unsafe { (api.release)(h) };
            self.check("cuMemMap", st)?;
            mapping.vmm_push(seg);
        }
        let desc = AccessDesc { location_type: LOCATION_DEVICE, location_id: self.dev, flags: PROT_READWRITE };
        // SAFETY: the fully mapped range; one descriptor.
        self.check("cuMemSetAccess", unsafe { (api.set_access)(ptr, total, &desc, 1) })?;
        DeviceMemory::from_vmm(mapping, len)
    }
}

/// What holds a range of device memory ([`Context::device_extent`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// The memory: `base` and `size` span the allocation, or the VMM
    /// mappings, that hold the range.
    pub info: PointerInfo,
    /// For VMM memory, the mappings' lengths (contiguous from `info.base`).
    pub vmm: Option<Vec<usize>>,
}

/// This process's descriptor server.
struct Server {
    name: String,
    secret: [u8; 16],
    /// The contexts whose memory was exported, by device ordinal.
    contexts: Mutex<Vec<Arc<Context>>>,
}

/// Starts the server (once) and adds `ctx`'s device to what it serves.
fn server(ctx: &Arc<Context>) -> Result<Arc<Server>> {
    static SERVER: OnceLock<std::result::Result<Arc<Server>, String>> = OnceLock::new();
    let srv = SERVER
        .get_or_init(|| start().map_err(|e| format!("starting the VMM descriptor server: {e}")))
        .as_ref()
        .map_err(|e| invalid("cuMemExportToShareableHandle", e.clone()))?
        .clone();
    let mut ctxs = srv.contexts.lock().unwrap_or_else(|e| e.into_inner());
    if !ctxs.iter().any(|c| c.ordinal() == ctx.ordinal()) {
        ctxs.push(ctx.clone());
    }
    drop(ctxs);
    Ok(srv)
}

fn random16() -> std::io::Result<[u8; 16]> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b)
}

fn start() -> std::io::Result<Arc<Server>> {
    use std::os::linux::net::SocketAddrExt;
    let secret = random16()?;
    let nonce: String = random16()?[..4].iter().map(|b| format!("{b:02x}")).collect();
    let name = format!("rmacomm-cuda-fds.{}.{nonce}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = UnixListener::bind_addr(&addr)?;
    let srv = Arc::new(Server { name, secret, contexts: Mutex::new(Vec::new()) });
    let s = srv.clone();
    std::thread::Builder::new().name("rmacomm-cuda-fds".into()).spawn(move || accept(&s, listener))?;
    Ok(srv)
}

fn accept(srv: &Arc<Server>, listener: UnixListener) {
    static ACTIVE: AtomicUsize = AtomicUsize::new(0);
    for conn in listener.incoming() {
        let Ok(conn) = conn else {
            // Out of descriptors (or an aborted connection): not a busy loop.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if ACTIVE.fetch_add(1, Ordering::SeqCst) >= MAX_CONCURRENT {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
            // A fresh socket's buffer takes the short reply at once.
            let _ = conn.set_nonblocking(true);
            let _ = reply(&conn, Err(format!("busy: {MAX_CONCURRENT} connections are being served; try again")));
            continue;
        }
        let srv = srv.clone();
        let spawned = std::thread::Builder::new().name("rmacomm-cuda-fd".into()).spawn(move || {
            serve(&srv, conn);
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Request: magic, secret, device, padding, mapping address, its length.
const REQ_LEN: usize = 48;
const REQ_MAGIC: [u8; 8] = *b"RMACUFD1";
/// Reply: magic, status (0: one descriptor attached), reason length; the
/// reason follows.
const REPLY_LEN: usize = 16;
const REPLY_MAGIC: [u8; 8] = *b"RMACUFDR";

fn serve(srv: &Server, mut conn: UnixStream) {
    let _ = conn.set_read_timeout(Some(DEADLINE));
    let _ = conn.set_write_timeout(Some(DEADLINE));
    let euid = rustix::process::geteuid().as_raw();
    let Ok((_, uid)) = peer_cred(&conn) else { return };
    if uid != euid && uid != 0 {
        let _ = reply(&conn, Err(format!("uid {uid} is not this process's user")));
        return;
    }
    let mut req = [0u8; REQ_LEN];
    while conn.read_exact(&mut req).is_ok() {
        let answer = answer(srv, &req);
        let refused = answer.is_err();
        if reply(&conn, answer).is_err() || refused {
            return;
        }
    }
}

/// The descriptor a request asks for, or why not.
fn answer(srv: &Server, req: &[u8; REQ_LEN]) -> std::result::Result<OwnedFd, String> {
    if req[..8] != REQ_MAGIC {
        return Err("not a descriptor request".into());
    }
    if req[8..24] != srv.secret {
        return Err("wrong secret".into());
    }
    let device = i32::from_le_bytes(req[24..28].try_into().expect("4 bytes"));
    let base = u64::from_le_bytes(req[32..40].try_into().expect("8 bytes"));
    let size = u64::from_le_bytes(req[40..48].try_into().expect("8 bytes")) as usize;
    let ctx = srv.contexts.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|c| c.ordinal() == device).cloned();
    let ctx = ctx.ok_or_else(|| format!("no memory of device {device} was exported here"))?;
    let api = ctx.vmm_api("cuMemExportToShareableHandle").map_err(|e| e.to_string())?;
    let _bound = ctx.bind().map_err(|e| e.to_string())?;
    let ext = ctx.device_extent(base, size).map_err(|e| e.to_string())?;
    if ext.info.base != base || ext.vmm.as_deref() != Some(&[size][..]) {
        return Err(format!("{base:#x}+{size} is not one whole exportable VMM mapping here"));
    }
    let mut h = 0u64;
    // SAFETY: a valid out-pointer; an address of a live mapping (checked).
    ctx.check("cuMemRetainAllocationHandle", unsafe { (api.retain)(&mut h, base as *mut c_void) })
        .map_err(|e| e.to_string())?;
    let mut fd: c_int = -1;
    // SAFETY: a valid out-pointer (an int for the POSIX handle type).
    let st = unsafe { (api.export)((&raw mut fd).cast(), h, POSIX_FD, 0) };
    // SAFETY: retained above, released once.
    unsafe { (api.release)(h) };
    ctx.check("cuMemExportToShareableHandle", st).map_err(|e| e.to_string())?;
    // SAFETY: the driver returned a new descriptor, ours.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

fn reply(conn: &UnixStream, answer: std::result::Result<OwnedFd, String>) -> std::io::Result<()> {
    let why = answer.as_ref().err().map(|w| w.as_bytes()[..w.len().min(1024)].to_vec()).unwrap_or_default();
    let mut frame = Vec::with_capacity(REPLY_LEN + why.len());
    frame.extend_from_slice(&REPLY_MAGIC);
    frame.extend_from_slice(&u32::from(answer.is_err()).to_le_bytes());
    frame.extend_from_slice(&(why.len() as u32).to_le_bytes());
    frame.extend_from_slice(&why);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Ok(fd) = &answer {
        fds = [fd.as_fd()];
        if !cmsg.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(std::io::Error::other("descriptor buffer too small"));
        }
    }
    let n = rustix::net::sendmsg(conn, &[IoSlice::new(&frame)], &mut cmsg, rustix::net::SendFlags::NOSIGNAL)?;
    (&*conn).write_all(&frame[n..])
}

/// The peer's (pid, uid) (`SO_PEERCRED`); pid 0 where the peer is in a PID
/// namespace this process cannot see. Read with libc: rustix's `UCred`
/// holds the pid as a non-zero value.
fn peer_cred(conn: &UnixStream) -> std::io::Result<(u32, u32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a live socket; `cred` and `len` are valid out-pointers of
    // the option's type and size.
    let st = unsafe {
        libc::getsockopt(conn.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len)
    };
    if st != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid.max(0) as u32, cred.uid))
}

/// Fetches every mapping's descriptor of `v` from its server, which must
/// be process `owner`, and hands each to `take` as it arrives (so that
/// no more than one is open at a time).
fn fetch(
    v: &VmmExport,
    owner: u32,
    mut take: impl FnMut(OwnedFd) -> std::result::Result<(), String>,
) -> std::result::Result<(), String> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(v.server.as_bytes()).map_err(|e| e.to_string())?;
    let mut conn = UnixStream::connect_addr(&addr)
        .map_err(|e| format!("its descriptor server {:?} does not answer ({e}): has it exited?", v.server))?;
    conn.set_read_timeout(Some(DEADLINE)).map_err(|e| e.to_string())?;
    conn.set_write_timeout(Some(DEADLINE)).map_err(|e| e.to_string())?;
    let (pid, _) = peer_cred(&conn).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if pid != owner {
        return Err(format!("its descriptor server {:?} is process {pid}, not {owner}", v.server));
    }
    let mut at = v.base;
    for &size in &v.sizes {
        let mut req = [0u8; REQ_LEN];
        req[..8].copy_from_slice(&REQ_MAGIC);
        req[8..24].copy_from_slice(&v.secret);
        req[24..28].copy_from_slice(&v.device.to_le_bytes());
        req[32..40].copy_from_slice(&at.to_le_bytes());
        req[40..48].copy_from_slice(&(size as u64).to_le_bytes());
        conn.write_all(&req).map_err(|e| format!("request: {e}"))?;
        let (status, why, fd) =
            recv_reply(&conn).map_err(|e| format!("reply to the request for {at:#x}+{size}: {e}"))?;
        match (status, fd) {
            (0, Some(fd)) => take(fd)?,
            (0, None) => return Err(format!("the reply for {at:#x}+{size} carried no descriptor")),
            _ => return Err(format!("the mapping {at:#x}+{size} was refused: {why}")),
        }
        at += size as u64;
    }
    Ok(())
}

fn recv_reply(mut conn: &UnixStream) -> std::io::Result<(u32, String, Option<OwnedFd>)> {
    let mut head = [0u8; REPLY_LEN];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < REPLY_LEN {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut cmsg = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut head[got..])];
        let r = match rustix::net::recvmsg(conn, &mut iov, &mut cmsg, RecvFlags::CMSG_CLOEXEC) {
            Err(rustix::io::Errno::INTR) => continue,
            r => r?,
        };
        for m in cmsg.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = m {
                fds.extend(rights);
            }
        }
        if r.flags.contains(rustix::net::ReturnFlags::CTRUNC) || fds.len() > 1 {
            return Err(std::io::Error::other("more than one descriptor"));
        }
        if r.bytes == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += r.bytes;
    }
    if head[..8] != REPLY_MAGIC {
        return Err(std::io::Error::other("not a descriptor reply"));
    }
    let status = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    let n = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if n > 1024 {
        return Err(std::io::Error::other("an over-long reason"));
    }
    let mut why = vec![0u8; n];
    conn.read_exact(&mut why)?;
    Ok((status, String::from_utf8_lossy(&why).into_owned(), fds.pop()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> VmmExport {
        VmmExport {
            server: "rmacomm-cuda-fds.42.0a0b0c0d".into(),
            secret: [7; 16],
            device: 0,
            base: 0x7f00_0000_0000,
            sizes: vec![2 << 20, 2 << 20, 2 << 20, 20 << 20],
        }
    }

    #[test]
    fn exports_round_trip_through_text_and_bad_text_is_refused() {
        let v = Export::Vmm(sample());
        let t = v.to_text();
        assert!(!t.contains(' '), "{t}");
        assert!(t.ends_with(":2097152*3,20971520*1"), "{t}");
        assert_eq!(Export::from_text(&t), Some(v));
        let h = Export::Ipc(IpcHandle([3; 64]));
        assert_eq!(Export::from_text(&h.to_text()), Some(h));
        for bad in [
            "vmm:",
            "vmm:a:b:c:d:e",
            &t.replace("*3", "*0"),
            &t.replace(":0:", ":x:"),
            &t.replace("2097152*3", "0*3"),
            &t.replace("rmacomm", "rma comm"),
            &format!("{t}:extra"),
            "vmm:s:0707070707070707070707070707070z:0:10:4096*1",
            "vmm:s:07070707070707070707070707070707:0:ffffffffffffffff:4096*1",
            "vmm:s:07070707070707070707070707070707:0:10:4096*99999999",
            "vmm:s:07070707070707070707070707070707:0:10:4096*1,4096*18446744073709551615",
            // A sign is not a hex digit (from_str_radix takes it).
            "vmm:s:+7070707070707070707070707070707:0:10:4096*1",
            "vmm:s:07070707070707070707070707070707:0:+10:4096*1",
        ] {
            assert_eq!(Export::from_text(bad), None, "{bad}");
        }
        assert!(!format!("{:?}", sample()).contains("0707"), "the secret is never printed");
    }
}
