//! [`Transfer`]: one request — a list of pieces moved as one unit, then at
//! most one notification — as a future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use rmacomm_transport::{RdmaMemory, RdmaRemoteBuffer, TransportError};
use tokio::sync::{mpsc, oneshot};

use crate::connection::{Conn, Job};
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
    pub(crate) locals: Vec<&'a RdmaMemory>,
    /// The peer's regions the plan names, from its metadata.
    pub(crate) remotes: Vec<(u32, RdmaRemoteBuffer)>,
    pub(crate) notify: Option<Vec<u8>>,
    pub(crate) counters: Arc<Counters>,
}

type Piece<'a> = BoxFuture<'a, Result<(), TransportError>>;

enum Stage<'a> {
    Connecting { conn: BoxFuture<'static, Result<Arc<Conn>, AgentError>>, posting: Posting<'a> },
    Moving { pieces: FuturesUnordered<Piece<'a>>, notify: Option<(Vec<u8>, mpsc::UnboundedSender<Job>)> },
    Notifying { done: oneshot::Receiver<Result<(), AgentError>> },
    Finished(Result<(), AgentError>),
}

impl fmt::Debug for Transfer<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stage = match &self.stage {
            Stage::Connecting { .. } => "connecting",
            Stage::Moving { .. } => "moving",
            Stage::Notifying { .. } => "notifying",
            Stage::Finished(Ok(())) => "done",
            Stage::Finished(Err(_)) => "failed",
        };
        f.debug_struct("Transfer").field("peer", &self.peer).field("ops", &self.ops).field("stage", &stage).finish()
    }
}

impl<'a> Transfer<'a> {
    /// A request whose connection is ready: posted now.
    pub(crate) fn posted(peer: &str, conn: &Conn, posting: Posting<'a>) -> Result<Transfer<'a>, AgentError> {
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

/// Posts every planned operation (the checks that can only be made against
/// the connection come first, so that a failure posts nothing).
fn post<'a>(peer: &str, conn: &Conn, p: Posting<'a>) -> Result<Stage<'a>, AgentError> {
    if let Some(e) = conn.transport.error() {
        return Err(AgentError::from_transport(peer, e));
    }
    if p.locals.iter().any(|m| !m.is_usable_with(&conn.transport)) {
        return Err(AgentError::invalid(
            "transfer",
            "a local memory is on another device than the agent's transports (allocate it with TransferAgent::alloc)",
        ));
    }
    let pieces = FuturesUnordered::new();
    for o in &p.plan {
        let mem = p.locals[o.local];
        let region = p.remotes.iter().find(|(id, _)| *id == o.region).expect("the planner checked the region").1;
        let remote = region.slice(o.remote_off, o.len as u64).expect("the planner checked the bounds");
        // The views lie inside views the caller made of `mem` (coalescing
        // only joins adjacent ones, up to MAX_OP_LEN): they cannot fail.
        let piece: Piece<'a> = match p.op {
            Op::Write => {
                conn.transport.write(mem.view(o.local_off, o.len).expect("inside a view"), &remote, false).boxed()
            }
            Op::Read => conn.transport.read(mem.view_mut(o.local_off, o.len).expect("inside a view"), &remote).boxed(),
        };
        pieces.push(piece);
    }
    Counters::add(&p.counters.ops_posted, p.plan.len() as u64);
    Ok(Stage::Moving { pieces, notify: p.notify.map(|m| (m, conn.notify_tx.clone())) })
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
                    conn.and_then(|c| post(&this.peer, &c, posting)).unwrap_or_else(|e| Stage::Finished(Err(e)))
                }
                Stage::Moving { pieces, notify } => {
                    let mut failed = None;
                    loop {
                        match pieces.poll_next_unpin(cx) {
                            Poll::Pending => return Poll::Pending,
                            Poll::Ready(Some(Ok(()))) => {}
                            Poll::Ready(Some(Err(e))) => {
                                failed = Some(e);
                                break;
                            }
                            Poll::Ready(None) => break,
                        }
                    }
                    match (failed, notify.take()) {
                        // The other pieces keep running in the transport;
                        // dropping their futures cancels nothing.
                        (Some(e), _) => Stage::Finished(Err(AgentError::from_transport(&this.peer, e))),
                        (None, None) => Stage::Finished(Ok(())),
                        (None, Some((message, tx))) => {
                            let (done_tx, done) = oneshot::channel();
                            match tx.send(Job { message, done: done_tx }) {
                                Ok(()) => Stage::Notifying { done },
                                Err(_) => Stage::Finished(Err(AgentError::PeerRemoved { peer: this.peer.clone() })),
                            }
                        }
                    }
                }
                Stage::Notifying { done } => match done.poll_unpin(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(r) => {
                        Stage::Finished(r.unwrap_or_else(|_| Err(AgentError::PeerRemoved { peer: this.peer.clone() })))
                    }
                },
                Stage::Finished(r) => return Poll::Ready(r.clone()),
            };
            this.stage = next;
        }
    }
}
