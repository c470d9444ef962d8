//! The verbs provider's loading and selection paths, on whatever machine
//! runs them: the dlopen error paths always; on a machine with libibverbs
//! but no kernel RDMA (CI here) the ENOSYS → zero devices → soft fallback
//! path; on an RDMA host, that devices are listed and open.

use ibverbx::verbs::{self, LoadError, VerbsProvider, NO_KERNEL_RDMA};
use ibverbx::{devices_of, Error, ProviderKind};

#[test]
fn missing_library_is_unavailable_with_its_name() {
    match verbs::load("libibverbs.so.999") {
        Err(LoadError::LibraryMissing { soname, .. }) => assert_eq!(soname, "libibverbs.so.999"),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn library_without_the_symbols_is_unavailable() {
    let e = verbs::load("libc.so.6").unwrap_err();
    assert!(matches!(e, LoadError::SymbolMissing { symbol: "ibv_get_device_list", .. }), "{e:?}");
}

#[test]
fn soft_is_always_there() {
    let d = devices_of(ProviderKind::Soft).unwrap();
    assert_eq!(d[0].info().provider, "soft");
}

#[test]
fn no_rdma_means_zero_devices_and_auto_falls_back_to_soft() {
    let provider = match VerbsProvider::get() {
        Ok(p) => p,
        Err(e) => {
            println!("skipped the libibverbs part: {e}");
            // Without the library, verbs is unavailable and auto is soft.
            assert!(matches!(devices_of(ProviderKind::Verbs), Err(Error::Unavailable { provider: "verbs", .. })));
            assert_eq!(devices_of(ProviderKind::Auto).unwrap()[0].info().provider, "soft");
            return;
        }
    };
    let scan = provider.scan().expect("ibv_get_device_list");
    if !scan.devices.is_empty() {
        println!("skipped the no-RDMA part: this machine has {:?}", scan.devices);
        let d = devices_of(ProviderKind::Verbs).expect("verbs devices");
        assert_eq!(d[0].info().provider, "verbs");
        d[0].open().expect("open the nearest device");
        return;
    }
    let why = scan.why_none.expect("a reason when there are no devices");
    println!("no RDMA devices here: {why}");
    if !std::path::Path::new("/sys/class/infiniband").exists() {
        assert!(why.contains(NO_KERNEL_RDMA), "{why}");
        let e = devices_of(ProviderKind::Verbs).unwrap_err();
        assert!(e.to_string().contains("verbs: no RDMA devices (kernel has no RDMA support)"), "{e}");
        assert!(matches!(e, Error::Unavailable { provider: "verbs", .. }));
    }
    assert_eq!(devices_of(ProviderKind::Auto).unwrap()[0].info().provider, "soft");
}
