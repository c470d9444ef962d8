//! Device memory that outlives a borrow: what windows and transports keep
//! (an `Arc<Context>` inside), CUDA IPC between processes, host memory
//! made visible to the device, streams with their memory operations
//! (`cuStreamWriteValue64` / `cuStreamWaitValue64`) and graph capture.
//!
//! Every call binds the context first, so any thread may use these.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::Arc;

use crate::driver::{call_error, Context, CuGraph, CuGraphExec, CuStream, DevicePtr, SPEC};
use crate::{CudaError, Result};

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`, `_DEVICE_ORDINAL`,
/// `_RANGE_START_ADDR`, `_RANGE_SIZE`.
const PA_MEMORY_TYPE: c_int = 2;
const PA_DEVICE_ORDINAL: c_int = 9;
const PA_RANGE_START: c_int = 11;
const PA_RANGE_SIZE: c_int = 12;
/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`.
const HOST_REGISTER_FLAGS: u32 = 1 | 2;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
const IPC_LAZY_PEER: u32 = 1;
/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CU_STREAM_WAIT_VALUE_GEQ`, `CU_STREAM_WRITE_VALUE_DEFAULT` (a write
/// preceded by a system-wide memory fence).
const WAIT_GEQ: u32 = 0;
const WRITE_DEFAULT: u32 = 0;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_RELAXED: c_int = 2;
/// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` (the CUDA 12 value).
const ATTR_64_BIT_MEM_OPS: c_int = 122;
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
const ALREADY_REGISTERED: c_int = 712;

/// What kind of memory a pointer is (`CUmemorytype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryType {
    /// Host memory (pinned or registered).
    Host,
    /// Device memory.
    Device,
    /// A CUDA array.
    Array,
    /// Managed (unified) memory.
    Unified,
    /// A value this crate does not know.
    Other(u32),
}

/// What the driver knows of a device pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    /// The kind of memory.
    pub memory_type: MemoryType,
    /// The device it lives on.
    pub device: i32,
    /// The start of the allocation that holds it (what IPC exports).
    pub base: DevicePtr,
    /// The allocation's size.
    pub size: usize,
}

/// A CUDA IPC handle (`CUipcMemHandle`): 64 opaque bytes another process on
/// the host opens with [`Context::open_ipc`].
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle(pub [u8; 64]);

/// The allocations this process has opened, with how many mappings use
/// each: the driver refuses (or may refuse) a second `cuIpcOpenMemHandle`
/// of one allocation in a process, which two windows over tensors of one
/// PyTorch segment would need.
static OPENED: std::sync::Mutex<Option<OpenedMap>> = std::sync::Mutex::new(None);

/// Peers' allocations this process has open through CUDA IPC now (for
/// tests and diagnostics).
pub fn ipc_mappings_open() -> usize {
    let opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
    opened.as_ref().map_or(0, |m| m.values().filter(|(_, refs)| *refs > 0).count())
}

/// Signalled when a closing allocation's entry leaves [`OPENED`].
static CLOSED: std::sync::Condvar = std::sync::Condvar::new();

/// How long `open_ipc` waits for a close of the same allocation.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// `CUDA_ERROR_ALREADY_MAPPED`.
const CUDA_ERROR_ALREADY_MAPPED: i32 = 208;

/// (device, handle) → (where it is mapped, mappings using it; 0 while its
/// last mapping is being closed).
type OpenedMap = std::collections::HashMap<(i32, IpcHandle), (DevicePtr, usize)>;

impl fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcHandle({})", self.to_hex())
    }
}

impl IpcHandle {
    /// The handle as 128 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`to_hex`](Self::to_hex)'s text; `None` for anything else.
    pub fn from_hex(s: &str) -> Option<IpcHandle> {
        let b = s.as_bytes();
        // Hex digits only (from_str_radix also takes a leading '+').
        if b.len() != 128 || !b.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        let mut out = [0u8; 64];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(std::str::from_utf8(&b[2 * i..2 * i + 2]).ok()?, 16).ok()?;
        }
        Some(IpcHandle(out))
    }
}

fn invalid(call: &'static str, why: String) -> CudaError {
    CudaError::Call { lib: SPEC.lib, call, code: 1, name: why }
}

impl Context {
    /// Opens device `ordinal`'s primary context, shared: what
    /// [`DeviceMemory`], [`Stream`] and mappings keep alive.
    pub fn open_shared(ordinal: u32) -> Result<Arc<Context>> {
        Context::open(ordinal).map(Arc::new)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> i32 {
        self.dev
    }

    /// Whether streams of this device can wait on and write 64-bit values
    /// (`cuStreamWaitValue64` / `cuStreamWriteValue64`).
    pub fn stream_mem_ops(&self) -> Result<bool> {
        let mut v = 0;
        // SAFETY: a valid out-pointer and device.
        self.check("cuDeviceGetAttribute", unsafe { (self.api.device_attr)(&mut v, ATTR_64_BIT_MEM_OPS, self.dev) })?;
        Ok(v != 0)
    }

    /// `len` zeroed bytes of device memory, freed when the last user drops
    /// it.
    pub fn alloc_shared(self: &Arc<Self>, len: usize) -> Result<DeviceMemory> {
        let _bound = self.bind()?;
        let mut ptr = 0;
        // SAFETY: a valid out-pointer; the context is current.
        self.check("cuMemAlloc", unsafe { (self.api.mem_alloc)(&mut ptr, len.max(1)) })?;
        let mem = DeviceMemory { ctx: self.clone(), ptr, len, vmm: None };
        // Zeroed on a stream of its own, not the context: a context-wide
        // synchronize would wait for other threads' streams too (ranks as
        // threads: one that waits for this thread's signal).
        let s = self.stream()?;
        // SAFETY: the allocation just made, of at least `len` bytes.
        self.check("cuMemsetD8Async", unsafe { (self.api.memset_d8)(ptr, 0, len, s.s) })?;
        s.synchronize()?;
        Ok(mem)
    }

    /// What the driver knows of `ptr`: an error for an address no CUDA
    /// allocation holds.
    pub fn pointer_info(&self, ptr: DevicePtr) -> Result<PointerInfo> {
        let _bound = self.bind()?;
        let (mut mt, mut dev, mut base, mut size) = (0u32, 0 as c_int, 0 as DevicePtr, 0usize);
        // SAFETY: each out-pointer has the attribute's type (unsigned int,
        // int, CUdeviceptr, size_t).
        unsafe {
            self.check("cuPointerGetAttribute", (self.api.ptr_attr)((&raw mut mt).cast(), PA_MEMORY_TYPE, ptr))?;
            self.check("cuPointerGetAttribute", (self.api.ptr_attr)((&raw mut dev).cast(), PA_DEVICE_ORDINAL, ptr))?;
            self.check("cuPointerGetAttribute", (self.api.ptr_attr)((&raw mut base).cast(), PA_RANGE_START, ptr))?;
            self.check("cuPointerGetAttribute", (self.api.ptr_attr)((&raw mut size).cast(), PA_RANGE_SIZE, ptr))?;
        }
        let memory_type = match mt {
            1 => MemoryType::Host,
            2 => MemoryType::Device,
            3 => MemoryType::Array,
            4 => MemoryType::Unified,
            o => MemoryType::Other(o),
        };
        Ok(PointerInfo { memory_type, device: dev, base, size })
    }

    /// The IPC handle of the allocation that starts at `base` (device
    /// memory from `cuMemAlloc`; not managed or VMM memory).
    pub fn ipc_handle(&self, base: DevicePtr) -> Result<IpcHandle> {
        let _bound = self.bind()?;
        let mut h = IpcHandle([0; 64]);
        // SAFETY: a valid out-pointer of the handle's layout.
        self.check("cuIpcGetMemHandle", unsafe { (self.api.ipc_get)(&mut h, base) })?;
        Ok(h)
    }

    /// Maps another process's allocation (its [`IpcHandle`]) into this
    /// one, until the last mapping of it drops (an allocation opened twice
    /// is mapped once, counted). The handle of an allocation of this
    /// process is refused by the driver.
    pub fn open_ipc(self: &Arc<Self>, handle: &IpcHandle) -> Result<IpcMapping> {
        let key = (self.dev, *handle);
        let mut guard = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        // An allocation whose last mapping is being closed (IpcMapping's
        // drop) is waited for, briefly: the close may wait for the whole
        // device, and the caller may be a thread a stream waits for.
        let deadline = std::time::Instant::now() + CLOSE_WAIT;
        loop {
            match guard.get_or_insert_with(Default::default).get_mut(&key) {
                Some((ptr, refs)) if *refs > 0 => {
                    *refs += 1;
                    return Ok(IpcMapping {
                        ctx: self.clone(),
                        ptr: *ptr,
                        key: Some(key),
                        vmm: Vec::new(),
                        mapped: 0,
                        reserved: 0,
                    });
                }
                Some(_) => {
                    let now = std::time::Instant::now();
                    if now >= deadline {
                        return Err(CudaError::Call {
                            lib: SPEC.lib,
                            call: "cuIpcOpenMemHandle",
                            code: CUDA_ERROR_ALREADY_MAPPED,
                            name: format!(
                                "CUDA_ERROR_ALREADY_MAPPED: this allocation's last mapping here is still being closed \
                                 after {CLOSE_WAIT:?} (the close waits for the device); open it again later"
                            ),
                        });
                    }
                    guard = CLOSED.wait_timeout(guard, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
                }
                None => break,
            }
        }
        let opened = guard.get_or_insert_with(Default::default);
        let _bound = self.bind()?;
        let mut ptr = 0;
        // SAFETY: a valid out-pointer; the handle is passed by value.
        self.check("cuIpcOpenMemHandle", unsafe { (self.api.ipc_open)(&mut ptr, *handle, IPC_LAZY_PEER) })?;
        opened.insert(key, (ptr, 1));
        Ok(IpcMapping { ctx: self.clone(), ptr, key: Some(key), vmm: Vec::new(), mapped: 0, reserved: 0 })
    }

    /// Page-locks `len` bytes of host memory at `ptr` (widened to whole
    /// pages) and maps them for the device, until the registration drops.
    ///
    /// Pages an earlier `register_host` of this process registered are
    /// shared with it (counted: unregistered when the last holder drops);
    /// a range that only overlaps such a registration is refused. Memory
    /// registered by someone else (torch's `cudaHostRegister`) is used as
    /// it is when the driver maps the whole range, refused otherwise.
    ///
    /// # Safety
    /// The range must stay mapped while the registration lives.
    pub unsafe fn register_host(self: &Arc<Self>, ptr: *mut u8, len: usize) -> Result<HostRegistration> {
        let _bound = self.bind()?;
        let page = 4096usize;
        let start = (ptr as usize) & !(page - 1);
        let end = (ptr as usize)
            .checked_add(len.max(1))
            .map(|e| e.div_ceil(page) * page)
            .ok_or_else(|| self.host_error(ptr, len, "the range wraps past the end of the address space"))?;
        let mut regs = HOST_REGS.lock().unwrap_or_else(|e| e.into_inner());
        // Ours already: an entry holding these pages, or one in the way.
        let before = regs.range(..end).next_back().map(|(&b, &(e, _))| (b, e)).filter(|&(_, e)| e > start);
        let held = match before {
            Some((b, e)) if b <= start && end <= e => {
                regs.get_mut(&b).expect("found above").1 += 1;
                Some(b)
            }
            Some((b, e)) => {
                return Err(self.host_error(
                    ptr,
                    len,
                    &format!("its pages overlap an earlier registration of {:#x}..{e:#x} without lying in it", b),
                ))
            }
            None => {
                // SAFETY: the caller's range, widened to the pages that hold
                // it (mapped too: mappings are whole pages).
                match unsafe { (self.api.host_register)(start as *mut c_void, end - start, HOST_REGISTER_FLAGS) } {
                    0 => {
                        regs.insert(start, (end, 1));
                        Some(start)
                    }
                    // Someone else's registration (not through here).
                    ALREADY_REGISTERED => None,
                    st => return Err(call_error(self.api.err_name, "cuMemHostRegister", st)),
                }
            }
        };
        drop(regs);
        // Let go on drop, also when the next calls fail.
        let mut reg = HostRegistration { ctx: self.clone(), held, dev: 0 };
        let dev_of = |p: usize| -> Result<DevicePtr> {
            let mut d = 0;
            // SAFETY: a valid out-pointer; the driver only looks the address up.
            self.check("cuMemHostGetDevicePointer", unsafe { (self.api.host_dev_ptr)(&mut d, p as *mut c_void, 0) })?;
            Ok(d)
        };
        let first = dev_of(ptr as usize)?;
        if reg.held.is_none() {
            // Someone else's registration must map the whole range, in one
            // piece (it may be smaller than asked, or several).
            let last = ptr as usize + len.max(1) - 1;
            let whole = dev_of(last).ok().is_some_and(|d| d.checked_sub(first) == Some((last - ptr as usize) as u64));
            if !whole {
                return Err(self.host_error(ptr, len, "it is registered already (not by rmacomm), but not all of it"));
            }
        }
        reg.dev = first;
        Ok(reg)
    }

    fn host_error(&self, ptr: *mut u8, len: usize, why: &str) -> CudaError {
        CudaError::Call {
            lib: "the CUDA driver",
            call: "cuMemHostRegister",
            code: ALREADY_REGISTERED,
            name: format!("{len} bytes at {ptr:p}: {why}"),
        }
    }

    /// A DMA-BUF exporting the pages that hold `len` bytes at `ptr`, and
    /// the offset of `ptr` in it (`cuMemGetHandleForAddressRange`, for
    /// `ibv_reg_dmabuf_mr`). `None` where the driver has no such call.
    pub fn dmabuf(&self, ptr: DevicePtr, len: usize) -> Option<Result<(std::os::fd::OwnedFd, u64)>> {
        let f = self.api.range_handle?;
        Some((|| {
            let _bound = self.bind()?;
            // One allocation, or contiguous VMM mappings.
            let info = self.device_extent(ptr, len)?.info;
            let page = 4096u64;
            let start = ptr & !(page - 1);
            let end = (ptr + len.max(1) as u64).div_ceil(page) * page;
            // The pages must lie in the allocation (cuMemAlloc's are whole
            // pages, larger ones 2 MiB-aligned; VMM mappings whole
            // granules).
            let alloc_end = (info.base + info.size as u64).div_ceil(page) * page;
            if start < info.base || end > alloc_end {
                return Err(invalid(
                    "cuMemGetHandleForAddressRange",
                    format!("{len} bytes at {ptr:#x} are not whole pages of one allocation"),
                ));
            }
            let mut fd: c_int = -1;
            // SAFETY: a valid out-pointer (an int for a DMA-BUF fd); a
            // page-aligned range of a live allocation; handle type 1 is
            // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD.
            let st = unsafe { f((&raw mut fd).cast(), start, (end - start) as usize, 1, 0) };
            self.check("cuMemGetHandleForAddressRange", st)?;
            // SAFETY: the driver returned a new descriptor, ours to close.
            let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            Ok((fd, ptr - start))
        })())
    }

    /// A new non-blocking stream of this context.
    pub fn stream(self: &Arc<Self>) -> Result<Stream> {
        let _bound = self.bind()?;
        let mut s: CuStream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        self.check("cuStreamCreate", unsafe { (self.api.stream_create)(&mut s, STREAM_NON_BLOCKING) })?;
        Ok(Stream { ctx: self.clone(), s, owned: true })
    }
}

/// Device memory of a shared [`Context`], zeroed when allocated, freed on
/// drop.
pub struct DeviceMemory {
    ctx: Arc<Context>,
    ptr: DevicePtr,
    len: usize,
    /// VMM memory ([`Context::alloc_vmm`]): its mappings, undone on drop
    /// (instead of `cuMemFree`).
    vmm: Option<IpcMapping>,
}

impl fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceMemory({:#x}, {} B, {})", self.ptr, self.len, self.ctx.name())
    }
}

impl DeviceMemory {
    /// The device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The `len` bytes at `offset`, or `None` when they do not fit.
    pub fn view(&self, offset: usize, len: usize) -> Option<DeviceView<'_>> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(DeviceView { mem: self, offset, len })
    }

    /// All of it.
    pub fn all(&self) -> DeviceView<'_> {
        DeviceView { mem: self, offset: 0, len: self.len }
    }

    /// Copies `src` to byte `offset`; complete when this returns, for every
    /// stream (on a stream of its own, synchronized: a pageable copy on the
    /// legacy stream may return before its DMA ends).
    pub fn write_from(&self, offset: usize, src: &[u8]) -> Result<()> {
        let v = self.view(offset, src.len()).ok_or_else(|| self.outside("cuMemcpyHtoD", offset, src.len()))?;
        let _bound = self.ctx.bind()?;
        let s = self.ctx.stream()?;
        // SAFETY: `src` is valid for its length, which fits the memory, and
        // outlives the copy (synchronized below).
        let st = unsafe { (self.ctx.api.htod_async)(v.ptr(), src.as_ptr().cast(), src.len(), s.s) };
        self.ctx.check("cuMemcpyHtoDAsync", st)?;
        s.synchronize()
    }

    /// Copies from byte `offset` into `dst` (complete when this returns; on
    /// a stream of its own, so work queued on other streams is not waited
    /// for).
    pub fn read_into(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let v = self.view(offset, dst.len()).ok_or_else(|| self.outside("cuMemcpyDtoH", offset, dst.len()))?;
        let _bound = self.ctx.bind()?;
        let s = self.ctx.stream()?;
        // SAFETY: `dst` is valid for writes of its length, which fits, and
        // outlives the copy (synchronized below).
        let st = unsafe { (self.ctx.api.dtoh_async)(dst.as_mut_ptr().cast(), v.ptr(), dst.len(), s.s) };
        self.ctx.check("cuMemcpyDtoHAsync", st)?;
        s.synchronize()
    }

    /// Whether this is VMM memory ([`Context::alloc_vmm`]).
    pub fn is_vmm(&self) -> bool {
        self.vmm.is_some()
    }

    /// VMM memory made of `mapping`'s first `len` bytes, zeroed.
    pub(crate) fn from_vmm(mapping: IpcMapping, len: usize) -> Result<DeviceMemory> {
        let ctx = mapping.ctx.clone();
        let ptr = mapping.ptr;
        let mem = DeviceMemory { ctx: ctx.clone(), ptr, len, vmm: Some(mapping) };
        let _bound = ctx.bind()?;
        let s = ctx.stream()?;
        // SAFETY: mapped, accessible memory of at least `len` bytes.
        ctx.check("cuMemsetD8Async", unsafe { (ctx.api.memset_d8)(ptr, 0, len, s.s) })?;
        s.synchronize()?;
        Ok(mem)
    }

    fn outside(&self, call: &'static str, offset: usize, n: usize) -> CudaError {
        invalid(call, format!("{n} bytes at offset {offset} do not fit device memory of {} bytes", self.len))
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.vmm.is_some() {
            return;
        }
        let _bound = self.ctx.bind();
        // SAFETY: allocated by cuMemAlloc, freed once.
        unsafe { (self.ctx.api.mem_free)(self.ptr) };
    }
}

/// A range of a [`DeviceMemory`].
#[derive(Debug, Clone, Copy)]
pub struct DeviceView<'a> {
    mem: &'a DeviceMemory,
    offset: usize,
    len: usize,
}

impl DeviceView<'_> {
    /// The device address of its first byte.
    pub fn ptr(&self) -> DevicePtr {
        self.mem.ptr + self.offset as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The memory it is part of.
    pub fn memory(&self) -> &DeviceMemory {
        self.mem
    }
}

/// Another process's allocation mapped here ([`Context::open_ipc`]);
/// unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    ctx: Arc<Context>,
    ptr: DevicePtr,
    /// A CUDA IPC mapping's key (counted in `OPENED`); `None` for VMM.
    key: Option<(i32, IpcHandle)>,
    /// VMM: the lengths of the mappings made so far, from `ptr` on, and the
    /// length of the address range reserved for them.
    vmm: Vec<usize>,
    mapped: usize,
    reserved: usize,
}

impl IpcMapping {
    /// Where the allocation is mapped (its first byte).
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// How many bytes are mapped from [`ptr`](Self::ptr) on, for VMM
    /// memory (an [`Export::Vmm`](crate::vmm::Export)); `None` for a CUDA
    /// IPC mapping (its allocation's size, which the driver reports).
    pub fn mapped_len(&self) -> Option<usize> {
        self.key.is_none().then(|| self.vmm_mapped())
    }

    pub(crate) fn vmm(ctx: Arc<Context>, ptr: DevicePtr, reserved: usize) -> IpcMapping {
        IpcMapping { ctx, ptr, key: None, vmm: Vec::new(), mapped: 0, reserved }
    }

    pub(crate) fn vmm_mapped(&self) -> usize {
        self.mapped
    }

    pub(crate) fn vmm_push(&mut self, size: usize) {
        self.vmm.push(size);
        self.mapped += size;
    }

    fn drop_vmm(&mut self) {
        let Some(api) = self.ctx.api.vmm else { return };
        let _bound = self.ctx.bind();
        let mut at = self.ptr;
        for &size in &self.vmm {
            // SAFETY: a mapping made at `at` (cuMemMap, whole allocation),
            // unmapped once; the allocation goes with its last mapping.
            unsafe { (api.unmap)(at, size) };
            at += size as u64;
        }
        // SAFETY: the reservation made for these mappings, freed once,
        // after they are gone.
        unsafe { (api.address_free)(self.ptr, self.reserved) };
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let Some(key) = self.key else { return self.drop_vmm() };
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        let Some(map) = opened.as_mut() else { return };
        let last = match map.get_mut(&key) {
            Some((_, refs)) if *refs > 1 => {
                *refs -= 1;
                false
            }
            Some((_, refs)) => {
                // Closing: no new mapping takes it (open_ipc refuses).
                *refs = 0;
                true
            }
            None => false,
        };
        drop(opened);
        if last {
            // Outside the lock: the close may synchronize the context
            // (wait for every stream), and opens of other allocations must
            // not wait for that.
            let _bound = self.ctx.bind();
            // SAFETY: opened by cuIpcOpenMemHandle, closed once, by the
            // last mapping that used it.
            unsafe { (self.ctx.api.ipc_close)(self.ptr) };
            let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(map) = opened.as_mut() {
                map.remove(&key);
            }
            drop(opened);
            CLOSED.notify_all();
        }
    }
}

/// Host memory the device can reach ([`Context::register_host`]).
#[derive(Debug)]
pub struct HostRegistration {
    ctx: Arc<Context>,
    /// The [`HOST_REGS`] entry this holds (its first page), or `None` for
    /// memory someone else registered.
    held: Option<usize>,
    dev: DevicePtr,
}

/// Host ranges `register_host` registered, by first page: (end, holders).
/// The last holder to drop unregisters the range. Process-wide, as
/// registrations are (`CU_MEMHOSTREGISTER_PORTABLE`).
static HOST_REGS: std::sync::Mutex<std::collections::BTreeMap<usize, (usize, usize)>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

impl HostRegistration {
    /// The device address of the registered pointer's first byte.
    pub fn device_ptr(&self) -> DevicePtr {
        self.dev
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let Some(base) = self.held else { return };
        let mut regs = HOST_REGS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(entry) = regs.get_mut(&base) else { return };
        entry.1 -= 1;
        if entry.1 == 0 {
            regs.remove(&base);
            let _bound = self.ctx.bind();
            // SAFETY: registered by `register_host` at this address, and
            // its last holder is gone: unregistered once, under the lock
            // (a new registration of these pages waits for it).
            unsafe { (self.ctx.api.host_unregister)(base as *mut c_void) };
        }
    }
}

/// A CUDA stream: asynchronous copies, 64-bit value writes and waits, and
/// graph capture. Made by [`Context::stream`] (destroyed on drop) or
/// adopted with [`Stream::from_raw`] (a stream of PyTorch's, left alone).
pub struct Stream {
    ctx: Arc<Context>,
    s: CuStream,
    owned: bool,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stream({:p}{})", self.s, if self.owned { "" } else { ", adopted" })
    }
}

// SAFETY: a stream handle may be used from any thread whose current context
// is the stream's (every call binds it first).
unsafe impl Send for Stream {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Stream {}

impl Stream {
    /// Adopts `raw`, a `CUstream` of `ctx` made elsewhere (0: the legacy
    /// default stream); not destroyed on drop.
    ///
    /// # Safety
    /// `raw` must be a stream of `ctx` (or 0) that outlives this value.
    pub unsafe fn from_raw(ctx: Arc<Context>, raw: usize) -> Stream {
        Stream { ctx, s: raw as CuStream, owned: false }
    }

    /// Adopts `raw` as [`from_raw`](Self::from_raw) does, after checking
    /// with the driver that it is a stream of `ctx` (0, the legacy default
    /// stream, is the context's own): a stream of another GPU is an error
    /// naming both devices, not work ordered on the wrong device.
    ///
    /// # Safety
    /// `raw` must be a live stream handle (of any context), or 0, that
    /// outlives this value.
    pub unsafe fn from_raw_checked(ctx: Arc<Context>, raw: usize) -> Result<Stream> {
        if raw != 0 {
            let _bound = ctx.bind()?;
            let mut of: *mut c_void = std::ptr::null_mut();
            // SAFETY: a live stream (the caller's contract); a valid
            // out-pointer.
            ctx.check("cuStreamGetCtx", unsafe { (ctx.api.stream_ctx)(raw as CuStream, &mut of) })?;
            if of != ctx.raw_context() {
                return Err(invalid(
                    "cuStreamGetCtx",
                    format!("stream {raw:#x} is not a stream of CUDA device {} ({})", ctx.ordinal(), ctx.name()),
                ));
            }
        }
        Ok(Stream { ctx, s: raw as CuStream, owned: false })
    }

    /// The `CUstream` handle.
    pub fn raw(&self) -> usize {
        self.s as usize
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: a live stream of the current context.
        self.ctx.check("cuStreamSynchronize", unsafe { (self.ctx.api.stream_sync)(self.s) })
    }

    /// Queues a copy of `len` bytes from `src` to `dst`.
    ///
    /// # Safety
    /// Both ranges must be device memory (or device-mapped memory) that
    /// stays valid until the copy has run.
    pub unsafe fn copy_async(&self, dst: DevicePtr, src: DevicePtr, len: usize) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        self.ctx.check("cuMemcpyDtoDAsync", unsafe { (self.ctx.api.dtod_async)(dst, src, len, self.s) })
    }

    /// Queues a copy of `len` bytes from `src` to `dst`, each device
    /// memory or registered host memory (its device address), the kind of
    /// each taken from the address (`cuMemcpyAsync`, unified addressing).
    ///
    /// # Safety
    /// As for [`copy_async`](Self::copy_async).
    pub unsafe fn copy_any_async(&self, dst: DevicePtr, src: DevicePtr, len: usize) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        self.ctx.check("cuMemcpyAsync", unsafe { (self.ctx.api.memcpy_async)(dst, src, len, self.s) })
    }

    /// Queues a write of `value` to the 8-byte-aligned `addr`, after a
    /// system-wide memory fence (what the stream did before is visible
    /// to whoever sees the value).
    ///
    /// # Safety
    /// `addr` must be device memory or registered host memory that stays
    /// valid until the write has run.
    pub unsafe fn write_value64(&self, addr: DevicePtr, value: u64) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        self.ctx
            .check("cuStreamWriteValue64", unsafe { (self.ctx.api.write_value64)(self.s, addr, value, WRITE_DEFAULT) })
    }

    /// Queues a wait: the stream goes on once the 64-bit word at `addr` is
    /// at least `value` (unsigned).
    ///
    /// # Safety
    /// As for [`write_value64`](Self::write_value64).
    pub unsafe fn wait_value64_geq(&self, addr: DevicePtr, value: u64) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        self.ctx.check("cuStreamWaitValue64", unsafe { (self.ctx.api.wait_value64)(self.s, addr, value, WAIT_GEQ) })
    }

    /// Whether the stream is capturing work into a graph now
    /// (`cuStreamIsCapturing`: active, or invalidated by an error).
    pub fn is_capturing(&self) -> Result<bool> {
        // Bound: the legacy default stream (0) is the current context's.
        let _bound = self.ctx.bind()?;
        let mut status: std::os::raw::c_int = 0;
        // SAFETY: a live stream and a valid out-pointer.
        self.ctx.check("cuStreamIsCapturing", unsafe { (self.ctx.api.is_capturing)(self.s, &mut status) })?;
        Ok(status != 0)
    }

    /// Starts capturing the stream's work into a graph (relaxed mode).
    pub fn begin_capture(&self) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: a live stream.
        self.ctx.check("cuStreamBeginCapture", unsafe { (self.ctx.api.begin_capture)(self.s, CAPTURE_RELAXED) })
    }

    /// Ends the capture and instantiates what was captured.
    pub fn end_capture(&self) -> Result<Graph> {
        let _bound = self.ctx.bind()?;
        let mut g: CuGraph = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; a stream in capture.
        self.ctx.check("cuStreamEndCapture", unsafe { (self.ctx.api.end_capture)(self.s, &mut g) })?;
        let mut e: CuGraphExec = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and graph.
        let st = unsafe { (self.ctx.api.graph_instantiate)(&mut e, g, 0) };
        if st != 0 {
            // SAFETY: made by the capture, destroyed once.
            unsafe { (self.ctx.api.graph_destroy)(g) };
            return Err(call_error(self.ctx.api.err_name, "cuGraphInstantiate", st));
        }
        Ok(Graph { ctx: self.ctx.clone(), g, e })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned {
            let _bound = self.ctx.bind();
            // SAFETY: created by cuStreamCreate, destroyed once.
            unsafe { (self.ctx.api.stream_destroy)(self.s) };
        }
    }
}

impl Stream {
    /// Queues a copy of `len` host bytes at `src` to `dst`.
    ///
    /// # Safety
    /// `src` must be readable and `dst` device memory, both for `len` bytes
    /// until the copy has run (pinned `src`: the copy reads it later).
    pub unsafe fn upload_raw_async(&self, dst: DevicePtr, src: *const u8, len: usize) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        self.ctx.check("cuMemcpyHtoDAsync", unsafe { (self.ctx.api.htod_async)(dst, src.cast(), len, self.s) })
    }

    /// Queues a copy of `len` device bytes at `src` to host memory at `dst`.
    ///
    /// # Safety
    /// `src` must be device memory and `dst` writable host memory (pinned
    /// for an asynchronous copy), both for `len` bytes until the copy has
    /// run, and `dst` not borrowed meanwhile.
    pub unsafe fn download_raw_async(&self, dst: *mut u8, src: DevicePtr, len: usize) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: the caller's contract.
        self.ctx.check("cuMemcpyDtoHAsync", unsafe { (self.ctx.api.dtoh_async)(dst.cast(), src, len, self.s) })
    }

    /// Queues a copy of `bytes` (host memory, staged by the driver before
    /// this returns) to `dst`.
    ///
    /// # Safety
    /// `dst` must be device memory of `bytes.len()` bytes valid until the
    /// copy has run.
    pub unsafe fn upload_async(&self, dst: DevicePtr, bytes: &[u8]) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: `bytes` is valid for its length during the call (a pageable
        // source is staged before the call returns); `dst` is the caller's.
        self.ctx.check("cuMemcpyHtoDAsync", unsafe {
            (self.ctx.api.htod_async)(dst, bytes.as_ptr().cast(), bytes.len(), self.s)
        })
    }
}

/// A module loaded in a shared [`Context`] (unloaded on drop), whose
/// kernels launch on a [`Stream`] without waiting.
pub struct SharedModule {
    ctx: Arc<Context>,
    m: *mut c_void,
}

impl fmt::Debug for SharedModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedModule({:p})", self.m)
    }
}

// SAFETY: a module handle may be used from any thread (bound first).
unsafe impl Send for SharedModule {}
// SAFETY: as above; launches are thread-safe.
unsafe impl Sync for SharedModule {}

impl SharedModule {
    /// Loads a cubin or NUL-terminated PTX.
    ///
    /// # Safety
    /// As [`Context::load_module`]: a cubin must be well-formed.
    pub unsafe fn load(ctx: &Arc<Context>, image: &[u8]) -> Result<SharedModule> {
        // SAFETY: forwarded.
        let m = unsafe { ctx.load_module(image)? };
        let raw = m.raw();
        std::mem::forget(m);
        Ok(SharedModule { ctx: ctx.clone(), m: raw })
    }

    /// Queues `name` on `grid` blocks of `block` threads with `args` on
    /// `stream`.
    ///
    /// # Safety
    /// As [`crate::driver::Module::launch`]; the memory the kernel uses must
    /// stay valid until the stream has run it.
    pub unsafe fn launch_on(
        &self,
        stream: &Stream,
        name: &str,
        grid: u32,
        block: u32,
        args: &[crate::driver::Arg],
    ) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { crate::driver::launch_raw(&self.ctx, self.m, name, grid, block, args, stream.s) }
    }
}

impl Drop for SharedModule {
    fn drop(&mut self) {
        let _bound = self.ctx.bind();
        // SAFETY: loaded once, unloaded once.
        unsafe { (self.ctx.api.module_unload)(self.m) };
    }
}

/// A captured, instantiated CUDA graph.
pub struct Graph {
    ctx: Arc<Context>,
    g: CuGraph,
    e: CuGraphExec,
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Graph({:p})", self.e)
    }
}

// SAFETY: graph handles may be used from any thread (bound first).
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl Graph {
    /// Queues one replay on `stream`.
    ///
    /// # Safety
    /// The captured work replays with the addresses it was captured with:
    /// every buffer and mapping it uses must still be allocated (a replay
    /// after a window's deregistration would write memory no longer its).
    pub unsafe fn launch(&self, stream: &Stream) -> Result<()> {
        let _bound = self.ctx.bind()?;
        // SAFETY: a live executable graph and stream; the memory it uses is
        // the caller's contract.
        self.ctx.check("cuGraphLaunch", unsafe { (self.ctx.api.graph_launch)(self.e, stream.s) })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _bound = self.ctx.bind();
        // SAFETY: each made once above, destroyed once.
        unsafe {
            (self.ctx.api.graph_exec_destroy)(self.e);
            (self.ctx.api.graph_destroy)(self.g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_handles_round_trip_through_hex_and_bad_text_is_refused() {
        let mut h = IpcHandle([0; 64]);
        for (i, b) in h.0.iter_mut().enumerate() {
            *b = (i * 37 + 5) as u8;
        }
        let s = h.to_hex();
        assert_eq!(s.len(), 128);
        assert_eq!(IpcHandle::from_hex(&s), Some(h));
        assert_eq!(IpcHandle::from_hex(&s[..126]), None);
        assert_eq!(IpcHandle::from_hex(&format!("{}zz", &s[..126])), None);
        assert_eq!(IpcHandle::from_hex(&"é".repeat(64)), None);
        assert_eq!(IpcHandle::from_hex(&format!("+f{}", &s[2..])), None, "a sign is no hex digit");
    }
}
