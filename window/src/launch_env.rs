//! Launcher detection, sans-IO: reads torchrun's, Open MPI's or Slurm's
//! variables through a lookup function, so tests never touch the process
//! environment.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::nodelist::first_host;

/// Timeout used when neither code nor `RMACOMM_TIMEOUT_SECONDS` sets one.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The launcher that started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// torchrun, rmacomm-run, `python -m rmacomm.run`, or variables set by hand (`RANK`, `WORLD_SIZE`, ...).
    Torchrun,
    /// Open MPI's mpirun (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// Slurm's srun (`SLURM_PROCID`, ...).
    Slurm,
}

/// What the launcher says about this process and where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchEnv {
    /// Which launcher.
    pub launcher: Launcher,
    /// This process's rank in the job.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// Rank among the processes the launcher started on this node, if it says.
    pub local_rank: Option<usize>,
    /// Processes the launcher started on this node, if it says.
    pub local_world_size: Option<usize>,
    /// Host of the store (rank 0's host).
    pub master_addr: String,
    /// Port of rmacomm's store: `RMACOMM_MASTER_PORT` when set, else
    /// `MASTER_PORT` (the port after it under torchrun when its agent
    /// serves torch's store there: `TORCHELASTIC_USE_AGENT_STORE=True`).
    pub master_port: u16,
}

type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

impl LaunchEnv {
    /// Detects the launcher from the process environment.
    pub fn from_process_env() -> Result<Self> {
        Self::detect(&|k| std::env::var(k).ok())
    }

    /// Detects the launcher from `lookup` (a variable's value, or `None`).
    ///
    /// Checked in this order, so that a torchrun started inside a Slurm
    /// allocation, or an mpirun whose environment inherited `SLURM_*`, is taken
    /// for what started this process:
    /// 1. `RANK` or `WORLD_SIZE` set: torchrun's variables (`LOCAL_RANK` and
    ///    `LOCAL_WORLD_SIZE` optional; `MASTER_ADDR`, `MASTER_PORT` required).
    ///    Where torchrun's agent serves torch's own store on `MASTER_PORT`
    ///    (`TORCHELASTIC_USE_AGENT_STORE=True`, its default rendezvous),
    ///    rmacomm's store takes the next port.
    ///
    /// With any launcher, `RMACOMM_MASTER_PORT` (when set) is the port of
    /// rmacomm's store, whatever `MASTER_PORT` says.
    /// 2. `OMPI_COMM_WORLD_RANK`: Open MPI (`OMPI_COMM_WORLD_SIZE`,
    ///    `..._LOCAL_RANK`, `..._LOCAL_SIZE`); mpirun has no notion of a store,
    ///    so pass `-x MASTER_ADDR -x MASTER_PORT`.
    /// 3. `SLURM_PROCID`: Slurm (`SLURM_NTASKS`, `SLURM_LOCALID`; the local size
    ///    from `SLURM_TASKS_PER_NODE` and `SLURM_NODEID`). The store is at
    ///    `MASTER_ADDR`, else the first host of `SLURM_STEP_NODELIST` /
    ///    `SLURM_JOB_NODELIST` (where srun puts task 0); the port is
    ///    `MASTER_PORT`, else one derived from `SLURM_JOB_ID` and
    ///    `SLURM_STEP_ID` (15000-29999), the same on every task.
    pub fn detect(lookup: Lookup<'_>) -> Result<Self> {
        if lookup("RANK").is_some() || lookup("WORLD_SIZE").is_some() {
            let rank = required(lookup, "RANK")?;
            let world_size = required(lookup, "WORLD_SIZE")?;
            let (local_rank, local_world_size) =
                (optional(lookup, "LOCAL_RANK")?, optional(lookup, "LOCAL_WORLD_SIZE")?);
            let env = LaunchEnv {
                launcher: Launcher::Torchrun,
                rank,
                world_size,
                local_rank,
                local_world_size,
                master_addr: master_addr(lookup, "set MASTER_ADDR to rank 0's host")?,
                master_port: master_port(lookup)?
                    .ok_or_else(|| Error::env("MASTER_PORT", "not set; set it to a free port on rank 0's host"))?,
            };
            return env.validated(["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]);
        }
        if lookup("OMPI_COMM_WORLD_RANK").is_some() {
            const HINT: &str = "mpirun does not set it: pass -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<free port>";
            let env = LaunchEnv {
                launcher: Launcher::OpenMpi,
                rank: required(lookup, "OMPI_COMM_WORLD_RANK")?,
                world_size: required(lookup, "OMPI_COMM_WORLD_SIZE")?,
                local_rank: optional(lookup, "OMPI_COMM_WORLD_LOCAL_RANK")?,
                local_world_size: optional(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE")?,
                master_addr: master_addr(lookup, HINT)?,
                master_port: master_port(lookup)?
                    .ok_or_else(|| Error::env("MASTER_PORT", format!("not set; {HINT}")))?,
            };
            return env.validated([
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ]);
        }
        if lookup("SLURM_PROCID").is_some() {
            let master_addr = match lookup("MASTER_ADDR").filter(|s| !s.trim().is_empty()) {
                Some(a) => a.trim().to_string(),
                None => {
                    let var = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                        .into_iter()
                        .find(|v| lookup(v).is_some())
                        .ok_or_else(|| {
                            Error::env(
                                "MASTER_ADDR",
                                "not set, and no SLURM_JOB_NODELIST to take the first host from; export MASTER_ADDR",
                            )
                        })?;
                    first_host(var, &lookup(var).unwrap_or_default())?
                }
            };
            let master_port = match master_port(lookup)? {
                Some(p) => p,
                None => {
                    let job: u64 = required(lookup, "SLURM_JOB_ID").map_err(|_| {
                        Error::env(
                            "MASTER_PORT",
                            "not set, and no numeric SLURM_JOB_ID to derive one from; export MASTER_PORT",
                        )
                    })?;
                    let step: u64 = optional(lookup, "SLURM_STEP_ID")?.unwrap_or(0);
                    15000 + (job.wrapping_mul(31).wrapping_add(step) % 15000) as u16
                }
            };
            let local_world_size = match (lookup("SLURM_TASKS_PER_NODE"), optional::<usize>(lookup, "SLURM_NODEID")?) {
                (Some(list), Some(node)) => Some(tasks_on_node(&list, node)?),
                _ => None,
            };
            let env = LaunchEnv {
                launcher: Launcher::Slurm,
                rank: required(lookup, "SLURM_PROCID")?,
                world_size: match optional(lookup, "SLURM_NTASKS")? {
                    Some(n) => n,
                    None => required(lookup, "SLURM_NPROCS")
                        .map_err(|_| Error::env("SLURM_NTASKS", "not set; run the program with srun"))?,
                },
                local_rank: optional(lookup, "SLURM_LOCALID")?,
                local_world_size,
                master_addr,
                master_port,
            };
            return env.validated(["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"]);
        }
        Err(Error::NoLaunchEnv)
    }

    /// Checks that the numbers agree; `names` are this launcher's variables for rank, size, local rank, local size.
    fn validated(self, names: [&str; 4]) -> Result<Self> {
        let [rank, size, local_rank, local_size] = names;
        if self.world_size == 0 {
            return Err(Error::env(size, "is 0; a job has at least one process"));
        }
        if self.world_size > crate::MAX_GROUP_SIZE {
            return Err(Error::env(
                size,
                format!("is {}, above the largest group, {} ranks", self.world_size, crate::MAX_GROUP_SIZE),
            ));
        }
        if self.rank >= self.world_size {
            return Err(Error::env(rank, format!("is {}, not below {size}={}", self.rank, self.world_size)));
        }
        if let Some(ls) = self.local_world_size {
            if ls == 0 || ls > self.world_size {
                return Err(Error::env(local_size, format!("is {ls}, must be 1..={size}={}", self.world_size)));
            }
            if let Some(lr) = self.local_rank {
                if lr >= ls {
                    return Err(Error::env(local_rank, format!("is {lr}, not below {local_size}={ls}")));
                }
            }
        }
        if let Some(lr) = self.local_rank {
            if lr >= self.world_size {
                return Err(Error::env(local_rank, format!("is {lr}, not below {size}={}", self.world_size)));
            }
        }
        Ok(self)
    }
}

fn parse<T: std::str::FromStr>(var: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| Error::env(var, format!("'{value}' is not a non-negative integer")))
}

fn required<T: std::str::FromStr>(lookup: Lookup<'_>, var: &str) -> Result<T> {
    let v = lookup(var).ok_or_else(|| Error::env(var, "not set; the launcher should set it (or set it by hand)"))?;
    parse(var, &v)
}

fn optional<T: std::str::FromStr>(lookup: Lookup<'_>, var: &str) -> Result<Option<T>> {
    lookup(var).map(|v| parse(var, &v)).transpose()
}

fn master_addr(lookup: Lookup<'_>, hint: &str) -> Result<String> {
    match lookup("MASTER_ADDR") {
        Some(a) if !a.trim().is_empty() => Ok(a.trim().to_string()),
        Some(_) => Err(Error::env("MASTER_ADDR", format!("is empty; {hint}"))),
        None => Err(Error::env("MASTER_ADDR", format!("not set; {hint}"))),
    }
}

/// The store's port: `RMACOMM_MASTER_PORT` when set (a port of rmacomm's
/// own), else `MASTER_PORT` — or the port after it where torchrun's agent
/// already serves torch's own TCPStore on `MASTER_PORT`
/// (`TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's static rendezvous, and
/// its c10d one since torch 2.4), which rank 0 could not bind and which
/// speaks another protocol.
fn master_port(lookup: Lookup<'_>) -> Result<Option<u16>> {
    if let Some(p) = port_var(lookup, "RMACOMM_MASTER_PORT")? {
        return Ok(Some(p));
    }
    let Some(p) = port_var(lookup, "MASTER_PORT")? else { return Ok(None) };
    let agent_store = lookup("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    if !agent_store {
        return Ok(Some(p));
    }
    p.checked_add(1).map(Some).ok_or_else(|| {
        Error::env(
            "RMACOMM_MASTER_PORT",
            "not set, and torchrun's agent serves its store on MASTER_PORT=65535 (rmacomm's takes the next port); \
             set RMACOMM_MASTER_PORT to a free port on rank 0's host",
        )
    })
}

fn port_var(lookup: Lookup<'_>, var: &str) -> Result<Option<u16>> {
    let Some(v) = lookup(var) else { return Ok(None) };
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(Some(p)),
        _ => Err(Error::env(var, format!("'{v}' is not a port number (1-65535)"))),
    }
}

/// Tasks on node `node` from Slurm's `SLURM_TASKS_PER_NODE` (`2(x3),1`: three nodes with 2, one with 1).
fn tasks_on_node(list: &str, node: usize) -> Result<usize> {
    let bad = || Error::env("SLURM_TASKS_PER_NODE", format!("cannot read '{list}' (expected a form like 2(x3),1)"));
    let mut first = 0usize;
    for item in list.split(',') {
        let item = item.trim();
        let (count, repeat) = match item.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(bad)?),
            None => (item, "1"),
        };
        let count: usize = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        if node < first.saturating_add(repeat) {
            return Ok(count);
        }
        first = first.saturating_add(repeat);
    }
    Err(Error::env("SLURM_NODEID", format!("is {node}, but SLURM_TASKS_PER_NODE='{list}' lists only {first} nodes")))
}

/// The default timeout from `RMACOMM_TIMEOUT_SECONDS` in `lookup` (seconds,
/// fractions allowed), else [`DEFAULT_TIMEOUT`].
pub fn timeout_from(lookup: Lookup<'_>) -> Result<Duration> {
    match lookup("RMACOMM_TIMEOUT_SECONDS") {
        None => Ok(DEFAULT_TIMEOUT),
        Some(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| Error::env("RMACOMM_TIMEOUT_SECONDS", format!("'{v}' is not a positive number of seconds"))),
    }
}

/// [`timeout_from`] the process environment.
pub fn default_timeout() -> Result<Duration> {
    timeout_from(&|k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::tasks_on_node;

    #[test]
    fn tasks_per_node() {
        assert_eq!(tasks_on_node("2(x3),1", 0).unwrap(), 2);
        assert_eq!(tasks_on_node("2(x3),1", 2).unwrap(), 2);
        assert_eq!(tasks_on_node("2(x3),1", 3).unwrap(), 1);
        assert!(tasks_on_node("2(x3),1", 4).unwrap_err().to_string().contains("SLURM_NODEID"));
        assert!(tasks_on_node("2(x3", 0).is_err());
        assert!(tasks_on_node("four", 0).is_err());
    }
}
