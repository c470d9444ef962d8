//! A stand-in for `libcuda.so.1` on machines without a GPU, loaded through
//! `RMACOMM_CUDA_LIB` by tests only. It implements the driver calls
//! rmacomm's device-memory windows make, on the host:
//!
//! - device memory is POSIX shared memory (`/dev/shm/rmacomm-standin-*`);
//!   its "device address" is a range reserved with no access at all (a
//!   host load or store there faults, as it would on a GPU's address), and
//!   the stand-in's copies, value writes, waits and kernels translate it to
//!   the segment's host mapping; an IPC handle names the segment, and
//!   another process maps it (and reserves its own device range);
//! - a stream is a thread running its queue in order (copies, 64-bit value
//!   writes, waits that poll until the value is reached); the legacy default
//!   stream (0) runs work in the caller; capture records a stream's work
//!   into a graph that launches replay;
//! - VMM memory (`cuMemCreate`, `cuMemMap`, ...) is a memfd per
//!   allocation, mapped into a host range that shadows the reserved device
//!   range (so contiguous mappings are contiguous on the host); exporting
//!   hands out a duplicate of the memfd (the POSIX descriptor handle type);
//!   a host access to a mapping whose access was never set aborts;
//! - host registration maps host memory at its own address;
//! - devices: `RMACOMM_STANDIN_DEVICES` of them (default 1), renumbered
//!   per process by `CUDA_VISIBLE_DEVICES` as the driver does (physical
//!   indices or the devices' UUIDs, `GPU-...`); each has a primary context,
//!   current per thread (`cuCtxSetCurrent` / `cuCtxGetCurrent`), and memory
//!   of its own. A kernel or stream memory operation that touches another
//!   device's memory without peer access (`cuCtxEnablePeerAccess`, an IPC
//!   mapping opened in the kernel's context, VMM access set for its device)
//!   aborts the process, naming it, as a GPU would fault; calls that need a
//!   current context fail without one; a kernel launched on a stream of
//!   another context than the current one, or from a module of another, is
//!   refused. `RMACOMM_STANDIN_P2P=0`: no peer access between devices (IPC
//!   opens of another device's memory fail). `RMACOMM_STANDIN_ALLOWED_DEVICES`
//!   (ordinals): a process that retains another device's context aborts
//!   (a process that should never touch another GPU);
//! - under `RMACOMM_STANDIN_STRICT=1` (or 2), a call that takes a real driver's
//!   lock (host registration, IPC open and close, freeing memory) made by
//!   a thread that stream operations depend on (a soft provider engine, a
//!   window's runtime, the CUDA reaper) while a stream waits on registered
//!   host memory aborts the process, naming it: on an H200 each such call
//!   hung (docs/gpu.md); under `RMACOMM_STANDIN_STRICT=2`, any driver call
//!   such a thread makes then does (a path held to making none at all:
//!   GpuComm's transport mode on host slots).
//!
//! So rmacomm's logic around the driver — handle exchange, offsets, bounds,
//! signal counts, stream order — runs in CI on every commit. CUDA itself
//! (the copy engine, PCIe visibility of value writes, real IPC) is not
//! exercised: the GPU suite (`scripts/gpu_suite.sh`) does that. Kernels
//! are emulated on the host by name (rmacomm's reductions and signal
//! kernels, `cuLaunchKernel`); any other is `CUDA_ERROR_NOT_SUPPORTED`.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub mod nccl;

type CuResult = c_int;
const OK: CuResult = 0;
const INVALID_VALUE: CuResult = 1;
const OUT_OF_MEMORY: CuResult = 2;
const ALREADY_MAPPED: CuResult = 208;
const INVALID_HANDLE: CuResult = 400;
const ALREADY_REGISTERED: CuResult = 712;
const NOT_SUPPORTED: CuResult = 801;
const INVALID_DEVICE: CuResult = 101;
const INVALID_CONTEXT: CuResult = 201;
const PEER_ACCESS_UNSUPPORTED: CuResult = 217;
const PEER_ACCESS_ALREADY_ENABLED: CuResult = 704;
const STREAM_CAPTURE_UNSUPPORTED: CuResult = 900;

/// A `CUipcMemHandle`: the segment's name, NUL-padded.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct IpcHandle([u8; 64]);

/// One unit of stream work.
#[derive(Clone, Debug)]
enum Op {
    Copy { dst: u64, src: u64, len: usize },
    Set { dst: u64, value: u8, len: usize },
    Write { addr: u64, value: u64 },
    Add { addr: u64, delta: u64 },
    WaitGeq { addr: u64, value: u64 },
    Kernel(Box<Kernel>),
    Upload { dst: u64, bytes: Vec<u8> },
}

impl Op {
    /// Runs the work as device `dev` (physical index) would.
    fn run(self, dev: usize) {
        match self {
            Op::Kernel(k) => k.run(dev),
            // SAFETY: `dst` holds the bytes (the driver contract).
            Op::Upload { dst, bytes } => unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), host(dst) as *mut u8, bytes.len())
            },
            // SAFETY: the caller of the enqueuing function promised both
            // ranges are live device (or host) memory; memmove semantics.
            Op::Copy { dst, src, len } => {
                copy_delay();
                // SAFETY: as above.
                unsafe { std::ptr::copy(host(src) as *const u8, host(dst) as *mut u8, len) }
            }
            // SAFETY: as for copies.
            Op::Set { dst, value, len } => unsafe { std::ptr::write_bytes(host(dst) as *mut u8, value, len) },
            Op::Write { addr, value } => {
                reach(addr, dev, "cuStreamWriteValue64");
                word(addr).store(value, Ordering::SeqCst)
            }
            // A host word only: the NCCL stand-in counts a communicator's
            // finished work so.
            Op::Add { addr, delta } => {
                word(addr).fetch_add(delta, Ordering::SeqCst);
            }
            Op::WaitGeq { addr, value } => {
                reach(addr, dev, "cuStreamWaitValue64");
                let w = word(addr);
                if w.load(Ordering::SeqCst) >= value {
                    return;
                }
                // A wait on registered host memory: a host thread (a
                // window's stream proxy) or another stream releases it.
                let host_word =
                    with(|st| st.registered.range(..=addr).next_back().is_some_and(|(b, l)| addr < b + *l as u64));
                if host_word {
                    HOST_WAITS.fetch_add(1, Ordering::SeqCst);
                }
                while w.load(Ordering::SeqCst) < value {
                    std::thread::sleep(Duration::from_micros(20));
                }
                if host_word {
                    HOST_WAITS.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }
}

/// `RMACOMM_STANDIN_COPY_DELAY=<ms>[@<rank>]`: every copy (in a process
/// whose `RANK` is `<rank>`, if given) first sleeps that long — a slow
/// device, for tests of what a faster peer must not do meanwhile.
fn copy_delay() {
    static DELAY: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    let delay = DELAY.get_or_init(|| {
        let v = std::env::var("RMACOMM_STANDIN_COPY_DELAY").ok()?;
        let (ms, rank) = v.split_once('@').map_or((v.as_str(), None), |(m, r)| (m, Some(r)));
        if rank.is_some_and(|r| std::env::var("RANK").ok().as_deref() != Some(r.trim())) {
            return None;
        }
        ms.trim().parse().ok().map(Duration::from_millis)
    });
    if let Some(d) = delay {
        std::thread::sleep(*d);
    }
}

/// Streams of this process waiting now on a word of registered host
/// memory.
static HOST_WAITS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The strict level (`RMACOMM_STANDIN_STRICT`): 0 off; 1 the calls that
/// take a real driver's locks (host registration, IPC open and close,
/// freeing memory); 2 every driver call.
fn strict_level() -> u8 {
    static LEVEL: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| match std::env::var("RMACOMM_STANDIN_STRICT").as_deref() {
        Ok("1") => 1,
        Ok("2") => 2,
        _ => 0,
    })
}

/// Under `RMACOMM_STANDIN_STRICT=1` (or 2): aborts the process, naming
/// `call`, when a thread that stream operations depend on (a soft provider
/// engine, a window's runtime or stream proxy, the CUDA reaper) makes a
/// call that takes a lock of a real driver's (registering host memory,
/// opening or closing IPC mappings, freeing memory) while a stream waits on
/// registered host memory. On an H200 each such call hung the process
/// (docs/gpu.md, "Nothing a stream waits for may take a driver lock"): a
/// thread waiting for the device held that lock, and the device waited for
/// the stream.
fn strict(call: &str) {
    strict_at(1, call);
}

/// Under `RMACOMM_STANDIN_STRICT=2`: as [`strict`], for any other driver
/// call (copies, synchronizations, launches, queries): what a path that
/// makes no CUDA call at all while a stream waits for it (GpuComm's
/// transport mode on host slots) is held to. A kernel launch may load its
/// module lazily, which waits for the device, holding locks every other
/// call may need.
fn strict_any(call: &str) {
    strict_at(2, call);
}

fn strict_at(level: u8, call: &str) {
    if strict_level() < level || HOST_WAITS.load(Ordering::SeqCst) == 0 {
        return;
    }
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes (NUL included).
    unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    let name = CStr::from_bytes_until_nul(&name).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    if ["rmacomm-soft", "rmacomm-window", "rmacomm-stream", "rmacomm-cuda-re"].iter().any(|p| name.starts_with(p)) {
        eprintln!(
            "CUDA stand-in (RMACOMM_STANDIN_STRICT={}): {call} on thread {name:?} while a stream waits on host \
             memory that such a thread releases: on a real driver this may hang (docs/gpu.md)",
            strict_level()
        );
        std::process::abort();
    }
}

/// The most devices the stand-in emulates.
const MAX_DEVICES: usize = 8;

/// The emulated devices: how many there are, which this process sees
/// (ordinal → physical index), whether distinct devices reach each other
/// (peer access), and which ordinals this process may retain.
#[derive(Debug)]
struct Devices {
    count: usize,
    visible: Vec<usize>,
    p2p: bool,
    allowed: Option<Vec<usize>>,
}

fn devices() -> &'static Devices {
    static D: std::sync::OnceLock<Devices> = std::sync::OnceLock::new();
    D.get_or_init(|| {
        let count = std::env::var("RMACOMM_STANDIN_DEVICES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1)
            .clamp(1, MAX_DEVICES);
        // As the driver reads CUDA_VISIBLE_DEVICES: indices or UUIDs, the
        // list ending at the first entry that names no device (or repeats
        // one). Only where the device count is set too: a machine's own
        // CUDA_VISIBLE_DEVICES (naming its real GPUs) must not empty the
        // stand-in under the tests.
        let named = std::env::var_os("RMACOMM_STANDIN_DEVICES").is_some();
        let visible = match std::env::var("CUDA_VISIBLE_DEVICES").ok().filter(|_| named).ok_or(()) {
            Err(()) => (0..count).collect(),
            Ok(v) => {
                let mut out: Vec<usize> = Vec::new();
                for e in v.split(',').map(str::trim) {
                    let k =
                        e.parse::<usize>().ok().or_else(|| (0..count).find(|k| e.eq_ignore_ascii_case(&uuid_text(*k))));
                    match k {
                        Some(k) if k < count && !out.contains(&k) => out.push(k),
                        _ => break,
                    }
                }
                out
            }
        };
        let p2p = std::env::var("RMACOMM_STANDIN_P2P").map_or(true, |v| v != "0");
        let allowed = std::env::var("RMACOMM_STANDIN_ALLOWED_DEVICES")
            .ok()
            .map(|v| v.split(',').filter_map(|e| e.trim().parse::<usize>().ok()).collect());
        Devices { count, visible, p2p, allowed }
    })
}

/// Device `k`'s UUID: "rmacomm-standin" and the index.
fn uuid(k: usize) -> [u8; 16] {
    let mut u = [0u8; 16];
    u[..15].copy_from_slice(b"rmacomm-standin");
    u[15] = k as u8;
    u
}

/// A UUID as `nvidia-smi -L` and `CUDA_VISIBLE_DEVICES` write them.
fn uuid_text(k: usize) -> String {
    let u = uuid(k);
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// The physical device of `ordinal` in this process.
fn physical(ordinal: c_int) -> Option<usize> {
    usize::try_from(ordinal).ok().and_then(|o| devices().visible.get(o).copied())
}

/// The ordinal of physical device `k` here, if it is visible.
fn ordinal_of(k: usize) -> Option<c_int> {
    devices().visible.iter().position(|v| *v == k).map(|o| o as c_int)
}

/// Primary context handles: an address per device (never dereferenced).
static CONTEXTS: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

fn context_handle(k: usize) -> *mut c_void {
    std::ptr::from_ref(&CONTEXTS[k]).cast_mut().cast()
}

fn context_device(ctx: *mut c_void) -> Option<usize> {
    let base = CONTEXTS.as_ptr() as usize;
    let at = (ctx as usize).checked_sub(base)?;
    (at < devices().count).then_some(at)
}

thread_local! {
    /// The physical device whose context is current on this thread.
    static CURRENT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

fn current() -> Option<usize> {
    CURRENT.with(std::cell::Cell::get)
}

/// Peer access enabled: (from, to) physical devices.
static PEERS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Aborts, naming `what`, when device `dev` may not touch `addr` (device
/// memory of another device, without peer access): a GPU faults there.
fn reach(addr: u64, dev: usize, what: &str) {
    let found = with(|st| {
        let (_, r) =
            st.device_ranges.range(..=addr).next_back().filter(|(base, r)| addr < *base + r.len.max(1) as u64)?;
        Some((r.dev, r.reach.clone(), r.peerable))
    });
    let Some((owner, reach, peerable)) = found else { return };
    let peered = peerable && PEERS.lock().unwrap_or_else(|e| e.into_inner()).contains(&(dev, owner));
    if !(reach.contains(&dev) || peered) {
        eprintln!(
            "CUDA stand-in: {what} on device {dev} touched {addr:#x}, memory of device {owner}, without peer access \
             (cuCtxEnablePeerAccess, an IPC mapping opened in this device's context, or VMM access for it): a GPU \
             faults here"
        );
        std::process::abort();
    }
}

fn word(addr: u64) -> &'static AtomicU64 {
    // SAFETY: an 8-byte-aligned word of live memory (the driver contract of
    // the value write and wait calls), at its host address; AtomicU64 has
    // u64's layout.
    unsafe { AtomicU64::from_ptr(host(addr) as *mut u64) }
}

/// The host address of `addr`: inside a device range of this process (an
/// allocation or an opened IPC mapping) its segment's mapping, else
/// `addr` itself (host memory, registered or not).
fn host(addr: u64) -> u64 {
    let (h, unset) = with(|st| {
        let found = st.device_ranges.range(..=addr).next_back().filter(|(base, r)| addr < *base + r.len.max(1) as u64);
        match found {
            Some((base, r)) => (r.host + (addr - base), r.reach.is_empty()),
            None => (addr, false),
        }
    });
    if unset {
        eprintln!("CUDA stand-in: {addr:#x} is VMM memory mapped without cuMemSetAccess: a GPU faults here");
        std::process::abort();
    }
    h
}

/// Reserves `len` bytes of address space with no access: a device range.
fn reserve(len: usize) -> Option<u64> {
    // SAFETY: a fresh anonymous mapping that nothing may touch.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as u64)
}

enum Msg {
    Op(Op),
    Fence(Sender<()>),
}

/// A stream: its thread's queue, and the graph being captured.
#[derive(Debug)]
struct Stream {
    tx: Mutex<Sender<Msg>>,
    capture: Mutex<Option<Vec<Op>>>,
    /// The physical device of the context it was made in.
    dev: usize,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Op(o) => write!(f, "{o:?}"),
            Msg::Fence(_) => write!(f, "Fence"),
        }
    }
}

impl Stream {
    fn new(dev: usize) -> Stream {
        let (tx, rx) = channel::<Msg>();
        std::thread::spawn(move || {
            for m in rx {
                match m {
                    Msg::Op(op) => op.run(dev),
                    Msg::Fence(done) => {
                        let _ = done.send(());
                    }
                }
            }
        });
        Stream { tx: Mutex::new(tx), capture: Mutex::new(None), dev }
    }

    fn push(&self, op: Op) {
        if let Some(g) = self.capture.lock().unwrap().as_mut() {
            g.push(op);
            return;
        }
        let _ = self.tx.lock().unwrap().send(Msg::Op(op));
    }

    fn sync(&self) {
        let (tx, rx) = channel();
        if self.tx.lock().unwrap().send(Msg::Fence(tx)).is_ok() {
            let _ = rx.recv();
        }
    }
}

#[derive(Debug)]
struct Alloc {
    len: usize,
    name: CString,
    /// The segment's host mapping.
    host: u64,
    /// An IPC handle was taken: other processes may map it.
    exported: bool,
}

/// A device range of this process: where its bytes are on the host, which
/// device's memory it is, the devices that reach it directly (its own; an
/// IPC mapping's opener; VMM access as set: none, and a host access aborts
/// too), and whether peer access between contexts reaches it (allocations).
#[derive(Debug, Clone)]
struct DevRange {
    host: u64,
    len: usize,
    dev: usize,
    reach: Vec<usize>,
    peerable: bool,
}

#[derive(Debug, Default)]
struct State {
    /// Allocations of this process by base address.
    allocs: BTreeMap<u64, Alloc>,
    /// Device ranges (allocations, opened IPC mappings, VMM mappings) by
    /// device base.
    device_ranges: BTreeMap<u64, DevRange>,
    /// Opened IPC mappings: base → length, base → (opening device,
    /// segment), and those pairs (one open per device context).
    opened: BTreeMap<u64, usize>,
    opened_by_base: BTreeMap<u64, (usize, CString)>,
    opened_names: std::collections::BTreeSet<(usize, CString)>,
    /// Registered host ranges: base → length.
    registered: BTreeMap<u64, usize>,
    /// VMM (cuMemCreate) allocations by handle, mappings of them by device
    /// address (→ handle, length), and reserved address ranges (→ length,
    /// the host range that shadows it). A mapping whose access was never
    /// set has an empty `reach` (a host access there aborts: a GPU faults).
    vmm: BTreeMap<u64, Vmm>,
    vmm_maps: BTreeMap<u64, (u64, usize)>,
    reserved: BTreeMap<u64, (usize, u64)>,
    streams: Vec<Arc<Stream>>,
    next: u64,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut State) -> T) -> T {
    let mut g = STATE.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(State::default))
}

/// Resolves a `CUstream`: `None` for the legacy default stream (0).
fn stream(s: *mut c_void) -> Option<Arc<Stream>> {
    if s.is_null() {
        return None;
    }
    with(|st| st.streams.iter().find(|x| Arc::as_ptr(x) as *mut c_void == s).cloned())
}

/// A handle that is neither a special stream (0, `CU_STREAM_LEGACY`,
/// `CU_STREAM_PER_THREAD`) nor a live stream of the stand-in's: a destroyed
/// or foreign one, which the driver refuses (`CUDA_ERROR_INVALID_HANDLE`).
/// It was taken for the default stream, running stream-ordered work at once
/// on the caller's thread: use-after-destroy passed unseen.
fn unknown(s: *mut c_void) -> bool {
    (s as usize) > 2 && stream(s).is_none()
}

fn enqueue(s: *mut c_void, op: Op) -> CuResult {
    if unknown(s) {
        return INVALID_HANDLE;
    }
    match stream(s) {
        Some(st) => st.push(op),
        // The legacy default stream: the current context's.
        None => match current() {
            Some(dev) => op.run(dev),
            None => return INVALID_CONTEXT,
        },
    }
    OK
}

fn map_segment(name: &CStr, len: usize, create: bool) -> Option<u64> {
    let flags = if create { libc::O_RDWR | libc::O_CREAT | libc::O_EXCL } else { libc::O_RDWR };
    // SAFETY: a NUL-terminated name; the fd is closed below.
    let fd = unsafe { libc::shm_open(name.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return None;
    }
    let mut len = len;
    // SAFETY: a valid fd; stat is written by fstat.
    unsafe {
        if create {
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                libc::close(fd);
                return None;
            }
        } else {
            let mut stat: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut stat) != 0 {
                libc::close(fd);
                return None;
            }
            len = stat.st_size as usize;
        }
    }
    // SAFETY: a fresh shared mapping of the whole segment.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), len.max(1), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
    };
    // SAFETY: our fd, closed once (the mapping stays).
    unsafe { libc::close(fd) };
    (p != libc::MAP_FAILED).then_some(p as u64)
}

/// `cuInit`.
#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CuResult {
    strict_any("cuInit");
    OK
}

/// `cuDriverGetVersion`: 13.0.
///
/// # Safety
/// `v` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CuResult {
    strict_any("cuDriverGetVersion");
    // SAFETY: the caller's out-pointer.
    unsafe { *v = 13000 };
    OK
}

/// `cuDeviceGetCount`: the devices this process sees.
///
/// # Safety
/// `n` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CuResult {
    strict_any("cuDeviceGetCount");
    // SAFETY: the caller's out-pointer.
    unsafe { *n = devices().visible.len() as c_int };
    OK
}

/// `cuGetErrorName`.
///
/// # Safety
/// `p` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CuResult, p: *mut *const c_char) -> CuResult {
    strict_any("cuGetErrorName");
    let name: &'static CStr = match code {
        OK => c"CUDA_SUCCESS",
        INVALID_VALUE => c"CUDA_ERROR_INVALID_VALUE",
        INVALID_DEVICE => c"CUDA_ERROR_INVALID_DEVICE",
        INVALID_CONTEXT => c"CUDA_ERROR_INVALID_CONTEXT",
        PEER_ACCESS_UNSUPPORTED => c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        PEER_ACCESS_ALREADY_ENABLED => c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        OUT_OF_MEMORY => c"CUDA_ERROR_OUT_OF_MEMORY",
        ALREADY_MAPPED => c"CUDA_ERROR_ALREADY_MAPPED",
        INVALID_HANDLE => c"CUDA_ERROR_INVALID_HANDLE",
        ALREADY_REGISTERED => c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        NOT_SUPPORTED => c"CUDA_ERROR_NOT_SUPPORTED (rmacomm's CUDA stand-in runs no kernels)",
        STREAM_CAPTURE_UNSUPPORTED => c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        _ => return INVALID_VALUE,
    };
    // SAFETY: the caller's out-pointer; the string is static.
    unsafe { *p = name.as_ptr() };
    OK
}

/// `cuDeviceGet`.
///
/// # Safety
/// `d` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> CuResult {
    strict_any("cuDeviceGet");
    if physical(ordinal).is_none() {
        return INVALID_DEVICE;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *d = ordinal };
    OK
}

/// `cuDeviceGetUuid_v2`: the device's 16 bytes.
///
/// # Safety
/// `u` points to 16 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(u: *mut [u8; 16], dev: c_int) -> CuResult {
    strict_any("cuDeviceGetUuid");
    let Some(k) = physical(dev) else { return INVALID_DEVICE };
    // SAFETY: the caller's 16 bytes.
    unsafe { *u = uuid(k) };
    OK
}

/// `cuDeviceCanAccessPeer`: distinct devices reach each other unless
/// `RMACOMM_STANDIN_P2P=0`.
///
/// # Safety
/// `can` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: c_int, peer: c_int) -> CuResult {
    strict_any("cuDeviceCanAccessPeer");
    let (Some(a), Some(b)) = (physical(dev), physical(peer)) else { return INVALID_DEVICE };
    // SAFETY: the caller's out-pointer.
    unsafe { *can = c_int::from(a != b && devices().p2p) };
    OK
}

/// `cuDeviceGetAttribute`: compute capability 9.0, 64-bit stream memory
/// operations, nothing else.
///
/// # Safety
/// `v` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> CuResult {
    strict_any("cuDeviceGetAttribute");
    if physical(dev).is_none() {
        return INVALID_DEVICE;
    }
    // RMACOMM_STANDIN_NO_MEMOPS=1: a device without 64-bit stream memory
    // operations (attribute 122), for the kernel-signal fallback.
    let memops = std::env::var("RMACOMM_STANDIN_NO_MEMOPS").map_or(true, |v| v != "1");
    let value = match attr {
        75 => 9,
        122 => c_int::from(memops),
        _ => 0,
    };
    // SAFETY: the caller's out-pointer.
    unsafe { *v = value };
    OK
}

/// `cuDeviceGetName`.
///
/// # Safety
/// `buf` holds `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(buf: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    strict_any("cuDeviceGetName");
    let Some(k) = physical(dev) else { return INVALID_DEVICE };
    let name = CString::new(format!("rmacomm CUDA stand-in {k} (host memory, no GPU)")).expect("no NUL");
    let name = name.as_bytes_with_nul();
    let n = name.len().min(len.max(1) as usize);
    // SAFETY: `n` bytes fit the caller's buffer; the last is made NUL.
    unsafe {
        std::ptr::copy_nonoverlapping(name.as_ptr().cast(), buf, n);
        *buf.add(n - 1) = 0;
    }
    OK
}

/// `cuDevicePrimaryCtxRetain`: the device's context (aborting where
/// `RMACOMM_STANDIN_ALLOWED_DEVICES` leaves the device out).
///
/// # Safety
/// `ctx` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut *mut c_void, dev: c_int) -> CuResult {
    strict_any("cuDevicePrimaryCtxRetain");
    let Some(k) = physical(dev) else { return INVALID_DEVICE };
    if let Some(allowed) = &devices().allowed {
        if !allowed.contains(&(dev as usize)) {
            eprintln!(
                "CUDA stand-in: this process retained device {dev}'s context, but RMACOMM_STANDIN_ALLOWED_DEVICES \
                 allows only {allowed:?} (a context on another GPU costs that GPU memory)"
            );
            std::process::abort();
        }
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *ctx = context_handle(k) };
    OK
}

/// `cuDevicePrimaryCtxRelease_v2`.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CuResult {
    strict_any("cuDevicePrimaryCtxRelease");
    if physical(dev).is_none() {
        return INVALID_DEVICE;
    }
    OK
}

/// `cuCtxSetCurrent`: this thread's current context (null: none).
#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: *mut c_void) -> CuResult {
    strict_any("cuCtxSetCurrent");
    if ctx.is_null() {
        CURRENT.with(|c| c.set(None));
        return OK;
    }
    let Some(k) = context_device(ctx) else { return INVALID_CONTEXT };
    CURRENT.with(|c| c.set(Some(k)));
    OK
}

/// `cuCtxGetCurrent`.
///
/// # Safety
/// `ctx` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut *mut c_void) -> CuResult {
    strict_any("cuCtxGetCurrent");
    // SAFETY: the caller's out-pointer.
    unsafe { *ctx = current().map_or(std::ptr::null_mut(), context_handle) };
    OK
}

/// `cuCtxGetDevice`: the current context's device.
///
/// # Safety
/// `d` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(d: *mut c_int) -> CuResult {
    strict_any("cuCtxGetDevice");
    let Some(o) = current().and_then(ordinal_of) else { return INVALID_CONTEXT };
    // SAFETY: the caller's out-pointer.
    unsafe { *d = o };
    OK
}

/// `cuCtxEnablePeerAccess`: the current context's kernels may touch
/// `peer`'s device memory from now on.
#[no_mangle]
pub extern "C" fn cuCtxEnablePeerAccess(peer: *mut c_void, _flags: c_uint) -> CuResult {
    strict_any("cuCtxEnablePeerAccess");
    let Some(me) = current() else { return INVALID_CONTEXT };
    let Some(other) = context_device(peer) else { return INVALID_CONTEXT };
    if me == other {
        return INVALID_DEVICE;
    }
    if !devices().p2p {
        return PEER_ACCESS_UNSUPPORTED;
    }
    let mut peers = PEERS.lock().unwrap_or_else(|e| e.into_inner());
    if peers.contains(&(me, other)) {
        return PEER_ACCESS_ALREADY_ENABLED;
    }
    peers.push((me, other));
    OK
}

/// `cuCtxSynchronize`: every stream of the current context drained.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    strict_any("cuCtxSynchronize");
    let Some(dev) = current() else { return INVALID_CONTEXT };
    sync_device(dev);
    OK
}

/// Drains every stream of the process.
fn sync_all() {
    let streams = with(|st| st.streams.clone());
    for s in streams {
        s.sync();
    }
}

/// Drains every stream of device `dev`.
fn sync_device(dev: usize) {
    let streams = with(|st| st.streams.iter().filter(|s| s.dev == dev).cloned().collect::<Vec<_>>());
    for s in streams {
        s.sync();
    }
}

/// `cuMemAlloc_v2`: a shared memory segment mapped at its address.
///
/// # Safety
/// `p` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut u64, len: usize) -> CuResult {
    strict_any("cuMemAlloc");
    let Some(dev) = current() else { return INVALID_CONTEXT };
    let n = with(|st| {
        st.next += 1;
        st.next
    });
    // A random part: a segment an aborted process left behind (its pid
    // reused since) never blocks a new one.
    static NONCE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let nonce = *NONCE.get_or_init(|| {
        let mut b = [0u8; 4];
        // SAFETY: getrandom writes at most 4 bytes into `b`.
        let got = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
        if got == 4 {
            u32::from_ne_bytes(b)
        } else {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
        }
    });
    let name = CString::new(format!("/rmacomm-standin-{}-{nonce:08x}-{n}", std::process::id())).expect("no NUL");
    let Some(h) = map_segment(&name, len, true) else { return OUT_OF_MEMORY };
    let Some(base) = reserve(len) else {
        // SAFETY: our mapping and segment, undone once.
        unsafe {
            libc::munmap(h as *mut c_void, len.max(1));
            libc::shm_unlink(name.as_ptr());
        }
        return OUT_OF_MEMORY;
    };
    with(|st| {
        st.allocs.insert(base, Alloc { len, name, host: h, exported: false });
        st.device_ranges.insert(base, DevRange { host: h, len, dev, reach: vec![dev], peerable: true });
    });
    // SAFETY: the caller's out-pointer.
    unsafe { *p = base };
    OK
}

/// `cuMemFree_v2`.
#[no_mangle]
pub extern "C" fn cuMemFree_v2(p: u64) -> CuResult {
    strict("cuMemFree");
    // The free waits for every stream (as cuMemFree synchronizes): a
    // stream of another device may read the memory through peer access.
    if !with(|st| st.allocs.contains_key(&p)) {
        return INVALID_VALUE;
    }
    sync_all();
    let Some(a) = with(|st| {
        st.device_ranges.remove(&p);
        st.allocs.remove(&p)
    }) else {
        return INVALID_VALUE;
    };
    // SAFETY: our mappings of `a.len` bytes (the segment's and the device
    // range's), unmapped once; the name is ours to unlink.
    unsafe {
        if a.exported {
            // Another process's IPC mapping keeps the segment: what it
            // reads after this free is garbage (as CUDA leaves it
            // undefined), never the bytes it would have read before.
            std::ptr::write_bytes(a.host as *mut u8, 0xff, a.len);
        }
        libc::munmap(a.host as *mut c_void, a.len.max(1));
        libc::munmap(p as *mut c_void, a.len.max(1));
        libc::shm_unlink(a.name.as_ptr());
    }
    OK
}

/// `cuMemsetD8Async`.
#[no_mangle]
pub extern "C" fn cuMemsetD8Async(p: u64, v: u8, len: usize, s: *mut c_void) -> CuResult {
    strict_any("cuMemsetD8Async");
    enqueue(s, Op::Set { dst: p, value: v, len })
}

/// `cuMemcpyHtoDAsync_v2`: the source is copied before this returns, as
/// the driver stages pageable memory (the caller may free it at once).
#[no_mangle]
pub extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, len: usize, s: *mut c_void) -> CuResult {
    strict_any("cuMemcpyHtoDAsync");
    let mut bytes = vec![0u8; len];
    // SAFETY: the caller's `len` readable bytes at `src`.
    unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), bytes.as_mut_ptr(), len) };
    enqueue(s, Op::Upload { dst, bytes })
}

/// `cuMemcpyDtoHAsync_v2`.
#[no_mangle]
pub extern "C" fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: u64, len: usize, s: *mut c_void) -> CuResult {
    strict_any("cuMemcpyDtoHAsync");
    enqueue(s, Op::Copy { dst: dst as u64, src, len })
}

/// `cuMemcpyHtoD_v2`.
#[no_mangle]
pub extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> CuResult {
    strict_any("cuMemcpyHtoD");
    let Some(dev) = current() else { return INVALID_CONTEXT };
    Op::Copy { dst, src: src as u64, len }.run(dev);
    OK
}

/// `cuMemcpyDtoH_v2`.
#[no_mangle]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> CuResult {
    strict_any("cuMemcpyDtoH");
    let Some(dev) = current() else { return INVALID_CONTEXT };
    Op::Copy { dst: dst as u64, src, len }.run(dev);
    OK
}

/// `cuMemcpyDtoD_v2`.
#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, len: usize) -> CuResult {
    strict_any("cuMemcpyDtoD");
    let Some(dev) = current() else { return INVALID_CONTEXT };
    Op::Copy { dst, src, len }.run(dev);
    OK
}

/// `cuMemcpyDtoDAsync_v2`.
#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, len: usize, s: *mut c_void) -> CuResult {
    strict_any("cuMemcpyDtoDAsync");
    enqueue(s, Op::Copy { dst, src, len })
}

/// `cuMemcpyAsync`: pointers of either kind (unified addressing).
#[no_mangle]
pub extern "C" fn cuMemcpyAsync(dst: u64, src: u64, len: usize, s: *mut c_void) -> CuResult {
    strict_any("cuMemcpyAsync");
    enqueue(s, Op::Copy { dst, src, len })
}

/// `cuModuleLoadData`: any image; kernels are emulated by name. The
/// module is its context's (the current one's) device, boxed.
///
/// # Safety
/// `m` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut *mut c_void, _image: *const c_void) -> CuResult {
    strict_any("cuModuleLoadData");
    let Some(dev) = current() else { return INVALID_CONTEXT };
    // SAFETY: the caller's out-pointer; the box is freed by cuModuleUnload.
    unsafe { *m = Box::into_raw(Box::new(dev)).cast() };
    OK
}

/// `cuModuleUnload`.
#[no_mangle]
pub extern "C" fn cuModuleUnload(m: *mut c_void) -> CuResult {
    strict_any("cuModuleUnload");
    if !m.is_null() {
        // SAFETY: made by Box::into_raw in cuModuleLoadData, freed once.
        drop(unsafe { Box::from_raw(m.cast::<usize>()) });
    }
    OK
}

/// A kernel handed out as a `CUfunction`: its name and its module's
/// device (interned, never freed).
#[derive(Debug)]
struct Function {
    name: &'static CStr,
    dev: usize,
}

static FUNCTIONS: Mutex<Vec<&'static Function>> = Mutex::new(Vec::new());

/// `cuModuleGetFunction`: the function is its interned name and device.
///
/// # Safety
/// `f` is a valid out-pointer, `m` a module of `cuModuleLoadData`, `name`
/// a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut *mut c_void, m: *mut c_void, name: *const c_char) -> CuResult {
    strict_any("cuModuleGetFunction");
    if m.is_null() {
        return INVALID_HANDLE;
    }
    // SAFETY: a live module (its device).
    let dev = unsafe { *m.cast::<usize>() };
    // SAFETY: the caller's NUL-terminated string.
    let name = unsafe { CStr::from_ptr(name) };
    let mut fns = FUNCTIONS.lock().unwrap_or_else(|e| e.into_inner());
    let interned = match fns.iter().find(|x| x.name == name && x.dev == dev) {
        Some(x) => *x,
        None => {
            let x: &'static Function =
                Box::leak(Box::new(Function { name: Box::leak(name.to_owned().into_boxed_c_str()), dev }));
            fns.push(x);
            x
        }
    };
    // SAFETY: the caller's out-pointer.
    unsafe { *f = std::ptr::from_ref(interned).cast_mut().cast() };
    OK
}

/// `cuLaunchKernel`: rmacomm's k-input reductions (`rmacomm_<op>_n_<t>`),
/// `rmacomm_sum_full_<t>` and the signal kernels, on f32, f64, i32, i64,
/// i8 and u8, run on the host in stream order; anything else is
/// `CUDA_ERROR_NOT_SUPPORTED`.
///
/// # Safety
/// `f` comes from `cuModuleGetFunction`; `params` holds one pointer per
/// kernel parameter, each to a value of the parameter's type.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    s: *mut c_void,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    strict_any("cuLaunchKernel");
    // SAFETY: an interned function (cuModuleGetFunction).
    let func = unsafe { &*f.cast::<Function>() };
    // A kernel runs in the current context, on a stream of it, from a
    // module loaded in it.
    let Some(dev) = current() else { return INVALID_CONTEXT };
    if func.dev != dev || unknown(s) || stream(s).is_some_and(|st| st.dev != dev) {
        return INVALID_HANDLE;
    }
    let name = func.name.to_str().unwrap_or("");
    // SAFETY: the caller's parameter array, read per the kernel's signature.
    let arg = |i: usize| unsafe { *params.add(i) };
    // SAFETY: as above: 8-byte and 4-byte parameters.
    let (u64_at, u32_at) = (|i: usize| unsafe { *arg(i).cast::<u64>() }, |i: usize| unsafe { *arg(i).cast::<u32>() });
    let k = if let Some(rest) = name.strip_prefix("rmacomm_sum_full_") {
        // SAFETY: the f64 parameter.
        let factor = unsafe { *arg(4).cast::<f64>() };
        Kernel {
            op: "full",
            t: rest.to_string(),
            out: u64_at(0),
            inp: u64_at(1),
            k: u32_at(2),
            n: u64_at(3),
            factor,
            count: u64_at(5),
        }
    } else if name == "rmacomm_wait_reach" {
        // `n`: the `want` word.
        let n = u64_at(2);
        Kernel { op: "wait_reach", t: String::new(), out: u64_at(0), inp: u64_at(1), k: 0, n, factor: 0.0, count: 0 }
    } else if name == "rmacomm_signal_next" || name == "rmacomm_wait_next" {
        let next = name.ends_with("signal_next");
        Kernel {
            op: if next { "signal_next" } else { "wait_next" },
            t: String::new(),
            out: u64_at(0),
            inp: if next { 0 } else { u64_at(1) },
            k: 0,
            // wait_next: the `want` word.
            n: if next { 0 } else { u64_at(2) },
            factor: 0.0,
            count: 0,
        }
    } else if name == "rmacomm_signal_add" || name == "rmacomm_wait_geq" {
        Kernel {
            op: if name.ends_with("add") { "add" } else { "wait" },
            t: String::new(),
            out: u64_at(0),
            inp: 0,
            k: 0,
            n: u64_at(1),
            factor: 0.0,
            count: 0,
        }
    } else if let Some((op, t)) = name.strip_prefix("rmacomm_").and_then(|r| r.split_once("_n_")) {
        let op = match op {
            "sum" => "sum",
            "product" => "product",
            "min" => "min",
            "max" => "max",
            "band" => "band",
            "bor" => "bor",
            "bxor" => "bxor",
            _ => return NOT_SUPPORTED,
        };
        Kernel {
            op,
            t: t.to_string(),
            out: u64_at(0),
            inp: u64_at(1),
            k: u32_at(2),
            n: u64_at(3),
            factor: 1.0,
            count: 1,
        }
    } else {
        return NOT_SUPPORTED;
    };
    if !matches!(k.t.as_str(), "" | "f32" | "f64" | "i32" | "i64" | "i8" | "u8") {
        return NOT_SUPPORTED;
    }
    enqueue(s, Op::Kernel(Box::new(k)))
}

/// An emulated kernel launch.
#[derive(Clone, Debug)]
struct Kernel {
    op: &'static str,
    t: String,
    out: u64,
    inp: u64,
    k: u32,
    n: u64,
    factor: f64,
    count: u64,
}

/// One element type's arithmetic for the emulated kernels.
trait Elem: Copy {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn ap(op: &str, a: Self, b: Self) -> Self;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
            fn ap(op: &str, a: Self, b: Self) -> Self {
                match op {
                    "sum" => a.wrapping_add(b),
                    "product" => a.wrapping_mul(b),
                    "min" => a.min(b),
                    "max" => a.max(b),
                    "band" => a & b,
                    "bor" => a | b,
                    _ => a ^ b,
                }
            }
        }
    )*};
}
int_elem!(i32, i64, i8, u8);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
            fn ap(op: &str, a: Self, b: Self) -> Self {
                match op {
                    "sum" => a + b,
                    "product" => a * b,
                    "min" => if a.is_nan() || b.is_nan() { <$t>::NAN } else { a.min(b) },
                    _ => if a.is_nan() || b.is_nan() { <$t>::NAN } else { a.max(b) },
                }
            }
        }
    )*};
}
float_elem!(f32, f64);

fn run_kernel<T: Elem>(k: &Kernel, dev: usize) {
    let n = k.n as usize;
    reach(k.inp, dev, "a reduction kernel's pointer table");
    reach(k.out, dev, "a reduction kernel's output");
    let table = host(k.inp) as *const u64;
    let inputs: Vec<*const T> = (0..k.k as usize)
        .map(|j| {
            // SAFETY: the pointer table: k device pointers.
            let at = unsafe { *table.add(j) };
            reach(at, dev, "a reduction kernel's input");
            host(at) as *const T
        })
        .collect();
    let out = host(k.out) as *mut T;
    for i in 0..n {
        // SAFETY: every input holds n elements (the kernel's contract).
        let at = |j: usize| unsafe { inputs[j].add(i).read_unaligned() };
        let v = if k.op == "full" {
            let acc: f64 = (0..inputs.len()).map(|j| at(j).to_f64() * k.factor).sum();
            T::from_f64(acc / k.count as f64)
        } else {
            (1..inputs.len()).fold(at(0), |acc, j| T::ap(k.op, acc, at(j)))
        };
        // SAFETY: `out` holds n elements.
        unsafe { out.add(i).write_unaligned(v) };
    }
}

impl Kernel {
    /// Runs on device `dev` (a signal kernel's words checked as its
    /// reductions' pointers are).
    fn run(&self, dev: usize) {
        let signal = |addr: u64| {
            reach(addr, dev, "a signal kernel");
            word(addr)
        };
        match (self.op, self.t.as_str()) {
            ("add", _) => {
                signal(self.out).fetch_add(self.n, Ordering::SeqCst);
            }
            ("wait", _) => Op::WaitGeq { addr: self.out, value: self.n }.run(dev),
            ("signal_next", _) => {
                signal(self.out).fetch_add(1, Ordering::SeqCst);
            }
            ("wait_reach", _) => {
                let want = signal(self.inp).load(Ordering::SeqCst);
                signal(self.n).store(want, Ordering::SeqCst);
                Op::WaitGeq { addr: self.out, value: want }.run(dev);
            }
            ("wait_next", _) => {
                let want = signal(self.out).load(Ordering::SeqCst) + 1;
                signal(self.n).store(want, Ordering::SeqCst);
                Op::WaitGeq { addr: self.inp, value: want }.run(dev);
                word(self.out).store(want, Ordering::SeqCst);
            }
            (_, "f32") => run_kernel::<f32>(self, dev),
            (_, "f64") => run_kernel::<f64>(self, dev),
            (_, "i32") => run_kernel::<i32>(self, dev),
            (_, "i64") => run_kernel::<i64>(self, dev),
            (_, "i8") => run_kernel::<i8>(self, dev),
            _ => run_kernel::<u8>(self, dev),
        }
    }
}

/// `cuPointerGetAttribute`: memory type (device), ordinal (0), range start
/// and size, for addresses inside an allocation of this process or an IPC
/// mapping opened here.
///
/// # Safety
/// `out` is a valid out-pointer of the attribute's type.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(out: *mut c_void, attr: c_int, p: u64) -> CuResult {
    strict_any("cuPointerGetAttribute");
    // As strict as a driver may be: a context must be current.
    if current().is_none() {
        return INVALID_CONTEXT;
    }
    // Allocations of this process, IPC mappings and VMM mappings opened
    // here: (base, length, legacy IPC capable, VMM handle types).
    let found = with(|st| {
        let (b, r) = st.device_ranges.range(..=p).next_back()?;
        let vmm = st.vmm_maps.get(b).and_then(|(h, _)| st.vmm.get(h)).map(|v| v.handle_types);
        // The ordinal of the memory's device here; a device this process
        // does not see: the device that opened the mapping.
        let ord = ordinal_of(r.dev).or_else(|| r.reach.iter().find_map(|d| ordinal_of(*d))).unwrap_or(0);
        Some((*b, r.len, st.allocs.contains_key(b), vmm, ord))
    });
    let Some((base, len, legacy, vmm, ord)) = found.filter(|(b, l, ..)| p < b + (*l).max(1) as u64) else {
        return INVALID_VALUE;
    };
    // SAFETY: the caller's out-pointer, of the attribute's type.
    unsafe {
        match attr {
            2 => *out.cast::<c_uint>() = 2,
            9 => *out.cast::<c_int>() = ord,
            10 => *out.cast::<c_int>() = c_int::from(legacy),
            11 | 19 => *out.cast::<u64>() = base,
            12 | 18 => *out.cast::<usize>() = len,
            14 => *out.cast::<c_int>() = vmm.unwrap_or(0),
            _ => return INVALID_VALUE,
        }
    }
    OK
}

/// `cuIpcGetMemHandle`: the segment's name.
///
/// # Safety
/// `h` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(h: *mut IpcHandle, p: u64) -> CuResult {
    strict_any("cuIpcGetMemHandle");
    let Some((name, dev)) = with(|st| {
        let dev = st.device_ranges.get(&p).map_or(0, |r| r.dev);
        st.allocs.get_mut(&p).map(|a| {
            a.exported = true;
            (a.name.clone(), dev)
        })
    }) else {
        return INVALID_VALUE;
    };
    // The segment's name, NUL-padded, and the memory's device in the last
    // byte.
    let mut out = [0u8; 64];
    out[..name.as_bytes().len()].copy_from_slice(name.as_bytes());
    out[63] = dev as u8;
    // SAFETY: the caller's out-pointer.
    unsafe { *h = IpcHandle(out) };
    OK
}

/// `cuIpcOpenMemHandle_v2`: maps the named segment in the current
/// context (refused for this process's own memory, as the driver does;
/// another device's memory needs peer access between the two, which the
/// mapping then has, as with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`).
///
/// # Safety
/// `p` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(p: *mut u64, h: IpcHandle, _flags: c_uint) -> CuResult {
    strict("cuIpcOpenMemHandle");
    let Some(me) = current() else { return INVALID_CONTEXT };
    let owner = usize::from(h.0[63]);
    let end = h.0[..63].iter().position(|b| *b == 0).unwrap_or(63);
    let Ok(name) = CString::new(&h.0[..end]) else { return INVALID_VALUE };
    if owner >= devices().count {
        return INVALID_VALUE;
    }
    if owner != me && !devices().p2p {
        return PEER_ACCESS_UNSUPPORTED;
    }
    if with(|st| st.allocs.values().any(|a| a.name == name)) {
        return INVALID_VALUE;
    }
    // As the driver: one open of an allocation per device context in a
    // process.
    if with(|st| st.opened_names.contains(&(me, name.clone()))) {
        return ALREADY_MAPPED;
    }
    let Some(hm) = map_segment(&name, 0, false) else { return INVALID_HANDLE };
    let mut stat_len = 0usize;
    let c = name.clone();
    // SAFETY: a NUL-terminated name; the fd is closed at once.
    unsafe {
        let fd = libc::shm_open(c.as_ptr(), libc::O_RDONLY, 0);
        if fd >= 0 {
            let mut stat: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut stat) == 0 {
                stat_len = stat.st_size as usize;
            }
            libc::close(fd);
        }
    }
    let Some(base) = reserve(stat_len) else {
        // SAFETY: our mapping, undone once.
        unsafe { libc::munmap(hm as *mut c_void, stat_len.max(1)) };
        return OUT_OF_MEMORY;
    };
    with(|st| {
        st.opened.insert(base, stat_len);
        st.opened_by_base.insert(base, (me, name.clone()));
        st.opened_names.insert((me, name));
        // Reached by the context that opened it (lazy peer access from it).
        st.device_ranges
            .insert(base, DevRange { host: hm, len: stat_len, dev: owner, reach: vec![me], peerable: false });
    });
    // SAFETY: the caller's out-pointer.
    unsafe { *p = base };
    OK
}

/// `cuIpcCloseMemHandle`.
#[no_mangle]
pub extern "C" fn cuIpcCloseMemHandle(p: u64) -> CuResult {
    strict("cuIpcCloseMemHandle");
    // The close waits for every stream (any may use the mapping).
    sync_all();
    let Some((len, hm)) = with(|st| {
        if let Some(n) = st.opened_by_base.remove(&p) {
            st.opened_names.remove(&n);
        }
        let hm = st.device_ranges.remove(&p).map_or(0, |r| r.host);
        st.opened.remove(&p).map(|l| (l, hm))
    }) else {
        return INVALID_VALUE;
    };
    // SAFETY: our mappings (the segment's and the device range's), unmapped
    // once.
    unsafe {
        libc::munmap(hm as *mut c_void, len.max(1));
        libc::munmap(p as *mut c_void, len.max(1));
    }
    OK
}

/// `cuMemHostRegister_v2`: the range is its own device address; an
/// overlapping registration is refused as the driver does.
#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, len: usize, _flags: c_uint) -> CuResult {
    strict("cuMemHostRegister");
    if current().is_none() {
        return INVALID_CONTEXT;
    }
    let (start, end) = (p as u64, p as u64 + len as u64);
    with(|st| {
        if st.registered.iter().any(|(b, l)| *b < end && start < b + *l as u64) {
            return ALREADY_REGISTERED;
        }
        st.registered.insert(start, len);
        OK
    })
}

/// `cuMemHostUnregister`.
#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CuResult {
    strict("cuMemHostUnregister");
    match with(|st| st.registered.remove(&(p as u64))) {
        Some(_) => OK,
        None => INVALID_VALUE,
    }
}

/// `cuMemHostGetDevicePointer_v2`: the host address.
///
/// # Safety
/// `d` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(d: *mut u64, p: *mut c_void, _flags: c_uint) -> CuResult {
    strict_any("cuMemHostGetDevicePointer");
    let a = p as u64;
    if !with(|st| st.registered.iter().any(|(b, l)| *b <= a && a < b + *l as u64)) {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *d = a };
    OK
}

/// `cuStreamCreate`: a thread with a queue.
///
/// # Safety
/// `s` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(s: *mut *mut c_void, _flags: c_uint) -> CuResult {
    strict_any("cuStreamCreate");
    let Some(dev) = current() else { return INVALID_CONTEXT };
    let st = Arc::new(Stream::new(dev));
    let p = Arc::as_ptr(&st) as *mut c_void;
    with(|state| state.streams.push(st));
    // SAFETY: the caller's out-pointer.
    unsafe { *s = p };
    OK
}

/// `cuStreamGetCtx`: the context a stream was made in (the legacy
/// default stream: the current one's).
///
/// # Safety
/// `ctx` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(s: *mut c_void, ctx: *mut *mut c_void) -> CuResult {
    strict_any("cuStreamGetCtx");
    // 0, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2): the current
    // context's.
    let special = (s as usize) <= 2;
    let dev = if special { current() } else { stream(s).map(|st| st.dev) };
    let Some(dev) = dev else { return if special { INVALID_CONTEXT } else { INVALID_HANDLE } };
    // SAFETY: the caller's out-pointer.
    unsafe { *ctx = context_handle(dev) };
    OK
}

/// `cuStreamDestroy_v2`: drains the stream, then ends its thread.
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(s: *mut c_void) -> CuResult {
    strict_any("cuStreamDestroy");
    let Some(st) = stream(s) else { return INVALID_HANDLE };
    st.sync();
    with(|state| state.streams.retain(|x| !Arc::ptr_eq(x, &st)));
    OK
}

/// `cuStreamSynchronize`.
#[no_mangle]
pub extern "C" fn cuStreamSynchronize(s: *mut c_void) -> CuResult {
    strict_any("cuStreamSynchronize");
    if unknown(s) {
        return INVALID_HANDLE;
    }
    if let Some(st) = stream(s) {
        st.sync();
    }
    OK
}

/// `RMACOMM_STANDIN_NO_MEMOPS=1`: a device without 64-bit stream memory
/// operations, whose driver refuses them (`CUDA_ERROR_NOT_SUPPORTED`).
fn no_memops() -> bool {
    std::env::var("RMACOMM_STANDIN_NO_MEMOPS").is_ok_and(|v| v == "1")
}

/// `cuStreamWriteValue64_v2`.
#[no_mangle]
pub extern "C" fn cuStreamWriteValue64_v2(s: *mut c_void, addr: u64, value: u64, _flags: c_uint) -> CuResult {
    strict_any("cuStreamWriteValue64");
    if no_memops() {
        return NOT_SUPPORTED;
    }
    if !addr.is_multiple_of(8) {
        return INVALID_VALUE;
    }
    enqueue(s, Op::Write { addr, value })
}

/// `cuStreamWaitValue64_v2` (only `CU_STREAM_WAIT_VALUE_GEQ`).
#[no_mangle]
pub extern "C" fn cuStreamWaitValue64_v2(s: *mut c_void, addr: u64, value: u64, flags: c_uint) -> CuResult {
    if no_memops() {
        return NOT_SUPPORTED;
    }
    strict_any("cuStreamWaitValue64");
    if !addr.is_multiple_of(8) || flags & 0xf != 0 {
        return INVALID_VALUE;
    }
    enqueue(s, Op::WaitGeq { addr, value })
}

/// `cuStreamIsCapturing`: 1 (active) while capturing, else 0.
///
/// # Safety
/// `status` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(s: *mut c_void, status: *mut c_int) -> CuResult {
    strict_any("cuStreamIsCapturing");
    if unknown(s) {
        return INVALID_HANDLE;
    }
    let capturing = match stream(s) {
        Some(st) => st.capture.lock().unwrap().is_some(),
        // The legacy default stream is the current context's.
        None if current().is_none() => return INVALID_CONTEXT,
        None => false,
    };
    // SAFETY: the caller's out-pointer.
    unsafe { *status = c_int::from(capturing) };
    OK
}

/// `cuStreamBeginCapture_v2`.
#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(s: *mut c_void, _mode: c_int) -> CuResult {
    strict_any("cuStreamBeginCapture");
    let Some(st) = stream(s) else { return STREAM_CAPTURE_UNSUPPORTED };
    *st.capture.lock().unwrap() = Some(Vec::new());
    OK
}

/// `cuStreamEndCapture`: the captured work, as a graph.
///
/// # Safety
/// `g` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(s: *mut c_void, g: *mut *mut c_void) -> CuResult {
    strict_any("cuStreamEndCapture");
    let Some(st) = stream(s) else { return INVALID_HANDLE };
    let Some(ops) = st.capture.lock().unwrap().take() else { return INVALID_VALUE };
    // SAFETY: the caller's out-pointer; the graph is freed by cuGraphDestroy.
    unsafe { *g = Box::into_raw(Box::new(ops)).cast() };
    OK
}

/// `cuGraphInstantiateWithFlags`: the executable graph is a copy.
///
/// # Safety
/// `e` is a valid out-pointer, `g` a graph of `cuStreamEndCapture`.
#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(e: *mut *mut c_void, g: *mut c_void, _flags: u64) -> CuResult {
    strict_any("cuGraphInstantiateWithFlags");
    // SAFETY: a live graph made by cuStreamEndCapture.
    let ops = unsafe { &*g.cast::<Vec<Op>>() }.clone();
    // SAFETY: the caller's out-pointer.
    unsafe { *e = Box::into_raw(Box::new(ops)).cast() };
    OK
}

/// `cuGraphLaunch`: queues the recorded work.
///
/// # Safety
/// `e` is an executable graph of `cuGraphInstantiateWithFlags`.
#[no_mangle]
pub unsafe extern "C" fn cuGraphLaunch(e: *mut c_void, s: *mut c_void) -> CuResult {
    strict_any("cuGraphLaunch");
    if unknown(s) {
        return INVALID_HANDLE;
    }
    // SAFETY: a live executable graph.
    let ops = unsafe { &*e.cast::<Vec<Op>>() }.clone();
    for op in ops {
        enqueue(s, op);
    }
    OK
}

/// `cuGraphExecDestroy`.
///
/// # Safety
/// `e` is an executable graph, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn cuGraphExecDestroy(e: *mut c_void) -> CuResult {
    strict_any("cuGraphExecDestroy");
    // SAFETY: made by Box::into_raw in cuGraphInstantiateWithFlags.
    drop(unsafe { Box::from_raw(e.cast::<Vec<Op>>()) });
    OK
}

/// `cuGraphDestroy`.
///
/// # Safety
/// `g` is a graph, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn cuGraphDestroy(g: *mut c_void) -> CuResult {
    strict_any("cuGraphDestroy");
    // SAFETY: made by Box::into_raw in cuStreamEndCapture.
    drop(unsafe { Box::from_raw(g.cast::<Vec<Op>>()) });
    OK
}

// ---- Virtual memory management (cuMemCreate and friends) ----------------
//
// An allocation is a memfd (its "physical memory"). A reserved device
// range has a host range of the same length that shadows it; mapping an
// allocation at a device address maps its memfd at the same place of the
// shadow, so contiguous device mappings are contiguous on the host too (a
// copy may span them). Exporting hands out a duplicate of the memfd (the
// POSIX file descriptor handle type); importing keeps the received one.

/// A VMM allocation: its memfd, length, the handle types it was created
/// for, and its references (the unreleased handle and each mapping); freed
/// when they reach zero.
#[derive(Debug)]
struct Vmm {
    fd: std::os::fd::OwnedFd,
    len: usize,
    handle_types: c_int,
    refs: usize,
    /// The physical device it was created on.
    dev: usize,
}

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const POSIX_FD: c_int = 1;
/// The allocation granularity the stand-in reports (a real GPU's: 2 MiB).
const GRANULARITY: usize = 2 << 20;

fn vmm_new(fd: std::os::fd::OwnedFd, len: usize, handle_types: c_int, dev: usize) -> u64 {
    with(|st| {
        st.next += 1;
        let h = st.next;
        st.vmm.insert(h, Vmm { fd, len, handle_types, refs: 1, dev });
        h
    })
}

/// The memfd name of VMM memory created on physical device `dev` (an
/// importer reads the device back from it).
fn vmm_name(dev: usize) -> CString {
    CString::new(format!("rmacomm-standin-vmm-{dev}")).expect("no NUL")
}

/// Drops one reference of allocation `h`; the last one unmaps it.
fn vmm_unref(st: &mut State, h: u64) {
    let Some(v) = st.vmm.get_mut(&h) else { return };
    v.refs -= 1;
    if v.refs == 0 {
        st.vmm.remove(&h);
    }
}

/// `cuMemGetAllocationGranularity`.
///
/// # Safety
/// `g` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(g: *mut usize, _prop: *const c_void, _flags: c_int) -> CuResult {
    strict_any("cuMemGetAllocationGranularity");
    // SAFETY: the caller's out-pointer.
    unsafe { *g = GRANULARITY };
    OK
}

/// `cuMemCreate`: a memfd of `len` bytes (a multiple of the granularity);
/// the handle types requested are read from the properties (bytes 4..8).
///
/// # Safety
/// `h` is a valid out-pointer; `prop` points to a `CUmemAllocationProp`.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(h: *mut u64, len: usize, prop: *const c_int, _flags: u64) -> CuResult {
    strict("cuMemCreate");
    if len == 0 || !len.is_multiple_of(GRANULARITY) || prop.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's properties: type, requestedHandleTypes,
    // location type, location id (a device ordinal), ...
    let (kind, types, loc, id) = unsafe { (*prop, *prop.add(1), *prop.add(2), *prop.add(3)) };
    if kind != 1 || loc != 1 {
        return INVALID_VALUE;
    }
    let Some(dev) = physical(id) else { return INVALID_DEVICE };
    let name = vmm_name(dev);
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return OUT_OF_MEMORY;
    }
    // SAFETY: a new descriptor, ours.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: our memfd.
    if unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len as libc::off_t) } != 0 {
        return OUT_OF_MEMORY;
    }
    let handle = vmm_new(fd, len, types, dev);
    // SAFETY: the caller's out-pointer.
    unsafe { *h = handle };
    OK
}

/// `cuMemRelease`.
#[no_mangle]
pub extern "C" fn cuMemRelease(h: u64) -> CuResult {
    strict("cuMemRelease");
    with(|st| {
        if !st.vmm.contains_key(&h) {
            return INVALID_HANDLE;
        }
        vmm_unref(st, h);
        OK
    })
}

/// `cuMemAddressReserve`: a range with no access at all.
///
/// # Safety
/// `p` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    p: *mut u64,
    len: usize,
    _align: usize,
    _addr: u64,
    _flags: u64,
) -> CuResult {
    strict("cuMemAddressReserve");
    if len == 0 || !len.is_multiple_of(GRANULARITY) {
        return INVALID_VALUE;
    }
    let Some(base) = reserve(len) else { return OUT_OF_MEMORY };
    let Some(shadow) = reserve(len) else {
        // SAFETY: the range just reserved, undone once.
        unsafe { libc::munmap(base as *mut c_void, len) };
        return OUT_OF_MEMORY;
    };
    with(|st| st.reserved.insert(base, (len, shadow)));
    // SAFETY: the caller's out-pointer.
    unsafe { *p = base };
    OK
}

/// `cuMemAddressFree`: refused while any of the range is mapped.
#[no_mangle]
pub extern "C" fn cuMemAddressFree(p: u64, len: usize) -> CuResult {
    strict("cuMemAddressFree");
    let shadow = with(|st| {
        let (l, shadow) = *st.reserved.get(&p)?;
        if l != len || st.vmm_maps.range(p..p + len as u64).next().is_some() {
            return None;
        }
        st.reserved.remove(&p);
        Some(shadow)
    });
    let Some(shadow) = shadow else { return INVALID_VALUE };
    // SAFETY: the reservation made by cuMemAddressReserve and its shadow,
    // unmapped once.
    unsafe {
        libc::munmap(p as *mut c_void, len);
        libc::munmap(shadow as *mut c_void, len);
    }
    OK
}

/// `cuMemMap`: the whole allocation (offset 0) at `p`, inside a
/// reservation, over nothing mapped; no access until `cuMemSetAccess`.
#[no_mangle]
pub extern "C" fn cuMemMap(p: u64, len: usize, offset: usize, h: u64, _flags: u64) -> CuResult {
    strict("cuMemMap");
    with(|st| {
        let Some(v) = st.vmm.get_mut(&h) else { return INVALID_HANDLE };
        if offset != 0 || len != v.len {
            return INVALID_VALUE;
        }
        let Some((base, (_, shadow))) =
            st.reserved.range(..=p).next_back().filter(|(b, (l, _))| p + len as u64 <= *b + *l as u64)
        else {
            return INVALID_VALUE;
        };
        let end = p + len as u64;
        if st.vmm_maps.range(..end).next_back().is_some_and(|(b, (_, l))| b + *l as u64 > p) {
            return INVALID_VALUE;
        }
        let host = shadow + (p - base);
        // SAFETY: the memfd over its place in the shadow range (reserved,
        // nothing mapped there: checked above).
        let m = unsafe {
            libc::mmap(
                host as *mut c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                std::os::fd::AsRawFd::as_raw_fd(&v.fd),
                0,
            )
        };
        if m == libc::MAP_FAILED {
            return OUT_OF_MEMORY;
        }
        v.refs += 1;
        let dev = v.dev;
        st.vmm_maps.insert(p, (h, len));
        st.device_ranges.insert(p, DevRange { host, len, dev, reach: Vec::new(), peerable: false });
        OK
    })
}

/// `cuMemSetAccess`: `count` descriptors, for mappings covering the range
/// exactly.
///
/// # Safety
/// `desc` points to `count` `CUmemAccessDesc`s.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(p: u64, len: usize, desc: *const c_int, count: usize) -> CuResult {
    strict("cuMemSetAccess");
    if desc.is_null() || count == 0 {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's descriptors: location type, id, flags each.
    let descs: Vec<(c_int, c_int, c_int)> =
        (0..count).map(|i| unsafe { (*desc.add(3 * i), *desc.add(3 * i + 1), *desc.add(3 * i + 2)) }).collect();
    let mut devs = Vec::new();
    for (loc, id, flags) in descs {
        if loc != 1 || flags != 3 {
            return INVALID_VALUE;
        }
        let Some(d) = physical(id) else { return INVALID_DEVICE };
        devs.push(d);
    }
    with(|st| {
        let end = p + len as u64;
        let mut at = p;
        let mut bases = Vec::new();
        while at < end {
            let Some((_, l)) = st.vmm_maps.get(&at) else { return INVALID_VALUE };
            bases.push(at);
            at += *l as u64;
        }
        if at != end {
            return INVALID_VALUE;
        }
        // Another device's memory needs peer access between the two.
        if !devices().p2p
            && bases.iter().any(|b| devs.iter().any(|d| st.device_ranges.get(b).is_some_and(|r| r.dev != *d)))
        {
            return PEER_ACCESS_UNSUPPORTED;
        }
        for b in bases {
            if let Some(r) = st.device_ranges.get_mut(&b) {
                for d in &devs {
                    if !r.reach.contains(d) {
                        r.reach.push(*d);
                    }
                }
            }
        }
        OK
    })
}

/// `cuMemUnmap`: one whole mapping.
#[no_mangle]
pub extern "C" fn cuMemUnmap(p: u64, len: usize) -> CuResult {
    strict("cuMemUnmap");
    // The unmap waits for the devices that reach the mapping.
    for d in with(|st| st.device_ranges.get(&p).map(|r| r.reach.clone()).unwrap_or_default()) {
        sync_device(d);
    }
    with(|st| {
        let Some((h, l)) = st.vmm_maps.get(&p).copied() else { return INVALID_VALUE };
        if l != len {
            return INVALID_VALUE;
        }
        st.vmm_maps.remove(&p);
        let host = st.device_ranges.remove(&p).map_or(0, |r| r.host);
        // SAFETY: the memfd's mapping in the shadow range, made inaccessible
        // again (the range stays reserved).
        unsafe {
            libc::mmap(
                host as *mut c_void,
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        vmm_unref(st, h);
        OK
    })
}

/// `cuMemRetainAllocationHandle`: the handle mapped at an address of a
/// mapping (one more reference, released with `cuMemRelease`).
///
/// # Safety
/// `h` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(h: *mut u64, addr: *mut c_void) -> CuResult {
    strict_any("cuMemRetainAllocationHandle");
    let a = addr as u64;
    let found = with(|st| {
        let (_, (handle, _)) = st.vmm_maps.range(..=a).next_back().filter(|(b, (_, l))| a < *b + *l as u64)?;
        let handle = *handle;
        st.vmm.get_mut(&handle)?.refs += 1;
        Some(handle)
    });
    let Some(handle) = found else { return INVALID_VALUE };
    // SAFETY: the caller's out-pointer.
    unsafe { *h = handle };
    OK
}

/// `cuMemExportToShareableHandle`: a new descriptor of the allocation's
/// memfd, for an allocation created with that handle type requested.
///
/// # Safety
/// `out` points to an `int` (the POSIX descriptor type).
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(out: *mut c_void, h: u64, kind: c_int, _flags: u64) -> CuResult {
    strict_any("cuMemExportToShareableHandle");
    if kind != POSIX_FD {
        return NOT_SUPPORTED;
    }
    let fd = with(|st| {
        let v = st.vmm.get(&h).ok_or(INVALID_HANDLE)?;
        if v.handle_types & POSIX_FD == 0 {
            return Err(INVALID_VALUE);
        }
        v.fd.try_clone().map_err(|_| OUT_OF_MEMORY)
    });
    match fd {
        // SAFETY: the caller's out-pointer, an int.
        Ok(fd) => unsafe { *out.cast::<c_int>() = std::os::fd::IntoRawFd::into_raw_fd(fd) },
        Err(e) => return e,
    }
    OK
}

/// `cuMemImportFromShareableHandle`: maps the memfd the descriptor names
/// (the caller keeps its descriptor).
///
/// # Safety
/// `h` is a valid out-pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(h: *mut u64, os: *mut c_void, kind: c_int) -> CuResult {
    strict("cuMemImportFromShareableHandle");
    if kind != POSIX_FD {
        return NOT_SUPPORTED;
    }
    let raw = os as usize as c_int;
    // SAFETY: a descriptor the caller owns, borrowed for the duplicate.
    let Ok(fd) = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) }.try_clone_to_owned() else { return INVALID_VALUE };
    // SAFETY: stat is written by fstat.
    let len = unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        if libc::fstat(raw, &mut stat) != 0 {
            return INVALID_VALUE;
        }
        stat.st_size as usize
    };
    if len == 0 || !len.is_multiple_of(GRANULARITY) {
        return INVALID_VALUE;
    }
    // The device it was created on, from the memfd's name.
    let link = std::fs::read_link(format!("/proc/self/fd/{raw}")).map(|p| p.to_string_lossy().into_owned());
    let dev = link
        .ok()
        .and_then(|l| l.strip_prefix("/memfd:rmacomm-standin-vmm-").and_then(|r| r.split(' ').next()?.parse().ok()))
        .unwrap_or(0);
    let handle = vmm_new(fd, len, POSIX_FD, dev);
    // SAFETY: the caller's out-pointer.
    unsafe { *h = handle };
    OK
}

/// Where the device memory at `p..p + len` of this process lives, for
/// another process to map: (file, offset in it, bytes) per piece, in
/// order — one for `cuMemAlloc` memory (its shared-memory segment), one
/// per VMM mapping the range touches (its memfd, through `/proc`). `None`
/// when the range is not all device memory of this process.
fn backing(p: u64, len: usize) -> Option<Vec<(String, u64, usize)>> {
    with(|st| {
        let end = p.checked_add(len as u64)?;
        if let Some((base, a)) = st.allocs.range(..=p).next_back() {
            if end <= base + a.len as u64 {
                return Some(vec![(format!("/dev/shm{}", a.name.to_str().ok()?), p - base, len)]);
            }
        }
        let mut pieces = Vec::new();
        let mut at = p;
        while at < end || pieces.is_empty() {
            let (base, (h, l)) = st.vmm_maps.range(..=at).next_back()?;
            let stop = base + *l as u64;
            if at >= stop {
                return None;
            }
            let fd = std::os::fd::AsRawFd::as_raw_fd(&st.vmm.get(h)?.fd);
            let upto = stop.min(end);
            pieces.push((format!("/proc/{}/fd/{fd}", std::process::id()), at - base, (upto - at) as usize));
            at = upto;
            if len == 0 {
                break;
            }
        }
        Some(pieces)
    })
}
