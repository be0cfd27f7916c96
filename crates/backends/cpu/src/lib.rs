//! The fast CPU backend: quantized matrix-vector and matrix-matrix kernels chosen at run time
//! (AVX-512, AVX2, portable scalar) behind one dispatch point, a persistent thread pool, and fused MoE.

pub mod attention;
pub mod backend;
pub mod delta_rule;
pub mod heap;
pub mod kernels;
mod populate;
pub mod team;

pub use backend::{CpuBackend, CpuLinear};
