//! Flow-controlled channels between every pair of ranks, on one window,
//! and the executor that moves a collective's transfers over them.
//!
//! Each rank's window buffer holds, for every source rank, `DEPTH` slots
//! of a header and `slot_bytes` of data. A sender puts a chunk (data, then
//! header) into its next slot at the destination and adds 1 to the
//! destination's *data* counter for it (a value signal: ordered after the
//! puts); the destination reads the chunk out of its own buffer and adds 1
//! to the sender's *ack* counter for it. A sender puts chunk k only once
//! the destination acknowledged chunk k - DEPTH, so a slot is never
//! overwritten before it was read. Counters only grow, so nothing is reset
//! between collectives: consecutive collectives simply continue the
//! streams.
//!
//! The executor ([`Channels::run`]) never blocks on one peer: it sends
//! whatever has credit and receives whatever has arrived, in any order,
//! until every transfer is done, so collectives whose ranks send and receive
//! many chunks to and from many peers cannot deadlock. The header carries
//! the operation, its sequence number, the pair's total bytes and the chunk
//! index: a peer that called another collective, or the same one with
//! another size, is reported as a mismatch naming both.

use std::time::{Duration, Instant};

use rmacomm_window::{Group, Window, WindowOptions};

use crate::error::{Error, Result};

/// How long the executor spins while nothing moves before it yields.
const SPIN: Duration = Duration::from_micros(30);

/// Slots per (source, destination) pair: chunk k+1 travels while chunk k
/// is consumed.
pub(crate) const DEPTH: u64 = 2;
const HDR: usize = 32;
const MAGIC: u32 = 0x524d_4143; // "RMAC"

/// Combines one chunk of several ranks' data into the output chunk:
/// `inputs` are in rank order and one of them is the output itself (which
/// holds this rank's own contribution); every input is `len` bytes. The
/// peers' inputs point into this rank's window buffer, where nobody writes
/// until the chunk is acknowledged (after the call).
pub(crate) type Combine<'a> = &'a dyn Fn(*mut u8, &[*const u8], usize) -> Result<()>;

/// One rank's part of a collective with one peer (or, for `Reduce`, with
/// several).
pub(crate) enum Transfer<'a> {
    /// Send these bytes to `peer`.
    Send { peer: usize, data: &'a [u8] },
    /// Receive `out.len()` bytes from `peer` into `out`.
    Recv { peer: usize, out: &'a mut [u8] },
    /// Receive `out.len()` bytes from each of `peers` (ascending) and
    /// combine them into `out` chunk by chunk, once every peer's chunk is
    /// there (so the result does not depend on arrival order).
    Reduce { peers: Vec<usize>, out: &'a mut [u8], combine: Combine<'a> },
}

struct State<'a> {
    t: Transfer<'a>,
    /// Chunks moved so far.
    chunk: u64,
    chunks: u64,
}

/// The channels of one communicator.
pub(crate) struct Channels {
    pub(crate) win: Window,
    slot_bytes: usize,
    /// Per peer: chunks sent to it, and chunks received from it.
    sent: Vec<u64>,
    recvd: Vec<u64>,
}

impl Channels {
    /// Creates the window (collective): `slot_bytes` of data per slot.
    pub(crate) fn new(group: &Group, slot_bytes: usize, opts: WindowOptions) -> Result<Channels> {
        const OP: &str = "new_comm";
        let n = group.size();
        let slot_bytes = slot_bytes.max(64) / 64 * 64;
        let bytes = n * DEPTH as usize * (HDR + slot_bytes);
        let win = Window::allocate(group, bytes, 2 * n, opts).map_err(Error::window(OP))?;
        Ok(Channels { win, slot_bytes, sent: vec![0; n], recvd: vec![0; n] })
    }

    fn size(&self) -> usize {
        self.win.size()
    }

    /// Where the slot for chunk `k` from `src` is in a rank's buffer.
    fn slot_offset(&self, src: usize, k: u64) -> usize {
        (src * DEPTH as usize + (k % DEPTH) as usize) * (HDR + self.slot_bytes)
    }

    fn data_disp(src: usize) -> usize {
        src
    }

    fn ack_disp(&self, dst: usize) -> usize {
        self.size() + dst
    }

    fn chunks(&self, len: usize) -> u64 {
        len.div_ceil(self.slot_bytes).max(1) as u64
    }

    /// Moves every transfer (none to this rank itself), or fails naming the
    /// operation and the peers still missing.
    pub(crate) fn run(
        &mut self,
        op: &'static str,
        code: u32,
        seq: u64,
        transfers: Vec<Transfer<'_>>,
        timeout: Duration,
    ) -> Result<()> {
        let me = self.win.rank();
        let mut st: Vec<State<'_>> = transfers
            .into_iter()
            .map(|t| {
                let len = match &t {
                    Transfer::Send { data, .. } => data.len(),
                    Transfer::Recv { out, .. } | Transfer::Reduce { out, .. } => out.len(),
                };
                State { chunks: self.chunks(len), chunk: 0, t }
            })
            .collect();
        debug_assert!(st.iter().all(|s| !peers_of(&s.t).contains(&me)));
        let start = Instant::now();
        let mut idle = 0u32;
        let mut idle_since = start;
        let mut tmp: Vec<usize> = Vec::new();
        let n = self.size();
        let (mut busy_out, mut busy_in) = (vec![false; n], vec![false; n]);
        loop {
            let mut progressed = false;
            let mut pending = false;
            // Transfers on one pair and direction go one after the other
            // (their chunks share the pair's stream): a later one waits
            // until the earlier ones are done.
            busy_out.fill(false);
            busy_in.fill(false);
            for s in st.iter_mut() {
                let (busy, peers) = match &s.t {
                    Transfer::Send { peer, .. } => (&mut busy_out, std::slice::from_ref(peer)),
                    Transfer::Recv { peer, .. } => (&mut busy_in, std::slice::from_ref(peer)),
                    Transfer::Reduce { peers, .. } => (&mut busy_in, peers.as_slice()),
                };
                if s.chunk < s.chunks && peers.iter().any(|&p| busy[p]) {
                    pending = true;
                    continue;
                }
                while s.chunk < s.chunks {
                    pending = true;
                    let moved = match &mut s.t {
                        Transfer::Send { peer, data } => self.try_send(op, code, seq, *peer, data, s.chunk)?,
                        Transfer::Recv { peer, out } => self.try_recv(op, code, seq, *peer, out, s.chunk)?,
                        Transfer::Reduce { peers, out, combine } => {
                            self.try_reduce(op, code, seq, peers, out, *combine, s.chunk, &mut tmp)?
                        }
                    };
                    if !moved {
                        break;
                    }
                    s.chunk += 1;
                    progressed = true;
                }
                if s.chunk < s.chunks {
                    let (busy, peers) = match &s.t {
                        Transfer::Send { peer, .. } => (&mut busy_out, std::slice::from_ref(peer)),
                        Transfer::Recv { peer, .. } => (&mut busy_in, std::slice::from_ref(peer)),
                        Transfer::Reduce { peers, .. } => (&mut busy_in, peers.as_slice()),
                    };
                    for &p in peers {
                        busy[p] = true;
                    }
                }
            }
            if !pending {
                return Ok(());
            }
            if progressed {
                idle = 0;
                continue;
            }
            // Spin 30 µs, then yield (ranks often outnumber free cores: a
            // rank that spins through its time slice keeps the peer it
            // waits for off the CPU), then, after a few idle milliseconds,
            // sleep in short steps.
            idle += 1;
            if idle == 1 {
                idle_since = Instant::now();
            }
            let waited = if idle < 64 { Duration::ZERO } else { idle_since.elapsed() };
            if waited < SPIN {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(5) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            if idle.is_multiple_of(64) && start.elapsed() >= timeout {
                return Err(self.timeout(op, seq, &st, timeout));
            }
        }
    }

    fn timeout(&self, op: &'static str, seq: u64, st: &[State<'_>], after: Duration) -> Error {
        let mut missing: Vec<usize> = Vec::new();
        let mut what = Vec::new();
        for s in st.iter().filter(|s| s.chunk < s.chunks) {
            let verb = if matches!(s.t, Transfer::Send { .. }) { "to take" } else { "to send" };
            for p in peers_of(&s.t) {
                // A peer of a reduction whose chunk is here already is not missing.
                if let Transfer::Reduce { .. } = s.t {
                    if self.win.read_signal(Self::data_disp(p)).unwrap_or(0) > self.recvd[p] {
                        continue;
                    }
                }
                if !missing.contains(&p) {
                    missing.push(p);
                }
                what.push(format!("rank {p} {verb} chunk {} of {}", s.chunk + 1, s.chunks));
            }
        }
        missing.sort_unstable();
        Error::Timeout { op, seq, missing, waiting_for: what.join(", "), after }
    }

    /// Puts chunk `k` of `data` to `peer` if the slot is free.
    #[allow(clippy::too_many_arguments)]
    fn try_send(&mut self, op: &'static str, code: u32, seq: u64, peer: usize, data: &[u8], k: u64) -> Result<bool> {
        let n = self.sent[peer];
        if n >= DEPTH {
            let acked = self.win.read_signal(self.ack_disp(peer)).map_err(Error::window(op))?;
            if acked + DEPTH <= n {
                return Ok(false);
            }
        }
        let me = self.win.rank();
        let from = k as usize * self.slot_bytes;
        let piece = &data[from.min(data.len())..(from + self.slot_bytes).min(data.len())];
        let at = self.slot_offset(me, n);
        let mut hdr = [0u8; HDR];
        hdr[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        hdr[4..8].copy_from_slice(&code.to_le_bytes());
        hdr[8..16].copy_from_slice(&seq.to_le_bytes());
        hdr[16..24].copy_from_slice(&(data.len() as u64).to_le_bytes());
        hdr[24..28].copy_from_slice(&(k as u32).to_le_bytes());
        hdr[28..32].copy_from_slice(&(piece.len() as u32).to_le_bytes());
        if !piece.is_empty() {
            self.win.put_bytes(piece, peer, at + HDR).map_err(Error::window(op))?;
        }
        self.win.put_bytes(&hdr, peer, at).map_err(Error::window(op))?;
        self.win
            .signal_value(Self::data_disp(me), 1, peer, rmacomm_window::SignalOp::Add, false)
            .map_err(Error::window(op))?;
        self.sent[peer] = n + 1;
        Ok(true)
    }

    /// Whether chunk `recvd[peer]` from `peer` has arrived.
    fn arrived(&self, op: &'static str, peer: usize) -> Result<bool> {
        Ok(self.win.read_signal(Self::data_disp(peer)).map_err(Error::window(op))? > self.recvd[peer])
    }

    /// Checks the header of the chunk from `peer` now in its slot against
    /// what this rank expects: chunk `k` of `len` bytes of `op` #`seq`.
    /// Returns where its data is in this rank's buffer and its length.
    #[allow(clippy::too_many_arguments)]
    fn check_header(
        &self,
        op: &'static str,
        code: u32,
        seq: u64,
        peer: usize,
        len: usize,
        k: u64,
    ) -> Result<(usize, usize)> {
        let me = self.win.rank();
        let at = self.slot_offset(peer, self.recvd[peer]);
        let own = self.win.map_remote_tensor(me).map_err(Error::window(op))?;
        let mut hdr = [0u8; HDR];
        own.read_into(at, &mut hdr).map_err(Error::window(op))?;
        let u32_at = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(hdr[i..i + 8].try_into().expect("8 bytes"));
        let (their_code, their_seq, their_total, their_k, their_len) =
            (u32_at(4), u64_at(8), u64_at(16), u32_at(24) as u64, u32_at(28) as usize);
        let want_len = len.saturating_sub(k as usize * self.slot_bytes).min(self.slot_bytes);
        if u32_at(0) != MAGIC {
            return Err(Error::Mismatch { op, seq, reason: format!("rank {peer} sent a chunk without a header") });
        }
        if their_code != code || their_seq != seq || their_total != len as u64 || their_k != k {
            return Err(Error::Mismatch {
                op,
                seq,
                reason: format!(
                    "rank {peer} sent {} #{their_seq} with {their_total} bytes for this rank (chunk {their_k}); this \
                     rank expects {} #{seq} with {len} bytes (chunk {k})",
                    crate::ops::describe(their_code),
                    crate::ops::describe(code)
                ),
            });
        }
        if their_len != want_len {
            return Err(Error::Mismatch {
                op,
                seq,
                reason: format!("rank {peer} sent a chunk of {their_len} bytes, expected {want_len}"),
            });
        }
        Ok((at + HDR, want_len))
    }

    /// After chunk `recvd[peer]` was read: frees its slot for `peer`. An
    /// acknowledgement that cannot be delivered is dropped: it only lets the
    /// peer send more, and a peer that is gone sends nothing (its next part
    /// in a collective fails there or times out here). This is what lets a
    /// rank that finished its last collective exit while others still
    /// acknowledge its chunks.
    fn ack(&mut self, op: &'static str, peer: usize) -> Result<()> {
        let me = self.win.rank();
        if let Err(e) = self.win.signal_value(self.ack_disp(me), 1, peer, rmacomm_window::SignalOp::Add, false) {
            tracing::debug!("{op}: acknowledgement to rank {peer} dropped: {e}");
        }
        self.recvd[peer] += 1;
        Ok(())
    }

    /// Takes chunk `k` of `out` from `peer` if it came.
    fn try_recv(&mut self, op: &'static str, code: u32, seq: u64, peer: usize, out: &mut [u8], k: u64) -> Result<bool> {
        if !self.arrived(op, peer)? {
            return Ok(false);
        }
        let (at, n) = self.check_header(op, code, seq, peer, out.len(), k)?;
        let from = k as usize * self.slot_bytes;
        let own = self.win.map_remote_tensor(self.win.rank()).map_err(Error::window(op))?;
        own.read_into(at, &mut out[from..from + n]).map_err(Error::window(op))?;
        self.ack(op, peer)?;
        Ok(true)
    }

    /// Combines chunk `k` from every one of `peers` into `out` once all
    /// of them came.
    #[allow(clippy::too_many_arguments)]
    fn try_reduce(
        &mut self,
        op: &'static str,
        code: u32,
        seq: u64,
        peers: &[usize],
        out: &mut [u8],
        combine: Combine<'_>,
        k: u64,
        tmp: &mut Vec<usize>,
    ) -> Result<bool> {
        for &p in peers {
            if !self.arrived(op, p)? {
                return Ok(false);
            }
        }
        let me = self.win.rank();
        let from = k as usize * self.slot_bytes;
        let n = out.len().saturating_sub(from).min(self.slot_bytes);
        let own = self.win.map_remote_tensor(me).map_err(Error::window(op))?;
        let base = own.as_ptr() as usize;
        let outp = out[from..from + n].as_mut_ptr();
        tmp.clear();
        for &p in peers {
            let (at, _) = self.check_header(op, code, seq, p, out.len(), k)?;
            if p > me && !tmp.contains(&(outp as usize)) {
                tmp.push(outp as usize);
            }
            // Inside this rank's window buffer (checked by slot_offset's
            // layout): the chunk's data, read in place.
            tmp.push(base + at);
        }
        if !tmp.contains(&(outp as usize)) {
            tmp.push(outp as usize);
        }
        let inputs: Vec<*const u8> = tmp.iter().map(|&a| a as *const u8).collect();
        combine(outp, &inputs, n)?;
        for &p in peers {
            self.ack(op, p)?;
        }
        Ok(true)
    }
}

fn peers_of(t: &Transfer<'_>) -> Vec<usize> {
    match t {
        Transfer::Send { peer, .. } | Transfer::Recv { peer, .. } => vec![*peer],
        Transfer::Reduce { peers, .. } => peers.clone(),
    }
}
