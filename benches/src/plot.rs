//! `--plot FILE.svg`: bandwidth and latency against message size on log
//! axes, one line per series (operation and link), drawn with plotters'
//! SVG backend (no fonts or system libraries needed).

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use crate::coll_report::CollRecord;
use crate::report::Record;
use crate::size::format_size;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// The legend name of a record's series: operation, link, and the QP
/// count when there are several.
pub fn series_name(r: &Record) -> String {
    let qps = if r.qps > 1 { format!(", {} QPs {}", r.qps, r.lb) } else { String::new() };
    format!("{} ({}/{}{qps})", r.op, r.provider, r.link)
}

type Series = BTreeMap<String, Vec<(f64, f64)>>;

fn group(records: &[Record], y: impl Fn(&Record) -> Option<f64>) -> Series {
    let mut m: Series = BTreeMap::new();
    for r in records {
        if let Some(v) = y(r).filter(|v| *v > 0.0) {
            m.entry(series_name(r)).or_default().push((r.bytes as f64, v));
        }
    }
    for pts in m.values_mut() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    m
}

/// Series of collective records: `y` of each against its size.
fn coll_group(records: &[CollRecord], y: impl Fn(&CollRecord) -> f64) -> Series {
    let mut m: Series = BTreeMap::new();
    for r in records {
        let v = y(r);
        if v > 0.0 && v.is_finite() {
            m.entry(r.series()).or_default().push((r.bytes as f64, v));
        }
    }
    for pts in m.values_mut() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    m
}

fn bounds(s: &Series) -> ((f64, f64), (f64, f64)) {
    let pts = s.values().flatten();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if x1 <= x0 {
        (x0, x1) = (x0 / 2.0, x0 * 2.0);
    }
    // Room above the data for the legend.
    ((x0, x1), (y0 / 1.5, y1 * 6.0))
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    s: &Series,
    colors: &BTreeMap<String, RGBColor>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let ((x0, x1), (y0, y1)) = bounds(s);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d((x0..x1).log_scale().base(2.0), (y0..y1).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("message size")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format_size(x.round() as u64))
        .y_label_formatter(&|y| if *y >= 10.0 { format!("{y:.0}") } else { format!("{y:.2}") })
        .label_style(("sans-serif", 13))
        .draw()
        .map_err(|e| e.to_string())?;
    for (name, pts) in s {
        let c = colors[name];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled()))).map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Draws `records` into an SVG file: a bandwidth panel (average MB/s) when
/// any record has bandwidth figures, a latency panel (typical µs) when any
/// has latency figures, side by side.
pub fn write_svg(path: &Path, records: &[Record]) -> Result<(), String> {
    let bw = group(records, |r| r.bw_avg_MBps);
    let lat = group(records, |r| r.t_typical_us);
    if bw.is_empty() && lat.is_empty() {
        return Err("nothing to plot: no figures were measured".into());
    }
    let mut colors = BTreeMap::new();
    for name in bw.keys().chain(lat.keys()) {
        let n = colors.len();
        colors.entry(name.clone()).or_insert(COLORS[n % COLORS.len()]);
    }
    let panels = usize::from(!bw.is_empty()) + usize::from(!lat.is_empty());
    let width = 760 * panels as u32;
    let root = SVGBackend::new(path, (width, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((1, panels));
    let mut next = areas.iter();
    if !bw.is_empty() {
        panel(next.next().expect("panel"), "Bandwidth (average)", "MB/s (2^20 B/s)", &bw, &colors)?;
    }
    if !lat.is_empty() {
        panel(next.next().expect("panel"), "Latency (typical, half round trip)", "usec", &lat, &colors)?;
    }
    root.present().map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// Draws collective records (rdma_bench's and, from compare.sh, other
/// libraries') into an SVG: time per call and bus bandwidth against size,
/// side by side, one line per series (operation, library, ranks, type).
pub fn write_coll_svg(path: &Path, records: &[CollRecord]) -> Result<(), String> {
    let time = coll_group(records, |r| r.time_us);
    let bus = coll_group(records, |r| r.busbw_GBps);
    if time.is_empty() {
        return Err("nothing to plot: no times were measured".into());
    }
    let mut colors = BTreeMap::new();
    for name in time.keys().chain(bus.keys()) {
        let n = colors.len();
        colors.entry(name.clone()).or_insert(COLORS[n % COLORS.len()]);
    }
    let panels = 1 + usize::from(!bus.is_empty());
    let root = SVGBackend::new(path, (760 * panels as u32, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let areas = root.split_evenly((1, panels));
    panel(&areas[0], "Time per call (lower is better)", "usec", &time, &colors)?;
    if !bus.is_empty() {
        panel(&areas[1], "Bus bandwidth (nccl-tests)", "GB/s (10^9 B/s)", &bus, &colors)?;
    }
    root.present().map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::RunInfo;
    use crate::stats::{summarize_bandwidth, summarize_latency, Timings};

    #[test]
    fn svg_has_both_panels_and_series() {
        let info =
            RunInfo { op: "write".into(), provider: "soft".into(), link: "shm".into(), qps: 1, lb: "dqplb".into() };
        let lat_info = RunInfo { op: "write_lat".into(), ..info.clone() };
        let mut recs = Vec::new();
        for (i, b) in [64u64, 4096, 1 << 20].into_iter().enumerate() {
            recs.push(Record::bandwidth(
                &info,
                b,
                &summarize_bandwidth(b, &Timings { posted: vec![0.0], completed: vec![0.001 * (i + 1) as f64] })
                    .unwrap(),
            ));
            recs.push(Record::latency(&lat_info, b, &summarize_latency(&[1.0 + i as f64]).unwrap()));
        }
        let dir = std::env::temp_dir().join(format!("rdma_bench_plot_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.svg");
        write_svg(&p, &recs).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("write (soft/shm)") && svg.contains("write_lat (soft/shm)"));
        assert!(svg.contains("Bandwidth") && svg.contains("Latency"));
        assert!(svg.contains("<polyline"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(write_svg(&p, &[]).is_err());
    }

    #[test]
    fn collective_svg_has_time_and_busbw_of_every_series() {
        let rec = |peer: Option<&str>, bytes: u64, t: f64| CollRecord {
            op: "all_reduce".into(),
            bytes,
            count: bytes / 4,
            dtype: "f32".into(),
            redop: Some("sum".into()),
            root: None,
            algo: None,
            ranks: 2,
            iterations: 20,
            time_us: t,
            time_max_us: None,
            algbw_GBps: bytes as f64 / t / 1e3,
            busbw_GBps: bytes as f64 / t / 1e3,
            wrong: Some(0),
            provider: "soft".into(),
            link: "shm".into(),
            peer: peer.map(str::to_owned),
        };
        let recs: Vec<CollRecord> = [4096u64, 1 << 20, 64 << 20]
            .iter()
            .flat_map(|&b| [rec(None, b, b as f64 / 1e4 + 2.0), rec(Some("Open MPI 4.1"), b, b as f64 / 5e3 + 1.0)])
            .collect();
        let dir = std::env::temp_dir().join(format!("rdma_bench_coll_plot_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("c.svg");
        write_coll_svg(&p, &recs).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("all_reduce rmacomm soft/shm (2 ranks, f32)"), "rmacomm series missing");
        assert!(svg.contains("all_reduce Open MPI 4.1 (2 ranks, f32)"), "peer series missing");
        assert!(svg.contains("Time per call") && svg.contains("Bus bandwidth"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(write_coll_svg(&p, &[]).is_err());
    }
}
