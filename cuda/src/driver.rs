//! The CUDA driver (libcuda, installed with the NVIDIA kernel driver):
//! whether this machine can run CUDA at all, which driver version and how
//! many devices.

use std::ffi::{c_char, c_int, CStr};

use crate::device::IpcHandle;
use crate::loader::{self, Spec};
use crate::{CudaError, Result};

pub(crate) const SPEC: Spec = Spec {
    lib: "the CUDA driver (libcuda.so.1)",
    env: "RMACOMM_CUDA_LIB",
    names: &["libcuda.so.1", "libcuda.so"],
    wheel_dirs: &[],
    hint: "it comes with the NVIDIA GPU driver; a machine without an NVIDIA GPU has none \
           (RMACOMM_CUDA_LIB names the file where it is not on the loader's path)",
};

/// libcuda, opened once and never closed: the driver starts threads at
/// `cuInit` and is not made to be unloaded.
fn driver_lib() -> Result<&'static loader::Opened> {
    static LIB: std::sync::OnceLock<Result<loader::Opened>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| loader::open(&SPEC)).as_ref().map_err(Clone::clone)
}

/// `cuGetErrorName`.
type ErrNameFn = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// The error of a failed driver call, named by the driver.
pub(crate) fn call_error(err_name: ErrNameFn, call: &'static str, code: c_int) -> CudaError {
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: a valid out-pointer; the string, when set, is static.
    let name = if unsafe { err_name(code, &mut p) } == 0 && !p.is_null() {
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        "unknown".to_owned()
    };
    CudaError::Call { lib: SPEC.lib, call, code, name }
}

/// `CUDA_ERROR_NO_DEVICE`.
const NO_DEVICE: c_int = 100;
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`.
const PEER_ACCESS_ALREADY_ENABLED: c_int = 704;

/// What the driver reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// The CUDA version the driver supports, as (major, minor): 13.0 is
    /// `(13, 0)`.
    pub version: (i32, i32),
    /// Devices visible to this process (`CUDA_VISIBLE_DEVICES` applies).
    pub devices: usize,
    /// The file the driver was loaded from.
    pub path: std::path::PathBuf,
}

/// Loads the driver, initialises it and counts the devices. A machine with
/// no NVIDIA driver gets [`CudaError::NotFound`] naming `libcuda.so.1`; a
/// driver with no device, `DriverInfo { devices: 0, .. }`.
pub fn probe() -> Result<DriverInfo> {
    let lib = driver_lib()?;
    // SAFETY: the types are the C signatures in cuda.h (CUresult is an int
    // enum; cuGetErrorName writes a static string's address).
    let (init, version, count, err_name) = unsafe {
        (
            lib.get::<unsafe extern "C" fn(u32) -> c_int>("cuInit\0")?,
            lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>("cuDriverGetVersion\0")?,
            lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>("cuDeviceGetCount\0")?,
            lib.get::<ErrNameFn>("cuGetErrorName\0")?,
        )
    };
    let fail = |call: &'static str, code: c_int| call_error(err_name, call, code);
    let mut v = 0;
    // SAFETY: a valid out-pointer (callable before cuInit).
    let st = unsafe { version(&mut v) };
    if st != 0 {
        return Err(fail("cuDriverGetVersion", st));
    }
    // SAFETY: flags must be 0.
    let st = unsafe { init(0) };
    let devices = match st {
        0 => {
            let mut n = 0;
            // SAFETY: a valid out-pointer, after a successful cuInit.
            let st = unsafe { count(&mut n) };
            if st != 0 {
                return Err(fail("cuDeviceGetCount", st));
            }
            usize::try_from(n).unwrap_or(0)
        }
        NO_DEVICE => 0,
        st => return Err(fail("cuInit", st)),
    };
    Ok(DriverInfo { version: (v / 1000, (v % 1000) / 10), devices, path: lib.path.clone() })
}

pub(crate) type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut std::ffi::c_void;
type CuModule = *mut std::ffi::c_void;
type CuFunction = *mut std::ffi::c_void;
pub(crate) type CuStream = *mut std::ffi::c_void;
pub(crate) type CuGraph = *mut std::ffi::c_void;
pub(crate) type CuGraphExec = *mut std::ffi::c_void;
/// A device address (`CUdeviceptr`).
pub type DevicePtr = u64;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` / `_MINOR`.
const CC_MAJOR: c_int = 75;
const CC_MINOR: c_int = 76;

/// The driver functions a [`Context`] uses, resolved once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Api {
    pub(crate) init: unsafe extern "C" fn(u32) -> CuResult,
    pub(crate) err_name: ErrNameFn,
    pub(crate) device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    pub(crate) device_attr: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    pub(crate) device_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    pub(crate) ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    pub(crate) ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    pub(crate) ctx_set: unsafe extern "C" fn(CuContext) -> CuResult,
    pub(crate) ctx_get: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    pub(crate) device_uuid: unsafe extern "C" fn(*mut [u8; 16], CuDevice) -> CuResult,
    pub(crate) can_access_peer: unsafe extern "C" fn(*mut c_int, CuDevice, CuDevice) -> CuResult,
    pub(crate) enable_peer: unsafe extern "C" fn(CuContext, u32) -> CuResult,
    pub(crate) stream_ctx: unsafe extern "C" fn(CuStream, *mut CuContext) -> CuResult,
    pub(crate) ctx_sync: unsafe extern "C" fn() -> CuResult,
    pub(crate) mem_alloc: unsafe extern "C" fn(*mut DevicePtr, usize) -> CuResult,
    pub(crate) mem_free: unsafe extern "C" fn(DevicePtr) -> CuResult,
    pub(crate) htod: unsafe extern "C" fn(DevicePtr, *const std::ffi::c_void, usize) -> CuResult,
    pub(crate) dtoh: unsafe extern "C" fn(*mut std::ffi::c_void, DevicePtr, usize) -> CuResult,
    pub(crate) dtod: unsafe extern "C" fn(DevicePtr, DevicePtr, usize) -> CuResult,
    pub(crate) module_load: unsafe extern "C" fn(*mut CuModule, *const std::ffi::c_void) -> CuResult,
    pub(crate) module_unload: unsafe extern "C" fn(CuModule) -> CuResult,
    pub(crate) module_fn: unsafe extern "C" fn(*mut CuFunction, CuModule, *const c_char) -> CuResult,
    pub(crate) ptr_attr: unsafe extern "C" fn(*mut std::ffi::c_void, c_int, DevicePtr) -> CuResult,
    pub(crate) ipc_get: unsafe extern "C" fn(*mut IpcHandle, DevicePtr) -> CuResult,
    pub(crate) ipc_open: unsafe extern "C" fn(*mut DevicePtr, IpcHandle, u32) -> CuResult,
    pub(crate) ipc_close: unsafe extern "C" fn(DevicePtr) -> CuResult,
    pub(crate) host_register: unsafe extern "C" fn(*mut std::ffi::c_void, usize, u32) -> CuResult,
    pub(crate) host_unregister: unsafe extern "C" fn(*mut std::ffi::c_void) -> CuResult,
    pub(crate) host_dev_ptr: unsafe extern "C" fn(*mut DevicePtr, *mut std::ffi::c_void, u32) -> CuResult,
    pub(crate) memset_d8: unsafe extern "C" fn(DevicePtr, u8, usize, CuStream) -> CuResult,
    pub(crate) htod_async: unsafe extern "C" fn(DevicePtr, *const std::ffi::c_void, usize, CuStream) -> CuResult,
    pub(crate) dtoh_async: unsafe extern "C" fn(*mut std::ffi::c_void, DevicePtr, usize, CuStream) -> CuResult,
    pub(crate) stream_create: unsafe extern "C" fn(*mut CuStream, u32) -> CuResult,
    pub(crate) stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    pub(crate) stream_sync: unsafe extern "C" fn(CuStream) -> CuResult,
    pub(crate) dtod_async: unsafe extern "C" fn(DevicePtr, DevicePtr, usize, CuStream) -> CuResult,
    pub(crate) memcpy_async: unsafe extern "C" fn(DevicePtr, DevicePtr, usize, CuStream) -> CuResult,
    pub(crate) write_value64: unsafe extern "C" fn(CuStream, DevicePtr, u64, u32) -> CuResult,
    pub(crate) wait_value64: unsafe extern "C" fn(CuStream, DevicePtr, u64, u32) -> CuResult,
    pub(crate) begin_capture: unsafe extern "C" fn(CuStream, c_int) -> CuResult,
    pub(crate) end_capture: unsafe extern "C" fn(CuStream, *mut CuGraph) -> CuResult,
    pub(crate) is_capturing: unsafe extern "C" fn(CuStream, *mut c_int) -> CuResult,
    pub(crate) graph_instantiate: unsafe extern "C" fn(*mut CuGraphExec, CuGraph, u64) -> CuResult,
    pub(crate) graph_launch: unsafe extern "C" fn(CuGraphExec, CuStream) -> CuResult,
    pub(crate) graph_exec_destroy: unsafe extern "C" fn(CuGraphExec) -> CuResult,
    pub(crate) graph_destroy: unsafe extern "C" fn(CuGraph) -> CuResult,
    /// `cuMemGetHandleForAddressRange` (CUDA 11.7+; optional: absent, no
    /// DMA-BUF export).
    pub(crate) range_handle:
        Option<unsafe extern "C" fn(*mut std::ffi::c_void, DevicePtr, usize, c_int, u64) -> CuResult>,
    /// The virtual memory management calls (optional as a set).
    pub(crate) vmm: Option<crate::vmm::VmmApi>,
    pub(crate) launch: unsafe extern "C" fn(
        CuFunction,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        CuStream,
        *mut *mut std::ffi::c_void,
        *mut *mut std::ffi::c_void,
    ) -> CuResult,
}

/// One device's primary context, current on the threads that use it
/// ([`Context::bind`]): device memory, modules and launches. Synchronous
/// (the default stream, a synchronize after each launch): the building block
/// of tests and of the kernels' checks against the CPU, not of the fast
/// path.
#[derive(Debug)]
pub struct Context {
    pub(crate) api: Api,
    pub(crate) dev: CuDevice,
    ctx: CuContext,
    name: String,
    cc: (i32, i32),
}

// SAFETY: a CUDA context may be used from any thread that makes it current
// (every call below binds it first); the handle is an opaque pointer.
unsafe impl Send for Context {}
// SAFETY: as above; the driver API is thread-safe.
unsafe impl Sync for Context {}

impl Context {
    /// Opens device `ordinal`'s primary context.
    pub fn open(ordinal: u32) -> Result<Context> {
        let lib = driver_lib()?;
        // SAFETY: each type is the C signature in cuda.h (the `_v2` symbols
        // are what the header's unsuffixed names map to).
        let api = unsafe {
            Api {
                init: lib.get("cuInit\0")?,
                err_name: lib.get("cuGetErrorName\0")?,
                device_get: lib.get("cuDeviceGet\0")?,
                device_attr: lib.get("cuDeviceGetAttribute\0")?,
                device_name: lib.get("cuDeviceGetName\0")?,
                ctx_retain: lib.get("cuDevicePrimaryCtxRetain\0")?,
                ctx_release: lib.get("cuDevicePrimaryCtxRelease_v2\0")?,
                ctx_set: lib.get("cuCtxSetCurrent\0")?,
                ctx_get: lib.get("cuCtxGetCurrent\0")?,
                device_uuid: match lib.get("cuDeviceGetUuid_v2\0") {
                    Ok(f) => f,
                    Err(_) => lib.get("cuDeviceGetUuid\0")?,
                },
                can_access_peer: lib.get("cuDeviceCanAccessPeer\0")?,
                enable_peer: lib.get("cuCtxEnablePeerAccess\0")?,
                stream_ctx: lib.get("cuStreamGetCtx\0")?,
                ctx_sync: lib.get("cuCtxSynchronize\0")?,
                mem_alloc: lib.get("cuMemAlloc_v2\0")?,
                mem_free: lib.get("cuMemFree_v2\0")?,
                htod: lib.get("cuMemcpyHtoD_v2\0")?,
                dtoh: lib.get("cuMemcpyDtoH_v2\0")?,
                dtod: lib.get("cuMemcpyDtoD_v2\0")?,
                module_load: lib.get("cuModuleLoadData\0")?,
                module_unload: lib.get("cuModuleUnload\0")?,
                module_fn: lib.get("cuModuleGetFunction\0")?,
                launch: lib.get("cuLaunchKernel\0")?,
                ptr_attr: lib.get("cuPointerGetAttribute\0")?,
                ipc_get: lib.get("cuIpcGetMemHandle\0")?,
                ipc_open: lib.get("cuIpcOpenMemHandle_v2\0")?,
                ipc_close: lib.get("cuIpcCloseMemHandle\0")?,
                host_register: lib.get("cuMemHostRegister_v2\0")?,
                host_unregister: lib.get("cuMemHostUnregister\0")?,
                host_dev_ptr: lib.get("cuMemHostGetDevicePointer_v2\0")?,
                memset_d8: lib.get("cuMemsetD8Async\0")?,
                htod_async: lib.get("cuMemcpyHtoDAsync_v2\0")?,
                dtoh_async: lib.get("cuMemcpyDtoHAsync_v2\0")?,
                stream_create: lib.get("cuStreamCreate\0")?,
                stream_destroy: lib.get("cuStreamDestroy_v2\0")?,
                stream_sync: lib.get("cuStreamSynchronize\0")?,
                dtod_async: lib.get("cuMemcpyDtoDAsync_v2\0")?,
                memcpy_async: lib.get("cuMemcpyAsync\0")?,
                write_value64: lib.get("cuStreamWriteValue64_v2\0")?,
                wait_value64: lib.get("cuStreamWaitValue64_v2\0")?,
                begin_capture: lib.get("cuStreamBeginCapture_v2\0")?,
                end_capture: lib.get("cuStreamEndCapture\0")?,
                is_capturing: lib.get("cuStreamIsCapturing\0")?,
                graph_instantiate: lib.get("cuGraphInstantiateWithFlags\0")?,
                graph_launch: lib.get("cuGraphLaunch\0")?,
                graph_exec_destroy: lib.get("cuGraphExecDestroy\0")?,
                graph_destroy: lib.get("cuGraphDestroy\0")?,
                range_handle: lib.get("cuMemGetHandleForAddressRange\0").ok(),
                vmm: crate::vmm::VmmApi::load(lib),
            }
        };
        let mut c = Context { api, dev: 0, ctx: std::ptr::null_mut(), name: String::new(), cc: (0, 0) };
        // SAFETY: flags 0.
        c.check("cuInit", unsafe { (api.init)(0) })?;
        let ord = c_int::try_from(ordinal).map_err(|_| CudaError::Call {
            lib: SPEC.lib,
            call: "cuDeviceGet",
            code: 101,
            name: format!("device ordinal {ordinal} is out of range"),
        })?;
        // The device's calls name the device (`cuDeviceGet failed with 101`
        // said nothing of which one).
        let on_device = |e: CudaError| match e {
            CudaError::Call { lib, call, code, name } => {
                CudaError::Call { lib, call, code, name: format!("{name}; device {ordinal}") }
            }
            other => other,
        };
        // SAFETY: valid out-pointers throughout.
        unsafe {
            let mut dev = 0;
            c.check("cuDeviceGet", (api.device_get)(&mut dev, ord)).map_err(on_device)?;
            c.dev = dev;
            let (mut maj, mut min) = (0, 0);
            c.check("cuDeviceGetAttribute", (api.device_attr)(&mut maj, CC_MAJOR, c.dev)).map_err(on_device)?;
            c.check("cuDeviceGetAttribute", (api.device_attr)(&mut min, CC_MINOR, c.dev)).map_err(on_device)?;
            c.cc = (maj, min);
            let mut buf = [0 as c_char; 256];
            c.check("cuDeviceGetName", (api.device_name)(buf.as_mut_ptr(), 255, c.dev)).map_err(on_device)?;
            c.name = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
            let mut ctx = std::ptr::null_mut();
            c.check("cuDevicePrimaryCtxRetain", (api.ctx_retain)(&mut ctx, c.dev)).map_err(on_device)?;
            c.ctx = ctx;
        }
        Ok(c)
    }

    pub(crate) fn check(&self, call: &'static str, st: CuResult) -> Result<()> {
        if st == 0 {
            return Ok(());
        }
        Err(call_error(self.api.err_name, call, st))
    }

    /// Makes the context current on the calling thread while the guard
    /// lives; the context current before (the caller's: PyTorch's device,
    /// or none) is current again when it drops. Every call of this crate
    /// binds so, leaving the thread's current device as it found it
    /// (`torch.cuda.current_device()` reads it).
    pub fn bind(&self) -> Result<Bound<'_>> {
        let mut cur: CuContext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        self.check("cuCtxGetCurrent", unsafe { (self.api.ctx_get)(&mut cur) })?;
        if cur == self.ctx {
            return Ok(Bound { ctx: self, prev: None, _thread: std::marker::PhantomData });
        }
        // SAFETY: a context retained by `open`.
        self.check("cuCtxSetCurrent", unsafe { (self.api.ctx_set)(self.ctx) })?;
        Ok(Bound { ctx: self, prev: Some(cur), _thread: std::marker::PhantomData })
    }

    /// The `CUcontext` handle.
    pub(crate) fn raw_context(&self) -> CuContext {
        self.ctx
    }

    /// Makes the context current on the calling thread and leaves it so
    /// (what `torch.cuda.set_device` does); rmacomm's own calls never need
    /// it ([`bind`](Self::bind)).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: a context retained by `open`.
        self.check("cuCtxSetCurrent", unsafe { (self.api.ctx_set)(self.ctx) })
    }

    /// The device's UUID: the same GPU's in every process, whatever
    /// `CUDA_VISIBLE_DEVICES` numbers it there (ordinals are per process).
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let mut u = [0u8; 16];
        // SAFETY: 16 writable bytes and a device of this driver.
        self.check("cuDeviceGetUuid", unsafe { (self.api.device_uuid)(&mut u, self.dev) })?;
        Ok(u)
    }

    /// Whether kernels of this device can touch `peer`'s memory once peer
    /// access is enabled ([`enable_peer_access`](Self::enable_peer_access));
    /// false for the device itself (it needs none).
    pub fn can_access_peer(&self, peer: &Context) -> Result<bool> {
        let mut can = 0;
        // SAFETY: a valid out-pointer and two devices of this driver.
        self.check("cuDeviceCanAccessPeer", unsafe { (self.api.can_access_peer)(&mut can, self.dev, peer.dev) })?;
        Ok(can != 0)
    }

    /// Lets this context's kernels touch `peer`'s memory (in this process:
    /// ranks as threads on different GPUs); enabled already is fine, the
    /// device itself needs nothing. An error where the two cannot reach
    /// each other.
    pub fn enable_peer_access(&self, peer: &Context) -> Result<()> {
        if peer.dev == self.dev {
            return Ok(());
        }
        let _bound = self.bind()?;
        // SAFETY: a retained context; flags 0.
        match unsafe { (self.api.enable_peer)(peer.ctx, 0) } {
            0 | PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            st => Err(call_error(self.api.err_name, "cuCtxEnablePeerAccess", st)),
        }
    }

    /// The device's name ("NVIDIA H100 80GB HBM3").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's compute capability, (major, minor): (9, 0) on an H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// The `sm_XY` architecture to compile cubins for.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    /// `len` bytes of device memory (uninitialised).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer<'_>> {
        let _bound = self.bind()?;
        let mut ptr = 0;
        // SAFETY: a valid out-pointer; the context is current.
        self.check("cuMemAlloc", unsafe { (self.api.mem_alloc)(&mut ptr, len.max(1)) })?;
        Ok(DeviceBuffer { ctx: self, ptr, len })
    }

    /// Waits for everything launched on the context.
    pub fn synchronize(&self) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: no arguments; the context is current.
        self.check("cuCtxSynchronize", unsafe { (self.api.ctx_sync)() })
    }

    /// [`synchronize`](Self::synchronize), waited for at most `within` (on
    /// a thread of its own, left to finish when the time passes): `None`
    /// when the device had not run everything launched on the context in
    /// time. Without a thread to wait with, unbounded.
    pub fn synchronize_within(self: &std::sync::Arc<Self>, within: std::time::Duration) -> Option<Result<()>> {
        let ctx = self.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::Builder::new().name("rmacomm-cuda-sync".into()).spawn(move || {
            let _ = tx.send(ctx.synchronize());
        });
        match waiter {
            Ok(_) => rx.recv_timeout(within).ok(),
            Err(_) => Some(self.synchronize()),
        }
    }

    /// Loads a module from a cubin (an ELF image) or NUL-terminated PTX;
    /// an image that is neither is refused before the driver reads it.
    ///
    /// # Safety
    /// A cubin must be well-formed (as NVRTC writes them): the driver
    /// follows the offsets and sizes in its ELF headers, which are not
    /// checked here against `image`'s length.
    pub unsafe fn load_module(&self, image: &[u8]) -> Result<Module<'_>> {
        if !(image.starts_with(b"\x7fELF") || (image.last() == Some(&0) && !image.is_empty())) {
            return Err(CudaError::Call {
                lib: SPEC.lib,
                call: "cuModuleLoadData",
                code: 1,
                name: "the image is neither a cubin (ELF) nor NUL-terminated PTX".into(),
            });
        }
        let _bound = self.bind()?;
        let mut m: CuModule = std::ptr::null_mut();
        // SAFETY: `image` outlives the call (the driver copies it); a cubin
        // is well-formed by the caller's contract, PTX ends in NUL (checked).
        self.check("cuModuleLoadData", unsafe { (self.api.module_load)(&mut m, image.as_ptr().cast()) })?;
        Ok(Module { ctx: self, m })
    }

    /// Copies `len` bytes between device buffers (the copy engine).
    pub fn copy(&self, dst: &DeviceBuffer<'_>, src: &DeviceBuffer<'_>, len: usize) -> Result<()> {
        if len > dst.len || len > src.len {
            return Err(CudaError::Call {
                lib: SPEC.lib,
                call: "cuMemcpyDtoD",
                code: 1,
                name: format!("{len} bytes do not fit buffers of {} and {}", dst.len, src.len),
            });
        }
        let _bound = self.bind()?;
        // SAFETY: both ranges are inside live allocations of this context.
        self.check("cuMemcpyDtoD", unsafe { (self.api.dtod)(dst.ptr, src.ptr, len) })
    }
}

/// The calling thread's current device: the ordinal of its current
/// context's device, `None` when no context is current (or no driver).
pub fn current_device() -> Result<Option<i32>> {
    let lib = driver_lib()?;
    // SAFETY: the C signatures in cuda.h.
    let (get, device) = unsafe {
        (
            lib.get::<unsafe extern "C" fn(*mut CuContext) -> CuResult>("cuCtxGetCurrent\0")?,
            lib.get::<unsafe extern "C" fn(*mut CuDevice) -> CuResult>("cuCtxGetDevice\0")?,
        )
    };
    let mut cur: CuContext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    if unsafe { get(&mut cur) } != 0 || cur.is_null() {
        return Ok(None);
    }
    let mut d: CuDevice = 0;
    // SAFETY: a valid out-pointer; a context is current.
    Ok((unsafe { device(&mut d) } == 0).then_some(d))
}

/// A [`Context`] made current by [`Context::bind`]; the context current
/// before comes back on drop. Tied to its thread (the current context is
/// per thread).
#[must_use = "the context is current only while the guard lives"]
#[derive(Debug)]
pub struct Bound<'c> {
    ctx: &'c Context,
    /// The context to make current again; `None` when it was this one.
    prev: Option<CuContext>,
    _thread: std::marker::PhantomData<*const ()>,
}

impl Drop for Bound<'_> {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            // SAFETY: the context current when the guard was made (null: none),
            // which its owner keeps alive while it is current.
            unsafe { (self.ctx.api.ctx_set)(prev) };
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if !self.ctx.is_null() {
            // SAFETY: retained once by `open`, released once here.
            unsafe { (self.api.ctx_release)(self.dev) };
        }
    }
}

/// Device memory of a [`Context`], freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer<'c> {
    ctx: &'c Context,
    ptr: DevicePtr,
    len: usize,
}

impl DeviceBuffer<'_> {
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

    /// Copies `src` to the start of the buffer.
    pub fn upload(&self, src: &[u8]) -> Result<()> {
        self.fits("cuMemcpyHtoD", src.len())?;
        let _bound = self.ctx.bind()?;
        // SAFETY: `src` is valid for its length, which fits the buffer.
        self.ctx.check("cuMemcpyHtoD", unsafe { (self.ctx.api.htod)(self.ptr, src.as_ptr().cast(), src.len()) })
    }

    /// Copies the start of the buffer into `dst`.
    pub fn download(&self, dst: &mut [u8]) -> Result<()> {
        self.fits("cuMemcpyDtoH", dst.len())?;
        let _bound = self.ctx.bind()?;
        // SAFETY: `dst` is valid for writes of its length, which fits.
        self.ctx.check("cuMemcpyDtoH", unsafe { (self.ctx.api.dtoh)(dst.as_mut_ptr().cast(), self.ptr, dst.len()) })
    }

    fn fits(&self, call: &'static str, n: usize) -> Result<()> {
        if n <= self.len {
            return Ok(());
        }
        Err(CudaError::Call {
            lib: SPEC.lib,
            call,
            code: 1,
            name: format!("{n} bytes do not fit a buffer of {}", self.len),
        })
    }
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        let _bound = self.ctx.bind();
        // SAFETY: allocated by cuMemAlloc, freed once.
        unsafe { (self.ctx.api.mem_free)(self.ptr) };
    }
}

/// A kernel argument, passed by value.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device pointer (or any 64-bit word).
    U64(u64),
    /// A 32-bit unsigned integer.
    U32(u32),
    /// A double.
    F64(f64),
}

/// A loaded module, unloaded on drop.
#[derive(Debug)]
pub struct Module<'c> {
    ctx: &'c Context,
    m: CuModule,
}

impl Module<'_> {
    /// Launches `name` on `grid` blocks of `block` threads with `args`,
    /// then waits for it.
    ///
    /// # Safety
    /// `args` must be the kernel's parameters, in order, each of its type
    /// (the driver reads one value per parameter the kernel declares), and
    /// every pointer among them must be device memory the kernel may
    /// access for the ranges it uses.
    pub unsafe fn launch(&self, name: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        // SAFETY: forwarded; the default stream, waited for below.
        unsafe { launch_raw(self.ctx, self.m, name, grid, block, args, std::ptr::null_mut())? };
        self.ctx.synchronize()
    }

    /// The `CUmodule` handle (for [`crate::device::SharedModule`]).
    pub(crate) fn raw(&self) -> CuModule {
        self.m
    }
}

/// Queues kernel `name` of module `m` on `stream`.
///
/// # Safety
/// As [`Module::launch`].
pub(crate) unsafe fn launch_raw(
    ctx: &Context,
    m: CuModule,
    name: &str,
    grid: u32,
    block: u32,
    args: &[Arg],
    stream: CuStream,
) -> Result<()> {
    let c_name = std::ffi::CString::new(name).map_err(|_| CudaError::Call {
        lib: SPEC.lib,
        call: "cuModuleGetFunction",
        code: 1,
        name: "the kernel name contains a NUL byte".into(),
    })?;
    let _bound = ctx.bind()?;
    let mut f: CuFunction = std::ptr::null_mut();
    // SAFETY: a valid out-pointer, module and C string.
    let st = unsafe { (ctx.api.module_fn)(&mut f, m, c_name.as_ptr()) };
    if st != 0 {
        return Err(CudaError::Call {
            lib: SPEC.lib,
            call: "cuModuleGetFunction",
            code: st,
            name: format!("no kernel {name} in the module"),
        });
    }
    // One 8-byte-aligned slot per argument; a 4-byte value sits in the
    // slot's first bytes (its address is the value's).
    let mut vals: Vec<u64> = args
        .iter()
        .map(|a| match *a {
            Arg::U64(v) => v,
            Arg::F64(v) => v.to_bits(),
            Arg::U32(v) => {
                let mut b = [0u8; 8];
                b[..4].copy_from_slice(&v.to_ne_bytes());
                u64::from_ne_bytes(b)
            }
        })
        .collect();
    let mut ptrs: Vec<*mut std::ffi::c_void> = vals.iter_mut().map(|v| std::ptr::from_mut(v).cast()).collect();
    // SAFETY: `ptrs` holds one pointer per argument, each to a value of the
    // argument's size (the driver copies them at the call); that these are
    // the kernel's parameters is the caller's contract.
    let st = unsafe {
        (ctx.api.launch)(f, grid.max(1), 1, 1, block.max(1), 1, 1, 0, stream, ptrs.as_mut_ptr(), std::ptr::null_mut())
    };
    ctx.check("cuLaunchKernel", st)
}

impl Drop for Module<'_> {
    fn drop(&mut self) {
        let _bound = self.ctx.bind();
        // SAFETY: loaded by cuModuleLoadData, unloaded once.
        unsafe { (self.ctx.api.module_unload)(self.m) };
    }
}
