//! Nearest-HCA choice: orders devices by distance to the calling thread or
//! to a GPU.
//!
//! A place in the machine is a [`Locality`]: its NUMA node and its path in
//! the topology tree (sysfs PCI path components, or hwloc ancestors with the
//! `hwloc` feature). Devices are ranked by tree distance (hops to the first
//! common ancestor: same PCIe switch beats same root complex beats another
//! socket), then by NUMA distance (`/sys/devices/system/node/*/distance`),
//! then by name. The ranking is pure; `probe_*` read sysfs.

use std::cmp::Ordering;
use std::path::Path;

/// Where a device, thread or GPU sits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Locality {
    /// NUMA node, when known.
    pub numa_node: Option<u32>,
    /// Path from the root of the topology tree down to the object; empty when
    /// unknown.
    pub path: Vec<String>,
}

/// What to be near.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Near {
    /// The calling thread (the CPU it runs on now).
    CurrentThread,
    /// A PCI device, e.g. a GPU, by bus id (`0000:3b:00.0`; CUDA's
    /// `00000000:3B:00.0` form is accepted).
    PciBusId(String),
}

/// Hops between two tree paths through their deepest common ancestor;
/// `None` when either path is unknown.
pub fn tree_distance(a: &[String], b: &[String]) -> Option<usize> {
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    Some(a.len() + b.len() - 2 * common)
}

/// Orders `candidates` (name, locality) by nearness to `target`; returns
/// indices into `candidates`, nearest first. `numa_distance(a, b)` gives the
/// firmware's NUMA distance (10 = local).
pub fn rank(
    candidates: &[(String, Locality)],
    target: &Locality,
    numa_distance: &dyn Fn(u32, u32) -> u32,
) -> Vec<usize> {
    let key = |l: &Locality| {
        let tree = tree_distance(&l.path, &target.path).unwrap_or(usize::MAX);
        let numa = match (l.numa_node, target.numa_node) {
            (Some(a), Some(b)) => numa_distance(a, b),
            _ => u32::MAX,
        };
        (tree, numa)
    };
    let mut idx: Vec<usize> = (0..candidates.len()).collect();
    idx.sort_by(|&i, &j| {
        let (ni, li) = &candidates[i];
        let (nj, lj) = &candidates[j];
        key(li).cmp(&key(lj)).then_with(|| natural_cmp(ni, nj))
    });
    idx
}

/// Name order where `mlx5_2` < `mlx5_10`.
fn natural_cmp(a: &str, b: &str) -> Ordering {
    let split = |s: &str| {
        let digits = s.len() - s.bytes().rev().take_while(u8::is_ascii_digit).count();
        (s[..digits].to_owned(), s[digits..].parse::<u64>().unwrap_or(0))
    };
    split(a).cmp(&split(b)).then_with(|| a.cmp(b))
}

/// Normalises a PCI bus id to sysfs form: 4-digit lowercase domain,
/// `dddd:bb:dd.f`. Accepts `bb:dd.f` (domain 0) and CUDA's 8-digit domain.
pub(crate) fn normalize_bus_id(s: &str) -> Option<String> {
    let s = s.trim().to_ascii_lowercase();
    let parts: Vec<&str> = s.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [bus, devfn] => ("0", *bus, *devfn),
        [domain, bus, devfn] => (*domain, *bus, *devfn),
        _ => return None,
    };
    let (dev, func) = devfn.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if domain > 0xffff || dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The path components of a sysfs device directory below `/sys/devices`
/// (`pci0000:3a`, `0000:3a:00.0`, `0000:3b:00.0`).
pub(crate) fn sysfs_path_components(real: &Path) -> Vec<String> {
    let rel = real.strip_prefix("/sys/devices").unwrap_or(real);
    rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect()
}

fn read_numa_node(dir: &Path) -> Option<u32> {
    let s = std::fs::read_to_string(dir.join("numa_node")).ok()?;
    // -1 means "no affinity" (single-node machines, some VMs).
    s.trim().parse::<i64>().ok().filter(|&n| n >= 0).map(|n| n as u32)
}

/// Locality of a sysfs device directory (`/sys/class/infiniband/mlx5_0/device`,
/// `/sys/bus/pci/devices/0000:3b:00.0`).
pub(crate) fn probe_sysfs_device(dir: &Path) -> Locality {
    let real = std::fs::canonicalize(dir).ok();
    Locality { numa_node: read_numa_node(dir), path: real.as_deref().map(sysfs_path_components).unwrap_or_default() }
}

/// Locality of an RDMA device by name, from `/sys/class/infiniband`.
pub(crate) fn probe_rdma_device(name: &str) -> Locality {
    probe_sysfs_device(&Path::new("/sys/class/infiniband").join(name).join("device"))
}

/// The PCI address of an RDMA device, from its sysfs `device` link.
pub(crate) fn rdma_device_pci_addr(name: &str) -> Option<String> {
    let real = std::fs::canonicalize(Path::new("/sys/class/infiniband").join(name).join("device")).ok()?;
    let last = real.file_name()?.to_string_lossy().into_owned();
    normalize_bus_id(&last).filter(|n| *n == last)
}

/// The NUMA node the calling thread runs on now (`getcpu`).
pub(crate) fn current_numa_node() -> Option<u32> {
    let mut cpu: libc::c_uint = 0;
    let mut node: libc::c_uint = 0;
    // SAFETY: getcpu writes two unsigned ints through valid pointers; the
    // third (cache) argument is unused since Linux 2.6.24 and may be null.
    let r = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut libc::c_uint,
            &mut node as *mut libc::c_uint,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    (r == 0).then_some(node)
}

/// Locality of the target, from sysfs.
pub(crate) fn probe_target_sysfs(near: &Near) -> Result<Locality, String> {
    match near {
        Near::CurrentThread => Ok(Locality { numa_node: current_numa_node(), path: Vec::new() }),
        Near::PciBusId(id) => {
            let n = normalize_bus_id(id).ok_or_else(|| format!("{id:?} is not a PCI bus id (dddd:bb:dd.f)"))?;
            let dir = Path::new("/sys/bus/pci/devices").join(&n);
            if !dir.exists() {
                return Err(format!("no PCI device {n} in /sys/bus/pci/devices"));
            }
            Ok(probe_sysfs_device(&dir))
        }
    }
}

/// The firmware NUMA distance (SLIT) from sysfs; 10 for the same node and 20
/// otherwise when sysfs does not say.
pub(crate) fn sysfs_numa_distance(a: u32, b: u32) -> u32 {
    let path = format!("/sys/devices/system/node/node{a}/distance");
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().nth(b as usize).and_then(|d| d.parse().ok()))
        .unwrap_or(if a == b { 10 } else { 20 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(s: &str) -> Vec<String> {
        s.split('/').filter(|c| !c.is_empty()).map(str::to_owned).collect()
    }

    fn loc(numa: Option<u32>, p: &str) -> Locality {
        Locality { numa_node: numa, path: path(p) }
    }

    /// Two sockets, distance 10 local / 21 remote.
    fn slit(a: u32, b: u32) -> u32 {
        if a == b {
            10
        } else {
            21
        }
    }

    fn names(c: &[(String, Locality)], order: Vec<usize>) -> Vec<&str> {
        order.into_iter().map(|i| c[i].0.as_str()).collect()
    }

    #[test]
    fn tree_distances() {
        let gpu = path("pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:00.0");
        let same_switch = path("pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3d:00.0");
        let same_root = path("pci0000:3a/0000:3a:02.0/0000:40:00.0");
        let other_socket = path("pci0000:ae/0000:ae:00.0/0000:af:00.0");
        assert_eq!(tree_distance(&gpu, &same_switch), Some(2));
        assert_eq!(tree_distance(&gpu, &same_root), Some(5));
        assert_eq!(tree_distance(&gpu, &other_socket), Some(7));
        assert_eq!(tree_distance(&gpu, &[]), None);
    }

    #[test]
    fn gpu_prefers_the_hca_behind_its_switch() {
        let c = vec![
            ("mlx5_0".to_owned(), loc(Some(0), "pci0000:3a/0000:3a:02.0/0000:40:00.0")),
            ("mlx5_1".to_owned(), loc(Some(0), "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3d:00.0")),
            ("mlx5_2".to_owned(), loc(Some(1), "pci0000:ae/0000:ae:00.0/0000:af:00.0")),
        ];
        let gpu = loc(Some(0), "pci0000:3a/0000:3a:00.0/0000:3b:00.0/0000:3c:00.0");
        assert_eq!(names(&c, rank(&c, &gpu, &slit)), ["mlx5_1", "mlx5_0", "mlx5_2"]);
    }

    #[test]
    fn thread_prefers_its_numa_node_then_name() {
        let c = vec![
            ("mlx5_10".to_owned(), loc(Some(1), "pci0000:ae/0000:ae:00.0")),
            ("mlx5_3".to_owned(), loc(Some(1), "pci0000:ae/0000:ae:01.0")),
            ("mlx5_0".to_owned(), loc(Some(0), "pci0000:3a/0000:3a:00.0")),
            ("rxe0".to_owned(), loc(None, "")),
        ];
        let thread = Locality { numa_node: Some(1), path: vec![] };
        assert_eq!(names(&c, rank(&c, &thread, &slit)), ["mlx5_3", "mlx5_10", "mlx5_0", "rxe0"]);
        let thread = Locality { numa_node: Some(0), path: vec![] };
        assert_eq!(names(&c, rank(&c, &thread, &slit)), ["mlx5_0", "mlx5_3", "mlx5_10", "rxe0"]);
    }

    #[test]
    fn unknown_target_keeps_name_order() {
        let c = vec![("b".to_owned(), Locality::default()), ("a".to_owned(), Locality::default())];
        assert_eq!(names(&c, rank(&c, &Locality::default(), &slit)), ["a", "b"]);
    }

    #[test]
    fn bus_ids() {
        assert_eq!(normalize_bus_id("00000000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(normalize_bus_id("3b:00.1").as_deref(), Some("0000:3b:00.1"));
        assert_eq!(normalize_bus_id("0001:af:1f.7").as_deref(), Some("0001:af:1f.7"));
        assert_eq!(normalize_bus_id("mlx5_0"), None);
        assert_eq!(normalize_bus_id("0000:3b:20.0"), None);
    }

    #[test]
    fn sysfs_components() {
        let p = Path::new("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0");
        assert_eq!(sysfs_path_components(p), ["pci0000:3a", "0000:3a:00.0", "0000:3b:00.0"]);
    }

    #[test]
    fn probing_this_machine_does_not_fail() {
        // No RDMA here: an unknown device has no locality; the thread's node
        // is known on Linux.
        assert_eq!(probe_rdma_device("no_such_dev0"), Locality::default());
        assert!(current_numa_node().is_some());
        assert!(probe_target_sysfs(&Near::PciBusId("zz".into())).is_err());
        assert!(sysfs_numa_distance(0, 0) >= 10);
    }
}
