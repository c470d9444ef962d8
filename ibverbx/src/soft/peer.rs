//! Direct access to a same-host peer's memory: its key table and shared
//! segments mapped here, or `process_vm_writev`/`readv` for its other
//! memory.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use super::keytable::{KeyTableView, SlotData, TABLE_BYTES};
use crate::endpoint::SoftAddress;
use crate::shm::segment_name;
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
    /// Maps the memfd `fd` of process `pid`, after checking that it is the
    /// segment `uid` (fd numbers are reused).
    fn open(pid: u32, fd: i32, uid: u64, writable: bool) -> Result<Mapping> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let target = std::fs::read_link(&path).map_err(|e| Error::os("map peer segment", e))?;
        if !target.to_string_lossy().contains(&segment_name(uid)) {
            return Err(Error::invalid("map peer segment", format!("{path} is not segment {uid:#x}")));
        }
        let c = CString::new(path).expect("no NUL");
        let flags = if writable { libc::O_RDWR } else { libc::O_RDONLY };
        // SAFETY: c is a valid C string.
        let f = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
        if f < 0 {
            return Err(Error::last_os("open peer segment"));
        }
        // SAFETY: f is a valid fd; st is written by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(f, &mut st) } != 0 {
            let e = Error::last_os("fstat peer segment");
            // SAFETY: f is ours.
            unsafe { libc::close(f) };
            return Err(e);
        }
        let len = st.st_size as usize;
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: mapping a valid fd of len bytes; checked below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len.max(1), prot, libc::MAP_SHARED, f, 0) };
        // SAFETY: the mapping holds its own reference to the file.
        unsafe { libc::close(f) };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os("mmap peer segment"));
        }
        Ok(Mapping { ptr: p as *mut u8, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are a mapping we made; users hold an Arc while
        // they access it.
        unsafe { libc::munmap(self.ptr.cast(), self.len.max(1)) };
    }
}

/// Where a direct access goes.
#[derive(Debug)]
pub(crate) enum Direct {
    /// An address (as an integer, so that futures holding it stay `Send`)
    /// in a mapped segment, kept mapped by the Arc.
    Ptr(usize, Arc<Mapping>),
    /// An address in the peer process, reached by process_vm_*.
    Vm(u64),
    /// No direct path: send it through the connection.
    Staged,
}

const VM_UNKNOWN: u8 = 0;
const VM_OK: u8 = 1;
const VM_DENIED: u8 = 2;

/// Everything mapped from one peer context.
#[derive(Debug)]
pub(crate) struct PeerMap {
    pid: u32,
    _table_map: Mapping,
    table: KeyTableView,
    segs: Mutex<HashMap<u64, Arc<Mapping>>>,
    vm: AtomicU8,
    /// The peer context's doorbell table, mapped on first use.
    doorbells: Mutex<Option<Arc<Mapping>>>,
}

impl PeerMap {
    pub(crate) fn open(a: &SoftAddress) -> Result<PeerMap> {
        let m = Mapping::open(a.pid, a.keytable_fd, a.keytable_uid, false)?;
        if m.len < TABLE_BYTES {
            return Err(Error::invalid("map peer key table", "key table is too short"));
        }
        // SAFETY: the mapping is TABLE_BYTES long and page aligned, and
        // lives in the same struct as the view.
        let table = unsafe { KeyTableView::new(m.ptr) };
        Ok(PeerMap {
            pid: a.pid,
            _table_map: m,
            table,
            segs: Mutex::new(HashMap::new()),
            vm: AtomicU8::new(VM_UNKNOWN),
            doorbells: Mutex::new(None),
        })
    }

    /// The peer's pid.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The doorbell slot of the peer QP at `a`, mapped writable.
    pub(crate) fn doorbell(&self, a: &SoftAddress) -> Result<super::doorbell::SlotRef> {
        if a.doorbell_fd < 0 || a.doorbell_slot == 0 {
            return Err(Error::invalid("map peer doorbell", "the peer QP has no doorbell slot"));
        }
        let mut g = self.doorbells.lock().unwrap_or_else(|e| e.into_inner());
        let m = match g.as_ref() {
            Some(m) => m.clone(),
            None => {
                let m = Arc::new(Mapping::open(self.pid, a.doorbell_fd, a.doorbell_uid, true)?);
                if m.len < super::doorbell::TABLE_BYTES {
                    return Err(Error::invalid("map peer doorbell", "doorbell table is too short"));
                }
                *g = Some(m.clone());
                m
            }
        };
        let base = m.ptr as *const u8;
        // SAFETY: the mapping is TABLE_BYTES long, page aligned, kept by the Arc.
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
        let d: SlotData = self.table.lookup(rkey).ok_or(WcStatus::RemAccessErr)?;
        let access = AccessFlags::from_bits_truncate(d.access);
        let end = raddr.checked_add(len).ok_or(WcStatus::RemAccessErr)?;
        if d.pd != pd || !access.contains(need) || raddr < d.addr || end > d.addr + d.len {
            return Err(WcStatus::RemAccessErr);
        }
        if d.seg_uid != 0 {
            let mut segs = self.segs.lock().unwrap_or_else(|e| e.into_inner());
            let m = match segs.get(&d.seg_uid) {
                Some(m) => m.clone(),
                None => match Mapping::open(self.pid, d.seg_fd, d.seg_uid, true) {
                    Ok(m) => {
                        let m = Arc::new(m);
                        segs.insert(d.seg_uid, m.clone());
                        m
                    }
                    Err(e) => {
                        tracing::debug!("cannot map peer segment, staging instead: {e}");
                        return Ok(Direct::Staged);
                    }
                },
            };
            let off = d.seg_off + (raddr - d.addr);
            if off.checked_add(len).is_none_or(|e| e > m.len as u64) {
                return Err(WcStatus::RemAccessErr);
            }
            // SAFETY: off+len is within the mapping (checked above).
            let p = unsafe { m.ptr.add(off as usize) };
            return Ok(Direct::Ptr(p as usize, m));
        }
        if self.vm.load(Ordering::Relaxed) == VM_DENIED || need.contains(AccessFlags::REMOTE_ATOMIC) {
            return Ok(Direct::Staged);
        }
        Ok(Direct::Vm(raddr))
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
