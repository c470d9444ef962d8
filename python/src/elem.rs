//! Element types: what numpy and torch call them, their size, and the
//! reduction dtype ([`DType`]) where one exists.
//!
//! Data movement (send, broadcast, gathers, windows) works on any of these;
//! reductions need one with a [`DType`]. Names are numpy's and torch's
//! shared spelling (`float32`, `bfloat16`, `bool`), which is also what
//! window registrations exchange so that `map_remote_tensor` can rebuild a
//! peer's tensor.

use rmacomm_collectives::DType;

/// One element type.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Elem {
    /// numpy / torch name (`torch.<name>` for torch).
    pub(crate) name: &'static str,
    /// Bytes per element.
    pub(crate) size: usize,
    /// numpy's kind letter (`f`, `i`, `u`, `b`, `c`); `None`: numpy has no
    /// such type (bfloat16), arrays of it are viewed as `u2` and only torch
    /// can hold it.
    pub(crate) np_kind: Option<char>,
    /// The reduction dtype, for types reductions support.
    pub(crate) dtype: Option<DType>,
}

const fn e(name: &'static str, size: usize, np_kind: Option<char>, dtype: Option<DType>) -> Elem {
    Elem { name, size, np_kind, dtype }
}

/// Every element type rmacomm moves.
pub(crate) static ELEMS: [Elem; 15] = [
    e("float32", 4, Some('f'), Some(DType::F32)),
    e("float64", 8, Some('f'), Some(DType::F64)),
    e("float16", 2, Some('f'), Some(DType::F16)),
    e("bfloat16", 2, None, Some(DType::BF16)),
    e("int8", 1, Some('i'), Some(DType::I8)),
    e("uint8", 1, Some('u'), Some(DType::U8)),
    e("int16", 2, Some('i'), None),
    e("uint16", 2, Some('u'), None),
    e("int32", 4, Some('i'), Some(DType::I32)),
    e("uint32", 4, Some('u'), None),
    e("int64", 8, Some('i'), Some(DType::I64)),
    e("uint64", 8, Some('u'), None),
    e("bool", 1, Some('b'), None),
    e("complex64", 8, Some('c'), None),
    e("complex128", 16, Some('c'), None),
];

/// The element type called `name`: numpy / torch names (`float32`,
/// `torch.bfloat16`), Rust names (`f32`, `bf16`, `i64`) and the C-ish
/// aliases reductions accept (`float`, `double`, `half`, `int`, `long`).
pub(crate) fn by_name(name: &str) -> Option<&'static Elem> {
    let lower = name.trim().to_ascii_lowercase();
    let n = lower.strip_prefix("torch.").unwrap_or(&lower);
    if let Some(e) = ELEMS.iter().find(|e| e.name == n) {
        return Some(e);
    }
    if let Ok(d) = n.parse::<DType>() {
        return ELEMS.iter().find(|e| e.dtype == Some(d));
    }
    let alias = match n {
        "i16" | "short" => "int16",
        "u16" => "uint16",
        "u32" => "uint32",
        "u64" => "uint64",
        "bool_" => "bool",
        "c64" | "cfloat" => "complex64",
        "c128" | "cdouble" => "complex128",
        _ => return None,
    };
    ELEMS.iter().find(|e| e.name == alias)
}

/// The element type of a buffer-protocol format string (`struct` module
/// syntax, as numpy exports it: `f`, `<d`, `e`, `?`, `Zf`, `l`) whose items
/// are `itemsize` bytes; `Err` says why it is not one.
pub(crate) fn from_format(format: &str, itemsize: usize) -> Result<&'static Elem, String> {
    let little = cfg!(target_endian = "little");
    let (order, code) = match format.as_bytes().first() {
        Some(b'@' | b'=') => (None, &format[1..]),
        Some(b'<') => (Some(true), &format[1..]),
        Some(b'>' | b'!') => (Some(false), &format[1..]),
        _ => (None, format),
    };
    if order.is_some_and(|l| l != little) && itemsize > 1 {
        return Err(format!("byte order of format {format:?} is not this machine's; convert it (e.g. .astype('='))"));
    }
    let name = match (code, itemsize) {
        ("f", 4) => "float32",
        ("d", 8) => "float64",
        ("e", 2) => "float16",
        ("?", 1) => "bool",
        ("Zf", 8) => "complex64",
        ("Zd", 16) => "complex128",
        ("b" | "h" | "i" | "l" | "q" | "n", 1) => "int8",
        ("b" | "h" | "i" | "l" | "q" | "n", 2) => "int16",
        ("b" | "h" | "i" | "l" | "q" | "n", 4) => "int32",
        ("b" | "h" | "i" | "l" | "q" | "n", 8) => "int64",
        ("B" | "H" | "I" | "L" | "Q" | "N" | "c", 1) => "uint8",
        ("B" | "H" | "I" | "L" | "Q" | "N", 2) => "uint16",
        ("B" | "H" | "I" | "L" | "Q" | "N", 4) => "uint32",
        ("B" | "H" | "I" | "L" | "Q" | "N", 8) => "uint64",
        _ => return Err(format!("element format {format:?} ({itemsize} bytes) is not a numeric type rmacomm moves")),
    };
    Ok(ELEMS.iter().find(|e| e.name == name).expect("in the table"))
}

impl Elem {
    /// numpy's `typestr` (`<f4`, `|u1`) of arrays of this type; bfloat16,
    /// which numpy lacks, as `<u2`.
    pub(crate) fn typestr(&self) -> String {
        let order = if self.size == 1 {
            '|'
        } else if cfg!(target_endian = "little") {
            '<'
        } else {
            '>'
        };
        format!("{order}{}{}", self.np_kind.unwrap_or('u'), self.size)
    }

    /// The reduction dtype, or a `TypeError` message naming `arg`.
    pub(crate) fn reduction_dtype(&self, arg: &str) -> Result<DType, String> {
        self.dtype.ok_or_else(|| {
            format!(
                "{arg}: reductions support float32, float64, float16, bfloat16, int8, uint8, int32 and int64, not {}",
                self.name
            )
        })
    }
}
