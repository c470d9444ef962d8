//! The soft provider's side of [`RemoteMapping`](crate::RemoteMapping): a
//! peer's region in one of its sealed segments, mapped here through the
//! attach socket, and checked against the peer's key table (under its
//! deregistration fence) by every copy.

use std::sync::Arc;

use super::peer::{Direct, Mapping, PeerMap};
use crate::{AccessFlags, Error, Result};

/// What a connected soft QP knows about a same-host peer: its mapped
/// tables, its PD, and the QP (number and token) that vouches for us.
#[derive(Debug)]
pub(crate) struct MapTarget {
    pub(crate) peer: Arc<PeerMap>,
    pub(crate) remote_pd: u32,
    pub(crate) peer_qpn: u32,
    pub(crate) token: [u8; 16],
}

/// A mapped peer region.
#[derive(Debug)]
pub(crate) struct PeerRegion {
    target: Arc<MapTarget>,
    /// Keeps the segment mapped.
    map: Arc<Mapping>,
    pub(crate) base: usize,
    pub(crate) len: usize,
    pub(crate) rkey: u32,
    pub(crate) addr: u64,
    /// Set once the owner's key was seen to allow remote atomics.
    atomics_ok: std::sync::atomic::AtomicBool,
    /// The segment the region lies in, and where the region starts in it.
    seg_uid: u64,
    seg_off: u64,
}

impl PeerRegion {
    /// Maps `len` bytes at `addr` (asking the peer for its segment when it
    /// is not mapped here yet); with no `len`, all of the region `rkey`
    /// registers, found through `addr`, a byte in it. `None`: the region is
    /// not in a shared segment, or the peer would not share it.
    pub(crate) async fn map(
        target: Arc<MapTarget>,
        rkey: u32,
        addr: u64,
        len: Option<u64>,
    ) -> Result<Option<PeerRegion>> {
        const OP: &str = "map_remote";
        let need = AccessFlags::REMOTE_READ;
        let (addr, len) = match len {
            Some(len) => (addr, len),
            None => target.peer.key_extent(target.remote_pd, rkey, addr).ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!(
                        "the peer (pid {}) registers no region holding {addr:#x} under key {rkey:#x} in this QP's PD",
                        target.peer.pid()
                    ),
                )
            })?,
        };
        let mut asked = false;
        loop {
            let d = target.peer.resolve(target.remote_pd, rkey, addr, len.max(1), need).map_err(|st| {
                Error::invalid(
                    OP,
                    format!(
                        "the peer (pid {}) does not register {len} bytes at {addr:#x} under key {rkey:#x} for \
                         remote reads in this QP's PD ({st})",
                        target.peer.pid()
                    ),
                )
            })?;
            match d {
                Direct::Ptr(p, held) => {
                    let Some(map) = held.mapping() else { return Ok(None) };
                    let t = &target;
                    let Ok((_fence, seg_uid, seg_off)) = t.peer.check_key(t.remote_pd, rkey, addr, len.max(1), need)
                    else {
                        return Ok(None);
                    };
                    return Ok(Some(PeerRegion {
                        target,
                        map,
                        base: p,
                        len: len as usize,
                        rkey,
                        addr,
                        atomics_ok: Default::default(),
                        seg_uid,
                        seg_off,
                    }));
                }
                Direct::Unmapped(uid) if !asked => {
                    asked = true;
                    target.peer.map_segment(uid, target.peer_qpn, target.token).await;
                }
                _ => return Ok(None),
            }
        }
    }

    /// Checks that the owner still registers `n` bytes at `offset` with
    /// `need`, and returns their address here and what holds the fence
    /// until the caller's copy is done.
    pub(crate) fn check(
        &self,
        op: &'static str,
        offset: usize,
        n: usize,
        need: AccessFlags,
    ) -> Result<(usize, super::fence::FenceGuard)> {
        let end = offset.checked_add(n).filter(|&e| e <= self.len);
        if end.is_none() {
            return Err(Error::invalid(
                op,
                format!("{offset}+{n} is outside the mapped region of {} bytes (key {:#x})", self.len, self.rkey),
            ));
        }
        let raddr = self.addr + offset as u64;
        let t = &self.target;
        match t.peer.check_key(t.remote_pd, self.rkey, raddr, n.max(1) as u64, need) {
            Ok((fence, uid, off)) if uid == self.seg_uid && off == self.seg_off + offset as u64 => {
                Ok((self.base + offset, fence))
            }
            Ok(_) => Err(Error::InvalidState {
                verb: op,
                reason: format!("the peer (pid {}) moved the region of key {:#x}", t.peer.pid(), self.rkey),
            }),
            Err(st) => Err(Error::InvalidState {
                verb: op,
                reason: format!(
                    "the peer (pid {}) no longer registers key {:#x} at {raddr:#x}+{n} with {need:?} access \
                     (deregistered?): {st}; nothing was copied",
                    t.peer.pid(),
                    self.rkey
                ),
            }),
        }
    }

    /// Copies `n` bytes from `src` into the region at `offset`.
    ///
    /// # Safety
    /// `src..src+n` must be readable for the call.
    pub(crate) unsafe fn copy_in(
        &self,
        op: &'static str,
        offset: usize,
        src: *const u8,
        n: usize,
        stream: bool,
    ) -> Result<()> {
        let (p, _held) = self.check(op, offset, n, AccessFlags::REMOTE_WRITE)?;
        // SAFETY: p..p+n was checked against the peer's live key and lies in
        // our mapping (held); src is the caller's.
        unsafe { super::copy::copy(p as *mut u8, src, n, stream) };
        Ok(())
    }

    /// Copies `n` bytes of the region at `offset` into `dst`.
    ///
    /// # Safety
    /// `dst..dst+n` must be writable for the call and not borrowed.
    pub(crate) unsafe fn copy_out(
        &self,
        op: &'static str,
        offset: usize,
        dst: *mut u8,
        n: usize,
        stream: bool,
    ) -> Result<()> {
        let (p, _held) = self.check(op, offset, n, AccessFlags::REMOTE_READ)?;
        // SAFETY: as in copy_in, directions swapped.
        unsafe { super::copy::copy(dst, p as *const u8, n, stream) };
        Ok(())
    }

    /// The address of the `size`-byte word at `offset`, aligned and inside
    /// the region, registered for remote atomics. The key is checked on the
    /// first call only: a word handed out stays in our mapping whatever the
    /// owner does later (atomics on it are memory-safe; what the owner no
    /// longer registers it no longer reads), so signals pay no key lookup.
    pub(crate) fn word(&self, op: &'static str, offset: usize, size: usize) -> Result<usize> {
        use std::sync::atomic::Ordering;
        let p = if self.atomics_ok.load(Ordering::Relaxed) {
            if offset.checked_add(size).is_none_or(|e| e > self.len) {
                return Err(Error::invalid(
                    op,
                    format!(
                        "{offset}+{size} is outside the mapped region of {} bytes (key {:#x})",
                        self.len, self.rkey
                    ),
                ));
            }
            self.base + offset
        } else {
            let (p, _held) = self.check(op, offset, size, AccessFlags::REMOTE_ATOMIC)?;
            self.atomics_ok.store(true, Ordering::Relaxed);
            p
        };
        if !p.is_multiple_of(size) {
            return Err(Error::invalid(op, format!("offset {offset} is not {size}-byte aligned in the peer's region")));
        }
        debug_assert!(p + size <= self.map.end());
        Ok(p)
    }
}
