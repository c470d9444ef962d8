//! rmacomm kernels: the CPU reductions the collectives call, for every op
//! and dtype.
//!
//! (Docs to come with the first complete API.)

mod arith;
mod device;
mod dispatch;
mod dtype;
mod element;
mod error;
mod halfs;
mod native;
mod nontemporal;
mod op;
mod parallel;
mod reducer;

pub use device::Device;
pub use dtype::DType;
pub use element::{as_bytes, as_bytes_mut, Element};
pub use error::{Error, Result};
pub use half;
pub use op::ReduceOp;
pub use reducer::{Reducer, NONTEMPORAL_MIN_BYTES, PARALLEL_MIN_BYTES};
