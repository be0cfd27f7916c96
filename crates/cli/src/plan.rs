//! `redlite plan`: what is resident under a memory budget and how large the expert cache is.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use redlite_engine::planner::{plan, Budget, PlanInput, PlanRequest, Target};
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::layout::{Layout, LayoutParams, LayoutTypes, LAYOUT_NAMES};
use redlite_model::KvType;

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(
        short = 'm',
        long = "model",
        value_name = "FILE",
        required_unless_present = "layout"
    )]
    pub model: Option<PathBuf>,
    /// Plan a layout without a file instead (qwen3next-80b-a3b, qwen3next-tiny).
    #[arg(long, conflicts_with = "model")]
    pub layout: Option<String>,
    /// Expert type of --layout (default IQ2_XXS).
    #[arg(long, value_name = "TYPE", requires = "layout")]
    pub expert_type: Option<String>,
    /// Memory budget: 16GiB, 512MiB, 24GB, or min (the smallest that runs).
    #[arg(long, value_name = "SIZE")]
    pub memory: String,
    /// Context length in positions.
    #[arg(long, default_value_t = 4096)]
    pub ctx: u64,
    /// Which memory the budget is: cpu (host RAM) or cuda (GPU memory).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// KV-cache element type: f32, f16, q8_0 (default: f32 for cpu, f16 for cuda, as
    /// `generate` and `bench` take them).
    #[arg(long)]
    pub kv_type: Option<String>,
    /// Tokens per forward pass counted in the scratch.
    #[arg(long, default_value_t = 64)]
    pub ubatch: u64,
}

pub fn run(args: Args) -> Result<()> {
    let input = match (&args.model, &args.layout) {
        (Some(path), _) => {
            let file = GgufFile::open(path).context("opening the model file")?;
            PlanInput::from_file(&file).with_context(|| format!("sizing {}", path.display()))?
        }
        (None, Some(name)) => {
            let params = LayoutParams::by_name(name).ok_or_else(|| {
                anyhow!(
                    "unknown layout '{name}' (known: {})",
                    LAYOUT_NAMES.join(", ")
                )
            })?;
            let mut types = LayoutTypes::default();
            if let Some(t) = &args.expert_type {
                types.experts =
                    GgmlType::from_name(t).ok_or_else(|| anyhow!("unknown type '{t}'"))?;
            }
            PlanInput::from_layout(&Layout::new(params, types)?)?
        }
        (None, None) => bail!("give -m FILE or --layout NAME"),
    };
    let target = Target::parse(&args.backend).map_err(|e| anyhow!("--backend: {e}"))?;
    let kv = match &args.kv_type {
        Some(t) => t.parse::<KvType>().map_err(|e| anyhow!("--kv-type: {e}"))?,
        None if target == Target::Cuda => KvType::F16,
        None => KvType::F32,
    };
    let req = PlanRequest {
        memory: Budget::parse(&args.memory).map_err(|e| anyhow!("--memory: {e}"))?,
        ctx: args.ctx,
        target,
        kv,
        ubatch: args.ubatch.max(1),
    };
    let p = plan(&input, req)?;
    println!("{p}");
    Ok(())
}
