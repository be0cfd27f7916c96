//! [`CpuBackend`]: the model's [`Backend`] on the fast CPU kernels. Weights stay in their quantized
//! GGUF form, read in place from the memory map; activations are quantized to 8 bits per product
//! where the weight type calls for it. Routed experts come through the expert cache
//! (`redlite-expert-cache`): unbounded (the default), it hands out the map's bytes, so the experts
//! of a 20 GB file are never copied; bounded, it streams them into RAM slots from the file.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use redlite_expert_cache::{
    CacheConfig, CacheShape, CacheStats, ExpertBytes, ExpertCache, ExpertRequest, Key,
};
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::backend::{
    add_shared_expert, swiglu, Backend, ExpertTag, LinearData, LinearSource,
};
use redlite_model::delta_rule::{DeltaRule, HeadInputs};
use redlite_model::state::KvCache;
use redlite_model::weights::FfnWeights;
use redlite_model::ModelError;

use crate::kernels::driver;
use crate::kernels::fused::{self, Product};
use crate::kernels::tiles_x86::DecodeTiles;

/// Where a weight's bytes live.
enum Bytes {
    /// In place in the memory-mapped file.
    Mapped(Arc<GgufFile>, Range<usize>),
    /// Rearranged at load (the legacy DeltaNet layout).
    Owned(Vec<u8>),
}

/// One linear layer, quantized.
pub struct CpuLinear {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    bytes: Bytes,
    /// Set for routed-expert slabs, which are read through the expert cache.
    expert: Option<ExpertTag>,
    /// A Q4_K or Q6_K matrix of a small file, repacked for one-row products
    /// ([`decode_tiles_max_bytes`]).
    tiles: Option<DecodeTiles>,
}

impl CpuLinear {
    /// The bytes in the map (for a routed expert, the kernels read the expert cache's copy).
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(file, range) => &file.bytes()[range.clone()],
            Bytes::Owned(v) => v,
        }
    }
}

/// The fast CPU backend. Threads come from one persistent pool (rayon's global pool, sized by
/// [`CpuBackend::with_threads`] or to the physical cores). A backend serves one model: its expert
/// cache is built when that model's weights are loaded; a clone has the same settings and its
/// own (unbuilt) cache.
pub struct CpuBackend {
    config: CacheConfig,
    /// The experts' shape, gathered by `load_linear`.
    shape: Mutex<CacheShape>,
    /// Routers and expert slabs by block, gathered by `load_linear` for the predictor.
    seen: Mutex<Seen>,
    cache: OnceLock<Box<ExpertCache>>,
    /// Guesses the next block's experts (only for a cache that prefetches).
    predictor: OnceLock<Predictor>,
}

/// A router or expert slab as `load_linear` saw it: type, shape and file range.
#[derive(Debug, Clone)]
struct SeenLinear {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    range: Range<usize>,
}

/// What `load_linear` saw of the routing: each block's router, each expert's slab ranges.
#[derive(Debug, Default)]
struct Seen {
    routers: BTreeMap<usize, SeenLinear>,
    slabs: BTreeMap<(usize, usize), [Option<Range<usize>>; 3]>,
}

/// Cross-layer prefetch: block `l + 1`'s router applied to block `l`'s MoE input ranks
/// `l + 1`'s experts before `l + 1` runs its mixer (the residual stream changes little from one
/// block to the next). A guess only decides what the cache loads early.
struct Predictor {
    file: Arc<GgufFile>,
    /// Per block, its router (`[experts, hidden]`).
    routers: Vec<Option<SeenLinear>>,
    /// Per block and expert, the file ranges of gate, up and down.
    slabs: Vec<Vec<[Range<usize>; 3]>>,
}

/// How many of the next block's experts to guess for a block that routes to `k`: the 60 % most
/// likely. On the 36-layer near-uniform file the lower-ranked guesses are wrong more often (each
/// wrong guess costs a read and evicts a slot): 6 of 10 read 317 MB/token for a 74.5 % hit rate
/// and 4.34 tok/s, all 10 read 378 MB/token for 73.8 % and 4.13 tok/s (docs/expert-cache.md).
fn guesses_for(k: usize) -> usize {
    (k * 3).div_ceil(5).max(1)
}

impl Predictor {
    /// From what the loader saw; `None` unless every block with experts has a router and all
    /// of its experts' slabs.
    fn new(file: Arc<GgufFile>, seen: &Seen, layers: usize) -> Option<Predictor> {
        let mut routers = vec![None; layers];
        let mut slabs: Vec<Vec<[Range<usize>; 3]>> = vec![Vec::new(); layers];
        for (&(layer, expert), parts) in &seen.slabs {
            let list = slabs.get_mut(layer)?;
            if expert != list.len() {
                return None;
            }
            let [g, u, d] = parts.clone();
            list.push([g?, u?, d?]);
        }
        for (l, r) in routers.iter_mut().enumerate() {
            *r = seen
                .routers
                .get(&l)
                .filter(|r| r.rows == slabs[l].len())
                .cloned();
        }
        Some(Predictor {
            file,
            routers,
            slabs,
        })
    }

    /// Block `layer + 1`'s experts, most likely first (`count` of them), for input `x` of block
    /// `layer`'s MoE; empty when there is no such block or router.
    fn guess(&self, layer: usize, x: &[f32], count: usize) -> Vec<ExpertRequest> {
        let next = layer + 1;
        let Some(Some(router)) = self.routers.get(next) else {
            return Vec::new();
        };
        if router.cols != x.len() {
            return Vec::new();
        }
        let mut logits = vec![0.0f32; router.rows];
        let w = &self.file.bytes()[router.range.clone()];
        run_linear(router.ty, w, (router.rows, router.cols), x, 1, &mut logits);
        let mut order: Vec<usize> = (0..router.rows).collect();
        let count = count.min(order.len());
        order.select_nth_unstable_by(count.saturating_sub(1), |&a, &b| {
            logits[b].total_cmp(&logits[a])
        });
        order.truncate(count);
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        order
            .into_iter()
            .map(|e| ExpertRequest {
                key: Key {
                    layer: next as u32,
                    expert: e as u32,
                },
                parts: self.slabs[next][e].clone(),
            })
            .collect()
    }
}

/// `blk.N.ffn_gate_inp.weight` → N.
fn router_block(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?
        .strip_suffix(".ffn_gate_inp.weight")?
        .parse()
        .ok()
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::with_cache_config(CacheConfig::default())
    }
}

impl Clone for CpuBackend {
    fn clone(&self) -> Self {
        CpuBackend::with_cache_config(self.config)
    }
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("expert_cache", &self.config)
            .finish()
    }
}

impl CpuBackend {
    /// A backend whose pool has `threads` threads (0: one per physical core). The pool is process-wide
    /// and can be sized once; later calls keep the first size. Every expert resident.
    pub fn with_threads(threads: usize) -> CpuBackend {
        CpuBackend::with_threads_and_cache(threads, CacheConfig::default())
    }

    /// [`CpuBackend::with_threads`] with an expert cache of the given settings. A pool that cannot
    /// be built (see [`CpuBackend::try_with_threads_and_cache`]) is left to rayon's default.
    pub fn with_threads_and_cache(threads: usize, config: CacheConfig) -> CpuBackend {
        let _ = driver::init_threads(Self::pool_size(threads));
        CpuBackend::with_cache_config(config)
    }

    /// [`CpuBackend::with_threads_and_cache`], failing when the pool of `threads` threads cannot
    /// be built: more than [`driver::MAX_THREADS`], or threads the system cannot start. An
    /// already-built pool is not an error: it is the one persistent pool, and keeps its size.
    pub fn try_with_threads_and_cache(
        threads: usize,
        config: CacheConfig,
    ) -> Result<CpuBackend, driver::KernelError> {
        driver::init_threads(Self::pool_size(threads))?;
        Ok(CpuBackend::with_cache_config(config))
    }

    /// The pool size for a requested thread count (0: one per physical core).
    fn pool_size(threads: usize) -> usize {
        if threads == 0 {
            driver::physical_cores()
        } else {
            threads
        }
    }

    fn with_cache_config(config: CacheConfig) -> CpuBackend {
        CpuBackend {
            config,
            shape: Mutex::new(CacheShape::default()),
            seen: Mutex::new(Seen::default()),
            cache: OnceLock::new(),
            predictor: OnceLock::new(),
        }
    }

    /// The expert cache's counters (`None` before the weights are loaded).
    pub fn expert_cache_stats(&self) -> Option<CacheStats> {
        self.cache.get().map(|c| c.stats())
    }

    /// Starts or stops recording the routed experts (see [`CpuBackend::take_expert_trace`]).
    pub fn set_expert_trace(&self, on: bool) {
        if let Some(c) = self.cache.get() {
            c.set_trace(on);
        }
    }

    /// The experts requested since the last call, in order, as (block, expert).
    pub fn take_expert_trace(&self) -> Vec<Key> {
        self.cache.get().map(|c| c.take_trace()).unwrap_or_default()
    }

    /// Notes a router or an expert slab in the map, for the [`Predictor`].
    fn see(&self, src: &LinearSource) {
        let LinearData::Mapped { range, .. } = &src.data else {
            return;
        };
        let linear = SeenLinear {
            ty: src.ty,
            rows: src.rows,
            cols: src.cols,
            range: range.clone(),
        };
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tag) = src.expert {
            let parts = seen.slabs.entry((tag.layer, tag.expert)).or_default();
            parts[tag.part as usize] = Some(linear.range);
        } else if let Some(block) = router_block(&src.name) {
            seen.routers.insert(block, linear);
        }
    }

    /// The next block's likely experts for this block's MoE input `x` (see [`Predictor`]);
    /// empty without a prefetching cache.
    fn guess_next(&self, experts: &[FfnWeights<Self>], x: &[f32], k: usize) -> Vec<ExpertRequest> {
        match (
            self.predictor.get(),
            experts.first().and_then(|w| w.gate.expert),
        ) {
            (Some(p), Some(tag)) => p.guess(tag.layer, x, guesses_for(k)),
            _ => Vec::new(),
        }
    }

    /// Runs `f` over the experts `ids` of one block in rounds of experts resident together
    /// (indices into `ids`, their gate/up/down bytes), and starts prefetching `ahead` once the
    /// first round is pinned. Without a cache (weights not loaded through `Weights::load`) the
    /// bytes are the linears' own.
    fn with_experts<F>(
        &self,
        experts: &[FfnWeights<Self>],
        ids: &[usize],
        ahead: &[ExpertRequest],
        mut f: F,
    ) where
        F: FnMut(&[usize], &[ExpertBytes]),
    {
        let requests: Option<Vec<ExpertRequest>> =
            ids.iter().map(|&e| expert_request(&experts[e])).collect();
        match (self.cache.get(), requests) {
            (Some(cache), Some(requests)) => cache
                .run_then_prefetch(&requests, ahead, f)
                .unwrap_or_else(|e| panic!("expert cache: {e}")),
            _ => {
                let bytes: Vec<ExpertBytes> = ids
                    .iter()
                    .map(|&e| {
                        let w = &experts[e];
                        [w.gate.bytes(), w.up.bytes(), w.down.bytes()]
                    })
                    .collect();
                let idx: Vec<usize> = (0..ids.len()).collect();
                f(&idx, &bytes);
            }
        }
    }

    /// `down_e(silu(gate_e·x) ⊙ up_e·x)` for each expert `e` of `ids`, its weights in `bytes`: gate
    /// and up of every expert in one parallel pass over the same quantized x, then every down.
    /// With `shared`, the shared expert's three products ride along in the same two passes (its
    /// output last): its memory-bound dense rows overlap the routed experts' compute-bound ones,
    /// and the three parallel regions of its own are saved.
    fn expert_outputs(
        &self,
        experts: &[FfnWeights<Self>],
        ids: &[usize],
        bytes: &[ExpertBytes],
        shared: Option<&FfnWeights<Self>>,
        x: &[f32],
    ) -> Vec<Vec<f32>> {
        let mut ffns: Vec<(&FfnWeights<Self>, ExpertBytes, &[usize])> = ids
            .iter()
            .zip(bytes)
            .map(|(&e, &b)| (&experts[e], b, &[0usize][..]))
            .collect();
        if let Some(w) = shared {
            ffns.push((w, [w.gate.bytes(), w.up.bytes(), w.down.bytes()], &[0]));
        }
        ffn_outputs(&ffns, &[x])
            .into_iter()
            .map(|mut y| y.pop().unwrap_or_default())
            .collect()
    }
}

/// `down(silu(gate·x_t) ⊙ up·x_t)` of each feed-forward `(weights, their bytes, tokens)` for each
/// of its tokens `t` (indices into `xs`): `[ffn][its token][rows]`. Every (feed-forward, token)
/// pair is a product of its own in two parallel regions (gate and up of every pair over the
/// tokens' activations quantized once each, then every down), so each output is the one-token
/// path's ([`CpuBackend::expert_outputs`]) bit for bit.
fn ffn_outputs<'a>(
    ffns: &[(&'a FfnWeights<CpuBackend>, ExpertBytes<'a>, &[usize])],
    xs: &[&[f32]],
) -> Vec<Vec<Vec<f32>>> {
    fn product<'a>(w: &'a CpuLinear, bytes: &'a [u8], input: usize) -> Product<'a> {
        Product {
            ty: w.ty,
            w: bytes,
            rows: w.rows,
            cols: w.cols,
            input,
            tiles: w.tiles.as_ref(),
        }
    }
    let mut products = Vec::new();
    for (ffn, b, tokens) in ffns {
        for &t in tokens.iter() {
            products.push(product(&ffn.gate, b[0], t));
            products.push(product(&ffn.up, b[1], t));
        }
    }
    let mut gate_up = vec![Vec::new(); products.len()];
    fused::matvec_batch(&products, xs, &mut gate_up)
        .unwrap_or_else(|e| panic!("expert gate/up: {e}"));
    let act = |gu: &[Vec<f32>]| -> Vec<f32> { silu_times(&gu[0], &gu[1]) };
    // One exp per value (≈ 5.6k at full size): on the pool when there are that many.
    let values: usize = gate_up.iter().map(Vec::len).sum::<usize>() / 2;
    let acts: Vec<Vec<f32>> = if values >= 4096 {
        gate_up.par_chunks_exact(2).map(act).collect()
    } else {
        gate_up.chunks_exact(2).map(act).collect()
    };
    let inputs: Vec<&[f32]> = acts.iter().map(|a| a.as_slice()).collect();
    let mut products = Vec::with_capacity(acts.len());
    for (ffn, b, tokens) in ffns {
        for _ in tokens.iter() {
            products.push(product(&ffn.down, b[2], products.len()));
        }
    }
    let mut downs = vec![Vec::new(); products.len()];
    fused::matvec_batch(&products, &inputs, &mut downs)
        .unwrap_or_else(|e| panic!("expert down: {e}"));
    let mut downs = downs.into_iter();
    ffns.iter()
        .map(|(_, _, tokens)| downs.by_ref().take(tokens.len()).collect())
        .collect()
}

/// [`ffn_outputs`] where every feed-forward has Q8_0 tiles (a small model): each token row
/// quantized once, one parallel region for every gate and up over its tokens and one for every
/// down (`fused::q8_0_tiles_jobs`), each weight's tokens through the tile kernel together. The
/// tile kernel's rows do not depend on the rows beside them, so the outputs are the pairs' (the
/// one-token path's) bit for bit, without a product and a task per pair. `None` unless every
/// matrix has tiles.
#[cfg(target_arch = "x86_64")]
fn ffn_outputs_tiled(
    ffns: &[(&FfnWeights<CpuBackend>, ExpertBytes, &[usize])],
    xs: &[&[f32]],
) -> Option<Vec<Vec<f32>>> {
    use crate::kernels::q8::{quantize_row_q8_0, BlockQ8_0, QK8_0};
    use crate::kernels::tiles_x86::{Q80Act, Q80Tiles};
    fn tiles(w: &CpuLinear) -> Option<&Q80Tiles> {
        w.tiles.as_ref().and_then(|t| t.q8_0())
    }
    let ts: Vec<[&Q80Tiles; 3]> = ffns
        .iter()
        .map(|(f, _, _)| Some([tiles(&f.gate)?, tiles(&f.up)?, tiles(&f.down)?]))
        .collect::<Option<_>>()?;
    // As the one-token path quantizes its inputs (`matvec_batch`, Q8_0 tiles).
    let quantize = |x: &[f32]| {
        let mut q = vec![BlockQ8_0::ZERO; x.len() / QK8_0];
        quantize_row_q8_0(x, &mut q);
        q
    };
    let nb = xs.first().map_or(0, |x| x.len() / QK8_0);
    let xq = fused::quantize_rows_q8_0(xs.len(), nb, |i| xs[i]);
    let x_acts: Vec<Q80Act> = xq.iter().map(|q| Q80Act::new(q)).collect();
    let jobs: Vec<(&Q80Tiles, &[usize])> = ts
        .iter()
        .zip(ffns)
        .flat_map(|(t, (_, _, tokens))| [(t[0], *tokens), (t[1], *tokens)])
        .collect();
    let mut gate_up = vec![Vec::new(); jobs.len()];
    fused::q8_0_tiles_jobs(&x_acts, &jobs, &mut gate_up);
    // silu(gate) · up of every (feed-forward, token) pair, quantized for the downs.
    let pair_of: Vec<(usize, usize)> = ffns
        .iter()
        .enumerate()
        .flat_map(|(f, (_, _, tokens))| (0..tokens.len()).map(move |k| (f, k)))
        .collect();
    // The per-row work between the products on the threads too for long runs.
    let aq = crate::team::map_rows(pair_of.len(), |p| {
        let (f, k) = pair_of[p];
        let rows = ts[f][0].rows();
        let (g, u) = (&gate_up[2 * f], &gate_up[2 * f + 1]);
        quantize(&silu_times(
            &g[k * rows..(k + 1) * rows],
            &u[k * rows..(k + 1) * rows],
        ))
    });
    let mut first = 0;
    let pairs: Vec<Vec<usize>> = ffns
        .iter()
        .map(|(_, _, tokens)| {
            first += tokens.len();
            (first - tokens.len()..first).collect()
        })
        .collect();
    let a_acts: Vec<Q80Act> = aq.iter().map(|q| Q80Act::new(q)).collect();
    let jobs: Vec<(&Q80Tiles, &[usize])> = ts
        .iter()
        .zip(&pairs)
        .map(|(t, p)| (t[2], p.as_slice()))
        .collect();
    let mut downs = vec![Vec::new(); jobs.len()];
    fused::q8_0_tiles_jobs(&a_acts, &jobs, &mut downs);
    Some(downs)
}

/// Whether [`CpuBackend::moe_rows`] computes a run's MoE block (at most 128 tokens: a verify
/// pass, not a prompt) itself:
/// * experts with Q8_0 tiles (a small model): always, through [`ffn_outputs_tiled`];
/// * otherwise as (expert, token) pairs when the experts average at most two tokens each. The
///   full-size layout's verify (2 threads, 3 alternating rounds, docs/perf-ledger.md): 2 / 8 /
///   16 / 64 rows −6 / −4 / −3 / −10 % against the grouped products, whose per-expert hand-offs
///   and quantization cost more than the multi-row kernels save there; 128 rows (2.7 tokens an
///   expert) +8 %.
///
/// `REDLITE_MOE_PAIRS=0` / `=1` never / always, for comparisons.
fn pairs_pay(experts: &[FfnWeights<CpuBackend>], chosen: &[Vec<(usize, f32)>]) -> bool {
    static MODE: OnceLock<Option<bool>> = OnceLock::new();
    let mode = *MODE.get_or_init(|| match std::env::var("REDLITE_MOE_PAIRS").as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    });
    if chosen.len() > 128 {
        return false;
    }
    let tiled = experts
        .first()
        .and_then(|w| w.gate.tiles.as_ref())
        .is_some_and(|t| t.q8_0().is_some());
    mode.unwrap_or_else(|| {
        let pairs: usize = chosen.iter().map(Vec::len).sum();
        let mut experts: Vec<usize> = chosen.iter().flatten().map(|&(e, _)| e).collect();
        experts.sort_unstable();
        experts.dedup();
        tiled || pairs <= 2 * experts.len()
    })
}

/// `silu(g) · u` elementwise (the SiLU 16 at a time, same bits as the scalar one).
fn silu_times(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let mut a = gate.to_vec();
    crate::vexp::silu_in_place(&mut a);
    a.iter_mut().zip(up).for_each(|(a, &u)| *a *= u);
    a
}

/// The file ranges of an expert's three slabs, when all three are tagged slabs of the map.
fn expert_request(w: &FfnWeights<CpuBackend>) -> Option<ExpertRequest> {
    let tag = w.gate.expert?;
    let range = |l: &CpuLinear| match &l.bytes {
        Bytes::Mapped(_, r) if l.expert.is_some() => Some(r.clone()),
        _ => None,
    };
    Some(ExpertRequest {
        key: Key {
            layer: tag.layer as u32,
            expert: tag.expert as u32,
        },
        parts: [range(&w.gate)?, range(&w.up)?, range(&w.down)?],
    })
}

/// Passes running now ([`CpuBackend::run_pass`]), across models and callers.
static ACTIVE_PASSES: AtomicUsize = AtomicUsize::new(0);

/// Counts a pass in [`ACTIVE_PASSES`] while it lives.
struct ActivePass;

impl ActivePass {
    fn enter() -> ActivePass {
        ACTIVE_PASSES.fetch_add(1, Ordering::AcqRel);
        ActivePass
    }
}

impl Drop for ActivePass {
    fn drop(&mut self) {
        ACTIVE_PASSES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Sets its flag when dropped (also when the pass unwinds, so the warm-keepers stop).
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs on a pool thread for the length of a pass ([`CpuBackend::run_pass`]): takes the pass's
/// parallel work as soon as it is pushed (`rayon::yield_now`) instead of letting the thread fall
/// asleep between regions and be woken for each one (8-layer decode +3 %, tiny model +11 % on a
/// quiet machine; costs the spinning CPU time; `REDLITE_NO_KEEP_WARM=1` turns it off).
///
/// It returns at once on the pass's own thread (which picked it up while waiting: nothing else
/// would end the pass), and as soon as a second pass runs: a keeper holds its thread until its
/// pass ends, so two passes' keepers nested under each other's passes could wait on each other.
///
/// It also returns after [`keep_warm_idle`] without any work. A keeper can start *nested*: a
/// thread that had not yet picked up its keeper when the pass's first rayon region came (no
/// thread warm, so the region went to rayon) steals part of that region, and while it waits in
/// a `join` inside it, rayon hands it its keeper. That keeper sits on top of work the pass is
/// waiting for, so spinning until the pass ends would never end (seen: `spec-bench rewrite -t 2`
/// hung at 100 % of one core, both threads' stacks as described, 2026-12-01; once before in a
/// perf run). Without the limit nothing else breaks the cycle.
fn keep_warm(done: &AtomicBool, pass_thread: Option<usize>) {
    if rayon::current_thread_index() == pass_thread {
        return;
    }
    let _helper = crate::team::Helper::enter();
    let mut idle = 0u32;
    let mut seen = crate::team::latest_job();
    let mut active = Instant::now();
    while !done.load(Ordering::Acquire) && ACTIVE_PASSES.load(Ordering::Acquire) == 1 {
        // The pass's small regions come as team jobs (see `team`), polled often (one load);
        // the larger ones via rayon, whose poll costs ≈ 0.5 µs (deque steals), once in 16.
        if crate::team::help() {
            idle = 0;
            continue;
        }
        // A new job counts as activity even when the publisher ran all of it: a thread that
        // only counted its own tasks fell into the yielding mode below during a decode run
        // and, on a loaded machine, got the CPU back too late to take any task.
        let job = crate::team::latest_job();
        if job != seen {
            seen = job;
            idle = 0;
        }
        if idle == 0 {
            active = Instant::now();
        }
        idle = idle.saturating_add(1);
        // Once yielding between polls (below), rayon is polled every time: a `sched_yield`
        // costs as much as that poll.
        if (idle.is_multiple_of(RAYON_POLL_EVERY) || idle >= spin_polls())
            && rayon::yield_now() == Some(rayon::Yield::Executed)
        {
            idle = 0;
            continue;
        }
        // Spin briefly, then let other processes have the CPU between checks (and give up
        // after a long idle stretch: see above).
        if idle < spin_polls() {
            std::hint::spin_loop();
        } else if active.elapsed() > keep_warm_idle() {
            return;
        } else {
            std::thread::yield_now();
        }
    }
}

/// Idle polls a warm thread spins through after its last job before it yields the CPU between
/// polls (`REDLITE_WARM_SPIN`, default 64, a few µs; a `sched_yield` returns at once on an idle
/// CPU, so the thread stays as quick to take work there). Spinning for 65536 polls (≈ 2 ms), the
/// process demanded both cores between jobs, and on a loaded machine the scheduler took them back
/// in multi-ms slices in the middle of passes: tiny fixture, 2 threads, load 2.9, mean decode
/// 3580 → 5518 tok/s at 64 (median step unchanged, 8439 / 8387), prefill-512 ≈ 6.0 → 6.8 K tok/s.
fn spin_polls() -> u32 {
    static N: OnceLock<u32> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("REDLITE_WARM_SPIN")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(64)
    })
}

/// How long a keeper ([`keep_warm`]) waits without work before it gives its thread back
/// (`REDLITE_KEEP_WARM_IDLE_US`, default 2,000 µs): far longer than the gaps between a decode
/// pass's regions (tens of µs), short enough that a nested keeper costs a pause, not a hang.
fn keep_warm_idle() -> Duration {
    static US: OnceLock<u64> = OnceLock::new();
    Duration::from_micros(*US.get_or_init(|| {
        std::env::var("REDLITE_KEEP_WARM_IDLE_US")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(2000)
    }))
}

/// Idle polls of the team job per poll of rayon's queues in [`keep_warm`].
const RAYON_POLL_EVERY: u32 = 16;

/// Files up to this size get their Q4_K and Q6_K matrices repacked as [`DecodeTiles`] for one-row
/// products: `REDLITE_DECODE_TILES_MB` MiB, default 64 (0: never). Small models' products run
/// from cache, where the row kernels' per-row work (one block per row on the tiny fixture)
/// dominates; the tiles cost a second copy of those matrices (1.03× / 1.39× their bytes).
fn decode_tiles_max_bytes() -> usize {
    static MB: OnceLock<usize> = OnceLock::new();
    let mb = *MB.get_or_init(|| {
        std::env::var("REDLITE_DECODE_TILES_MB")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(64)
    });
    if mb == 0 {
        0
    } else {
        mb << 20
    }
}

/// `ys = W · xs` for `n` rows of a weight given by its bytes.
fn run_linear(
    ty: GgmlType,
    w: &[u8],
    (rows, cols): (usize, usize),
    xs: &[f32],
    n: usize,
    ys: &mut [f32],
) {
    // Shapes were checked at load; the model passes matching activation lengths.
    let result = if n == 1 {
        driver::matvec(ty, w, rows, cols, xs, ys)
    } else {
        driver::matmul(ty, w, rows, cols, xs, n, ys)
    };
    if let Err(e) = result {
        panic!("CPU linear {rows}×{cols} {ty}: {e}");
    }
}

impl Backend for CpuBackend {
    type Linear = CpuLinear;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn load_linear(&self, src: LinearSource) -> Result<CpuLinear, ModelError> {
        let unsupported = |message: String| ModelError::Tensor {
            tensor: src.name.clone(),
            message,
        };
        if !driver::supported(src.ty) {
            return Err(unsupported(format!(
                "the CPU backend has no kernel for {}",
                src.ty
            )));
        }
        let expected = src
            .ty
            .row_bytes(src.cols as u64)
            .and_then(|rb| rb.checked_mul(src.rows as u64))
            .ok_or_else(|| {
                unsupported(format!(
                    "{} columns is not a whole number of {} blocks",
                    src.cols, src.ty
                ))
            })?;
        if src.bytes().len() as u64 != expected {
            return Err(unsupported(format!(
                "{} bytes, expected {expected}",
                src.bytes().len()
            )));
        }
        if let Some(tag) = src.expert {
            let mut shape = self.shape.lock().unwrap_or_else(|e| e.into_inner());
            shape.layers = shape.layers.max(tag.layer + 1);
            let part = &mut shape.part_bytes[tag.part as usize];
            *part = (*part).max(expected);
            shape.all_expert_bytes += expected;
        }
        self.see(&src);
        let file_bytes = match &src.data {
            LinearData::Mapped { file, .. } => file.bytes().len(),
            LinearData::Owned(v) => v.len(),
        };
        let bytes = match src.data {
            LinearData::Mapped { file, range } => Bytes::Mapped(file.clone(), range),
            LinearData::Owned(v) => Bytes::Owned(v),
        };
        let mut linear = CpuLinear {
            ty: src.ty,
            rows: src.rows,
            cols: src.cols,
            bytes,
            expert: src.expert,
            tiles: None,
        };
        if file_bytes <= decode_tiles_max_bytes() {
            linear.tiles = DecodeTiles::repack(linear.ty, linear.bytes(), linear.rows, linear.cols);
        }
        Ok(linear)
    }

    fn weights_loaded(&self, file: &Arc<GgufFile>) -> Result<(), ModelError> {
        let shape = *self.shape.lock().unwrap_or_else(|e| e.into_inner());
        let cache = ExpertCache::new(file.clone(), shape, &self.config)
            .map_err(|e| ModelError::BadConfig(format!("expert cache: {e}")))?;
        if cache.is_unbounded() {
            crate::populate::populate_map(file.bytes());
        }
        if cache.prefetches() {
            let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(p) = Predictor::new(file.clone(), &seen, shape.layers) {
                let _ = self.predictor.set(p);
            }
        }
        self.cache.set(Box::new(cache)).map_err(|_| {
            ModelError::BadConfig(
                "this CPU backend already serves a model (clone it for another)".into(),
            )
        })
    }

    fn linear(&self, w: &CpuLinear, xs: &[f32], n: usize, ys: &mut [f32]) {
        if let Some(tiles) = &w.tiles {
            // Q8_0 tiles take every row count (same values as `matvec` per row).
            let done = fused::q8_0_tiles_matmul(&[tiles], xs, n, &mut [ys])
                .unwrap_or_else(|e| panic!("CPU linear {}×{} {}: {e}", w.rows, w.cols, w.ty));
            if done {
                return;
            }
        }
        if let (1, Some(tiles)) = (n, &w.tiles) {
            // One row on the tiles (same values as `matvec`).
            let product = Product {
                ty: w.ty,
                w: w.bytes(),
                rows: w.rows,
                cols: w.cols,
                input: 0,
                tiles: Some(tiles),
            };
            fused::matvec_into(&product, xs, ys)
                .unwrap_or_else(|e| panic!("CPU linear {}×{} {}: {e}", w.rows, w.cols, w.ty));
            return;
        }
        run_linear(w.ty, w.bytes(), (w.rows, w.cols), xs, n, ys);
    }

    /// Weights of one type and width over several rows: the rows quantized once
    /// (`driver::matmul_many`; each output as `linear` gives it). Otherwise one by one.
    fn linears(&self, ws: &[&CpuLinear], xs: &[f32], n: usize, ys: &mut [&mut [f32]]) {
        let same = ws
            .first()
            .is_some_and(|w0| ws.iter().all(|w| w.ty == w0.ty && w.cols == w0.cols));
        if n < 2 || ws.len() < 2 || !same {
            for (w, y) in ws.iter().zip(ys.iter_mut()) {
                self.linear(w, xs, n, y);
            }
            return;
        }
        let tiles: Option<Vec<&DecodeTiles>> = ws.iter().map(|w| w.tiles.as_ref()).collect();
        if let Some(tiles) = tiles {
            let done = fused::q8_0_tiles_matmul(&tiles, xs, n, ys)
                .unwrap_or_else(|e| panic!("CPU linears ({} weights, Q8_0 tiles): {e}", ws.len()));
            if done {
                return;
            }
        }
        let bytes: Vec<(&[u8], usize)> = ws.iter().map(|w| (w.bytes(), w.rows)).collect();
        driver::matmul_many(ws[0].ty, &bytes, ws[0].cols, xs, n, ys)
            .unwrap_or_else(|e| panic!("CPU linears ({} weights, {}): {e}", ws.len(), ws[0].ty));
    }

    /// [`Backend::linears_rows`] of one weight (on Q8_0 tiles each row's output written in
    /// place; otherwise gathered, `linears` of one weight being `linear`).
    fn linear_rows(&self, w: &CpuLinear, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        self.linears_rows(&[w], xs).pop().unwrap_or_default()
    }

    /// On Q8_0 tiles of one width (small models), every row's outputs written in place, the
    /// rows quantized once; otherwise gathered.
    fn linears_rows(&self, ws: &[&CpuLinear], xs: &[Vec<f32>]) -> Vec<Vec<Vec<f32>>> {
        #[cfg(target_arch = "x86_64")]
        if xs.len() > 1 {
            let tiles: Option<Vec<_>> = ws
                .iter()
                .map(|w| w.tiles.as_ref().and_then(|t| t.q8_0()))
                .collect();
            if let Some(ts) = tiles.filter(|ts| ts.iter().all(|t| t.blocks() == ts[0].blocks())) {
                return fused::q8_0_tiles_rows_many(&ts, xs).unwrap_or_else(|e| {
                    panic!("CPU linears ({} weights, Q8_0 tiles): {e}", ws.len())
                });
            }
        }
        redlite_model::backend::linears_rows_gathered(self, ws, xs)
    }

    fn linear_shape(&self, w: &CpuLinear) -> (usize, usize) {
        (w.rows, w.cols)
    }

    /// One fused pass over all the weights (one parallel region instead of one per weight; the
    /// input quantized once per format); each row by `matvec`'s kernel, so the same values.
    fn matvecs(&self, ws: &[&CpuLinear], x: &[f32]) -> Vec<Vec<f32>> {
        let products: Vec<Product> = ws
            .iter()
            .map(|w| Product {
                ty: w.ty,
                w: w.bytes(),
                rows: w.rows,
                cols: w.cols,
                input: 0,
                tiles: w.tiles.as_ref(),
            })
            .collect();
        let mut ys = vec![Vec::new(); ws.len()];
        fused::matvec_batch(&products, &[x], &mut ys)
            .unwrap_or_else(|e| panic!("CPU projections: {e}"));
        ys
    }

    /// On a pool thread: every parallel region of the pass is then a fork inside the pool that
    /// this thread takes part in, and the caller sleeps once per pass. Run from the caller, each
    /// of the ≈10 regions per layer woke a worker and put the caller to sleep until the region
    /// ended (perf, 8-layer decode: scheduler and `sched_yield` ≈ 8 % of CPU samples → ≈ 1.5 %).
    fn run_pass<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        // Sizes the pool first if nothing has (as the kernels do).
        let _ = driver::num_threads();
        // Already on a pool thread (a pass inside a pass, or a caller that is itself a pool
        // task): run here, and leave the keepers to the outer pass.
        if rayon::current_thread_index().is_some() {
            return f();
        }
        if std::env::var_os("REDLITE_NO_KEEP_WARM").is_some() {
            return rayon::scope(|_| f());
        }
        let done = AtomicBool::new(false);
        let done = &done;
        rayon::scope(|s| {
            let _active = ActivePass::enter();
            // Only a pass that runs alone keeps the pool warm (see `keep_warm`).
            if ACTIVE_PASSES.load(Ordering::Acquire) == 1 {
                let pass_thread = rayon::current_thread_index();
                // One keeper per thread, each bound to its thread (a broadcast job cannot be
                // stolen): with plain spawns, the pass thread could pop the keepers from its
                // own deque while the others were still waking (a keeper returns at once there),
                // and the pass then ran without any warm thread.
                s.spawn_broadcast(move |_, _| keep_warm(done, pass_thread));
            }
            let _stop = SetOnDrop(done);
            f()
        })
    }

    /// As one team job inside a pass (a region costs ≈ 1 µs there, against several through
    /// rayon's deques); on rayon's pool outside one.
    fn for_each_item<T: Send>(&self, items: &mut [T], f: impl Fn(usize, &mut T) + Sync + Send) {
        crate::team::for_each_indexed(items, f);
    }

    /// 16 at a time, bit-identical to the scalar SiLU (`vexp`).
    fn silu_in_place(&self, xs: &mut [f32]) {
        crate::vexp::silu_in_place(xs);
    }

    fn sigmoid_in_place(&self, xs: &mut [f32]) {
        crate::vexp::sigmoid_in_place(xs);
    }

    fn attention(
        &self,
        q: &[f32],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<f32> {
        crate::attention::attention_online(q, kv, n_heads, head_dim, scale)
    }

    fn attention_rows(
        &self,
        q: &[Vec<f32>],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<Vec<f32>> {
        crate::attention::attention_rows_online(q, kv, n_heads, head_dim, scale)
    }

    /// The recurrence, token by token: on this CPU 7.7× (64 × 64 heads) and 4.3× (128 × 128)
    /// faster a token than the chunked algorithm with AVX-512, 1.6–2.4× with AVX2, 1.3–1.9× in
    /// scalar code (`delta_rule::bench::step_against_chunked_time`), since the chunked form
    /// does more arithmetic a token and only pays on matrix units. A prompt's states are then
    /// those its tokens would leave as decode steps, bit for bit. Where a decay multiplies the
    /// state into subnormal numbers, as the random full-size layout's g ≈ −100 do, the
    /// recurrence is the slower one (15.1 against 6.2 µs of wall time a 128 × 128 head and
    /// token, 32 heads on two threads); that layout's prefill still spends less in the delta
    /// rule (8.8 % of the samples against 12.0).
    fn prompt_delta_rule(&self, _pos0: usize) -> DeltaRule {
        DeltaRule::Step
    }

    fn delta_rule(
        &self,
        heads: &[HeadInputs],
        states: &mut [f32],
        rule: DeltaRule,
        traces: Option<&mut [Vec<f32>]>,
    ) -> Vec<Vec<f32>> {
        crate::delta_rule::delta_rule_parallel(heads, states, rule, traces)
    }

    fn delta_rule_keeping_initial(
        &self,
        heads: &[HeadInputs],
        states: &mut [f32],
        initial: &mut [f32],
        rule: DeltaRule,
    ) -> Vec<Vec<f32>> {
        crate::delta_rule::delta_rule_parallel_keeping(heads, states, initial, rule)
    }

    fn routed_experts_rows(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[Vec<(usize, f32)>],
        xs: &[Vec<f32>],
    ) -> Vec<Vec<f32>> {
        // Tokens per expert, so each expert's weights are read once for all its tokens; `at[t][i]`
        // says where token t's i-th chosen expert keeps its output (expert, row in its batch).
        let mut tokens_of: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let mut at: Vec<Vec<(usize, usize)>> = Vec::with_capacity(chosen.len());
        for (t, c) in chosen.iter().enumerate() {
            at.push(
                c.iter()
                    .map(|&(e, _)| {
                        let toks = tokens_of.entry(e).or_default();
                        toks.push(t);
                        (e, toks.len() - 1)
                    })
                    .collect(),
            );
        }
        let groups: Vec<(usize, Vec<usize>)> = tokens_of.into_iter().collect();
        // down(silu(gate·x) ⊙ up·x) for every (expert, token) pair, `[tokens of e][hidden]` per
        // expert; matmul rows are bit-identical to matvec, so each token gets exactly what
        // `routed_experts` computes for it alone.
        // Expert bytes come from the expert cache, in rounds of co-resident experts.
        let ids: Vec<usize> = groups.iter().map(|(e, _)| *e).collect();
        let mut outputs: Vec<Vec<f32>> = vec![Vec::new(); groups.len()];
        self.with_experts(experts, &ids, &[], |idx, bytes| {
            let round: Vec<Vec<f32>> = idx
                .par_iter()
                .zip(bytes)
                .map(|(&g, b)| {
                    let (e, toks) = &groups[g];
                    let ffn = &experts[*e];
                    let n = toks.len();
                    let x: Vec<f32> = toks.iter().flat_map(|&t| xs[t].iter().copied()).collect();
                    let mut gate = vec![0.0f32; n * ffn.gate.rows];
                    let mut up = vec![0.0f32; n * ffn.up.rows];
                    let shape = |w: &CpuLinear| (w.rows, w.cols);
                    if let (Some(tg), Some(tu), Some(td)) =
                        (&ffn.gate.tiles, &ffn.up.tiles, &ffn.down.tiles)
                    {
                        // Q8_0 tiles of a small file (the copy the one-token path reads too).
                        let tiled = |ws: &[&DecodeTiles], x: &[f32], ys: &mut [&mut [f32]]| {
                            fused::q8_0_tiles_matmul(ws, x, n, ys)
                                .unwrap_or_else(|e| panic!("CPU expert (Q8_0 tiles): {e}"))
                        };
                        if tiled(&[tg, tu], &x, &mut [&mut gate, &mut up]) {
                            let act = silu_times(&gate, &up);
                            let mut down = vec![0.0f32; n * ffn.down.rows];
                            if tiled(&[td], &act, &mut [&mut down]) {
                                return down;
                            }
                        }
                    }
                    if n > 1 && ffn.gate.ty == ffn.up.ty && ffn.gate.cols == ffn.up.cols {
                        // The token rows quantized once for both products.
                        let ws = [(b[0], ffn.gate.rows), (b[1], ffn.up.rows)];
                        driver::matmul_many(
                            ffn.gate.ty,
                            &ws,
                            ffn.gate.cols,
                            &x,
                            n,
                            &mut [&mut gate, &mut up],
                        )
                        .unwrap_or_else(|e| panic!("CPU expert gate/up: {e}"));
                    } else {
                        run_linear(ffn.gate.ty, b[0], shape(&ffn.gate), &x, n, &mut gate);
                        run_linear(ffn.up.ty, b[1], shape(&ffn.up), &x, n, &mut up);
                    }
                    let act = silu_times(&gate, &up);
                    let mut down = vec![0.0f32; n * ffn.down.rows];
                    run_linear(ffn.down.ty, b[2], shape(&ffn.down), &act, n, &mut down);
                    down
                })
                .collect();
            for (&g, out) in idx.iter().zip(round) {
                outputs[g] = out;
            }
        });
        let group_of: HashMap<usize, usize> = groups
            .iter()
            .enumerate()
            .map(|(g, (e, _))| (*e, g))
            .collect();
        // Weighted sum per token, in its chosen order (prompt-sized runs on the pool).
        let sum = |t: usize| {
            let mut out = vec![0.0f32; xs[t].len()];
            for (&(_, weight), &(e, k)) in chosen[t].iter().zip(&at[t]) {
                let h = experts[e].down.rows;
                let y = &outputs[group_of[&e]][k * h..(k + 1) * h];
                for (o, v) in out.iter_mut().zip(y) {
                    *o += weight * v;
                }
            }
            out
        };
        if chosen.len() >= 16 {
            (0..chosen.len()).into_par_iter().map(sum).collect()
        } else {
            (0..chosen.len()).map(sum).collect()
        }
    }

    fn routed_experts(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[(usize, f32)],
        x: &[f32],
    ) -> Vec<f32> {
        self.moe_decode(experts, chosen, None, x).0
    }

    fn moe_rows(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[Vec<(usize, f32)>],
        shared: &FfnWeights<Self>,
        shared_gate: &[f32],
        xs: &[Vec<f32>],
    ) -> Option<Vec<Vec<f32>>> {
        if !pairs_pay(experts, chosen) {
            return None;
        }
        // Tokens per expert, and where token t's i-th choice finds its output.
        let mut tokens_of: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let at: Vec<Vec<(usize, usize)>> = chosen
            .iter()
            .enumerate()
            .map(|(t, c)| {
                c.iter()
                    .map(|&(e, _)| {
                        let toks = tokens_of.entry(e).or_default();
                        toks.push(t);
                        (e, toks.len() - 1)
                    })
                    .collect()
            })
            .collect();
        let groups: Vec<(usize, Vec<usize>)> = tokens_of.into_iter().collect();
        let group_of: HashMap<usize, usize> = groups
            .iter()
            .enumerate()
            .map(|(g, (e, _))| (*e, g))
            .collect();
        let ids: Vec<usize> = groups.iter().map(|(e, _)| *e).collect();
        let every: Vec<usize> = (0..xs.len()).collect();
        let inputs: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
        let shared_ffn = (
            shared,
            [shared.gate.bytes(), shared.up.bytes(), shared.down.bytes()],
        );
        // Each round's (expert, token) pairs as products; the shared expert rides in the first.
        // Each feed-forward's outputs come flat: `[its tokens][hidden]`.
        let flat = |ys: Vec<Vec<Vec<f32>>>| ys.into_iter().map(|y| y.concat()).collect::<Vec<_>>();
        let mut outputs: Vec<Vec<f32>> = vec![Vec::new(); groups.len()];
        let mut shared_down: Option<Vec<f32>> = None;
        self.with_experts(experts, &ids, &[], |idx, bytes| {
            let mut ffns: Vec<(&FfnWeights<Self>, ExpertBytes, &[usize])> = idx
                .iter()
                .zip(bytes)
                .map(|(&g, &b)| (&experts[groups[g].0], b, groups[g].1.as_slice()))
                .collect();
            let first = shared_down.is_none();
            if first {
                ffns.push((shared_ffn.0, shared_ffn.1, &every));
            }
            #[cfg(target_arch = "x86_64")]
            let mut ys = ffn_outputs_tiled(&ffns, &inputs)
                .unwrap_or_else(|| flat(ffn_outputs(&ffns, &inputs)));
            #[cfg(not(target_arch = "x86_64"))]
            let mut ys = flat(ffn_outputs(&ffns, &inputs));
            if first {
                shared_down = ys.pop();
            }
            for (&g, y) in idx.iter().zip(ys) {
                outputs[g] = y;
            }
        });
        let shared_down = match shared_down {
            Some(d) => d,
            None => flat(ffn_outputs(
                &[(shared_ffn.0, shared_ffn.1, &every)],
                &inputs,
            ))
            .pop()
            .unwrap_or_default(),
        };
        // Per token: the weighted sum in its chosen order, then the gated shared expert, as
        // `moe_token` does.
        let hidden = xs.first().map_or(0, Vec::len);
        let row = |t: usize| {
            let x = &xs[t];
            let mut out = vec![0.0f32; hidden];
            for (&(_, weight), &(e, k)) in chosen[t].iter().zip(&at[t]) {
                let y = &outputs[group_of[&e]][k * hidden..(k + 1) * hidden];
                for (o, v) in out.iter_mut().zip(y) {
                    *o += weight * v;
                }
            }
            add_shared_expert(
                &mut out,
                &shared_down[t * hidden..(t + 1) * hidden],
                shared_gate,
                x,
            );
            out
        };
        Some(crate::team::map_rows(xs.len(), row))
    }

    fn moe_token(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[(usize, f32)],
        shared: &FfnWeights<Self>,
        shared_gate: &[f32],
        x: &[f32],
    ) -> Vec<f32> {
        let (mut out, down) = self.moe_decode(experts, chosen, Some(shared), x);
        // Without a round (no experts chosen) the shared expert is computed on its own.
        let down = down.unwrap_or_else(|| swiglu(self, shared, x));
        add_shared_expert(&mut out, &down, shared_gate, x);
        out
    }
}

impl CpuBackend {
    /// The weighted sum of the `chosen` routed experts of one token (in the given order) and,
    /// with `shared`, the shared expert's SwiGLU output, computed in the first round of routed
    /// experts (see [`CpuBackend::expert_outputs`]).
    fn moe_decode(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[(usize, f32)],
        mut shared: Option<&FfnWeights<Self>>,
        x: &[f32],
    ) -> (Vec<f32>, Option<Vec<f32>>) {
        let ids: Vec<usize> = chosen.iter().map(|&(e, _)| e).collect();
        // The next block's likely experts load while this block and the next one's mixer run.
        let ahead = self.guess_next(experts, x, ids.len());
        let mut downs = vec![Vec::new(); ids.len()];
        let mut shared_down = None;
        self.with_experts(experts, &ids, &ahead, |idx, bytes| {
            let round: Vec<usize> = idx.iter().map(|&i| ids[i]).collect();
            let with = shared.take();
            let mut ys = self.expert_outputs(experts, &round, bytes, with, x);
            if with.is_some() {
                shared_down = ys.pop();
            }
            for (&i, y) in idx.iter().zip(ys) {
                downs[i] = y;
            }
        });
        // Weighted sum in the given order.
        let mut out = vec![0.0f32; x.len()];
        for (y, &(_, weight)) in downs.iter().zip(chosen) {
            for (o, v) in out.iter_mut().zip(y) {
                *o += weight * v;
            }
        }
        (out, shared_down)
    }
}
