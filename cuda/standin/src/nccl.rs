//! A stand-in for NCCL's window API (2.29+), in the same library as the
//! CUDA stand-in (`RMACOMM_NCCL_LIB` points at it), so rmacomm's side of
//! NCCL windows — the version gate, registration,
//! bounds, the signal counts a put adds, stream order — runs in CI:
//!
//! - `ncclGetVersion` reports `RMACOMM_STANDIN_NCCL_VERSION` (default
//!   23007, NCCL 2.30.7, the header CI's venv carries);
//! - a communicator is a shared-memory segment its unique id names: a
//!   join count, a signal counter per (source, destination) pair and, per
//!   window and rank, where that rank's buffer lives (files another
//!   process maps: see `backing`);
//! - `ncclCommInitRank` gives one RMA context (NCCL's default), waiting
//!   for every rank (at most a minute, then `ncclSystemError`);
//!   `ncclCommInitRankConfig` (2.14+) reads its `ncclConfig_t` as NCCL
//!   does — `size` first, then that many bytes, `magic` 0xcafebeef,
//!   `version` — and more strictly: `size` must be that version's
//!   `sizeof`, the version no newer than this library's, every field but
//!   `blocking` `NCCL_CONFIG_UNDEF` (so a layout wrong on the caller's side
//!   fails). With `blocking = 0` (and no `NCCL_COMM_BLOCKING=1`) it
//!   returns `ncclInProgress`, and `ncclCommGetAsyncError` says
//!   `ncclInProgress` until every rank has joined — forever if one never
//!   does: only the caller's deadline (and `ncclCommAbort`) ends it. Such
//!   a communicator answers its window calls `ncclInProgress` too (the
//!   next `ncclCommGetAsyncError` says so once more, then success), as
//!   NCCL may;
//! - the work a communicator queues on streams is counted, and finishing
//!   counted: `ncclCommDestroy` waits for it as NCCL's does (for a minute,
//!   then it aborts the process saying a real NCCL would hang there),
//!   `ncclCommFinalize` of a non-blocking communicator is `ncclInProgress`
//!   until it has finished, and `ncclCommAbort` releases this rank's
//!   signal waits (NCCL's abort makes its device work exit) and frees the
//!   communicator, in progress or not (leaked, said so, when other stream
//!   work keeps the queue from draining);
//! - failures on request: `RMACOMM_STANDIN_NCCL_FAIL_PUT=1` makes every
//!   `ncclPutSignal` fail with `ncclInternalError`;
//!   `RMACOMM_STANDIN_NCCL_FAIL_INIT=<rank>` fails that rank's init after it
//!   joined (`ncclSystemError`, asynchronously when non-blocking: the other
//!   ranks' inits succeed); `RMACOMM_STANDIN_NCCL_EXIT_AT_INIT=<rank>`
//!   makes that rank's process exit (status 17) as it calls init, before
//!   joining (a rank that dies there); `RMACOMM_STANDIN_NCCL_FINALIZE_HANGS=1`
//!   keeps a non-blocking finalize `ncclInProgress` for good;
//! - `ncclCommWindowRegister` wants cuMem/VMM memory, 4096-byte aligned,
//!   one size on every rank (else `ncclInvalidArgument`), and gives no
//!   window (success, NULL) under `NCCL_WIN_ENABLE=0`, as NCCL does
//!   without symmetric support;
//! - `ncclPutSignal` queues, on the stand-in stream, a copy into the
//!   peer's buffer and then a write of the (self, peer) counter's next
//!   value (NCCL writes sequence numbers, not increments: a signal on
//!   another stream can overtake a put); `ncclSignal` the write alone;
//!   `ncclWaitSignal` a wait until the (peer, self) counter reaches what
//!   this rank's waits so far add up to. Both check what NCCL checks:
//!   signal index, context and flags 0, a peer in range, a registered
//!   window, the put within the peer's buffer, its source inside a window
//!   this rank registered.
//!
//! Collectives and point-to-point calls are refused (`ncclInvalidUsage`):
//! nothing here stands in for them.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{backing, enqueue, Op};

type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
const SYSTEM_ERROR: NcclResult = 2;
const INTERNAL_ERROR: NcclResult = 3;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;
const IN_PROGRESS: NcclResult = 7;

const MAX_RANKS: usize = 16;
const MAX_WINDOWS: usize = 32;
const BLOB: usize = 2040;
/// How long a rank waits for the others at init and at registration.
const JOIN: Duration = Duration::from_secs(60);
const ID_TAG: &[u8] = b"rmacomm-standin-nccl ";

/// `ncclUniqueId`, by value as C passes it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UniqueId([u8; 128]);

/// One rank's part of one window: `ready` 1 once `blob` holds its
/// length and pieces as text (`len\npath offset bytes\n...`), 2 once
/// it has mapped every rank's.
#[repr(C)]
struct Entry {
    ready: AtomicU64,
    blob: [u8; BLOB],
}

/// The communicator's shared segment.
#[repr(C)]
struct Shared {
    joined: AtomicU64,
    /// `signals[src * MAX_RANKS + dst]`: signals (puts included) src sent dst.
    signals: [AtomicU64; MAX_RANKS * MAX_RANKS],
    wins: [Entry; MAX_WINDOWS * MAX_RANKS],
}

/// Where a communicator stands (`ncclCommGetAsyncError`'s answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Non-blocking init: waiting for every rank to join.
    Joining,
    /// Non-blocking init done, but it fails (`RMACOMM_STANDIN_NCCL_FAIL_INIT`).
    Failing,
    Ready,
    /// `ncclCommFinalize` called: in progress until its work has finished.
    Finalizing,
}

struct Comm {
    shared: *mut Shared,
    /// The segment's name (rank 0 unlinks it once every rank mapped it).
    name: CString,
    rank: usize,
    n: usize,
    nonblocking: bool,
    state: Mutex<State>,
    /// A non-blocking call answered `ncclInProgress`: the next query says so.
    settling: AtomicBool,
    /// Operations this communicator queued on streams, and those finished
    /// (each one's last stream op adds 1; boxed: a stream thread writes it,
    /// and it must outlive an abort that leaves work behind).
    issued: AtomicU64,
    finished: Box<AtomicU64>,
    /// Per source: the signals this rank's waits so far add up to.
    expected: Mutex<Vec<u64>>,
    /// Per destination: signals (puts included) queued to it so far.
    sent: Mutex<Vec<u64>>,
    windows: AtomicUsize,
    /// This rank's registered buffers (device address, length).
    local: Mutex<Vec<(u64, usize)>>,
}

impl Comm {
    fn shared(&self) -> &Shared {
        // SAFETY: mapped for the communicator's life.
        unsafe { &*self.shared }
    }

    /// Queues `ops` on `stream` as one operation of this communicator,
    /// counted until it has run.
    fn queue(&self, stream: *mut c_void, ops: impl IntoIterator<Item = Op>) {
        self.issued.fetch_add(1, Ordering::SeqCst);
        for op in ops {
            enqueue(stream, op);
        }
        enqueue(stream, Op::Add { addr: &*self.finished as *const AtomicU64 as u64, delta: 1 });
    }

    /// Whether every operation queued so far has run.
    fn drained(&self) -> bool {
        self.finished.load(Ordering::SeqCst) >= self.issued.load(Ordering::SeqCst)
    }

    /// Waits at most `limit` for [`drained`](Self::drained).
    fn drain(&self, limit: Duration) -> bool {
        let start = Instant::now();
        while !self.drained() {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// What a call of a communicator returns on success: a non-blocking
    /// one says `ncclInProgress` (settled at the next query).
    fn done(&self) -> NcclResult {
        if self.nonblocking {
            self.settling.store(true, Ordering::SeqCst);
            return IN_PROGRESS;
        }
        SUCCESS
    }

    /// Once every rank has mapped the segment its name can go.
    fn joined(&self) {
        if self.rank == 0 {
            // SAFETY: a NUL-terminated name.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
        }
    }

    /// The value the next signal to `dst` writes.
    fn next_seq(&self, dst: usize) -> u64 {
        let mut s = self.sent.lock().unwrap();
        s[dst] += 1;
        s[dst]
    }

    fn counter(&self, src: usize, dst: usize) -> u64 {
        &self.shared().signals[src * MAX_RANKS + dst] as *const AtomicU64 as u64
    }
}

/// A window: this rank's buffer and every rank's, mapped here.
struct Win {
    comm: *const Comm,
    base: u64,
    len: usize,
    /// Per rank: host address of its buffer here, its length.
    peers: Vec<(u64, usize)>,
    /// Mappings to undo: (address, length).
    maps: Vec<(u64, usize)>,
}

fn comm<'a>(c: *mut c_void) -> Option<&'a Comm> {
    // SAFETY: a communicator this library made (the caller's contract).
    (!c.is_null()).then(|| unsafe { &*(c as *const Comm) })
}

/// `ncclGetVersion`.
///
/// # Safety
/// `v` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    // SAFETY: the caller's out-pointer.
    unsafe { *v = version_code() };
    SUCCESS
}

/// `ncclGetErrorString`.
#[no_mangle]
pub extern "C" fn ncclGetErrorString(code: NcclResult) -> *const c_char {
    let s: &'static [u8] = match code {
        0 => b"no error\0",
        2 => b"unhandled system error (stand-in)\0",
        3 => b"internal error (stand-in)\0",
        4 => b"invalid argument (stand-in)\0",
        5 => b"invalid usage (stand-in)\0",
        6 => b"remote process exited or there was a network error (stand-in)\0",
        7 => b"NCCL operation in progress (stand-in)\0",
        _ => b"unknown result code (stand-in)\0",
    };
    s.as_ptr().cast()
}

/// `ncclGetUniqueId`: names a fresh shared segment.
///
/// # Safety
/// `id` points to 128 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let name = format!("/rmacomm-nccl-{}-{nanos:08x}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    let mut out = [0u8; 128];
    out[..ID_TAG.len()].copy_from_slice(ID_TAG);
    out[ID_TAG.len()..ID_TAG.len() + name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: the caller's 128 bytes.
    unsafe { *id = UniqueId(out) };
    SUCCESS
}

/// The stand-in's version code (`RMACOMM_STANDIN_NCCL_VERSION`).
fn version_code() -> c_int {
    std::env::var("RMACOMM_STANDIN_NCCL_VERSION").ok().and_then(|s| s.parse().ok()).unwrap_or(23007)
}

/// (major, minor, patch) of an `NCCL_VERSION` code.
fn decode(code: i64) -> (i64, i64, i64) {
    if code >= 20900 {
        (code / 10000, code % 10000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    }
}

/// The rank `var` names, if any.
fn env_rank(var: &str) -> Option<usize> {
    std::env::var(var).ok().and_then(|v| v.trim().parse().ok())
}

/// Maps the communicator's segment and joins it; the new communicator.
fn attach(n: c_int, UniqueId(id): UniqueId, rank: c_int, nonblocking: bool) -> Result<Box<Comm>, NcclResult> {
    let (Ok(n), Ok(rank)) = (usize::try_from(n), usize::try_from(rank)) else { return Err(INVALID_ARGUMENT) };
    if n == 0 || n > MAX_RANKS || rank >= n || !id.starts_with(ID_TAG) {
        return Err(INVALID_ARGUMENT);
    }
    if env_rank("RMACOMM_STANDIN_NCCL_EXIT_AT_INIT") == Some(rank) {
        eprintln!("NCCL stand-in: rank {rank} exits in its init (RMACOMM_STANDIN_NCCL_EXIT_AT_INIT)");
        // SAFETY: ends the process at once, as a crash would (no atexit).
        unsafe { libc::_exit(17) };
    }
    let name: Vec<u8> = id[ID_TAG.len()..].iter().copied().take_while(|&b| b != 0).collect();
    let Ok(name) = CString::new(name) else { return Err(INVALID_ARGUMENT) };
    let len = std::mem::size_of::<Shared>();
    // SAFETY: a NUL-terminated name; the fd is closed below.
    let fd = unsafe { libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600) };
    if fd < 0 {
        return Err(SYSTEM_ERROR);
    }
    // SAFETY: our fd; every rank sets the same size.
    let p = unsafe {
        if libc::ftruncate(fd, len as libc::off_t) != 0 {
            libc::close(fd);
            return Err(SYSTEM_ERROR);
        }
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        libc::close(fd);
        p
    };
    if p == libc::MAP_FAILED {
        return Err(SYSTEM_ERROR);
    }
    let c = Box::new(Comm {
        shared: p.cast(),
        name,
        rank,
        n,
        nonblocking,
        state: Mutex::new(if nonblocking { State::Joining } else { State::Ready }),
        settling: AtomicBool::new(false),
        issued: AtomicU64::new(0),
        finished: Box::new(AtomicU64::new(0)),
        expected: Mutex::new(vec![0; n]),
        sent: Mutex::new(vec![0; n]),
        windows: AtomicUsize::new(0),
        local: Mutex::new(Vec::new()),
    });
    c.shared().joined.fetch_add(1, Ordering::AcqRel);
    Ok(c)
}

fn all_joined(c: &Comm) -> bool {
    c.shared().joined.load(Ordering::Acquire) >= c.n as u64
}

/// `ncclCommInitRank`: waits for every rank (at most a minute).
///
/// # Safety
/// `out` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(out: *mut *mut c_void, n: c_int, id: UniqueId, rank: c_int) -> NcclResult {
    let c = match attach(n, id, rank, false) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let start = Instant::now();
    while !all_joined(&c) {
        if start.elapsed() > JOIN {
            eprintln!("NCCL stand-in: rank {rank}: not every rank of {n} joined within {JOIN:?}");
            // SAFETY: our mapping and name, undone once.
            unsafe {
                libc::munmap(c.shared.cast(), std::mem::size_of::<Shared>());
                libc::shm_unlink(c.name.as_ptr());
            }
            return SYSTEM_ERROR;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    c.joined();
    if env_rank("RMACOMM_STANDIN_NCCL_FAIL_INIT") == Some(c.rank) {
        eprintln!("NCCL stand-in: rank {rank}: init fails (RMACOMM_STANDIN_NCCL_FAIL_INIT)");
        free(Box::into_raw(c).cast());
        return SYSTEM_ERROR;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *out = Box::into_raw(c).cast() };
    SUCCESS
}

/// `NCCL_CONFIG_UNDEF_INT`.
const UNDEF_INT: i32 = i32::MIN;

/// `sizeof(ncclConfig_t)` per nccl.h release that appended fields (2.14:
/// size, magic, version, blocking; 2.17: cgaClusterSize, minCTAs, maxCTAs,
/// netName; 2.18: splitShare; 2.26: trafficClass; 2.27: commName,
/// collnetEnable, CTAPolicy, shrinkShare, nvlsCTAs; 2.28:
/// nChannelsPerNetPeer, nvlinkCentricSched; 2.29: graphUsageMode,
/// numRmaCtx; 2.30: maxP2pPeers; 2.30.5: graphStreamOrdering), on LP64.
const CONFIG_SIZES: &[((i64, i64, i64), usize)] = &[
    ((2, 14, 0), 24),
    ((2, 17, 0), 40),
    ((2, 18, 0), 48),
    ((2, 26, 0), 48),
    ((2, 27, 0), 72),
    ((2, 28, 0), 80),
    ((2, 29, 0), 88),
    ((2, 30, 0), 96),
    ((2, 30, 5), 96),
];

/// The fields after `blocking`: (since, byte offset, is a pointer).
const CONFIG_FIELDS: &[((i64, i64, i64), usize, bool)] = &[
    ((2, 17, 0), 20, false),
    ((2, 17, 0), 24, false),
    ((2, 17, 0), 28, false),
    ((2, 17, 0), 32, true),
    ((2, 18, 0), 40, false),
    ((2, 26, 0), 44, false),
    ((2, 27, 0), 48, true),
    ((2, 27, 0), 56, false),
    ((2, 27, 0), 60, false),
    ((2, 27, 0), 64, false),
    ((2, 27, 0), 68, false),
    ((2, 28, 0), 72, false),
    ((2, 28, 0), 76, false),
    ((2, 29, 0), 80, false),
    ((2, 29, 0), 84, false),
    ((2, 30, 0), 88, false),
    ((2, 30, 5), 92, false),
];

/// Reads a config as NCCL's `parseCommConfig` does (`size`, then that
/// many bytes, at most its own struct's), checked more strictly; whether
/// it asks for a non-blocking communicator.
///
/// # Safety
/// `config` is null or points to at least `size` (its first field) bytes.
unsafe fn parse_config(config: *const u8) -> Result<bool, NcclResult> {
    let bad = |why: String| {
        eprintln!("NCCL stand-in: ncclCommInitRankConfig: {why}");
        Err(INVALID_ARGUMENT)
    };
    if config.is_null() {
        return Ok(false);
    }
    let mut raw = [0u8; 96];
    // SAFETY: every config starts with its size_t size (the caller's contract).
    let size = unsafe { config.cast::<u64>().read_unaligned() } as usize;
    if size < 24 {
        return bad(format!("size {size} is smaller than any ncclConfig_t"));
    }
    // SAFETY: the caller says it has `size` bytes; at most this struct's are read.
    unsafe { std::ptr::copy_nonoverlapping(config, raw.as_mut_ptr(), size.min(raw.len())) };
    let int = |at: usize| i32::from_ne_bytes(raw[at..at + 4].try_into().unwrap());
    let magic = u32::from_ne_bytes(raw[8..12].try_into().unwrap());
    if magic != 0xcafe_beef {
        return bad(format!("magic {magic:#x}: the config was not made from NCCL_CONFIG_INITIALIZER"));
    }
    let code = u32::from_ne_bytes(raw[12..16].try_into().unwrap());
    let version = decode(i64::from(code));
    let mine = decode(i64::from(version_code()));
    if version < (2, 14, 0) || version > mine {
        return bad(format!("version {code} {version:?}: not a header between 2.14 and this library's {mine:?}"));
    }
    let want = CONFIG_SIZES.iter().rev().find(|(since, _)| *since <= version).map_or(0, |e| e.1);
    if size != want {
        return bad(format!("size {size}, but nccl.h {version:?}'s ncclConfig_t is {want} bytes"));
    }
    for &(since, at, ptr) in CONFIG_FIELDS.iter().filter(|f| f.0 <= version) {
        let undef = if ptr { raw[at..at + 8].iter().all(|&b| b == 0) } else { int(at) == UNDEF_INT };
        if !undef {
            return bad(format!(
                "the field at byte {at} (since {since:?}) is not NCCL_CONFIG_UNDEF: a layout mismatch"
            ));
        }
    }
    let blocking = match std::env::var("NCCL_COMM_BLOCKING").ok().and_then(|v| v.trim().parse::<i32>().ok()) {
        Some(v) => v,
        None => int(16),
    };
    match blocking {
        UNDEF_INT | 1 => Ok(false),
        0 => Ok(true),
        other => bad(format!("blocking is {other}")),
    }
}

/// `ncclCommInitRankConfig` (2.14+): as `ncclCommInitRank`, or
/// non-blocking (returns `ncclInProgress`; `ncclCommGetAsyncError` says
/// when every rank has joined).
///
/// # Safety
/// `out` is a valid out-pointer; `config` null or a config of its size.
#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    out: *mut *mut c_void,
    n: c_int,
    id: UniqueId,
    rank: c_int,
    config: *const u8,
) -> NcclResult {
    if decode(i64::from(version_code())) < (2, 14, 0) {
        eprintln!("NCCL stand-in: ncclCommInitRankConfig called, but this library says it is older than 2.14");
        return INVALID_USAGE;
    }
    // SAFETY: the caller's config.
    let nonblocking = match unsafe { parse_config(config) } {
        Ok(nb) => nb,
        Err(e) => return e,
    };
    if !nonblocking {
        // SAFETY: the caller's out-pointer.
        return unsafe { ncclCommInitRank(out, n, id, rank) };
    }
    let c = match attach(n, id, rank, true) {
        Ok(c) => c,
        Err(e) => return e,
    };
    // SAFETY: the caller's out-pointer: NCCL hands the communicator out at
    // once, its init going on behind it.
    unsafe { *out = Box::into_raw(c).cast() };
    IN_PROGRESS
}

/// Frees a communicator whose work has run, or leaks it (saying so) when
/// some never does: a stream thread would touch it.
fn free(c: *mut c_void) -> NcclResult {
    if c.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: a communicator this library made, freed once (the caller's
    // contract).
    let c = unsafe { Box::from_raw(c as *mut Comm) };
    if !c.drain(Duration::from_secs(2)) {
        eprintln!(
            "NCCL stand-in: rank {}: {} of its operations never ran (a stream blocked on other work): the \
             communicator is leaked",
            c.rank,
            c.issued.load(Ordering::SeqCst) - c.finished.load(Ordering::SeqCst)
        );
        std::mem::forget(c);
        return SUCCESS;
    }
    // SAFETY: the communicator's mapping, undone once; nothing queued
    // touches it any more.
    unsafe { libc::munmap(c.shared.cast(), std::mem::size_of::<Shared>()) };
    SUCCESS
}

/// `ncclCommDestroy`: waits for the communicator's work, as NCCL does
/// (NCCL forever; here a minute, then the process aborts, saying so).
#[no_mangle]
pub extern "C" fn ncclCommDestroy(c: *mut c_void) -> NcclResult {
    let Some(cm) = comm(c) else { return INVALID_ARGUMENT };
    if !cm.drain(JOIN) {
        eprintln!(
            "NCCL stand-in: rank {}: ncclCommDestroy waited {JOIN:?} for {} unfinished operations (a peer that \
             died?): a real NCCL waits here forever",
            cm.rank,
            cm.issued.load(Ordering::SeqCst) - cm.finished.load(Ordering::SeqCst)
        );
        std::process::abort();
    }
    free(c)
}

/// `ncclCommAbort`: ends the communicator at once, in progress or not:
/// this rank's signal waits are released (NCCL's abort flag makes its
/// device work exit), then it is freed.
#[no_mangle]
pub extern "C" fn ncclCommAbort(c: *mut c_void) -> NcclResult {
    let Some(cm) = comm(c) else { return INVALID_ARGUMENT };
    if *cm.state.lock().unwrap() == State::Joining && cm.rank == 0 {
        // Nobody else unlinks it; a rank joining later makes a new one
        // (and waits for ranks that are gone, until its own deadline).
        cm.joined();
    }
    for src in 0..cm.n {
        cm.shared().signals[src * MAX_RANKS + cm.rank].store(u64::MAX, Ordering::SeqCst);
    }
    free(c)
}

/// `ncclCommFinalize` (2.14+): a non-blocking communicator is
/// `ncclInProgress` until its work has run; a blocking one waits for it
/// here (at most a minute).
#[no_mangle]
pub extern "C" fn ncclCommFinalize(c: *mut c_void) -> NcclResult {
    let Some(cm) = comm(c) else { return INVALID_ARGUMENT };
    if decode(i64::from(version_code())) < (2, 14, 0) {
        eprintln!("NCCL stand-in: ncclCommFinalize called, but this library says it is older than 2.14");
        return INVALID_USAGE;
    }
    let mut st = cm.state.lock().unwrap();
    if *st != State::Ready || cm.settling.load(Ordering::SeqCst) {
        // NCCL: the communicator must be ready, and finalized once.
        return INVALID_USAGE;
    }
    if cm.nonblocking {
        *st = State::Finalizing;
        return IN_PROGRESS;
    }
    drop(st);
    if cm.drain(JOIN) {
        SUCCESS
    } else {
        SYSTEM_ERROR
    }
}

/// `RMACOMM_STANDIN_NCCL_FINALIZE_HANGS=1`: a non-blocking communicator's
/// finalize never completes (as with a peer that died mid-collective):
/// only the caller's deadline, then `ncclCommAbort`, ends it.
fn finalize_hangs() -> bool {
    std::env::var("RMACOMM_STANDIN_NCCL_FINALIZE_HANGS").is_ok_and(|v| v == "1")
}

/// `ncclCommGetAsyncError`: where the communicator stands.
///
/// # Safety
/// `st` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(c: *mut c_void, st: *mut NcclResult) -> NcclResult {
    let Some(cm) = comm(c) else { return INVALID_ARGUMENT };
    let mut state = cm.state.lock().unwrap();
    if *state == State::Joining && all_joined(cm) {
        cm.joined();
        let fails = env_rank("RMACOMM_STANDIN_NCCL_FAIL_INIT") == Some(cm.rank);
        if fails {
            eprintln!("NCCL stand-in: rank {}: init fails (RMACOMM_STANDIN_NCCL_FAIL_INIT)", cm.rank);
        }
        *state = if fails { State::Failing } else { State::Ready };
    }
    let now = match *state {
        State::Joining => IN_PROGRESS,
        State::Failing => SYSTEM_ERROR,
        State::Finalizing if cm.drained() && !finalize_hangs() => SUCCESS,
        State::Finalizing => IN_PROGRESS,
        State::Ready if cm.settling.swap(false, Ordering::SeqCst) => IN_PROGRESS,
        State::Ready => SUCCESS,
    };
    // SAFETY: the caller's out-pointer.
    unsafe { *st = now };
    SUCCESS
}

/// `ncclGroupStart`.
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    SUCCESS
}

/// `ncclGroupEnd`.
#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    SUCCESS
}

macro_rules! refused {
    ($($name:ident),*) => {$(
        /// Refused: the stand-in has no collectives or point-to-point calls.
        #[no_mangle]
        pub extern "C" fn $name() -> NcclResult {
            INVALID_USAGE
        }
    )*};
}
refused!(ncclAllReduce, ncclReduceScatter, ncclBroadcast, ncclReduce, ncclAllGather, ncclSend, ncclRecv);

/// Maps `pieces` (from another rank's blob) contiguously; returns the
/// buffer's start and the mappings to undo.
fn map_pieces(pieces: &[(String, u64, usize)], len: usize) -> Option<(u64, Vec<(u64, usize)>)> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let first = pieces.first()?;
    let delta = first.1 % page;
    let total = (delta as usize + len.max(1)).next_multiple_of(page as usize);
    // SAFETY: a fresh reservation the pieces are mapped over.
    let base = unsafe {
        libc::mmap(std::ptr::null_mut(), total, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let base = base as u64;
    let mut at = base;
    for (i, (path, off, n)) in pieces.iter().enumerate() {
        let aligned = off - off % page;
        let span = ((off - aligned) as usize + n).next_multiple_of(page as usize);
        let Ok(cpath) = CString::new(path.as_str()) else { return None };
        // SAFETY: a NUL-terminated path; the fd is closed at once; the
        // mapping lands inside the reservation (sizes add up to `total`).
        let ok = unsafe {
            let fd = libc::open(cpath.as_ptr(), libc::O_RDWR);
            if fd < 0 {
                false
            } else {
                let m = libc::mmap(
                    at as *mut c_void,
                    span,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd,
                    aligned as libc::off_t,
                );
                libc::close(fd);
                m != libc::MAP_FAILED
            }
        };
        if !ok || (i > 0 && off % page != 0) {
            // SAFETY: our reservation.
            unsafe { libc::munmap(base as *mut c_void, total) };
            return None;
        }
        at += span as u64;
    }
    Some((base + delta, vec![(base, total)]))
}

/// A buffer's pieces: (file, offset in it, bytes).
type Pieces = Vec<(String, u64, usize)>;

fn parse_blob(blob: &[u8]) -> Option<(usize, Pieces)> {
    let text = std::str::from_utf8(blob.split(|&b| b == 0).next()?).ok()?;
    let mut lines = text.lines();
    let len = lines.next()?.parse().ok()?;
    let mut pieces = Vec::new();
    for l in lines {
        let mut f = l.split(' ');
        pieces.push((f.next()?.to_string(), f.next()?.parse().ok()?, f.next()?.parse().ok()?));
    }
    Some((len, pieces))
}

/// `ncclCommWindowRegister` (collective): publishes where this rank's
/// buffer lives, waits for every rank's, maps them.
///
/// # Safety
/// `win` is a valid out-pointer; `buff` device memory of this process.
#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    c: *mut c_void,
    buff: *mut c_void,
    size: usize,
    win: *mut *mut c_void,
    _flags: c_int,
) -> NcclResult {
    let Some(cm) = comm(c) else { return INVALID_ARGUMENT };
    if std::env::var("NCCL_WIN_ENABLE").is_ok_and(|v| v.trim() == "0") {
        // No symmetric support: success, and no window.
        // SAFETY: the caller's out-pointer.
        unsafe { *win = std::ptr::null_mut() };
        return cm.done();
    }
    // Taken before any check, so every rank's n-th registration is the
    // n-th window whatever failed locally.
    let idx = cm.windows.fetch_add(1, Ordering::AcqRel);
    if idx >= MAX_WINDOWS {
        return INTERNAL_ERROR;
    }
    let Some(pieces) = backing(buff as u64, size) else {
        eprintln!("NCCL stand-in: window register: {buff:?} (+{size}) is not device memory of this process");
        return INVALID_ARGUMENT;
    };
    if !pieces.iter().all(|p| p.0.starts_with("/proc/")) || !(buff as u64).is_multiple_of(4096) {
        eprintln!("NCCL stand-in: window register: {buff:?} is not 4096-byte aligned cuMem/VMM memory");
        return INVALID_ARGUMENT;
    }
    let mut text = format!("{size}\n");
    for (path, off, n) in &pieces {
        text.push_str(&format!("{path} {off} {n}\n"));
    }
    if text.len() >= BLOB {
        return INTERNAL_ERROR;
    }
    let me = &cm.shared().wins[idx * MAX_RANKS + cm.rank];
    // SAFETY: this rank's entry, written only here, before `ready`.
    unsafe {
        let blob = me.blob.as_ptr() as *mut u8;
        std::ptr::write_bytes(blob, 0, BLOB);
        std::ptr::copy_nonoverlapping(text.as_ptr(), blob, text.len());
    }
    me.ready.store(1, Ordering::Release);
    let mut peers = Vec::with_capacity(cm.n);
    let mut maps = Vec::new();
    let undo = |maps: &[(u64, usize)]| {
        for (a, l) in maps {
            // SAFETY: mappings made here, undone once.
            unsafe { libc::munmap(*a as *mut c_void, *l) };
        }
    };
    let start = Instant::now();
    let mut result = SUCCESS;
    for r in 0..cm.n {
        let e = &cm.shared().wins[idx * MAX_RANKS + r];
        while e.ready.load(Ordering::Acquire) == 0 {
            if start.elapsed() > JOIN {
                eprintln!("NCCL stand-in: window register: rank {r} did not register within {JOIN:?}");
                undo(&maps);
                return SYSTEM_ERROR;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let Some((len, pieces)) = parse_blob(&e.blob) else {
            undo(&maps);
            return INTERNAL_ERROR;
        };
        if len != size {
            // Every rank sees it: all fail (after the handshake below).
            eprintln!("NCCL stand-in: window register: rank {r}'s buffer is {len} bytes, this rank's {size}");
            result = INVALID_ARGUMENT;
        }
        let Some((at, m)) = map_pieces(&pieces, len) else {
            eprintln!("NCCL stand-in: window register: cannot map rank {r}'s buffer ({pieces:?})");
            undo(&maps);
            return SYSTEM_ERROR;
        };
        peers.push((at, len));
        maps.extend(m);
    }
    // Every rank has mapped every buffer before any returns (NCCL's
    // registration is collective too): a rank that deregistered and freed
    // its buffer at once would leave nothing to map.
    me.ready.store(2, Ordering::Release);
    for r in 0..cm.n {
        let e = &cm.shared().wins[idx * MAX_RANKS + r];
        while e.ready.load(Ordering::Acquire) < 2 {
            if start.elapsed() > JOIN {
                eprintln!("NCCL stand-in: window register: rank {r} did not map the buffers within {JOIN:?}");
                undo(&maps);
                return SYSTEM_ERROR;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    if result != SUCCESS {
        undo(&maps);
        return result;
    }
    cm.local.lock().unwrap().push((buff as u64, size));
    let w = Box::new(Win { comm: cm, base: buff as u64, len: size, peers, maps });
    // SAFETY: the caller's out-pointer.
    unsafe { *win = Box::into_raw(w).cast() };
    cm.done()
}

/// `ncclCommWindowDeregister`.
#[no_mangle]
pub extern "C" fn ncclCommWindowDeregister(c: *mut c_void, win: *mut c_void) -> NcclResult {
    let Some(cm) = comm(c) else { return INVALID_ARGUMENT };
    if win.is_null() {
        // NCCL's answer to the window it never gave.
        return SUCCESS;
    }
    // SAFETY: a window this library made (the caller's contract).
    if !std::ptr::eq(unsafe { &*(win as *const Win) }.comm, cm) {
        return INVALID_ARGUMENT;
    }
    // SAFETY: a window this library made, freed once (the caller's
    // contract), and its mappings.
    unsafe {
        let w = Box::from_raw(win as *mut Win);
        let mut local = cm.local.lock().unwrap();
        if let Some(i) = local.iter().position(|&(b, l)| (b, l) == (w.base, w.len)) {
            local.remove(i);
        }
        drop(local);
        for (a, l) in &w.maps {
            libc::munmap(*a as *mut c_void, *l);
        }
    }
    cm.done()
}

fn dtype_size(dt: c_int) -> Option<usize> {
    Some(match dt {
        0 | 1 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        4 | 5 | 8 => 8,
        _ => return None,
    })
}

/// Checks common to the one-sided calls.
fn one_sided(c: *mut c_void, peer: c_int, sig: c_int, ctx: c_int, flags: c_uint) -> Result<&'static Comm, NcclResult> {
    let cm = comm(c).ok_or(INVALID_ARGUMENT)?;
    if sig != 0 || ctx != 0 || flags != 0 {
        return Err(INVALID_ARGUMENT);
    }
    usize::try_from(peer).ok().filter(|&p| p < cm.n).ok_or(INVALID_ARGUMENT)?;
    Ok(cm)
}

/// `ncclPutSignal`.
///
/// # Safety
/// As NCCL's: `localbuff` device memory live until the stream runs the put.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ncclPutSignal(
    localbuff: *const c_void,
    count: usize,
    dt: c_int,
    peer: c_int,
    win: *mut c_void,
    offset: usize,
    sig: c_int,
    ctx: c_int,
    flags: c_uint,
    c: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let cm = match one_sided(c, peer, sig, ctx, flags) {
        Ok(cm) => cm,
        Err(e) => return e,
    };
    if std::env::var("RMACOMM_STANDIN_NCCL_FAIL_PUT").is_ok_and(|v| v == "1") {
        return INTERNAL_ERROR;
    }
    if win.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: a window this library made (the caller's contract).
    let w = unsafe { &*(win as *const Win) };
    if !std::ptr::eq(w.comm, cm) {
        return INVALID_ARGUMENT;
    }
    let Some(bytes) = dtype_size(dt).and_then(|s| s.checked_mul(count)) else { return INVALID_ARGUMENT };
    let peer = peer as usize;
    let (dst, dlen) = w.peers[peer];
    if offset.checked_add(bytes).is_none_or(|e| e > dlen) {
        eprintln!("NCCL stand-in: put of {bytes} bytes at {offset} past rank {peer}'s {dlen}-byte window");
        return INVALID_ARGUMENT;
    }
    let src = localbuff as u64;
    let Some(end) = src.checked_add(bytes as u64) else { return INVALID_ARGUMENT };
    let in_window = cm.local.lock().unwrap().iter().any(|&(b, l)| src >= b && end <= b + l as u64);
    if !in_window {
        eprintln!("NCCL stand-in: put source {src:#x} (+{bytes}) is in no window this rank registered");
        return INVALID_ARGUMENT;
    }
    let signal = Op::Write { addr: cm.counter(cm.rank, peer), value: cm.next_seq(peer) };
    cm.queue(stream, [Op::Copy { dst: dst + offset as u64, src, len: bytes }, signal]);
    cm.done()
}

/// `ncclSignal`.
#[no_mangle]
pub extern "C" fn ncclSignal(
    peer: c_int,
    sig: c_int,
    ctx: c_int,
    flags: c_uint,
    c: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let cm = match one_sided(c, peer, sig, ctx, flags) {
        Ok(cm) => cm,
        Err(e) => return e,
    };
    cm.queue(stream, [Op::Write { addr: cm.counter(cm.rank, peer as usize), value: cm.next_seq(peer as usize) }]);
    cm.done()
}

/// `ncclWaitSignalDesc_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct WaitDesc {
    op_cnt: c_int,
    peer: c_int,
    sig_idx: c_int,
    ctx: c_int,
}

/// `ncclWaitSignal`.
///
/// # Safety
/// `descs` points to `n` descriptors.
#[no_mangle]
pub unsafe extern "C" fn ncclWaitSignal(
    n: c_int,
    descs: *const WaitDesc,
    c: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let Ok(n) = usize::try_from(n) else { return INVALID_ARGUMENT };
    if descs.is_null() && n > 0 {
        return INVALID_ARGUMENT;
    }
    let mut waits = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: the caller's descriptors, read once each.
        let d = unsafe { descs.add(i).read() };
        let cm = match one_sided(c, d.peer, d.sig_idx, d.ctx, 0) {
            Ok(cm) => cm,
            Err(e) => return e,
        };
        let Ok(k) = u64::try_from(d.op_cnt) else { return INVALID_ARGUMENT };
        waits.push((cm, d.peer as usize, k));
    }
    let Some(cm) = comm(c) else { return INVALID_ARGUMENT };
    for (cm, peer, k) in waits {
        let target = {
            let mut e = cm.expected.lock().unwrap();
            e[peer] += k;
            e[peer]
        };
        cm.queue(stream, [Op::WaitGeq { addr: cm.counter(peer, cm.rank), value: target }]);
    }
    cm.done()
}
