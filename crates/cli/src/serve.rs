//! `redlite serve`: the HTTP server (OpenAI-compatible API) for a model file.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use redlite_engine::default_model::resolve_model;
use redlite_engine::speculative::SpecMode;
use redlite_engine::{load_model_with_cache, with_model, BackendChoice};
use redlite_server::ServerOptions;

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF); default: the shipped demo model (models/redlite-demo.gguf) or $REDLITE_MODEL.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on API requests.
    #[arg(long = "api-key")]
    pub api_key: Option<String>,
    /// Context size in tokens (default: the model's, at most 32768).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Model id reported by the API.
    #[arg(long)]
    pub alias: Option<String>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body: usize,
    /// Conversations kept in the prefix cache.
    #[arg(long, default_value_t = 4)]
    pub cache_entries: usize,
    /// Prefix cache memory budget in MiB.
    #[arg(long, default_value_t = 8192)]
    pub cache_mb: usize,
    /// Checkpoint spacing in tokens inside a conversation (a multiple of 64).
    #[arg(long, default_value_t = 4096)]
    pub checkpoint_interval: usize,
    /// Replay the replies in this JSON file (an array of strings) instead of sampling, one per
    /// request (testing).
    #[arg(long)]
    pub replay: Option<PathBuf>,
    /// Keep prefix states in this directory across restarts (state files).
    #[arg(long = "state-dir")]
    pub state_dir: Option<PathBuf>,
    /// Compute backend: cpu (fast, quantized kernels) or oracle (f32 reference).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// CPU threads (0: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub cache: crate::cache_args::CacheArgs,
    #[command(flatten)]
    pub kv: crate::kv_args::KvArgs,
    /// Speculative decoding: off, lookup (prompt n-gram lookup), mtp (the model's MTP head), or
    /// both (lookup when it matches, MTP otherwise); a request's `spec` field overrides it. The
    /// replies are the same as without.
    #[arg(long, default_value = "off")]
    pub spec: String,
    #[command(flatten)]
    pub spec_args: crate::spec_args::SpecArgs,
}

pub fn run(args: Args) -> Result<()> {
    let choice = BackendChoice::parse(&args.backend)?;
    check_options(&args)?;
    let model_path = resolve_model(args.model.as_deref()).map_err(anyhow::Error::msg)?;
    let replay = match &args.replay {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str::<Vec<String>>(&text)
                .with_context(|| format!("{}: expected a JSON array of strings", p.display()))?
        }
        None => Vec::new(),
    };
    let file = std::sync::Arc::new(
        redlite_gguf::GgufFile::open(&model_path).context("opening the model file")?,
    );
    if let Some(ctx) = args.ctx {
        let trained = redlite_model::Config::from_gguf(&file)
            .context("reading the model configuration")?
            .context_length;
        if ctx > trained {
            bail!("--ctx {ctx} exceeds the model's context length of {trained} tokens");
        }
    }
    let cache = args.cache.config(&file, args.kv.cpu())?;
    let mut model = load_model_with_cache(file, choice, args.threads, cache)
        .with_context(|| format!("loading {}", model_path.display()))?;
    args.kv.apply(&mut model)?;
    let opts = ServerOptions {
        host: args.host,
        port: args.port,
        api_key: args.api_key,
        ctx: args.ctx,
        model_name: args.alias,
        max_body_bytes: args.max_body,
        cache_entries: args.cache_entries,
        cache_bytes: args.cache_mb << 20,
        checkpoint_interval: args.checkpoint_interval,
        replay,
        state_dir: args.state_dir,
        spec: args.spec_args.config(SpecMode::parse(&args.spec)?),
        ..ServerOptions::default()
    };
    with_model!(model, m => redlite_server::run_blocking(m, opts))
}

/// The options that can be checked before the model loads: a usable context size, checkpoint
/// spacing, API key and state directory (created here when missing, so that a bad path is
/// reported with the option's name).
fn check_options(args: &Args) -> Result<()> {
    if let Some(ctx) = args.ctx {
        if ctx < 2 {
            bail!("--ctx must be at least 2 tokens (a prompt token and a reply), got {ctx}");
        }
    }
    if args.checkpoint_interval == 0 || !args.checkpoint_interval.is_multiple_of(64) {
        bail!(
            "--checkpoint-interval must be a positive multiple of 64, got {}",
            args.checkpoint_interval
        );
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        bail!("--api-key is empty");
    }
    if let Some(dir) = &args.state_dir {
        if dir.exists() && !dir.is_dir() {
            bail!("--state-dir {}: not a directory", dir.display());
        }
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--state-dir {}: cannot create it", dir.display()))?;
    }
    Ok(())
}
