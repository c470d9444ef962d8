//! The provider conformance suite (`tests/conformance/`) on the verbs
//! provider: two contexts on the nearest RDMA device (or the first that
//! `RMACOMM_IB_HCA` admits), QPs connected through the HCA's loopback.
//!
//! Without a device every case prints `skipped: no RDMA device (…)` and
//! passes: nothing here is faked. On an RDMA host:
//! `RMACOMM_IB_HCA=mlx5_0 cargo test -p ibverbx --release --test verbs_conformance -- --nocapture`.

mod conformance;

use std::sync::OnceLock;

/// The hook: the verbs device the suite runs on, or why there is none.
/// Point the suite at another device with `RMACOMM_IB_HCA` (and
/// `RMACOMM_IB_GID_INDEX` on RoCE when the automatic choice is wrong).
pub fn verbs_device() -> Result<ibverbx::Device, String> {
    static DEV: OnceLock<Result<ibverbx::Device, String>> = OnceLock::new();
    DEV.get_or_init(|| match ibverbx::verbs::devices() {
        Ok(mut d) => Ok(d.remove(0)),
        Err(e) => Err(e.to_string()),
    })
    .clone()
}

/// Runs one case on the verbs device, or prints why it cannot.
fn device_or_skip() -> Option<ibverbx::Device> {
    match verbs_device() {
        Ok(d) => {
            println!("verbs conformance on {}", d.name());
            Some(d)
        }
        Err(why) => {
            println!("skipped: no RDMA device ({why})");
            None
        }
    }
}

conformance_suite!(match device_or_skip() {
    Some(d) => d,
    None => return,
});
