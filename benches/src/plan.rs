//! How many iterations each size gets: perftest's defaults, bounded so
//! that a sweep to 256 MiB finishes in seconds on a small machine.

use serde::{Deserialize, Serialize};

use crate::report::Kind;

/// How long the measured part runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Measure {
    /// A fixed number of iterations.
    Count(u64),
    /// As many as fit in this many seconds.
    Seconds(f64),
}

/// Warm-up and measured iterations of one size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Iterations run before measuring.
    pub warmup: u64,
    /// The measured part.
    pub measure: Measure,
}

/// Bytes a bandwidth test moves per size by default.
pub const BW_BUDGET: u64 = 2 << 30;
/// Bytes a latency test moves per size by default (one way).
pub const LAT_BUDGET: u64 = 256 << 20;

/// The plan for `size` given the options `-n`, `--warmup` and `-D`.
pub fn plan(kind: Kind, size: u64, iters: Option<u64>, warmup: Option<u64>, seconds: Option<f64>) -> Plan {
    let (budget, lo, hi) = match kind {
        Kind::Bandwidth => (BW_BUDGET, 8, 5000),
        Kind::Latency => (LAT_BUDGET, 8, 1000),
    };
    let n = iters.unwrap_or_else(|| (budget / size.max(1)).clamp(lo, hi)).max(1);
    let measure = match seconds {
        Some(s) => Measure::Seconds(s.max(0.0)),
        None => Measure::Count(n),
    };
    // Duration mode needs a warm-up: latency runs size their count from it.
    let default_warmup = (n / 10).clamp(2, 500);
    let warmup = warmup.unwrap_or(default_warmup);
    let warmup = if seconds.is_some() { warmup.max(1) } else { warmup };
    Plan { warmup, measure }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_budget() {
        let p = plan(Kind::Bandwidth, 2, None, None, None);
        assert_eq!(p, Plan { warmup: 500, measure: Measure::Count(5000) });
        let p = plan(Kind::Bandwidth, 1 << 20, None, None, None);
        assert_eq!(p, Plan { warmup: 204, measure: Measure::Count(2048) });
        let p = plan(Kind::Bandwidth, 256 << 20, None, None, None);
        assert_eq!(p, Plan { warmup: 2, measure: Measure::Count(8) });
        let p = plan(Kind::Latency, 2, None, None, None);
        assert_eq!(p.measure, Measure::Count(1000));
        assert_eq!(plan(Kind::Latency, 256 << 20, None, None, None).measure, Measure::Count(8));
    }

    #[test]
    fn options_win() {
        let p = plan(Kind::Bandwidth, 2, Some(10), Some(0), None);
        assert_eq!(p, Plan { warmup: 0, measure: Measure::Count(10) });
        let p = plan(Kind::Latency, 2, None, Some(0), Some(1.5));
        assert_eq!(p, Plan { warmup: 1, measure: Measure::Seconds(1.5) });
        assert_eq!(plan(Kind::Bandwidth, 2, Some(0), None, None).measure, Measure::Count(1));
    }
}
