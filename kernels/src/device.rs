//! [`Device`]: where a reduction runs. Only the CPU has a backend today;
//! this is the seam the CUDA kernels will plug into.

use std::fmt;

/// The memory and compute a [`Reducer`](crate::Reducer) works on.
///
/// [`Reducer::on`](crate::Reducer::on) with anything but [`Device::Cpu`]
/// returns [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable) in
/// this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Device {
    /// Host memory, reduced by the calling thread (and helper threads for
    /// large buffers, see [`Reducer::threads`](crate::Reducer::threads)).
    #[default]
    Cpu,
    /// A CUDA device by ordinal (kernels compiled with NVRTC; not built yet).
    Cuda(u32),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
