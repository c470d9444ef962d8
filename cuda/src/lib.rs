//! rmacomm's GPU libraries, loaded at run time: the CUDA driver, NVRTC and
//! NCCL/RCCL. Nothing here is linked: a build, and a machine, without CUDA
//! are unaffected, and a missing library, symbol or device is an error that
//! names it (never a panic, as `cudarc`'s loaders give).
//!
//! Where each library is looked for, in order:
//! 1. the file its variable names (`RMACOMM_CUDA_LIB`, `RMACOMM_NVRTC_LIB`,
//!    `RMACOMM_NCCL_LIB`, `RMACOMM_RCCL_LIB`): that file or an error;
//! 2. its sonames through the dynamic loader (`LD_LIBRARY_PATH`, the ld.so
//!    cache);
//! 3. the directories `RMACOMM_CUDA_LIB_DIRS` lists (`:`-separated), then
//!    the PyPI wheels' `site-packages/nvidia/{cu13,cuda_nvrtc,nccl,cu12}/lib`
//!    of the active virtual environment (`VIRTUAL_ENV`), conda prefix, the
//!    user's and the system's Python: where `pip install torch` puts them.
//!
//! ```
//! // On a machine without an NVIDIA driver this is an error naming libcuda.
//! match rmacomm_cuda::driver::probe() {
//!     Ok(d) => println!("CUDA {}.{}, {} device(s)", d.version.0, d.version.1, d.devices),
//!     Err(e) => println!("no CUDA here: {e}"),
//! }
//! ```
//!
//! # Organization
//! `driver` (libcuda: version and devices, a context, kernels), `device`
//! (memory that outlives a borrow, CUDA IPC, registered host memory,
//! streams with value writes and waits, graph capture), `vmm` (cuMem/VMM
//! memory shared between processes as descriptors), `nvrtc` (CUDA C to PTX or
//! cubin, no GPU needed), `nccl` (NCCL/RCCL version probes for the fallback
//! backends), `nccl_comm` (an NCCL/RCCL communicator: collectives, and from
//! NCCL 2.29 its window calls; init, in-progress calls and its end bounded
//! by a timeout), `nccl_config` (`ncclConfig_t` as the loaded version lays
//! it out), `loader` (the search above), `error`.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod device;
pub mod driver;
mod error;
mod loader;
pub mod nccl;
pub mod nccl_comm;
mod nccl_config;
pub mod nvrtc;
pub mod reaper;
pub mod staging;
pub mod vmm;

pub use error::{CudaError, Result};

/// What to tell a user of stream operations that a host thread completes
/// (the window's stream proxy: staged windows, GPU collectives across
/// hosts) when CUDA loads modules lazily — `None` under
/// `CUDA_MODULE_LOADING=EAGER`.
///
/// With lazy loading (CUDA's default since 12.2, and PyTorch's) a kernel's
/// first launch loads its module, which may synchronize the context (the
/// CUDA programming guide, "Lazy Loading"), holding a driver lock: behind a
/// stream that waits for the transport's engine, and the engine's own CUDA
/// calls (the copies of device memory) wait for that lock. On an H200
/// (2026-11-27) GpuComm across hosts hung so, with torch's launches in the
/// stacks. Loading eagerly avoids it; GpuComm across hosts now keeps its
/// slots in host memory on the soft provider, so that its engine makes no
/// CUDA call at all (docs/gpu.md); windows of device memory through the
/// transport still copy through the driver.
pub fn lazy_loading_hazard() -> Option<&'static str> {
    lazy_loading_hazard_for(std::env::var("CUDA_MODULE_LOADING").ok().as_deref())
}

fn lazy_loading_hazard_for(setting: Option<&str>) -> Option<&'static str> {
    match setting {
        Some(v) if v.trim().eq_ignore_ascii_case("EAGER") => None,
        _ => Some(
            "stream operations completed by a host thread on device memory the transport copies through the CUDA \
             driver (the window's stream proxy: staged CUDA windows, GPU collectives across hosts with \
             RMACOMM_GPU_SLOTS=device) may hang the process when CUDA loads modules lazily (CUDA_MODULE_LOADING is not \
             EAGER): a kernel's first launch may wait for a stream that waits for the transport, whose copies wait for \
             that launch; set CUDA_MODULE_LOADING=EAGER before CUDA starts (docs/gpu.md, 'Known problem')",
        ),
    }
}

/// rmacomm's CUDA stand-in (`cuda/standin`, `librmacomm_cuda_standin.so`:
/// the driver calls rmacomm makes, on the host), for tests on machines
/// without a GPU: the library in the running test binary's target
/// directory (`target/<profile>/`, beside its `deps/`), or `None` with the
/// reason printed. Under `RMACOMM_EXPECT_STANDIN=1` (CI, which builds it
/// first) a missing stand-in panics instead. Point `RMACOMM_CUDA_LIB` at
/// it before anything loads the driver.
pub fn standin_for_tests() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let lib = exe.parent()?.parent()?.join("librmacomm_cuda_standin.so");
    if lib.exists() {
        return Some(lib);
    }
    assert!(
        std::env::var("RMACOMM_EXPECT_STANDIN").map_or(true, |v| v != "1"),
        "RMACOMM_EXPECT_STANDIN=1 but {} is not built",
        lib.display()
    );
    println!("skipped: the CUDA stand-in is not built (cargo build -p rmacomm-cuda-standin)");
    None
}

#[cfg(test)]
mod lazy_loading_tests {
    #[test]
    fn only_eager_loading_is_free_of_the_hazard() {
        assert!(super::lazy_loading_hazard_for(None).is_some_and(|m| m.contains("CUDA_MODULE_LOADING=EAGER")));
        assert!(super::lazy_loading_hazard_for(Some("LAZY")).is_some());
        assert!(super::lazy_loading_hazard_for(Some("eager")).is_none());
        assert!(super::lazy_loading_hazard_for(Some("EAGER")).is_none());
    }
}
