//! Virtual queue pairs: one message striped over many physical RC QPs,
//! reported as one completion on a virtual CQ.
//!
//! The protocol logic is sans-IO — plain state machines that tests drive
//! directly and replay any reordering with — and a thin driver does the
//! verbs calls, so the same code runs on every provider.
//!
//! # Organization
//! - `config`: [`VirtualQpConfig`], [`LoadBalancing`]
//! - `planner`: [`FragmentPlanner`](proto::FragmentPlanner), cutting WRs into
//!   fragments and choosing QPs (sans-IO)
//! - `dqplb`: DQPLB immediates and the receiver's
//!   [`SeqTracker`](proto::SeqTracker) (sans-IO)
//! - `aggregator`: [`CompletionAggregator`](proto::CompletionAggregator),
//!   physical → virtual send completions (sans-IO)
//! - `recv_order`: [`RecvSequencer`](proto::RecvSequencer), receive
//!   completions in message order (sans-IO)
//! - `endpoint`: [`VirtualQpEndpoint`]
//! - `virtual_qp`, `virtual_cq`: the drivers

mod aggregator;
mod config;
mod dqplb;
mod endpoint;
mod planner;
mod recv_order;
mod virtual_cq;
mod virtual_qp;

pub use config::{LoadBalancing, VirtualQpConfig};
pub use endpoint::VirtualQpEndpoint;
pub use virtual_cq::VirtualCq;
pub use virtual_qp::{VirtualQp, VirtualQpStats};

/// The sans-IO state machines behind [`VirtualQp`], for drivers of other
/// transports and for tests that replay reorderings.
pub mod proto {
    pub use super::aggregator::{CompletionAggregator, Part};
    pub use super::dqplb::{
        next_seq, DqplbImm, FinishedMessage, SeqTracker, TrackerError, LAST_BIT, SEQ_BITS, SEQ_MASK, USER_BIT,
    };
    pub use super::planner::{fragments, Fragment, FragmentPlanner, Lane};
    pub use super::recv_order::RecvSequencer;
}
