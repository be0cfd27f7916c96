//! `--kv-type`, shared by `generate`, `logits`, `perplexity`, `bench` and `serve`.

use anyhow::{Context, Result};
use redlite_engine::backends::AnyModel;
use redlite_engine::with_model;
use redlite_model::KvType;

#[derive(clap::Args, Debug, Clone, Copy)]
pub struct KvArgs {
    /// KV cache element type: f32 (exact), f16 (half the bytes) or q8_0 (34 bytes per 32 values,
    /// needs a head dimension that is a multiple of 32; the CUDA backend takes f32 or f16). Drift
    /// against f32: docs/quality.md.
    #[arg(long, value_name = "TYPE", env = "REDLITE_KV_TYPE", default_value_t = KvType::F32)]
    pub kv_type: KvType,
}

impl KvArgs {
    /// Make `model` create its sequence states with this KV type.
    pub fn apply(&self, model: &mut AnyModel) -> Result<()> {
        with_model!(model, m => m.set_kv_type(self.kv_type)).context("--kv-type")
    }

    /// Fails unless the CUDA backend's attention kernels take the type (f32 or f16).
    pub fn require_cuda(&self) -> Result<()> {
        if !matches!(self.kv_type, KvType::F32 | KvType::F16) {
            anyhow::bail!(
                "--kv-type {} is not available with --backend cuda (f32 or f16)",
                self.kv_type
            );
        }
        Ok(())
    }

    /// The GPU memory settings: `cache`'s expert cache with this KV type.
    pub fn gpu<'a>(&self, cache: &'a crate::cache_args::CacheArgs) -> crate::cuda_cmd::GpuMem<'a> {
        crate::cuda_cmd::GpuMem {
            cache,
            kv: self.kv_type,
        }
    }
}
