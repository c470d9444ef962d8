//! Soft-provider settings, from code or from the environment.

use std::net::IpAddr;
use std::time::Duration;

/// Which link a soft QP uses to reach its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SoftLink {
    /// Shared memory when the peer is on the same host (same boot id, IPC
    /// and network namespace), TCP otherwise.
    #[default]
    Auto,
    /// Shared memory only; connecting to another host fails.
    Shm,
    /// TCP always, also on the same host.
    Tcp,
}

impl SoftLink {
    /// Parses `auto`, `shm` or `tcp`.
    pub fn parse(s: &str) -> Option<SoftLink> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(SoftLink::Auto),
            "shm" => Some(SoftLink::Shm),
            "tcp" => Some(SoftLink::Tcp),
            _ => None,
        }
    }
}

/// Settings of a soft context.
#[derive(Debug, Clone, PartialEq)]
pub struct SoftConfig {
    /// Link choice (`RMACOMM_SOFT_LINK`).
    pub link: SoftLink,
    /// Address the TCP listener binds to and advertises
    /// (`RMACOMM_SOFT_ADDR`); `None` binds all and advertises every IPv4
    /// address that is up.
    pub bind_addr: Option<IpAddr>,
    /// Interfaces whose addresses the TCP listener binds (one listener per
    /// address) and advertises, in `NCCL_SOCKET_IFNAME` syntax (`eth0,ib`,
    /// `=eth0`, `^docker,lo`): `RMACOMM_SOCKET_IFNAME`. `bind_addr` wins
    /// when both are set.
    pub socket_ifname: Option<String>,
    /// Largest message; longer WRs fail at post time and longer frames are
    /// rejected as malformed.
    pub max_msg_size: u32,
    /// Deterministic delivery chaos for tests (`RMACOMM_SOFT_CHAOS=SEED`):
    /// each requester stalls for a seeded pseudo-random 0..=`chaos_max_delay`
    /// before each operation, so that traffic on several QPs interleaves
    /// differently, reproducibly per seed.
    pub chaos_seed: Option<u64>,
    /// Upper bound of a chaos stall.
    pub chaos_max_delay: Duration,
    /// Same-host RDMA WRITE/READ/atomics up to this many bytes, posted
    /// while the send queue is empty, are copied by the posting thread
    /// itself (no hand-off to the progress thread). 0 disables it.
    /// `RMACOMM_SOFT_INLINE_COPY_MAX`.
    pub inline_copy_max: usize,
    /// After any activity, the progress thread keeps polling (without
    /// sleeping) for this long before it blocks in epoll again: lower
    /// latency for a core's worth of CPU while busy. Zero (the default)
    /// never spins. `RMACOMM_SOFT_BUSY_POLL_US`.
    pub busy_poll: Duration,
    /// Same-host WRITE_WITH_IMM notifications on an idle QP go through a
    /// shared-memory doorbell that the peer's CQ poll picks up, instead of
    /// through both progress threads (see `soft/doorbell.rs`). On by
    /// default; `RMACOMM_SOFT_DOORBELL=0` turns it off.
    pub doorbell: bool,
    /// Over tcp, a thread busy-polling a CQ receives what waits on its QPs'
    /// connections itself (small WRITEs, notifies, ACKs), instead of
    /// waiting for the progress thread's wake-up (see `soft/polled_rx.rs`).
    /// On by default; `RMACOMM_SOFT_POLLED_RX=0` turns it off.
    pub polled_rx: bool,
    /// How long the posting thread waits for socket room to finish a
    /// frame it began writing before it declares the peer dead (a peer
    /// that stops reading in the middle of a frame). 30 s by default;
    /// `RMACOMM_SOFT_PARTIAL_FRAME_MS`.
    pub partial_frame_limit: Duration,
    /// Threads of the context's progress engine (`RMACOMM_SOFT_PROGRESS_THREADS`,
    /// 1 by default). With one, every QP of the context is driven by one
    /// thread, which bounds a context's tcp bandwidth at what one core copies
    /// through the kernel; with more, the QPs' connections are driven in
    /// parallel (a virtual QP striped over several QPs sends from several
    /// cores). Each QP's own work stays in order either way. 0 counts as 1.
    pub progress_threads: usize,
}

impl Default for SoftConfig {
    fn default() -> Self {
        SoftConfig {
            link: SoftLink::Auto,
            bind_addr: None,
            socket_ifname: None,
            max_msg_size: 1 << 30,
            chaos_seed: None,
            chaos_max_delay: Duration::from_micros(500),
            inline_copy_max: 1 << 20,
            busy_poll: Duration::ZERO,
            doorbell: true,
            polled_rx: true,
            partial_frame_limit: Duration::from_secs(30),
            progress_threads: 1,
        }
    }
}

impl SoftConfig {
    /// Defaults overridden by `RMACOMM_SOFT_LINK`, `RMACOMM_SOFT_ADDR` and
    /// `RMACOMM_SOFT_CHAOS`. Unparsable values are reported and ignored.
    pub fn from_env() -> SoftConfig {
        let mut c = SoftConfig::default();
        if let Ok(v) = std::env::var("RMACOMM_SOFT_LINK") {
            match SoftLink::parse(&v) {
                Some(l) => c.link = l,
                None => {
                    tracing::warn!("RMACOMM_SOFT_LINK={v:?} is not auto, shm or tcp; using auto")
                }
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_ADDR") {
            match v.parse() {
                Ok(ip) => c.bind_addr = Some(ip),
                Err(_) => {
                    tracing::warn!("RMACOMM_SOFT_ADDR={v:?} is not an IP address; ignoring it")
                }
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOCKET_IFNAME") {
            if !v.trim().is_empty() {
                c.socket_ifname = Some(v);
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_INLINE_COPY_MAX") {
            match v.parse() {
                Ok(n) => c.inline_copy_max = n,
                Err(_) => tracing::warn!("RMACOMM_SOFT_INLINE_COPY_MAX={v:?} is not a byte count; ignoring it"),
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_BUSY_POLL_US") {
            match v.parse() {
                Ok(us) => c.busy_poll = Duration::from_micros(us),
                Err(_) => {
                    tracing::warn!("RMACOMM_SOFT_BUSY_POLL_US={v:?} is not a number of microseconds; ignoring it")
                }
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_DOORBELL") {
            match v.trim() {
                "0" | "off" | "false" => c.doorbell = false,
                "1" | "on" | "true" => c.doorbell = true,
                _ => tracing::warn!("RMACOMM_SOFT_DOORBELL={v:?} is not 0 or 1; ignoring it"),
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_POLLED_RX") {
            match v.trim() {
                "0" | "off" | "false" => c.polled_rx = false,
                "1" | "on" | "true" => c.polled_rx = true,
                _ => tracing::warn!("RMACOMM_SOFT_POLLED_RX={v:?} is not 0 or 1; ignoring it"),
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_PARTIAL_FRAME_MS") {
            match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => c.partial_frame_limit = Duration::from_millis(ms),
                _ => tracing::warn!(
                    "RMACOMM_SOFT_PARTIAL_FRAME_MS={v:?} is not a positive number of milliseconds; ignoring it"
                ),
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_PROGRESS_THREADS") {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=64).contains(&n) => c.progress_threads = n,
                _ => tracing::warn!(
                    "RMACOMM_SOFT_PROGRESS_THREADS={v:?} is not a thread count from 1 to 64; ignoring it"
                ),
            }
        }
        if let Ok(v) = std::env::var("RMACOMM_SOFT_CHAOS") {
            match v.parse() {
                Ok(seed) => c.chaos_seed = Some(seed),
                Err(_) => {
                    tracing::warn!("RMACOMM_SOFT_CHAOS={v:?} is not an integer seed; ignoring it")
                }
            }
        }
        c
    }
}
