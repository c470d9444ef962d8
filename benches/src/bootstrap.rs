//! The bootstrap connection between client and server: one TCP stream of
//! JSON lines that carries the session settings, each side's endpoint
//! (transport URL, virtual-QP endpoint, or the window's store port) and buffer, the server's part of
//! bidirectional and ping-pong tests, and the per-size refills and checksums.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

use ibverbx::VirtualQpEndpoint;
use rmacomm_transport::RdmaRemoteBuffer;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{BenchError, Result};
use crate::host::HostInfo;
use crate::plan::Plan;

/// Bumped when the messages change; both ends must agree.
pub const PROTOCOL_VERSION: u32 = 2;

/// Client → server: what to set up.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the client.
    pub version: u32,
    /// Operation name.
    pub op: String,
    /// Largest message of the run (each side registers twice this).
    pub max_bytes: u64,
    /// Physical QPs.
    pub qps: u32,
    /// `dqplb` or `spray`.
    pub lb: String,
    /// Fragment size.
    pub frag_size: u64,
    /// `auto`, `verbs` or `soft`.
    pub provider: String,
    /// `auto`, `shm` or `tcp`.
    pub link: String,
    /// Operations in flight in bandwidth tests.
    pub tx_depth: u32,
    /// Busy-poll setting of the client (`None`: the test's default).
    pub busy_poll_us: Option<u64>,
}

/// Either side → the other: how to reach it. `Debug` redacts the URL (its
/// tokens admit a connection); the endpoint redacts its own.
#[derive(Clone, Serialize, Deserialize)]
pub struct SideInfo {
    /// Provider actually used (`soft`, `verbs`).
    pub provider: String,
    /// Device actually used.
    pub device: String,
    /// Where the process runs.
    pub host: HostInfo,
    /// Transport URL (transport operations).
    pub url: Option<String>,
    /// Virtual QP endpoint (raw operations).
    pub vqp: Option<VirtualQpEndpoint>,
    /// The registered buffer: source half, then destination half.
    pub buf: RdmaRemoteBuffer,
    /// Window operations: the port of the server's group store (a
    /// `TcpStore` the client joins at the server's address).
    #[serde(default)]
    pub store_port: Option<u16>,
}

impl std::fmt::Debug for SideInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let SideInfo { provider, device, host, url, vqp, buf, store_port } = self;
        f.debug_struct("SideInfo")
            .field("provider", provider)
            .field("device", device)
            .field("host", host)
            .field("url", &url.as_deref().map(rmacomm_transport::redact_url))
            .field("vqp", vqp)
            .field("buf", buf)
            .field("store_port", store_port)
            .finish()
    }
}

/// The halves of each side's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Region {
    /// `[0, max)`: what this side sends, filled with its pattern.
    Src,
    /// `[max, 2 max)`: where the peer's data lands.
    Dst,
}

/// Client → server requests after the connection is up.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "req", rename_all = "snake_case")]
pub enum Request {
    /// Run the same bandwidth test towards the client (bidirectional).
    Bandwidth {
        /// Message size.
        size: u64,
        /// Iterations.
        plan: Plan,
    },
    /// Answer `count` notifying writes of `size` bytes, one each.
    Echo {
        /// Message size.
        size: u64,
        /// Pings to answer.
        count: u64,
    },
    /// Refill the first `len` bytes of the source half with the pattern
    /// of `seed` (before each size, so that each size's check covers only
    /// what that size moved).
    Fill {
        /// Pattern seed.
        seed: u64,
        /// Bytes from the start of the source half.
        len: u64,
    },
    /// Checksum of the first `len` bytes of a region.
    Checksum {
        /// Which half.
        region: Region,
        /// Bytes from its start.
        len: u64,
    },
    /// The run is over.
    Bye,
}

/// Server → client answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// The server's direction of a bidirectional test.
    Bandwidth {
        /// Iterations done.
        iterations: u64,
        /// Average bytes/s.
        avg_bps: f64,
        /// Peak bytes/s.
        peak_bps: f64,
        /// Million messages/s.
        msg_rate_mpps: f64,
    },
    /// Every ping was answered.
    EchoDone,
    /// The source half was refilled.
    Filled,
    /// A checksum.
    Checksum {
        /// The value.
        value: u64,
    },
    /// The server failed; it exits after sending this.
    Error {
        /// Why.
        message: String,
    },
}

/// How long a client waits for the server's answer to its hello (the
/// server's endpoint, or its error): the server sets up its memory and
/// queue pairs in that time, or is not an rdma_bench server. 60 s, or
/// `RDMA_BENCH_HELLO_TIMEOUT_SECONDS`.
pub(crate) fn hello_answer_timeout() -> std::time::Duration {
    env_seconds("RDMA_BENCH_HELLO_TIMEOUT_SECONDS", 60)
}

/// `var` as a positive number of seconds, else `default` seconds.
fn env_seconds(var: &str, default: u64) -> std::time::Duration {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map_or(std::time::Duration::from_secs(default), std::time::Duration::from_secs_f64)
}

/// How long the client waits for each of the server's replies once the
/// run is under way (`RDMA_BENCH_REPLY_TIMEOUT_SECONDS`, default 120 s): a
/// reply comes when the server's part of a step ends, at most moments after
/// the client's own (it waited forever for a server that stopped
/// answering).
pub(crate) fn reply_timeout() -> std::time::Duration {
    env_seconds("RDMA_BENCH_REPLY_TIMEOUT_SECONDS", 120)
}

/// One JSON-lines connection.
#[derive(Debug)]
pub struct Control {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// How long a receive waits (see [`set_timeout`](Self::set_timeout)).
    timeout: Option<std::time::Duration>,
}

impl Control {
    /// Wraps a connected stream.
    pub fn new(s: TcpStream) -> Result<Control> {
        s.set_nodelay(true)?;
        Ok(Control { reader: BufReader::new(s.try_clone()?), writer: s, timeout: None })
    }

    /// Receives wait at most `t` (`None`: without a limit, for answers
    /// that come after a measurement of the user's length): a peer that
    /// accepted the connection and never answers is an error, not a hang.
    pub fn set_timeout(&mut self, t: Option<std::time::Duration>) -> Result<()> {
        self.writer.set_read_timeout(t)?;
        self.timeout = t;
        Ok(())
    }

    /// Sends one message.
    pub fn send<T: Serialize>(&mut self, msg: &T) -> Result<()> {
        let mut line = serde_json::to_vec(msg).map_err(BenchError::run)?;
        line.push(b'\n');
        self.writer.write_all(&line)?;
        Ok(())
    }

    /// Receives one message; end of stream is an error naming `what`.
    pub fn recv<T: DeserializeOwned>(&mut self, what: &str) -> Result<T> {
        self.recv_or_end(what)?.ok_or_else(|| {
            BenchError::Run(format!("the peer closed the bootstrap connection while {what} was expected"))
        })
    }

    /// Receives one message, or `None` at the end of the stream (the peer
    /// closed the connection, or it was reset: the peer exited).
    pub fn recv_or_end<T: DeserializeOwned>(&mut self, what: &str) -> Result<Option<T>> {
        let mut line = String::new();
        let n = match self.reader.read_line(&mut line) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                let t = self.timeout.unwrap_or_default();
                return Err(BenchError::Run(format!(
                    "no answer on the bootstrap connection within {t:?} while {what} was expected; is the peer an \
                     rdma_bench of this version, and alive?"
                )));
            }
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            return Ok(None);
        }
        serde_json::from_str(&line)
            .map(Some)
            .map_err(|e| BenchError::Run(format!("bad bootstrap message ({what}): {e}: {}", line.trim_end())))
    }

    /// The address of the other end, as text (for the server: where the
    /// client dialled from).
    pub fn peer_host(&self) -> Result<String> {
        Ok(self.writer.peer_addr()?.ip().to_string())
    }

    /// Receives a reply; a server error becomes this side's error.
    pub fn reply(&mut self, what: &str) -> Result<Reply> {
        match self.recv::<Reply>(what)? {
            Reply::Error { message } => Err(BenchError::Run(format!("server: {message}"))),
            r => Ok(r),
        }
    }
}

/// `HOST[:PORT]` (IPv6 in brackets) with `default_port`.
pub fn parse_peer(s: &str, default_port: u16) -> std::result::Result<(String, u16), String> {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').ok_or_else(|| format!("{s:?}: missing ']'"))?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| format!("{s:?}: bad port"))?,
            None if tail.is_empty() => default_port,
            None => return Err(format!("{s:?}: expected [HOST]:PORT")),
        };
        return Ok((host.to_owned(), port));
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => {
            Ok((h.to_owned(), p.parse().map_err(|_| format!("{s:?}: bad port {p:?}"))?))
        }
        _ if s.is_empty() => Err("empty host".into()),
        _ => Ok((s.to_owned(), default_port)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Measure;

    #[test]
    fn side_info_debug_redacts_the_url() {
        let info = SideInfo {
            provider: "soft".into(),
            device: "soft0".into(),
            host: HostInfo::current(),
            url: Some("rmacomm://soft/eyJzZWNyZXQiOiJ0b2tlbiJ9".into()),
            vqp: None,
            buf: RdmaRemoteBuffer { addr: 0x1000, len: 64, key: 7 },
            store_port: None,
        };
        let d = format!("{info:?}");
        assert!(d.contains("rmacomm://soft/<redacted>") && d.contains("soft0"), "{d}");
        assert!(!d.contains("eyJzZWNyZXQi"), "the URL's payload leaked: {d}");
    }

    #[test]
    fn peers() {
        assert_eq!(parse_peer("10.0.0.1", 18515), Ok(("10.0.0.1".into(), 18515)));
        assert_eq!(parse_peer("host:99", 1), Ok(("host".into(), 99)));
        assert_eq!(parse_peer("[::1]:7", 1), Ok(("::1".into(), 7)));
        assert_eq!(parse_peer("[::1]", 5), Ok(("::1".into(), 5)));
        assert_eq!(parse_peer("::1", 5), Ok(("::1".into(), 5)));
        assert!(parse_peer("host:x", 1).is_err());
        assert!(parse_peer("", 1).is_err());
    }

    #[test]
    fn messages_round_trip() {
        let r = Request::Bandwidth { size: 8, plan: Plan { warmup: 1, measure: Measure::Count(3) } };
        let j = serde_json::to_string(&r).unwrap();
        assert!(j.contains("\"req\":\"bandwidth\""), "{j}");
        assert!(matches!(serde_json::from_str::<Request>(&j).unwrap(), Request::Bandwidth { size: 8, .. }));
        let j = serde_json::to_string(&Request::Checksum { region: Region::Dst, len: 4 }).unwrap();
        assert!(j.contains("\"region\":\"dst\""), "{j}");
        let j = serde_json::to_string(&Reply::Checksum { value: 9 }).unwrap();
        assert!(matches!(serde_json::from_str::<Reply>(&j).unwrap(), Reply::Checksum { value: 9 }));
    }
}
