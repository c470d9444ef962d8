//! A peer's registered buffer, as it travels between processes.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a peer's registered memory is: address, length and remote key.
/// Serialise it (serde) into your own messages; `Display` prints it as
/// `addr:len:key` in hex, which `parse` reads back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RdmaRemoteBuffer {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub key: u32,
}

impl RdmaRemoteBuffer {
    /// The sub-buffer `offset..offset+len`, or `None` if it does not fit
    /// (or its end would pass the top of the address space: a buffer a
    /// peer described wrongly).
    pub fn slice(&self, offset: u64, len: u64) -> Option<RdmaRemoteBuffer> {
        let end = offset.checked_add(len)?;
        let addr = self.addr.checked_add(offset)?;
        addr.checked_add(len)?;
        (end <= self.len).then_some(RdmaRemoteBuffer { addr, len, key: self.key })
    }

    /// Whether `addr..addr+len` lies below the top of the address space
    /// (what a real registration always does; a description that does not
    /// came from a confused or hostile peer).
    pub fn is_addressable(&self) -> bool {
        self.addr.checked_add(self.len).is_some()
    }

    /// Parses the `Display` form (`None` also for a buffer that is not
    /// [addressable](Self::is_addressable)).
    pub fn parse(s: &str) -> Option<RdmaRemoteBuffer> {
        let mut it = s.split(':');
        let addr = u64::from_str_radix(it.next()?.trim_start_matches("0x"), 16).ok()?;
        let len = u64::from_str_radix(it.next()?.trim_start_matches("0x"), 16).ok()?;
        let key = u32::from_str_radix(it.next()?.trim_start_matches("0x"), 16).ok()?;
        let b = RdmaRemoteBuffer { addr, len, key };
        (it.next().is_none() && b.is_addressable()).then_some(b)
    }
}

impl fmt::Display for RdmaRemoteBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}:{:#x}:{:#x}", self.addr, self.len, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_parse_serde_round_trip() {
        let b = RdmaRemoteBuffer { addr: 0x7f00_1234_0000, len: 1 << 20, key: 0xdead_beef };
        assert_eq!(RdmaRemoteBuffer::parse(&b.to_string()), Some(b));
        let j = serde_json::to_string(&b).unwrap();
        assert_eq!(serde_json::from_str::<RdmaRemoteBuffer>(&j).unwrap(), b);
        assert_eq!(b.slice(16, 32), Some(RdmaRemoteBuffer { addr: b.addr + 16, len: 32, key: b.key }));
        assert_eq!(b.slice(1 << 20, 1), None);
        assert_eq!(RdmaRemoteBuffer::parse("1:2"), None);
    }

    #[test]
    fn a_slice_past_the_top_of_the_address_space_is_none() {
        let b = RdmaRemoteBuffer { addr: u64::MAX - 100, len: 1 << 20, key: 1 };
        assert!(!b.is_addressable());
        assert_eq!(b.slice(200, 8), None);
        assert_eq!(b.slice(50, 60), None);
        assert_eq!(b.slice(50, 8).map(|s| s.addr), Some(u64::MAX - 50));
        assert_eq!(RdmaRemoteBuffer::parse(&b.to_string()), None);
    }
}
