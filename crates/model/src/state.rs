//! Per-sequence state: the KV cache of each attention layer, the conv history and delta-rule state
//! of each DeltaNet layer, and the position. Snapshots hold only the fixed-size recurrent part;
//! restoring one truncates the KV caches to the snapshot's position.

use crate::config::{Config, LayerKind};
use crate::ModelError;

/// f32 KV cache of one attention layer: `len` positions × `width` (= KV heads × head dim) values each.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub width: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl KvCache {
    pub fn new(width: usize) -> KvCache {
        KvCache {
            width,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.k.len() / self.width.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }

    pub fn push(&mut self, k: &[f32], v: &[f32]) {
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
    }

    pub fn truncate(&mut self, len: usize) {
        self.k.truncate(len * self.width);
        self.v.truncate(len * self.width);
    }

    pub fn key(&self, pos: usize) -> &[f32] {
        &self.k[pos * self.width..(pos + 1) * self.width]
    }

    pub fn value(&self, pos: usize) -> &[f32] {
        &self.v[pos * self.width..(pos + 1) * self.width]
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
    /// While verifying speculative drafts: the DeltaNet states after every stepped token.
    pub trace: Option<StepTrace>,
}

/// DeltaNet states recorded after every token of a run of `Mode::Step` tokens, so that
/// [`SequenceState::keep`] can roll back to any of them without recomputing.
#[derive(Debug, Clone)]
pub struct StepTrace {
    /// The state when recording began.
    pub initial: Snapshot,
    /// `states[layer][t]`: the state of DeltaNet layer `layer` after the `t`-th recorded token
    /// (empty for attention layers).
    pub states: Vec<Vec<DeltaNetState>>,
}

/// The recurrent part of a [`SequenceState`] at some position; KV caches are not copied.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub pos: usize,
    recurrent: Vec<Option<DeltaNetState>>,
}

impl SequenceState {
    pub fn new(cfg: &Config) -> SequenceState {
        let layers = cfg
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Attention => {
                    LayerState::Attention(KvCache::new(cfg.n_kv_heads * cfg.head_dim))
                }
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
        }
    }

    /// Start recording the DeltaNet state after every token stepped from here on (speculative
    /// verification). Only `Mode::Step` runs are recorded.
    pub fn begin_trace(&mut self) {
        self.trace = Some(StepTrace {
            initial: self.snapshot(),
            states: vec![Vec::new(); self.layers.len()],
        });
    }

    /// Keep the first `n` tokens processed since [`SequenceState::begin_trace`] and drop the rest:
    /// recurrent states come from the recording, KV caches are truncated. Ends the recording.
    pub fn keep(&mut self, n: usize) -> Result<(), ModelError> {
        let trace = self
            .trace
            .take()
            .ok_or_else(|| ModelError::State("keep() without begin_trace()".into()))?;
        let start = trace.initial.pos;
        let processed = self.pos - start;
        if n > processed {
            return Err(ModelError::State(format!(
                "cannot keep {n} tokens: only {processed} were processed"
            )));
        }
        if n == processed {
            return Ok(());
        }
        if n == 0 {
            return self.restore(&trace.initial);
        }
        for (layer, recorded) in self.layers.iter_mut().zip(trace.states) {
            if let LayerState::DeltaNet(d) = layer {
                let saved = recorded.into_iter().nth(n - 1).ok_or_else(|| {
                    ModelError::State(
                        "the verified tokens were not run in Mode::Step while recording".into(),
                    )
                })?;
                *d = saved;
            }
        }
        self.truncate_kv(start + n);
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
    pub kv: KvCache,
}

impl MtpState {
    pub fn new(cfg: &Config) -> MtpState {
        MtpState {
            kv: KvCache::new(cfg.n_kv_heads * cfg.head_dim),
        }
    }
}
