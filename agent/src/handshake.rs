//! The handshake that makes a connection: its messages and their framing
//! over the TCP stream to the peer's listener (4-byte little-endian length,
//! then JSON).
//!
//! The caller sends a [`Hello`]: the callee's token (proof that it holds
//! the callee's metadata), its own metadata (the callee learns the caller
//! from it), the URL of the transport it made for this peer, and the ring
//! the callee's notifications are to land in. The callee answers
//! [`Reply::Accepted`] with its transport's URL and ring and an id for the
//! connection, and both sides `connect` their transports to each other.
//! When both agents start a connection to each other at once, the one whose
//! name sorts first wins: the other answers its hello with
//! [`Reply::Crossing`] and accepts the winner's. A hello that would replace
//! a connection the callee is making or still finds alive, and that does
//! not name that connection as the one it replaces, is a stale attempt (or
//! comes before the callee noticed the old connection close): the callee
//! answers [`Reply::Busy`], and the caller retries for as long as its
//! attempt is still current (see [`on_hello`]).

use rmacomm_transport::RdmaRemoteBuffer;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::metadata::MAX_METADATA_LEN;

pub(crate) const VERSION: u32 = 1;
/// Largest frame either side accepts.
const MAX_FRAME: usize = MAX_METADATA_LEN + 64 * 1024;

#[derive(Serialize, Deserialize)]
pub(crate) struct Hello {
    pub(crate) v: u32,
    pub(crate) token: String,
    pub(crate) from: String,
    pub(crate) url: String,
    pub(crate) ring: RdmaRemoteBuffer,
    pub(crate) slots: u32,
    /// The id of the caller's last connection to the callee, which this
    /// one replaces (the caller found it broken), if it had one.
    pub(crate) replaces: Option<u64>,
}

#[derive(Serialize, Deserialize)]
pub(crate) enum Reply {
    Accepted {
        url: String,
        ring: RdmaRemoteBuffer,
        slots: u32,
        id: u64,
    },
    /// This side is connecting to the caller too and wins the tie: the
    /// caller waits for this side's hello instead.
    Crossing,
    /// This side is making, or still has, another connection to the
    /// caller: retry if the attempt is still wanted.
    Busy,
    Refused {
        reason: String,
    },
}

/// Where this agent's link to a peer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkState {
    /// No connection, none being made.
    Idle,
    /// A connection is being made: by this side's hello (`mine`) or by
    /// answering the peer's.
    Connecting { mine: bool },
    /// Connection `id`, alive or found broken.
    Ready { id: u64, usable: bool },
}

/// The answer to a hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Accept,
    Crossing,
    Busy,
}

/// What to do with a hello from `them` that replaces connection `replaces`
/// (sans-IO). Accept it on an idle link, over a broken connection or the
/// very one it says it replaces, and in a crossing the caller wins (its
/// name sorts first); refuse it as a crossing when this side wins; answer
/// busy while this side is already answering a hello of theirs, or holds a
/// live connection the hello does not name: a stale attempt of the peer's,
/// which must not tear down the connection both sides use.
pub(crate) fn on_hello(link: LinkState, me: &str, them: &str, replaces: Option<u64>) -> Answer {
    match link {
        LinkState::Idle => Answer::Accept,
        LinkState::Connecting { mine: true } if me < them => Answer::Crossing,
        LinkState::Connecting { mine: true } => Answer::Accept,
        LinkState::Connecting { mine: false } => Answer::Busy,
        LinkState::Ready { usable: false, .. } => Answer::Accept,
        LinkState::Ready { id, usable: true } if replaces == Some(id) => Answer::Accept,
        LinkState::Ready { .. } => Answer::Busy,
    }
}

pub(crate) async fn write_frame<W: AsyncWriteExt + Unpin, T: Serialize>(w: &mut W, msg: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    w.flush().await
}

pub(crate) async fn read_frame<R: AsyncReadExt + Unpin, T: for<'de> Deserialize<'de>>(r: &mut R) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a {len}-byte handshake frame")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crossing_hellos_leave_exactly_one_connection() {
        use LinkState::*;
        // Both sides connecting: exactly one side accepts the other's hello.
        let (a, b) = ("prefill-0", "prefill-1");
        let link = Connecting { mine: true };
        assert_eq!(on_hello(link, b, a, None), Answer::Accept, "b accepts the hello of a, whose name sorts first");
        assert_eq!(on_hello(link, a, b, None), Answer::Crossing, "a refuses b's hello as a crossing");
        assert_eq!(on_hello(Idle, a, b, None), Answer::Accept);
    }

    #[test]
    fn a_stale_hello_never_replaces_a_live_connection() {
        use LinkState::*;
        let (a, b) = ("a", "b");
        // b's attempt lost the crossing but its hello arrives late: a is
        // already answering one of b's, or connected.
        assert_eq!(on_hello(Connecting { mine: false }, a, b, None), Answer::Busy);
        assert_eq!(on_hello(Ready { id: 7, usable: true }, a, b, None), Answer::Busy);
        assert_eq!(on_hello(Ready { id: 7, usable: true }, a, b, Some(6)), Answer::Busy);
        // The caller found connection 7 broken before this side did.
        assert_eq!(on_hello(Ready { id: 7, usable: true }, a, b, Some(7)), Answer::Accept);
        // This side found it broken too.
        assert_eq!(on_hello(Ready { id: 7, usable: false }, a, b, None), Answer::Accept);
    }

    #[tokio::test]
    async fn frames_round_trip_and_oversized_ones_are_refused() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let reply = Reply::Refused { reason: "no".into() };
        write_frame(&mut a, &reply).await.unwrap();
        assert!(matches!(read_frame::<_, Reply>(&mut b).await.unwrap(), Reply::Refused { reason } if reason == "no"));
        a.write_all(&(u32::MAX).to_le_bytes()).await.unwrap();
        let e = read_frame::<_, Reply>(&mut b).await.err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }
}
