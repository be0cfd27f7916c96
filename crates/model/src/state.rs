//! Per-sequence state: the KV cache of each attention layer, the conv history and delta-rule state
//! of each DeltaNet layer, and the position. Snapshots hold only the fixed-size recurrent part;
//! restoring one truncates the KV caches to the snapshot's position.

use std::borrow::Cow;

use crate::config::{Config, LayerKind};
use crate::delta_rule::{delta_rule_heads, DeltaRule, HeadInputs};
use crate::kv_type::{
    dequantize_q8_0, f16_to_f32, f32_to_f16, quantize_q8_0, BlockQ8_0, KvType, Q8_0_BLOCK,
    Q8_0_BLOCK_BYTES,
};
use crate::ModelError;

/// Keys or values of one attention layer, `positions × width` values in the cache's element type.
#[derive(Debug, Clone, PartialEq)]
pub enum KvRows {
    F32(Vec<f32>),
    /// IEEE half bits.
    F16(Vec<u16>),
    /// `width / 32` blocks per position.
    Q8_0(Vec<BlockQ8_0>),
}

impl KvRows {
    fn new(kv_type: KvType) -> KvRows {
        match kv_type {
            KvType::F32 => KvRows::F32(Vec::new()),
            KvType::F16 => KvRows::F16(Vec::new()),
            KvType::Q8_0 => KvRows::Q8_0(Vec::new()),
        }
    }

    pub fn kv_type(&self) -> KvType {
        match self {
            KvRows::F32(_) => KvType::F32,
            KvRows::F16(_) => KvType::F16,
            KvRows::Q8_0(_) => KvType::Q8_0,
        }
    }

    /// Number of stored values (all positions).
    pub fn n_values(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) => v.len(),
            KvRows::Q8_0(v) => v.len() * Q8_0_BLOCK,
        }
    }

    /// Append one row, converted to this type.
    fn push(&mut self, row: &[f32]) {
        match self {
            KvRows::F32(v) => v.extend_from_slice(row),
            KvRows::F16(v) => v.extend(row.iter().map(|&x| f32_to_f16(x))),
            KvRows::Q8_0(v) => quantize_q8_0(row, v),
        }
    }

    /// Keep the first `n_values` values (a multiple of 32 for q8_0).
    fn truncate(&mut self, n_values: usize) {
        match self {
            KvRows::F32(v) => v.truncate(n_values),
            KvRows::F16(v) => v.truncate(n_values),
            KvRows::Q8_0(v) => v.truncate(n_values / Q8_0_BLOCK),
        }
    }

    /// Remove the first `n_values` values (whole rows).
    fn drop_front(&mut self, n_values: usize) {
        match self {
            KvRows::F32(v) => drop(v.drain(..n_values.min(v.len()))),
            KvRows::F16(v) => drop(v.drain(..n_values.min(v.len()))),
            KvRows::Q8_0(v) => drop(v.drain(..(n_values / Q8_0_BLOCK).min(v.len()))),
        }
    }

    /// Values `start..start + len` as f32: borrowed for f32, converted otherwise.
    fn f32_range(&self, start: usize, len: usize) -> Cow<'_, [f32]> {
        match self {
            KvRows::F32(v) => Cow::Borrowed(&v[start..start + len]),
            KvRows::F16(v) => Cow::Owned(
                v[start..start + len]
                    .iter()
                    .map(|&h| f16_to_f32(h))
                    .collect(),
            ),
            KvRows::Q8_0(v) => {
                let mut out = vec![0.0; len];
                dequantize_q8_0(&v[start / Q8_0_BLOCK..(start + len) / Q8_0_BLOCK], &mut out);
                Cow::Owned(out)
            }
        }
    }

    /// The stored bytes, little-endian (f32 / f16 values; Q8_0 blocks as `d` then 32 `i8`).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            KvRows::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            KvRows::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            KvRows::Q8_0(v) => {
                let mut out = Vec::with_capacity(v.len() * Q8_0_BLOCK_BYTES);
                for b in v {
                    out.extend_from_slice(&b.d.to_le_bytes());
                    out.extend(b.qs.iter().map(|&q| q as u8));
                }
                out
            }
        }
    }

    /// The inverse of [`KvRows::to_le_bytes`]; `None` when `bytes` is not a whole number of
    /// elements of `kv_type`.
    pub fn from_le_bytes(kv_type: KvType, bytes: &[u8]) -> Option<KvRows> {
        Some(match kv_type {
            KvType::F32 => {
                if !bytes.len().is_multiple_of(4) {
                    return None;
                }
                KvRows::F32(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
            }
            KvType::F16 => {
                if !bytes.len().is_multiple_of(2) {
                    return None;
                }
                KvRows::F16(
                    bytes
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                )
            }
            KvType::Q8_0 => {
                if !bytes.len().is_multiple_of(Q8_0_BLOCK_BYTES) {
                    return None;
                }
                KvRows::Q8_0(
                    bytes
                        .chunks_exact(Q8_0_BLOCK_BYTES)
                        .map(|c| BlockQ8_0 {
                            d: u16::from_le_bytes([c[0], c[1]]),
                            qs: std::array::from_fn(|i| c[2 + i] as i8),
                        })
                        .collect(),
                )
            }
        })
    }
}

/// KV cache of one attention layer: `len` positions × `width` (= KV heads × head dim) values for
/// keys and for values, stored in the element type chosen at creation (f32 by default).
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    pub width: usize,
    k: KvRows,
    v: KvRows,
}

impl Default for KvCache {
    fn default() -> KvCache {
        KvCache::new(0)
    }
}

impl KvCache {
    /// An empty f32 cache.
    pub fn new(width: usize) -> KvCache {
        KvCache::with_type(width, KvType::F32)
    }

    /// An empty cache of `kv_type` elements. For q8_0 every head's row must be whole blocks
    /// ([`KvType::check_head_dim`], checked by [`SequenceState::with_kv_type`]).
    pub fn with_type(width: usize, kv_type: KvType) -> KvCache {
        KvCache {
            width,
            k: KvRows::new(kv_type),
            v: KvRows::new(kv_type),
        }
    }

    /// A cache holding `k` and `v` (from [`KvRows::from_le_bytes`]); fails when they differ in
    /// type or length or are not whole rows of `width`.
    pub fn from_rows(width: usize, k: KvRows, v: KvRows) -> Result<KvCache, ModelError> {
        let whole = |r: &KvRows| width > 0 && r.n_values().is_multiple_of(width);
        if k.kv_type() != v.kv_type() || k.n_values() != v.n_values() || !whole(&k) {
            return Err(ModelError::State(format!(
                "KV rows do not match: keys {} × {}, values {} × {}, row width {width}",
                k.n_values(),
                k.kv_type(),
                v.n_values(),
                v.kv_type()
            )));
        }
        Ok(KvCache { width, k, v })
    }

    pub fn kv_type(&self) -> KvType {
        self.k.kv_type()
    }

    pub fn len(&self) -> usize {
        self.k.n_values() / self.width.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.k.n_values() == 0
    }

    /// Append one position: `k` and `v` are `[width]` each, converted to the cache's type.
    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        self.k.push(k);
        self.v.push(v);
    }

    pub fn truncate(&mut self, len: usize) {
        self.k.truncate(len * self.width);
        self.v.truncate(len * self.width);
    }

    /// Remove the oldest `n` positions (the rest move to the front).
    pub fn drop_front(&mut self, n: usize) {
        self.k.drop_front(n * self.width);
        self.v.drop_front(n * self.width);
    }

    /// The stored keys, all positions.
    pub fn keys(&self) -> &KvRows {
        &self.k
    }

    /// The stored values, all positions.
    pub fn values(&self) -> &KvRows {
        &self.v
    }

    /// The key row at `pos` as f32 (borrowed when the cache is f32, dequantized otherwise).
    pub fn key(&self, pos: usize) -> Cow<'_, [f32]> {
        self.k.f32_range(pos * self.width, self.width)
    }

    /// The value row at `pos` as f32 (borrowed when the cache is f32, dequantized otherwise).
    pub fn value(&self, pos: usize) -> Cow<'_, [f32]> {
        self.v.f32_range(pos * self.width, self.width)
    }
}

/// Recurrent state of one DeltaNet layer.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetState {
    /// The previous `conv_kernel − 1` conv inputs, oldest first: `[kernel − 1, channels]`.
    pub conv: Vec<f32>,
    /// Delta-rule state per V head, `[v_heads, k_dim, v_dim]` (row-major `S[k][v]` as in HF).
    pub s: Vec<f32>,
}

#[derive(Debug, Clone)]
pub enum LayerState {
    Attention(KvCache),
    DeltaNet(DeltaNetState),
}

/// Everything a sequence carries from one token to the next.
#[derive(Debug, Clone)]
pub struct SequenceState {
    pub layers: Vec<LayerState>,
    /// Tokens processed so far (the position of the next token).
    pub pos: usize,
    /// While verifying speculative drafts: what [`SequenceState::keep`] needs to roll back.
    pub trace: Option<StepTrace>,
    /// The buffers of the last finished recording, reused by the next [`SequenceState::begin_trace`]
    /// (a verify pass then allocates no state-sized memory).
    spare_trace: SpareTrace,
}

/// Reusable trace buffers; a clone of the state does not copy them (they hold a full recurrent
/// state, 72 MiB on the full-size layout, and carry no information).
#[derive(Debug, Default)]
struct SpareTrace(Option<StepTrace>);

impl Clone for SpareTrace {
    fn clone(&self) -> SpareTrace {
        SpareTrace(None)
    }
}

/// The recording of a run of `Mode::Step` tokens (speculative verification), from which
/// [`SequenceState::keep`] rolls back to any of them: per DeltaNet layer, the state when
/// recording began and the one-token recurrence's inputs of every recorded token. Rolling back
/// to token `n` re-runs the recurrence over the first `n` rows from the initial state — the
/// same operations in the same order as the verify pass, so the state is bit-identical — which
/// costs far less than copying every row's state (72 MiB per row on the full-size layout).
#[derive(Debug, Clone, Default)]
pub struct StepTrace {
    /// Position when recording began.
    start: usize,
    /// Per layer; `None` for attention layers.
    layers: Vec<Option<DeltaTrace>>,
}

/// [`StepTrace`] of one DeltaNet layer.
#[derive(Debug, Clone, Default)]
pub struct DeltaTrace {
    /// The delta-rule state when recording began, `[v_heads, k_dim, v_dim]`: copied by the
    /// layer's first recorded run as its heads read the state ([`DeltaTrace::checkpoint`]), so
    /// a verify pass reads each layer's state once instead of copying all of them first.
    s0: Vec<f32>,
    /// `s0` is still to be copied (nothing recorded yet).
    s0_pending: bool,
    /// The conv state when recording began (`kernel − 1` rows of `channels`), then the conv input
    /// row of every recorded token.
    conv: Vec<f32>,
    /// Delta-rule inputs of each recorded run of tokens, in order.
    runs: Vec<RecordedRun>,
    /// Tokens recorded (over all runs).
    rows: usize,
}

/// The delta-rule inputs of one run of `n` stepped tokens, laid out per V head as
/// [`HeadInputs`] takes them: q and k `[heads, n, dk]`, v `[heads, n, dv]`, β and g `[heads, n]`.
#[derive(Debug, Clone, Default)]
pub struct RecordedRun {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub beta: Vec<f32>,
    pub g: Vec<f32>,
    pub n: usize,
    pub dk: usize,
    pub dv: usize,
}

impl RecordedRun {
    /// Head inputs of the first `rows` tokens of this run.
    fn heads(&self, rows: usize) -> Vec<HeadInputs<'_>> {
        let (n, dk, dv) = (self.n, self.dk, self.dv);
        let heads = self.beta.len() / n.max(1);
        (0..heads)
            .map(|h| HeadInputs {
                q: &self.q[h * n * dk..(h * n + rows) * dk],
                k: &self.k[h * n * dk..(h * n + rows) * dk],
                v: &self.v[h * n * dv..(h * n + rows) * dv],
                beta: &self.beta[h * n..h * n + rows],
                g: &self.g[h * n..h * n + rows],
                dk,
                dv,
            })
            .collect()
    }
}

impl DeltaTrace {
    /// Where the first recorded run must copy the layer's delta-rule state before stepping it
    /// (`Backend::delta_rule_keeping_initial`); `None` once it has been taken.
    pub fn checkpoint(&mut self) -> Option<&mut [f32]> {
        std::mem::take(&mut self.s0_pending).then_some(self.s0.as_mut_slice())
    }

    /// Record a run of stepped tokens: their conv input rows (`n` rows of `channels`) and
    /// delta-rule inputs.
    pub fn record(&mut self, conv_rows: &[Vec<f32>], run: RecordedRun) {
        for row in conv_rows {
            self.conv.extend_from_slice(row);
        }
        self.rows += run.n;
        self.runs.push(run);
    }
}

impl StepTrace {
    /// The recording of layer `layer`, if it is a DeltaNet layer.
    pub fn layer_mut(&mut self, layer: usize) -> Option<&mut DeltaTrace> {
        self.layers.get_mut(layer).and_then(|l| l.as_mut())
    }
}

/// The recurrent part of a [`SequenceState`] at some position; KV caches are not copied.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub pos: usize,
    recurrent: Vec<Option<DeltaNetState>>,
}

impl SequenceState {
    /// An empty sequence with f32 KV caches.
    pub fn new(cfg: &Config) -> SequenceState {
        SequenceState::build(cfg, KvType::F32)
    }

    /// An empty sequence whose KV caches hold `kv_type` elements; fails when the model's head
    /// dimension does not suit the type ([`KvType::check_head_dim`]).
    pub fn with_kv_type(cfg: &Config, kv_type: KvType) -> Result<SequenceState, ModelError> {
        kv_type.check_head_dim(cfg.head_dim)?;
        Ok(SequenceState::build(cfg, kv_type))
    }

    /// [`SequenceState::with_kv_type`] once the type is known to suit the model.
    pub(crate) fn build(cfg: &Config, kv_type: KvType) -> SequenceState {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => LayerState::Attention(KvCache::with_type(
                    cfg.n_kv_heads * cfg.head_dim,
                    kv_type,
                )),
                LayerKind::DeltaNet => LayerState::DeltaNet(DeltaNetState {
                    conv: vec![0.0; (cfg.conv_kernel - 1) * cfg.dn_conv_channels()],
                    s: vec![0.0; cfg.dn_v_heads * cfg.dn_k_dim * cfg.dn_v_dim],
                }),
            })
            .collect();
        SequenceState {
            layers,
            pos: 0,
            trace: None,
            spare_trace: SpareTrace(None),
        }
    }

    /// Start recording every token stepped from here on (speculative verification), so that
    /// [`SequenceState::keep`] can roll back to any of them. Only `Mode::Step` runs are recorded.
    pub fn begin_trace(&mut self) {
        let mut trace = self.spare_trace.0.take().unwrap_or_default();
        trace.start = self.pos;
        trace.layers.resize_with(self.layers.len(), || None);
        for (t, l) in trace.layers.iter_mut().zip(&self.layers) {
            match l {
                LayerState::DeltaNet(d) => {
                    let t = t.get_or_insert_with(DeltaTrace::default);
                    // Sized now, filled by the first recorded run (`checkpoint`).
                    t.s0.resize(d.s.len(), 0.0);
                    t.s0_pending = true;
                    t.conv.clear();
                    t.conv.extend_from_slice(&d.conv);
                    t.runs.clear();
                    t.rows = 0;
                }
                LayerState::Attention(_) => *t = None,
            }
        }
        self.trace = Some(trace);
    }

    /// Keep the first `n` tokens processed since [`SequenceState::begin_trace`] and drop the rest:
    /// the DeltaNet states are rebuilt from the recording, KV caches are truncated. Ends the
    /// recording. The recurrence is re-run by the model crate's delta rule; see
    /// [`SequenceState::keep_with`] to run it on a backend.
    pub fn keep(&mut self, n: usize) -> Result<(), ModelError> {
        self.keep_with(n, |heads, s| {
            delta_rule_heads(heads, s, DeltaRule::Step, None);
        })
    }

    /// [`SequenceState::keep`], re-running the one-token recurrence with `replay(heads, states)`,
    /// which must step every head of `heads` through its rows exactly as the verify pass did
    /// (`Backend::delta_rule` with `DeltaRule::Step` of the same backend).
    pub fn keep_with(
        &mut self,
        n: usize,
        mut replay: impl FnMut(&[HeadInputs], &mut [f32]),
    ) -> Result<(), ModelError> {
        let mut trace = self
            .trace
            .take()
            .ok_or_else(|| ModelError::State("keep() without begin_trace()".into()))?;
        let start = trace.start;
        let processed = self.pos - start;
        if n > processed {
            self.spare_trace.0 = Some(trace);
            return Err(ModelError::State(format!(
                "cannot keep {n} tokens: only {processed} were processed"
            )));
        }
        if n < processed {
            // Check every layer's recording before changing any state.
            if trace.layers.iter().flatten().any(|t| t.rows != processed) {
                self.spare_trace.0 = Some(trace);
                return Err(ModelError::State(
                    "the verified tokens were not run in Mode::Step while recording".into(),
                ));
            }
            for (layer, t) in self.layers.iter_mut().zip(&mut trace.layers) {
                let (LayerState::DeltaNet(d), Some(t)) = (layer, t) else {
                    continue;
                };
                // Conv state after n tokens: the last kernel − 1 inputs up to token n.
                let ch_rows = d.conv.len();
                let ch = (t.conv.len() - ch_rows) / processed.max(1);
                let from = n * ch;
                d.conv.copy_from_slice(&t.conv[from..from + ch_rows]);
                // Delta-rule state: the initial one, stepped through the first n rows again. The
                // buffers trade places instead of copying: the rejected state left in `t.s0` is
                // overwritten by the next `begin_trace`.
                std::mem::swap(&mut d.s, &mut t.s0);
                let mut left = n;
                for run in &t.runs {
                    if left == 0 {
                        break;
                    }
                    let rows = left.min(run.n);
                    replay(&run.heads(rows), &mut d.s);
                    left -= rows;
                }
            }
            self.truncate_kv(start + n);
        }
        self.spare_trace.0 = Some(trace);
        Ok(())
    }

    /// Back to an empty sequence.
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            match l {
                LayerState::Attention(kv) => kv.truncate(0),
                LayerState::DeltaNet(d) => {
                    d.conv.fill(0.0);
                    d.s.fill(0.0);
                }
            }
        }
        self.pos = 0;
        self.trace = None;
    }

    fn has_recurrent_layers(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l, LayerState::DeltaNet(_)))
    }

    /// Drop the positions from `len` on. The recurrent state cannot be rewound, so with DeltaNet
    /// layers this is only possible to `len == 0` or the current position; otherwise restore a
    /// [`Snapshot`] taken at `len`.
    pub fn truncate(&mut self, len: usize) -> Result<(), ModelError> {
        if len > self.pos {
            return Err(ModelError::State(format!(
                "cannot truncate to {len}: only {} positions",
                self.pos
            )));
        }
        if len == 0 {
            self.reset();
            return Ok(());
        }
        if len != self.pos && self.has_recurrent_layers() {
            return Err(ModelError::State(format!(
                "cannot truncate from {} to {len}: DeltaNet state cannot be rewound; restore a snapshot taken at {len}",
                self.pos
            )));
        }
        self.truncate_kv(len);
        Ok(())
    }

    fn truncate_kv(&mut self, len: usize) {
        for l in &mut self.layers {
            if let LayerState::Attention(kv) = l {
                kv.truncate(len);
            }
        }
        self.pos = len;
    }

    /// Copy the recurrent state at the current position.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            pos: self.pos,
            recurrent: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::DeltaNet(d) => Some(d.clone()),
                    LayerState::Attention(_) => None,
                })
                .collect(),
        }
    }

    /// Return to a snapshot taken earlier in this same sequence: recurrent states are copied back
    /// and the KV caches truncated to the snapshot's position.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<(), ModelError> {
        if snap.pos > self.pos || snap.recurrent.len() != self.layers.len() {
            return Err(ModelError::State(format!(
                "snapshot at position {} does not belong to this sequence (position {})",
                snap.pos, self.pos
            )));
        }
        for (l, r) in self.layers.iter_mut().zip(&snap.recurrent) {
            if let (LayerState::DeltaNet(d), Some(saved)) = (l, r) {
                d.clone_from(saved);
            }
        }
        self.truncate_kv(snap.pos);
        Ok(())
    }
}

/// State of the MTP head: the KV cache of its attention layer, one entry per draft slot.
#[derive(Debug, Clone)]
pub struct MtpState {
    /// Cache rows of slots `base..base + kv.len()`.
    pub kv: KvCache,
    /// Slots dropped from the front of the cache ([`MtpState::keep_last`]); 0 unless the
    /// drafter attends over a window.
    pub base: usize,
}

impl MtpState {
    /// An empty MTP state with an f32 KV cache.
    pub fn new(cfg: &Config) -> MtpState {
        MtpState::build(cfg, KvType::F32)
    }

    /// An empty MTP state whose KV cache holds `kv_type` elements (checked like
    /// [`SequenceState::with_kv_type`]).
    pub fn with_kv_type(cfg: &Config, kv_type: KvType) -> Result<MtpState, ModelError> {
        kv_type.check_head_dim(cfg.head_dim)?;
        Ok(MtpState::build(cfg, kv_type))
    }

    pub(crate) fn build(cfg: &Config, kv_type: KvType) -> MtpState {
        MtpState {
            kv: KvCache::with_type(cfg.n_kv_heads * cfg.head_dim, kv_type),
            base: 0,
        }
    }

    /// Slots run so far (the next slot's position).
    pub fn slots(&self) -> usize {
        self.base + self.kv.len()
    }

    /// Back to `slots` slots (at least `base`: dropped slots do not come back).
    pub fn truncate(&mut self, slots: usize) {
        self.kv.truncate(slots.saturating_sub(self.base));
    }

    /// Keep the cache rows of the last `window` slots only (a sliding-window MTP drafter: drafts
    /// attend over recent slots; positions stay absolute).
    pub fn keep_last(&mut self, window: usize) {
        let n = self.kv.len();
        if n > window {
            self.kv.drop_front(n - window);
            self.base += n - window;
        }
    }
}
