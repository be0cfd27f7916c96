//! `redlite convert`: a Hugging Face Qwen3-Next checkpoint folder → GGUF (llama.cpp layout).

use std::path::PathBuf;

use anyhow::Context;
use redlite_convert::{convert, ConvertOptions, OutType};

#[derive(clap::Args)]
pub struct Args {
    /// Folder with config.json, *.safetensors, tokenizer.json and tokenizer_config.json.
    pub hf_dir: PathBuf,
    /// The GGUF file to write.
    pub out: PathBuf,
    /// Type of the weight matrices (norms, routers, conv and other small tensors stay F32).
    #[arg(long = "type", default_value = "f16")]
    pub out_type: OutType,
    /// general.name (default: the folder's name).
    #[arg(long)]
    pub name: Option<String>,
    /// tokenizer.ggml.pre.
    #[arg(long, default_value = "qwen2")]
    pub pre: String,
    /// Leave out the MTP block even when the checkpoint has one.
    #[arg(long)]
    pub no_mtp: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let opts = ConvertOptions {
        out_type: a.out_type,
        name: a.name,
        tokenizer_pre: a.pre,
        include_mtp: !a.no_mtp,
    };
    let r = convert(&a.hf_dir, &a.out, &opts)
        .with_context(|| format!("converting {} to {}", a.hf_dir.display(), a.out.display()))?;
    let types: Vec<String> = r
        .type_counts
        .iter()
        .map(|(t, n)| format!("{t} {n}"))
        .collect();
    println!(
        "wrote {}: {} bytes, {} tensors ({}), {} blocks ({} MTP)",
        a.out.display(),
        r.bytes,
        r.tensors,
        types.join(", "),
        r.block_count,
        r.nextn_layers
    );
    Ok(())
}
