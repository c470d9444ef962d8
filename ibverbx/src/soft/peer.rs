//! Direct access to a same-host peer's memory: its key table and shared
//! segments mapped here (descriptors obtained through `attach`, never from
//! numbers the peer reported), or `process_vm_writev`/`readv` for its other
//! memory.
//!
//! A peer's device region (GPU memory) that exports itself (CUDA IPC) is
//! published with a segment holding the export, which this side maps like
//! any segment and opens with the process's [`DeviceIpc`](crate::DeviceIpc):
//! copies into and out of it are then this side's driver copies, not the
//! peer's engine's. Without an export, an opener, or when opening fails,
//! the region is staged through the connection.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use super::address::SoftAddress;
use super::attach::{self, Request, Status, Want};
use super::fence::{FenceGuard, FenceView};
use super::keytable::{KeyTableView, SlotData, TABLE_BYTES};
use crate::{AccessFlags, Error, Result, WcStatus};

/// A mapping of a peer's memfd.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a shared mapping accessed by raw pointer only.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `fd` after checking that it is the sealed segment `uid` of at
    /// least `min_len` bytes (sealed: its owner cannot shrink it under us).
    fn map(fd: &OwnedFd, uid: u64, min_len: usize, writable: bool) -> Result<Mapping> {
        let len = attach::check_segment(fd, uid, min_len).map_err(|e| Error::invalid("map peer segment", e))?;
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: mapping a valid fd of len bytes (sealed: it stays that
        // long); the result is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len.max(1), prot, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap peer segment"));
        }
        Ok(Mapping { ptr: p as *mut u8, len })
    }
}

impl Mapping {
    /// One past the mapping's last byte.
    pub(crate) fn end(&self) -> usize {
        self.ptr as usize + self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are a mapping we made; users hold an Arc while
        // they access it.
        unsafe { libc::munmap(self.ptr.cast(), self.len.max(1)) };
    }
}

/// What a direct access holds until its copy is done: the mapping it
/// copies into, and the peer's deregistration fence for the key.
#[derive(Debug, Default)]
pub(crate) struct Held {
    _map: Option<Arc<Mapping>>,
    _fence: Option<FenceGuard>,
}

impl Held {
    /// The mapping the access lies in, if any.
    pub(crate) fn mapping(&self) -> Option<Arc<Mapping>> {
        self._map.clone()
    }
}

/// Where a direct access goes. The copy must be done (synchronously)
/// while the value lives: it holds the key's fence.
#[derive(Debug)]
pub(crate) enum Direct {
    /// An address (as an integer, so that futures holding it stay `Send`)
    /// in a mapped segment, kept mapped by what is held.
    Ptr(usize, Held),
    /// An address in the peer process, reached by process_vm_*.
    Vm(u64, Held),
    /// In the peer's segment with this unique id, not mapped here yet:
    /// [`PeerMap::map_segment`] first (the engine does; a posting thread
    /// takes its slow path).
    Unmapped(u64),
    /// A peer's device region opened here, at this byte offset of it.
    Device(Arc<dyn crate::PeerDevice>, u64, Held),
    /// No direct path: send it through the connection.
    Staged,
}

const VM_UNKNOWN: u8 = 0;
const VM_OK: u8 = 1;
const VM_DENIED: u8 = 2;

/// Everything mapped from one peer context.
#[derive(Debug)]
pub(crate) struct PeerMap {
    /// The peer's pid as the kernel reported it on the attach socket.
    pid: u32,
    /// The peer context's QP listener name (its attach socket derives from it).
    unix: String,
    _table_map: Mapping,
    table: KeyTableView,
    /// Mapped segments by unique id; `None`: the peer would not give it
    /// (transfers to it are staged).
    segs: Mutex<HashMap<u64, Option<Arc<Mapping>>>>,
    vm: AtomicU8,
    /// The peer context's doorbell table, when it has one.
    doorbells: Option<Arc<Mapping>>,
    /// The peer context's deregistration fences.
    fence: FenceView,
    /// The peer's device regions opened here, by the unique id of the
    /// segment that holds each one's export; `None`: it would not open
    /// (transfers to it are staged).
    devs: Mutex<HashMap<u64, Option<Arc<dyn crate::PeerDevice>>>>,
}

impl PeerMap {
    /// Attaches to the context behind `remote` through its attach socket,
    /// presenting the token of its QP `qpn`. `pid` is the pid the kernel
    /// reported for that QP's connection: the attach socket must be served
    /// by the same process.
    pub(crate) async fn attach(remote: &SoftAddress, qpn: u32, pid: u32) -> Result<PeerMap> {
        let req = Request { qpn, token: remote.token, want: Want::Tables };
        let ans = attach::call(&remote.unix, &req, None).await.map_err(|e| Error::invalid("attach peer", e))?;
        if ans.pid != pid {
            return Err(Error::invalid(
                "attach peer",
                format!("the attach socket is served by pid {}, the QP connection by pid {pid}", ans.pid),
            ));
        }
        if ans.status != Status::Ok || ans.fds.is_empty() {
            return Err(Error::invalid("attach peer", format!("peer answered {:?}", ans.status)));
        }
        if ans.fds.len() < 2 {
            return Err(Error::invalid("attach peer", "the peer sent no fence table"));
        }
        let mut fds = ans.fds.into_iter();
        let kt = fds.next().expect("checked");
        let m = Mapping::map(&kt, remote.keytable_uid, TABLE_BYTES, false)?;
        let f =
            Arc::new(Mapping::map(&fds.next().expect("checked"), remote.fence_uid, super::fence::TABLE_BYTES, true)?);
        // SAFETY: a writable mapping of at least TABLE_BYTES, page aligned,
        // kept by the Arc handed over with it.
        let fence = unsafe { FenceView::new(f.ptr, f.clone()) };
        let doorbells = match fds.next() {
            Some(fd) => Some(Arc::new(Mapping::map(&fd, remote.doorbell_uid, super::doorbell::TABLE_BYTES, true)?)),
            None => None,
        };
        // SAFETY: the mapping is at least TABLE_BYTES long and page
        // aligned, and lives in the same struct as the view.
        let table = unsafe { KeyTableView::new(m.ptr) };
        Ok(PeerMap {
            pid,
            unix: remote.unix.clone(),
            _table_map: m,
            table,
            segs: Mutex::new(HashMap::new()),
            vm: AtomicU8::new(VM_UNKNOWN),
            doorbells,
            fence,
            devs: Mutex::new(HashMap::new()),
        })
    }

    /// The peer's pid (from the kernel, not from its endpoint).
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Drops the mappings of segments that no region the peer publishes
    /// lies in any more (the peer deregistered them): they would keep the
    /// peer's memory alive. Copies in progress hold their own reference.
    /// Returns how many were dropped.
    pub(crate) fn prune(&self) -> usize {
        let live = self.table.live_segments();
        self.devs.lock().unwrap_or_else(|e| e.into_inner()).retain(|uid, _| live.contains(uid));
        let mut segs = self.segs.lock().unwrap_or_else(|e| e.into_inner());
        let before = segs.len();
        segs.retain(|uid, _| live.contains(uid));
        before - segs.len()
    }

    /// Asks the peer for segment `uid` (presenting QP `qpn`'s token) and
    /// maps it; a refusal is remembered, and transfers to it are staged.
    /// Mappings of segments the peer no longer publishes are dropped first,
    /// so a peer that registers and frees memory over and over does not
    /// have it all kept mapped here. Returns whether `uid` is mapped now and
    /// how many stale mappings were dropped.
    pub(crate) async fn map_segment(&self, uid: u64, qpn: u32, token: [u8; 16]) -> (bool, usize) {
        let pruned = self.prune();
        let req = Request { qpn, token, want: Want::Segment(uid) };
        let mapped = match attach::call(&self.unix, &req, None).await {
            Ok(a) if a.pid != self.pid => Err(format!("answered by pid {}, not {}", a.pid, self.pid)),
            Ok(a) if a.status == Status::Ok && a.fds.len() == 1 => {
                Mapping::map(&a.fds[0], uid, 1, true).map(Arc::new).map_err(|e| e.to_string())
            }
            // Not registered (any more): ask again next time.
            Ok(a) if a.status == Status::NotFound => return (false, pruned),
            Ok(a) => Err(format!("peer answered {:?}", a.status)),
            Err(e) => Err(e),
        };
        let entry = match mapped {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::info!("cannot map peer segment {uid:#x} ({e}); staging transfers to it");
                None
            }
        };
        let ok = entry.is_some();
        self.segs.lock().unwrap_or_else(|e| e.into_inner()).entry(uid).or_insert(entry);
        (ok, pruned)
    }

    /// The peer's device region whose export segment `uid` is mapped at
    /// `m`, opened (once; a failure is remembered).
    fn device(&self, uid: u64, m: &Mapping, ipc: &dyn crate::DeviceIpc) -> Option<Arc<dyn crate::PeerDevice>> {
        let mut devs = self.devs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = devs.get(&uid) {
            return d.clone();
        }
        let opened = (|| {
            if m.len < 4 {
                return Err(format!("the export segment is {} bytes", m.len));
            }
            let mut n = [0u8; 4];
            // SAFETY: the mapping holds at least 4 bytes; copied out, never
            // borrowed (the peer may write its segment).
            unsafe { std::ptr::copy_nonoverlapping(m.ptr, n.as_mut_ptr(), 4) };
            let n = u32::from_ne_bytes(n) as usize;
            if n > crate::IPC_EXPORT_MAX || 4 + n > m.len {
                return Err(format!("the export's length {n} does not fit its segment of {} bytes", m.len));
            }
            let mut blob = vec![0u8; n];
            // SAFETY: 4 + n bytes lie in the mapping (checked above).
            unsafe { std::ptr::copy_nonoverlapping(m.ptr.add(4), blob.as_mut_ptr(), n) };
            ipc.open(&blob, self.pid)
        })();
        let entry = match opened {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::info!("cannot open the device memory of pid {} ({e}); staging transfers to it", self.pid);
                None
            }
        };
        devs.insert(uid, entry.clone());
        entry
    }

    /// Remembers that copies with `dev` (opened by [`device`](Self::device))
    /// fail here (say, GPUs that cannot reach each other): its region is
    /// staged from now on.
    pub(crate) fn device_failed(&self, dev: &Arc<dyn crate::PeerDevice>) {
        let mut devs = self.devs.lock().unwrap_or_else(|e| e.into_inner());
        for d in devs.values_mut() {
            if d.as_ref().is_some_and(|x| Arc::ptr_eq(x, dev)) {
                *d = None;
            }
        }
    }

    /// The event fd of the receive CQ of the peer's QP `qpn`, checked.
    pub(crate) async fn recv_cq_waker(&self, qpn: u32, token: [u8; 16]) -> Result<OwnedFd, String> {
        let req = Request { qpn, token, want: Want::RecvCqWaker };
        let a = attach::call(&self.unix, &req, None).await?;
        if a.pid != self.pid || a.status != Status::Ok || a.fds.len() != 1 {
            return Err(format!("peer answered {:?} (pid {})", a.status, a.pid));
        }
        let fd = a.fds.into_iter().next().expect("one descriptor");
        attach::check_eventfd(&fd)?;
        Ok(fd)
    }

    /// Gives the peer's QP `qpn` the event fd of our send CQ `cq`.
    pub(crate) async fn give_send_cq_waker(
        &self,
        qpn: u32,
        token: [u8; 16],
        cq: u64,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<(), String> {
        let req = Request { qpn, token, want: Want::SendCqWaker(cq) };
        let a = attach::call(&self.unix, &req, Some(fd)).await?;
        match a.status {
            Status::Ok if a.pid == self.pid => Ok(()),
            s => Err(format!("peer answered {s:?} (pid {})", a.pid)),
        }
    }

    /// The doorbell slot of the peer QP at `a`, mapped writable.
    pub(crate) fn doorbell(&self, a: &SoftAddress) -> Result<super::doorbell::SlotRef> {
        let Some(m) = self.doorbells.clone() else {
            return Err(Error::invalid("map peer doorbell", "the peer context has no doorbell table"));
        };
        if a.doorbell_slot == 0 {
            return Err(Error::invalid("map peer doorbell", "the peer QP has no doorbell slot"));
        }
        let base = m.ptr as *const u8;
        // SAFETY: the mapping is at least TABLE_BYTES long (checked when
        // mapped), page aligned, kept by the Arc.
        unsafe { super::doorbell::SlotRef::new(base, a.doorbell_slot, m) }
            .ok_or_else(|| Error::invalid("map peer doorbell", format!("slot {} is out of range", a.doorbell_slot)))
    }

    /// Validates `rkey` for `len` bytes at `raddr` with access `need` from a
    /// QP whose peer QP is in `pd`, and finds the direct path.
    pub(crate) fn resolve(
        &self,
        pd: u32,
        rkey: u32,
        raddr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<Direct, WcStatus> {
        // Entered before the key is checked, left when the caller's copy
        // is done: the owner's deregistration waits for it.
        let fence = self.fence.enter(rkey);
        let d: SlotData = self.table.lookup(rkey).ok_or(WcStatus::RemAccessErr)?;
        let access = AccessFlags::from_bits_truncate(d.access);
        let end = raddr.checked_add(len).ok_or(WcStatus::RemAccessErr)?;
        // The table is the peer's (shared memory it writes): its words are
        // checked, never trusted not to overflow.
        if d.pd != pd || !access.contains(need) || raddr < d.addr || d.addr.checked_add(d.len).is_none_or(|e| end > e) {
            return Err(WcStatus::RemAccessErr);
        }
        if d.is_device() {
            // Atomics, and regions without an export, go to the owner's
            // engine, which copies through its driver.
            let Some(ipc) = crate::device_mem::device_ipc() else { return Ok(Direct::Staged) };
            if d.seg_uid == 0 || need.contains(AccessFlags::REMOTE_ATOMIC) {
                return Ok(Direct::Staged);
            }
            let m = match self.segs.lock().unwrap_or_else(|e| e.into_inner()).get(&d.seg_uid) {
                Some(Some(m)) => m.clone(),
                Some(None) => return Ok(Direct::Staged),
                None => return Ok(Direct::Unmapped(d.seg_uid)),
            };
            let Some(dev) = self.device(d.seg_uid, &m, &**ipc) else { return Ok(Direct::Staged) };
            let off = raddr - d.addr;
            if off.checked_add(len).is_none_or(|e| e > dev.len()) {
                return Ok(Direct::Staged);
            }
            return Ok(Direct::Device(dev, off, Held { _map: Some(m), _fence: Some(fence) }));
        }
        if d.seg_uid != 0 {
            let m = match self.segs.lock().unwrap_or_else(|e| e.into_inner()).get(&d.seg_uid) {
                Some(Some(m)) => m.clone(),
                Some(None) => return Ok(Direct::Staged),
                None => return Ok(Direct::Unmapped(d.seg_uid)),
            };
            let Some(off) = d.seg_off.checked_add(raddr - d.addr) else { return Err(WcStatus::RemAccessErr) };
            if off.checked_add(len).is_none_or(|e| e > m.len as u64) {
                return Err(WcStatus::RemAccessErr);
            }
            // SAFETY: off+len is within the mapping (checked above).
            let p = unsafe { m.ptr.add(off as usize) };
            return Ok(Direct::Ptr(p as usize, Held { _map: Some(m), _fence: Some(fence) }));
        }
        if self.vm.load(Ordering::Relaxed) == VM_DENIED || need.contains(AccessFlags::REMOTE_ATOMIC) {
            return Ok(Direct::Staged);
        }
        Ok(Direct::Vm(raddr, Held { _map: None, _fence: Some(fence) }))
    }

    /// Where the region `rkey` registers (in a QP's peer PD `pd`) starts and
    /// how long it is, when `raddr` lies in it. Checked again by every
    /// access: the owner may deregister it at any time.
    pub(crate) fn key_extent(&self, pd: u32, rkey: u32, raddr: u64) -> Option<(u64, u64)> {
        let d: SlotData = self.table.lookup(rkey)?;
        (d.pd == pd && raddr >= d.addr && raddr - d.addr < d.len.max(1)).then_some((d.addr, d.len))
    }

    /// The key check of [`resolve`](Self::resolve) alone, for a region
    /// already mapped: enters the key's fence, checks `rkey`, the PD, the
    /// access and the bounds, and returns the fence (held until the copy is
    /// done) and the address of `raddr` in the segment `seg_uid` (as an
    /// offset), which the caller compares with its own mapping.
    pub(crate) fn check_key(
        &self,
        pd: u32,
        rkey: u32,
        raddr: u64,
        len: u64,
        need: AccessFlags,
    ) -> Result<(FenceGuard, u64, u64), WcStatus> {
        let fence = self.fence.enter(rkey);
        let d: SlotData = self.table.lookup(rkey).ok_or(WcStatus::RemAccessErr)?;
        let access = AccessFlags::from_bits_truncate(d.access);
        let end = raddr.checked_add(len).ok_or(WcStatus::RemAccessErr)?;
        // The table is the peer's (shared memory it writes): its words are
        // checked, never trusted not to overflow.
        if d.pd != pd || !access.contains(need) || raddr < d.addr || d.addr.checked_add(d.len).is_none_or(|e| end > e) {
            return Err(WcStatus::RemAccessErr);
        }
        let off = d.seg_off.checked_add(raddr - d.addr).ok_or(WcStatus::RemAccessErr)?;
        Ok((fence, d.seg_uid, off))
    }

    /// `process_vm_writev` (write) or `readv` (read) of the local pieces
    /// against `len` bytes at `raddr` in the peer. Returns false when the
    /// kernel refuses (the caller then stages), an error status on a fault.
    pub(crate) fn vm_copy(
        &self,
        write: bool,
        local: &[(usize, usize)],
        raddr: u64,
        len: usize,
    ) -> Result<bool, WcStatus> {
        let mut done = 0usize;
        // The local iovecs advance as partial transfers complete.
        let mut iov: Vec<libc::iovec> = local
            .iter()
            .filter(|(_, l)| *l > 0)
            .map(|&(p, l)| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: l })
            .collect();
        let mut first = 0usize;
        while done < len {
            let remote = libc::iovec { iov_base: (raddr as usize + done) as *mut libc::c_void, iov_len: len - done };
            // SAFETY: the local iovecs point into live, checked registrations;
            // the remote iovec is checked by the kernel against the peer.
            let r = unsafe {
                if write {
                    libc::process_vm_writev(
                        self.pid as i32,
                        iov[first..].as_ptr(),
                        (iov.len() - first) as u64,
                        &remote,
                        1,
                        0,
                    )
                } else {
                    libc::process_vm_readv(
                        self.pid as i32,
                        iov[first..].as_ptr(),
                        (iov.len() - first) as u64,
                        &remote,
                        1,
                        0,
                    )
                }
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                return match e.raw_os_error() {
                    Some(libc::EPERM) | Some(libc::ENOSYS) | Some(libc::EACCES) if done == 0 => {
                        tracing::debug!("process_vm_* refused ({e}); staging through the peer");
                        self.vm.store(VM_DENIED, Ordering::Relaxed);
                        Ok(false)
                    }
                    Some(libc::ESRCH) => Err(WcStatus::RetryExcErr),
                    _ => Err(WcStatus::RemAccessErr),
                };
            }
            if r == 0 {
                return Err(WcStatus::RemAccessErr);
            }
            self.vm.store(VM_OK, Ordering::Relaxed);
            let mut n = r as usize;
            done += n;
            while n > 0 && first < iov.len() {
                if n >= iov[first].iov_len {
                    n -= iov[first].iov_len;
                    first += 1;
                } else {
                    // SAFETY: advancing within the same iovec.
                    iov[first].iov_base = unsafe { (iov[first].iov_base as *mut u8).add(n) }.cast();
                    iov[first].iov_len -= n;
                    n = 0;
                }
            }
        }
        Ok(true)
    }
}
