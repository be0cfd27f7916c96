//! `--backend cuda` for `generate`, `logits` and `bench decode|prefill`: the device-resident
//! [`redlite_cuda::CudaModel`] (weights, activations, KV caches and recurrent states on the GPU;
//! the decode step replayed as a CUDA graph). It is not a `redlite_model::Backend` (those run the
//! forward pass on the host), so these commands branch to it here. Without the `cuda` feature, or
//! without a GPU, `generate` and `logits` say so and run on the CPU ([`or_cpu`]); the benches fail
//! with a message that says which and how to proceed.

use std::sync::Arc;

use anyhow::Result;
use redlite_engine::bench::{DecodeResult, PrefillResult, Progress};
use redlite_engine::sampler::Sampler;
use redlite_engine::speculative::{SpecConfig, SpecStats};
use redlite_engine::{GenerateOptions, GenerationStats};
use redlite_gguf::GgufFile;

use crate::cache_args::CacheArgs;
use redlite_model::KvType;

/// Where `bench decode --backend cuda` decodes and what it profiles.
#[derive(Debug, Clone, Copy, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA build only
pub struct DecodeAt {
    /// Time the steps at this position (`CudaModel::skip_to` after the prompt).
    pub position: Option<usize>,
    /// Bracket this decode step with the profiler's start/stop (`CudaModel::set_profile_step`).
    pub profile_step: Option<u64>,
}

/// What a CUDA decode bench measured besides the engine's figures.
pub struct CudaDecodeInfo {
    pub device: String,
    pub launches_per_step: Option<u64>,
    pub graphs: bool,
    pub device_mib: usize,
    /// GPU memory in use after the run (cuMemGetInfo: context, model, graph), MiB.
    pub gpu_used_mib: usize,
    /// Where the routed experts are (all resident, or the cache's slots and policy).
    pub experts: String,
    /// Expert-cache counters over the timed steps.
    pub hit_rate: f64,
    pub misses_per_token: f64,
    pub promotions_per_token: f64,
    pub pcie_mb_per_token: f64,
    /// Seconds a step of the decode graph replayed back to back without the host's round trip
    /// (`CudaModel::time_graph_replays`), when graphs are on.
    pub replay_step_s: Option<f64>,
}

/// How `bench kernel|gemm --backend cuda` launches the product.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA build only
pub struct KernelLaunch<'a> {
    /// Activations of one-token calls: `None` what decode uses, `Some("f32")` or `Some("q8")`.
    pub acts: Option<&'a str>,
    /// Programmatic dependent launch (as decode on compute capability ≥ 9.0).
    pub pdl: bool,
    /// The row split `(lane_iters, rows per warp group)`, or decode's default for its matrices.
    pub split: Option<(usize, usize)>,
}

/// One line of `spec-bench verify --backend cuda`: a verify pass of `k + 1` rows against a
/// one-token decode step (medians, milliseconds).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // built by the CUDA build only
pub struct VerifyCost {
    pub k: usize,
    pub verify_ms: f64,
    pub decode_ms: f64,
}

/// `--backend cuda` where no GPU can be used (no `cuda` feature, no driver, no NVRTC, no device):
/// say why on stderr and run on the CPU backend instead. Returns the backend name to use.
pub fn or_cpu(backend: &str) -> &str {
    if backend != "cuda" {
        return backend;
    }
    match redlite_cuda::probe() {
        Ok(()) => "cuda",
        Err(e) => {
            eprintln!("warning: --backend cuda: {e}; using the CPU backend instead");
            "cpu"
        }
    }
}

/// What the command line says of the GPU's memory: the expert cache (`--expert-cache`,
/// `--memory`, `--cache-policy`, `--ubatch`) and the KV cache's element type (`--kv-type`).
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by the CUDA build only
pub struct GpuMem<'a> {
    pub cache: &'a CacheArgs,
    pub kv: KvType,
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    fn not_built<T>() -> Result<T> {
        anyhow::bail!(
            "{} (or choose --backend cpu)",
            redlite_cuda::CudaError::NotBuilt
        )
    }

    pub fn logits(
        _file: Arc<GgufFile>,
        _ids: &[u32],
        _step: bool,
        _mem: GpuMem,
    ) -> Result<Vec<Vec<f32>>> {
        not_built()
    }

    pub fn generate(
        _file: Arc<GgufFile>,
        _prompt: &[u32],
        _sampler: &mut Sampler,
        _opts: &GenerateOptions,
        _mem: GpuMem,
        _on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, GenerationStats)> {
        not_built()
    }

    pub fn bench_decode(
        _file: Arc<GgufFile>,
        _prompt: usize,
        _steps: usize,
        _graphs: (bool, DecodeAt),
        _mem: GpuMem,
        _progress: Progress,
    ) -> Result<(DecodeResult, CudaDecodeInfo)> {
        not_built()
    }

    pub fn bench_expert(
        _file: Arc<GgufFile>,
        _layer: usize,
        _distinct: usize,
        _per_call: usize,
        _replays: usize,
        _acts: Option<&str>,
    ) -> Result<Vec<serde_json::Value>> {
        not_built()
    }

    pub fn bench_prefill(
        _file: Arc<GgufFile>,
        _tokens: usize,
        _runs: usize,
        _mem: GpuMem,
        _progress: Progress,
    ) -> Result<(PrefillResult, String)> {
        not_built()
    }

    pub fn generate_speculative(
        _file: Arc<GgufFile>,
        _prompt: &[u32],
        _sampler: &mut Sampler,
        _opts: &GenerateOptions,
        _spec: &SpecConfig,
        _mem: GpuMem,
        _on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, GenerationStats, SpecStats)> {
        not_built()
    }

    pub fn bench_kernels(
        _specs: &[(redlite_gguf::GgmlType, usize, usize)],
        _tokens: usize,
        _working_set: usize,
        _reps: usize,
        _bw_bytes: usize,
        _launch: crate::cuda_cmd::KernelLaunch,
    ) -> Result<(f64, Vec<serde_json::Value>)> {
        not_built()
    }

    pub fn verify_cost(
        _file: Arc<GgufFile>,
        _context: usize,
        _ks: &[usize],
        _reps: usize,
        _mem: GpuMem,
    ) -> Result<Vec<VerifyCost>> {
        not_built()
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::time::{Duration, Instant};

    use anyhow::Context;
    use redlite_cuda::expert_cache::device_used;
    use redlite_cuda::selftest::Rng;
    use redlite_cuda::{
        CudaModel, CudaModelOptions, ExpertCacheSize, ExpertPolicy, Gpu, GpuSampling,
    };
    use redlite_engine::bench::{bench_tokens, median};
    use redlite_model::sizing::ModelSizes;

    use super::*;

    fn open(file: Arc<GgufFile>, mut opts: CudaModelOptions, mem: GpuMem) -> Result<CudaModel> {
        (opts.experts, opts.expert_policy) = gpu_experts(&file, mem)?;
        opts.kv_type = mem.kv;
        // Prompt tokens per forward call: --ubatch (a verify pass still gets its rows).
        let ubatch = mem
            .cache
            .gpu_ubatch(matches!(opts.experts, ExpertCacheSize::All));
        opts.max_batch = opts
            .max_batch
            .min(ubatch.clamp(1, MAX_UBATCH))
            .max(opts.max_verify)
            .max(1);
        let gpu = Gpu::new(0)
            .context("opening the CUDA device (use --backend cpu on a machine without a GPU)")?;
        eprintln!("{}", gpu.info);
        let t0 = Instant::now();
        let model = CudaModel::from_gguf(Arc::new(gpu), file, opts)
            .context("loading the model onto the GPU")?;
        eprintln!(
            "model on the GPU: {} MiB in {:.1} s; {}; {}",
            model.device_bytes() >> 20,
            t0.elapsed().as_secs_f64(),
            experts_note(&model),
            model.prompt_gemms()
        );
        Ok(model)
    }

    /// The expert cache `--expert-cache` / `--memory` / `--cache-policy` ask for.
    fn gpu_experts(file: &GgufFile, mem: GpuMem) -> Result<(ExpertCacheSize, ExpertPolicy)> {
        let cache_args = mem.cache;
        use crate::cache_args::GpuExperts;
        let size = match cache_args.gpu_experts(file, mem.kv)? {
            GpuExperts::All => ExpertCacheSize::All,
            GpuExperts::Min => ExpertCacheSize::Min,
            GpuExperts::Bytes(b) => ExpertCacheSize::Bytes(b),
            GpuExperts::Budget(b) => ExpertCacheSize::Budget(b),
        };
        let policy = cache_args
            .cache_policy
            .parse()
            .map_err(|e| anyhow::anyhow!("--cache-policy: {e}"))?;
        Ok((size, policy))
    }

    /// Where the routed experts are, in words.
    fn experts_note(model: &CudaModel) -> String {
        let c = model.expert_cache();
        if !c.bounded() {
            return format!(
                "routed experts all resident ({} MiB)",
                c.slot_bytes_total() >> 20
            );
        }
        format!(
            "expert cache: {} of {} experts per layer on the GPU ({} MiB of slots), all {} MiB in pinned host memory, policy {:?}",
            c.slots_per_layer(),
            model.config.n_experts,
            c.slot_bytes_total() >> 20,
            c.host_bytes() >> 20,
            c.policy()
        )
    }

    /// The most prompt tokens per forward call `--ubatch` may ask for: the activations (and the
    /// logits of a forward that keeps every row's) take ≈ 1 MB of GPU memory per token.
    const MAX_UBATCH: usize = 4096;

    /// Chained MTP drafts a pass of the GPU's loop when `--spec-mtp-draft` is not given.
    const CUDA_MTP_DRAFT: usize = 3;

    fn options(context: usize, batch: usize) -> CudaModelOptions {
        CudaModelOptions {
            max_context: context.max(1),
            max_batch: batch.clamp(1, MAX_UBATCH),
            ..CudaModelOptions::default()
        }
    }

    /// Logits of every id: one forward call (`step == false`) or one decode step per id.
    pub fn logits(
        file: Arc<GgufFile>,
        ids: &[u32],
        step: bool,
        mem: GpuMem,
    ) -> Result<Vec<Vec<f32>>> {
        let mut model = open(file, options(ids.len(), ids.len()), mem)?;
        if !step {
            return Ok(model.forward_logits(ids)?);
        }
        let mut rows = Vec::with_capacity(ids.len());
        for &id in ids {
            model.decode(id, &GpuSampling::greedy(), 0.0)?;
            rows.push(model.last_logits()?);
        }
        Ok(rows)
    }

    /// The engine's sampler settings as GPU sampling, when the GPU kernel can draw with them
    /// (greedy, or top-k 1..=64 with no penalties).
    fn gpu_sampling(sampler: &Sampler) -> Option<GpuSampling> {
        let c = sampler.config();
        let penalties = c.penalty_last_n != 0
            && (c.repeat_penalty != 1.0 || c.presence_penalty != 0.0 || c.frequency_penalty != 0.0);
        let s = GpuSampling {
            temperature: c.temperature,
            top_k: if c.is_greedy() { 1 } else { c.top_k },
            top_p: c.top_p,
            min_p: c.min_p,
        };
        (!penalties && s.supported()).then_some(s)
    }

    /// The generation loop of `redlite_engine::generate` on the GPU. Tokens are drawn on the GPU
    /// when the settings allow it (only the id comes back); otherwise the logits are read back
    /// and the engine's sampler draws.
    pub fn generate(
        file: Arc<GgufFile>,
        prompt: &[u32],
        sampler: &mut Sampler,
        opts: &GenerateOptions,
        mem: GpuMem,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, GenerationStats)> {
        let mut model = open(
            file,
            options(prompt.len() + opts.max_tokens + 1, prompt.len()),
            mem,
        )?;
        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        let mut out = Vec::new();
        if prompt.is_empty() || opts.max_tokens == 0 {
            return Ok((out, stats));
        }
        let on_gpu = gpu_sampling(sampler);
        if on_gpu.is_none() {
            eprintln!("cuda: these sampling settings are drawn on the host (logits read back)");
        }
        let mut rng = Rng::new(sampler.config().seed);
        let mut history = prompt.to_vec();
        let t0 = Instant::now();
        model.prefill(prompt)?;
        let mut token = match &on_gpu {
            Some(s) => model.sample_last(s, rng.uniform() as f32)?,
            None => sampler.sample(&model.last_logits()?, &history),
        };
        stats.prompt_time = t0.elapsed();
        let t1 = Instant::now();
        loop {
            if opts.stop_ids.contains(&token) {
                stats.stopped_on_eos = true;
                break;
            }
            out.push(token);
            history.push(token);
            if !on_token(token) || out.len() >= opts.max_tokens {
                break;
            }
            token = match &on_gpu {
                Some(s) => model.decode(token, s, rng.uniform() as f32)?,
                None => {
                    model.prefill(&[token])?;
                    sampler.sample(&model.last_logits()?, &history)
                }
            };
        }
        stats.generated_tokens = out.len();
        stats.decode_time = t1.elapsed();
        if let Some(n) = model.launches_per_step() {
            eprintln!("cuda: {n} kernel launches per decode step (captured once as a CUDA graph)");
        }
        Ok((out, stats))
    }

    /// `bench decode` on the GPU: a `prompt`-token prefill, one untimed step (it captures the
    /// graph), then `steps` timed greedy steps (each ends with the token id read back).
    pub fn bench_decode(
        file: Arc<GgufFile>,
        prompt_len: usize,
        steps: usize,
        (graphs, at): (bool, DecodeAt),
        mem: GpuMem,
        progress: Progress,
    ) -> Result<(DecodeResult, CudaDecodeInfo)> {
        progress("loading the model", 0, 0);
        let position = at.position;
        let mut opts = options(
            position.unwrap_or(0).max(prompt_len) + steps + 2,
            prompt_len,
        );
        opts.graphs = graphs;
        let mut model = open(file.clone(), opts, mem)?;
        if let Some(step) = at.profile_step {
            if let Err(why) = model.set_profile_step(Some(step)) {
                eprintln!("profiling decode step {step} without NVTX ranges ({why})");
            }
        }
        let sizes = ModelSizes::new(&file, &model.config)?;
        let prompt = bench_tokens(prompt_len.max(1), model.config.vocab, 1);
        let greedy = GpuSampling::greedy();

        progress("prompt", 0, 0);
        let t0 = Instant::now();
        model.prefill(&prompt)?;
        let mut token = model.sample_last(&greedy, 0.0)?;
        let prompt_time = t0.elapsed();
        if let Some(p) = position {
            model.skip_to(p.max(model.pos()))?;
        }
        token = model.decode(token, &greedy, 0.0)?; // warm-up: graph capture
        model.expert_cache_mut().reset_stats();
        let tracing = redlite_cuda::kernels::trace_on();
        if tracing {
            model.trace(true)?;
        }
        let mut step_secs = Vec::with_capacity(steps);
        for s in 0..steps {
            progress("decode", s as u64, steps as u64);
            let t = Instant::now();
            token = model.decode(token, &greedy, 0.0)?;
            step_secs.push(t.elapsed().as_secs_f64());
        }
        progress("decode", steps as u64, steps as u64);
        if tracing {
            print_trace(&model.trace(false)?, &model);
        }
        let total: f64 = step_secs.iter().sum();
        let tok_per_s = if steps == 0 {
            0.0
        } else {
            steps as f64 / total.max(1e-12)
        };
        let bytes_per_token = sizes.decode.total();
        let st = model.expert_cache().stats();
        let per = |v: u64| v as f64 / st.tokens.max(1) as f64;
        // Last, since it leaves the sequence cleared: the same graph without the host between
        // steps, so the host's share of a step shows.
        progress("graph replays", 0, 0);
        let replay_step_s = model.time_graph_replays(steps)?;
        let info = CudaDecodeInfo {
            device: model.device_info().name.clone(),
            launches_per_step: model.launches_per_step(),
            graphs,
            device_mib: model.device_bytes() >> 20,
            gpu_used_mib: (device_used()? >> 20) as usize,
            experts: experts_note(&model),
            hit_rate: st.hit_rate(),
            misses_per_token: per(st.misses),
            promotions_per_token: per(st.promotions),
            pcie_mb_per_token: per(st.pcie_bytes) / 1e6,
            replay_step_s,
        };
        Ok((
            DecodeResult {
                backend: "cuda",
                prompt_tokens: prompt.len(),
                prompt_time,
                steps,
                decode_time: Duration::from_secs_f64(total),
                median_step: Duration::from_secs_f64(median(&step_secs)),
                tok_per_s,
                bytes_per_token,
                gbps: bytes_per_token as f64 * tok_per_s / 1e9,
            },
            info,
        ))
    }

    /// A traced kernel for [`print_trace`]: its name, its calls' slot, its phases' slots and
    /// names.
    type TracedKernel = (&'static str, usize, &'static [(usize, &'static str)]);

    /// `REDLITE_CUDA_DEFINES=REDLITE_TRACE`: the traced kernels' phases (block 0's thread 0, SM
    /// clock cycles), mean per call; slots as in common.cu's `g_trace`.
    fn print_trace(t: &[u64], model: &CudaModel) {
        // The SM clock (kHz) turns cycles into µs.
        let khz = model.device_info().clock_khz.max(1) as f64;
        const WAIT: &str = "launch to the end of the wait";
        const AFTER: &str = "after the wait";
        let kernels: [TracedKernel; 8] = [
            (
                "moe_route_gate_up",
                0,
                &[
                    (1, WAIT),
                    (2, "router rows"),
                    (3, "grid barrier"),
                    (4, "top-k"),
                    (5, "gate/up rows"),
                ],
            ),
            (
                "  its router rows",
                0,
                &[
                    (30, "loads and partials"),
                    (31, "warp sums"),
                    (32, "barrier"),
                    (33, "row sums and stores"),
                ],
            ),
            (
                "  its top-k",
                0,
                &[
                    // The block-wide top-k (TOPK_PAR, default) uses 16, 17, 19 and 20 as
                    // the second names say; warp 0's rounds (its fallback) as the first.
                    (16, "loads and max | warps' maxima"),
                    (17, "exps and sum | t0 and candidates"),
                    (18, "divisions"),
                    (19, "rounds | ranks"),
                    (20, "tail"),
                ],
            ),
            (
                "  its gate/up rows",
                0,
                &[(21, "rows"), (22, "barrier"), (23, "q8 tail")],
            ),
            ("moe_down_combine", 6, &[(7, WAIT), (8, AFTER)]),
            ("matvec_q8x", 9, &[(10, WAIT), (11, AFTER)]),
            ("dn_fused_cols", 12, &[(13, WAIT), (14, AFTER)]),
            (
                "dn_fused_cols_rows",
                24,
                &[
                    (25, WAIT),
                    (26, "prologues"),
                    (27, "recurrences"),
                    (28, "barrier"),
                    (29, "gated norms"),
                ],
            ),
        ];
        eprintln!("trace: block 0 of each call, at {:.0} MHz", khz / 1e3);
        for (name, calls_slot, phases) in kernels {
            let calls = t.get(calls_slot).copied().unwrap_or(0);
            if calls == 0 {
                eprintln!("trace: {name}: no calls recorded");
                continue;
            }
            let parts: Vec<String> = phases
                .iter()
                .map(|&(slot, n)| {
                    let cyc = t.get(slot).copied().unwrap_or(0) as f64 / calls as f64;
                    format!("{n} {cyc:.0} cycles ({:.2} µs)", cyc / khz * 1e3)
                })
                .collect();
            eprintln!(
                "trace: {name} (mean of {calls} calls): {}",
                parts.join(", ")
            );
        }
    }

    /// `bench expert`: one layer's expert kernels on `distinct` experts of the file, `per_call`
    /// per call, experts in device slots and in mapped pinned host memory; one row each (JSON).
    /// `acts`: None (auto: the q8 kernels where the types have them), "q8" or "f32".
    pub fn bench_expert(
        file: Arc<GgufFile>,
        layer: usize,
        distinct: usize,
        per_call: usize,
        replays: usize,
        acts: Option<&str>,
    ) -> Result<Vec<serde_json::Value>> {
        use redlite_cuda::expert_bench::{bench_experts, ExpertActs, ExpertBenchOptions};
        let acts = match acts {
            None => ExpertActs::Auto,
            Some("q8") => ExpertActs::Q8,
            Some("f32") => ExpertActs::F32,
            Some(a) => anyhow::bail!("--acts {a}: expected auto, f32 or q8"),
        };
        let gpu = Arc::new(Gpu::new(0).context("opening the CUDA device")?);
        eprintln!("{}", gpu.info);
        let o = ExpertBenchOptions {
            layer,
            distinct,
            per_call,
            calls: 64,
            replays,
            acts,
        };
        let rows = bench_experts(&gpu, &file, o).context("bench expert")?;
        Ok(rows
            .into_iter()
            .map(|r| {
                serde_json::json!({
                    "place": r.place, "warps": r.warps, "types": r.types, "kernels": r.kernels,
                    "expert_bytes": r.expert_bytes,
                    "per_call": r.per_call, "distinct": r.distinct,
                    "us_per_call": r.call_s * 1e6, "gbps": r.gbps,
                    "fraction_of_4_5_tbs": r.gbps / 4500.0, "checksum": r.checksum,
                })
            })
            .collect())
    }

    /// `bench prefill` on the GPU: `runs` passes of a `tokens`-token prompt from an empty state
    /// (last token's logits only), median time.
    pub fn bench_prefill(
        file: Arc<GgufFile>,
        tokens: usize,
        runs: usize,
        mem: GpuMem,
        progress: Progress,
    ) -> Result<(PrefillResult, String)> {
        progress("loading the model", 0, 0);
        let mut model = open(file, options(tokens + 1, tokens), mem)?;
        let prompt = bench_tokens(tokens.max(1), model.config.vocab, 2);
        let runs = runs.max(1);
        let mut secs = Vec::with_capacity(runs);
        for r in 0..runs {
            progress("prefill", r as u64, runs as u64);
            model.reset()?;
            let t0 = Instant::now();
            model.prefill(&prompt)?;
            secs.push(t0.elapsed().as_secs_f64());
        }
        progress("prefill", runs as u64, runs as u64);
        let time = median(&secs);
        let batch = model.options().max_batch;
        Ok((
            PrefillResult {
                backend: "cuda",
                tokens: prompt.len(),
                runs,
                time: Duration::from_secs_f64(time),
                tok_per_s: prompt.len() as f64 / time.max(1e-12),
            },
            format!("{batch} tokens per forward call"),
        ))
    }

    /// `generate --spec lookup` on the GPU, greedy: prompt-lookup drafts (the engine's
    /// `lookup_draft` and adaptive length) verified in one `CudaModel::verify_greedy` pass,
    /// rolled back with `CudaModel::keep`. Every token is the argmax of logits bit-identical to a
    /// one-token step's, so the output is the plain greedy output.
    pub fn generate_speculative(
        file: Arc<GgufFile>,
        prompt: &[u32],
        sampler: &mut Sampler,
        opts: &GenerateOptions,
        spec: &SpecConfig,
        mem: GpuMem,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<(Vec<u32>, GenerationStats, SpecStats)> {
        use redlite_engine::speculative::{LookupDrafter, SpecMode};
        if spec.mode == SpecMode::Off {
            anyhow::bail!("generate_speculative with --spec off");
        }
        // Chained MTP drafts a pass: 3 unless given (session 21 on the H200, demo rewrite: 3 / 4 /
        // 5 / 6 drafts 1.47 / 1.41, 1.37 / 1.36, 1.32 / 1.30, 1.37 / 1.39×; the chain has no
        // probability cut here).
        let mtp_draft = spec.mtp_draft.unwrap_or(CUDA_MTP_DRAFT);
        let rows_max = (spec.max_draft.max(mtp_draft) + 1).min(redlite_cuda::MAX_VERIFY_ROWS);
        let mut mo = options(prompt.len() + opts.max_tokens + rows_max + 1, prompt.len());
        mo.max_batch = mo.max_batch.max(rows_max);
        mo.max_verify = rows_max;
        mo.mtp = spec.mode.uses_mtp() && mtp_draft > 0;
        let mut model = open(file, mo, mem)?;
        if spec.mode == SpecMode::Mtp && !model.has_mtp() {
            anyhow::bail!("--spec mtp: the model has no MTP block (nextn_predict_layers = 0)");
        }
        // `both` on a model without an MTP block drafts by prompt lookup alone (as on the CPU).
        let use_mtp = model.has_mtp();
        let greedy = GpuSampling::greedy();
        // With sampling, plain generation's draws in its order (docs/speculative.md, "Acceptance
        // rule with sampling"): a verify row is drawn only once the drafts before it were
        // accepted, one uniform per emitted token (on the GPU), or the host sampler on the row's
        // logits with the accepted drafts in the history (penalties).
        let sampling = !sampler.config().is_greedy();
        let on_gpu = gpu_sampling(sampler);
        let mut rng = Rng::new(sampler.config().seed);
        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        let mut sp = SpecStats {
            mode: spec.mode,
            ..Default::default()
        };
        let mut out = Vec::new();
        if prompt.is_empty() || opts.max_tokens == 0 {
            return Ok((out, stats, sp));
        }
        // The CPU path's drafter: follows its source across passes, draft length adapted.
        let mut drafter = LookupDrafter::new(spec);
        let mut history = prompt.to_vec();
        let t0 = Instant::now();
        model.prefill(prompt)?;
        let mut pending = match (&on_gpu, sampling) {
            (_, false) => model.sample_last(&greedy, 0.0)?,
            (Some(s), true) => model.sample_last(s, rng.uniform() as f32)?,
            (None, true) => sampler.sample(&model.last_logits()?, &history),
        };
        stats.prompt_time = t0.elapsed();
        let t1 = Instant::now();
        'gen: loop {
            if opts.stop_ids.contains(&pending) {
                stats.stopped_on_eos = true;
                break;
            }
            out.push(pending);
            history.push(pending);
            if !on_token(pending) || out.len() >= opts.max_tokens {
                break;
            }
            let room = (opts.max_tokens - out.len()).min(rows_max - 1);
            let td = Instant::now();
            // Prompt lookup first (when on), else the MTP head (as on the CPU).
            let mut drafts = if spec.mode.uses_lookup() {
                drafter.draft(&history, room)
            } else {
                Vec::new()
            };
            let from_mtp = drafts.is_empty() && use_mtp && room > 0;
            if from_mtp {
                drafts = model.mtp_draft(pending, mtp_draft.min(room))?;
            }
            sp.draft_time += td.elapsed();
            sp.forward_passes += 1;
            sp.rows += 1 + drafts.len();
            if drafts.is_empty() {
                drafter.update(0, 0);
                pending = match (&on_gpu, sampling) {
                    (_, false) => model.decode(pending, &greedy, 0.0)?,
                    (Some(s), true) => model.decode(pending, s, rng.uniform() as f32)?,
                    (None, true) => {
                        model.prefill(&[pending])?;
                        sampler.sample(&model.last_logits()?, &history)
                    }
                };
                continue;
            }
            let mut rows = Vec::with_capacity(1 + drafts.len());
            rows.push(pending);
            rows.extend_from_slice(&drafts);
            // ids[i]: the token after rows[..=i] (greedy: every row's argmax; sampling: drawn
            // row by row up to the first rejected draft).
            let ids = if sampling {
                model.verify_on_device(&rows)?;
                let mut ids = Vec::with_capacity(rows.len());
                let mut hist = history.clone();
                for i in 0..rows.len() {
                    let y = match &on_gpu {
                        Some(s) => model.sample_row(i, s, rng.uniform() as f32)?,
                        None => sampler.sample(&model.row_logits(i)?, &hist),
                    };
                    ids.push(y);
                    match drafts.get(i) {
                        Some(&d) if d == y => hist.push(d),
                        _ => break,
                    }
                }
                ids
            } else {
                model.verify_greedy(&rows)?
            };
            let accepted = drafts.iter().zip(&ids).take_while(|(d, y)| d == y).count();
            if from_mtp {
                sp.mtp.add(drafts.len(), accepted);
                drafter.forget();
            } else {
                sp.lookup.add(drafts.len(), accepted);
                drafter.update(drafts.len(), accepted);
            }
            model.keep(1 + accepted)?;
            for &d in &drafts[..accepted] {
                if opts.stop_ids.contains(&d) {
                    stats.stopped_on_eos = true;
                    break 'gen;
                }
                out.push(d);
                history.push(d);
                if !on_token(d) || out.len() >= opts.max_tokens {
                    break 'gen;
                }
            }
            pending = ids[accepted];
        }
        stats.generated_tokens = out.len();
        stats.decode_time = t1.elapsed();
        Ok((out, stats, sp))
    }

    /// `bench kernel|gemm --backend cuda`: the device's read bandwidth, then the model's fused
    /// matvec (no norm) on `tokens` activation rows for each `(type, rows, cols)`; one JSON row
    /// each.
    pub fn bench_kernels(
        specs: &[(redlite_gguf::GgmlType, usize, usize)],
        tokens: usize,
        working_set: usize,
        reps: usize,
        bw_bytes: usize,
        launch: crate::cuda_cmd::KernelLaunch,
    ) -> Result<(f64, Vec<serde_json::Value>)> {
        use redlite_cuda::kernel_bench::{bench_matvec, read_bandwidth, Acts, KernelBenchOptions};
        let crate::cuda_cmd::KernelLaunch { acts, pdl, split } = launch;
        let gpu = Gpu::new(0).context("opening the CUDA device")?;
        eprintln!("{}", gpu.info);
        let bw = read_bandwidth(&gpu, bw_bytes, reps).context("read bandwidth")?;
        let mut rows = Vec::with_capacity(specs.len());
        for &(ty, r, c) in specs {
            let o = KernelBenchOptions {
                ty,
                rows: r,
                cols: c,
                tokens,
                working_set,
                reps,
                acts: match acts {
                    Some("q8") => Acts::Q8,
                    Some(_) => Acts::F32,
                    None => Acts::for_decode(ty, c),
                },
                pdl,
                split,
            };
            let b = bench_matvec(&gpu, o).with_context(|| format!("{} {r}x{c}", ty.name()))?;
            rows.push(serde_json::json!({
                "type": ty.name(), "rows": r, "cols": c, "tokens": tokens, "parts": b.parts,
                "warp_rows": b.warp_rows,
                "kernel": b.kernel, "pdl": pdl,
                "matrices": b.matrices, "us_per_call": b.call_s * 1e6, "gbps": b.gbps,
                "tflops": b.tflops,
            }));
        }
        Ok((bw, rows))
    }

    /// `spec-bench verify --backend cuda`: after a `context`-token prompt, a verify pass of
    /// `k + 1` rows (then `keep(1)`, so every pass starts at the same position) against a
    /// one-token decode step (graph replay), medians of `reps`.
    pub fn verify_cost(
        file: Arc<GgufFile>,
        context: usize,
        ks: &[usize],
        reps: usize,
        mem: GpuMem,
    ) -> Result<Vec<VerifyCost>> {
        let rows_max = ks.iter().max().copied().unwrap_or(0) + 1;
        if rows_max > redlite_cuda::MAX_VERIFY_ROWS {
            anyhow::bail!(
                "K up to {} on the GPU (got {})",
                redlite_cuda::MAX_VERIFY_ROWS - 1,
                rows_max - 1
            );
        }
        let context = context.max(1);
        let mut mo = options(context + rows_max + reps + 8, context.max(rows_max));
        mo.max_verify = rows_max;
        let mut model = open(file, mo, mem)?;
        let prompt = bench_tokens(context, model.config.vocab, 3);
        let greedy = GpuSampling::greedy();
        model.prefill(&prompt)?;
        let token = model.sample_last(&greedy, 0.0)?;
        // Every pass starts at the prompt's end (`skip_to`; the values are a bench's, the work
        // is a real pass's). The decode step: captured once, then timed as the graph replay it
        // is in generation.
        let p0 = model.pos();
        model.decode(token, &greedy, 0.0)?;
        let mut out = Vec::with_capacity(ks.len());
        for &k in ks {
            let rows: Vec<u32> = bench_tokens(k + 1, model.config.vocab, 4);
            // One untimed pass (first use of this row count), then the timed ones.
            model.skip_to(p0)?;
            model.verify_greedy(&rows)?;
            // The trace build (REDLITE_CUDA_DEFINES=REDLITE_TRACE): the kernels' phases over
            // this row count's passes and the decode steps between them.
            let tracing = redlite_cuda::kernels::trace_on();
            if tracing {
                model.trace(true)?;
            }
            let (mut v, mut d) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
            for _ in 0..reps.max(1) {
                model.skip_to(p0)?;
                let t = Instant::now();
                model.verify_greedy(&rows)?;
                v.push(t.elapsed().as_secs_f64());
                model.skip_to(p0)?;
                let t = Instant::now();
                model.decode(token, &greedy, 0.0)?;
                d.push(t.elapsed().as_secs_f64());
            }
            if tracing {
                eprintln!("trace: verify passes of {} rows and 1-row steps", k + 1);
                print_trace(&model.trace(false)?, &model);
            }
            out.push(VerifyCost {
                k,
                verify_ms: median(&v) * 1e3,
                decode_ms: median(&d) * 1e3,
            });
        }
        Ok(out)
    }
}

pub use imp::*;
