//! Which provider and device a run uses, resolved once so that the header
//! states exactly what ran (never silently something else than asked).

use ibverbx::soft::{SoftConfig, SoftLink, SoftProvider};
use ibverbx::{Device, ProviderKind};

use crate::error::{BenchError, Result};

/// The provider and device a run uses.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// `Soft` or `Verbs` (never `Auto`).
    pub kind: ProviderKind,
    /// The device.
    pub device: Device,
    /// Soft settings (soft provider only).
    pub soft: Option<SoftConfig>,
}

impl Resolved {
    /// `soft` or `verbs`.
    pub fn provider_name(&self) -> &'static str {
        self.device.info().provider
    }
}

/// The provider a run asks for (`auto`, `verbs`, `soft`) and where the
/// choice came from, for messages: `--provider` when given, else
/// `RMACOMM_PROVIDER` (`env` is its value; `None`: unset), else `auto`.
/// An invalid `RMACOMM_PROVIDER` is an error, never a silent `auto`.
pub(crate) fn requested_provider(flag: Option<&'static str>, env: Option<&str>) -> Result<(&'static str, String)> {
    if let Some(p) = flag {
        return Ok((p, format!("--provider {p}")));
    }
    let kind = ProviderKind::from_env_value(env)
        .map_err(|e| BenchError::Config(format!("{e}; or pass --provider auto|verbs|soft")))?;
    let name = match kind {
        ProviderKind::Auto => "auto",
        ProviderKind::Verbs => "verbs",
        ProviderKind::Soft => "soft",
    };
    Ok(match env {
        Some(v) => (name, format!("RMACOMM_PROVIDER={v}")),
        None => (name, "--provider auto (the default)".to_owned()),
    })
}

/// Resolves `--provider`, `--link` and `-d` (as the names the CLI takes).
/// `origin` says where the provider came from (`--provider verbs`,
/// `RMACOMM_PROVIDER=verbs`), to start the messages with.
pub fn resolve(provider: &str, origin: &str, link: &str, ib_dev: Option<&str>) -> Result<Resolved> {
    let kind = ProviderKind::parse(provider)
        .ok_or_else(|| BenchError::Config(format!("{origin}: expected auto, verbs or soft")))?;
    let link =
        SoftLink::parse(link).ok_or_else(|| BenchError::Config(format!("--link {link}: expected auto, shm or tcp")))?;
    let soft = SoftConfig { link, ..SoftConfig::from_env() };
    let devs = match kind {
        ProviderKind::Soft => vec![SoftProvider::new(soft.clone()).device()],
        ProviderKind::Verbs => match ibverbx::devices_of(ProviderKind::Verbs) {
            Ok(d) if !d.is_empty() => d,
            Ok(_) => {
                return Err(BenchError::Config(format!(
                    "{origin}: the verbs provider lists no RDMA device; use --provider soft (or auto) on a machine \
                     without an HCA"
                )))
            }
            Err(e) => {
                return Err(BenchError::Config(format!(
                    "{origin}: {e}; use --provider soft (or auto) on a machine without an HCA"
                )))
            }
        },
        ProviderKind::Auto => {
            let d = ibverbx::devices_of(ProviderKind::Auto)
                .map_err(|e| BenchError::Config(format!("listing devices: {e}")))?;
            if d.first().is_some_and(|d| d.info().provider == "soft") {
                vec![SoftProvider::new(soft.clone()).device()]
            } else {
                d
            }
        }
    };
    let device = match ib_dev {
        None => devs.into_iter().next(),
        Some(name) => {
            let names: Vec<String> = devs.iter().map(|d| d.name().to_owned()).collect();
            match devs.into_iter().find(|d| d.name() == name) {
                Some(d) => Some(d),
                None => {
                    return Err(BenchError::Config(format!(
                        "-d {name}: no such device; this provider lists: {}",
                        names.join(", ")
                    )))
                }
            }
        }
    }
    .ok_or_else(|| BenchError::Config("no device to run on".into()))?;
    let is_soft = device.info().provider == "soft";
    if !is_soft && link != SoftLink::Auto {
        return Err(BenchError::Config(format!(
            "--link {} selects a soft-provider link, but the run uses the verbs device {}; add --provider soft",
            if link == SoftLink::Shm { "shm" } else { "tcp" },
            device.name()
        )));
    }
    Ok(Resolved {
        kind: if is_soft { ProviderKind::Soft } else { ProviderKind::Verbs },
        device,
        soft: is_soft.then_some(soft),
    })
}

/// The link a run used, for the header and the records: `shm` or `tcp` for
/// the soft provider (`auto` resolved by whether both ends share a host),
/// `hca` for verbs.
pub fn link_used(r: &Resolved, same_host: bool) -> &'static str {
    match r.soft.as_ref().map(|s| s.link) {
        None => "hca",
        Some(SoftLink::Shm) => "shm",
        Some(SoftLink::Tcp) => "tcp",
        Some(SoftLink::Auto) if same_host => "shm",
        Some(SoftLink::Auto) => "tcp",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn soft_resolves_with_its_link() {
        let r = resolve("soft", "--provider soft", "tcp", None).unwrap();
        assert_eq!(r.provider_name(), "soft");
        assert_eq!(link_used(&r, true), "tcp");
        let r = resolve("soft", "--provider soft", "auto", Some("soft0")).unwrap();
        assert_eq!((link_used(&r, true), link_used(&r, false)), ("shm", "tcp"));
    }

    #[test]
    fn bad_names_are_config_errors() {
        let o = "--provider soft";
        assert!(matches!(resolve("soft", o, "shm", Some("mlx5_9")), Err(BenchError::Config(m)) if m.contains("soft0")));
        assert!(matches!(resolve("rxe", o, "shm", None), Err(BenchError::Config(_))));
        assert!(matches!(resolve("soft", o, "ib", None), Err(BenchError::Config(_))));
    }

    #[test]
    fn the_flag_wins_then_rmacomm_provider_then_auto() {
        assert_eq!(requested_provider(Some("soft"), Some("verbs")).unwrap(), ("soft", "--provider soft".into()));
        assert_eq!(requested_provider(None, Some("verbs")).unwrap(), ("verbs", "RMACOMM_PROVIDER=verbs".into()));
        assert_eq!(requested_provider(None, Some(" Soft ")).unwrap().0, "soft");
        assert_eq!(requested_provider(None, None).unwrap().0, "auto");
        // A flag makes a bad variable irrelevant; without one it is an error
        // that names the variable and the choices.
        assert_eq!(requested_provider(Some("auto"), Some("foo")).unwrap().0, "auto");
        match requested_provider(None, Some("foo")) {
            Err(BenchError::Config(m)) => {
                assert!(m.contains("RMACOMM_PROVIDER") && m.contains("\"foo\"") && m.contains("auto|verbs|soft"), "{m}")
            }
            other => panic!("expected a config error, got {other:?}"),
        }
    }
}
