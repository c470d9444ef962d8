//! Releasing the streams that wait on this rank's signal buffer, for a
//! watchdog (`watch` module) that found a peer gone or work overdue.
//!
//! A stream's `cuStreamWaitValue64` (or a signal kernel) on a slot of this
//! rank's signal buffer waits for a value a peer writes; a peer that died
//! or never makes the call leaves it waiting forever, and with it every
//! synchronize, free and drop behind it. The buffer is host memory, so a
//! host thread can end those waits without any driver call: it stores
//! `u64::MAX` into every counting and value slot (every wait is "at
//! least"). The window is *released* from then on: its host waits and
//! stream operations fail with the reason instead of reading the poisoned
//! slots as signals.
//!
//! A released stream runs on through the work queued behind its waits,
//! writing what it computed (garbage) and its signals into its peers'
//! memory. So before poisoning its own slots, the releasing rank marks
//! itself in every same-host peer's *control* slot (the last of each
//! buffer): a peer's watchdog fails its own calls when it sees the mark
//! (and releases in turn), and counts as sound only those of its calls
//! that had finished before it last saw no mark.
//!
//! [`PeerWatch`] tells the watchdog which peer is gone (its connection
//! broke: a same-host peer's death closes it).
//!
//! Kernel waits (the signal kernels of CUDA graphs, and of devices without
//! stream memory operations) are queued by no host call the watchdog
//! could learn of when they replay; each first writes the value it waits
//! for into this rank's *want* word for its slot (host memory the device
//! maps). A slot whose want is above its value has a kernel waiting on it
//! now ([`StreamRelease::kernel_waits_in_flight`]): whose signal it waits
//! for is known (a counting slot's peer, or what the caller says of a
//! value slot), so a gone peer is a wait that never ends — a peer that
//! left normally had its signals land before its connections closed — and
//! one that does not move for the timeout is overdue.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use rmacomm_transport::{MappedBuffer, RdmaMemory, RdmaTransport, TransportError};

use super::Window;
use crate::error::{Error, Result};
use crate::unified::{Slot, SLOT};

/// Ends every stream wait on one rank's signal buffer (module docs);
/// cheap to clone, usable from any thread (no driver call).
#[derive(Debug, Clone)]
pub struct StreamRelease {
    mem: Arc<RdmaMemory>,
    /// Counting and value slots (the control slot follows them).
    slots: usize,
    released: Arc<OnceLock<Error>>,
    /// Per peer: signals waited for (the window's count).
    consumed: Arc<Vec<std::sync::atomic::AtomicU64>>,
    /// Per peer: its signal buffer mapped here (same-host pairs).
    peers: Vec<Option<Arc<MappedBuffer>>>,
    me: usize,
    /// Per slot: what the last kernel wait on it waited for (module docs),
    /// with a device registration.
    wants: Option<Arc<super::device::PinnedWords>>,
}

impl StreamRelease {
    /// Marks the window released for `why` (the first reason stays), marks
    /// this rank in every same-host peer's control slot, then stores
    /// `u64::MAX` into every counting and value slot of its own buffer,
    /// waking host sleepers. Peers may still write their counts over it:
    /// call it again until the streams have drained.
    pub fn release(&self, why: &Error) {
        let _ = self.released.set(why.clone());
        let control = SLOT * self.slots;
        for (_, m) in self.peers.iter().enumerate().filter(|(p, _)| *p != self.me) {
            let Some(m) = m else { continue };
            if let Ok(slot) = Slot::at(control, |o| m.atomic_u64(o), |o| m.atomic_u32(o)) {
                // The lowest rank's mark stays (any says enough).
                if slot.value.load(Ordering::Acquire) == 0 {
                    slot.set(self.me as u64 + 1);
                }
            }
        }
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

    /// The peer that released its streams and marked this rank (module
    /// docs), if one did.
    pub fn released_by(&self) -> Option<usize> {
        let v = self.mem.atomic_u64(SLOT * self.slots).map_or(0, |w| w.load(Ordering::SeqCst));
        (v != 0).then(|| (v - 1) as usize)
    }

    /// The same-host peers from which fewer signals have arrived than this
    /// rank has taken or queued waits for, or than a kernel waits for now
    /// (module docs): whom its waits wait on now.
    pub fn signals_missing(&self) -> Vec<usize> {
        (0..self.peers.len())
            .filter(|&p| p != self.me && self.peers[p].is_some())
            .filter(|&p| {
                // What is waited for first, then what arrived (which only
                // grows): a wait queued between the two reads is not taken
                // for one behind.
                let (consumed, want) = (self.consumed[p].load(Ordering::Acquire), self.want(p));
                let have = self.slot_value(p);
                have < consumed || have < want
            })
            .collect()
    }

    /// Whether a kernel waits on value slot `disp` now (module docs): for
    /// whoever knows whose signal that slot waits for.
    pub fn value_waited(&self, disp: usize) -> bool {
        let Some(i) = self.peers.len().checked_add(disp) else { return false };
        // The want first (as in `signals_missing`).
        let want = self.want(i);
        i < self.slots && self.slot_value(i) < want
    }

    /// The slots (counting, then value slots) a kernel waits on now, each
    /// with the value it waits for (module docs).
    pub fn kernel_waits_in_flight(&self) -> Vec<(usize, u64)> {
        if self.wants.is_none() {
            return Vec::new();
        }
        // The want first (as in `signals_missing`).
        (0..self.slots).map(|i| (i, self.want(i))).filter(|&(i, want)| self.slot_value(i) < want).collect()
    }

    /// Whether any kernel has waited on this rank's slots (module docs):
    /// then the watchdog looks often even with nothing issued.
    pub fn kernel_waits_seen(&self) -> bool {
        (0..self.slots).any(|i| self.want(i) > 0)
    }

    /// With a device registration, where kernel waits write what they wait
    /// for (module docs).
    pub(super) fn kernel_waits(mut self, wants: Arc<super::device::PinnedWords>) -> StreamRelease {
        self.wants = Some(wants);
        self
    }

    /// Slot `i` of this rank's buffer (counting, then value slots) now.
    pub(super) fn slot_value(&self, i: usize) -> u64 {
        self.mem.atomic_u64(SLOT * i).map_or(u64::MAX, |w| w.load(Ordering::Acquire))
    }

    /// What the last kernel wait on slot `i` waited for (0: none).
    fn want(&self, i: usize) -> u64 {
        self.wants.as_ref().filter(|w| i < w.len()).map_or(0, |w| w.word(i).load(Ordering::Acquire))
    }

    /// Value slot `disp` of this rank's buffer (after the counting slots),
    /// as it stands.
    pub fn value(&self, disp: usize) -> Option<u64> {
        let i = self.peers.len().checked_add(disp).filter(|&i| i < self.slots)?;
        self.mem.atomic_u64(SLOT * i).ok().map(|w| w.load(Ordering::Acquire))
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
        self.gone_among(&(0..self.links.len()).collect::<Vec<_>>())
    }

    /// The first of `peers` whose connection has failed, and how.
    pub fn gone_among(&self, peers: &[usize]) -> Option<(usize, TransportError)> {
        peers.iter().filter(|p| **p != self.me).find_map(|&p| self.links.get(p)?.error().map(|e| (p, e)))
    }
}

impl Window {
    /// A handle that releases the streams waiting on this rank's signal
    /// buffer (module docs).
    pub fn stream_release(&self) -> StreamRelease {
        StreamRelease {
            mem: self.signal_dst.clone(),
            slots: self.size() + self.value_slots,
            released: self.released.clone(),
            consumed: self.consumed.clone(),
            peers: self.signal_maps.clone(),
            me: self.rank(),
            wants: self.dev.as_ref().map(|d| d.want_words()),
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
