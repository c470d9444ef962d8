//! rmacomm cross-crate and multi-process integration tests.
//!
//! Integration tests that span crates live in this package's `tests/` folder; the helpers they share will live here.

#![forbid(unsafe_code)]
