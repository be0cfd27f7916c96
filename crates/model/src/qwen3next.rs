//! The Qwen3-Next forward pass, one function per block, in plain f32 (the oracle).
//!
//! Decoder layer: `h = x + Mixer(RMSNorm_in(x))`, `out = h + MoE(RMSNorm_post(h))`; the mixer is
//! Gated DeltaNet on three of every four layers and gated full attention on the fourth.
//! After the last layer: final RMSNorm, then the lm_head.

use std::path::Path;
use std::sync::Arc;

use redlite_gguf::GgufFile;

use crate::backend::{
    matvec_rows, matvec_rows_many, Backend, LinearData, LinearSource, Oracle, PARALLEL_ROWS,
};
use crate::config::Config;
use crate::delta_rule::{DeltaRule, HeadInputs};
use crate::kv_type::KvType;
use crate::ops::{
    dot, l2_normalize, rms_norm, rms_norm_into, rope_angles, rope_neox_with, sigmoid, silu,
    softmax, softplus, top_k,
};
use crate::state::{
    DeltaNetState, DeltaTrace, KvCache, LayerState, MtpState, RecordedRun, SequenceState,
};
use crate::weights::{
    AttentionWeights, DeltaNetWeights, LayerWeights, MixerWeights, MoeWeights, MtpWeights, Weights,
};
use crate::ModelError;

/// The ε of the L2 normalisation of DeltaNet q and k (HF's `l2norm` default).
const L2_NORM_EPS: f32 = 1e-6;

/// `f(i)` for `i` in `0..n`, on the backend's threads when `n ≥ PARALLEL_ROWS`.
fn map_range<B: Backend, R: Send>(b: &B, n: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    if n < PARALLEL_ROWS {
        return (0..n).map(f).collect();
    }
    let mut slots: Vec<Option<R>> = (0..n).map(|_| None).collect();
    b.for_each_item(&mut slots, |i, slot| *slot = Some(f(i)));
    slots
        .into_iter()
        .map(|r| r.expect("for_each_item visits every item"))
        .collect()
}

/// `f` of every row, on the backend's threads for runs of [`PARALLEL_ROWS`] rows or more.
fn map_rows<B: Backend, T: Sync, R: Send>(
    b: &B,
    xs: &[T],
    f: impl Fn(&T) -> R + Sync + Send,
) -> Vec<R> {
    map_range(b, xs.len(), |i| f(&xs[i]))
}

/// A single token's gated-norm heads go to the backend's threads from this many elements: each
/// element costs an `exp` (SiLU of the gate), ~4k of them per layer at full size, which the
/// calling thread would otherwise do alone.
const STEP_PARALLEL_ELEMENTS: usize = 4096;

/// `f(i, &mut items[i])` for every item, on the backend's threads for runs of [`PARALLEL_ROWS`]
/// or more.
fn for_each_row<B: Backend, T: Send>(
    b: &B,
    items: &mut [T],
    f: impl Fn(usize, &mut T) + Sync + Send,
) {
    if items.len() >= PARALLEL_ROWS {
        b.for_each_item(items, f);
    } else {
        items.iter_mut().enumerate().for_each(|(i, t)| f(i, t));
    }
}

/// `h += m` row by row, on the backend's threads for long runs.
fn add_rows<B: Backend>(b: &B, x: &mut [Vec<f32>], m: &[Vec<f32>]) {
    for_each_row(b, x, |i, h| add_in_place(h, &m[i]));
}

/// How a run of tokens goes through the DeltaNet layers. Both give the same result up to rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The chunked prompt algorithm (chunks of 64 tokens).
    Prefill,
    /// The one-token recurrence, token after token.
    Step,
}

/// A loaded Qwen3-Next model running on backend `B` (the f32 [`Oracle`] unless chosen).
pub struct Model<B: Backend = Oracle> {
    pub config: Config,
    pub weights: Weights<B>,
    pub backend: B,
    pub file: Arc<GgufFile>,
    /// Element type of the KV caches of new states (f32 unless [`Model::set_kv_type`]).
    kv_type: KvType,
}

impl Model<Oracle> {
    /// Open a GGUF file and load it on the oracle backend.
    pub fn load(path: impl AsRef<Path>) -> Result<Model<Oracle>, ModelError> {
        Model::load_with(path, Oracle)
    }
}

impl<B: Backend> Model<B> {
    /// Open a GGUF file and load it on `backend`.
    pub fn load_with(path: impl AsRef<Path>, backend: B) -> Result<Model<B>, ModelError> {
        let file = Arc::new(GgufFile::open(path.as_ref())?);
        Model::from_gguf(file, backend)
    }

    pub fn from_gguf(file: Arc<GgufFile>, backend: B) -> Result<Model<B>, ModelError> {
        let config = Config::from_gguf(&file)?;
        let weights = Weights::load(&file, &config, &backend)?;
        Ok(Model {
            config,
            weights,
            backend,
            file,
            kv_type: KvType::F32,
        })
    }

    /// Store the KV caches of states made from now on in `kv_type`; fails when the model's head
    /// dimension does not suit it (q8_0 needs a multiple of 32).
    pub fn set_kv_type(&mut self, kv_type: KvType) -> Result<(), ModelError> {
        kv_type.check_head_dim(self.config.head_dim)?;
        self.kv_type = kv_type;
        Ok(())
    }

    /// The element type of the KV caches of new states.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// An empty sequence (KV caches in [`Model::kv_type`]).
    pub fn new_state(&self) -> SequenceState {
        SequenceState::build(&self.config, self.kv_type)
    }

    /// An empty MTP state (KV cache in [`Model::kv_type`]).
    pub fn new_mtp_state(&self) -> MtpState {
        MtpState::build(&self.config, self.kv_type)
    }

    pub fn has_mtp(&self) -> bool {
        self.weights.mtp.is_some()
    }

    /// Row `id` of the token embedding.
    pub fn embed(&self, id: u32) -> Result<Vec<f32>, ModelError> {
        self.weights.token_embd.row(id)
    }

    /// Run `tokens` after what `state` already holds; returns the final hidden state (after the
    /// output norm) of each token, `[tokens.len()][hidden]`.
    pub fn forward_hidden(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        mode: Mode,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let x = self.run_layers(state, tokens, mode, false)?;
        Ok(map_rows(&self.backend, &x, |h| self.output_norm(h)))
    }

    /// The final norm of a residual row (`output_norm`), before the lm_head.
    fn output_norm(&self, h: &[f32]) -> Vec<f32> {
        rms_norm(h, &self.weights.output_norm, self.config.rms_eps)
    }

    /// [`Model::forward_hidden`]'s last row only (`None` for no tokens), what a prompt needs
    /// when nothing reads the other rows' hidden states: the state ends the same and the row is
    /// the same bits. In the last layer the other rows then matter only through the cache rows
    /// they leave, so an attention layer there computes only their keys and values
    /// ([`push_cache_rows`]) and runs whole for the last row (llama.cpp likewise drops the
    /// rows without outputs before the last layer's feed-forward).
    pub fn forward_last(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        mode: Mode,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let x = self.run_layers(state, tokens, mode, true)?;
        Ok(x.last().map(|h| self.output_norm(h)))
    }

    /// The logits of `tokens`' last row ([`Model::forward_last`], then the lm_head of that row;
    /// `None` for no tokens): a prompt whose other rows nothing reads.
    pub fn last_logits(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        mode: Mode,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let last = self.forward_last(state, tokens, mode)?;
        Ok(last.and_then(|h| self.lm_head(&[h]).pop()))
    }

    /// The layers over `tokens`: the residual stream of every row after the last layer, or with
    /// `last_only` the rows whose last-layer output was computed (see [`Model::forward_last`]).
    fn run_layers(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        mode: Mode,
        last_only: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.config;
        let b = &self.backend;
        let mut x = map_rows(b, tokens, |&t| self.embed(t))
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        let pos0 = state.pos;
        let n_layers = self.weights.layers.len();
        // The layers as one pass on the backend's threads (see `Backend::run_pass`).
        b.run_pass(|| {
            let mut trace = state.trace.as_mut();
            for (i, (w, st)) in self
                .weights
                .layers
                .iter()
                .zip(state.layers.iter_mut())
                .enumerate()
            {
                let recorder = match (&mut trace, mode) {
                    (Some(t), Mode::Step) => t.layer_mut(i),
                    _ => None,
                };
                let n = x.len();
                if let (true, true, MixerWeights::Attention(a), LayerState::Attention(kv)) =
                    (last_only && i + 1 == n_layers, n > 1, &w.mixer, &mut *st)
                {
                    // Rows 0..n-1: their cache rows only; then the whole layer for the last.
                    push_cache_rows(b, cfg, &w.attn_norm, a, kv, &x[..n - 1], pos0);
                    x.drain(..n - 1);
                    decoder_layer(b, cfg, w, st, &mut x, pos0 + n - 1, mode, recorder);
                } else {
                    decoder_layer(b, cfg, w, st, &mut x, pos0, mode, recorder);
                }
            }
        });
        state.pos += tokens.len();
        Ok(x)
    }

    /// Keep the first `n` tokens processed since `state.begin_trace()` and drop the rest
    /// ([`SequenceState::keep_with`]): the DeltaNet recurrence over the kept rows is re-run on
    /// this model's backend, bit-identical to the verify pass that computed them.
    pub fn keep(&self, state: &mut SequenceState, n: usize) -> Result<(), ModelError> {
        state.keep_with(n, |heads, s| {
            self.backend.delta_rule(heads, s, DeltaRule::Step, None);
        })
    }

    /// The lm_head: logits over the vocabulary for each final hidden state.
    pub fn lm_head(&self, hidden: &[Vec<f32>]) -> Vec<Vec<f32>> {
        matvec_rows(&self.backend, &self.weights.output, hidden)
    }

    /// A draft head: the lm_head's rows for the token ids `ids` only, as one linear layer
    /// (`[ids.len(), hidden]`; its output `i` is the logit of `ids[i]`, bit-identical to that
    /// entry of [`Model::lm_head`]). MTP drafting scores part of the vocabulary with it (FR-Spec,
    /// EAGLE-3's reduced draft vocabulary): only the verify pass needs every logit.
    pub fn head_rows(&self, ids: &[u32]) -> Result<B::Linear, ModelError> {
        let t = self
            .file
            .tensor("output.weight")
            .or_else(|| self.file.tensor("token_embd.weight"))
            .ok_or_else(|| ModelError::State("no output.weight or token_embd.weight".into()))?;
        let row = t.ty.row_bytes(self.config.hidden as u64).ok_or_else(|| {
            ModelError::State(format!("{}: row not whole blocks of {}", t.name, t.ty))
        })? as usize;
        let data = self.file.tensor_data(t);
        let mut bytes = Vec::with_capacity(ids.len() * row);
        for &id in ids {
            let r = id as usize;
            let src = data.get(r * row..(r + 1) * row).ok_or_else(|| {
                ModelError::State(format!("head_rows: token {id} outside {}", t.name))
            })?;
            bytes.extend_from_slice(src);
        }
        self.backend.load_linear(LinearSource {
            name: format!("{} (draft rows)", t.name),
            ty: t.ty,
            rows: ids.len(),
            cols: self.config.hidden,
            data: LinearData::Owned(bytes),
            expert: None,
        })
    }

    /// Logits of every token, `[tokens.len()][vocab]`.
    pub fn forward(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        mode: Mode,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        // The lm_head in the same pass as the layers (see `Backend::run_pass`).
        self.backend.run_pass(|| {
            let hidden = self.forward_hidden(state, tokens, mode)?;
            Ok(self.lm_head(&hidden))
        })
    }

    /// MTP draft logits for token t+2 from `hidden_t` (the trunk's final hidden state at position t)
    /// and `next_token` (token t+1). The MTP decoder layer runs at RoPE position `t`, the slot's
    /// position in `mtp_state` (its KV cache must hold the slots 0..t).
    pub fn mtp_logits(
        &self,
        mtp_state: &mut MtpState,
        hidden_t: &[f32],
        next_token: u32,
        t: usize,
    ) -> Result<Vec<f32>, ModelError> {
        // The one-slot case of `mtp_hidden`, then the lm_head.
        let out = self.mtp_hidden(mtp_state, &[hidden_t.to_vec()], &[next_token], t)?;
        Ok(self.lm_head(&out).pop().unwrap_or_default())
    }

    /// The MTP block over a run of slots `t0, t0+1, ..` at once, without the lm_head: row `i`
    /// takes `hidden[i]` (a final hidden state) and `next_tokens[i]` and returns the MTP's own
    /// output hidden state (after its shared-head norm), so that [`Model::lm_head`] of it equals
    /// [`Model::mtp_logits`] for the same inputs and chained drafting can feed it back. Every row
    /// is computed as a one-row call would (`Mode::Step`); the cache must hold the slots `0..t0`.
    pub fn mtp_hidden(
        &self,
        mtp_state: &mut MtpState,
        hidden: &[Vec<f32>],
        next_tokens: &[u32],
        t0: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.config;
        let mtp = self.weights.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        if mtp_state.slots() != t0 || hidden.len() != next_tokens.len() {
            return Err(ModelError::State(format!(
                "MTP slots from {t0}: the cache holds {} slots, {} hidden rows for {} tokens",
                mtp_state.slots(),
                hidden.len(),
                next_tokens.len()
            )));
        }
        let mut x = self.mtp_inputs(mtp, hidden, next_tokens)?;
        let mut layer_state = LayerState::Attention(std::mem::take(&mut mtp_state.kv));
        // As one pass on the backend's threads, like the trunk (see `Backend::run_pass`).
        self.backend.run_pass(|| {
            decoder_layer(
                &self.backend,
                cfg,
                &mtp.layer,
                &mut layer_state,
                &mut x,
                t0,
                Mode::Step,
                None,
            )
        });
        if let LayerState::Attention(kv) = layer_state {
            mtp_state.kv = kv;
        }
        Ok(x.iter()
            .map(|h| rms_norm(h, &mtp.shared_head_norm, cfg.rms_eps))
            .collect())
    }

    /// The MTP block's catch-up over slots `t0, t0+1, ..`: the cache gains every slot and the
    /// output hidden state of the last one is returned (`None` for no slots); the cache and that
    /// row are [`Model::mtp_hidden`]'s over the same slots, bit for bit. The block is one layer,
    /// so a slot's key and value rows depend on that slot alone: every slot but the last needs
    /// only its input row (`eh_proj`), its attention norm and the key / value projections
    /// ([`push_cache_rows`]); the queries, the attention, the output projection and the MoE run
    /// for the last slot only, the one a draft continues from. (After a prompt-lookup stretch of
    /// a hundred accepted tokens, the MTP cache catches up on a hundred slots at once.)
    pub fn mtp_catch_up(
        &self,
        mtp_state: &mut MtpState,
        hidden: &[Vec<f32>],
        next_tokens: &[u32],
        t0: usize,
    ) -> Result<Option<Vec<f32>>, ModelError> {
        let n = hidden.len();
        if n <= 1 || n != next_tokens.len() {
            return Ok(self.mtp_hidden(mtp_state, hidden, next_tokens, t0)?.pop());
        }
        let cfg = &self.config;
        let mtp = self.weights.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        let (MixerWeights::Attention(attn), true) = (&mtp.layer.mixer, mtp_state.slots() == t0)
        else {
            // Slots that do not follow the cache: `mtp_hidden` reports them. (The MTP layer is
            // an attention layer in every Qwen3-Next file; `mtp_hidden` assumes it as well.)
            return Ok(self.mtp_hidden(mtp_state, hidden, next_tokens, t0)?.pop());
        };
        let b = &self.backend;
        let x = self.mtp_inputs(mtp, &hidden[..n - 1], &next_tokens[..n - 1])?;
        b.run_pass(|| {
            push_cache_rows(
                b,
                cfg,
                &mtp.layer.attn_norm,
                attn,
                &mut mtp_state.kv,
                &x,
                t0,
            );
        });
        Ok(self
            .mtp_hidden(
                mtp_state,
                &hidden[n - 1..],
                &next_tokens[n - 1..],
                t0 + n - 1,
            )?
            .pop())
    }

    /// The MTP block's input rows: `eh_proj · [enorm(embed(next_token)) | hnorm(hidden)]` per
    /// slot, one product for all slots (each row bit-identical to its own matvec).
    fn mtp_inputs(
        &self,
        mtp: &MtpWeights<B>,
        hidden: &[Vec<f32>],
        next_tokens: &[u32],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let eps = self.config.rms_eps;
        let mut eh = Vec::with_capacity(hidden.len());
        for (h, &tok) in hidden.iter().zip(next_tokens) {
            let e = rms_norm(&self.embed(tok)?, &mtp.enorm, eps);
            let h = rms_norm(h, &mtp.hnorm, eps);
            eh.push([e, h].concat());
        }
        Ok(matvec_rows(&self.backend, &mtp.eh_proj, &eh))
    }
}

/// One decoder layer over a run of tokens at positions `pos0..`, updating `x` in place.
#[allow(clippy::too_many_arguments)]
fn decoder_layer<B: Backend>(
    b: &B,
    cfg: &Config,
    w: &LayerWeights<B>,
    st: &mut LayerState,
    x: &mut [Vec<f32>],
    pos0: usize,
    mode: Mode,
    recorder: Option<&mut DeltaTrace>,
) {
    let normed = map_rows(b, x, |h| rms_norm(h, &w.attn_norm, cfg.rms_eps));
    let mixed = match (&w.mixer, st) {
        (MixerWeights::Attention(a), LayerState::Attention(kv)) => {
            gated_attention(b, cfg, a, kv, &normed, pos0)
        }
        (MixerWeights::DeltaNet(d), LayerState::DeltaNet(s)) => {
            gated_delta_net(b, cfg, d, s, &normed, pos0, mode, recorder)
        }
        _ => unreachable!("layer state kind follows the config"),
    };
    add_rows(b, x, &mixed);
    let post = map_rows(b, x, |h| rms_norm(h, &w.post_attention_norm, cfg.rms_eps));
    add_rows(b, x, &moe(b, cfg, &w.moe, &post));
}

/// `W_i · x` for every row of `xs` and each of `N` weights: a single row (a decode step) as one
/// [`Backend::matvecs`] call, longer runs one batched product per weight.
fn projections<B: Backend, const N: usize>(
    b: &B,
    ws: [&B::Linear; N],
    xs: &[Vec<f32>],
) -> [Vec<Vec<f32>>; N] {
    if let [x] = xs {
        let mut ys = b.matvecs(&ws, x).into_iter();
        return std::array::from_fn(|_| vec![ys.next().unwrap_or_default()]);
    }
    matvec_rows_many(b, ws, xs)
}

fn add_in_place(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// Gated full attention. Per query head the projection holds `[query | gate]`; q and k are
/// RMS-normed per head (QK-norm), then partially rotated (NeoX RoPE on the first `rope_dims`);
/// causal softmax attention with GQA; the output is multiplied by `sigmoid(gate)` before `wo`.
fn gated_attention<B: Backend>(
    b: &B,
    cfg: &Config,
    w: &AttentionWeights<B>,
    kv: &mut KvCache,
    xs: &[Vec<f32>],
    pos0: usize,
) -> Vec<Vec<f32>> {
    let (nh, hd) = (cfg.n_heads, cfg.head_dim);
    let scale = 1.0 / (hd as f32).sqrt();
    // qg [t][nh, 2, hd], k and v [t][nkv, hd].
    let [qg_all, k_all, v_all] = projections(b, [&w.wq, &w.wk, &w.wv], xs);
    // Per row: q (QK-normed, rotated), its gate, k (QK-normed, rotated); the rows in parallel,
    // each computed as a one-token step computes it.
    let prepared: Vec<[Vec<f32>; 3]> = map_range(b, xs.len(), |t| {
        let angles = rope_angles(pos0 + t, cfg.rope_dims, cfg.rope_theta);
        let qg = &qg_all[t];
        let mut q = vec![0.0f32; nh * hd];
        let mut gate = vec![0.0f32; nh * hd];
        for h in 0..nh {
            let head = &qg[h * 2 * hd..(h + 1) * 2 * hd];
            let qh = &mut q[h * hd..(h + 1) * hd];
            rms_norm_into(&head[..hd], &w.q_norm, cfg.rms_eps, qh);
            rope_neox_with(qh, &angles);
            gate[h * hd..(h + 1) * hd].copy_from_slice(&head[hd..]);
        }
        [q, gate, key_row(cfg, w, &k_all[t], &angles)]
    });
    let (mut qs, mut gates) = (Vec::with_capacity(xs.len()), Vec::with_capacity(xs.len()));
    for ([q, gate, k], v) in prepared.into_iter().zip(&v_all) {
        kv.push(&k, v);
        qs.push(q);
        gates.push(gate);
    }
    // Causal attention: row t over positions 0..=pos0 + t, as a one-token step would.
    let attn_out = b.attention_rows(&qs, kv, nh, hd, scale);
    // Each row times the sigmoid of its gate.
    let mut rows: Vec<(Vec<f32>, Vec<f32>)> = attn_out.into_iter().zip(gates).collect();
    for_each_row(b, &mut rows, |_, (o, gate)| {
        b.sigmoid_in_place(gate);
        for (od, gd) in o.iter_mut().zip(gate.iter()) {
            *od *= *gd;
        }
    });
    let attn_out: Vec<Vec<f32>> = rows.into_iter().map(|(o, _)| o).collect();
    matvec_rows(b, &w.wo, &attn_out)
}

/// A key row as the cache holds it: each KV head's projection QK-normed, then rotated.
fn key_row<B: Backend>(
    cfg: &Config,
    w: &AttentionWeights<B>,
    k_in: &[f32],
    angles: &[(f32, f32)],
) -> Vec<f32> {
    let hd = cfg.head_dim;
    let mut k = vec![0.0f32; k_in.len()];
    for (kh, src) in k.chunks_exact_mut(hd).zip(k_in.chunks_exact(hd)) {
        rms_norm_into(src, &w.k_norm, cfg.rms_eps, kh);
        rope_neox_with(kh, angles);
    }
    k
}

/// What an attention layer leaves in its cache for the rows `xs` (its input, before
/// `attn_norm`) at positions `pos0..`: each row's key and value as [`gated_attention`] appends
/// them, without the queries, the attention or anything after it.
fn push_cache_rows<B: Backend>(
    b: &B,
    cfg: &Config,
    attn_norm: &[f32],
    w: &AttentionWeights<B>,
    kv: &mut KvCache,
    xs: &[Vec<f32>],
    pos0: usize,
) {
    let normed = map_rows(b, xs, |h| rms_norm(h, attn_norm, cfg.rms_eps));
    let [k_all, v_all] = projections(b, [&w.wk, &w.wv], &normed);
    let ks = map_range(b, xs.len(), |t| {
        let angles = rope_angles(pos0 + t, cfg.rope_dims, cfg.rope_theta);
        key_row(cfg, w, &k_all[t], &angles)
    });
    for (k, v) in ks.iter().zip(&v_all) {
        kv.push(k, v);
    }
}

/// Gated DeltaNet over a run of tokens.
/// 1. `qkv = W_qkv·x` (conv channels [q | k | v]), `z = W_z·x`, `[β-logits, a-logits] = W_ba·x`.
/// 2. Causal depthwise conv (kernel K, the last K−1 inputs kept in the state), then SiLU.
/// 3. L2-normalise q and k per head, scale q by 1/√dk; V head h reads QK head h / (nv/nk).
/// 4. β = sigmoid(b), g = A·softplus(a + dt_bias) (A = −exp(A_log), stored as is).
/// 5. The gated delta rule per V head (chunked for prompts, with chunks on absolute multiples of
///    64 positions; recurrent for steps).
/// 6. Gated RMSNorm per head, `RMSNorm(o)·w ⊙ SiLU(z)`, then `W_out`.
#[allow(clippy::too_many_arguments)]
fn gated_delta_net<B: Backend>(
    b: &B,
    cfg: &Config,
    w: &DeltaNetWeights<B>,
    st: &mut DeltaNetState,
    xs: &[Vec<f32>],
    pos0: usize,
    mode: Mode,
    mut recorder: Option<&mut DeltaTrace>,
) -> Vec<Vec<f32>> {
    let n = xs.len();
    let (nk, nv, dk, dv) = (cfg.dn_k_heads, cfg.dn_v_heads, cfg.dn_k_dim, cfg.dn_v_dim);
    let r = nv / nk;
    let ch = cfg.dn_conv_channels();
    let kern = cfg.conv_kernel;

    // 1. Projections.
    let [qkv, z, ba] = projections(b, [&w.qkv, &w.z, &w.ba], xs);

    // 2. Causal conv over [state history (K−1 rows) | this run's inputs], then SiLU.
    // Its rows as slices (the run's rows are not copied).
    let history: Vec<&[f32]> = st
        .conv
        .chunks_exact(ch)
        .chain(qkv.iter().map(Vec::as_slice))
        .collect();
    // Row t: per channel c, Σ_j tap_j[c] · history[t + j][c], the taps in order from 0.0 (the
    // taps as rows [kern][ch], so a row's channels go through each tap together: vectorises).
    let conv_row = |t: usize| {
        let mut y = vec![0.0f32; ch];
        for j in 0..kern {
            let (tap, h) = (&w.conv_taps[j * ch..(j + 1) * ch], history[t + j]);
            for ((y, &wj), &hj) in y.iter_mut().zip(tap).zip(h) {
                *y += wj * hj;
            }
        }
        b.silu_in_place(&mut y);
        y
    };
    let conv_out: Vec<Vec<f32>> = map_range(b, n, conv_row);
    // The state keeps the last K−1 rows.
    let kept = history[n..].concat();
    st.conv.copy_from_slice(&kept);

    // 3./4. Per-head q, k, v, β, g, laid out per V head for the delta rule: q/k [nv][n][dk], v [nv][n][dv].
    let q_scale = 1.0 / (dk as f32).sqrt();
    let mut q = vec![0.0f32; nv * n * dk];
    let mut k = vec![0.0f32; nv * n * dk];
    let mut v = vec![0.0f32; nv * n * dv];
    let mut beta = vec![0.0f32; nv * n];
    let mut g = vec![0.0f32; nv * n];
    // V head h's rows: q/k [n][dk], v [n][dv], β and g [n].
    let head = |h: usize,
                qh_all: &mut [f32],
                kh_all: &mut [f32],
                vh_all: &mut [f32],
                beta_h: &mut [f32],
                g_h: &mut [f32]| {
        let kh = h / r;
        for (t, y) in conv_out.iter().enumerate() {
            // Normalised in place where they go (no copies per row and head).
            let qh = &mut qh_all[t * dk..(t + 1) * dk];
            qh.copy_from_slice(&y[kh * dk..(kh + 1) * dk]);
            l2_normalize(qh, L2_NORM_EPS);
            for x in qh.iter_mut() {
                *x *= q_scale;
            }
            let khv = &mut kh_all[t * dk..(t + 1) * dk];
            khv.copy_from_slice(&y[nk * dk + kh * dk..nk * dk + (kh + 1) * dk]);
            l2_normalize(khv, L2_NORM_EPS);
            let vo = 2 * nk * dk + h * dv;
            vh_all[t * dv..(t + 1) * dv].copy_from_slice(&y[vo..vo + dv]);
            // ba is grouped per QK head: [β-logits of its r V heads | a-logits of its r V heads].
            let (grp, j) = (h / r, h % r);
            let b_logit = ba[t][grp * 2 * r + j];
            let a_logit = ba[t][grp * 2 * r + r + j];
            beta_h[t] = sigmoid(b_logit);
            g_h[t] = w.a[h] * softplus(a_logit + w.dt_bias[h]);
        }
    };
    if n > 0 {
        let mut parts: Vec<_> = q
            .chunks_mut(n * dk)
            .zip(k.chunks_mut(n * dk))
            .zip(v.chunks_mut(n * dv))
            .zip(beta.chunks_mut(n))
            .zip(g.chunks_mut(n))
            .collect();
        // The heads in parallel for long runs (a head holds a row of every token).
        if n >= PARALLEL_ROWS {
            b.for_each_item(&mut parts, |h, ((((q, k), v), bt), g)| {
                head(h, q, k, v, bt, g)
            });
        } else {
            for (h, ((((q, k), v), bt), g)) in parts.iter_mut().enumerate() {
                head(h, q, k, v, bt, g);
            }
        }
    }

    // 5. The delta rule, one V head at a time. When recording (speculative verification), the
    //    run's conv input rows and delta-rule inputs are kept, so a rollback can re-run the
    //    recurrence over any prefix of the rows.
    let heads: Vec<HeadInputs> = (0..nv)
        .map(|h| HeadInputs {
            q: &q[h * n * dk..(h + 1) * n * dk],
            k: &k[h * n * dk..(h + 1) * n * dk],
            v: &v[h * n * dv..(h + 1) * n * dv],
            beta: &beta[h * n..(h + 1) * n],
            g: &g[h * n..(h + 1) * n],
            dk,
            dv,
        })
        .collect();
    let rule = match mode {
        Mode::Prefill if n > 1 => b.prompt_delta_rule(pos0),
        _ => DeltaRule::Step,
    };
    // While recording, the layer's first run also keeps the state it starts from (the verify's
    // checkpoint), copied head by head as the rows read it.
    let checkpoint = match (recorder.as_deref_mut(), mode) {
        (Some(rec), Mode::Step) => rec.checkpoint(),
        _ => None,
    };
    let o = match checkpoint {
        Some(s0) => b.delta_rule_keeping_initial(&heads, &mut st.s, s0, rule),
        None => b.delta_rule(&heads, &mut st.s, rule, None),
    }
    .concat(); // [nv][n][dv]
    drop(heads);
    if let Some(rec) = recorder.filter(|_| mode == Mode::Step) {
        let run = RecordedRun {
            q,
            k,
            v,
            beta,
            g,
            n,
            dk,
            dv,
        };
        rec.record(&qkv, run);
    }

    // 6. Gated RMSNorm per head, then the output projection.
    // Head h of token t into `out` (`[dv]`).
    // SiLU(z) of every row, in place (the backend's, same values as `ops::silu`).
    let mut z = z;
    for_each_row(b, &mut z, |_, zt| b.silu_in_place(zt));
    let gate_head = |t: usize, h: usize, out: &mut [f32]| {
        let oh = &o[(h * n + t) * dv..(h * n + t + 1) * dv];
        rms_norm_into(oh, &w.norm, cfg.rms_eps, out);
        for (d, o) in out.iter_mut().enumerate() {
            *o *= z[t][h * dv + d];
        }
    };
    let gated: Vec<Vec<f32>> = map_range(b, n, |t| {
        let mut gated = vec![0.0f32; nv * dv];
        if n == 1 && gated.len() >= STEP_PARALLEL_ELEMENTS {
            // One token (decode): its heads on the pool.
            let mut heads: Vec<&mut [f32]> = gated.chunks_mut(dv).collect();
            b.for_each_item(&mut heads, |h, out| gate_head(t, h, out));
        } else {
            for (h, out) in gated.chunks_mut(dv).enumerate() {
                gate_head(t, h, out);
            }
        }
        gated
    });
    matvec_rows(b, &w.out, &gated)
}

/// The routed experts of one token: softmax over the router logits, top-k, weights renormalised to
/// sum to 1; the chosen experts are summed in expert order (as the reference does).
fn expert_choice(cfg: &Config, router_logits: &[f32]) -> Vec<(usize, f32)> {
    let mut probs = router_logits.to_vec();
    softmax(&mut probs);
    let mut chosen = top_k(&probs, cfg.n_experts_used);
    let total: f32 = chosen.iter().map(|&e| probs[e]).sum();
    chosen.sort_unstable();
    chosen.into_iter().map(|e| (e, probs[e] / total)).collect()
}

/// The shared expert of every row, scaled by the row's scalar sigmoid gate. The products are
/// batched over the rows (each weight read once); each row gets what its one-row products give.
fn shared_expert_rows<B: Backend>(b: &B, w: &MoeWeights<B>, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let [gate, up] = matvec_rows_many(b, [&w.shared.gate, &w.shared.up], xs);
    let act: Vec<Vec<f32>> = map_range(b, xs.len(), |t| {
        gate[t]
            .iter()
            .zip(&up[t])
            .map(|(&g, &u)| silu(g) * u)
            .collect()
    });
    let down = matvec_rows(b, &w.shared.down, &act);
    map_range(b, xs.len(), |t| {
        let gate = sigmoid(dot(&w.shared_gate, &xs[t]));
        down[t].iter().map(|v| gate * v).collect()
    })
}

/// MoE block: routed experts plus the gated shared expert, for each token.
fn moe<B: Backend>(b: &B, cfg: &Config, w: &MoeWeights<B>, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let router_logits = matvec_rows(b, &w.router, xs);
    let chosen = map_rows(b, &router_logits, |l| expert_choice(cfg, l));
    if xs.len() == 1 {
        let (shared, gate) = (&w.shared, &w.shared_gate);
        return vec![b.moe_token(&w.experts, &chosen[0], shared, gate, &xs[0])];
    }
    if let Some(out) = b.moe_rows(&w.experts, &chosen, &w.shared, &w.shared_gate, xs) {
        return out;
    }
    let mut out = b.routed_experts_rows(&w.experts, &chosen, xs);
    add_rows(b, &mut out, &shared_expert_rows(b, w, xs));
    out
}
