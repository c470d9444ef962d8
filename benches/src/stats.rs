//! Figures from raw timings, as perftest computes them: latency summaries
//! (min, max, typical = median, mean, stdev, 99 % and 99.9 % percentiles)
//! and bandwidth (average, perftest's peak over windows from a post to a
//! completion, message rate).
//! Pure functions: the runners hand in timestamps, nothing here reads a
//! clock.

/// Bytes in perftest's "MB": 2^20 (its `MB/sec` columns are MiB/s).
pub const MB: f64 = 1_048_576.0;
/// Bytes per second in one Gb/s (perftest's `--report_gbits`: 10^9 bits).
pub const GBIT: f64 = 125_000_000.0;

/// Latency figures in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencySummary {
    /// Samples.
    pub n: usize,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// perftest's "typical": the median, `sorted[n / 2]`.
    pub typical: f64,
    /// Mean.
    pub avg: f64,
    /// Population standard deviation (perftest's).
    pub stdev: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// 99.9th percentile (nearest rank).
    pub p999: f64,
}

/// The nearest-rank percentile `p` (0..=1) of sorted samples: the smallest
/// sample with at least `p * n` samples at or below it.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    assert!(!sorted.is_empty(), "percentile of no samples");
    let rank = (p.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarises latency samples (microseconds); `None` without samples.
pub fn summarize_latency(samples_us: &[f64]) -> Option<LatencySummary> {
    if samples_us.is_empty() {
        return None;
    }
    let mut v = samples_us.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let avg = v.iter().sum::<f64>() / n as f64;
    let var = v.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n as f64;
    Some(LatencySummary {
        n,
        min: v[0],
        max: v[n - 1],
        typical: v[n / 2],
        avg,
        stdev: var.sqrt(),
        p99: percentile(&v, 0.99),
        p999: percentile(&v, 0.999),
    })
}

/// Bandwidth figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BandwidthSummary {
    /// Operations completed.
    pub iterations: u64,
    /// Bytes per second over the whole run (first post to last completion).
    pub avg_bps: f64,
    /// Best bytes per second over a window of operations (see
    /// [`summarize_bandwidth`]); never below `avg_bps`.
    pub peak_bps: f64,
    /// Millions of operations per second over the whole run.
    pub msg_rate_mpps: f64,
}

impl BandwidthSummary {
    /// Both directions of a bidirectional run: figures add up, as
    /// perftest's `-b` reports them.
    pub fn plus(self, o: BandwidthSummary) -> BandwidthSummary {
        BandwidthSummary {
            iterations: self.iterations + o.iterations,
            avg_bps: self.avg_bps + o.avg_bps,
            peak_bps: self.peak_bps + o.peak_bps,
            msg_rate_mpps: self.msg_rate_mpps + o.msg_rate_mpps,
        }
    }
}

/// When each measured operation of a bandwidth run was posted and when each
/// completion was seen, in seconds since the first measured post; both
/// non-decreasing. `completed[k]` is the time of the k-th completion,
/// whichever operation it belongs to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    /// Post times, taken just before each post call.
    pub posted: Vec<f64>,
    /// Completion times, taken when each completion was seen.
    pub completed: Vec<f64>,
}

/// Runs longer than this get the peak from windows whose lengths are powers
/// of two (`n log n` work) instead of every window (`n^2 / 2`).
pub const EXACT_PEAK_MAX: usize = 4096;

/// The best rate in operations per second over any window of operations,
/// as perftest computes its peak: for `i <= j`, `(j - i + 1)` operations
/// over `completed[j] - posted[i]`. At least `j - i + 1` operations were
/// posted and completed inside that interval (at most `i` of the first
/// `j + 1` completions can belong to operations posted before `posted[i]`),
/// so the figure never exceeds what the link moved, however the
/// completions bunch up.
fn peak_ops_per_sec(t: &Timings) -> f64 {
    let n = t.posted.len().min(t.completed.len());
    let mut best = 0.0f64;
    let mut try_window = |i: usize, j: usize| {
        let dt = t.completed[j] - t.posted[i];
        if dt > 0.0 {
            best = best.max((j - i + 1) as f64 / dt);
        }
    };
    if n <= EXACT_PEAK_MAX {
        for i in 0..n {
            for j in i..n {
                try_window(i, j);
            }
        }
    } else {
        let mut len = 1;
        while len <= n {
            for i in 0..=n - len {
                try_window(i, i + len - 1);
            }
            len *= 2;
        }
        try_window(0, n - 1);
    }
    best
}

/// Bandwidth of `bytes`-sized operations. Average: all bytes over the time
/// from the first post to the last completion. Peak: perftest's (see
/// [`Timings`]; the best window, never below the average). `None` without
/// completions or with a zero duration.
pub fn summarize_bandwidth(bytes: u64, t: &Timings) -> Option<BandwidthSummary> {
    let n = t.completed.len();
    let total = *t.completed.last()? - t.posted.first().copied().unwrap_or(0.0);
    if total <= 0.0 {
        return None;
    }
    let avg_ops = n as f64 / total;
    let peak_ops = peak_ops_per_sec(t).max(avg_ops);
    Some(BandwidthSummary {
        iterations: n as u64,
        avg_bps: bytes as f64 * avg_ops,
        peak_bps: bytes as f64 * peak_ops,
        msg_rate_mpps: avg_ops / 1e6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_of_one_to_hundred() {
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = summarize_latency(&v).unwrap();
        assert_eq!(s.n, 100);
        assert_eq!((s.min, s.max), (1.0, 100.0));
        assert_eq!(s.typical, 51.0);
        assert!((s.avg - 50.5).abs() < 1e-12);
        // Population stdev of 1..=100: sqrt((100^2 - 1) / 12).
        assert!((s.stdev - (9999.0f64 / 12.0).sqrt()).abs() < 1e-9);
        assert_eq!(s.p99, 99.0);
        assert_eq!(s.p999, 100.0);
    }

    #[test]
    fn latency_edge_cases() {
        assert_eq!(summarize_latency(&[]), None);
        let s = summarize_latency(&[3.0]).unwrap();
        assert_eq!((s.min, s.max, s.typical, s.avg, s.stdev, s.p99, s.p999), (3.0, 3.0, 3.0, 3.0, 0.0, 3.0, 3.0));
        let s = summarize_latency(&[2.0, 2.0, 2.0, 2.0]).unwrap();
        assert_eq!(s.stdev, 0.0);
    }

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 990.0);
        assert_eq!(percentile(&v, 0.999), 999.0);
        assert_eq!(percentile(&v, 0.5), 500.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 1000.0);
        assert_eq!(percentile(&[7.0, 8.0], 0.99), 8.0);
    }

    /// Operations posted every `gap` seconds, each completing `lat` later.
    fn steady(n: usize, gap: f64, lat: f64) -> Timings {
        let posted: Vec<f64> = (0..n).map(|i| i as f64 * gap).collect();
        let completed = posted.iter().map(|p| p + lat).collect();
        Timings { posted, completed }
    }

    #[test]
    fn steady_bandwidth() {
        // 100 operations of 1 MB, one posted every 1 ms, each done 1 ms later.
        let s = summarize_bandwidth(1_000_000, &steady(100, 1e-3, 1e-3)).unwrap();
        assert_eq!(s.iterations, 100);
        // 100 MB from 0 to 100 ms.
        assert!((s.avg_bps - 1e9).abs() < 1.0, "{s:?}");
        assert!((s.peak_bps - 1e9).abs() < 1.0, "{s:?}");
        assert!((s.msg_rate_mpps - 0.001).abs() < 1e-12);
    }

    #[test]
    fn peak_finds_the_fast_stretch() {
        // 20 operations 1 ms apart, then 10 operations 0.25 ms apart, each
        // done as the next is posted.
        let mut posted: Vec<f64> = (0..20).map(|i| i as f64 * 1e-3).collect();
        posted.extend((0..10).map(|i| 0.020 + i as f64 * 0.25e-3));
        let mut completed: Vec<f64> = posted[1..].to_vec();
        completed.push(0.0225);
        let t = Timings { posted, completed };
        let s = summarize_bandwidth(1000, &t).unwrap();
        // The last 10: posted from 20 ms, done by 22.5 ms: 4000 ops/s.
        assert!((s.peak_bps - 1000.0 * 4000.0).abs() < 1e-3, "{s:?}");
        assert!(s.peak_bps > s.avg_bps);
    }

    #[test]
    fn bunched_completions_never_beat_the_posts() {
        // The posting thread moves the data itself (1 ms per post) and the
        // completions are all seen at the end: the peak is the real rate,
        // not 10 completions over zero time.
        let posted: Vec<f64> = (0..10).map(|i| i as f64 * 1e-3).collect();
        let t = Timings { posted, completed: vec![10e-3; 10] };
        let s = summarize_bandwidth(10, &t).unwrap();
        assert!((s.avg_bps - 10.0 * 1000.0).abs() < 1e-6, "{s:?}");
        assert!((s.peak_bps - 10.0 * 1000.0).abs() < 1e-6, "{s:?}");
    }

    #[test]
    fn long_runs_use_power_of_two_windows() {
        // Past EXACT_PEAK_MAX: a steady run with a fast stretch of 1024.
        let n = EXACT_PEAK_MAX * 2;
        let mut t = steady(n, 1e-3, 1e-3);
        for k in 0..1024 {
            let i = 1000 + k;
            t.posted[i] = t.posted[1000] + k as f64 * 1e-4;
            t.completed[i] = t.posted[i] + 1e-4;
        }
        for i in 2024..n {
            t.posted[i] = t.posted[2023] + (i - 2023) as f64 * 1e-3;
            t.completed[i] = t.posted[i] + 1e-3;
        }
        let s = summarize_bandwidth(1, &t).unwrap();
        assert!((s.peak_bps - 1e4).abs() < 1.0, "{s:?}");
    }

    #[test]
    fn bandwidth_edge_cases() {
        assert_eq!(summarize_bandwidth(8, &Timings::default()), None);
        assert_eq!(summarize_bandwidth(8, &Timings { posted: vec![0.0], completed: vec![0.0] }), None);
        let s = summarize_bandwidth(8, &Timings { posted: vec![0.0], completed: vec![2.0] }).unwrap();
        assert_eq!((s.avg_bps, s.peak_bps), (4.0, 4.0));
    }

    #[test]
    fn bidirectional_sums() {
        let one = Timings { posted: vec![0.0], completed: vec![1.0] };
        let a = summarize_bandwidth(100, &one).unwrap();
        let b = summarize_bandwidth(300, &one).unwrap();
        let s = a.plus(b);
        assert_eq!((s.iterations, s.avg_bps, s.peak_bps), (2, 400.0, 400.0));
    }
}
