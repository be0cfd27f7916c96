//! `redlite perplexity`: perplexity of a text by llama.cpp's method (non-overlapping chunks of
//! `--ctx` tokens, each from an empty state, the second half of each chunk scored), printed the
//! way `llama-perplexity` prints it so the figures compare directly.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use redlite_engine::perplexity::{perplexity, PerplexityOptions, PerplexityReport};
use redlite_engine::{load_model_from, with_model, BackendChoice};
use redlite_gguf::GgufFile;
use redlite_tokenizer::tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Text file to score.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Tokens per chunk.
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks (default: every full chunk).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Compute backend: oracle (f32 reference) or cpu.
    #[arg(long, default_value = "oracle")]
    pub backend: String,
    /// Threads: chunks run side by side on the oracle backend; the CPU backend's thread pool
    /// otherwise (0: one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub kv: crate::kv_args::KvArgs,
    /// Print the result as one JSON object instead of llama.cpp-style text.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    let choice = BackendChoice::parse(&args.backend)?;
    if args.chunks == Some(0) {
        anyhow::bail!("--chunks must be at least 1 (leave it out to score every full chunk)");
    }
    let file = Arc::new(GgufFile::open(&args.model).context("opening the model file")?);
    let tokenizer = Tokenizer::from_gguf(&file).context("building the tokenizer")?;
    let mut text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    // llama.cpp's `-f` drops one trailing newline from the file.
    if text.ends_with('\n') {
        text.pop();
    }
    // llama-perplexity tokenizes with add_special = true and parse_special = false.
    let mut tokens = Vec::new();
    let bos = if tokenizer.add_bos_token() {
        tokenizer.bos_token_id()
    } else {
        None
    };
    tokens.extend(bos);
    tokens.extend(
        tokenizer
            .encode(&text, false)
            .context("tokenizing the text")?,
    );
    if args.ctx < 4 {
        bail!("--ctx must be at least 4");
    }

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads == 0 {
        cores
    } else {
        args.threads
    };
    // The oracle is single-threaded: run chunks side by side instead. Other backends thread
    // inside each chunk.
    let (parallel_chunks, backend_threads) = match choice {
        BackendChoice::Oracle => (threads, 1),
        _ => (1, args.threads),
    };
    let mut model = load_model_from(file.clone(), choice, backend_threads)
        .with_context(|| format!("loading {}", args.model.display()))?;
    args.kv.apply(&mut model)?;

    let opts = PerplexityOptions {
        ctx: args.ctx,
        max_chunks: args.chunks,
        bos,
        parallel_chunks,
    };
    let n_chunks = redlite_engine::perplexity::chunk_count(tokens.len(), args.ctx, args.chunks);
    if !args.json {
        eprintln!(
            "perplexity: {} tokens, {} chunks of {} (scoring {} tokens each), backend {}",
            tokens.len(),
            n_chunks,
            args.ctx,
            args.ctx - args.ctx / 2 - 1,
            args.backend
        );
    }
    let bar = if args.quiet || args.json {
        ProgressBar::hidden()
    } else {
        let b = ProgressBar::new(n_chunks as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} chunks  {msg}  [{elapsed} < {eta}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    };
    let t0 = Instant::now();
    let report: PerplexityReport = with_model!(&model, m => perplexity(m, &tokens, &opts, |c| {
        bar.inc(1);
        bar.set_message(format!("PPL {:.4}", c.running.ppl()));
    }))?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();

    if args.json {
        let out = serde_json::json!({
            "model": args.model.display().to_string(),
            "file": args.file.display().to_string(),
            "backend": args.backend,
            "n_tokens": report.n_tokens,
            "ctx": report.ctx,
            "chunks": report.chunks,
            "scored_tokens": report.stats.count,
            "mean_nll": report.stats.mean_nll(),
            "ppl": report.ppl(),
            "ppl_stderr": report.ppl_stderr(),
            "running_ppl": report.running_ppl,
            "seconds": secs,
        });
        println!("{out}");
    } else {
        println!("{}", report.running_line());
        match report.ppl_stderr() {
            Some(e) => println!("Final estimate: PPL = {:.4} +/- {:.5}", report.ppl(), e),
            None => println!("Final estimate: PPL = {:.4}", report.ppl()),
        }
        eprintln!(
            "{} chunks, {} scored tokens, {:.1} s ({:.0} tok/s evaluated)",
            report.chunks,
            report.stats.count,
            secs,
            (report.chunks * report.ctx) as f64 / secs.max(1e-9)
        );
    }
    Ok(())
}
