//! Random, truncated and malformed frames sent to a live soft/tcp endpoint:
//! each connection is closed with a logged reason, nothing panics or hangs,
//! no registered memory changes, and the endpoint keeps serving good peers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ibverbx::soft::wire::{Frame, Hello, HelloStatus, HEADER_LEN, HELLO_LEN};
use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};
use ibverbx::{
    AccessFlags, CompletionQueue, Context, InitAttr, MemoryRegion, ProtectionDomain, QpInitAttr, QpTransition,
    QueuePair, RecvWr, RtrAttr, SendFlags, SendOp, SendWr, WcStatus, WorkCompletion,
};
use rand::{Rng, SeedableRng};

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Reads until EOF or error; fails the test if the peer keeps the
/// connection open past `limit`.
fn expect_closed(s: &mut TcpStream, what: &str) {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                panic!("{what}: the endpoint kept the connection open for 10 s")
            }
            Err(_) => return,
        }
    }
}

#[test]
fn random_and_truncated_frames_close_the_connection_only() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |i| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        prev(i);
    }));
    let _ = tracing_subscriber::fmt().with_env_filter("warn").with_test_writer().try_init();

    let dev = SoftProvider::new(SoftConfig { link: SoftLink::Tcp, ..SoftConfig::default() }).device();
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let target = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let other = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    target.connect(&other.endpoint().unwrap()).unwrap();
    other.connect(&target.endpoint().unwrap()).unwrap();
    let mem = MemoryRegion::alloc(&pd, 1 << 16, AccessFlags::all_remote()).unwrap();
    // The bad peers connect to `probe`, whose connection is forged as
    // coming from `other`: a QP admits one connection per life (reset
    // epoch), from the QP set at RTR, so `probe` is reset and brought back
    // to RTR before each.
    let probe = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let other_ep = other.endpoint().unwrap();
    let ep = probe.endpoint().unwrap();
    let soft = ep.soft.clone().unwrap();
    let addr = *soft.tcp.iter().find(|a| a.ip().is_loopback()).unwrap();
    let hello = Hello { src_qpn: other_ep.qpn, dst_qpn: ep.qpn, token: soft.token, rnr_retry: 0 };
    let renew = || {
        probe.modify(&QpTransition::Reset).unwrap();
        probe.modify(&QpTransition::Init(InitAttr::default())).unwrap();
        probe.modify(&QpTransition::Rtr(RtrAttr::new(other_ep.clone()))).unwrap();
    };
    let hello_status = |h: &Hello| {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&h.encode()).unwrap();
        let mut r = [0u8; HELLO_LEN];
        s.read_exact(&mut r).unwrap();
        (HelloStatus::decode(&r).unwrap(), s)
    };
    let connect = || {
        renew();
        let (st, s) = hello_status(&hello);
        assert_eq!(st, HelloStatus::Ok);
        s
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);

    // 1. Garbage instead of a hello, and truncated hellos.
    for i in 0..50 {
        let mut s = TcpStream::connect(addr).unwrap();
        let n = if i % 2 == 0 { HELLO_LEN } else { rng.gen_range(0..HELLO_LEN) };
        let junk: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
        s.write_all(&junk).unwrap();
        if n < HELLO_LEN {
            s.shutdown(std::net::Shutdown::Write).unwrap();
        }
        expect_closed(&mut s, "garbage hello");
    }
    // 2. A wrong token is refused with a reply, then closed.
    {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut bad = hello;
        bad.token[0] ^= 1;
        s.write_all(&bad.encode()).unwrap();
        let mut r = [0u8; HELLO_LEN];
        s.read_exact(&mut r).unwrap();
        assert_eq!(HelloStatus::decode(&r), Ok(HelloStatus::BadToken));
        expect_closed(&mut s, "wrong token");
    }
    // 2b. With the right token, still one connection per life of the QP,
    //     and only from the QP set at RTR.
    {
        let first = connect();
        let (st, mut again) = hello_status(&hello);
        assert_eq!(st, HelloStatus::BadToken, "a second connection in one life was admitted");
        expect_closed(&mut again, "second connection");
        drop(first);
        renew();
        let (st, mut wrong) = hello_status(&Hello { src_qpn: other_ep.qpn ^ 1, ..hello });
        assert_eq!(st, HelloStatus::BadToken, "a connection from another QP than RTR's was admitted");
        expect_closed(&mut wrong, "connection from the wrong QP");
    }
    // 3. Random headers and payloads after a valid hello.
    for _ in 0..200 {
        let mut s = connect();
        let mut hdr = [0u8; HEADER_LEN];
        rng.fill(&mut hdr[..]);
        let tail: Vec<u8> = (0..rng.gen_range(0..256)).map(|_| rng.gen()).collect();
        let _ = s.write_all(&hdr);
        let _ = s.write_all(&tail);
        let _ = s.shutdown(std::net::Shutdown::Write);
        expect_closed(&mut s, "random frame");
    }
    // 4. Valid headers that lie: truncated payloads, lengths over the
    //    maximum, keys and addresses that do not exist.
    let lies = [
        Frame::Write { psn: 0, raddr: mem.addr(), rkey: mem.rkey(), len: 1000, imm: None },
        Frame::Write { psn: 0, raddr: mem.addr(), rkey: mem.rkey(), len: u32::MAX, imm: None },
        Frame::Write { psn: 0, raddr: 0x1000, rkey: 0xdead_beef, len: 64, imm: None },
        Frame::Write { psn: 0, raddr: mem.addr() + (1 << 16) - 8, rkey: mem.rkey(), len: 64, imm: None },
        Frame::ReadReq { psn: 0, raddr: mem.addr(), rkey: mem.rkey() ^ 1, len: 64 },
        Frame::Atomic { psn: 0, raddr: mem.addr() + 3, rkey: mem.rkey(), cmp_swap: false, a: 1, b: 0 },
        Frame::Send { psn: 0, len: 5000, imm: None },
        Frame::Ack { psn: 0 },
    ];
    for f in lies {
        let mut s = connect();
        // The endpoint may close as soon as it has read the header, so these
        // writes may fail; what matters is that it closes.
        let _ = s.write_all(&f.encode());
        let _ = s.write_all(&[0xAB; 10]);
        let _ = s.shutdown(std::net::Shutdown::Write);
        expect_closed(&mut s, &format!("{f:?}"));
    }
    // 5. Fuzzed valid frames: one byte of a real header flipped.
    for _ in 0..200 {
        let mut s = connect();
        let mut hdr = Frame::Write { psn: 0, raddr: 0x10, rkey: 7, len: 16, imm: Some(1) }.encode();
        let i = rng.gen_range(0..HEADER_LEN);
        hdr[i] = rng.gen();
        let _ = s.write_all(&hdr);
        let _ = s.write_all(&[0xCD; 16]);
        let _ = s.shutdown(std::net::Shutdown::Write);
        expect_closed(&mut s, "mutated frame");
    }

    // Only the authorised, in-bounds write whose payload was cut short left
    // bytes behind (its first 10, as a failed RDMA WRITE may); nothing else
    // changed.
    let mut buf = vec![0u8; 1 << 16];
    mem.read(0, &mut buf).unwrap();
    assert!(buf[..10].iter().all(|&b| b == 0xAB || b == 0), "{:?}", &buf[..10]);
    assert!(buf[10..].iter().all(|&b| b == 0), "a malformed frame changed registered memory");
    // The endpoint still serves a well-behaved peer.
    let src = MemoryRegion::alloc(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.write(0, b"still alive").unwrap();
    let s = [src.sge(0, 11).unwrap()];
    other
        .post_send(&[SendWr {
            wr_id: 1,
            op: SendOp::RdmaWrite { remote_addr: mem.addr(), rkey: mem.rkey() },
            sg_list: &s,
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    let mut wc = [WorkCompletion::empty(); 1];
    assert_eq!(cq.wait(&mut wc, Some(Duration::from_secs(20)), Duration::ZERO).unwrap(), 1);
    assert!(wc[0].is_ok(), "{:?}", wc[0]);
    let mut out = [0u8; 11];
    mem.read(0, &mut out).unwrap();
    assert_eq!(&out, b"still alive");
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a malformed frame panicked a thread");
}

/// A SEND whose connection ends before all of it arrived (the requester
/// died) consumes no receive: the receive it had taken goes back, so the
/// QP's error still completes it, in posting order, as it completes every
/// receive it holds.
#[test]
fn a_send_cut_short_keeps_its_receive() {
    assert_eq!(send_cut_short(true), [(10, WcStatus::WrFlushErr), (11, WcStatus::WrFlushErr)]);
}

/// A SEND whose requester stops sending mid-way (a stalled process, its
/// connection open) does not hold its receive past the QP's error: the
/// error flushes both receives at once (the one being filled after the
/// other, once nothing more is written into it).
#[test]
fn a_stalled_send_lets_the_error_flush_its_receive() {
    let mut got = send_cut_short(false);
    got.sort_by_key(|g| g.0);
    assert_eq!(got, [(10, WcStatus::WrFlushErr), (11, WcStatus::WrFlushErr)]);
}

/// A soft/tcp QP at RTR (remote access allowed) and a connection to it
/// forged as coming from the QP it was connected to, its hello accepted.
/// Bound whole (`let f = forged()`): a pattern with `..` would drop the
/// fields it leaves at once.
struct Forged {
    _ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    probe: QueuePair,
    _other: QueuePair,
    s: TcpStream,
}

fn forged() -> Forged {
    let _ = tracing_subscriber::fmt().with_env_filter("warn").with_test_writer().try_init();
    let dev = SoftProvider::new(SoftConfig { link: SoftLink::Tcp, ..SoftConfig::default() }).device();
    let ctx = dev.open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let probe = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let other = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let other_ep = other.endpoint().unwrap();
    probe.modify(&QpTransition::Init(InitAttr { access: AccessFlags::all_remote(), ..InitAttr::default() })).unwrap();
    probe.modify(&QpTransition::Rtr(RtrAttr::new(other_ep.clone()))).unwrap();
    let ep = probe.endpoint().unwrap();
    let soft = ep.soft.clone().unwrap();
    let at = *soft.tcp.iter().find(|a| a.ip().is_loopback()).unwrap();
    let hello = Hello { src_qpn: other_ep.qpn, dst_qpn: ep.qpn, token: soft.token, rnr_retry: 0 };
    let mut s = TcpStream::connect(at).unwrap();
    s.write_all(&hello.encode()).unwrap();
    let mut r = [0u8; HELLO_LEN];
    s.read_exact(&mut r).unwrap();
    assert_eq!(HelloStatus::decode(&r), Ok(HelloStatus::Ok));
    Forged { _ctx: ctx, pd, cq, probe, _other: other, s }
}

impl Forged {
    /// Posts receives `10..10 + n` of 8 KiB each (in the region returned).
    fn post_recvs(&self, n: u64) -> MemoryRegion {
        let buf = MemoryRegion::alloc(&self.pd, n as usize * 8192, AccessFlags::LOCAL_WRITE).unwrap();
        for i in 0..n {
            let sge = [buf.sge(i as usize * 8192, 8192).unwrap()];
            self.probe.post_recv(&[RecvWr { wr_id: 10 + i, sg_list: &sge }]).unwrap();
        }
        buf
    }

    /// Sends `wire`, gives the responder time to read it (and stall on what
    /// is missing), then moves the QP to ERR.
    fn send_then_fail(&mut self, wire: &[u8]) {
        self.s.write_all(wire).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        self.probe.modify(&QpTransition::Err).unwrap();
    }

    /// The next `n` receive completions, as they come.
    fn completions(&self, n: usize) -> Vec<(u64, WcStatus)> {
        let mut wc = [WorkCompletion::empty(); 4];
        let mut got = Vec::new();
        while got.len() < n {
            let k = self.cq.wait(&mut wc, Some(Duration::from_secs(10)), Duration::ZERO).unwrap();
            assert!(k > 0, "the QP's error completed {got:?} of the {n} receives posted");
            got.extend(wc[..k].iter().map(|w| (w.wr_id, w.status)));
        }
        got
    }
}

/// Two receives posted on a QP whose forged requester sends 100 bytes of a
/// 5000-byte SEND, then closes its connection (`close`) or keeps it open;
/// then the QP is moved to ERR. The receive completions, as they came.
fn send_cut_short(close: bool) -> Vec<(u64, WcStatus)> {
    let mut f = forged();
    let _buf = f.post_recvs(2);
    let mut wire = Frame::Send { psn: 0, len: 5000, imm: None }.encode().to_vec();
    wire.extend_from_slice(&[0xAB; 100]);
    if close {
        f.s.write_all(&wire).unwrap();
        f.s.shutdown(std::net::Shutdown::Write).unwrap();
        expect_closed(&mut f.s, "cut SEND");
        let mut wc = [WorkCompletion::empty(); 1];
        assert_eq!(f.cq.poll(&mut wc).unwrap(), 0, "a cut SEND completed a receive: {:?}", wc[0]);
        f.probe.modify(&QpTransition::Err).unwrap();
    } else {
        // The wait: time for the responder to take a receive and wait
        // inside the SEND (were the error first, the SEND would find no
        // receive and the stall would go untested).
        f.send_then_fail(&wire);
    }
    let got = f.completions(2);
    if !close {
        expect_closed(&mut f.s, "stalled SEND after the QP's error");
    }
    got
}

/// A peer that stops sending in the middle of a WRITE's payload (a stalled
/// process, its connection open) does not keep its connection past the
/// QP's error.
#[test]
fn a_stalled_write_ends_with_the_qp() {
    let mut f = forged();
    let mem = MemoryRegion::alloc(&f.pd, 1 << 16, AccessFlags::all_remote()).unwrap();
    let mut first =
        Frame::Write { psn: 0, raddr: mem.addr(), rkey: mem.rkey(), len: 1 << 16, imm: None }.encode().to_vec();
    first.extend_from_slice(&[0xAB; 100]);
    f.send_then_fail(&first);
    expect_closed(&mut f.s, "stalled WRITE after the QP's error");
}

/// The QP's error while the responder holds a notification's completion
/// for its ACK (a SEND behind it, stalled, kept the ACK back): that
/// completion comes first, before the flushes of the receives behind it.
#[test]
fn the_error_completes_what_arrived_before_it_flushes() {
    let mut f = forged();
    let _buf = f.post_recvs(3);
    let mut wire = Frame::Notify { psn: 0, len: 0, imm: 7 }.encode().to_vec();
    wire.extend_from_slice(&Frame::Send { psn: 1, len: 5000, imm: None }.encode());
    wire.extend_from_slice(&[0xAB; 100]);
    f.send_then_fail(&wire);
    let mut got = f.completions(3);
    assert_eq!(got[0], (10, WcStatus::Success), "the notification's completion came after a flush: {got:?}");
    got.sort_by_key(|g| g.0);
    assert_eq!(got, [(10, WcStatus::Success), (11, WcStatus::WrFlushErr), (12, WcStatus::WrFlushErr)]);
}

/// A peer that stops in the middle of a request's header does not keep its
/// connection past the QP's error either.
#[test]
fn a_stalled_header_ends_with_the_qp() {
    let mut f = forged();
    let hdr = Frame::Write { psn: 0, raddr: 0, rkey: 0, len: 0, imm: None }.encode();
    f.send_then_fail(&hdr[..HEADER_LEN / 2]);
    expect_closed(&mut f.s, "stalled header after the QP's error");
}

/// A peer's RDMA WRITE whose payload is still arriving when the region's
/// owner deregisters it: deregistration returns (it does not wait for the
/// peer), and no byte of the payload lands after it has returned; the
/// request is refused and its connection closed.
#[test]
fn a_write_arriving_as_its_region_is_deregistered_stops_there() {
    let mut f = forged();
    const LEN: usize = 1 << 16;
    let mut buf = vec![0u8; LEN];
    // SAFETY: `buf` outlives the region, which is dropped first below.
    let mr = unsafe { MemoryRegion::register_raw(&f.pd, buf.as_mut_ptr(), LEN, AccessFlags::all_remote()) }.unwrap();
    // The header and the first half in one write: the responder reads what
    // is there when it wakes, then sleeps until the rest is all there.
    let mut first =
        Frame::Write { psn: 0, raddr: mr.addr(), rkey: mr.rkey(), len: LEN as u32, imm: None }.encode().to_vec();
    first.extend_from_slice(&[0xAB; LEN / 2]);
    f.s.write_all(&first).unwrap();
    // What landed of the first half (the responder writes as it reads).
    let p = buf.as_ptr();
    // SAFETY: in bounds; read volatile, as the responder writes meanwhile.
    let landed = || (0..LEN).filter(|&i| unsafe { std::ptr::read_volatile(p.add(i)) } != 0).count();
    let t = std::time::Instant::now();
    while landed() < LEN / 2 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(landed(), LEN / 2, "the first half of the payload did not land within 5 s");
    drop(mr);
    // SAFETY: as above.
    let at_dereg: Vec<u8> = (0..LEN).map(|i| unsafe { std::ptr::read_volatile(p.add(i)) }).collect();
    let _ = f.s.write_all(&[0xAB; LEN / 2]);
    let _ = f.s.shutdown(std::net::Shutdown::Write);
    expect_closed(&mut f.s, "WRITE into a deregistered region");
    let changed = buf.iter().zip(&at_dereg).filter(|(a, b)| a != b).count();
    assert_eq!(changed, 0, "{changed} bytes of a peer's WRITE landed after deregistration returned");
}

/// A peer that stops reading in the middle of an RDMA READ's response (its
/// socket's buffers full, the responder waiting to send more) does not
/// keep its connection past the QP's error: the response is cut there and
/// the connection closed (the responder waited for the peer, holding the
/// QP and the region, for as long as the peer kept the socket open).
#[test]
fn a_read_response_the_peer_stops_reading_ends_with_the_qp() {
    let mut f = forged();
    const LEN: usize = 64 << 20;
    let mr = MemoryRegion::alloc(&f.pd, LEN, AccessFlags::all_remote()).unwrap();
    f.send_then_fail(&Frame::ReadReq { psn: 0, raddr: mr.addr(), rkey: mr.rkey(), len: LEN as u32 }.encode());
    // What the sockets held when the QP failed, then the end: not the rest
    // of the response (reading lets a responder still waiting go on).
    std::thread::sleep(Duration::from_millis(300));
    f.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (mut got, mut chunk) = (0usize, vec![0u8; 1 << 16]);
    loop {
        match f.s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    assert!(got < HEADER_LEN + LEN, "the whole response ({got} bytes) was sent after the QP's error");
}

/// A peer's RDMA READ whose response is still being sent (the peer reads
/// slowly) when the region's owner deregisters it: deregistration returns,
/// and nothing read from the region after that reaches the peer (the
/// owner refills it with a sentinel the moment deregistration returns);
/// the torn response ends the connection.
#[test]
fn a_read_sent_as_its_region_is_deregistered_stops_there() {
    let mut f = forged();
    // Larger than what the sockets' buffers hold, so that the response is
    // still being sent when the region goes.
    const LEN: usize = 64 << 20;
    let mut buf = vec![0x11u8; LEN];
    // SAFETY: `buf` outlives the region, which is dropped first below.
    let mr = unsafe { MemoryRegion::register_raw(&f.pd, buf.as_mut_ptr(), LEN, AccessFlags::all_remote()) }.unwrap();
    f.s.write_all(&Frame::ReadReq { psn: 0, raddr: mr.addr(), rkey: mr.rkey(), len: LEN as u32 }.encode()).unwrap();
    // Nothing read until the sockets' buffers are full and the responder
    // waits to send more.
    std::thread::sleep(Duration::from_millis(300));
    drop(mr);
    buf.fill(0xEE);
    f.s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = 0usize;
    let mut chunk = vec![0u8; 1 << 16];
    let mut sentinel = 0usize;
    loop {
        match f.s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                sentinel += chunk[..n].iter().filter(|&&b| b == 0xEE).count();
                got += n;
            }
        }
    }
    assert_eq!(sentinel, 0, "{sentinel} bytes read from the region after its deregistration returned reached the peer");
    // (A NAK alone when the deregistration came before the first send.)
    assert!(got > 0 && got < HEADER_LEN + LEN, "the response was {got} bytes: not cut by the deregistration");
}

/// `retry_cnt` / `rnr_retry` beyond verbs' 3-bit range are refused at RTS,
/// as the verbs provider refuses them (the requester took 8 as a count, the
/// responder it told as "forever"); the QP stays in RTR and takes a valid one.
#[test]
fn retry_counts_past_seven_are_refused_at_rts() {
    use ibverbx::{QpState, RtsAttr};
    let f = forged();
    for bad in [RtsAttr { rnr_retry: 8, ..RtsAttr::default() }, RtsAttr { retry_cnt: 200, ..RtsAttr::default() }] {
        let e = f.probe.modify(&QpTransition::Rts(bad)).unwrap_err();
        assert!(e.to_string().contains("must be 0..=7"), "{e}");
        assert_eq!(f.probe.state(), QpState::Rtr);
    }
    f.probe.modify(&QpTransition::Rts(RtsAttr { rnr_retry: 7, ..RtsAttr::default() })).unwrap();
    assert_eq!(f.probe.state(), QpState::Rts);
}
