//! The measured side through `rmacomm_transport::RdmaTransport`: writes and
//! reads are futures, awaited in order with `depth` in flight.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, RdmaTransport, TransportConfig, TransportError};

use crate::bootstrap::SideInfo;
use crate::engine::CAPACITY_HINT_MAX;
use crate::engine::{Dir, Engine, EngineConfig, OP_TIMEOUT};
use crate::error::{BenchError, Result};
use crate::host::HostInfo;
use crate::plan::{Measure, Plan};
use crate::stats::Timings;

type OpFuture<'a> = Pin<Box<dyn Future<Output = std::result::Result<(), TransportError>> + Send + 'a>>;

/// One transport, its runtime (one worker thread runs the completion
/// driver, also while this side waits on the bootstrap connection) and its
/// buffer.
pub(crate) struct TransportEngine {
    rt: tokio::runtime::Runtime,
    t: RdmaTransport,
    mem: RdmaMemory,
    cfg: EngineConfig,
    peer: Option<RdmaRemoteBuffer>,
}

impl TransportEngine {
    pub(crate) fn new(cfg: EngineConfig) -> Result<TransportEngine> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(BenchError::run)?;
        let tc = TransportConfig::default()
            .with_provider(cfg.resolved.kind)
            .with_device(Some(cfg.resolved.device.name().to_owned()))
            .with_qps(cfg.qps)
            .with_load_balancing(cfg.lb)
            .with_frag_size(cfg.frag)
            .with_timeout(Some(OP_TIMEOUT))
            .with_busy_poll(cfg.busy_poll)
            .with_soft(cfg.resolved.soft.clone());
        let t = RdmaTransport::new(tc)?;
        let len = (2 * cfg.max) as usize;
        let mem = match cfg.cuda {
            Some(gpu) => RdmaMemory::alloc_cuda_for(&t, len, gpu)?,
            None => RdmaMemory::alloc_for(&t, len)?,
        };
        Ok(TransportEngine { rt, t, mem, cfg, peer: None })
    }

    fn peer(&self) -> Result<RdmaRemoteBuffer> {
        self.peer.ok_or_else(|| BenchError::run("not connected"))
    }

    /// The peer's half `region_off..+size`.
    fn remote(&self, region_off: u64, size: u64) -> Result<RdmaRemoteBuffer> {
        self.peer()?.slice(region_off, size).ok_or_else(|| BenchError::run("the peer's buffer is too small"))
    }
}

impl Engine for TransportEngine {
    fn info(&self) -> Result<SideInfo> {
        Ok(SideInfo {
            provider: self.cfg.resolved.provider_name().to_owned(),
            device: self.cfg.resolved.device.name().to_owned(),
            host: HostInfo::current(),
            url: Some(self.t.bind()?),
            vqp: None,
            buf: self.mem.remote_buffer(),
            store_port: None,
        })
    }

    fn describe(&self) -> Option<String> {
        self.mem.device().map(|d| format!("this side's buffer in {d} (--use-cuda)"))
    }

    fn device_counters(&self) -> Option<crate::report::DeviceCounters> {
        self.mem.device()?;
        let st = self.t.soft_stats()?;
        Some(crate::report::DeviceCounters {
            copies: st.device_copies,
            waits: st.device_copy_waits,
            bytes: st.peer_device_bytes,
        })
    }

    fn connect(&mut self, peer: &SideInfo, _peer_host: &str) -> Result<()> {
        let url = peer.url.as_deref().ok_or_else(|| BenchError::run("the peer sent no transport URL"))?;
        self.rt.block_on(self.t.connect(url))?;
        self.peer = Some(peer.buf);
        Ok(())
    }

    fn bandwidth(&mut self, dir: Dir, size: u64, plan: Plan) -> Result<Timings> {
        let max = self.cfg.max;
        let remote = match dir {
            Dir::Write => self.remote(max, size)?,
            Dir::Read => self.remote(0, size)?,
        };
        let (t, mem, depth) = (&self.t, &self.mem, self.cfg.depth.max(1));
        let post = || -> std::result::Result<OpFuture<'_>, TransportError> {
            Ok(match dir {
                Dir::Write => Box::pin(t.write(mem.view(0, size as usize)?, &remote, false)),
                Dir::Read => Box::pin(t.read(mem.view_mut(max as usize, size as usize)?, &remote)),
            })
        };
        self.rt
            .block_on(async {
                let mut inflight: VecDeque<OpFuture<'_>> =
                    VecDeque::with_capacity(depth.min(CAPACITY_HINT_MAX as usize));
                // Warm-up, then the measured part.
                for _ in 0..plan.warmup {
                    if inflight.len() == depth {
                        inflight.pop_front().expect("in flight").await?;
                    }
                    inflight.push_back(post()?);
                }
                for f in inflight.drain(..) {
                    f.await?;
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
                        inflight.pop_front().expect("in flight").await?;
                        times.completed.push(start.elapsed().as_secs_f64());
                    }
                    times.posted.push(start.elapsed().as_secs_f64());
                    inflight.push_back(post()?);
                    posted += 1;
                }
                for f in inflight.drain(..) {
                    f.await?;
                    times.completed.push(start.elapsed().as_secs_f64());
                }
                Ok::<_, TransportError>(times)
            })
            .map_err(Into::into)
    }

    fn ping(&mut self, size: u64, count: u64) -> Result<Vec<f64>> {
        let remote = self.remote(self.cfg.max, size)?;
        let (t, mem) = (&self.t, &self.mem);
        self.rt
            .block_on(async {
                let mut rtts = Vec::with_capacity(count.min(CAPACITY_HINT_MAX) as usize);
                for _ in 0..count {
                    let t0 = Instant::now();
                    // Posted here; the echo cannot come before it is placed.
                    let w = t.write(mem.view(0, size as usize)?, &remote, true);
                    t.wait_for_write().await?;
                    rtts.push(t0.elapsed().as_secs_f64() * 1e6);
                    w.await?;
                }
                Ok::<_, TransportError>(rtts)
            })
            .map_err(Into::into)
    }

    fn echo(&mut self, size: u64, count: u64) -> Result<()> {
        let remote = self.remote(self.cfg.max, size)?;
        let (t, mem) = (&self.t, &self.mem);
        self.rt
            .block_on(async {
                for _ in 0..count {
                    t.wait_for_write().await?;
                    t.write(mem.view(0, size as usize)?, &remote, true).await?;
                }
                Ok::<_, TransportError>(())
            })
            .map_err(Into::into)
    }

    fn read_lat(&mut self, size: u64, count: u64) -> Result<Vec<f64>> {
        let remote = self.remote(0, size)?;
        let (t, mem, max) = (&self.t, &self.mem, self.cfg.max as usize);
        self.rt
            .block_on(async {
                let mut v = Vec::with_capacity(count.min(CAPACITY_HINT_MAX) as usize);
                for _ in 0..count {
                    let t0 = Instant::now();
                    t.read(mem.view_mut(max, size as usize)?, &remote).await?;
                    v.push(t0.elapsed().as_secs_f64() * 1e6);
                }
                Ok::<_, TransportError>(v)
            })
            .map_err(Into::into)
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        Ok(self.mem.read_into(offset as usize, out)?)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        Ok(self.mem.write_from(offset as usize, data)?)
    }

    fn max(&self) -> u64 {
        self.cfg.max
    }
}
