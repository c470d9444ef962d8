//! Fuzzes the soft provider's frame and hello decoders: no input may panic,
//! and every accepted header re-encodes to the same bytes.
//!
//! Run with `RUSTC_BOOTSTRAP=1 cargo fuzz run frame_decode --sanitizer none`
//! from `ibverbx/` (stable toolchain; CI runs it for a minute).

#![no_main]

use ibverbx::soft::wire::{Frame, Hello, HelloStatus, HEADER_LEN, HELLO_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let max = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
    for chunk in data[4..].chunks_exact(HEADER_LEN) {
        let b: &[u8; HEADER_LEN] = chunk.try_into().unwrap();
        if let Ok(f) = Frame::decode(b, max) {
            assert_eq!(&f.encode(), b);
            assert!(f.payload_len() <= max as usize);
        }
        let h: &[u8; HELLO_LEN] = chunk.try_into().unwrap();
        if let Ok(hello) = Hello::decode(h) {
            assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
        }
        let _ = HelloStatus::decode(h);
    }
});
