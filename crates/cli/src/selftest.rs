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
}

pub fn run(args: Args) -> Result<()> {
    match args.backend.as_str() {
        "cpu" => cpu(args.verbose),
        other => bail!("no self-test for backend '{other}' (available: cpu)"),
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
