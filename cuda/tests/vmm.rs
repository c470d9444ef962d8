//! cuMem/VMM memory between processes (`rmacomm_cuda::vmm`) against the
//! CUDA stand-in (`cuda/standin`, loaded through `RMACOMM_CUDA_LIB`), or
//! the real driver under `RMACOMM_EXPECT_GPU=1` (the GPU suite runs this
//! binary): an
//! allocation made of several mappings (as PyTorch's expandable segments
//! are) exported and mapped by another process through the descriptor
//! server, bytes both ways; ranges spanning mappings; and every misuse —
//! a wrong owner, a wrong secret, a server that is gone, a range past
//! mapped memory, memory with no shareable handle type — refused naming
//! it.

use std::process::Command;
use std::sync::Arc;

use rmacomm_cuda::device::DeviceMemory;
use rmacomm_cuda::driver::Context;
use rmacomm_cuda::vmm::Export;

const MIB: usize = 1 << 20;
/// Set in a child: the test runs its child part.
const CHILD: &str = "RMACOMM_VMM_CHILD";

/// Device 0 of the real driver (under `RMACOMM_EXPECT_GPU=1`) or of the
/// stand-in (`None`, with the reason printed, where it is not built).
fn ctx() -> Option<Arc<Context>> {
    if std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1") {
        return Some(Context::open_shared(0).expect("RMACOMM_EXPECT_GPU=1: device 0 opens"));
    }
    static SET: std::sync::Once = std::sync::Once::new();
    let lib = rmacomm_cuda::standin_for_tests()?;
    SET.call_once(|| std::env::set_var("RMACOMM_CUDA_LIB", &lib));
    Some(Context::open_shared(0).expect("the stand-in opens device 0"))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn read(ctx: &Arc<Context>, ptr: u64, len: usize) -> Vec<u8> {
    let back = ctx.alloc_shared(len).unwrap();
    let s = ctx.stream().unwrap();
    // SAFETY: both ranges are live device memory of this context.
    unsafe { s.copy_async(back.ptr(), ptr, len).unwrap() };
    s.synchronize().unwrap();
    let mut out = vec![0; len];
    back.read_into(0, &mut out).unwrap();
    out
}

fn write(ctx: &Arc<Context>, ptr: u64, data: &[u8]) {
    let src = ctx.alloc_shared(data.len()).unwrap();
    src.write_from(0, data).unwrap();
    let s = ctx.stream().unwrap();
    // SAFETY: both ranges are live device memory of this context.
    unsafe { s.copy_async(ptr, src.ptr(), data.len()).unwrap() };
    s.synchronize().unwrap();
}

/// 5 MiB in 2 MiB mappings (three of them, 6 MiB mapped).
fn segmented(ctx: &Arc<Context>) -> DeviceMemory {
    let mem = ctx.alloc_vmm(5 * MIB, 2 * MIB).unwrap();
    assert!(mem.is_vmm());
    mem
}

#[test]
fn a_range_spanning_mappings_is_exported_and_mapped_again() {
    let Some(ctx) = ctx() else { return };
    let mem = segmented(&ctx);
    let data = pattern(5 * MIB, 1);
    mem.write_from(0, &data).unwrap();
    // 2.5 MiB from 1.5 MiB on: the first two mappings.
    let (from, n) = (3 * MIB / 2, 5 * MIB / 2);
    let at = mem.ptr() + from as u64;
    let ext = ctx.device_extent(at, n).unwrap();
    assert_eq!((ext.info.base, ext.vmm.as_deref()), (mem.ptr(), Some(&[2 * MIB, 2 * MIB][..])));
    let (export, offset) = ctx.export_range(at, n).unwrap();
    assert_eq!(offset, from as u64);
    let Export::Vmm(v) = &export else { panic!("VMM memory exported as {export:?}") };
    assert_eq!(v.len(), 4 * MIB);
    // Opened through the descriptor server by this process (the owner).
    let text = export.to_text();
    let m = ctx.open_export(&Export::from_text(&text).unwrap(), std::process::id()).unwrap();
    assert_eq!(m.mapped_len(), Some(4 * MIB));
    assert_ne!(m.ptr(), mem.ptr(), "a second mapping of the same bytes");
    assert_eq!(read(&ctx, m.ptr() + offset, n), data[from..from + n]);
    write(&ctx, m.ptr() + offset, &pattern(n, 2));
    let mut back = vec![0; 5 * MIB];
    mem.read_into(0, &mut back).unwrap();
    assert_eq!(back[from..from + n], pattern(n, 2)[..], "a write through the mapping");
    assert_eq!(back[..from], data[..from]);
    assert_eq!(back[from + n..], data[from + n..]);
    let base = m.ptr();
    drop(m);
    assert!(ctx.pointer_info(base).is_err(), "the mapping is gone when dropped");
    // cuMemAlloc memory still exports its IPC handle.
    let plain = ctx.alloc_shared(4096).unwrap();
    assert!(matches!(ctx.export_range(plain.ptr() + 16, 100).unwrap(), (Export::Ipc(_), 16)));
    let p = mem.ptr();
    drop(mem);
    assert!(ctx.pointer_info(p).is_err(), "VMM memory is unmapped when dropped");
}

#[test]
fn misuse_is_refused_naming_it() {
    let Some(ctx) = ctx() else { return };
    let mem = segmented(&ctx);
    let e = ctx.export_range(mem.ptr() + MIB as u64, 6 * MIB).unwrap_err().to_string();
    assert!(e.contains("run past mapped device memory"), "{e}");
    let e = ctx.export_range(0x1000, 8).unwrap_err().to_string();
    assert!(e.contains("cuPointerGetAttribute"), "{e}");
    let plain = ctx.alloc_shared(4096).unwrap();
    let e = ctx.export_range(plain.ptr(), 4097).unwrap_err().to_string();
    assert!(e.contains("run past its allocation"), "{e}");
    let bare = ctx.alloc_vmm_unexportable(2 * MIB).unwrap();
    let e = ctx.export_range(bare.ptr(), 8).unwrap_err().to_string();
    assert!(e.contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"), "{e}");

    let (export, _) = ctx.export_range(mem.ptr(), 5 * MIB).unwrap();
    let text = export.to_text();
    let me = std::process::id();
    // Another owner than the process that answers.
    let e = ctx.open_export(&export, me + 1).unwrap_err().to_string();
    assert!(e.contains(&format!("is process {me}, not {}", me + 1)), "{e}");
    // A wrong secret.
    let f: Vec<&str> = text.split(':').collect();
    let forged = text.replace(f[2], &"0".repeat(32));
    let e = ctx.open_export(&Export::from_text(&forged).unwrap(), me).unwrap_err().to_string();
    assert!(e.contains("wrong secret"), "{e}");
    // A mapping the owner does not have (one more than it mapped).
    let longer = text.replace("2097152*3", "2097152*4");
    let e = ctx.open_export(&Export::from_text(&longer).unwrap(), me).unwrap_err().to_string();
    assert!(e.contains("refused"), "{e}");
    // A server that is gone.
    let gone = text.replace(f[1], "rmacomm-cuda-fds.1.00000000");
    let e = ctx.open_export(&Export::from_text(&gone).unwrap(), me).unwrap_err().to_string();
    assert!(e.contains("does not answer"), "{e}");
    // Nothing was left mapped by the failures: the good export still opens.
    let m = ctx.open_export(&export, me).unwrap();
    assert_eq!(m.mapped_len(), Some(6 * MIB));
}

/// The child: maps the parent's export, checks the parent's bytes, writes
/// its own.
fn child_part(ctx: &Arc<Context>) {
    let export = Export::from_text(&std::env::var("VMM_EXPORT").unwrap()).unwrap();
    let owner: u32 = std::env::var("VMM_OWNER").unwrap().parse().unwrap();
    let m = ctx.open_export(&export, owner).unwrap();
    assert_eq!(read(ctx, m.ptr(), 5 * MIB), pattern(5 * MIB, 3), "the parent's bytes");
    write(ctx, m.ptr() + MIB as u64, &pattern(3 * MIB, 4));
    println!("child ok");
}

#[test]
fn another_process_maps_the_memory() {
    let Some(ctx) = ctx() else { return };
    if std::env::var(CHILD).is_ok() {
        return child_part(&ctx);
    }
    let mem = segmented(&ctx);
    mem.write_from(0, &pattern(5 * MIB, 3)).unwrap();
    let (export, offset) = ctx.export_range(mem.ptr(), 5 * MIB).unwrap();
    assert_eq!(offset, 0);
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "another_process_maps_the_memory", "--nocapture"])
        .env(CHILD, "1")
        .env("VMM_EXPORT", export.to_text())
        .env("VMM_OWNER", std::process::id().to_string())
        .output()
        .unwrap();
    let s = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && s.contains("child ok"), "the child failed:\n{s}");
    let mut back = vec![0; 5 * MIB];
    mem.read_into(0, &mut back).unwrap();
    let want = pattern(5 * MIB, 3);
    assert_eq!(back[..MIB], want[..MIB]);
    assert_eq!(back[MIB..4 * MIB], pattern(3 * MIB, 4)[..], "the child's write");
    assert_eq!(back[4 * MIB..], want[4 * MIB..]);
}
