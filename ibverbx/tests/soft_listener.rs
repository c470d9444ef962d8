//! The soft TCP listener binds and advertises only the interfaces
//! `RMACOMM_SOCKET_IFNAME` (NCCL_SOCKET_IFNAME syntax) selects.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};
use ibverbx::{AccessFlags, MemoryRegion, QpInitAttr, SendFlags, SendOp, SendWr, WorkCompletion};

fn config(ifname: &str) -> SoftConfig {
    SoftConfig { link: SoftLink::Tcp, socket_ifname: Some(ifname.to_owned()), ..SoftConfig::default() }
}

/// The machine's IPv4 addresses that are not loopback (from `ip`-free
/// sources: the addresses a default context advertises).
fn other_addrs() -> Vec<IpAddr> {
    let ctx = SoftProvider::new(SoftConfig::default()).device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4).unwrap();
    let qp = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    qp.endpoint().unwrap().soft.unwrap().tcp.iter().map(|a| a.ip()).filter(|ip| !ip.is_loopback()).collect()
}

#[test]
fn only_the_selected_interfaces_listen() {
    let ctx = SoftProvider::new(config("=lo")).device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let a = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let b = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let ep = a.endpoint().unwrap();
    let tcp: Vec<SocketAddr> = ep.soft.as_ref().unwrap().tcp.clone();
    assert!(!tcp.is_empty() && tcp.iter().all(|a| a.ip().is_loopback()), "advertised {tcp:?}");
    let port = tcp[0].port();
    let others = other_addrs();
    if others.is_empty() {
        eprintln!("note: this machine has no non-loopback IPv4 address; only the advertisement is checked");
    }
    for ip in others {
        let r = TcpStream::connect_timeout(&SocketAddr::new(ip, port), Duration::from_secs(1));
        assert!(r.is_err(), "the listener also accepts on {ip} although only lo was selected");
    }
    // And it works over the selected interface.
    a.connect(&b.endpoint().unwrap()).unwrap();
    b.connect(&ep).unwrap();
    write_and_check(&pd, &a, &cq, b"over lo");
}

/// Writes `msg` from `qp` (connected) into a new region of `pd` and checks
/// that it landed.
fn write_and_check(pd: &ibverbx::ProtectionDomain, qp: &ibverbx::QueuePair, cq: &ibverbx::CompletionQueue, msg: &[u8]) {
    let src = MemoryRegion::alloc(pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = MemoryRegion::alloc(pd, 4096, AccessFlags::all_remote()).unwrap();
    src.write(0, msg).unwrap();
    let sg = [src.sge(0, msg.len()).unwrap()];
    let op = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
    qp.post_send(&[SendWr { wr_id: 1, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).unwrap();
    let mut wc = [WorkCompletion::empty(); 1];
    assert_eq!(cq.wait(&mut wc, Some(Duration::from_secs(20)), Duration::ZERO).unwrap(), 1);
    assert!(wc[0].is_ok(), "{:?}", wc[0]);
    let mut got = vec![0u8; msg.len()];
    dst.read(0, &mut got).unwrap();
    assert_eq!(got, msg);
}

#[test]
fn a_selection_that_matches_nothing_is_an_error_naming_the_variable() {
    let e = SoftProvider::new(config("=no-such-if0")).device().open().unwrap_err().to_string();
    assert!(e.contains("RMACOMM_SOCKET_IFNAME") && e.contains("no-such-if0"), "{e}");
    let e = SoftProvider::new(config("^")).device().open().unwrap_err().to_string();
    assert!(e.contains("RMACOMM_SOCKET_IFNAME"), "{e}");
}

/// A wait whose timeout is longer than poll(2) counts (2^40 s here, past
/// its i32 milliseconds) sleeps in pieces until the completion comes,
/// instead of overflowing the millisecond count (a panic, or a negative
/// timeout: a wait without end).
#[test]
fn a_wait_longer_than_poll_counts_still_returns_its_completion() {
    let ctx = SoftProvider::new(SoftConfig::default()).device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let a = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let b = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    a.connect(&b.endpoint().unwrap()).unwrap();
    b.connect(&a.endpoint().unwrap()).unwrap();
    let src = MemoryRegion::alloc(&pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = MemoryRegion::alloc(&pd, 4096, AccessFlags::all_remote()).unwrap();
    let sg = [src.sge(0, 8).unwrap()];
    std::thread::scope(|s| {
        s.spawn(|| {
            // Posted once the wait below is asleep.
            std::thread::sleep(Duration::from_millis(200));
            let op = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
            a.post_send(&[SendWr { wr_id: 9, op, sg_list: &sg, flags: SendFlags::SIGNALED }]).unwrap();
        });
        let mut wc = [WorkCompletion::empty(); 1];
        assert_eq!(cq.wait(&mut wc, Some(Duration::from_secs(1 << 40)), Duration::ZERO).unwrap(), 1);
        assert!(wc[0].is_ok() && wc[0].wr_id == 9, "{:?}", wc[0]);
    });
}

/// A requester whose hello connection is closed without an answer (the
/// target's listener closed it as one of too many pending handshakes, as
/// under a flood of idle connections) connects again instead of failing its
/// QP. A proxy in front of the target resets the first connection after its
/// hello arrived, then forwards the next ones.
#[test]
fn a_hello_connection_closed_without_an_answer_is_retried() {
    use std::net::{Shutdown, TcpListener};

    let ctx = SoftProvider::new(config("=lo")).device().open().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let a = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let b = pd.create_qp(&QpInitAttr::default(), &cq, &cq).unwrap();
    let target = b.endpoint().unwrap().soft.as_ref().unwrap().tcp[0];
    let proxy = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut via_proxy = b.endpoint().unwrap();
    via_proxy.soft.as_mut().unwrap().tcp = vec![proxy.local_addr().unwrap()];
    let proxied = std::thread::spawn(move || {
        let (first, _) = proxy.accept().unwrap();
        // Its hello arrives, unread: closing now resets the connection.
        let mut b = [0u8; 1];
        first.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = first.peek(&mut b);
        drop(first);
        let (mut from, _) = proxy.accept().unwrap();
        let mut to = TcpStream::connect(target).unwrap();
        let (mut from2, mut to2) = (from.try_clone().unwrap(), to.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut to2, &mut from2);
            let _ = from2.shutdown(Shutdown::Write);
        });
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
        let _ = back.join();
    });
    a.connect(&via_proxy).unwrap();
    b.connect(&a.endpoint().unwrap()).unwrap();
    write_and_check(&pd, &a, &cq, b"retried");
    // The proxy's copies end with the connection (not waited for).
    drop(proxied);
}
