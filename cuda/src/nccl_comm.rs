//! An NCCL (or RCCL) communicator through the run-time loaded library:
//! the fallback backend's collectives on device memory, queued on a CUDA
//! stream. The unique id needs no GPU (rank 0 makes it, the bootstrap
//! group carries it); everything else needs the device.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Arc;

use crate::device::{DeviceMemory, Stream};
use crate::driver::{Context, DevicePtr};
use crate::nccl::{Flavor, Library, WINDOW_API};
use crate::{CudaError, Result};

type NcclResult = c_int;
type NcclComm_ = *mut c_void;
type CuStream = *mut c_void;

/// An `ncclUniqueId`: what every rank passes to [`NcclComm::init`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId(pub [u8; 128]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId(..)")
    }
}

/// `ncclDataType_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum DataType {
    /// `ncclInt8`.
    I8 = 0,
    /// `ncclUint8`.
    U8 = 1,
    /// `ncclInt32`.
    I32 = 2,
    /// `ncclUint32`.
    U32 = 3,
    /// `ncclInt64`.
    I64 = 4,
    /// `ncclUint64`.
    U64 = 5,
    /// `ncclFloat16`.
    F16 = 6,
    /// `ncclFloat32`.
    F32 = 7,
    /// `ncclFloat64`.
    F64 = 8,
    /// `ncclBfloat16`.
    Bf16 = 9,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }
}

/// `ncclRedOp_t` (the built-in ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum RedOp {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclProd`.
    Prod = 1,
    /// `ncclMax`.
    Max = 2,
    /// `ncclMin`.
    Min = 3,
    /// `ncclAvg`.
    Avg = 4,
}

type Coll5 = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm_, CuStream) -> NcclResult;
type Reduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, NcclComm_, CuStream) -> NcclResult;
type Gather = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm_, CuStream) -> NcclResult;
type P2p = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm_, CuStream) -> NcclResult;
type P2pMut = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm_, CuStream) -> NcclResult;

/// `ncclWaitSignalDesc_t`.
#[repr(C)]
struct WaitDesc {
    op_cnt: c_int,
    peer: c_int,
    sig_idx: c_int,
    ctx: c_int,
}

/// NCCL's window API (2.29+): registration and the host-initiated
/// one-sided calls.
#[derive(Clone, Copy, Debug)]
struct RmaApi {
    register: unsafe extern "C" fn(NcclComm_, *mut c_void, usize, *mut *mut c_void, c_int) -> NcclResult,
    deregister: unsafe extern "C" fn(NcclComm_, *mut c_void) -> NcclResult,
    #[allow(clippy::type_complexity)]
    put_signal: unsafe extern "C" fn(
        *const c_void,
        usize,
        c_int,
        c_int,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_uint,
        NcclComm_,
        CuStream,
    ) -> NcclResult,
    signal: unsafe extern "C" fn(c_int, c_int, c_int, c_uint, NcclComm_, CuStream) -> NcclResult,
    wait_signal: unsafe extern "C" fn(c_int, *mut WaitDesc, NcclComm_, CuStream) -> NcclResult,
}

impl RmaApi {
    fn of(lib: &Library) -> Result<RmaApi> {
        lib.require(WINDOW_API, "windows (ncclCommWindowRegister, ncclPutSignal, ncclSignal, ncclWaitSignal)")?;
        let l = &lib.lib;
        // SAFETY: each type is the function's C signature in nccl.h 2.29+
        // (ncclWindow_t is a pointer; flags are unsigned ints).
        unsafe {
            Ok(RmaApi {
                register: l.get("ncclCommWindowRegister\0")?,
                deregister: l.get("ncclCommWindowDeregister\0")?,
                put_signal: l.get("ncclPutSignal\0")?,
                signal: l.get("ncclSignal\0")?,
                wait_signal: l.get("ncclWaitSignal\0")?,
            })
        }
    }
}

/// `NCCL_WIN_COLL_SYMMETRIC`: every rank registers its buffer together
/// (what the one-sided calls need).
const WIN_COLL_SYMMETRIC: c_int = 1;

/// One rank's registration of a buffer in an NCCL window
/// ([`NcclComm::window_register`]); deregistered by
/// [`NcclComm::window_deregister`] (or with the communicator).
#[derive(Debug)]
pub struct NcclWindow {
    raw: *mut c_void,
    /// The communicator that registered it (its calls refuse others').
    comm: NcclComm_,
    ptr: DevicePtr,
    len: usize,
}

// SAFETY: the handles are opaque NCCL pointers, used only through the
// registering communicator's calls.
unsafe impl Send for NcclWindow {}

impl NcclWindow {
    /// The registered buffer's device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Clone, Copy)]
struct Api {
    unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    init_rank: unsafe extern "C" fn(*mut NcclComm_, c_int, UniqueId, c_int) -> NcclResult,
    destroy: unsafe extern "C" fn(NcclComm_) -> NcclResult,
    abort: unsafe extern "C" fn(NcclComm_) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    async_error: unsafe extern "C" fn(NcclComm_, *mut NcclResult) -> NcclResult,
    all_reduce: Coll5,
    reduce_scatter: Coll5,
    broadcast: Coll5,
    reduce: Reduce,
    all_gather: Gather,
    send: P2p,
    recv: P2pMut,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

impl Api {
    fn of(lib: &Library) -> Result<Api> {
        let l = &lib.lib;
        // SAFETY: each type is the function's C signature in nccl.h
        // (ncclUniqueId by value is a 128-byte struct; enums are ints;
        // cudaStream_t and ncclComm_t are pointers).
        unsafe {
            Ok(Api {
                unique_id: l.get("ncclGetUniqueId\0")?,
                init_rank: l.get("ncclCommInitRank\0")?,
                destroy: l.get("ncclCommDestroy\0")?,
                abort: l.get("ncclCommAbort\0")?,
                error_string: l.get("ncclGetErrorString\0")?,
                async_error: l.get("ncclCommGetAsyncError\0")?,
                all_reduce: l.get("ncclAllReduce\0")?,
                reduce_scatter: l.get("ncclReduceScatter\0")?,
                broadcast: l.get("ncclBroadcast\0")?,
                reduce: l.get("ncclReduce\0")?,
                all_gather: l.get("ncclAllGather\0")?,
                send: l.get("ncclSend\0")?,
                recv: l.get("ncclRecv\0")?,
                group_start: l.get("ncclGroupStart\0")?,
                group_end: l.get("ncclGroupEnd\0")?,
            })
        }
    }

    fn check(&self, lib: &Library, call: &'static str, st: NcclResult) -> Result<()> {
        if st == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let p = unsafe { (self.error_string)(st) };
        let name = if p.is_null() {
            format!("ncclResult {st}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Err(CudaError::Call { lib: lib_name(lib), call, code: st, name })
    }
}

fn lib_name(lib: &Library) -> &'static str {
    match lib.flavor() {
        Flavor::Nccl => "NCCL (libnccl.so.2)",
        Flavor::Rccl => "RCCL (librccl.so.1)",
    }
}

/// A new unique id (rank 0 makes it; no GPU needed).
pub fn unique_id(lib: &Library) -> Result<UniqueId> {
    let api = Api::of(lib)?;
    let mut id = UniqueId([0; 128]);
    // SAFETY: a valid out-pointer of the id's layout.
    api.check(lib, "ncclGetUniqueId", unsafe { (api.unique_id)(&mut id) })?;
    Ok(id)
}

/// One rank's NCCL communicator, on one device; destroyed on drop.
pub struct NcclComm {
    api: Api,
    lib: Arc<Library>,
    ctx: Arc<Context>,
    comm: NcclComm_,
    rank: usize,
    size: usize,
    /// NCCL's window API, resolved at init: its calls, or why there are none
    /// (older than 2.29, a missing symbol).
    rma: std::result::Result<RmaApi, CudaError>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {}, {} {})", self.rank, self.size, lib_name(&self.lib), self.lib.version())
    }
}

// SAFETY: an NCCL communicator may be used from any thread (one at a time:
// the methods take &mut self) with its device's context current.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the communicator of `size` ranks that `id` names, as `rank`,
    /// on `ctx`'s device (collective: every rank calls it).
    pub fn init(lib: Arc<Library>, ctx: Arc<Context>, id: &UniqueId, rank: usize, size: usize) -> Result<NcclComm> {
        let api = Api::of(&lib)?;
        let bound = ctx.bind()?;
        let mut comm: NcclComm_ = std::ptr::null_mut();
        let (n, r) = (c_int::try_from(size).unwrap_or(c_int::MAX), c_int::try_from(rank).unwrap_or(c_int::MAX));
        // SAFETY: a valid out-pointer; the id by value. (From 2.29 NCCL
        // gives a communicator one RMA context by default, what its
        // one-sided calls need; NCCL_NUM_RMA_CTX sets how many.)
        api.check(&lib, "ncclCommInitRank", unsafe { (api.init_rank)(&mut comm, n, *id, r) })?;
        drop(bound);
        let rma = RmaApi::of(&lib);
        Ok(NcclComm { api, lib, ctx, comm, rank, size, rma })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The library's version, as "NCCL 2.28.9".
    pub fn library(&self) -> String {
        format!("{} {}", lib_name(&self.lib), self.lib.version())
    }

    fn call(&self, call: &'static str, f: impl FnOnce() -> NcclResult) -> Result<()> {
        let _bound = self.ctx.bind()?;
        self.api.check(&self.lib, call, f())?;
        // An error of earlier work (a peer gone, a network error) surfaces
        // here rather than as a hang later.
        let mut st = 0;
        // SAFETY: a live communicator and a valid out-pointer.
        self.api.check(&self.lib, "ncclCommGetAsyncError", unsafe { (self.api.async_error)(self.comm, &mut st) })?;
        self.api.check(&self.lib, call, st)
    }

    /// `ncclAllReduce` of `count` elements from `send` into `recv` (may be
    /// the same), queued on `stream`.
    ///
    /// # Safety
    /// Both buffers hold `count` elements of device memory valid until the
    /// stream has run the operation.
    pub unsafe fn all_reduce(
        &mut self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dt: DataType,
        op: RedOp,
        stream: &Stream,
    ) -> Result<()> {
        let (c, s) = (self.comm, stream.raw() as CuStream);
        // SAFETY: the caller's contract.
        self.call("ncclAllReduce", || unsafe {
            (self.api.all_reduce)(send as _, recv as _, count, dt as c_int, op as c_int, c, s)
        })
    }

    /// `ncclReduceScatter`: `recv` gets `recv_count` elements, `send` holds
    /// `size × recv_count`.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce), for those sizes.
    pub unsafe fn reduce_scatter(
        &mut self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dt: DataType,
        op: RedOp,
        stream: &Stream,
    ) -> Result<()> {
        let (c, s) = (self.comm, stream.raw() as CuStream);
        // SAFETY: the caller's contract.
        self.call("ncclReduceScatter", || unsafe {
            (self.api.reduce_scatter)(send as _, recv as _, recv_count, dt as c_int, op as c_int, c, s)
        })
    }

    /// `ncclBroadcast` of `count` elements from `root`'s `send` into every
    /// rank's `recv`.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce).
    pub unsafe fn broadcast(
        &mut self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dt: DataType,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (c, s, root) = (self.comm, stream.raw() as CuStream, root as c_int);
        // SAFETY: the caller's contract (ncclBroadcast's fifth argument, an
        // int like the reductions' op, is the root).
        self.call("ncclBroadcast", || unsafe {
            (self.api.broadcast)(send as _, recv as _, count, dt as c_int, root, c, s)
        })
    }

    /// `ncclReduce` into `root`'s `recv`.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &mut self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dt: DataType,
        op: RedOp,
        root: usize,
        stream: &Stream,
    ) -> Result<()> {
        let (c, s, root) = (self.comm, stream.raw() as CuStream, root as c_int);
        // SAFETY: the caller's contract.
        self.call("ncclReduce", || unsafe {
            (self.api.reduce)(send as _, recv as _, count, dt as c_int, op as c_int, root, c, s)
        })
    }

    /// `ncclAllGather`: `send` holds `send_count` elements, `recv`
    /// `size × send_count`.
    ///
    /// # Safety
    /// As for [`all_reduce`](Self::all_reduce), for those sizes.
    pub unsafe fn all_gather(
        &mut self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dt: DataType,
        stream: &Stream,
    ) -> Result<()> {
        let (c, s) = (self.comm, stream.raw() as CuStream);
        // SAFETY: the caller's contract.
        self.call("ncclAllGather", || unsafe {
            (self.api.all_gather)(send as _, recv as _, send_count, dt as c_int, c, s)
        })
    }

    /// Point-to-point transfers in one NCCL group: each `(send, count,
    /// peer)` of `sends` to its peer, each `(recv, count, peer)` of `recvs`
    /// from its peer (all-to-all, send, recv).
    ///
    /// # Safety
    /// Every buffer holds its count of elements of device memory valid
    /// until the stream has run the group.
    pub unsafe fn send_recv(
        &mut self,
        sends: &[(DevicePtr, usize, usize)],
        recvs: &[(DevicePtr, usize, usize)],
        dt: DataType,
        stream: &Stream,
    ) -> Result<()> {
        let (c, s) = (self.comm, stream.raw() as CuStream);
        let _bound = self.ctx.bind()?;
        // SAFETY: no arguments.
        self.api.check(&self.lib, "ncclGroupStart", unsafe { (self.api.group_start)() })?;
        let mut first_err = Ok(());
        for &(p, n, peer) in sends {
            // SAFETY: the caller's contract.
            let st = unsafe { (self.api.send)(p as _, n, dt as c_int, peer as c_int, c, s) };
            first_err = first_err.and(self.api.check(&self.lib, "ncclSend", st));
        }
        for &(p, n, peer) in recvs {
            // SAFETY: the caller's contract.
            let st = unsafe { (self.api.recv)(p as _, n, dt as c_int, peer as c_int, c, s) };
            first_err = first_err.and(self.api.check(&self.lib, "ncclRecv", st));
        }
        // The group is always closed, whatever failed inside it.
        // SAFETY: no arguments.
        let end = self.api.check(&self.lib, "ncclGroupEnd", unsafe { (self.api.group_end)() });
        first_err.and(end)
    }

    /// Whether NCCL's window API can be used (2.29 or later, with the
    /// calls; else the error saying which is missing): check before a
    /// collective registration, so every rank can learn of any rank's
    /// refusal.
    pub fn window_api(&self) -> Result<()> {
        self.rma.clone().map(drop)
    }

    /// `ncclCommWindowRegister` of `mem` with `NCCL_WIN_COLL_SYMMETRIC`
    /// (collective: every rank registers its buffer in the same order).
    /// NCCL wants cuMem/VMM memory (`ncclMemAlloc`, PyTorch's expandable
    /// segments), 4096-byte aligned. A communicator without symmetric
    /// window support (or `NCCL_WIN_ENABLE=0`) gives no window: an error
    /// here.
    ///
    /// # Safety
    /// `mem` stays allocated until the window is deregistered (peers write
    /// it until then), and is in no other window of this communicator
    /// (NCCL leaves registering a buffer twice undefined).
    pub unsafe fn window_register(&mut self, mem: &DeviceMemory) -> Result<NcclWindow> {
        let api = self.rma.clone()?;
        let mut raw: *mut c_void = std::ptr::null_mut();
        let (c, ptr, len) = (self.comm, mem.ptr(), mem.len());
        let bound = self.ctx.bind()?;
        // SAFETY: live device memory (the caller keeps it allocated while
        // registered); a valid out-pointer.
        let st = unsafe { (api.register)(c, ptr as *mut c_void, len, &mut raw, WIN_COLL_SYMMETRIC) };
        drop(bound);
        self.api.check(&self.lib, "ncclCommWindowRegister", st)?;
        if raw.is_null() {
            return Err(CudaError::Call {
                lib: lib_name(&self.lib),
                call: "ncclCommWindowRegister",
                code: 0,
                name: "NCCL gave no window: this communicator has no symmetric window support (or NCCL_WIN_ENABLE=0)"
                    .into(),
            });
        }
        let win = NcclWindow { raw, comm: c, ptr, len };
        // Registered: an asynchronous error now must not lose the window.
        if let Err(e) = self.call("ncclCommWindowRegister", || 0) {
            // SAFETY: just registered, nothing queued uses it.
            let _ = unsafe { self.window_deregister(win) };
            return Err(e);
        }
        Ok(win)
    }

    fn mine(&self, call: &'static str, win: &NcclWindow) -> Result<()> {
        if win.comm != self.comm {
            return Err(CudaError::Call {
                lib: lib_name(&self.lib),
                call,
                code: 4,
                name: "the window belongs to another communicator".into(),
            });
        }
        Ok(())
    }

    /// `ncclCommWindowDeregister` (local to this rank, as NCCL documents).
    ///
    /// # Safety
    /// No queued operation of any stream uses the window (its buffer as a
    /// put's source, or NCCL's mapping of a peer's buffer).
    pub unsafe fn window_deregister(&mut self, win: NcclWindow) -> Result<()> {
        let api = self.rma.clone()?;
        self.mine("ncclCommWindowDeregister", &win)?;
        let c = self.comm;
        // SAFETY: a window this communicator registered, deregistered once
        // (taken by value), unused (the caller's contract).
        self.call("ncclCommWindowDeregister", || unsafe { (api.deregister)(c, win.raw) })
    }

    /// `ncclPutSignal`: `len` bytes at `src` (inside a window this rank
    /// registered, as NCCL requires) into `peer`'s buffer of `win` at byte
    /// `offset`, then one signal to `peer` (NCCL's signal 0, context 0),
    /// queued on `stream`. NCCL counts the put among `peer`'s signals from
    /// this rank.
    ///
    /// # Safety
    /// `src..src + len` lies in a window this rank registered; both
    /// windows stay registered (and their memory allocated) until the
    /// stream has run the put; `offset + len` fits `peer`'s buffer of `win`
    /// (NCCL does not check it: rmacomm's `NcclRma` does).
    pub unsafe fn put_signal(
        &mut self,
        src: DevicePtr,
        len: usize,
        peer: usize,
        win: &NcclWindow,
        offset: usize,
        stream: &Stream,
    ) -> Result<()> {
        let api = self.rma.clone()?;
        self.mine("ncclPutSignal", win)?;
        let (c, s, w) = (self.comm, stream.raw() as CuStream, win.raw);
        let peer = c_int::try_from(peer).unwrap_or(c_int::MAX);
        // SAFETY: the caller's contract; bytes as ncclUint8.
        self.call("ncclPutSignal", || unsafe {
            (api.put_signal)(src as *const c_void, len, DataType::U8 as c_int, peer, w, offset, 0, 0, 0, c, s)
        })
    }

    /// `ncclSignal` to `peer` (signal 0, context 0), queued on `stream`.
    pub fn signal(&mut self, peer: usize, stream: &Stream) -> Result<()> {
        let api = self.rma.clone()?;
        let (c, s) = (self.comm, stream.raw() as CuStream);
        let peer = c_int::try_from(peer).unwrap_or(c_int::MAX);
        // SAFETY: no buffers; a live communicator and stream.
        self.call("ncclSignal", || unsafe { (api.signal)(peer, 0, 0, 0, c, s) })
    }

    /// `ncclWaitSignal` for `count` more signals (puts included) from
    /// `peer`, queued on `stream`. A count NCCL cannot take (above a C
    /// int's range) is refused, not cut.
    pub fn wait_signal(&mut self, peer: usize, count: u32, stream: &Stream) -> Result<()> {
        let api = self.rma.clone()?;
        let Ok(op_cnt) = c_int::try_from(count) else {
            return Err(CudaError::Call {
                lib: lib_name(&self.lib),
                call: "ncclWaitSignal",
                code: 4,
                name: format!("a wait for {count} signals: NCCL counts in a C int"),
            });
        };
        let (c, s) = (self.comm, stream.raw() as CuStream);
        let mut desc = WaitDesc { op_cnt, peer: c_int::try_from(peer).unwrap_or(c_int::MAX), sig_idx: 0, ctx: 0 };
        // SAFETY: one valid descriptor, read during the call.
        self.call("ncclWaitSignal", || unsafe { (api.wait_signal)(1, &mut desc, c, s) })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let _bound = self.ctx.bind();
        let mut st = 0;
        // SAFETY: a live communicator, destroyed (or aborted, after an
        // asynchronous error, which destroy could wait on forever) once.
        unsafe {
            let broken = (self.api.async_error)(self.comm, &mut st) != 0 || st != 0;
            if broken {
                (self.api.abort)(self.comm);
            } else {
                (self.api.destroy)(self.comm);
            }
        }
    }
}
