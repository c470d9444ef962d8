//! The native backend's GPU all_reduce (`GpuComm`) with ranks as threads,
//! against rmacomm's CUDA stand-in (`cuda/standin`: device memory is host
//! memory, streams are threads, the reduction kernels are emulated on the
//! host by name) and the real NVRTC compiling the real kernels: rmacomm's
//! side of it — chunking through the slots, the share split, the pointer
//! tables, the stream-ordered signal rounds, AVG and PREMUL_SUM through the
//! full kernel — checked against the host's result on every CI run. What
//! the kernels compute on a GPU is `kernels/tests/cuda_kernels.rs`'s (on a
//! GPU); the collective on a GPU is the GPU suite's.

use std::sync::{Arc, Once};
use std::time::Duration;

use rmacomm_collectives::{DType, GpuComm, ReduceOp};
use rmacomm_window::cuda::device::DeviceMemory;
use rmacomm_window::cuda::driver::Context;
use rmacomm_window::{Group, GroupOptions, HashStore, Store};

/// The stand-in and NVRTC, or the reason (printed) they are not here.
fn ready() -> bool {
    static SET: Once = Once::new();
    let expect = |var: &str| std::env::var(var).is_ok_and(|v| v == "1");
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return false };
    if let Err(e) = rmacomm_window::cuda::nvrtc::Nvrtc::get() {
        assert!(!expect("RMACOMM_EXPECT_NVRTC"), "RMACOMM_EXPECT_NVRTC=1 but {e}");
        eprintln!("skipped: no NVRTC to compile the kernels ({e})");
        return false;
    }
    SET.call_once(|| {
        std::env::set_var("RMACOMM_CUDA_LIB", &lib);
        // No thread a stream waits for may make any driver call while it
        // waits (level 2: transport mode's host slots make none; the
        // stand-in aborts naming the call: docs/gpu.md).
        std::env::set_var("RMACOMM_STANDIN_STRICT", "2");
        // Two devices: ranks may sit on either (device 0 unless a test
        // says otherwise).
        std::env::set_var("RMACOMM_STANDIN_DEVICES", "2");
    });
    true
}

/// The host's reduction of one element's contributions.
type Host = fn(&[f32]) -> f32;

fn as_bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    let n = std::mem::size_of_val(v);
    let mut out = vec![0u8; n];
    // SAFETY: plain numbers, copied byte for byte.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr().cast::<u8>(), out.as_mut_ptr(), n) };
    out
}

/// Runs `f(rank, group, ctx, comm, stream)` on three thread ranks, each with
/// a GpuComm of 64 KiB slots, three times: through CUDA IPC (the ranks
/// share a host) with the signals in host memory (the default), again with
/// them in device memory (`RMACOMM_GPU_FLAGS=device`), then in transport
/// mode (what ranks on different hosts get: puts through the window's
/// stream proxy); drops the comm after a barrier (a free synchronizes the
/// whole device: no rank may still be waiting; `f` frees its buffers after
/// a barrier too).
fn three_ranks(f: fn(usize, &Group, &Arc<Context>, &mut GpuComm, &rmacomm_window::cuda::device::Stream)) {
    for (mode, transport) in [("IPC", false), ("IPC, device flags", false), ("transport mode", true)] {
        // Read by every rank's GpuComm::new (the threads of the mode
        // before have ended).
        match mode {
            "IPC, device flags" => std::env::set_var("RMACOMM_GPU_FLAGS", "device"),
            _ => std::env::remove_var("RMACOMM_GPU_FLAGS"),
        }
        thread_ranks(3, mode, move |rank, g, ctx| {
            let (slot, t) = (Some(64 << 10), Duration::from_secs(60));
            let mut c = if transport {
                GpuComm::new_through_transport(&g, ctx.clone(), slot, t).unwrap()
            } else {
                GpuComm::new(&g, ctx.clone(), slot, t).unwrap()
            };
            assert_eq!(c.through_transport(), transport, "{c:?}");
            assert_eq!(c.host_slots(), transport, "{c:?}");
            let stream = ctx.stream().unwrap();
            f(rank, &g, &ctx, &mut c, &stream);
            g.barrier(None).unwrap();
            drop(c);
        });
    }
}

/// Runs `f(rank, group, ctx)` on `n` thread ranks of one group (60 s
/// timeouts), each with device 0's context; panics naming the rank (and
/// `what`) that failed.
fn thread_ranks(n: usize, what: &str, f: impl Fn(usize, Group, Arc<Context>) + Send + Sync + Copy + 'static) {
    thread_ranks_on(n, what, |_| 0, f)
}

/// [`thread_ranks`] with rank `r` on device `gpu(r)`.
fn thread_ranks_on(
    n: usize,
    what: &str,
    gpu: fn(usize) -> u32,
    f: impl Fn(usize, Group, Arc<Context>) + Send + Sync + Copy + 'static,
) {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let opts = GroupOptions::new().timeout(Duration::from_secs(60));
                let g = Group::with_options(rank, n, store, opts).unwrap();
                f(rank, g, Context::open_shared(gpu(rank)).unwrap());
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        assert!(h.join().is_ok(), "rank {rank} failed ({what})");
    }
}

/// Three thread ranks, 64 KiB slots (a 200 KB buffer is four chunks):
/// element counts 1, 1000 and 50,000 × (f32: SUM, MAX, AVG, PREMUL_SUM;
/// i32: SUM, BAND), every rank's result checked.
#[test]
fn gpu_all_reduce_through_the_slots_matches_the_host() {
    if !ready() {
        return;
    }
    three_ranks(|rank, g, ctx, c, stream| {
        let n = 3;
        // Allocated up front and freed after a barrier: a free
        // synchronizes the whole device (the driver's, and the
        // stand-in's), and with ranks as threads of one process
        // another rank's stream may be waiting for this rank's next
        // signal.
        let bufs: Vec<_> = [1usize, 1000, 50_000].iter().map(|e| ctx.alloc_shared(e * 4).unwrap()).collect();
        for (elems, buf) in [1usize, 1000, 50_000].into_iter().zip(&bufs) {
            let f = |r: usize, i: usize| ((r + 1) * 10 + i % 7) as f32;
            let cases: [(ReduceOp, Host); 4] = [
                (ReduceOp::Sum, |v| v.iter().sum()),
                (ReduceOp::Max, |v| v.iter().copied().fold(f32::MIN, f32::max)),
                (ReduceOp::Avg, |v| v.iter().sum::<f32>() / v.len() as f32),
                (ReduceOp::PremulSum(0.5), |v| v.iter().map(|x| x * 0.5).sum()),
            ];
            for (op, want) in cases {
                let x: Vec<f32> = (0..elems).map(|i| f(rank, i)).collect();
                buf.write_from(0, &as_bytes(&x)).unwrap();
                // SAFETY: buf holds elems f32 and outlives the synchronize.
                unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, op, stream) }.unwrap();
                stream.synchronize().unwrap();
                let mut got = vec![0u8; elems * 4];
                buf.read_into(0, &mut got).unwrap();
                let expect: Vec<f32> = (0..elems).map(|i| want(&(0..n).map(|r| f(r, i)).collect::<Vec<_>>())).collect();
                assert_eq!(got, as_bytes(&expect), "rank {rank}: f32 {op:?} of {elems}");
            }
            let y = |r: usize, i: usize| ((r + 1) as i32 * 1000 + i as i32) | 0x100;
            for (op, want) in [(ReduceOp::Sum, 0), (ReduceOp::Band, 1)] {
                let x: Vec<i32> = (0..elems).map(|i| y(rank, i)).collect();
                buf.write_from(0, &as_bytes(&x)).unwrap();
                // SAFETY: as above.
                unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::I32, op, stream) }.unwrap();
                stream.synchronize().unwrap();
                let mut got = vec![0u8; elems * 4];
                buf.read_into(0, &mut got).unwrap();
                let expect: Vec<i32> = (0..elems)
                    .map(|i| {
                        let v = (0..n).map(|r| y(r, i));
                        if want == 0 {
                            v.fold(0i32, i32::wrapping_add)
                        } else {
                            v.fold(-1i32, |a, b| a & b)
                        }
                    })
                    .collect();
                assert_eq!(got, as_bytes(&expect), "rank {rank}: i32 {op:?} of {elems}");
            }
        }
        // A length that is not whole elements is refused.
        // SAFETY: refused before anything is queued.
        let e = unsafe { c.all_reduce(bufs[1].ptr(), 6, DType::F32, ReduceOp::Sum, stream) }.unwrap_err();
        assert!(e.to_string().contains("not whole"), "{e}");
        g.barrier(None).unwrap();
        drop(bufs);
    });
}

/// Ranks of one process on two GPUs (threads, ranks 0 and 2 on device 0,
/// rank 1 on device 1), through CUDA IPC's path for same-process peers:
/// their memory is reached with peer access, which registration enables
/// (the stand-in aborts a kernel that touches another device's memory
/// without it, as a GPU faults), and the all_reduce matches the host's.
#[test]
fn gpu_all_reduce_with_ranks_on_two_gpus() {
    if !ready() {
        return;
    }
    thread_ranks_on(
        3,
        "two GPUs",
        |r| (r % 2) as u32,
        |rank, g, ctx| {
            let c = GpuComm::new(&g, ctx.clone(), Some(64 << 10), Duration::from_secs(60)).unwrap();
            assert!(!c.through_transport(), "{c:?}");
            assert_eq!(ctx.ordinal(), (rank % 2) as i32);
            let (c, buf) = sum_of_three(rank, &ctx, c);
            // The call's end, read from host memory (what a handle polls).
            assert_eq!((c.calls_queued(), c.call_done(1).map(|r| r.is_ok())), (1, Some(true)));
            g.barrier(None).unwrap();
            drop((buf, c));
        },
    );
}

/// An all_reduce (f32 SUM, 50,000 elements: four chunks of the 64 KiB
/// slots) of three ranks' buffers on `c`, checked against the host's sum;
/// gives `c` and the buffer back (free it after a barrier: a free waits for
/// the device, where another thread rank's stream may wait for this one).
fn sum_of_three(rank: usize, ctx: &Arc<Context>, mut c: GpuComm) -> (GpuComm, DeviceMemory) {
    let stream = ctx.stream().unwrap();
    let elems = 50_000;
    let buf = ctx.alloc_shared(elems * 4).unwrap();
    let f = |r: usize, i: usize| ((r + 1) * 10 + i % 7) as f32;
    buf.write_from(0, &as_bytes(&(0..elems).map(|i| f(rank, i)).collect::<Vec<_>>())).unwrap();
    // SAFETY: buf holds elems f32 and outlives the synchronize.
    unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, &stream) }.unwrap();
    stream.synchronize().unwrap();
    let mut got = vec![0u8; elems * 4];
    buf.read_into(0, &mut got).unwrap();
    let expect: Vec<f32> = (0..elems).map(|i| (0..3).map(|r| f(r, i)).sum()).collect();
    assert_eq!(got, as_bytes(&expect), "rank {rank} on cuda:{}", ctx.ordinal());
    (c, buf)
}

/// Thread ranks on two GPUs without peer access between them
/// (`RMACOMM_STANDIN_P2P=0`, in a child process): every rank learns at
/// `GpuComm::new` that some rank cannot reach a peer's slots, and all go
/// through the transport instead (before, `GpuComm::new` failed on every
/// rank); the all_reduce matches the host's.
#[test]
fn gpu_all_reduce_with_ranks_on_two_gpus_without_peer_access() {
    const NAME: &str = "gpu_all_reduce_with_ranks_on_two_gpus_without_peer_access";
    if !ready() {
        return;
    }
    if std::env::var_os("GPU_STANDIN_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture"])
            .env("GPU_STANDIN_CHILD", "1")
            .env("RMACOMM_STANDIN_P2P", "0")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "{NAME} in a child:\n{text}");
        return;
    }
    thread_ranks_on(
        3,
        "two GPUs without peer access",
        |r| (r % 2) as u32,
        |rank, g, ctx| {
            let c = GpuComm::new(&g, ctx.clone(), Some(64 << 10), Duration::from_secs(60)).unwrap();
            assert!(c.through_transport(), "{c:?}");
            let kept = sum_of_three(rank, &ctx, c);
            g.barrier(None).unwrap();
            drop(kept);
        },
    );
}

/// A rank that never makes the call (IPC mode, a 2 s timeout): the
/// watchdog fails rank 0's all_reduce once the timeout has passed since it
/// was queued and releases its stream (its synchronize returns instead of
/// waiting forever; the data is garbage), naming rank 1; every later call
/// fails with it, and the drop returns. Send and recv likewise: a send of
/// three chunks to a rank that never receives.
#[test]
fn a_rank_that_never_calls_is_timed_out_and_the_stream_released() {
    if !ready() {
        return;
    }
    for what in ["all_reduce", "send"] {
        thread_ranks(2, what, move |rank, g, ctx| {
            let t = Duration::from_secs(2);
            let mut c = GpuComm::new(&g, ctx.clone(), Some(64 << 10), t).unwrap();
            let stream = ctx.stream().unwrap();
            let buf = ctx.alloc_shared(200_000).unwrap();
            if rank == 0 {
                let t0 = std::time::Instant::now();
                // SAFETY: buf holds 200 kB (50,000 f32) and outlives the
                // synchronize.
                unsafe {
                    match what {
                        "all_reduce" => c.all_reduce(buf.ptr(), 200_000, DType::F32, ReduceOp::Sum, &stream),
                        _ => c.send(buf.ptr(), 200_000, 1, &stream),
                    }
                }
                .unwrap();
                let (tx, rx) = std::sync::mpsc::channel();
                let s2 = ctx.stream().unwrap();
                let raw = stream.raw();
                let ctx2 = ctx.clone();
                std::thread::spawn(move || {
                    // SAFETY: the stream outlives this (the test waits for
                    // the answer before dropping it).
                    let s = unsafe { rmacomm_window::cuda::device::Stream::from_raw(ctx2, raw) };
                    let _ = tx.send(s.synchronize());
                    drop(s2);
                });
                let synced = rx.recv_timeout(Duration::from_secs(30));
                assert!(matches!(synced, Ok(Ok(()))), "{what}: the stream was not released: {synced:?}");
                let after = t0.elapsed();
                assert!(after >= Duration::from_millis(1900), "{what}: released after {after:?}, before the timeout");
                // SAFETY: refused before anything is queued.
                let e = unsafe { c.all_reduce(buf.ptr(), 4, DType::F32, ReduceOp::Sum, &stream) }.unwrap_err();
                let msg = e.to_string();
                assert!(
                    matches!(&e, rmacomm_collectives::Error::Timeout { missing, .. } if missing == &[1])
                        && msg.contains(what),
                    "{what}: {msg}"
                );
                assert!(matches!(c.call_done(1), Some(Err(_))), "{what}: call 1 is not reported failed");
                eprintln!("{what}: released after {after:?}: {msg}");
            }
            g.barrier(None).unwrap();
            let t0 = std::time::Instant::now();
            drop(c);
            assert!(t0.elapsed() < Duration::from_secs(10), "{what}: the drop took {:?}", t0.elapsed());
            g.barrier(None).unwrap();
            drop(buf);
        });
    }
}

/// Ranks whose slot memory is laid out differently (slot sizes differ)
/// are refused on every rank, naming the other's layout: each rank found a
/// peer's words at its own offsets (past the peer's memory).
#[test]
fn gpu_comms_with_different_slot_sizes_are_refused_on_every_rank() {
    if !ready() {
        return;
    }
    thread_ranks(2, "slot sizes", |rank, g, ctx| {
        let slot = if rank == 0 { 64 << 10 } else { 128 << 10 };
        let e = GpuComm::new(&g, ctx, Some(slot), Duration::from_secs(60)).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, rmacomm_collectives::Error::Mismatch { .. }), "rank {rank}: {e}");
        assert!(s.contains("slot 65536") && s.contains("slot 131072"), "rank {rank}: {s}");
    });
}

/// broadcast, all_gather_single, all_to_all_single and reduce_scatter_single
/// of the native backend on three thread ranks through 64 KiB slots (blocks
/// of 40,000 i32: several chunks each), every rank's result checked.
#[test]
fn gpu_broadcast_gather_all_to_all_and_reduce_scatter_match_the_host() {
    if !ready() {
        return;
    }
    three_ranks(|rank, g, ctx, c, stream| {
        let n = 3;
        let b = 40_000usize; // elements per block
        let (small, big) = (ctx.alloc_shared(b * 4).unwrap(), ctx.alloc_shared(n * b * 4).unwrap());
        let out_big = ctx.alloc_shared(n * b * 4).unwrap();
        let val = |r: usize, i: usize| (r * 1_000_000 + i) as i32;
        let read = |m: &rmacomm_window::cuda::device::DeviceMemory, len: usize| {
            stream.synchronize().unwrap();
            let mut v = vec![0u8; len];
            m.read_into(0, &mut v).unwrap();
            v
        };
        // broadcast from rank 1.
        small.write_from(0, &as_bytes(&(0..b).map(|i| val(rank, i)).collect::<Vec<_>>())).unwrap();
        // SAFETY: every buffer is large enough and outlives the synchronizations.
        unsafe { c.broadcast(small.ptr(), b * 4, 1, stream) }.unwrap();
        assert_eq!(read(&small, b * 4), as_bytes(&(0..b).map(|i| val(1, i)).collect::<Vec<_>>()), "broadcast");
        // all_gather_single.
        small.write_from(0, &as_bytes(&(0..b).map(|i| val(rank, i)).collect::<Vec<_>>())).unwrap();
        // SAFETY: as above.
        unsafe { c.all_gather(out_big.ptr(), small.ptr(), b * 4, stream) }.unwrap();
        let want: Vec<i32> = (0..n).flat_map(|p| (0..b).map(move |i| val(p, i))).collect();
        assert_eq!(read(&out_big, n * b * 4), as_bytes(&want), "rank {rank}: all_gather_single");
        // all_to_all_single: block j of rank r holds val(r * 10 + j, i).
        let inp: Vec<i32> = (0..n).flat_map(|j| (0..b).map(move |i| val(rank * 10 + j, i))).collect();
        big.write_from(0, &as_bytes(&inp)).unwrap();
        // SAFETY: as above.
        unsafe { c.all_to_all(out_big.ptr(), big.ptr(), b * 4, stream) }.unwrap();
        let want: Vec<i32> = (0..n).flat_map(|p| (0..b).map(move |i| val(p * 10 + rank, i))).collect();
        assert_eq!(read(&out_big, n * b * 4), as_bytes(&want), "rank {rank}: all_to_all_single");
        // reduce_scatter_single (SUM): rank j gets sum over r of block j of rank r.
        // SAFETY: as above.
        unsafe { c.reduce_scatter(small.ptr(), big.ptr(), b * 4, DType::I32, ReduceOp::Sum, stream) }.unwrap();
        let want: Vec<i32> =
            (0..b).map(|i| (0..n).map(|r| val(r * 10 + rank, i)).fold(0i32, i32::wrapping_add)).collect();
        assert_eq!(read(&small, b * 4), as_bytes(&want), "rank {rank}: reduce_scatter_single");
        g.barrier(None).unwrap();
        drop((small, big, out_big));
    });
}

/// Calls queued back to back with no host synchronization between them,
/// alternating between two streams: all_reduce (SUM, four chunks each
/// through the 64 KiB slots) and broadcast interleaved, six buffers, every
/// result checked once both streams have run. The slot regions are reused
/// every other chunk with no closing signal round, and a call on the other
/// stream first waits for the previous call: a region overwritten while a
/// peer still reads it, or a stream that ran ahead, shows as a wrong sum.
#[test]
fn gpu_calls_queued_back_to_back_on_two_streams_match_the_host() {
    if !ready() {
        return;
    }
    three_ranks(|rank, g, ctx, c, stream| {
        let n = 3;
        let elems = 50_000usize;
        let other = ctx.stream().unwrap();
        let f = |r: usize, k: usize, i: usize| ((r + 1) * 100 + k * 10 + i % 9) as f32;
        let bufs: Vec<_> = (0..6).map(|_| ctx.alloc_shared(elems * 4).unwrap()).collect();
        for (k, b) in bufs.iter().enumerate() {
            b.write_from(0, &as_bytes(&(0..elems).map(|i| f(rank, k, i)).collect::<Vec<_>>())).unwrap();
        }
        for (k, b) in bufs.iter().enumerate() {
            let s = if k % 2 == 0 { stream } else { &other };
            if k % 3 == 2 {
                // SAFETY: every buffer outlives the synchronizations below.
                unsafe { c.broadcast(b.ptr(), elems * 4, k % n, s) }.unwrap();
            } else {
                // SAFETY: as above.
                unsafe { c.all_reduce(b.ptr(), elems * 4, DType::F32, ReduceOp::Sum, s) }.unwrap();
            }
        }
        stream.synchronize().unwrap();
        other.synchronize().unwrap();
        for (k, b) in bufs.iter().enumerate() {
            let mut got = vec![0u8; elems * 4];
            b.read_into(0, &mut got).unwrap();
            let want: Vec<f32> = (0..elems)
                .map(|i| if k % 3 == 2 { f(k % n, k, i) } else { (0..n).map(|r| f(r, k, i)).sum() })
                .collect();
            assert_eq!(
                got,
                as_bytes(&want),
                "rank {rank}: call {k} ({})",
                if k % 3 == 2 { "broadcast" } else { "all_reduce" }
            );
        }
        g.barrier(None).unwrap();
        drop(other);
        drop(bufs);
    });
}

/// reduce (SUM, f32) to each root in turn through 64 KiB slots (50,000
/// elements: four chunks): the root gets the sum, the others keep their
/// input.
#[test]
fn gpu_reduce_reaches_the_root_only() {
    if !ready() {
        return;
    }
    three_ranks(|rank, g, ctx, c, stream| {
        let n = 3;
        let elems = 50_000usize;
        let buf = ctx.alloc_shared(elems * 4).unwrap();
        let f = |r: usize, i: usize| ((r + 1) * 1000 + i % 11) as f32;
        let mine: Vec<f32> = (0..elems).map(|i| f(rank, i)).collect();
        for root in 0..n {
            buf.write_from(0, &as_bytes(&mine)).unwrap();
            // SAFETY: buf holds elems f32 and outlives the synchronize.
            unsafe { c.reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, root, stream) }.unwrap();
            stream.synchronize().unwrap();
            let mut got = vec![0u8; elems * 4];
            buf.read_into(0, &mut got).unwrap();
            let want: Vec<f32> =
                if rank == root { (0..elems).map(|i| (0..n).map(|r| f(r, i)).sum()).collect() } else { mine.clone() };
            assert_eq!(got, as_bytes(&want), "rank {rank}: reduce to {root}");
        }
        // SAFETY: refused before anything is queued.
        let e = unsafe { c.reduce(buf.ptr(), 4, DType::F32, ReduceOp::Sum, n, stream) }.unwrap_err();
        assert!(e.to_string().contains("root 3"), "{e}");
        g.barrier(None).unwrap();
        drop(buf);
    });
}

/// send / recv of the native backend, through IPC and in transport mode:
/// a ring of 200 KB messages (four 64 KiB chunks: even ranks send first,
/// odd ranks receive first), then every rank sends one chunk-sized message
/// to its right and only then receives (a one-chunk message is buffered),
/// three messages in a row to the same peer with an all_reduce in between,
/// and sends to itself or to no rank refused.
#[test]
fn gpu_send_recv_in_both_modes() {
    if !ready() {
        return;
    }
    three_ranks(|rank, g, ctx, c, stream| {
        let n = 3;
        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        let val = |r: usize, k: usize, i: usize| (r * 1_000_000 + k * 10_000 + i) as i32;
        let big = 50_000usize; // 200 KB of i32
        let out = ctx.alloc_shared(big * 4).unwrap();
        let inp = ctx.alloc_shared(big * 4).unwrap();
        let sum = ctx.alloc_shared(1000 * 4).unwrap();
        let get = |m: &rmacomm_window::cuda::device::DeviceMemory, len: usize| {
            stream.synchronize().unwrap();
            let mut v = vec![0u8; len];
            m.read_into(0, &mut v).unwrap();
            v
        };
        // The ring, several chunks per message.
        inp.write_from(0, &as_bytes(&(0..big).map(|i| val(rank, 0, i)).collect::<Vec<_>>())).unwrap();
        // SAFETY: both buffers hold `big` i32 and outlive the synchronize.
        unsafe {
            if rank.is_multiple_of(2) {
                c.send(inp.ptr(), big * 4, right, stream).unwrap();
                c.recv(out.ptr(), big * 4, left, stream).unwrap();
            } else {
                c.recv(out.ptr(), big * 4, left, stream).unwrap();
                c.send(inp.ptr(), big * 4, right, stream).unwrap();
            }
        }
        assert_eq!(get(&out, big * 4), as_bytes(&(0..big).map(|i| val(left, 0, i)).collect::<Vec<_>>()), "ring");
        // One chunk: every rank sends first (buffered), then receives.
        let one = 16_000usize;
        inp.write_from(0, &as_bytes(&(0..one).map(|i| val(rank, 1, i)).collect::<Vec<_>>())).unwrap();
        // SAFETY: as above.
        unsafe {
            c.send(inp.ptr(), one * 4, right, stream).unwrap();
            c.recv(out.ptr(), one * 4, left, stream).unwrap();
        }
        assert_eq!(get(&out, one * 4), as_bytes(&(0..one).map(|i| val(left, 1, i)).collect::<Vec<_>>()), "one");
        // Three messages in a row from rank 0 to rank 1, an all_reduce of
        // every rank between the second and the third.
        let msgs: Vec<_> = (0..3).map(|_| ctx.alloc_shared(big * 4).unwrap()).collect();
        sum.write_from(0, &as_bytes(&vec![rank as i32 + 1; 1000])).unwrap();
        for (k, m) in msgs.iter().enumerate() {
            if rank == 0 {
                m.write_from(0, &as_bytes(&(0..big).map(|i| val(0, 2 + k, i)).collect::<Vec<_>>())).unwrap();
            }
        }
        for (k, m) in msgs.iter().enumerate() {
            if k == 2 {
                // SAFETY: `sum` holds 1000 i32.
                unsafe { c.all_reduce(sum.ptr(), 4000, DType::I32, ReduceOp::Sum, stream) }.unwrap();
            }
            // SAFETY: every message buffer outlives the synchronize.
            unsafe {
                if rank == 0 {
                    c.send(m.ptr(), big * 4, 1, stream).unwrap();
                } else if rank == 1 {
                    c.recv(m.ptr(), big * 4, 0, stream).unwrap();
                }
            }
        }
        stream.synchronize().unwrap();
        if rank == 1 {
            for (k, m) in msgs.iter().enumerate() {
                assert_eq!(get(m, big * 4), as_bytes(&(0..big).map(|i| val(0, 2 + k, i)).collect::<Vec<_>>()), "{k}");
            }
        }
        assert_eq!(get(&sum, 4000), as_bytes(&vec![6i32; 1000]), "all_reduce between the messages");
        for bad in [rank, n] {
            // SAFETY: refused before anything is queued.
            let e = unsafe { c.send(inp.ptr(), 4, bad, stream) }.unwrap_err();
            assert!(e.to_string().contains(&format!("rank {bad} is not a peer")), "{e}");
            // SAFETY: as above.
            let e = unsafe { c.recv(inp.ptr(), 4, bad, stream) }.unwrap_err();
            assert!(e.to_string().contains("recv"), "{e}");
        }
        g.barrier(None).unwrap();
        drop((out, inp, sum, msgs));
    });
}

/// A call that fails midway stops the communicator: in transport mode,
/// rank 0 queues an all_reduce of thousands of tiny chunks while rank 1
/// never joins it, so the proxy's operations pile up behind the first
/// exchange until the window's timeout; the call fails, the stream is
/// released, and the next call fails saying the communicator stopped.
#[test]
fn gpu_call_failing_midway_stops_the_communicator() {
    if !ready() {
        return;
    }
    thread_ranks(2, "a call failing midway", |rank, g, ctx| {
        let mut c = GpuComm::new_through_transport(&g, ctx.clone(), Some(4096), Duration::from_secs(2)).unwrap();
        let stream = ctx.stream().unwrap();
        let buf = ctx.alloc_shared(4 << 20).unwrap();
        if rank == 0 {
            // SAFETY: buf holds 4 MiB and outlives the synchronize.
            let e = unsafe { c.all_reduce(buf.ptr(), 4 << 20, DType::F32, ReduceOp::Sum, &stream) };
            assert!(e.is_err(), "an all_reduce rank 1 never joined succeeded");
            // SAFETY: as above.
            let again = unsafe { c.all_reduce(buf.ptr(), 64, DType::F32, ReduceOp::Sum, &stream) }.unwrap_err();
            assert!(again.to_string().contains("stopped when an earlier call failed midway"), "{again}");
            // SAFETY: as above.
            let again = unsafe { c.send(buf.ptr(), 64, 1, &stream) }.unwrap_err();
            assert!(again.to_string().contains("stopped"), "{again}");
            stream.synchronize().unwrap();
        }
        g.barrier(None).unwrap();
        drop(c);
        g.barrier(None).unwrap();
        drop(buf);
    });
}

/// CUDA graphs: in IPC mode collectives captured into a graph replay
/// correctly (the signal kernels count on the device: every replay
/// signals and waits again) — an all_reduce of one chunk, one of three
/// (odd: padded to an even number of uses), a broadcast and send/recv
/// rings of one chunk and of three, replayed four times with new inputs,
/// eager calls in between, every result checked; in transport mode (the
/// stream proxy is not capturable) a collective under capture is refused
/// before anything is queued, and the next call, outside it, runs.
#[test]
fn gpu_collectives_captured_in_a_graph_replay_correctly_or_are_refused() {
    if ready() {
        three_ranks(captured_and_replayed);
    }
}

fn captured_and_replayed(
    rank: usize,
    g: &Group,
    ctx: &Arc<Context>,
    c: &mut GpuComm,
    stream: &rmacomm_window::cuda::device::Stream,
) {
    {
        let n = 3;
        let (small, odd, bc, eager) = (64usize, 40_000usize, 1000usize, 500usize);
        // 4..8: send/recv rings of one chunk (64 KiB slots) and of three.
        let sizes = [small, odd, bc, eager, bc, bc, odd, odd];
        let bufs: Vec<_> = sizes.iter().map(|e| ctx.alloc_shared(e * 4).unwrap()).collect();
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let ring_val = |r: usize, i: usize, k: usize| (r * 100_000 + i + 7 * k) as f32;
        let ring_fill = |b: usize, elems: usize, k: usize| {
            let x: Vec<f32> = (0..elems).map(|i| ring_val(rank, i, k)).collect();
            bufs[b].write_from(0, &as_bytes(&x)).unwrap();
        };
        let ring_check = |b: usize, elems: usize, k: usize, what: &str| {
            let mut got = vec![0u8; elems * 4];
            bufs[b].read_into(0, &mut got).unwrap();
            let want: Vec<f32> = (0..elems).map(|i| ring_val(prev, i, k)).collect();
            assert_eq!(got, as_bytes(&want), "rank {rank}: {what}");
        };
        // A ring: one chunk from buffer a into b, three from c into d (even
        // ranks send first: a send of several chunks waits for its receiver).
        let ring = |c: &mut GpuComm, (a, b, cc, d): (usize, usize, usize, usize)| -> Result<(), _> {
            // SAFETY: as below.
            unsafe { c.send(bufs[a].ptr(), bc * 4, next, stream) }?;
            // SAFETY: as below.
            unsafe { c.recv(bufs[b].ptr(), bc * 4, prev, stream) }?;
            if rank.is_multiple_of(2) {
                // SAFETY: as below.
                unsafe { c.send(bufs[cc].ptr(), odd * 4, next, stream) }?;
                // SAFETY: as below.
                unsafe { c.recv(bufs[d].ptr(), odd * 4, prev, stream) }
            } else {
                // SAFETY: as below.
                unsafe { c.recv(bufs[d].ptr(), odd * 4, prev, stream) }?;
                // SAFETY: as below.
                unsafe { c.send(bufs[cc].ptr(), odd * 4, next, stream) }
            }
        };
        let val = |r: usize, i: usize, k: usize| ((r + 1) * 10 + i % 5 + 100 * k) as f32;
        let fill = |b: usize, elems: usize, k: usize| {
            let x: Vec<f32> = (0..elems).map(|i| val(rank, i, k)).collect();
            bufs[b].write_from(0, &as_bytes(&x)).unwrap();
        };
        let check_sum = |b: usize, elems: usize, k: usize, what: &str| {
            let mut got = vec![0u8; elems * 4];
            bufs[b].read_into(0, &mut got).unwrap();
            let want: Vec<f32> = (0..elems).map(|i| (0..n).map(|r| val(r, i, k)).sum()).collect();
            assert_eq!(got, as_bytes(&want), "rank {rank}: {what}");
        };
        // An eager call first: the capture starts from the other region.
        fill(3, eager, 0);
        // SAFETY: each buffer holds its elements and outlives the
        // synchronizes (so below); a graph replays the addresses captured.
        unsafe { c.all_reduce(bufs[3].ptr(), eager * 4, DType::F32, ReduceOp::Sum, stream) }.unwrap();
        stream.synchronize().unwrap();
        check_sum(3, eager, 0, "eager all_reduce before the capture");
        stream.begin_capture().unwrap();
        let captured = (|| {
            // SAFETY: as above.
            unsafe { c.all_reduce(bufs[0].ptr(), small * 4, DType::F32, ReduceOp::Sum, stream) }?;
            // SAFETY: as above.
            unsafe { c.all_reduce(bufs[1].ptr(), odd * 4, DType::F32, ReduceOp::Sum, stream) }?;
            // SAFETY: as above.
            unsafe { c.broadcast(bufs[2].ptr(), bc * 4, 1, stream) }?;
            ring(c, (4, 5, 6, 7))
        })();
        let graph = stream.end_capture().unwrap();
        if c.through_transport() {
            let e = captured.unwrap_err();
            assert!(e.to_string().contains("capturing a CUDA graph"), "{e}");
            drop(graph);
            fill(3, eager, 1);
            // SAFETY: as above.
            unsafe { c.all_reduce(bufs[3].ptr(), eager * 4, DType::F32, ReduceOp::Sum, stream) }.unwrap();
            stream.synchronize().unwrap();
            check_sum(3, eager, 1, "transport mode: eager all_reduce after a refused capture");
            g.barrier(None).unwrap();
            return;
        }
        captured.unwrap();
        for k in 1..5 {
            fill(0, small, k);
            fill(1, odd, k);
            let b: Vec<f32> = (0..bc).map(|i| (rank * 1000 + i + k) as f32).collect();
            bufs[2].write_from(0, &as_bytes(&b)).unwrap();
            ring_fill(4, bc, k);
            ring_fill(6, odd, k);
            // SAFETY: as above.
            unsafe { graph.launch(stream) }.unwrap();
            stream.synchronize().unwrap();
            check_sum(0, small, k, &format!("replay {k}: all_reduce of one chunk"));
            check_sum(1, odd, k, &format!("replay {k}: all_reduce of three chunks"));
            let mut got = vec![0u8; bc * 4];
            bufs[2].read_into(0, &mut got).unwrap();
            let want: Vec<f32> = (0..bc).map(|i| (1000 + i + k) as f32).collect();
            assert_eq!(got, as_bytes(&want), "rank {rank}: replay {k}: broadcast from rank 1");
            ring_check(5, bc, k, &format!("replay {k}: send/recv ring of one chunk"));
            ring_check(7, odd, k, &format!("replay {k}: send/recv ring of three chunks"));
            // Eager calls between replays (the signal kernels now).
            ring_fill(4, bc, k + 50);
            ring_fill(6, odd, k + 50);
            ring(c, (4, 5, 6, 7)).unwrap();
            stream.synchronize().unwrap();
            ring_check(5, bc, k + 50, &format!("eager send/recv ring of one chunk after replay {k}"));
            ring_check(7, odd, k + 50, &format!("eager send/recv ring of three chunks after replay {k}"));
            fill(3, eager, k);
            // SAFETY: as above.
            unsafe { c.all_reduce(bufs[3].ptr(), eager * 4, DType::F32, ReduceOp::Sum, stream) }.unwrap();
            stream.synchronize().unwrap();
            check_sum(3, eager, k, &format!("eager all_reduce after replay {k}"));
        }
        drop(graph);
        g.barrier(None).unwrap();
    }
}

/// A device without 64-bit stream memory operations (the stand-in refuses
/// them under `RMACOMM_STANDIN_NO_MEMOPS=1`, as such a driver does): in
/// IPC mode the signal kernels stand in from the start (exchange,
/// send/recv, the calls' `done` word), the pointer tables are uploaded,
/// and all_reduce, broadcast and a send/recv ring match the host, on one
/// stream and then another; transport mode (whose stream proxy waits on
/// them) is refused at construction, naming what is missing.
#[test]
fn gpu_collectives_without_stream_memory_operations() {
    if !ready() {
        return;
    }
    std::env::set_var("RMACOMM_STANDIN_NO_MEMOPS", "1");
    thread_ranks(3, "no stream memory operations", |rank, g, ctx| {
        let n = 3;
        assert!(!ctx.stream_mem_ops().unwrap());
        let t = Duration::from_secs(60);
        let e = GpuComm::new_through_transport(&g, ctx.clone(), Some(64 << 10), t).unwrap_err();
        assert!(e.to_string().contains("stream memory operations"), "{e}");
        let mut c = GpuComm::new(&g, ctx.clone(), Some(64 << 10), t).unwrap();
        let (s1, s2) = (ctx.stream().unwrap(), ctx.stream().unwrap());
        let elems = 40_000usize;
        let (buf, a, b) =
            (ctx.alloc_shared(elems * 4).unwrap(), ctx.alloc_shared(4000).unwrap(), ctx.alloc_shared(4000).unwrap());
        for (k, stream) in [&s1, &s2, &s1].into_iter().enumerate() {
            let x: Vec<f32> = (0..elems).map(|i| (rank * 10 + i % 7 + k) as f32).collect();
            buf.write_from(0, &as_bytes(&x)).unwrap();
            // SAFETY: buf holds elems f32 and outlives the synchronize.
            unsafe { c.all_reduce(buf.ptr(), elems * 4, DType::F32, ReduceOp::Sum, stream) }.unwrap();
            stream.synchronize().unwrap();
            let mut got = vec![0u8; elems * 4];
            buf.read_into(0, &mut got).unwrap();
            let want: Vec<f32> = (0..elems).map(|i| (0..n).map(|r| (r * 10 + i % 7 + k) as f32).sum()).collect();
            assert_eq!(got, as_bytes(&want), "rank {rank}: all_reduce {k}");
            let y: Vec<f32> = (0..1000).map(|i| (rank * 1000 + i + k) as f32).collect();
            a.write_from(0, &as_bytes(&y)).unwrap();
            // SAFETY: a holds 1000 f32 and outlives the synchronize.
            unsafe { c.broadcast(a.ptr(), 4000, 2, stream) }.unwrap();
            // SAFETY: a and b hold 1000 f32 and outlive the synchronize.
            unsafe { c.send(a.ptr(), 4000, (rank + 1) % n, stream) }.unwrap();
            // SAFETY: as above.
            unsafe { c.recv(b.ptr(), 4000, (rank + n - 1) % n, stream) }.unwrap();
            stream.synchronize().unwrap();
            let mut got = vec![0u8; 4000];
            b.read_into(0, &mut got).unwrap();
            let want: Vec<f32> = (0..1000).map(|i| (2000 + i + k) as f32).collect();
            assert_eq!(got, as_bytes(&want), "rank {rank}: broadcast then send/recv {k}");
        }
        g.barrier(None).unwrap();
        drop(c);
        g.barrier(None).unwrap();
    });
}

/// PREMUL_SUM with a different factor on every rank (rank r weighs its
/// input by r + 1): Σ fᵣ·xᵣ on every rank, as NCCL and the host collectives
/// give — all_reduce, reduce_scatter_single and reduce's root. (The rank
/// reducing a share used to apply its own factor to the whole sum.)
#[test]
fn gpu_premul_sum_takes_each_ranks_own_factor() {
    if !ready() {
        return;
    }
    three_ranks(|rank, g, ctx, c, stream| {
        let (n, b) = (3usize, 30_000usize);
        let (small, big) = (ctx.alloc_shared(b * 4).unwrap(), ctx.alloc_shared(n * b * 4).unwrap());
        let read = |m: &rmacomm_window::cuda::device::DeviceMemory, len: usize| {
            stream.synchronize().unwrap();
            let mut v = vec![0u8; len];
            m.read_into(0, &mut v).unwrap();
            v
        };
        // The first element that differs (not the whole buffer).
        let check = |got: Vec<u8>, want: &[f32], what: &str| {
            let got: Vec<f32> = got.chunks(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect();
            if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                panic!("rank {rank}: {what}: element {i} is {}, want {}", got[i], want[i]);
            }
        };
        let x = |r: usize, i: usize| (r + 1 + i % 5) as f32;
        let op = ReduceOp::PremulSum((rank + 1) as f64);
        let want = |i: usize| (0..n).map(|r| (r + 1) as f32 * x(r, i)).sum::<f32>();
        big.write_from(0, &as_bytes(&(0..n * b).map(|i| x(rank, i)).collect::<Vec<_>>())).unwrap();
        // SAFETY: every buffer is large enough and outlives the synchronizations.
        unsafe { c.all_reduce(big.ptr(), n * b * 4, DType::F32, op, stream) }.unwrap();
        let expect: Vec<f32> = (0..n * b).map(want).collect();
        check(read(&big, n * b * 4), &expect, "all_reduce");
        big.write_from(0, &as_bytes(&(0..n * b).map(|i| x(rank, i)).collect::<Vec<_>>())).unwrap();
        // SAFETY: as above.
        unsafe { c.reduce_scatter(small.ptr(), big.ptr(), b * 4, DType::F32, op, stream) }.unwrap();
        let expect: Vec<f32> = (0..b).map(|i| want(rank * b + i)).collect();
        check(read(&small, b * 4), &expect, "reduce_scatter_single");
        let mine: Vec<f32> = (0..b).map(|i| x(rank, i)).collect();
        small.write_from(0, &as_bytes(&mine)).unwrap();
        // SAFETY: as above.
        unsafe { c.reduce(small.ptr(), b * 4, DType::F32, op, 0, stream) }.unwrap();
        let got = read(&small, b * 4);
        if rank == 0 {
            check(got, &(0..b).map(want).collect::<Vec<_>>(), "reduce at the root");
        }
        g.barrier(None).unwrap();
        drop((small, big));
    });
}
