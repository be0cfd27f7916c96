//! `--kv-type`, shared by `generate`, `logits`, `perplexity`, `bench` and `serve`.

use anyhow::{Context, Result};
use redlite_engine::backends::AnyModel;
use redlite_engine::with_model;
use redlite_model::KvType;

#[derive(clap::Args, Debug, Clone, Copy)]
pub struct KvArgs {
    /// KV cache element type: f32 (exact), f16 (half the bytes) or q8_0 (34 bytes per 32 values,
    /// needs a head dimension that is a multiple of 32; the CUDA backend takes f32 or f16).
    /// Default: f32 on the CPU, f16 with --backend cuda (llama.cpp's default type; at 32K
    /// positions the GPU's decode streams half the bytes). Drift against f32: docs/quality.md.
    #[arg(long, value_name = "TYPE", env = "REDLITE_KV_TYPE")]
    pub kv_type: Option<KvType>,
}

impl KvArgs {
    /// The type on the CPU backends: as asked, else f32.
    pub fn cpu(&self) -> KvType {
        self.kv_type.unwrap_or(KvType::F32)
    }

    /// The type on the CUDA backend: as asked, else f16.
    pub fn cuda(&self) -> KvType {
        self.kv_type.unwrap_or(KvType::F16)
    }

    /// Make `model` (a CPU backend's) create its sequence states with [`Self::cpu`]'s type.
    pub fn apply(&self, model: &mut AnyModel) -> Result<()> {
        with_model!(model, m => m.set_kv_type(self.cpu())).context("--kv-type")
    }

    /// Fails unless the CUDA backend's attention kernels take the type (f32 or f16).
    pub fn require_cuda(&self) -> Result<()> {
        if !matches!(self.cuda(), KvType::F32 | KvType::F16) {
            anyhow::bail!(
                "--kv-type {} is not available with --backend cuda (f32 or f16)",
                self.cuda()
            );
        }
        Ok(())
    }

    /// The GPU memory settings: `cache`'s expert cache with [`Self::cuda`]'s type.
    pub fn gpu<'a>(&self, cache: &'a crate::cache_args::CacheArgs) -> crate::cuda_cmd::GpuMem<'a> {
        crate::cuda_cmd::GpuMem {
            cache,
            kv: self.cuda(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        kv: KvArgs,
    }

    #[test]
    fn the_default_type_depends_on_the_backend() {
        // (REDLITE_KV_TYPE would set the default: not set in the test environment.)
        if std::env::var_os("REDLITE_KV_TYPE").is_some() {
            return;
        }
        let kv = Cli::parse_from(["x"]).kv;
        assert_eq!((kv.cpu(), kv.cuda()), (KvType::F32, KvType::F16));
        let kv = Cli::parse_from(["x", "--kv-type", "f32"]).kv;
        assert_eq!((kv.cpu(), kv.cuda()), (KvType::F32, KvType::F32));
        let kv = Cli::parse_from(["x", "--kv-type", "q8_0"]).kv;
        assert_eq!(kv.cpu(), KvType::Q8_0);
        assert!(kv.require_cuda().is_err());
    }
}
