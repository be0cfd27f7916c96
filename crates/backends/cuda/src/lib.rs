//! `redlite-cuda`: the CUDA backend.
//!
//! Kernels are CUDA C sources ([`kernels`], one `.cu` file per family under `kernels/`) compiled
//! at start-up by NVRTC for the device's architecture (`sm_90a` on Hopper) and cached on disk by
//! a hash of source, architecture, options and NVRTC version. CUDA is reached through `cudarc`
//! with dynamic loading, so a binary built with the `cuda` feature still starts on a machine
//! without a GPU: [`CudaBackend::new`] then returns [`CudaError::NoDriver`] (or
//! [`CudaError::NoNvrtc`], [`CudaError::NoDevice`]) instead of touching the missing library.
//!
//! Without the `cuda` feature the crate only carries the kernel sources and [`CudaError`]; every
//! entry point answers [`CudaError::NotBuilt`], and nothing CUDA is needed to build.
//!
//! With the feature:
//! - [`CudaBackend`] implements [`redlite_model::Backend`]: weights live on the device in their
//!   quantized form; `linear` copies activations in, runs the matvec kernel and copies out;
//!   `routed_experts` runs the fused expert kernels over the chosen experts.
//! - [`CudaModel`] runs the whole forward pass on the device (weights, activations, KV caches
//!   and recurrent states resident; the decode step replayed as a CUDA graph).
//! - [`selftest`] checks every kernel against the CPU reference on fresh random data.
//! - [`parity`] runs fixture models on the GPU and compares their logits with the exact ones.

mod error;
pub mod kernels;
pub mod mtp_queue;

pub use error::CudaError;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
pub mod blas;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
pub mod expert_bench;
#[cfg(feature = "cuda")]
pub mod expert_cache;
#[cfg(feature = "cuda")]
pub mod host;
#[cfg(feature = "cuda")]
pub mod kernel_bench;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
pub mod nvtx;
#[cfg(feature = "cuda")]
pub mod ops;
#[cfg(feature = "cuda")]
pub mod parity;
#[cfg(feature = "cuda")]
pub mod selftest;

#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, CudaLinear};
#[cfg(feature = "cuda")]
pub use device::{probe, DeviceInfo, Gpu};

/// Whether a GPU can be used; without the `cuda` feature never.
#[cfg(not(feature = "cuda"))]
pub fn probe() -> Result<(), CudaError> {
    Err(CudaError::NotBuilt)
}
#[cfg(feature = "cuda")]
pub use expert_cache::{ExpertCacheSize, ExpertPolicy, ExpertStats};
#[cfg(feature = "cuda")]
pub use model::{CudaModel, CudaModelOptions, GpuSampling, MAX_VERIFY_ROWS};

/// Whether this build carries the CUDA backend (the `cuda` feature).
pub const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");
