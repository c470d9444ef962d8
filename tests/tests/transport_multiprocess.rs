//! `RdmaTransport` between real processes: same host (shm, and tcp forced)
//! and two network namespaces (tcp over veth); a peer killed mid-transfer.

use std::time::Duration;

use rmacomm_tests::harness::{introduce, NetnsPair, Peer};

const PEER: &str = env!("CARGO_BIN_EXE_transport_peer");

/// Runs a server and a client; returns the client's output lines.
fn run(prefix_s: &[String], prefix_c: &[String], env: &[(&str, &str)], extra: &[&str]) -> Vec<String> {
    let s = Peer::spawn("server", PEER, prefix_s, &[&["server"], extra].concat(), env);
    let c = Peer::spawn("client", PEER, prefix_c, &[&["client"], extra].concat(), env);
    let (s, c) = introduce(s, c);
    let (co, cok) = c.finish(Duration::from_secs(180));
    let (so, sok) = s.finish(Duration::from_secs(30));
    assert!(cok && sok, "client: {co:?}\nserver: {so:?}");
    assert_eq!(so.iter().filter(|l| l.contains("verified")).count(), 9, "{so:?}");
    co
}

#[test]
fn shm_two_processes() {
    run(&[], &[], &[("RMACOMM_PROVIDER", "soft"), ("RMACOMM_SOFT_LINK", "auto")], &[]);
}

#[test]
fn shm_two_processes_four_qps() {
    run(&[], &[], &[("RMACOMM_PROVIDER", "soft"), ("RMACOMM_SOFT_LINK", "auto")], &["--qps", "4"]);
}

#[test]
fn tcp_two_processes() {
    run(&[], &[], &[("RMACOMM_PROVIDER", "soft"), ("RMACOMM_SOFT_LINK", "tcp")], &[]);
}

#[test]
fn tcp_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => return println!("skipped: two network namespaces need root and iproute2 ({why})"),
    };
    let env = [("RMACOMM_PROVIDER", "soft"), ("RMACOMM_SOFT_LINK", "auto")];
    run(&NetnsPair::prefix(&ns.a), &NetnsPair::prefix(&ns.b), &env, &["--qps", "4"]);
}

/// The transport on CUDA device memory (the stand-in's): every size
/// written with notify into the server's device memory, verified there,
/// and read back, over the soft provider's `link`; `mem` is `cuda` or
/// `mixed` (the read-back buffer in host memory).
/// Returns the bytes the client copied into and out of the server's device
/// memory itself (CUDA IPC), `None` where the stand-in is not built.
fn cuda(prefix_s: &[String], prefix_c: &[String], link: &str, mem: &str) -> Option<u64> {
    let lib = rmacomm_cuda::standin_for_tests()?;
    let lib = lib.to_string_lossy().into_owned();
    let env = [("RMACOMM_PROVIDER", "soft"), ("RMACOMM_SOFT_LINK", link), ("RMACOMM_CUDA_LIB", lib.as_str())];
    let out = run(prefix_s, prefix_c, &env, &["--mem", mem, "--qps", "2"]);
    let line = out.iter().find(|l| l.contains("peer_device_bytes")).unwrap_or_else(|| panic!("{out:?}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    Some(v["peer_device_bytes"].as_u64().unwrap())
}

/// Same host over shared memory: the client opens the server's device
/// memory through CUDA IPC and copies itself (every write and read).
#[test]
fn cuda_memory_same_host() {
    if let Some(direct) = cuda(&[], &[], "auto", "cuda") {
        assert!(direct >= 2 * (64 << 20), "the client copied {direct} bytes through IPC");
    }
}

/// The same on cuMem/VMM memory (2 MiB mappings, as PyTorch's expandable
/// segments): the client maps the server's memory through its mappings'
/// descriptors (the server's descriptor server), not an IPC handle.
#[test]
fn cuda_vmm_memory_same_host() {
    if let Some(direct) = cuda(&[], &[], "auto", "vmm") {
        assert!(direct >= 2 * (64 << 20), "the client copied {direct} bytes through the VMM mapping");
    }
}

/// Two processes of a host with two GPUs (the stand-in's), each on its
/// own: the client opens the server's memory through CUDA IPC in its own
/// GPU's context and copies itself. Each process may retain only its own
/// GPU's context (`RMACOMM_STANDIN_ALLOWED_DEVICES`: a context on the
/// other GPU aborts it) — with both GPUs visible (`ALL`, ordinals 0 and 1),
/// with one each (`CUDA_VISIBLE_DEVICES`: both see ordinal 0, different
/// GPUs), and with the two numbered the other way round in the server.
/// Opened by the owner's ordinal (before), the client made a context on
/// the server's GPU in its engine (ALL), or opened on the wrong GPU.
fn cuda_two_gpus(server: (&str, &str), client: (&str, &str), mem: &str) -> u64 {
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return 2 * (64 << 20) };
    let lib = lib.to_string_lossy().into_owned();
    let env = [
        ("RMACOMM_PROVIDER", "soft"),
        ("RMACOMM_SOFT_LINK", "auto"),
        ("RMACOMM_CUDA_LIB", lib.as_str()),
        ("RMACOMM_STANDIN_DEVICES", "2"),
    ];
    // (CUDA_VISIBLE_DEVICES, the ordinal the process uses there).
    let prefix = |(visible, gpu): (&str, &str)| -> Vec<String> {
        let mut p = vec!["env".to_string(), format!("RMACOMM_STANDIN_ALLOWED_DEVICES={gpu}")];
        if !visible.is_empty() {
            p.push(format!("CUDA_VISIBLE_DEVICES={visible}"));
        }
        p
    };
    let extra =
        |gpu: &str| vec!["--mem".to_string(), mem.to_string(), "--qps".into(), "2".into(), "--gpu".into(), gpu.into()];
    let (se, ce) = (extra(server.1), extra(client.1));
    let s = Peer::spawn(
        "server",
        PEER,
        &prefix(server),
        &[&["server"], &se.iter().map(String::as_str).collect::<Vec<_>>()[..]].concat(),
        &env,
    );
    let c = Peer::spawn(
        "client",
        PEER,
        &prefix(client),
        &[&["client"], &ce.iter().map(String::as_str).collect::<Vec<_>>()[..]].concat(),
        &env,
    );
    let (s, c) = introduce(s, c);
    let (co, cok) = c.finish(Duration::from_secs(180));
    let (so, sok) = s.finish(Duration::from_secs(30));
    assert!(cok && sok, "client: {co:?}\nserver: {so:?}");
    assert_eq!(so.iter().filter(|l| l.contains("verified")).count(), 9, "{so:?}");
    let line = co.iter().find(|l| l.contains("peer_device_bytes")).unwrap_or_else(|| panic!("{co:?}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    v["peer_device_bytes"].as_u64().unwrap()
}

#[test]
fn cuda_memory_two_gpus_all_visible() {
    let direct = cuda_two_gpus(("", "1"), ("", "0"), "cuda");
    assert!(direct >= 2 * (64 << 20), "the client copied {direct} bytes through IPC");
}

#[test]
fn cuda_memory_two_gpus_one_visible_each() {
    let direct = cuda_two_gpus(("1", "0"), ("0", "0"), "cuda");
    assert!(direct >= 2 * (64 << 20), "the client copied {direct} bytes through IPC");
}

/// Both GPUs visible to both, numbered the other way round in the server:
/// its ordinal 0 is the client's ordinal 1.
#[test]
fn cuda_memory_two_gpus_numbered_differently() {
    let direct = cuda_two_gpus(("1,0", "0"), ("1,0", "1"), "cuda");
    assert!(direct >= 2 * (64 << 20), "the client copied {direct} bytes through IPC");
}

/// Both processes on one GPU, which each numbers differently (the
/// server's ordinal 0 is the client's 1): the client opens the memory in
/// that GPU's context, its own.
#[test]
fn cuda_memory_one_gpu_numbered_differently() {
    let direct = cuda_two_gpus(("1,0", "0"), ("0,1", "1"), "cuda");
    assert!(direct >= 2 * (64 << 20), "the client copied {direct} bytes through IPC");
}

#[test]
fn cuda_vmm_memory_two_gpus_all_visible() {
    let direct = cuda_two_gpus(("", "1"), ("", "0"), "vmm");
    assert!(direct >= 2 * (64 << 20), "the client copied {direct} bytes through the VMM mapping");
}

#[test]
fn cuda_memory_same_host_tcp_mixed() {
    // Over tcp nothing is opened: the server's engine places every byte.
    assert_eq!(cuda(&[], &[], "tcp", "mixed").unwrap_or(0), 0);
}

#[test]
fn cuda_memory_two_network_namespaces() {
    let ns = match NetnsPair::create() {
        Ok(ns) => ns,
        Err(why) => return println!("skipped: two network namespaces need root and iproute2 ({why})"),
    };
    assert_eq!(cuda(&NetnsPair::prefix(&ns.a), &NetnsPair::prefix(&ns.b), "auto", "cuda").unwrap_or(0), 0);
}

fn peer_killed(link: &str, stop_instead_of_kill: bool) {
    let env = [("RMACOMM_PROVIDER", "soft"), ("RMACOMM_SOFT_LINK", link)];
    let h = Peer::spawn("holder", PEER, &[], &["hold"], &env);
    let s = Peer::spawn("streamer", PEER, &[], &["stream"], &env);
    let (mut h, s) = introduce(h, s);
    assert!(h.line(Duration::from_secs(30)).contains("ready"));
    assert!(s.line(Duration::from_secs(30)).contains("ready"));
    std::thread::sleep(Duration::from_millis(300));
    let pid = h.child.id().to_string();
    if stop_instead_of_kill {
        // A stopped (not dead) peer: nothing closes the connection; only
        // timeouts can tell.
        std::process::Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    } else {
        h.child.kill().unwrap();
    }
    let (out, ok) = s.finish(Duration::from_secs(60));
    if stop_instead_of_kill {
        std::process::Command::new("kill").args(["-CONT", &pid]).status().unwrap();
    }
    assert!(ok, "{out:?}");
    let failed = out.iter().find(|l| l.contains("failed")).unwrap_or_else(|| panic!("no failure: {out:?}"));
    if stop_instead_of_kill {
        // Over TCP the soft provider gives up on a silent peer after its
        // retry timeout: "closed the connection (or became unreachable)".
        assert!(["\"timeout\"", "\"broken\"", "\"peer_closed\""].iter().any(|k| failed.contains(k)), "{failed}");
    } else {
        // A dead peer is named as such, not as the status of a flushed WR.
        assert!(failed.contains("\"failed\":\"peer_closed\""), "{failed}");
        assert!(failed.contains("peer closed the connection"), "{failed}");
        assert!(!failed.contains("Flushed"), "{failed}");
    }
    let again = out.iter().find(|l| l.contains("\"again\":")).unwrap_or_else(|| panic!("{out:?}"));
    assert!(again.contains("\"again\":true"), "{again}");
}

#[test]
fn peer_killed_mid_transfer_shm() {
    peer_killed("auto", false);
}

#[test]
fn peer_killed_mid_transfer_tcp() {
    peer_killed("tcp", false);
}

#[test]
fn peer_stopped_mid_transfer_tcp() {
    peer_killed("tcp", true);
}
