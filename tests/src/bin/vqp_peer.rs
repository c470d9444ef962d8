//! A virtual-QP peer process for the two-process VirtualQp tests.
//!
//! Usage: `vqp_peer target|initiator --qps N --lb dqplb|spray --sizes N,N,...
//! [--frag BYTES] [--window N]`; the soft provider's chaos and link come from
//! `RMACOMM_SOFT_CHAOS` / `RMACOMM_SOFT_LINK`.
//!
//! Each side prints one JSON line with its virtual-QP endpoint and region,
//! reads the peer's line from stdin and connects. The initiator posts every
//! message back to back (even ones as RDMA_WRITE_WITH_IMM with immediate
//! `0x5eed_0000 | i`, odd ones as plain RDMA_WRITE), checks that each send
//! completes once and in order, then SENDs "done" and reads the whole region
//! back. The target checks the immediates arrive once and in order, verifies
//! each WRITE_WITH_IMM's bytes when its immediate arrives, and the plain
//! writes' when "done" arrives. Results are JSON lines; the exit status is 0
//! only if every check passed.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use ibverbx::{
    AccessFlags, LoadBalancing, MemoryRegion, RecvWr, SendFlags, SendOp, SendWr, VirtualCq, VirtualQp, VirtualQpConfig,
    VirtualQpEndpoint, WcOpcode, WcStatus, WorkCompletion,
};
use rmacomm_tests::pattern;
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Hello {
    endpoint: VirtualQpEndpoint,
    addr: u64,
    rkey: u32,
}

const WAIT: Duration = Duration::from_secs(120);
const IMM_TAG: u32 = 0x5eed_0000;

fn fail(msg: String) -> ! {
    println!("{}", serde_json::json!({ "error": msg }));
    std::process::exit(1);
}

/// The next `n` virtual completions.
fn next(cq: &VirtualCq, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::with_capacity(n);
    let mut buf = [WorkCompletion::empty(); 32];
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            fail(format!("only {} of {n} completions within {WAIT:?}: {out:?}", out.len()));
        }
        let want = (n - out.len()).min(buf.len());
        match cq.wait(&mut buf[..want], Some(left), Duration::ZERO) {
            Ok(k) => out.extend_from_slice(&buf[..k]),
            Err(e) => fail(format!("poll: {e}")),
        }
    }
    out
}

fn check_bytes(region: &MemoryRegion, off: usize, n: usize, seed: u64) {
    let mut got = vec![0u8; n];
    region.read(off, &mut got).unwrap();
    let want = pattern(n, seed);
    if got != want {
        let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        fail(format!("message {seed} ({n} bytes) differs at byte {at}"));
    }
}

fn main() {
    let filter = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let role = args.first().cloned().unwrap_or_default();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let num = |name: &str, d: u64| opt(name).map_or(d, |v| v.parse().unwrap_or_else(|_| fail(format!("bad {name}"))));
    let lb = LoadBalancing::parse(&opt("--lb").unwrap_or_else(|| "dqplb".into()))
        .unwrap_or_else(|| fail("--lb must be dqplb or spray".into()));
    let sizes: Vec<usize> = opt("--sizes")
        .map(|s| s.split(',').map(|x| x.parse().expect("size")).collect())
        .unwrap_or_else(|| vec![1024, 4097, 1 << 20]);
    let offsets: Vec<usize> = sizes.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect();
    let total: usize = sizes.iter().sum();
    let len = total + 4096;
    let cfg = VirtualQpConfig {
        total_qps: num("--qps", 4) as u32,
        load_balancing: lb,
        max_msg_size: num("--frag", 64 << 10) as u32,
        max_msg_cnt_per_qp: num("--window", 8) as u32,
        ..VirtualQpConfig::default()
    };

    let dev = ibverbx::devices().unwrap_or_else(|e| fail(format!("devices: {e}"))).remove(0);
    let ctx = dev.open().unwrap_or_else(|e| fail(format!("open: {e}")));
    let pd = ctx.alloc_pd().unwrap();
    let cq = VirtualCq::new(&ctx, 8192).unwrap();
    let qp = VirtualQp::new(&pd, &cq, &cfg).unwrap_or_else(|e| fail(format!("create: {e}")));
    let region = MemoryRegion::alloc(&pd, len, AccessFlags::all_remote()).unwrap();
    let msg_sge = [region.sge(total, 16).unwrap()];
    let imm_msgs: Vec<usize> = (0..sizes.len()).filter(|i| i % 2 == 0).collect();
    if role == "target" {
        // One receive per immediate and one for the final SEND.
        let wrs: Vec<RecvWr<'_>> =
            (0..=imm_msgs.len()).map(|k| RecvWr { wr_id: 1000 + k as u64, sg_list: &msg_sge }).collect();
        qp.post_recv(&wrs).unwrap();
    }
    let me = Hello { endpoint: qp.endpoint().unwrap(), addr: region.addr(), rkey: region.rkey() };
    println!("{}", serde_json::to_string(&me).unwrap());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let peer: Hello = serde_json::from_str(&line).unwrap_or_else(|e| fail(format!("peer hello: {e}")));
    qp.connect(&peer.endpoint).unwrap_or_else(|e| fail(format!("connect: {e}")));

    match role.as_str() {
        "target" => {
            for (k, &i) in imm_msgs.iter().enumerate() {
                let wc = next(&cq, 1)[0];
                let want = (1000 + k as u64, WcStatus::Success, WcOpcode::RecvRdmaWithImm, Some(IMM_TAG | i as u32));
                if (wc.wr_id, wc.status, wc.opcode, wc.imm_data) != want {
                    fail(format!("immediate {k}: got {wc:?}, want {want:?} ({:?})", qp.error()));
                }
                check_bytes(&region, offsets[i], sizes[i], i as u64);
                println!("{}", serde_json::json!({ "verified": sizes[i], "imm": wc.imm_data }));
            }
            let wc = next(&cq, 1)[0];
            let mut done = [0u8; 4];
            region.read(total, &mut done).unwrap();
            if (wc.wr_id, wc.status, wc.opcode) != (1000 + imm_msgs.len() as u64, WcStatus::Success, WcOpcode::Recv)
                || &done != b"done"
            {
                fail(format!("final SEND: {wc:?} {done:?}"));
            }
            for i in (0..sizes.len()).filter(|i| i % 2 == 1) {
                check_bytes(&region, offsets[i], sizes[i], i as u64);
                println!("{}", serde_json::json!({ "verified": sizes[i] }));
            }
            let st = qp.stats();
            println!(
                "{}",
                serde_json::json!({ "fragments": st.fragments_received, "out_of_order": st.fragments_out_of_order, "max_held": st.max_held })
            );
            // Stay until the initiator's read-back is over (it closes stdin).
            let mut rest = String::new();
            let _ = std::io::stdin().lock().read_line(&mut rest);
            println!("{}", serde_json::json!({ "ok": true }));
        }
        "initiator" => {
            let mut wrs = Vec::new();
            let sges: Vec<[ibverbx::Sge; 1]> = offsets
                .iter()
                .zip(&sizes)
                .enumerate()
                .map(|(i, (&off, &n))| {
                    region.write(off, &pattern(n, i as u64)).unwrap();
                    [region.sge(off, n).unwrap()]
                })
                .collect();
            for (i, sge) in sges.iter().enumerate() {
                let (remote_addr, rkey) = (peer.addr + offsets[i] as u64, peer.rkey);
                let op = if i % 2 == 0 {
                    SendOp::RdmaWriteWithImm { remote_addr, rkey, imm: IMM_TAG | i as u32 }
                } else {
                    SendOp::RdmaWrite { remote_addr, rkey }
                };
                wrs.push(SendWr { wr_id: i as u64, op, sg_list: sge, flags: SendFlags::SIGNALED });
            }
            let start = Instant::now();
            qp.post_send(&wrs).unwrap_or_else(|e| fail(format!("post: {e}")));
            let wcs = next(&cq, sizes.len());
            for (i, wc) in wcs.iter().enumerate() {
                if (wc.wr_id, wc.status, wc.byte_len as usize) != (i as u64, WcStatus::Success, sizes[i]) {
                    fail(format!("send completion {i}: {wc:?} ({:?})", qp.error()));
                }
            }
            let secs = start.elapsed().as_secs_f64();
            println!("{}", serde_json::json!({ "written": total, "seconds": secs }));
            region.write(total, b"done").unwrap();
            let s = [region.sge(total, 4).unwrap()];
            qp.post_send(&[SendWr { wr_id: 9999, op: SendOp::Send, sg_list: &s, flags: SendFlags::SIGNALED }]).unwrap();
            let wc = next(&cq, 1)[0];
            if (wc.wr_id, wc.status) != (9999, WcStatus::Success) {
                fail(format!("final SEND: {wc:?}"));
            }
            // Read the target's region back over our own (zeroed first).
            region.write(0, &vec![0u8; total]).unwrap();
            let b = [region.sge(0, total).unwrap()];
            let op = SendOp::RdmaRead { remote_addr: peer.addr, rkey: peer.rkey };
            qp.post_send(&[SendWr { wr_id: 7777, op, sg_list: &b, flags: SendFlags::SIGNALED }]).unwrap();
            let wc = next(&cq, 1)[0];
            if (wc.wr_id, wc.status, wc.opcode, wc.byte_len as usize)
                != (7777, WcStatus::Success, WcOpcode::RdmaRead, total)
            {
                fail(format!("read back: {wc:?}"));
            }
            for (i, &n) in sizes.iter().enumerate() {
                check_bytes(&region, offsets[i], n, i as u64);
            }
            println!("{}", serde_json::json!({ "read_back": total }));
            println!("{}", serde_json::json!({ "ok": true }));
        }
        r => fail(format!("unknown role {r:?}: use target or initiator")),
    }
}
