//! NVRTC, CUDA's run-time compiler: CUDA C to PTX or to a cubin for one
//! architecture. It needs no GPU, so kernels are compiled (and their
//! sources checked) on any machine that has the library.

use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::OnceLock;

use crate::loader::{self, Opened, Spec};
use crate::{CudaError, Result};

const SPEC: Spec = Spec {
    lib: "NVRTC (libnvrtc)",
    env: "RMACOMM_NVRTC_LIB",
    names: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    wheel_dirs: &["cu13", "cuda_nvrtc", "cu12"],
    hint: "install the CUDA toolkit's NVRTC or the nvidia-cuda-nvrtc wheel (PyTorch's CUDA wheels bring it), \
           or set RMACOMM_NVRTC_LIB to the libnvrtc.so file",
};

type Prog = *mut std::ffi::c_void;
type Status = c_int;

/// The NVRTC functions used, resolved once.
#[derive(Debug, Clone, Copy)]
struct Fns {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> Status,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    destroy: unsafe extern "C" fn(*mut Prog) -> Status,
}

/// NVRTC, loaded. Cheap to share: [`Nvrtc::get`] loads it once per process.
#[derive(Debug)]
pub struct Nvrtc {
    fns: Fns,
    version: (i32, i32),
    lib: Opened,
}

/// What a compilation produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// PTX text (for a virtual architecture, `compute_XY`): the driver
    /// compiles it for the device when it loads it.
    Ptx(String),
    /// A cubin for one real architecture (`sm_XY`): loaded as is, with no
    /// JIT, by any driver of the same CUDA major version.
    Cubin(Vec<u8>),
}

impl Output {
    /// The image `cuModuleLoadData` takes: the cubin, or the PTX with its
    /// terminating NUL.
    pub fn image(&self) -> Vec<u8> {
        match self {
            Output::Cubin(b) => b.clone(),
            Output::Ptx(p) => format!("{p}\0").into_bytes(),
        }
    }
}

impl Nvrtc {
    /// Loads NVRTC (see the crate docs for where it is looked for).
    pub fn load() -> Result<Nvrtc> {
        let lib = loader::open(&SPEC)?;
        // SAFETY: each type below is the function's C signature in nvrtc.h
        // (nvrtcProgram is a pointer, nvrtcResult an int enum).
        let fns = unsafe {
            Fns {
                version: lib.get("nvrtcVersion\0")?,
                error_string: lib.get("nvrtcGetErrorString\0")?,
                create: lib.get("nvrtcCreateProgram\0")?,
                compile: lib.get("nvrtcCompileProgram\0")?,
                ptx_size: lib.get("nvrtcGetPTXSize\0")?,
                ptx: lib.get("nvrtcGetPTX\0")?,
                cubin_size: lib.get("nvrtcGetCUBINSize\0")?,
                cubin: lib.get("nvrtcGetCUBIN\0")?,
                log_size: lib.get("nvrtcGetProgramLogSize\0")?,
                log: lib.get("nvrtcGetProgramLog\0")?,
                destroy: lib.get("nvrtcDestroyProgram\0")?,
            }
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        let st = unsafe { (fns.version)(&mut major, &mut minor) };
        let mut n = Nvrtc { fns, version: (0, 0), lib };
        n.check("nvrtcVersion", st)?;
        n.version = (major, minor);
        Ok(n)
    }

    /// The process's NVRTC, loaded on first use (a failure is remembered:
    /// the library does not appear later).
    pub fn get() -> Result<&'static Nvrtc> {
        static N: OnceLock<Result<Nvrtc>> = OnceLock::new();
        N.get_or_init(Nvrtc::load).as_ref().map_err(Clone::clone)
    }

    /// NVRTC's version, (major, minor).
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &std::path::Path {
        &self.lib.path
    }

    fn check(&self, call: &'static str, st: Status) -> Result<()> {
        if st == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string for any code.
        let p = unsafe { (self.fns.error_string)(st) };
        let name = if p.is_null() {
            "unknown".to_owned()
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        Err(CudaError::Call { lib: SPEC.lib, call, code: st, name })
    }

    /// Compiles `src` (named `name` in messages) for `arch`: `sm_XY` gives
    /// a cubin, `compute_XY` PTX. `options` are passed on (`-default-device`,
    /// `-std=c++17`, ...). A compile error is [`CudaError::Compile`] with
    /// NVRTC's log.
    pub fn compile(&self, src: &str, name: &str, arch: &str, options: &[&str]) -> Result<Output> {
        let bad = |what: &str| CudaError::Compile {
            name: name.to_owned(),
            arch: arch.to_owned(),
            log: format!("{what} contains a NUL byte"),
        };
        let c_src = CString::new(src).map_err(|_| bad("the source"))?;
        let c_name = CString::new(name).map_err(|_| bad("the name"))?;
        let mut opts = vec![CString::new(format!("--gpu-architecture={arch}")).map_err(|_| bad("the arch"))?];
        for o in options {
            opts.push(CString::new(*o).map_err(|_| bad("an option"))?);
        }
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: valid C strings; no headers (0, null, null).
        let st = unsafe {
            (self.fns.create)(&mut prog, c_src.as_ptr(), c_name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
        };
        self.check("nvrtcCreateProgram", st)?;
        let guard = ProgGuard { fns: &self.fns, prog };
        let n_opts = c_int::try_from(opt_ptrs.len()).map_err(|_| bad("the option list"))?;
        // SAFETY: prog is live; opt_ptrs holds n_opts valid C strings.
        let st = unsafe { (self.fns.compile)(guard.prog, n_opts, opt_ptrs.as_ptr()) };
        if st != 0 {
            let log = self.log(guard.prog).unwrap_or_else(|e| e.to_string());
            return Err(CudaError::Compile { name: name.to_owned(), arch: arch.to_owned(), log });
        }
        if arch.starts_with("sm_") {
            let bytes = self.fetch(guard.prog, "nvrtcGetCUBIN", self.fns.cubin_size, self.fns.cubin)?;
            Ok(Output::Cubin(bytes))
        } else {
            let mut bytes = self.fetch(guard.prog, "nvrtcGetPTX", self.fns.ptx_size, self.fns.ptx)?;
            while bytes.last() == Some(&0) {
                bytes.pop();
            }
            Ok(Output::Ptx(String::from_utf8_lossy(&bytes).into_owned()))
        }
    }

    fn log(&self, prog: Prog) -> Result<String> {
        let mut bytes = self.fetch(prog, "nvrtcGetProgramLog", self.fns.log_size, self.fns.log)?;
        while bytes.last() == Some(&0) {
            bytes.pop();
        }
        Ok(String::from_utf8_lossy(&bytes).trim().to_owned())
    }

    fn fetch(
        &self,
        prog: Prog,
        call: &'static str,
        size: unsafe extern "C" fn(Prog, *mut usize) -> Status,
        get: unsafe extern "C" fn(Prog, *mut c_char) -> Status,
    ) -> Result<Vec<u8>> {
        let mut n = 0usize;
        // SAFETY: prog is live; n is a valid out-pointer.
        self.check(call, unsafe { size(prog, &mut n) })?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            // SAFETY: buf has the n bytes NVRTC said it writes.
            self.check(call, unsafe { get(prog, buf.as_mut_ptr().cast()) })?;
        }
        Ok(buf)
    }
}

/// Destroys the program on every path out of `compile`.
struct ProgGuard<'a> {
    fns: &'a Fns,
    prog: Prog,
}

impl Drop for ProgGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe { (self.fns.destroy)(&mut self.prog) };
    }
}

#[cfg(test)]
mod image_tests {
    use super::Output;

    #[test]
    fn ptx_images_end_in_a_nul_and_cubins_are_as_compiled() {
        assert_eq!(Output::Ptx(".version 8.0".into()).image(), b".version 8.0\0");
        assert_eq!(Output::Cubin(b"\x7fELF..".to_vec()).image(), b"\x7fELF..");
    }
}
