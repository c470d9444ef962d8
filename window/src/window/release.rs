//! Releasing the streams that wait on this rank's signal buffer, for a
//! watchdog (GpuComm's) that found a peer gone or a call overdue.
//!
//! A stream's `cuStreamWaitValue64` (or a signal kernel) on a slot of this
//! rank's signal buffer waits for a value a peer writes; a peer that died
//! or never makes the call leaves it waiting forever, and with it every
//! synchronize, free and drop behind it. The buffer is host memory, so a
//! host thread can end those waits without any driver call: it stores
//! `u64::MAX` into every slot (every wait is "at least"). The window is
//! *released* from then on: its host waits and stream operations fail with
//! the reason instead of reading the poisoned slots as signals.
//!
//! [`PeerWatch`] tells the watchdog which peer is gone (its connection
//! broke: a same-host peer's death closes it).

use std::sync::{Arc, OnceLock};

use rmacomm_transport::{RdmaMemory, RdmaTransport, TransportError};

use super::Window;
use crate::error::{Error, Result};
use crate::unified::{Slot, SLOT};

/// Ends every stream wait on one rank's signal buffer (module docs);
/// cheap to clone, usable from any thread (no driver call).
#[derive(Debug, Clone)]
pub struct StreamRelease {
    mem: Arc<RdmaMemory>,
    slots: usize,
    released: Arc<OnceLock<Error>>,
    /// Per peer: signals waited for (the window's count), and whether the
    /// pair is UNIFIED.
    consumed: Arc<Vec<std::sync::atomic::AtomicU64>>,
    unified: Vec<bool>,
}

impl StreamRelease {
    /// Marks the window released for `why` (the first reason stays) and
    /// stores `u64::MAX` into every slot of its signal buffer, waking host
    /// sleepers. Peers may still write their counts over it: call it again
    /// until the streams have drained.
    pub fn release(&self, why: &Error) {
        let _ = self.released.set(why.clone());
        for i in 0..self.slots {
            if let Ok(slot) = Slot::at(SLOT * i, |o| self.mem.atomic_u64(o), |o| self.mem.atomic_u32(o)) {
                slot.set(u64::MAX);
            }
        }
    }

    /// Why the window was released, if it was.
    pub fn released(&self) -> Option<&Error> {
        self.released.get()
    }

    /// The UNIFIED peers from which fewer signals have arrived than this
    /// rank has taken or queued waits for: whom its waits wait on now.
    pub fn signals_missing(&self) -> Vec<usize> {
        use std::sync::atomic::Ordering;
        (0..self.unified.len())
            .filter(|&p| self.unified[p])
            .filter(|&p| {
                let have = self.mem.atomic_u64(SLOT * p).map_or(u64::MAX, |w| w.load(Ordering::Acquire));
                have < self.consumed[p].load(Ordering::Acquire)
            })
            .collect()
    }

    /// Value slot `disp` of this rank's buffer (after the counting slots),
    /// as it stands.
    pub fn value(&self, disp: usize) -> Option<u64> {
        let n = self.unified.len();
        (n + disp < self.slots)
            .then(|| self.mem.atomic_u64(SLOT * (n + disp)).ok().map(|w| w.load(std::sync::atomic::Ordering::Acquire)))
            .flatten()
    }
}

/// Which of a window's peers is gone (module docs); usable from any
/// thread.
#[derive(Debug, Clone)]
pub struct PeerWatch {
    links: Vec<Arc<RdmaTransport>>,
    me: usize,
}

impl PeerWatch {
    /// The first peer whose connection has failed, and how.
    pub fn gone(&self) -> Option<(usize, TransportError)> {
        self.links.iter().enumerate().filter(|(p, _)| *p != self.me).find_map(|(p, l)| l.error().map(|e| (p, e)))
    }
}

impl Window {
    /// A handle that releases the streams waiting on this rank's signal
    /// buffer (module docs).
    pub fn stream_release(&self) -> StreamRelease {
        let me = self.rank();
        StreamRelease {
            mem: self.signal_dst.clone(),
            slots: self.size() + self.value_slots,
            released: self.released.clone(),
            consumed: self.consumed.clone(),
            unified: (0..self.size()).map(|p| p != me && self.signal_maps[p].is_some()).collect(),
        }
    }

    /// A handle that tells which peer is gone (module docs).
    pub fn peer_watch(&self) -> PeerWatch {
        PeerWatch { links: self.links.iter().map(|l| l.out.clone()).collect(), me: self.rank() }
    }

    /// Fails `op` with `peer` once the window was released.
    pub(super) fn not_released(&self, op: &'static str, peer: usize) -> Result<()> {
        match self.released.get() {
            Some(why) => Err(Error::StreamFailed { op, peer, earlier: Box::new(why.clone()) }),
            None => Ok(()),
        }
    }
}
