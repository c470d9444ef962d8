//! Device-memory windows whose ranks are threads of this process, against
//! rmacomm's CUDA stand-in (`cuda/standin`, loaded through
//! `RMACOMM_CUDA_LIB`): the same-process path (no IPC: the pointer is used
//! as it is), stream-ordered signals, and every misuse refused with an
//! error naming the operation and the rank. What CUDA does on a GPU is the
//! GPU suite's to check (`scripts/gpu_suite.sh`).

use std::sync::{Arc, Once};
use std::time::Duration;

use rmacomm_window::cuda::driver::Context;
use rmacomm_window::{Error, Group, GroupOptions, HashStore, Store, Window, WindowOptions};

/// Points the driver loader at the stand-in; false (with the reason
/// printed) where it is not built.
fn use_standin() -> bool {
    static SET: Once = Once::new();
    let Some(lib) = rmacomm_window::cuda::standin_for_tests() else { return false };
    // Before any thread loads the driver; this binary's tests all use it.
    SET.call_once(|| {
        std::env::set_var("RMACOMM_CUDA_LIB", &lib);
        // No thread a stream waits for may take a driver lock while it
        // waits (the stand-in aborts naming the call: docs/gpu.md).
        std::env::set_var("RMACOMM_STANDIN_STRICT", "1");
        // Two devices (device 0 unless a test says otherwise).
        std::env::set_var("RMACOMM_STANDIN_DEVICES", "2");
    });
    true
}

fn ranks<F>(n: usize, f: F)
where
    F: Fn(usize, Group) + Send + Sync + 'static,
{
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (store, f) = (store.clone(), f.clone());
            std::thread::spawn(move || {
                let g =
                    Group::with_options(rank, n, store, GroupOptions::new().timeout(Duration::from_secs(30))).unwrap();
                f(rank, g)
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

fn window(g: &Group) -> Window {
    Window::new(g, WindowOptions::new().timeout(Duration::from_secs(30))).unwrap()
}

/// Three thread ranks: puts on a stream followed by stream signals, waits
/// on a stream, host signals in between; get; the data checked each round.
#[test]
fn a_device_ring_of_threads_with_stream_ordered_signals() {
    if !use_standin() {
        return;
    }
    ranks(3, |rank, g| {
        let (size, right, left) = (3, (rank + 1) % 3, (rank + 2) % 3);
        let ctx = Context::open_shared(0).unwrap();
        let mut w = window(&g);
        const COUNT: usize = 1000;
        w.tensor_register_device(ctx.alloc_shared(size * COUNT * 8).unwrap(), 8).unwrap();
        let src = ctx.alloc_shared(COUNT * 8).unwrap();
        let stream = ctx.stream().unwrap();
        for it in 0..20u64 {
            let value = |r: usize| (r as u64) << 32 | it;
            src.write_from(0, &value(rank).to_le_bytes().repeat(COUNT)).unwrap();
            if it % 3 == 0 {
                w.device_put(src.all(), right, rank * COUNT, None).unwrap();
                w.signal(right, false).unwrap();
                w.wait_signal(left, None).unwrap();
            } else {
                w.device_put(src.all(), right, rank * COUNT, Some(&stream)).unwrap();
                w.signal_on_stream(right, &stream).unwrap();
                if it % 3 == 1 {
                    w.wait_signal_on_stream(left, &stream).unwrap();
                    stream.synchronize().unwrap();
                } else {
                    // A host wait takes a stream signal too.
                    w.wait_signal(left, None).unwrap();
                    stream.synchronize().unwrap();
                }
            }
            let mut got = vec![0u8; COUNT * 8];
            w.local_device_tensor().unwrap().read_into(left * COUNT * 8, &mut got).unwrap();
            assert_eq!(got, value(left).to_le_bytes().repeat(COUNT), "rank {rank} iteration {it}");
            g.barrier(None).unwrap();
        }
        let back = ctx.alloc_shared(COUNT * 8).unwrap();
        w.device_get(back.all(), right, rank * COUNT, None).unwrap();
        let mut got = vec![0u8; COUNT * 8];
        back.read_into(0, &mut got).unwrap();
        assert_eq!(got, ((rank as u64) << 32 | 19).to_le_bytes().repeat(COUNT));
        assert_eq!(w.get_device(), "cuda");
        assert_eq!(w.map_remote_device(right).unwrap().1, size * COUNT * 8);
        g.barrier(None).unwrap();
        assert!(w.tensor_deregister_device().unwrap().is_some());
        assert_eq!(w.get_device(), "cpu");
    });
}

/// Thread ranks on two GPUs: each puts into the other's memory from its
/// own GPU's stream and signals it there (registration enables peer
/// access between them, which GpuComm's kernels need:
/// `gpu_all_reduce_with_ranks_on_two_gpus`); memory of another device
/// than the context given with it is refused on every rank, naming the
/// rank and both devices.
#[test]
fn device_windows_of_thread_ranks_on_two_gpus() {
    if !use_standin() {
        return;
    }
    ranks(2, |rank, g| {
        let ctx = Context::open_shared(rank as u32).unwrap();
        let mut w = window(&g);
        w.tensor_register_device(ctx.alloc_shared(4096).unwrap(), 8).unwrap();
        let stream = ctx.stream().unwrap();
        let src = ctx.alloc_shared(4096).unwrap();
        src.write_from(0, &[rank as u8 + 1; 4096]).unwrap();
        w.device_put(src.all(), 1 - rank, 0, Some(&stream)).unwrap();
        w.signal_on_stream(1 - rank, &stream).unwrap();
        w.wait_signal_on_stream(1 - rank, &stream).unwrap();
        stream.synchronize().unwrap();
        let mut got = [0u8; 4096];
        w.local_device_tensor().unwrap().read_into(0, &mut got).unwrap();
        assert_eq!(got, [(1 - rank) as u8 + 1; 4096], "rank {rank}");
        g.barrier(None).unwrap();
        w.tensor_deregister_device().unwrap();
        // Rank 1 offers cuda:1 memory with cuda:0's context.
        let other = Context::open_shared(1).unwrap();
        let mem = other.alloc_shared(4096).unwrap();
        let given = if rank == 1 { Context::open_shared(0).unwrap() } else { ctx.clone() };
        let mine = if rank == 1 { mem.ptr() } else { src.ptr() };
        // SAFETY: both buffers outlive the window's registration attempt.
        let e = unsafe { w.tensor_register_device_ptr(given, mine, 4096, 8) }.unwrap_err();
        assert!(
            matches!(e, Error::PeerFailed { peer: 1, .. }) && e.to_string().contains("memory of cuda:1, not of cuda:0"),
            "rank {rank}: {e}"
        );
        g.barrier(None).unwrap();
    });
}

/// A stream wait for a signal that never comes (rank 1 never signals;
/// a 2 s window timeout): the watchdog releases rank 0's stream once the
/// timeout has passed since the wait was queued (its synchronize returns),
/// and the window's later stream operations and host waits fail with the
/// reason instead of taking the poisoned slots for signals.
#[test]
fn a_stream_wait_for_a_signal_that_never_comes_is_released_after_the_timeout() {
    never_comes_after(0);
}

/// More streams than the watchdog has lanes (64), one after another: rank
/// 0 waits for one signal of rank 1 on each of 70 new streams, each run
/// before the next; then a 71st new stream waits for a signal that never
/// comes and is still released after the (2 s) timeout — it takes the lane
/// of a stream that has run all its waits. Before, the 65th stream and every
/// one after were not watched: the last wait hung for good.
#[test]
fn waits_on_more_streams_than_lanes_are_still_watched() {
    never_comes_after(70);
}

/// Rank 0 waits for one signal of rank 1 on each of `streams` new streams
/// (each run before the next), then on one more for a signal that never
/// comes: released after the 2 s timeout (or the process exits, saying
/// so, after 20 s), and the window's later waits fail.
fn never_comes_after(streams: usize) {
    if !use_standin() {
        return;
    }
    ranks(2, move |rank, g| {
        let ctx = Context::open_shared(0).unwrap();
        let mut w = Window::new(&g, WindowOptions::new().timeout(Duration::from_secs(2))).unwrap();
        w.tensor_register_device(ctx.alloc_shared(4096).unwrap(), 8).unwrap();
        if rank == 1 {
            for _ in 0..streams {
                w.signal(0, false).unwrap();
            }
        } else {
            let all: Vec<_> = (0..=streams).map(|_| ctx.stream().unwrap()).collect();
            for s in &all[..streams] {
                w.wait_signal_on_stream(1, s).unwrap();
                s.synchronize().unwrap();
            }
            let last = &all[streams];
            let t0 = std::time::Instant::now();
            w.wait_signal_on_stream(1, last).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::scope(|sc| {
                sc.spawn(|| tx.send(last.synchronize()).unwrap());
                if rx.recv_timeout(Duration::from_secs(20)).is_err() {
                    eprintln!("stream {streams}'s wait was not released in 20 s (not watched)");
                    std::process::exit(1);
                }
            });
            let after = t0.elapsed();
            assert!(after >= Duration::from_millis(1900), "released after {after:?}");
            let e = w.wait_signal_on_stream(1, last).unwrap_err();
            assert!(
                matches!(e, Error::StreamFailed { peer: 1, .. }) && e.to_string().contains("waiting for ranks [1]"),
                "{e}"
            );
            let e = w.wait_signal(1, None).unwrap_err();
            assert!(matches!(e, Error::StreamFailed { .. }), "{e}");
        }
        g.barrier(None).unwrap();
        w.tensor_deregister_device().unwrap();
    });
}

/// What the watchdog must not take for a failure, and what it must pass
/// on (four thread ranks, a 3 s window timeout):
/// - rank 2 drops its window (its connections break) while rank 0's stream
///   waits for rank 1, which signals after 1 s: nothing is released (a
///   peer gone counts only when the work waits for it);
/// - two waits for rank 1 queued at once, signalled 2 s and 4 s later:
///   the second's clock starts when the first is through, so neither is
///   overdue (counted from when it was queued, the second would be);
/// - then rank 0's stream waits for rank 3, which never signals: released
///   after the timeout, and rank 0 marks rank 1, whose window is failed too
///   (its next stream operation refused), though rank 1 itself waited for
///   no one.
#[test]
fn the_watchdog_fails_only_what_waits_and_tells_the_peers() {
    if !use_standin() {
        return;
    }
    ranks(4, |rank, g| {
        let ctx = Context::open_shared(0).unwrap();
        let mut w = Window::new(&g, WindowOptions::new().timeout(Duration::from_secs(3))).unwrap();
        w.tensor_register_device(ctx.alloc_shared(4096).unwrap(), 8).unwrap();
        g.barrier(None).unwrap();
        let stream = ctx.stream().unwrap();
        match rank {
            0 => {
                w.wait_signal_on_stream(1, &stream).unwrap();
                stream.synchronize().unwrap();
                assert!(w.stream_release().released().is_none(), "released for a peer it did not wait for");
                let t0 = std::time::Instant::now();
                w.wait_signal_on_stream(1, &stream).unwrap();
                w.wait_signal_on_stream(1, &stream).unwrap();
                stream.synchronize().unwrap();
                assert!(t0.elapsed() >= Duration::from_millis(3800), "{:?}", t0.elapsed());
                assert!(w.stream_release().released().is_none(), "the second wait was taken for overdue");
                w.wait_signal_on_stream(3, &stream).unwrap();
                stream.synchronize().unwrap();
                let e = w.wait_signal_on_stream(3, &stream).unwrap_err();
                assert!(matches!(e, Error::StreamFailed { .. }) && e.to_string().contains("ranks [3]"), "{e}");
                g.barrier(None).unwrap();
            }
            1 => {
                std::thread::sleep(Duration::from_secs(1));
                w.signal(0, false).unwrap();
                std::thread::sleep(Duration::from_secs(2));
                w.signal(0, false).unwrap();
                std::thread::sleep(Duration::from_secs(2));
                w.signal(0, false).unwrap();
                g.barrier(None).unwrap();
                // Rank 0 released and marked this rank: its window is failed.
                let t0 = std::time::Instant::now();
                while w.stream_release().released().is_none() {
                    assert!(t0.elapsed() < Duration::from_secs(10), "rank 0's release never reached rank 1");
                    std::thread::sleep(Duration::from_millis(5));
                }
                let e = w.wait_signal_on_stream(0, &stream).unwrap_err();
                assert!(matches!(e, Error::StreamFailed { .. }) && e.to_string().contains("rank 0"), "{e}");
            }
            2 => {
                drop(w);
                g.barrier(None).unwrap();
                return;
            }
            _ => {
                // Alive, never signalling; failed once rank 0 marks it.
                g.barrier(None).unwrap();
            }
        }
        drop(w);
    });
}

/// Misuse: operations before registration (stream signals need none: with
/// no device registration they go through the stream proxy, tested
/// below), registering twice or host
/// memory on top, out of bounds, a rank whose pointer is not device memory
/// (every rank fails, naming it), a window whose peers are not UNIFIED.
#[test]
fn device_window_misuse_is_refused_naming_the_operation_and_the_rank() {
    if !use_standin() {
        return;
    }
    ranks(2, |rank, g| {
        let ctx = Context::open_shared(0).unwrap();
        let mut w = window(&g);
        let src = ctx.alloc_shared(64).unwrap();
        let stream = ctx.stream().unwrap();
        for e in [
            w.device_put(src.all(), 1 - rank, 0, None).unwrap_err(),
            w.device_get(src.all(), 1 - rank, 0, None).unwrap_err(),
            w.map_remote_device(0).unwrap_err(),
        ] {
            assert!(
                matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("tensor_register_device"),
                "{e}"
            );
        }
        for e in [w.signal_on_stream(5, &stream).unwrap_err(), w.wait_signal_on_stream(5, &stream).unwrap_err()] {
            assert!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("rank 5"), "{e}");
        }
        // Rank 1 offers an address no allocation holds: both ranks fail,
        // naming rank 1, and nothing is registered.
        let r = if rank == 1 {
            // SAFETY: refused before anything is mapped or written.
            #[allow(unsafe_code)]
            unsafe {
                w.tensor_register_device_ptr(ctx.clone(), 0x1000, 64, 4)
            }
        } else {
            w.tensor_register_device(ctx.alloc_shared(64).unwrap(), 4)
        };
        match r {
            Err(e @ Error::PeerFailed { peer: 1, .. }) => {
                assert!(e.to_string().contains("tensor_register_device"), "{e}")
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        assert!(w.local_device_tensor().is_none());
        // Registered: a second registration of either kind is refused;
        // out of bounds moves nothing.
        w.tensor_register_device(ctx.alloc_shared(256).unwrap(), 4).unwrap();
        let e = w.tensor_register_device(ctx.alloc_shared(64).unwrap(), 4).unwrap_err();
        assert!(e.to_string().contains("registered already"), "{e}");
        let e = w.tensor_register(w.alloc(64).unwrap(), 4).unwrap_err();
        assert!(e.to_string().contains("registered already"), "{e}");
        for (off, len) in [(64, 4), (63, 8), (usize::MAX / 2, 4)] {
            let e = w.device_put(src.view(0, len).unwrap(), 1 - rank, off, None).unwrap_err();
            let m = e.to_string();
            assert!(matches!(e, Error::Bounds { .. }) && m.contains(&format!("rank {}", 1 - rank)), "{m}");
        }
        w.device_put(src.view(0, 8).unwrap(), 1 - rank, 62, None).unwrap();
        g.barrier(None).unwrap();
        w.tensor_deregister_device().unwrap();
        // Peers that are not UNIFIED cannot be reached with device memory.
        let mut sep = Window::new(&g, WindowOptions::new().timeout(Duration::from_secs(30)).unified(false)).unwrap();
        let e = sep.tensor_register_device(ctx.alloc_shared(64).unwrap(), 4).unwrap_err();
        assert!(e.to_string().contains("not a same-host (UNIFIED) peer"), "{e}");
    });
}

/// Device memory through the transport (`Window::alloc_cuda` registered
/// with `tensor_register`): a ring of put + signal / wait_signal and gets,
/// every buffer device memory, between UNIFIED thread ranks (the peers'
/// buffers are not mappable: map_remote_tensor names the rank) and with
/// UNIFIED access off (every peer as on another host).
#[test]
fn device_tensors_through_the_transport() {
    if !use_standin() {
        return;
    }
    for unified in [true, false] {
        ranks(3, move |rank, g| {
            let (right, left) = ((rank + 1) % 3, (rank + 2) % 3);
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified);
            let mut w = Window::new(&g, opts).unwrap();
            const N: usize = (1 << 20) + 12;
            w.tensor_register(w.alloc_cuda(3 * N, 0).unwrap(), 4).unwrap();
            assert!(w.local_tensor().unwrap().device().is_some());
            assert_eq!(w.all_unified(), unified);
            let src = w.alloc_cuda(N, 0).unwrap();
            let back = w.alloc_cuda(N, 0).unwrap();
            // The caller's device memory, registered for the call (as the
            // Python binding does with a torch tensor).
            let ctx = Context::open_shared(0).unwrap();
            let own = ctx.alloc_shared(N).unwrap();
            // SAFETY: `own` outlives the registration (dropped first).
            #[allow(unsafe_code)]
            let own_reg = unsafe { w.register_cuda(own.ptr(), N, 0) }.unwrap();
            let e = w.map_remote_tensor(right).unwrap_err();
            assert!(e.to_string().contains(&format!("rank {right}")), "{e}");
            let data = |r: usize, it: usize| (0..N).map(|i| (i * 7 + r * 31 + it * 3) as u8).collect::<Vec<u8>>();
            for it in 0..4 {
                let from = if it % 2 == 0 { &src } else { &own_reg };
                from.write_from(0, &data(rank, it)).unwrap();
                w.put(from.view(0, N).unwrap(), right, rank * N / 4, it % 2 == 1).unwrap().wait(None).unwrap();
                w.signal(right, false).unwrap();
                w.wait_signal(left, None).unwrap();
                let mut got = vec![0u8; N];
                w.local_tensor().unwrap().read_into(left * N, &mut got).unwrap();
                assert!(got == data(left, it), "rank {rank}, iteration {it}: what rank {left} put");
                // A get of what this rank put into its right neighbour.
                w.get(back.view_mut(0, N).unwrap(), right, rank * N / 4, false).unwrap();
                let mut got = vec![0u8; N];
                back.read_into(0, &mut got).unwrap();
                assert!(got == data(rank, it), "rank {rank}, iteration {it}: get from rank {right}");
                g.barrier(None).unwrap();
            }
            drop(own_reg);
            w.tensor_deregister().unwrap();
        });
    }
}

/// Device memory as the source of a put, and the destination of a get,
/// with a same-host peer whose tensor is host shared memory (mapped here):
/// the host cannot copy device memory itself, so these take the transport
/// (they failed, "the local region is device memory").
#[test]
fn device_sources_and_destinations_with_mapped_host_peers() {
    if !use_standin() {
        return;
    }
    ranks(2, move |rank, g| {
        let peer = 1 - rank;
        let mut w = window(&g);
        const N: usize = (1 << 20) + 12;
        w.tensor_register(w.alloc(2 * N).unwrap(), 1).unwrap();
        assert!(w.local_tensor().unwrap().device().is_none());
        let src = w.alloc_cuda(N, 0).unwrap();
        let back = w.alloc_cuda(N, 0).unwrap();
        let data = |r: usize| (0..N).map(|i| (i * 5 + r * 17) as u8).collect::<Vec<u8>>();
        src.write_from(0, &data(rank)).unwrap();
        for async_op in [false, true] {
            w.put(src.view(0, N).unwrap(), peer, rank * N, async_op).unwrap().wait(None).unwrap();
            w.signal(peer, false).unwrap();
            w.wait_signal(peer, None).unwrap();
            let mut got = vec![0u8; N];
            w.local_tensor().unwrap().read_into(peer * N, &mut got).unwrap();
            assert!(got == data(peer), "rank {rank}: what rank {peer} put (async {async_op})");
            w.get(back.view_mut(0, N).unwrap(), peer, rank * N, async_op).unwrap().wait(None).unwrap();
            let mut got = vec![0u8; N];
            back.read_into(0, &mut got).unwrap();
            assert!(got == data(rank), "rank {rank}: get from rank {peer} (async {async_op})");
            g.barrier(None).unwrap();
        }
        w.tensor_deregister().unwrap();
    });
}

/// A word of host memory the device reads (a gate a stream waits at).
struct Gate {
    _reg: rmacomm_window::cuda::device::HostRegistration,
    mem: rmacomm_transport::RdmaMemory,
    at: u64,
}

impl Gate {
    fn new(w: &Window, ctx: &Arc<Context>) -> Gate {
        let mem = w.alloc(4096).unwrap();
        // SAFETY: the registration is dropped before the memory (`_reg`
        // comes first in the struct).
        #[allow(unsafe_code)]
        let reg = unsafe { ctx.register_host(mem.as_ptr(), mem.len()) }.unwrap();
        let at = reg.device_ptr();
        Gate { _reg: reg, mem, at }
    }

    fn open(&self, value: u64) {
        self.mem.write_from(0, &value.to_le_bytes()).unwrap();
    }
}

/// Stream-ordered put / signal / wait / get with peers the device does not
/// reach itself (device memory registered through the transport), run by
/// the window's stream proxy: with UNIFIED access off (every peer as on
/// another host: transport signals) and on (signals in shared slots). The
/// calls return at once: a put queued behind a closed gate has not run
/// when the gate opens, and work queued after a wait sees the peer's data.
#[test]
fn stream_ordered_operations_through_the_proxy() {
    if !use_standin() {
        return;
    }
    for unified in [false, true] {
        ranks(3, move |rank, g| {
            let (right, left) = ((rank + 1) % 3, (rank + 2) % 3);
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(unified);
            let mut w = Window::new(&g, opts).unwrap();
            const N: usize = (256 << 10) + 12;
            let ctx = Context::open_shared(0).unwrap();
            let mine = ctx.alloc_shared(3 * N).unwrap();
            // SAFETY: `mine` outlives the registration (deregistered below).
            #[allow(unsafe_code)]
            let reg = unsafe { w.register_cuda(mine.ptr(), 3 * N, 0) }.unwrap();
            w.tensor_register(reg, 4).unwrap();
            let src = Arc::new(w.alloc_cuda(N, 0).unwrap());
            let back = Arc::new(w.alloc_cuda(N, 0).unwrap());
            let check = ctx.alloc_shared(N).unwrap();
            let stream = ctx.stream().unwrap();
            let gate = Gate::new(&w, &ctx);
            let data = |r: usize, it: usize| (0..N).map(|i| (i * 5 + r * 17 + it * 3) as u8).collect::<Vec<u8>>();
            for it in 0..6 {
                src.write_from(0, &data(rank, it)).unwrap();
                let gated = it % 2 == 0;
                if gated {
                    // SAFETY: the gate's word, registered while `gate` lives.
                    #[allow(unsafe_code)]
                    unsafe { stream.wait_value64_geq(gate.at, it as u64 + 1) }.unwrap();
                }
                let put = w.put_on_stream(src.clone(), 0, N, right, rank * N / 4, &stream).unwrap();
                w.signal_on_stream(right, &stream).unwrap();
                if gated {
                    std::thread::sleep(Duration::from_millis(30));
                    assert!(!put.is_completed(), "rank {rank}: the put ran before its stream reached it");
                    gate.open(it as u64 + 1);
                }
                put.wait(None).unwrap();
                if it == 3 {
                    // A host wait takes a stream signal.
                    w.wait_signal(left, None).unwrap();
                } else {
                    w.wait_signal_on_stream(left, &stream).unwrap();
                }
                // Queued after the wait: sees what the left neighbour put.
                // SAFETY: both ranges are device memory of this test.
                #[allow(unsafe_code)]
                unsafe { stream.copy_async(check.ptr(), mine.ptr() + (left * N) as u64, N) }.unwrap();
                let got = w.get_on_stream(back.clone(), 0, N, right, rank * N / 4, &stream).unwrap();
                stream.synchronize().unwrap();
                got.wait(None).unwrap();
                let mut seen = vec![0u8; N];
                check.read_into(0, &mut seen).unwrap();
                assert!(seen == data(left, it), "rank {rank}, round {it} (unified {unified}): what rank {left} put");
                back.read_into(0, &mut seen).unwrap();
                assert!(seen == data(rank, it), "rank {rank}, round {it} (unified {unified}): get from rank {right}");
                g.barrier(None).unwrap();
            }
            assert!(w.stream_error().is_none());
            w.tensor_deregister().unwrap();
            drop(mine);
        });
    }
}

/// Stream operations through the proxy that cannot be: out of bounds (an
/// error at once, nothing queued), inside a CUDA graph capture (refused),
/// and a wait for a signal that never comes: the stream is released after
/// the window's timeout, the error names the operation and the peer, and
/// every later stream operation fails with it.
#[test]
fn proxy_misuse_and_failures_are_named_and_never_hold_the_stream() {
    if !use_standin() {
        return;
    }
    for unified in [false, true] {
        ranks(2, move |rank, g| {
            let opts = WindowOptions::new().timeout(Duration::from_secs(1)).unified(unified);
            let mut w = Window::new(&g, opts).unwrap();
            w.tensor_register(w.alloc_cuda(64, 0).unwrap(), 4).unwrap();
            let ctx = Context::open_shared(0).unwrap();
            let stream = ctx.stream().unwrap();
            let src = Arc::new(w.alloc_cuda(64, 0).unwrap());
            let e = w.put_on_stream(src.clone(), 0, 8, 1 - rank, 15, &stream).unwrap_err();
            assert!(matches!(e, Error::Bounds { .. }) && e.to_string().contains(&format!("rank {}", 1 - rank)), "{e}");
            let e = w.get_on_stream(src.clone(), 60, 8, 1 - rank, 0, &stream).unwrap_err();
            assert!(e.to_string().contains("get_on_stream"), "{e}");
            stream.begin_capture().unwrap();
            for e in [
                w.put_on_stream(src.clone(), 0, 8, 1 - rank, 0, &stream).map(drop).unwrap_err(),
                w.signal_on_stream(1 - rank, &stream).unwrap_err(),
                w.wait_signal_on_stream(1 - rank, &stream).unwrap_err(),
            ] {
                assert!(matches!(e, Error::Unsupported { .. }) && e.to_string().contains("CUDA graph"), "{e}");
            }
            drop(stream.end_capture().unwrap());
            g.barrier(None).unwrap();
            if rank == 0 {
                // Rank 1 never signals. A signal queued behind the wait is
                // not sent once the wait failed (rank 1 checks below).
                let start = std::time::Instant::now();
                let wait = w.wait_signal_on_stream_tracked(1, &stream).unwrap();
                let sig = w.signal_on_stream_tracked(1, &stream).unwrap();
                stream.synchronize().unwrap();
                assert!(start.elapsed() >= Duration::from_millis(900), "released before the timeout");
                let m = wait.wait(None).unwrap_err().to_string();
                assert!(m.contains("wait_signal_on_stream") && m.contains("rank 1"), "{m}");
                let e = w.stream_error().expect("the wait's failure is kept");
                assert_eq!(e.to_string(), m);
                let not_sent = sig.wait(None).unwrap_err();
                assert!(matches!(not_sent, Error::StreamFailed { op: "signal_on_stream", peer: 1, .. }), "{not_sent}");
                assert!(not_sent.to_string().contains(&m), "{not_sent}");
                let again = w.put_on_stream(src.clone(), 0, 8, 1, 0, &stream).unwrap_err();
                assert!(matches!(again, Error::StreamFailed { op: "put_on_stream", peer: 1, .. }), "{again}");
            }
            g.barrier(None).unwrap();
            if rank == 1 {
                let e = w.wait_signal(0, Some(Duration::from_millis(300))).unwrap_err();
                assert!(e.to_string().contains("rank 0"), "a signal came after a failed wait: {e}");
            }
            w.tensor_deregister().unwrap();
        });
    }
}

/// Windows made one after another, each running stream-ordered rounds
/// through its proxy and then dropped: each proxy takes over the words of
/// the one before (sequence numbers going on), so the process makes no
/// more blocks of proxy words than it had proxies alive at once (two: one
/// per rank), and the rounds of every window still pair up.
#[test]
fn proxy_words_pass_from_window_to_window() {
    if !use_standin() {
        return;
    }
    let before = rmacomm_window::stream_proxy_blocks();
    ranks(2, |rank, g| {
        let ctx = Context::open_shared(0).unwrap();
        let stream = ctx.stream().unwrap();
        for round in 0..4 {
            let opts = WindowOptions::new().timeout(Duration::from_secs(30)).unified(round % 2 == 0);
            let w = Window::new(&g, opts).unwrap();
            let mut works = Vec::new();
            for _ in 0..3 {
                works.push(w.signal_on_stream_tracked(1 - rank, &stream).unwrap());
                works.push(w.wait_signal_on_stream_tracked(1 - rank, &stream).unwrap());
            }
            stream.synchronize().unwrap();
            for work in works {
                work.wait(None).unwrap();
            }
            assert!(w.stream_error().is_none(), "round {round}: {:?}", w.stream_error());
            g.barrier(None).unwrap();
            drop(w);
            g.barrier(None).unwrap();
        }
    });
    let made = rmacomm_window::stream_proxy_blocks() - before;
    assert!(made <= 2, "{made} blocks of proxy words for 2 ranks' windows made one after another");
}

/// A store that rewrites rank 1's `tensor_register_device` record: its
/// element size (the record's fifth field) becomes `es`.
#[derive(Debug)]
struct ForgedElemSize {
    inner: HashStore,
    es: &'static str,
}

impl Store for ForgedElemSize {
    fn set(&self, key: &str, value: &[u8]) -> rmacomm_window::Result<()> {
        const CALL: &[u8] = b"exchange 'tensor_register_device'";
        let call_len = value.get(..4).map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap()) as usize);
        if key.ends_with("/1") && value.get(4..4 + call_len) == Some(CALL) {
            let text = String::from_utf8_lossy(&value[4 + call_len..]).into_owned();
            let mut f: Vec<&str> = text.split(' ').collect();
            f[4] = self.es;
            let mut forged = value[..4 + call_len].to_vec();
            forged.extend_from_slice(f.join(" ").as_bytes());
            return self.inner.set(key, &forged);
        }
        self.inner.set(key, value)
    }
    fn try_get(&self, key: &str) -> rmacomm_window::Result<Option<Vec<u8>>> {
        self.inner.try_get(key)
    }
    fn multi_get(&self, keys: &[&str], timeout: Duration) -> rmacomm_window::Result<Vec<Vec<u8>>> {
        self.inner.multi_get(keys, timeout)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> rmacomm_window::Result<()> {
        self.inner.wait(keys, timeout)
    }
    fn check(&self, keys: &[&str]) -> rmacomm_window::Result<bool> {
        self.inner.check(keys)
    }
    fn add(&self, key: &str, delta: i64) -> rmacomm_window::Result<i64> {
        self.inner.add(key, delta)
    }
    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> rmacomm_window::Result<Option<Vec<u8>>> {
        self.inner.compare_set(key, expected, desired)
    }
    fn delete(&self, key: &str) -> rmacomm_window::Result<bool> {
        self.inner.delete(key)
    }
}

/// A peer's device descriptor whose element size is 0 (bounds checks
/// divided by it: a panic on the first put that did not fit) or does not
/// divide its length is refused at registration on every rank, naming the
/// rank.
#[test]
fn a_device_descriptor_with_a_bad_element_size_is_refused() {
    if !use_standin() {
        return;
    }
    for es in ["0", "3"] {
        let store: Arc<dyn Store> = Arc::new(ForgedElemSize { inner: HashStore::new(), es });
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let g = Group::with_options(rank, 2, store, GroupOptions::new().timeout(Duration::from_secs(30)))
                        .unwrap();
                    let ctx = Context::open_shared(0).unwrap();
                    let mut w = window(&g);
                    let e = w.tensor_register_device(ctx.alloc_shared(64).unwrap(), 8).unwrap_err();
                    assert!(
                        matches!(e, Error::Protocol(_)) && e.to_string().contains("rank 1 sent a malformed descriptor"),
                        "rank {rank}, element size {es}: {e}"
                    );
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }
}
