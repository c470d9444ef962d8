//! The measured side through `rmacomm_window::Window`: two ranks of a group
//! of two (the server rank 0, hosting the group's `TcpStore`; the client
//! rank 1), each with one registered tensor (source half, destination
//! half). Puts and gets are the window's, with `depth` in flight as
//! `Work`s; ping-pongs are put + signal answered by wait_signal + put +
//! signal.
//!
//! The window picks its data path per peer (`get_attr`): SEPARATE through
//! the transport, or UNIFIED (mapped same-host memory) where the window
//! offers it; the engine uses only the public API, so a run measures
//! whichever the window chose, and the header says which.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use rmacomm_transport::{RdmaMemory, RdmaTransport, TransportConfig};
use rmacomm_window::{Group, GroupOptions, Store, TcpStore, Window, WindowOptions, Work};

use crate::bootstrap::SideInfo;
use crate::engine::CAPACITY_HINT_MAX;
use crate::engine::{Dir, Engine, EngineConfig, OP_TIMEOUT};
use crate::error::{BenchError, Result};
use crate::host::HostInfo;
use crate::plan::{Measure, Plan};
use crate::stats::Timings;

/// Which end of the run this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Rank 0: hosts the group's store.
    Server,
    /// Rank 1: joins it at the server's address.
    Client,
}

/// The window and the group it lives in (the group holds the store: on
/// the server, its host).
struct Connected {
    // Field order is drop order: the window before its group.
    win: Window,
    _group: Group,
}

/// One rank of the two-rank window.
pub(crate) struct WindowEngine {
    cfg: EngineConfig,
    tc: TransportConfig,
    role: Role,
    /// The server's store, until the group takes it.
    store: Option<TcpStore>,
    /// The buffer before it is registered (filled before the peers meet).
    mem: Option<RdmaMemory>,
    conn: Option<Connected>,
}

impl WindowEngine {
    pub(crate) fn new(cfg: EngineConfig, role: Role) -> Result<WindowEngine> {
        let tc = TransportConfig::default()
            .with_provider(cfg.resolved.kind)
            .with_device(Some(cfg.resolved.device.name().to_owned()))
            .with_qps(cfg.qps)
            .with_load_balancing(cfg.lb)
            .with_frag_size(cfg.frag)
            .with_timeout(Some(OP_TIMEOUT))
            .with_busy_poll(cfg.busy_poll)
            .with_soft(cfg.resolved.soft.clone());
        // Registrations belong to the device, which every transport of these
        // settings shares (the window's included): memory allocated through
        // this one is the window's, as `Window::alloc` would give it.
        let mem = RdmaMemory::alloc_for(&RdmaTransport::new(tc.clone())?, (2 * cfg.max) as usize)?;
        let store = match role {
            Role::Server => Some(TcpStore::new("0.0.0.0", 0, Some(2), true, OP_TIMEOUT)?),
            Role::Client => None,
        };
        Ok(WindowEngine { cfg, tc, role, store, mem: Some(mem), conn: None })
    }

    fn peer(&self) -> usize {
        match self.role {
            Role::Server => 1,
            Role::Client => 0,
        }
    }

    fn win(&self) -> Result<&Window> {
        self.conn.as_ref().map(|c| &c.win).ok_or_else(|| BenchError::run("not connected"))
    }

    /// The memory: the registered tensor once connected.
    fn mem(&self) -> Result<&RdmaMemory> {
        match &self.conn {
            Some(c) => c.win.local_tensor().ok_or_else(|| BenchError::run("no tensor registered")),
            None => self.mem.as_ref().ok_or_else(|| BenchError::run("no buffer")),
        }
    }

    /// The end of a batch of puts: a signal behind them, then the peer's
    /// answer (its `echo` of size 0, or its own batch end in a
    /// bidirectional run). Once it returns, the peer has seen the signal,
    /// so every put before it is placed and visible there.
    fn sync(&self) -> Result<()> {
        let (w, peer) = (self.win()?, self.peer());
        w.signal(peer, false)?;
        w.wait_signal(peer, None)?;
        Ok(())
    }

    /// Posts one operation of `size` bytes in `dir`: a put of the source
    /// half into the peer's destination half, or a get of the peer's
    /// source half into this side's destination half.
    fn post<'a>(&self, w: &'a Window, mem: &'a RdmaMemory, dir: Dir, size: usize) -> Result<Work<'a>> {
        let max = self.cfg.max as usize;
        Ok(match dir {
            // Element size 1: offsets are bytes.
            Dir::Write => w.put(mem.view(0, size)?, self.peer(), max, true)?,
            Dir::Read => w.get(mem.view_mut(max, size)?, self.peer(), 0, true)?,
        })
    }
}

impl Engine for WindowEngine {
    fn info(&self) -> Result<SideInfo> {
        let mem = self.mem()?;
        Ok(SideInfo {
            provider: self.cfg.resolved.provider_name().to_owned(),
            device: self.cfg.resolved.device.name().to_owned(),
            host: HostInfo::current(),
            url: None,
            vqp: None,
            buf: mem.remote_buffer(),
            store_port: self.store.as_ref().map(TcpStore::port),
        })
    }

    fn connect(&mut self, peer: &SideInfo, peer_host: &str) -> Result<()> {
        let (rank, store): (usize, Arc<dyn Store>) = match self.role {
            Role::Server => (0, Arc::new(self.store.take().ok_or_else(|| BenchError::run("connected twice"))?)),
            Role::Client => {
                let port = peer.store_port.ok_or_else(|| {
                    BenchError::run("the server sent no store port: is it an rdma_bench of the same version?")
                })?;
                (1, Arc::new(TcpStore::connect(peer_host, port, OP_TIMEOUT)?))
            }
        };
        let group = Group::with_options(rank, 2, store, GroupOptions::new().timeout(OP_TIMEOUT))?;
        // A UNIFIED wait_signal spins as long as the transport's waits do
        // (`--busy-poll-us`; latency tests spin, bandwidth tests sleep).
        let opts = WindowOptions::new().timeout(OP_TIMEOUT).transport(self.tc.clone()).spin(self.cfg.busy_poll);
        let mut win = Window::new(&group, opts)?;
        let mem = self.mem.take().ok_or_else(|| BenchError::run("connected twice"))?;
        win.tensor_register(mem, 1)?;
        self.conn = Some(Connected { win, _group: group });
        Ok(())
    }

    fn describe(&self) -> Option<String> {
        let w = self.win().ok()?;
        let access = w.get_attr(self.peer()).ok()?.access_type;
        Some(format!("{access:?} (get_attr of the peer)"))
    }

    fn peer_syncs(&self, dir: Dir) -> u64 {
        // One at the end of the warm-up, one at the end of the measured part.
        match dir {
            Dir::Write => 2,
            Dir::Read => 0,
        }
    }

    fn bandwidth(&mut self, dir: Dir, size: u64, plan: Plan) -> Result<Timings> {
        let (w, mem, depth) = (self.win()?, self.mem()?, self.cfg.depth.max(1));
        let size = size as usize;
        let mut inflight: VecDeque<Work<'_>> = VecDeque::with_capacity(depth.min(CAPACITY_HINT_MAX as usize));
        // Warm-up, then the measured part.
        for _ in 0..plan.warmup {
            if inflight.len() == depth {
                inflight.pop_front().expect("in flight").wait(None)?;
            }
            inflight.push_back(self.post(w, mem, dir, size)?);
        }
        for work in inflight.drain(..) {
            work.wait(None)?;
        }
        if dir == Dir::Write {
            self.sync()?;
        }
        let start = Instant::now();
        let mut times = Timings::default();
        let mut posted = 0u64;
        let more = |posted: u64| match plan.measure {
            Measure::Count(n) => posted < n,
            Measure::Seconds(s) => start.elapsed().as_secs_f64() < s,
        };
        while more(posted) {
            if inflight.len() == depth {
                inflight.pop_front().expect("in flight").wait(None)?;
                times.completed.push(start.elapsed().as_secs_f64());
            }
            times.posted.push(start.elapsed().as_secs_f64());
            inflight.push_back(self.post(w, mem, dir, size)?);
            posted += 1;
        }
        for work in inflight.drain(..) {
            work.wait(None)?;
            times.completed.push(start.elapsed().as_secs_f64());
        }
        if dir == Dir::Write {
            // The run ends when the peer has seen the data.
            self.sync()?;
            if let Some(last) = times.completed.last_mut() {
                *last = start.elapsed().as_secs_f64();
            }
        }
        Ok(times)
    }

    fn ping(&mut self, size: u64, count: u64) -> Result<Vec<f64>> {
        let (w, mem, peer) = (self.win()?, self.mem()?, self.peer());
        let max = self.cfg.max as usize;
        let mut rtts = Vec::with_capacity(count.min(CAPACITY_HINT_MAX) as usize);
        for _ in 0..count {
            let t0 = Instant::now();
            let put = w.put(mem.view(0, size as usize)?, peer, max, true)?;
            // Delivered after the put is placed: the echo cannot come before.
            let sig = w.signal(peer, true)?;
            w.wait_signal(peer, None)?;
            rtts.push(t0.elapsed().as_secs_f64() * 1e6);
            put.wait(None)?;
            sig.wait(None)?;
        }
        Ok(rtts)
    }

    /// Answers `count` signals, each with a put of `size` bytes (none for
    /// 0: the answer to a bandwidth batch's end) and a signal.
    fn echo(&mut self, size: u64, count: u64) -> Result<()> {
        let (w, mem, peer) = (self.win()?, self.mem()?, self.peer());
        let max = self.cfg.max as usize;
        for _ in 0..count {
            w.wait_signal(peer, None)?;
            let put = match size {
                0 => None,
                n => Some(w.put(mem.view(0, n as usize)?, peer, max, true)?),
            };
            let sig = w.signal(peer, true)?;
            if let Some(p) = put {
                p.wait(None)?;
            }
            sig.wait(None)?;
        }
        Ok(())
    }

    fn read_lat(&mut self, size: u64, count: u64) -> Result<Vec<f64>> {
        let (w, mem, peer) = (self.win()?, self.mem()?, self.peer());
        let max = self.cfg.max as usize;
        let mut v = Vec::with_capacity(count.min(CAPACITY_HINT_MAX) as usize);
        for _ in 0..count {
            let t0 = Instant::now();
            w.get(mem.view_mut(max, size as usize)?, peer, 0, false)?;
            v.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        Ok(v)
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        Ok(self.mem()?.read_into(offset as usize, out)?)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        Ok(self.mem()?.write_from(offset as usize, data)?)
    }

    fn max(&self) -> u64 {
        self.cfg.max
    }
}
