//! Result records and how they are printed: perftest's bandwidth and
//! latency tables, and one JSON object per line.

use serde::{Deserialize, Serialize};

use crate::stats::{BandwidthSummary, LatencySummary, GBIT, MB};

/// What a test measures, which decides its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Bandwidth and message rate.
    Bandwidth,
    /// Latency distribution.
    Latency,
}

/// One measured size: the figures of both kinds, `None` where a figure does
/// not apply (JSON `null`). Keys are fixed: scripts read them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(non_snake_case)]
pub struct Record {
    /// The operation (`write`, `verbs_write_lat`, ...).
    pub op: String,
    /// Message size in bytes.
    pub bytes: u64,
    /// Measured iterations.
    pub iterations: u64,
    /// Peak bandwidth, MB/s (MB = 2^20 bytes, as perftest).
    pub bw_peak_MBps: Option<f64>,
    /// Average bandwidth, MB/s.
    pub bw_avg_MBps: Option<f64>,
    /// Million messages per second.
    pub msg_rate_Mpps: Option<f64>,
    /// Latency minimum, µs.
    pub t_min_us: Option<f64>,
    /// Latency maximum, µs.
    pub t_max_us: Option<f64>,
    /// Median latency, µs.
    pub t_typical_us: Option<f64>,
    /// Mean latency, µs.
    pub t_avg_us: Option<f64>,
    /// Latency standard deviation, µs.
    pub t_stdev_us: Option<f64>,
    /// 99th percentile latency, µs.
    pub t_p99_us: Option<f64>,
    /// 99.9th percentile latency, µs.
    pub t_p999_us: Option<f64>,
    /// Provider actually used (`soft`, `verbs`).
    pub provider: String,
    /// Link actually used (`shm`, `tcp`, `hca`).
    pub link: String,
    /// Physical QPs.
    pub qps: u32,
    /// Load balancing (`dqplb`, `spray`).
    pub lb: String,
    /// Device-to-device copies the soft provider's engine made for this
    /// size, warm-up included (`--use-cuda` with a same-host peer; merged
    /// fragments count once); `null` where it made none.
    #[serde(default)]
    pub device_copies: Option<u64>,
    /// Times the engine waited for the device for them (one per run of
    /// WRs: far fewer than the messages when batching works).
    #[serde(default)]
    pub device_copy_waits: Option<u64>,
    /// Bytes those copies moved with the peer's device memory.
    #[serde(default)]
    pub peer_device_bytes: Option<u64>,
}

/// The soft provider engine's device-to-device copy counters
/// (`ibverbx::soft::SoftStats`), or their growth over a measurement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Copies queued or made.
    pub copies: u64,
    /// Waits for the device.
    pub waits: u64,
    /// Bytes moved with peers' device memory.
    pub bytes: u64,
}

impl DeviceCounters {
    /// What grew from `before` to `self`.
    pub fn since(self, before: DeviceCounters) -> DeviceCounters {
        DeviceCounters {
            copies: self.copies.saturating_sub(before.copies),
            waits: self.waits.saturating_sub(before.waits),
            bytes: self.bytes.saturating_sub(before.bytes),
        }
    }
}

/// The settings every record of a run shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    /// Operation name.
    pub op: String,
    /// Provider actually used.
    pub provider: String,
    /// Link actually used.
    pub link: String,
    /// Physical QPs.
    pub qps: u32,
    /// Load balancing.
    pub lb: String,
}

impl Record {
    fn empty(info: &RunInfo, bytes: u64, iterations: u64) -> Record {
        Record {
            op: info.op.clone(),
            bytes,
            iterations,
            bw_peak_MBps: None,
            bw_avg_MBps: None,
            msg_rate_Mpps: None,
            t_min_us: None,
            t_max_us: None,
            t_typical_us: None,
            t_avg_us: None,
            t_stdev_us: None,
            t_p99_us: None,
            t_p999_us: None,
            provider: info.provider.clone(),
            link: info.link.clone(),
            qps: info.qps,
            lb: info.lb.clone(),
            device_copies: None,
            device_copy_waits: None,
            peer_device_bytes: None,
        }
    }

    /// With the engine's device-copy counters of this size (`None`, or
    /// nothing counted: left `null`).
    pub fn with_device(mut self, c: Option<DeviceCounters>) -> Record {
        if let Some(c) = c.filter(|c| c.copies > 0 || c.waits > 0) {
            self.device_copies = Some(c.copies);
            self.device_copy_waits = Some(c.waits);
            self.peer_device_bytes = Some(c.bytes);
        }
        self
    }

    /// A bandwidth record.
    pub fn bandwidth(info: &RunInfo, bytes: u64, s: &BandwidthSummary) -> Record {
        Record {
            bw_peak_MBps: Some(s.peak_bps / MB),
            bw_avg_MBps: Some(s.avg_bps / MB),
            msg_rate_Mpps: Some(s.msg_rate_mpps),
            ..Record::empty(info, bytes, s.iterations)
        }
    }

    /// A latency record.
    pub fn latency(info: &RunInfo, bytes: u64, s: &LatencySummary) -> Record {
        Record {
            t_min_us: Some(s.min),
            t_max_us: Some(s.max),
            t_typical_us: Some(s.typical),
            t_avg_us: Some(s.avg),
            t_stdev_us: Some(s.stdev),
            t_p99_us: Some(s.p99),
            t_p999_us: Some(s.p999),
            ..Record::empty(info, bytes, s.n as u64)
        }
    }

    /// Which table it belongs to.
    pub fn kind(&self) -> Kind {
        if self.bw_avg_MBps.is_some() {
            Kind::Bandwidth
        } else {
            Kind::Latency
        }
    }

    /// One JSON object, no newline.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("records serialise")
    }
}

/// The rule perftest draws around headers.
pub const RULE: &str = "---------------------------------------------------------------------------------------";

/// The column header of a table.
pub fn table_header(kind: Kind, gbits: bool) -> String {
    match kind {
        Kind::Bandwidth => {
            let unit = if gbits { "Gb/sec" } else { "MB/sec" };
            format!(
                " {:<10} {:<12} {:>18} {:>21} {:>15}",
                "#bytes",
                "#iterations",
                format!("BW peak[{unit}]"),
                format!("BW average[{unit}]"),
                "MsgRate[Mpps]"
            )
        }
        Kind::Latency => format!(
            " {:<10} {:<12} {:>12} {:>12} {:>16} {:>12} {:>14} {:>21} {:>23}",
            "#bytes",
            "#iterations",
            "t_min[usec]",
            "t_max[usec]",
            "t_typical[usec]",
            "t_avg[usec]",
            "t_stdev[usec]",
            "99% percentile[usec]",
            "99.9% percentile[usec]"
        ),
    }
}

fn num(v: Option<f64>, prec: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.prec$}"))
}

/// One table row, aligned under [`table_header`].
pub fn table_row(r: &Record, gbits: bool) -> String {
    match r.kind() {
        Kind::Bandwidth => {
            let conv = |v: Option<f64>| if gbits { v.map(|x| x * MB / GBIT) } else { v };
            format!(
                " {:<10} {:<12} {:>18} {:>21} {:>15}",
                r.bytes,
                r.iterations,
                num(conv(r.bw_peak_MBps), 2),
                num(conv(r.bw_avg_MBps), 2),
                num(r.msg_rate_Mpps, 6)
            )
        }
        Kind::Latency => format!(
            " {:<10} {:<12} {:>12} {:>12} {:>16} {:>12} {:>14} {:>21} {:>23}",
            r.bytes,
            r.iterations,
            num(r.t_min_us, 2),
            num(r.t_max_us, 2),
            num(r.t_typical_us, 2),
            num(r.t_avg_us, 2),
            num(r.t_stdev_us, 2),
            num(r.t_p99_us, 2),
            num(r.t_p999_us, 2)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{summarize_bandwidth, summarize_latency, Timings};

    /// Two operations over 2 ms.
    fn two_ms() -> Timings {
        Timings { posted: vec![0.0, 0.001], completed: vec![0.001, 0.002] }
    }

    fn info() -> RunInfo {
        RunInfo { op: "write".into(), provider: "soft".into(), link: "shm".into(), qps: 2, lb: "dqplb".into() }
    }

    #[test]
    fn json_shape_bandwidth() {
        let s = summarize_bandwidth(1 << 20, &two_ms()).unwrap();
        let r = Record::bandwidth(&info(), 1 << 20, &s);
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        let obj = v.as_object().unwrap();
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        let mut want = vec![
            "op",
            "bytes",
            "iterations",
            "bw_peak_MBps",
            "bw_avg_MBps",
            "msg_rate_Mpps",
            "t_min_us",
            "t_max_us",
            "t_typical_us",
            "t_avg_us",
            "t_stdev_us",
            "t_p99_us",
            "t_p999_us",
            "provider",
            "link",
            "qps",
            "lb",
            "device_copies",
            "device_copy_waits",
            "peer_device_bytes",
        ];
        let mut got = keys.clone();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(v["op"], "write");
        assert_eq!(v["bytes"], 1 << 20);
        assert_eq!(v["iterations"], 2);
        assert!((v["bw_avg_MBps"].as_f64().unwrap() - 1000.0).abs() < 1e-9);
        assert!(v["t_typical_us"].is_null());
        assert_eq!(v["qps"], 2);
        assert_eq!(v["link"], "shm");
        assert_eq!(serde_json::from_str::<Record>(&r.to_json()).unwrap(), r);
        assert!(v["device_copy_waits"].is_null());
        // Records written before the device counters existed still read.
        let mut old = v.clone();
        for k in ["device_copies", "device_copy_waits", "peer_device_bytes"] {
            old.as_object_mut().unwrap().remove(k);
        }
        assert_eq!(serde_json::from_value::<Record>(old).unwrap(), r);
    }

    /// The engine's device-copy counters of a size: in the record where it
    /// counted any, `null` where it counted none.
    #[test]
    fn device_counters_in_records() {
        let s = summarize_bandwidth(1 << 20, &two_ms()).unwrap();
        let before = DeviceCounters { copies: 10, waits: 5, bytes: 1 << 30 };
        let after = DeviceCounters { copies: 74, waits: 7, bytes: (1 << 30) + (64 << 20) };
        let r = Record::bandwidth(&info(), 1 << 20, &s).with_device(Some(after.since(before)));
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!((v["device_copies"].as_u64(), v["device_copy_waits"].as_u64()), (Some(64), Some(2)));
        assert_eq!(v["peer_device_bytes"].as_u64(), Some(64 << 20));
        for none in [None, Some(DeviceCounters::default())] {
            let r = Record::bandwidth(&info(), 1 << 20, &s).with_device(none);
            assert_eq!((r.device_copies, r.device_copy_waits, r.peer_device_bytes), (None, None, None));
        }
    }

    #[test]
    fn json_shape_latency() {
        let s = summarize_latency(&[1.0, 2.0, 3.0]).unwrap();
        let r = Record::latency(&info(), 8, &s);
        let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
        assert!(v["bw_avg_MBps"].is_null() && v["bw_peak_MBps"].is_null() && v["msg_rate_Mpps"].is_null());
        assert_eq!(v["t_typical_us"], 2.0);
        assert_eq!(v["t_p999_us"], 3.0);
        assert_eq!(r.kind(), Kind::Latency);
    }

    #[test]
    fn tables_align() {
        let s = summarize_bandwidth(65536, &two_ms()).unwrap();
        let r = Record::bandwidth(&info(), 65536, &s);
        for gbits in [false, true] {
            let h = table_header(Kind::Bandwidth, gbits);
            let row = table_row(&r, gbits);
            assert_eq!(h.len(), row.len(), "{h}\n{row}");
            assert!(h.contains(if gbits { "BW average[Gb/sec]" } else { "BW average[MB/sec]" }));
            assert!(h.contains("MsgRate[Mpps]") && h.contains("#bytes") && h.contains("#iterations"));
        }
        // 65536 B every ms = 62.5 MB/s (MiB), 0.524288 Gb/s.
        assert!(table_row(&r, false).contains("62.50"));
        assert!(table_row(&r, true).contains("0.52"));
        let l = Record::latency(&info(), 2, &summarize_latency(&[1.5, 2.5]).unwrap());
        let h = table_header(Kind::Latency, false);
        let row = table_row(&l, false);
        assert_eq!(h.len(), row.len(), "{h}\n{row}");
        for col in ["t_min[usec]", "t_typical[usec]", "t_stdev[usec]", "99% percentile[usec]", "99.9% percentile[usec]"]
        {
            assert!(h.contains(col), "{col}");
        }
        assert!(row.trim_start().starts_with("2 "));
    }
}
