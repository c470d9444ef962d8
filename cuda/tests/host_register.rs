//! `Context::register_host` against the CUDA stand-in (or the real driver
//! under `RMACOMM_EXPECT_GPU=1`): registrations of the same pages are
//! shared and counted; a range that only overlaps an earlier registration
//! is refused (it was handed out as if registered whole, and the earlier
//! one's drop unregistered pages still in use); a device that is not
//! there is named; the stand-in refuses a destroyed stream (it ran its work
//! at once as the default stream's).

use std::sync::Arc;

use rmacomm_cuda::driver::Context;

fn ctx() -> Option<Arc<Context>> {
    if std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1") {
        return Some(Context::open_shared(0).expect("RMACOMM_EXPECT_GPU=1: device 0 opens"));
    }
    static SET: std::sync::Once = std::sync::Once::new();
    let lib = rmacomm_cuda::standin_for_tests()?;
    SET.call_once(|| std::env::set_var("RMACOMM_CUDA_LIB", &lib));
    Some(Context::open_shared(0).expect("the stand-in opens device 0"))
}

/// Writes `v` through the registration's device address and reads it back
/// on the host.
fn through(ctx: &Arc<Context>, dev: u64, host: *const u64, v: u64) {
    let s = ctx.stream().unwrap();
    // SAFETY: registered host memory, live until after the synchronize.
    unsafe { s.write_value64(dev, v) }.unwrap();
    s.synchronize().unwrap();
    // SAFETY: the caller's live, aligned word.
    assert_eq!(unsafe { host.read_volatile() }, v);
}

#[test]
fn registrations_of_the_same_pages_are_shared_and_overlaps_refused() {
    let Some(ctx) = ctx() else { return };
    // 4 pages, page-aligned.
    let mut host = vec![0u64; 4 * 4096 / 8 + 512];
    let p = {
        let a = host.as_mut_ptr() as usize;
        (a.div_ceil(4096) * 4096) as *mut u8
    };
    // SAFETY: `host` outlives every registration (here and below).
    let a = unsafe { ctx.register_host(p, 4096) }.unwrap();
    // SAFETY: `host` outlives the registration.
    let b = unsafe { ctx.register_host(p.wrapping_add(128), 64) }.unwrap();
    assert_eq!(b.device_ptr(), a.device_ptr() + 128, "the same page: the same registration");
    // SAFETY: `host` outlives the registration.
    let e = unsafe { ctx.register_host(p, 4 * 4096) }.unwrap_err();
    assert!(e.to_string().contains("overlap an earlier registration"), "{e}");
    // The first holder goes: the pages stay registered for the second.
    drop(a);
    through(&ctx, b.device_ptr(), p.wrapping_add(128) as *const u64, 7);
    drop(b);
    // The last holder unregistered them: the larger range registers now.
    // SAFETY: `host` outlives the registration.
    let c = unsafe { ctx.register_host(p, 4 * 4096) }.unwrap();
    through(&ctx, c.device_ptr() + 3 * 4096, p.wrapping_add(3 * 4096) as *const u64, 9);
    // SAFETY: `host` outlives the registration.
    let d = unsafe { ctx.register_host(p.wrapping_add(4096), 4096) }.unwrap();
    assert_eq!(d.device_ptr(), c.device_ptr() + 4096);
    drop((c, d));
}

#[test]
fn a_device_that_is_not_there_is_named() {
    let Some(_) = ctx() else { return };
    let e = Context::open(999).unwrap_err().to_string();
    assert!(e.contains("cuDeviceGet") && e.contains("device 999"), "{e}");
}

#[test]
fn a_destroyed_stream_is_refused_not_run_as_the_default_stream() {
    // The stand-in's own check (CI's CUDA): a real driver given a destroyed
    // handle is undefined behaviour, not a test.
    if std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1") {
        println!("skipped: a destroyed stream is only safe to pass to the stand-in");
        return;
    }
    let Some(ctx) = ctx() else { return };
    let mem = ctx.alloc_shared(64).unwrap();
    let s = ctx.stream().unwrap();
    let raw = s.raw();
    drop(s);
    // SAFETY: the stand-in (checked above) refuses handles it does not hold;
    // nothing is dereferenced.
    let t = unsafe { rmacomm_cuda::device::Stream::from_raw(ctx.clone(), raw) };
    // SAFETY: device memory of this context, live past the call.
    assert!(unsafe { t.write_value64(mem.ptr(), 1) }.is_err(), "work on a destroyed stream ran");
    assert!(t.synchronize().is_err());
}
