//! [`DType`]: the element types a reduction runs on, their sizes and names.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// An element type of a buffer being reduced.
///
/// Buffers are byte slices (collectives move bytes); the dtype says how the
/// bytes are read: native-endian values, `F16` as IEEE binary16 and
/// `BF16` as bfloat16 (both computed in `f32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary64.
    F64,
    /// IEEE binary16 ([`half::f16`]).
    F16,
    /// bfloat16 ([`half::bf16`]).
    BF16,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I8, DType::U8, DType::I32, DType::I64];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// The short name (`"f32"`, `"bf16"`, `"i64"`), which [`FromStr`] accepts.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    /// Whether the type is a floating-point type (bitwise ops are refused).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Whether the type is an integer type (arithmetic wraps).
    pub const fn is_integer(self) -> bool {
        !self.is_float()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Parses Rust names (`f32`), torch/numpy names (`float32`, `bfloat16`,
    /// `int64`, `torch.float16`) and C-ish aliases (`float`, `double`,
    /// `half`, `int`, `long`), case-insensitively.
    fn from_str(s: &str) -> Result<Self, Error> {
        let lower = s.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("torch.").unwrap_or(&lower);
        Ok(match name {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "i8" | "int8" => DType::I8,
            "u8" | "uint8" => DType::U8,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            _ => return Err(Error::UnknownDType(s.to_owned())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_aliases_parse() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert_eq!(d.to_string(), d.name());
        }
        assert_eq!("float32".parse::<DType>().unwrap(), DType::F32);
        assert_eq!("BFloat16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("torch.float16".parse::<DType>().unwrap(), DType::F16);
        assert_eq!("int64".parse::<DType>().unwrap(), DType::I64);
        assert_eq!("uint8".parse::<DType>().unwrap(), DType::U8);
        assert_eq!("double".parse::<DType>().unwrap(), DType::F64);
        assert_eq!("f128".parse::<DType>(), Err(Error::UnknownDType("f128".into())));
    }

    #[test]
    fn sizes_and_kinds() {
        let sizes: Vec<usize> = DType::ALL.iter().map(|d| d.size()).collect();
        assert_eq!(sizes, [4, 8, 2, 2, 1, 1, 4, 8]);
        assert!(DType::BF16.is_float() && !DType::BF16.is_integer());
        assert!(DType::U8.is_integer() && !DType::U8.is_float());
    }
}
