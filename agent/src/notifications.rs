//! Notifications received from peers: the queue the connections' drain
//! tasks fill and [`Notifications`], the stream that empties it.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::stream::BoxStream;
use futures::Stream;
use tokio::sync::Notify;

/// One notification: the message a peer attached to a transfer, delivered
/// once all of that transfer's pieces were placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The name of the peer's agent.
    pub peer: String,
    /// The message (up to [`MAX_MESSAGE`](crate::MAX_MESSAGE) bytes).
    pub message: Vec<u8>,
}

/// Received notifications not yet taken, in arrival order (per peer: the
/// order in which that peer's requests completed).
#[derive(Debug, Default)]
pub(crate) struct Queue {
    q: Mutex<Inner>,
    ready: Notify,
}

#[derive(Debug, Default)]
struct Inner {
    items: VecDeque<Notification>,
    /// The agent is gone: streams end once the queue is empty.
    closed: bool,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.q.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn push(&self, n: Notification) {
        self.lock().items.push_back(n);
        self.ready.notify_one();
    }

    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_waiters();
    }

    pub(crate) fn drain(&self) -> Vec<Notification> {
        self.lock().items.drain(..).collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().items.len()
    }

    /// The next notification, waiting for one; `None` once the agent is
    /// dropped and nothing is left.
    async fn pop(&self) -> Option<Notification> {
        loop {
            let ready = self.ready.notified();
            tokio::pin!(ready);
            // Registered before looking, so that a push after the look
            // wakes this waiter.
            ready.as_mut().enable();
            {
                let mut q = self.lock();
                if let Some(n) = q.items.pop_front() {
                    // Another waiter may be owed the wake-up this one took.
                    if !q.items.is_empty() {
                        self.ready.notify_one();
                    }
                    return Some(n);
                }
                if q.closed {
                    return None;
                }
            }
            ready.await;
        }
    }
}

/// The notifications this agent receives, as an async stream of
/// [`Notification`]s (from [`TransferAgent::notifications`](crate::TransferAgent::notifications)).
/// Every notification is yielded once, to one taker: several streams and
/// [`try_notifications`](crate::TransferAgent::try_notifications) share the
/// one queue. The stream ends when the agent is dropped and the queue is
/// empty.
pub struct Notifications {
    inner: BoxStream<'static, Notification>,
}

impl fmt::Debug for Notifications {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Notifications").finish_non_exhaustive()
    }
}

impl Notifications {
    pub(crate) fn new(q: Arc<Queue>) -> Self {
        let inner = futures::stream::unfold(q, |q| async move { q.pop().await.map(|n| (n, q)) });
        Notifications { inner: Box::pin(inner) }
    }
}

impl Stream for Notifications {
    type Item = Notification;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Notification>> {
        self.inner.as_mut().poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn n(peer: &str, m: &[u8]) -> Notification {
        Notification { peer: peer.into(), message: m.to_vec() }
    }

    #[tokio::test]
    async fn each_notification_goes_to_one_taker_in_order_and_streams_end_with_the_agent() {
        let q = Arc::new(Queue::default());
        let mut s1 = Notifications::new(q.clone());
        let mut s2 = Notifications::new(q.clone());
        let waiting = tokio::spawn(async move { s2.next().await });
        tokio::task::yield_now().await;
        q.push(n("a", b"1"));
        q.push(n("a", b"2"));
        q.push(n("b", b"3"));
        let got2 = waiting.await.unwrap().unwrap();
        let got1 = s1.next().await.unwrap();
        let rest = q.drain();
        let mut all: Vec<Notification> = vec![got2, got1];
        all.extend(rest);
        all.sort_by(|x, y| x.message.cmp(&y.message));
        assert_eq!(all, vec![n("a", b"1"), n("a", b"2"), n("b", b"3")]);
        q.push(n("c", b"4"));
        q.close();
        assert_eq!(s1.next().await, Some(n("c", b"4")), "what was queued is still yielded");
        assert_eq!(s1.next().await, None);
    }
}
