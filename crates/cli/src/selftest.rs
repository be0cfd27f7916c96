//! `redlite selftest`: every fast kernel against the oracle on fresh random data, for every type
//! and shape class. The same checks run in `cargo test`.

use anyhow::{bail, Result};

#[derive(clap::Args)]
pub struct Args {
    /// Backend whose kernels to check.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Print every comparison, not only failures and the summary.
    #[arg(short, long)]
    pub verbose: bool,
    /// cuda: fixture folder for the GPU parity run (logits/index.json, logits/*__exact.bin,
    /// models/*.gguf).
    #[arg(long)]
    pub fixtures: Option<std::path::PathBuf>,
    /// cuda: seed of the random test data (default: from the clock, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// cuda: skip the CPU oracle in the parity run (no argmax check, no oracle KL).
    #[arg(long)]
    pub no_oracle: bool,
    /// cuda: also run each fixture model's first prompt token by token (the decode path).
    #[arg(long)]
    pub step: bool,
    /// cuda: the KV cache's element type of the parity run's models (f32 or f16; the kernel
    /// self-test checks both forms of every attention kernel whatever this says).
    #[arg(long, value_name = "TYPE", env = "REDLITE_KV_TYPE", default_value_t = redlite_model::KvType::F32)]
    pub kv_type: redlite_model::KvType,
}

/// The CUDA branch (`--backend cuda`), in its own file.
#[path = "selftest_cuda.rs"]
mod cuda;

pub fn run(args: Args) -> Result<()> {
    match args.backend.as_str() {
        "cpu" => cpu(args.verbose),
        "cuda" => cuda::run(args),
        other => bail!("no self-test for backend '{other}' (available: cpu, cuda)"),
    }
}

fn cpu(verbose: bool) -> Result<()> {
    use redlite_cpu::kernels::selftest::selftest;
    let (mut passed, mut failed) = (0usize, 0usize);
    selftest(&mut |r| {
        if r.passed {
            passed += 1;
        } else {
            failed += 1;
        }
        if verbose || !r.passed {
            println!("{r}");
        }
    });
    println!("cpu kernels: {passed} checks passed, {failed} failed");
    if failed > 0 {
        bail!("{failed} kernel checks failed");
    }
    Ok(())
}
