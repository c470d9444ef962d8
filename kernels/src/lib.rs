//! rmacomm kernels: the CPU reductions the collectives call, for every op
//! and dtype.
//!
//! (The kernels and their docs come in the next commits.)

mod device;
mod dtype;
mod element;
mod error;
mod op;

pub use device::Device;
pub use dtype::DType;
pub use element::{as_bytes, as_bytes_mut, Element};
pub use error::{Error, Result};
pub use half;
pub use op::ReduceOp;
