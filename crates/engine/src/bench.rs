//! Benchmarks: the machine's memory read bandwidth (a STREAM-like sum over a buffer much larger
//! than the caches), matrix-vector kernel throughput, and model decode / prefill speed.
//!
//! Decode at batch 1 is bound by memory bandwidth: every token reads the dense weights, the
//! chosen experts and the head once. Each result therefore carries the bytes it read, so that
//! GB/s and the fraction of the measured bandwidth can be reported next to tok/s.
//!
//! Timings are measurements, never test assertions. Everything here is generic over
//! [`Backend`]; the CLI picks the backend (see [`crate::backends`]).

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use redlite_gguf::quant::random::{fill_random_blocks, QuantRng};
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::backend::{Backend, LinearData, LinearSource};
use redlite_model::sizing::ModelSizes;
use redlite_model::{Mode, Model, ModelError, Oracle};

use crate::backends::{BackendChoice, CacheStats};
use redlite_cpu::CpuBackend;

/// Progress of a benchmark: `(stage, done, total)`; `total` 0 means unknown.
pub type Progress<'a> = &'a mut (dyn FnMut(&str, u64, u64) + Send);

/// A progress sink that ignores everything.
pub fn no_progress(_: &str, _: u64, _: u64) {}

/// Median of a non-empty list (the mean of the two middle values for an even count); 0 if empty.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}

// ---------------------------------------------------------------------------------------------
// Memory bandwidth.

/// Result of [`measure_read_bandwidth`].
#[derive(Debug, Clone)]
pub struct Bandwidth {
    /// Size of the buffer read per run.
    pub buffer_bytes: u64,
    pub threads: usize,
    /// GB/s (10⁹ bytes per second) of each timed run.
    pub runs_gbps: Vec<f64>,
    /// Median of `runs_gbps`.
    pub gbps: f64,
}

/// Sum of a slice of u64 with eight independent accumulators (vectorisable, memory-bound).
fn read_sum(s: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0u64, |a, &b| a.wrapping_add(b));
    acc.iter().fold(tail, |a, &b| a.wrapping_add(b))
}

/// A buffer for STREAM-like read runs: `threads` threads each sum their share of it. The pages
/// are first touched by the thread that later reads them (real and local pages).
pub struct ReadProbe {
    buf: Vec<u64>,
    per: usize,
    threads: usize,
}

impl ReadProbe {
    /// A probe of `buffer_bytes` (much larger than the last-level cache: 1 GiB is a good default).
    pub fn new(buffer_bytes: usize, threads: usize) -> ReadProbe {
        let threads = threads.max(1);
        let words = (buffer_bytes / 8).max(threads * 8);
        // A zeroed allocation maps the shared zero page: each thread then writes its own share.
        let mut buf: Vec<u64> = vec![0; words];
        let per = words.div_ceil(threads);
        std::thread::scope(|s| {
            for (t, part) in buf.chunks_mut(per).enumerate() {
                s.spawn(move || {
                    for (i, w) in part.iter_mut().enumerate() {
                        *w = (t * per + i) as u64 | 1;
                    }
                });
            }
        });
        ReadProbe { buf, per, threads }
    }

    pub fn bytes(&self) -> u64 {
        (self.buf.len() * 8) as u64
    }

    /// One timed read of the whole buffer by all threads at once: GB/s.
    pub fn run(&self) -> f64 {
        let barrier = Barrier::new(self.threads + 1);
        let start = std::thread::scope(|s| {
            for part in self.buf.chunks(self.per) {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    black_box(read_sum(black_box(part)));
                });
            }
            barrier.wait();
            Instant::now()
        });
        let secs = start.elapsed().as_secs_f64();
        self.bytes() as f64 / secs.max(1e-9) / 1e9
    }
}

/// Measures the memory read bandwidth the way STREAM's read kernels do ([`ReadProbe`]): `runs`
/// timed runs after one warm-up run; reports the median GB/s.
pub fn measure_read_bandwidth(
    buffer_bytes: usize,
    threads: usize,
    runs: usize,
    progress: Progress,
) -> Bandwidth {
    let probe = ReadProbe::new(buffer_bytes, threads);
    let runs = runs.max(1);
    let mut runs_gbps = Vec::with_capacity(runs);
    for r in 0..=runs {
        progress("memory bandwidth", r as u64, runs as u64 + 1);
        let gbps = probe.run();
        if r > 0 {
            runs_gbps.push(gbps);
        }
    }
    progress("memory bandwidth", runs as u64 + 1, runs as u64 + 1);
    let gbps = median(&runs_gbps);
    Bandwidth {
        buffer_bytes: probe.bytes(),
        threads: probe.threads,
        runs_gbps,
        gbps,
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels.

/// A matrix shape to benchmark: `rows` outputs of `cols` inputs, of type `ty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSpec {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

/// Result of [`bench_kernel`].
#[derive(Debug, Clone)]
pub struct KernelResult {
    pub spec: KernelSpec,
    /// Distinct random matrices cycled through, so that the working set exceeds the caches.
    pub matrices: usize,
    /// Bytes of quantized weights read per pass (all matrices once).
    pub bytes_per_pass: u64,
    /// Timed passes.
    pub passes: usize,
    /// Median time of one matrix-vector product.
    pub per_matvec: Duration,
    /// GB/s of quantized weight bytes, from the median pass.
    pub gbps: f64,
    /// With a [`ReadProbe`]: one bandwidth run after each timed pass, and the median over the
    /// passes of (pass GB/s / the run right after it): the fraction of the bandwidth measured
    /// side by side, which a machine whose load changes during the bench moves far less than
    /// the ratio of two medians taken at different times.
    pub paired: Option<PairedBandwidth>,
}

/// See [`KernelResult::paired`].
#[derive(Debug, Clone)]
pub struct PairedBandwidth {
    pub runs_gbps: Vec<f64>,
    pub fraction: f64,
}

/// One kernel shape per weight type of `file`, taken from that type's largest tensor of at least
/// two dimensions: `cols` = ne0, `rows` = ne1 (one expert's slab for the 3-D expert tensors, the
/// shape the model multiplies by). Sorted by type id.
pub fn kernel_specs_from_file(file: &GgufFile) -> Vec<KernelSpec> {
    let mut best: std::collections::BTreeMap<u32, (u64, KernelSpec)> = Default::default();
    for t in file.tensors() {
        // Matrices only: the conv taps are 2-D but never multiplied as a matrix.
        if t.dims.len() < 2 || t.dims[1] < 2 || t.name.contains("ssm_conv1d") {
            continue;
        }
        let spec = KernelSpec {
            ty: t.ty,
            rows: t.dims[1] as usize,
            cols: t.dims[0] as usize,
        };
        let e = best.entry(t.ty.id()).or_insert((0, spec));
        if t.n_bytes > e.0 {
            *e = (t.n_bytes, spec);
        }
    }
    best.into_values().map(|(_, s)| s).collect()
}

/// Times `W · x` for random valid matrices of `spec` on `backend`: enough distinct matrices to
/// make `working_set_bytes` of quantized weights (at least one), one warm-up pass, then
/// `passes` timed passes over all of them. Reports GB/s of quantized weight bytes read.
///
/// With `probe`, every timed pass is followed by one bandwidth run ([`KernelResult::paired`]).
pub fn bench_kernel<B: Backend>(
    backend: &B,
    spec: KernelSpec,
    working_set_bytes: u64,
    passes: usize,
    seed: u64,
    probe: Option<&ReadProbe>,
    progress: Progress,
) -> Result<KernelResult, ModelError> {
    let bad = |message: String| ModelError::Tensor {
        tensor: format!("bench {} {}x{}", spec.ty, spec.rows, spec.cols),
        message,
    };
    let row_bytes = spec.ty.row_bytes(spec.cols as u64).ok_or_else(|| {
        bad(format!(
            "{} columns are not whole {} blocks",
            spec.cols, spec.ty
        ))
    })?;
    let bytes = row_bytes * spec.rows as u64;
    if bytes == 0 {
        return Err(bad("empty matrix".into()));
    }
    let matrices = working_set_bytes.div_ceil(bytes).max(1) as usize;
    let stage = format!("{} {}x{}", spec.ty, spec.rows, spec.cols);
    let mut rng = QuantRng::new(seed);
    let mut weights = Vec::with_capacity(matrices);
    for m in 0..matrices {
        progress(&format!("{stage}: preparing"), m as u64, matrices as u64);
        let mut data = vec![0u8; bytes as usize];
        fill_random_blocks(spec.ty, &mut data, &mut rng).map_err(|e| bad(e.to_string()))?;
        weights.push(backend.load_linear(LinearSource {
            name: format!("bench[{m}]"),
            ty: spec.ty,
            rows: spec.rows,
            cols: spec.cols,
            data: LinearData::Owned(data),
            expert: None,
        })?);
    }
    let x: Vec<f32> = (0..spec.cols).map(|_| rng.normal(0.0, 1.0)).collect();
    let mut y = vec![0.0f32; spec.rows];

    let passes = passes.max(1);
    let mut pass_secs = Vec::with_capacity(passes);
    let mut probe_gbps = Vec::with_capacity(passes);
    for p in 0..=passes {
        progress(&stage, p as u64, passes as u64 + 1);
        let t0 = Instant::now();
        // Inside one pass, as a decode step runs its products (the CPU backend keeps its pool
        // warm during a pass; outside one, every product's parallel region woke a sleeping
        // thread: IQ2_XXS 512x2048 at 2 threads ran 32 µs a product, about one thread's rate).
        backend.run_pass(|| {
            for w in &weights {
                backend.linear(w, black_box(&x), 1, &mut y);
                black_box(&mut y);
            }
        });
        if p > 0 {
            pass_secs.push(t0.elapsed().as_secs_f64());
            if let Some(probe) = probe {
                probe_gbps.push(probe.run());
            }
        }
    }
    progress(&stage, passes as u64 + 1, passes as u64 + 1);
    let pass = median(&pass_secs);
    let bytes_per_pass = bytes * matrices as u64;
    let gbps_of = |secs: f64| bytes_per_pass as f64 / secs.max(1e-12) / 1e9;
    let paired = probe.map(|_| {
        let ratios: Vec<f64> = pass_secs
            .iter()
            .zip(&probe_gbps)
            .map(|(&secs, &bw)| gbps_of(secs) / bw.max(1e-12))
            .collect();
        PairedBandwidth {
            fraction: median(&ratios),
            runs_gbps: probe_gbps.clone(),
        }
    });
    Ok(KernelResult {
        spec,
        matrices,
        bytes_per_pass,
        passes,
        per_matvec: Duration::from_secs_f64(pass / matrices as f64),
        gbps: gbps_of(pass),
        paired,
    })
}

/// [`bench_kernel`] on the backend `choice` names (`threads` sizes the CPU pool, 0 = physical
/// cores). A new backend gets its arm here, next to [`crate::backends::load_model_from`].
pub fn bench_kernel_on(
    choice: BackendChoice,
    threads: usize,
    spec: KernelSpec,
    (working_set_bytes, passes, seed): (u64, usize, u64),
    probe: Option<&ReadProbe>,
    progress: Progress,
) -> Result<KernelResult, ModelError> {
    match choice {
        BackendChoice::Oracle => bench_kernel(
            &Oracle,
            spec,
            working_set_bytes,
            passes,
            seed,
            probe,
            progress,
        ),
        BackendChoice::Cpu => bench_kernel(
            &CpuBackend::try_with_threads_and_cache(threads, Default::default())
                .map_err(|e| ModelError::Backend(e.to_string()))?,
            spec,
            working_set_bytes,
            passes,
            seed,
            probe,
            progress,
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// Model decode and prefill.

/// `n` deterministic token ids spread over the vocabulary (below the special tokens of Qwen3).
pub fn bench_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let limit = vocab.clamp(1, 151_643) as u64;
    let mut rng = QuantRng::new(seed);
    (0..n).map(|_| (rng.next_u64() % limit) as u32).collect()
}

/// Result of [`bench_decode`].
#[derive(Debug, Clone)]
pub struct DecodeResult {
    pub backend: &'static str,
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    /// Decode steps timed (one token each).
    pub steps: usize,
    pub decode_time: Duration,
    /// Median time of one step.
    pub median_step: Duration,
    pub tok_per_s: f64,
    /// Weight bytes one decode step reads (dense + top-k experts + head + one embedding row).
    pub bytes_per_token: u64,
    /// `bytes_per_token × tok/s`.
    pub gbps: f64,
}

/// Argmax with the lowest index on ties.
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Runs a `prompt_len`-token prompt, then `steps` greedy decode steps, each timed.
pub fn bench_decode<B: Backend>(
    model: &Model<B>,
    prompt_len: usize,
    steps: usize,
    progress: Progress,
) -> Result<DecodeResult, ModelError> {
    bench_decode_with(model, prompt_len, steps, progress, &()).map(|(r, _)| r)
}

/// [`bench_decode`], also reporting what the expert cache did during the decode steps and the
/// routing those steps had (from `probe`, usually the [`crate::AnyModel`] that holds `model`).
pub fn bench_decode_with<B: Backend>(
    model: &Model<B>,
    prompt_len: usize,
    steps: usize,
    progress: Progress,
    probe: &dyn ExpertProbe,
) -> Result<(DecodeResult, ExpertReport), ModelError> {
    let sizes = ModelSizes::new(&model.file, &model.config)?;
    let bytes_per_token = sizes.decode.total();
    let prompt = bench_tokens(prompt_len.max(1), model.config.vocab, 1);
    let mut state = model.new_state();

    progress("prompt", 0, 0);
    let t0 = Instant::now();
    let mut logits = model
        .last_logits(&mut state, &prompt, Mode::Prefill)?
        .unwrap_or_default();
    let prompt_time = t0.elapsed();

    let mut step_secs = Vec::with_capacity(steps);
    let before = probe.cache_stats();
    probe.set_trace(true);
    let mut traces = Vec::with_capacity(steps);
    // All steps in one pass on the backend's threads (see `Backend::run_pass`): one hand-off
    // for the run instead of one per token, as a generation loop does.
    model.backend.run_pass(|| -> Result<(), ModelError> {
        for s in 0..steps {
            progress("decode", s as u64, steps as u64);
            let token = argmax(&logits);
            let t = Instant::now();
            logits = model
                .forward(&mut state, &[token], Mode::Step)?
                .pop()
                .unwrap_or_default();
            step_secs.push(t.elapsed().as_secs_f64());
            traces.push(probe.take_trace());
        }
        Ok(())
    })?;
    probe.set_trace(false);
    let cache = match (before, probe.cache_stats()) {
        (Some(b), Some(a)) => Some(a.since(&b)),
        _ => None,
    };
    let routing = RoutingStats::of(&traces, model.config.n_experts);
    progress("decode", steps as u64, steps as u64);
    let total: f64 = step_secs.iter().sum();
    let tok_per_s = if steps == 0 {
        0.0
    } else {
        steps as f64 / total.max(1e-12)
    };
    let result = DecodeResult {
        backend: model.backend.name(),
        prompt_tokens: prompt.len(),
        prompt_time,
        steps,
        decode_time: Duration::from_secs_f64(total),
        median_step: Duration::from_secs_f64(median(&step_secs)),
        tok_per_s,
        bytes_per_token,
        gbps: bytes_per_token as f64 * tok_per_s / 1e9,
    };
    Ok((result, ExpertReport { cache, routing }))
}

/// What a decode bench can ask of the expert cache (no-op for `()`).
pub trait ExpertProbe: Sync {
    fn cache_stats(&self) -> Option<CacheStats>;
    fn set_trace(&self, on: bool);
    /// The `(block, expert)` pairs requested since the last call.
    fn take_trace(&self) -> Vec<(usize, usize)>;
}

impl ExpertProbe for () {
    fn cache_stats(&self) -> Option<CacheStats> {
        None
    }
    fn set_trace(&self, _: bool) {}
    fn take_trace(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }
}

/// The expert cache and the routing during the timed decode steps.
#[derive(Debug, Clone)]
pub struct ExpertReport {
    /// Counters over the decode steps (`None` without a cache).
    pub cache: Option<CacheStats>,
    /// `None` when no routing was recorded.
    pub routing: Option<RoutingStats>,
}

/// Routing statistics of a run of decode tokens (from the experts each token requested).
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingStats {
    pub tokens: usize,
    pub layers: usize,
    pub experts_per_layer: usize,
    /// Distinct experts a block used over the run: mean, min, max over blocks.
    pub distinct_mean: f64,
    pub distinct_min: usize,
    pub distinct_max: usize,
    /// Entropy of a block's expert-use distribution in bits, mean over blocks (uniform routing
    /// over 512 experts: 9 bits).
    pub entropy_bits: f64,
    /// Reuse distance in tokens (tokens since the same expert of the same block last ran),
    /// median and 90th percentile over every reuse.
    pub reuse_tokens_median: f64,
    pub reuse_tokens_p90: f64,
    /// LRU stack distance (distinct experts of the block used since this one last ran; a
    /// per-block LRU cache of more than d slots hits), median and 90th percentile.
    pub stack_distance_median: f64,
    pub stack_distance_p90: f64,
    /// Accesses that were first uses (compulsory misses of any cache).
    pub first_use_fraction: f64,
}

impl RoutingStats {
    /// From per-token traces of `(block, expert)` requests.
    pub fn of(traces: &[Vec<(usize, usize)>], n_experts: usize) -> Option<RoutingStats> {
        let layers = traces.iter().flatten().map(|&(l, _)| l + 1).max()?;
        let mut counts = vec![vec![0u64; n_experts.max(1)]; layers];
        let mut last_token: Vec<Vec<Option<usize>>> = vec![vec![None; n_experts.max(1)]; layers];
        let mut recency: Vec<Vec<usize>> = vec![Vec::new(); layers];
        let (mut reuse, mut stack) = (Vec::new(), Vec::new());
        let (mut accesses, mut first) = (0usize, 0usize);
        for (t, trace) in traces.iter().enumerate() {
            for &(l, e) in trace {
                let e = e.min(n_experts.max(1) - 1);
                accesses += 1;
                counts[l][e] += 1;
                match last_token[l][e] {
                    Some(t0) => reuse.push((t - t0) as f64),
                    None => first += 1,
                }
                last_token[l][e] = Some(t);
                let r = &mut recency[l];
                if let Some(d) = r.iter().position(|&x| x == e) {
                    stack.push(d as f64);
                    r.remove(d);
                }
                r.insert(0, e);
            }
        }
        let distinct: Vec<usize> = counts
            .iter()
            .map(|c| c.iter().filter(|&&n| n > 0).count())
            .collect();
        let used: Vec<&Vec<u64>> = counts.iter().filter(|c| c.iter().any(|&n| n > 0)).collect();
        let entropy = |c: &Vec<u64>| {
            let total: u64 = c.iter().sum();
            c.iter()
                .filter(|&&n| n > 0)
                .map(|&n| {
                    let p = n as f64 / total as f64;
                    -p * p.log2()
                })
                .sum::<f64>()
        };
        let pct = |v: &mut Vec<f64>, q: f64| {
            if v.is_empty() {
                return f64::NAN;
            }
            v.sort_by(f64::total_cmp);
            v[((v.len() - 1) as f64 * q).round() as usize]
        };
        let active: Vec<usize> = distinct.iter().copied().filter(|&d| d > 0).collect();
        Some(RoutingStats {
            tokens: traces.len(),
            layers: used.len(),
            experts_per_layer: n_experts,
            distinct_mean: active.iter().sum::<usize>() as f64 / active.len().max(1) as f64,
            distinct_min: active.iter().copied().min().unwrap_or(0),
            distinct_max: active.iter().copied().max().unwrap_or(0),
            entropy_bits: used.iter().map(|c| entropy(c)).sum::<f64>() / used.len().max(1) as f64,
            reuse_tokens_median: pct(&mut reuse, 0.5),
            reuse_tokens_p90: pct(&mut reuse, 0.9),
            stack_distance_median: pct(&mut stack, 0.5),
            stack_distance_p90: pct(&mut stack, 0.9),
            first_use_fraction: first as f64 / accesses.max(1) as f64,
        })
    }
}

/// Result of [`bench_prefill`].
#[derive(Debug, Clone)]
pub struct PrefillResult {
    pub backend: &'static str,
    pub tokens: usize,
    pub runs: usize,
    /// Median time of one prompt pass (hidden states of every token, logits of the last).
    pub time: Duration,
    pub tok_per_s: f64,
}

/// Times a `tokens`-token prompt pass from an empty state, `runs` times; reports the median.
/// Like a real prompt ingestion, only the last token's logits are computed.
pub fn bench_prefill<B: Backend>(
    model: &Model<B>,
    tokens: usize,
    runs: usize,
    progress: Progress,
) -> Result<PrefillResult, ModelError> {
    let prompt = bench_tokens(tokens.max(1), model.config.vocab, 2);
    let runs = runs.max(1);
    let mut secs = Vec::with_capacity(runs);
    for r in 0..runs {
        progress("prefill", r as u64, runs as u64);
        let mut state = model.new_state();
        let t0 = Instant::now();
        black_box(model.last_logits(&mut state, &prompt, Mode::Prefill)?);
        secs.push(t0.elapsed().as_secs_f64());
    }
    progress("prefill", runs as u64, runs as u64);
    let time = median(&secs);
    Ok(PrefillResult {
        backend: model.backend.name(),
        tokens: prompt.len(),
        runs,
        time: Duration::from_secs_f64(time),
        tok_per_s: prompt.len() as f64 / time.max(1e-12),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_argmax() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn read_sum_matches_a_plain_sum() {
        let v: Vec<u64> = (0..1003).collect();
        assert_eq!(read_sum(&v), 1003 * 1002 / 2);
    }

    #[test]
    fn bandwidth_and_kernel_run_small() {
        let bw = measure_read_bandwidth(1 << 20, 2, 2, &mut no_progress);
        assert_eq!(bw.runs_gbps.len(), 2);
        assert!(bw.gbps > 0.0);
        let spec = KernelSpec {
            ty: GgmlType::Q4K,
            rows: 8,
            cols: 512,
        };
        let probe = ReadProbe::new(1 << 20, 2);
        let r = bench_kernel(&Oracle, spec, 10_000, 2, 1, Some(&probe), &mut no_progress).unwrap();
        assert_eq!(r.bytes_per_pass, r.matrices as u64 * 8 * 2 * 144);
        assert!(r.matrices >= 2);
        let paired = r.paired.expect("a probe was given");
        assert_eq!(paired.runs_gbps.len(), 2);
        assert!(paired.fraction > 0.0 && paired.fraction.is_finite());
        let bad = KernelSpec { cols: 100, ..spec };
        assert!(bench_kernel(&Oracle, bad, 1, 1, 1, None, &mut no_progress).is_err());
    }
}
