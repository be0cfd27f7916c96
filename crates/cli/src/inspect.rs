//! `redlite inspect`.

#[derive(clap::Args)]
pub struct Args {
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    pub model: std::path::PathBuf,
}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`redlite inspect` is not implemented yet")
}
