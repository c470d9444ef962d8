//! Transports created, connected, used and dropped in a loop keep the
//! process's descriptors, threads and memory flat.
//!
//! 10,000 pairs per link, as the hardening issue asks (10-60 s each on a
//! shared 2-core machine); `--nocapture` shows the series.
//! The counts are compared once asynchronous teardown has settled: while
//! the loop runs, the soft provider still holds the QPs of the last second
//! or so of dropped transports (TCP connections linger up to 5 s), a
//! bounded backlog. `CHURN_FDS=1` prints open descriptors by kind.

mod common;

use std::time::{Duration, Instant};

use rmacomm_transport::RdmaMemory;

/// Descriptors open in this process.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// A field of /proc/self/status (`VmRSS` in KiB, `Threads`).
fn status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Open descriptors by kind (`socket`, `anon_inode:[eventfd]`, `/memfd:…`).
fn fd_kinds() -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let t = std::fs::read_link(e.path()).map(|p| p.display().to_string()).unwrap_or_default();
        let k = t.split(['[', ' ']).next().unwrap_or("").to_owned();
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    iteration: usize,
    fds: usize,
    threads: u64,
    maps: usize,
    /// VmRSS as the kernel reports it.
    rss_kib: u64,
    /// VmRSS after glibc gave its free heap pages back (`malloc_trim`):
    /// what is live, without the allocator's retained free memory, which
    /// grows with the peak of transports awaiting the provider's teardown.
    live_kib: u64,
}

/// Returns glibc's free heap pages to the kernel.
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: malloc_trim only releases free memory of the allocator;
        // it has no preconditions.
        unsafe { malloc_trim(0) };
    }
}

fn sample(iteration: usize) -> Sample {
    let maps = std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count()).unwrap_or(0);
    let rss_kib = status("VmRSS");
    trim_heap();
    Sample { iteration, fds: fds(), threads: status("Threads"), maps, rss_kib, live_kib: status("VmRSS") }
}

/// Waits for asynchronous cleanup (driver tasks ending, the soft provider's
/// tasks letting go of dropped QPs and contexts, which takes it up to about
/// a second) to finish: until the counts stop falling for 1.5 s, or 15 s
/// have passed.
async fn settled(iteration: usize) -> Sample {
    let start = Instant::now();
    let mut last = sample(iteration);
    let mut stable_since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let s = sample(iteration);
        if s.fds < last.fds || s.threads < last.threads {
            stable_since = Instant::now();
        }
        last = s;
        if stable_since.elapsed() > Duration::from_millis(1500) || start.elapsed() > Duration::from_secs(15) {
            return last;
        }
    }
}

async fn churn(link: &str, iterations: usize) {
    common::link(link);
    const WARMUP: usize = 200;
    let src = RdmaMemory::alloc(4096).unwrap();
    let dst = RdmaMemory::alloc(4096).unwrap();
    let mut series = Vec::new();
    let mut base = None;
    let start = Instant::now();
    for i in 1..=iterations {
        let (a, b) = common::pair().await;
        src.write_from(0, &(i as u64).to_le_bytes()).unwrap();
        a.write(src.view(0, 8).unwrap(), &dst.remote_buffer(), true).await.unwrap();
        b.wait_for_write().await.unwrap();
        assert_eq!(common::contents(&dst, 0, 8), (i as u64).to_le_bytes());
        drop((a, b));
        if i == WARMUP {
            let s = settled(i).await;
            base = Some(s);
            series.push(s);
        } else if i % (iterations / 10) == 0 {
            series.push(sample(i));
            if std::env::var_os("CHURN_FDS").is_some() {
                println!("{i}: {:?}", fd_kinds());
            }
        }
    }
    let base = base.expect("more iterations than the warm-up");
    let end = settled(iterations).await;
    series.push(end);
    let el = start.elapsed();
    println!(
        "{link}: {iterations} transport pairs in {el:.1?} ({:.2} ms a pair)",
        el.as_secs_f64() * 1e3 / iterations as f64
    );
    println!("{:>9} {:>5} {:>7} {:>5} {:>9} {:>14}", "iteration", "fds", "threads", "maps", "RSS MiB", "trimmed MiB");
    for s in &series {
        println!(
            "{:>9} {:>5} {:>7} {:>5} {:>9.1} {:>14.1}",
            s.iteration,
            s.fds,
            s.threads,
            s.maps,
            s.rss_kib as f64 / 1024.0,
            s.live_kib as f64 / 1024.0
        );
    }
    assert!(end.fds <= base.fds + 4, "descriptors grew from {} to {}", base.fds, end.fds);
    assert!(end.threads <= base.threads + 2, "threads grew from {} to {}", base.threads, end.threads);
    let grew = end.live_kib.saturating_sub(base.live_kib);
    assert!(grew < 64 << 10, "RSS (trimmed) grew by {} MiB", grew >> 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_10000_shm() {
    churn("shm", 10_000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_10000_tcp() {
    churn("tcp", 10_000).await;
}

/// Transports with settings of their own (here: a chaos seed each) get a
/// device of their own; it closes, progress thread and all, with its last
/// user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_of_dropped_transports_close() {
    common::link("shm");
    let before = settled(0).await;
    for i in 0..50u64 {
        let mut soft = ibverbx::soft::SoftConfig::from_env();
        soft.chaos_seed = Some(1000 + i);
        soft.chaos_max_delay = Duration::ZERO;
        let cfg = common::config().with_soft(Some(soft));
        let (a, b) = common::pair_with(cfg.clone(), cfg).await;
        let (src, dst) = (RdmaMemory::alloc_for(&a, 4096).unwrap(), RdmaMemory::alloc_for(&b, 4096).unwrap());
        a.write(src.view(0, 8).unwrap(), &dst.remote_buffer(), true).await.unwrap();
        b.wait_for_write().await.unwrap();
    }
    let after = settled(50).await;
    println!("before: {before:?}\nafter 50 devices: {after:?}");
    assert!(after.threads <= before.threads, "threads grew from {} to {}", before.threads, after.threads);
    assert!(after.fds <= before.fds + 4, "descriptors grew from {} to {}", before.fds, after.fds);
}
