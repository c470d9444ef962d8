//! Agent metadata: what a peer needs to reach this agent and name its
//! memory, as one printable string (`rmacomm-agent:` + base64url(JSON)).
//!
//! It carries the agent's name, the addresses of its handshake listener,
//! its provider, its registered regions (id, address, length, key) and an
//! unguessable token that a peer presents in its handshake: the string is a
//! credential, like a transport URL. `Debug` and errors never show the
//! token.

use std::fmt;
use std::net::SocketAddr;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use rmacomm_transport::RdmaRemoteBuffer;
use serde::{Deserialize, Serialize};

use crate::AgentError;

const PREFIX: &str = "rmacomm-agent:";
const VERSION: u32 = 1;
/// Longest agent name, in bytes.
pub const MAX_NAME_LEN: usize = 256;
/// Most regions one agent publishes.
pub const MAX_REGIONS: usize = 4096;
/// Longest metadata string accepted.
pub(crate) const MAX_METADATA_LEN: usize = 1 << 20;

/// One registered region as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Region {
    pub(crate) id: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) key: u32,
}

impl Region {
    pub(crate) fn remote(&self) -> RdmaRemoteBuffer {
        RdmaRemoteBuffer { addr: self.addr, len: self.len, key: self.key }
    }
}

/// A peer's region as [`TransferAgent::peer_regions`](crate::TransferAgent::peer_regions)
/// lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerRegion {
    /// The id a [`RemoteBlock`](crate::RemoteBlock) names it by.
    pub id: u32,
    /// Its start address in the peer's process (for facades whose requests
    /// name remote memory by address, as NIXL's descriptors do).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Metadata {
    pub(crate) v: u32,
    pub(crate) name: String,
    /// 32 hex digits: presented by peers in their handshake.
    pub(crate) token: String,
    pub(crate) control: Vec<SocketAddr>,
    pub(crate) regions: Vec<Region>,
}

impl fmt::Debug for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metadata")
            .field("name", &self.name)
            .field("control", &self.control)
            .field("regions", &self.regions.len())
            .finish_non_exhaustive()
    }
}

/// Checks an agent name: 1 to 256 bytes, no control characters.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!("an agent name has 1 to {MAX_NAME_LEN} bytes, not {}", name.len()));
    }
    if name.chars().any(char::is_control) {
        return Err("an agent name has no control characters".into());
    }
    Ok(())
}

impl Metadata {
    pub(crate) fn new(name: &str, token: &str, control: Vec<SocketAddr>, regions: Vec<Region>) -> Metadata {
        Metadata { v: VERSION, name: name.into(), token: token.into(), control, regions }
    }

    pub(crate) fn encode(&self) -> String {
        let json = serde_json::to_vec(self).expect("metadata serialises");
        format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(json))
    }

    pub(crate) fn decode(s: &str) -> Result<Metadata, AgentError> {
        let bad = |why: String| AgentError::BadMetadata { reason: why };
        let s = s.trim();
        if s.len() > MAX_METADATA_LEN {
            return Err(bad(format!("{} bytes, more than {MAX_METADATA_LEN}", s.len())));
        }
        let payload = s.strip_prefix(PREFIX).ok_or_else(|| bad(format!("it does not start with {PREFIX}")))?;
        let json = URL_SAFE_NO_PAD.decode(payload).map_err(|_| bad("the payload is not base64url".into()))?;
        let m: Metadata =
            serde_json::from_slice(&json).map_err(|e| bad(format!("the payload is not agent metadata ({e})")))?;
        if m.v != VERSION {
            return Err(bad(format!("version {} (this build reads {VERSION})", m.v)));
        }
        check_name(&m.name).map_err(bad)?;
        if m.token.len() != 32 || !m.token.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("its token is malformed".into()));
        }
        if m.control.is_empty() {
            return Err(bad("it lists no address to connect to".into()));
        }
        if m.regions.len() > MAX_REGIONS {
            return Err(bad(format!("{} regions, more than {MAX_REGIONS}", m.regions.len())));
        }
        let mut ids: Vec<u32> = m.regions.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            return Err(bad("it lists a region id twice".into()));
        }
        if let Some(r) = m.regions.iter().find(|r| !r.remote().is_addressable()) {
            return Err(bad(format!("region {} ({} bytes at {:#x}) ends past the top of memory", r.id, r.len, r.addr)));
        }
        Ok(m)
    }

    pub(crate) fn region(&self, id: u32) -> Option<&Region> {
        self.regions.iter().find(|r| r.id == id)
    }
}

/// A fresh unguessable token: 128 random bits in hex.
pub(crate) fn new_token() -> String {
    let bits: u128 = rand::random();
    format!("{bits:032x}")
}

/// Compares two tokens in time independent of where they differ.
pub(crate) fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Metadata {
        Metadata::new(
            "decode-0",
            &new_token(),
            vec!["10.0.0.2:4000".parse().unwrap(), "127.0.0.1:4000".parse().unwrap()],
            vec![Region { id: 1, addr: 0x7f00_0000_0000, len: 1 << 30, key: 0x1234 }],
        )
    }

    #[test]
    fn metadata_round_trips_and_hides_its_token() {
        let m = sample();
        let s = m.encode();
        assert!(s.starts_with(PREFIX) && s.is_ascii() && !s.contains(char::is_whitespace));
        assert_eq!(Metadata::decode(&format!(" {s}\n")).unwrap(), m);
        assert!(!format!("{m:?}").contains(&m.token));
        assert_eq!(m.region(1).unwrap().remote().len, 1 << 30);
        assert!(m.region(2).is_none());
    }

    #[test]
    fn what_is_not_metadata_says_why_without_echoing_it() {
        for (s, why) in [
            ("rmacomm://soft/abc", "does not start"),
            ("rmacomm-agent:!!", "not base64url"),
            ("rmacomm-agent:e30", "not agent metadata"),
        ] {
            let e = Metadata::decode(s).unwrap_err();
            assert!(e.to_string().contains(why), "{s}: {e}");
        }
        let mut m = sample();
        m.token = "secret".into();
        let e = Metadata::decode(&m.encode()).unwrap_err();
        assert!(e.to_string().contains("token is malformed") && !e.to_string().contains("secret"), "{e}");
        let mut m = sample();
        m.regions.push(m.regions[0]);
        assert!(Metadata::decode(&m.encode()).unwrap_err().to_string().contains("twice"));
        let mut m = sample();
        m.name = String::new();
        assert!(Metadata::decode(&m.encode()).is_err());
        let mut m = sample();
        m.v = 2;
        assert!(Metadata::decode(&m.encode()).unwrap_err().to_string().contains("version 2"));
        // A region whose end wraps past the top of memory: a later
        // transfer into it would compute a wrapped remote address.
        let mut m = sample();
        m.regions[0].addr = u64::MAX - 100;
        let e = Metadata::decode(&m.encode()).unwrap_err();
        assert!(e.to_string().contains("region 1") && e.to_string().contains("top of memory"), "{e}");
    }

    #[test]
    fn tokens_are_fresh_and_compare_exactly() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert!(same_token(&a, &a.clone()) && !same_token(&a, &b) && !same_token(&a, &a[1..]));
    }
}
