//! The `hwloc` feature: localities from hwloc's topology tree instead of
//! sysfs paths.
//!
//! hwloc knows the PCI bridges, packages, NUMA nodes and caches between a
//! thread's CPU and a device, so tree distance (see `topology.rs`) is hops
//! through those objects. A thread's place is the PU it last ran on.

use hwlocality::cpu::binding::CpuBindingFlags;
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::TypeFilter;
use hwlocality::Topology;

use super::topology::{normalize_bus_id, Locality, Near};

/// A topology with the important I/O objects (PCI devices and bridges).
pub(crate) fn topology() -> Result<Topology, String> {
    Topology::builder()
        .with_io_type_filter(TypeFilter::KeepImportant)
        .map_err(|e| format!("hwloc: {e}"))?
        .build()
        .map_err(|e| format!("hwloc: {e}"))
}

fn locality_of(obj: &TopologyObject) -> Locality {
    let mut path: Vec<String> = obj.ancestors().map(|a| a.global_persistent_index().to_string()).collect();
    path.reverse();
    path.push(obj.global_persistent_index().to_string());
    let numa_node = obj
        .first_non_io_ancestor()
        .or(Some(obj))
        .and_then(|a| a.nodeset())
        .and_then(|ns| ns.first_set())
        .and_then(|i| u32::try_from(usize::from(i)).ok());
    Locality { numa_node, path }
}

/// Locality of a PCI device by bus id, or `None` when hwloc does not list it.
pub(crate) fn pci_locality(topo: &Topology, bus_id: &str) -> Option<Locality> {
    let id = normalize_bus_id(bus_id)?;
    let obj = topo.pci_device_by_bus_id_string(&id).ok()??;
    Some(locality_of(obj))
}

/// Locality of the target.
pub(crate) fn target_locality(topo: &Topology, near: &Near) -> Result<Locality, String> {
    match near {
        Near::CurrentThread => {
            let cpus = topo.last_cpu_location(CpuBindingFlags::THREAD).map_err(|e| format!("hwloc: {e}"))?;
            let pu = topo.pus_from_cpuset(&cpus).next().ok_or("hwloc: the thread's CPU is not in the topology")?;
            Ok(locality_of(pu))
        }
        Near::PciBusId(id) => pci_locality(topo, id).ok_or_else(|| format!("hwloc lists no PCI device {id}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_thread_has_a_locality() {
        let topo = topology().expect("hwloc topology");
        let l = target_locality(&topo, &Near::CurrentThread).expect("thread locality");
        assert!(!l.path.is_empty());
        assert!(pci_locality(&topo, "00ff:ff:1f.7").is_none());
    }
}
