//! The GPU expert cache: routed experts in a bounded pool of device slots, the rest read from
//! mapped pinned host memory, behind one per-layer table of expert addresses.
//!
//! The expert kernels (`moe_gate_up_tab_<type>`, `moe_down_combine_tab_<type>`) find part p
//! (gate, up, down) of expert e of a layer at `table[3 e + p]`. An entry points either into a
//! device slot or into the expert's copy in pinned host memory allocated with
//! `CU_MEMHOSTALLOC_DEVICEMAP`, which the kernel reads over PCIe (zero-copy). Same kernel, same
//! bytes: the logits do not depend on which experts are resident. Every expert resident (the
//! default) is the unbounded case of the same path: one slot per expert, no host copy.
//!
//! The decode step stays one CUDA graph: the graph holds the table addresses, not the experts'.
//! Between calls (the model's stream idle), [`ExpertCache::after_forward`] reads back the
//! experts the call routed to (`layers × tokens × k` ids), counts hits and misses, and promotes
//! missed experts into slots:
//!
//! 1. the victims' entries go back to their host copies, and the changed tables are uploaded on
//!    the model's stream (so the next step reads them first);
//! 2. the promoted experts are copied host → slot on a copy stream that waits for that upload,
//!    overlapping the next step (which reads neither the victims' slots nor the new entries);
//! 3. at a later call, once the copies' event has completed, the new entries point at the slots.
//!
//! An entry is therefore always either a complete device copy or the host copy.

use std::sync::Arc;

use cudarc::driver::{result as cu, sys, CudaContext, CudaEvent, CudaStream};

use crate::CudaError;

/// Alignment of each part inside a slot (and of slots).
const PART_ALIGN: usize = 256;
/// Device memory left free under a `--memory` budget for the graph, cuBLAS-free workspaces and
/// the driver's own allocations after load. On the H200 those took ≈ 12 MiB (16 GiB budget:
/// 16,204 MiB in use after 128 steps with a 192 MiB margin), so 96 MiB keeps 8× that spare and
/// gives the expert slots ≈ 2 more experts per layer of the full-size layout.
const BUDGET_MARGIN: u64 = 96 << 20;

/// How many experts the device holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertCacheSize {
    /// Every expert in device memory.
    #[default]
    All,
    /// One slot per layer.
    Min,
    /// Slots of this many bytes in all (an equal share per layer).
    Bytes(u64),
    /// Everything the process holds on the GPU (context, weights, caches, slots) within this
    /// many bytes: the slots get what the rest leaves.
    Budget(u64),
}

/// Which missed experts enter the slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertPolicy {
    /// Decayed use counts per expert; a missed expert replaces its layer's least-used resident
    /// one when it has been used clearly more (admission margin), a few per step.
    #[default]
    Lfu,
    /// A missed expert replaces its layer's least recently used resident one.
    Lru,
    /// No promotion: the slots keep what they were filled with.
    Static,
}

impl std::str::FromStr for ExpertPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<ExpertPolicy, String> {
        match s {
            "lfu" | "layer-quota" => Ok(ExpertPolicy::Lfu),
            "lru" => Ok(ExpertPolicy::Lru),
            "static" => Ok(ExpertPolicy::Static),
            _ => Err(format!(
                "unknown expert-cache policy {s} (lfu, lru, static)"
            )),
        }
    }
}

/// Counters since the last [`ExpertCache::reset_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertStats {
    /// Tokens run (a prompt of n tokens counts n).
    pub tokens: u64,
    /// Expert uses (token × layer × choice) served from a device slot.
    pub hits: u64,
    /// Expert uses read from host memory over PCIe.
    pub misses: u64,
    /// Experts copied into slots.
    pub promotions: u64,
    /// Bytes that crossed PCIe: missed experts read by the kernels plus promotion copies.
    pub pcie_bytes: u64,
}

impl ExpertStats {
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

/// Where one expert's parts sit in its slot (and in the host copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Bytes of the gate part (= the up part).
    pub gate_bytes: usize,
    pub down_bytes: usize,
    pub up_off: usize,
    pub down_off: usize,
    /// Bytes per slot (parts aligned to 256).
    pub slot_bytes: usize,
}

impl ExpertLayout {
    pub fn new(gate_bytes: usize, down_bytes: usize) -> ExpertLayout {
        let up_off = gate_bytes.next_multiple_of(PART_ALIGN);
        let down_off = up_off + gate_bytes.next_multiple_of(PART_ALIGN);
        ExpertLayout {
            gate_bytes,
            down_bytes,
            up_off,
            down_off,
            slot_bytes: down_off + down_bytes.next_multiple_of(PART_ALIGN),
        }
    }

    /// The bytes a kernel reads for one expert.
    pub fn expert_bytes(&self) -> usize {
        2 * self.gate_bytes + self.down_bytes
    }

    /// Write one expert's parts into `slot` (`slot_bytes` long).
    fn pack(&self, parts: &[&[u8]; 3], slot: &mut [u8]) {
        slot[..self.gate_bytes].copy_from_slice(parts[0]);
        slot[self.up_off..self.up_off + self.gate_bytes].copy_from_slice(parts[1]);
        slot[self.down_off..self.down_off + self.down_bytes].copy_from_slice(parts[2]);
    }

    fn part_offsets(&self) -> [u64; 3] {
        [0, self.up_off as u64, self.down_off as u64]
    }
}

/// Page-locked host memory mapped into the device's address space.
struct Pinned {
    ptr: *mut u8,
    len: usize,
    /// The device address of `ptr`.
    dev: u64,
}

// SAFETY: the buffer is plain memory owned by this value; access is synchronised by the owner.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(len: usize, what: &str) -> Result<Pinned, CudaError> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a fresh allocation, freed once in `drop`.
        let ptr = unsafe { cu::malloc_host(len.max(PART_ALIGN), flags) }.map_err(|e| {
            CudaError::driver(
                format!("pinning {} MiB of host memory for {what}", len >> 20),
                e,
            )
        })? as *mut u8;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` came from cuMemHostAlloc with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr as *mut _, 0) };
        let p = Pinned { ptr, len, dev };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::driver(
                format!("mapping the pinned {what} into the device"),
                format!("{r:?}"),
            ));
        }
        Ok(p)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes owned by this value.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn u64s(&self) -> &[u64] {
        // SAFETY: as `u64s_mut`.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u64, self.len / 8) }
    }

    fn u64s_mut(&mut self) -> &mut [u64] {
        // SAFETY: cuMemHostAlloc memory is page-aligned; `len` is a multiple of 8 where used.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u64, self.len / 8) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once; no copy or kernel uses it any more
        // (the owner synchronises first).
        let _ = unsafe { cu::free_host(self.ptr as *mut _) };
    }
}

/// The experts of every layer as the file holds them: `experts[layer][e] = [gate, up, down]`.
pub type ExpertBytes<'a> = Vec<Vec<[&'a [u8]; 3]>>;

/// Slots per layer for a size, or `None` for every expert resident.
pub fn slots_per_layer(
    size: ExpertCacheSize,
    layers: usize,
    n_expert: usize,
    slot_bytes: usize,
    used_now: u64,
) -> Result<Option<usize>, CudaError> {
    let per_layer_bytes = (layers * slot_bytes) as u64;
    let from_bytes = |b: u64, what: &str| -> Result<Option<usize>, CudaError> {
        let s = (b / per_layer_bytes.max(1)) as usize;
        if s == 0 {
            return Err(CudaError::Invalid(format!(
                "{what}: {} MiB leaves room for less than one expert per layer ({} MiB for {layers} layers)",
                b >> 20,
                per_layer_bytes >> 20
            )));
        }
        Ok((s < n_expert).then_some(s))
    };
    match size {
        ExpertCacheSize::All => Ok(None),
        ExpertCacheSize::Min => Ok((n_expert > 1).then_some(1)),
        ExpertCacheSize::Bytes(b) => from_bytes(b, "expert cache"),
        ExpertCacheSize::Budget(b) => {
            let avail = b.saturating_sub(used_now + BUDGET_MARGIN);
            from_bytes(
                avail,
                &format!(
                    "GPU memory budget {} MiB ({} MiB in use before the experts, {} MiB margin)",
                    b >> 20,
                    used_now >> 20,
                    BUDGET_MARGIN >> 20
                ),
            )
        }
    }
}

/// Warps per block of the expert kernels: `REDLITE_MOE_WARPS` (1..=32) or the default. More
/// warps per block stage the IQ grids into shared memory fewer times per call.
pub fn moe_warps() -> u32 {
    std::env::var("REDLITE_MOE_WARPS")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|w| (1..=32).contains(w))
        .unwrap_or(DEFAULT_MOE_WARPS)
}

/// See [`moe_warps`]. 8 since session 30 (H200, full-size layout, three alternating rounds in
/// each of two runs: decode +0.6 / +0.7 % against 4, 16 +0.2 %; `--memory 16GiB` lfu +2.5 %;
/// the 8-row verify +0.4 %; the logits bit for bit).
const DEFAULT_MOE_WARPS: u32 = 8;

/// Device memory in use on the current device (all processes), bytes.
pub fn device_used() -> Result<u64, CudaError> {
    let (free, total) = cu::mem_get_info().map_err(|e| CudaError::driver("cuMemGetInfo", e))?;
    Ok((total - free) as u64)
}

/// The routed experts of every layer and where they are.
pub struct ExpertCache {
    /// Each layer's part offsets (types may differ between layers).
    layouts: Vec<ExpertLayout>,
    /// Bytes per slot: the largest layer's.
    sb: usize,
    layers: usize,
    n_expert: usize,
    k: usize,
    /// Slots per layer (`n_expert` when every expert is resident).
    per_layer: usize,
    bounded: bool,
    /// Every layer's table affine in the expert id (expert e's parts at expert 0's + e · sb):
    /// see [`ExpertCache::direct_stride`].
    affine: bool,
    policy: ExpertPolicy,
    /// Device slots: layer l's slot s at `slots + (l · per_layer + s) · sb`.
    slots: u64,
    /// Every expert in pinned host memory (bounded only): layer l's expert e at
    /// `(l · n_expert + e) · sb`.
    host: Option<Pinned>,
    /// `[layers][n_expert][3]` u64 addresses on the device, and the host mirror they come from.
    tables_dev: u64,
    tables: Pinned,
    /// i32 ids the router writes: `[layers][tokens][k]` for a call of `tokens` tokens.
    ids_dev: u64,
    ids: Vec<i32>,
    /// Which expert is where, and the policy's counts.
    res: Residency,
    dirty: Vec<bool>,
    /// The event after the copies in flight ([`Residency::pending`]).
    copies_done: CudaEvent,
    tables_ready: CudaEvent,
    copy: Arc<CudaStream>,
    stats: ExpertStats,
}

/// Which expert each slot holds, and the eviction policy's state (no CUDA in here).
///
/// An expert is resident (`slot(l, e)` is `Some`) only once its copy is complete: a promoted
/// expert is *pending* (its slot reserved, its entry still the host copy) until
/// [`Residency::activate`]; its victim stops being resident at once.
#[derive(Debug, Clone)]
pub struct Residency {
    layers: usize,
    n_expert: usize,
    k: usize,
    per_layer: usize,
    policy: ExpertPolicy,
    /// `slot_of[l · n_expert + e]`: the slot expert e's entry points to, or -1 (host).
    slot_of: Vec<i32>,
    /// `holder[l · per_layer + s]`: the expert in (or being copied into) slot s.
    holder: Vec<i32>,
    /// Decayed use counts (LFU) and last use (LRU), per expert.
    score: Vec<f32>,
    last_use: Vec<u64>,
    tick: u64,
    /// Promotions whose copies are in flight: (layer, expert, slot).
    pending: Vec<(usize, usize, usize)>,
    /// Most experts promoted per call.
    max_promotions: usize,
}

/// What one call's ids did: uses served by slots, and the missed uses per layer and the
/// distinct missed (layer, expert) pairs, most used first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counted {
    pub hits: u64,
    pub misses_per_layer: Vec<u64>,
    pub missed: Vec<(usize, usize)>,
}

impl Residency {
    /// Slots `0..per_layer` of every layer hold experts `0..per_layer`.
    pub fn new(
        layers: usize,
        n_expert: usize,
        k: usize,
        per_layer: usize,
        policy: ExpertPolicy,
    ) -> Residency {
        let mut slot_of = vec![-1i32; layers * n_expert];
        let mut holder = vec![-1i32; layers * per_layer];
        for l in 0..layers {
            for s in 0..per_layer {
                slot_of[l * n_expert + s] = s as i32;
                holder[l * per_layer + s] = s as i32;
            }
        }
        Residency {
            layers,
            n_expert,
            k,
            per_layer,
            policy,
            slot_of,
            holder,
            score: vec![0.0; layers * n_expert],
            last_use: vec![0; layers * n_expert],
            tick: 0,
            pending: Vec::new(),
            max_promotions: MAX_PROMOTIONS,
        }
    }

    /// The slot expert `e` of layer `l` is read from, if resident.
    pub fn slot(&self, l: usize, e: usize) -> Option<usize> {
        usize::try_from(self.slot_of[l * self.n_expert + e]).ok()
    }

    /// Promotions waiting for their copies.
    pub fn pending(&self) -> &[(usize, usize, usize)] {
        &self.pending
    }

    /// Count a call of `n` tokens (`ids`: `[layers][n][k]`): hits and misses against the
    /// current residency; the use counts and recency the policies read.
    pub fn count(&mut self, ids: &[i32], n: usize) -> Counted {
        let (ne, k) = (self.n_expert, self.k);
        let decay = LFU_DECAY.powi(n as i32);
        let mut c = Counted {
            misses_per_layer: vec![0; self.layers],
            ..Counted::default()
        };
        for l in 0..self.layers {
            for s in &mut self.score[l * ne..(l + 1) * ne] {
                *s *= decay;
            }
            for t in 0..n {
                self.tick += 1;
                for j in 0..k {
                    let Some(&e) = ids.get((l * n + t) * k + j) else {
                        continue;
                    };
                    if e < 0 || e as usize >= ne {
                        continue;
                    }
                    let at = l * ne + e as usize;
                    self.score[at] += 1.0;
                    self.last_use[at] = self.tick;
                    if self.slot_of[at] >= 0 {
                        c.hits += 1;
                    } else {
                        c.misses_per_layer[l] += 1;
                        c.missed.push((l, e as usize));
                    }
                }
            }
        }
        c.missed.sort_unstable();
        c.missed.dedup();
        let score = &self.score;
        c.missed
            .sort_by(|a, b| score[b.0 * ne + b.1].total_cmp(&score[a.0 * ne + a.1]));
        c
    }

    /// The pending promotions' copies are complete: their experts become resident. Returns the
    /// (layer, expert) entries that changed.
    pub fn activate(&mut self) -> Vec<(usize, usize)> {
        let done = std::mem::take(&mut self.pending);
        for &(l, e, s) in &done {
            self.slot_of[l * self.n_expert + e] = s as i32;
        }
        done.into_iter().map(|(l, e, _)| (l, e)).collect()
    }

    /// Choose up to `max_promotions` of the `missed` experts to copy into slots (they become
    /// pending; nothing is promoted while copies are pending). Returns the promotions
    /// (layer, expert, slot) and the victims (layer, expert), no longer resident.
    #[allow(clippy::type_complexity)]
    pub fn promote(
        &mut self,
        missed: &[(usize, usize)],
    ) -> (Vec<(usize, usize, usize)>, Vec<(usize, usize)>) {
        let ne = self.n_expert;
        let mut victims = Vec::new();
        if self.policy == ExpertPolicy::Static || !self.pending.is_empty() {
            return (Vec::new(), victims);
        }
        let mut taken = vec![false; self.layers * self.per_layer];
        for &(l, e) in missed {
            if self.pending.len() >= self.max_promotions {
                break;
            }
            let at = l * ne + e;
            if self.slot_of[at] >= 0 {
                continue;
            }
            // The victim: the layer's resident expert with the lowest score (LFU) or the
            // oldest use (LRU), among slots not already taken this round.
            let mut best: Option<(usize, f64)> = None;
            for s in 0..self.per_layer {
                if taken[l * self.per_layer + s] {
                    continue;
                }
                let v = self.holder[l * self.per_layer + s] as usize;
                let key = match self.policy {
                    ExpertPolicy::Lru => self.last_use[l * ne + v] as f64,
                    _ => f64::from(self.score[l * ne + v]),
                };
                if best.is_none_or(|(_, b)| key < b) {
                    best = Some((s, key));
                }
            }
            let Some((s, key)) = best else { continue };
            let admit = match self.policy {
                ExpertPolicy::Lru => true,
                _ => f64::from(self.score[at]) > key + f64::from(LFU_MARGIN),
            };
            if !admit {
                continue;
            }
            taken[l * self.per_layer + s] = true;
            let victim = self.holder[l * self.per_layer + s] as usize;
            self.slot_of[l * ne + victim] = -1;
            victims.push((l, victim));
            self.holder[l * self.per_layer + s] = e as i32;
            self.pending.push((l, e, s));
        }
        (self.pending.clone(), victims)
    }
}

/// LFU: decay of the use counts per token (a window of a few hundred tokens).
const LFU_DECAY: f32 = 0.995;
/// LFU: a missed expert enters when its count exceeds the victim's by this much.
const LFU_MARGIN: f32 = 1.0;
/// Promotions per call (each an expert's bytes over PCIe on the copy stream).
const MAX_PROMOTIONS: usize = 32;

impl ExpertCache {
    /// Put the experts on the device: all of them (`per_layer = None`), or `per_layer` slots per
    /// layer filled with experts `0..per_layer`, every expert also in pinned host memory.
    /// `layouts`: one per layer. `alloc` allocates device memory (the model's arena).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &Arc<CudaContext>,
        alloc: &mut dyn FnMut(usize) -> Result<u64, CudaError>,
        experts: &ExpertBytes<'_>,
        layouts: Vec<ExpertLayout>,
        k: usize,
        max_batch: usize,
        per_layer: Option<usize>,
        policy: ExpertPolicy,
    ) -> Result<ExpertCache, CudaError> {
        let layers = experts.len();
        let n_expert = experts.first().map_or(0, |l| l.len());
        if layers == 0
            || n_expert == 0
            || experts.iter().any(|l| l.len() != n_expert)
            || layouts.len() != layers
        {
            return Err(CudaError::Invalid(
                "expert cache: every MoE layer needs the same number of experts".into(),
            ));
        }
        for (l, (layer, layout)) in experts.iter().zip(&layouts).enumerate() {
            for (e, p) in layer.iter().enumerate() {
                if p[0].len() != layout.gate_bytes
                    || p[1].len() != layout.gate_bytes
                    || p[2].len() != layout.down_bytes
                {
                    return Err(CudaError::Invalid(format!(
                        "expert cache: expert {e} of layer {l} has parts of {}/{}/{} bytes, expected {}/{}/{}",
                        p[0].len(),
                        p[1].len(),
                        p[2].len(),
                        layout.gate_bytes,
                        layout.gate_bytes,
                        layout.down_bytes
                    )));
                }
            }
        }
        let bounded = per_layer.is_some_and(|s| s < n_expert);
        let per_layer = per_layer.unwrap_or(n_expert).clamp(1, n_expert);
        let sb = stride(&layouts);
        let slots = alloc(layers * per_layer * sb)?;
        let host = if bounded {
            let mut h = Pinned::new(layers * n_expert * sb, "the experts")?;
            fill_host(h.bytes_mut(), experts, &layouts);
            // Experts 0..per_layer of a layer sit back to back in the host copy: one copy each.
            for l in 0..layers {
                let src = &h.bytes()[l * n_expert * sb..][..per_layer * sb];
                // SAFETY: the slot range holds per_layer · sb bytes; synchronous copy.
                unsafe { cu::memcpy_htod_sync(slots + (l * per_layer * sb) as u64, src) }
                    .map_err(|e| CudaError::driver("filling the expert slots", e))?;
            }
            Some(h)
        } else {
            upload_all(slots, experts, &layouts)?;
            None
        };
        let entries = layers * n_expert * 3;
        let tables_dev = alloc(8 * entries)?;
        let tables = Pinned::new(8 * entries, "the expert tables")?;
        let ids_dev = alloc(4 * layers * max_batch.max(1) * k)?;
        let copy = crate::device::new_stream(ctx)
            .map_err(|e| CudaError::driver("creating the expert copy stream", e))?;
        let event = || {
            ctx.new_event(None)
                .map_err(|e| CudaError::driver("creating an event", e))
        };
        let mut cache = ExpertCache {
            layouts,
            sb,
            layers,
            n_expert,
            k,
            per_layer,
            bounded,
            affine: false,
            policy,
            slots,
            host,
            tables_dev,
            tables,
            ids_dev,
            ids: Vec::new(),
            res: Residency::new(layers, n_expert, k, per_layer, policy),
            dirty: vec![true; layers],
            copies_done: event()?,
            tables_ready: event()?,
            copy,
            stats: ExpertStats::default(),
        };
        for l in 0..layers {
            for e in 0..n_expert {
                cache.point(l, e);
            }
        }
        let bytes = &cache.tables.bytes()[..8 * entries];
        // SAFETY: `tables_dev` holds `entries` u64; synchronous copy.
        unsafe { cu::memcpy_htod_sync(cache.tables_dev, bytes) }
            .map_err(|e| CudaError::driver("uploading the expert tables", e))?;
        cache.dirty.fill(false);
        cache.affine = !bounded && cache.tables_affine();
        Ok(cache)
    }

    /// Whether every layer's table has expert e's part p at expert 0's part p + e · sb.
    fn tables_affine(&self) -> bool {
        let (t, n, sb) = (self.tables.u64s(), self.n_expert, self.sb as u64);
        (0..self.layers).all(|l| {
            let t0 = &t[3 * l * n..3 * (l + 1) * n];
            (0..n).all(|e| (0..3).all(|p| t0[3 * e + p] == t0[p] + e as u64 * sb))
        })
    }

    /// With every expert resident the tables never change and are affine in the id: the expert
    /// kernels' `dstride` (part p of expert e at `table[p] + e · dstride`, one dependent load
    /// fewer than `table[3 e + p]`). `None` when some experts live in host memory (the entries
    /// move) or a table is not affine.
    pub fn direct_stride(&self) -> Option<u64> {
        self.affine.then_some(self.sb as u64)
    }

    /// The table of layer `l` (for the expert kernels).
    pub fn table(&self, l: usize) -> u64 {
        self.tables_dev + (8 * 3 * l * self.n_expert) as u64
    }

    /// Where the router of layer `l` writes the ids of a call of `n` tokens.
    pub fn ids(&self, l: usize, n: usize) -> u64 {
        self.ids_dev + (4 * l * n * self.k) as u64
    }

    /// Whether some experts live in host memory.
    pub fn bounded(&self) -> bool {
        self.bounded
    }

    /// Slots per layer.
    pub fn slots_per_layer(&self) -> usize {
        self.per_layer
    }

    /// Layer `l`'s part offsets.
    pub fn layout(&self, l: usize) -> ExpertLayout {
        self.layouts[l]
    }

    /// Bytes per slot (the largest layer's expert, parts aligned).
    pub fn slot_stride(&self) -> usize {
        self.sb
    }

    /// Device bytes of the slots.
    pub fn slot_bytes_total(&self) -> usize {
        self.layers * self.per_layer * self.sb
    }

    /// Pinned host bytes (every expert's copy, bounded only).
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.len)
    }

    pub fn policy(&self) -> ExpertPolicy {
        self.policy
    }

    pub fn stats(&self) -> ExpertStats {
        self.stats
    }

    pub fn reset_stats(&mut self) {
        self.stats = ExpertStats::default();
    }

    /// Point expert e's table entries at its slot or its host copy (host mirror only).
    fn point(&mut self, l: usize, e: usize) {
        let sb = self.sb;
        let base = match self.res.slot(l, e) {
            Some(s) => self.slots + ((l * self.per_layer + s) * sb) as u64,
            None => {
                let h = self.host.as_ref().map_or(0, |h| h.dev);
                h + ((l * self.n_expert + e) * sb) as u64
            }
        };
        let offs = self.layouts[l].part_offsets();
        let at = 3 * (l * self.n_expert + e);
        let t = self.tables.u64s_mut();
        for p in 0..3 {
            t[at + p] = base + offs[p];
        }
        self.dirty[l] = true;
    }

    /// After a call of `n` tokens, once `stream` (the model's) is idle: count hits and misses
    /// of what the call routed to, activate finished promotions, start new ones.
    pub fn after_forward(&mut self, stream: &CudaStream, n: usize) -> Result<(), CudaError> {
        let uses = (self.layers * n * self.k) as u64;
        self.stats.tokens += n as u64;
        if !self.bounded {
            self.stats.hits += uses;
            return Ok(());
        }
        self.ids.resize(self.layers * n * self.k, 0);
        // SAFETY: the router wrote layers · n · k ids at `ids_dev`; synchronous copy.
        unsafe { cu::memcpy_dtoh_sync(&mut self.ids, self.ids_dev) }
            .map_err(|e| CudaError::driver("reading the routed expert ids", e))?;
        let counted = self.res.count(&self.ids, n);
        self.stats.hits += counted.hits;
        for (l, &m) in counted.misses_per_layer.iter().enumerate() {
            self.stats.misses += m;
            self.stats.pcie_bytes += m * self.layouts[l].expert_bytes() as u64;
        }
        let mut fresh = Vec::new();
        if self.res.pending().is_empty() || self.copies_done.is_complete() {
            for (l, e) in self.res.activate() {
                self.point(l, e);
            }
            let victims;
            (fresh, victims) = self.res.promote(&counted.missed);
            for (l, e) in victims {
                self.point(l, e);
            }
        }
        self.upload_tables(stream)?;
        self.start_copies(stream, &fresh)
    }

    /// Upload the changed layers' tables on the model's stream (ordered before the next call).
    fn upload_tables(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        let per = 8 * 3 * self.n_expert;
        for l in 0..self.layers {
            if !std::mem::take(&mut self.dirty[l]) {
                continue;
            }
            let src = &self.tables.bytes()[l * per..(l + 1) * per];
            // SAFETY: pinned source, not written again before the stream is synchronised (the
            // next `after_forward` runs after the next call's synchronisation).
            unsafe { cu::memcpy_htod_async(self.table(l), src, stream.cu_stream()) }
                .map_err(|e| CudaError::driver("uploading an expert table", e))?;
        }
        Ok(())
    }

    /// Copy the newly promoted experts into their slots on the copy stream, after the table
    /// upload that retired the victims.
    fn start_copies(
        &mut self,
        stream: &CudaStream,
        fresh: &[(usize, usize, usize)],
    ) -> Result<(), CudaError> {
        if fresh.is_empty() {
            return Ok(());
        }
        let Some(host) = &self.host else {
            return Ok(());
        };
        let sb = self.sb;
        let drv = |e| CudaError::driver("promoting an expert", e);
        self.tables_ready.record(stream).map_err(drv)?;
        self.copy.wait(&self.tables_ready).map_err(drv)?;
        for &(l, e, s) in fresh {
            let src = &host.bytes()[(l * self.n_expert + e) * sb..][..sb];
            let dst = self.slots + ((l * self.per_layer + s) * sb) as u64;
            // SAFETY: pinned source owned by the cache; the slot is no table's target until the
            // copies' event has completed.
            unsafe { cu::memcpy_htod_async(dst, src, self.copy.cu_stream()) }.map_err(drv)?;
        }
        self.copies_done.record(&self.copy).map_err(drv)?;
        self.stats.promotions += fresh.len() as u64;
        for &(l, _, _) in fresh {
            self.stats.pcie_bytes += self.layouts[l].expert_bytes() as u64;
        }
        Ok(())
    }

    /// Wait for the copy stream (before the memory goes).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.copy
            .synchronize()
            .map_err(|e| CudaError::driver("synchronizing the expert copy stream", e))
    }
}

impl Drop for ExpertCache {
    fn drop(&mut self) {
        let _ = self.synchronize();
    }
}

/// Bytes per slot for these layers: the largest, aligned.
fn stride(layouts: &[ExpertLayout]) -> usize {
    layouts
        .iter()
        .map(|l| l.slot_bytes)
        .max()
        .unwrap_or(PART_ALIGN)
}

/// Every expert into the pinned host copy (layer-major, expert e of layer l at
/// `(l · n_expert + e) · stride`), a few threads at a time.
fn fill_host(dst: &mut [u8], experts: &ExpertBytes<'_>, layouts: &[ExpertLayout]) {
    let sb = stride(layouts);
    let per_layer = experts.first().map_or(0, |l| l.len()) * sb;
    let threads = std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(1, 16);
    let chunk = experts.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for ((ls, lays), dsts) in experts
            .chunks(chunk)
            .zip(layouts.chunks(chunk))
            .zip(dst.chunks_mut(chunk * per_layer.max(1)))
        {
            scope.spawn(move || {
                for ((layer, layout), d) in
                    ls.iter().zip(lays).zip(dsts.chunks_mut(per_layer.max(1)))
                {
                    for (parts, slot) in layer.iter().zip(d.chunks_mut(sb)) {
                        layout.pack(parts, slot);
                    }
                }
            });
        }
    });
}

/// Every expert into its device slot (slots in the host copy's order), one layer per copy.
fn upload_all(
    slots: u64,
    experts: &ExpertBytes<'_>,
    layouts: &[ExpertLayout],
) -> Result<(), CudaError> {
    let sb = stride(layouts);
    let n_expert = experts.first().map_or(0, |l| l.len());
    let mut staged = vec![0u8; n_expert * sb];
    for (l, (layer, layout)) in experts.iter().zip(layouts).enumerate() {
        for (parts, slot) in layer.iter().zip(staged.chunks_mut(sb)) {
            layout.pack(parts, slot);
        }
        // SAFETY: layer l's slots hold n_expert · sb bytes; synchronous copy.
        unsafe { cu::memcpy_htod_sync(slots + (l * n_expert * sb) as u64, &staged) }
            .map_err(|e| CudaError::driver("uploading the experts", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One token's ids for every layer (`[layers][1][k]`).
    fn ids(per_layer: &[&[i32]]) -> Vec<i32> {
        per_layer.iter().flat_map(|l| l.iter().copied()).collect()
    }

    /// Every slot holds one expert, resident or pending, and a resident expert's slot holds it.
    fn check_invariants(r: &Residency) {
        for l in 0..r.layers {
            let mut seen = vec![false; r.n_expert];
            for s in 0..r.per_layer {
                let e = r.holder[l * r.per_layer + s];
                assert!(
                    e >= 0 && (e as usize) < r.n_expert,
                    "slot {s} of layer {l} empty"
                );
                assert!(!seen[e as usize], "expert {e} in two slots of layer {l}");
                seen[e as usize] = true;
                let pending = r.pending.contains(&(l, e as usize, s));
                assert!(pending || r.slot(l, e as usize) == Some(s));
                if pending {
                    assert_eq!(r.slot(l, e as usize), None, "pending yet resident");
                }
            }
            for e in 0..r.n_expert {
                if let Some(s) = r.slot(l, e) {
                    assert_eq!(r.holder[l * r.per_layer + s], e as i32);
                }
            }
        }
    }

    #[test]
    fn hits_and_misses_against_the_residency() {
        let mut r = Residency::new(2, 8, 2, 3, ExpertPolicy::Static);
        let c = r.count(&ids(&[&[0, 5], &[2, 7]]), 1);
        assert_eq!(c.hits, 2);
        assert_eq!(c.misses_per_layer, vec![1, 1]);
        assert_eq!(c.missed.len(), 2);
        assert!(c.missed.contains(&(0, 5)) && c.missed.contains(&(1, 7)));
        // Static never promotes.
        assert_eq!(r.promote(&c.missed), (vec![], vec![]));
    }

    #[test]
    fn a_promoted_expert_is_resident_only_after_its_copy() {
        let mut r = Residency::new(1, 4, 1, 1, ExpertPolicy::Lru);
        let c = r.count(&[3], 1);
        let (fresh, victims) = r.promote(&c.missed);
        assert_eq!(fresh, vec![(0, 3, 0)]);
        assert_eq!(victims, vec![(0, 0)]);
        assert_eq!(r.slot(0, 0), None, "the victim leaves at once");
        assert_eq!(r.slot(0, 3), None, "not resident before the copy completes");
        check_invariants(&r);
        // No new promotions while a copy is pending.
        let c = r.count(&[2], 1);
        assert_eq!(r.promote(&c.missed), (vec![], vec![]));
        assert_eq!(r.activate(), vec![(0, 3)]);
        assert_eq!(r.slot(0, 3), Some(0));
        check_invariants(&r);
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut r = Residency::new(1, 8, 1, 3, ExpertPolicy::Lru);
        for e in [0, 1, 2, 0, 2] {
            r.count(&[e], 1);
        }
        let c = r.count(&[6], 1);
        let (_, victims) = r.promote(&c.missed);
        assert_eq!(victims, vec![(0, 1)]);
        r.activate();
        check_invariants(&r);
    }

    #[test]
    fn lfu_admits_only_clearly_more_used_experts() {
        let mut r = Residency::new(1, 8, 1, 2, ExpertPolicy::Lfu);
        for e in [0, 0, 0, 1, 1, 1] {
            r.count(&[e], 1);
        }
        // Expert 5, used once: not more than the least used resident (1, three uses) + margin.
        let c = r.count(&[5], 1);
        assert_eq!(r.promote(&c.missed), (vec![], vec![]));
        for _ in 0..5 {
            r.count(&[5], 1);
        }
        let c = r.count(&[5], 1);
        let (fresh, victims) = r.promote(&c.missed);
        assert_eq!(fresh.len(), 1);
        assert_eq!(victims.len(), 1);
        r.activate();
        assert!(r.slot(0, 5).is_some());
        check_invariants(&r);
    }

    #[test]
    fn random_routing_keeps_the_slots_consistent() {
        for policy in [ExpertPolicy::Lru, ExpertPolicy::Lfu, ExpertPolicy::Static] {
            let (layers, ne, k, per) = (3, 16, 4, 5);
            let mut r = Residency::new(layers, ne, k, per, policy);
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            let mut promoted = 0;
            for step in 0..400 {
                let n = 1 + step % 3;
                let ids: Vec<i32> = (0..layers * n * k)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        // Skewed: low ids more often.
                        ((x % 64) as f64).sqrt() as i32 * ne as i32 / 8 % ne as i32
                    })
                    .collect();
                let c = r.count(&ids, n);
                let uses: u64 = c.hits + c.misses_per_layer.iter().sum::<u64>();
                assert_eq!(uses, (layers * n * k) as u64);
                if step % 2 == 0 {
                    r.activate();
                }
                let (fresh, victims) = r.promote(&c.missed);
                assert!(fresh.len() >= victims.len());
                promoted += victims.len();
                check_invariants(&r);
            }
            assert_eq!(promoted == 0, policy == ExpertPolicy::Static, "{policy:?}");
        }
    }

    #[test]
    fn slots_per_layer_from_a_size() {
        let sb = 1000;
        assert_eq!(
            slots_per_layer(ExpertCacheSize::All, 4, 8, sb, 0).unwrap(),
            None
        );
        assert_eq!(
            slots_per_layer(ExpertCacheSize::Min, 4, 8, sb, 0).unwrap(),
            Some(1)
        );
        assert_eq!(
            slots_per_layer(ExpertCacheSize::Bytes(4 * 3 * 1000 + 5), 4, 8, sb, 0).unwrap(),
            Some(3)
        );
        // As large as every expert: unbounded.
        assert_eq!(
            slots_per_layer(ExpertCacheSize::Bytes(4 * 8 * 1000), 4, 8, sb, 0).unwrap(),
            None
        );
        assert!(slots_per_layer(ExpertCacheSize::Bytes(3999), 4, 8, sb, 0).is_err());
        let budget = BUDGET_MARGIN + 10_000 + 4 * 2 * 1000;
        assert_eq!(
            slots_per_layer(ExpertCacheSize::Budget(budget), 4, 8, sb, 10_000).unwrap(),
            Some(2)
        );
        assert!(slots_per_layer(ExpertCacheSize::Budget(1 << 20), 4, 8, sb, 1 << 20).is_err());
    }

    #[test]
    fn layout_aligns_parts() {
        let l = ExpertLayout::new(270_336, 1000);
        assert_eq!(l.up_off, 270_336);
        assert_eq!(l.down_off, 540_672);
        assert_eq!(l.slot_bytes, 540_672 + 1024);
        assert_eq!(l.expert_bytes(), 2 * 270_336 + 1000);
        let odd = ExpertLayout::new(100, 100);
        assert_eq!((odd.up_off, odd.down_off, odd.slot_bytes), (256, 512, 768));
    }
}
