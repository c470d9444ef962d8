//! rmacomm kernels: reductions for every op and dtype.
//!
//! It will hold vectorised CPU reductions (SUM, PRODUCT, MIN, MAX, bitwise, AVG, PREMUL_SUM over f32, f64, f16, bf16, i8, u8, i32, i64) and CUDA kernels compiled with NVRTC. Nothing is implemented yet.

#![forbid(unsafe_code)]
