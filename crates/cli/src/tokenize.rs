//! `redlite tokenize` and `redlite detokenize`.

#[derive(clap::Args)]
pub struct TokenizeArgs {
    /// Model file (GGUF) whose tokenizer to use.
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
}

#[derive(clap::Args)]
pub struct DetokenizeArgs {
    /// Model file (GGUF) whose tokenizer to use.
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
}

pub fn run_tokenize(_args: TokenizeArgs) -> anyhow::Result<()> {
    anyhow::bail!("`redlite tokenize` is not implemented yet")
}

pub fn run_detokenize(_args: DetokenizeArgs) -> anyhow::Result<()> {
    anyhow::bail!("`redlite detokenize` is not implemented yet")
}
