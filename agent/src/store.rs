//! Publishing agent metadata through a bootstrap [`Store`] (the window
//! crate's `TcpStore`, `FileStore`, …), under `rmacomm-agent/<name>`.
//!
//! The store calls block (with timeouts), like every [`Store`] call: from
//! async code run them in `tokio::task::spawn_blocking`.

use std::time::Duration;

use rmacomm_window::Store;

use crate::{AgentError, TransferAgent};

/// The key an agent's metadata is published under.
pub fn metadata_key(name: &str) -> String {
    format!("rmacomm-agent/{name}")
}

/// Publishes `agent`'s current metadata (again, after registering more
/// memory). The store's readers can then read and write its regions: keep
/// the store private to the job.
pub fn publish_metadata(store: &dyn Store, agent: &TransferAgent) -> Result<(), AgentError> {
    Ok(store.set(&metadata_key(agent.name()), agent.metadata().as_bytes())?)
}

/// The metadata agent `name` published, waiting up to `timeout` for it to
/// appear; hand it to [`TransferAgent::add_peer`].
pub fn fetch_metadata(store: &dyn Store, name: &str, timeout: Duration) -> Result<String, AgentError> {
    let v = store.get(&metadata_key(name), timeout)?;
    String::from_utf8(v).map_err(|_| AgentError::BadMetadata { reason: "the stored value is not text".into() })
}
