//! Endpoints are printed in logs and errors: their `Debug` output must not
//! carry the soft provider's connection token, while serde still does.

use ibverbx::{Gid, HostId, QpEndpoint, SoftAddress};

const TOKEN: [u8; 16] =
    [0xde, 0xad, 0xbe, 0xef, 0x5e, 0xc2, 0xe7, 0x42, 0x17, 0x71, 0xab, 0xcd, 0x01, 0x23, 0x45, 0x67];

fn endpoint() -> QpEndpoint {
    QpEndpoint {
        qpn: 0x1234,
        psn: 7,
        lid: 0,
        gid: Gid::default(),
        mtu: 4096,
        soft: Some(SoftAddress {
            host: HostId { boot_id: "boot".into(), ipc_ns: 1, net_ns: 2 },
            pid: 4242,
            ctx_uid: 99,
            tcp: vec!["127.0.0.1:5000".parse().unwrap()],
            unix: "rmacomm-test".into(),
            keytable_fd: 5,
            keytable_uid: 6,
            pd: 1,
            token: TOKEN,
            doorbell_fd: -1,
            doorbell_uid: 0,
            doorbell_slot: 0,
            fence_uid: 0x5151,
        }),
    }
}

/// Every spelling of the token a formatter or encoder might produce.
fn spellings() -> Vec<String> {
    use std::fmt::Write;
    let hex = TOKEN.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    });
    vec![
        format!("{TOKEN:?}"),
        format!("{:?}", &TOKEN[..4]).trim_matches(['[', ']']).to_owned(), // "222, 173, 190, 239"
        hex.clone(),
        hex.to_uppercase(),
        hex[..8].to_owned(),
    ]
}

#[test]
fn debug_of_an_endpoint_hides_the_token_and_shows_the_rest() {
    let ep = endpoint();
    for d in [format!("{ep:?}"), format!("{ep:#?}"), format!("{:?}", ep.soft.as_ref().unwrap())] {
        for s in spellings() {
            assert!(!d.contains(&s), "the token leaked as {s:?} in:\n{d}");
        }
        assert!(d.contains("<redacted>"), "{d}");
        assert!(d.contains("4242") && d.contains("rmacomm-test") && d.contains("127.0.0.1:5000"), "{d}");
    }
}

#[test]
fn serde_still_carries_the_token() {
    let ep = endpoint();
    let json = serde_json::to_string(&ep).unwrap();
    let back: QpEndpoint = serde_json::from_str(&json).unwrap();
    assert_eq!(back, ep);
    assert_eq!(back.soft.unwrap().token, TOKEN);
}
