//! Interface selection in `NCCL_SOCKET_IFNAME` syntax
//! (`RMACOMM_SOCKET_IFNAME`): which interfaces the soft TCP listener binds
//! and advertises.
//!
//! A comma-separated list of names; each is a prefix (`eth` matches `eth0`
//! and `eth1`) unless the list starts with `=` (exact names). A leading `^`
//! turns the list into exclusions: `^docker,lo` is every interface but
//! those. `^=lo` excludes exactly `lo`. Sans-IO: matching names only.

/// A parsed selection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IfnameFilter {
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfnameFilter {
    /// Parses `spec`; an empty list is an error (it would select nothing
    /// or everything by accident).
    pub(crate) fn parse(spec: &str) -> Result<IfnameFilter, String> {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let names: Vec<String> = s.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_owned).collect();
        if names.is_empty() {
            return Err(format!(
                "RMACOMM_SOCKET_IFNAME={spec:?} names no interface (syntax: eth0,ib | =eth0 | ^docker,lo)"
            ));
        }
        if let Some(bad) = names.iter().find(|n| n.len() > 15 || n.contains(['/', ' ', '^', '='])) {
            return Err(format!("RMACOMM_SOCKET_IFNAME={spec:?}: {bad:?} is not an interface name"));
        }
        Ok(IfnameFilter { exclude, exact, names })
    }

    /// Whether interface `name` is selected.
    pub(crate) fn matches(&self, name: &str) -> bool {
        let hit = self.names.iter().any(|n| if self.exact { name == n } else { name.starts_with(n.as_str()) });
        hit != self.exclude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_syntax() {
        let f = IfnameFilter::parse("eth,ib").unwrap();
        assert!(f.matches("eth0") && f.matches("ib1") && !f.matches("lo") && !f.matches("veth0"));
        let f = IfnameFilter::parse("=eth0").unwrap();
        assert!(f.matches("eth0") && !f.matches("eth01"));
        let f = IfnameFilter::parse("^docker,lo").unwrap();
        assert!(f.matches("eth0") && !f.matches("docker0") && !f.matches("lo"));
        let f = IfnameFilter::parse("^=lo").unwrap();
        assert!(f.matches("lo0") && !f.matches("lo"));
        assert!(IfnameFilter::parse("").is_err());
        assert!(IfnameFilter::parse("^").is_err());
        assert!(IfnameFilter::parse(" , ").is_err());
        assert!(IfnameFilter::parse("eth0/1").is_err());
    }
}
