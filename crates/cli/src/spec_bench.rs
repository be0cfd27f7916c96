//! `redlite spec-bench`: speculative-decoding benchmarks.
//!
//! * `redlite spec-bench verify -m MODEL --backend cpu --ks 1,3,7,15`: time of a K+1-row verify
//!   pass against a 1-row decode step.
//! * `redlite spec-bench rewrite -m MODEL -f FILE`: ask the model to rewrite a file with a small
//!   edit and let it write the whole file back (the file's tokens + 64 at most, stopping at
//!   end-of-sequence); decode tok/s plainly and with each speculation mode (outputs checked
//!   identical), and how much of the file the answer reproduces. `-n N` generates a fixed N
//!   tokens instead (the first N of the answer; with `--ignore-eos`, the older benchmark).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use redlite_engine::spec_bench::{
    file_rewrite, reproduction, rewrite_budget, rewrite_prompt, verify_cost, RewriteRun,
    REWRITE_MARGIN,
};
use redlite_engine::speculative::SpecMode;
use redlite_engine::{load_model_from, with_model, BackendChoice};
use redlite_gguf::GgufFile;
use redlite_tokenizer::tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub which: Which,
}

#[derive(clap::Subcommand)]
pub enum Which {
    /// K+1-row verify pass vs 1-row decode step.
    Verify(VerifyArgs),
    /// File rewrite: decode speed with and without speculation.
    Rewrite(RewriteArgs),
}

#[derive(clap::Args)]
pub struct VerifyArgs {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Draft lengths K to time (the pass has K+1 rows).
    #[arg(long, value_delimiter = ',', default_value = "1,3,7,15")]
    pub ks: Vec<usize>,
    /// Context tokens before the measured passes.
    #[arg(long, default_value_t = 16)]
    pub context: usize,
    /// Timed repetitions per K (medians are reported; one more untimed warm-up).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Compute backend: cpu, oracle or cuda (the device-resident GPU model).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// CPU threads (0: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub cache: crate::cache_args::CacheArgs,
    #[command(flatten)]
    pub kv: crate::kv_args::KvArgs,
}

#[derive(clap::Args)]
pub struct RewriteArgs {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// The source file to rewrite.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Use only the first N lines of the file.
    #[arg(long)]
    pub lines: Option<usize>,
    /// The edit to ask for.
    #[arg(
        long,
        default_value = "Rewrite this file with one change: add a comment line at the top saying it was reviewed."
    )]
    pub edit: String,
    /// Tokens to generate at most. Default: the whole file back (its token count + 64,
    /// stopping at end-of-sequence); a number gives the fixed-length benchmark (the first N
    /// tokens of the answer, usually with --ignore-eos).
    #[arg(short = 'n', long = "n-predict")]
    pub n: Option<usize>,
    /// Speculation modes to compare with plain decoding.
    #[arg(long, value_delimiter = ',', default_value = "lookup,mtp,both")]
    pub modes: Vec<String>,
    #[command(flatten)]
    pub spec_args: crate::spec_args::SpecArgs,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Compute backend: cpu, oracle or cuda (the device-resident GPU model, every expert
    /// resident; greedy MTP drafts from the GPU's MTP block).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// CPU threads (0: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Rounds of (plain, then each mode) in turn: tok/s are the medians over the rounds and each
    /// speed-up the median of the rounds' own ratios (a single run moves by 15 % on a shared
    /// machine).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
}

pub fn run(args: Args) -> Result<()> {
    match args.which {
        Which::Verify(a) => run_verify(a),
        Which::Rewrite(a) => run_rewrite(a),
    }
}

fn open(path: &PathBuf) -> Result<Arc<GgufFile>> {
    Ok(Arc::new(
        GgufFile::open(path).context("opening the model file")?,
    ))
}

fn run_verify(args: VerifyArgs) -> Result<()> {
    if args.ks.is_empty() || args.reps == 0 {
        bail!("give at least one K and one repetition");
    }
    if args.backend == "cuda" {
        args.kv.require_cuda()?;
        return run_verify_cuda(&args);
    }
    let choice = BackendChoice::parse(&args.backend)?;
    let file = open(&args.model)?;
    let mut model = load_model_from(file, choice, args.threads)
        .with_context(|| format!("loading {}", args.model.display()))?;
    args.kv.apply(&mut model)?;
    // Fixed, spread-out token ids (the vocabulary of any Qwen3 file holds them).
    let tokens: Vec<u32> = (0..64u32).map(|i| 100 + i * 37).collect();
    println!(
        "verify cost: {} (backend {}), context {} tokens, median of {} reps",
        args.model.display(),
        args.backend,
        args.context,
        args.reps
    );
    println!("| K | rows | verify ms | 1-row decode ms | ratio | per row | untraced ms | untraced ratio |");
    println!("|---|------|-----------|-----------------|-------|---------|-------------|----------------|");
    with_model!(&model, m => verify_cost(m, &tokens, args.context, &args.ks, args.reps, |r| {
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2}x | {:.2}x | {:.1} | {:.2}x |",
            r.k,
            r.k + 1,
            r.verify.as_secs_f64() * 1e3,
            r.decode.as_secs_f64() * 1e3,
            r.ratio(),
            r.ratio() / (r.k + 1) as f64,
            r.untraced.as_secs_f64() * 1e3,
            r.untraced.as_secs_f64() / r.decode.as_secs_f64().max(1e-12)
        );
    }))?;
    Ok(())
}

/// The verify-cost table on the GPU (`CudaModel::verify_greedy` of K+1 rows against one decode
/// step replayed from its graph).
fn run_verify_cuda(args: &VerifyArgs) -> Result<()> {
    let file = open(&args.model)?;
    let rows = crate::cuda_cmd::verify_cost(
        file,
        args.context,
        &args.ks,
        args.reps,
        args.kv.gpu(&args.cache),
    )?;
    println!(
        "verify cost: {} (backend cuda), context {} tokens, median of {} reps",
        args.model.display(),
        args.context,
        args.reps
    );
    println!("| K | rows | verify ms | 1-row decode ms | ratio | per row |");
    println!("|---|------|-----------|-----------------|-------|---------|");
    for r in rows {
        let ratio = r.verify_ms / r.decode_ms.max(1e-9);
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.2}x | {:.2}x |",
            r.k,
            r.k + 1,
            r.verify_ms,
            r.decode_ms,
            ratio,
            ratio / (r.k + 1) as f64
        );
    }
    Ok(())
}

fn run_rewrite(args: RewriteArgs) -> Result<()> {
    let cuda = args.backend == "cuda";
    let file = open(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(&file).context("building the tokenizer")?;
    let model = if cuda {
        None
    } else {
        let choice = BackendChoice::parse(&args.backend)?;
        Some(
            load_model_from(file.clone(), choice, args.threads)
                .with_context(|| format!("loading {}", args.model.display()))?,
        )
    };
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let text = match args.lines {
        Some(n) => text.lines().take(n).collect::<Vec<_>>().join("\n"),
        None => text,
    };
    let prompt = tokenizer.encode(&rewrite_prompt(&text, &args.edit), false)?;
    let file_ids = tokenizer.encode(&text, false)?;
    let max_tokens = args.n.unwrap_or_else(|| rewrite_budget(file_ids.len()));
    let modes = args
        .modes
        .iter()
        .map(|m| SpecMode::parse(m))
        .collect::<Result<Vec<_>, _>>()?;
    let spec = args.spec_args.config(SpecMode::Off);
    let stop_ids = if args.ignore_eos {
        Vec::new()
    } else {
        tokenizer.stop_token_ids().to_vec()
    };
    let length = match args.n {
        Some(n) => format!("a fixed {n} tokens"),
        None => format!(
            "the whole file ({} tokens + {REWRITE_MARGIN}: up to {max_tokens})",
            file_ids.len()
        ),
    };
    println!(
        "file rewrite: {} on {} (backend {}), prompt {} tokens, generating {length}{}, greedy",
        args.file.display(),
        args.model.display(),
        args.backend,
        prompt.len(),
        if stop_ids.is_empty() {
            ""
        } else {
            " or to end-of-sequence"
        },
    );
    let rounds = args.rounds.max(1);
    if rounds > 1 {
        println!("{rounds} rounds, each plain decoding then every mode in turn: medians");
    }
    // Every round's runs (plain first, then the modes in order).
    let mut all: Vec<Vec<RewriteRun>> = Vec::with_capacity(rounds);
    for round in 0..rounds {
        if rounds > 1 {
            eprintln!("round {}/{rounds} ...", round + 1);
        }
        let runs = match &model {
            Some(model) => {
                with_model!(model, m => file_rewrite(m, &prompt, max_tokens, &stop_ids, &modes, &spec, |_| {}))?
            }
            None => cuda_rewrite(&file, &prompt, max_tokens, &stop_ids, &modes, &spec)?,
        };
        all.push(runs);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("| spec | tokens | decode tok/s | speed-up | passes | acceptance | mean accepted | tokens/pass | same output |{}", if rounds > 1 { " rounds (tok/s) |" } else { "" });
    println!("|------|--------|--------------|----------|--------|------------|---------------|-------------|-------------|{}", if rounds > 1 { "----------------|" } else { "" });
    let runs = all.last().cloned().unwrap_or_default();
    for (i, r) in runs.iter().enumerate() {
        let tps: Vec<f64> = all.iter().map(|rs| rs[i].decode_tok_per_s).collect();
        let ratios: Vec<f64> = all
            .iter()
            .map(|rs| rs[i].decode_tok_per_s / rs[0].decode_tok_per_s.max(1e-12))
            .collect();
        let identical = all.iter().all(|rs| rs[i].identical);
        let (passes, acc, mean, tpp) = match &r.spec {
            Some(s) => (
                s.forward_passes.to_string(),
                format!("{:.1}%", 100.0 * s.total().acceptance_rate()),
                format!("{:.2}", s.total().mean_accepted()),
                format!("{:.2}", s.tokens_per_pass()),
            ),
            None => (
                r.generated.saturating_sub(1).to_string(),
                "-".into(),
                "-".into(),
                "1.00".into(),
            ),
        };
        let per_round = if rounds > 1 {
            let v: Vec<String> = tps.iter().map(|t| format!("{t:.0}")).collect();
            format!(" {} |", v.join(" / "))
        } else {
            String::new()
        };
        println!(
            "| {:?} | {} | {:.2} | {:.2}x | {} | {} | {} | {} | {} |{per_round}",
            r.mode,
            r.generated,
            median(tps),
            median(ratios),
            passes,
            acc,
            mean,
            tpp,
            if identical { "yes" } else { "NO" }
        );
    }
    if let Some(plain) = runs.first() {
        let answer = tokenizer.decode(&plain.tokens, true)?;
        let r = reproduction(&file_ids, &plain.tokens, &text, &answer);
        println!(
            "answer vs file: {} generated tokens; {} of the file's {} tokens reproduced in order, longest verbatim copy {} tokens; {} of its {} non-blank lines in order",
            r.generated, r.in_order, r.file_tokens, r.longest_copy, r.lines, r.file_lines
        );
    }
    if all.iter().flatten().any(|r| !r.identical) {
        bail!("a speculative run's output differs from plain decoding");
    }
    Ok(())
}

/// One round of the rewrite on the GPU (`CudaModel`, every expert resident): plain greedy
/// decoding, then each mode through `generate --spec lookup`'s path (`CudaModel::verify_greedy`
/// and `keep`, MTP drafts by `CudaModel::mtp_draft`).
fn cuda_rewrite(
    file: &Arc<GgufFile>,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    modes: &[SpecMode],
    spec: &redlite_engine::speculative::SpecConfig,
) -> Result<Vec<RewriteRun>> {
    use clap::Parser;
    use redlite_engine::sampler::{Sampler, SamplerConfig};
    use redlite_engine::GenerateOptions;
    #[derive(Parser)]
    struct Defaults {
        #[command(flatten)]
        cache: crate::cache_args::CacheArgs,
    }
    let cache = Defaults::try_parse_from(["redlite"])
        .context("default expert-cache arguments")?
        .cache;
    let opts = GenerateOptions {
        max_tokens,
        stop_ids: stop_ids.to_vec(),
    };
    let (base, stats) = crate::cuda_cmd::generate(
        file.clone(),
        prompt,
        &mut Sampler::new(SamplerConfig::greedy()),
        &opts,
        crate::cuda_cmd::GpuMem {
            cache: &cache,
            kv: redlite_model::KvType::F32,
        },
        |_| true,
    )?;
    let mut out = vec![RewriteRun::plain(base.clone(), &stats)];
    // As on the CPU: the MTP modes only on a file with an MTP block.
    let config = redlite_model::Config::from_gguf(file)?;
    let has_mtp = redlite_model::weights::has_mtp_block(file, &config);
    for &mode in modes.iter().filter(|m| **m != SpecMode::Off) {
        if matches!(mode, SpecMode::Mtp | SpecMode::Both) && !has_mtp {
            continue;
        }
        let cfg = redlite_engine::speculative::SpecConfig {
            mode,
            ..spec.clone()
        };
        let (ids, stats, s) = crate::cuda_cmd::generate_speculative(
            file.clone(),
            prompt,
            &mut Sampler::new(SamplerConfig::greedy()),
            &opts,
            &cfg,
            crate::cuda_cmd::GpuMem {
                cache: &cache,
                kv: redlite_model::KvType::F32,
            },
            |_| true,
        )?;
        out.push(RewriteRun::speculative(mode, ids, &stats, s, &base));
    }
    Ok(out)
}
