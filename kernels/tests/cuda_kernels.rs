//! The CUDA kernels' source compiles with NVRTC for the GPUs rmacomm
//! targets, and defines every entry point `cuda::entries` names. NVRTC
//! needs no GPU; where the library is absent the test says so and skips
//! (the test command runs it again with PyTorch's wheels, which bring it).

use rmacomm_cuda::nvrtc::{Nvrtc, Output};
use rmacomm_kernels::{cuda, DType, ReduceOp};

/// Every op (PremulSum with a factor integers accept too).
const OPS: [ReduceOp; 9] = [
    ReduceOp::Sum,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Band,
    ReduceOp::Bor,
    ReduceOp::Bxor,
    ReduceOp::Avg,
    ReduceOp::PremulSum(3.0),
];

/// NVRTC, or `None` after saying why the test skips. With
/// `RMACOMM_EXPECT_NVRTC=1` (the test command sets it where it installed
/// the library) a missing NVRTC fails the test instead.
fn nvrtc() -> Option<&'static Nvrtc> {
    match Nvrtc::get() {
        Ok(n) => Some(n),
        Err(e) if std::env::var("RMACOMM_EXPECT_NVRTC").is_ok_and(|v| v == "1") => panic!("{e}"),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

#[test]
fn every_kernel_compiles_to_ptx_and_a_cubin() {
    let Some(n) = nvrtc() else { return };
    println!("NVRTC {}.{} from {}", n.version().0, n.version().1, n.path().display());
    let Output::Ptx(ptx) = &*cuda::compile("compute_80").unwrap() else { panic!("PTX for compute_80") };
    for e in cuda::entry_points() {
        assert!(ptx.contains(&format!(".entry {e}(")), "{e} is not in the PTX");
    }
    // Contraction would round PremulSum's multiply-add once where the CPU
    // rounds twice.
    assert!(!ptx.contains("fma.rn"), "the PTX contracts multiply-adds");
    for arch in ["sm_75", "sm_80", "sm_90"] {
        match &*cuda::compile(arch).unwrap() {
            Output::Cubin(b) => assert!(b.len() > 10_000 && b.starts_with(b"\x7fELF"), "{arch}: {} bytes", b.len()),
            o => panic!("{arch}: {o:?}"),
        }
    }
    // Cached per architecture.
    assert!(std::sync::Arc::ptr_eq(&cuda::compile("sm_90").unwrap(), &cuda::compile("sm_90").unwrap()));
}

#[test]
fn the_signal_program_compiles_to_ptx_and_a_cubin() {
    if nvrtc().is_none() {
        return;
    }
    let Output::Ptx(ptx) = &*cuda::compile_signals("compute_80").unwrap() else { panic!("PTX for compute_80") };
    for e in cuda::SIGNAL_ENTRY_POINTS {
        assert!(ptx.contains(&format!(".entry {e}(")), "{e} is not in the PTX");
    }
    match &*cuda::compile_signals("sm_90").unwrap() {
        Output::Cubin(b) => assert!(b.starts_with(b"\x7fELF"), "sm_90: {} bytes", b.len()),
        o => panic!("sm_90: {o:?}"),
    }
    assert!(std::sync::Arc::ptr_eq(&cuda::compile_signals("sm_90").unwrap(), &cuda::compile_signals("sm_90").unwrap()));
}

#[test]
fn every_valid_op_and_dtype_has_its_kernels_and_no_other() {
    let names = cuda::entry_points();
    for d in DType::ALL {
        for op in OPS {
            match cuda::entries(op, d) {
                Ok(e) => {
                    for k in
                        [Some(&e.binary), Some(&e.nary), e.prepare.as_ref(), e.finish.as_ref()].into_iter().flatten()
                    {
                        assert!(names.contains(k), "{op} {d}: {k} is not defined");
                    }
                    assert_eq!(e.prepare.is_some(), matches!(op, ReduceOp::PremulSum(_)));
                    assert_eq!(e.finish.is_some(), op == ReduceOp::Avg);
                }
                Err(e) => {
                    assert!(d.is_float() && e.to_string().contains("not defined for"), "{op} {d}: {e}");
                    assert!(!names.iter().any(|n| n == &format!("rmacomm_{}_{}", op.name(), d.name())));
                }
            }
        }
    }
}

#[test]
fn a_compile_error_returns_nvrtcs_log() {
    let Some(n) = nvrtc() else { return };
    let e = n.compile("__global__ void k() { undefined_thing(); }", "broken.cu", "compute_90", &[]).unwrap_err();
    let s = e.to_string();
    assert!(s.contains("broken.cu") && s.contains("undefined_thing") && s.contains("compute_90"), "{s}");
}

/// Device 0, or `None` after saying why the GPU tests skip. With
/// `RMACOMM_EXPECT_GPU=1` (the GPU suite sets it) no GPU fails instead.
fn gpu() -> Option<rmacomm_cuda::driver::Context> {
    let expect = std::env::var("RMACOMM_EXPECT_GPU").is_ok_and(|v| v == "1");
    let why = match rmacomm_cuda::driver::probe() {
        Ok(d) if d.devices > 0 => match rmacomm_cuda::driver::Context::open(0) {
            Ok(c) => {
                println!(
                    "GPU: {} (sm_{}{}), driver {}.{}",
                    c.name(),
                    c.compute_capability().0,
                    c.compute_capability().1,
                    d.version.0,
                    d.version.1
                );
                return Some(c);
            }
            Err(e) => e.to_string(),
        },
        Ok(d) => format!("the CUDA driver {}.{} sees no device", d.version.0, d.version.1),
        Err(e) => e.to_string(),
    };
    assert!(!expect, "RMACOMM_EXPECT_GPU=1 but: {why}");
    println!("skipped (no GPU): {why}");
    None
}

/// Deterministic bytes of `n` elements of `d`, floats with the special
/// values (NaN, ±inf, ±0, subnormals) mixed in.
fn data(d: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::with_capacity(n * d.size());
    for i in 0..n {
        let r = next();
        let special = i % 17 == 0;
        match d {
            DType::F32 => {
                let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1e-40, -3e-39];
                let v = if special { specials[(r % 7) as usize] } else { ((r % 20001) as f32 - 10000.0) / 97.0 };
                out.extend_from_slice(&v.to_ne_bytes());
            }
            DType::F64 => {
                let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1e-310, -4e-320];
                let v = if special { specials[(r % 7) as usize] } else { ((r % 2_000_001) as f64 - 1e6) / 977.0 };
                out.extend_from_slice(&v.to_ne_bytes());
            }
            DType::F16 | DType::BF16 => {
                // Any 16-bit pattern: NaNs, infinities, zeros and subnormals
                // included.
                out.extend_from_slice(&((r >> 16) as u16).to_ne_bytes());
            }
            _ => out.extend_from_slice(&r.to_ne_bytes()[..d.size()]),
        }
    }
    out
}

/// Equal bytes, or both NaN (the GPU's NaN payloads are canonical, the
/// CPU's keep an operand's).
fn same(d: DType, gpu: &[u8], cpu: &[u8]) -> Result<(), String> {
    let w = d.size();
    for (i, (g, c)) in gpu.chunks(w).zip(cpu.chunks(w)).enumerate() {
        if g == c {
            continue;
        }
        let nan = |b: &[u8]| match d {
            DType::F32 => f32::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            DType::F64 => f64::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            DType::F16 => half::f16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            DType::BF16 => half::bf16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
            _ => false,
        };
        if !(nan(g) && nan(c)) {
            return Err(format!("element {i}: gpu {g:02x?}, cpu {c:02x?}"));
        }
    }
    Ok(())
}

/// Every kernel on a GPU against the CPU kernels: the two-input combine
/// (into a third buffer: the fused copy + reduce), the three-input combine
/// with `PremulSum`'s prepare and `Avg`'s finish, the signal and the wait.
#[test]
fn gpu_kernels_match_the_cpu_kernels() {
    let Some(ctx) = gpu() else { return };
    let image = cuda::compile(&ctx.arch()).unwrap().image();
    // SAFETY: NVRTC's own output.
    let module = unsafe { ctx.load_module(&image) }.unwrap();
    let launch = |name: &str, grid: u32, block: u32, args: &[rmacomm_cuda::driver::Arg]| {
        // SAFETY: every call below passes its kernel's parameters (see the
        // signatures in kernels/src/cuda.rs) and device buffers of at least
        // `n` elements of the kernel's dtype.
        unsafe { module.launch(name, grid, block, args) }
    };
    const N: usize = 100_003;
    let (grid, block) = (N.div_ceil(256) as u32, 256);
    use rmacomm_cuda::driver::Arg;
    let mut checked = 0;
    for d in DType::ALL {
        let bytes = N * d.size();
        let inputs: Vec<Vec<u8>> = (0..3).map(|k| data(d, N, k + 1 + d.size() as u64)).collect();
        for op in OPS {
            let Ok(e) = cuda::entries(op, d) else { continue };
            let cpu = rmacomm_kernels::Reducer::new(d, op).unwrap();
            let bufs: Vec<_> = inputs
                .iter()
                .map(|v| {
                    let b = ctx.alloc(bytes).unwrap();
                    b.upload(v).unwrap();
                    b
                })
                .collect();
            let out = ctx.alloc(bytes).unwrap();
            let mut got = vec![0u8; bytes];

            // Two inputs, a third output buffer.
            launch(
                &e.binary,
                grid,
                block,
                &[Arg::U64(out.ptr()), Arg::U64(bufs[0].ptr()), Arg::U64(bufs[1].ptr()), Arg::U64(N as u64)],
            )
            .unwrap();
            out.download(&mut got).unwrap();
            let mut want = vec![0u8; bytes];
            cpu.reduce(&mut want, &inputs[0], &inputs[1]).unwrap();
            same(d, &got, &want).unwrap_or_else(|m| panic!("{} ({op} {d}): {m}", e.binary));

            // Three raw contributions, the whole reduction (prepare and
            // finish fused where the op has them).
            let table: Vec<u8> = bufs.iter().flat_map(|b| b.ptr().to_ne_bytes()).collect();
            let tbuf = ctx.alloc(table.len()).unwrap();
            tbuf.upload(&table).unwrap();
            let (ptr, tab, n) = (Arg::U64(out.ptr()), Arg::U64(tbuf.ptr()), Arg::U64(N as u64));
            match &e.full {
                Some(full) => {
                    let f = if let ReduceOp::PremulSum(f) = op { f } else { 1.0 };
                    let count = if op == ReduceOp::Avg { 3 } else { 1 };
                    launch(full, grid, block, &[ptr, tab, Arg::U32(3), n, Arg::F64(f), Arg::U64(count)]).unwrap()
                }
                None => launch(&e.nary, grid, block, &[ptr, tab, Arg::U32(3), n]).unwrap(),
            }
            out.download(&mut got).unwrap();
            let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            cpu.reduce_full(&mut want, &refs).unwrap();
            same(d, &got, &want).unwrap_or_else(|m| panic!("{op} {d}, 3 inputs: {m}"));

            // The separate maps (ring steps apply them on their own).
            if let (Some(p), ReduceOp::PremulSum(f)) = (&e.prepare, op) {
                launch(p, grid, block, &[Arg::U64(bufs[2].ptr()), Arg::F64(f), n]).unwrap();
                bufs[2].download(&mut got).unwrap();
                want.copy_from_slice(&inputs[2]);
                cpu.prepare(&mut want).unwrap();
                same(d, &got, &want).unwrap_or_else(|m| panic!("{p}: {m}"));
            }
            if let Some(fin) = &e.finish {
                launch(fin, grid, block, &[Arg::U64(bufs[1].ptr()), Arg::U64(3), n]).unwrap();
                bufs[1].download(&mut got).unwrap();
                want.copy_from_slice(&inputs[1]);
                cpu.finish(&mut want, 3).unwrap();
                same(d, &got, &want).unwrap_or_else(|m| panic!("{fin}: {m}"));
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * 6 + 4 * 9, "every valid (op, dtype)");

    // The signal adds at system scope; the wait returns once the word is
    // at least the value.
    let word = ctx.alloc(8).unwrap();
    word.upload(&5u64.to_ne_bytes()).unwrap();
    launch("rmacomm_signal_add", 1, 1, &[Arg::U64(word.ptr()), Arg::U64(7)]).unwrap();
    let mut w = [0u8; 8];
    word.download(&mut w).unwrap();
    assert_eq!(u64::from_ne_bytes(w), 12);
    launch("rmacomm_wait_geq", 1, 1, &[Arg::U64(word.ptr()), Arg::U64(12)]).unwrap();
}
