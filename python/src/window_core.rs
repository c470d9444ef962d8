//! What both window forms share: the window, its registration as Python
//! sees it (every rank's element type and shape), the memory operations
//! read from or write into, and the owning design of pending operations.
//!
//! # Pending operations own a borrow of the window
//!
//! The window's `Work<'a>` borrows the window and the operation's local
//! memory; Python needs a handle it can keep as long as it likes. A
//! [`WinPending`] owns the `Work` with its lifetime extended to `'static`
//! together with what it borrows: an `Arc` of the [`WinCore`] (the window
//! inside an `RwLock`, at a stable address) and an `Arc` of the local
//! memory's registration. That is sound because:
//!
//! - the window is only ever borrowed shared while a `WinPending` exists:
//!   the exclusive operations (`tensor_register`, `tensor_deregister`)
//!   take the write lock and proceed only when `live` is 0, and `live` is
//!   raised while the read lock the `Work` was made under is still held,
//!   so no `WinPending` can appear while the write lock is held;
//! - the memory a put or get uses is an `Arc` the `WinPending` holds, or
//!   the window's own registered tensor (moved out only by
//!   `tensor_deregister`, exclusive as above);
//! - `WinPending` drops the `Work` before anything it borrows.
//!
//! Before an exclusive operation the window waits for every pending
//! operation it knows of (their results are kept for their handles), so a
//! `Work` the program still holds never blocks a deregistration.
//!
//! Operations that finish in the call (the UNIFIED path's copies and
//! atomics) never become a `WinPending`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use rmacomm_transport::{RdmaMemory, View, ViewMut};
use rmacomm_window::{AccessType, Cmp, Group, Window, Work};

use crate::array::{self, Keep};
use crate::elem::{self, Elem};
use crate::errors::{py_err, ErrKind, Failure};
use crate::mapping::DupMapping;
use crate::memory::{self, Borrowed, Owner, Registered};
use crate::tensor::{Kind, Raw, Tensor};
use crate::work::{State, WorkCell};

/// A rank's registered tensor, as its element type and shape.
#[derive(Debug, Clone)]
pub(crate) struct PeerMeta {
    pub(crate) elem: &'static Elem,
    pub(crate) shape: Vec<usize>,
}

/// This rank's registration as Python sees it.
pub(crate) struct Reg {
    /// The registered tensor (returned by `map_remote_tensor(own rank)`).
    pub(crate) tensor: Py<PyAny>,
    pub(crate) kind: Kind,
    pub(crate) peers: Vec<PeerMeta>,
    /// The CUDA device of a registered CUDA tensor (`None`: host memory).
    pub(crate) device: Option<u32>,
    /// A CUDA tensor registered through the transport (some peer is not
    /// UNIFIED), not mapped through CUDA IPC.
    pub(crate) staged: bool,
}

/// A window and what the Python classes keep beside it.
pub(crate) struct WinCore {
    /// Taken (and dropped with the GIL released) by `Drop`.
    pub(crate) win: std::mem::ManuallyDrop<RwLock<Window>>,
    /// `WinPending`s alive (each borrows `win`).
    live: AtomicUsize,
    /// Handles of operations that may still be pending.
    pending: Mutex<Vec<Weak<WorkCell>>>,
    /// Registration metadata exchanges (a group of its own).
    meta: Group,
    pub(crate) reg: Mutex<Option<Reg>>,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) timeout: Duration,
}

impl Drop for WinCore {
    /// A window's end waits for the device and for peers (a device
    /// registration's drop waits for the device to run its queued work, the
    /// stream proxy and the watchdogs drain, up to the timeout): with the
    /// GIL released when this
    /// thread holds it (the Python window's deallocation), so other Python
    /// threads run meanwhile.
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used after.
        let win = unsafe { std::mem::ManuallyDrop::take(&mut self.win) };
        crate::runtime::end_without_gil(move || drop(win));
    }
}

/// A pending window operation with what it borrows (module docs).
pub(crate) struct WinPending {
    // Dropped by hand first (Drop below).
    work: Option<Work<'static>>,
    core: Arc<WinCore>,
    _mem: Option<Arc<Registered>>,
}

impl Drop for WinPending {
    fn drop(&mut self) {
        // The borrow ends before the window may be borrowed exclusively.
        drop(self.work.take());
        self.core.live.fetch_sub(1, Ordering::AcqRel);
    }
}

fn win_failure(e: rmacomm_window::Error) -> Failure {
    e.into()
}

impl WinPending {
    /// "put with rank 1": what a timeout of its wait names.
    pub(crate) fn describe(&self) -> String {
        format!("{} with rank {}", self.work().op(), self.work().peer())
    }

    fn work(&self) -> &Work<'static> {
        self.work.as_ref().expect("taken only on drop")
    }

    pub(crate) fn is_completed(&self) -> bool {
        self.work().is_completed()
    }

    /// The result of a completed operation.
    pub(crate) fn result(&self) -> Result<(), Failure> {
        self.work().wait(None).map_err(win_failure)
    }

    /// Waits at most `slice`; `None` if it is still pending then.
    pub(crate) fn wait_slice(&self, slice: Duration) -> Option<Result<(), Failure>> {
        match self.work().wait(Some(slice)) {
            Ok(()) => Some(Ok(())),
            // A wait that timed out leaves the operation pending; an error
            // of the operation itself completes it.
            Err(e) => self.work().is_completed().then(|| Err(win_failure(e))),
        }
    }
}

/// Where an operation's local memory is: a view of it, and the
/// registration to keep alive while the operation is pending.
enum Local {
    /// Inside the window's registered tensor, at this offset.
    Window(usize),
    Reg(Arc<Registered>, usize),
}

impl WinCore {
    pub(crate) fn new(win: Window, meta: Group, timeout: Duration) -> Arc<WinCore> {
        let (rank, size) = (win.rank(), win.size());
        Arc::new(WinCore {
            win: std::mem::ManuallyDrop::new(RwLock::new(win)),
            live: AtomicUsize::new(0),
            pending: Mutex::new(Vec::new()),
            meta,
            reg: Mutex::new(None),
            rank,
            size,
            timeout,
        })
    }

    fn read_guard(&self) -> std::sync::RwLockReadGuard<'_, Window> {
        self.win.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the window under the read lock: with the GIL held when
    /// `blocking` is false and the lock is free, else with it released.
    pub(crate) fn with<R: Send>(&self, py: Python<'_>, blocking: bool, f: impl FnOnce(&Window) -> R + Send) -> R {
        if !blocking {
            if let Ok(g) = self.win.try_read() {
                return f(&g);
            }
        }
        py.detach(|| f(&self.read_guard()))
    }

    /// Turns a `Work` made under the read lock `_guard` into a `Work`
    /// state: done when it is, else a `WinPending`.
    pub(crate) fn settle(self: &Arc<Self>, work: Work<'_>, mem: Option<Arc<Registered>>) -> State {
        if work.is_completed() {
            return State::Done(work.wait(None).map_err(win_failure));
        }
        // Raised while the read lock is held (the caller's `with`).
        self.live.fetch_add(1, Ordering::AcqRel);
        // SAFETY: only the lifetime changes. The borrows it erases are of
        // `self.win` (kept by the Arc below; never borrowed exclusively
        // while `live` > 0, see the module docs) and of the registration
        // `mem` or the window's own tensor (kept by `_mem`, resp. by the
        // window until an exclusive call). WinPending drops the Work first.
        let work = unsafe { std::mem::transmute::<Work<'_>, Work<'static>>(work) };
        State::Win(WinPending { work: Some(work), core: self.clone(), _mem: mem })
    }

    /// Keeps a weak reference to a pending handle (finished before an
    /// exclusive operation).
    pub(crate) fn track(&self, cell: &Arc<WorkCell>) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.len() >= 64 {
            p.retain(|w| w.strong_count() > 0);
        }
        p.push(Arc::downgrade(cell));
    }

    /// Runs `f` with the window borrowed exclusively, after every pending
    /// operation has finished.
    pub(crate) fn exclusive<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut Window) -> R + Send) -> PyResult<R> {
        let mut f = Some(f);
        loop {
            let cells: Vec<Arc<WorkCell>> = {
                let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                std::mem::take(&mut *p).iter().filter_map(Weak::upgrade).collect()
            };
            for (i, c) in cells.iter().enumerate() {
                // Its result stays in the handle; its error surfaces there.
                if let Err(e) = c.wait(py, None) {
                    if !c.poll() {
                        // Not the operation's error: the wait itself was
                        // interrupted (Ctrl-C). Keep the rest for next time.
                        for c in &cells[i..] {
                            self.track(c);
                        }
                        return Err(e);
                    }
                }
            }
            let r = py.detach(|| {
                let mut w = self.win.write().unwrap_or_else(|e| e.into_inner());
                if self.live.load(Ordering::Acquire) != 0 {
                    return None;
                }
                Some((f.take().expect("called once"))(&mut w))
            });
            if let Some(r) = r {
                return Ok(r);
            }
            // A handle made meanwhile by another thread: finish it too.
            py.detach(std::thread::yield_now);
            py.check_signals()?;
        }
    }

    /// Where the local memory `raw` of an operation is: in the window's
    /// registered tensor, in a published registration, or (`None`) in
    /// memory nothing registers.
    fn locate(&self, w: &Window, raw: Raw) -> Option<Local> {
        if let Some(mem) = w.local_tensor() {
            if mem.contains(raw.ptr, raw.len) {
                return Some(Local::Window(raw.ptr as usize - mem.as_ptr() as usize));
            }
        }
        memory::find(raw.ptr, raw.len).map(|r| {
            let off = r.offset_of(raw.ptr);
            Local::Reg(r, off)
        })
    }

    /// A put of `t` to `dst` at element (torchcomms form) or byte (ctran
    /// form) offset `offset` of `dst`'s registration. `bounded`: a
    /// synchronous call with a timeout of its own, which waits for the
    /// returned state itself ([`finish`](Self::finish)): the put is issued
    /// async, from memory that may stay in use past the call.
    /// A put or get of `elem`s with `peer`'s registered tensor: the same
    /// dtype (its offset counts the peer's elements; torchcomms' NCCLX
    /// window counts the source's, c10d's refuses a mismatch, as this
    /// does). Nothing registered, or a rank outside: the call's own checks
    /// say so.
    pub(crate) fn same_dtype(&self, op: &str, peer: usize, elem: &Elem) -> PyResult<()> {
        let reg = self.reg.lock().unwrap_or_else(|e| e.into_inner());
        match reg.as_ref().and_then(|r| r.peers.get(peer)) {
            Some(m) if m.elem.name != elem.name => Err(PyTypeError::new_err(format!(
                "{op} with rank {peer}: tensor has dtype {}, but rank {peer} registered {}; offsets count the \
                 registered tensor's elements: view the tensor as {} (or register that dtype)",
                elem.name, m.elem.name, m.elem.name
            ))),
            _ => Ok(()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn put(
        self: &Arc<Self>,
        py: Python<'_>,
        t: &Tensor<'_>,
        dst: usize,
        offset: usize,
        async_op: bool,
        bounded: bool,
        sliced: bool,
    ) -> PyResult<State> {
        let raw = t.raw();
        let unified = self.unified(py, dst);
        let (located, signals_mapped) =
            self.with(py, false, |w| (self.locate(w, raw).is_some(), w.signals_mapped(dst)));
        // The GIL is let go whenever the call may wait, async_op or not: a
        // put from memory nothing registers (put_bytes) is complete when it
        // returns, and the window completes a put through the transport
        // before it returns when the peer's signals are mapped (so that a
        // later signal follows it); a large copy into a peer's mapped memory
        // takes a while. It is kept for a small copy, and for an async put
        // that only posts (letting it go and taking it back again can wait a
        // switch interval behind a busy Python thread).
        //
        // `sliced`: a synchronous call without a timeout of its own, whose
        // caller waits for it in slices (`finish`: Ctrl-C interrupts) when
        // it was issued async — which it is when that only posts.
        let posts_async = (async_op || sliced) && !bounded && !unified && located && !signals_mapped;
        let only_posts = posts_async;
        let small_copy = raw.len <= 64 << 10 && unified;
        let blocking = !(small_copy || only_posts);
        // Memory nothing registers, to a SEPARATE peer, for a bounded call:
        // put_bytes cannot be left pending, so the bytes are copied into a
        // registration of their own that the pending put keeps.
        let staged =
            if bounded && !unified && !located { Some(py.detach(|| stage(raw)).map_err(PyErr::from)?) } else { None };
        let issue_async = async_op || bounded || posts_async;
        let core = self.clone();
        self.with(py, blocking, move |w| -> Result<State, Failure> {
            let local = match staged {
                Some(r) => Some(Local::Reg(r, 0)),
                None => core.locate(w, raw),
            };
            match local {
                Some(local) => {
                    let (mem, keep) = local_mem(w, &local);
                    let view: View<'_> = mem.view(local_offset(&local), raw.len).map_err(Failure::from)?;
                    let work = w.put(view, dst, offset, issue_async).map_err(win_failure)?;
                    Ok(core.settle(work, keep))
                }
                None => {
                    // SAFETY: the tensor is alive and not written during
                    // the call (the caller's argument; crate docs); the
                    // copy is done when put_bytes returns.
                    let bytes = unsafe { raw.slice() };
                    w.put_bytes(bytes, dst, offset).map_err(|e| {
                        // The caller called put: name it so.
                        let mut f = win_failure(e);
                        if let Some(rest) = f.msg.strip_prefix("put_bytes ") {
                            f.msg = format!("put {rest}");
                        }
                        f
                    })?;
                    Ok(State::Done(Ok(())))
                }
            }
        })
        .map_err(PyErr::from)
    }

    /// A get into `t` from `src` at element / byte `offset` (`bounded`: as
    /// for [`put`](Self::put)).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn get(
        self: &Arc<Self>,
        py: Python<'_>,
        t: &Tensor<'_>,
        src: usize,
        offset: usize,
        async_op: bool,
        bounded: bool,
        sliced: bool,
    ) -> PyResult<State> {
        let raw = t.raw();
        // As for put: the GIL is kept for a small copy from a mapped peer,
        // and for an async get through the transport (it only posts); a
        // synchronous one (`sliced`) through the transport is issued async
        // too, its caller waiting in slices.
        let unified = self.unified(py, src);
        let only_posts = (async_op || sliced) && !bounded && !unified;
        let small_copy = raw.len <= 64 << 10 && unified;
        let blocking = !(small_copy || only_posts);
        // Memory nothing registers is registered for this one get, kept
        // alive by the tensor's reference until the get is done.
        let extra = {
            let probe = self.with(py, false, |w| self.locate(w, raw).is_some());
            if probe {
                None
            } else {
                // SAFETY: a numpy array or torch tensor (checked by
                // Tensor::new) keeps its memory at one address while
                // referenced; the registration holds the reference.
                let b = unsafe { Borrowed::new(raw.ptr, raw.len, Owner::Py(t.keep())) };
                Some(py.detach(|| Registered::register(b)).map_err(py_err)?)
            }
        };
        let issue_async = async_op || bounded || only_posts;
        let core = self.clone();
        self.with(py, blocking, move |w| -> Result<State, Failure> {
            let local = match extra {
                Some(r) => Local::Reg(r, 0),
                None => core.locate(w, raw).ok_or_else(|| {
                    Failure::new(ErrKind::Comm, "get: the destination's registration went away during the call")
                })?,
            };
            let (mem, keep) = local_mem(w, &local);
            let view: ViewMut<'_> = mem.view_mut(local_offset(&local), raw.len).map_err(Failure::from)?;
            let work = w.get(view, src, offset, issue_async).map_err(win_failure)?;
            Ok(core.settle(work, keep))
        })
        .map_err(PyErr::from)
    }

    /// The handle of a put, get or signal. A synchronous call with a
    /// timeout of its own (`bound`: when the call started, and the
    /// timeout) issued it async; it is waited for here until the timeout
    /// has passed since the start, else `TimeoutError` naming `op` and
    /// `peer` (the operation goes on: the window cannot take it back). A
    /// synchronous call without one (`sliced`) that was issued async is
    /// waited for here until it ends (its own timeout is the window's), in
    /// slices: Ctrl-C interrupts it (it waited inside one detached call).
    pub(crate) fn finish(
        &self,
        py: Python<'_>,
        state: State,
        bound: Option<(Instant, Duration)>,
        op: &str,
        peer: usize,
        sliced: bool,
    ) -> PyResult<crate::work::PyWork> {
        let w = self.handle(state);
        let Some((start, limit)) = bound else {
            if sliced {
                if let Some(r) = w.cell.wait_within(py, None)? {
                    r.map_err(PyErr::from)?;
                }
            }
            return Ok(w);
        };
        match w.cell.wait_within(py, Some(limit.saturating_sub(start.elapsed())))? {
            Some(r) => r.map(|()| w).map_err(PyErr::from),
            None => {
                let what = match op {
                    "put" => "its data may still land, so keep the source unchanged until then",
                    "get" => "the tensor may still be written until then",
                    _ => "the peer may still receive it",
                };
                Err(Failure::new(
                    ErrKind::Timeout,
                    format!(
                        "{op} with rank {peer}: not complete within {limit:?} (this call's timeout); it goes on in \
                         the background until it completes or fails ({what}); a Window's tensor_deregister waits for it"
                    ),
                )
                .into())
            }
        }
    }

    /// Whether `rank`'s memory is mapped here (its operations are copies by
    /// the calling thread: no wait).
    pub(crate) fn unified(&self, py: Python<'_>, rank: usize) -> bool {
        self.with(py, false, |w| w.get_attr(rank).map(|a| a.access_type == AccessType::Unified).unwrap_or(false))
    }

    /// A handle for `state`, tracked when it is pending.
    pub(crate) fn handle(&self, state: State) -> crate::work::PyWork {
        let pending = matches!(state, State::Win(_));
        let w = crate::work::PyWork::of(state);
        if pending {
            self.track(&w.cell);
        }
        w
    }

    /// `wait_signal(peer)` in one step of at most `slice`, of a wait of
    /// `total` ending at `end` (`None`: never, `total` being past the
    /// clock's range).
    pub(crate) fn wait_signal_slice(
        &self,
        peer: usize,
        slice: Duration,
        end: Option<Instant>,
        total: Duration,
    ) -> Option<Result<(), Failure>> {
        let t = step(slice, end);
        match self.read_guard().wait_signal(peer, Some(t)) {
            Ok(()) => Some(Ok(())),
            Err(e) if is_timeout(&e) => passed(end).then(|| Err(signal_timeout(peer, total))),
            Err(e) => Some(Err(win_failure(e))),
        }
    }

    /// `wait_signal(peer)` if a signal is there now; its timeout error
    /// once the wait of `total` ending at `end` has run out.
    pub(crate) fn try_wait_signal(
        &self,
        peer: usize,
        end: Option<Instant>,
        total: Duration,
    ) -> Option<Result<(), Failure>> {
        let w = self.win.try_read().ok()?;
        match w.wait_signal(peer, Some(Duration::ZERO)) {
            Ok(()) => Some(Ok(())),
            Err(e) if is_timeout(&e) => passed(end).then(|| Err(signal_timeout(peer, total))),
            Err(e) => Some(Err(win_failure(e))),
        }
    }

    /// ctran's `wait_signal` in one step of at most `slice`, of a wait of
    /// `total` ending at `end` (`None`: never).
    pub(crate) fn wait_value_slice(
        &self,
        disp: usize,
        value: u64,
        cmp: Cmp,
        slice: Duration,
        end: Option<Instant>,
        total: Duration,
    ) -> Option<Result<(), Failure>> {
        let t = step(slice, end);
        match self.read_guard().wait_signal_until(disp, value, cmp, Some(t)) {
            Ok(()) => Some(Ok(())),
            Err(e) if is_timeout(&e) => {
                passed(end).then(|| Err(value_timeout(&self.read_guard(), disp, value, cmp, total)))
            }
            Err(e) => Some(Err(win_failure(e))),
        }
    }

    /// ctran's `wait_signal` if the comparison holds now; its timeout
    /// error once the wait of `total` ending at `end` has run out.
    pub(crate) fn try_wait_value(
        &self,
        disp: usize,
        value: u64,
        cmp: Cmp,
        end: Option<Instant>,
        total: Duration,
    ) -> Option<Result<(), Failure>> {
        let w = self.win.try_read().ok()?;
        match w.wait_signal_until(disp, value, cmp, Some(Duration::ZERO)) {
            Ok(()) => Some(Ok(())),
            Err(e) if is_timeout(&e) => passed(end).then(|| Err(value_timeout(&w, disp, value, cmp, total))),
            Err(e) => Some(Err(win_failure(e))),
        }
    }

    /// Registers `t` (collective): the window's `tensor_register` of its
    /// bytes with its element size, after every rank's element type and
    /// shape were exchanged.
    pub(crate) fn register(&self, py: Python<'_>, t: &mut Tensor<'_>) -> PyResult<()> {
        if self.reg.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            return Err(PyValueError::new_err("a tensor is registered already; call tensor_deregister first"));
        }
        let raw = t.raw();
        // What this rank offers, or why it cannot: either way it takes its
        // part in the exchange, so that its peers hear of a refusal at once.
        let offer = (|| {
            if t.nbytes == 0 {
                return Err(PyValueError::new_err("tensor: an empty tensor cannot be registered"));
            }
            let shape = t.shape()?;
            let owner = match memory::find(raw.ptr, raw.len) {
                Some(r) => Owner::Mem(r),
                None => Owner::Py(t.keep()),
            };
            // SAFETY: a numpy array or torch tensor (checked by
            // Tensor::new), or an rmacomm allocation, keeps its memory at
            // one address while the owner lives; the registration holds the
            // owner.
            let b = unsafe { Borrowed::new(raw.ptr, raw.len, owner) };
            Ok((t.elem, shape, py.detach(|| RdmaMemory::register(b)).map_err(py_err)?))
        })();
        let (peers, mem) = self.exchange_meta(py, false, offer)?;
        let (elem_size, len) = (t.elem.size, raw.len);
        self.exclusive(py, move |w| w.tensor_register_len(mem, len, elem_size))?.map_err(py_err)?;
        *self.reg.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Reg { tensor: t.keep(), kind: t.kind, peers, device: None, staged: false });
        Ok(())
    }

    /// This rank's part in a `tensor_register` refused before it started
    /// (its argument is no tensor it can register): its peers hear `e` at
    /// once, naming this rank, instead of waiting for it. Returns `e`.
    pub(crate) fn register_refused(&self, py: Python<'_>, e: PyErr) -> PyErr {
        if self.reg.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            // Registered on every rank (registration is collective): no
            // peer is in an exchange.
            return e;
        }
        match self.exchange_meta::<()>(py, false, Err(e)) {
            Err(e) => e,
            Ok(_) => unreachable!("a refused offer never succeeds"),
        }
    }

    /// Every rank's element type and shape (one exchange); every rank must
    /// register the same kind of memory (host or CUDA), else a mismatch
    /// naming them.
    ///
    /// `offer` is this rank's part (its shape, and what the caller goes on
    /// with), or why it has none: a rank whose registration is refused before the exchange
    /// still sends its error, so that its peers raise a `PeerError` naming
    /// it at once instead of waiting for it until the timeout; it raises
    /// its own. Returns the peers' descriptors and the offer.
    pub(crate) fn exchange_meta<T>(
        &self,
        py: Python<'_>,
        cuda: bool,
        offer: PyResult<(&'static Elem, Vec<usize>, T)>,
    ) -> PyResult<(Vec<PeerMeta>, T)> {
        let blob = match &offer {
            Ok((elem, shape, _)) => {
                let dims = shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
                format!("{}\n{dims}\n{}", elem.name, if cuda { "cuda" } else { "cpu" })
            }
            Err(e) => format!("err\n{e}"),
        };
        let all = py.detach(|| self.meta.exchange("tensor_register", blob.as_bytes())).map_err(py_err)?;
        let (_, _, offer) = offer?;
        if let Some((r, why)) = all.iter().enumerate().find_map(|(r, v)| Some((r, v.strip_prefix(b"err\n")?))) {
            let why = String::from_utf8_lossy(why);
            return Err(Failure::new(ErrKind::Peer, format!("tensor_register: rank {r} failed its part: {why}")).into());
        }
        let mut peers = Vec::with_capacity(all.len());
        let mut kinds = Vec::with_capacity(all.len());
        for (r, v) in all.iter().enumerate() {
            let (m, k) =
                parse_meta(v).ok_or_else(|| PyValueError::new_err(format!("rank {r} sent a bad descriptor")))?;
            // A peer's word, used later to size views of its memory: a
            // shape whose byte count wrapped would make a small mapping
            // look large enough for a huge array.
            if array::nbytes(&m.shape, m.elem).is_none() {
                return Err(PyValueError::new_err(format!(
                    "tensor_register: rank {r} sent a descriptor of shape {:?} of {}, whose byte count is past \
                     2**64; check that every rank runs the same rmacomm",
                    m.shape, m.elem.name
                )));
            }
            peers.push(m);
            kinds.push(k);
        }
        if kinds.iter().any(|k| *k != kinds[0]) {
            let detail = kinds.iter().enumerate().map(|(r, k)| format!("rank {r}: {k}")).collect::<Vec<_>>().join(", ");
            return Err(Failure::new(
                ErrKind::Mismatch,
                format!("tensor_register: ranks register different kinds of memory ({detail}); all CUDA or all CPU"),
            )
            .into());
        }
        Ok((peers, offer))
    }

    /// Ends the registration (collective).
    pub(crate) fn deregister(&self, py: Python<'_>) -> PyResult<()> {
        if self.device().is_some() && !self.staged() {
            self.exclusive(py, |w| w.tensor_deregister_device().map(drop))?.map_err(py_err)?;
            // The tensor is let go only now: peers reached it until the
            // deregistration's barrier.
            drop(self.reg.lock().unwrap_or_else(|e| e.into_inner()).take());
            return Ok(());
        }
        let mem = self.exclusive(py, |w| w.tensor_deregister())?.map_err(py_err)?;
        let reg = self.reg.lock().unwrap_or_else(|e| e.into_inner()).take();
        // The memory region, and with it the reference to the tensor, goes
        // here (with the GIL held: the reference is dropped at once).
        drop(mem);
        drop(reg);
        Ok(())
    }

    /// `rank`'s registered tensor as an array of this rank's kind, of the
    /// element type and shape `rank` registered.
    pub(crate) fn map_remote_tensor<'py>(&self, py: Python<'py>, rank: usize) -> PyResult<Bound<'py, PyAny>> {
        let (meta, kind, own) = {
            let reg = self.reg.lock().unwrap_or_else(|e| e.into_inner());
            let reg = reg.as_ref().ok_or_else(|| {
                PyValueError::new_err("map_remote_tensor: no tensor is registered; call tensor_register first")
            })?;
            let meta = reg.peers.get(rank).cloned().ok_or_else(|| {
                PyValueError::new_err(format!("map_remote_tensor: rank {rank} is not in this window of {}", self.size))
            })?;
            (meta, reg.kind, (rank == self.rank).then(|| reg.tensor.clone_ref(py)))
        };
        if let Some(t) = own {
            return Ok(t.into_bound(py));
        }
        if self.device().is_some() && !self.staged() {
            return self.map_remote_cuda(py, rank, &meta);
        }
        // Checked when the descriptor came (exchange_meta); checked again
        // rather than trusted to have been.
        let nbytes = array::nbytes(&meta.shape, meta.elem).ok_or_else(|| {
            PyValueError::new_err(format!("map_remote_tensor: rank {rank}'s shape {:?} is too large", meta.shape))
        })?;
        let (map, ptr) = self.dup(
            py,
            &format!("map_remote_tensor of rank {rank}"),
            |w| w.map_remote_tensor(rank).map(|m| (m.as_ptr() as usize, m.len())),
            nbytes,
        )?;
        array::make(py, ptr, meta.shape, meta.elem, kind, Keep::Peer(map))
    }

    /// A private mapping of `len` bytes of what `f` finds mapped; `what`
    /// (the call and the rank) begins its errors.
    pub(crate) fn dup(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&Window) -> Result<(usize, usize), rmacomm_window::Error> + Send,
        len: usize,
    ) -> PyResult<(DupMapping, *mut u8)> {
        let r = self.with(py, false, |w| -> Result<(DupMapping, usize), Failure> {
            let (ptr, have) = f(w).map_err(win_failure)?;
            if have < len {
                return Err(Failure::new(ErrKind::Argument, format!("{what}: {len} bytes asked, {have} mapped")));
            }
            // SAFETY: `ptr..ptr+len` lies in the window's mapping of the
            // peer's shared segment (or this rank's own segment), which
            // stays mapped while the read lock is held.
            let (m, p) = unsafe { DupMapping::of(ptr as *mut u8, len) }.map_err(|e| {
                Failure::new(ErrKind::Comm, format!("{what}: mapping the peer's memory again failed: {e}"))
            })?;
            Ok((m, p as usize))
        });
        let (m, p) = r?;
        Ok((m, p as *mut u8))
    }
}

/// A per-call `timeout` of a put, get or signal: when the call started and
/// the timeout, for a synchronous call (`finish` waits at most that long);
/// `None` for an async one, whose call does not wait (`Work.wait(timeout=)`
/// bounds its wait), and without a timeout or with one no shorter than the
/// window's (the window's bounds it).
pub(crate) fn sync_bound(
    timeout: Option<&Bound<'_, PyAny>>,
    async_op: bool,
    window_timeout: Duration,
) -> PyResult<Option<(Instant, Duration)>> {
    let limit = crate::timeout::duration(timeout, "timeout")?;
    // One no shorter than the window's bounds nothing more than the
    // window's own (timeout=sys.maxsize: no staging, no detour).
    Ok(limit.filter(|&l| !async_op && l < window_timeout).map(|l| (Instant::now(), l)))
}

/// A registered copy of `raw`, for a put that may stay pending past the
/// call (the caller's tensor is free to change once this returns).
fn stage(raw: Raw) -> Result<Arc<Registered>, Failure> {
    let r = Registered::alloc(raw.len)?;
    // SAFETY: the tensor is alive and not written during the call (the
    // caller's argument; crate docs), as for put_bytes.
    r.mem.write_from(0, unsafe { raw.slice() })?;
    Ok(r)
}

/// The registered memory of a local location, and the registration to
/// keep alive while an operation on it is pending.
fn local_mem<'w>(w: &'w Window, local: &'w Local) -> (&'w RdmaMemory, Option<Arc<Registered>>) {
    match local {
        Local::Window(_) => (w.local_tensor().expect("located in it"), None),
        Local::Reg(r, _) => (&*r.mem, Some(r.clone())),
    }
}

fn local_offset(local: &Local) -> usize {
    match local {
        Local::Window(o) | Local::Reg(_, o) => *o,
    }
}

/// How long one step of a wait ending at `end` (`None`: never) may wait.
fn step(slice: Duration, end: Option<Instant>) -> Duration {
    end.map_or(slice, |end| slice.min(end.saturating_duration_since(Instant::now())))
}

/// The timeout error of `wait_signal(peer)` after `total`.
fn signal_timeout(peer: usize, total: Duration) -> Failure {
    Failure::new(
        ErrKind::Timeout,
        format!(
            "wait_signal with rank {peer}: no signal within {total:?}; check that rank {peer} signals this rank, or \
             raise the timeout"
        ),
    )
}

/// The timeout error of ctran's `wait_signal` (slot `disp` `cmp` `value`)
/// after `total`, saying what the slot holds.
fn value_timeout(w: &Window, disp: usize, value: u64, cmp: Cmp, total: Duration) -> Failure {
    let held = w.read_signal(disp).map(|v| v.to_string()).unwrap_or_else(|_| "?".into());
    Failure::new(
        ErrKind::Timeout,
        format!(
            "wait_signal: slot {disp} {cmp:?} {value} did not hold within {total:?} (it holds {held}); check that \
             the peers signal it, or raise the timeout"
        ),
    )
}

/// Whether a wait ending at `end` (`None`: never) has run out.
fn passed(end: Option<Instant>) -> bool {
    end.is_some_and(|end| Instant::now() >= end)
}

fn is_timeout(e: &rmacomm_window::Error) -> bool {
    matches!(
        e,
        rmacomm_window::Error::Timeout { .. }
            | rmacomm_window::Error::Rma { source: rmacomm_transport::TransportError::Timeout { .. }, .. }
    )
}

fn parse_meta(v: &[u8]) -> Option<(PeerMeta, String)> {
    let text = std::str::from_utf8(v).ok()?;
    let (name, rest) = text.split_once('\n')?;
    let (dims, kind) = rest.split_once('\n')?;
    let shape = if dims.is_empty() {
        Vec::new()
    } else {
        dims.split(',').map(|d| d.parse().ok()).collect::<Option<Vec<usize>>>()?
    };
    Some((PeerMeta { elem: elem::by_name(name)?, shape }, kind.to_string()))
}
