//! `--kv-type`, shared by `generate`, `logits`, `perplexity`, `bench` and `serve`.

use anyhow::{Context, Result};
use redlite_engine::backends::AnyModel;
use redlite_engine::with_model;
use redlite_model::KvType;

#[derive(clap::Args, Debug, Clone, Copy)]
pub struct KvArgs {
    /// KV cache element type: f32 (exact), f16 (half the bytes) or q8_0 (34 bytes per 32 values,
    /// needs a head dimension that is a multiple of 32). Drift against f32: docs/quality.md.
    #[arg(long, value_name = "TYPE", default_value_t = KvType::F32)]
    pub kv_type: KvType,
}

impl KvArgs {
    /// Make `model` create its sequence states with this KV type.
    pub fn apply(&self, model: &mut AnyModel) -> Result<()> {
        with_model!(model, m => m.set_kv_type(self.kv_type)).context("--kv-type")
    }

    /// Fails unless the type is f32: for paths (the CUDA model) that keep their own f32 cache.
    pub fn require_f32(&self, what: &str) -> Result<()> {
        if self.kv_type != KvType::F32 {
            anyhow::bail!(
                "--kv-type {} is not available with {what} yet (f32 only)",
                self.kv_type
            );
        }
        Ok(())
    }
}
