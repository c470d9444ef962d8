//! The kernels crate's one error type.

use crate::{DType, Device};

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of reductions: an op the element type cannot do, buffers that do
/// not fit together, or a device this build cannot reduce on.
///
/// Every error is returned before any byte is written. The type is
/// `Clone + PartialEq` so that tests can compare errors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The op is not defined for the element type (a bitwise op on floats).
    #[error("{op} is not defined for {dtype}: {hint}")]
    UnsupportedOp {
        /// The op's name (`band`, `bor`, `bxor`).
        op: &'static str,
        /// The element type asked for.
        dtype: DType,
        /// What to do instead.
        hint: &'static str,
    },
    /// A `PremulSum` factor the element type cannot hold.
    #[error("premul_sum factor {factor} cannot be applied to {dtype}: {reason}")]
    InvalidFactor {
        /// The factor given.
        factor: f64,
        /// The element type.
        dtype: DType,
        /// Why, and what to pass instead.
        reason: &'static str,
    },
    /// A string that names no element type.
    #[error(
        "unknown dtype '{0}'; use one of f32/float32/float, f64/float64/double, f16/float16/half, \
         bf16/bfloat16, i8/int8, u8/uint8, i32/int32/int, i64/int64/long"
    )]
    UnknownDType(String),
    /// A string that names no reduction op.
    #[error("unknown reduce op '{0}'; use one of sum, product, min, max, band, bor, bxor, avg")]
    UnknownOp(String),
    /// Buffers whose lengths do not fit together, or a bad count; nothing
    /// was written.
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// The kernel entry point (`reduce_into`, `reduce_n`, ...).
        op: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The device has no reduction backend in this build.
    #[error(
        "reductions on {device} are not available in this build of rmacomm-kernels (only the CPU backend \
         runs; the CUDA kernels compile with NVRTC, see rmacomm_kernels::cuda, but launching them is not \
         built yet); reduce on Device::Cpu, staging device buffers through host memory"
    )]
    DeviceUnavailable {
        /// The device asked for.
        device: Device,
    },
    /// A GPU library (NVRTC, the CUDA driver) is missing or failed; the
    /// message names it.
    #[error(transparent)]
    Cuda(#[from] rmacomm_cuda::CudaError),
}
