//! What exchanging connection details costs: building a transport URL
//! (`bind`), decoding one (`connect`'s parsing, measured through a URL
//! whose provider does not match, which `connect` rejects right after
//! decoding), and a remote buffer's JSON and text forms.
//!
//! Run: `cargo bench -p rmacomm-bench --bench serde`.

use std::hint::black_box;

use criterion::Criterion;
use rmacomm_transport::{RdmaRemoteBuffer, RdmaTransport, TransportConfig, TransportError};

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let t =
        RdmaTransport::new(TransportConfig::default().with_provider(ibverbx::ProviderKind::Soft).with_qps(4)).unwrap();
    let url = t.bind().unwrap();
    let (scheme_provider, payload) = url.rsplit_once('/').unwrap();
    assert!(scheme_provider.ends_with("soft"), "{url}");
    // Same payload, another provider: connect decodes it fully, then refuses.
    let foreign = format!("rmacomm://verbs/{payload}");
    let rb = RdmaRemoteBuffer { addr: 0x7f12_3456_7000, len: 256 << 20, key: 0x1234_abcd };
    let rb_json = serde_json::to_string(&rb).unwrap();
    let rb_text = rb.to_string();

    let mut g = c.benchmark_group("serde");
    g.bench_function("url_encode_bind_4qp", |b| b.iter(|| black_box(t.bind().unwrap())));
    g.bench_function("url_decode_4qp", |b| {
        let other =
            RdmaTransport::new(TransportConfig::default().with_provider(ibverbx::ProviderKind::Soft).with_qps(4))
                .unwrap();
        b.iter(|| {
            let r = rt.block_on(other.connect(black_box(&foreign)));
            assert!(matches!(r, Err(TransportError::InvalidArgument { .. })), "{r:?}");
        })
    });
    g.bench_function("remote_buffer_to_json", |b| b.iter(|| black_box(serde_json::to_string(black_box(&rb)).unwrap())));
    g.bench_function("remote_buffer_from_json", |b| {
        b.iter(|| black_box(serde_json::from_str::<RdmaRemoteBuffer>(black_box(&rb_json)).unwrap()))
    });
    g.bench_function("remote_buffer_display", |b| b.iter(|| black_box(black_box(&rb).to_string())));
    g.bench_function("remote_buffer_parse", |b| b.iter(|| black_box(RdmaRemoteBuffer::parse(black_box(&rb_text)))));
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
