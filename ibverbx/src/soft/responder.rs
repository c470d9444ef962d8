//! The responder side of a soft QP: validates and executes the requests
//! arriving on one connection, in order.
//!
//! A request that fails a check is answered with a NAK and the connection is
//! closed; a malformed frame closes the connection at once. Payloads are read
//! from the socket straight into the registered memory (through raw
//! pointers, `raw_io`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use super::device_io::{device_atomic, read_device, recv_to, recv_to_while, Failed};
use super::mr::{SoftMr, Target};
use super::polled_rx::{PolledRx, RxFd, POLLED_MAX};
use super::qp::{RecvEntry, SoftQp};
use super::raw_io::send_frame_while;
use super::raw_io::HasSock;
use super::wire::{Frame, Hello, Syndrome, HEADER_LEN};
use crate::provider::QpOps;
use crate::qp_attr::QpState;
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};
use crate::AccessFlags;

enum Outcome {
    Continue,
    /// The request was refused (or the connection must end): close, after
    /// lingering for the peer to read the answer.
    Close,
    /// The QP left service (error or reset) while a request was still
    /// arriving: close at once.
    Dead,
}

/// ACKs not sent yet. Consecutive WRITE, notify and SEND requests are
/// answered by one cumulative ACK of the last one's PSN (as RC's ACKs are
/// cumulative) while more requests already wait in the socket: one write
/// and one wake-up of the requester's reader per batch instead of per
/// request. A batch is sent when nothing more is readable (so a lone
/// request is answered at once), after [`ACK_BATCH`] requests or
/// [`ACK_BATCH_BYTES`] of payload (so the requester's window keeps moving),
/// and before any other answer (NAK, RNR wait, READ or atomic response),
/// which must not overtake it.
///
/// The receive completions of the requests an ACK covers are made visible
/// only once that ACK is written (as an HCA acknowledges at placement,
/// before the receiver's CQ shows anything): a receiver that exits as soon
/// as it sees a notification still leaves the requester its ACK, so the
/// requester never reports a delivered message as lost.
#[derive(Default)]
struct Acks {
    psn: Option<u32>,
    count: u32,
    bytes: u64,
}

const ACK_BATCH: u32 = 16;
const ACK_BATCH_BYTES: u64 = 256 << 10;

impl Acks {
    fn add(&mut self, psn: u32, len: u32) {
        self.psn = Some(psn);
        self.count += 1;
        self.bytes += u64::from(len);
    }

    fn full(&self) -> bool {
        self.count >= ACK_BATCH || self.bytes >= ACK_BATCH_BYTES
    }

    async fn flush<S: AsyncWrite + Unpin>(&mut self, s: &mut S, qp: &SoftQp) -> std::io::Result<()> {
        let sent = match self.psn.take() {
            Some(psn) => {
                self.count = 0;
                self.bytes = 0;
                s.write_all(&Frame::Ack { psn }.encode()).await
            }
            None => Ok(()),
        };
        // The data is placed either way: a lost connection does not take
        // the receiver's completions with it.
        qp.rx_release();
        sent
    }

    /// [`flush`](Self::flush) by a busy-poller, on its own descriptor.
    fn flush_now(&mut self, fd: &RxFd, qp: &SoftQp) {
        if let Some(psn) = self.psn.take() {
            self.count = 0;
            self.bytes = 0;
            if let Err(e) = fd.send_all(&Frame::Ack { psn }.encode()) {
                // The connection's thread sees the connection end.
                tracing::debug!("soft QP {:#x}: ACK not sent: {e}", qp.qpn);
                fd.shut();
            }
        }
        qp.rx_release();
    }
}

/// A connection's gate (see `polled_rx.rs`): held by whoever reads the
/// connection, for a whole frame; the pending ACKs live under it (the
/// receive completions they cover are held by the QP, `SoftQp::rx_hold`).
struct Gate {
    st: tokio::sync::Mutex<GateState>,
    /// Busy-pollers' descriptor of the socket (tcp only, when enabled).
    fd: Option<RxFd>,
    qp: Weak<SoftQp>,
    epoch: u64,
    max_msg: u32,
}

impl Drop for Gate {
    fn drop(&mut self) {
        // A connection's task cancelled with completions held (its runtime
        // shutting down, its handshake aborted): they are still made
        // visible, and the QP's count of held ones stays true.
        if let Some(qp) = self.qp.upgrade() {
            qp.rx_release();
        }
    }
}

#[derive(Default)]
struct GateState {
    acks: Acks,
    /// The connection came from the remote QP that RTR named (checked by
    /// the connection's thread on its first request).
    checked_peer: bool,
    /// The connection's thread is done with it (or it failed).
    closed: bool,
}

/// Serves one connection until it closes, the QP leaves service, or a
/// request fails.
pub(crate) async fn run<S>(qp: Arc<SoftQp>, s: S, hello: Hello, peer: String)
where
    S: AsyncRead + AsyncWrite + HasSock + Unpin + Send,
{
    let mut state_rx = qp.state_tx.subscribe();
    let epoch = qp.epoch();
    let max_msg = qp.ctx.config.max_msg_size;
    let polled = qp.ctx.config.polled_rx && s.sock().is_tcp();
    let gate = Arc::new(Gate {
        st: Default::default(),
        fd: if polled { RxFd::dup(s.sock().fd()).ok() } else { None },
        qp: Arc::downgrade(&qp),
        epoch,
        max_msg,
    });
    if gate.fd.is_some() {
        let weak: Weak<Gate> = Arc::downgrade(&gate);
        qp.rx_register(false, weak);
    }
    // The QP's error or reset ends the connection wherever it waits: a
    // response or an ACK blocked on a peer that stopped reading (its
    // buffers full) held the QP and the region's owner for as long as the
    // peer kept the socket open. The socket is shut down (through a
    // duplicate descriptor), so that the blocked write fails and the
    // connection ends through its own paths (a receive it took is
    // completed or flushed there; cancelling it lost the receive).
    let shut = s.sock().fd().try_clone_to_owned();
    let mut dead_rx = state_rx.clone();
    let serve = serve_conn(&qp, s, hello, peer, &mut state_rx, &gate);
    tokio::pin!(serve);
    tokio::select! {
        biased;
        () = &mut serve => {}
        () = dead(&qp, epoch, &mut dead_rx) => {
            if let Ok(fd) = &shut {
                use std::os::fd::AsRawFd;
                tracing::debug!("soft QP {:#x}: left service; its connection is shut down", qp.qpn);
                // SAFETY: shutdown of our own (duplicate) descriptor.
                unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
            }
            serve.await;
        }
    }
    let mut g = gate.st.lock().await;
    g.closed = true;
    qp.rx_release();
}

/// `run`'s loop; every way out leaves the held completions to `run`.
async fn serve_conn<S>(
    qp: &Arc<SoftQp>,
    mut s: S,
    hello: Hello,
    peer: String,
    state_rx: &mut watch::Receiver<QpState>,
    gate: &Gate,
) where
    S: AsyncRead + AsyncWrite + HasSock + Unpin + Send,
{
    let (epoch, max_msg) = (gate.epoch, gate.max_msg);
    loop {
        {
            let mut g = gate.st.lock().await;
            // Pollers went on to other work: take the connection back.
            if let Some(fd) = gate.fd.as_ref().filter(|fd| fd.stale()) {
                fd.lower();
            }
            let acks = &mut g.acks;
            if acks.psn.is_some() && (acks.full() || !s.sock().readable_now()) {
                if let Err(e) = acks.flush(&mut s, qp).await {
                    g.closed = true;
                    return tracing::debug!("soft QP {:#x}: connection to {peer} lost: {e}", qp.qpn);
                }
            }
        }
        let sock = s.sock();
        let watch = async {
            match &gate.fd {
                Some(fd) => fd.watch().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = sock.readable() => {
                if r.is_err() {
                    return;
                }
            }
            _ = dead(qp, epoch, state_rx) => return,
            _ = watch => continue,
        }
        // Whoever holds the gate reads whole frames: a busy-poller may have
        // taken what made the socket readable. This thread reads at the
        // normal mark.
        let mut g = gate.st.lock().await;
        if let Some(fd) = &gate.fd {
            fd.lower();
        }
        let mut hdr = [0u8; HEADER_LEN];
        match s.sock().try_recv(&mut hdr) {
            Ok(0) => return,
            Ok(n) if n < HEADER_LEN => {
                // The rest of the header, unless the QP leaves service first
                // (a peer stalled mid-header keeps nothing alive).
                tokio::select! {
                    biased;
                    r = s.read_exact(&mut hdr[n..]) => if r.is_err() {
                        return;
                    },
                    _ = dead(qp, epoch, state_rx) => return,
                }
            }
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) => continue,
            Err(_) => return,
        }
        let f = match Frame::decode(&hdr, max_msg) {
            Ok(f) if f.is_request() => f,
            Ok(f) => {
                return tracing::warn!(
                "soft QP {:#x}: peer {peer} (QP {:#x}) sent response frame {f:?} as a request; closing the connection",
                qp.qpn,
                hello.src_qpn
            )
            }
            Err(e) => {
                return tracing::warn!(
                    "soft QP {:#x}: malformed frame from peer {peer} (QP {:#x}): {e}; closing the connection",
                    qp.qpn,
                    hello.src_qpn
                )
            }
        };
        qp.ctx.touch();
        if !ready(qp, epoch, state_rx).await {
            return;
        }
        // A connection admitted before RTR must come from the remote QP
        // that RTR then named.
        if !g.checked_peer {
            if qp.rtr_remote_qpn().is_some_and(|q| q != hello.src_qpn) {
                g.closed = true;
                return tracing::warn!(
                    "soft QP {:#x}: connection from {peer} is QP {:#x}, not the one set at RTR; closing it",
                    qp.qpn,
                    hello.src_qpn
                );
            }
            g.checked_peer = true;
        }
        match serve(qp, &mut s, &mut g.acks, f, epoch, hello.rnr_retry, state_rx).await {
            Ok(Outcome::Continue) => {}
            Ok(Outcome::Close) => {
                g.closed = true;
                // What was placed is completed now, not after lingering on
                // a stalled peer for seconds (with the QP in error or
                // reset meanwhile).
                qp.rx_release();
                return linger(&mut s).await;
            }
            Ok(Outcome::Dead) => {
                g.closed = true;
                qp.rx_release();
                return tracing::debug!(
                    "soft QP {:#x}: left service while a request from {peer} was arriving; connection closed",
                    qp.qpn
                );
            }
            Err(e) => {
                g.closed = true;
                return tracing::debug!("soft QP {:#x}: connection to {peer} lost: {e}", qp.qpn);
            }
        }
    }
}

impl PolledRx for Gate {
    /// Receives the small WRITEs and notifies already waiting whole in the
    /// socket, in order, while the QP may receive and (with an immediate)
    /// a receive is posted; then sends their ACK. Anything else is left in
    /// the socket for the connection's thread.
    fn drive(&self) -> bool {
        let Some(fd) = &self.fd else { return false };
        let Ok(mut g) = self.st.try_lock() else { return false };
        if g.closed || !g.checked_peer {
            return false;
        }
        let Some(qp) = self.qp.upgrade() else { return false };
        fd.begin();
        let mut served = 0;
        // Whether it stopped at a frame it leaves to the thread (rather
        // than at one not all there yet, or at none).
        let declined = loop {
            if served == ACK_BATCH {
                break false;
            }
            if qp.epoch() != self.epoch
                || !matches!(qp.state(), QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe)
            {
                break true;
            }
            // The next frame, and whether all of it is there, in one look
            // (a second, longer one for payloads over 256 bytes).
            let mut look = [0u8; HEADER_LEN + 256];
            let mut there = fd.peek(&mut look);
            let mut looked = look.len();
            if there < HEADER_LEN {
                break false;
            }
            let mut hdr = [0u8; HEADER_LEN];
            hdr.copy_from_slice(&look[..HEADER_LEN]);
            if let Ok(Frame::Write { len, .. }) = Frame::decode(&hdr, self.max_msg) {
                if len > 256 && len <= POLLED_MAX {
                    looked = HEADER_LEN + POLLED_MAX as usize + 1;
                    there = fd.peek(&mut [0u8; HEADER_LEN + POLLED_MAX as usize + 1]);
                }
            }
            let (psn, payload, wc_len, imm, dest) = match Frame::decode(&hdr, self.max_msg) {
                Ok(Frame::Write { psn, raddr, rkey, len, imm }) if len <= POLLED_MAX => {
                    let dest = if len > 0 {
                        match check(&qp, rkey, raddr, len as u64, AccessFlags::REMOTE_WRITE) {
                            // Held registered until the payload is taken.
                            Some((mr, Target::Host(p))) => match mr.hold(&qp.ctx.fences) {
                                Some(registered) => Some((mr, p, registered)),
                                None => break true,
                            },
                            // Device memory (and a refused key) take the
                            // engine's path.
                            Some((_, Target::Device(..))) | None => break true,
                        }
                    } else {
                        None
                    };
                    (psn, len, len, imm, dest)
                }
                Ok(Frame::Notify { psn, len, imm }) => (psn, 0, len, Some(imm), None),
                _ => break true,
            };
            if there < HEADER_LEN + payload as usize {
                break false;
            }
            let recv = match imm {
                Some(_) => {
                    qp.db_claim_in_order();
                    let mut rq = qp.rq.lock().unwrap_or_else(|e| e.into_inner());
                    // As take_recv: no receive of a later life.
                    if qp.epoch() != self.epoch {
                        break true;
                    }
                    let Some(r) = qp.rx_take(&mut rq) else { break true };
                    Some(r)
                }
                None => None,
            };
            // SAFETY: hdr is a live local; dest..+payload was checked
            // against a live MR, held (and held registered) by `dest` until
            // the read is done. Both
            // are waiting in the socket (peeked).
            let taken = unsafe {
                let to = dest.as_ref().map_or(0, |(_mr, p, _registered)| *p);
                fd.take(&[(hdr.as_mut_ptr() as usize, HEADER_LEN), (to, payload as usize)])
            };
            if let Err(e) = taken {
                // Not reached (the bytes were peeked): end the connection,
                // as a read error there would.
                tracing::debug!("soft QP {:#x}: polled receive failed: {e}", qp.qpn);
                if let Some(r) = recv {
                    qp.give_back_recv(self.epoch, r);
                }
                fd.shut();
                break true;
            }
            qp.ctx.touch();
            if let (Some(r), Some(imm)) = (recv, imm) {
                qp.rx_hold(recv_wc(&qp, &r, WcStatus::Success, WcOpcode::RecvRdmaWithImm, wc_len, Some(imm)));
            }
            g.acks.add(psn, payload);
            served += 1;
            // Nothing followed it when it was looked at: the next pass
            // looks again (not this one: a look at an empty socket is a
            // system call on the way to the ACK).
            if there == HEADER_LEN + payload as usize && there < looked {
                break false;
            }
        };
        if served > 0 {
            g.acks.flush_now(fd, &qp);
        }
        if declined {
            fd.lower();
        }
        served > 0
    }

    fn release(&self) {
        if let (Some(fd), Ok(_g)) = (&self.fd, self.st.try_lock()) {
            fd.lower();
        }
    }
}

/// Closes after a NAK without losing it: half-close, then discard what the
/// requester had already sent until it closes too (closing a TCP socket with
/// unread data would reset the connection and drop the NAK in flight).
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) {
    let _ = s.flush().await;
    let _ = s.shutdown().await;
    let drain = async {
        let mut scratch = vec![0u8; 64 * 1024];
        while let Ok(n) = s.read(&mut scratch).await {
            if n == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
}

/// Resolves when the QP enters ERR, is reset after the connection was
/// accepted (`epoch`), or is gone.
async fn dead(qp: &SoftQp, epoch: u64, rx: &mut watch::Receiver<QpState>) {
    loop {
        if *rx.borrow_and_update() == QpState::Err || qp.epoch() != epoch {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Waits until the QP can receive (RTR or RTS); false when it never will.
async fn ready(qp: &SoftQp, epoch: u64, rx: &mut watch::Receiver<QpState>) -> bool {
    let wait = async {
        loop {
            if qp.epoch() != epoch {
                return false;
            }
            match *rx.borrow_and_update() {
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe => return true,
                QpState::Err => return false,
                QpState::Init | QpState::Reset => {}
            }
            if rx.changed().await.is_err() {
                return false;
            }
        }
    };
    match tokio::time::timeout(std::time::Duration::from_secs(30), wait).await {
        Ok(ok) => ok,
        Err(_) => {
            tracing::warn!("soft QP {:#x} received requests but did not reach RTR within 30 s", qp.qpn);
            false
        }
    }
}

/// Checks a remote access against the MR and the QP's access flags.
fn check(qp: &SoftQp, rkey: u32, raddr: u64, len: u64, need: AccessFlags) -> Option<(Arc<SoftMr>, Target)> {
    if !qp.remote_access().contains(need) {
        return None;
    }
    let mr = qp.ctx.mr(rkey)?;
    let t = mr.target(qp.pd, raddr, len, need)?;
    Some((mr, t))
}

/// The NAK for a device copy that failed (its error logged).
async fn device_nak<S: AsyncWrite + Unpin>(
    qp: &SoftQp,
    s: &mut S,
    acks: &mut Acks,
    psn: u32,
    what: &str,
    e: Failed,
) -> std::io::Result<Outcome> {
    match e {
        Failed::Io(e) => Err(e),
        Failed::Copy(e) => {
            tracing::warn!("soft QP {:#x}: {what}: device copy failed: {e}", qp.qpn);
            nak(qp, s, acks, psn, Syndrome::RemoteOp, &format!("{what}: device copy failed: {e}")).await
        }
    }
}

async fn nak<S: AsyncWrite + Unpin>(
    qp: &SoftQp,
    s: &mut S,
    acks: &mut Acks,
    psn: u32,
    syndrome: Syndrome,
    why: &str,
) -> std::io::Result<Outcome> {
    tracing::debug!("soft QP {:#x}: NAK {syndrome:?} for PSN {psn}: {why}", qp.qpn);
    acks.flush(s, qp).await?;
    s.write_all(&Frame::Nak { psn, syndrome }.encode()).await?;
    Ok(Outcome::Close)
}

/// Takes a posted receive, sending RNR waits while there is none.
async fn take_recv<S: AsyncWrite + Unpin>(
    qp: &SoftQp,
    s: &mut S,
    acks: &mut Acks,
    psn: u32,
    epoch: u64,
    rnr_retry: u8,
    state_rx: &mut watch::Receiver<QpState>,
) -> std::io::Result<Option<RecvEntry>> {
    let period = qp.rnr_period();
    let mut waits = 0u32;
    loop {
        let notified = qp.rq_notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // A doorbell record of this connection is older than this request:
        // it takes its receive first, unless completions of receives taken
        // before are held (then it goes behind them, claimed as they are
        // released, and this request's receive comes first).
        qp.db_claim_in_order();
        {
            let mut rq = qp.rq.lock().unwrap_or_else(|e| e.into_inner());
            // A connection of an earlier life takes no receive of this one
            // (checked under the RQ lock: a reset moves the epoch before it
            // clears the queue, and the next life posts after that).
            if qp.epoch() != epoch {
                return Ok(None);
            }
            if let Some(r) = qp.rx_take(&mut rq) {
                return Ok(Some(r));
            }
        }
        if *state_rx.borrow() == QpState::Err || qp.epoch() != epoch {
            return Ok(None);
        }
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(period) => {
                // The requester gives up after rnr_retry waits (7: never);
                // so does this side, one period later.
                if rnr_retry < 7 && waits > rnr_retry as u32 {
                    return Ok(None);
                }
                waits += 1;
                acks.flush(s, qp).await?;
                s.write_all(&Frame::RnrWait { psn }.encode()).await?;
            }
            _ = dead(qp, epoch, state_rx) => return Ok(None),
        }
    }
}

fn recv_wc(
    qp: &SoftQp,
    r: &RecvEntry,
    status: WcStatus,
    opcode: WcOpcode,
    len: u32,
    imm: Option<u32>,
) -> WorkCompletion {
    WorkCompletion { wr_id: r.wr_id, status, opcode, byte_len: len, imm_data: imm, qp_num: qp.qpn, vendor_err: 0 }
}

async fn serve<S>(
    qp: &SoftQp,
    s: &mut S,
    acks: &mut Acks,
    f: Frame,
    epoch: u64,
    rnr_retry: u8,
    state_rx: &mut watch::Receiver<QpState>,
) -> std::io::Result<Outcome>
where
    S: AsyncRead + AsyncWrite + HasSock + Unpin + Send,
{
    match f {
        Frame::Write { psn, raddr, rkey, len, imm } => {
            if len > 0 {
                let Some((mr, t)) = check(qp, rkey, raddr, len as u64, AccessFlags::REMOTE_WRITE) else {
                    return nak(qp, s, acks, psn, Syndrome::RemoteAccess, "RDMA WRITE outside a writable region").await;
                };
                // A long payload takes a while: what it follows is
                // answered first.
                if u64::from(len) >= ACK_BATCH_BYTES {
                    acks.flush(s, qp).await?;
                }
                let got = tokio::select! {
                    biased;
                    // SAFETY: the target was checked against a live MR;
                    // each write into it holds the region registered (its
                    // owner may deregister it while the payload arrives:
                    // nothing lands after that has returned).
                    got = unsafe { recv_to_while(s, &t, len as usize, || mr.hold(&qp.ctx.fences)) } => got,
                    // The QP's error or reset while a stalled peer's payload
                    // is still due: the connection ends now, not when the
                    // peer closes it.
                    _ = dead(qp, epoch, state_rx) => return Ok(Outcome::Dead),
                };
                if let Err(e) = got {
                    if !mr.valid.load(Ordering::Acquire) {
                        return nak(
                            qp,
                            s,
                            acks,
                            psn,
                            Syndrome::RemoteAccess,
                            "RDMA WRITE into a region deregistered as it arrived",
                        )
                        .await;
                    }
                    return device_nak(qp, s, acks, psn, "RDMA WRITE", e).await;
                }
            }
            if let Some(imm) = imm {
                let Some(r) = take_recv(qp, s, acks, psn, epoch, rnr_retry, state_rx).await? else {
                    return Ok(Outcome::Close);
                };
                qp.rx_hold(recv_wc(qp, &r, WcStatus::Success, WcOpcode::RecvRdmaWithImm, len, Some(imm)));
            }
            acks.add(psn, len);
        }
        Frame::Notify { psn, len, imm } => {
            let Some(r) = take_recv(qp, s, acks, psn, epoch, rnr_retry, state_rx).await? else {
                return Ok(Outcome::Close);
            };
            qp.rx_hold(recv_wc(qp, &r, WcStatus::Success, WcOpcode::RecvRdmaWithImm, len, Some(imm)));
            acks.add(psn, 0);
        }
        Frame::Send { psn, len, imm } => {
            let Some(r) = take_recv(qp, s, acks, psn, epoch, rnr_retry, state_rx).await? else {
                return Ok(Outcome::Close);
            };
            // Every way out below completes `r` or gives it back: a receive
            // taken for a SEND whose connection failed on the way (the
            // requester died, or its link did) is the next message's.
            if (len as u64) > r.capacity() {
                if let Err(e) = acks.flush(s, qp).await {
                    qp.give_back_recv(epoch, r);
                    return Err(e);
                }
                qp.rx_failed(recv_wc(qp, &r, WcStatus::LocLenErr, WcOpcode::Recv, 0, None));
                qp.set_error("receive too small for an incoming SEND");
                return nak(qp, s, acks, psn, Syndrome::InvalidRequest, "SEND longer than the posted receive").await;
            }
            let mut left = len as usize;
            let mut pieces = Vec::with_capacity(r.segs.len());
            for seg in &r.segs {
                if left == 0 {
                    break;
                }
                match seg.target(qp.pd, AccessFlags::LOCAL_WRITE) {
                    Ok(t) => {
                        let n = left.min(seg.len as usize);
                        pieces.push((t, n));
                        left -= n;
                    }
                    Err(st) => {
                        if let Err(e) = acks.flush(s, qp).await {
                            qp.give_back_recv(epoch, r);
                            return Err(e);
                        }
                        qp.rx_failed(recv_wc(qp, &r, st, WcOpcode::Recv, 0, None));
                        qp.set_error("receive buffer failed its key check");
                        return nak(qp, s, acks, psn, Syndrome::RemoteOp, "receive buffer is not a valid local region")
                            .await;
                    }
                }
            }
            for (t, n) in pieces {
                let got = tokio::select! {
                    biased;
                    // SAFETY: the target lies in a checked local MR kept
                    // alive by `r`.
                    got = unsafe { recv_to(s, &t, n) } => got,
                    // The QP's error or reset while the rest has not come
                    // (a stalled requester): nothing more is written into
                    // the receive, which is flushed (or discarded) with the
                    // others, and the connection ends.
                    _ = dead(qp, epoch, state_rx) => {
                        // Earlier receives' held completions first: `r` was
                        // taken after them.
                        qp.rx_release();
                        qp.give_back_recv(epoch, r);
                        return Ok(Outcome::Dead);
                    }
                };
                if let Err(e) = got {
                    match e {
                        Failed::Io(_) => {
                            // As above: the held completions first.
                            qp.rx_release();
                            qp.give_back_recv(epoch, r);
                        }
                        Failed::Copy(_) => {
                            if let Err(e) = acks.flush(s, qp).await {
                                qp.give_back_recv(epoch, r);
                                return Err(e);
                            }
                            qp.rx_failed(recv_wc(qp, &r, WcStatus::LocProtErr, WcOpcode::Recv, 0, None));
                            qp.set_error("a SEND into device memory failed its copy");
                        }
                    }
                    return device_nak(qp, s, acks, psn, "SEND", e).await;
                }
            }
            let opcode = WcOpcode::Recv;
            qp.rx_hold(recv_wc(qp, &r, WcStatus::Success, opcode, len, imm));
            acks.add(psn, len);
        }
        Frame::ReadReq { psn, raddr, rkey, len } => {
            let mut keep = None;
            let mut src = 0usize;
            let mut staged = Vec::new();
            if len > 0 {
                let Some((mr, t)) = check(qp, rkey, raddr, len as u64, AccessFlags::REMOTE_READ) else {
                    return nak(qp, s, acks, psn, Syndrome::RemoteAccess, "RDMA READ outside a readable region").await;
                };
                src = match t {
                    Target::Host(p) => p,
                    Target::Device(dev, a) => {
                        let Some(registered) = mr.hold(&qp.ctx.fences) else {
                            return nak(qp, s, acks, psn, Syndrome::RemoteAccess, "RDMA READ of a deregistered region")
                                .await;
                        };
                        // SAFETY: checked against a live MR, held by `mr`,
                        // registered while `registered` lives.
                        let read = unsafe { read_device(&*dev, a, len as usize) };
                        drop(registered);
                        match read {
                            Ok(v) => {
                                staged = v;
                                staged.as_ptr() as usize
                            }
                            Err(e) => return device_nak(qp, s, acks, psn, "RDMA READ", e).await,
                        }
                    }
                };
                keep = Some(mr);
            }
            let payload = [(src, len as usize)];
            acks.flush(s, qp).await?;
            // Deregistered since the check (or the ACK's write): refused
            // while nothing of the response is sent. (One deregistered
            // after this ends the connection: the response is torn.)
            if staged.is_empty() && keep.as_ref().is_some_and(|mr| mr.hold(&qp.ctx.fences).is_none()) {
                return nak(qp, s, acks, psn, Syndrome::RemoteAccess, "RDMA READ of a deregistered region").await;
            }
            // Host memory is read as it is sent: each read holds the region
            // registered (its owner may deregister it meanwhile; nothing is
            // read after that has returned, and the torn response ends the
            // connection). A staged copy needs nothing.
            let host = staged.is_empty() && len > 0;
            let registered = || match (&keep, host) {
                (Some(mr), true) => mr.hold(&qp.ctx.fences).map(Some),
                _ => Some(None),
            };
            let payload: &[(usize, usize)] = if len > 0 { &payload } else { &[] };
            // SAFETY: the payload is the checked range of the MR `keep`
            // holds (valid while `registered` gives guards), or `staged`.
            unsafe { send_frame_while(s, &Frame::ReadResp { psn, len }, payload, registered).await? };
            drop((keep, staged));
        }
        Frame::Atomic { psn, raddr, rkey, cmp_swap, a, b } => {
            if raddr % 8 != 0 {
                return nak(qp, s, acks, psn, Syndrome::InvalidRequest, "misaligned atomic").await;
            }
            let checked = check(qp, rkey, raddr, 8, AccessFlags::REMOTE_ATOMIC);
            // Registered until the word is updated (the guard is dropped
            // before any wait below).
            let Some(((_mr, t), registered)) =
                checked.and_then(|(mr, t)| mr.hold(&qp.ctx.fences).map(|g| ((mr, t), g)))
            else {
                return nak(qp, s, acks, psn, Syndrome::RemoteAccess, "atomic outside an atomic-enabled region").await;
            };
            let p = match t {
                Target::Host(p) => p,
                Target::Device(dev, at) => {
                    // SAFETY: a checked aligned word of a live MR (held).
                    let orig = unsafe { device_atomic(&*dev, at, cmp_swap, a, b) };
                    drop(registered);
                    let orig = match orig {
                        Ok(v) => v,
                        Err(e) => return device_nak(qp, s, acks, psn, "atomic", e).await,
                    };
                    acks.flush(s, qp).await?;
                    s.write_all(&Frame::AtomicResp { psn, orig }.encode()).await?;
                    return Ok(Outcome::Continue);
                }
            };
            // SAFETY: p is 8-byte aligned, inside a live MR; every soft atomic
            // on this address (from any process) goes through an AtomicU64.
            let cell = unsafe { &*(p as *const std::sync::atomic::AtomicU64) };
            let orig = if cmp_swap {
                match cell.compare_exchange(a, b, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(v) | Err(v) => v,
                }
            } else {
                cell.fetch_add(a, Ordering::AcqRel)
            };
            drop(registered);
            acks.flush(s, qp).await?;
            s.write_all(&Frame::AtomicResp { psn, orig }.encode()).await?;
        }
        _ => return Ok(Outcome::Close),
    }
    Ok(Outcome::Continue)
}
