//! Run-time loading of libibverbs: `dlopen` plus versioned symbol lookup.
//!
//! Every entry point the provider calls is resolved once, here, into a table
//! of function pointers ([`IbvLib`]); a missing library or symbol becomes a
//! [`LoadError`] that says what to install, so a machine without rdma-core
//! simply has no verbs provider. The data path (`poll_cq`, `post_send`, …)
//! does not go through this table: like verbs.h's inline functions it calls
//! the ops table of the `ibv_context` (see `context.rs`).

use std::ffi::{c_void, CStr, CString};
use std::fmt;
use std::os::raw::{c_char, c_int};

use super::ffi::*;

/// The soname rdma-core installs (ABI 1 since 2006).
pub const LIBIBVERBS_SONAME: &str = "libibverbs.so.1";

/// Why libibverbs could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadError {
    /// `dlopen` failed: the library is not installed (or not loadable).
    LibraryMissing {
        /// The soname that was tried.
        soname: String,
        /// `dlerror()`'s text.
        detail: String,
    },
    /// The library lacks a required entry point (not libibverbs, or too old).
    SymbolMissing {
        /// The library that was opened.
        soname: String,
        /// The missing symbol.
        symbol: &'static str,
        /// The symbol version asked for.
        version: &'static str,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::LibraryMissing { soname, detail } => write!(
                f,
                "verbs: cannot load {soname} ({detail}); install rdma-core's libibverbs \
                 (Debian/Ubuntu: libibverbs1 ibverbs-providers) or use RMACOMM_PROVIDER=soft"
            ),
            LoadError::SymbolMissing { soname, symbol, version } => write!(
                f,
                "verbs: {soname} has no symbol {symbol}@{version}; it is not libibverbs or is older than \
                 rdma-core 17 — update rdma-core or use RMACOMM_PROVIDER=soft"
            ),
        }
    }
}

impl std::error::Error for LoadError {}

pub(crate) type GetDeviceList = unsafe extern "C" fn(num: *mut c_int) -> *mut *mut ibv_device;
pub(crate) type FreeDeviceList = unsafe extern "C" fn(list: *mut *mut ibv_device);
pub(crate) type GetDeviceName = unsafe extern "C" fn(dev: *mut ibv_device) -> *const c_char;
pub(crate) type GetDeviceGuid = unsafe extern "C" fn(dev: *mut ibv_device) -> u64;
pub(crate) type OpenDevice = unsafe extern "C" fn(dev: *mut ibv_device) -> *mut ibv_context;
pub(crate) type CloseDevice = unsafe extern "C" fn(ctx: *mut ibv_context) -> c_int;
pub(crate) type QueryDevice = unsafe extern "C" fn(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int;
pub(crate) type QueryPort = unsafe extern "C" fn(ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int;
pub(crate) type QueryGid =
    unsafe extern "C" fn(ctx: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
pub(crate) type QueryGidEx = unsafe extern "C" fn(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int;
pub(crate) type AllocPd = unsafe extern "C" fn(ctx: *mut ibv_context) -> *mut ibv_pd;
pub(crate) type DeallocPd = unsafe extern "C" fn(pd: *mut ibv_pd) -> c_int;
pub(crate) type RegMr =
    unsafe extern "C" fn(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
pub(crate) type RegDmabufMr =
    unsafe extern "C" fn(pd: *mut ibv_pd, offset: u64, len: usize, iova: u64, fd: c_int, access: c_int) -> *mut ibv_mr;
pub(crate) type DeregMr = unsafe extern "C" fn(mr: *mut ibv_mr) -> c_int;
pub(crate) type CreateCompChannel = unsafe extern "C" fn(ctx: *mut ibv_context) -> *mut ibv_comp_channel;
pub(crate) type DestroyCompChannel = unsafe extern "C" fn(ch: *mut ibv_comp_channel) -> c_int;
pub(crate) type CreateCq = unsafe extern "C" fn(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq;
pub(crate) type DestroyCq = unsafe extern "C" fn(cq: *mut ibv_cq) -> c_int;
pub(crate) type GetCqEvent =
    unsafe extern "C" fn(ch: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, cq_context: *mut *mut c_void) -> c_int;
pub(crate) type AckCqEvents = unsafe extern "C" fn(cq: *mut ibv_cq, nevents: u32);
pub(crate) type CreateQp = unsafe extern "C" fn(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
pub(crate) type ModifyQp = unsafe extern "C" fn(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int;
pub(crate) type QueryQp = unsafe extern "C" fn(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int;
pub(crate) type DestroyQp = unsafe extern "C" fn(qp: *mut ibv_qp) -> c_int;

/// The resolved libibverbs entry points. The library stays loaded while
/// this value lives (the provider keeps it for the life of the process).
pub struct IbvLib {
    soname: String,
    pub(crate) get_device_list: GetDeviceList,
    pub(crate) free_device_list: FreeDeviceList,
    pub(crate) get_device_name: GetDeviceName,
    pub(crate) get_device_guid: GetDeviceGuid,
    pub(crate) open_device: OpenDevice,
    pub(crate) close_device: CloseDevice,
    pub(crate) query_device: QueryDevice,
    pub(crate) query_port: QueryPort,
    pub(crate) query_gid: QueryGid,
    /// `_ibv_query_gid_ex` (rdma-core ≥ 32): GID type with the GID.
    pub(crate) query_gid_ex: Option<QueryGidEx>,
    pub(crate) alloc_pd: AllocPd,
    pub(crate) dealloc_pd: DeallocPd,
    pub(crate) reg_mr: RegMr,
    /// `ibv_reg_dmabuf_mr` (rdma-core ≥ 34).
    pub(crate) reg_dmabuf_mr: Option<RegDmabufMr>,
    pub(crate) dereg_mr: DeregMr,
    pub(crate) create_comp_channel: CreateCompChannel,
    pub(crate) destroy_comp_channel: DestroyCompChannel,
    pub(crate) create_cq: CreateCq,
    pub(crate) destroy_cq: DestroyCq,
    pub(crate) get_cq_event: GetCqEvent,
    pub(crate) ack_cq_events: AckCqEvents,
    pub(crate) create_qp: CreateQp,
    pub(crate) modify_qp: ModifyQp,
    pub(crate) query_qp: QueryQp,
    pub(crate) destroy_qp: DestroyQp,
    _lib: libloading::os::unix::Library,
}

impl fmt::Debug for IbvLib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbvLib")
            .field("soname", &self.soname)
            .field("query_gid_ex", &self.query_gid_ex.is_some())
            .field("reg_dmabuf_mr", &self.reg_dmabuf_mr.is_some())
            .finish()
    }
}

impl IbvLib {
    /// The soname this table was loaded from.
    pub fn soname(&self) -> &str {
        &self.soname
    }

    /// Whether `ibv_reg_dmabuf_mr` is available (rdma-core ≥ 34).
    pub fn has_dmabuf(&self) -> bool {
        self.reg_dmabuf_mr.is_some()
    }
}

/// Opens `soname` and resolves every libibverbs entry point the provider
/// uses. Tests call it with other names to exercise the error paths.
pub fn load(soname: &str) -> Result<IbvLib, LoadError> {
    let lib_missing = |detail: String| LoadError::LibraryMissing { soname: soname.to_owned(), detail };
    // SAFETY: loading runs the library's initialisers; libibverbs' only set
    // up its internal state. RTLD_LOCAL keeps its symbols out of the global
    // namespace so that they cannot interpose on anything else.
    let lib = unsafe {
        libloading::os::unix::Library::open(
            Some(soname),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL,
        )
    }
    .map_err(|e| lib_missing(e.to_string()))?;
    let handle = lib.into_raw();
    // SAFETY: `handle` came from `into_raw` just above and is converted back
    // once; `sym` below only borrows it while `lib` keeps it open.
    let lib = unsafe { libloading::os::unix::Library::from_raw(handle) };

    let sym = |name: &'static str, version: &'static str| -> Option<*mut c_void> { resolve(handle, name, version) };
    let missing = |symbol: &'static str, version: &'static str| LoadError::SymbolMissing {
        soname: soname.to_owned(),
        symbol,
        version,
    };

    macro_rules! required {
        ($name:literal, $ver:literal, $ty:ty) => {
            match sym($name, $ver) {
                // SAFETY: the symbol is libibverbs' exported function of that
                // name and version, whose C prototype `$ty` transcribes.
                Some(p) => unsafe { std::mem::transmute::<*mut c_void, $ty>(p) },
                None => return Err(missing($name, $ver)),
            }
        };
    }
    macro_rules! optional {
        ($name:literal, $ver:literal, $ty:ty) => {
            // SAFETY: as for `required!`.
            sym($name, $ver).map(|p| unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
        };
    }

    Ok(IbvLib {
        soname: soname.to_owned(),
        get_device_list: required!("ibv_get_device_list", "IBVERBS_1.1", GetDeviceList),
        free_device_list: required!("ibv_free_device_list", "IBVERBS_1.1", FreeDeviceList),
        get_device_name: required!("ibv_get_device_name", "IBVERBS_1.1", GetDeviceName),
        get_device_guid: required!("ibv_get_device_guid", "IBVERBS_1.1", GetDeviceGuid),
        open_device: required!("ibv_open_device", "IBVERBS_1.1", OpenDevice),
        close_device: required!("ibv_close_device", "IBVERBS_1.1", CloseDevice),
        query_device: required!("ibv_query_device", "IBVERBS_1.1", QueryDevice),
        query_port: required!("ibv_query_port", "IBVERBS_1.1", QueryPort),
        query_gid: required!("ibv_query_gid", "IBVERBS_1.1", QueryGid),
        query_gid_ex: optional!("_ibv_query_gid_ex", "IBVERBS_1.11", QueryGidEx),
        alloc_pd: required!("ibv_alloc_pd", "IBVERBS_1.1", AllocPd),
        dealloc_pd: required!("ibv_dealloc_pd", "IBVERBS_1.1", DeallocPd),
        reg_mr: required!("ibv_reg_mr", "IBVERBS_1.1", RegMr),
        reg_dmabuf_mr: optional!("ibv_reg_dmabuf_mr", "IBVERBS_1.12", RegDmabufMr),
        dereg_mr: required!("ibv_dereg_mr", "IBVERBS_1.1", DeregMr),
        create_comp_channel: required!("ibv_create_comp_channel", "IBVERBS_1.0", CreateCompChannel),
        destroy_comp_channel: required!("ibv_destroy_comp_channel", "IBVERBS_1.0", DestroyCompChannel),
        create_cq: required!("ibv_create_cq", "IBVERBS_1.1", CreateCq),
        destroy_cq: required!("ibv_destroy_cq", "IBVERBS_1.1", DestroyCq),
        get_cq_event: required!("ibv_get_cq_event", "IBVERBS_1.1", GetCqEvent),
        ack_cq_events: required!("ibv_ack_cq_events", "IBVERBS_1.1", AckCqEvents),
        create_qp: required!("ibv_create_qp", "IBVERBS_1.1", CreateQp),
        modify_qp: required!("ibv_modify_qp", "IBVERBS_1.1", ModifyQp),
        query_qp: required!("ibv_query_qp", "IBVERBS_1.1", QueryQp),
        destroy_qp: required!("ibv_destroy_qp", "IBVERBS_1.1", DestroyQp),
        _lib: lib,
    })
}

/// `dlvsym(handle, name, version)`, falling back to plain `dlsym` (the
/// default version) where the C library has no `dlvsym` or the symbol is
/// unversioned.
fn resolve(handle: *mut c_void, name: &str, version: &str) -> Option<*mut c_void> {
    let cname = CString::new(name).ok()?;
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let cver = CString::new(version).ok()?;
        // SAFETY: `handle` is a live dlopen handle; both strings are
        // NUL-terminated and outlive the call.
        let p = unsafe { libc::dlvsym(handle, cname.as_ptr(), cver.as_ptr()) };
        if !p.is_null() {
            return Some(p);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = version;
    // SAFETY: as above.
    let p = unsafe { libc::dlsym(handle, cname.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Reads a NUL-terminated C string owned by libibverbs.
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string that stays valid for
/// the call.
pub(crate) unsafe fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: forwarded to the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_reported_with_its_name() {
        let e = load("libibverbs-does-not-exist.so.9").unwrap_err();
        match &e {
            LoadError::LibraryMissing { soname, detail } => {
                assert_eq!(soname, "libibverbs-does-not-exist.so.9");
                assert!(!detail.is_empty());
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(e.to_string().contains("RMACOMM_PROVIDER=soft"), "{e}");
    }

    #[test]
    fn library_without_ibv_symbols_is_reported() {
        // libc is always there and has no ibv_* symbols.
        let e = load("libc.so.6").unwrap_err();
        assert_eq!(
            e,
            LoadError::SymbolMissing {
                soname: "libc.so.6".into(),
                symbol: "ibv_get_device_list",
                version: "IBVERBS_1.1"
            }
        );
        assert!(e.to_string().contains("ibv_get_device_list@IBVERBS_1.1"), "{e}");
    }
}
