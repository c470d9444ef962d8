//! Opening a requester's connection: the unix socket (same host) or TCP,
//! the hello exchange, and the same-host peer's mapped tables.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Reader, Writer};
use crate::qp_attr::RtsAttr;
use crate::soft::address::SoftAddress;
use crate::soft::config::SoftLink;
use crate::soft::peer::PeerMap;
use crate::soft::qp::SoftQp;
use crate::soft::wire::{Hello, HelloStatus, HELLO_LEN};

/// Opens the connection: unix socket + direct placement on the same host,
/// TCP otherwise; retries until the ACK timeout budget runs out.
pub(super) async fn connect(
    qp: &SoftQp,
    remote: &SoftAddress,
    remote_qpn: u32,
    rts: &RtsAttr,
    ack_timeout: Option<Duration>,
) -> Result<(Reader, Writer, Option<Arc<PeerMap>>, Option<OwnedFd>), String> {
    let same_host = remote.host == qp.ctx.host;
    let use_shm = match qp.ctx.config.link {
        SoftLink::Auto => same_host,
        SoftLink::Shm if !same_host => return Err("RMACOMM_SOFT_LINK=shm but the peer is on another host".into()),
        SoftLink::Shm => true,
        SoftLink::Tcp => false,
    };
    let hello = Hello { src_qpn: qp.qpn, dst_qpn: remote_qpn, token: remote.token, rnr_retry: rts.rnr_retry.min(7) };
    let deadline = Instant::now() + ack_timeout.unwrap_or(Duration::from_secs(30)).max(Duration::from_secs(2));
    let mut last_err = String::new();
    while Instant::now() < deadline {
        let attempt = async {
            if use_shm {
                let addr = <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(
                    remote.unix.as_bytes(),
                )
                .map_err(|e| e.to_string())?;
                let s =
                    std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| format!("unix connect: {e}"))?;
                // Who really serves that socket: the direct path trusts the
                // kernel's word, never the endpoint's pid.
                let cred = rustix::net::sockopt::socket_peercred(&s).map_err(|e| format!("SO_PEERCRED: {e}"))?;
                let same_user = cred.uid == rustix::process::geteuid();
                let served_by = same_user.then(|| cred.pid.as_raw_nonzero().get() as u32);
                s.set_nonblocking(true).map_err(|e| e.to_string())?;
                // A second descriptor of the same socket, for notifies sent
                // by the posting thread (it stays valid whatever the task
                // does with its own).
                let dup = s.try_clone().ok().map(OwnedFd::from);
                let s = tokio::net::UnixStream::from_std(s).map_err(|e| e.to_string())?;
                let (r, w) = s.into_split();
                Ok::<(Reader, Writer, Option<OwnedFd>, Option<u32>), String>((Box::new(r), Box::new(w), dup, served_by))
            } else {
                let mut err = String::from("no TCP address");
                for a in &remote.tcp {
                    match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(a)).await {
                        Ok(Ok(s)) => {
                            let _ = s.set_nodelay(true);
                            // A second descriptor for the posting thread's
                            // small requests (as for the unix socket).
                            let (s, dup) = match s.into_std() {
                                Ok(std_s) => {
                                    let dup = std_s.try_clone().ok().map(OwnedFd::from);
                                    match tokio::net::TcpStream::from_std(std_s) {
                                        Ok(s) => (s, dup),
                                        Err(e) => {
                                            err = format!("tcp connect {a}: {e}");
                                            continue;
                                        }
                                    }
                                }
                                Err(e) => {
                                    err = format!("tcp connect {a}: {e}");
                                    continue;
                                }
                            };
                            let (r, w) = s.into_split();
                            return Ok((Box::new(r) as Reader, Box::new(w) as Writer, dup, None));
                        }
                        Ok(Err(e)) => err = format!("tcp connect {a}: {e}"),
                        Err(_) => err = format!("tcp connect {a}: timed out"),
                    }
                }
                Err(err)
            }
        };
        match attempt.await {
            Ok((mut r, mut w, dup, served_by)) => {
                let mut buf = [0u8; HELLO_LEN];
                let sent = match w.write_all(&hello.encode()).await {
                    Ok(()) => tokio::time::timeout(Duration::from_secs(10), r.read_exact(&mut buf))
                        .await
                        .map_err(|_| "no reply to hello within 10 s".to_string())?
                        .map_err(|e| format!("hello reply: {e}")),
                    Err(e) => Err(format!("hello: {e}")),
                };
                if let Err(e) = sent {
                    // Closed before any answer: the listener never took the
                    // hello (it closed the connection as one of too many
                    // pending handshakes, as under a flood of idle
                    // connections, or the peer is going away). Nothing was
                    // admitted, so trying again is safe; a peer that is gone
                    // refuses the next connect, until the deadline.
                    last_err = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                match HelloStatus::decode(&buf).map_err(|e| e.to_string())? {
                    HelloStatus::Ok => {}
                    HelloStatus::BadToken => {
                        return Err("peer refused the connection: unknown QP or wrong token".into());
                    }
                    HelloStatus::BadState => {
                        // The peer QP is in ERR; it may be reset and reused.
                        last_err = "peer QP is in the error state".into();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                }
                let peer = match served_by {
                    Some(pid) => match qp.ctx.peer(remote, remote_qpn, pid).await {
                        Ok(p) => Some(p),
                        Err(e) => {
                            tracing::info!("same-host peer's tables cannot be mapped ({e}); staging every transfer");
                            None
                        }
                    },
                    None if use_shm => {
                        tracing::info!("same-host peer runs as another user; staging every transfer");
                        None
                    }
                    None => None,
                };
                return Ok((r, w, peer, dup));
            }
            Err(e) => {
                last_err = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    Err(last_err)
}
