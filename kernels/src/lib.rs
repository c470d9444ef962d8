//! rmacomm kernels: the CPU reductions the collectives call, for every op
//! and dtype.
//!
//! A [`Reducer`] is one (dtype, op) with its kernels chosen: build it once
//! per collective call, then reduce each chunk with it. Buffers are bytes
//! (collectives move bytes) at any alignment, or raw pointers for memory
//! that must not be borrowed as a Rust slice (a peer's shared memory, a
//! registered buffer).
//!
//! # Quick start
//!
//! ```
//! use rmacomm_kernels::{as_bytes, as_bytes_mut, DType, ReduceOp, Reducer};
//!
//! # fn main() -> Result<(), rmacomm_kernels::Error> {
//! let sum = Reducer::new(DType::F32, ReduceOp::Sum)?;
//!
//! // A ring step: combine a received chunk into the local one.
//! let mut mine = vec![1.0f32, 2.0, 3.0];
//! let received = vec![10.0f32, 20.0, 30.0];
//! sum.reduce_into(as_bytes_mut(&mut mine), as_bytes(&received))?;
//! assert_eq!(mine, [11.0, 22.0, 33.0]);
//!
//! // The shared-memory all_reduce: every peer's slice in, one output out,
//! // in one pass (raw bytes work the same; here f32 views of them).
//! let peers = [[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]];
//! let inputs: Vec<&[u8]> = peers.iter().map(|p| as_bytes(p)).collect();
//! let mut out = [0.0f32; 2];
//! sum.reduce_n(as_bytes_mut(&mut out), &inputs)?;
//! assert_eq!(out, [16.0, 20.0]);
//!
//! // Avg: reduce_full sums and divides by the number of inputs.
//! Reducer::new(DType::F32, ReduceOp::Avg)?.reduce_full(as_bytes_mut(&mut out), &inputs)?;
//! assert_eq!(out, [4.0, 5.0]);
//!
//! // Bitwise ops on floats are an error, not a panic.
//! assert!(Reducer::new(DType::BF16, ReduceOp::Bxor).is_err());
//! # Ok(()) }
//! ```
//!
//! On memory a peer maps, with the peers synchronised (a signal says their
//! data is there, and nobody writes the output until told):
//!
//! ```
//! use rmacomm_kernels::{DType, ReduceOp, Reducer};
//!
//! # fn main() -> Result<(), rmacomm_kernels::Error> {
//! let max = Reducer::new(DType::I32, ReduceOp::Max)?;
//! let (a, b) = ([1i32, 9, -4], [7i32, -2, -3]);
//! let mut out = [0i32; 3];
//! // SAFETY: all three are valid for 12 bytes and nothing else touches
//! // them during the call.
//! unsafe {
//!     max.reduce_n_raw(out.as_mut_ptr().cast(), &[a.as_ptr().cast(), b.as_ptr().cast()], 12)?;
//! }
//! assert_eq!(out, [7, 9, -3]);
//! # Ok(()) }
//! ```
//!
//! # Features
//!
//! - Ops ([`ReduceOp`]): `Sum`, `Product`, `Min`, `Max`, `Band`, `Bor`,
//!   `Bxor` (integers only: [`Error::UnsupportedOp`] on floats), `Avg`,
//!   `PremulSum(factor)`. Integer arithmetic wraps. Float `Min`/`Max` are
//!   IEEE 754-2019 `minimum`/`maximum`: NaN if either input is NaN (as
//!   `torch.minimum`), `-0.0 < +0.0` whatever the order, infinities ordered
//!   as usual.
//! - Element types ([`DType`]): `f32`, `f64`, `f16`, `bf16`, `i8`, `u8`,
//!   `i32`, `i64`, with sizes, names and parsing (`"f32"`, `"float32"`,
//!   `"bfloat16"`, `"torch.int64"`). `f16`/`bf16` compute in `f32`: an
//!   N-input reduction accumulates all N in `f32` and rounds once.
//! - Entry points shaped for collectives ([`Reducer`]): `reduce_into`
//!   (`dst = op(dst, src)`), `reduce` (`out = op(a, b)`), `reduce_n`
//!   (`out = op(in0, ..., in_{k-1})`, each input read once and the output
//!   stored once), and for `Avg`/`PremulSum` the steps outside the combine:
//!   `prepare` (PremulSum multiplies a rank's own contribution by the factor:
//!   the factor applies to **inputs before summing**, as NCCL does),
//!   `finish` (Avg divides by n; integers truncate toward zero, as torch
//!   does) and `reduce_full` (all three in one pass). Each has an `unsafe`
//!   `*_raw` twin on pointers, with its safety contract.
//! - Any alignment: elements are read and written unaligned, which costs
//!   nothing on x86_64 and needs no fallback path.
//! - Vectorised by the compiler: one plain indexed loop per (op, type, pass),
//!   chosen once per call through a function pointer, never a branch on the
//!   op per element. Up to 4 inputs are fused into one pass; more go through
//!   an L1-resident accumulator block. x86_64 builds carry an AVX2 copy of
//!   the kernels, picked at run time ([`Reducer::avx2`]). Seen in the
//!   assembly of the 2-input f32 `Sum` loop: baseline `movups`/`addps` on 2
//!   xmm registers per iteration (8 floats), AVX2 `vaddps` with memory
//!   operands on 4 ymm registers (32 floats), both behind a run-time overlap
//!   check of the pointers, with scalar tails.
//! - Non-temporal stores ([`Reducer::nontemporal`]), helper threads
//!   ([`Reducer::threads`]) and a device seam ([`Device`]), below.
//!
//! # Non-temporal stores
//!
//! With [`Reducer::nontemporal`] on, outputs of at least
//! [`NONTEMPORAL_MIN_BYTES`] (32 MiB, or
//! [`Reducer::nontemporal_min_bytes`]) are computed a block at a time on the
//! stack and written with `movntdq` (x86_64; ordinary stores elsewhere), then
//! an `sfence` before the call returns. That skips reading the output's
//! lines before writing them and leaves the cache to the inputs. Use it for
//! results larger than the last-level cache that this core will not read
//! again soon (a final result handed to a NIC or another process); leave it
//! off when the next step reads the output, and for the in-place calls,
//! which read their destination anyway (they ignore it).
//!
//! # Helper threads
//!
//! Outputs of at least [`PARALLEL_MIN_BYTES`] (4 MiB) are split into
//! contiguous, page-aligned ranges of at least 1 MiB over up to
//! [`Reducer::threads`] threads (`std::thread::scope`: spawned per call, the
//! calling thread takes one range, all joined before the call returns, each
//! fencing its own streaming stores). The default is `RMACOMM_REDUCE_THREADS`
//! if set, else 1 on machines with at most 2 cores (the collective's thread
//! and the application need them) and half the cores, at most 8, on larger
//! ones (a socket's memory bandwidth is saturated by then). Results do not
//! depend on the thread count: each element is combined in the same order.
//!
//! # Devices
//!
//! [`Reducer::on`] takes a [`Device`]; only [`Device::Cpu`] has a backend in
//! this build, [`Device::Cuda`] returns [`Error::DeviceUnavailable`]. The
//! CUDA kernels exist as source compiled at run time with NVRTC
//! ([`cuda`]: every op and dtype, checked to compile for `sm_80` and
//! `sm_90` wherever NVRTC is); launching them on a device is not built yet.
//!
//! # Thread safety
//!
//! A [`Reducer`] is `Send + Sync` and holds no buffers: share one between
//! threads, or clone it (cheap). Calls on disjoint buffers may run
//! concurrently. The raw-pointer calls require that nothing else writes
//! their ranges (nor reads the output) during the call; for shared memory
//! that means the peers were synchronised with first.
//!
//! # Resource cleanup
//!
//! Nothing to clean up: a call borrows its buffers for its duration only,
//! and its helper threads end before it returns.
//!
//! # Performance
//!
//! `cargo bench -p rmacomm-kernels --bench reduce`, f32 `Sum`, output bytes
//! per second, on the CI VM (AMD EPYC Zen 4, 2 cores, shared with other
//! builds; figures drift by ±30% between runs), beside a `memcpy` of the
//! same size (ratio = memcpy time / reduction time):
//!
//! | size | memcpy | 2 inputs | 4 inputs | in place |
//! | --- | --- | --- | --- | --- |
//! | 4 KiB | 78 GB/s | 42 GB/s (0.53) | 27 GB/s (0.35) | 57 GB/s (0.74) |
//! | 1 MiB | 41 GB/s | 26 GB/s (0.62) | 16 GB/s (0.38) | 38 GB/s (0.92) |
//! | 64 MiB | 8.1 GB/s | 7.3 GB/s (0.90) | 4.3 GB/s (0.53) | 10.2 GB/s (1.26) |
//!
//! A 2-input reduction (or the in-place one) moves 1.5 times memcpy's bytes
//! and a 4-input one 2.5 times. At 64 MiB memcpy is glibc's large-copy path
//! (which, as far as we know, streams above a fraction of the L3), so
//! ratios there are not a traffic bound. The baseline (SSE2) kernels reach
//! 0.36 (2 inputs) and 0.25 (4 inputs) at 4 KiB, where AVX2 matters; from
//! 1 MiB on the copies are within 10%.
//!
//! # Organization
//!
//! - `reducer.rs`: [`Reducer`], the entry points, argument checks, the
//!   non-temporal and thread decisions.
//! - `dispatch.rs`: the kernel table of one (dtype, op), and the choice of
//!   instruction set.
//! - `native.rs`: kernels for types that compute as themselves (`f32`,
//!   `f64`, integers), baseline and AVX2 copies; `halfs.rs`: `f16`/`bf16`
//!   through `f32` blocks.
//! - `arith.rs`: per-element ops and maps (`Avg`'s division, `PremulSum`'s
//!   scale); `nontemporal.rs`: streaming stores; `parallel.rs`: the range
//!   split over helper threads.
//! - `dtype.rs`, `op.rs`, `device.rs`, `element.rs`, `error.rs`: the public
//!   vocabulary.
//! - `cuda.rs` and `cuda/prelude.cu`: the CUDA kernels' source, compiled at
//!   run time with NVRTC ([`cuda`]).

mod arith;
pub mod cuda;
mod device;
mod dispatch;
mod dtype;
mod element;
mod error;
mod halfs;
mod native;
mod nontemporal;
mod op;
mod parallel;
mod reducer;

pub use device::Device;
pub use dtype::DType;
pub use element::{as_bytes, as_bytes_mut, Element};
pub use error::{Error, Result};
pub use half;
pub use op::ReduceOp;
pub use reducer::{Reducer, NONTEMPORAL_MIN_BYTES, PARALLEL_MIN_BYTES};
