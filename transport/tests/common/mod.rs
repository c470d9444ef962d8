//! Transport behaviours, checked on whichever soft link the test binary
//! selects (`RMACOMM_SOFT_LINK`, set by [`link`] before anything opens).

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig, TransportError};

pub fn link(l: &str) {
    std::env::set_var("RMACOMM_PROVIDER", "soft");
    std::env::set_var("RMACOMM_SOFT_LINK", l);
    let _ = tracing_subscriber::fmt().with_env_filter("warn").with_test_writer().try_init();
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn config() -> TransportConfig {
    TransportConfig::default().with_timeout(Some(Duration::from_secs(30)))
}

pub async fn pair_with(ca: TransportConfig, cb: TransportConfig) -> (Arc<RdmaTransport>, Arc<RdmaTransport>) {
    let a = RdmaTransport::new(ca).unwrap();
    let b = RdmaTransport::new(cb).unwrap();
    let (ua, ub) = (a.bind().unwrap(), b.bind().unwrap());
    let (ra, rb) = tokio::join!(a.connect(&ub), b.connect(&ua));
    ra.unwrap();
    rb.unwrap();
    assert!(a.connected() && b.connected());
    (Arc::new(a), Arc::new(b))
}

pub async fn pair() -> (Arc<RdmaTransport>, Arc<RdmaTransport>) {
    pair_with(config(), config()).await
}

pub fn contents(m: &RdmaMemory, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    m.read_into(off, &mut v).unwrap();
    v
}

pub const SIZES: [usize; 9] = [1, 64, 4095, 4096, 4097, 8192, 64 << 10, 1 << 20, 64 << 20];

pub async fn write_notify_read_every_size(qps: u32, lb: ibverbx::LoadBalancing) {
    let cfg = config().with_qps(qps).with_load_balancing(lb).with_frag_size(256 << 10);
    let (a, b) = pair_with(cfg.clone(), cfg).await;
    let max = *SIZES.iter().max().unwrap();
    let src = RdmaMemory::alloc(max).unwrap();
    let dst = RdmaMemory::alloc(max + 64).unwrap();
    let back = RdmaMemory::alloc(max).unwrap();
    for (i, &n) in SIZES.iter().enumerate() {
        let data = pattern(n, i as u64);
        src.write_from(0, &data).unwrap();
        dst.write_from(n, &[0x5A]).unwrap();
        a.write(src.view(0, n).unwrap(), &dst.remote_buffer(), true).await.unwrap();
        b.wait_for_write().await.unwrap();
        assert!(contents(&dst, 0, n) == data, "write of {n} bytes differs");
        assert_eq!(contents(&dst, n, 1), [0x5A], "write of {n} bytes spilled past its end");
        // Read it back from the other side.
        b.read(back.view_mut(0, n).unwrap(), &src.remote_buffer()).await.unwrap();
        assert!(contents(&back, 0, n) == data, "read of {n} bytes differs");
    }
}

/// Busy-polling calls behave as sleeping ones, only sooner.
pub async fn busy_poll_ping_pong() {
    let cfg = config().with_busy_poll(Duration::from_micros(200));
    let (a, b) = pair_with(cfg.clone(), cfg).await;
    let (ma, mb) = (RdmaMemory::alloc(4096).unwrap(), RdmaMemory::alloc(4096).unwrap());
    for i in 0..200u64 {
        ma.write_from(0, &i.to_le_bytes()).unwrap();
        a.write(ma.view(0, 8).unwrap(), &mb.remote_buffer(), true).await.unwrap();
        b.wait_for_write().await.unwrap();
        assert_eq!(contents(&mb, 0, 8), i.to_le_bytes());
        b.write(mb.view(0, 8).unwrap(), &ma.remote_buffer(), true).await.unwrap();
        a.wait_for_write().await.unwrap();
    }
    let e = a.wait_for_write_with_timeout(Some(Duration::from_millis(10))).await.unwrap_err();
    assert!(matches!(e, TransportError::Timeout { .. }));
}

pub async fn partial_views_touch_only_their_slice() {
    let (a, b) = pair().await;
    let src = RdmaMemory::alloc(8192).unwrap();
    let dst = RdmaMemory::alloc(8192).unwrap();
    src.write_from(0, &[7u8; 8192]).unwrap();
    dst.write_from(0, &[1u8; 8192]).unwrap();
    let rb = dst.remote_buffer().slice(1000, 100).unwrap();
    a.write(src.view(500, 100).unwrap(), &rb, true).await.unwrap();
    b.wait_for_write().await.unwrap();
    let got = contents(&dst, 0, 8192);
    assert!(got[..1000].iter().all(|&x| x == 1));
    assert!(got[1000..1100].iter().all(|&x| x == 7));
    assert!(got[1100..].iter().all(|&x| x == 1));
    // Read into a slice of a local buffer.
    let back = RdmaMemory::alloc(4096).unwrap();
    b.read(back.view_mut(10, 100).unwrap(), &src.remote_buffer().slice(0, 100).unwrap()).await.unwrap();
    let got = contents(&back, 0, 4096);
    assert!(
        got[..10].iter().all(|&x| x == 0) && got[10..110].iter().all(|&x| x == 7) && got[110..].iter().all(|&x| x == 0)
    );
}

pub async fn bounds_are_checked_before_anything_moves() {
    let (a, _b) = pair().await;
    let src = RdmaMemory::alloc(4096).unwrap();
    let dst = RdmaMemory::alloc(4096).unwrap();
    assert!(matches!(src.view(4000, 200), Err(TransportError::InvalidArgument { .. })));
    assert!(matches!(src.view_mut(usize::MAX, 2), Err(TransportError::InvalidArgument { .. })));
    assert!(src.view(0, src.len()).is_ok());
    // Local view longer than the remote buffer.
    let short = dst.remote_buffer().slice(0, 100).unwrap();
    let e = a.write(src.view(0, 200).unwrap(), &short, false).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    let e = a.read(src.view_mut(0, 200).unwrap(), &short).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    // Shorter local view than the remote buffer: fine, only its bytes move.
    a.write(src.view(0, 50).unwrap(), &short, false).await.unwrap();
    assert!(a.connected(), "an argument error must not break the transport");
    assert!(src.contains(src.as_ptr(), 4096) && !src.contains(src.as_ptr(), 4097));
}

pub async fn thousand_concurrent_writes_then_thousand_waits() {
    let (a, b) = pair().await;
    let src = RdmaMemory::alloc(1000 * 64).unwrap();
    let dst = RdmaMemory::alloc(1000 * 64).unwrap();
    for i in 0..1000 {
        src.write_from(i * 64, &pattern(64, i as u64)).unwrap();
    }
    let rb = dst.remote_buffer();
    let futs: Vec<_> = (0..1000)
        .map(|i| {
            let a = a.clone();
            let view = src.view(i * 64, 64).unwrap();
            let rb = rb.slice(i as u64 * 64, 64).unwrap();
            async move { a.write(view, &rb, true).await }
        })
        .collect();
    for r in futures_join_all(futs).await {
        r.unwrap();
    }
    for _ in 0..1000 {
        b.wait_for_write().await.unwrap();
    }
    // Exactly 1000: one more wait times out.
    let e = b.wait_for_write_with_timeout(Some(Duration::from_millis(100))).await.unwrap_err();
    assert!(matches!(e, TransportError::Timeout { .. }));
    for i in 0..1000 {
        assert_eq!(contents(&dst, i * 64, 64), pattern(64, i as u64));
    }
}

/// A minimal join_all (no extra dependency): polls every future in turn.
pub async fn futures_join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::with_capacity(futs.len());
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    // Start them all first (each posts its WR on first poll), then await.
    let mut handles: Vec<_> = handles.into_iter().map(Some).collect();
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut ready: Vec<Option<F::Output>> = (0..handles.len()).map(|_| None).collect();
    for (h, r) in handles.iter_mut().zip(ready.iter_mut()) {
        if let std::task::Poll::Ready(v) = h.as_mut().unwrap().as_mut().poll(&mut cx) {
            *r = Some(v);
            *h = None;
        }
    }
    for (h, r) in handles.into_iter().zip(ready) {
        match (h, r) {
            (_, Some(v)) => out.push(v),
            (Some(f), None) => out.push(f.await),
            (None, None) => unreachable!(),
        }
    }
    out
}

pub async fn notifications_are_banked() {
    let (a, b) = pair().await;
    let src = RdmaMemory::alloc(4096).unwrap();
    let dst = RdmaMemory::alloc(4096).unwrap();
    for _ in 0..5 {
        a.write(src.view(0, 8).unwrap(), &dst.remote_buffer(), true).await.unwrap();
    }
    // Writes without notify do not count.
    a.write(src.view(0, 8).unwrap(), &dst.remote_buffer(), false).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    for _ in 0..5 {
        b.wait_for_write_with_timeout(Some(Duration::from_secs(5))).await.unwrap();
    }
    assert!(b.wait_for_write_with_timeout(Some(Duration::from_millis(50))).await.is_err());
}

pub async fn timeouts() {
    let (a, b) = pair().await;
    for ms in [0u64, 100] {
        let t = Instant::now();
        let e = b.wait_for_write_with_timeout(Some(Duration::from_millis(ms))).await.unwrap_err();
        let el = t.elapsed();
        assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
        assert!(el >= Duration::from_millis(ms), "returned after {el:?}, before {ms} ms");
        assert!(el < Duration::from_millis(ms) + Duration::from_secs(2), "took {el:?} for a {ms} ms timeout");
    }
    // Writes with a 0 ms timeout: each one either was already placed when
    // first polled or times out at once; the transport stays usable and
    // every byte of a later write lands.
    let src = RdmaMemory::alloc(64 << 20).unwrap();
    let dst = RdmaMemory::alloc(64 << 20).unwrap();
    let mut timed_out = 0;
    for _ in 0..4 {
        let t = Instant::now();
        match a
            .write_with_timeout(src.view(0, 64 << 20).unwrap(), &dst.remote_buffer(), false, Some(Duration::ZERO))
            .await
        {
            Ok(()) => {}
            Err(TransportError::Timeout { .. }) => timed_out += 1,
            Err(e) => panic!("unexpected {e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1));
    }
    let _ = timed_out;
    src.write_from(0, &pattern(4096, 9)).unwrap();
    a.write(src.view(0, 4096).unwrap(), &dst.remote_buffer(), true).await.unwrap();
    b.wait_for_write().await.unwrap();
    assert_eq!(contents(&dst, 0, 4096), pattern(4096, 9));
}

pub async fn revoked_key_is_remote_access_then_broken_fails_fast() {
    let (a, _b) = pair().await;
    let src = RdmaMemory::alloc(4096).unwrap();
    let dst = RdmaMemory::alloc(4096).unwrap();
    let rb: RdmaRemoteBuffer = dst.remote_buffer();
    a.write(src.view(0, 64).unwrap(), &rb, false).await.unwrap();
    drop(dst);
    let e = a.write(src.view(0, 64).unwrap(), &rb, false).await.unwrap_err();
    assert!(matches!(e, TransportError::RemoteAccess { .. }), "{e}");
    // It names the peer and the range the write named.
    let range = format!("{:#x}+64 key {:#x}", rb.addr, rb.key);
    assert!(e.to_string().contains(&range) && e.to_string().contains("write with "), "{e}");
    assert!(!e.to_string().contains("with the peer:"), "the peer is named: {e}");
    assert!(!a.connected());
    let t = Instant::now();
    let other = RdmaMemory::alloc(4096).unwrap();
    let e = a.write(src.view(0, 8).unwrap(), &other.remote_buffer(), false).await.unwrap_err();
    assert!(matches!(e, TransportError::Broken(_)), "{e}");
    assert!(e.to_string().contains(&range), "the later error says what broke it: {e}");
    assert!(t.elapsed() < Duration::from_millis(500), "a broken transport must fail fast");
    let e = a.wait_for_write().await.unwrap_err();
    assert!(matches!(e, TransportError::Broken(_)), "{e}");
}

pub async fn wrong_token_is_refused() {
    let a = RdmaTransport::new(config()).unwrap();
    let b = RdmaTransport::new(config()).unwrap();
    let ub = b.bind().unwrap();
    // Flip one character of the token-bearing payload: decode the URL,
    // change the token, re-encode.
    let (prefix, payload) = ub.rsplit_once('/').unwrap();
    use base64::Engine;
    let eng = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut json: serde_json::Value = serde_json::from_slice(&eng.decode(payload).unwrap()).unwrap();
    let tok = &mut json["ep"]["data"][0]["soft"]["token"][0];
    *tok = serde_json::json!((tok.as_u64().unwrap() + 1) % 256);
    let bad = format!("{prefix}/{}", eng.encode(serde_json::to_vec(&json).unwrap()));
    let e = a.connect(&bad).await.unwrap_err();
    assert!(matches!(e, TransportError::Broken(_)), "{e}");
    assert!(!a.connected());
    // Garbage URLs are argument errors.
    let c = RdmaTransport::new(config()).unwrap();
    assert!(matches!(c.connect("http://example").await, Err(TransportError::InvalidArgument { .. })));
    assert!(matches!(c.connect("rmacomm://soft/@@@").await, Err(TransportError::InvalidArgument { .. })));
}

pub async fn dropping_the_transport_aborts_pending() {
    let (a, b) = pair().await;
    let (a, b) = (Arc::try_unwrap(a).unwrap(), Arc::try_unwrap(b).unwrap());
    // A waiter on b, then b dropped: the waiter resolves with Aborted.
    let waiter = b.wait_for_write_with_timeout(None);
    drop(b);
    let e = tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("the waiter hung").unwrap_err();
    assert!(matches!(e, TransportError::Aborted { .. }), "{e}");
    drop(a);
    // Writes pending on a transport when it is dropped resolve with Aborted
    // (or had finished already), never hang; the memory stays valid.
    // (8 MiB fragments: larger than what the soft provider copies in the
    // posting thread, so the writes really are pending.)
    let big = config().with_frag_size(8 << 20);
    let (a, _b) = pair_with(big.clone(), big).await;
    let a = Arc::try_unwrap(a).unwrap();
    let src = RdmaMemory::alloc(64 << 20).unwrap();
    let dst = RdmaMemory::alloc(64 << 20).unwrap();
    let rb = dst.remote_buffer();
    let writes: Vec<_> = (0..8).map(|_| a.write(src.view(0, 64 << 20).unwrap(), &rb, false)).collect();
    drop(a);
    let mut aborted = 0;
    for w in writes {
        match tokio::time::timeout(Duration::from_secs(10), w).await.expect("a pending write hung") {
            Ok(()) => {}
            Err(TransportError::Aborted { .. }) => aborted += 1,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert!(aborted > 0, "eight 64 MiB writes cannot all be done before the drop");
    // Operations on a transport that was never connected are refused.
    let c = RdmaTransport::new(config()).unwrap();
    let e = c.write(src.view(0, 8).unwrap(), &rb, false).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
}

/// Every spelling of a 16-byte token that a formatter or encoder might put
/// in a message: Debug, JSON, hex, base64.
fn token_spellings(tok: &[u8]) -> Vec<String> {
    use base64::Engine;
    let dec: Vec<String> = tok.iter().map(|b| b.to_string()).collect();
    let hex: String = tok.iter().map(|b| format!("{b:02x}")).collect();
    vec![
        dec.join(", "),
        dec.join(","),
        hex.clone(),
        hex.to_uppercase(),
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(tok),
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tok),
    ]
}

/// The URL's payload as JSON, and the tokens of its QPs.
fn url_tokens(url: &str) -> (String, Vec<Vec<u8>>) {
    use base64::Engine;
    let (_, payload) = url.rsplit_once('/').unwrap();
    let json: serde_json::Value =
        serde_json::from_slice(&base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload).unwrap()).unwrap();
    let mut qps: Vec<&serde_json::Value> = json["ep"]["data"].as_array().unwrap().iter().collect();
    qps.extend(json["ep"]["notify"].as_object().map(|_| &json["ep"]["notify"]));
    let toks = qps
        .iter()
        .map(|qp| qp["soft"]["token"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect())
        .collect();
    (payload.to_owned(), toks)
}

fn assert_no_secret(what: &str, text: &str, url: &str) {
    let (payload, toks) = url_tokens(url);
    assert!(!toks.is_empty());
    assert!(!text.contains(&payload[..24.min(payload.len())]), "{what} echoes the URL: {text}");
    for t in &toks {
        for s in token_spellings(t) {
            assert!(!text.contains(&s), "{what} shows a token as {s:?}: {text}");
        }
    }
}

/// Tokens never reach `Debug` output or error messages: not the
/// transport's, not an endpoint's, not a refused connect's.
pub async fn tokens_never_show_in_debug_or_errors() {
    let cfg = config().with_qps(2);
    let a = RdmaTransport::new(cfg.clone()).unwrap();
    let b = RdmaTransport::new(cfg).unwrap();
    let ub = b.bind().unwrap();
    // The endpoint inside the URL, printed as a log line would print it.
    use base64::Engine;
    let (prefix, payload) = ub.rsplit_once('/').unwrap();
    let eng = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut json: serde_json::Value = serde_json::from_slice(&eng.decode(payload).unwrap()).unwrap();
    let ep: ibverbx::VirtualQpEndpoint = serde_json::from_value(json["ep"].clone()).unwrap();
    assert_no_secret("an endpoint's Debug", &format!("{ep:?}"), &ub);
    assert_no_secret("an endpoint's Debug", &format!("{ep:#?}"), &ub);
    assert_no_secret("redact_url", &rmacomm_transport::redact_url(&ub), &ub);
    assert_eq!(rmacomm_transport::redact_url(&ub), "rmacomm://soft/<redacted>");
    // A connect with a wrong token: neither the URL sent nor the real one.
    let tok = &mut json["ep"]["data"][0]["soft"]["token"][0];
    *tok = serde_json::json!((tok.as_u64().unwrap() + 1) % 256);
    let bad = format!("{prefix}/{}", eng.encode(serde_json::to_vec(&json).unwrap()));
    let e = a.connect(&bad).await.unwrap_err();
    assert!(matches!(e, TransportError::Broken(_)), "{e}");
    for text in [e.to_string(), format!("{e:?}")] {
        assert!(text.contains("QP 0x"), "the error should say which peer: {text}");
        assert_no_secret("a refused connect", &text, &ub);
        assert_no_secret("a refused connect", &text, &bad);
    }
    assert_no_secret("a transport's Debug", &format!("{a:?} {b:?}"), &ub);
    // Another provider's URL: an argument error, which does not echo it.
    let c = RdmaTransport::new(config()).unwrap();
    let foreign = ub.replacen("rmacomm://soft/", "rmacomm://verbs/", 1);
    let e = c.connect(&foreign).await.unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    assert_no_secret("a refused connect", &e.to_string(), &ub);
}

/// Two racing `connect` calls on one transport: exactly one goes ahead, the
/// other fails at once with an argument error; later ones fail the same
/// way, and the connection works.
pub async fn concurrent_connects_one_wins() {
    let a = RdmaTransport::new(config()).unwrap();
    let b = RdmaTransport::new(config()).unwrap();
    let (ua, ub) = (a.bind().unwrap(), b.bind().unwrap());
    let (r1, r2, rb) = tokio::join!(a.connect(&ub), a.connect(&ub), b.connect(&ua));
    rb.unwrap();
    let lost = match (r1, r2) {
        (Ok(()), Err(e)) | (Err(e), Ok(())) => e,
        (r1, r2) => panic!("exactly one connect must succeed: {r1:?}, {r2:?}"),
    };
    match &lost {
        TransportError::InvalidArgument { op: "connect", reason } => {
            assert!(reason.contains("already in progress") || reason.contains("already connected"), "{reason}")
        }
        other => panic!("the losing connect should be an argument error: {other}"),
    }
    assert!(a.connected() && b.connected());
    // Once connected, another connect (to any URL) is refused at once.
    let t = Instant::now();
    let e = a.connect(&ub).await.unwrap_err();
    assert!(
        matches!(&e, TransportError::InvalidArgument { reason, .. } if reason.contains("already connected")),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(1));
    assert!(a.connected(), "a refused connect must not break the transport");
    // And the connection works both ways.
    let (ma, mb) = (RdmaMemory::alloc(4096).unwrap(), RdmaMemory::alloc(4096).unwrap());
    ma.write_from(0, b"one connection").unwrap();
    a.write(ma.view(0, 14).unwrap(), &mb.remote_buffer(), true).await.unwrap();
    b.wait_for_write().await.unwrap();
    assert_eq!(contents(&mb, 0, 14), b"one connection");
    b.read(mb.view_mut(100, 14).unwrap(), &ma.remote_buffer()).await.unwrap();
    assert_eq!(contents(&mb, 100, 14), b"one connection");
}

/// A connect that fails before reaching the peer can be retried; one that
/// reached it cannot, and says to make a new transport.
pub async fn a_connect_may_be_retried_only_if_it_never_reached_the_peer() {
    let a = RdmaTransport::new(config()).unwrap();
    let b = RdmaTransport::new(config()).unwrap();
    let (ua, ub) = (a.bind().unwrap(), b.bind().unwrap());
    assert!(matches!(a.connect("not a url").await, Err(TransportError::InvalidArgument { .. })));
    let (ra, rb) = tokio::join!(a.connect(&ub), b.connect(&ua));
    ra.unwrap();
    rb.unwrap();
    // A connect polled once (it reaches the peer and waits for its answer)
    // and then dropped, as a caller's own timeout would.
    let c = RdmaTransport::new(config()).unwrap();
    let d = RdmaTransport::new(config()).unwrap();
    let ud = d.bind().unwrap();
    use std::future::Future as _;
    let mut pending = Box::pin(c.connect(&ud));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let first = pending.as_mut().poll(&mut cx);
    drop(pending);
    if first.is_pending() {
        let e = c.connect(&ud).await.unwrap_err();
        assert!(
            matches!(&e, TransportError::InvalidArgument { reason, .. } if reason.contains("create a new transport")),
            "{e}"
        );
        assert!(!c.connected());
    }
}
