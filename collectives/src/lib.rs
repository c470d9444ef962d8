//! rmacomm collectives: torchcomms' collectives on one-sided windows.

mod channel;
mod comm;
mod error;
mod gpu;
mod kern;
mod ops;
mod work;

pub use comm::{new_comm, Batch, Comm, CommOptions, DEFAULT_SLOT_BYTES, MAX_SLOT_BYTES};
pub use error::{Error, Result};
pub use gpu::{GpuComm, DEFAULT_GPU_SLOT_BYTES};
pub use ops::AllReduceAlgo;
pub use rmacomm_kernels::{self as kernels, DType, ReduceOp};
pub use work::{AsyncComm, CommWork};
