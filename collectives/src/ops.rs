//! The collectives, each a list of transfers over the channels
//! ([`crate::channel`]) plus local copies and reductions.

use crate::kern::{self as rmacomm_kernels, DType, ReduceOp};

use crate::channel::{Combine, Transfer};
use crate::comm::Comm;
use crate::error::{Error, Result};

// Operation codes carried in chunk headers (to name a mismatched peer's
// call).
pub(crate) const SEND: u32 = 1;
pub(crate) const BROADCAST: u32 = 2;
pub(crate) const REDUCE: u32 = 3;
pub(crate) const ALL_REDUCE: u32 = 4;
pub(crate) const ALL_GATHER: u32 = 5;
pub(crate) const REDUCE_SCATTER: u32 = 6;
pub(crate) const ALL_TO_ALL: u32 = 7;
pub(crate) const SCATTER: u32 = 8;
pub(crate) const GATHER: u32 = 9;
pub(crate) const BARRIER: u32 = 10;
pub(crate) const BATCH: u32 = 11;

// The algorithm, in bits 8..16 of a code (0: the call has one): ranks that
// take different ones for one call (sizes on either side of ONESHOT_MAX,
// different `rmacomm::algo` hints) fail as mismatched, instead of trading
// chunks that look alike (a one-shot rank returned Ok holding its own
// data reduced with the first part of a direct peer's).
pub(crate) const ALGO_ONESHOT: u32 = 1 << 8;
pub(crate) const ALGO_DIRECT: u32 = 2 << 8;
pub(crate) const ALGO_RING: u32 = 3 << 8;
pub(crate) const ALGO_TREE: u32 = 4 << 8;

pub(crate) fn op_name(code: u32) -> &'static str {
    match code & 0xff {
        SEND => "send/recv",
        BROADCAST => "broadcast",
        REDUCE => "reduce",
        ALL_REDUCE => "all_reduce",
        ALL_GATHER => "all_gather",
        REDUCE_SCATTER => "reduce_scatter",
        ALL_TO_ALL => "all_to_all",
        SCATTER => "scatter",
        GATHER => "gather",
        BARRIER => "barrier",
        BATCH => "batch",
        _ => "an unknown operation",
    }
}

/// `code` of a reduction of `dtype` with `op`: the element type and the
/// operation (not PREMUL_SUM's factor, which is each rank's own) ride in
/// the upper half, so that ranks reducing the same bytes as different
/// types, or with different operations, fail as mismatched instead of
/// each combining the bytes its own way.
pub(crate) fn reducing(code: u32, dtype: DType, op: ReduceOp) -> u32 {
    let dt = DType::ALL.iter().position(|&d| d == dtype).expect("every dtype is listed") as u32 + 1;
    let op = match op {
        ReduceOp::Sum => 1,
        ReduceOp::Product => 2,
        ReduceOp::Min => 3,
        ReduceOp::Max => 4,
        ReduceOp::Band => 5,
        ReduceOp::Bor => 6,
        ReduceOp::Bxor => 7,
        ReduceOp::Avg => 8,
        ReduceOp::PremulSum(_) => 9,
        // An operation added to the kernels later: named as unknown.
        _ => 0xff,
    };
    code | dt << 16 | op << 24
}

/// The call a chunk header's `code` names: "all_reduce of F16 with Avg
/// (direct)".
pub(crate) fn describe(code: u32) -> String {
    let algo = match code & 0xff00 {
        0 => "",
        ALGO_ONESHOT => " (one-shot)",
        ALGO_DIRECT => " (direct)",
        ALGO_RING => " (ring)",
        ALGO_TREE => " (tree)",
        _ => " (an unknown algorithm)",
    };
    let name = op_name(code);
    let (dt, op) = ((code >> 16) & 0xff, code >> 24);
    if dt == 0 {
        return format!("{name}{algo}");
    }
    let dtype = DType::ALL.get(dt as usize - 1).map_or_else(|| "an unknown type".to_owned(), |d| format!("{d:?}"));
    let op = ["Sum", "Product", "Min", "Max", "Band", "Bor", "Bxor", "Avg", "PremulSum"]
        .get((op as usize).wrapping_sub(1))
        .copied()
        .unwrap_or("an unknown operation");
    format!("{name} of {dtype} with {op}{algo}")
}

/// An all-reduce algorithm (hint `rmacomm::algo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReduceAlgo {
    /// Every rank sends block j of its input to rank j, which reduces it and
    /// sends the result to every rank: two steps, n - 1 messages per rank
    /// per step. The default.
    Direct,
    /// Reduce-scatter and all-gather around the ring: 2(n - 1) steps, one
    /// peer each (the bandwidth-optimal schedule across hosts).
    Ring,
    /// Every rank sends its whole input to every rank and reduces all of
    /// them itself, in rank order: one step, for small messages (the
    /// default up to 64 KiB).
    OneShot,
}

/// Up to this size all_reduce is one-shot by default.
pub(crate) const ONESHOT_MAX: usize = 64 << 10;

impl AllReduceAlgo {
    pub(crate) fn parse(s: &str) -> Option<Self> {
        match s {
            "direct" => Some(AllReduceAlgo::Direct),
            "ring" => Some(AllReduceAlgo::Ring),
            "oneshot" => Some(AllReduceAlgo::OneShot),
            _ => None,
        }
    }
}

/// Splits `len` bytes into `n` blocks of whole `elem` elements, as even as
/// possible (the first ones one element larger): (offset, length) each.
pub(crate) fn blocks(len: usize, n: usize, elem: usize) -> Vec<(usize, usize)> {
    let elems = len / elem;
    let (q, r) = (elems / n, elems % n);
    let mut at = 0;
    (0..n)
        .map(|i| {
            let l = (q + usize::from(i < r)) * elem;
            let b = (at, l);
            at += l;
            b
        })
        .collect()
}

/// Two disjoint blocks of `buf`: the first to read, the second to write.
fn two_blocks(buf: &mut [u8], a: (usize, usize), b: (usize, usize)) -> (&[u8], &mut [u8]) {
    debug_assert!(a.0 + a.1 <= b.0 || b.0 + b.1 <= a.0, "blocks overlap");
    if a.1 == 0 {
        return (&[], &mut buf[b.0..b.0 + b.1]);
    }
    if a.0 < b.0 {
        let (lo, hi) = buf.split_at_mut(b.0);
        (&lo[a.0..a.0 + a.1], &mut hi[..b.1])
    } else {
        let (lo, hi) = buf.split_at_mut(a.0);
        (&hi[..a.1], &mut lo[b.0..b.0 + b.1])
    }
}

fn check_dtype(op: &'static str, buf_len: usize, dtype: DType) -> Result<()> {
    if !buf_len.is_multiple_of(dtype.size()) {
        return Err(Error::invalid(op, format!("{buf_len} bytes are not a whole number of {dtype:?} elements")));
    }
    Ok(())
}

impl Comm {
    /// Combines the inputs into `out` (which holds this rank's part) with
    /// `op`, as a kernel call.
    fn combiner(
        op_name: &'static str,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<impl Fn(*mut u8, &[*const u8], usize) -> Result<()>> {
        let r = rmacomm_kernels::reducer(dtype, op).map_err(|source| Error::Kernel { op: op_name, source })?;
        Ok(move |out: *mut u8, inputs: &[*const u8], len: usize| {
            // SAFETY: the executor's contract for `Combine` (channel.rs):
            // `out` is an exclusively borrowed output chunk, the other inputs
            // are acknowledged-later chunks in this rank's window buffer.
            unsafe { rmacomm_kernels::combine_raw(&r, out, inputs, len) }
                .map_err(|source| Error::Kernel { op: op_name, source })
        })
    }

    /// Scales this rank's own contribution in place before it is combined
    /// (PREMUL_SUM by its factor, a float AVG by 1/n: `kern::scaler`).
    fn scale_own(op_name: &'static str, dtype: DType, op: ReduceOp, n: usize, buf: &mut [u8]) -> Result<()> {
        match rmacomm_kernels::scaler(dtype, op, n).map_err(|source| Error::Kernel { op: op_name, source })? {
            Some(s) => s.prepare(buf).map_err(|source| Error::Kernel { op: op_name, source }),
            None => Ok(()),
        }
    }

    /// [`scale_own`](Self::scale_own) of an input the caller keeps: a
    /// scaled copy when the op scales, else the input itself.
    fn scaled_own<'a>(
        op_name: &'static str,
        dtype: DType,
        op: ReduceOp,
        n: usize,
        input: &'a [u8],
    ) -> Result<std::borrow::Cow<'a, [u8]>> {
        if rmacomm_kernels::scaler(dtype, op, n).map_err(|source| Error::Kernel { op: op_name, source })?.is_none() {
            return Ok(std::borrow::Cow::Borrowed(input));
        }
        let mut v = input.to_vec();
        Self::scale_own(op_name, dtype, op, n, &mut v)?;
        Ok(std::borrow::Cow::Owned(v))
    }

    /// The reduction's last step on this rank's result (an integer AVG
    /// divides by the world size).
    fn finish(op_name: &'static str, dtype: DType, op: ReduceOp, n: usize, out: &mut [u8]) -> Result<()> {
        let r = rmacomm_kernels::reducer(dtype, op).map_err(|source| Error::Kernel { op: op_name, source })?;
        rmacomm_kernels::finish(&r, n, out).map_err(|source| Error::Kernel { op: op_name, source })
    }

    /// Reduce-scatter with arbitrary blocks: rank j ends with the reduction
    /// of every rank's `input[blocks[j]]` in `out` (its own block's length).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn reduce_scatter_blocks(
        &mut self,
        name: &'static str,
        code: u32,
        input: &[u8],
        blocks: &[(usize, usize)],
        out: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let mine = blocks[me];
        out[..mine.1].copy_from_slice(&input[mine.0..mine.0 + mine.1]);
        let combine = Self::combiner(name, dtype, op)?;
        let mut transfers: Vec<Transfer<'_>> = Vec::with_capacity(n);
        for (p, &(at, len)) in blocks.iter().enumerate() {
            if p != me {
                transfers.push(Transfer::Send { peer: p, data: &input[at..at + len] });
            }
        }
        let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
        if !peers.is_empty() {
            transfers.push(Transfer::Reduce { peers, out: &mut out[..mine.1], combine: &combine as Combine<'_> });
        }
        self.exchange(name, code, transfers)
    }

    /// All-gather with arbitrary blocks: every rank ends with every rank's
    /// block `blocks[r]` (which it has in `out[blocks[me]]`) in place.
    pub(crate) fn all_gather_blocks(
        &mut self,
        name: &'static str,
        code: u32,
        out: &mut [u8],
        blocks: &[(usize, usize)],
    ) -> Result<()> {
        let me = self.rank();
        let (mine_at, mine_len) = blocks[me];
        // Split `out` into disjoint per-rank pieces: this rank's (sent) and
        // the others' (received).
        let mut pieces: Vec<(usize, &mut [u8])> = Vec::with_capacity(blocks.len());
        let mut rest = out;
        let mut consumed = 0;
        let mut order: Vec<usize> = (0..blocks.len()).collect();
        order.sort_by_key(|&r| blocks[r].0);
        for r in order {
            let (at, len) = blocks[r];
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(at - consumed);
            let (piece, tail) = tail.split_at_mut(len);
            rest = tail;
            consumed = at + len;
            pieces.push((r, piece));
        }
        let mut own: &[u8] = &[];
        let mut transfers: Vec<Transfer<'_>> = Vec::with_capacity(2 * blocks.len());
        for (r, piece) in pieces {
            if r == me {
                own = piece;
            } else {
                transfers.push(Transfer::Recv { peer: r, out: piece });
            }
        }
        debug_assert_eq!(own.len(), mine_len);
        let _ = mine_at;
        for p in (0..blocks.len()).filter(|&p| p != me) {
            transfers.push(Transfer::Send { peer: p, data: own });
        }
        self.exchange(name, code, transfers)
    }

    /// `all_reduce` of `buf` in place.
    pub fn all_reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        check_dtype(OP, buf.len(), dtype)?;
        rmacomm_kernels::check(dtype, op).map_err(|source| Error::Kernel { op: OP, source })?;
        self.collective(OP)?;
        let n = self.size();
        let blocks = blocks(buf.len(), n, dtype.size());
        let code = reducing(ALL_REDUCE, dtype, op);
        // The result replaces `buf`: its own contribution is scaled there.
        Self::scale_own(OP, dtype, op, n, buf)?;
        match self.all_reduce_algo(buf.len()) {
            AllReduceAlgo::Ring => self.all_reduce_ring(buf, &blocks, dtype, op),
            AllReduceAlgo::OneShot => {
                let code = code | ALGO_ONESHOT;
                let input = buf.to_vec();
                let combine = Self::combiner(OP, dtype, op)?;
                let me = self.rank();
                let mut transfers: Vec<Transfer<'_>> =
                    (0..n).filter(|&p| p != me).map(|p| Transfer::Send { peer: p, data: &input }).collect();
                let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
                if !peers.is_empty() {
                    transfers.push(Transfer::Reduce { peers, out: &mut *buf, combine: &combine });
                }
                self.exchange(OP, code, transfers)?;
                Self::finish(OP, dtype, op, n, buf)
            }
            AllReduceAlgo::Direct => {
                let code = code | ALGO_DIRECT;
                let (at, len) = blocks[self.rank()];
                let mut mine = vec![0u8; len];
                self.reduce_scatter_blocks(OP, code, buf, &blocks, &mut mine, dtype, op)?;
                Self::finish(OP, dtype, op, n, &mut mine)?;
                buf[at..at + len].copy_from_slice(&mine);
                self.all_gather_blocks(OP, code, buf, &blocks)
            }
        }
    }

    /// Ring all-reduce: n - 1 reduce-scatter steps, each sending one block
    /// to the right neighbour and reducing the block from the left one
    /// into `buf`, so that rank r ends with block r reduced; then n - 1
    /// all-gather steps around the ring.
    fn all_reduce_ring(&mut self, buf: &mut [u8], blocks: &[(usize, usize)], dtype: DType, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        let (me, n) = (self.rank(), self.size());
        let code = reducing(ALL_REDUCE, dtype, op) | ALGO_RING;
        self.reduce_scatter_ring(OP, code, buf, blocks, dtype, op)?;
        let (at, len) = blocks[me];
        Self::finish(OP, dtype, op, n, &mut buf[at..at + len])?;
        self.all_gather_ring(OP, code, buf, blocks)
    }

    /// Ring reduce-scatter in place: n - 1 steps, each sending one block of
    /// `buf` to the right neighbour and reducing the block from the left
    /// one into `buf`, so that rank r ends with block r reduced (not yet
    /// finished: AVG and PREMUL_SUM are the caller's).
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_ring(
        &mut self,
        name: &'static str,
        code: u32,
        buf: &mut [u8],
        blocks: &[(usize, usize)],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let combine = Self::combiner(name, dtype, op)?;
        for step in 0..n.saturating_sub(1) {
            let send = (me + 2 * n - 1 - step) % n;
            let recv = (me + 2 * n - 2 - step) % n;
            let (data, acc) = two_blocks(buf, blocks[send], blocks[recv]);
            let transfers = vec![
                Transfer::Send { peer: right, data },
                Transfer::Reduce { peers: vec![left], out: acc, combine: &combine },
            ];
            self.exchange(name, code, transfers)?;
        }
        Ok(())
    }

    /// Recursive-doubling all-gather (a power-of-two number of ranks): at
    /// distance d = 1, 2, 4, … each rank swaps the d blocks it holds with
    /// the rank d away; log2(n) steps.
    fn all_gather_recursive(&mut self, name: &'static str, out: &mut [u8], block: usize) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let mut d = 1;
        while d < n {
            let partner = me ^ d;
            let mine = (me & !(d - 1)) * block;
            let theirs = (partner & !(d - 1)) * block;
            let (data, into) = two_blocks(out, (mine, d * block), (theirs, d * block));
            let t = vec![Transfer::Send { peer: partner, data }, Transfer::Recv { peer: partner, out: into }];
            self.exchange(name, ALL_GATHER, t)?;
            d <<= 1;
        }
        Ok(())
    }

    /// Recursive-halving reduce-scatter in place (a power-of-two number of
    /// ranks): at distance d = n/2, n/4, … each rank keeps the half of its
    /// current range that holds its own block, sends the other half to the
    /// rank d away and reduces what that rank sends into the half it kept;
    /// log2(n) steps, block `rank` reduced at the end.
    fn reduce_scatter_halving(
        &mut self,
        name: &'static str,
        buf: &mut [u8],
        block: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let combine = Self::combiner(name, dtype, op)?;
        let (mut lo, mut hi) = (0, n);
        let mut d = n / 2;
        while d >= 1 {
            let partner = me ^ d;
            let mid = (lo + hi) / 2;
            let (keep, give) = if me & d == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
            let range = |(a, b): (usize, usize)| (a * block, (b - a) * block);
            let (data, acc) = two_blocks(buf, range(give), range(keep));
            let t = vec![
                Transfer::Send { peer: partner, data },
                Transfer::Reduce { peers: vec![partner], out: acc, combine: &combine },
            ];
            self.exchange(name, reducing(REDUCE_SCATTER, dtype, op), t)?;
            (lo, hi) = keep;
            d /= 2;
        }
        Ok(())
    }

    /// Ring all-gather in place: n - 1 steps, each sending the block
    /// received last (first: this rank's own) to the right neighbour and
    /// receiving the next from the left one.
    fn all_gather_ring(
        &mut self,
        name: &'static str,
        code: u32,
        out: &mut [u8],
        blocks: &[(usize, usize)],
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        for step in 0..n.saturating_sub(1) {
            let send = (me + n - step) % n;
            let recv = (me + 2 * n - 1 - step) % n;
            let (data, into) = two_blocks(out, blocks[send], blocks[recv]);
            self.exchange(
                name,
                code,
                vec![Transfer::Send { peer: right, data }, Transfer::Recv { peer: left, out: into }],
            )?;
        }
        Ok(())
    }

    /// `broadcast` of `buf` from `root` (in place on every rank).
    pub fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.check_root(OP, root)?;
        self.collective(OP)?;
        let (me, n) = (self.rank(), self.size());
        if self.algo_hint() == Some("tree") {
            // Binomial tree over ranks renumbered from the root: receive from
            // the parent, then send to the children, largest subtree first.
            let v = (me + n - root) % n;
            let real = |x: usize| (x + root) % n;
            let mut mask = 1;
            while mask < n {
                if v & mask != 0 {
                    let from = vec![Transfer::Recv { peer: real(v - mask), out: &mut *buf }];
                    self.exchange(OP, BROADCAST | ALGO_TREE, from)?;
                    break;
                }
                mask <<= 1;
            }
            let data: &[u8] = buf;
            let mut kids = Vec::new();
            mask >>= 1;
            while mask > 0 {
                if v + mask < n {
                    kids.push(Transfer::Send { peer: real(v + mask), data });
                }
                mask >>= 1;
            }
            return self.exchange(OP, BROADCAST | ALGO_TREE, kids);
        }
        let transfers = if me == root {
            let data: &[u8] = buf;
            (0..n).filter(|&p| p != me).map(|p| Transfer::Send { peer: p, data }).collect()
        } else {
            vec![Transfer::Recv { peer: root, out: buf }]
        };
        self.exchange(OP, BROADCAST, transfers)
    }

    /// `reduce` of every rank's `buf` into `root`'s `buf` (others' are left
    /// as they were).
    pub fn reduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
        const OP: &str = "reduce";
        self.check_root(OP, root)?;
        check_dtype(OP, buf.len(), dtype)?;
        rmacomm_kernels::check(dtype, op).map_err(|source| Error::Kernel { op: OP, source })?;
        self.collective(OP)?;
        let (me, n) = (self.rank(), self.size());
        if me != root {
            // Left as it was: a scaled copy goes.
            let data = Self::scaled_own(OP, dtype, op, n, buf)?;
            return self.exchange(OP, reducing(REDUCE, dtype, op), vec![Transfer::Send { peer: root, data: &data }]);
        }
        Self::scale_own(OP, dtype, op, n, buf)?;
        let combine = Self::combiner(OP, dtype, op)?;
        let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
        let transfers =
            if peers.is_empty() { vec![] } else { vec![Transfer::Reduce { peers, out: &mut *buf, combine: &combine }] };
        self.exchange(OP, reducing(REDUCE, dtype, op), transfers)?;
        Self::finish(OP, dtype, op, n, buf)
    }

    /// `all_gather_single`: rank r's `input` lands at `output[r * len..]`
    /// on every rank (`output` is `size * input.len()` bytes).
    pub fn all_gather_single(&mut self, output: &mut [u8], input: &[u8]) -> Result<()> {
        const OP: &str = "all_gather_single";
        let n = self.size();
        if output.len() != n * input.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "output has {} bytes, {n} ranks × {} input bytes need {}",
                    output.len(),
                    input.len(),
                    n * input.len()
                ),
            ));
        }
        self.collective(OP)?;
        let blocks: Vec<(usize, usize)> = (0..n).map(|r| (r * input.len(), input.len())).collect();
        let me = self.rank();
        output[me * input.len()..(me + 1) * input.len()].copy_from_slice(input);
        if self.algo_hint() == Some("ring") {
            return self.all_gather_ring(OP, ALL_GATHER | ALGO_RING, output, &blocks);
        }
        if self.algo_hint() == Some("recursive") && n.is_power_of_two() {
            return self.all_gather_recursive(OP, output, input.len());
        }
        self.all_gather_blocks(OP, ALL_GATHER, output, &blocks)
    }

    /// `all_gather` into a list: `outputs[r]` receives rank r's `input`.
    /// With different lengths per rank (`outputs[r].len()` must equal rank
    /// r's input length) this is `all_gather_v`.
    pub fn all_gather(&mut self, outputs: &mut [&mut [u8]], input: &[u8]) -> Result<()> {
        self.all_gather_list("all_gather", outputs, input)
    }

    /// `all_gather_v`: as [`all_gather`](Self::all_gather) (which accepts
    /// uneven lengths already), its errors naming `all_gather_v`.
    pub fn all_gather_v(&mut self, outputs: &mut [&mut [u8]], input: &[u8]) -> Result<()> {
        self.all_gather_list("all_gather_v", outputs, input)
    }

    /// The list form of all_gather, its errors naming `op`.
    fn all_gather_list(&mut self, op: &'static str, outputs: &mut [&mut [u8]], input: &[u8]) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        if outputs.len() != n {
            return Err(Error::invalid(op, format!("{} outputs for {n} ranks", outputs.len())));
        }
        if outputs[me].len() != input.len() {
            return Err(Error::invalid(
                op,
                format!("outputs[{me}] has {} bytes, this rank's input {}", outputs[me].len(), input.len()),
            ));
        }
        self.collective(op)?;
        outputs[me].copy_from_slice(input);
        let mut transfers: Vec<Transfer<'_>> = Vec::with_capacity(2 * n);
        for (r, o) in outputs.iter_mut().enumerate() {
            if r != me {
                transfers.push(Transfer::Recv { peer: r, out: o });
                transfers.push(Transfer::Send { peer: r, data: input });
            }
        }
        self.exchange(op, ALL_GATHER, transfers)
    }

    /// `reduce_scatter` from a list: this rank's `output` is the reduction
    /// of every rank's `inputs[rank]`; `inputs[j].len()` may differ per j
    /// (`reduce_scatter_v`) but must equal rank j's output length.
    pub fn reduce_scatter(&mut self, output: &mut [u8], inputs: &[&[u8]], dtype: DType, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_list("reduce_scatter", output, inputs, dtype, op)
    }

    /// `reduce_scatter_v`: as [`reduce_scatter`](Self::reduce_scatter)
    /// (which accepts uneven lengths already), its errors naming
    /// `reduce_scatter_v`.
    pub fn reduce_scatter_v(&mut self, output: &mut [u8], inputs: &[&[u8]], dtype: DType, op: ReduceOp) -> Result<()> {
        self.reduce_scatter_list("reduce_scatter_v", output, inputs, dtype, op)
    }

    /// The list form of reduce_scatter, its errors naming `name`.
    fn reduce_scatter_list(
        &mut self,
        name: &'static str,
        output: &mut [u8],
        inputs: &[&[u8]],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        if inputs.len() != n {
            return Err(Error::invalid(name, format!("{} inputs for {n} ranks", inputs.len())));
        }
        if inputs[me].len() != output.len() {
            return Err(Error::invalid(
                name,
                format!("inputs[{me}] has {} bytes, the output {}", inputs[me].len(), output.len()),
            ));
        }
        // Every input whole elements (the peers' too: they are scaled here
        // for AVG and PREMUL_SUM) before the call takes its number.
        for (p, data) in inputs.iter().enumerate() {
            check_dtype(name, data.len(), dtype).map_err(|_| {
                Error::invalid(
                    name,
                    format!("inputs[{p}]: {} bytes are not a whole number of {dtype:?} elements", data.len()),
                )
            })?;
        }
        rmacomm_kernels::check(dtype, op).map_err(|source| Error::Kernel { op: name, source })?;
        self.collective(name)?;
        output.copy_from_slice(inputs[me]);
        Self::scale_own(name, dtype, op, n, output)?;
        // The caller's inputs stay as they were: scaled copies go.
        let scaled = inputs
            .iter()
            .enumerate()
            .map(|(p, &data)| {
                if p == me {
                    Ok(std::borrow::Cow::Borrowed(&[][..]))
                } else {
                    Self::scaled_own(name, dtype, op, n, data)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let combine = Self::combiner(name, dtype, op)?;
        let mut transfers: Vec<Transfer<'_>> = Vec::with_capacity(n);
        for (p, data) in scaled.iter().enumerate() {
            if p != me {
                transfers.push(Transfer::Send { peer: p, data });
            }
        }
        let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
        if !peers.is_empty() {
            transfers.push(Transfer::Reduce { peers, out: &mut *output, combine: &combine });
        }
        self.exchange(name, reducing(REDUCE_SCATTER, dtype, op), transfers)?;
        Self::finish(name, dtype, op, n, output)
    }

    /// `reduce_scatter_single`: `input` is `size * output.len()` bytes;
    /// this rank gets the reduction of every rank's block `rank`.
    pub fn reduce_scatter_single(&mut self, output: &mut [u8], input: &[u8], dtype: DType, op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter_single";
        let n = self.size();
        if input.len() != n * output.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "input has {} bytes, {n} ranks × {} output bytes need {}",
                    input.len(),
                    output.len(),
                    n * output.len()
                ),
            ));
        }
        if self.algo_hint() == Some("recursive") && n.is_power_of_two() {
            rmacomm_kernels::check(dtype, op).map_err(|source| Error::Kernel { op: OP, source })?;
            check_dtype(OP, output.len(), dtype)?;
            self.collective(OP)?;
            let mut work = input.to_vec();
            Self::scale_own(OP, dtype, op, n, &mut work)?;
            self.reduce_scatter_halving(OP, &mut work, output.len(), dtype, op)?;
            let me = self.rank();
            output.copy_from_slice(&work[me * output.len()..(me + 1) * output.len()]);
            return Self::finish(OP, dtype, op, n, output);
        }
        if self.algo_hint() == Some("ring") {
            rmacomm_kernels::check(dtype, op).map_err(|source| Error::Kernel { op: OP, source })?;
            check_dtype(OP, output.len(), dtype)?;
            self.collective(OP)?;
            let mut work = input.to_vec();
            Self::scale_own(OP, dtype, op, n, &mut work)?;
            let blocks: Vec<(usize, usize)> = (0..n).map(|r| (r * output.len(), output.len())).collect();
            self.reduce_scatter_ring(
                OP,
                reducing(REDUCE_SCATTER, dtype, op) | ALGO_RING,
                &mut work,
                &blocks,
                dtype,
                op,
            )?;
            let me = self.rank();
            output.copy_from_slice(&work[me * output.len()..(me + 1) * output.len()]);
            return Self::finish(OP, dtype, op, n, output);
        }
        let inputs: Vec<&[u8]> = input.chunks(output.len().max(1)).take(n).collect();
        let inputs = if output.is_empty() { vec![&input[..0]; n] } else { inputs };
        // Its errors name this call (they said reduce_scatter, and
        // `inputs[0]`, a list the caller never passed).
        self.reduce_scatter_list(OP, output, &inputs, dtype, op)
    }

    /// `all_to_all` with lists: `inputs[j]` goes to rank j, `outputs[i]`
    /// comes from rank i (lengths may differ: they must match pairwise).
    pub fn all_to_all(&mut self, outputs: &mut [&mut [u8]], inputs: &[&[u8]]) -> Result<()> {
        self.all_to_all_list("all_to_all", outputs, inputs)
    }

    /// [`all_to_all`](Self::all_to_all), its errors naming `name` (the
    /// single forms' own name).
    fn all_to_all_list(&mut self, name: &'static str, outputs: &mut [&mut [u8]], inputs: &[&[u8]]) -> Result<()> {
        let (me, n) = (self.rank(), self.size());
        if outputs.len() != n || inputs.len() != n {
            return Err(Error::invalid(
                name,
                format!("{} outputs and {} inputs for {n} ranks", outputs.len(), inputs.len()),
            ));
        }
        if outputs[me].len() != inputs[me].len() {
            let what = if name == "all_to_all" {
                format!("outputs[{me}] and inputs[{me}] differ in length")
            } else {
                format!(
                    "output_splits[{me}] ({}) and input_splits[{me}] ({}) differ: this rank's own block",
                    outputs[me].len(),
                    inputs[me].len()
                )
            };
            return Err(Error::invalid(name, what));
        }
        self.collective(name)?;
        outputs[me].copy_from_slice(inputs[me]);
        let mut transfers: Vec<Transfer<'_>> = Vec::with_capacity(2 * n);
        for (r, o) in outputs.iter_mut().enumerate() {
            if r != me {
                transfers.push(Transfer::Recv { peer: r, out: o });
                transfers.push(Transfer::Send { peer: r, data: inputs[r] });
            }
        }
        self.exchange(name, ALL_TO_ALL, transfers)
    }

    /// `all_to_all_single`: equal blocks; block j of `input` goes to rank j,
    /// block i of `output` comes from rank i.
    pub fn all_to_all_single(&mut self, output: &mut [u8], input: &[u8]) -> Result<()> {
        let n = self.size();
        let b = input.len() / n;
        if !input.len().is_multiple_of(n) || output.len() != input.len() {
            return Err(Error::invalid(
                "all_to_all_single",
                format!(
                    "input {} and output {} bytes must be equal and divisible by {n} ranks",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let splits = vec![b; n];
        self.all_to_all_v_named("all_to_all_single", output, input, &splits, &splits)
    }

    /// `all_to_all_v_single`: `input_splits[j]` bytes of `input` (in order)
    /// go to rank j, `output_splits[i]` bytes of `output` come from rank i.
    pub fn all_to_all_v_single(
        &mut self,
        output: &mut [u8],
        input: &[u8],
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<()> {
        self.all_to_all_v_named("all_to_all_v_single", output, input, output_splits, input_splits)
    }

    fn all_to_all_v_named(
        &mut self,
        name: &'static str,
        output: &mut [u8],
        input: &[u8],
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<()> {
        let n = self.size();
        // Checked: splits that overflow the sum must not wrap to a length
        // that matches (and then split past the buffer's end).
        let sum = |v: &[usize]| v.iter().try_fold(0usize, |a, &l| a.checked_add(l));
        if output_splits.len() != n || input_splits.len() != n {
            return Err(Error::invalid(name, format!("splits must have {n} entries")));
        }
        if sum(output_splits) != Some(output.len()) || sum(input_splits) != Some(input.len()) {
            return Err(Error::invalid(name, "the splits do not add up to the buffers' lengths"));
        }
        let mut inputs: Vec<&[u8]> = Vec::with_capacity(n);
        let mut rest = input;
        for &l in input_splits {
            let (a, b) = rest.split_at(l);
            inputs.push(a);
            rest = b;
        }
        let mut outputs: Vec<&mut [u8]> = Vec::with_capacity(n);
        let mut rest = output;
        for &l in output_splits {
            let (a, b) = std::mem::take(&mut rest).split_at_mut(l);
            outputs.push(a);
            rest = b;
        }
        self.all_to_all_list(name, &mut outputs, &inputs)
    }

    /// `scatter` from `root`: rank j receives `inputs[j]` (given on the
    /// root only) into `output`.
    pub fn scatter(&mut self, output: &mut [u8], inputs: Option<&[&[u8]]>, root: usize) -> Result<()> {
        const OP: &str = "scatter";
        self.check_root(OP, root)?;
        let (me, n) = (self.rank(), self.size());
        if me != root {
            self.collective(OP)?;
            return self.exchange(OP, SCATTER, vec![Transfer::Recv { peer: root, out: output }]);
        }
        let inputs = inputs.ok_or_else(|| Error::invalid(OP, "the root must pass the inputs"))?;
        if inputs.len() != n || inputs[me].len() != output.len() {
            return Err(Error::invalid(OP, format!("{n} inputs needed, inputs[{me}] as long as the output")));
        }
        self.collective(OP)?;
        output.copy_from_slice(inputs[me]);
        let transfers = (0..n).filter(|&p| p != me).map(|p| Transfer::Send { peer: p, data: inputs[p] }).collect();
        self.exchange(OP, SCATTER, transfers)
    }

    /// `gather` to `root`: `outputs[i]` (on the root only) receives rank
    /// i's `input`.
    pub fn gather(&mut self, outputs: Option<&mut [&mut [u8]]>, input: &[u8], root: usize) -> Result<()> {
        const OP: &str = "gather";
        self.check_root(OP, root)?;
        let (me, n) = (self.rank(), self.size());
        if me != root {
            self.collective(OP)?;
            return self.exchange(OP, GATHER, vec![Transfer::Send { peer: root, data: input }]);
        }
        let outputs = outputs.ok_or_else(|| Error::invalid(OP, "the root must pass the outputs"))?;
        if outputs.len() != n || outputs[me].len() != input.len() {
            return Err(Error::invalid(OP, format!("{n} outputs needed, outputs[{me}] as long as the input")));
        }
        self.collective(OP)?;
        outputs[me].copy_from_slice(input);
        let transfers = outputs
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| *p != me)
            .map(|(p, o)| Transfer::Recv { peer: p, out: o })
            .collect();
        self.exchange(OP, GATHER, transfers)
    }

    /// `send` of `data` to `dst` (matched by `dst`'s `recv` from this rank).
    pub fn send(&mut self, data: &[u8], dst: usize) -> Result<()> {
        const OP: &str = "send";
        self.begin(OP)?;
        self.check_peer(OP, dst)?;
        // Point-to-point streams are FIFO per pair: no sequence number.
        self.exchange_seq(OP, SEND, 0, vec![Transfer::Send { peer: dst, data }])
    }

    /// `recv` into `out` from `src`.
    pub fn recv(&mut self, out: &mut [u8], src: usize) -> Result<()> {
        const OP: &str = "recv";
        self.begin(OP)?;
        self.check_peer(OP, src)?;
        self.exchange_seq(OP, SEND, 0, vec![Transfer::Recv { peer: src, out }])
    }

    /// `barrier`: returns once every rank called it.
    pub fn barrier(&mut self) -> Result<()> {
        self.barrier_as("barrier")
    }

    /// A barrier whose errors name `op` (`finalize` is one).
    pub(crate) fn barrier_as(&mut self, op: &'static str) -> Result<()> {
        self.collective(op)?;
        let me = self.rank();
        let mut transfers: Vec<Transfer<'_>> = Vec::new();
        let mut sinks: Vec<[u8; 0]> = vec![[]; self.size()];
        for (p, sink) in sinks.iter_mut().enumerate() {
            if p != me {
                transfers.push(Transfer::Send { peer: p, data: &[] });
                transfers.push(Transfer::Recv { peer: p, out: sink });
            }
        }
        self.exchange(op, BARRIER, transfers)
    }
}
