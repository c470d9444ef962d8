//! Copies between pageable host memory and device memory through pinned
//! staging buffers, pipelined: while one chunk's DMA runs, the CPU fills
//! (or drains) the other. What a software transport needs to put bytes
//! that arrived on a socket into GPU memory, and to send GPU memory: a
//! copy from pageable memory may return before its DMA ends, one from
//! pinned memory on a stream of its own is complete at the stream's
//! synchronize.

use std::sync::{Arc, Condvar, Mutex};

use crate::device::{HostRegistration, Stream};
use crate::driver::{Context, DevicePtr};
use crate::Result;

/// Bytes per staging chunk (two per stage).
pub const STAGE_CHUNK: usize = 1 << 20;

/// Stages per context: made together, before any copy needs one
/// ([`Staging::new`]), and never more: a copy waits for a free one.
///
/// Making a stage registers host memory (`cuMemHostRegister`), which on a
/// real driver takes a lock of the driver's that a kernel launch holds
/// while it waits for room behind a stream that is itself waiting: a
/// transport engine whose copy made a stage while the stream it serves
/// waited for that copy (a window's stream proxy) hung the process (seen
/// on an H200, driver 580, with torch launching on the waiting stream).
pub const POOL: usize = 4;

/// An anonymous mapping, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Two pinned chunks and a stream for each. Fields drop in order after
/// [`Drop`] drained the streams: streams, registration, mapping.
struct Stage {
    streams: [Stream; 2],
    _reg: HostRegistration,
    map: Mapping,
}

// SAFETY: the pinned buffer is used by one copy at a time (the stage is
// taken out of the pool), and only through raw pointers.
unsafe impl Send for Stage {}

impl Stage {
    fn new(ctx: &Arc<Context>) -> Result<Stage> {
        let len = 2 * STAGE_CHUNK;
        // SAFETY: a fresh private anonymous mapping; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(crate::CudaError::Call {
                lib: "the C library",
                call: "mmap",
                code: 2,
                name: format!("{len} bytes for a staging buffer: {}", std::io::Error::last_os_error()),
            });
        }
        let map = Mapping { ptr: p.cast(), len };
        // SAFETY: the mapping outlives the registration (field order).
        let reg = unsafe { ctx.register_host(map.ptr, len)? };
        Ok(Stage { streams: [ctx.stream()?, ctx.stream()?], _reg: reg, map })
    }

    fn chunk(&self, k: usize) -> *mut u8 {
        // SAFETY: k is 0 or 1; the mapping holds two chunks.
        unsafe { self.map.ptr.add(k * STAGE_CHUNK) }
    }

    /// Waits for both streams (nothing reads or writes the buffer after).
    fn drain(&self) -> Result<()> {
        self.streams[0].synchronize()?;
        self.streams[1].synchronize()
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        // No DMA may still use the buffer when it is unregistered.
        let _ = self.drain();
    }
}

/// Pipelined copies between host memory and one context's device memory
/// through pinned chunks; shareable by threads (each copy takes a stage of
/// its own).
pub struct Staging {
    ctx: Arc<Context>,
    pool: Mutex<Vec<Stage>>,
    /// Where [`copy_device_queue`](Self::copy_device_queue) queues copies
    /// (made with the stages, up front).
    queue: Stream,
    /// Signalled when a stage goes back to the pool.
    freed: Condvar,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staging({})", self.ctx.name())
    }
}

impl Staging {
    /// Copies through `ctx`'s pinned chunks: [`POOL`] stages of two
    /// [`STAGE_CHUNK`]s, made (registered with the device) here, on the
    /// caller's thread — never later, on a thread a stream may be waiting
    /// for ([`POOL`]).
    pub fn new(ctx: Arc<Context>) -> Result<Staging> {
        let stages = (0..POOL).map(|_| Stage::new(&ctx)).collect::<Result<Vec<_>>>()?;
        let queue = ctx.stream()?;
        Ok(Staging { ctx, pool: Mutex::new(stages), queue, freed: Condvar::new() })
    }

    /// Stages free now (for tests and diagnostics: [`POOL`] when no copy
    /// runs).
    pub fn free_stages(&self) -> usize {
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// A free stage, waiting for one while [`POOL`] copies run (each ends
    /// without waiting for anything but its own DMA).
    fn take(&self) -> Stage {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(s) = pool.pop() {
                return s;
            }
            pool = self.freed.wait(pool).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Back to the pool. A copy that failed midway may have left DMA
    /// queued on the stage (`failed`): drained first, errors and all; a
    /// copy that succeeded ended with its streams synchronized.
    fn give(&self, s: Stage, failed: bool) {
        if failed {
            let _ = s.drain();
        }
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        self.freed.notify_one();
    }

    /// Runs `f` with a stage, which goes back to the pool whatever `f`
    /// returns (never dropped: that would unregister host memory, on a
    /// thread a stream may be waiting for, and shrink the pool).
    fn with_stage<T>(&self, f: impl FnOnce(&Stage) -> Result<T>) -> Result<T> {
        let st = self.take();
        let r = f(&st);
        self.give(st, r.is_err());
        r
    }

    /// Copies `src` to device memory at `dst`: complete (for every stream)
    /// when this returns.
    ///
    /// # Safety
    /// `dst..dst + src.len()` must be device memory of this context.
    pub unsafe fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        // SAFETY: a live slice; the destination is the caller's.
        unsafe { self.upload_raw(dst, src.as_ptr(), src.len()) }
    }

    /// [`upload`](Self::upload) from `len` bytes at `src`.
    ///
    /// # Safety
    /// As for `upload`; `src..src + len` readable for the call.
    pub unsafe fn upload_raw(&self, dst: DevicePtr, src: *const u8, len: usize) -> Result<()> {
        self.with_stage(|st| {
            for i in 0..len.div_ceil(STAGE_CHUNK) {
                let (a, b) = (i * STAGE_CHUNK, ((i + 1) * STAGE_CHUNK).min(len));
                let k = i % 2;
                // The chunk's previous copy (two back) has read it.
                st.streams[k].synchronize()?;
                // SAFETY: a pinned chunk of STAGE_CHUNK bytes no copy uses
                // now; the source is the caller's.
                unsafe { std::ptr::copy_nonoverlapping(src.add(a), st.chunk(k), b - a) };
                // SAFETY: pinned source valid until drained (below, or by
                // `give` on an error); the destination is the caller's.
                unsafe { st.streams[k].upload_raw_async(dst + a as u64, st.chunk(k), b - a)? };
            }
            st.drain()
        })
    }

    /// Copies `len` bytes from device address `src` to `dst` (this
    /// context's memory or memory mapped into it), device to device:
    /// complete when this returns.
    ///
    /// # Safety
    /// Both ranges must be device memory valid in this context.
    pub unsafe fn copy_device(&self, dst: DevicePtr, src: DevicePtr, len: usize) -> Result<()> {
        self.with_stage(|st| {
            // SAFETY: the caller's ranges; synchronized below.
            unsafe { st.streams[0].copy_async(dst, src, len)? };
            st.streams[0].synchronize()
        })
    }

    /// Queues a copy of `len` bytes from device address `src` to `dst`
    /// (as [`copy_device`](Self::copy_device)) on this context's copy
    /// queue, one stream shared by every thread: done once a later
    /// [`wait_queued`](Self::wait_queued) returns `Ok`.
    ///
    /// # Safety
    /// Both ranges must be device memory valid in this context until the
    /// wait returns.
    pub unsafe fn copy_device_queue(&self, dst: DevicePtr, src: DevicePtr, len: usize) -> Result<()> {
        // SAFETY: the caller's ranges, valid until its wait.
        unsafe { self.queue.copy_async(dst, src, len) }
    }

    /// Waits for every copy queued so far by
    /// [`copy_device_queue`](Self::copy_device_queue), on any thread.
    pub fn wait_queued(&self) -> Result<()> {
        self.queue.synchronize()
    }

    /// Copies device memory at `src` into `dst`: complete when this
    /// returns.
    ///
    /// # Safety
    /// `src..src + dst.len()` must be device memory of this context.
    pub unsafe fn download(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        // SAFETY: a live exclusive slice; the source is the caller's.
        unsafe { self.download_raw(src, dst.as_mut_ptr(), dst.len()) }
    }

    /// [`download`](Self::download) into `len` bytes at `dst`.
    ///
    /// # Safety
    /// As for `download`; `dst..dst + len` writable for the call and not
    /// borrowed.
    pub unsafe fn download_raw(&self, src: DevicePtr, dst: *mut u8, len: usize) -> Result<()> {
        let n = len.div_ceil(STAGE_CHUNK);
        let span = |i: usize| (i * STAGE_CHUNK, ((i + 1) * STAGE_CHUNK).min(len));
        self.with_stage(|st| {
            for i in 0..=n {
                if i < n {
                    let (a, b) = span(i);
                    // SAFETY: chunk i % 2 was drained into `dst` at step
                    // i - 1 (or is unused); the source is the caller's.
                    unsafe { st.streams[i % 2].download_raw_async(st.chunk(i % 2), src + a as u64, b - a)? };
                }
                if i > 0 {
                    let j = i - 1;
                    st.streams[j % 2].synchronize()?;
                    let (a, b) = span(j);
                    // SAFETY: the chunk holds chunk j's bytes (its stream is
                    // synchronized); `dst` has room (the caller's).
                    unsafe { std::ptr::copy_nonoverlapping(st.chunk(j % 2), dst.add(a), b - a) };
                }
            }
            Ok(())
        })
    }
}
