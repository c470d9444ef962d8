//! The run-time probes: a missing library, symbol or device is an error that
//! names it, never a panic; where a library is present (the test command
//! points at PyTorch's wheels) its version is read for real.

use std::process::Command;

use rmacomm_cuda::nccl::{Flavor, Library, Version, WINDOW_API};
use rmacomm_cuda::nvrtc::Nvrtc;
use rmacomm_cuda::{driver, CudaError};

/// Set in a child: the test runs its child part.
const CHILD: &str = "RMACOMM_PROBES_CHILD";

/// Runs this test binary's `name` test again in a child with `env` set (the
/// variables are read by the loaders; a child keeps them out of this
/// process's other tests), and returns its output.
fn child(name: &str, env: &[(&str, &str)]) -> String {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", name, "--nocapture"]).env(CHILD, "1");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let s = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{name} failed:\n{s}");
    s
}

fn child_named_files() {
    for (e, lib) in [
        (Nvrtc::load().unwrap_err(), "NVRTC"),
        (Library::load(Flavor::Nccl).unwrap_err(), "NCCL"),
        (Library::load(Flavor::Rccl).unwrap_err(), "RCCL"),
        (driver::probe().unwrap_err(), "libcuda.so.1"),
    ] {
        let s = e.to_string();
        println!("{s}");
        assert!(matches!(e, CudaError::NotFound { .. }), "{e:?}");
        assert!(s.contains(lib) && s.contains("/nonexistent/lib.so"), "{s}");
    }
}

#[test]
fn a_named_file_that_is_missing_is_an_error_naming_it() {
    if std::env::var_os(CHILD).is_some() {
        return child_named_files();
    }
    let bad = "/nonexistent/lib.so";
    let vars = ["RMACOMM_NVRTC_LIB", "RMACOMM_NCCL_LIB", "RMACOMM_RCCL_LIB", "RMACOMM_CUDA_LIB"];
    let env: Vec<(&str, &str)> = vars.iter().map(|v| (*v, bad)).collect();
    let out = child("a_named_file_that_is_missing_is_an_error_naming_it", &env);
    // The variable is in the message, so the user sees what to fix.
    for v in vars {
        assert!(out.contains(&format!("{v}={bad}")), "{v}: {out}");
    }
}

fn child_wrong_file() {
    let e = Library::load(Flavor::Nccl).unwrap_err();
    println!("{e}");
    assert!(matches!(e, CudaError::MissingSymbol { symbol: "ncclGetVersion", .. }), "{e:?}");
}

#[test]
fn a_file_that_is_not_the_library_is_an_error_naming_the_symbol() {
    if std::env::var_os(CHILD).is_some() {
        return child_wrong_file();
    }
    // libc is a shared library without ncclGetVersion.
    let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    let Some(libc) = libc else {
        println!("skipped: no libc.so.6 at the usual paths");
        return;
    };
    let out = child("a_file_that_is_not_the_library_is_an_error_naming_the_symbol", &[("RMACOMM_NCCL_LIB", libc)]);
    assert!(out.contains("has no symbol ncclGetVersion") && out.contains(libc), "{out}");
}

#[test]
fn the_driver_probe_reports_the_machine() {
    match driver::probe() {
        Ok(d) => {
            println!("CUDA driver {}.{} at {}, {} device(s)", d.version.0, d.version.1, d.path.display(), d.devices);
            assert!(d.version.0 >= 10, "{d:?}");
        }
        Err(e) if std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => {
            println!("no CUDA driver here: {e}");
            let s = e.to_string();
            assert!(s.contains("libcuda.so.1") || s.contains("cuInit"), "{s}");
        }
    }
}

#[test]
fn nccl_versions_decode_and_gate_the_window_api() {
    assert_eq!(Version::from_code(22809), Version { major: 2, minor: 28, patch: 9 });
    assert_eq!(Version::from_code(23007).to_string(), "2.30.7");
    assert_eq!(Version::from_code(2708), Version { major: 2, minor: 7, patch: 8 });
    assert!(Version::from_code(22809) < WINDOW_API && Version::from_code(22900) >= WINDOW_API);
    match Library::load(Flavor::Nccl) {
        // The test command sets this where it installed the library.
        Err(e) if std::env::var("RMACOMM_EXPECT_NCCL").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => println!("skipped the loaded-library part: {e}"),
        Ok(l) => {
            println!("NCCL {} at {}", l.version(), l.path().display());
            assert!(l.version().major == 2 && l.version().minor >= 18, "{}", l.version());
            match l.require(WINDOW_API, "the NCCL backend's windows") {
                Ok(()) => assert!(l.version() >= WINDOW_API),
                Err(e) => {
                    let s = e.to_string();
                    assert!(s.contains("too old") && s.contains("2.29.0") && s.contains("windows"), "{s}");
                }
            }
            let e = l.require(Version { major: 9, minor: 0, patch: 0 }, "a test").unwrap_err().to_string();
            assert!(e.contains(&l.version().to_string()) && e.contains("9.0.0"), "{e}");
        }
    }
}

/// The NCCL communicator's symbols resolve and a unique id is made (no GPU
/// needed); on a GPU a one-rank communicator runs every collective.
#[test]
fn nccl_unique_ids_need_no_gpu_and_a_one_rank_comm_runs_on_one() {
    use rmacomm_cuda::nccl_comm::{self, DataType, NcclComm, RedOp};
    let lib = match Library::load(Flavor::Nccl) {
        Err(e) if std::env::var("RMACOMM_EXPECT_NCCL").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => return println!("skipped: {e}"),
        Ok(l) => std::sync::Arc::new(l),
    };
    let (a, b) = (nccl_comm::unique_id(&lib).unwrap(), nccl_comm::unique_id(&lib).unwrap());
    assert!(a.0.iter().any(|x| *x != 0) && a.0 != b.0, "two unique ids are distinct and not blank");
    let ctx = match driver::Context::open_shared(0) {
        Err(e) if std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => return println!("skipped the one-rank communicator: {e}"),
        Ok(c) => c,
    };
    let mut comm = NcclComm::init(lib, ctx.clone(), &a, 0, 1, std::time::Duration::from_secs(60)).unwrap();
    println!("{comm:?}");
    let stream = ctx.stream().unwrap();
    let n = 1000;
    let (x, y) = (ctx.alloc_shared(n * 4).unwrap(), ctx.alloc_shared(n * 4).unwrap());
    let vals: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    x.write_from(0, &vals).unwrap();
    let read = |m: &rmacomm_cuda::device::DeviceMemory| {
        stream.synchronize().unwrap();
        let mut out = vec![0u8; n * 4];
        m.read_into(0, &mut out).unwrap();
        out
    };
    // One rank: every collective is a copy of its input.
    // SAFETY: both buffers hold n f32 and outlive the synchronizations.
    unsafe {
        comm.all_reduce(x.ptr(), y.ptr(), n, DataType::F32, RedOp::Sum, &stream).unwrap();
        assert_eq!(read(&y), vals, "all_reduce");
        y.write_from(0, &vec![0; n * 4]).unwrap();
        comm.broadcast(x.ptr(), y.ptr(), n, DataType::F32, 0, &stream).unwrap();
        assert_eq!(read(&y), vals, "broadcast");
        y.write_from(0, &vec![0; n * 4]).unwrap();
        comm.all_gather(x.ptr(), y.ptr(), n, DataType::F32, &stream).unwrap();
        assert_eq!(read(&y), vals, "all_gather");
        y.write_from(0, &vec![0; n * 4]).unwrap();
        comm.send_recv(&[(x.ptr(), n, 0)], &[(y.ptr(), n, 0)], DataType::F32, &stream).unwrap();
        assert_eq!(read(&y), vals, "send/recv to self");
    }
}
