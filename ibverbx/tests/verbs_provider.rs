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

/// Set when this binary runs `auto_with_the_hca_filter_given` for the test
/// below, with `RMACOMM_IB_HCA` set in its environment (scripts/test.sh
/// runs this file under `cargo test` too: threads of one process, which must
/// not share a changed environment).
const ROLE: &str = "IBVERBX_TEST_HCA_FILTER_ROLE";

#[test]
fn a_malformed_hca_filter_is_an_error_under_auto_not_a_silent_soft_fallback() {
    // A typo used to move everything to the soft provider (TCP) with a log
    // line at info level.
    for (filter, want) in [("mlx5_0:x", "error"), ("mlx5_0", "ok")] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "auto_with_the_hca_filter_given", "--nocapture", "--test-threads=1"])
            .env(ROLE, want)
            .env("RMACOMM_IB_HCA", filter)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("checked"),
            "{filter}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn auto_with_the_hca_filter_given() {
    let Some(want) = std::env::var_os(ROLE) else { return };
    match devices_of(ProviderKind::Auto) {
        Err(e) => {
            assert_eq!(want, "error", "{e}");
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
            assert!(e.to_string().contains("bad port"), "{e}");
        }
        // A well-formed filter: devices where there are, else soft.
        Ok(d) => assert_eq!(want, "ok", "{:?}", d[0].info()),
    }
    println!("checked");
}
