//! What both measured layers offer the runner: one side of a connection
//! with a registered buffer (source half, destination half), able to run
//! bandwidth loops, ping-pongs and reads, and to checksum its memory.

use std::time::Duration;

/// The most entries a measurement's vectors reserve up front: `-n` and
/// `-t` are the user's, and a huge one must grow its vector as it runs
/// (or be refused), not abort the process reserving it all at once.
pub(crate) const CAPACITY_HINT_MAX: u64 = 1 << 20;

use crate::bootstrap::{Region, SideInfo};
use crate::checksum::{pattern_chunk, Checksum};
use crate::error::{BenchError, Result};
use crate::plan::Plan;
use crate::stats::Timings;

/// Direction of a bandwidth test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// This side's source half into the peer's destination half.
    Write,
    /// The peer's source half into this side's destination half.
    Read,
}

/// Settings both engines take.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    pub(crate) resolved: crate::device::Resolved,
    /// Largest message; the buffer is twice this.
    pub(crate) max: u64,
    pub(crate) qps: u32,
    pub(crate) lb: ibverbx::LoadBalancing,
    pub(crate) frag: u32,
    pub(crate) depth: usize,
    /// How long a waiting call spins before it sleeps.
    pub(crate) busy_poll: Duration,
    /// Whether bandwidth waits spin where this thread copies the data.
    pub(crate) spin_small: bool,
    /// The buffer in CUDA device memory on this GPU (`--use-cuda`).
    pub(crate) cuda: Option<u32>,
}

/// Longest a single completion may take before the run is declared broken.
pub(crate) const OP_TIMEOUT: Duration = Duration::from_secs(60);

/// One side of a measured connection.
pub(crate) trait Engine {
    /// What the peer needs.
    fn info(&self) -> Result<SideInfo>;
    /// Connects to the peer (both sides call it at about the same time).
    /// `peer_host`: the address of the peer's bootstrap connection (the
    /// host the client dialled, or the address the server was dialled from).
    fn connect(&mut self, peer: &SideInfo, peer_host: &str) -> Result<()>;
    /// A line for the header about the data path, once connected (the
    /// window's access type); `None` where there is nothing to say.
    fn describe(&self) -> Option<String> {
        None
    }
    /// The soft provider's device-copy counters so far (`None` where the
    /// engine's memory is host memory or the provider is not soft).
    fn device_counters(&self) -> Option<crate::report::DeviceCounters> {
        None
    }
    /// How many times a bandwidth test in `dir` needs the peer's answer
    /// (the server's `echo` of size 0, run alongside): the window's puts end
    /// each batch with a signal the peer answers. 0 by default.
    fn peer_syncs(&self, _dir: Dir) -> u64 {
        0
    }
    /// Runs `plan` of `size`-byte operations in `dir` with the configured
    /// depth; returns when each measured operation was posted and each
    /// completion was seen.
    fn bandwidth(&mut self, dir: Dir, size: u64, plan: Plan) -> Result<Timings>;
    /// `count` notifying-write ping-pongs; the round-trip times in µs.
    fn ping(&mut self, size: u64, count: u64) -> Result<Vec<f64>>;
    /// Answers `count` ping-pongs (server).
    fn echo(&mut self, size: u64, count: u64) -> Result<()>;
    /// `count` reads, one at a time; each one's time in µs.
    fn read_lat(&mut self, size: u64, count: u64) -> Result<Vec<f64>>;
    /// Copies bytes out of the registered buffer.
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()>;
    /// Copies bytes into the registered buffer.
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()>;
    /// Largest message.
    fn max(&self) -> u64;
    /// Server side, once connected: start answering the peer on its own
    /// (the raw engine's responder thread); nothing by default.
    fn start_serving(&mut self) {}
}

const CHUNK: usize = 4 << 20;

/// Fills the first `len` bytes of the source half with the pattern of
/// `seed`.
pub(crate) fn fill(e: &dyn Engine, seed: u64, len: u64) -> Result<()> {
    let len = len.min(e.max());
    let mut buf = vec![0u8; CHUNK.min(len as usize)];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK as u64) as usize;
        pattern_chunk(seed, off, &mut buf[..n]);
        e.write_at(off, &buf[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// Checksum of the first `len` bytes of `region`.
pub(crate) fn checksum(e: &dyn Engine, region: Region, len: u64) -> Result<u64> {
    let base = match region {
        Region::Src => 0,
        Region::Dst => e.max(),
    };
    if len > e.max() {
        // The peer asked (over the bootstrap connection) for more than a
        // half holds: the rest would be the other half's bytes.
        return Err(BenchError::run(format!("a checksum of {len} bytes of a {} byte half", e.max())));
    }
    let mut c = Checksum::new();
    let mut buf = vec![0u8; CHUNK];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK as u64) as usize;
        e.read_at(base + off, &mut buf[..n])?;
        c.update(&buf[..n]);
        off += n as u64;
    }
    Ok(c.finish())
}
