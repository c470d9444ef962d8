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
//! streams with value writes and waits, graph capture), `nvrtc` (CUDA C to PTX or
//! cubin, no GPU needed), `nccl` (NCCL/RCCL version probes for the fallback
//! backends), `loader` (the search above), `error`.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod device;
pub mod driver;
mod error;
mod loader;
pub mod nccl;
pub mod nccl_comm;
pub mod nvrtc;
pub mod reaper;
pub mod staging;

pub use error::{CudaError, Result};

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
