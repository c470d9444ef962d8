//! rmacomm cross-crate and multi-process integration tests.
//!
//! The tests live in this package's `tests/` folder; the peer processes they
//! start are this package's binaries (`soft_peer`, `transport_peer`,
//! `vqp_peer`, `window_peer`, `agent_peer`); this library holds what both share.

#![forbid(unsafe_code)]

pub mod harness;

/// Deterministic test data: `len` bytes from a xorshift seeded by `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
