//! `rdma_bench kv`, the parts without I/O: the shapes of a sweep (N blocks
//! of B bytes), where each block goes in the decode side's cache (shuffled
//! slots that never touch, or one contiguous run), the blocks' contents,
//! the default iterations, and the record each shape prints (a table row
//! or one JSON object).

use serde::{Deserialize, Serialize};

use crate::checksum::pattern_chunk;
use crate::size::format_size;
use crate::stats::LatencySummary;

/// The request counts of the default sweep.
pub const SWEEP_BLOCKS: [u64; 3] = [64, 256, 1024];
/// The block sizes of the default sweep.
pub const SWEEP_BLOCK_SIZES: [u64; 4] = [4 << 10, 16 << 10, 256 << 10, 1 << 20];
/// Requests of the default sweep move at most this much (the decode side
/// registers twice as much): 256 × 1 MiB, 1024 × 256 KiB and 1024 × 1 MiB
/// are left out unless asked for.
pub const SWEEP_MAX_BYTES: u64 = 64 << 20;

/// Bytes a shape moves over its measured iterations by default.
pub const KV_BUDGET: u64 = 1 << 30;

/// The shapes to measure: `(blocks, block_size)`. A given `--blocks` or
/// `--block-size` fixes that axis; a missing one sweeps it (capped at
/// [`SWEEP_MAX_BYTES`] a request when either is swept).
pub fn shapes(blocks: Option<u64>, block_size: Option<u64>) -> Vec<(u64, u64)> {
    match (blocks, block_size) {
        (Some(n), Some(b)) => vec![(n, b)],
        _ => {
            let ns: Vec<u64> = blocks.map_or(SWEEP_BLOCKS.to_vec(), |n| vec![n]);
            let bs: Vec<u64> = block_size.map_or(SWEEP_BLOCK_SIZES.to_vec(), |b| vec![b]);
            let mut v: Vec<(u64, u64)> = ns
                .iter()
                .flat_map(|&n| bs.iter().map(move |&b| (n, b)))
                .filter(|&(n, b)| n.checked_mul(b).is_some_and(|t| t <= SWEEP_MAX_BYTES))
                .collect();
            v.sort_by_key(|&(n, b)| (b, n));
            v
        }
    }
}

/// Measured iterations and warm-up of a shape moving `bytes` a request:
/// about [`KV_BUDGET`] (20 ..= 500), a tenth of that to warm up (2 ..= 50),
/// unless `-n` / `--warmup` say otherwise.
pub fn iterations(bytes: u64, iters: Option<u64>, warmup: Option<u64>) -> (u64, u64) {
    let n = iters.unwrap_or_else(|| (KV_BUDGET / bytes.max(1)).clamp(20, 500)).max(1);
    (n, warmup.unwrap_or_else(|| (n / 10).clamp(2, 50)))
}

/// The decode side's slot of each of `blocks` blocks, in a cache of
/// `2 × blocks` slots. Contiguous: slots `0 .. blocks` in order (the agent
/// coalesces the request into one operation). Otherwise the even slots in a
/// shuffled order (seeded): no two blocks land in adjacent slots, so no
/// two pieces coalesce, whatever the local side's layout.
pub fn slots(blocks: u64, contiguous: bool, seed: u64) -> Vec<u64> {
    if contiguous {
        return (0..blocks).collect();
    }
    let mut v: Vec<u64> = (0..blocks).map(|i| 2 * i).collect();
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// The contents of block `b` of round `round`: distinct for every block
/// and round, so a block in the wrong slot or left from an earlier round
/// fails the check.
pub fn fill_block(round: u64, b: u64, out: &mut [u8]) {
    pattern_chunk(round.wrapping_mul(0x1_0000_0001) ^ b.rotate_left(40) ^ 0x6b76, 0, out);
}

/// What a slot no block was written to holds: untouched slots must still
/// hold it after a run.
pub const UNTOUCHED: u8 = 0xee;

/// The direction of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvOp {
    /// Prefill writes its blocks into decode's slots.
    Write,
    /// Prefill reads the blocks from decode's slots.
    Read,
}

impl KvOp {
    /// The name on the command line and in records.
    pub fn name(self) -> &'static str {
        match self {
            KvOp::Write => "write",
            KvOp::Read => "read",
        }
    }
}

/// One measured shape. Keys are fixed: scripts (compare.sh) read them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(non_snake_case)]
pub struct KvRecord {
    /// Always `kv`.
    pub op: String,
    /// `write` or `read`.
    pub kv_op: KvOp,
    /// Blocks in the request (N).
    pub blocks: u64,
    /// Bytes a block (B).
    pub block_bytes: u64,
    /// Bytes a request: N × B.
    pub bytes: u64,
    /// Whether the slots were one contiguous run.
    pub contiguous: bool,
    /// Whether the request carried a notification.
    pub notify: bool,
    /// What `time` runs to: `notification at decode` (transfer called →
    /// decode's application took the notification; one host: one clock),
    /// or `transfer completed` (the request's future resolved at prefill).
    pub until: String,
    /// Operations the agent posted for one request (after coalescing).
    pub ops: u64,
    /// Measured iterations.
    pub iterations: u64,
    /// Fastest, µs.
    pub t_min_us: f64,
    /// Median, µs.
    pub t_median_us: f64,
    /// 90th percentile (nearest rank), µs.
    pub t_p90_us: f64,
    /// 99th percentile (nearest rank), µs.
    pub t_p99_us: f64,
    /// Slowest, µs.
    pub t_max_us: f64,
    /// Median of transfer called → future resolved at prefill, µs (equal to
    /// `t_median_us` when that is what `time` measures).
    pub t_local_median_us: f64,
    /// bytes / median time, GB/s (10^9 B/s).
    pub GBps: f64,
    /// Median time / N, µs.
    pub us_per_block: f64,
    /// Provider (`soft`, `verbs`).
    pub provider: String,
    /// Link between the two agents (`shm`, `tcp`, `hca`).
    pub link: String,
    /// QPs a connection.
    pub qps: u32,
    /// Whether every round's bytes were checked (`--check`); the last
    /// round is checked always.
    pub checked_every_round: bool,
}

/// The settings every record of a run shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvRunInfo {
    /// Write or read.
    pub op: KvOp,
    /// Contiguous slots.
    pub contiguous: bool,
    /// A notification a request.
    pub notify: bool,
    /// Provider used.
    pub provider: String,
    /// Link used.
    pub link: String,
    /// QPs.
    pub qps: u32,
    /// `--check`.
    pub check: bool,
    /// Whether decode's arrival time is on prefill's clock (one host).
    pub one_clock: bool,
}

impl KvRunInfo {
    /// What the time of a request runs to.
    pub fn until(&self) -> &'static str {
        if self.op == KvOp::Write && self.notify && self.one_clock {
            "notification at decode"
        } else {
            "transfer completed"
        }
    }
}

impl KvRecord {
    /// The record of a shape from its times (µs; `local_us`: transfer →
    /// future resolved).
    pub fn new(
        info: &KvRunInfo,
        blocks: u64,
        block_bytes: u64,
        ops: u64,
        s: &LatencySummary,
        local_us: &[f64],
        p90: f64,
    ) -> Self {
        let bytes = blocks * block_bytes;
        let mut l = local_us.to_vec();
        l.sort_by(f64::total_cmp);
        KvRecord {
            op: "kv".into(),
            kv_op: info.op,
            blocks,
            block_bytes,
            bytes,
            contiguous: info.contiguous,
            notify: info.notify,
            until: info.until().into(),
            ops,
            iterations: s.n as u64,
            t_min_us: s.min,
            t_median_us: s.typical,
            t_p90_us: p90,
            t_p99_us: s.p99,
            t_max_us: s.max,
            t_local_median_us: l.get(l.len() / 2).copied().unwrap_or(f64::NAN),
            GBps: bytes as f64 / s.typical / 1e3,
            us_per_block: s.typical / blocks as f64,
            provider: info.provider.clone(),
            link: info.link.clone(),
            qps: info.qps,
            checked_every_round: info.check,
        }
    }

    /// One JSON line.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a record serializes")
    }
}

/// The column headers of the table.
pub fn kv_table_header() -> String {
    format!(
        " {:>6} {:>9} {:>10} {:>6} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>8} {:>9}",
        "blocks",
        "block",
        "request",
        "ops",
        "iters",
        "t_min[us]",
        "t_median",
        "t_p90",
        "t_p99",
        "t_max",
        "GB/s",
        "us/block"
    )
}

/// One table row.
pub fn kv_table_row(r: &KvRecord) -> String {
    format!(
        " {:>6} {:>9} {:>10} {:>6} {:>6} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>8.3} {:>9.3}",
        r.blocks,
        format_size(r.block_bytes),
        format_size(r.bytes),
        r.ops,
        r.iterations,
        r.t_min_us,
        r.t_median_us,
        r.t_p90_us,
        r.t_p99_us,
        r.t_max_us,
        r.GBps,
        r.us_per_block
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::summarize_latency;

    #[test]
    fn the_default_sweep_is_capped() {
        let v = shapes(None, None);
        assert_eq!(v.len(), 9, "{v:?}");
        assert!(v.iter().all(|&(n, b)| n * b <= SWEEP_MAX_BYTES));
        assert!(v.contains(&(64, 1 << 20)) && v.contains(&(1024, 4096)) && v.contains(&(256, 256 << 10)));
        assert!(!v.contains(&(256, 1 << 20)));
        assert_eq!(shapes(Some(3), Some(5)), vec![(3, 5)]);
        // A given size is measured even above the cap.
        assert_eq!(shapes(Some(1024), Some(1 << 20)), vec![(1024, 1 << 20)]);
        assert_eq!(shapes(Some(64), None).len(), 4);
        assert_eq!(shapes(None, Some(16 << 10)).len(), 3);
    }

    #[test]
    fn shuffled_slots_are_distinct_and_never_adjacent() {
        for n in [1u64, 2, 7, 64, 1024] {
            let s = slots(n, false, 42);
            let mut sorted = s.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len() as u64, n);
            assert!(sorted.iter().all(|&x| x < 2 * n));
            assert!(sorted.windows(2).all(|w| w[1] - w[0] >= 2), "{n}: adjacent slots");
            if n >= 64 {
                assert_ne!(s, sorted, "{n}: not shuffled");
            }
        }
        assert_eq!(slots(4, true, 42), vec![0, 1, 2, 3]);
        assert_eq!(slots(64, false, 7), slots(64, false, 7));
    }

    #[test]
    fn blocks_differ_by_round_and_index() {
        let (mut a, mut b, mut c) = ([0u8; 64], [0u8; 64], [0u8; 64]);
        fill_block(1, 2, &mut a);
        fill_block(1, 3, &mut b);
        fill_block(2, 2, &mut c);
        assert!(a != b && a != c && b != c);
        let mut again = [0u8; 64];
        fill_block(1, 2, &mut again);
        assert_eq!(a, again);
    }

    #[test]
    fn default_iterations() {
        assert_eq!(iterations(4 << 20, None, None), (256, 25));
        assert_eq!(iterations(64 << 20, None, None), (20, 2));
        assert_eq!(iterations(256 << 10, None, None), (500, 50));
        assert_eq!(iterations(1, Some(3), Some(0)), (3, 0));
    }

    #[test]
    fn records_compute_rates() {
        let info = KvRunInfo {
            op: KvOp::Write,
            contiguous: false,
            notify: true,
            provider: "soft".into(),
            link: "shm".into(),
            qps: 1,
            check: false,
            one_clock: true,
        };
        let s = summarize_latency(&[1000.0, 2000.0, 3000.0]).unwrap();
        let r = KvRecord::new(&info, 256, 16384, 256, &s, &[900.0, 1900.0, 2900.0], 3000.0);
        assert_eq!((r.bytes, r.t_median_us, r.t_local_median_us), (4 << 20, 2000.0, 1900.0));
        assert!((r.GBps - 4194304.0 / 2000.0 / 1e3).abs() < 1e-9);
        assert!((r.us_per_block - 2000.0 / 256.0).abs() < 1e-9);
        assert_eq!(r.until, "notification at decode");
        let j: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(j["kv_op"], "write");
        assert_eq!(j["op"], "kv");
        assert!(kv_table_row(&r).contains("16 KiB") || kv_table_row(&r).contains("16K"));
        let no_clock = KvRunInfo { one_clock: false, ..info };
        assert_eq!(no_clock.until(), "transfer completed");
    }
}
