//! Qwen3-Next hyperparameters read from GGUF metadata (`qwen3next.*` keys).

use redlite_gguf::GgufFile;

use crate::ModelError;

/// What kind of token mixer a trunk layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state and a causal conv).
    DeltaNet,
    /// Gated full softmax attention with a KV cache.
    Attention,
}

/// The shape of a Qwen3-Next model. Names follow the HF config where they exist.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub hidden: usize,
    /// Trunk layers (`block_count - nextn_predict_layers`).
    pub n_layers: usize,
    /// Kind of each trunk layer.
    pub layer_kinds: Vec<LayerKind>,
    pub vocab: usize,
    pub context_length: usize,
    pub rms_eps: f32,

    // Gated attention.
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Rotary dimensions at the start of each head (partial RoPE, NeoX pairing).
    pub rope_dims: usize,
    pub rope_theta: f64,

    // Gated DeltaNet.
    /// Width of the causal depthwise conv (4).
    pub conv_kernel: usize,
    /// QK heads (`ssm.group_count`).
    pub dn_k_heads: usize,
    /// V heads (`ssm.time_step_rank`).
    pub dn_v_heads: usize,
    /// Dimension of each QK head (`ssm.state_size`).
    pub dn_k_dim: usize,
    /// Dimension of each V head (`ssm.inner_size / ssm.time_step_rank`).
    pub dn_v_dim: usize,

    // MoE.
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub expert_ff: usize,
    pub shared_ff: usize,

    /// Number of MTP (next-n prediction) blocks stored after the trunk (0 or 1).
    pub nextn_layers: usize,
}

impl Config {
    /// Channels of the DeltaNet conv: q, k (QK heads × k dim each) and v (V heads × v dim).
    pub fn dn_conv_channels(&self) -> usize {
        2 * self.dn_k_heads * self.dn_k_dim + self.dn_v_heads * self.dn_v_dim
    }

    /// Width of the DeltaNet value space (V heads × v dim).
    pub fn dn_value_width(&self) -> usize {
        self.dn_v_heads * self.dn_v_dim
    }

    /// Number of trunk layers of each kind.
    pub fn count(&self, kind: LayerKind) -> usize {
        self.layer_kinds.iter().filter(|&&k| k == kind).count()
    }

    /// KV cache values per position (K and V of every attention layer).
    pub fn kv_values_per_position(&self) -> usize {
        self.count(LayerKind::Attention) * 2 * self.n_kv_heads * self.head_dim
    }

    /// Recurrent-state values of one sequence: conv history plus delta-rule state, every DeltaNet layer.
    pub fn recurrent_state_values(&self) -> usize {
        let per_layer = (self.conv_kernel - 1) * self.dn_conv_channels()
            + self.dn_v_heads * self.dn_k_dim * self.dn_v_dim;
        self.count(LayerKind::DeltaNet) * per_layer
    }

    /// Read the configuration of a `qwen3next` GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<Config, ModelError> {
        let arch = file.architecture()?;
        if arch != "qwen3next" {
            return Err(ModelError::UnsupportedArchitecture(arch.to_string()));
        }
        let key = |k: &str| format!("qwen3next.{k}");
        let u = |k: &str| -> Result<usize, ModelError> { Ok(file.get_u32(&key(k))? as usize) };
        let opt_u = |k: &str| -> Result<Option<usize>, ModelError> {
            Ok(file.get_opt_u32(&key(k))?.map(|v| v as usize))
        };

        let block_count = u("block_count")?;
        let nextn_layers = opt_u("nextn_predict_layers")?.unwrap_or(0);
        if nextn_layers >= block_count {
            return Err(ModelError::BadConfig(format!(
                "nextn_predict_layers = {nextn_layers} leaves no trunk layers of block_count = {block_count}"
            )));
        }
        let n_layers = block_count - nextn_layers;
        let interval = opt_u("full_attention_interval")?.unwrap_or(4);
        let layer_kinds: Vec<LayerKind> = match file.get(&key("attention.recurrent_layers")) {
            Some(_) => {
                let flags = file.get_bool_array(&key("attention.recurrent_layers"))?;
                if flags.len() < n_layers {
                    return Err(ModelError::BadConfig(format!(
                        "attention.recurrent_layers has {} entries, need at least {n_layers}",
                        flags.len()
                    )));
                }
                flags[..n_layers]
                    .iter()
                    .map(|&r| {
                        if r {
                            LayerKind::DeltaNet
                        } else {
                            LayerKind::Attention
                        }
                    })
                    .collect()
            }
            None => {
                if interval == 0 {
                    return Err(ModelError::BadConfig("full_attention_interval = 0".into()));
                }
                (0..n_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::Attention
                        } else {
                            LayerKind::DeltaNet
                        }
                    })
                    .collect()
            }
        };

        let n_heads = u("attention.head_count")?;
        let n_kv_heads = u("attention.head_count_kv")?;
        let head_dim = u("attention.key_length")?;
        let value_length = opt_u("attention.value_length")?.unwrap_or(head_dim);
        let dn_v_heads = u("ssm.time_step_rank")?;
        let inner = u("ssm.inner_size")?;
        let n_experts = u("expert_count")?;
        let n_experts_used = u("expert_used_count")?;

        let vocab = match file.tensor("token_embd.weight") {
            Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
            _ => return Err(ModelError::MissingTensor("token_embd.weight".into())),
        };

        let cfg = Config {
            hidden: u("embedding_length")?,
            n_layers,
            layer_kinds,
            vocab,
            context_length: u("context_length")?,
            rms_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dims: opt_u("rope.dimension_count")?.unwrap_or(head_dim),
            rope_theta: file
                .get_opt_f32(&key("rope.freq_base"))?
                .unwrap_or(10_000.0) as f64,
            conv_kernel: u("ssm.conv_kernel")?,
            dn_k_heads: u("ssm.group_count")?,
            dn_v_heads,
            dn_k_dim: u("ssm.state_size")?,
            dn_v_dim: inner.checked_div(dn_v_heads).unwrap_or(0),
            n_experts,
            n_experts_used,
            expert_ff: opt_u("expert_feed_forward_length")?.unwrap_or(0),
            shared_ff: opt_u("expert_shared_feed_forward_length")?.unwrap_or(0),
            nextn_layers,
        };

        let mut cfg = cfg;
        // The FFN widths are optional metadata; fall back to the first layer's tensor shapes.
        if cfg.expert_ff == 0 {
            cfg.expert_ff = tensor_dim(file, "blk.0.ffn_gate_exps.weight", 1)?;
        }
        if cfg.shared_ff == 0 {
            cfg.shared_ff = tensor_dim(file, "blk.0.ffn_gate_shexp.weight", 1).unwrap_or(0);
        }

        let bad = |m: String| Err(ModelError::BadConfig(m));
        if value_length != head_dim {
            return bad(format!(
                "attention value_length {value_length} != key_length {head_dim}"
            ));
        }
        if cfg.hidden == 0 || cfg.n_layers == 0 || cfg.vocab == 0 {
            return bad("embedding_length, block_count and vocabulary must be non-zero".into());
        }
        if cfg.context_length == 0 {
            return bad("context_length must be non-zero".into());
        }
        // A NaN, zero or negative epsilon or RoPE base loads and then yields NaN logits.
        if !(cfg.rms_eps.is_finite() && cfg.rms_eps > 0.0) {
            return bad(format!(
                "attention.layer_norm_rms_epsilon must be finite and > 0, got {}",
                cfg.rms_eps
            ));
        }
        if !(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0) {
            return bad(format!(
                "rope.freq_base must be finite and > 0, got {}",
                cfg.rope_theta
            ));
        }
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return bad(format!(
                "head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}"
            ));
        }
        if cfg.rope_dims > head_dim || !cfg.rope_dims.is_multiple_of(2) {
            return bad(format!(
                "rope.dimension_count {} must be even and ≤ key_length {head_dim}",
                cfg.rope_dims
            ));
        }
        if cfg.dn_k_heads == 0 || dn_v_heads == 0 || !dn_v_heads.is_multiple_of(cfg.dn_k_heads) {
            return bad(format!(
                "ssm.time_step_rank {dn_v_heads} is not a multiple of ssm.group_count {}",
                cfg.dn_k_heads
            ));
        }
        if !inner.is_multiple_of(dn_v_heads) {
            return bad(format!(
                "ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {dn_v_heads}"
            ));
        }
        if cfg.conv_kernel == 0 {
            return bad("ssm.conv_kernel = 0".into());
        }
        if n_experts == 0 || n_experts_used == 0 || n_experts_used > n_experts {
            return bad(format!(
                "expert_used_count {n_experts_used} must be in 1..=expert_count {n_experts}"
            ));
        }
        Ok(cfg)
    }
}

/// Dimension `axis` of tensor `name`, or a missing-tensor error.
fn tensor_dim(file: &GgufFile, name: &str, axis: usize) -> Result<usize, ModelError> {
    file.tensor(name)
        .and_then(|t| t.dims.get(axis).copied())
        .map(|d| d as usize)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
}
