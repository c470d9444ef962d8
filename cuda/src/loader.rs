//! Finds and opens a shared library: the file an environment variable
//! names, else the library's sonames through the dynamic loader's own
//! search (`LD_LIBRARY_PATH`, the ld.so cache), else the directories where
//! the PyPI wheels put them (`site-packages/nvidia/{cu13,cu12,nccl,...}/lib`
//! of the active virtual environment or conda prefix, the user's and the
//! system's Python), after the directories `RMACOMM_CUDA_LIB_DIRS` lists.

use std::path::{Path, PathBuf};

use crate::{CudaError, Result};

/// What to look for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Spec {
    /// In words, for errors: "the CUDA driver (libcuda.so.1)".
    pub(crate) lib: &'static str,
    /// The variable that names the file to use.
    pub(crate) env: &'static str,
    /// File names, most specific first.
    pub(crate) names: &'static [&'static str],
    /// Wheel subdirectories of `site-packages/nvidia` holding it.
    pub(crate) wheel_dirs: &'static [&'static str],
    /// How to point rmacomm at it.
    pub(crate) hint: &'static str,
}

/// An opened library and the file it came from.
#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) lib: libloading::Library,
    pub(crate) path: PathBuf,
    pub(crate) what: &'static str,
}

impl Opened {
    /// The function `symbol` (NUL-terminated) as `T`.
    ///
    /// # Safety
    /// `T` must be the function's true C signature.
    pub(crate) unsafe fn get<T: Copy>(&self, symbol: &'static str) -> Result<T> {
        debug_assert!(symbol.ends_with('\0'));
        // SAFETY: forwarded to the caller (the type is the symbol's).
        match unsafe { self.lib.get::<T>(symbol.as_bytes()) } {
            Ok(f) => Ok(*f),
            Err(e) => Err(CudaError::MissingSymbol {
                lib: self.what,
                path: self.path.clone(),
                symbol: symbol.trim_end_matches('\0'),
                reason: e.to_string(),
            }),
        }
    }
}

/// Opens the library `spec` describes, or says everything that was tried.
pub(crate) fn open(spec: &Spec) -> Result<Opened> {
    if let Some(p) = std::env::var_os(spec.env).filter(|p| !p.is_empty()) {
        // Named by the user: that file or an error, never a silent other one.
        return open_file(spec, Path::new(&p)).map_err(|why| CudaError::NotFound {
            lib: spec.lib,
            tried: vec![format!("{}={} ({why})", spec.env, Path::new(&p).display())],
            hint: spec.hint,
        });
    }
    let mut tried = Vec::new();
    for name in spec.names {
        match open_file(spec, Path::new(name)) {
            Ok(o) => return Ok(o),
            Err(why) => tried.push(format!("{name} ({why})")),
        }
    }
    for dir in wheel_lib_dirs(spec.wheel_dirs) {
        for name in spec.names {
            let p = dir.join(name);
            if p.exists() {
                match open_file(spec, &p) {
                    Ok(o) => return Ok(o),
                    Err(why) => tried.push(format!("{} ({why})", p.display())),
                }
            }
        }
    }
    if tried.len() == spec.names.len() && !spec.wheel_dirs.is_empty() {
        tried.push("no Python wheel directory holds it".into());
    }
    Err(CudaError::NotFound { lib: spec.lib, tried, hint: spec.hint })
}

fn open_file(spec: &Spec, p: &Path) -> std::result::Result<Opened, String> {
    // SAFETY: loading runs the library's initialisers; these are the
    // vendor's libraries (or the file the user named for them), loaded as
    // any CUDA program loads them.
    match unsafe { libloading::Library::new(p) } {
        Ok(lib) => Ok(Opened { lib, path: p.to_path_buf(), what: spec.lib }),
        Err(e) => Err(short(&e.to_string(), p)),
    }
}

/// dlerror's message without the path tried (given beside it), keeping the
/// rest whole: "libamdhip64.so.6: cannot open shared object file: No such
/// file or directory" names the missing dependency (the last part alone
/// said "No such file or directory" of a file that exists).
fn short(e: &str, tried: &Path) -> String {
    let e = e.strip_prefix(&*tried.to_string_lossy()).and_then(|r| r.strip_prefix(": ")).unwrap_or(e);
    e.to_owned()
}

/// Library directories to search, in order: those `RMACOMM_CUDA_LIB_DIRS`
/// lists, then the wheels' `site-packages/nvidia/<sub>/lib` that exist.
fn wheel_lib_dirs(subs: &[&str]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::env::var_os("RMACOMM_CUDA_LIB_DIRS")
        .map(|d| std::env::split_paths(&d).filter(|p| !p.as_os_str().is_empty()).collect())
        .unwrap_or_default();
    out.extend(wheel_lib_dirs_under(&site_packages_roots(), subs));
    dedup(out)
}

fn wheel_lib_dirs_under(roots: &[PathBuf], subs: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for root in roots {
        for sub in subs {
            let d = root.join("nvidia").join(sub).join("lib");
            if d.is_dir() {
                out.push(d);
            }
        }
    }
    out
}

/// `site-packages` / `dist-packages` directories of the active virtual
/// environment, conda prefix, user site and system Python.
fn site_packages_roots() -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = std::env::var_os(var).filter(|p| !p.is_empty()) {
            prefixes.push(PathBuf::from(p));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
    let mut out = Vec::new();
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else { continue };
        let mut pys: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pys.sort();
        for py in pys.into_iter().rev() {
            for sp in ["site-packages", "dist-packages"] {
                let d = py.join(sp);
                if d.is_dir() {
                    out.push(d);
                }
            }
        }
    }
    out
}

fn dedup(v: Vec<PathBuf>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for p in v {
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod short_tests {
    use super::*;

    #[test]
    fn dlerror_keeps_what_is_missing() {
        let tried = Path::new("/opt/rocm/lib/librccl.so.1");
        assert_eq!(
            short("libamdhip64.so.6: cannot open shared object file: No such file or directory", tried),
            "libamdhip64.so.6: cannot open shared object file: No such file or directory"
        );
        assert_eq!(
            short("/opt/rocm/lib/librccl.so.1: undefined symbol: hipFoo", tried),
            "undefined symbol: hipFoo",
            "the path tried is dropped, the symbol kept"
        );
        assert_eq!(
            short("/opt/rocm/lib/librccl.so.1: wrong ELF class: ELFCLASS32", tried),
            "wrong ELF class: ELFCLASS32"
        );
    }
}
