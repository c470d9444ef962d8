//! The ctran form of the window (torchcomms' ncclx/ctran feature set):
//! `allocate` (a window owning its buffer and an array of 64-bit value
//! signal slots), value signals with SET or ADD, `wait_signal_until` with
//! NVSHMEM's comparisons, `get_tensor`, `get_size`, `get_device`.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rmacomm_transport::{RdmaMemory, TransportError};

use super::{InFlight, MappedTensor, Window, WindowOptions};
use crate::error::{Error, Result};
use crate::group::Group;
use crate::unified::{Slot, SLICE, SLOT};
use crate::work::Work;

/// What a value signal does to the destination's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalOp {
    /// The slot becomes the value.
    Set,
    /// The value is added to the slot (atomically, wrapping).
    Add,
}

/// How [`Window::wait_signal_until`] compares the slot with the value
/// (NVSHMEM's `NVSHMEM_CMP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    /// slot == value
    Eq,
    /// slot != value
    Ne,
    /// slot >= value
    Ge,
    /// slot > value
    Gt,
    /// slot <= value
    Le,
    /// slot < value
    Lt,
}

impl Cmp {
    /// Whether `slot` satisfies the comparison with `value`.
    pub fn holds(self, slot: u64, value: u64) -> bool {
        match self {
            Cmp::Eq => slot == value,
            Cmp::Ne => slot != value,
            Cmp::Ge => slot >= value,
            Cmp::Gt => slot > value,
            Cmp::Le => slot <= value,
            Cmp::Lt => slot < value,
        }
    }
}

/// How long a waiter sleeps at most between looks when a writer may be
/// SEPARATE: an RDMA write from another host changes the slot without
/// waking anyone.
pub(super) const SEPARATE_SLICE: Duration = Duration::from_micros(200);

impl Window {
    /// ctran's `window_allocate`: a window over `group` that owns a zeroed
    /// buffer of `size_bytes` bytes (registered, byte elements, so puts'
    /// offsets are byte displacements) and `signal_slots` 64-bit value
    /// signal slots. Collective; sizes may differ per rank (0 too: a
    /// window whose buffer no put or get reaches), `signal_slots` may not.
    /// A rank whose buffer cannot be allocated fails with the reason, and
    /// its peers at once with [`Error::PeerFailed`] naming it.
    pub fn allocate(group: &Group, size_bytes: usize, signal_slots: usize, opts: WindowOptions) -> Result<Window> {
        let mut w = Window::new(group, opts.signal_slots(signal_slots))?;
        // An allocation is never empty; the registration may be.
        let mem = w.alloc(size_bytes.max(1));
        w.register_buffer(mem, size_bytes)?;
        Ok(w)
    }

    /// The registration [`allocate`](Self::allocate) makes, over memory
    /// the caller allocated (collective): the first `size_bytes` bytes of
    /// `mem` as byte elements, `size_bytes` 0 allowed (no put or get reaches
    /// it); `mem` may be the error that kept this rank from allocating it,
    /// which every peer then hears as [`Error::PeerFailed`] naming this rank.
    pub fn register_buffer(&mut self, mem: Result<RdmaMemory>, size_bytes: usize) -> Result<()> {
        self.register_offer("window_allocate", mem, size_bytes, 1, true)
    }

    /// Bytes this rank registered (ctran's `get_size`); 0 when nothing is.
    pub fn get_size(&self) -> usize {
        match (&self.reg, &self.dev) {
            (Some(r), _) => r.peers[self.rank()].0.len as usize,
            (None, Some(d)) => d.registered_len(self.rank()),
            (None, None) => 0,
        }
    }

    /// Where the window's memory lives (ctran's `get_device`): `"cuda"`
    /// while device memory is registered, else `"cpu"`.
    pub fn get_device(&self) -> &'static str {
        if self.dev.is_some() {
            "cuda"
        } else {
            "cpu"
        }
    }

    /// Value-signal slots per rank.
    pub fn signal_slots(&self) -> usize {
        self.value_slots
    }

    /// ctran's `get_tensor`: `len` bytes at byte `offset` of `rank`'s
    /// buffer as a local view aliasing it (this rank's own, or a UNIFIED
    /// peer's); for a SEPARATE peer an [`Error::Unsupported`] naming it.
    pub fn get_tensor(&self, rank: usize, offset: usize, len: usize) -> Result<MappedTensor<'_>> {
        const OP: &str = "get_tensor";
        let t = self.map_remote_tensor(rank)?;
        t.slice(offset, len).ok_or_else(|| Error::Bounds {
            op: OP,
            peer: rank,
            reason: format!("{len} bytes at byte {offset} end past rank {rank}'s buffer of {} bytes", t.len()),
        })
    }

    pub(super) fn value_slot_index(&self, op: &'static str, peer: usize, disp: usize) -> Result<usize> {
        if disp >= self.value_slots {
            return Err(Error::Bounds {
                op,
                peer,
                reason: format!("signal slot {disp} of a window with {} value-signal slots", self.value_slots),
            });
        }
        Ok(SLOT * (self.size() + disp))
    }

    /// ctran's `signal(signal_disp, value, dst_rank, op)`: sets (`Set`) or
    /// adds to (`Add`) `dst_rank`'s value slot `signal_disp`, after every
    /// put this rank issued to `dst_rank` before the call has been placed.
    ///
    /// UNIFIED pairs: an atomic store or add (release) on the mapped slot,
    /// which wakes a sleeping waiter. SEPARATE pairs: an 8-byte write into
    /// this rank's counting slot at the peer, waited for (the fence: every
    /// earlier put is placed once it completes), then an RDMA write of the
    /// value (`Set`) or an RDMA fetch-and-add (`Add`); the waiter polls.
    /// Value signals to one peer take effect in call order (async ones
    /// too: each starts when the one before has ended).
    pub fn signal_value(
        &self,
        signal_disp: usize,
        value: u64,
        dst_rank: usize,
        op: SignalOp,
        async_op: bool,
    ) -> Result<Work<'_>> {
        const OP: &str = "signal_value";
        self.check_rank(OP, dst_rank)?;
        let off = self.value_slot_index(OP, dst_rank, signal_disp)?;
        if let Some(m) = &self.signal_maps[dst_rank] {
            let r = self.peer_alive(dst_rank).and_then(|()| Slot::at(off, |o| m.atomic_u64(o), |o| m.atomic_u32(o)));
            let r = r.map(|slot| match op {
                SignalOp::Set => slot.set(value),
                SignalOp::Add => slot.add(value),
            });
            return self.done(OP, dst_rank, r, async_op);
        }
        let t = self.links[dst_rank].out.clone();
        let fence_slot = self.signal_slots[dst_rank];
        let slot = self.signal_bufs[dst_rank].slice(off as u64, 8).expect("checked at Window::new");
        let (timeout, fence_src) = (self.timeout, self.signal_src.clone());
        // The timeout counts from the call, its wait for the signals queued
        // before it included (they did add up: k queued signals to a
        // stalled peer made the next one wait k + 1 timeouts).
        let at = tokio::time::Instant::from_std(ibverbx::deadline_after(timeout));
        let in_order = self.in_order;
        let counter = InFlight::enter(&self.signals_in_flight);
        // In call order: this signal starts once the previous one to this
        // peer has ended (its value placed, or failed).
        let (done, ended) = tokio::sync::oneshot::channel::<()>();
        let previous = self.value_chain[dst_rank].lock().unwrap_or_else(|e| e.into_inner()).replace(ended);
        let (tell, told) = tokio::sync::oneshot::channel::<Result<(), TransportError>>();
        self.rt.spawn(async move {
            let _counter = counter;
            // Held until this task ends: the next signal waits for it.
            let _done = done;
            if let Some(mut previous) = previous {
                if tokio::time::timeout_at(at, &mut previous).await.is_err() {
                    // Failed now, unwritten; the chain still waits for the
                    // one before, so that later values land after it.
                    let _ = tell.send(Err(TransportError::Timeout { op: OP, after: timeout }));
                    let _ = previous.await;
                    return;
                }
            }
            let left = || Some(at.saturating_duration_since(tokio::time::Instant::now()));
            let r = async {
                // The value's own registered word (SEPARATE pairs only:
                // another host, where a registration is cheap beside the
                // round trip), made now: one per signal under way, not one
                // per signal queued (each held a descriptor).
                let word = RdmaMemory::alloc_for(&t, 8)?;
                word.write_from(0, &value.to_le_bytes())?;
                if !in_order {
                    // Striped connections place writes in any order: a
                    // write waited for first proves every earlier put
                    // placed.
                    t.write_with_timeout(fence_src.view(0, 8)?, &fence_slot, false, left()).await?;
                }
                match op {
                    SignalOp::Set => t.write_with_timeout(word.view(0, 8)?, &slot, false, left()).await,
                    SignalOp::Add => t.fetch_add(word.view_mut(0, 8)?, &slot, value, left()).await,
                }
            }
            .await;
            let _ = tell.send(r);
        });
        let fut = async move { told.await.unwrap_or(Err(TransportError::Aborted { op: OP })) };
        self.work(OP, dst_rank, fut, async_op)
    }

    /// The value of this rank's value slot `signal_disp` now.
    pub fn read_signal(&self, signal_disp: usize) -> Result<u64> {
        let off = self.value_slot_index("read_signal", self.rank(), signal_disp)?;
        // A released slot holds no value (`release` module).
        self.not_released("read_signal", self.rank())?;
        let v = self.signal_dst.atomic_u64(off).map_err(|source| Error::Transport { op: "read_signal", source })?;
        Ok(v.load(Ordering::Acquire))
    }

    /// The value of same-host peer `rank`'s value slot `signal_disp` now,
    /// read through the mapping of its signal buffer (UNIFIED pairs; a peer
    /// of another host has none here: `Unsupported`). The mapping outlives
    /// the peer, so a peer that left reads as it left its slot; a peer's
    /// release (`release` module) reads as `u64::MAX`.
    pub fn read_peer_signal(&self, rank: usize, signal_disp: usize) -> Result<u64> {
        const OP: &str = "read_peer_signal";
        self.check_rank(OP, rank)?;
        let off = self.value_slot_index(OP, rank, signal_disp)?;
        let v = match &self.signal_maps[rank] {
            _ if rank == self.rank() => self.signal_dst.atomic_u64(off),
            Some(m) => m.atomic_u64(off),
            None => {
                return Err(Error::Unsupported {
                    op: OP,
                    reason: format!("rank {rank} is on another host: its signal buffer is not mapped here"),
                })
            }
        };
        Ok(v.map_err(|source| Error::Transport { op: OP, source })?.load(Ordering::Acquire))
    }

    /// ctran's `wait_signal_until`: waits until this rank's value slot
    /// `signal_disp` compares to `value` as `cmp` says (acquire: what the
    /// signalling ranks put before their signal is visible then), for at
    /// most `timeout` (`None`: the window's). Spins, then sleeps on the
    /// slot's futex (woken by UNIFIED writers; with SEPARATE peers it also
    /// looks every 200 µs, since their RDMA writes wake nobody).
    pub fn wait_signal_until(&self, signal_disp: usize, value: u64, cmp: Cmp, timeout: Option<Duration>) -> Result<()> {
        const OP: &str = "wait_signal_until";
        let me = self.rank();
        let off = self.value_slot_index(OP, me, signal_disp)?;
        let slot = Slot::at(off, |o| self.signal_dst.atomic_u64(o), |o| self.signal_dst.atomic_u32(o))
            .map_err(|source| Error::Transport { op: OP, source })?;
        let timeout = timeout.unwrap_or(self.timeout);
        let any_separate = (0..self.size()).any(|p| self.signal_maps[p].is_none());
        let slice = if any_separate { SEPARATE_SLICE } else { SLICE };
        let ready = || cmp.holds(slot.value.load(Ordering::Acquire), value);
        // Any peer may write the slot: none being gone is no reason to fail,
        // so only the deadline ends the wait.
        let deadline = ibverbx::deadline_after(timeout);
        self.not_released(OP, me)?;
        // A release ends the wait with its reason (its poison may not
        // compare as asked).
        if slot.wait(self.spin, slice, deadline, ready, || self.not_released(OP, me))? {
            return self.not_released(OP, me);
        }
        Err(Error::Timeout {
            waiting_for: format!(
                "{OP}: slot {signal_disp} {cmp:?} {value} on rank {me} (it holds {})",
                slot.value.load(Ordering::Acquire)
            ),
            after: timeout,
        })
    }

    /// Sets this rank's own value slot (e.g. to reset it between phases;
    /// no one is signalled).
    pub fn reset_signal(&self, signal_disp: usize, value: u64) -> Result<()> {
        let off = self.value_slot_index("reset_signal", self.rank(), signal_disp)?;
        // Not over a release's poison (a stream may still wait on it).
        self.not_released("reset_signal", self.rank())?;
        let v = self.signal_dst.atomic_u64(off).map_err(|source| Error::Transport { op: "reset_signal", source })?;
        v.store(value, Ordering::Release);
        Ok(())
    }
}
