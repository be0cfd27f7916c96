//! `redlite selftest --backend cuda`: every GPU kernel against the CPU reference on fresh random
//! data, then (with `--fixtures DIR`) the fixture models' logits on the GPU against the exact ones.
//! Prints one table per part and a closing `N passed, M failed` line; fails on any failed check.
//! Without the `cuda` feature it says so and fails cleanly.

#[cfg(not(feature = "cuda"))]
pub fn run(_args: super::Args) -> anyhow::Result<()> {
    anyhow::bail!("{}", redlite_cuda::CudaError::NotBuilt)
}

#[cfg(feature = "cuda")]
pub use imp::run;

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;
    use std::time::Instant;

    use anyhow::{bail, Context, Result};
    use redlite_cuda::{parity, selftest, Gpu};

    pub fn run(args: super::super::Args) -> Result<()> {
        let gpu = Arc::new(Gpu::new(0).context("opening the CUDA device")?);
        println!("{}", gpu.info);
        let seed = args.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x5eed)
        });
        println!("seed {seed}");

        let t0 = Instant::now();
        let checks = selftest::run(&gpu, seed);
        println!("\nkernel self-test ({:.1} s)", t0.elapsed().as_secs_f64());
        println!("| kernel | case | error | tol | ok |");
        println!("|---|---|---|---|---|");
        for c in &checks {
            let note = if c.note.is_empty() {
                String::new()
            } else {
                format!(" ({})", c.note)
            };
            println!(
                "| {} | {} | {:.2e} | {:.0e} | {}{} |",
                c.kernel,
                c.case,
                c.err,
                c.tol,
                if c.pass { "ok" } else { "FAIL" },
                note
            );
        }
        let mut passed = checks.iter().filter(|c| c.pass).count();
        let mut failed = checks.len() - passed;
        println!("kernels: {passed} passed, {failed} failed");

        if let Some(dir) = &args.fixtures {
            let rows = parity::run(gpu.clone(), dir, !args.no_oracle, args.step, args.kv_type)
                .with_context(|| format!("parity run on {}", dir.display()))?;
            println!(
                "\nfixture parity ({} KV cache): mean KL(exact ‖ ·) over the stored rows, nats",
                args.kv_type
            );
            println!("| file | mode | rows | KL cuda | KL oracle | KL llama.cpp | bound | argmax (margin > {}) | max abs cuda−oracle | s | ok |", parity::ARGMAX_MARGIN);
            println!("|---|---|---|---|---|---|---|---|---|---|---|");
            let opt = |v: Option<f64>| v.map(|x| format!("{x:.2e}")).unwrap_or_else(|| "-".into());
            for r in &rows {
                println!(
                    "| {} | {} | {} | {:.2e} | {} | {:.2e} | {:.1e} | {}/{} equal | {} | {:.1} | {} |",
                    r.model,
                    r.mode,
                    r.rows,
                    r.kl_cuda,
                    opt(r.kl_oracle),
                    r.kl_llamacpp,
                    r.bound,
                    r.argmax_checked - r.argmax_mismatch,
                    r.argmax_checked,
                    opt(r.max_abs_vs_oracle),
                    r.seconds,
                    if r.pass { "ok" } else { "FAIL" }
                );
            }
            for r in rows.iter().filter(|r| r.launches_per_step.is_some()) {
                println!(
                    "decode step of {}: {} kernel launches, replayed as one CUDA graph",
                    r.model,
                    r.launches_per_step.unwrap_or(0)
                );
            }
            if rows.is_empty() {
                println!(
                    "(no fixture with a model file and exact logits in {})",
                    dir.display()
                );
            }
            let p = rows.iter().filter(|r| r.pass).count();
            passed += p;
            failed += rows.len() - p;
        }
        println!("\nselftest: {passed} passed, {failed} failed");
        if failed > 0 {
            bail!("{failed} self-test checks failed");
        }
        Ok(())
    }
}
