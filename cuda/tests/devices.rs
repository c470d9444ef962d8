//! Hosts with several GPUs: rmacomm's calls leave the calling thread's
//! current context (PyTorch's current device) as they found it, devices
//! are told apart by UUID across processes that number them differently,
//! a stream of another GPU is refused, and peer access is enabled or
//! refused as the devices allow. Against the CUDA stand-in with two
//! devices (`RMACOMM_STANDIN_DEVICES=2`, in a child process), or under
//! `RMACOMM_EXPECT_GPU=1` the real driver where it has two GPUs (skipped,
//! saying so, with one).

use std::process::Command;
use std::sync::Arc;

use rmacomm_cuda::device::Stream;
use rmacomm_cuda::driver::{self, Context};

/// Set in a child: the test runs its child part.
const CHILD: &str = "RMACOMM_DEVICES_CHILD";

/// Runs this binary's `name` test again in a child, on the two-device
/// stand-in (with `env`), or here on a real driver with two GPUs; `None`
/// when neither can run (the reason printed).
fn on_two_devices(name: &str, env: &[(&str, &str)], part: fn()) -> Option<String> {
    if std::env::var_os(CHILD).is_some() {
        part();
        return None;
    }
    if std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1") {
        let d = driver::probe().expect("RMACOMM_EXPECT_GPU=1: the driver loads");
        if d.devices < 2 {
            println!("skipped: {name} needs two GPUs, this machine has {}", d.devices);
            return None;
        }
        part();
        return None;
    }
    let lib = rmacomm_cuda::standin_for_tests()?;
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", name, "--nocapture"])
        .env(CHILD, "1")
        .env("RMACOMM_CUDA_LIB", &lib)
        .env("RMACOMM_STANDIN_DEVICES", "2")
        .env_remove("CUDA_VISIBLE_DEVICES");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let s = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{name} failed:\n{s}");
    Some(s)
}

fn two() -> (Arc<Context>, Arc<Context>) {
    (Context::open_shared(0).unwrap(), Context::open_shared(1).unwrap())
}

fn calls_keep_the_current_device() {
    let (d0, d1) = two();
    // Opening a context makes nothing current.
    assert_eq!(driver::current_device().unwrap(), None, "after opening contexts");
    // As torch.cuda.set_device(1): the caller's device is 1; every call on
    // device 0's objects leaves it so.
    d1.make_current().unwrap();
    let check = |what: &str| assert_eq!(driver::current_device().unwrap(), Some(1), "after {what}");
    let mem = d0.alloc_shared(1 << 16).unwrap();
    check("alloc_shared");
    mem.write_from(0, &[7u8; 4096]).unwrap();
    check("write_from");
    let mut back = [0u8; 4096];
    mem.read_into(0, &mut back).unwrap();
    assert_eq!(back, [7u8; 4096]);
    check("read_into");
    let s = d0.stream().unwrap();
    check("stream");
    // SAFETY: both ranges lie in `mem`, which outlives the synchronize.
    unsafe { s.copy_async(mem.ptr() + 8192, mem.ptr(), 4096) }.unwrap();
    check("copy_async");
    assert!(!s.is_capturing().unwrap());
    check("is_capturing");
    s.synchronize().unwrap();
    check("synchronize");
    let mut host = vec![0u64; 512];
    // SAFETY: `host` outlives the registration (dropped below).
    let reg = unsafe { d0.register_host(host.as_mut_ptr().cast(), 4096) }.unwrap();
    check("register_host");
    // SAFETY: registered host memory, live until after the synchronize.
    unsafe { s.write_value64(reg.device_ptr(), 42) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(host[0], 42);
    d0.pointer_info(mem.ptr()).unwrap();
    check("pointer_info");
    d0.ipc_handle(mem.ptr()).unwrap();
    check("ipc_handle");
    drop((reg, s, mem));
    check("the drops");
    // A thread with no current context has none after the calls either.
    let d0c = d0.clone();
    std::thread::spawn(move || {
        let m = d0c.alloc_shared(4096).unwrap();
        m.write_from(0, &[1; 16]).unwrap();
        drop(m);
        assert_eq!(driver::current_device().unwrap(), None, "a thread with no context current");
    })
    .join()
    .unwrap();
    // The memory of device 0 is device 0's, whichever device is current.
    let m0 = d0.alloc_shared(4096).unwrap();
    assert_eq!(d1.pointer_info(m0.ptr()).unwrap().device, 0);
}

/// Every call binds its context for the call only: the caller's current
/// device (what `torch.cuda.current_device()` reads) is the same after.
#[test]
fn calls_leave_the_threads_current_device_as_they_found_it() {
    on_two_devices("calls_leave_the_threads_current_device_as_they_found_it", &[], calls_keep_the_current_device);
}

fn uuids_part() {
    let (d0, d1) = two();
    let (u0, u1) = (d0.uuid().unwrap(), d1.uuid().unwrap());
    assert_ne!(u0, u1, "two GPUs, two UUIDs");
    println!("uuid0 {u0:02x?}");
    println!("uuid1 {u1:02x?}");
}

fn uuid_of_ordinal_0() {
    println!("visible0 {:02x?}", Context::open_shared(0).unwrap().uuid().unwrap());
}

/// A GPU's UUID is the same in every process, whatever number
/// `CUDA_VISIBLE_DEVICES` gives it there.
#[test]
fn a_gpu_has_one_uuid_however_a_process_numbers_it() {
    let Some(all) = on_two_devices("a_gpu_has_one_uuid_however_a_process_numbers_it", &[], uuids_part) else {
        return;
    };
    let line = |out: &str, key: &str| out.lines().find_map(|l| l.strip_prefix(key).map(str::to_owned)).unwrap();
    let u1 = line(&all, "uuid1 ");
    // In a process that sees only the second GPU it is device 0.
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "a_gpu_has_one_uuid_however_a_process_numbers_it_child", "--nocapture"])
        .env(CHILD, "1")
        .env("RMACOMM_CUDA_LIB", rmacomm_cuda::standin_for_tests().unwrap())
        .env("RMACOMM_STANDIN_DEVICES", "2")
        .env("CUDA_VISIBLE_DEVICES", "1");
    let out = c.output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{s}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(line(&s, "visible0 "), u1, "{s}");
}

/// The child part of the test above (runs only in its child).
#[test]
fn a_gpu_has_one_uuid_however_a_process_numbers_it_child() {
    if std::env::var_os(CHILD).is_some() {
        uuid_of_ordinal_0();
    }
}

fn streams_part() {
    let (d0, d1) = two();
    let s1 = d1.stream().unwrap();
    // SAFETY: a live stream (of device 1), outliving the values.
    let wrong = unsafe { Stream::from_raw_checked(d0.clone(), s1.raw()) }.unwrap_err().to_string();
    assert!(wrong.contains("not a stream of CUDA device 0"), "{wrong}");
    // SAFETY: as above; 0 is the legacy default stream.
    unsafe {
        Stream::from_raw_checked(d1.clone(), s1.raw()).unwrap();
        Stream::from_raw_checked(d0.clone(), 0).unwrap();
    }
}

/// A stream handle (a `torch.cuda.Stream`'s) is checked to belong to the
/// device the work is for.
#[test]
fn a_stream_of_another_gpu_is_refused() {
    on_two_devices("a_stream_of_another_gpu_is_refused", &[], streams_part);
}

fn peer_part() {
    let (d0, d1) = two();
    let p2p = std::env::var("RMACOMM_STANDIN_P2P").map_or(true, |v| v != "0");
    assert_eq!(d0.can_access_peer(&d1).unwrap(), p2p);
    if p2p {
        d0.enable_peer_access(&d1).unwrap();
        d0.enable_peer_access(&d1).unwrap();
    } else {
        let e = d0.enable_peer_access(&d1).unwrap_err().to_string();
        assert!(e.contains("cuCtxEnablePeerAccess"), "{e}");
    }
    // A device needs no peer access to itself.
    d0.enable_peer_access(&d0).unwrap();
}

/// Peer access is enabled (twice is fine) where the GPUs reach each other,
/// an error naming the call where they do not.
#[test]
fn peer_access_is_enabled_where_the_gpus_allow() {
    on_two_devices("peer_access_is_enabled_where_the_gpus_allow", &[], peer_part);
    if std::env::var_os(CHILD).is_none() && std::env::var("RMACOMM_EXPECT_GPU").is_err() {
        on_two_devices("peer_access_is_enabled_where_the_gpus_allow", &[("RMACOMM_STANDIN_P2P", "0")], peer_part);
    }
}
