//! Slurm's compressed host lists (`node[01-04,07],other`): just what
//! bootstrap needs, the first host.

use crate::error::{Error, Result};

/// The first host of a Slurm host list such as `node[01-04,07],gpu-[1-2]-a`
/// (`node01`). Zero padding is kept; several bracket groups in one name
/// (`rack[1-2]-n[3-4]`) each give their first element. `var` names the
/// variable the list came from, for the error.
pub fn first_host(var: &str, list: &str) -> Result<String> {
    let bad = |why: &str| Error::env(var, format!("cannot read host list '{list}': {why}; set MASTER_ADDR instead"));
    // The first top-level item ends at the first comma outside brackets.
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => {
                if depth > 0 {
                    return Err(bad("nested '['"));
                }
                depth += 1;
            }
            ']' => depth = depth.checked_sub(1).ok_or_else(|| bad("']' without '['"))?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let item = list[..end].trim();
    let mut host = String::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']').ok_or_else(|| bad("'[' without ']'"))? + open;
        let inner = &rest[open + 1..close];
        let first = inner.split(',').next().unwrap_or("").split('-').next().unwrap_or("").trim();
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad("a bracket must hold numbers and ranges like [01-04,07]"));
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return Err(bad("']' without '['"));
    }
    host.push_str(rest);
    if host.is_empty() {
        return Err(bad("it is empty"));
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::first_host;

    #[test]
    fn forms() {
        for (list, first) in [
            ("node[01-04,07],other", "node01"),
            ("node07", "node07"),
            ("a,b,c", "a"),
            ("gpu[3,1-2]", "gpu3"),
            ("rack[1-2]-n[003-004]", "rack1-n003"),
            ("n[1-2]x,m", "n1x"),
            ("  host-1.example.com ", "host-1.example.com"),
            ("node[10]", "node10"),
        ] {
            assert_eq!(first_host("L", list).unwrap(), first, "{list}");
        }
    }

    #[test]
    fn malformed_lists_name_the_variable() {
        for list in ["", "node[01-04", "node01-04]", "node[]", "node[a-b]", ",x", "n[[1]]"] {
            let e = first_host("SLURM_JOB_NODELIST", list).unwrap_err().to_string();
            assert!(e.contains("SLURM_JOB_NODELIST"), "{list}: {e}");
        }
    }
}
