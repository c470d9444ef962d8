//! [`Transfer`]: one request — a list of pieces moved as one unit, then at
//! most one notification — as a future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use std::sync::atomic::{AtomicUsize, Ordering};

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use rmacomm_transport::{RdmaRemoteBuffer, TransportError};
use tokio::sync::oneshot;

use crate::block::LocalMem;
use crate::connection::Conn;
use crate::plan::PlannedOp;
use crate::stats::Counters;
use crate::{AgentError, Op};

/// Where a [`Transfer`] stands, from [`Transfer::status`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferStatus {
    /// Pieces (or the notification) are still in flight, or the connection
    /// is being made.
    InProgress,
    /// Every piece is placed, and the notification, if any, is in the
    /// peer's ring.
    Done,
    /// The transfer failed; the error names the peer.
    Failed(AgentError),
}

/// A request in flight, from [`TransferAgent::transfer`](crate::TransferAgent::transfer):
/// a future that resolves once every piece is placed and the notification
/// (if the request has one) has landed in the peer's ring, or with the
/// first error.
///
/// The pieces are posted when the request is made if the peer is connected,
/// else as soon as the connection is made, which needs the future to be
/// polled (`.await`, or [`status`](Self::status)). The notification is
/// handed to the connection's notifier when a poll finds every piece
/// placed; from then on it is delivered whether or not this value is
/// still polled.
///
/// Dropping a `Transfer` cancels nothing already posted: its pieces still
/// land (the transport keeps their memory registered until they complete).
/// Dropped before a poll saw all of its pieces placed, the request sends no
/// notification; dropped after, its notification is still delivered,
/// exactly once. Either way the agent and the connection stay consistent:
/// later requests to the peer are not affected.
#[must_use = "a transfer's notification is sent only once a poll (await or status) sees every piece placed"]
pub struct Transfer<'a> {
    peer: String,
    ops: usize,
    stage: Stage<'a>,
}

/// What posting a request needs, kept until the connection is there.
pub(crate) struct Posting<'a> {
    pub(crate) op: Op,
    pub(crate) plan: Vec<PlannedOp>,
    /// The distinct local memories the plan's `local` indices name.
    pub(crate) locals: Vec<LocalMem<'a>>,
    /// The peer's regions the plan names, from its metadata.
    pub(crate) remotes: Vec<(u32, RdmaRemoteBuffer)>,
    /// The token of the peer's metadata the plan was made from: a request
    /// that waited for a connection is posted only on a connection to that
    /// incarnation of the peer.
    pub(crate) peer_token: String,
    pub(crate) notify: Option<Vec<u8>>,
    pub(crate) counters: Arc<Counters>,
}

type Piece<'a> = BoxFuture<'a, Result<(), AgentError>>;

enum Stage<'a> {
    Connecting {
        conn: BoxFuture<'static, Result<Arc<Conn>, AgentError>>,
        posting: Posting<'a>,
    },
    /// Pieces (and, when it was posted right behind them, the notification)
    /// in flight; `notify`: the notification still to send once they are
    /// placed.
    Moving {
        pieces: FuturesUnordered<Piece<'a>>,
        notify: Option<(Vec<u8>, Weak<Conn>)>,
        _overflow: Option<Overflow>,
    },
    Notifying(BoxFuture<'static, Result<(), AgentError>>),
    Finished(Result<(), AgentError>),
}

/// Counts a request whose pieces did not all get an in-flight slot at
/// once (see `Conn::overflowing`) while it exists.
struct Overflow(Arc<AtomicUsize>);

impl Drop for Overflow {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl fmt::Debug for Transfer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stage = match &self.stage {
            Stage::Connecting { .. } => "connecting",
            Stage::Moving { .. } => "moving",
            Stage::Notifying(_) => "notifying",
            Stage::Finished(Ok(())) => "done",
            Stage::Finished(Err(_)) => "failed",
        };
        f.debug_struct("Transfer").field("peer", &self.peer).field("ops", &self.ops).field("stage", &stage).finish()
    }
}

impl<'a> Transfer<'a> {
    /// A request whose connection is ready: posted now.
    pub(crate) fn posted(peer: &str, conn: &Arc<Conn>, posting: Posting<'a>) -> Result<Transfer<'a>, AgentError> {
        let ops = posting.plan.len();
        Ok(Transfer { peer: peer.into(), ops, stage: post(peer, conn, posting)? })
    }

    /// A request posted once `conn` resolves.
    pub(crate) fn connecting(
        peer: &str,
        conn: BoxFuture<'static, Result<Arc<Conn>, AgentError>>,
        posting: Posting<'a>,
    ) -> Transfer<'a> {
        Transfer { peer: peer.into(), ops: posting.plan.len(), stage: Stage::Connecting { conn, posting } }
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// How many writes or reads the request posts: its pieces after
    /// coalescing (pieces adjacent on both sides count once).
    pub fn ops(&self) -> usize {
        self.ops
    }

    /// Polls the transfer once without waiting: moves it on (posting, once
    /// the connection is there; handing over its notification, once its
    /// pieces are placed) and says where it stands. A loop that calls this
    /// (as NIXL's `checkXferState` is used) completes the transfer without
    /// ever awaiting it.
    pub fn status(&mut self) -> TransferStatus {
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        match Pin::new(self).poll(&mut cx) {
            Poll::Pending => TransferStatus::InProgress,
            Poll::Ready(Ok(())) => TransferStatus::Done,
            Poll::Ready(Err(e)) => TransferStatus::Failed(e),
        }
    }
}

/// Requests copied by the calling thread on the mapped path up to this
/// many bytes run on it directly; above, inside `block_in_place` where the
/// runtime allows it (a multi-thread tokio runtime), so that the worker's
/// other tasks move elsewhere while it copies.
const INLINE_COPY_MAX: usize = 1 << 20;

/// Requests above this many bytes are copied with non-temporal stores (the
/// soft provider's threshold for long runs of copies: about where a copy
/// stops fitting in one core's share of the cache), in their pieces of at
/// least [`STREAM_PIECE`] bytes.
const STREAM_REQUEST: usize = 32 << 20;
const STREAM_PIECE: usize = 64 << 10;

/// Posts every planned operation (the checks that can only be made against
/// the connection come first, so that a failure posts nothing).
///
/// Three ways, chosen per request:
/// - the peer's regions are mapped here (same host): the calling thread
///   copies every piece, then posts the notification;
/// - notifying writes are counted in post order (one QP, DQPLB) and every
///   piece gets an in-flight slot at once: the notification is posted right
///   behind the pieces (a write request; a read's completion is what says
///   its data was read), and the transfer resolves with its completion;
/// - else the notification is sent once a poll sees every piece placed.
fn post<'a>(peer: &str, conn: &Arc<Conn>, p: Posting<'a>) -> Result<Stage<'a>, AgentError> {
    if let Some(e) = conn.transport.error() {
        return Err(AgentError::from_transport(peer, e));
    }
    if p.locals.iter().any(|m| !m.get().is_usable_with(&conn.transport)) {
        return Err(AgentError::invalid(
            "transfer",
            format!(
                "with peer {peer:?}: a local memory is on another device than the agent's transports (allocate it \
                 with TransferAgent::alloc)"
            ),
        ));
    }
    Counters::add(&p.counters.ops_posted, p.plan.len() as u64);
    // Device memory on this side: the host copies none of it (the transport
    // moves it, or the soft provider with the peer's device memory).
    let host_locals = p.locals.iter().all(|m| m.get().device().is_none());
    if !p.plan.is_empty() {
        if let Some(maps) = conn.mapped(&p.remotes).filter(|_| host_locals) {
            if let Err(e) = copy_mapped(peer, &p, &maps) {
                // Pieces before the one that failed may be placed: the
                // request's own result, not the call's (an error from the
                // call means nothing moved).
                return Ok(Stage::Finished(Err(e)));
            }
            // Placed: the notification goes now (or queues at the notifier
            // now, keeping its place among the connection's notifications).
            let pieces = FuturesUnordered::new();
            if let Some(message) = p.notify {
                pieces.push(send_notification(conn, &mut conn.lane(), message));
            }
            return Ok(Stage::Moving { pieces, notify: None, _overflow: None });
        }
    }
    let remote_of = |o: &PlannedOp| {
        let region = p.remotes.iter().find(|(id, _)| *id == o.region).expect("the planner checked the region").1;
        region.slice(o.remote_off, o.len as u64).expect("the planner checked the bounds")
    };
    let piece = |o: &PlannedOp| -> Piece<'a> {
        let remote = remote_of(o);
        let name = peer.to_owned();
        let (off, len, t) = (o.local_off, o.len, &conn.transport);
        // The views lie inside views the caller made of the memory and are
        // at most MAX_OP_LEN long (the planner joins only adjacent pieces
        // and cuts longer ones): they cannot fail.
        match (&p.locals[o.local], p.op) {
            (LocalMem::Borrowed(mem), Op::Write) => {
                named(name, t.write(mem.view(off, len).expect("inside a view"), &remote, false))
            }
            (LocalMem::Borrowed(mem), Op::Read) => {
                named(name, t.read(mem.view_mut(off, len).expect("inside a view"), &remote))
            }
            (LocalMem::Owned(mem), Op::Write) => named(name, t.write_owned(mem.clone(), off, len, &remote, false)),
            (LocalMem::Owned(mem), Op::Read) => named(name, t.read_owned(mem.clone(), off, len, &remote)),
        }
    };
    // A write piece posted now, or `None` (nothing posted) when no in-flight
    // slot is free.
    let try_piece = |o: &PlannedOp| -> Option<Piece<'a>> {
        let remote = remote_of(o);
        let name = peer.to_owned();
        let (off, len, t) = (o.local_off, o.len, &conn.transport);
        match &p.locals[o.local] {
            LocalMem::Borrowed(mem) => {
                t.try_write(mem.view(off, len).expect("inside a view"), &remote, false).map(|f| named(name, f))
            }
            LocalMem::Owned(mem) => t.try_write_owned(mem.clone(), off, len, &remote, false).map(|f| named(name, f)),
        }
    };
    let pieces = FuturesUnordered::new();
    let behind =
        p.notify.is_some() && p.op == Op::Write && conn.ordered && conn.overflowing.load(Ordering::Acquire) == 0;
    if behind {
        // The notification goes right behind the pieces only if every piece
        // is posted now: others of this agent (requests without a
        // notification, reads) post without the lane lock and may take the
        // slots counted here, and a piece left to post later would be
        // counted after the notification announcing it.
        let mut lane = conn.lane();
        if conn.transport.free_slots() >= p.plan.len() + 2 && conn.overflowing.load(Ordering::Acquire) == 0 {
            let mut all_posted = true;
            for o in &p.plan {
                let posted = if all_posted { try_piece(o) } else { None };
                all_posted &= posted.is_some();
                pieces.push(posted.unwrap_or_else(|| piece(o)));
            }
            if all_posted {
                pieces.push(send_notification(conn, &mut lane, p.notify.expect("checked")));
                return Ok(Stage::Moving { pieces, notify: None, _overflow: None });
            }
            // Some wait for a slot: the notification follows their
            // completions instead, and the request counts as overflowing
            // while they wait.
            conn.overflowing.fetch_add(1, Ordering::AcqRel);
            let overflow = Some(Overflow(conn.overflowing.clone()));
            return Ok(notify_after(conn, pieces, p.notify, overflow));
        }
    }
    let overflow = (p.plan.len() > conn.transport.free_slots()).then(|| {
        conn.overflowing.fetch_add(1, Ordering::AcqRel);
        Overflow(conn.overflowing.clone())
    });
    for o in &p.plan {
        pieces.push(piece(o));
    }
    Ok(notify_after(conn, pieces, p.notify, overflow))
}

/// A piece's future, its error naming the peer.
fn named<'a>(peer: String, f: impl Future<Output = Result<(), TransportError>> + Send + 'a) -> Piece<'a> {
    f.map(move |r| r.map_err(|e| AgentError::from_transport(&peer, e))).boxed()
}

/// The stage of pieces in flight whose notification (if any) is sent once
/// they are placed.
fn notify_after<'a>(
    conn: &Arc<Conn>,
    pieces: FuturesUnordered<Piece<'a>>,
    notify: Option<Vec<u8>>,
    overflow: Option<Overflow>,
) -> Stage<'a> {
    Stage::Moving { pieces, notify: notify.map(|m| (m, Arc::downgrade(conn))), _overflow: overflow }
}

/// Copies every piece through the peer's mapped regions, in the calling
/// thread. A copy that fails (the peer deregistered a region) fails the
/// request; the pieces before it have landed.
fn copy_mapped(
    peer: &str,
    p: &Posting<'_>,
    maps: &[(Arc<rmacomm_transport::MappedBuffer>, usize)],
) -> Result<(), AgentError> {
    let bytes: usize = p.plan.iter().map(|o| o.len).sum();
    // A request larger than the cache is copied with non-temporal stores
    // (its pieces of 64 KiB or more): their destination lines would be
    // evicted before anyone reads them, so reading them for ownership
    // first only costs bandwidth (rdma_bench kv 64 x 1 MiB: 7.1 -> 10.4
    // GB/s, medians of three A/B pairs).
    let stream_all = bytes > STREAM_REQUEST;
    let run = || -> Result<(), AgentError> {
        for o in &p.plan {
            let k = p.remotes.iter().position(|(id, _)| *id == o.region).expect("the planner checked the region");
            let mem = p.locals[o.local].get();
            let (m, base) = &maps[k];
            let at = base + o.remote_off as usize;
            let stream = stream_all && o.len >= STREAM_PIECE;
            let r = match (p.op, stream) {
                (Op::Write, false) => m.put(mem.view(o.local_off, o.len).expect("inside a view"), at),
                (Op::Write, true) => m.put_streaming(mem.view(o.local_off, o.len).expect("inside a view"), at),
                (Op::Read, false) => m.get(mem.view_mut(o.local_off, o.len).expect("inside a view"), at),
                (Op::Read, true) => m.get_streaming(mem.view_mut(o.local_off, o.len).expect("inside a view"), at),
            };
            r.map_err(|e| match e {
                // The peer no longer registers the region (its key is
                // revoked): the only argument a mapped copy can fail on
                // once the planner checked the bounds.
                TransportError::InvalidArgument { reason, .. } => AgentError::Refused {
                    peer: peer.to_owned(),
                    op: if p.op == Op::Write { "write" } else { "read" },
                    reason,
                },
                e => AgentError::from_transport(peer, e),
            })?;
        }
        Ok(())
    };
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if bytes > INLINE_COPY_MAX && multi_thread {
        tokio::task::block_in_place(run)
    } else {
        run()
    }
}

impl Future for Transfer<'_> {
    type Output = Result<(), AgentError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        loop {
            let next = match &mut this.stage {
                Stage::Connecting { conn, .. } => {
                    let conn = match conn.poll_unpin(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(c) => c,
                    };
                    let Stage::Connecting { posting, .. } = std::mem::replace(&mut this.stage, Stage::Finished(Ok(())))
                    else {
                        unreachable!("matched above")
                    };
                    conn.and_then(|c| {
                        // The peer restarted (new metadata, new regions)
                        // while this request waited: its addresses and
                        // keys are the old incarnation's. Nothing is sent.
                        if !crate::metadata::same_token(&c.peer_token, &posting.peer_token) {
                            return Err(AgentError::PeerRemoved { peer: this.peer.clone() });
                        }
                        post(&this.peer, &c, posting)
                    })
                    .unwrap_or_else(|e| Stage::Finished(Err(e)))
                }
                Stage::Moving { pieces, notify, .. } => {
                    let mut failed = None;
                    loop {
                        match pieces.poll_next_unpin(cx) {
                            Poll::Pending => return Poll::Pending,
                            Poll::Ready(Some(Ok(()))) => {}
                            Poll::Ready(Some(Err(e))) => {
                                failed = Some(first_cause(pieces, cx, e));
                                break;
                            }
                            Poll::Ready(None) => break,
                        }
                    }
                    match (failed, notify.take()) {
                        // The other pieces keep running in the transport;
                        // dropping their futures cancels nothing.
                        (Some(e), _) => Stage::Finished(Err(e)),
                        (None, None) => Stage::Finished(Ok(())),
                        (None, Some((message, conn))) => match conn.upgrade() {
                            Some(conn) => Stage::Notifying(send_notification(&conn, &mut conn.lane(), message)),
                            None => Stage::Finished(Err(AgentError::PeerRemoved { peer: this.peer.clone() })),
                        },
                    }
                }
                Stage::Notifying(done) => match done.poll_unpin(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(r) => Stage::Finished(r),
                },
                Stage::Finished(r) => return Poll::Ready(r.clone()),
            };
            this.stage = next;
        }
    }
}

/// The error to report for a request one of whose pieces failed with `e`.
/// When `e` only says the connection was already broken, a piece that
/// broke it may have its own error waiting (the transport hands the cause
/// its error before failing the rest, but the piece or notification whose
/// poll reaped the completion sees its own first): that error is the one
/// that says what happened (a refused write, a failed completion).
fn first_cause(pieces: &mut FuturesUnordered<Piece<'_>>, cx: &mut Context<'_>, e: AgentError) -> AgentError {
    if !e.is_consequence() {
        return e;
    }
    while let Poll::Ready(Some(r)) = pieces.poll_next_unpin(cx) {
        if let Err(cause) = r {
            if !cause.is_consequence() {
                return cause;
            }
        }
    }
    e
}

/// Sends a request's notification (its pieces are placed, or posted ahead
/// of it on an ordered link): posted at once where notifying writes are
/// counted in post order and the ring has room, else through the
/// connection's notifier, behind the notifications already there. The
/// future resolves when it is in the peer's ring.
fn send_notification(
    conn: &Arc<Conn>,
    lane: &mut crate::connection::Lane,
    message: Vec<u8>,
) -> BoxFuture<'static, Result<(), AgentError>> {
    if conn.ordered {
        if let Some(n) = conn.try_notify_now(lane, &message) {
            return n;
        }
    }
    let (done_tx, done) = oneshot::channel();
    let peer = conn.peer.clone();
    if let Err(e) = conn.queue_notification(lane, message, done_tx) {
        return futures::future::ready(Err(e)).boxed();
    }
    done.map(move |r| r.unwrap_or(Err(AgentError::PeerRemoved { peer }))).boxed()
}
