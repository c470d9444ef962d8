//! The measured side on the raw virtual QP (`ibverbx::VirtualQp` and
//! `VirtualCq`, no transport layer), configured as the transport configures
//! its own, so that the two can be compared in one run.
//!
//! The server keeps a responder thread that progresses its virtual CQ
//! (a DQPLB receiver replenishes its receives only there) and answers
//! every incoming WRITE_WITH_IMM ping with one of the size the immediate
//! names. A bandwidth test of the server's own (bidirectional) pauses it
//! and polls the CQ itself.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ibverbx::{
    AccessFlags, MemoryRegion, RecvWr, SendFlags, SendOp, SendWr, VirtualCq, VirtualQp, VirtualQpConfig, WcOpcode,
    WorkCompletion,
};
use rmacomm_transport::{RdmaRemoteBuffer, TransportConfig};

use crate::bootstrap::SideInfo;
use crate::engine::CAPACITY_HINT_MAX;
use crate::engine::{Dir, Engine, EngineConfig, OP_TIMEOUT};
use crate::error::{BenchError, Result};
use crate::host::HostInfo;
use crate::plan::{Measure, Plan};
use crate::stats::Timings;

/// Receive WR ids carry this bit.
const RECV: u64 = 1 << 63;

struct Shared {
    cq: VirtualCq,
    qp: VirtualQp,
    mr: MemoryRegion,
    max: u64,
    peer: Mutex<Option<RdmaRemoteBuffer>>,
    /// The responder must leave the CQ alone.
    pause: AtomicBool,
    /// The responder is away from the CQ.
    paused: AtomicBool,
    stop: AtomicBool,
    failure: Mutex<Option<String>>,
}

/// A raw virtual QP side.
pub(crate) struct VerbsEngine {
    sh: Arc<Shared>,
    cfg: EngineConfig,
    responder: Option<JoinHandle<()>>,
    /// The soft provider's same-host link: the posting thread copies small
    /// messages itself, so waiting for them may spin (on TCP, spinning
    /// would take a core from the progress threads).
    shm: bool,
}

/// The virtual QP settings the transport would use for `cfg`.
fn vqp_config(cfg: &EngineConfig) -> (VirtualQpConfig, usize) {
    let t = TransportConfig::default().with_qps(cfg.qps).with_load_balancing(cfg.lb).with_frag_size(cfg.frag);
    (t.virtual_qp_config(), t.cq_depth)
}

fn check(wc: &WorkCompletion) -> Result<()> {
    if wc.is_ok() {
        Ok(())
    } else {
        Err(BenchError::Run(format!("completion error: {:?} (wr_id {}, {:?})", wc.status, wc.wr_id, wc.opcode)))
    }
}

fn is_recv(wc: &WorkCompletion) -> bool {
    wc.wr_id & RECV != 0 || matches!(wc.opcode, WcOpcode::RecvRdmaWithImm | WcOpcode::Recv)
}

impl Shared {
    fn peer(&self) -> Result<RdmaRemoteBuffer> {
        self.peer.lock().unwrap_or_else(|e| e.into_inner()).ok_or_else(|| BenchError::run("not connected"))
    }

    fn repost_recv(&self) -> Result<()> {
        Ok(self.qp.post_recv(&[RecvWr { wr_id: RECV, sg_list: &[] }])?)
    }

    /// One WRITE_WITH_IMM of `size` bytes from the source half into the
    /// peer's destination half; the immediate names the size.
    fn post_ping(&self, size: u64, wr_id: u64) -> Result<()> {
        let peer = self.peer()?;
        let sge = [self.mr.sge(0, size as usize)?];
        let sg: &[ibverbx::Sge] = if size == 0 { &[] } else { &sge };
        self.qp.post_send(&[SendWr {
            wr_id,
            op: SendOp::RdmaWriteWithImm { remote_addr: peer.addr + self.max, rkey: peer.key, imm: size as u32 },
            sg_list: sg,
            flags: SendFlags::SIGNALED,
        }])?;
        Ok(())
    }

    /// Waits for at least one completion (error after [`OP_TIMEOUT`]).
    fn wait(&self, wc: &mut [WorkCompletion], spin: Duration) -> Result<usize> {
        let n = self.cq.wait(wc, Some(OP_TIMEOUT), spin)?;
        if n == 0 {
            return Err(BenchError::Run(format!("no completion within {OP_TIMEOUT:?}; is the peer alive?")));
        }
        Ok(n)
    }
}

/// The server's responder loop (see the module docs).
fn respond(sh: Arc<Shared>) {
    let mut wc = [WorkCompletion::empty(); 64];
    let mut busy = false;
    while !sh.stop.load(Ordering::Acquire) {
        if sh.pause.load(Ordering::Acquire) {
            sh.paused.store(true, Ordering::Release);
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        sh.paused.store(false, Ordering::Release);
        // Spin while pings flow; an idle responder sleeps so that it does
        // not take a core from the bandwidth runs.
        let spin = if busy { Duration::from_millis(50) } else { Duration::ZERO };
        let n = match sh.cq.wait(&mut wc, Some(Duration::from_millis(2)), spin) {
            Ok(n) => n,
            Err(e) => {
                *sh.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                return;
            }
        };
        busy = n > 0;
        for w in &wc[..n] {
            let r = check(w).and_then(|()| {
                if is_recv(w) {
                    sh.repost_recv()?;
                    sh.post_ping(u64::from(w.imm_data.unwrap_or(0)), 0)?;
                }
                Ok(())
            });
            if let Err(e) = r {
                *sh.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                return;
            }
        }
    }
}

impl VerbsEngine {
    pub(crate) fn new(cfg: EngineConfig) -> Result<VerbsEngine> {
        let ctx = cfg.resolved.device.open()?;
        let pd = ctx.alloc_pd()?;
        let (vcfg, cq_depth) = vqp_config(&cfg);
        let cq = VirtualCq::new(&ctx, cq_depth)?;
        let qp = VirtualQp::new(&pd, &cq, &vcfg)?;
        let mr = MemoryRegion::alloc(&pd, (2 * cfg.max) as usize, AccessFlags::all_remote())?;
        let sh = Arc::new(Shared {
            cq,
            qp,
            mr,
            max: cfg.max,
            peer: Mutex::new(None),
            pause: AtomicBool::new(false),
            paused: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            failure: Mutex::new(None),
        });
        Ok(VerbsEngine { sh, cfg, responder: None, shm: false })
    }

    fn failure(&self) -> Result<()> {
        match self.sh.failure.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            Some(m) => Err(BenchError::Run(format!("responder: {m}"))),
            None => Ok(()),
        }
    }

    /// Takes the CQ from the responder for the duration of `f`.
    fn exclusive<T>(&mut self, f: impl FnOnce(&Shared) -> Result<T>) -> Result<T> {
        self.failure()?;
        if self.responder.is_some() {
            self.sh.pause.store(true, Ordering::Release);
            while !self.sh.paused.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        let r = f(&self.sh);
        self.sh.pause.store(false, Ordering::Release);
        r
    }

    fn spin_for(&self, size: u64) -> Duration {
        let copies_here =
            self.shm && self.cfg.resolved.soft.as_ref().is_some_and(|s| size as usize <= s.inline_copy_max);
        if self.cfg.spin_small && copies_here {
            Duration::from_secs(3600)
        } else {
            self.cfg.busy_poll
        }
    }
}

impl Drop for VerbsEngine {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
        if let Some(h) = self.responder.take() {
            let _ = h.join();
        }
    }
}

impl Engine for VerbsEngine {
    fn info(&self) -> Result<SideInfo> {
        let buf = RdmaRemoteBuffer { addr: self.sh.mr.addr(), len: self.sh.mr.len() as u64, key: self.sh.mr.rkey() };
        Ok(SideInfo {
            provider: self.cfg.resolved.provider_name().to_owned(),
            device: self.cfg.resolved.device.name().to_owned(),
            host: HostInfo::current(),
            url: None,
            vqp: Some(self.sh.qp.endpoint()?),
            buf,
            store_port: None,
        })
    }

    fn connect(&mut self, peer: &SideInfo, _peer_host: &str) -> Result<()> {
        let ep = peer.vqp.as_ref().ok_or_else(|| BenchError::run("the peer sent no virtual QP endpoint"))?;
        self.sh.qp.connect(ep)?;
        let (vcfg, _) = vqp_config(&self.cfg);
        let recvs: Vec<RecvWr<'_>> = (0..vcfg.max_recv_wr).map(|_| RecvWr { wr_id: RECV, sg_list: &[] }).collect();
        self.sh.qp.post_recv(&recvs)?;
        *self.sh.peer.lock().unwrap_or_else(|e| e.into_inner()) = Some(peer.buf);
        self.shm = crate::device::link_used(&self.cfg.resolved, HostInfo::current().same_host(&peer.host)) == "shm";
        Ok(())
    }

    fn bandwidth(&mut self, dir: Dir, size: u64, plan: Plan) -> Result<Timings> {
        let depth = self.cfg.depth.max(1) as u64;
        let spin = self.spin_for(size);
        self.exclusive(|sh| {
            let peer = sh.peer()?;
            let (op, sge) = match dir {
                Dir::Write => (
                    SendOp::RdmaWrite { remote_addr: peer.addr + sh.max, rkey: peer.key },
                    sh.mr.sge(0, size as usize)?,
                ),
                Dir::Read => (
                    SendOp::RdmaRead { remote_addr: peer.addr, rkey: peer.key },
                    sh.mr.sge(sh.max as usize, size as usize)?,
                ),
            };
            let sg = [sge];
            let mut wc = [WorkCompletion::empty(); 64];
            let mut run = |measure: Measure, times: Option<&mut Timings>| -> Result<()> {
                let start = Instant::now();
                let (mut posted, mut done) = (0u64, 0u64);
                let mut times = times;
                let more = |posted: u64| match measure {
                    Measure::Count(n) => posted < n,
                    Measure::Seconds(s) => start.elapsed().as_secs_f64() < s,
                };
                loop {
                    while posted - done < depth && more(posted) {
                        if let Some(t) = times.as_deref_mut() {
                            t.posted.push(start.elapsed().as_secs_f64());
                        }
                        sh.qp.post_send(&[SendWr { wr_id: posted, op, sg_list: &sg, flags: SendFlags::SIGNALED }])?;
                        posted += 1;
                    }
                    if done == posted {
                        return Ok(());
                    }
                    let n = sh.wait(&mut wc, spin)?;
                    let now = start.elapsed().as_secs_f64();
                    for w in &wc[..n] {
                        check(w)?;
                        if is_recv(w) {
                            sh.repost_recv()?;
                            continue;
                        }
                        done += 1;
                        if let Some(t) = times.as_deref_mut() {
                            t.completed.push(now);
                        }
                    }
                }
            };
            run(Measure::Count(plan.warmup), None)?;
            let mut times = Timings::default();
            run(plan.measure, Some(&mut times))?;
            Ok(times)
        })
    }

    fn ping(&mut self, size: u64, count: u64) -> Result<Vec<f64>> {
        let spin = if self.cfg.busy_poll.is_zero() { Duration::ZERO } else { self.cfg.busy_poll };
        self.exclusive(|sh| {
            let mut wc = [WorkCompletion::empty(); 16];
            let mut rtts = Vec::with_capacity(count.min(CAPACITY_HINT_MAX) as usize);
            let mut sends_out = 0u64;
            for i in 0..count {
                let t0 = Instant::now();
                sh.post_ping(size, i)?;
                sends_out += 1;
                let mut got = false;
                while !got {
                    let n = sh.wait(&mut wc, spin)?;
                    for w in &wc[..n] {
                        check(w)?;
                        if is_recv(w) {
                            got = true;
                            sh.repost_recv()?;
                        } else {
                            sends_out -= 1;
                        }
                    }
                }
                rtts.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            while sends_out > 0 {
                let n = sh.wait(&mut wc, spin)?;
                for w in &wc[..n] {
                    check(w)?;
                    if is_recv(w) {
                        return Err(BenchError::run("an unexpected echo arrived"));
                    }
                    sends_out -= 1;
                }
            }
            Ok(rtts)
        })
    }

    fn echo(&mut self, _size: u64, _count: u64) -> Result<()> {
        // The responder answers every ping as it comes.
        self.failure()
    }

    fn read_lat(&mut self, _size: u64, _count: u64) -> Result<Vec<f64>> {
        Err(BenchError::Config("read latency runs through the transport (read_lat)".into()))
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        Ok(self.sh.mr.read(offset as usize, out)?)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        Ok(self.sh.mr.write(offset as usize, data)?)
    }

    fn max(&self) -> u64 {
        self.cfg.max
    }

    fn start_serving(&mut self) {
        let sh = self.sh.clone();
        self.sh.pause.store(false, Ordering::Release);
        self.responder = Some(std::thread::spawn(move || respond(sh)));
    }
}
