//! The collective operations `rdma_bench` measures, and nccl-tests'
//! arithmetic for them: what "size" and "count" mean per operation, which
//! sizes a sweep can use with N ranks, and the bus-bandwidth factor.
//!
//! Sans-IO: the run itself is `coll_run`.

use rmacomm_collectives::{DType, ReduceOp};

/// A measured collective of `rmacomm_collectives::Comm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coll {
    /// `all_reduce` in place.
    AllReduce,
    /// `all_gather_single`: each rank's `size / n` bytes to every rank.
    AllGather,
    /// `reduce_scatter_single`: `size` bytes in, `size / n` out.
    ReduceScatter,
    /// `all_to_all_single`: `size` bytes in and out, `size / n` per peer.
    AllToAll,
    /// `broadcast` of `size` bytes from the root.
    Broadcast,
}

impl Coll {
    /// Every collective, in the order the docs list them.
    pub const ALL: [Coll; 5] = [Coll::AllReduce, Coll::AllGather, Coll::ReduceScatter, Coll::AllToAll, Coll::Broadcast];

    /// The name on the command line and in records.
    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::AllGather => "all_gather",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllToAll => "all_to_all",
            Coll::Broadcast => "broadcast",
        }
    }

    /// Whether the operation reduces (takes `--op`).
    pub fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::ReduceScatter)
    }

    /// Whether the operation has a root (takes `--root`).
    pub fn rooted(self) -> bool {
        self == Coll::Broadcast
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks: busbw = algbw ×
    /// factor, so that busbw is comparable with the link's speed whatever
    /// the rank count (all_reduce 2(n−1)/n; all_gather, reduce_scatter and
    /// all_to_all (n−1)/n; broadcast 1).
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Coll::AllReduce => 2.0 * (n - 1.0) / n,
            Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll => (n - 1.0) / n,
            Coll::Broadcast => 1.0,
        }
    }

    /// Whether `size` is split into `n` per-rank blocks.
    fn blocked(self) -> bool {
        matches!(self, Coll::AllGather | Coll::ReduceScatter | Coll::AllToAll)
    }

    /// The granule every size must be a multiple of: one element, or one
    /// element per rank where the buffer is cut into per-rank blocks.
    pub fn unit(self, dtype: DType, n: usize) -> u64 {
        let e = dtype.size() as u64;
        if self.blocked() {
            e * n.max(1) as u64
        } else {
            e
        }
    }

    /// nccl-tests' "count": elements of the per-call parameter (the whole
    /// buffer for all_reduce and broadcast; one rank's block for
    /// all_gather, reduce_scatter and all_to_all).
    pub fn count(self, size: u64, dtype: DType, n: usize) -> u64 {
        let elems = size / dtype.size() as u64;
        if self.blocked() {
            elems / n.max(1) as u64
        } else {
            elems
        }
    }

    /// Bytes of (input, output) each rank passes for `size` (nccl-tests'
    /// size: the larger of the two).
    pub fn buffers(self, size: usize, n: usize) -> (usize, usize) {
        let n = n.max(1);
        match self {
            Coll::AllReduce | Coll::Broadcast | Coll::AllToAll => (size, size),
            Coll::AllGather => (size / n, size),
            Coll::ReduceScatter => (size, size / n),
        }
    }
}

/// What `--op` means for a collective: `None` for those that do not reduce.
pub fn redop_name(coll: Coll, op: ReduceOp) -> Option<String> {
    coll.reduces().then(|| match op {
        ReduceOp::PremulSum(f) => format!("premul_sum:{f}"),
        op => op.name().to_owned(),
    })
}

/// Parses `--op`: torch's names (`sum`, `prod`, `min`, `max`, `avg`,
/// `band`, `bor`, `bxor`) and `premul_sum:FACTOR`.
pub fn parse_redop(s: &str) -> Result<ReduceOp, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    if let Some(rest) = lower.strip_prefix("premul_sum").or_else(|| lower.strip_prefix("premulsum")) {
        let f = rest.trim_start_matches([':', '=', '(']).trim_end_matches(')');
        return f.parse::<f64>().map(ReduceOp::PremulSum).map_err(|_| {
            format!("{s:?}: premul_sum needs its factor, e.g. premul_sum:2 (the inputs are multiplied by it)")
        });
    }
    t.parse::<ReduceOp>()
        .map_err(|e| format!("{e}; expected sum, prod, min, max, avg, band, bor, bxor or premul_sum:FACTOR"))
}

/// Parses `--dtype` (`f32`, `float32`, `bf16`, `torch.int64`, ...).
pub fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse::<DType>().map_err(|e| format!("{e}; expected f32, f64, f16, bf16, i8, u8, i32 or i64"))
}

/// The sizes of a sweep (`-a`) for `coll` with `n` ranks: the powers of
/// two from `min` to `max`, each rounded down to a multiple of the unit
/// (nccl-tests does the same) and at least one unit, without repeats.
pub fn sweep(coll: Coll, dtype: DType, n: usize, sizes: &[u64]) -> Vec<u64> {
    let unit = coll.unit(dtype, n);
    let mut v: Vec<u64> = sizes.iter().map(|&s| (s - s % unit).max(unit)).collect();
    v.dedup();
    v
}

/// Default measured iterations for `size` bytes: enough that a size moves
/// about 256 MiB (20 ..= 1000), as nccl-tests' fixed `-n 20` is too few to
/// time microsecond operations on a CPU.
pub fn default_iters(size: u64) -> u64 {
    ((256u64 << 20) / size.max(1)).clamp(20, 1000)
}

/// Default warm-up: a tenth of the iterations, 5 ..= 100 (nccl-tests: 5).
pub fn default_warmup(iters: u64) -> u64 {
    (iters / 10).clamp(5, 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(Coll::AllReduce.bus_factor(2), 1.0);
        assert_eq!(Coll::AllReduce.bus_factor(4), 1.5);
        for c in [Coll::AllGather, Coll::ReduceScatter, Coll::AllToAll] {
            assert_eq!(c.bus_factor(2), 0.5);
            assert_eq!(c.bus_factor(4), 0.75);
        }
        assert_eq!(Coll::Broadcast.bus_factor(8), 1.0);
        assert_eq!(Coll::AllReduce.bus_factor(1), 0.0);
    }

    #[test]
    fn counts_and_buffers() {
        // 1 MiB of f32 with 2 ranks.
        let s = 1 << 20;
        assert_eq!(Coll::AllReduce.count(s, DType::F32, 2), 262144);
        assert_eq!(Coll::AllGather.count(s, DType::F32, 2), 131072);
        assert_eq!(Coll::ReduceScatter.count(s, DType::F32, 2), 131072);
        assert_eq!(Coll::AllToAll.count(s, DType::F32, 2), 131072);
        assert_eq!(Coll::Broadcast.count(s, DType::F64, 2), 131072);
        assert_eq!(Coll::AllGather.buffers(1024, 4), (256, 1024));
        assert_eq!(Coll::ReduceScatter.buffers(1024, 4), (1024, 256));
        assert_eq!(Coll::AllToAll.buffers(1024, 4), (1024, 1024));
        assert_eq!(Coll::AllGather.unit(DType::F32, 3), 12);
        assert_eq!(Coll::Broadcast.unit(DType::BF16, 3), 2);
    }

    #[test]
    fn sweeps_round_to_the_unit() {
        let sizes = [1, 2, 4, 8, 16, 32];
        assert_eq!(sweep(Coll::AllReduce, DType::F32, 2, &sizes), [4, 8, 16, 32]);
        assert_eq!(sweep(Coll::AllGather, DType::F32, 2, &sizes), [8, 16, 32]);
        // 3 ranks of f32: 12-byte granules.
        assert_eq!(sweep(Coll::AllToAll, DType::F32, 3, &sizes), [12, 24]);
        assert_eq!(sweep(Coll::Broadcast, DType::U8, 3, &sizes), sizes);
    }

    #[test]
    fn ops_and_dtypes_parse() {
        assert_eq!(parse_redop("sum"), Ok(ReduceOp::Sum));
        assert_eq!(parse_redop("PROD"), Ok(ReduceOp::Product));
        assert_eq!(parse_redop("premul_sum:2.5"), Ok(ReduceOp::PremulSum(2.5)));
        assert_eq!(parse_redop("premul_sum(3)"), Ok(ReduceOp::PremulSum(3.0)));
        assert!(parse_redop("premul_sum").unwrap_err().contains("needs its factor"));
        assert!(parse_redop("median").unwrap_err().contains("expected sum, prod"));
        assert_eq!(parse_dtype("float32"), Ok(DType::F32));
        assert!(parse_dtype("f128").unwrap_err().contains("expected f32"));
        assert_eq!(redop_name(Coll::AllReduce, ReduceOp::PremulSum(2.0)).as_deref(), Some("premul_sum:2"));
        assert_eq!(redop_name(Coll::AllGather, ReduceOp::Sum), None);
    }

    #[test]
    fn default_iterations() {
        assert_eq!(default_iters(4), 1000);
        assert_eq!(default_iters(1 << 20), 256);
        assert_eq!(default_iters(64 << 20), 20);
        assert_eq!(default_warmup(1000), 100);
        assert_eq!(default_warmup(20), 5);
    }
}
