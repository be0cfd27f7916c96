//! The tensor layout of a Qwen3-Next GGUF file as llama.cpp writes it: every tensor's name,
//! shape (ne0 first) and type, plus the `qwen3next.*` metadata, from a handful of
//! hyperparameters. `redlite make-model` writes files from it (random weights, for benchmarks)
//! and tests check it against real files.
//!
//! The DeltaNet layers use the current converter's split form (`attn_qkv` + `attn_gate`), so the
//! full-size 48-layer layout has 3 + 36 × 18 + 12 × 16 = 843 tensors. Small tensors follow the
//! converter's type policy: norms, the router (`ffn_gate_inp`), the shared-expert gate vector
//! (`ffn_gate_inp_shexp`, 1-D), `ssm_conv1d`, `ssm_a` and `ssm_dt.bias` are F32.

use redlite_gguf::{GgmlType, MetaArray, MetaValue};

use crate::ModelError;

/// The names accepted by [`LayoutParams::by_name`].
pub const LAYOUT_NAMES: &[&str] = &["qwen3next-80b-a3b", "qwen3next-tiny"];

/// The hyperparameters a layout is built from (names as in the GGUF keys / HF config).
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutParams {
    /// `general.name` of written files.
    pub name: String,
    pub hidden: u64,
    /// Trunk layers (the MTP block, when present, comes after them).
    pub n_layers: u64,
    pub vocab: u64,
    pub context_length: u64,
    /// `feed_forward_length` (unused by the model, read generically).
    pub feed_forward_length: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
    pub rope_dims: u64,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub n_experts: u64,
    pub n_experts_used: u64,
    pub expert_ff: u64,
    pub shared_ff: u64,
    pub conv_kernel: u64,
    /// DeltaNet QK heads (`ssm.group_count`).
    pub dn_k_heads: u64,
    /// DeltaNet V heads (`ssm.time_step_rank`).
    pub dn_v_heads: u64,
    /// QK head dim (`ssm.state_size`; also the V head dim in llama.cpp).
    pub dn_k_dim: u64,
    pub dn_v_dim: u64,
    /// Layer `i` is full attention iff `(i + 1) % interval == 0`.
    pub full_attention_interval: u64,
    /// Whether an MTP block (`blk.{n_layers}`, with `nextn.*` tensors) follows the trunk.
    pub mtp: bool,
}

impl LayoutParams {
    /// Qwen3-Next-80B-A3B(-Instruct): 48 layers (36 DeltaNet, 12 attention), 512 experts, top 10.
    pub fn qwen3next_80b_a3b() -> LayoutParams {
        LayoutParams {
            name: "qwen3next-80b-a3b-random".into(),
            hidden: 2048,
            n_layers: 48,
            vocab: 151936,
            context_length: 262144,
            feed_forward_length: 5120,
            n_heads: 16,
            n_kv_heads: 2,
            head_dim: 256,
            rope_dims: 64,
            rope_theta: 1e7,
            rms_eps: 1e-6,
            n_experts: 512,
            n_experts_used: 10,
            expert_ff: 512,
            shared_ff: 512,
            conv_kernel: 4,
            dn_k_heads: 16,
            dn_v_heads: 32,
            dn_k_dim: 128,
            dn_v_dim: 128,
            full_attention_interval: 4,
            mtp: false,
        }
    }

    /// The shape of the reference `tiny-*.gguf` fixtures (hidden 256, 4 layers, 4 experts, top 2):
    /// small enough for the f32 oracle, for tests of written files.
    pub fn qwen3next_tiny() -> LayoutParams {
        LayoutParams {
            name: "qwen3next-tiny-random".into(),
            hidden: 256,
            n_layers: 4,
            vocab: 4160,
            context_length: 4096,
            feed_forward_length: 512,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 64,
            rope_dims: 16,
            rope_theta: 1e7,
            rms_eps: 1e-6,
            n_experts: 4,
            n_experts_used: 2,
            expert_ff: 256,
            shared_ff: 256,
            conv_kernel: 4,
            dn_k_heads: 2,
            dn_v_heads: 4,
            dn_k_dim: 64,
            dn_v_dim: 64,
            full_attention_interval: 4,
            mtp: false,
        }
    }

    /// A layout by name (one of [`LAYOUT_NAMES`]).
    pub fn by_name(name: &str) -> Option<LayoutParams> {
        match name {
            "qwen3next-80b-a3b" => Some(Self::qwen3next_80b_a3b()),
            "qwen3next-tiny" => Some(Self::qwen3next_tiny()),
            _ => None,
        }
    }

    /// Whether trunk layer `i` is full attention (else Gated DeltaNet).
    pub fn is_attention(&self, i: u64) -> bool {
        (i + 1).is_multiple_of(self.full_attention_interval)
    }

    /// `block_count`: trunk layers plus the MTP block.
    pub fn block_count(&self) -> u64 {
        self.n_layers + u64::from(self.mtp)
    }

    /// DeltaNet conv channels: q and k of every QK head, v of every V head.
    pub fn dn_conv_channels(&self) -> u64 {
        2 * self.dn_k_heads * self.dn_k_dim + self.dn_v_heads * self.dn_v_dim
    }

    /// DeltaNet value width (`ssm.inner_size`).
    pub fn dn_value_width(&self) -> u64 {
        self.dn_v_heads * self.dn_v_dim
    }
}

/// The quant types of a layout's big tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutTypes {
    /// Every non-expert matrix, including `token_embd` and `ssm_ba`.
    pub dense: GgmlType,
    /// The routed experts (`ffn_{gate,up,down}_exps`).
    pub experts: GgmlType,
    /// `output.weight`.
    pub head: GgmlType,
}

impl Default for LayoutTypes {
    /// Q4_K dense, IQ2_XXS experts, Q6_K head (the ≈ 21.5 GB full-size bench file).
    fn default() -> Self {
        LayoutTypes {
            dense: GgmlType::Q4K,
            experts: GgmlType::IQ2XXS,
            head: GgmlType::Q6K,
        }
    }
}

/// What a tensor is, so that a writer of random weights can pick plausible values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// A matrix (quantized or float) of a linear layer or the embedding.
    Matrix,
    /// An RMSNorm weight with the `+1` folded in (values near 1).
    Norm,
    /// The DeltaNet gated-norm weight (`ssm_norm`, near 1, nothing folded).
    GatedNorm,
    /// `ssm_conv1d`: the depthwise conv taps.
    ConvTaps,
    /// `ssm_dt.bias`.
    DtBias,
    /// `ssm_a` = −exp(A_log): negative.
    DecayA,
    /// `ffn_gate_inp`: the router, F32.
    Router,
    /// `ffn_gate_inp_shexp`: the shared expert's scalar gate vector, F32.
    SharedExpertGate,
}

/// One tensor of a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    /// ne0 first, as stored in GGUF.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub role: TensorRole,
}

impl TensorSpec {
    /// Number of elements.
    pub fn n_elems(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of data (the layout checked that rows are whole blocks).
    pub fn n_bytes(&self) -> u64 {
        let ne0 = self.dims.first().copied().unwrap_or(1);
        let rows: u64 = self.dims.iter().skip(1).product();
        self.ty.row_bytes(ne0).unwrap_or(0) * rows
    }
}

/// A complete file layout: hyperparameters, types and the ordered tensor list.
#[derive(Debug, Clone)]
pub struct Layout {
    pub params: LayoutParams,
    pub types: LayoutTypes,
    pub tensors: Vec<TensorSpec>,
}

impl Layout {
    /// Builds the tensor list. Fails when a type cannot hold a tensor's rows (ne0 not a multiple
    /// of the type's block) or a hyperparameter is zero where it must not be.
    pub fn new(params: LayoutParams, types: LayoutTypes) -> Result<Layout, ModelError> {
        let p = &params;
        for (what, v) in [
            ("hidden", p.hidden),
            ("n_layers", p.n_layers),
            ("vocab", p.vocab),
            ("n_heads", p.n_heads),
            ("n_kv_heads", p.n_kv_heads),
            ("head_dim", p.head_dim),
            ("n_experts", p.n_experts),
            ("n_experts_used", p.n_experts_used),
            ("full_attention_interval", p.full_attention_interval),
            ("dn_k_heads", p.dn_k_heads),
            ("dn_v_heads", p.dn_v_heads),
        ] {
            if v == 0 {
                return Err(ModelError::BadConfig(format!("layout: {what} is 0")));
            }
        }
        if p.n_experts_used > p.n_experts {
            return Err(ModelError::BadConfig(format!(
                "layout: {} experts used of {}",
                p.n_experts_used, p.n_experts
            )));
        }

        let mut b = Builder {
            tensors: Vec::new(),
        };
        let (h, f32) = (p.hidden, GgmlType::F32);
        b.push(
            "token_embd.weight",
            &[h, p.vocab],
            types.dense,
            TensorRole::Matrix,
        );
        b.push("output_norm.weight", &[h], f32, TensorRole::Norm);
        b.push(
            "output.weight",
            &[h, p.vocab],
            types.head,
            TensorRole::Matrix,
        );
        for i in 0..p.n_layers {
            b.layer(p, &types, i, p.is_attention(i));
        }
        if p.mtp {
            let i = p.n_layers;
            b.layer(p, &types, i, true);
            let pre = format!("blk.{i}.nextn.");
            b.push(
                &format!("{pre}eh_proj.weight"),
                &[2 * h, h],
                types.dense,
                TensorRole::Matrix,
            );
            for n in ["enorm", "hnorm", "shared_head_norm"] {
                b.push(&format!("{pre}{n}.weight"), &[h], f32, TensorRole::Norm);
            }
        }

        for t in &b.tensors {
            let ne0 = t.dims[0];
            if t.ty.row_bytes(ne0).is_none() {
                return Err(ModelError::Tensor {
                    tensor: t.name.clone(),
                    message: format!(
                        "rows of {ne0} elements are not whole {} blocks ({} elements each)",
                        t.ty,
                        t.ty.block_elems()
                    ),
                });
            }
        }
        Ok(Layout {
            params,
            types,
            tensors: b.tensors,
        })
    }

    /// Total bytes of tensor data (no alignment padding).
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorSpec::n_bytes).sum()
    }

    /// The `general.*` and `qwen3next.*` metadata of a file with this layout, in write order
    /// (the tokenizer keys come from elsewhere).
    pub fn metadata(&self) -> Vec<(String, MetaValue)> {
        let p = &self.params;
        let u = |v: u64| MetaValue::U32(v as u32);
        let k = |s: &str| format!("qwen3next.{s}");
        let mut kv = vec![
            (
                "general.architecture".to_string(),
                MetaValue::String("qwen3next".into()),
            ),
            ("general.type".into(), MetaValue::String("model".into())),
            ("general.name".into(), MetaValue::String(p.name.clone())),
            (k("block_count"), u(p.block_count())),
            (k("context_length"), u(p.context_length)),
            (k("embedding_length"), u(p.hidden)),
            (k("feed_forward_length"), u(p.feed_forward_length)),
            (k("attention.head_count"), u(p.n_heads)),
            (k("attention.head_count_kv"), u(p.n_kv_heads)),
            (k("rope.freq_base"), MetaValue::F32(p.rope_theta)),
            (
                k("attention.layer_norm_rms_epsilon"),
                MetaValue::F32(p.rms_eps),
            ),
            (k("expert_count"), u(p.n_experts)),
            (k("expert_used_count"), u(p.n_experts_used)),
            (k("attention.key_length"), u(p.head_dim)),
            (k("attention.value_length"), u(p.head_dim)),
            (k("expert_feed_forward_length"), u(p.expert_ff)),
            (k("expert_shared_feed_forward_length"), u(p.shared_ff)),
        ];
        if p.mtp {
            kv.push((k("nextn_predict_layers"), u(1)));
        }
        kv.extend([
            (k("ssm.conv_kernel"), u(p.conv_kernel)),
            (k("ssm.state_size"), u(p.dn_k_dim)),
            (k("ssm.group_count"), u(p.dn_k_heads)),
            (k("ssm.time_step_rank"), u(p.dn_v_heads)),
            (k("ssm.inner_size"), u(p.dn_value_width())),
            (
                k("attention.recurrent_layers"),
                MetaValue::Array(MetaArray::Bool(
                    (0..p.block_count())
                        .map(|i| i < p.n_layers && !p.is_attention(i))
                        .collect(),
                )),
            ),
            (k("full_attention_interval"), u(p.full_attention_interval)),
            (k("rope.dimension_count"), u(p.rope_dims)),
            ("general.quantization_version".into(), MetaValue::U32(2)),
        ]);
        kv
    }
}

struct Builder {
    tensors: Vec<TensorSpec>,
}

impl Builder {
    fn push(&mut self, name: &str, dims: &[u64], ty: GgmlType, role: TensorRole) {
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            role,
        });
    }

    /// The tensors of block `i`: norms, mixer, MoE.
    fn layer(&mut self, p: &LayoutParams, types: &LayoutTypes, i: u64, attention: bool) {
        use TensorRole::*;
        let pre = format!("blk.{i}.");
        let n = |s: &str| format!("{pre}{s}");
        let (h, d, f32) = (p.hidden, types.dense, GgmlType::F32);
        self.push(&n("attn_norm.weight"), &[h], f32, Norm);
        self.push(&n("post_attention_norm.weight"), &[h], f32, Norm);
        if attention {
            let (q, kv) = (p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim);
            self.push(&n("attn_q.weight"), &[h, 2 * q], d, Matrix);
            self.push(&n("attn_k.weight"), &[h, kv], d, Matrix);
            self.push(&n("attn_v.weight"), &[h, kv], d, Matrix);
            self.push(&n("attn_output.weight"), &[q, h], d, Matrix);
            self.push(&n("attn_q_norm.weight"), &[p.head_dim], f32, Norm);
            self.push(&n("attn_k_norm.weight"), &[p.head_dim], f32, Norm);
        } else {
            let (conv, val) = (p.dn_conv_channels(), p.dn_value_width());
            self.push(&n("attn_qkv.weight"), &[h, conv], d, Matrix);
            self.push(&n("attn_gate.weight"), &[h, val], d, Matrix);
            self.push(&n("ssm_ba.weight"), &[h, 2 * p.dn_v_heads], d, Matrix);
            self.push(
                &n("ssm_conv1d.weight"),
                &[p.conv_kernel, conv],
                f32,
                ConvTaps,
            );
            self.push(&n("ssm_dt.bias"), &[p.dn_v_heads], f32, DtBias);
            self.push(&n("ssm_a"), &[p.dn_v_heads], f32, DecayA);
            self.push(&n("ssm_norm.weight"), &[p.dn_v_dim], f32, GatedNorm);
            self.push(&n("ssm_out.weight"), &[val, h], d, Matrix);
        }
        let (e, ff, sff, x) = (p.n_experts, p.expert_ff, p.shared_ff, types.experts);
        self.push(&n("ffn_gate_inp.weight"), &[h, e], f32, Router);
        self.push(&n("ffn_gate_exps.weight"), &[h, ff, e], x, Matrix);
        self.push(&n("ffn_up_exps.weight"), &[h, ff, e], x, Matrix);
        self.push(&n("ffn_down_exps.weight"), &[ff, h, e], x, Matrix);
        self.push(&n("ffn_gate_inp_shexp.weight"), &[h], f32, SharedExpertGate);
        self.push(&n("ffn_gate_shexp.weight"), &[h, sff], d, Matrix);
        self.push(&n("ffn_up_shexp.weight"), &[h, sff], d, Matrix);
        self.push(&n("ffn_down_shexp.weight"), &[sff, h], d, Matrix);
    }
}
