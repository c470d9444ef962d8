//! The TCP store's wire protocol, sans-IO: encode and decode functions on byte
//! slices; the client and server only move the bytes.
//!
//! A frame is a little-endian `u32` body length followed by the body: an
//! opcode byte and its fields. Byte strings are a `u32` length and the bytes;
//! keys must be UTF-8. Every length is checked against the store limits before
//! anything is allocated, and a body must be consumed exactly. Any violation is
//! a [`WireError`]; the server answers it by closing that one connection.

use std::fmt;

use crate::store::{MAX_KEYS, MAX_KEY_LEN, MAX_VALUE_LEN};

/// Largest frame body: two maximal values (a `compare_set`'s expected and
/// desired) plus room for a key and headers. Every request the stores'
/// limits let through fits (a call's keys add up to at most
/// `MAX_KEYS_BYTES`, less than this); a larger frame is refused before
/// anything is allocated for it.
pub(crate) const MAX_FRAME_LEN: usize = 2 * MAX_VALUE_LEN + (1 << 20);

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WireError(pub(crate) String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(msg: impl Into<String>) -> Result<T, WireError> {
    Err(WireError(msg.into()))
}

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    Set { key: String, value: Vec<u8> },
    TryGet { key: String },
    MultiGet { keys: Vec<String>, timeout_ms: u64 },
    Wait { keys: Vec<String>, timeout_ms: u64 },
    Check { keys: Vec<String> },
    Add { key: String, delta: i64 },
    CompareSet { key: String, expected: Option<Vec<u8>>, desired: Vec<u8> },
    Delete { key: String },
}

/// The server's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    Ok,
    Value(Option<Vec<u8>>),
    Values(Vec<Vec<u8>>),
    Int(i64),
    Bool(bool),
    /// A wait ran out; carries the first missing key.
    Timeout {
        key: String,
    },
    /// The request was refused (bad counter, response too large, ...).
    Error(String),
}

mod op {
    pub(super) const SET: u8 = 1;
    pub(super) const TRY_GET: u8 = 2;
    pub(super) const MULTI_GET: u8 = 3;
    pub(super) const WAIT: u8 = 4;
    pub(super) const CHECK: u8 = 5;
    pub(super) const ADD: u8 = 6;
    pub(super) const COMPARE_SET: u8 = 7;
    pub(super) const DELETE: u8 = 8;

    pub(super) const OK: u8 = 64;
    pub(super) const VALUE: u8 = 65;
    pub(super) const VALUES: u8 = 66;
    pub(super) const INT: u8 = 67;
    pub(super) const BOOL: u8 = 68;
    pub(super) const TIMEOUT: u8 = 69;
    pub(super) const ERROR: u8 = 70;
}

/// Builds one frame: reserves the length header and fills it in at the end.
struct FrameWriter(Vec<u8>);

impl FrameWriter {
    fn new(opcode: u8) -> Self {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&[0; 4]);
        v.push(opcode);
        FrameWriter(v)
    }
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u32(&mut self, x: usize) {
        // Lengths are bounded by the store limits (checked before encoding), far below u32::MAX.
        self.0.extend_from_slice(&(x as u32).to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len());
        self.0.extend_from_slice(b);
    }
    fn keys(&mut self, keys: &[String]) {
        self.u32(keys.len());
        keys.iter().for_each(|k| self.bytes(k.as_bytes()));
    }
    fn finish(mut self) -> Vec<u8> {
        let body = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&body.to_le_bytes());
        self.0
    }
}

/// Encodes a request as a whole frame (header included).
pub(crate) fn encode_request(req: &Request) -> Vec<u8> {
    let w = match req {
        Request::Set { key, value } => {
            let mut w = FrameWriter::new(op::SET);
            w.bytes(key.as_bytes());
            w.bytes(value);
            w
        }
        Request::TryGet { key } => {
            let mut w = FrameWriter::new(op::TRY_GET);
            w.bytes(key.as_bytes());
            w
        }
        Request::MultiGet { keys, timeout_ms } | Request::Wait { keys, timeout_ms } => {
            let code = if matches!(req, Request::MultiGet { .. }) { op::MULTI_GET } else { op::WAIT };
            let mut w = FrameWriter::new(code);
            w.keys(keys);
            w.u64(*timeout_ms);
            w
        }
        Request::Check { keys } => {
            let mut w = FrameWriter::new(op::CHECK);
            w.keys(keys);
            w
        }
        Request::Add { key, delta } => {
            let mut w = FrameWriter::new(op::ADD);
            w.bytes(key.as_bytes());
            w.u64(*delta as u64);
            w
        }
        Request::CompareSet { key, expected, desired } => {
            let mut w = FrameWriter::new(op::COMPARE_SET);
            w.bytes(key.as_bytes());
            match expected {
                None => w.u8(0),
                Some(e) => {
                    w.u8(1);
                    w.bytes(e);
                }
            }
            w.bytes(desired);
            w
        }
        Request::Delete { key } => {
            let mut w = FrameWriter::new(op::DELETE);
            w.bytes(key.as_bytes());
            w
        }
    };
    w.finish()
}

/// Encodes a response as a whole frame (header included).
pub(crate) fn encode_response(resp: &Response) -> Vec<u8> {
    let w = match resp {
        Response::Ok => FrameWriter::new(op::OK),
        Response::Value(v) => {
            let mut w = FrameWriter::new(op::VALUE);
            match v {
                None => w.u8(0),
                Some(v) => {
                    w.u8(1);
                    w.bytes(v);
                }
            }
            w
        }
        Response::Values(vs) => {
            let mut w = FrameWriter::new(op::VALUES);
            w.u32(vs.len());
            vs.iter().for_each(|v| w.bytes(v));
            w
        }
        Response::Int(x) => {
            let mut w = FrameWriter::new(op::INT);
            w.u64(*x as u64);
            w
        }
        Response::Bool(b) => {
            let mut w = FrameWriter::new(op::BOOL);
            w.u8(u8::from(*b));
            w
        }
        Response::Timeout { key } => {
            let mut w = FrameWriter::new(op::TIMEOUT);
            w.bytes(key.as_bytes());
            w
        }
        Response::Error(msg) => {
            let mut w = FrameWriter::new(op::ERROR);
            // Error texts are ours and short; cut them anyway so the frame stays valid.
            let cut = floor_char_boundary(msg, MAX_KEY_LEN);
            w.bytes(&msg.as_bytes()[..cut]);
            w
        }
    };
    w.finish()
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    (0..=max).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0)
}

/// The body length announced by a frame header, checked against the limit.
pub(crate) fn frame_len(header: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(header) as usize;
    if len == 0 {
        return err("empty frame");
    }
    if len > MAX_FRAME_LEN {
        return err(format!("frame of {len} bytes exceeds the limit of {MAX_FRAME_LEN} bytes"));
    }
    Ok(len)
}

// The drivers read header and body separately; this whole-buffer form is for tests and fuzzing.
#[cfg_attr(not(test), allow(dead_code))]
/// Splits one frame off the front of `buf`: `Ok(None)` when more bytes are
/// needed, else the body and the number of bytes the frame used.
pub(crate) fn split_frame(buf: &[u8]) -> Result<Option<(&[u8], usize)>, WireError> {
    let Some(header) = buf.get(..4) else { return Ok(None) };
    let len = frame_len(header.try_into().expect("4 bytes"))?;
    Ok(buf.get(4..4 + len).map(|body| (body, 4 + len)))
}

/// Reads fields off a frame body; every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        match self.buf.get(self.pos..self.pos.saturating_add(n)) {
            Some(s) if self.pos.checked_add(n).is_some() => {
                self.pos += n;
                Ok(s)
            }
            _ => err(format!("truncated frame: {what} needs {n} bytes at offset {}", self.pos)),
        }
    }
    fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<usize, WireError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")) as usize)
    }
    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn bytes(&mut self, max: usize, what: &str) -> Result<Vec<u8>, WireError> {
        let len = self.u32(what)?;
        if len > max {
            return err(format!("{what} of {len} bytes exceeds the limit of {max} bytes"));
        }
        Ok(self.take(len, what)?.to_vec())
    }
    fn key(&mut self) -> Result<String, WireError> {
        String::from_utf8(self.bytes(MAX_KEY_LEN, "key")?).or_else(|_| err("key is not UTF-8"))
    }
    fn keys(&mut self) -> Result<Vec<String>, WireError> {
        let n = self.u32("key count")?;
        if n > MAX_KEYS {
            return err(format!("{n} keys exceed the limit of {MAX_KEYS}"));
        }
        // Each key takes at least its 4-byte length: do not trust `n` for the allocation.
        let mut keys = Vec::with_capacity(n.min(self.buf.len() / 4));
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
    fn flag(&mut self, what: &str) -> Result<bool, WireError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            x => err(format!("{what} flag is {x}, not 0 or 1")),
        }
    }
    fn end(self) -> Result<(), WireError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            err(format!("{} unexpected trailing bytes", self.buf.len() - self.pos))
        }
    }
}

/// Decodes a request body (the frame without its length header).
pub(crate) fn decode_request(body: &[u8]) -> Result<Request, WireError> {
    let mut r = Reader { buf: body, pos: 0 };
    let req = match r.u8("opcode")? {
        op::SET => Request::Set { key: r.key()?, value: r.bytes(MAX_VALUE_LEN, "value")? },
        op::TRY_GET => Request::TryGet { key: r.key()? },
        op::MULTI_GET => Request::MultiGet { keys: r.keys()?, timeout_ms: r.u64("timeout")? },
        op::WAIT => Request::Wait { keys: r.keys()?, timeout_ms: r.u64("timeout")? },
        op::CHECK => Request::Check { keys: r.keys()? },
        op::ADD => Request::Add { key: r.key()?, delta: r.u64("delta")? as i64 },
        op::COMPARE_SET => {
            let key = r.key()?;
            let expected = if r.flag("expected")? { Some(r.bytes(MAX_VALUE_LEN, "expected value")?) } else { None };
            Request::CompareSet { key, expected, desired: r.bytes(MAX_VALUE_LEN, "desired value")? }
        }
        op::DELETE => Request::Delete { key: r.key()? },
        x => return err(format!("unknown request opcode {x}")),
    };
    r.end()?;
    Ok(req)
}

/// Decodes a response body (the frame without its length header).
pub(crate) fn decode_response(body: &[u8]) -> Result<Response, WireError> {
    let mut r = Reader { buf: body, pos: 0 };
    let resp = match r.u8("opcode")? {
        op::OK => Response::Ok,
        op::VALUE => {
            Response::Value(if r.flag("value present")? { Some(r.bytes(MAX_VALUE_LEN, "value")?) } else { None })
        }
        op::VALUES => {
            let n = r.u32("value count")?;
            if n > MAX_KEYS {
                return err(format!("{n} values exceed the limit of {MAX_KEYS}"));
            }
            let mut vs = Vec::with_capacity(n.min(body.len() / 4));
            for _ in 0..n {
                vs.push(r.bytes(MAX_VALUE_LEN, "value")?);
            }
            Response::Values(vs)
        }
        op::INT => Response::Int(r.u64("integer")? as i64),
        op::BOOL => Response::Bool(r.flag("bool")?),
        op::TIMEOUT => Response::Timeout { key: r.key()? },
        op::ERROR => Response::Error(String::from_utf8_lossy(&r.bytes(MAX_KEY_LEN, "error message")?).into_owned()),
        x => return err(format!("unknown response opcode {x}")),
    };
    r.end()?;
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip_req(req: Request) {
        let frame = encode_request(&req);
        let (body, used) = split_frame(&frame).unwrap().unwrap();
        assert_eq!(used, frame.len());
        assert_eq!(decode_request(body).unwrap(), req);
        // Every strict prefix is "need more bytes", never an error or a wrong request.
        for cut in 0..frame.len() {
            assert_eq!(split_frame(&frame[..cut]).unwrap(), None);
        }
        // A body cut short is a clean error.
        for cut in 0..body.len() {
            assert!(decode_request(&body[..cut]).is_err(), "cut at {cut} of {req:?}");
        }
    }

    #[test]
    fn every_request_roundtrips() {
        let keys = vec!["a".to_string(), "b/ü".to_string(), String::new()];
        for req in [
            Request::Set { key: "k".into(), value: b"v".to_vec() },
            Request::Set { key: String::new(), value: vec![] },
            Request::TryGet { key: "k".into() },
            Request::MultiGet { keys: keys.clone(), timeout_ms: 1234 },
            Request::Wait { keys: keys.clone(), timeout_ms: u64::MAX },
            Request::Check { keys },
            Request::Add { key: "c".into(), delta: -7 },
            Request::CompareSet { key: "k".into(), expected: None, desired: b"x".to_vec() },
            Request::CompareSet { key: "k".into(), expected: Some(vec![]), desired: b"x".to_vec() },
            Request::Delete { key: "k".into() },
        ] {
            roundtrip_req(req);
        }
    }

    #[test]
    fn every_response_roundtrips() {
        for resp in [
            Response::Ok,
            Response::Value(None),
            Response::Value(Some(b"abc".to_vec())),
            Response::Values(vec![vec![], b"x".to_vec()]),
            Response::Int(i64::MIN),
            Response::Bool(true),
            Response::Timeout { key: "k".into() },
            Response::Error("nope".into()),
        ] {
            let frame = encode_response(&resp);
            let (body, _) = split_frame(&frame).unwrap().unwrap();
            assert_eq!(decode_response(body).unwrap(), resp);
        }
    }

    #[test]
    fn oversized_and_empty_frames_are_refused_from_the_header() {
        assert!(frame_len((MAX_FRAME_LEN as u32 + 1).to_le_bytes()).is_err());
        assert!(frame_len(u32::MAX.to_le_bytes()).is_err());
        assert!(frame_len([0; 4]).is_err());
        assert_eq!(frame_len(5u32.to_le_bytes()).unwrap(), 5);
    }

    #[test]
    fn bad_fields_are_errors() {
        // Unknown opcode.
        assert!(decode_request(&[0]).unwrap_err().0.contains("unknown request opcode 0"));
        assert!(decode_request(&[200, 1, 2]).is_err());
        // Key longer than the limit.
        let mut body = vec![op::TRY_GET];
        body.extend_from_slice(&(MAX_KEY_LEN as u32 + 1).to_le_bytes());
        body.extend(std::iter::repeat_n(b'a', MAX_KEY_LEN + 1));
        assert!(decode_request(&body).unwrap_err().0.contains("exceeds the limit"));
        // Key that is not UTF-8.
        let body = [op::TRY_GET, 2, 0, 0, 0, 0xff, 0xfe];
        assert!(decode_request(&body).unwrap_err().0.contains("UTF-8"));
        // Too many keys.
        let mut body = vec![op::CHECK];
        body.extend_from_slice(&(MAX_KEYS as u32 + 1).to_le_bytes());
        assert!(decode_request(&body).is_err());
        // A count that promises more keys than there are bytes.
        let body = [op::CHECK, 0xff, 0xff, 0, 0];
        assert!(decode_request(&body).unwrap_err().0.contains("truncated"));
        // Trailing bytes.
        let mut frame = encode_request(&Request::Delete { key: "k".into() });
        frame.push(0);
        assert!(decode_request(&frame[4..]).unwrap_err().0.contains("trailing"));
        // A bad option flag.
        let body = [op::COMPARE_SET, 0, 0, 0, 0, 7];
        assert!(decode_request(&body).is_err());
    }

    #[test]
    fn long_error_messages_are_cut_on_a_char_boundary() {
        let msg = "é".repeat(MAX_KEY_LEN);
        let frame = encode_response(&Response::Error(msg));
        let Response::Error(back) = decode_response(&frame[4..]).unwrap() else { panic!() };
        assert!(back.len() <= MAX_KEY_LEN && back.chars().all(|c| c == 'é'));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(&bytes);
            let _ = decode_response(&bytes);
            let _ = split_frame(&bytes);
        }

        #[test]
        fn random_bodies_behind_a_valid_opcode_never_panic(
            opcode in 0u8..80, rest in proptest::collection::vec(any::<u8>(), 0..256)
        ) {
            let mut body = vec![opcode];
            body.extend(rest);
            let _ = decode_request(&body);
            let _ = decode_response(&body);
        }

        #[test]
        fn set_roundtrips(key in "\\PC{0,40}", value in proptest::collection::vec(any::<u8>(), 0..300)) {
            let req = Request::Set { key, value };
            let frame = encode_request(&req);
            prop_assert_eq!(decode_request(&frame[4..]).unwrap(), req);
        }
    }
}
