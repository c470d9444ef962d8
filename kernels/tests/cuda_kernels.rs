//! The CUDA kernels' source compiles with NVRTC for the GPUs rmacomm
//! targets, and defines every entry point `cuda::entries` names. NVRTC
//! needs no GPU; where the library is absent the test says so and skips
//! (the test command runs it again with PyTorch's wheels, which bring it).

use rmacomm_cuda::nvrtc::{Nvrtc, Output};
use rmacomm_kernels::{cuda, DType, ReduceOp};

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
    for arch in ["sm_80", "sm_90"] {
        match &*cuda::compile(arch).unwrap() {
            Output::Cubin(b) => assert!(b.len() > 10_000 && b.starts_with(b"\x7fELF"), "{arch}: {} bytes", b.len()),
            o => panic!("{arch}: {o:?}"),
        }
    }
    // Cached per architecture.
    assert!(std::sync::Arc::ptr_eq(&cuda::compile("sm_90").unwrap(), &cuda::compile("sm_90").unwrap()));
}

#[test]
fn every_valid_op_and_dtype_has_its_kernels_and_no_other() {
    let names = cuda::entry_points();
    for d in DType::ALL {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Product,
            ReduceOp::Min,
            ReduceOp::Max,
            ReduceOp::Band,
            ReduceOp::Bor,
            ReduceOp::Bxor,
            ReduceOp::Avg,
            ReduceOp::PremulSum(2.0),
        ] {
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
