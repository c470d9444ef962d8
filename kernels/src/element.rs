//! [`Element`]: the Rust types behind each [`DType`], and byte views of
//! typed slices for callers that hold `Vec<f32>` rather than bytes.

use half::{bf16, f16};

use crate::DType;

mod sealed {
    pub trait Sealed {}
}

/// A Rust type whose values a [`DType`] describes: `f32`, `f64`,
/// [`half::f16`], [`half::bf16`], `i8`, `u8`, `i32`, `i64`.
///
/// Sealed: every bit pattern of these types is a valid value and they have
/// no padding, which [`as_bytes_mut`] relies on.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtype that reads this type's bytes.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}
element!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i8 => I8, u8 => U8, i32 => I32, i64 => I64);

/// The bytes of a typed slice, for the byte-slice API.
#[allow(clippy::disallowed_methods)] // a view of memory the caller's `&[T]` borrows, not shared memory
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` types have no padding, so every byte of the slice is
    // initialised; the view has the slice's lifetime and length in bytes.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// The bytes of a typed slice, writable, for the byte-slice API.
#[allow(clippy::disallowed_methods)] // a view of memory the caller's `&mut [T]` borrows exclusively
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`, and every bit pattern is a valid `T`
    // (`Element` is sealed to such types), so any bytes written are values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_are_native_endian_bytes() {
        let mut v = [1.0f32, -2.0];
        assert_eq!(as_bytes(&v), [1.0f32.to_ne_bytes(), (-2.0f32).to_ne_bytes()].concat());
        as_bytes_mut(&mut v)[4..].copy_from_slice(&3.5f32.to_ne_bytes());
        assert_eq!(v, [1.0, 3.5]);
        assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
    }
}
