//! `redlite quantize IN OUT (--type T | --recipe NAME) [--imatrix FILE]`: write a quantized copy
//! of a Qwen3-Next GGUF file, each tensor's type chosen by the recipe (see
//! `redlite_engine::quantize` for the rules), rows quantized in parallel.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use redlite_engine::imatrix::Imatrix;
use redlite_engine::quantize::{plan, quantize_file, QuantizeOptions, Recipe};
use redlite_gguf::GgufFile;

#[derive(clap::Args)]
pub struct Args {
    /// Input GGUF file (F32, F16 or BF16 weights).
    pub input: PathBuf,
    /// Output GGUF file.
    pub output: PathBuf,
    /// One type for every quantized weight: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS,
    /// IQ2_XXS or IQ1_M.
    #[arg(long = "type", conflicts_with = "recipe")]
    pub ty: Option<String>,
    /// A mix: cf2 (Q4_K dense, IQ2_XXS routed experts, Q6_K head) or q4_k_m (llama.cpp's).
    #[arg(long)]
    pub recipe: Option<String>,
    /// Importance matrix (llama-imatrix's GGUF format, or `redlite imatrix`'s output).
    #[arg(long)]
    pub imatrix: Option<PathBuf>,
    /// Worker threads (0: one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Quantize weights that are already quantized (dequantized first; quality suffers).
    #[arg(long)]
    pub allow_requantize: bool,
    /// Print the plan (every tensor's type) without writing anything.
    #[arg(long)]
    pub dry_run: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    let recipe = match (&args.ty, &args.recipe) {
        (Some(t), None) => Recipe::whole(t)?,
        (None, Some(r)) => Recipe::named(r)?,
        _ => bail!("give either --type T or --recipe NAME"),
    };
    let imatrix = args
        .imatrix
        .as_ref()
        .map(|p| Imatrix::load(p).with_context(|| format!("reading imatrix {}", p.display())))
        .transpose()?;
    let file = GgufFile::open(&args.input).context("opening the input file")?;
    let choices = plan(&file, recipe, imatrix.as_ref(), args.allow_requantize)
        .with_context(|| format!("planning {} with {}", args.input.display(), recipe.label()))?;
    for c in choices.iter().filter(|c| c.note.is_some() || args.dry_run) {
        let note = c.note.as_deref().unwrap_or("");
        let im = if c.with_imatrix { " (imatrix)" } else { "" };
        eprintln!(
            "{:40} {:>8} -> {:8}{im} {note}",
            c.name,
            c.from.name(),
            c.to.name()
        );
    }
    if args.dry_run {
        return Ok(());
    }
    drop(file);

    let total: u64 = choices.iter().map(|c| c.dims.iter().product::<u64>()).sum();
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {percent:>3}% {msg:40} {elapsed} (eta {eta})")
            .context("progress bar template")?,
    );
    let start = Instant::now();
    let opts = QuantizeOptions {
        recipe,
        imatrix: imatrix.as_ref(),
        imatrix_path: args.imatrix.as_ref().map(|p| p.display().to_string()),
        threads: args.threads,
        allow_requantize: args.allow_requantize,
    };
    let report = quantize_file(&args.input, &args.output, &opts, |name, n| {
        bar.set_message(name.to_string());
        bar.inc(n);
    })
    .with_context(|| format!("quantizing {}", args.input.display()))?;
    bar.finish_and_clear();

    let mut counts = std::collections::BTreeMap::new();
    for c in &report.tensors {
        *counts.entry(c.to.name()).or_insert(0usize) += 1;
    }
    let mix: Vec<String> = counts.iter().map(|(t, n)| format!("{t} {n}")).collect();
    eprintln!(
        "wrote {} ({}, {} tensors: {}): {:.1} MB -> {:.1} MB in {:.1} s",
        args.output.display(),
        recipe.label(),
        report.tensors.len(),
        mix.join(", "),
        report.bytes_in as f64 / 1e6,
        report.bytes_out as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
