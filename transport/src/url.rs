//! Transport URLs: everything a peer needs to connect, as one printable
//! string.
//!
//! `rmacomm://<provider>/<base64url(JSON)>`, where the JSON holds the
//! version and the virtual QP's endpoint (QP numbers, addresses, and the
//! soft provider's per-QP connection tokens, which are unguessable: a
//! connection that does not present them is refused).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ibverbx::VirtualQpEndpoint;
use serde::{Deserialize, Serialize};

use crate::TransportError;

const SCHEME: &str = "rmacomm://";
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Body {
    v: u32,
    ep: VirtualQpEndpoint,
}

pub(crate) fn encode(provider: &str, ep: &VirtualQpEndpoint) -> String {
    let body = serde_json::to_vec(&Body { v: VERSION, ep: ep.clone() }).expect("endpoint serialises");
    format!("{SCHEME}{provider}/{}", URL_SAFE_NO_PAD.encode(body))
}

pub(crate) fn decode(url: &str) -> Result<(String, VirtualQpEndpoint), TransportError> {
    let bad = |why: &str| TransportError::invalid("connect", format!("not an rmacomm URL ({why})"));
    let rest = url.trim().strip_prefix(SCHEME).ok_or_else(|| bad("it must start with rmacomm://"))?;
    let (provider, payload) = rest.split_once('/').ok_or_else(|| bad("missing provider"))?;
    let bytes = URL_SAFE_NO_PAD.decode(payload).map_err(|_| bad("the payload is not base64url"))?;
    let body: Body = serde_json::from_slice(&bytes).map_err(|_| bad("the payload is not an endpoint"))?;
    if body.v != VERSION {
        return Err(bad(&format!("version {} is not supported (this build speaks {VERSION})", body.v)));
    }
    Ok((provider.to_owned(), body.ep))
}
