//! `redlite logits`: the logits of every position of a token sequence, as row-major little-endian
//! f32 `[n_ids, vocab]` — the interface parity tools and checks use.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use redlite_model::{Mode, Model};

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
    /// Compute backend.
    #[arg(long, default_value = "oracle")]
    pub backend: String,
    /// `prefill` runs the ids as one prompt (chunked DeltaNet); `step` feeds them one at a time.
    #[arg(long, default_value = "prefill", value_parser = ["prefill", "step"])]
    pub mode: String,
}

pub fn run(args: Args) -> Result<()> {
    if args.backend != "oracle" {
        bail!("unknown backend '{}' (available: oracle)", args.backend);
    }
    let model =
        Model::load(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let mut state = model.new_state();
    let logits = if args.mode == "step" {
        let mut rows = Vec::with_capacity(args.ids.len());
        for &id in &args.ids {
            rows.extend(model.forward(&mut state, &[id], Mode::Step)?);
        }
        rows
    } else {
        model.forward(&mut state, &args.ids, Mode::Prefill)?
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
        model.config.vocab,
        args.out.display()
    );
    Ok(())
}
