//! `redlite logits`: the logits of every position of a token sequence, as row-major little-endian
//! f32 `[n_ids, vocab]` — the interface parity tools and checks use.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use redlite_engine::{load_model_with_cache, with_model, BackendChoice};
use redlite_model::Mode;

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
    /// Output file.
    #[arg(long)]
    pub out: PathBuf,
    /// Compute backend: cpu (fast, quantized kernels), oracle (f32 reference) or cuda (the
    /// device-resident GPU model; needs the `cuda` feature and a GPU).
    #[arg(long, default_value = "oracle")]
    pub backend: String,
    /// CPU threads (0: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub cache: crate::cache_args::CacheArgs,
    #[command(flatten)]
    pub kv: crate::kv_args::KvArgs,
    /// `prefill` runs the ids as one prompt (chunked DeltaNet); `step` feeds them one at a time.
    #[arg(long, default_value = "prefill", value_parser = ["prefill", "step"])]
    pub mode: String,
}

pub fn run(args: Args) -> Result<()> {
    let backend = crate::cuda_cmd::or_cpu(&args.backend);
    let (logits, vocab) = if backend == "cuda" {
        args.kv.require_cuda()?;
        let file = std::sync::Arc::new(
            redlite_gguf::GgufFile::open(&args.model).context("opening the model file")?,
        );
        let rows = crate::cuda_cmd::logits(
            file,
            &args.ids,
            args.mode == "step",
            args.kv.gpu(&args.cache),
        )?;
        let vocab = rows.first().map_or(0, Vec::len);
        (rows, vocab)
    } else {
        let choice = BackendChoice::parse(backend)?;
        let file = std::sync::Arc::new(
            redlite_gguf::GgufFile::open(&args.model).context("opening the model file")?,
        );
        let cache = args.cache.config(&file, args.kv.cpu())?;
        let mut model = load_model_with_cache(file, choice, args.threads, cache)
            .with_context(|| format!("loading {}", args.model.display()))?;
        args.kv.apply(&mut model)?;
        with_model!(&model, m => {
            let mut state = m.new_state();
            let rows = if args.mode == "step" {
                let mut rows = Vec::with_capacity(args.ids.len());
                for &id in &args.ids {
                    rows.extend(m.forward(&mut state, &[id], Mode::Step)?);
                }
                rows
            } else {
                m.forward(&mut state, &args.ids, Mode::Prefill)?
            };
            (rows, m.config.vocab)
        })
    };
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&args.out)
            .with_context(|| format!("creating {}", args.out.display()))?,
    );
    for row in &logits {
        for v in row {
            out.write_all(&v.to_le_bytes())?;
        }
    }
    out.flush()
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "wrote {} × {} logits to {}",
        logits.len(),
        vocab,
        args.out.display()
    );
    Ok(())
}
