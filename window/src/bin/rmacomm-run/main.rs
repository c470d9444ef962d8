//! `rmacomm-run`: start N ranks of a program on this host, torchrun-style.
//!
//! ```text
//! rmacomm-run --nproc-per-node 4 [--] ./my_prog --its-args
//! ```
//!
//! Each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR` and `MASTER_PORT` (a free port, unless `MASTER_ADDR` /
//! `MASTER_PORT` are set already or given as options). Every line a rank
//! prints is prefixed with `[rank] ` on the same stream. When a rank fails the
//! others get SIGTERM, then SIGKILL after the grace period, and rmacomm-run
//! exits with the failed rank's code (128 + signal for a rank killed by a
//! signal). SIGINT and SIGTERM are forwarded to the ranks, SIGHUP and SIGQUIT
//! as SIGTERM. Each rank runs in its own process group, and signals go to the
//! group, so helpers a rank started stop with it (a rank's group also gets
//! SIGTERM when the rank ends). A rank gets SIGKILL if rmacomm-run itself
//! dies (`PR_SET_PDEATHSIG`): killed launchers leave no ranks behind waiting
//! out their timeouts.
//!
//! Organization: `supervisor.rs` decides (sans-IO), this file does the I/O.

#![deny(unsafe_code)]

mod supervisor;

use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use clap::Parser;
use rustix::process::{kill_process_group, Pid, Signal};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use supervisor::{Action, Event, Supervisor};

/// Start N ranks of PROGRAM on this host with torchrun's environment variables.
#[derive(Debug, Parser)]
#[command(name = "rmacomm-run", version, about, long_about = None)]
struct Args {
    /// Ranks to start on this host.
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", value_name = "N")]
    nproc_per_node: usize,
    /// Store host given to the ranks (default: $MASTER_ADDR, else 127.0.0.1).
    #[arg(long = "master-addr", alias = "master_addr")]
    master_addr: Option<String>,
    /// Store port given to the ranks (default: $MASTER_PORT, else a free port).
    #[arg(long = "master-port", alias = "master_port")]
    master_port: Option<u16>,
    /// Seconds between SIGTERM and SIGKILL when stopping the ranks.
    #[arg(long = "grace-period", default_value_t = 5.0, value_name = "SECONDS")]
    grace_period: f64,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM [ARGS]...")]
    command: Vec<String>,
}

fn main() {
    let args = Args::parse();
    if args.nproc_per_node == 0 || args.nproc_per_node > rmacomm_window::MAX_GROUP_SIZE {
        eprintln!("rmacomm-run: --nproc-per-node must be 1..={}", rmacomm_window::MAX_GROUP_SIZE);
        std::process::exit(2);
    }
    if Duration::try_from_secs_f64(args.grace_period).is_err() {
        eprintln!("rmacomm-run: --grace-period must be a non-negative number of seconds (at most 2^64 - 1)");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap_or_else(|e| {
        eprintln!("rmacomm-run: cannot start: {e}");
        std::process::exit(1);
    });
    let code = runtime.block_on(run(args));
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

fn master_port(args: &Args) -> Result<u16, String> {
    if let Some(p) = args.master_port {
        return if p == 0 {
            Err("--master-port 0: give a port number (1-65535), or none for a free one".into())
        } else {
            Ok(p)
        };
    }
    if let Ok(p) = std::env::var("MASTER_PORT") {
        return match p.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(format!("MASTER_PORT='{p}' is not a port number (1-65535)")),
            Ok(p) => Ok(p),
        };
    }
    // A port that binds now, below Linux's ephemeral range (32768-60999):
    // an ephemeral port, once let go here, may be handed to another
    // process's outgoing connection before rank 0 binds it again.
    for _ in 0..200 {
        let port = rand::Rng::gen_range(&mut rand::thread_rng(), 20000..32768u16);
        if TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok() {
            return Ok(port);
        }
    }
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("cannot find a free port: {e}"))?;
    l.local_addr().map(|a| a.port()).map_err(|e| e.to_string())
}

fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    }
}

async fn run(args: Args) -> i32 {
    let n = args.nproc_per_node;
    let addr = args.master_addr.clone().or_else(|| std::env::var("MASTER_ADDR").ok()).unwrap_or("127.0.0.1".into());
    let port = match master_port(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("rmacomm-run: {e}");
            return 2;
        }
    };
    // Before the ranks start: a signal while they start is forwarded too.
    let mut signals = Vec::new();
    for (kind, sig) in [
        (SignalKind::interrupt(), 2),
        (SignalKind::terminate(), 15),
        (SignalKind::hangup(), 1),
        (SignalKind::quit(), 3),
    ] {
        match signal(kind) {
            Ok(s) => signals.push((s, sig)),
            Err(e) => {
                eprintln!("rmacomm-run: cannot install signal handlers: {e}");
                return 1;
            }
        }
    }
    let (events, mut rx) = mpsc::unbounded_channel::<Event>();
    let mut pids: Vec<Option<u32>> = vec![None; n];
    let mut printers = Vec::new();
    let mut supervisor = Supervisor::new(n);
    let mut spawn_failed = None;
    for (rank, pid) in pids.iter_mut().enumerate() {
        let mut cmd = Command::new(&args.command[0]);
        cmd.args(&args.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string())
            // Inherited, these would move the ranks' store off the port
            // given to them (rmacomm's own port; torchrun's agent store).
            .env_remove("RMACOMM_MASTER_PORT")
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so that stopping a rank stops what it started too.
            .process_group(0)
            .kill_on_drop(true);
        let launcher = rustix::process::getpid();
        #[allow(unsafe_code)]
        // SAFETY: the closure runs in the child between fork and exec and
        // makes only async-signal-safe system calls (prctl, getppid, _exit);
        // it allocates nothing and takes no lock.
        unsafe {
            cmd.pre_exec(move || {
                // The rank dies with the launcher, even one killed by SIGKILL
                // (nothing else could stop it then).
                rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
                // The launcher died before that took effect.
                if rustix::process::getppid() != Some(launcher) {
                    return Err(rustix::io::Errno::SRCH.into());
                }
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("rmacomm-run: cannot start '{}' for rank {rank}: {e}", args.command[0]);
                spawn_failed = Some(rank);
                break;
            }
        };
        *pid = child.id();
        if let Some(out) = child.stdout.take() {
            printers.push(tokio::spawn(prefix_lines(rank, out, false)));
        }
        if let Some(err) = child.stderr.take() {
            printers.push(tokio::spawn(prefix_lines(rank, err, true)));
        }
        let events = events.clone();
        let leader = child.id();
        tokio::spawn(async move {
            let code = match child.wait().await {
                Ok(status) => exit_code(status),
                Err(_) => 1,
            };
            // What the rank started and left running stops with it.
            send(leader, supervisor::SIGTERM);
            let _ = events.send(Event::Exited { rank, code });
        });
    }
    // Ranks that could not start count as failed with 127 ("command not found"),
    // which stops the ones that did start.
    let mut pending = Vec::new();
    if let Some(failed) = spawn_failed {
        for rank in failed..n {
            pending.extend(supervisor.handle(Event::Exited { rank, code: 127 }));
        }
    }

    let grace = Duration::from_secs_f64(args.grace_period);
    let mut grace_timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    loop {
        let actions = if pending.is_empty() {
            let event = tokio::select! {
            e = rx.recv() => match e { Some(e) => e, None => break 1 },
            sig = next_signal(&mut signals) => Event::Signal(sig),
            _ = async { grace_timer.as_mut().expect("guarded").await }, if grace_timer.is_some() => {
                grace_timer = None;
                Event::GraceExpired
            }
            };
            supervisor.handle(event)
        } else {
            std::mem::take(&mut pending)
        };
        let mut exit = None;
        for action in actions {
            match action {
                Action::Kill { ranks, signal } => ranks.iter().for_each(|&r| send(pids[r], signal)),
                Action::StartGrace => {
                    if grace_timer.is_none() {
                        grace_timer = Some(Box::pin(tokio::time::sleep(grace)));
                    }
                }
                Action::Exit(code) => exit = Some(code),
            }
        }
        if let Some(code) = exit {
            // Let the printers drain what the ranks wrote last (bounded: a
            // grandchild may hold a pipe open).
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                for p in printers.drain(..) {
                    let _ = p.await;
                }
            })
            .await;
            if let Some(sig) = supervisor.interrupted() {
                eprintln!("rmacomm-run: stopped by signal {sig}, forwarded to the ranks");
            } else if let Some((rank, code)) = supervisor.failure() {
                eprintln!("rmacomm-run: rank {rank} failed with exit code {code}; stopped the other ranks");
            }
            break code;
        }
    }
}

/// The next signal received, of those handled.
async fn next_signal(signals: &mut [(tokio::signal::unix::Signal, supervisor::Sig)]) -> supervisor::Sig {
    let waits = signals.iter_mut().map(|(s, sig)| Box::pin(async move { s.recv().await.map(|_| *sig) }));
    match futures::future::select_all(waits).await.0 {
        Some(sig) => sig,
        // A handler gone (never, while the runtime lives): wait for the others.
        None => std::future::pending().await,
    }
}

fn send(pid: Option<u32>, sig: supervisor::Sig) {
    let Some(pid) = pid.and_then(|p| Pid::from_raw(p as i32)) else { return };
    let signal = match sig {
        2 => Signal::INT,
        9 => Signal::KILL,
        _ => Signal::TERM,
    };
    // The rank leads its process group (its pgid is its pid). ESRCH (already
    // gone) is expected in races with the exit.
    let _ = kill_process_group(pid, signal);
}

/// Copies a rank's stream line by line to ours, each line prefixed with `[rank] `.
async fn prefix_lines(rank: usize, stream: impl AsyncRead + Unpin, stderr: bool) {
    let mut reader = BufReader::new(stream);
    let prefix = format!("[{rank}] ");
    let mut line = Vec::new();
    let mut out = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.last() != Some(&b'\n') {
            line.push(b'\n');
        }
        out.clear();
        out.extend_from_slice(prefix.as_bytes());
        out.extend_from_slice(&line);
        // One write per line under the stream's lock: lines of different ranks never interleave.
        let _ = if stderr {
            std::io::stderr().lock().write_all(&out)
        } else {
            let mut o = std::io::stdout().lock();
            o.write_all(&out).and_then(|()| o.flush())
        };
    }
}
