//! Launcher detection from fake environments (no process environment touched).

use std::collections::HashMap;
use std::time::Duration;

use rmacomm_window::{first_host, timeout_from, Error, LaunchEnv, Launcher};

fn detect(vars: &[(&str, &str)]) -> Result<LaunchEnv, Error> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    LaunchEnv::detect(&|k| map.get(k).cloned())
}

/// The error must be about `var`.
fn assert_names(r: Result<LaunchEnv, Error>, var: &str) {
    match r {
        Err(Error::Env { var: v, problem }) => assert_eq!(v, var, "problem: {problem}"),
        other => panic!("expected an error naming {var}, got {other:?}"),
    }
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "3"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "2"),
    ("MASTER_ADDR", "node01"),
    ("MASTER_PORT", "29500"),
];

fn with(
    base: &[(&'static str, &'static str)],
    changes: &[(&'static str, Option<&'static str>)],
) -> Vec<(&'static str, &'static str)> {
    let mut v: Vec<_> = base.iter().copied().filter(|(k, _)| !changes.iter().any(|(c, _)| c == k)).collect();
    v.extend(changes.iter().filter_map(|(k, val)| val.map(|val| (*k, val))));
    v
}

#[test]
fn torchrun_variables() {
    let env = detect(TORCHRUN).unwrap();
    assert_eq!(env.launcher, Launcher::Torchrun);
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (3, 8, Some(1), Some(2)));
    assert_eq!((env.master_addr.as_str(), env.master_port), ("node01", 29500));
    // LOCAL_* are optional (variables set by hand).
    let env = detect(&with(TORCHRUN, &[("LOCAL_RANK", None), ("LOCAL_WORLD_SIZE", None)])).unwrap();
    assert_eq!((env.local_rank, env.local_world_size), (None, None));
}

#[test]
fn torchrun_missing_and_contradictory_variables_are_named() {
    assert_names(detect(&with(TORCHRUN, &[("RANK", None)])), "RANK");
    assert_names(detect(&with(TORCHRUN, &[("WORLD_SIZE", None)])), "WORLD_SIZE");
    assert_names(detect(&with(TORCHRUN, &[("MASTER_ADDR", None)])), "MASTER_ADDR");
    assert_names(detect(&with(TORCHRUN, &[("MASTER_ADDR", Some(" "))])), "MASTER_ADDR");
    assert_names(detect(&with(TORCHRUN, &[("MASTER_PORT", None)])), "MASTER_PORT");
    assert_names(detect(&with(TORCHRUN, &[("MASTER_PORT", Some("70000"))])), "MASTER_PORT");
    assert_names(detect(&with(TORCHRUN, &[("MASTER_PORT", Some("0"))])), "MASTER_PORT");
    assert_names(detect(&with(TORCHRUN, &[("RANK", Some("8"))])), "RANK");
    assert_names(detect(&with(TORCHRUN, &[("RANK", Some("three"))])), "RANK");
    assert_names(detect(&with(TORCHRUN, &[("RANK", Some("-1"))])), "RANK");
    assert_names(detect(&with(TORCHRUN, &[("WORLD_SIZE", Some("0")), ("RANK", Some("0"))])), "WORLD_SIZE");
    assert_names(detect(&with(TORCHRUN, &[("WORLD_SIZE", Some("1000000000000"))])), "WORLD_SIZE");
    assert_names(detect(&with(TORCHRUN, &[("WORLD_SIZE", Some("65537"))])), "WORLD_SIZE");
    assert_names(detect(&with(TORCHRUN, &[("LOCAL_RANK", Some("2"))])), "LOCAL_RANK");
    assert_names(detect(&with(TORCHRUN, &[("LOCAL_WORLD_SIZE", Some("9"))])), "LOCAL_WORLD_SIZE");
    assert_names(detect(&with(TORCHRUN, &[("LOCAL_WORLD_SIZE", Some("x"))])), "LOCAL_WORLD_SIZE");
    let msg = detect(&with(TORCHRUN, &[("RANK", Some("8"))])).unwrap_err().to_string();
    assert!(msg.contains("RANK") && msg.contains("WORLD_SIZE=8"), "{msg}");
}

const OMPI: &[(&str, &str)] = &[
    ("OMPI_COMM_WORLD_RANK", "5"),
    ("OMPI_COMM_WORLD_SIZE", "6"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
    ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "1234"),
];

#[test]
fn open_mpi_variables() {
    let env = detect(OMPI).unwrap();
    assert_eq!(env.launcher, Launcher::OpenMpi);
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (5, 6, Some(2), Some(3)));
    assert_eq!((env.master_addr.as_str(), env.master_port), ("10.0.0.1", 1234));
    // Inside a Slurm allocation mpirun's ranks inherit SLURM_*: Open MPI still wins.
    let mut inside = OMPI.to_vec();
    inside.extend([("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]);
    assert_eq!(detect(&inside).unwrap().launcher, Launcher::OpenMpi);
}

#[test]
fn open_mpi_needs_the_store_address_and_consistent_numbers() {
    let e = detect(&with(OMPI, &[("MASTER_ADDR", None)])).unwrap_err();
    assert!(e.to_string().contains("-x MASTER_ADDR"), "{e}");
    assert_names(Err(e), "MASTER_ADDR");
    assert_names(detect(&with(OMPI, &[("MASTER_PORT", None)])), "MASTER_PORT");
    assert_names(detect(&with(OMPI, &[("OMPI_COMM_WORLD_SIZE", None)])), "OMPI_COMM_WORLD_SIZE");
    assert_names(detect(&with(OMPI, &[("OMPI_COMM_WORLD_RANK", Some("6"))])), "OMPI_COMM_WORLD_RANK");
    assert_names(detect(&with(OMPI, &[("OMPI_COMM_WORLD_LOCAL_RANK", Some("3"))])), "OMPI_COMM_WORLD_LOCAL_RANK");
}

const SLURM: &[(&str, &str)] = &[
    ("SLURM_PROCID", "4"),
    ("SLURM_NTASKS", "7"),
    ("SLURM_LOCALID", "1"),
    ("SLURM_NODEID", "2"),
    ("SLURM_TASKS_PER_NODE", "2(x3),1"),
    ("SLURM_JOB_NODELIST", "node[01-04,07],other"),
    ("SLURM_JOB_ID", "123456"),
    ("SLURM_STEP_ID", "0"),
];

#[test]
fn slurm_variables_and_the_first_host_of_the_node_list() {
    let env = detect(SLURM).unwrap();
    assert_eq!(env.launcher, Launcher::Slurm);
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (4, 7, Some(1), Some(2)));
    assert_eq!(env.master_addr, "node01");
    assert!((15000..30000).contains(&env.master_port));
    // Every task derives the same port; another step gets another one.
    assert_eq!(detect(&with(SLURM, &[("SLURM_PROCID", Some("0"))])).unwrap().master_port, env.master_port);
    assert_ne!(detect(&with(SLURM, &[("SLURM_STEP_ID", Some("1"))])).unwrap().master_port, env.master_port);
    // MASTER_ADDR / MASTER_PORT win; the step's node list wins over the job's.
    let env = detect(&with(SLURM, &[("MASTER_ADDR", Some("head")), ("MASTER_PORT", Some("4242"))])).unwrap();
    assert_eq!((env.master_addr.as_str(), env.master_port), ("head", 4242));
    let env = detect(&with(SLURM, &[("SLURM_STEP_NODELIST", Some("gpu[3-4]"))])).unwrap();
    assert_eq!(env.master_addr, "gpu3");
    // The last node holds one task.
    let env = detect(&with(SLURM, &[("SLURM_NODEID", Some("3")), ("SLURM_LOCALID", Some("0"))])).unwrap();
    assert_eq!(env.local_world_size, Some(1));
}

#[test]
fn slurm_errors_name_the_variable() {
    assert_names(detect(&with(SLURM, &[("SLURM_NTASKS", None)])), "SLURM_NTASKS");
    assert_names(detect(&with(SLURM, &[("SLURM_PROCID", Some("7"))])), "SLURM_PROCID");
    assert_names(detect(&with(SLURM, &[("SLURM_PROCID", Some("x"))])), "SLURM_PROCID");
    assert_names(detect(&with(SLURM, &[("SLURM_JOB_NODELIST", None)])), "MASTER_ADDR");
    assert_names(detect(&with(SLURM, &[("SLURM_JOB_NODELIST", Some("node[01-"))])), "SLURM_JOB_NODELIST");
    assert_names(detect(&with(SLURM, &[("SLURM_JOB_ID", None)])), "MASTER_PORT");
    assert_names(detect(&with(SLURM, &[("SLURM_NODEID", Some("9"))])), "SLURM_NODEID");
    assert_names(detect(&with(SLURM, &[("SLURM_LOCALID", Some("2"))])), "SLURM_LOCALID");
    // SLURM_NPROCS is the old name of SLURM_NTASKS.
    let env = detect(&with(SLURM, &[("SLURM_NTASKS", None), ("SLURM_NPROCS", Some("7"))])).unwrap();
    assert_eq!(env.world_size, 7);
}

#[test]
fn torchrun_inside_slurm_is_torchrun() {
    let mut vars = SLURM.to_vec();
    vars.extend(TORCHRUN);
    assert_eq!(detect(&vars).unwrap().launcher, Launcher::Torchrun);
}

#[test]
fn no_launcher_is_a_clear_error() {
    let e = detect(&[("HOME", "/root")]).unwrap_err();
    assert_eq!(e, Error::NoLaunchEnv);
    assert!(e.to_string().contains("rmacomm-run"));
}

#[test]
fn node_lists() {
    for (list, first) in [
        ("node[01-04,07],other", "node01"),
        ("other,node[01-04]", "other"),
        ("n7", "n7"),
        ("rack[2-3]-gpu[009-010]", "rack2-gpu009"),
    ] {
        assert_eq!(first_host("SLURM_JOB_NODELIST", list).unwrap(), first);
    }
    for bad in ["", "node[", "node]", "node[x]"] {
        assert!(first_host("SLURM_JOB_NODELIST", bad).is_err(), "{bad}");
    }
}

#[test]
fn timeout_variable() {
    let none = |_: &str| None;
    assert_eq!(timeout_from(&none).unwrap(), Duration::from_secs(600));
    let t = |v: &'static str| move |k: &str| (k == "RMACOMM_TIMEOUT_SECONDS").then(|| v.to_string());
    assert_eq!(timeout_from(&t("30")).unwrap(), Duration::from_secs(30));
    assert_eq!(timeout_from(&t("0.5")).unwrap(), Duration::from_millis(500));
    for bad in ["0", "-1", "soon", "inf", "NaN"] {
        match timeout_from(&t(bad)) {
            Err(Error::Env { var, .. }) => assert_eq!(var, "RMACOMM_TIMEOUT_SECONDS"),
            other => panic!("{bad}: {other:?}"),
        }
    }
}

/// Under torchrun's default rendezvous its agent serves torch's own store
/// on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): rmacomm's store
/// takes the next port (rank 0 could not bind MASTER_PORT: EADDRINUSE).
/// RMACOMM_MASTER_PORT, with any launcher, names the port outright.
#[test]
fn torchruns_agent_store_leaves_rmacomm_the_next_port() {
    let agent = with(TORCHRUN, &[("TORCHELASTIC_USE_AGENT_STORE", Some("True"))]);
    assert_eq!(detect(&agent).unwrap().master_port, 29501);
    let no_agent = with(TORCHRUN, &[("TORCHELASTIC_USE_AGENT_STORE", Some("False"))]);
    assert_eq!(detect(&no_agent).unwrap().master_port, 29500);
    let own = with(&agent, &[("RMACOMM_MASTER_PORT", Some("31000"))]);
    assert_eq!(detect(&own).unwrap().master_port, 31000);
    let top = with(&agent, &[("MASTER_PORT", Some("65535"))]);
    assert_names(detect(&top), "RMACOMM_MASTER_PORT");
    assert_names(detect(&with(TORCHRUN, &[("RMACOMM_MASTER_PORT", Some("x"))])), "RMACOMM_MASTER_PORT");
    // Without MASTER_PORT, RMACOMM_MASTER_PORT alone serves.
    let only_own = with(TORCHRUN, &[("MASTER_PORT", None), ("RMACOMM_MASTER_PORT", Some("31000"))]);
    assert_eq!(detect(&only_own).unwrap().master_port, 31000);
}
