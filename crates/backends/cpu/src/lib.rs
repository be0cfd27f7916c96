//! The fast CPU backend: quantized matrix-vector and matrix-matrix kernels chosen at run time
//! (AVX-512, AVX2, portable scalar) behind one dispatch point, a persistent thread pool, and fused MoE.
//!
//! Where things are: `kernels/` (the dispatch table in `kernels/mod.rs`, every SIMD kernel beside
//! its scalar twin and checked by `kernels/selftest.rs`; `kernels/tiles_x86.rs`,
//! `kernels/q8_0_tiles_x86.rs`: Q4_K / Q6_K / Q8_0 matrices of small files repacked at load as
//! 16-row tiles), `backend.rs` (the `Backend` implementation, the pool kept warm during a pass),
//! `team.rs` (fork-join of a pass's small regions over the warm threads), `delta_rule.rs`,
//! `attention.rs`, `populate.rs` (the weight map read in at load), `heap.rs` (freed activation
//! memory kept by the allocator), `vexp.rs` (`e^x`, SiLU, sigmoid 16 at a time, bit-identical to
//! libm's).

pub mod attention;
pub mod backend;
pub mod delta_rule;
pub mod heap;
pub mod kernels;
mod populate;
pub mod team;
pub mod vexp;

pub use backend::{CpuBackend, CpuLinear};
