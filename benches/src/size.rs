//! Message sizes as people type them (`64`, `8K`, `1M`, `2G`) and the
//! power-of-two sweep of `-a`.

/// Parses a byte count with an optional binary suffix: `K`, `M`, `G`
/// (also `KB`/`KiB`, any case), as perftest reads `-s`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let digits_end = lower.find(|c: char| !c.is_ascii_digit()).unwrap_or(lower.len());
    let (num, suffix) = lower.split_at(digits_end);
    if num.is_empty() {
        return Err(format!("{s:?} is not a size: expected a number with an optional K, M or G suffix"));
    }
    let shift = match suffix {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("{s:?}: unknown suffix {suffix:?} (use K, M or G)")),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is too large"))?;
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("{s:?} is too large"))
}

/// `clap` value parser for sizes.
pub fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s)
}

/// A short human form: `2 B`, `8 KiB`, `1 MiB`, `1.5 MiB`.
pub fn format_size(n: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if n >= unit {
            return if n.is_multiple_of(unit) {
                format!("{} {name}", n / unit)
            } else {
                format!("{:.1} {name}", n as f64 / unit as f64)
            };
        }
    }
    format!("{n} B")
}

/// Powers of two from the smallest one `>= min` up to `max`, inclusive.
pub fn sweep_sizes(min: u64, max: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = min.max(1).next_power_of_two();
    while s <= max {
        v.push(s);
        match s.checked_mul(2) {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("64"), Ok(64));
        assert_eq!(parse_size("8K"), Ok(8192));
        assert_eq!(parse_size("8k"), Ok(8192));
        assert_eq!(parse_size("8KiB"), Ok(8192));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size(" 256m "), Ok(256 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("12B"), Ok(12));
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse_size("").is_err());
        assert!(parse_size("K").is_err());
        assert!(parse_size("1T").is_err());
        assert!(parse_size("1.5M").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("17179869184G").is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(2), "2 B");
        assert_eq!(format_size(8192), "8 KiB");
        assert_eq!(format_size(3 << 19), "1.5 MiB");
        assert_eq!(format_size(256 << 20), "256 MiB");
        assert_eq!(format_size(1 << 30), "1 GiB");
    }

    #[test]
    fn sweeps_powers_of_two() {
        let v = sweep_sizes(2, 256 << 20);
        assert_eq!(v.len(), 28);
        assert_eq!(v[0], 2);
        assert_eq!(*v.last().unwrap(), 256 << 20);
        assert_eq!(sweep_sizes(3, 16), vec![4, 8, 16]);
        assert_eq!(sweep_sizes(0, 2), vec![1, 2]);
        assert!(sweep_sizes(64, 32).is_empty());
    }
}
