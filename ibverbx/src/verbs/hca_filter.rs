//! `RMACOMM_IB_HCA`: which HCAs (and ports) the verbs provider may use, in
//! `NCCL_IB_HCA` syntax.
//!
//! - `mlx5_0,mlx5_1` — only these; a name is a prefix (`mlx5_1` also admits
//!   `mlx5_10`), as in NCCL;
//! - `=mlx5_1` — exact names;
//! - `^mlx5_2` / `^=mlx5_2` — every device but these;
//! - `mlx5_0:1` — only port 1 of `mlx5_0`.
//!
//! Pure parsing and matching: no I/O, tested on fake device lists.

use std::fmt;

/// One `name[:port]` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcaEntry {
    /// Device name, or name prefix.
    pub name: String,
    /// Port restriction.
    pub port: Option<u8>,
}

/// A parsed `RMACOMM_IB_HCA` value.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HcaFilter {
    /// `^`: the entries are excluded rather than selected.
    pub exclude: bool,
    /// `=`: names match exactly rather than by prefix.
    pub exact: bool,
    /// The entries; empty admits everything.
    pub entries: Vec<HcaEntry>,
}

impl fmt::Display for HcaFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.exclude {
            f.write_str("^")?;
        }
        if self.exact {
            f.write_str("=")?;
        }
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(&e.name)?;
            if let Some(p) = e.port {
                write!(f, ":{p}")?;
            }
        }
        Ok(())
    }
}

impl HcaFilter {
    /// Parses the variable's value. Errors name the bad entry.
    pub fn parse(s: &str) -> Result<HcaFilter, String> {
        let mut rest = s.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let mut entries = Vec::new();
        for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (name, port) = match item.split_once(':') {
                None => (item, None),
                Some((n, p)) => {
                    let port: u8 = p.trim().parse().ok().filter(|&p| p > 0).ok_or_else(|| {
                        format!("RMACOMM_IB_HCA: {item:?} has a bad port (want name:port, port 1..255)")
                    })?;
                    (n.trim(), Some(port))
                }
            };
            if name.is_empty() {
                return Err(format!("RMACOMM_IB_HCA: {item:?} has no device name"));
            }
            entries.push(HcaEntry { name: name.to_owned(), port });
        }
        Ok(HcaFilter { exclude, exact, entries })
    }

    /// From `RMACOMM_IB_HCA`; unset or empty admits everything.
    pub fn from_env() -> Result<HcaFilter, String> {
        match std::env::var("RMACOMM_IB_HCA") {
            Ok(v) => Self::parse(&v),
            Err(_) => Ok(HcaFilter::default()),
        }
    }

    /// True when the filter admits everything.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn name_matches(&self, entry: &HcaEntry, name: &str) -> bool {
        if self.exact {
            entry.name == name
        } else {
            name.starts_with(&entry.name)
        }
    }

    /// Whether port `port` of device `name` may be used.
    pub fn allows_port(&self, name: &str, port: u8) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        let hit = self.entries.iter().any(|e| self.name_matches(e, name) && (e.port.is_none() || e.port == Some(port)));
        hit != self.exclude
    }

    /// Whether some port of device `name` may be used (the device is listed).
    /// An exclusion of single ports (`^mlx5_0:1`) leaves the device listed.
    pub fn allows_device(&self, name: &str) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        if self.exclude {
            !self.entries.iter().any(|e| e.port.is_none() && self.name_matches(e, name))
        } else {
            self.entries.iter().any(|e| self.name_matches(e, name))
        }
    }

    /// The ports of `name` this filter names explicitly when selecting, so
    /// that a QP defaults to them; `None` when any port is allowed.
    pub fn selected_ports(&self, name: &str) -> Option<Vec<u8>> {
        if self.exclude || self.entries.is_empty() {
            return None;
        }
        let mut ports = Vec::new();
        for e in self.entries.iter().filter(|e| self.name_matches(e, name)) {
            match e.port {
                None => return None,
                Some(p) => ports.push(p),
            }
        }
        Some(ports)
    }

    /// The ports of `name` (which has `port_count` of them) QPs may use,
    /// the default first; `None` when every port may be used. A selection
    /// gives the ports it names; an exclusion of single ports
    /// (`^mlx5_0:1`) the ports it leaves (it used to give `None`, and the
    /// excluded port stayed the default).
    pub fn port_list(&self, name: &str, port_count: u8) -> Option<Vec<u8>> {
        if !self.exclude {
            return self.selected_ports(name);
        }
        let left: Vec<u8> = (1..=port_count).filter(|&p| self.allows_port(name, p)).collect();
        (left.len() < port_count as usize).then_some(left)
    }

    /// Filters device names, keeping their order.
    pub fn apply<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
        names.into_iter().filter(|n| self.allows_device(n)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEVS: [&str; 5] = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_10", "rxe0"];

    fn keep(s: &str) -> Vec<&'static str> {
        HcaFilter::parse(s).unwrap().apply(DEVS)
    }

    #[test]
    fn empty_admits_everything() {
        assert_eq!(keep(""), DEVS);
        assert_eq!(keep("  "), DEVS);
        assert!(HcaFilter::default().allows_port("anything", 3));
    }

    #[test]
    fn names_are_prefixes_unless_exact() {
        assert_eq!(keep("mlx5_1"), ["mlx5_1", "mlx5_10"]);
        assert_eq!(keep("=mlx5_1"), ["mlx5_1"]);
        assert_eq!(keep("mlx5"), ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_10"]);
        assert_eq!(keep("mlx5_0,mlx5_2"), ["mlx5_0", "mlx5_2"]);
    }

    #[test]
    fn caret_excludes() {
        assert_eq!(keep("^mlx5_2"), ["mlx5_0", "mlx5_1", "mlx5_10", "rxe0"]);
        assert_eq!(keep("^mlx5_1"), ["mlx5_0", "mlx5_2", "rxe0"]);
        assert_eq!(keep("^=mlx5_1"), ["mlx5_0", "mlx5_2", "mlx5_10", "rxe0"]);
        assert_eq!(keep("^mlx5"), ["rxe0"]);
    }

    #[test]
    fn ports() {
        // "=" applies to the whole list, as in NCCL.
        let f = HcaFilter::parse("=mlx5_0:1,mlx5_1:2").unwrap();
        assert!(f.exact);
        assert!(f.allows_port("mlx5_0", 1));
        assert!(!f.allows_port("mlx5_0", 2));
        assert!(f.allows_device("mlx5_0"));
        assert_eq!(f.selected_ports("mlx5_0"), Some(vec![1]));
        assert_eq!(f.apply(DEVS), ["mlx5_0", "mlx5_1"]);
        assert!(!f.allows_device("mlx5_10"), "exact");

        let f = HcaFilter::parse("mlx5_0:1,mlx5_0:2,mlx5_1").unwrap();
        assert_eq!(f.selected_ports("mlx5_0"), Some(vec![1, 2]));
        assert_eq!(f.selected_ports("mlx5_1"), None);

        let f = HcaFilter::parse("^mlx5_0:1").unwrap();
        assert!(f.allows_device("mlx5_0"), "excluding one port keeps the device");
        assert!(!f.allows_port("mlx5_0", 1));
        assert!(f.allows_port("mlx5_0", 2));
        assert_eq!(f.selected_ports("mlx5_0"), None);
        assert_eq!(f.port_list("mlx5_0", 2), Some(vec![2]), "the port left is the one QPs use");
        assert_eq!(f.port_list("mlx5_1", 2), None);
        let f = HcaFilter::parse("mlx5_0:2,mlx5_0:1").unwrap();
        assert_eq!(f.port_list("mlx5_0", 2), Some(vec![2, 1]), "a selection keeps its order");
    }

    #[test]
    fn bad_entries_are_errors() {
        assert!(HcaFilter::parse("mlx5_0:x").unwrap_err().contains("bad port"));
        assert!(HcaFilter::parse("mlx5_0:0").is_err());
        assert!(HcaFilter::parse(":1").unwrap_err().contains("no device name"));
    }

    #[test]
    fn display_round_trips() {
        for s in ["^=mlx5_0:1,mlx5_1", "mlx5_0", "=a,b:2"] {
            assert_eq!(HcaFilter::parse(s).unwrap().to_string(), s);
        }
    }
}
