//! `redlite bench kernel|decode|prefill`: speed measurements with a progress bar and a final
//! table. Every run first measures the machine's memory read bandwidth (STREAM-like), so that
//! GB/s figures can be given as a fraction of what the memory delivers.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use redlite_engine::bench::ExpertReport;
use redlite_engine::bench::{
    bench_decode_with, bench_kernel_on, bench_prefill, kernel_specs_from_file,
    measure_read_bandwidth, Bandwidth, KernelResult, KernelSpec, ReadProbe,
};
use redlite_engine::default_model::resolve_model;
use redlite_engine::{load_model_from, load_model_with_cache, with_model, BackendChoice};
use redlite_gguf::{GgmlType, GgufFile};
use serde_json::json;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// Matrix-vector kernels: every weight type of the file (or --type), matrices ≫ cache.
    Kernel,
    /// A short prompt, then N timed decode steps.
    Decode,
    /// A P-token prompt pass.
    Prefill,
    /// cuda: one layer's routed-expert kernels on --distinct experts copied from the file,
    /// --per-call experts per call (no model loaded), experts in device memory and in pinned
    /// host memory (the expert cache's miss path).
    Expert,
    /// cuda: the dense prompt product (the model's fused matvec on -p activation rows, default
    /// 512) on random weights of --type (or the file's types), TFLOPS.
    Gemm,
}

#[derive(clap::Args)]
pub struct Args {
    /// What to measure.
    #[arg(value_enum)]
    pub kind: Kind,
    /// Model file (GGUF). Required for decode and prefill; for kernel, its weight types and
    /// shapes are benchmarked unless --type is given.
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Backend: cpu, oracle, or cuda (decode and prefill on the device-resident GPU model; needs
    /// the `cuda` feature and a GPU).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Decode steps (decode, default 32), timed passes (kernel, default 10) or prompt passes
    /// (prefill, default 1).
    #[arg(short = 'n', value_name = "N")]
    pub n: Option<usize>,
    /// Prompt tokens (prefill default 512; decode default 8).
    #[arg(short = 'p', long = "prompt", value_name = "P")]
    pub prompt: Option<usize>,
    /// Threads (0: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    #[command(flatten)]
    pub cache: crate::cache_args::CacheArgs,
    #[command(flatten)]
    pub kv: crate::kv_args::KvArgs,
    /// Kernel bench on random data of this type instead of the file's types.
    #[arg(long = "type", value_name = "TYPE")]
    pub ty: Option<String>,
    /// Matrix shape for --type, ROWSxCOLS.
    #[arg(long, default_value = "4096x8192", value_name = "ROWSxCOLS")]
    pub shape: String,
    /// Kernel working set in MiB of quantized weights (default: 512 for cpu, 64 for oracle,
    /// which holds f32 copies).
    #[arg(long, value_name = "MIB")]
    pub working_set_mib: Option<u64>,
    /// Size of the bandwidth buffer in MiB.
    #[arg(long, default_value_t = 1024, value_name = "MIB")]
    pub bw_mib: u64,
    /// Timed runs of the bandwidth measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub bw_runs: usize,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// cuda: run the decode step without the CUDA graph (every kernel launched each step).
    #[arg(long)]
    pub no_graphs: bool,
    /// cuda kernel: activations of the one-token product: auto (what decode uses: q8 for Q4_K
    /// and Q6_K), f32 or q8. cuda expert: auto (the q8 kernels decode's experts use, IQ2_XXS),
    /// q8 or f32 (the f32-activation expert kernels).
    #[arg(long, value_name = "auto|f32|q8")]
    pub acts: Option<String>,
    /// cuda kernel|gemm: launch without programmatic dependent launch (decode uses it on
    /// compute capability 9.0 and newer).
    #[arg(long)]
    pub no_pdl: bool,
    /// cuda kernel: the row split of the one-token product as `LANE_ITERS:ROWS` (the work units a
    /// lane aims for, which sets the warps per row, and the consecutive rows a warp group takes;
    /// decode's matrices use 4:4 for the q8 kernels, its lm_head 8:4). Default: 4 and the
    /// kernel's default rows.
    #[arg(long, value_name = "LANE_ITERS:ROWS")]
    pub split: Option<String>,
    /// cuda decode: bracket decode step N (0 = the untimed warm-up step) with the CUDA profiler's
    /// start/stop and NVTX ranges per layer, for `ncu --profile-from-start off` (ranges need
    /// --no-graphs: a replayed graph enqueues nothing).
    #[arg(long, value_name = "N")]
    pub profile_step: Option<u64>,
    /// cuda decode: time the steps at position N (the cache rows between the prompt and N hold
    /// zeros): a long context without its prompt pass.
    #[arg(long, value_name = "N")]
    pub position: Option<usize>,
    /// bench expert: the layer whose experts are used.
    #[arg(long, default_value_t = 0, value_name = "L")]
    pub layer: usize,
    /// bench expert: distinct experts cycled through (N).
    #[arg(long, default_value_t = 512, value_name = "N")]
    pub distinct: usize,
    /// bench expert: experts per call (K).
    #[arg(long, default_value_t = 10, value_name = "K")]
    pub per_call: usize,
}

/// A progress bar fed by the engine's `(stage, done, total)` callbacks.
fn progress_bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg:32} {bar:30} {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

fn update(bar: &ProgressBar, stage: &str, done: u64, total: u64) {
    bar.set_message(stage.to_string());
    bar.set_length(total);
    bar.set_position(done);
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (r, c) = s
        .split_once(['x', 'X'])
        .with_context(|| format!("--shape {s}: expected ROWSxCOLS, e.g. 4096x8192"))?;
    let rows: usize = r
        .trim()
        .parse()
        .with_context(|| format!("--shape {s}: rows"))?;
    let cols: usize = c
        .trim()
        .parse()
        .with_context(|| format!("--shape {s}: cols"))?;
    if rows == 0 || cols == 0 {
        bail!("--shape {s}: rows and columns must be positive");
    }
    Ok((rows, cols))
}

/// The backend's name as printed, with the CPU kernels' instruction set (`cpu (avx512)`).
fn backend_label(choice: BackendChoice, name: &str) -> String {
    match choice {
        BackendChoice::Cpu => format!("{name} ({})", redlite_cpu::kernels::Isa::active().name()),
        _ => name.to_string(),
    }
}

fn threads_used(args: &Args) -> usize {
    if args.threads == 0 {
        redlite_cpu::kernels::driver::physical_cores()
    } else {
        args.threads
    }
}

pub fn run(mut args: Args) -> Result<()> {
    if args.backend == "cuda" {
        args.kv.require_cuda()?;
        return run_cuda(args);
    }
    let choice = BackendChoice::parse(&args.backend)?;
    let threads = threads_used(&args);
    // Decode and prefill need a model: the one given, else the shipped demo model.
    let model_path = if args.kind != Kind::Kernel {
        Some(resolve_model(args.model.as_deref()).map_err(anyhow::Error::msg)?)
    } else {
        args.model.clone()
    };
    args.model = model_path;
    // Open the file before measuring so a bad path fails fast.
    let file = match &args.model {
        Some(p) => Some(Arc::new(
            GgufFile::open(p).context("opening the model file")?,
        )),
        None => None,
    };
    let bar = progress_bar();
    let mut progress = |stage: &str, done: u64, total: u64| update(&bar, stage, done, total);

    // Bandwidth first, and its buffer freed before the model is touched.
    let bw = measure_read_bandwidth(
        (args.bw_mib as usize) << 20,
        threads,
        args.bw_runs,
        &mut progress,
    );

    let mut expert_report: Option<ExpertReport> = None;
    let report = match args.kind {
        Kind::Kernel => {
            let specs = match (&args.ty, &file) {
                (Some(t), _) => {
                    let ty = GgmlType::from_name(t)
                        .with_context(|| format!("--type {t}: unknown type"))?;
                    let (rows, cols) = parse_shape(&args.shape)?;
                    vec![KernelSpec { ty, rows, cols }]
                }
                (None, Some(f)) => kernel_specs_from_file(f),
                (None, None) => bail!("kernel bench: give -m FILE or --type TYPE"),
            };
            let ws_mib = args.working_set_mib.unwrap_or(match choice {
                BackendChoice::Oracle => 64,
                _ => 512,
            });
            let passes = args.n.unwrap_or(10);
            // A bandwidth run after every timed pass: the "% bw paired" column.
            let probe = ReadProbe::new((args.bw_mib as usize) << 20, threads);
            let mut results = Vec::new();
            for spec in specs {
                let r = bench_kernel_on(
                    choice,
                    args.threads,
                    spec,
                    (ws_mib << 20, passes, 0x5eed),
                    Some(&probe),
                    &mut progress,
                )
                .with_context(|| format!("kernel {} {}x{}", spec.ty, spec.rows, spec.cols))?;
                results.push(r);
            }
            bar.finish_and_clear();
            Report::Kernel(results)
        }
        Kind::Decode => {
            let file = file.context("decode needs -m FILE")?;
            progress("loading the model", 0, 0);
            let cache = args.cache.config(&file, args.kv.cpu())?;
            let mut model = load_model_with_cache(file, choice, args.threads, cache)?;
            args.kv.apply(&mut model)?;
            let prompt = args.prompt.unwrap_or(8);
            let steps = args.n.unwrap_or(32);
            let (r, experts) = with_model!(&model, m => {
                bench_decode_with(m, prompt, steps, &mut progress, &model)
            })?;
            bar.finish_and_clear();
            expert_report = Some(experts);
            Report::Decode(r)
        }
        Kind::Expert => bail!("bench expert runs the GPU expert kernels: give --backend cuda"),
        Kind::Gemm => bail!("bench gemm runs the GPU's prompt product: give --backend cuda"),
        Kind::Prefill => {
            let file = file.context("prefill needs -m FILE")?;
            progress("loading the model", 0, 0);
            let mut model = load_model_from(file, choice, args.threads)?;
            args.kv.apply(&mut model)?;
            let tokens = args.prompt.unwrap_or(512);
            let runs = args.n.unwrap_or(1);
            let r = with_model!(&model, m => bench_prefill(m, tokens, runs, &mut progress))?;
            bar.finish_and_clear();
            Report::Prefill(r)
        }
    };

    let label = backend_label(choice, &args.backend);
    if args.json {
        let mut v = report.json(&args, &bw, threads);
        v["backend_label"] = json!(label);
        if let Some(e) = &expert_report {
            v["expert_cache"] = expert_json(e, &args);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_table(&report, &args, &bw, threads, &label);
        if let Some(e) = &expert_report {
            print_expert_report(e, &args);
        }
    }
    Ok(())
}

enum Report {
    Kernel(Vec<KernelResult>),
    Decode(redlite_engine::bench::DecodeResult),
    Prefill(redlite_engine::bench::PrefillResult),
}

fn pct(gbps: f64, bw: &Bandwidth) -> f64 {
    100.0 * gbps / bw.gbps.max(1e-12)
}

impl Report {
    fn json(&self, args: &Args, bw: &Bandwidth, threads: usize) -> serde_json::Value {
        let bandwidth = json!({
            "gbps": bw.gbps,
            "runs_gbps": bw.runs_gbps,
            "buffer_bytes": bw.buffer_bytes,
            "threads": bw.threads,
        });
        let model = args.model.as_ref().map(|p| p.display().to_string());
        match self {
            Report::Kernel(rs) => json!({
                "bench": "kernel", "backend": args.backend, "threads": threads, "model": model,
                "bandwidth": bandwidth,
                "kernels": rs.iter().map(|r| json!({
                    "type": r.spec.ty.name(), "rows": r.spec.rows, "cols": r.spec.cols,
                    "matrices": r.matrices, "bytes_per_pass": r.bytes_per_pass, "passes": r.passes,
                    "us_per_matvec": r.per_matvec.as_secs_f64() * 1e6,
                    "gbps": r.gbps, "fraction_of_bandwidth": r.gbps / bw.gbps.max(1e-12),
                    "fraction_of_bandwidth_paired": r.paired.as_ref().map(|p| p.fraction),
                    "paired_bandwidth_runs_gbps": r.paired.as_ref().map(|p| p.runs_gbps.clone()),
                })).collect::<Vec<_>>(),
            }),
            Report::Decode(r) => json!({
                "bench": "decode", "backend": r.backend, "threads": threads, "model": model,
                "bandwidth": bandwidth,
                "prompt_tokens": r.prompt_tokens, "prompt_s": r.prompt_time.as_secs_f64(),
                "steps": r.steps, "decode_s": r.decode_time.as_secs_f64(),
                "median_step_ms": r.median_step.as_secs_f64() * 1e3,
                "tok_per_s": r.tok_per_s, "bytes_per_token": r.bytes_per_token, "gbps": r.gbps,
                "fraction_of_bandwidth": r.gbps / bw.gbps.max(1e-12),
            }),
            Report::Prefill(r) => json!({
                "bench": "prefill", "backend": r.backend, "threads": threads, "model": model,
                "bandwidth": bandwidth,
                "tokens": r.tokens, "runs": r.runs, "median_s": r.time.as_secs_f64(),
                "tok_per_s": r.tok_per_s,
            }),
        }
    }
}

fn print_table(report: &Report, args: &Args, bw: &Bandwidth, threads: usize, label: &str) {
    if let Some(m) = &args.model {
        println!("model: {}", m.display());
    }
    println!(
        "memory read bandwidth: {:.2} GB/s (median of {} runs over {} MiB, {} threads)",
        bw.gbps,
        bw.runs_gbps.len(),
        bw.buffer_bytes >> 20,
        bw.threads
    );
    println!();
    match report {
        Report::Kernel(rs) => {
            println!(
                "{:<8} {:>12} {:>8} {:>10} {:>12} {:>9} {:>8} {:>13}",
                "type", "shape", "matrices", "set MiB", "us/matvec", "GB/s", "% bw", "% bw paired"
            );
            for r in rs {
                let paired = r
                    .paired
                    .as_ref()
                    .map_or("-".to_string(), |p| format!("{:.1}%", 100.0 * p.fraction));
                println!(
                    "{:<8} {:>12} {:>8} {:>10.1} {:>12.1} {:>9.2} {:>7.1}% {:>13}",
                    r.spec.ty.name(),
                    format!("{}x{}", r.spec.rows, r.spec.cols),
                    r.matrices,
                    r.bytes_per_pass as f64 / (1u64 << 20) as f64,
                    r.per_matvec.as_secs_f64() * 1e6,
                    r.gbps,
                    pct(r.gbps, bw),
                    paired
                );
            }
            println!(
                "\n% bw: against the bandwidth measured first; % bw paired: median over the passes of \
                 the pass against a bandwidth run right after it"
            );
            println!("backend {label}, {threads} threads");
        }
        Report::Decode(r) => {
            println!(
                "{:<14} {:>7} {:>7} {:>6} {:>9} {:>10} {:>9} {:>8} {:>7}",
                "backend",
                "threads",
                "prompt",
                "steps",
                "tok/s",
                "ms/token",
                "MB/token",
                "GB/s",
                "% bw"
            );
            println!(
                "{:<14} {:>7} {:>7} {:>6} {:>9.2} {:>10.2} {:>9.1} {:>8.2} {:>6.1}%",
                label,
                threads,
                r.prompt_tokens,
                r.steps,
                r.tok_per_s,
                r.median_step.as_secs_f64() * 1e3,
                r.bytes_per_token as f64 / 1e6,
                r.gbps,
                pct(r.gbps, bw)
            );
        }
        Report::Prefill(r) => {
            println!(
                "{:<14} {:>7} {:>7} {:>5} {:>10} {:>9}",
                "backend", "threads", "tokens", "runs", "time s", "tok/s"
            );
            println!(
                "{:<14} {:>7} {:>7} {:>5} {:>10.3} {:>9.2}",
                label,
                threads,
                r.tokens,
                r.runs,
                r.time.as_secs_f64(),
                r.tok_per_s
            );
        }
    }
}

/// `bench kernel|gemm --backend cuda`: the model's dense product kernel on random weights, one
/// activation row (kernel: GB/s against the device's read bandwidth measured in the same run) or
/// -p rows (gemm: TFLOPS).
fn run_cuda_kernels(args: &Args) -> Result<()> {
    let specs = match (&args.ty, &args.model) {
        (Some(t), _) => {
            let ty = GgmlType::from_name(t).with_context(|| format!("--type {t}: unknown type"))?;
            let (rows, cols) = parse_shape(&args.shape)?;
            vec![(ty, rows, cols)]
        }
        (None, Some(p)) => {
            let f = GgufFile::open(p).context("opening the model file")?;
            kernel_specs_from_file(&f)
                .into_iter()
                .map(|k| (k.ty, k.rows, k.cols))
                .collect()
        }
        (None, None) => vec![(GgmlType::Q4K, 4096, 2048), (GgmlType::IQ2XXS, 4096, 2048)],
    };
    let tokens = match args.kind {
        Kind::Gemm => args.prompt.unwrap_or(512),
        _ => 1,
    };
    let ws = (args.working_set_mib.unwrap_or(512) as usize) << 20;
    let reps = args.n.unwrap_or(10);
    let acts = acts_arg(args)?;
    let split = match args.split.as_deref() {
        None => None,
        Some(v) => {
            let bad = || format!("--split {v}: expected LANE_ITERS:ROWS, e.g. 8:1");
            let (a, b) = v.split_once(':').with_context(bad)?;
            let (li, r) = (
                a.trim().parse::<usize>().with_context(bad)?,
                b.trim().parse::<usize>().with_context(bad)?,
            );
            if li == 0 || !(1..=16).contains(&r) {
                bail!("--split {v}: LANE_ITERS at least 1, ROWS 1 to 16");
            }
            Some((li, r))
        }
    };
    let (bw, rows) = crate::cuda_cmd::bench_kernels(
        &specs,
        tokens,
        ws,
        reps,
        (args.bw_mib as usize) << 20,
        crate::cuda_cmd::KernelLaunch {
            acts,
            pdl: !args.no_pdl,
            split,
        },
    )?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"read_gbps": bw, "rows": rows}))?
        );
        return Ok(());
    }
    println!(
        "device read bandwidth: {bw:.0} GB/s (read_sum over {} MiB, median of {reps})",
        args.bw_mib
    );
    println!(
        "{:<8} {:>11} {:>6} {:>5} {:>4} {:>8} {:>10} {:>8} {:>6} {:>7}  kernel",
        "type", "shape", "tokens", "parts", "rows", "matrices", "us/call", "GB/s", "% bw", "TFLOPS"
    );
    for r in rows {
        let g = r["gbps"].as_f64().unwrap_or(0.0);
        println!(
            "{:<8} {:>11} {:>6} {:>5} {:>4} {:>8} {:>10.2} {:>8.1} {:>5.1}% {:>7.2}  {}{}",
            r["type"].as_str().unwrap_or("?"),
            format!("{}x{}", r["rows"], r["cols"]),
            r["tokens"],
            r["parts"],
            r["warp_rows"],
            r["matrices"],
            r["us_per_call"].as_f64().unwrap_or(0.0),
            g,
            100.0 * g / bw.max(1e-9),
            r["tflops"].as_f64().unwrap_or(0.0),
            r["kernel"].as_str().unwrap_or("?"),
            if r["pdl"].as_bool() == Some(true) {
                " (pdl)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// `--acts`: None for auto, else "f32" or "q8".
fn acts_arg(args: &Args) -> Result<Option<&str>> {
    match args.acts.as_deref() {
        None | Some("auto") => Ok(None),
        Some(a @ ("f32" | "q8")) => Ok(Some(a)),
        Some(a) => bail!("--acts {a}: expected auto, f32 or q8"),
    }
}

/// `bench decode|prefill --backend cuda`: the device-resident model (crate::cuda_cmd). No host
/// bandwidth run; GB/s is weight bytes per token × tok/s.
fn run_cuda(args: Args) -> Result<()> {
    if matches!(args.kind, Kind::Kernel | Kind::Gemm) {
        return run_cuda_kernels(&args);
    }
    if args.kind == Kind::Expert {
        let acts = acts_arg(&args)?;
        let path = args.model.as_ref().context("bench expert needs -m FILE")?;
        let file = Arc::new(GgufFile::open(path).context("opening the model file")?);
        let rows = crate::cuda_cmd::bench_expert(
            file,
            args.layer,
            args.distinct,
            args.per_call,
            args.n.unwrap_or(20),
            acts,
        )?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&rows)?);
            return Ok(());
        }
        println!(
            "model: {}, layer {}, {} warps per block (REDLITE_MOE_WARPS), kernels {}",
            path.display(),
            args.layer,
            rows.first().map_or(0, |r| r["warps"].as_u64().unwrap_or(0)),
            rows.first()
                .and_then(|r| r["kernels"].as_str())
                .unwrap_or("?")
        );
        println!(
            "{:<12} {:>14} {:>9} {:>5} {:>9} {:>10} {:>9} {:>9}  {:<16}",
            "experts in",
            "types",
            "KiB/exp",
            "K",
            "distinct",
            "us/call",
            "GB/s",
            "% 4.5TB/s",
            "output FNV-1a"
        );
        for r in rows {
            let g = r["gbps"].as_f64().unwrap_or(0.0);
            println!(
                "{:<12} {:>14} {:>9.0} {:>5} {:>9} {:>10.2} {:>9.1} {:>8.1}%  {:016x}",
                r["place"].as_str().unwrap_or("?"),
                r["types"].as_str().unwrap_or("?"),
                r["expert_bytes"].as_f64().unwrap_or(0.0) / 1024.0,
                r["per_call"],
                r["distinct"],
                r["us_per_call"].as_f64().unwrap_or(0.0),
                g,
                100.0 * g / 4500.0,
                r["checksum"].as_u64().unwrap_or(0)
            );
        }
        return Ok(());
    }
    let path = resolve_model(args.model.as_deref()).map_err(anyhow::Error::msg)?;
    let file = Arc::new(GgufFile::open(&path).context("opening the model file")?);
    let bar = progress_bar();
    let mut progress = |stage: &str, done: u64, total: u64| update(&bar, stage, done, total);
    println!("model: {}", path.display());
    if args.kind == Kind::Decode {
        let prompt = args.prompt.unwrap_or(8);
        let steps = args.n.unwrap_or(32);
        let at = crate::cuda_cmd::DecodeAt {
            position: args.position,
            profile_step: args.profile_step,
        };
        let (r, info) = crate::cuda_cmd::bench_decode(
            file,
            prompt,
            steps,
            (!args.no_graphs, at),
            args.kv.gpu(&args.cache),
            &mut progress,
        )?;
        bar.finish_and_clear();
        let launches = info
            .launches_per_step
            .map_or("?".to_string(), |n| n.to_string());
        if args.json {
            let v = json!({
                "bench": "decode", "backend": "cuda", "device": info.device,
                "graphs": info.graphs, "launches_per_step": info.launches_per_step,
                "kv_type": args.kv.cuda().name(),
                "device_mib": info.device_mib, "gpu_used_mib": info.gpu_used_mib,
                "experts": info.experts, "expert_hit_rate": info.hit_rate,
                "expert_misses_per_token": info.misses_per_token,
                "expert_promotions_per_token": info.promotions_per_token,
                "pcie_mb_per_token": info.pcie_mb_per_token,
                "graph_replay_step_ms": info.replay_step_s.map(|s| s * 1e3),
                "prompt_tokens": r.prompt_tokens,
                "prompt_s": r.prompt_time.as_secs_f64(), "steps": r.steps,
                "decode_s": r.decode_time.as_secs_f64(),
                "median_step_ms": r.median_step.as_secs_f64() * 1e3,
                "tok_per_s": r.tok_per_s, "bytes_per_token": r.bytes_per_token, "gbps": r.gbps,
            });
            println!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(());
        }
        println!(
            "device: {}, {} MiB on the GPU ({} KV cache), CUDA graph {}, {launches} kernel launches per decode step",
            info.device,
            info.device_mib,
            args.kv.cuda(),
            if info.graphs { "on" } else { "off" }
        );
        println!(
            "GPU memory in use (cuMemGetInfo, whole device): {} MiB; {}",
            info.gpu_used_mib, info.experts
        );
        println!(
            "experts over the timed steps: hit rate {:.1}%, {:.1} misses/token, {:.2} promotions/token, {:.1} MB/token over PCIe",
            100.0 * info.hit_rate,
            info.misses_per_token,
            info.promotions_per_token,
            info.pcie_mb_per_token
        );
        println!(
            "{:<8} {:>7} {:>6} {:>9} {:>10} {:>9} {:>8}",
            "backend", "prompt", "steps", "tok/s", "ms/token", "MB/token", "GB/s"
        );
        println!(
            "{:<8} {:>7} {:>6} {:>9.2} {:>10.3} {:>9.1} {:>8.1}",
            "cuda",
            r.prompt_tokens,
            r.steps,
            r.tok_per_s,
            r.median_step.as_secs_f64() * 1e3,
            r.bytes_per_token as f64 / 1e6,
            r.gbps
        );
        if let Some(replay) = info.replay_step_s {
            // The decode loop's mean step against the graph alone: what the host adds a step.
            let step = r.decode_time.as_secs_f64() / r.steps.max(1) as f64;
            println!(
                "graph replayed back to back: {:.3} ms a step ({:.2} tok/s); the host's round trip adds {:.1} µs a step ({:.1} %)",
                replay * 1e3,
                1.0 / replay.max(1e-12),
                (step - replay) * 1e6,
                100.0 * (step - replay) / step.max(1e-12)
            );
        }
    } else {
        let tokens = args.prompt.unwrap_or(512);
        let runs = args.n.unwrap_or(1);
        let (r, note) = crate::cuda_cmd::bench_prefill(
            file,
            tokens,
            runs,
            args.kv.gpu(&args.cache),
            &mut progress,
        )?;
        bar.finish_and_clear();
        if args.json {
            let v = json!({
                "bench": "prefill", "backend": "cuda", "tokens": r.tokens, "runs": r.runs,
                "median_s": r.time.as_secs_f64(), "tok_per_s": r.tok_per_s,
            });
            println!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(());
        }
        println!("{note}");
        println!(
            "{:<8} {:>7} {:>5} {:>10} {:>9}",
            "backend", "tokens", "runs", "time s", "tok/s"
        );
        println!(
            "{:<8} {:>7} {:>5} {:>10.3} {:>9.2}",
            "cuda",
            r.tokens,
            r.runs,
            r.time.as_secs_f64(),
            r.tok_per_s
        );
    }
    Ok(())
}

/// The expert cache's counters per decode token and the routing statistics, as JSON.
fn expert_json(e: &ExpertReport, args: &Args) -> serde_json::Value {
    let steps = args.n.unwrap_or(32).max(1) as f64;
    json!({
        "size": args.cache.expert_cache.clone().or(args.cache.memory.clone()),
        "policy": args.cache.cache_policy,
        "cache": e.cache.map(|c| json!({
            "hits": c.hits, "misses": c.misses, "hit_rate": c.hit_rate(),
            "misses_per_token": c.misses as f64 / steps,
            "bytes_read_per_token": c.bytes_read as f64 / steps,
            "stall_ms_per_token": c.stall.as_secs_f64() * 1e3 / steps,
            "prefetched_per_token": c.prefetched as f64 / steps,
            "prefetch_hits_per_token": c.prefetch_hits as f64 / steps,
            "slots": c.slots, "slot_bytes": c.slot_bytes, "direct_io": c.direct_io,
        })),
        "routing": e.routing.as_ref().map(|r| json!({
            "tokens": r.tokens, "layers": r.layers, "experts_per_layer": r.experts_per_layer,
            "distinct_mean": r.distinct_mean, "distinct_min": r.distinct_min,
            "distinct_max": r.distinct_max, "entropy_bits": r.entropy_bits,
            "reuse_tokens_median": r.reuse_tokens_median, "reuse_tokens_p90": r.reuse_tokens_p90,
            "stack_distance_median": r.stack_distance_median,
            "stack_distance_p90": r.stack_distance_p90,
            "first_use_fraction": r.first_use_fraction,
        })),
    })
}

fn print_expert_report(e: &ExpertReport, args: &Args) {
    let steps = args.n.unwrap_or(32).max(1) as f64;
    if let Some(c) = &e.cache {
        if c.slots == 0 {
            println!(
                "expert cache: every expert resident (memory map), {} lookups",
                c.hits
            );
        } else {
            println!(
                "expert cache: {} slots × {:.2} MiB ({}, {}), hit rate {:.1}%, {:.1} misses/token, \
                 {:.1} MB read/token, stall {:.1} ms/token, prefetched {:.1}/token ({:.1} used)",
                c.slots,
                c.slot_bytes as f64 / (1u64 << 20) as f64,
                args.cache.cache_policy,
                if c.direct_io { "O_DIRECT" } else { "buffered" },
                100.0 * c.hit_rate(),
                c.misses as f64 / steps,
                c.bytes_read as f64 / steps / 1e6,
                c.stall.as_secs_f64() * 1e3 / steps,
                c.prefetched as f64 / steps,
                c.prefetch_hits as f64 / steps
            );
        }
    }
    if let Some(r) = &e.routing {
        println!(
            "routing over {} tokens, {} layers: distinct experts/layer {:.1} (min {}, max {}) of {}, \
             entropy {:.2} bits (uniform {:.2}), reuse distance median {} p90 {} tokens, \
             LRU stack distance median {} p90 {}, first uses {:.1}%",
            r.tokens,
            r.layers,
            r.distinct_mean,
            r.distinct_min,
            r.distinct_max,
            r.experts_per_layer,
            r.entropy_bits,
            (r.experts_per_layer.max(1) as f64).log2(),
            r.reuse_tokens_median,
            r.reuse_tokens_p90,
            r.stack_distance_median,
            r.stack_distance_p90,
            100.0 * r.first_use_fraction
        );
    }
}
