//! The CUDA driver (libcuda, installed with the NVIDIA kernel driver):
//! whether this machine can run CUDA at all, which driver version and how
//! many devices.

use std::ffi::{c_char, c_int, CStr};

use crate::loader::{self, Spec};
use crate::{CudaError, Result};

const SPEC: Spec = Spec {
    lib: "the CUDA driver (libcuda.so.1)",
    env: "RMACOMM_CUDA_LIB",
    names: &["libcuda.so.1", "libcuda.so"],
    wheel_dirs: &[],
    hint: "it comes with the NVIDIA GPU driver; a machine without an NVIDIA GPU has none \
           (RMACOMM_CUDA_LIB names the file where it is not on the loader's path)",
};

/// `CUDA_ERROR_NO_DEVICE`.
const NO_DEVICE: c_int = 100;

/// What the driver reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// The CUDA version the driver supports, as (major, minor): 13.0 is
    /// `(13, 0)`.
    pub version: (i32, i32),
    /// Devices visible to this process (`CUDA_VISIBLE_DEVICES` applies).
    pub devices: usize,
    /// The file the driver was loaded from.
    pub path: std::path::PathBuf,
}

/// Loads the driver, initialises it and counts the devices. A machine with
/// no NVIDIA driver gets [`CudaError::NotFound`] naming `libcuda.so.1`; a
/// driver with no device, `DriverInfo { devices: 0, .. }`.
pub fn probe() -> Result<DriverInfo> {
    let lib = loader::open(&SPEC)?;
    // SAFETY: the types are the C signatures in cuda.h (CUresult is an int
    // enum; cuGetErrorName writes a static string's address).
    let (init, version, count, err_name) = unsafe {
        (
            lib.get::<unsafe extern "C" fn(u32) -> c_int>("cuInit\0")?,
            lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>("cuDriverGetVersion\0")?,
            lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>("cuDeviceGetCount\0")?,
            lib.get::<unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int>("cuGetErrorName\0")?,
        )
    };
    let fail = |call: &'static str, code: c_int| {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: a valid out-pointer; the string, when set, is static.
        let name = if unsafe { err_name(code, &mut p) } == 0 && !p.is_null() {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        } else {
            "unknown".to_owned()
        };
        CudaError::Call { lib: SPEC.lib, call, code, name }
    };
    let mut v = 0;
    // SAFETY: a valid out-pointer (callable before cuInit).
    let st = unsafe { version(&mut v) };
    if st != 0 {
        return Err(fail("cuDriverGetVersion", st));
    }
    // SAFETY: flags must be 0.
    let st = unsafe { init(0) };
    let devices = match st {
        0 => {
            let mut n = 0;
            // SAFETY: a valid out-pointer, after a successful cuInit.
            let st = unsafe { count(&mut n) };
            if st != 0 {
                return Err(fail("cuDeviceGetCount", st));
            }
            usize::try_from(n).unwrap_or(0)
        }
        NO_DEVICE => 0,
        st => return Err(fail("cuInit", st)),
    };
    Ok(DriverInfo { version: (v / 1000, (v % 1000) / 10), devices, path: lib.path.clone() })
}
