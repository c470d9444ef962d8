//! An NCCL (or RCCL) communicator through the run-time loaded library:
//! the fallback backend's collectives on device memory, queued on a CUDA
//! stream. The unique id needs no GPU (rank 0 makes it, the bootstrap
//! group carries it); everything else needs the device.
//!
//! No call waits for a peer without a limit (the project's rule: a dead
//! peer is an error naming the call, never a hang): the communicator is
//! made non-blocking (`ncclConfig_t.blocking = 0`, NCCL 2.14+), so init,
//! any call NCCL answers with `ncclInProgress`, and the end of the
//! communicator are polled with `ncclCommGetAsyncError` until the
//! communicator's timeout, as torch's ProcessGroupNCCL does. Work already
//! queued on a stream is the stream's: nothing here bounds how long a
//! stream waits for a peer, except that dropping the communicator aborts
//! what has not finished within the timeout.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::{DeviceMemory, Stream};
use crate::driver::{Context, DevicePtr};
use crate::nccl::{Flavor, Library, WINDOW_API};
use crate::nccl_config::{Config, CONFIG_API};
use crate::{CudaError, Result};

type NcclResult = c_int;
/// `ncclInProgress`: a non-blocking call (or the communicator's init or
/// finalization) has not finished yet.
const IN_PROGRESS: NcclResult = 7;
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

/// The calls of a non-blocking communicator (NCCL 2.14+).
#[derive(Clone, Copy)]
struct NonBlockingApi {
    init_rank_config: unsafe extern "C" fn(*mut NcclComm_, c_int, UniqueId, c_int, *mut Config) -> NcclResult,
    finalize: unsafe extern "C" fn(NcclComm_) -> NcclResult,
}

#[derive(Clone, Copy)]
struct Api {
    unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    init_rank: unsafe extern "C" fn(*mut NcclComm_, c_int, UniqueId, c_int) -> NcclResult,
    /// `None` for a library older than 2.14 or without the calls.
    nonblocking: Option<NonBlockingApi>,
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
        let nonblocking = if lib.version() >= CONFIG_API {
            // SAFETY: the C signatures in nccl.h 2.14+ (ncclConfig_t by
            // pointer).
            unsafe {
                match (l.get("ncclCommInitRankConfig\0"), l.get("ncclCommFinalize\0")) {
                    (Ok(init_rank_config), Ok(finalize)) => Some(NonBlockingApi { init_rank_config, finalize }),
                    _ => None,
                }
            }
        } else {
            None
        };
        // SAFETY: each type is the function's C signature in nccl.h
        // (ncclUniqueId by value is a 128-byte struct; enums are ints;
        // cudaStream_t and ncclComm_t are pointers).
        unsafe {
            Ok(Api {
                unique_id: l.get("ncclGetUniqueId\0")?,
                init_rank: l.get("ncclCommInitRank\0")?,
                nonblocking,
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
        match st {
            0 => Ok(()),
            e => Err(self.error(lib, call, e)),
        }
    }

    /// The error `call` returning `st` (not success) is.
    fn error(&self, lib: &Library, call: &'static str, st: NcclResult) -> CudaError {
        // SAFETY: NCCL returns a static string for any code.
        let p = unsafe { (self.error_string)(st) };
        let name = if p.is_null() {
            format!("ncclResult {st}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        CudaError::Call { lib: lib_name(lib), call, code: st, name }
    }

    /// Polls `ncclCommGetAsyncError` while it says `ncclInProgress`, until
    /// `deadline`: `Ok` once NCCL says success, else why not.
    fn settle(&self, comm: NcclComm_, deadline: Instant) -> std::result::Result<(), Unsettled> {
        // Short at first (most calls settle at once), then at most 1 ms:
        // init takes seconds, and a poll is one atomic load in NCCL.
        let mut pause = Duration::from_micros(10);
        loop {
            let mut st = 0;
            // SAFETY: a live communicator (init's, before any abort) and a
            // valid out-pointer.
            let q = unsafe { (self.async_error)(comm, &mut st) };
            match (q, st) {
                (0, 0) => return Ok(()),
                (0, IN_PROGRESS) => {}
                (0, e) | (e, _) => return Err(Unsettled::Failed(e)),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Unsettled::TimedOut);
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// `timeout` from now (a timeout past what `Instant` holds: a century).
fn deadline(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// Why a non-blocking call did not end in success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unsettled {
    /// NCCL reported this code (the call's own error, or an asynchronous
    /// one: a peer gone, a network error).
    Failed(NcclResult),
    /// Still `ncclInProgress` at the deadline.
    TimedOut,
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

/// One rank's NCCL communicator, on one device; ended on drop (see
/// [`close`](Self::close): at most the timeout, then aborted).
///
/// A call that fails with [`CudaError::Timeout`] may still be running
/// inside NCCL: its buffers must stay valid until the communicator is
/// dropped (which aborts it), and the communicator takes no other call
/// until NCCL says it has ended.
pub struct NcclComm {
    api: Api,
    lib: Arc<Library>,
    ctx: Arc<Context>,
    /// Null once closed or aborted.
    comm: NcclComm_,
    rank: usize,
    size: usize,
    /// How long a call NCCL answers `ncclInProgress`, and the end of the
    /// communicator, may take.
    timeout: Duration,
    /// Made with `blocking = 0` (else by `ncclCommInitRank`, or NCCL's
    /// `NCCL_COMM_BLOCKING=1` overrode it): its calls may return
    /// `ncclInProgress`, and it can be finalized without blocking.
    nonblocking: bool,
    /// A call still `ncclInProgress` at its deadline: NCCL allows no other
    /// call on the communicator until it ends.
    unsettled: Cell<Option<&'static str>>,
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
    /// on `ctx`'s device (collective: every rank calls it), waiting at most
    /// `timeout` for the others: past it (a rank that died, or never
    /// called init) the half-made communicator is aborted and the error
    /// ([`CudaError::Timeout`]) names `ncclCommInitRankConfig`, this rank
    /// and the timeout. NCCL cannot tell which rank is missing; the
    /// bootstrap group can (Python's `new_comm("nccl")` asks it).
    ///
    /// `ncclCommInitRankConfig` with `blocking = 0` (its `ncclConfig_t`
    /// laid out as the loaded version's nccl.h lays it out), then
    /// `ncclCommGetAsyncError` polled until success. A library older than
    /// 2.14 (or without `ncclCommInitRankConfig` / `ncclCommFinalize`) has
    /// only the blocking `ncclCommInitRank`: used then, and it waits for
    /// every rank without a limit, as does any init under NCCL's
    /// `NCCL_COMM_BLOCKING=1`. `timeout` also bounds the later calls NCCL
    /// answers `ncclInProgress` and the end of the communicator
    /// ([`set_timeout`](Self::set_timeout) changes it).
    pub fn init(
        lib: Arc<Library>,
        ctx: Arc<Context>,
        id: &UniqueId,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<NcclComm> {
        let api = Api::of(&lib)?;
        let bound = ctx.bind()?;
        let deadline = deadline(timeout);
        let mut comm: NcclComm_ = std::ptr::null_mut();
        let (n, r) = (c_int::try_from(size).unwrap_or(c_int::MAX), c_int::try_from(rank).unwrap_or(c_int::MAX));
        // (From 2.29 NCCL gives a communicator one RMA context by default,
        // what its one-sided calls need; NCCL_NUM_RMA_CTX sets how many.)
        let nonblocking = match (api.nonblocking, Config::nonblocking(lib.version())) {
            (Some(nb), Some(mut config)) => {
                const CALL: &str = "ncclCommInitRankConfig";
                // SAFETY: a valid out-pointer; the id by value; a config of
                // the loaded version's layout, read during the call.
                let st = unsafe { (nb.init_rank_config)(&mut comm, n, *id, r, &mut config) };
                let settled = match st {
                    0 | IN_PROGRESS => api.settle(comm, deadline),
                    e => Err(Unsettled::Failed(e)),
                };
                if let Err(why) = settled {
                    if !comm.is_null() {
                        // SAFETY: the communicator NCCL made (it leaves
                        // null where it freed it), aborted once; abort
                        // cancels an init still in progress.
                        unsafe { (api.abort)(comm) };
                    }
                    return Err(match why {
                        Unsettled::Failed(code) => match api.error(&lib, CALL, code) {
                            CudaError::Call { lib, call, code, name } => {
                                CudaError::Call { lib, call, code, name: format!("{name} (rank {rank} of {size})") }
                            }
                            other => other,
                        },
                        Unsettled::TimedOut => CudaError::Timeout {
                            lib: lib_name(&lib),
                            call: CALL,
                            after: timeout,
                            detail: format!(
                                "rank {rank} of {size} waited for the others: not every rank joined (one died, \
                                 or never called it); aborted here"
                            ),
                        },
                    });
                }
                std::env::var("NCCL_COMM_BLOCKING").map_or(true, |v| v.trim() == "0")
            }
            _ => {
                // SAFETY: a valid out-pointer; the id by value.
                api.check(&lib, "ncclCommInitRank", unsafe { (api.init_rank)(&mut comm, n, *id, r) })?;
                false
            }
        };
        drop(bound);
        let rma = RmaApi::of(&lib);
        Ok(NcclComm { api, lib, ctx, comm, rank, size, timeout, nonblocking, unsettled: Cell::new(None), rma })
    }

    /// Changes the limit of later calls NCCL answers `ncclInProgress` and
    /// of the communicator's end.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The limit [`init`](Self::init) was given (or
    /// [`set_timeout`](Self::set_timeout)'s).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the communicator is non-blocking (NCCL 2.14+, unless
    /// `NCCL_COMM_BLOCKING=1`): only then are its init, its calls and its
    /// end bounded by the timeout.
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking
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

    /// Refuses a call on an aborted communicator, and one while an earlier
    /// call is still `ncclInProgress` past its deadline (NCCL allows none
    /// then), unless it has ended since.
    fn usable(&self, call: &'static str) -> Result<()> {
        if self.comm.is_null() {
            return Err(CudaError::Call {
                lib: lib_name(&self.lib),
                call,
                code: 0,
                name: format!("rank {} of {}: the communicator was aborted", self.rank, self.size),
            });
        }
        let Some(earlier) = self.unsettled.get() else { return Ok(()) };
        if self.api.settle(self.comm, Instant::now()).is_err() {
            return Err(CudaError::Call {
                lib: lib_name(&self.lib),
                call,
                code: IN_PROGRESS,
                name: format!(
                    "rank {} of {}: an earlier {earlier} did not complete within {:?}, and NCCL allows no other call \
                     until it does: make a new communicator",
                    self.rank, self.size, self.timeout
                ),
            });
        }
        self.unsettled.set(None);
        Ok(())
    }

    /// `st`, the status `call` returned, and then the communicator's: a
    /// call answered `ncclInProgress` is polled until it ends (at most the
    /// timeout; past it the communicator refuses further calls), and an
    /// error of earlier work (a peer gone, a network error) surfaces here
    /// rather than as a hang later.
    fn finish(&self, call: &'static str, st: NcclResult) -> Result<()> {
        if st != IN_PROGRESS {
            self.api.check(&self.lib, call, st)?;
        }
        match self.api.settle(self.comm, deadline(self.timeout)) {
            Ok(()) => Ok(()),
            Err(Unsettled::Failed(code)) => Err(self.api.error(&self.lib, call, code)),
            Err(Unsettled::TimedOut) => {
                self.unsettled.set(Some(call));
                Err(CudaError::Timeout {
                    lib: lib_name(&self.lib),
                    call,
                    after: self.timeout,
                    detail: format!(
                        "rank {} of {}: NCCL still reports it in progress (a peer that died or stopped calling); \
                         the communicator takes no other call until it ends",
                        self.rank, self.size
                    ),
                })
            }
        }
    }

    fn call(&self, call: &'static str, f: impl FnOnce() -> NcclResult) -> Result<()> {
        self.usable(call)?;
        let _bound = self.ctx.bind()?;
        let st = f();
        self.finish(call, st)
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
        self.usable("ncclGroupStart")?;
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
        // The group is always closed, whatever failed inside it; a
        // non-blocking communicator may answer ncclInProgress (the group
        // runs in NCCL's thread), polled as any call.
        // SAFETY: no arguments.
        let end = unsafe { (self.api.group_end)() };
        first_err.and(self.finish("ncclGroupEnd", end))
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
    /// it until then) — after a [`CudaError::Timeout`] here, until the
    /// communicator is dropped (NCCL may still be registering it) — and is
    /// in no other window of this communicator (NCCL leaves registering a
    /// buffer twice undefined).
    pub unsafe fn window_register(&mut self, mem: &DeviceMemory) -> Result<NcclWindow> {
        let api = self.rma.clone()?;
        self.usable("ncclCommWindowRegister")?;
        // A non-blocking registration is a task NCCL's group thread runs,
        // writing the window's handle when it is done: on the heap, so
        // that one still running past the timeout writes nothing freed.
        let slot: *mut *mut c_void = Box::into_raw(Box::new(std::ptr::null_mut()));
        let (c, ptr, len) = (self.comm, mem.ptr(), mem.len());
        let bound = self.ctx.bind()?;
        // SAFETY: live device memory (the caller keeps it allocated while
        // registered); a valid out-pointer, alive until the registration
        // has ended (`finish` polls a non-blocking one to its end).
        let st = unsafe { (api.register)(c, ptr as *mut c_void, len, slot, WIN_COLL_SYMMETRIC) };
        drop(bound);
        let done = self.finish("ncclCommWindowRegister", st);
        if let Err(e @ CudaError::Timeout { .. }) = done {
            // Still running: the slot stays NCCL's (8 bytes leaked).
            return Err(e);
        }
        // SAFETY: the slot made above, freed once; the registration has
        // ended (finished or failed), so NCCL writes it no more.
        let raw = unsafe { *Box::from_raw(slot) };
        if let Err(e) = done {
            if !raw.is_null() {
                // NCCL made the window before the error: not lost.
                let win = NcclWindow { raw, comm: c, ptr, len };
                // SAFETY: just registered, nothing queued uses it.
                let _ = unsafe { self.window_deregister(win) };
            }
            return Err(e);
        }
        if raw.is_null() {
            return Err(CudaError::Call {
                lib: lib_name(&self.lib),
                call: "ncclCommWindowRegister",
                code: 0,
                name: "NCCL gave no window: this communicator has no symmetric window support (or NCCL_WIN_ENABLE=0)"
                    .into(),
            });
        }
        Ok(NcclWindow { raw, comm: c, ptr, len })
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

impl NcclComm {
    /// Ends the communicator, as dropping it does, and says how it went.
    ///
    /// A non-blocking communicator is finalized (`ncclCommFinalize`, which
    /// flushes its outstanding work, polled until `ncclSuccess`) and then
    /// destroyed, which then returns at once. If an asynchronous error is
    /// set, or the work has not finished within the timeout (a peer that
    /// died: its collectives, sends and signal waits never end), it is
    /// aborted instead (`ncclCommAbort`): that work is cut short — NCCL's
    /// kernels exit, what they were writing is undefined, streams go on to
    /// their next work — and the error names the call, this rank and the
    /// timeout. Waiting is bounded rather than skipped because destroying a
    /// communicator whose work is still running is the one thing NCCL
    /// leaves undefined, and cutting short work that would have finished
    /// loses data; an abort is never a leak, so nothing is left behind
    /// either way.
    ///
    /// A blocking communicator (a library older than 2.14, or
    /// `NCCL_COMM_BLOCKING=1`) is aborted after an asynchronous error and
    /// destroyed otherwise; `ncclCommDestroy` then waits for its work
    /// without a limit.
    pub fn close(mut self) -> Result<()> {
        self.end()
    }

    /// `ncclCommAbort` now, without waiting: outstanding work is cut short
    /// (as in [`close`](Self::close) past the timeout). For a communicator
    /// that other ranks have given up on.
    pub fn abort(mut self) {
        self.abort_in_place();
    }

    /// [`abort`](Self::abort), for an owner that cannot give the
    /// communicator up (a `Drop`): every later call fails saying it was
    /// aborted, and dropping it does nothing more.
    pub fn abort_in_place(&mut self) {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        if !comm.is_null() {
            let _bound = self.ctx.bind();
            // SAFETY: a live communicator, aborted once (nulled above).
            unsafe { (self.api.abort)(comm) };
        }
    }

    fn end(&mut self) -> Result<()> {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        if comm.is_null() {
            return Ok(());
        }
        // NCCL binds the device itself; a failure here changes nothing.
        let _bound = self.ctx.bind();
        let why = match self.api.nonblocking.filter(|_| self.nonblocking) {
            Some(nb) => self.finalize(comm, nb),
            None => {
                let mut st = 0;
                // SAFETY: a live communicator and a valid out-pointer.
                let q = unsafe { (self.api.async_error)(comm, &mut st) };
                match (q, st) {
                    (0, 0) => None,
                    (0, e) | (e, _) => Some(self.api.error(&self.lib, "ncclCommGetAsyncError", e)),
                }
            }
        };
        match why {
            None => {
                // SAFETY: a live communicator, destroyed once (nulled
                // above); finalized, or blocking without an error.
                let st = unsafe { (self.api.destroy)(comm) };
                self.api.check(&self.lib, "ncclCommDestroy", st)
            }
            Some(e) => {
                // SAFETY: a live communicator, aborted once (nulled above).
                unsafe { (self.api.abort)(comm) };
                Err(e)
            }
        }
    }

    /// Finalizes a non-blocking communicator within the timeout: `None`
    /// when it may be destroyed, else why it must be aborted.
    fn finalize(&self, comm: NcclComm_, nb: NonBlockingApi) -> Option<CudaError> {
        let deadline = deadline(self.timeout);
        let late = |call| CudaError::Timeout {
            lib: lib_name(&self.lib),
            call,
            after: self.timeout,
            detail: format!(
                "rank {} of {}: its outstanding work did not finish (a peer that died, or work waiting for one); \
                 aborted (ncclCommAbort): that work was cut short and what it was writing is undefined",
                self.rank, self.size
            ),
        };
        // A call still in progress must end first: NCCL allows no other.
        match self.api.settle(comm, deadline) {
            Ok(()) => {}
            Err(Unsettled::Failed(e)) => return Some(self.api.error(&self.lib, "ncclCommGetAsyncError", e)),
            Err(Unsettled::TimedOut) => return Some(late(self.unsettled.get().unwrap_or("ncclCommGetAsyncError"))),
        }
        // SAFETY: a live, settled communicator, finalized once.
        let st = unsafe { (nb.finalize)(comm) };
        if st != 0 && st != IN_PROGRESS {
            return Some(self.api.error(&self.lib, "ncclCommFinalize", st));
        }
        match self.api.settle(comm, deadline) {
            Ok(()) => None,
            Err(Unsettled::Failed(e)) => Some(self.api.error(&self.lib, "ncclCommFinalize", e)),
            Err(Unsettled::TimedOut) => Some(late("ncclCommFinalize")),
        }
    }
}

impl Drop for NcclComm {
    /// [`close`](NcclComm::close), its error (an abort) printed to stderr:
    /// a drop has no other way to say that work was cut short.
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        if let Err(e) = self.end() {
            eprintln!("rmacomm: dropping the NCCL communicator (rank {} of {}): {e}", self.rank, self.size);
        }
    }
}
