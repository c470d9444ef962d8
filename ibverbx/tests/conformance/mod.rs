//! The provider conformance suite: one set of checks, instantiated per
//! provider/link with [`conformance_suite!`]. Each check builds two
//! connected RC QPs on two contexts of the device the harness gives and
//! verifies verbs semantics byte for byte.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use ibverbx::{
    AccessFlags, AtomicOp, CompletionQueue, Context, Device, DeviceMemory, Error, InitAttr, MemoryRegion,
    ProtectionDomain, QpCaps, QpInitAttr, QpState, QpTransition, QueuePair, RecvWr, RtrAttr, RtsAttr, SendFlags,
    SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

pub const WAIT: Duration = Duration::from_secs(20);

/// What kind of memory the target region is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mem {
    /// Shared segment (`MemoryRegion::alloc`).
    Shm,
    /// Heap memory (`Vec<u8>`).
    Heap,
    /// Device memory ([`FakeDevice`]: addresses no host mapping has, so a
    /// provider that touched them directly would crash the test).
    Device,
    /// Device memory that exports itself to same-host peers ([`FakeIpc`]):
    /// the soft provider's peers copy into it themselves.
    DeviceIpc,
}

/// Device memory for tests: bytes the host reaches only through
/// [`DeviceMemory`] copies, at a non-canonical address (a load or store
/// there faults; `process_vm_*` fails with EFAULT). It counts its copies,
/// and refuses (test failure) one outside its bytes.
#[derive(Debug)]
pub struct FakeDevice {
    pub base: u64,
    id: u64,
    exports: bool,
    bytes: std::sync::Mutex<Vec<u8>>,
    pub copies: std::sync::atomic::AtomicU64,
    /// Copies peers try through [`FakePeer`], and whether they fail.
    pub peer_attempts: std::sync::atomic::AtomicU64,
    pub peer_fails: std::sync::atomic::AtomicBool,
    /// Device-to-device copies queued ([`DeviceMemory::copy_device_queue`])
    /// and not yet waited for: they happen only at the wait, so bytes
    /// looked at before it are the old ones.
    queued: std::sync::Mutex<Vec<(u64, u64, usize)>>,
    /// Waits that found copies queued.
    pub queue_waits: std::sync::atomic::AtomicU64,
    /// The next wait fails (dropping what was queued).
    pub queue_fails: std::sync::atomic::AtomicBool,
    /// The next wait fails after it made the queued copies.
    pub queue_fails_after: std::sync::atomic::AtomicBool,
    /// Every device-to-device copy made at once (not queued) fails.
    pub copy_fails: std::sync::atomic::AtomicBool,
    /// Bytes of the copies queued so far.
    pub queued_bytes: std::sync::atomic::AtomicU64,
    /// While true, a wait with copies queued blocks (a device still busy).
    pub hold: (std::sync::Mutex<bool>, std::sync::Condvar),
}

static NEXT_FAKE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Fake devices that export themselves, by id (what [`FakeIpc`] opens).
static FAKES: std::sync::Mutex<Vec<(u64, std::sync::Weak<FakeDevice>)>> = std::sync::Mutex::new(Vec::new());

impl FakeDevice {
    pub fn new(len: usize) -> std::sync::Arc<FakeDevice> {
        Self::with(len, false)
    }

    /// `exports`: it describes itself for [`FakeIpc`] (and installs that as
    /// the process's opener).
    pub fn with(len: usize, exports: bool) -> std::sync::Arc<FakeDevice> {
        let n = NEXT_FAKE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::sync::Arc::new(FakeDevice {
            base: 0x4000_0000_0000_0000 + (n << 36),
            id: n,
            exports,
            bytes: std::sync::Mutex::new(vec![0; len]),
            copies: Default::default(),
            peer_attempts: Default::default(),
            peer_fails: Default::default(),
            queued: Default::default(),
            queue_waits: Default::default(),
            queue_fails: Default::default(),
            queue_fails_after: Default::default(),
            copy_fails: Default::default(),
            queued_bytes: Default::default(),
            hold: Default::default(),
        });
        if exports {
            ibverbx::set_device_ipc(std::sync::Arc::new(FakeIpc));
            FAKES.lock().unwrap().push((n, std::sync::Arc::downgrade(&d)));
        }
        d
    }

    fn range(&self, addr: u64, n: usize) -> Result<std::ops::Range<usize>, String> {
        let len = self.bytes.lock().unwrap().len();
        let off = addr.checked_sub(self.base).filter(|o| o + n as u64 <= len as u64);
        let off = off.ok_or_else(|| format!("{addr:#x}+{n} is outside the fake device memory"))? as usize;
        Ok(off..off + n)
    }
}

impl DeviceMemory for FakeDevice {
    fn describe(&self) -> String {
        format!("fake device memory at {:#x}", self.base)
    }
    unsafe fn read(&self, src: u64, dst: &mut [u8]) -> Result<(), String> {
        let r = self.range(src, dst.len()).inspect_err(|e| panic!("{e}"))?;
        self.copies.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        dst.copy_from_slice(&self.bytes.lock().unwrap()[r]);
        Ok(())
    }
    unsafe fn write(&self, dst: u64, src: &[u8]) -> Result<(), String> {
        let r = self.range(dst, src.len()).inspect_err(|e| panic!("{e}"))?;
        self.copies.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.bytes.lock().unwrap()[r].copy_from_slice(src);
        Ok(())
    }
    fn ipc_export(&self, addr: u64, len: usize) -> Option<Result<Vec<u8>, String>> {
        let mut blob = self.id.to_ne_bytes().to_vec();
        blob.extend_from_slice(&(addr - self.base).to_ne_bytes());
        blob.extend_from_slice(&(len as u64).to_ne_bytes());
        self.exports.then_some(Ok(blob))
    }
    unsafe fn copy_device(&self, dst: u64, src: u64, len: usize) -> Option<Result<(), String>> {
        let find = |a: u64| {
            let fakes = FAKES.lock().unwrap();
            fakes.iter().filter_map(|(_, w)| w.upgrade()).find(|d| d.range(a, len).is_ok())
        };
        let (to, from) = (find(dst)?, find(src)?);
        if self.copy_fails.load(std::sync::atomic::Ordering::Relaxed) {
            return Some(Err("fake copy failure".into()));
        }
        DEVICE_TO_DEVICE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut v = vec![0u8; len];
        // SAFETY: bounds-checked fake memory (the fake panics outside it).
        Some(unsafe { from.read(src, &mut v).and_then(|()| to.write(dst, &v)) })
    }
    unsafe fn copy_device_queue(&self, dst: u64, src: u64, len: usize) -> Option<Result<(), String>> {
        let fake =
            |a: u64| FAKES.lock().unwrap().iter().filter_map(|(_, w)| w.upgrade()).any(|d| d.range(a, len).is_ok());
        if !fake(dst) || !fake(src) {
            return None;
        }
        self.queued.lock().unwrap().push((dst, src, len));
        self.queued_bytes.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        Some(Ok(()))
    }
    fn copy_device_wait(&self) -> Result<(), String> {
        let queued = std::mem::take(&mut *self.queued.lock().unwrap());
        if queued.is_empty() {
            return Ok(());
        }
        self.queue_waits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let held = self.hold.0.lock().unwrap();
        drop(self.hold.1.wait_while(held, |h| *h).unwrap());
        if self.queue_fails.swap(false, std::sync::atomic::Ordering::Relaxed) {
            return Err("fake queue failure".into());
        }
        let fails = self.copy_fails.swap(false, std::sync::atomic::Ordering::Relaxed);
        for (dst, src, len) in queued {
            // SAFETY: checked fake ranges (copy_device checks them again).
            let r = unsafe { self.copy_device(dst, src, len) }.expect("queued between fakes");
            if let Err(e) = r {
                self.copy_fails.store(fails, std::sync::atomic::Ordering::Relaxed);
                return Err(e);
            }
        }
        self.copy_fails.store(fails, std::sync::atomic::Ordering::Relaxed);
        if self.queue_fails_after.swap(false, std::sync::atomic::Ordering::Relaxed) {
            return Err("fake failure after the copies".into());
        }
        Ok(())
    }
}

/// Device-to-device copies fake devices made (this process).
pub static DEVICE_TO_DEVICE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl FakeDevice {
    /// Holds (true) or lets go (false) this device's waits.
    pub fn set_hold(&self, on: bool) {
        *self.hold.0.lock().unwrap() = on;
        self.hold.1.notify_all();
    }
}

/// Holds a fake device's waits until dropped: a failed assertion meanwhile
/// fails the test instead of leaving the engine held.
pub struct DeviceHold<'a>(&'a FakeDevice);

impl<'a> DeviceHold<'a> {
    pub fn new(dev: &'a FakeDevice) -> DeviceHold<'a> {
        dev.set_hold(true);
        DeviceHold(dev)
    }
}

impl Drop for DeviceHold<'_> {
    fn drop(&mut self) {
        self.0.set_hold(false);
    }
}

/// Opens [`FakeDevice`] exports (this process's: the tests' contexts share
/// it).
#[derive(Debug)]
pub struct FakeIpc;

/// A fake device opened through its export: the region at `off`, `len`
/// bytes long.
#[derive(Debug)]
pub struct FakePeer {
    dev: std::sync::Arc<FakeDevice>,
    off: u64,
    len: u64,
}

impl ibverbx::DeviceIpc for FakeIpc {
    fn open(&self, export: &[u8], pid: u32) -> Result<std::sync::Arc<dyn ibverbx::PeerDevice>, String> {
        assert_eq!(pid, std::process::id(), "the peer's pid comes from the kernel");
        let word = |i: usize| u64::from_ne_bytes(export[8 * i..8 * i + 8].try_into().unwrap());
        let (id, off, len) = (word(0), word(1), word(2));
        let fakes = FAKES.lock().unwrap();
        let dev = fakes.iter().find(|(i, _)| *i == id).and_then(|(_, w)| w.upgrade());
        Ok(std::sync::Arc::new(FakePeer { dev: dev.ok_or("no such fake device")?, off, len }))
    }
}

impl ibverbx::PeerDevice for FakePeer {
    fn len(&self) -> u64 {
        self.len
    }
    fn device_addr(&self) -> Option<u64> {
        Some(self.dev.base + self.off)
    }
    unsafe fn write(&self, offset: u64, src: *const u8, len: usize) -> Result<(), String> {
        assert!(offset + len as u64 <= self.len, "a peer copy past the exported region");
        self.dev.peer_attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.dev.peer_fails.load(std::sync::atomic::Ordering::Relaxed) {
            return Err("fake failure".into());
        }
        let mut v = vec![0u8; len];
        // SAFETY: the caller's readable range, copied through raw pointers.
        unsafe { std::ptr::copy_nonoverlapping(src, v.as_mut_ptr(), len) };
        // SAFETY: inside the exported region (asserted above).
        unsafe { self.dev.write(self.dev.base + self.off + offset, &v) }
    }
    unsafe fn read(&self, offset: u64, dst: *mut u8, len: usize) -> Result<(), String> {
        assert!(offset + len as u64 <= self.len, "a peer copy past the exported region");
        self.dev.peer_attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.dev.peer_fails.load(std::sync::atomic::Ordering::Relaxed) {
            return Err("fake failure".into());
        }
        let mut v = vec![0u8; len];
        // SAFETY: inside the exported region (asserted above).
        unsafe { self.dev.read(self.dev.base + self.off + offset, &mut v)? };
        // SAFETY: the caller's writable range.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), dst, len) };
        Ok(())
    }
}

/// A region of fresh fake device memory (`exports`: to same-host peers).
pub fn device_mr(pd: &ProtectionDomain, len: usize, access: AccessFlags, exports: bool) -> MemoryRegion {
    let d = FakeDevice::with(len, exports);
    // SAFETY: the fake device owns its bytes and lives as long as the
    // region (the region holds it).
    unsafe { MemoryRegion::register_device(pd, d.clone(), d.base, len, access, None) }.unwrap()
}

/// Whether `dev` can register fake device memory (the soft provider; the
/// verbs provider needs memory its HCA reaches). Prints why not.
pub fn fake_device_ok(dev: &Device) -> bool {
    let ok = dev.info().provider == "soft";
    if !ok {
        println!("skipped: fake device memory exists for the soft provider only");
    }
    ok
}

/// One side: context, PD, CQs, QP.
pub struct Side {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub scq: CompletionQueue,
    pub rcq: CompletionQueue,
    pub qp: QueuePair,
}

/// Two connected QPs on two contexts.
pub struct Pair {
    pub a: Side,
    pub b: Side,
}

/// Logs to the test output with the `RMACOMM_LOG` filter (default: warnings).
pub fn init_log() {
    let filter = std::env::var("RMACOMM_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init();
}

pub fn side(dev: &Device, cq_depth: usize, caps: QpCaps) -> Side {
    init_log();
    let ctx = dev.open().expect("open device");
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let scq = ctx.create_cq(cq_depth).expect("create send cq");
    let rcq = ctx.create_cq(cq_depth).expect("create recv cq");
    let qp = pd.create_qp(&QpInitAttr { caps, sq_sig_all: false }, &scq, &rcq).expect("create_qp");
    Side { ctx, pd, scq, rcq, qp }
}

impl Pair {
    pub fn new(dev: &Device) -> Pair {
        Self::with(dev, 1024, QpCaps::default(), RtsAttr::default(), 12)
    }

    pub fn with(dev: &Device, cq_depth: usize, caps: QpCaps, rts: RtsAttr, min_rnr_timer: u8) -> Pair {
        let a = side(dev, cq_depth, caps);
        let b = side(dev, cq_depth, caps);
        let ea = a.qp.endpoint().unwrap();
        let eb = b.qp.endpoint().unwrap();
        let rtr = |e| RtrAttr { min_rnr_timer, ..RtrAttr::new(e) };
        a.qp.connect_with(InitAttr::default(), rtr(eb), rts).unwrap();
        b.qp.connect_with(InitAttr::default(), rtr(ea), rts).unwrap();
        Pair { a, b }
    }
}

pub fn mr(pd: &ProtectionDomain, mem: Mem, len: usize, access: AccessFlags) -> MemoryRegion {
    match mem {
        Mem::Shm => MemoryRegion::alloc(pd, len, access).unwrap(),
        Mem::Heap => MemoryRegion::register(pd, vec![0u8; len], access).unwrap(),
        Mem::Device => device_mr(pd, len, access, false),
        Mem::DeviceIpc => device_mr(pd, len, access, true),
    }
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn contents(m: &MemoryRegion, off: usize, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    m.read(off, &mut v).unwrap();
    v
}

/// Waits for exactly one completion.
pub fn wait1(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::empty(); 1];
    let n = cq.wait(&mut wc, Some(WAIT), Duration::ZERO).unwrap();
    assert_eq!(n, 1, "no completion within {WAIT:?}");
    wc[0]
}

/// Asserts that no completion arrives within `d`.
pub fn none_within(cq: &CompletionQueue, d: Duration) {
    let mut wc = [WorkCompletion::empty(); 1];
    let n = cq.wait(&mut wc, Some(d), Duration::ZERO).unwrap();
    assert_eq!(n, 0, "unexpected completion {:?}", wc[0]);
}

pub fn post(qp: &QueuePair, wr_id: u64, op: SendOp, sges: &[Sge], signaled: bool) {
    qp.post_send(&[SendWr {
        wr_id,
        op,
        sg_list: sges,
        flags: if signaled { SendFlags::SIGNALED } else { SendFlags::UNSIGNALED },
    }])
    .unwrap();
}

pub fn recv(qp: &QueuePair, wr_id: u64, sges: &[Sge]) {
    qp.post_recv(&[RecvWr { wr_id, sg_list: sges }]).unwrap();
}

fn ok(wc: WorkCompletion, wr_id: u64, opcode: WcOpcode) {
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (wr_id, WcStatus::Success, opcode), "{wc:?}");
}

/// Sizes every opcode is checked at (the 64 MiB one only in release builds).
pub fn sizes() -> Vec<usize> {
    let mut v = vec![0, 1, 4095, 4096, 4097, 1 << 20];
    if !cfg!(debug_assertions) {
        v.push(64 << 20);
    }
    v
}

/// RDMA WRITE, WRITE_WITH_IMM, READ, SEND and SEND_WITH_IMM at every size.
pub fn every_opcode_every_size(dev: &Device, mem: Mem) {
    let p = Pair::new(dev);
    let max = *sizes().iter().max().unwrap() + 64;
    let src = mr(&p.a.pd, mem, max, AccessFlags::LOCAL_WRITE);
    let back = mr(&p.a.pd, mem, max, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, mem, max, AccessFlags::all_remote());
    for (i, &n) in sizes().iter().enumerate() {
        let data = pattern(n, i as u64 + 1);
        src.write(0, &data).unwrap();
        // A guard byte after the range must stay untouched.
        dst.write(n, &[0xA5]).unwrap();

        let s = [src.sge(0, n).unwrap()];
        post(&p.a.qp, 1, SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() }, &s, true);
        ok(wait1(&p.a.scq), 1, WcOpcode::RdmaWrite);
        assert!(contents(&dst, 0, n) == data, "RDMA WRITE of {n} bytes corrupted data");
        assert_eq!(contents(&dst, n, 1), [0xA5], "RDMA WRITE of {n} bytes wrote past its end");

        let data2 = pattern(n, 1000 + i as u64);
        src.write(0, &data2).unwrap();
        recv(&p.b.qp, 7, &[]);
        let imm = 0xC0DE_0000 | i as u32;
        post(&p.a.qp, 2, SendOp::RdmaWriteWithImm { remote_addr: dst.addr(), rkey: dst.rkey(), imm }, &s, true);
        ok(wait1(&p.a.scq), 2, WcOpcode::RdmaWrite);
        let wc = wait1(&p.b.rcq);
        ok(wc, 7, WcOpcode::RecvRdmaWithImm);
        assert_eq!((wc.imm_data, wc.byte_len), (Some(imm), n as u32));
        assert!(contents(&dst, 0, n) == data2, "WRITE_WITH_IMM of {n} bytes corrupted data");

        let r = [back.sge(0, n).unwrap()];
        post(&p.a.qp, 3, SendOp::RdmaRead { remote_addr: dst.addr(), rkey: dst.rkey() }, &r, true);
        let wc = wait1(&p.a.scq);
        ok(wc, 3, WcOpcode::RdmaRead);
        assert!(contents(&back, 0, n) == data2, "RDMA READ of {n} bytes corrupted data");

        let data3 = pattern(n, 2000 + i as u64);
        src.write(0, &data3).unwrap();
        let rs = [dst.sge(0, n + 1).unwrap()];
        recv(&p.b.qp, 8, &rs);
        post(&p.a.qp, 4, SendOp::SendWithImm { imm: 99 }, &s, true);
        ok(wait1(&p.a.scq), 4, WcOpcode::Send);
        let wc = wait1(&p.b.rcq);
        ok(wc, 8, WcOpcode::Recv);
        assert_eq!((wc.byte_len, wc.imm_data), (n as u32, Some(99)));
        assert!(contents(&dst, 0, n) == data3, "SEND of {n} bytes corrupted data");
    }
    // Who copied the device bytes: the peer itself through the export when
    // it reaches this context's segments directly, never without one.
    if let Some(st) = ibverbx::soft::stats(&p.a.ctx) {
        match mem {
            Mem::DeviceIpc if st.peer_segments_mapped > 0 => {
                assert!(st.peer_device_bytes > 0, "an exported device region was staged: {st:?}");
                let dtod = DEVICE_TO_DEVICE.load(std::sync::atomic::Ordering::Relaxed);
                assert!(dtod > 0, "device memory to a peer's device memory went through the host");
            }
            Mem::Device | Mem::Shm | Mem::Heap => assert_eq!(st.peer_device_bytes, 0, "{st:?}"),
            Mem::DeviceIpc => {}
        }
    }
}

/// Fetch-and-add and compare-and-swap return the old value and update the
/// target; concurrent fetch-adds from two QPs do not lose updates.
pub fn atomics(dev: &Device, mem: Mem) {
    let p = Pair::new(dev);
    let p2 = Pair::new(dev);
    let dst = mr(&p.b.pd, mem, 4096, AccessFlags::all_remote());
    let res = mr(&p.a.pd, mem, 64, AccessFlags::LOCAL_WRITE);
    dst.write(8, &41u64.to_ne_bytes()).unwrap();
    let s = [res.sge(0, 8).unwrap()];
    let at = |op| SendOp::Atomic { remote_addr: dst.addr() + 8, rkey: dst.rkey(), op };
    post(&p.a.qp, 1, at(AtomicOp::FetchAdd { add: 1 }), &s, true);
    ok(wait1(&p.a.scq), 1, WcOpcode::FetchAdd);
    assert_eq!(u64::from_ne_bytes(contents(&res, 0, 8).try_into().unwrap()), 41);
    post(&p.a.qp, 2, at(AtomicOp::CompareSwap { compare: 42, swap: 7 }), &s, true);
    ok(wait1(&p.a.scq), 2, WcOpcode::CompareSwap);
    assert_eq!(u64::from_ne_bytes(contents(&res, 0, 8).try_into().unwrap()), 42);
    post(&p.a.qp, 3, at(AtomicOp::CompareSwap { compare: 42, swap: 9 }), &s, true);
    ok(wait1(&p.a.scq), 3, WcOpcode::CompareSwap);
    assert_eq!(
        u64::from_ne_bytes(contents(&dst, 8, 8).try_into().unwrap()),
        7,
        "CAS with a wrong compare must not swap"
    );

    // Two QPs (different contexts as initiators, p.b's region as target).
    let dst2 = &dst;
    let res2 = mr(&p2.a.pd, mem, 64, AccessFlags::LOCAL_WRITE);
    // p2's QPs belong to other PDs: give p2.b's side a region too and have
    // both initiators hammer their own peer's counter concurrently through
    // one region each, then cross-check with reads.
    let dst3 = mr(&p2.b.pd, mem, 4096, AccessFlags::all_remote());
    let n = 500u64;
    std::thread::scope(|sc| {
        for (qp, cq, res, target) in [(&p.a.qp, &p.a.scq, &res, dst2), (&p2.a.qp, &p2.a.scq, &res2, &dst3)] {
            sc.spawn(move || {
                let s = [res.sge(0, 8).unwrap()];
                for i in 0..n {
                    let op = SendOp::Atomic {
                        remote_addr: target.addr() + 16,
                        rkey: target.rkey(),
                        op: AtomicOp::FetchAdd { add: 1 },
                    };
                    post(qp, i, op, &s, true);
                    let wc = wait1(cq);
                    assert!(wc.is_ok(), "{wc:?}");
                }
            });
        }
    });
    assert_eq!(u64::from_ne_bytes(contents(&dst, 16, 8).try_into().unwrap()), n);
    assert_eq!(u64::from_ne_bytes(contents(&dst3, 16, 8).try_into().unwrap()), n);
}

/// Two initiators on two QPs fetch-add the same word of one region.
pub fn atomics_same_word(dev: &Device, mem: Mem) {
    let target = side(dev, 64, QpCaps::default());
    let inits: Vec<Side> = (0..2).map(|_| side(dev, 64, QpCaps::default())).collect();
    // The target needs one QP per initiator, in the target's PD.
    let tqps: Vec<QueuePair> =
        (0..2).map(|_| target.pd.create_qp(&QpInitAttr::default(), &target.scq, &target.rcq).unwrap()).collect();
    for (i, s) in inits.iter().enumerate() {
        s.qp.connect(&tqps[i].endpoint().unwrap()).unwrap();
        tqps[i].connect(&s.qp.endpoint().unwrap()).unwrap();
    }
    let word = mr(&target.pd, mem, 4096, AccessFlags::all_remote());
    let n = 400u64;
    std::thread::scope(|sc| {
        for s in &inits {
            let word = &word;
            sc.spawn(move || {
                let res = mr(&s.pd, mem, 8, AccessFlags::LOCAL_WRITE);
                let sge = [res.sge(0, 8).unwrap()];
                for i in 0..n {
                    let op = SendOp::Atomic {
                        remote_addr: word.addr(),
                        rkey: word.rkey(),
                        op: AtomicOp::FetchAdd { add: 3 },
                    };
                    post(&s.qp, i, op, &sge, true);
                    let wc = wait1(&s.scq);
                    assert!(wc.is_ok(), "{wc:?}");
                }
            });
        }
    });
    assert_eq!(u64::from_ne_bytes(contents(&word, 0, 8).try_into().unwrap()), 2 * n * 3);
}

/// Gather on the send side, scatter on the receive side.
pub fn scatter_gather(dev: &Device, mem: Mem) {
    let p = Pair::new(dev);
    let src = mr(&p.a.pd, mem, 3 * 8192, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, mem, 3 * 8192, AccessFlags::all_remote());
    let data = pattern(3 * 8192, 5);
    src.write(0, &data).unwrap();
    // Gather three pieces out of order into one contiguous write.
    let s = [src.sge(16384, 100).unwrap(), src.sge(0, 5000).unwrap(), src.sge(8192, 1).unwrap()];
    post(&p.a.qp, 1, SendOp::RdmaWrite { remote_addr: dst.addr() + 10, rkey: dst.rkey() }, &s, true);
    ok(wait1(&p.a.scq), 1, WcOpcode::RdmaWrite);
    let mut want = data[16384..16484].to_vec();
    want.extend_from_slice(&data[0..5000]);
    want.push(data[8192]);
    assert_eq!(contents(&dst, 10, want.len()), want);
    // SEND scattered into two receive pieces.
    let r = [dst.sge(20000, 3000).unwrap(), dst.sge(100, 3000).unwrap()];
    recv(&p.b.qp, 5, &r);
    post(&p.a.qp, 2, SendOp::Send, &[src.sge(0, 4000).unwrap()], true);
    ok(wait1(&p.a.scq), 2, WcOpcode::Send);
    assert_eq!(wait1(&p.b.rcq).byte_len, 4000);
    assert_eq!(contents(&dst, 20000, 3000), data[0..3000]);
    assert_eq!(contents(&dst, 100, 1000), data[3000..4000]);
}

/// Inline data: the buffer may change right after post_send.
pub fn inline_send(dev: &Device) {
    let p = Pair::new(dev);
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    let src = mr(&p.a.pd, Mem::Heap, 8192, AccessFlags::LOCAL_WRITE);
    src.write(0, b"inline payload!").unwrap();
    p.a.qp
        .post_send(&[SendWr {
            wr_id: 1,
            op: SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() },
            sg_list: &[src.sge(0, 15).unwrap()],
            flags: SendFlags { signaled: true, inline: true, fence: false },
        }])
        .unwrap();
    src.write(0, &[0; 15]).unwrap();
    ok(wait1(&p.a.scq), 1, WcOpcode::RdmaWrite);
    assert_eq!(contents(&dst, 0, 15), b"inline payload!");
    // Too long for max_inline_data: refused at post time.
    let e = p.a.qp.post_send(&[SendWr {
        wr_id: 2,
        op: SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() },
        sg_list: &[src.sge(0, 5000).unwrap()],
        flags: SendFlags { signaled: true, inline: true, fence: false },
    }]);
    assert!(matches!(e, Err(Error::InvalidArgument { .. })), "{e:?}");
}

/// Inline SGEs are read by the library at post time, so each must lie in a
/// registered region of the QP's PD named by its lkey: anything else is
/// refused by post_send, posts nothing (not even the good WRs of the batch)
/// and leaves the QP usable.
pub fn inline_sources_checked(dev: &Device) {
    let p = Pair::new(dev);
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    let src = mr(&p.a.pd, Mem::Heap, 64, AccessFlags::LOCAL_WRITE);
    let other_pd = p.a.ctx.alloc_pd().unwrap();
    let foreign = mr(&other_pd, Mem::Heap, 64, AccessFlags::LOCAL_WRITE);
    let op = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
    // A fn, not a closure: each call borrows its own SGE list.
    fn inline<'a>(wr_id: u64, op: SendOp, sg_list: &'a [Sge]) -> SendWr<'a> {
        SendWr { wr_id, op, sg_list, flags: SendFlags { signaled: true, inline: true, fence: false } }
    }
    let refused = |wrs: &[SendWr<'_>], what: &str| {
        let e = p.a.qp.post_send(wrs);
        assert!(matches!(&e, Err(Error::InvalidArgument { verb: "post_send", .. })), "{what}: {e:?}");
    };
    let secret = *b"never registered";
    let stack = secret.as_ptr() as u64;
    refused(&[inline(1, op, &[Sge { addr: stack, length: 16, lkey: 0xdead_beef }])], "stack variable, bogus lkey");
    refused(&[inline(2, op, &[Sge { addr: 0x1000, length: 16, lkey: 0x1234_5678 }])], "unmapped address, bogus lkey");
    refused(
        &[inline(3, op, &[Sge { addr: stack, length: 16, lkey: src.lkey() }])],
        "valid lkey, address outside its MR",
    );
    refused(&[inline(4, op, &[Sge { addr: src.addr() + 60, length: 8, lkey: src.lkey() }])], "runs past the MR's end");
    refused(&[inline(6, op, &[foreign.sge(0, 8).unwrap()])], "MR of another PD");
    let good = [src.sge(0, 8).unwrap()];
    let bad = [src.sge(0, 8).unwrap(), Sge { addr: stack, length: 8, lkey: src.lkey() }];
    refused(&[inline(7, op, &good), inline(8, op, &bad)], "good WR then a WR with a bad second SGE");

    // The QP still works, and none of the refused WRs was posted: the next
    // WR's completion is the first and only one.
    src.write(0, b"checked inline!!").unwrap();
    p.a.qp.post_send(&[inline(9, op, &[src.sge(0, 16).unwrap()])]).unwrap();
    src.write(0, &[0; 16]).unwrap();
    ok(wait1(&p.a.scq), 9, WcOpcode::RdmaWrite);
    assert_eq!(contents(&dst, 0, 16), b"checked inline!!");
    std::thread::sleep(Duration::from_millis(50));
    let mut more = [WorkCompletion::empty(); 4];
    assert_eq!(p.a.scq.poll(&mut more).unwrap(), 0, "a refused WR was posted: {:?}", &more[..1]);
    assert_eq!(p.a.qp.state(), QpState::Rts);
}

/// No receive posted: with a small RNR budget the sender gets
/// RNR_RETRY_EXC_ERR; with a receive posted late (within budget) it succeeds.
pub fn rnr(dev: &Device) {
    let rts = RtsAttr { rnr_retry: 2, ..RtsAttr::default() };
    // min_rnr_timer 10 = 0.32 ms
    let p = Pair::with(dev, 64, QpCaps::default(), rts, 10);
    let src = mr(&p.a.pd, Mem::Shm, 64, AccessFlags::LOCAL_WRITE);
    post(&p.a.qp, 1, SendOp::Send, &[src.sge(0, 8).unwrap()], true);
    let wc = wait1(&p.a.scq);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RnrRetryExcErr), "{wc:?}");
    assert_eq!(p.a.qp.state(), QpState::Err);

    let rts = RtsAttr { rnr_retry: 7, ..RtsAttr::default() };
    let p = Pair::with(dev, 64, QpCaps::default(), rts, 10);
    let src = mr(&p.a.pd, Mem::Shm, 64, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, Mem::Shm, 64, AccessFlags::all_remote());
    src.write(0, b"late rcv").unwrap();
    post(&p.a.qp, 2, SendOp::Send, &[src.sge(0, 8).unwrap()], true);
    std::thread::sleep(Duration::from_millis(50));
    none_within(&p.a.scq, Duration::from_millis(10));
    recv(&p.b.qp, 3, &[dst.sge(0, 8).unwrap()]);
    ok(wait1(&p.a.scq), 2, WcOpcode::Send);
    ok(wait1(&p.b.rcq), 3, WcOpcode::Recv);
    assert_eq!(contents(&dst, 0, 8), b"late rcv");
}

/// Device memory beside host memory: every opcode between a host region and
/// a device region, both ways; SGE lists that mix them; the region's
/// placement (staged); the host accessors that refuse it; inline data from
/// it.
pub fn device_mixed(dev: &Device) {
    if !fake_device_ok(dev) {
        return;
    }
    let p = Pair::new(dev);
    let n = 3 * 4096 + 5;
    let acc = AccessFlags::all_remote();
    let (ha, da) = (mr(&p.a.pd, Mem::Shm, 2 * n, acc), mr(&p.a.pd, Mem::Device, 2 * n, acc));
    let (hb, db) = (mr(&p.b.pd, Mem::Heap, 2 * n, acc), mr(&p.b.pd, Mem::Device, 2 * n, acc));
    assert_eq!(da.placement(), ibverbx::Placement::Staged);
    assert!(da.device().is_some() && ha.device().is_none());
    assert!(da.atomic_u64(0).is_err(), "a device region has no host atomic view");
    for (i, (src, dst)) in [(&ha, &db), (&da, &hb), (&da, &db)].into_iter().enumerate() {
        let data = pattern(n, 40 + i as u64);
        src.write(0, &data).unwrap();
        dst.write(n, &[0xA5]).unwrap();
        let s = [src.sge(0, n).unwrap()];
        post(&p.a.qp, 1, SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() }, &s, true);
        ok(wait1(&p.a.scq), 1, WcOpcode::RdmaWrite);
        assert!(contents(dst, 0, n) == data, "case {i}: WRITE corrupted data");
        assert_eq!(contents(dst, n, 1), [0xA5], "case {i}: WRITE wrote past its end");
        // READ it back into the other kind of local memory.
        let back = if src.device().is_some() { &ha } else { &da };
        post(
            &p.a.qp,
            2,
            SendOp::RdmaRead { remote_addr: dst.addr(), rkey: dst.rkey() },
            &[back.sge(n, n).unwrap()],
            true,
        );
        ok(wait1(&p.a.scq), 2, WcOpcode::RdmaRead);
        assert!(contents(back, n, n) == data, "case {i}: READ corrupted data");
        // SEND scattered over host and device receive pieces.
        let data = pattern(n, 50 + i as u64);
        src.write(0, &data).unwrap();
        recv(&p.b.qp, 3, &[hb.sge(0, 100).unwrap(), db.sge(0, n - 100).unwrap()]);
        post(&p.a.qp, 4, SendOp::Send, &s, true);
        ok(wait1(&p.a.scq), 4, WcOpcode::Send);
        assert_eq!(wait1(&p.b.rcq).byte_len, n as u32);
        assert_eq!(contents(&hb, 0, 100), data[..100]);
        assert!(contents(&db, 0, n - 100) == data[100..], "case {i}: SEND into device pieces corrupted data");
    }
    // A gather from host and device pieces into one write.
    let (x, y) = (pattern(5000, 60), pattern(7000, 61));
    ha.write(0, &x).unwrap();
    da.write(0, &y).unwrap();
    let s = [da.sge(0, 7000).unwrap(), ha.sge(0, 5000).unwrap()];
    post(&p.a.qp, 5, SendOp::RdmaWrite { remote_addr: db.addr() + 3, rkey: db.rkey() }, &s, true);
    ok(wait1(&p.a.scq), 5, WcOpcode::RdmaWrite);
    assert_eq!(contents(&db, 3, 7000), y);
    assert_eq!(contents(&db, 7003, 5000), x);
    // Inline data read from device memory at post time.
    let inl = pattern(64, 62);
    da.write(0, &inl).unwrap();
    let wr = SendWr {
        wr_id: 6,
        op: SendOp::RdmaWrite { remote_addr: hb.addr(), rkey: hb.rkey() },
        sg_list: &[da.sge(0, 64).unwrap()],
        flags: SendFlags { inline: true, ..SendFlags::SIGNALED },
    };
    if p.a.qp.post_send(&[wr]).is_ok() {
        ok(wait1(&p.a.scq), 6, WcOpcode::RdmaWrite);
        assert_eq!(contents(&hb, 0, 64), inl);
    }
}

/// A peer copy into an exported device region that fails (GPUs that
/// cannot reach each other): the WR completes through the connection with
/// the right bytes, and later WRs do not try the peer copy again.
pub fn device_ipc_copy_failure_falls_back(dev: &Device) {
    if !fake_device_ok(dev) {
        return;
    }
    let p = Pair::new(dev);
    let src = mr(&p.a.pd, Mem::Heap, 8192, AccessFlags::LOCAL_WRITE);
    let d = FakeDevice::with(8192, true);
    // SAFETY: the fake owns its bytes and lives as long as the region.
    let dst =
        unsafe { MemoryRegion::register_device(&p.b.pd, d.clone(), d.base, 8192, AccessFlags::all_remote(), None) }
            .unwrap();
    d.peer_fails.store(true, std::sync::atomic::Ordering::Relaxed);
    for (i, seed) in [70u64, 71, 72].into_iter().enumerate() {
        let data = pattern(8192, seed);
        src.write(0, &data).unwrap();
        post(
            &p.a.qp,
            i as u64,
            SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() },
            &[src.sge(0, 8192).unwrap()],
            true,
        );
        ok(wait1(&p.a.scq), i as u64, WcOpcode::RdmaWrite);
        assert!(contents(&dst, 0, 8192) == data, "write {i} through the connection");
    }
    let tried = d.peer_attempts.load(std::sync::atomic::Ordering::Relaxed);
    assert!(tried <= 1, "the failing peer copy was tried {tried} times");
}

/// `n` READs of `far`'s pieces `i` into `near`'s pieces `i`, then `n`
/// WRITEs of `near`'s pieces `i` to `far`'s pieces `n + i` (forwarding what
/// was read), `piece` bytes each, wr_ids 0..2n.
fn forwarding(n: usize, piece: usize, far: &MemoryRegion, near: &MemoryRegion) -> Vec<(u64, SendOp, Sge)> {
    let reads = (0..n).map(|i| {
        let op = SendOp::RdmaRead { remote_addr: far.addr() + (i * piece) as u64, rkey: far.rkey() };
        (i as u64, op, near.sge(i * piece, piece).unwrap())
    });
    let writes = (0..n).map(|i| {
        let op = SendOp::RdmaWrite { remote_addr: far.addr() + ((n + i) * piece) as u64, rkey: far.rkey() };
        ((n + i) as u64, op, near.sge(i * piece, piece).unwrap())
    });
    reads.chain(writes).collect()
}

/// Posts `ops` (wr_id, opcode, one SGE; signaled) in one call.
fn post_ops(qp: &QueuePair, ops: &[(u64, SendOp, Sge)]) {
    let sges: Vec<[Sge; 1]> = ops.iter().map(|o| [o.2]).collect();
    let wrs: Vec<SendWr<'_>> = ops
        .iter()
        .zip(&sges)
        .map(|(o, sg)| SendWr { wr_id: o.0, op: o.1, sg_list: sg, flags: SendFlags::SIGNALED })
        .collect();
    qp.post_send(&wrs).unwrap();
}

/// WRITEs and READs between device memory and a same-host peer's exported
/// device region, posted together: their copies are queued, merged where
/// they continue each other, and waited for once per run (not per WR);
/// no completion comes before its bytes are placed (the fake performs
/// queued copies only at the wait), completions keep posting order, a WR
/// of another kind ends the run first, and a failed wait executes the
/// run's WRs again one by one.
pub fn device_copies_batched(dev: &Device) {
    if !fake_device_ok(dev) {
        return;
    }
    let p = Pair::new(dev);
    const N: usize = 64;
    const PIECE: usize = 4096;
    let acc = AccessFlags::all_remote();
    let src = FakeDevice::with(N * PIECE, true);
    let back = FakeDevice::with(N * PIECE, true);
    let reg = |pd: &ProtectionDomain, d: &std::sync::Arc<FakeDevice>| {
        // SAFETY: the fake owns its bytes and lives as long as the region.
        unsafe { MemoryRegion::register_device(pd, d.clone(), d.base, N * PIECE, acc, None) }.unwrap()
    };
    let (s_mr, back_mr) = (reg(&p.a.pd, &src), reg(&p.a.pd, &back));
    let dst = device_mr(&p.b.pd, N * PIECE + 1, acc, true);
    let stats = || ibverbx::soft::stats(&p.a.ctx).unwrap();
    // Every WR in one post, the device held meanwhile: the engine may
    // start on the first WRs and wait for them, but every other WR is
    // posted before that wait ends. So two runs at most, each one wait.
    let post_list = |ops: &[(u64, SendOp, Sge)]| post_ops(&p.a.qp, ops);
    let post_all = |ops: &[(u64, SendOp, Sge)], dev: &FakeDevice| {
        let _hold = DeviceHold::new(dev);
        post_list(ops);
    };
    let in_order = |n: usize, first: u64, what: &str| {
        for i in 0..n as u64 {
            let wc = wait1(&p.a.scq);
            assert_eq!((wc.wr_id, wc.status), (first + i, WcStatus::Success), "{what}: completion {i}");
        }
    };
    let writes = || -> Vec<_> {
        (0..N)
            .map(|i| {
                let op = SendOp::RdmaWrite { remote_addr: dst.addr() + (i * PIECE) as u64, rkey: dst.rkey() };
                (i as u64, op, s_mr.sge(i * PIECE, PIECE).unwrap())
            })
            .collect()
    };
    let same_host = |st: &ibverbx::soft::SoftStats| {
        if st.peer_segments_mapped == 0 {
            // Another host (tcp): nothing is copied device to device here.
            assert_eq!((st.device_copies, st.device_copy_waits), (0, 0), "{st:?}");
        }
        st.peer_segments_mapped > 0
    };
    for round in 0..3u64 {
        let data = pattern(N * PIECE, 300 + round);
        s_mr.write(0, &data).unwrap();
        dst.write(N * PIECE, &[0xA5]).unwrap();
        let before = stats();
        post_all(&writes(), &src);
        in_order(N, 0, "writes");
        assert!(contents(&dst, 0, N * PIECE) == data, "round {round}: batched WRITEs corrupted data");
        assert_eq!(contents(&dst, N * PIECE, 1), [0xA5], "round {round}: a WRITE went past its end");
        let mid = stats();
        // READ it all back, the pieces in reverse order (nothing to merge).
        let reads: Vec<_> = (0..N)
            .rev()
            .map(|i| {
                let op = SendOp::RdmaRead { remote_addr: dst.addr() + (i * PIECE) as u64, rkey: dst.rkey() };
                (100 + (N - 1 - i) as u64, op, back_mr.sge(i * PIECE, PIECE).unwrap())
            })
            .collect();
        post_all(&reads, &back);
        in_order(N, 100, "reads");
        assert!(contents(&back_mr, 0, N * PIECE) == data, "round {round}: batched READs corrupted data");
        let after = stats();
        if !same_host(&after) {
            return;
        }
        let delta = |a: &ibverbx::soft::SoftStats, b: &ibverbx::soft::SoftStats| {
            (a.device_copies - b.device_copies, a.device_copy_waits - b.device_copy_waits)
        };
        assert_eq!(after.peer_device_bytes - before.peer_device_bytes, (2 * N * PIECE) as u64);
        let (copies, waits) = delta(&mid, &before);
        assert!(
            (1..=2).contains(&copies) && (1..=2).contains(&waits),
            "round {round}: writes: {copies} copies, {waits} waits"
        );
        let (copies, waits) = delta(&after, &mid);
        assert!(copies == N as u64 && (1..=2).contains(&waits), "round {round}: reads: {copies} copies, {waits} waits");
    }
    // After a run posted together: one wait for it, or (`fail`: `flag`
    // was set to fail its wait) that wait failed. False on another host.
    let one_run = |before: &ibverbx::soft::SoftStats, fail: bool, flag: &std::sync::atomic::AtomicBool, what: &str| {
        let after = stats();
        if !same_host(&after) {
            return false;
        }
        let waits = after.device_copy_waits - before.device_copy_waits;
        if fail {
            assert!(!flag.load(std::sync::atomic::Ordering::Relaxed), "{what}: no wait failed");
        } else {
            assert!((1..=2).contains(&waits), "{what}: {waits} waits (one run expected)");
        }
        true
    };
    // WRITEs of different sources over the same bytes (a benchmark writes
    // one buffer again and again): one run, the last one's bytes stay —
    // also when the wait fails after making the copies and the run is
    // executed again.
    let over = || -> Vec<_> {
        (0..N)
            .map(|i| {
                let op = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
                (i as u64, op, s_mr.sge(i * PIECE, PIECE).unwrap())
            })
            .collect()
    };
    for fail in [false, true] {
        let data = pattern(N * PIECE, 350 + u64::from(fail));
        s_mr.write(0, &data).unwrap();
        src.queue_fails_after.store(fail, std::sync::atomic::Ordering::Relaxed);
        let before = stats();
        post_all(&over(), &src);
        in_order(N, 0, "writes over the same bytes");
        assert!(
            contents(&dst, 0, PIECE) == data[(N - 1) * PIECE..],
            "writes over the same bytes (wait failing: {fail}): not the last one's bytes"
        );
        if !one_run(&before, fail, &src.queue_fails_after, "writes over the same bytes") {
            break;
        }
    }
    // READs into local memory, then WRITEs of what they read to other
    // bytes of the peer (forwarding): one run too — also when the wait
    // fails after making the copies and the run is executed again.
    const H: usize = N / 2;
    let forward = || forwarding(H, PIECE, &dst, &s_mr);
    for fail in [false, true] {
        let data = pattern(H * PIECE, 360 + u64::from(fail));
        dst.write(0, &data).unwrap();
        s_mr.write(0, &pattern(N * PIECE, 370)).unwrap();
        src.queue_fails_after.store(fail, std::sync::atomic::Ordering::Relaxed);
        let before = stats();
        post_all(&forward(), &src);
        in_order(N, 0, "reads, then writes of what they read");
        assert!(contents(&s_mr, 0, H * PIECE) == data, "forwarding (wait failing: {fail}): the READs' bytes");
        assert!(
            contents(&dst, H * PIECE, H * PIECE) == data,
            "forwarding (wait failing: {fail}): the WRITEs did not send what the READs read"
        );
        if !one_run(&before, fail, &src.queue_fails_after, "forwarding") {
            break;
        }
    }
    // A WRITE_WITH_IMM behind a run: the run is placed before the
    // notification is seen.
    let data = pattern(N * PIECE, 400);
    s_mr.write(0, &data).unwrap();
    recv(&p.b.qp, 9, &[]);
    let mut ops: Vec<_> = (0..N - 1)
        .map(|i| {
            let op = SendOp::RdmaWrite { remote_addr: dst.addr() + (i * PIECE) as u64, rkey: dst.rkey() };
            (i as u64, op, s_mr.sge(i * PIECE, PIECE).unwrap())
        })
        .collect();
    let last = (N - 1) * PIECE;
    let op = SendOp::RdmaWriteWithImm { remote_addr: dst.addr() + last as u64, rkey: dst.rkey(), imm: 7 };
    ops.push(((N - 1) as u64, op, s_mr.sge(last, PIECE).unwrap()));
    post_all(&ops, &src);
    let wc = wait1(&p.b.rcq);
    assert_eq!((wc.status, wc.imm_data), (WcStatus::Success, Some(7)));
    assert!(contents(&dst, 0, N * PIECE) == data, "the notification came before the batch was placed");
    in_order(N, 0, "writes and a WRITE_WITH_IMM");
    // Every WR a WRITE_WITH_IMM (DQPLB's fragments, notifying messages):
    // one run, each notification once, in order, after its bytes — also
    // when the wait fails and the run is executed again.
    for fail in [false, true] {
        let data = pattern(N * PIECE, 410 + u64::from(fail));
        s_mr.write(0, &data).unwrap();
        dst.write(0, &vec![0u8; N * PIECE]).unwrap();
        for i in 0..N as u64 {
            recv(&p.b.qp, 1000 + i, &[]);
        }
        let ops: Vec<_> = (0..N)
            .map(|i| {
                let at = dst.addr() + (i * PIECE) as u64;
                let op = SendOp::RdmaWriteWithImm { remote_addr: at, rkey: dst.rkey(), imm: i as u32 };
                (i as u64, op, s_mr.sge(i * PIECE, PIECE).unwrap())
            })
            .collect();
        src.queue_fails.store(fail, std::sync::atomic::Ordering::Relaxed);
        let before = stats();
        post_all(&ops, &src);
        for i in 0..N {
            let wc = wait1(&p.b.rcq);
            assert_eq!((wc.wr_id, wc.status, wc.imm_data), (1000 + i as u64, WcStatus::Success, Some(i as u32)));
            let piece = &data[i * PIECE..(i + 1) * PIECE];
            assert!(
                contents(&dst, i * PIECE, PIECE) == piece,
                "notification {i} (wait failing: {fail}) before its bytes"
            );
        }
        in_order(N, 0, "WRITE_WITH_IMMs");
        none_within(&p.b.rcq, Duration::from_millis(20));
        one_run(&before, fail, &src.queue_fails, "WRITE_WITH_IMMs");
    }
    // A failed wait: every WR of the run again, one by one; right bytes.
    let data = pattern(N * PIECE, 500);
    s_mr.write(0, &data).unwrap();
    src.queue_fails.store(true, std::sync::atomic::Ordering::Relaxed);
    let before = stats();
    post_all(&writes(), &src);
    in_order(N, 0, "writes after a failed wait");
    assert!(contents(&dst, 0, N * PIECE) == data, "a failed wait lost bytes");
    let after = stats();
    if same_host(&after) {
        assert!(!src.queue_fails.load(std::sync::atomic::Ordering::Relaxed), "no wait failed");
        // The failed wait, then the failed run's WRs again one by one (a
        // copy and a wait each), then any run behind it.
        assert!(after.device_copy_waits - before.device_copy_waits >= 2, "{after:?}");
        assert_eq!(after.peer_device_bytes - before.peer_device_bytes, (N * PIECE) as u64);
        // A READ into local memory, then a WRITE into what it read, posted
        // together, and the wait fails after making the copies: the WRITE
        // must not have joined the READ's run (the READ, executed again,
        // would read the WRITE's bytes).
        let (old_p, m) = (pattern(PIECE, 600), pattern(PIECE, 601));
        dst.write(0, &old_p).unwrap();
        s_mr.write(0, &[0u8; PIECE]).unwrap();
        s_mr.write(PIECE, &m).unwrap();
        src.queue_fails_after.store(true, std::sync::atomic::Ordering::Relaxed);
        let p0 = dst.addr();
        post_all(
            &[
                (0, SendOp::RdmaRead { remote_addr: p0, rkey: dst.rkey() }, s_mr.sge(0, PIECE).unwrap()),
                (1, SendOp::RdmaWrite { remote_addr: p0, rkey: dst.rkey() }, s_mr.sge(PIECE, PIECE).unwrap()),
            ],
            &src,
        );
        in_order(2, 0, "a READ and a WRITE of the same bytes");
        assert!(!src.queue_fails_after.load(std::sync::atomic::Ordering::Relaxed), "no wait failed");
        assert!(contents(&s_mr, 0, PIECE) == old_p, "the READ, executed again, read the WRITE's bytes");
        assert!(contents(&dst, 0, PIECE) == m, "the WRITE's bytes are not there");
        // The QP goes to ERR while the engine waits for a run: the run is
        // flushed (as behind any error), never completed after it, and so
        // is every WR behind it; completions keep posting order.
        let waits = src.queue_waits.load(std::sync::atomic::Ordering::Relaxed);
        let hold = DeviceHold::new(&src);
        post_list(&writes());
        let t = std::time::Instant::now();
        while src.queue_waits.load(std::sync::atomic::Ordering::Relaxed) == waits {
            assert!(t.elapsed() < WAIT, "the engine never waited for the device");
            std::thread::sleep(Duration::from_millis(1));
        }
        p.a.qp.modify(&QpTransition::Err).unwrap();
        drop(hold);
        for i in 0..N as u64 {
            let wc = wait1(&p.a.scq);
            assert_eq!((wc.wr_id, wc.status), (i, WcStatus::WrFlushErr), "completion {i} after ERR");
        }
    }
}

/// A run whose wait fails, and whose WRs' device copies then fail one by
/// one too: each goes through the connection instead, and a WR that
/// reads what an earlier WR of the run wrote (READs into local device
/// memory, then WRITEs of it to other bytes of the peer) still sends what
/// the READ read — executed again, the WRs keep the run's order.
pub fn device_batch_executed_again_in_order(dev: &Device) {
    if !fake_device_ok(dev) {
        return;
    }
    const N: usize = 16;
    const PIECE: usize = 4096;
    let acc = AccessFlags::all_remote();
    // The engine may start a run before the last WRs of the post are in
    // (the first run then fails alone, the peer region is given up, and
    // the rest go through the connection as lone WRs, where an unfenced
    // WRITE of what a READ reads may send the old bytes, as on hardware):
    // tried again, with a new pair, until one run held them all.
    for attempt in 0..50 {
        let p = Pair::new(dev);
        let local = FakeDevice::with(N * PIECE, true);
        // SAFETY: the fake owns its bytes and lives as long as the region.
        let l_mr =
            unsafe { MemoryRegion::register_device(&p.a.pd, local.clone(), local.base, N * PIECE, acc, None) }.unwrap();
        let dst = device_mr(&p.b.pd, 2 * N * PIECE, acc, true);
        // One lone WRITE maps the peer's segment: same host or not.
        let w = SendOp::RdmaWrite { remote_addr: dst.addr() + (N * PIECE) as u64, rkey: dst.rkey() };
        post(&p.a.qp, 1, w, &[l_mr.sge(0, PIECE).unwrap()], true);
        ok(wait1(&p.a.scq), 1, WcOpcode::RdmaWrite);
        if ibverbx::soft::stats(&p.a.ctx).unwrap().peer_segments_mapped == 0 {
            println!("skipped: the peer is not on this host (tcp): no device batch");
            return;
        }
        let data = pattern(N * PIECE, 700 + attempt);
        dst.write(0, &data).unwrap();
        l_mr.write(0, &vec![0u8; N * PIECE]).unwrap();
        let ops = forwarding(N, PIECE, &dst, &l_mr);
        local.queue_fails.store(true, std::sync::atomic::Ordering::Relaxed);
        local.copy_fails.store(true, std::sync::atomic::Ordering::Relaxed);
        let queued = local.queued_bytes.load(std::sync::atomic::Ordering::Relaxed);
        {
            let _hold = DeviceHold::new(&local);
            post_ops(&p.a.qp, &ops);
        }
        for i in 0..2 * N as u64 {
            let wc = wait1(&p.a.scq);
            assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success), "completion {i}");
        }
        assert!(!local.queue_fails.load(std::sync::atomic::Ordering::Relaxed), "no wait failed");
        assert!(contents(&l_mr, 0, N * PIECE) == data, "the READs, executed again, read the wrong bytes");
        if local.queued_bytes.load(std::sync::atomic::Ordering::Relaxed) - queued < (2 * N * PIECE) as u64 {
            continue;
        }
        assert!(
            contents(&dst, N * PIECE, N * PIECE) == data,
            "the WRITEs, executed again, sent their buffer before the READs before them had filled it"
        );
        return;
    }
    panic!("in 50 tries the engine never took the 32 WRs of one post into one run");
}

/// The peer goes away while a WRITE and a READ through the connection
/// wait for their answers and a fenced WR waits for the READ: every WR
/// completes (the first with the error, the rest flushed), none hangs —
/// a large WRITE being written to the stopped peer (the writer must give
/// up too), or small requests it never answers.
pub fn fenced_wr_behind_a_dead_peer(dev: &Device) {
    if !fake_device_ok(dev) {
        return;
    }
    for len in [32usize << 20, 8] {
        let p = Pair::new(dev);
        // Device memory the peer does not export: its engine stages every
        // request, on any link.
        let far = device_mr(&p.b.pd, 2 * len, AccessFlags::all_remote(), false);
        let near = mr(&p.a.pd, Mem::Heap, 2 * len, AccessFlags::LOCAL_WRITE);
        let (w, r) = (far.addr(), far.addr() + len as u64);
        let wrs = [
            (1, SendOp::RdmaWrite { remote_addr: w, rkey: far.rkey() }, near.sge(0, len).unwrap(), false),
            (2, SendOp::RdmaRead { remote_addr: r, rkey: far.rkey() }, near.sge(len, len).unwrap(), false),
            (3, SendOp::RdmaWrite { remote_addr: w, rkey: far.rkey() }, near.sge(len, 8).unwrap(), true),
        ];
        let sges: Vec<[Sge; 1]> = wrs.iter().map(|w| [w.2]).collect();
        let list: Vec<SendWr<'_>> = wrs
            .iter()
            .zip(&sges)
            .map(|(w, sg)| SendWr {
                wr_id: w.0,
                op: w.1,
                sg_list: sg,
                flags: SendFlags { fence: w.3, ..SendFlags::SIGNALED },
            })
            .collect();
        // The peer's QP goes away first (its context stays, and the
        // connection with it: nobody reads or answers).
        let Pair { a, b } = p;
        drop(b);
        a.qp.post_send(&list).unwrap();
        let mut statuses = Vec::new();
        for i in 1..=3u64 {
            let wc = wait1(&a.scq);
            assert_eq!(wc.wr_id, i, "{len} bytes: completions in posting order: {wc:?}");
            statuses.push(wc.status);
        }
        // One error; the WRs behind it flushed.
        assert!(statuses[0] != WcStatus::Success, "{len} bytes: the peer went away, yet {statuses:?}");
        assert_eq!(statuses[1..], [WcStatus::WrFlushErr; 2], "{len} bytes: {statuses:?}");
        drop(far);
    }
}

/// A QP reset while connected and at once connected to another peer
/// QP: the first link's end (its peer closing, its reader and watchdog
/// outliving the reset) never takes the new connection to ERR.
pub fn reset_and_reconnect_elsewhere(dev: &Device) {
    let Pair { a, b } = Pair::new(dev);
    let src = mr(&a.pd, Mem::Heap, 4096, AccessFlags::LOCAL_WRITE);
    let mut peer = b;
    for round in 0..20u64 {
        let dst = mr(&peer.pd, Mem::Heap, 4096, AccessFlags::all_remote());
        let w = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
        post(&a.qp, round, w, &[src.sge(0, 64).unwrap()], true);
        ok(wait1(&a.scq), round, WcOpcode::RdmaWrite);
        // Another peer QP, and this one reset and connected to it.
        let next = side(dev, 64, QpCaps::default());
        a.qp.modify(&QpTransition::Reset).unwrap();
        let (ea, en) = (a.qp.endpoint().unwrap(), next.qp.endpoint().unwrap());
        a.qp.connect_with(InitAttr::default(), RtrAttr::new(en), RtsAttr::default()).unwrap();
        next.qp.connect_with(InitAttr::default(), RtrAttr::new(ea), RtsAttr::default()).unwrap();
        drop(dst);
        peer = next;
        // The old link's end arrives meanwhile; the new one must not mind.
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(a.qp.state(), QpState::Rts, "round {round}: the old link's end took the new connection to ERR");
    }
    let dst = mr(&peer.pd, Mem::Heap, 4096, AccessFlags::all_remote());
    post(&a.qp, 99, SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() }, &[src.sge(0, 64).unwrap()], true);
    ok(wait1(&a.scq), 99, WcOpcode::RdmaWrite);
}

/// A QP reset with its send queue full of WRs a stopped peer never
/// answers (dropped without completions, as in verbs), then connected to
/// another peer QP: its whole send queue is free again.
pub fn reset_frees_the_send_queue(dev: &Device) {
    const DEPTH: u32 = 8;
    let caps = QpCaps { max_send_wr: DEPTH, ..QpCaps::default() };
    let p = Pair::with(dev, 64, caps, RtsAttr::default(), 12);
    let src = mr(&p.a.pd, Mem::Heap, 4096, AccessFlags::LOCAL_WRITE);
    // Staged on every link (the peer's engine answers each), and the peer
    // stopped first: nothing is answered.
    let far = device_mr(&p.b.pd, 4096, AccessFlags::all_remote(), false);
    let Pair { a, b } = p;
    drop(b);
    let w = SendOp::RdmaWrite { remote_addr: far.addr(), rkey: far.rkey() };
    for i in 0..DEPTH as u64 {
        post(&a.qp, i, w, &[src.sge(0, 64).unwrap()], true);
    }
    a.qp.modify(&QpTransition::Reset).unwrap();
    let next = side(dev, 64, QpCaps::default());
    let (ea, en) = (a.qp.endpoint().unwrap(), next.qp.endpoint().unwrap());
    a.qp.connect_with(InitAttr::default(), RtrAttr::new(en), RtsAttr::default()).unwrap();
    next.qp.connect_with(InitAttr::default(), RtrAttr::new(ea), RtsAttr::default()).unwrap();
    let dst = mr(&next.pd, Mem::Heap, 4096, AccessFlags::all_remote());
    let w = SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() };
    for round in 0..3u64 {
        for i in 0..DEPTH as u64 {
            let wr = SendWr { wr_id: 100 + i, op: w, sg_list: &[src.sge(0, 64).unwrap()], flags: SendFlags::SIGNALED };
            a.qp.post_send(&[wr]).unwrap_or_else(|e| panic!("round {round}, WR {i} after the reset: {e}"));
        }
        for i in 0..DEPTH as u64 {
            ok(wait1(&a.scq), 100 + i, WcOpcode::RdmaWrite);
        }
    }
    none_within(&a.scq, Duration::from_millis(50));
    drop(far);
}

/// Bad rkeys, out-of-bounds addresses, missing access and deregistered
/// regions give REM_ACCESS_ERR, never a write; the QP goes to ERR and
/// flushes what follows.
pub fn remote_access_errors(dev: &Device, mem: Mem) {
    type Case = fn(&MemoryRegion, &MemoryRegion) -> SendOp;
    let cases: [(&str, Case); 6] = [
        ("rkey out of bounds", |d, _| SendOp::RdmaWrite { remote_addr: d.addr() + 4096 - 8, rkey: d.rkey() }),
        ("address below the region", |d, _| SendOp::RdmaWrite { remote_addr: d.addr() - 16, rkey: d.rkey() }),
        ("unknown rkey", |d, _| SendOp::RdmaWrite { remote_addr: d.addr(), rkey: d.rkey() ^ 0x5a5a_0000 }),
        ("write to a read-only region", |_, ro| SendOp::RdmaWrite { remote_addr: ro.addr(), rkey: ro.rkey() }),
        ("read from a write-only region", |d, _| SendOp::RdmaRead { remote_addr: d.addr(), rkey: d.rkey() }),
        ("atomic on a region without REMOTE_ATOMIC", |_, ro| SendOp::Atomic {
            remote_addr: ro.addr(),
            rkey: ro.rkey(),
            op: AtomicOp::FetchAdd { add: 1 },
        }),
    ];
    for (what, case) in cases {
        let p = Pair::new(dev);
        let src = mr(&p.a.pd, mem, 4096, AccessFlags::LOCAL_WRITE);
        src.write(0, &[0xEE; 64]).unwrap();
        let dst = mr(&p.b.pd, mem, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
        let ro = mr(&p.b.pd, mem, 4096, AccessFlags::REMOTE_READ);
        let len = if matches!(case(&dst, &ro), SendOp::Atomic { .. }) { 8 } else { 64 };
        post(&p.a.qp, 1, case(&dst, &ro), &[src.sge(0, len).unwrap()], true);
        post(
            &p.a.qp,
            2,
            SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() },
            &[src.sge(0, 8).unwrap()],
            true,
        );
        let wc = wait1(&p.a.scq);
        assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemAccessErr), "{what}: {wc:?}");
        let wc = wait1(&p.a.scq);
        assert_eq!((wc.wr_id, wc.status), (2, WcStatus::WrFlushErr), "{what}: {wc:?}");
        assert_eq!(p.a.qp.state(), QpState::Err, "{what}");
        assert!(contents(&dst, 0, 4096).iter().all(|&b| b == 0), "{what}: the target region was written");
        assert!(contents(&ro, 0, 4096).iter().all(|&b| b == 0), "{what}: the read-only region was written");
    }
    // A deregistered region's key stops working at once.
    let p = Pair::new(dev);
    let src = mr(&p.a.pd, mem, 4096, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, mem, 4096, AccessFlags::all_remote());
    let (addr, rkey) = (dst.addr(), dst.rkey());
    post(&p.a.qp, 1, SendOp::RdmaWrite { remote_addr: addr, rkey }, &[src.sge(0, 8).unwrap()], true);
    ok(wait1(&p.a.scq), 1, WcOpcode::RdmaWrite);
    drop(dst);
    post(&p.a.qp, 2, SendOp::RdmaWrite { remote_addr: addr, rkey }, &[src.sge(0, 8).unwrap()], true);
    let wc = wait1(&p.a.scq);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::RemAccessErr), "deregistered MR: {wc:?}");
}

/// A bad lkey is a local protection error.
pub fn local_protection_error(dev: &Device) {
    let p = Pair::new(dev);
    let src = mr(&p.a.pd, Mem::Shm, 4096, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    let bad = Sge { addr: src.addr(), length: 64, lkey: src.lkey() ^ 0x0101_0000 };
    post(&p.a.qp, 1, SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() }, &[bad], true);
    assert_eq!(wait1(&p.a.scq).status, WcStatus::LocProtErr);
    // Past the end of the local region.
    let p = Pair::new(dev);
    let src = mr(&p.a.pd, Mem::Shm, 4096, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, Mem::Shm, 8192, AccessFlags::all_remote());
    let bad = Sge { addr: src.addr() + 4000, length: 200, lkey: src.lkey() };
    post(&p.a.qp, 1, SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() }, &[bad], true);
    assert_eq!(wait1(&p.a.scq).status, WcStatus::LocProtErr);
    // An RDMA READ into a region without LOCAL_WRITE.
    let p = Pair::new(dev);
    let ro = mr(&p.a.pd, Mem::Shm, 4096, AccessFlags::empty());
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    post(&p.a.qp, 1, SendOp::RdmaRead { remote_addr: dst.addr(), rkey: dst.rkey() }, &[ro.sge(0, 8).unwrap()], true);
    assert_eq!(wait1(&p.a.scq).status, WcStatus::LocProtErr);
}

/// A SEND longer than the posted receive: REM_INV_REQ at the sender,
/// LOC_LEN_ERR at the receiver.
pub fn send_too_long(dev: &Device) {
    let p = Pair::new(dev);
    let src = mr(&p.a.pd, Mem::Shm, 4096, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    recv(&p.b.qp, 9, &[dst.sge(0, 16).unwrap()]);
    post(&p.a.qp, 1, SendOp::Send, &[src.sge(0, 100).unwrap()], true);
    assert_eq!(wait1(&p.a.scq).status, WcStatus::RemInvReqErr);
    let wc = wait1(&p.b.rcq);
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::LocLenErr));
}

/// Moving a QP to ERR flushes posted receives and every send posted after.
pub fn error_state_flushes(dev: &Device) {
    let p = Pair::new(dev);
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    for i in 0..5 {
        recv(&p.b.qp, 100 + i, &[dst.sge(0, 64).unwrap()]);
    }
    p.b.qp.modify(&QpTransition::Err).unwrap();
    for i in 0..5 {
        let wc = wait1(&p.b.rcq);
        assert_eq!((wc.wr_id, wc.status), (100 + i, WcStatus::WrFlushErr));
    }
    // Receives posted in ERR are flushed too.
    recv(&p.b.qp, 200, &[dst.sge(0, 64).unwrap()]);
    assert_eq!(wait1(&p.b.rcq).status, WcStatus::WrFlushErr);
    // Sends posted after ERR are flushed (even unsignaled ones report).
    let src = mr(&p.a.pd, Mem::Shm, 4096, AccessFlags::LOCAL_WRITE);
    p.a.qp.modify(&QpTransition::Err).unwrap();
    post(&p.a.qp, 1, SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() }, &[src.sge(0, 8).unwrap()], false);
    let wc = wait1(&p.a.scq);
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::WrFlushErr));
    // The peer sees its connection fail on the next operation.
    post(&p.b.qp, 2, SendOp::RdmaWrite { remote_addr: src.addr(), rkey: src.rkey() }, &[dst.sge(0, 8).unwrap()], true);
    assert_ne!(wait1(&p.b.scq).status, WcStatus::Success);
}

/// Unsignaled WRs produce no completion but free their slot when a later
/// signaled one completes.
pub fn unsignaled(dev: &Device) {
    let caps = QpCaps { max_send_wr: 16, ..QpCaps::default() };
    let p = Pair::with(dev, 64, caps, RtsAttr::default(), 12);
    let src = mr(&p.a.pd, Mem::Shm, 4096, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    for round in 0..10u64 {
        for i in 0..15 {
            let s = [src.sge(i, 1).unwrap()];
            post(
                &p.a.qp,
                round * 100 + i as u64,
                SendOp::RdmaWrite { remote_addr: dst.addr() + i as u64, rkey: dst.rkey() },
                &s,
                i == 14,
            );
        }
        let wc = wait1(&p.a.scq);
        assert_eq!((wc.wr_id, wc.status), (round * 100 + 14, WcStatus::Success));
    }
    none_within(&p.a.scq, Duration::from_millis(50));
    // The send queue is bounded: posting past max_send_wr is refused. SENDs
    // with no receive posted stay outstanding (RNR, retried forever).
    let s = [src.sge(0, 1).unwrap()];
    let mut refused = false;
    for i in 0..64 {
        let r = p.a.qp.post_send(&[SendWr { wr_id: i, op: SendOp::Send, sg_list: &s, flags: SendFlags::UNSIGNALED }]);
        if let Err(e) = r {
            assert!(matches!(e, Error::Exhausted { .. }), "{e:?}");
            refused = true;
            break;
        }
    }
    assert!(refused, "posting 64 WRs on a 16-deep send queue must be refused at some point");
}

/// Once its completion has been polled, a WR no longer occupies the send
/// queue: a one-deep queue takes the next WR right after each poll.
pub fn polled_completion_frees_its_slot(dev: &Device) {
    let caps = QpCaps { max_send_wr: 1, ..QpCaps::default() };
    let p = Pair::with(dev, 16, caps, RtsAttr::default(), 12);
    let src = mr(&p.a.pd, Mem::Shm, 1 << 16, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, Mem::Shm, 1 << 16, AccessFlags::all_remote());
    let s = [src.sge(0, 1 << 15).unwrap()];
    for i in 0..2000u64 {
        // Alternate the opcode so that both the posting-thread and the
        // progress-engine paths are exercised where a provider has both.
        let op = if i % 2 == 0 {
            SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() }
        } else {
            SendOp::RdmaRead { remote_addr: dst.addr(), rkey: dst.rkey() }
        };
        p.a.qp
            .post_send(&[SendWr { wr_id: i, op, sg_list: &s, flags: SendFlags::SIGNALED }])
            .unwrap_or_else(|e| panic!("post {i} right after polling the previous completion: {e}"));
        let wc = wait1(&p.a.scq);
        assert!(wc.is_ok() && wc.wr_id == i, "{wc:?}");
    }
}

/// A CQ that overflows reports it; completions are not silently lost.
pub fn cq_overflow(dev: &Device) {
    let p = Pair::with(dev, 4, QpCaps::default(), RtsAttr::default(), 12);
    let src = mr(&p.a.pd, Mem::Shm, 4096, AccessFlags::LOCAL_WRITE);
    let dst = mr(&p.b.pd, Mem::Shm, 4096, AccessFlags::all_remote());
    for i in 0..8 {
        post(
            &p.a.qp,
            i,
            SendOp::RdmaWrite { remote_addr: dst.addr(), rkey: dst.rkey() },
            &[src.sge(0, 8).unwrap()],
            true,
        );
    }
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let mut wc = [WorkCompletion::empty(); 1];
        match p.a.scq.poll(&mut wc[..0]) {
            Err(Error::CqOverflow { capacity: 4, dropped }) => {
                assert!(dropped >= 1);
                break;
            }
            Err(e) => panic!("unexpected error {e:?}"),
            Ok(_) => {
                assert!(std::time::Instant::now() < deadline, "overflow not reported");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

/// Posting is refused in the wrong state; invalid transitions are refused.
pub fn state_machine(dev: &Device) {
    let a = side(dev, 16, QpCaps::default());
    let src = mr(&a.pd, Mem::Shm, 64, AccessFlags::LOCAL_WRITE);
    assert_eq!(a.qp.state(), QpState::Reset);
    let e = a.qp.post_send(&[SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: &[src.sge(0, 8).unwrap()],
        flags: SendFlags::SIGNALED,
    }]);
    assert!(matches!(e, Err(Error::InvalidState { .. })), "{e:?}");
    assert!(matches!(a.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[] }]), Err(Error::InvalidState { .. })));
    assert!(a.qp.modify(&QpTransition::Rts(RtsAttr::default())).is_err(), "RESET → RTS must be refused");
    a.qp.modify(&QpTransition::Init(InitAttr::default())).unwrap();
    a.qp.post_recv(&[RecvWr { wr_id: 1, sg_list: &[] }]).unwrap();
    assert_eq!(a.qp.state(), QpState::Init);
}

/// Instantiates the suite for a harness expression that yields a `Device`.
#[macro_export]
macro_rules! conformance_suite {
    ($dev:expr) => {
        #[test]
        fn every_opcode_every_size_shm_memory() {
            conformance::every_opcode_every_size(&$dev, conformance::Mem::Shm);
        }
        #[test]
        fn every_opcode_every_size_heap_memory() {
            conformance::every_opcode_every_size(&$dev, conformance::Mem::Heap);
        }
        #[test]
        fn atomics_shm_memory() {
            conformance::atomics(&$dev, conformance::Mem::Shm);
        }
        #[test]
        fn atomics_heap_memory() {
            conformance::atomics(&$dev, conformance::Mem::Heap);
        }
        #[test]
        fn atomics_same_word() {
            conformance::atomics_same_word(&$dev, conformance::Mem::Shm);
        }
        #[test]
        fn scatter_gather() {
            conformance::scatter_gather(&$dev, conformance::Mem::Shm);
            conformance::scatter_gather(&$dev, conformance::Mem::Heap);
        }
        #[test]
        fn inline_send() {
            conformance::inline_send(&$dev);
        }
        #[test]
        fn inline_sources_checked() {
            conformance::inline_sources_checked(&$dev);
        }
        #[test]
        fn rnr() {
            conformance::rnr(&$dev);
        }
        #[test]
        fn remote_access_errors_shm_memory() {
            conformance::remote_access_errors(&$dev, conformance::Mem::Shm);
        }
        #[test]
        fn every_opcode_every_size_device_memory() {
            if conformance::fake_device_ok(&$dev) {
                conformance::every_opcode_every_size(&$dev, conformance::Mem::Device);
            }
        }
        #[test]
        fn atomics_device_memory() {
            if conformance::fake_device_ok(&$dev) {
                conformance::atomics(&$dev, conformance::Mem::Device);
            }
        }
        #[test]
        fn scatter_gather_device_memory() {
            if conformance::fake_device_ok(&$dev) {
                conformance::scatter_gather(&$dev, conformance::Mem::Device);
            }
        }
        #[test]
        fn remote_access_errors_device_memory() {
            if conformance::fake_device_ok(&$dev) {
                conformance::remote_access_errors(&$dev, conformance::Mem::Device);
            }
        }
        #[test]
        fn every_opcode_every_size_device_ipc() {
            if conformance::fake_device_ok(&$dev) {
                conformance::every_opcode_every_size(&$dev, conformance::Mem::DeviceIpc);
            }
        }
        #[test]
        fn atomics_device_ipc() {
            if conformance::fake_device_ok(&$dev) {
                conformance::atomics(&$dev, conformance::Mem::DeviceIpc);
            }
        }
        #[test]
        fn remote_access_errors_device_ipc() {
            if conformance::fake_device_ok(&$dev) {
                conformance::remote_access_errors(&$dev, conformance::Mem::DeviceIpc);
            }
        }
        #[test]
        fn device_ipc_copy_failure_falls_back() {
            conformance::device_ipc_copy_failure_falls_back(&$dev);
        }
        #[test]
        fn device_mixed() {
            conformance::device_mixed(&$dev);
        }
        #[test]
        fn device_copies_batched() {
            conformance::device_copies_batched(&$dev);
        }
        #[test]
        fn reset_frees_the_send_queue() {
            if conformance::fake_device_ok(&$dev) {
                conformance::reset_frees_the_send_queue(&$dev);
            }
        }
        #[test]
        fn reset_and_reconnect_elsewhere() {
            conformance::reset_and_reconnect_elsewhere(&$dev);
        }
        #[test]
        fn fenced_wr_behind_a_dead_peer() {
            conformance::fenced_wr_behind_a_dead_peer(&$dev);
        }
        #[test]
        fn device_batch_executed_again_in_order() {
            conformance::device_batch_executed_again_in_order(&$dev);
        }
        #[test]
        fn remote_access_errors_heap_memory() {
            conformance::remote_access_errors(&$dev, conformance::Mem::Heap);
        }
        #[test]
        fn local_protection_error() {
            conformance::local_protection_error(&$dev);
        }
        #[test]
        fn send_too_long() {
            conformance::send_too_long(&$dev);
        }
        #[test]
        fn error_state_flushes() {
            conformance::error_state_flushes(&$dev);
        }
        #[test]
        fn unsignaled() {
            conformance::unsignaled(&$dev);
        }
        #[test]
        fn polled_completion_frees_its_slot() {
            conformance::polled_completion_frees_its_slot(&$dev);
        }
        #[test]
        fn cq_overflow() {
            conformance::cq_overflow(&$dev);
        }
        #[test]
        fn state_machine() {
            conformance::state_machine(&$dev);
        }
    };
}
