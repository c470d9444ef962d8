//! Figures from raw timings, as perftest computes them: latency summaries
//! (min, max, typical = median, mean, stdev, 99 % and 99.9 % percentiles)
//! and bandwidth (average, peak over windows of completions, message rate).
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
    /// Best bytes per second over a window of consecutive completions (see
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

/// How many consecutive completions one peak window spans for a run of
/// `n` with `depth` operations in flight: a tenth of the run and at least
/// the depth, so that a burst of completions that arrived together (up to
/// a whole window's worth) does not count as a rate.
pub fn peak_window(n: usize, depth: usize) -> usize {
    (n / 10).max(depth).clamp(1, n.max(1))
}

/// Bandwidth of `bytes`-sized operations from their completion times
/// (seconds since the first post, non-decreasing), `depth` of them in
/// flight at a time. Average: all bytes over the last completion time.
/// Peak: the best rate over any [`peak_window`] consecutive completions
/// (the window starting at time 0 for the first). `None` without
/// completions or with a zero duration.
pub fn summarize_bandwidth(bytes: u64, completions: &[f64], depth: usize) -> Option<BandwidthSummary> {
    let n = completions.len();
    let total = *completions.last()?;
    if total <= 0.0 {
        return None;
    }
    let avg_bps = bytes as f64 * n as f64 / total;
    let k = peak_window(n, depth);
    let mut peak_bps = avg_bps;
    for end in k - 1..n {
        let start = if end + 1 == k { 0.0 } else { completions[end - k] };
        let dt = completions[end] - start;
        if dt > 0.0 {
            peak_bps = peak_bps.max(bytes as f64 * k as f64 / dt);
        }
    }
    Some(BandwidthSummary { iterations: n as u64, avg_bps, peak_bps, msg_rate_mpps: n as f64 / total / 1e6 })
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

    #[test]
    fn steady_bandwidth_has_peak_equal_average() {
        // 100 completions of 1 MB, one every 1 ms: 1 GB/s.
        let t: Vec<f64> = (1..=100).map(|i| i as f64 * 1e-3).collect();
        let s = summarize_bandwidth(1_000_000, &t, 1).unwrap();
        assert_eq!(s.iterations, 100);
        assert!((s.avg_bps - 1e9).abs() < 1.0);
        assert!((s.peak_bps - 1e9).abs() < 1.0);
        assert!((s.msg_rate_mpps - 0.001).abs() < 1e-12);
    }

    #[test]
    fn peak_finds_the_fast_stretch() {
        // 20 completions 1 ms apart, then 10 completions 0.25 ms apart.
        let mut t: Vec<f64> = (1..=20).map(|i| i as f64 * 1e-3).collect();
        t.extend((1..=10).map(|i| 0.020 + i as f64 * 0.25e-3));
        let s = summarize_bandwidth(1000, &t, 1).unwrap();
        assert_eq!(peak_window(30, 1), 3);
        assert_eq!(peak_window(30, 64), 30);
        assert_eq!(peak_window(5000, 64), 500);
        assert_eq!(peak_window(0, 4), 1);
        assert!((s.peak_bps - 1000.0 * 3.0 / 0.75e-3).abs() < 1e-3, "{s:?}");
        assert!(s.peak_bps > s.avg_bps);
    }

    #[test]
    fn bursts_are_averaged_over_the_window() {
        // Completions arriving in simultaneous pairs never give an infinite peak.
        let t = [1e-3, 1e-3, 2e-3, 2e-3];
        let s = summarize_bandwidth(10, &t, 2).unwrap();
        assert!(s.peak_bps.is_finite());
        assert!((s.peak_bps - 2.0 * 10.0 / 1e-3).abs() < 1e-6, "{s:?}");
    }

    #[test]
    fn bandwidth_edge_cases() {
        assert_eq!(summarize_bandwidth(8, &[], 1), None);
        assert_eq!(summarize_bandwidth(8, &[0.0], 1), None);
        let s = summarize_bandwidth(8, &[2.0], 1).unwrap();
        assert_eq!((s.avg_bps, s.peak_bps), (4.0, 4.0));
    }

    #[test]
    fn bidirectional_sums() {
        let a = summarize_bandwidth(100, &[1.0], 1).unwrap();
        let b = summarize_bandwidth(300, &[1.0], 1).unwrap();
        let s = a.plus(b);
        assert_eq!((s.iterations, s.avg_bps, s.peak_bps), (2, 400.0, 400.0));
    }
}
