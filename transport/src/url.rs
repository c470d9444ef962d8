//! Transport URLs: everything a peer needs to connect, as one printable
//! string.
//!
//! `rmacomm://<provider>/<base64url(JSON)>`, where the JSON holds the
//! version and the virtual QP's endpoint (QP numbers, addresses, and the
//! soft provider's per-QP connection tokens, which are unguessable: a
//! connection that does not present them is refused).
//!
//! A URL is therefore a credential: never log or echo one whole. Errors
//! describe the peer with [`describe`]; code that must print a URL uses
//! [`redact_url`].

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ibverbx::VirtualQpEndpoint;
use serde::{Deserialize, Serialize};

use crate::{RdmaRemoteBuffer, TransportError};

const SCHEME: &str = "rmacomm://";
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Body {
    v: u32,
    ep: VirtualQpEndpoint,
    /// The page where a same-host peer counts its notifications (see
    /// `notes`); absent where there is none (another provider).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    n: Option<RdmaRemoteBuffer>,
}

pub(crate) fn encode(provider: &str, ep: &VirtualQpEndpoint, notes: Option<RdmaRemoteBuffer>) -> String {
    let body = serde_json::to_vec(&Body { v: VERSION, ep: ep.clone(), n: notes }).expect("endpoint serialises");
    format!("{SCHEME}{provider}/{}", URL_SAFE_NO_PAD.encode(body))
}

/// A peer's URL, read: its provider, endpoint and notification page.
pub(crate) type Decoded = (String, VirtualQpEndpoint, Option<RdmaRemoteBuffer>);

pub(crate) fn decode(url: &str) -> Result<Decoded, TransportError> {
    let bad = |why: &str| TransportError::invalid("connect", format!("not an rmacomm URL ({why})"));
    let rest = url.trim().strip_prefix(SCHEME).ok_or_else(|| bad("it must start with rmacomm://"))?;
    let (provider, payload) = rest.split_once('/').ok_or_else(|| bad("missing provider"))?;
    let bytes = URL_SAFE_NO_PAD.decode(payload).map_err(|_| bad("the payload is not base64url"))?;
    let body: Body = serde_json::from_slice(&bytes).map_err(|_| bad("the payload is not an endpoint"))?;
    if body.v != VERSION {
        return Err(bad(&format!("version {} is not supported (this build speaks {VERSION})", body.v)));
    }
    Ok((provider.to_owned(), body.ep, body.n))
}

/// `url` with its payload (the endpoint and its tokens) replaced by
/// `<redacted>`, for logs and error messages: `rmacomm://soft/<redacted>`.
/// Anything that is not an rmacomm URL comes back as `<redacted>` whole.
///
/// ```
/// let url = "rmacomm://soft/eyJ2IjoxLCJlcCI6e319";
/// assert_eq!(rmacomm_transport::redact_url(url), "rmacomm://soft/<redacted>");
/// assert_eq!(rmacomm_transport::redact_url("garbage"), "<redacted>");
/// ```
pub fn redact_url(url: &str) -> String {
    let provider = url
        .trim()
        .strip_prefix(SCHEME)
        .and_then(|rest| rest.split_once('/'))
        .map(|(p, _)| p)
        .filter(|p| p.len() <= 16 && p.chars().all(|c| c.is_ascii_alphanumeric()));
    match provider {
        Some(p) => format!("{SCHEME}{p}/<redacted>"),
        None => "<redacted>".to_owned(),
    }
}

/// The peer of a decoded URL in words, without its tokens: provider, first
/// QP number and, for the soft provider, where it listens.
pub(crate) fn describe(provider: &str, ep: &VirtualQpEndpoint) -> String {
    let Some(qp) = ep.data.first() else {
        return format!("the {provider} peer");
    };
    let mut s = format!("the {provider} peer's QP {:#x}", qp.qpn);
    if let Some(soft) = &qp.soft {
        match soft.tcp.first() {
            Some(a) => s.push_str(&format!(" (pid {} at {a})", soft.pid)),
            None => s.push_str(&format!(" (pid {})", soft.pid)),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_url_keeps_only_scheme_and_provider() {
        assert_eq!(redact_url(" rmacomm://verbs/AAAA "), "rmacomm://verbs/<redacted>");
        assert_eq!(redact_url("rmacomm://soft/"), "rmacomm://soft/<redacted>");
        // A payload where the provider should be is not echoed either.
        assert_eq!(redact_url("rmacomm://c2VjcmV0LXRva2VuLWJ5dGVz/x"), "<redacted>");
        assert_eq!(redact_url("rmacomm://soft"), "<redacted>");
        assert_eq!(redact_url("http://host/secret"), "<redacted>");
    }
}
