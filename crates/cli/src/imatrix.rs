//! `redlite imatrix`: an importance matrix (llama-imatrix's GGUF format) from a text, computed
//! with our forward pass: the mean squared input of every matrix multiplication, per expert for
//! the routed experts. `--compare FILE` prints how far the result is from another imatrix.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use redlite_cpu::CpuBackend;
use redlite_engine::imatrix::{collect, compare, CollectOptions, Imatrix};
use redlite_engine::BackendChoice;
use redlite_gguf::GgufFile;
use redlite_model::Oracle;
use redlite_tokenizer::tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF, unquantized or quantized).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Text to run through the model.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Output file (GGUF imatrix).
    #[arg(short = 'o', long = "output", default_value = "imatrix.gguf")]
    pub output: PathBuf,
    /// Tokens per chunk (each chunk runs from an empty state).
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Use at most this many chunks (default: every full chunk).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Compute backend: oracle (f32 reference) or cpu.
    #[arg(long, default_value = "oracle")]
    pub backend: String,
    /// CPU backend threads (0: one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Compare the result with this imatrix file and print the differences.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    let choice = BackendChoice::parse(&args.backend)?;
    if args.ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    let file = Arc::new(GgufFile::open(&args.model).context("opening the model file")?);
    let tokenizer = Tokenizer::from_gguf(&file).context("building the tokenizer")?;
    let mut text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    // llama.cpp's `-f` drops one trailing newline.
    if text.ends_with('\n') {
        text.pop();
    }
    let bos = if tokenizer.add_bos_token() {
        tokenizer.bos_token_id()
    } else {
        None
    };
    let mut tokens: Vec<u32> = bos.into_iter().collect();
    tokens.extend(
        tokenizer
            .encode(&text, false)
            .context("tokenizing the text")?,
    );
    let opts = CollectOptions {
        ctx: args.ctx,
        max_chunks: args.chunks,
        bos,
        dataset: args.file.display().to_string(),
    };
    let total = (tokens.len() / args.ctx).min(args.chunks.unwrap_or(usize::MAX));
    eprintln!(
        "{} tokens, {total} chunks of {} on the {} backend",
        tokens.len(),
        args.ctx,
        args.backend
    );
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} chunks {elapsed} (eta {eta})")
            .context("progress bar template")?,
    );
    let start = Instant::now();
    let on_chunk = |done: usize, _total: usize| bar.set_position(done as u64);
    let m = match choice {
        BackendChoice::Oracle => collect(file, Oracle, &tokens, &opts, on_chunk),
        BackendChoice::Cpu => collect(
            file,
            CpuBackend::try_with_threads_and_cache(args.threads, Default::default())?,
            &tokens,
            &opts,
            on_chunk,
        ),
    }
    .context("computing the importance matrix")?;
    bar.finish_and_clear();
    m.save(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    eprintln!(
        "wrote {} entries over {} chunks to {} in {:.1} s",
        m.entries.len(),
        m.chunk_count,
        args.output.display(),
        start.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.compare {
        let reference =
            Imatrix::load(path).with_context(|| format!("reading {}", path.display()))?;
        let d = compare(&m, &reference);
        println!(
            "compared {} entries with {}: mean relative L2 difference of the importance {:.3e}, worst {}",
            d.compared,
            path.display(),
            d.mean_rel_l2,
            d.worst
                .map(|(n, v)| format!("{v:.3e} ({n})"))
                .unwrap_or_else(|| "-".into())
        );
        println!(
            "largest relative count difference {:.3e}; entries in only one file: {}",
            d.max_count_rel,
            if d.unmatched.is_empty() {
                "none".to_string()
            } else {
                d.unmatched.join(", ")
            }
        );
    }
    Ok(())
}
