//! The interface between the model and the hardware that runs it.
//!
//! The model's forward pass (in [`crate::qwen3next`]) is written once; a backend decides how
//! weights are held (dequantized f32, quantized in place in the memory map, on a GPU) and how the
//! heavy operations run. [`Oracle`] is the reference backend: every weight dequantized to f32 and
//! plain loops, obviously correct and slow.

use std::ops::Range;
use std::sync::Arc;

use redlite_gguf::{GgmlType, GgufFile};

use crate::delta_rule::{delta_rule_heads, DeltaRule, HeadInputs};
use crate::ops::Matrix;
use crate::state::KvCache;
use crate::weights::FfnWeights;
use crate::ModelError;

/// The bytes of one linear layer's weight: `rows` output rows of `cols` inputs, each row
/// `cols / block_elems` quant blocks of type `ty`.
pub struct LinearSource<'a> {
    /// Tensor name, for error messages (`blk.0.ffn_up_exps.weight[3]` for one expert's slab).
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: LinearData<'a>,
    /// Set for the slabs of a routed expert: which block and expert they belong to, so that a
    /// backend with an expert cache can fetch them by expert rather than keep them resident.
    pub expert: Option<ExpertTag>,
}

/// One routed expert of one block (trunk layer or MTP block): the unit of the expert cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertTag {
    pub layer: usize,
    pub expert: usize,
    pub part: ExpertPart,
}

/// Which of an expert's three matrices a slab is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertPart {
    Gate = 0,
    Up = 1,
    Down = 2,
}

/// Where the weight bytes are: in place in the memory-mapped file (a backend may keep using them
/// there, holding the `Arc`), or an owned buffer (a layout the loader had to rearrange).
pub enum LinearData<'a> {
    Mapped {
        file: &'a Arc<GgufFile>,
        range: Range<usize>,
    },
    Owned(Vec<u8>),
}

impl LinearSource<'_> {
    /// The raw bytes of this weight.
    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            LinearData::Mapped { file, range } => &file.bytes()[range.clone()],
            LinearData::Owned(v) => v,
        }
    }
}

/// A compute backend.
pub trait Backend: Send + Sync + Sized {
    /// A linear layer's weight in this backend's form.
    type Linear: Send + Sync + 'static;

    /// Short name (`oracle`, `cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// Prepare one linear layer.
    fn load_linear(&self, src: LinearSource) -> Result<Self::Linear, ModelError>;

    /// Called once every weight of `file` has gone through [`Backend::load_linear`]: a backend
    /// with an expert cache sizes and allocates it here, so that errors surface at load.
    fn weights_loaded(&self, file: &Arc<GgufFile>) -> Result<(), ModelError> {
        let _ = file;
        Ok(())
    }

    /// `ys[i] = W · xs[i]` for `n` rows: `xs` is `[n, cols]`, `ys` is `[n, rows]`, both row-major.
    /// Each output row must not depend on the other rows (same arithmetic as `n = 1`).
    fn linear(&self, w: &Self::Linear, xs: &[f32], n: usize, ys: &mut [f32]);

    /// [`Backend::linear`] of several weights over the same `n` rows `xs`: `ys[i] = W_i · xs`.
    /// Each output must be what `linear` gives for it; backends may share the work that
    /// depends only on `xs` (the CPU backend quantizes the rows once).
    fn linears(&self, ws: &[&Self::Linear], xs: &[f32], n: usize, ys: &mut [&mut [f32]]) {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            self.linear(w, xs, n, y);
        }
    }

    /// [`Backend::routed_experts`] for several tokens, each with its own choice. Backends group
    /// the tokens by expert so each expert's weights are read once; each token's result must be
    /// exactly what `routed_experts` gives for it alone.
    fn routed_experts_rows(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[Vec<(usize, f32)>],
        xs: &[Vec<f32>],
    ) -> Vec<Vec<f32>> {
        xs.iter()
            .zip(chosen)
            .map(|(x, c)| self.routed_experts(experts, c, x))
            .collect()
    }

    /// `(rows, cols)` of a prepared weight.
    fn linear_shape(&self, w: &Self::Linear) -> (usize, usize);

    /// `W_i · x` for several weights that read the same one activation row (a decode token's
    /// projections). Backends may run them as one parallel pass; each output must be what
    /// [`matvec`] gives for it.
    fn matvecs(&self, ws: &[&Self::Linear], x: &[f32]) -> Vec<Vec<f32>> {
        ws.iter().map(|w| matvec(self, w, x)).collect()
    }

    /// `x ← silu(x)` for every element ([`crate::ops::silu`]; a backend's own version must give
    /// the same bits).
    fn silu_in_place(&self, xs: &mut [f32]) {
        xs.iter_mut().for_each(|x| *x = crate::ops::silu(*x));
    }

    /// `x ← sigmoid(x)` for every element ([`crate::ops::sigmoid`], bit for bit).
    fn sigmoid_in_place(&self, xs: &mut [f32]) {
        xs.iter_mut().for_each(|x| *x = crate::ops::sigmoid(*x));
    }

    /// `W · x` for every row of `xs`, one output vector a row, each what [`Backend::linear`]
    /// gives for it. The default gathers the rows, runs `linear` once and splits its output
    /// ([`linear_rows_gathered`]); a backend may write each row's output in place instead.
    fn linear_rows(&self, w: &Self::Linear, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
        linear_rows_gathered(self, w, xs)
    }

    /// [`Backend::linear_rows`] for several weights that read the same rows (a run's
    /// projections): `out[i][t]` = `ws[i] · xs[t]`, each what [`matvec`] gives. The default
    /// gathers the rows once for one [`Backend::linears`] call and splits the outputs.
    fn linears_rows(&self, ws: &[&Self::Linear], xs: &[Vec<f32>]) -> Vec<Vec<Vec<f32>>> {
        linears_rows_gathered(self, ws, xs)
    }

    /// `f(i, &mut items[i])` for every item, in parallel where the backend has threads: the
    /// per-token work of a run of tokens (norms, conv, gating, routing; the model hands it runs
    /// of [`PARALLEL_ROWS`] or more). Each call must compute what it would alone; the default
    /// spreads the items over rayon's pool.
    fn for_each_item<T: Send>(&self, items: &mut [T], f: impl Fn(usize, &mut T) + Sync + Send) {
        use rayon::prelude::*;
        items.par_iter_mut().enumerate().for_each(|(i, t)| f(i, t));
    }

    /// Runs `f`, one forward pass over the layers, where this backend's parallel regions start
    /// cheapest (the CPU backend: on a thread of its pool, so the pass takes part in its own
    /// regions instead of handing each one over and sleeping). The default runs it here.
    fn run_pass<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// The form of the delta rule a prompt run of several tokens starting at position `pos0` takes
    /// on this backend. Both forms compute the gated delta rule exactly and differ only in
    /// rounding: the chunked algorithm (the default, the oracle's, built for matrix units) or the
    /// token-by-token recurrence ([`DeltaRule::Step`], whose rows then round as decode steps do).
    /// A backend returns the one it computes faster.
    fn prompt_delta_rule(&self, pos0: usize) -> DeltaRule {
        DeltaRule::Chunked { pos0 }
    }

    /// The gated delta rule for every V head of one DeltaNet layer (see
    /// [`crate::delta_rule::delta_rule_heads`], the default, for the contract). Backends run the
    /// heads in parallel; any implementation must give the same result for a row whether it is
    /// stepped alone or with others.
    fn delta_rule(
        &self,
        heads: &[HeadInputs],
        states: &mut [f32],
        rule: DeltaRule,
        traces: Option<&mut [Vec<f32>]>,
    ) -> Vec<Vec<f32>> {
        delta_rule_heads(heads, states, rule, traces)
    }

    /// [`Backend::delta_rule`] that first copies the starting states into `initial` (same
    /// layout): a speculative verify's checkpoint of the layer ([`crate::state::StepTrace`]).
    /// Backends copy each head's state as its rows are about to read it, instead of in a separate
    /// pass over every layer's state before the verify; the result is `delta_rule`'s.
    fn delta_rule_keeping_initial(
        &self,
        heads: &[HeadInputs],
        states: &mut [f32],
        initial: &mut [f32],
        rule: DeltaRule,
    ) -> Vec<Vec<f32>> {
        initial.copy_from_slice(states);
        self.delta_rule(heads, states, rule, None)
    }

    /// Causal softmax attention of one token's query heads `q` (`[n_heads, head_dim]`) over every
    /// position in `kv` (GQA: query head h reads KV head h / (n_heads / kv_heads)), scores scaled by
    /// `scale`. Returns `[n_heads, head_dim]`. The default is the oracle's two-pass softmax.
    fn attention(
        &self,
        q: &[f32],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<f32> {
        attention_two_pass(q, kv, n_heads, head_dim, scale)
    }

    /// Causal attention of a run of tokens whose keys and values are the last `q.len()` rows of
    /// `kv`: row t (`[n_heads, head_dim]`) attends over positions `0..kv.len() - q.len() + t + 1`.
    /// Each row's result must be bit-identical to [`Backend::attention`] with the cache holding
    /// only those positions (a verified row equals a one-token decode). The default does exactly
    /// that, on a truncated copy of the cache per row; backends override it with one pass.
    fn attention_rows(
        &self,
        q: &[Vec<f32>],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<Vec<f32>> {
        let n0 = kv.len() - q.len();
        q.iter()
            .enumerate()
            .map(|(t, qt)| {
                let mut prefix = kv.clone();
                prefix.truncate(n0 + t + 1);
                self.attention(qt, &prefix, n_heads, head_dim, scale)
            })
            .collect()
    }

    /// The MoE block of one token: [`Backend::routed_experts`], then the shared expert
    /// `sigmoid(shared_gate · x) · swiglu(shared, x)` added to it ([`add_shared_expert`]). A
    /// backend may run the shared expert's products alongside the routed ones; the result must
    /// be the same.
    fn moe_token(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[(usize, f32)],
        shared: &FfnWeights<Self>,
        shared_gate: &[f32],
        x: &[f32],
    ) -> Vec<f32> {
        let mut out = self.routed_experts(experts, chosen, x);
        add_shared_expert(&mut out, &swiglu(self, shared, x), shared_gate, x);
        out
    }

    /// The whole MoE block of a short run of tokens (a verify pass), each row exactly what
    /// [`Backend::moe_token`] gives for its token alone; `None` (the default) leaves it to the
    /// model, which runs [`Backend::routed_experts_rows`] and the shared expert as batched
    /// products. A backend whose batched products of a few rows cost more than its one-token
    /// path (small matrices, where each product's hand-off dominates) computes it here instead.
    fn moe_rows(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[Vec<(usize, f32)>],
        shared: &FfnWeights<Self>,
        shared_gate: &[f32],
        xs: &[Vec<f32>],
    ) -> Option<Vec<Vec<f32>>> {
        let _ = (experts, chosen, shared, shared_gate, xs);
        None
    }

    /// The routed experts of one token: `Σ weight_e · down_e(silu(gate_e·x) ⊙ up_e·x)` over the
    /// chosen `(expert, weight)` pairs, summed in the given order. Backends fuse this.
    fn routed_experts(
        &self,
        experts: &[FfnWeights<Self>],
        chosen: &[(usize, f32)],
        x: &[f32],
    ) -> Vec<f32> {
        let mut out = vec![0.0f32; x.len()];
        for &(e, weight) in chosen {
            let y = swiglu(self, &experts[e], x);
            for (o, v) in out.iter_mut().zip(&y) {
                *o += weight * v;
            }
        }
        out
    }
}

/// `y = W · x` for one vector.
pub fn matvec<B: Backend>(b: &B, w: &B::Linear, x: &[f32]) -> Vec<f32> {
    let (rows, _) = b.linear_shape(w);
    let mut y = vec![0.0f32; rows];
    b.linear(w, x, 1, &mut y);
    y
}

/// `W · x` for every row of `xs` ([`Backend::linear_rows`]).
pub fn matvec_rows<B: Backend>(b: &B, w: &B::Linear, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    b.linear_rows(w, xs)
}

/// [`Backend::linear_rows`] through one [`Backend::linear`] call: the rows gathered into one
/// buffer, the output split into a vector a row.
pub fn linear_rows_gathered<B: Backend>(b: &B, w: &B::Linear, xs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    if xs.is_empty() {
        return Vec::new();
    }
    let (rows, _) = b.linear_shape(w);
    let flat: Vec<f32> = xs.concat();
    let mut ys = vec![0.0f32; rows * xs.len()];
    b.linear(w, &flat, xs.len(), &mut ys);
    split_rows(b, ys, rows, xs.len())
}

/// `W_i · x` for every row of `xs` and each weight of `ws`, through one [`Backend::linears`]
/// call (the rows are gathered once, and a backend may prepare them once for all weights);
/// each output row is what [`matvec_rows`] gives.
pub fn matvec_rows_many<B: Backend, const N: usize>(
    b: &B,
    ws: [&B::Linear; N],
    xs: &[Vec<f32>],
) -> [Vec<Vec<f32>>; N] {
    if xs.is_empty() {
        return std::array::from_fn(|_| Vec::new());
    }
    let mut outs = b.linears_rows(&ws, xs).into_iter();
    std::array::from_fn(|_| outs.next().unwrap_or_default())
}

/// [`Backend::linears_rows`] by gathering: the rows concatenated once, one
/// [`Backend::linears`] call, each weight's output split into a vector a row.
pub fn linears_rows_gathered<B: Backend>(
    b: &B,
    ws: &[&B::Linear],
    xs: &[Vec<f32>],
) -> Vec<Vec<Vec<f32>>> {
    let n = xs.len();
    if n == 0 {
        return ws.iter().map(|_| Vec::new()).collect();
    }
    let flat: Vec<f32> = xs.concat();
    let rows: Vec<usize> = ws.iter().map(|w| b.linear_shape(w).0).collect();
    let mut ys: Vec<Vec<f32>> = rows.iter().map(|&r| vec![0.0f32; r * n]).collect();
    {
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        b.linears(ws, &flat, n, &mut outs);
    }
    ys.into_iter()
        .zip(rows)
        .map(|(y, r)| split_rows(b, y, r, n))
        .collect()
}

/// Runs of at least this many tokens do their per-token work (norms, conv, gating, routing,
/// copies) on the backend's threads ([`Backend::for_each_item`]; the CPU backend's own per-row
/// work uses the same threshold); shorter ones (decode steps, short drafts) stay on the calling
/// thread. Each token's values are computed the same way either way.
pub const PARALLEL_ROWS: usize = 16;

/// `n` rows of `rows` values, one vector each.
fn split_rows<B: Backend>(b: &B, ys: Vec<f32>, rows: usize, n: usize) -> Vec<Vec<f32>> {
    if n == 1 {
        // A decode step's row is the whole output (no copy of, e.g., the vocabulary's logits).
        return vec![ys];
    }
    if rows == 0 {
        return vec![Vec::new(); n];
    }
    if n >= PARALLEL_ROWS {
        // Long runs: the copies on the backend's threads.
        let mut out = vec![Vec::new(); n];
        b.for_each_item(&mut out, |i, r| *r = ys[i * rows..(i + 1) * rows].to_vec());
        return out;
    }
    ys.chunks_exact(rows).map(|r| r.to_vec()).collect()
}

/// `out += sigmoid(shared_gate · x) · down`: the gated shared expert (`down` its SwiGLU output)
/// added to the routed sum of one token.
pub fn add_shared_expert(out: &mut [f32], down: &[f32], shared_gate: &[f32], x: &[f32]) {
    let gate = crate::ops::sigmoid(crate::ops::dot(shared_gate, x));
    for (o, v) in out.iter_mut().zip(down) {
        *o += gate * v;
    }
}

/// One SwiGLU feed-forward: `down(silu(gate·x) ⊙ up·x)`.
pub fn swiglu<B: Backend>(b: &B, w: &FfnWeights<B>, x: &[f32]) -> Vec<f32> {
    let gate = matvec(b, &w.gate, x);
    let up = matvec(b, &w.up, x);
    let act: Vec<f32> = gate
        .iter()
        .zip(&up)
        .map(|(&g, &u)| crate::ops::silu(g) * u)
        .collect();
    matvec(b, &w.down, &act)
}

/// Attention by the book: all scores, softmax, weighted sum of values.
pub fn attention_two_pass(
    q: &[f32],
    kv: &KvCache,
    n_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    attention_two_pass_prefix(q, kv, kv.len(), n_heads, head_dim, scale)
}

/// [`attention_two_pass`] over the first `n` positions of `kv` only.
pub fn attention_two_pass_prefix(
    q: &[f32],
    kv: &KvCache,
    n: usize,
    n_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let hd = head_dim;
    let kv_heads = kv.width / hd;
    let group = n_heads / kv_heads.max(1);
    let mut o = vec![0.0f32; n_heads * hd];
    for h in 0..n_heads {
        let g = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut p: Vec<f32> = (0..n)
            .map(|j| crate::ops::dot(qh, &kv.key(j)[g * hd..(g + 1) * hd]) * scale)
            .collect();
        crate::ops::softmax(&mut p);
        let oh = &mut o[h * hd..(h + 1) * hd];
        for (j, pj) in p.iter().enumerate() {
            for (od, vd) in oh.iter_mut().zip(&kv.value(j)[g * hd..(g + 1) * hd]) {
                *od += pj * vd;
            }
        }
    }
    o
}

/// The reference backend: every weight dequantized to f32 at load, plain loops.
#[derive(Debug, Clone, Copy, Default)]
pub struct Oracle;

impl Backend for Oracle {
    type Linear = Matrix;

    fn attention_rows(
        &self,
        q: &[Vec<f32>],
        kv: &KvCache,
        n_heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Vec<Vec<f32>> {
        let n0 = kv.len() - q.len();
        q.iter()
            .enumerate()
            .map(|(t, qt)| attention_two_pass_prefix(qt, kv, n0 + t + 1, n_heads, head_dim, scale))
            .collect()
    }

    fn name(&self) -> &'static str {
        "oracle"
    }

    fn load_linear(&self, src: LinearSource) -> Result<Matrix, ModelError> {
        let data = redlite_gguf::quant::dequantize_to_vec(src.ty, src.bytes()).map_err(|e| {
            ModelError::Tensor {
                tensor: src.name.clone(),
                message: e.to_string(),
            }
        })?;
        Ok(Matrix {
            rows: src.rows,
            cols: src.cols,
            data,
        })
    }

    fn linear(&self, w: &Matrix, xs: &[f32], n: usize, ys: &mut [f32]) {
        for (x, y) in xs
            .chunks_exact(w.cols)
            .zip(ys.chunks_exact_mut(w.rows))
            .take(n)
        {
            for (r, yr) in y.iter_mut().enumerate() {
                *yr = crate::ops::dot(w.row(r), x);
            }
        }
    }

    fn linear_shape(&self, w: &Matrix) -> (usize, usize) {
        (w.rows, w.cols)
    }
}
