//! `NcclComm` never waits for a peer without a limit: a rank that never
//! joins makes init fail within its timeout, naming the call and the
//! timeout; work left waiting for a peer that died is aborted when the
//! communicator ends, within the timeout; ranks that both join still
//! work. Against the NCCL stand-in (`RMACOMM_NCCL_LIB`, the CUDA stand-in's
//! library), each rank a process: this test binary run again as a child,
//! its part chosen by `NCCL_TEST_PART`, under a deadline (a child that
//! outlives it hung, and fails the test).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rmacomm_cuda::driver::Context;
use rmacomm_cuda::nccl::{Flavor, Library};
use rmacomm_cuda::nccl_comm::{self, NcclComm, UniqueId};
use rmacomm_cuda::CudaError;

/// Set in a child: which part it runs (and the test returns after it).
const PART: &str = "NCCL_TEST_PART";

/// The layouts of `ncclConfig_t` the lent machines (2.28.9) and the window
/// API (2.29.7, 2.30.7) have: the stand-in checks the config against the
/// version it says it is.
const VERSIONS: [&str; 3] = ["22809", "22907", "23007"];

/// The longest a child may run: well below the stand-in's minute, after
/// which its blocking init gives up (and its destroy aborts the process),
/// so a child still running then is one that hangs.
const DEADLINE: Duration = Duration::from_secs(30);

fn child_part() -> Option<String> {
    std::env::var(PART).ok()
}

/// A child running this binary's `test` with `part`, on the stand-in.
fn spawn(lib: &std::path::Path, test: &str, part: &str, env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(PART, part)
        .env("RMACOMM_CUDA_LIB", lib)
        .env("RMACOMM_NCCL_LIB", lib)
        .env_remove("RMACOMM_STANDIN_NCCL_VERSION")
        .env_remove("RMACOMM_STANDIN_NCCL_FAIL_INIT")
        .env_remove("RMACOMM_STANDIN_NCCL_EXIT_AT_INIT")
        .env_remove("NCCL_COMM_BLOCKING")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().unwrap()
}

/// Waits for `c` until [`DEADLINE`] (killing it past it): its status and
/// output.
fn finish(mut c: Child, what: &str) -> (bool, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > DEADLINE {
            let _ = c.kill();
            let out = c.wait_with_output().unwrap();
            panic!(
                "{what} hung: still running after {DEADLINE:?}\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = c.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (status.success(), text)
}

fn must(ok_and_out: (bool, String), what: &str) -> String {
    let (ok, out) = ok_and_out;
    assert!(ok, "{what} failed:\n{out}");
    out
}

/// A fresh unique id, made by a child (only children load the stand-in).
fn new_id(lib: &std::path::Path, test: &str, env: &[(&str, &str)]) -> String {
    let out = must(finish(spawn(lib, test, "id", env), "the unique id"), "the unique id");
    let line = out.lines().find_map(|l| l.strip_prefix("NCCL_ID=")).unwrap_or_else(|| panic!("no id:\n{out}"));
    line.trim().to_string()
}

fn print_id() {
    let lib = Library::load(Flavor::Nccl).unwrap();
    let id = nccl_comm::unique_id(&lib).unwrap();
    // On a line of its own (the harness's "test ... " precedes it).
    println!("\nNCCL_ID={}", id.0.iter().map(|b| format!("{b:02x}")).collect::<String>());
}

/// The child's library, context and id (`NCCL_TEST_ID`).
fn setup() -> (Arc<Library>, Arc<Context>, UniqueId) {
    let lib = Arc::new(Library::load(Flavor::Nccl).unwrap());
    let ctx = Context::open_shared(0).unwrap();
    let hex = std::env::var("NCCL_TEST_ID").unwrap();
    let mut id = [0u8; 128];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    (lib, ctx, UniqueId(id))
}

fn rank() -> usize {
    std::env::var("NCCL_TEST_RANK").unwrap().parse().unwrap()
}

/// Rank 0 of 2 alone: init fails after its 2 s, naming the call, the rank
/// and the timeout, and leaves nothing waiting.
fn init_alone() {
    let (lib, ctx, id) = setup();
    let t = Instant::now();
    let e = NcclComm::init(lib, ctx, &id, 0, 2, Duration::from_secs(2)).unwrap_err();
    let took = t.elapsed();
    let s = e.to_string();
    println!("rank 0 alone: {s} (after {took:?})");
    assert!(matches!(e, CudaError::Timeout { call: "ncclCommInitRankConfig", .. }), "{e:?}");
    assert!(s.contains("within 2s") && s.contains("rank 0 of 2") && s.contains("aborted"), "{s}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(4), "{took:?}");
    println!("init_alone ok");
}

#[test]
fn init_fails_within_its_timeout_when_a_rank_never_joins() {
    const TEST: &str = "init_fails_within_its_timeout_when_a_rank_never_joins";
    if let Some(p) = child_part() {
        return match p.as_str() {
            "id" => print_id(),
            _ => init_alone(),
        };
    }
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
    for v in VERSIONS {
        let env = [("RMACOMM_STANDIN_NCCL_VERSION", v)];
        let id = new_id(&lib, TEST, &env);
        let env = [("RMACOMM_STANDIN_NCCL_VERSION", v), ("NCCL_TEST_ID", &id)];
        let t = Instant::now();
        let out = must(finish(spawn(&lib, TEST, "alone", &env), "rank 0 alone"), "rank 0 alone");
        assert!(out.contains("init_alone ok"), "NCCL {v}:\n{out}");
        eprintln!("NCCL {v}: rank 0 alone failed after {:?}", t.elapsed());
    }
}

/// Both ranks join; with the window API (2.29+) each puts into the other's
/// window and waits for its signal; then the communicator closes cleanly.
fn pair() {
    let (lib, ctx, id) = setup();
    let (me, n) = (rank(), 2);
    let peer = 1 - me;
    let mut comm = NcclComm::init(lib.clone(), ctx.clone(), &id, me, n, Duration::from_secs(20)).unwrap();
    assert!(comm.is_nonblocking(), "{comm:?}");
    if comm.window_api().is_ok() {
        let stream = ctx.stream().unwrap();
        let (src, dst) = (ctx.alloc_vmm(4096, 2 << 20).unwrap(), ctx.alloc_vmm(4096, 2 << 20).unwrap());
        src.write_from(0, &[me as u8 + 1; 4096]).unwrap();
        // SAFETY: both stay allocated until deregistered below, after the
        // stream has run everything; registered once each.
        let (ws, wd) = unsafe { (comm.window_register(&src).unwrap(), comm.window_register(&dst).unwrap()) };
        // SAFETY: the source is in a window of this rank, the target range
        // inside the peer's 4096 bytes; both registered until the end.
        unsafe { comm.put_signal(src.ptr(), 100, peer, &wd, 8, &stream).unwrap() };
        comm.wait_signal(peer, 1, &stream).unwrap();
        stream.synchronize().unwrap();
        let mut got = [0u8; 4096];
        dst.read_into(0, &mut got).unwrap();
        assert!(got[..8].iter().all(|&b| b == 0) && got[8..108].iter().all(|&b| b == peer as u8 + 1), "put");
        assert!(got[108..].iter().all(|&b| b == 0), "put past its length");
        // SAFETY: the stream has run everything that used them.
        unsafe {
            comm.window_deregister(ws).unwrap();
            comm.window_deregister(wd).unwrap();
        }
        println!("rank {me}: put and signal ok");
    }
    comm.close().unwrap();
    println!("pair ok");
}

#[test]
fn two_ranks_that_both_join_work_and_close() {
    const TEST: &str = "two_ranks_that_both_join_work_and_close";
    if let Some(p) = child_part() {
        return match p.as_str() {
            "id" => print_id(),
            _ => pair(),
        };
    }
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
    for v in VERSIONS {
        let env = [("RMACOMM_STANDIN_NCCL_VERSION", v)];
        let id = new_id(&lib, TEST, &env);
        let kids: Vec<Child> = (0..2)
            .map(|r| {
                let env =
                    [("RMACOMM_STANDIN_NCCL_VERSION", v), ("NCCL_TEST_ID", &id), ("NCCL_TEST_RANK", &r.to_string())];
                spawn(&lib, TEST, "pair", &env)
            })
            .collect();
        for (r, k) in kids.into_iter().enumerate() {
            let out = must(finish(k, &format!("rank {r}")), &format!("NCCL {v}, rank {r}"));
            assert!(out.contains("pair ok"), "NCCL {v}, rank {r}:\n{out}");
            assert_eq!(out.contains("put and signal ok"), v != "22809", "NCCL {v}, rank {r}:\n{out}");
        }
    }
}

/// Rank 1 joins and dies at once; rank 0 queues a wait for its signal,
/// then ends the communicator (`close`, or a drop): within its 2 s,
/// aborted, and the stream's wait released.
fn peer_dies() {
    let (lib, ctx, id) = setup();
    let me = rank();
    let mut comm = NcclComm::init(lib, ctx.clone(), &id, me, 2, Duration::from_secs(2)).unwrap();
    if me == 1 {
        println!("rank 1 dies");
        // SAFETY: ends the process at once, as a crash would.
        unsafe { libc::_exit(0) };
    }
    let stream = ctx.stream().unwrap();
    comm.wait_signal(1, 1, &stream).unwrap();
    let t = Instant::now();
    if std::env::var("NCCL_TEST_END").as_deref() == Ok("drop") {
        drop(comm);
    } else {
        let e = comm.close().unwrap_err();
        let s = e.to_string();
        println!("close: {s}");
        assert!(matches!(e, CudaError::Timeout { call: "ncclCommFinalize", .. }), "{e:?}");
        assert!(s.contains("within 2s") && s.contains("rank 0 of 2") && s.contains("aborted"), "{s}");
    }
    let took = t.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(5), "{took:?}");
    // The abort released the stream's wait (NCCL's abort makes its work exit).
    stream.synchronize().unwrap();
    println!("peer_dies ok after {took:?}");
}

#[test]
fn ending_a_communicator_whose_peer_died_aborts_within_the_timeout() {
    const TEST: &str = "ending_a_communicator_whose_peer_died_aborts_within_the_timeout";
    if let Some(p) = child_part() {
        return match p.as_str() {
            "id" => print_id(),
            _ => peer_dies(),
        };
    }
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
    for end in ["close", "drop"] {
        let id = new_id(&lib, TEST, &[]);
        let kids: Vec<Child> = (0..2)
            .map(|r| {
                let env = [("NCCL_TEST_ID", id.as_str()), ("NCCL_TEST_RANK", &r.to_string()), ("NCCL_TEST_END", end)];
                spawn(&lib, TEST, "peer_dies", &env)
            })
            .collect();
        let outs: Vec<String> =
            kids.into_iter().enumerate().map(|(r, k)| must(finish(k, &format!("{end}, rank {r}")), end)).collect();
        assert!(outs[1].contains("rank 1 dies"), "{}", outs[1]);
        assert!(outs[0].contains("peer_dies ok"), "{end}:\n{}", outs[0]);
        if end == "drop" {
            // A drop cannot return the error: it says so on stderr.
            assert!(outs[0].contains("dropping the NCCL communicator (rank 0 of 2)"), "{}", outs[0]);
            assert!(outs[0].contains("ncclCommFinalize did not complete within 2s"), "{}", outs[0]);
        }
    }
}

/// A library older than 2.14 has only the blocking `ncclCommInitRank`:
/// two ranks still make a communicator with it.
fn old_pair() {
    let (lib, ctx, id) = setup();
    let comm = NcclComm::init(lib, ctx, &id, rank(), 2, Duration::from_secs(20)).unwrap();
    assert!(!comm.is_nonblocking(), "{comm:?}");
    comm.close().unwrap();
    println!("old_pair ok");
}

#[test]
fn a_library_older_than_2_14_inits_blocking() {
    const TEST: &str = "a_library_older_than_2_14_inits_blocking";
    if let Some(p) = child_part() {
        return match p.as_str() {
            "id" => print_id(),
            _ => old_pair(),
        };
    }
    let Some(lib) = rmacomm_cuda::standin_for_tests() else { return };
    let env = [("RMACOMM_STANDIN_NCCL_VERSION", "21304")];
    let id = new_id(&lib, TEST, &env);
    let kids: Vec<Child> = (0..2)
        .map(|r| {
            let env =
                [("RMACOMM_STANDIN_NCCL_VERSION", "21304"), ("NCCL_TEST_ID", &id), ("NCCL_TEST_RANK", &r.to_string())];
            spawn(&lib, TEST, "old_pair", &env)
        })
        .collect();
    for (r, k) in kids.into_iter().enumerate() {
        let out = must(finish(k, &format!("rank {r}")), &format!("NCCL 2.13.4, rank {r}"));
        assert!(out.contains("old_pair ok"), "rank {r}:\n{out}");
    }
}
