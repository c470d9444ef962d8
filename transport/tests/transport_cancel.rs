//! Cancelled and timed-out operations: dropping write and read futures, and
//! then their memory, mid-flight never breaks the transport, and a late READ
//! never lands in memory that went back to the allocator.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use common::{contents, pattern};
use ibverbx::soft::{SoftConfig, SoftLink};
use ibverbx::{LoadBalancing, ProviderKind};
use rmacomm_transport::{RdmaMemory, RdmaTransport, TransportConfig, TransportError};

type Op<'a> = Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send + 'a>>;
type Outcome = Poll<Result<(), TransportError>>;

const OPS: usize = 1000;
const SIZES: [usize; 5] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];
/// The peer's buffer: operations land at staggered offsets inside it.
const REMOTE: usize = 16 << 20;
const SENTINEL: u8 = 0xEE;

fn config(link: SoftLink, chaos: Option<u64>) -> TransportConfig {
    let mut soft = SoftConfig::from_env();
    soft.link = link;
    soft.chaos_seed = chaos;
    // Two data QPs and 64 KiB fragments: a 1 MiB operation is 16 fragments,
    // so hundreds of operations leave fragments queued in the planner.
    common::config()
        .with_provider(ProviderKind::Soft)
        .with_soft(Some(soft))
        .with_qps(2)
        .with_load_balancing(LoadBalancing::Dqplb)
        .with_frag_size(64 << 10)
        .with_max_outstanding_per_qp(16)
}

fn poll_once(f: &mut Op<'_>) -> Outcome {
    f.as_mut().poll(&mut Context::from_waker(Waker::noop()))
}

async fn wait_idle(t: &RdmaTransport) {
    let start = Instant::now();
    while t.in_flight() > 0 {
        assert!(start.elapsed() < Duration::from_secs(60), "{} operations never completed", t.in_flight());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn dropped_operations_leave_the_transport_whole(link: SoftLink, chaos: Option<u64>) {
    common::link(if link == SoftLink::Tcp { "tcp" } else { "shm" });
    let cfg = config(link, chaos);
    let (a, b) = common::pair_with(cfg.clone(), cfg).await;
    let remote_mem = RdmaMemory::alloc_for(&b, REMOTE).unwrap();
    remote_mem.write_from(0, &pattern(REMOTE, 1)).unwrap();
    let rb = remote_mem.remote_buffer();
    let slot = |i: usize, n: usize| rb.slice((((i * 37) << 10) % (REMOTE - n)) as u64, n as u64).unwrap();

    // 1000 operations, each with its own memory: every other pair is polled
    // once and then dropped together with its memory; the rest are kept.
    // Read destinations are heap buffers (`Vec`), so the allocator hands
    // their blocks out again once they are free.
    let mut kept: Vec<(Op<'static>, Outcome, usize)> = Vec::new();
    let mut dropped = 0;
    for i in 0..OPS {
        let n = SIZES[i % SIZES.len()];
        let is_read = i % 2 == 1;
        let mem = if is_read {
            RdmaMemory::register_for(&a, vec![0u8; n]).unwrap()
        } else {
            let m = RdmaMemory::alloc_for(&a, n).unwrap();
            m.write_from(0, &pattern(n, i as u64)).unwrap();
            m
        };
        // The future owns its memory: dropping it frees both.
        let (t, remote) = (a.clone(), slot(i, n));
        let mut op: Op<'static> = Box::pin(async move {
            let mem = mem;
            if is_read {
                t.read(mem.view_mut(0, n)?, &remote).await
            } else {
                t.write(mem.view(0, n)?, &remote, false).await
            }
        });
        let first = poll_once(&mut op);
        if (i / 2) % 2 == 0 {
            drop(op);
            dropped += usize::from(first.is_pending());
        } else {
            kept.push((op, first, i));
        }
    }
    // Recycled memory: fresh heap buffers of the dropped reads' sizes, filled
    // with a sentinel; a late READ into a freed destination would show here.
    let recycled: Vec<Vec<u8>> = (0..OPS / 2).map(|i| vec![SENTINEL; SIZES[(2 * i + 1) % SIZES.len()]]).collect();
    for (op, first, i) in kept {
        let r = match first {
            Poll::Ready(r) => r,
            Poll::Pending => op.await,
        };
        r.unwrap_or_else(|e| panic!("kept operation {i} failed: {e}"));
    }
    wait_idle(&a).await;
    assert!(a.connected() && b.connected(), "dropping futures and memory broke the transport");
    for (k, v) in recycled.iter().enumerate() {
        assert!(v.iter().all(|&x| x == SENTINEL), "recycled buffer {k} was written after its memory was freed");
    }
    println!("{link:?} chaos={chaos:?}: {dropped} of {} dropped operations were still pending", OPS / 2);

    // 1000 more operations succeed with verified data: a write of a pattern,
    // then a read of it back, 16 at a time on disjoint slots.
    for batch in 0..OPS / 32 {
        let bufs: Vec<(usize, usize, RdmaMemory, RdmaMemory)> = (0..16)
            .map(|k| {
                let i = batch * 16 + k;
                let n = SIZES[i % SIZES.len()];
                let src = RdmaMemory::alloc_for(&a, n).unwrap();
                src.write_from(0, &pattern(n, 1000 + i as u64)).unwrap();
                (i, n, src, RdmaMemory::register_for(&a, vec![0u8; n]).unwrap())
            })
            .collect();
        let off = |k: usize| (k * (REMOTE / 16)) as u64;
        let writes: Vec<_> = bufs
            .iter()
            .enumerate()
            .map(|(k, (_, n, src, _))| a.write(src.view(0, *n).unwrap(), &rb.slice(off(k), *n as u64).unwrap(), false))
            .collect();
        for r in futures::future::join_all(writes).await {
            r.unwrap();
        }
        let reads: Vec<_> = bufs
            .iter()
            .enumerate()
            .map(|(k, (_, n, _, dst))| a.read(dst.view_mut(0, *n).unwrap(), &rb.slice(off(k), *n as u64).unwrap()))
            .collect();
        for r in futures::future::join_all(reads).await {
            r.unwrap();
        }
        for (k, (i, n, _, dst)) in bufs.iter().enumerate() {
            let want = pattern(*n, 1000 + *i as u64);
            assert!(contents(dst, 0, *n) == want, "operation {i}: the read back differs");
            assert!(contents(&remote_mem, off(k) as usize, *n) == want, "operation {i}: the write differs");
        }
    }
    assert!(a.connected() && b.connected());
    assert_eq!(a.in_flight(), 0);
}

macro_rules! t {
    ($name:ident, $link:expr, $chaos:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            dropped_operations_leave_the_transport_whole($link, $chaos).await;
        }
    };
}

t!(dropped_futures_and_memory_shm, SoftLink::Shm, None);
t!(dropped_futures_and_memory_tcp, SoftLink::Tcp, None);
t!(dropped_futures_and_memory_shm_chaos, SoftLink::Shm, Some(11));
t!(dropped_futures_and_memory_tcp_chaos, SoftLink::Tcp, Some(12));

/// Memory a caller handed over with `keep_alive` (a tensor, an allocation)
/// stays allocated while an operation on it runs, though the caller dropped
/// both its future and its `RdmaMemory`: the provider is still writing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_read_keeps_the_memorys_owner_until_it_completes() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// The allocation, and a flag raised when it goes back.
    struct Owner {
        _buf: Vec<u8>,
        freed: Arc<AtomicBool>,
    }
    impl Drop for Owner {
        fn drop(&mut self) {
            self.freed.store(true, Ordering::SeqCst);
        }
    }

    common::link("tcp");
    let cfg = config(SoftLink::Tcp, None);
    let (a, b) = common::pair_with(cfg.clone(), cfg).await;
    const LEN: usize = 256 << 20;
    let remote_mem = RdmaMemory::alloc_for(&b, LEN).unwrap();
    let mut buf = vec![0u8; LEN];
    let freed = Arc::new(AtomicBool::new(false));
    // SAFETY: the Vec's heap block stays put when the Vec moves into its
    // owner, which the registration keeps (the point of this test).
    let mem = unsafe { RdmaMemory::register_raw_for(&a, buf.as_mut_ptr(), LEN) }
        .unwrap()
        .keep_alive(Owner { _buf: buf, freed: freed.clone() });
    let read = a.read_owned(Arc::new(mem), 0, LEN, &remote_mem.remote_buffer());
    // The caller gives up at once: its future and its last handle go.
    drop(read);
    // The owner goes only with the read's completion, which leaves the
    // pending table first: an owner gone while the read is still pending
    // was freed under the provider.
    let gone = freed.load(Ordering::SeqCst);
    let pending = a.in_flight();
    assert!(!(gone && pending > 0), "the owner was freed while the read was in flight");
    wait_idle(&a).await;
    assert!(freed.load(Ordering::SeqCst), "the owner goes once the read completed");
}

/// `Duration::MAX` as an operation's or a wait's timeout ("never"): both
/// wait, and complete, instead of overflowing the clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_of_duration_max_waits_forever() {
    common::link("tcp");
    let cfg = config(SoftLink::Tcp, None).with_timeout(Some(Duration::MAX));
    let (a, b) = common::pair_with(cfg.clone(), cfg).await;
    const LEN: usize = 8 << 20;
    let src = RdmaMemory::alloc_for(&a, LEN).unwrap();
    let dst = RdmaMemory::alloc_for(&b, LEN).unwrap();
    // Asleep before the write comes: its deadline is taken now.
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { b.wait_for_write_with_timeout(Some(Duration::MAX)).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    a.write_with_timeout(src.view(0, LEN).unwrap(), &dst.remote_buffer(), true, Some(Duration::MAX)).await.unwrap();
    waiter.await.unwrap().unwrap();
    // The transport's own timeout, Duration::MAX too.
    let back = RdmaMemory::alloc_for(&a, LEN).unwrap();
    a.read(back.view_mut(0, LEN).unwrap(), &dst.remote_buffer()).await.unwrap();
}
