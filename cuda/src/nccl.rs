//! NCCL (or RCCL, which has the same C API), loaded at run time for the
//! fallback backends: which version is there, and whether it has what a
//! feature needs.

use std::ffi::c_int;
use std::fmt;

use crate::loader::{self, Spec};
use crate::{CudaError, Result};

const NCCL: Spec = Spec {
    lib: "NCCL (libnccl.so.2)",
    env: "RMACOMM_NCCL_LIB",
    names: &["libnccl.so.2", "libnccl.so"],
    wheel_dirs: &["nccl", "cu13", "cu12"],
    hint: "install libnccl2 or the nvidia-nccl-cu13 wheel (PyTorch's CUDA wheels bring it), or set \
           RMACOMM_NCCL_LIB to the libnccl.so.2 file",
};

const RCCL: Spec = Spec {
    lib: "RCCL (librccl.so.1)",
    env: "RMACOMM_RCCL_LIB",
    names: &["librccl.so.1", "librccl.so"],
    wheel_dirs: &[],
    hint: "install ROCm's rccl package, or set RMACOMM_RCCL_LIB to the librccl.so file",
};

/// Which library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// NVIDIA's NCCL.
    Nccl,
    /// AMD's RCCL (NCCL's API on ROCm).
    Rccl,
}

/// A library version, `major.minor.patch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl Version {
    /// Decodes `ncclGetVersion`'s code: `major * 10000 + minor * 100 +
    /// patch` from 2.9 on, `major * 1000 + minor * 100 + patch` before.
    pub fn from_code(code: i32) -> Version {
        let c = code.max(0) as u32;
        if c >= 20900 {
            Version { major: c / 10000, minor: (c % 10000) / 100, patch: c % 100 }
        } else {
            Version { major: c / 1000, minor: (c % 1000) / 100, patch: c % 100 }
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// NCCL's host-initiated one-sided API (`ncclPutSignal`, `ncclSignal`,
/// `ncclWaitSignal`) and window registration came in 2.29.
pub const WINDOW_API: Version = Version { major: 2, minor: 29, patch: 0 };

/// An opened NCCL or RCCL and its version.
#[derive(Debug)]
pub struct Library {
    flavor: Flavor,
    version: Version,
    path: std::path::PathBuf,
    pub(crate) lib: loader::Opened,
}

impl Library {
    /// Loads the library and reads its version (`ncclGetVersion`, which
    /// needs no GPU).
    pub fn load(flavor: Flavor) -> Result<Library> {
        let spec = match flavor {
            Flavor::Nccl => &NCCL,
            Flavor::Rccl => &RCCL,
        };
        let lib = loader::open(spec)?;
        // SAFETY: `ncclResult_t ncclGetVersion(int *version)` (nccl.h).
        let get = unsafe { lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>("ncclGetVersion\0")? };
        let mut code = 0;
        // SAFETY: a valid out-pointer.
        let st = unsafe { get(&mut code) };
        if st != 0 {
            return Err(CudaError::Call {
                lib: spec.lib,
                call: "ncclGetVersion",
                code: st,
                name: format!("ncclResult {st}"),
            });
        }
        Ok(Library { flavor, version: Version::from_code(code), path: lib.path.clone(), lib })
    }

    /// Which library this is.
    pub fn flavor(&self) -> Flavor {
        self.flavor
    }

    /// Its version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Ok when the version is at least `need`; else [`CudaError::TooOld`]
    /// saying what needed it.
    pub fn require(&self, need: Version, what: &'static str) -> Result<()> {
        if self.version >= need {
            return Ok(());
        }
        Err(CudaError::TooOld {
            lib: match self.flavor {
                Flavor::Nccl => NCCL.lib,
                Flavor::Rccl => RCCL.lib,
            },
            have: self.version.to_string(),
            need: need.to_string(),
            what,
        })
    }
}
