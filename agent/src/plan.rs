//! The request planner (sans-IO): checks every piece of a request against
//! the peer's published regions, then coalesces pieces that are adjacent on
//! both sides into one operation. Nothing here touches memory or the
//! network; the transfer posts what it returns.

use crate::{AgentError, RemoteBlock};

/// Longest operation the planner makes: coalescing stops there and a longer
/// piece is cut into operations of this length (a view is at most
/// `u32::MAX` bytes; the transport cuts what it posts into fragments
/// anyway).
pub(crate) const MAX_OP_LEN: usize = 1 << 30;

/// One piece as the planner sees it: the local side by its index in the
/// request's list of distinct local memories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PieceIn {
    pub(crate) local: usize,
    pub(crate) local_off: usize,
    pub(crate) local_len: usize,
    pub(crate) remote: RemoteBlock,
}

/// One operation to post: `len` bytes between local memory `local` at
/// `local_off` and the peer's region `region` at `remote_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PlannedOp {
    pub(crate) local: usize,
    pub(crate) local_off: usize,
    pub(crate) len: usize,
    pub(crate) region: u32,
    pub(crate) remote_off: u64,
}

/// Checks every piece and coalesces. `region_len(id)` is the length of the
/// peer's region `id`, `None` if it publishes none such. The first bad
/// piece (in the caller's order) is the error.
pub(crate) fn plan(
    peer: &str,
    pieces: &[PieceIn],
    region_len: impl Fn(u32) -> Option<u64>,
) -> Result<Vec<PlannedOp>, AgentError> {
    for (i, p) in pieces.iter().enumerate() {
        let r = p.remote;
        if p.local_len as u64 != r.len {
            return Err(AgentError::invalid(
                "transfer",
                format!(
                    "with peer {peer:?}: piece {i}: the local slice is {} bytes, the remote block {} bytes",
                    p.local_len, r.len
                ),
            ));
        }
        let Some(rlen) = region_len(r.region) else {
            return Err(AgentError::UnknownRegion { peer: peer.into(), piece: i, region: r.region });
        };
        if r.offset.checked_add(r.len).is_none_or(|end| end > rlen) {
            return Err(AgentError::OutOfBounds {
                peer: peer.into(),
                piece: i,
                region: r.region,
                offset: r.offset,
                len: r.len,
                region_len: rlen,
            });
        }
    }
    // Adjacent on both sides means adjacent locally; sorting by the local
    // side finds every such pair whatever order the caller listed them in.
    let mut order: Vec<usize> = (0..pieces.len()).filter(|&i| pieces[i].local_len > 0).collect();
    order.sort_by_key(|&i| (pieces[i].local, pieces[i].local_off));
    let mut ops: Vec<PlannedOp> = Vec::with_capacity(order.len());
    for i in order {
        let p = &pieces[i];
        // A piece continuing the last operation fills it up to the cap; a
        // piece longer than the cap goes as several operations.
        let mut done = 0;
        while done < p.local_len {
            let (local_off, remote_off) = (p.local_off + done, p.remote.offset + done as u64);
            let rest = p.local_len - done;
            if let Some(last) = ops.last_mut() {
                let adjacent = last.local == p.local
                    && last.local_off + last.len == local_off
                    && last.region == p.remote.region
                    && last.remote_off + last.len as u64 == remote_off
                    && last.len < MAX_OP_LEN;
                if adjacent {
                    let take = rest.min(MAX_OP_LEN - last.len);
                    last.len += take;
                    done += take;
                    continue;
                }
            }
            let len = rest.min(MAX_OP_LEN);
            ops.push(PlannedOp { local: p.local, local_off, len, region: p.remote.region, remote_off });
            done += len;
        }
    }
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn piece(local: usize, local_off: usize, len: usize, region: u32, remote_off: u64) -> PieceIn {
        PieceIn { local, local_off, local_len: len, remote: RemoteBlock::new(region, remote_off, len as u64) }
    }

    fn regions(id: u32) -> Option<u64> {
        (id < 4).then_some(1 << 20)
    }

    #[test]
    fn pieces_adjacent_on_both_sides_become_one_operation_in_any_order() {
        let mut ps: Vec<PieceIn> = (0..256).map(|i| piece(0, i * 16, 16, 1, 4096 + i as u64 * 16)).collect();
        ps.reverse();
        let ops = plan("p", &ps, regions).unwrap();
        assert_eq!(ops, vec![PlannedOp { local: 0, local_off: 0, len: 4096, region: 1, remote_off: 4096 }]);
    }

    #[test]
    fn adjacency_on_one_side_only_is_not_enough() {
        // Local adjacent, remote scattered; remote adjacent, local in two
        // memories; remote adjacent but in two regions.
        let ps = [piece(0, 0, 8, 1, 100), piece(0, 8, 8, 1, 0)];
        assert_eq!(plan("p", &ps, regions).unwrap().len(), 2);
        let ps = [piece(0, 0, 8, 1, 0), piece(1, 8, 8, 1, 8)];
        assert_eq!(plan("p", &ps, regions).unwrap().len(), 2);
        let ps = [piece(0, 0, 8, 1, 0), piece(0, 8, 8, 2, 8)];
        assert_eq!(plan("p", &ps, regions).unwrap().len(), 2);
    }

    #[test]
    fn every_piece_is_checked_before_any_is_planned() {
        let ok = piece(0, 0, 8, 1, 0);
        let mut bad_len = piece(0, 8, 8, 1, 8);
        bad_len.remote.len = 9;
        let e = plan("p", &[ok, bad_len], regions).unwrap_err();
        assert!(e.to_string().contains("piece 1: the local slice is 8 bytes, the remote block 9 bytes"), "{e}");
        let e = plan("p", &[ok, ok, piece(0, 0, 8, 9, 0)], regions).unwrap_err();
        assert_eq!(e, AgentError::UnknownRegion { peer: "p".into(), piece: 2, region: 9 });
        let e = plan("p", &[ok, piece(0, 0, 8, 1, (1 << 20) - 7)], regions).unwrap_err();
        assert_eq!(
            e,
            AgentError::OutOfBounds {
                peer: "p".into(),
                piece: 1,
                region: 1,
                offset: (1 << 20) - 7,
                len: 8,
                region_len: 1 << 20
            }
        );
        let e = plan("p", &[piece(0, 0, 1, 1, u64::MAX)], regions).unwrap_err();
        assert!(matches!(e, AgentError::OutOfBounds { .. }), "an overflowing end is out of bounds: {e:?}");
    }

    #[test]
    fn empty_pieces_post_nothing_and_runs_stop_at_the_cap() {
        assert!(plan("p", &[piece(0, 0, 0, 1, 0)], regions).unwrap().is_empty());
        let big = |i: usize| piece(0, i * (MAX_OP_LEN / 2), MAX_OP_LEN / 2, 0, (i * (MAX_OP_LEN / 2)) as u64);
        let ops = plan("p", &[big(0), big(1), big(2)], |_| Some(u64::MAX)).unwrap();
        assert_eq!(ops.iter().map(|o| o.len).collect::<Vec<_>>(), [MAX_OP_LEN, MAX_OP_LEN / 2]);
    }

    #[test]
    fn a_piece_longer_than_an_operation_is_cut_at_the_cap() {
        // 5 GiB + 3 in one piece (a view cannot hold over u32::MAX bytes:
        // the same-host copy of such a piece panicked).
        let n = 5 * MAX_OP_LEN + 3;
        let ops = plan("p", &[piece(1, 7, n, 2, 11)], |_| Some(u64::MAX)).unwrap();
        let want: Vec<PlannedOp> = (0..6)
            .map(|k| PlannedOp {
                local: 1,
                local_off: 7 + k * MAX_OP_LEN,
                len: if k < 5 { MAX_OP_LEN } else { 3 },
                region: 2,
                remote_off: 11 + (k * MAX_OP_LEN) as u64,
            })
            .collect();
        assert_eq!(ops, want);
        // A small piece before it fills the first operation up to the cap.
        let ops = plan("p", &[piece(0, 0, 8, 0, 0), piece(0, 8, MAX_OP_LEN, 0, 8)], |_| Some(u64::MAX)).unwrap();
        assert_eq!(ops.iter().map(|o| (o.local_off, o.len)).collect::<Vec<_>>(), [(0, MAX_OP_LEN), (MAX_OP_LEN, 8)]);
    }

    proptest! {
        /// Coalescing moves exactly the bytes the pieces name, each to the
        /// same place, and never makes more operations than pieces.
        #[test]
        fn coalescing_preserves_the_byte_mapping(
            raw in proptest::collection::vec((0usize..2, 0usize..64, 1usize..5, 0u32..2, 0u64..64), 0..40)
        ) {
            let ps: Vec<PieceIn> = raw.iter().map(|&(l, lo, n, r, ro)| piece(l, lo * 4, n * 4, r, ro * 4)).collect();
            let ops = plan("p", &ps, regions).unwrap();
            prop_assert!(ops.len() <= ps.len());
            let mut want = std::collections::BTreeSet::new();
            for p in &ps {
                for k in 0..p.local_len {
                    want.insert((p.local, p.local_off + k, p.remote.region, p.remote.offset + k as u64));
                }
            }
            let mut got = std::collections::BTreeSet::new();
            for o in &ops {
                for k in 0..o.len {
                    got.insert((o.local, o.local_off + k, o.region, o.remote_off + k as u64));
                }
            }
            prop_assert_eq!(got, want);
        }
    }
}
