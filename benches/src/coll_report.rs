//! Records of collective runs and how they are printed: nccl-tests'
//! columns (size, count, type, redop, root, time, algbw, busbw, #wrong)
//! and one JSON object per size, keyed like the other operations' records
//! where the meaning is the same (`op`, `bytes`, `iterations`,
//! `provider`, `link`).

use serde::{Deserialize, Serialize};

/// One measured size of a collective. Keys are fixed (scripts read them);
/// `null` where a figure does not apply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(non_snake_case)]
pub struct CollRecord {
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`,
    /// `broadcast`.
    pub op: String,
    /// nccl-tests' size: the larger of a rank's input and output, bytes.
    pub bytes: u64,
    /// nccl-tests' count: elements per call parameter (see `Coll::count`).
    pub count: u64,
    /// Element type (`f32`, ...).
    #[serde(rename = "type")]
    pub dtype: String,
    /// Reduction (`sum`, ...; `null` for collectives that do not reduce).
    #[serde(default)]
    pub redop: Option<String>,
    /// Root rank (`null` for collectives without one).
    #[serde(default)]
    pub root: Option<u64>,
    /// The `rmacomm::algo` hint given (`null`: none, the library chose).
    #[serde(default)]
    pub algo: Option<String>,
    /// Ranks.
    #[serde(default)]
    pub ranks: u64,
    /// Measured iterations (back to back, after the warm-up).
    #[serde(default)]
    pub iterations: u64,
    /// Time per iteration, µs: each rank's loop time / iterations,
    /// averaged over the ranks (nccl-tests' default).
    pub time_us: f64,
    /// The slowest rank's time per iteration, µs.
    #[serde(default)]
    pub time_max_us: Option<f64>,
    /// Algorithm bandwidth: bytes / time, GB/s (10^9 B/s).
    #[serde(default)]
    pub algbw_GBps: f64,
    /// Bus bandwidth: algbw × the collective's factor, GB/s.
    #[serde(default)]
    pub busbw_GBps: f64,
    /// Wrong elements over all ranks in the correctness check (`null`:
    /// not checked, `-c 0`).
    #[serde(default)]
    pub wrong: Option<u64>,
    /// Provider (`soft`, `verbs`).
    #[serde(default)]
    pub provider: String,
    /// Link (`shm` when every rank is on this host over the soft
    /// provider's shared memory, `tcp`, `hca`).
    #[serde(default)]
    pub link: String,
    /// Another library's figure (set by `benches/compare.sh` for Open MPI
    /// and gloo rows, which `rdma_bench plot` draws beside rmacomm's);
    /// absent from rdma_bench's own records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
}

impl CollRecord {
    /// One JSON object, no newline.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("records serialise")
    }

    /// The name of its series in a plot.
    pub fn series(&self) -> String {
        let who = self.peer.clone().unwrap_or_else(|| format!("rmacomm {}/{}", self.provider, self.link));
        let algo = self.algo.as_deref().map(|a| format!(", {a}")).unwrap_or_default();
        format!("{} {who} ({} ranks, {}{algo})", self.op, self.ranks, self.dtype)
    }
}

/// The column header, nccl-tests' columns with units.
pub fn coll_table_header() -> String {
    let line = |c: [&str; 10]| {
        format!(
            "# {:>10} {:>12} {:>6} {:>14} {:>5} {:>12} {:>8} {:>8} {:>7} {:>7}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9]
        )
    };
    let names = line(["size[B]", "count", "type", "redop", "root", "time[us]", "algbw", "busbw", "#wrong", "#iters"]);
    let units = line(["", "", "", "", "", "", "(GB/s)", "(GB/s)", "", ""]);
    format!("{names}\n{}", units.trim_end())
}

/// One row under [`coll_table_header`].
pub fn coll_table_row(r: &CollRecord) -> String {
    format!(
        "  {:>10} {:>12} {:>6} {:>14} {:>5} {:>12.2} {:>8.3} {:>8.3} {:>7} {:>7}",
        r.bytes,
        r.count,
        r.dtype,
        r.redop.as_deref().unwrap_or("none"),
        r.root.map_or(-1, |x| x as i64),
        r.time_us,
        r.algbw_GBps,
        r.busbw_GBps,
        r.wrong.map_or_else(|| "N/A".to_owned(), |w| w.to_string()),
        r.iterations,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> CollRecord {
        CollRecord {
            op: "all_reduce".into(),
            bytes: 1 << 20,
            count: 262144,
            dtype: "f32".into(),
            redop: Some("sum".into()),
            root: None,
            algo: None,
            ranks: 2,
            iterations: 256,
            time_us: 104.8576,
            time_max_us: Some(110.0),
            algbw_GBps: 10.0,
            busbw_GBps: 10.0,
            wrong: Some(0),
            provider: "soft".into(),
            link: "shm".into(),
            peer: None,
        }
    }

    #[test]
    fn json_keys_are_fixed() {
        let v: serde_json::Value = serde_json::from_str(&rec().to_json()).unwrap();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = vec![
            "op",
            "bytes",
            "count",
            "type",
            "redop",
            "root",
            "algo",
            "ranks",
            "iterations",
            "time_us",
            "time_max_us",
            "algbw_GBps",
            "busbw_GBps",
            "wrong",
            "provider",
            "link",
        ];
        want.sort_unstable();
        assert_eq!(keys, want);
        assert!(v["root"].is_null() && v["algo"].is_null() && v["type"] == "f32");
        assert_eq!(serde_json::from_str::<CollRecord>(&rec().to_json()).unwrap(), rec());
        // A peer's row needs only the figures it has.
        let p: CollRecord = serde_json::from_str(
            r#"{"op":"all_reduce","bytes":4096,"count":1024,"type":"f32","time_us":3.5,"peer":"Open MPI"}"#,
        )
        .unwrap();
        assert_eq!((p.peer.as_deref(), p.time_us, p.wrong), (Some("Open MPI"), 3.5, None));
        assert!(p.series().starts_with("all_reduce Open MPI"));
        assert_eq!(rec().series(), "all_reduce rmacomm soft/shm (2 ranks, f32)");
    }

    #[test]
    fn rows_align_under_the_header() {
        let h = coll_table_header();
        let first = h.lines().next().unwrap();
        let row = coll_table_row(&rec());
        assert_eq!(first.len(), row.len(), "{h}\n{row}");
        let f: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(f, ["1048576", "262144", "f32", "sum", "-1", "104.86", "10.000", "10.000", "0", "256"]);
        for col in ["size[B]", "count", "type", "redop", "root", "time[us]", "algbw", "busbw", "#wrong"] {
            assert!(first.contains(col), "{col}");
        }
        let b = CollRecord { op: "broadcast".into(), redop: None, root: Some(1), wrong: None, ..rec() };
        let f: Vec<String> = coll_table_row(&b).split_whitespace().map(str::to_owned).collect();
        assert_eq!((f[3].as_str(), f[4].as_str(), f[8].as_str()), ("none", "1", "N/A"));
    }
}
