//! The handshake that makes a connection: its messages and their framing
//! over the TCP stream to the peer's listener (4-byte little-endian length,
//! then JSON).
//!
//! The caller sends a [`Hello`]: the callee's token (proof that it holds
//! the callee's metadata), its own metadata (the callee learns the caller
//! from it), the URL of the transport it made for this peer, and the ring
//! the callee's notifications are to land in. The callee answers
//! [`Reply::Accepted`] with its transport's URL and ring, and both sides
//! `connect` their transports to each other. When both agents start a
//! connection to each other at once, the one whose name sorts first wins:
//! the other answers its hello with [`Reply::Crossing`] and accepts the
//! winner's (see [`on_hello`]).

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
}

#[derive(Serialize, Deserialize)]
pub(crate) enum Reply {
    Accepted {
        url: String,
        ring: RdmaRemoteBuffer,
        slots: u32,
    },
    /// This side is connecting to the caller too and wins the tie: the
    /// caller waits for this side's hello instead.
    Crossing,
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
    Connecting {
        mine: bool,
    },
    Ready,
}

/// What to do with a hello from `them` (sans-IO): refuse it as a crossing
/// when this side is sending its own hello to them and its name sorts
/// first; accept it otherwise (a fresh link, a crossing the caller wins, or
/// a peer reconnecting over a link this side still thinks alive).
pub(crate) fn on_hello(link: LinkState, me: &str, them: &str) -> bool {
    !matches!(link, LinkState::Connecting { mine: true } if me < them)
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
        assert!(on_hello(link, b, a), "b accepts the hello of a, whose name sorts first");
        assert!(!on_hello(link, a, b), "a refuses b's hello as a crossing");
        // Everything else is accepted.
        for link in [Idle, Connecting { mine: false }, Ready] {
            assert!(on_hello(link, a, b) && on_hello(link, b, a), "{link:?}");
        }
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
