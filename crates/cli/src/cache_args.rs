//! The expert-cache options shared by `generate`, `logits`, `bench` and `serve`.

use anyhow::{anyhow, Result};
use redlite_engine::planner::{plan, Budget, PlanInput, PlanRequest, Target};
use redlite_engine::{CacheConfig, CachePolicy, CacheSize};
use redlite_gguf::GgufFile;
use redlite_model::KvType;

#[derive(clap::Args, Debug, Clone)]
pub struct CacheArgs {
    /// Expert cache size: bytes (4GiB, 512MiB) or min (one expert per layer). Default: every
    /// expert resident (read in place from the file's memory map).
    #[arg(long, value_name = "SIZE|min", conflicts_with = "memory")]
    pub expert_cache: Option<String>,
    /// Memory budget for the whole model (see `redlite plan`); what the plan leaves becomes the
    /// expert cache.
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// Context length the --memory plan reserves KV for.
    #[arg(long, value_name = "N", default_value_t = 4096)]
    pub memory_ctx: u64,
    /// Expert-cache eviction: lru, lfu, layer-quota.
    #[arg(long, value_name = "POLICY", default_value = "lru")]
    pub cache_policy: String,
    /// Read expert-cache misses through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered_io: bool,
    /// Load misses before computing, instead of overlapping the loads with the resident experts.
    #[arg(long)]
    pub no_overlap: bool,
    /// Do not prefetch the experts the next layer's router predicts (bounded caches).
    #[arg(long)]
    pub no_prefetch: bool,
    /// GPU: prompt tokens per forward call (at most 4096; llama.cpp's -ub). Longer calls share
    /// each expert's decoded weights among more tokens (4,096-token prefill on the H200: 3,742
    /// tok/s at 512, 10,868 at 4096) and take ≈ 1 MB of GPU memory per token. Default: 4096
    /// when every routed expert is resident on the GPU (no --memory / --expert-cache), else 512
    /// (the GPU memory goes to the expert cache).
    #[arg(long, value_name = "N")]
    pub ubatch: Option<usize>,
}

/// `--ubatch`'s default with every routed expert on the GPU, and under a memory budget.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const UBATCH_RESIDENT: usize = 4096;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub const UBATCH_BOUNDED: usize = 512;

impl CacheArgs {
    /// GPU prompt tokens per forward call: `--ubatch`, else [`UBATCH_RESIDENT`] when the routed
    /// experts are all resident and [`UBATCH_BOUNDED`] under an expert cache.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn gpu_ubatch(&self, all_resident: bool) -> usize {
        self.ubatch.unwrap_or(if all_resident {
            UBATCH_RESIDENT
        } else {
            UBATCH_BOUNDED
        })
    }

    /// The cache settings for `file`; a --memory plan reserves KV in `kv_type`.
    pub fn config(&self, file: &GgufFile, kv_type: KvType) -> Result<CacheConfig> {
        let policy: CachePolicy = self
            .cache_policy
            .parse()
            .map_err(|e| anyhow!("--cache-policy: {e}"))?;
        let size = match (&self.expert_cache, &self.memory) {
            (Some(s), _) => match Budget::parse(s).map_err(|e| anyhow!("--expert-cache: {e}"))? {
                Budget::Min => CacheSize::Min,
                Budget::Bytes(b) => CacheSize::Bytes(b),
            },
            (None, Some(m)) => {
                let input = PlanInput::from_file(file)?;
                let req = PlanRequest {
                    memory: Budget::parse(m).map_err(|e| anyhow!("--memory: {e}"))?,
                    ctx: self.memory_ctx,
                    target: Target::Cpu,
                    kv: kv_type,
                    ubatch: 64,
                };
                let p = plan(&input, req)?;
                eprintln!("{p}");
                p.cache_size()
            }
            (None, None) => CacheSize::Unbounded,
        };
        Ok(CacheConfig {
            size,
            policy,
            direct_io: !self.buffered_io,
            overlap: !self.no_overlap,
            prefetch: !self.no_prefetch,
        })
    }
}

/// What `--expert-cache` / `--memory` ask of the GPU expert cache (`--backend cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub enum GpuExperts {
    /// Every routed expert in device memory (no flag).
    All,
    /// One device slot per layer (`--expert-cache min`, `--memory min`).
    Min,
    /// Device slots of this many bytes in all (`--expert-cache SIZE`).
    Bytes(u64),
    /// Everything on the GPU within this many bytes; the slots get what the rest leaves
    /// (`--memory SIZE`).
    Budget(u64),
}

impl CacheArgs {
    /// The GPU expert cache these flags ask for; `--memory` also prints the GPU plan for `file`
    /// (its KV in `kv_type`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub fn gpu_experts(&self, file: &GgufFile, kv_type: KvType) -> Result<GpuExperts> {
        match (&self.expert_cache, &self.memory) {
            (Some(s), _) => Ok(
                match Budget::parse(s).map_err(|e| anyhow!("--expert-cache: {e}"))? {
                    Budget::Min => GpuExperts::Min,
                    Budget::Bytes(b) => GpuExperts::Bytes(b),
                },
            ),
            (None, Some(m)) => {
                let memory = Budget::parse(m).map_err(|e| anyhow!("--memory: {e}"))?;
                let req = PlanRequest {
                    memory,
                    ctx: self.memory_ctx,
                    target: Target::Cuda,
                    kv: kv_type,
                    ubatch: 64,
                };
                match plan(&PlanInput::from_file(file)?, req) {
                    Ok(p) => eprintln!("{p}"),
                    Err(e) => eprintln!("warning: the GPU plan: {e}"),
                }
                Ok(match memory {
                    Budget::Min => GpuExperts::Min,
                    Budget::Bytes(b) => GpuExperts::Budget(b),
                })
            }
            (None, None) => Ok(GpuExperts::All),
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
        cache: CacheArgs,
    }

    fn parse(args: &[&str]) -> CacheArgs {
        let argv = std::iter::once("redlite").chain(args.iter().copied());
        Cli::try_parse_from(argv).expect("valid arguments").cache
    }

    #[test]
    fn gpu_ubatch_defaults_follow_residency_and_the_flag_wins() {
        let none = parse(&[]);
        assert_eq!(none.gpu_ubatch(true), UBATCH_RESIDENT);
        assert_eq!(none.gpu_ubatch(false), UBATCH_BOUNDED);
        let given = parse(&["--ubatch", "1024"]);
        assert_eq!(given.gpu_ubatch(true), 1024);
        assert_eq!(given.gpu_ubatch(false), 1024);
    }
}
