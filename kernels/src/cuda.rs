//! The CUDA kernels: CUDA C compiled at run time with NVRTC (through
//! `rmacomm-cuda`, which loads it dynamically), cached per architecture.
//!
//! One program holds every kernel:
//! - `rmacomm_<op>_<dtype>(out, a, b, n)`: `out[i] = op(a[i], b[i])`, for
//!   every op and dtype [`ReduceOp::check`] accepts (`sum`, `product`,
//!   `min`, `max`, and `band` / `bor` / `bxor` on integers). `out` may be
//!   `a` (a combine in place) or a third buffer: the fused copy + reduce of
//!   a ring step.
//! - `rmacomm_<op>_n_<dtype>(out, inputs, k, n)`: the op over `k` inputs in
//!   one pass (the same-host all_reduce over IPC-mapped peers).
//! - `rmacomm_sum_full_<dtype>(out, inputs, k, n, factor, count)`: `Avg`
//!   and `PremulSum` over raw contributions in one pass, rounded once
//!   ([`Reducer::reduce_full`](crate::Reducer::reduce_full)).
//! - `rmacomm_scale_<dtype>(buf, factor, n)` and
//!   `rmacomm_div_<dtype>(buf, count, n)`: `PremulSum`'s prepare and
//!   `Avg`'s finish, so that those ops run as `sum` between them, as on the
//!   CPU ([`Reducer::prepare`](crate::Reducer::prepare),
//!   [`Reducer::finish`](crate::Reducer::finish)).
//! - `rmacomm_signal_add(word, add)` and `rmacomm_wait_geq(word, value)`:
//!   a system-scope signal and a spin-wait for a value.
//!
//! A second, small program ([`signal_source`], [`compile_signals`]) holds
//! the windows' stream-ordered signals as kernels, `rmacomm_signal_next(word)`
//! and `rmacomm_wait_next(taken, word, want)`, and `rmacomm_wait_reach(word,
//! bound, want)` (GPU send/recv's credit: a count reaching another count):
//! counts kept in memory rather than in the launch, so that a CUDA graph
//! replays them, and what runs where the driver has no stream memory
//! operations. A wait first writes the value it waits for into `want`
//! (host memory), so that a host watchdog sees a wait in flight — one whose
//! `want` is above its word — though the host never issued it (a replay).
//!
//! Semantics are the CPU kernels': integers wrap, float `min`/`max` are IEEE
//! 754-2019 `minimum`/`maximum` (NaN propagates, −0 < +0), `f16`/`bf16`
//! compute in `f32` and round once to nearest even.
//!
//! Compiling needs NVRTC, not a GPU: [`compile`] works wherever the library
//! is (PyTorch's CUDA wheels bring it). Launching the kernels needs a device
//! and is not built yet: [`Reducer::on`](crate::Reducer::on) with
//! [`Device::Cuda`](crate::Device::Cuda) still says so.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use rmacomm_cuda::nvrtc::{Nvrtc, Output};

use crate::{DType, ReduceOp, Result};

const PRELUDE: &str = include_str!("cuda/prelude.cu");

/// The binary ops with a kernel of their own (`Avg` and `PremulSum` run as
/// `Sum` between their maps). Each is the C++ type `op_<name>` in the
/// program; element types are named as [`DType::name`] says.
const OPS: [ReduceOp; 7] =
    [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Band, ReduceOp::Bor, ReduceOp::Bxor];

/// The combining op a reduction runs as on the device.
fn base_op(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Avg | ReduceOp::PremulSum(_) => "sum",
        op => op.name(),
    }
}

/// The kernels a reduction of `op` on `dtype` uses, by entry point name:
/// the two-input combine, the `k`-input combine, and the prepare / finish
/// maps where the op has them. An op the dtype cannot do is the CPU
/// kernels' error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entries {
    /// `rmacomm_<op>_<dtype>`.
    pub binary: String,
    /// `rmacomm_<op>_n_<dtype>`.
    pub nary: String,
    /// `rmacomm_sum_full_<dtype>(out, inputs, k, n, factor, count)` for
    /// `Avg` and `PremulSum`: the whole reduction of raw contributions in
    /// one pass, rounded once, as [`Reducer::reduce_full`](crate::Reducer::reduce_full).
    pub full: Option<String>,
    /// `rmacomm_scale_<dtype>` for `PremulSum`.
    pub prepare: Option<String>,
    /// `rmacomm_div_<dtype>` for `Avg`.
    pub finish: Option<String>,
}

/// The entry points for `op` on `dtype`.
pub fn entries(op: ReduceOp, dtype: DType) -> Result<Entries> {
    op.check(dtype)?;
    let (o, t) = (base_op(op), dtype.name());
    Ok(Entries {
        binary: format!("rmacomm_{o}_{t}"),
        nary: format!("rmacomm_{o}_n_{t}"),
        full: matches!(op, ReduceOp::Avg | ReduceOp::PremulSum(_)).then(|| format!("rmacomm_sum_full_{t}")),
        prepare: matches!(op, ReduceOp::PremulSum(_)).then(|| format!("rmacomm_scale_{t}")),
        finish: matches!(op, ReduceOp::Avg).then(|| format!("rmacomm_div_{t}")),
    })
}

/// Every entry point the program defines.
pub fn entry_points() -> Vec<String> {
    let mut v = vec!["rmacomm_signal_add".to_owned(), "rmacomm_wait_geq".to_owned()];
    for d in DType::ALL {
        for op in OPS.into_iter().filter(|op| op.check(d).is_ok()) {
            v.push(format!("rmacomm_{}_{}", op.name(), d.name()));
            v.push(format!("rmacomm_{}_n_{}", op.name(), d.name()));
        }
        v.push(format!("rmacomm_sum_full_{}", d.name()));
        v.push(format!("rmacomm_scale_{}", d.name()));
        v.push(format!("rmacomm_div_{}", d.name()));
    }
    v
}

/// The program's CUDA C source.
pub fn source() -> &'static str {
    static SRC: OnceLock<String> = OnceLock::new();
    SRC.get_or_init(|| {
        let mut s = String::from(PRELUDE);
        s.push_str("\n// Entry points, one per (op, dtype).\n");
        for d in DType::ALL {
            let t = d.name();
            for op in OPS.into_iter().filter(|op| op.check(d).is_ok()) {
                let name = op.name();
                let _ = writeln!(
                    s,
                    "extern \"C\" __global__ void rmacomm_{name}_{t}({t}* out, const {t}* a, const {t}* b, u64 n) \
                     {{ binary<{t}, op_{name}>(out, a, b, n); }}"
                );
                let _ = writeln!(
                    s,
                    "extern \"C\" __global__ void rmacomm_{name}_n_{t}({t}* out, const {t}* const* in, u32 k, u64 n) \
                     {{ nary<{t}, op_{name}>(out, in, k, n); }}"
                );
            }
            let _ = writeln!(
                s,
                "extern \"C\" __global__ void rmacomm_sum_full_{t}({t}* out, const {t}* const* in, u32 k, u64 n, \
                 double factor, u64 count) {{ full<{t}>(out, in, k, n, factor, count); }}"
            );
            let _ = writeln!(
                s,
                "extern \"C\" __global__ void rmacomm_scale_{t}({t}* buf, double f, u64 n) {{ scale<{t}>(buf, f, n); }}"
            );
            let _ = writeln!(
                s,
                "extern \"C\" __global__ void rmacomm_div_{t}({t}* buf, u64 count, u64 n) \
                 {{ divide<{t}>(buf, count, n); }}"
            );
        }
        s
    })
}

const SIGNALS: &str = include_str!("cuda/signals.cu");

/// The signal program's entry points.
pub const SIGNAL_ENTRY_POINTS: [&str; 3] = ["rmacomm_signal_next", "rmacomm_wait_next", "rmacomm_wait_reach"];

/// The signal program's CUDA C source (module docs).
pub fn signal_source() -> &'static str {
    SIGNALS
}

/// Options every compilation gets. `--fmad=false`: no multiply-add
/// contraction, so that `PremulSum`'s `acc + x * f` rounds the product and
/// the sum separately, as the CPU kernels do.
const OPTIONS: &[&str] = &["-std=c++17", "-lineinfo", "--fmad=false"];

/// The program compiled for `arch` (`sm_90`: a cubin for that architecture,
/// loadable by any CUDA 13 driver without JIT; `compute_90`: PTX). Compiled
/// once per architecture and process; later calls return the cached result.
pub fn compile(arch: &str) -> Result<Arc<Output>> {
    static CACHE: Cache = OnceLock::new();
    cached(&CACHE, arch, source(), "rmacomm_kernels.cu")
}

/// Compiled programs per architecture.
type Cache = OnceLock<Mutex<HashMap<String, Arc<Output>>>>;

/// `src` compiled for `arch`, from `cache` or compiled into it.
fn cached(cache: &Cache, arch: &str, src: &str, name: &str) -> Result<Arc<Output>> {
    let cache = cache.get_or_init(Default::default);
    if let Some(o) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(o.clone());
    }
    let nvrtc = Nvrtc::get()?;
    let out = Arc::new(nvrtc.compile(src, name, arch, OPTIONS)?);
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(arch.to_owned(), out.clone());
    Ok(out)
}

/// The signal program ([`signal_source`]) compiled for `arch`, once per
/// architecture and process (a fraction of the reduction program's time).
pub fn compile_signals(arch: &str) -> Result<Arc<Output>> {
    static CACHE: Cache = OnceLock::new();
    cached(&CACHE, arch, signal_source(), "rmacomm_signals.cu")
}
