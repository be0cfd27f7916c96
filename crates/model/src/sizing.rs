//! Sizes derived from a model file: bytes per decode token (dense, routed experts, head), KV bytes
//! per position, recurrent state bytes.
//!
//! Everything here is computed from the tensor table of the actual file (every tensor's own ggml
//! type and byte size), never from assumed quantization types. Two levels:
//!
//! * [`FileSizes`] needs only the tensor table, so it works for any GGUF file (including
//!   vocab-only files and other architectures): tensor count and bytes by type, dense vs
//!   routed-expert bytes.
//! * [`ModelSizes`] also needs the Qwen3-Next [`Config`]: it splits the tensors into the trunk
//!   layers, the MTP block and the global tensors, and derives what one decode step (batch 1)
//!   reads from memory, plus the KV-cache and recurrent-state sizes.
//!
//! **Bytes read per decode token** = dense part + top-k routed experts + head + one embedding row:
//! * dense part: every trunk tensor that is not a routed-expert tensor, plus the global tensors
//!   other than `token_embd.weight` and `output.weight` (i.e. `output_norm.weight`); the MTP block
//!   is excluded;
//! * top-k routed experts: each `*_exps` tensor stores its experts as contiguous slabs along
//!   ne2, so one expert of a layer costs `n_bytes / n_experts` of each of that layer's expert
//!   tensors, and a token reads `k` of them per layer;
//! * head: `output.weight`, or `token_embd.weight` when the file has no separate output;
//! * one row of `token_embd.weight` (the embedding lookup).
//!
//! The MTP block (when stored) is reported separately as its own dense bytes plus its top-k experts;
//! a draft step also re-reads the head and one embedding row, which are not added there.

use std::collections::BTreeMap;

use redlite_gguf::{GgmlType, GgufFile, TensorInfo};

use crate::config::{Config, LayerKind};
use crate::kv_type::KvType;
use crate::ModelError;

/// KV-cache bytes one position takes in the trunk's attention layers with `kv_type` entries:
/// per attention layer one key row and one value row of `n_kv_heads × head_dim` values each
/// (full size: 12 layers × 2 × 2 × 256 values = 48 KiB f32, 24 KiB f16, 12.75 KiB q8_0).
/// The MTP block's own cache is not included ([`ModelSizes::mtp_kv_bytes_per_position`]).
pub fn kv_bytes_per_position(cfg: &Config, kv_type: KvType) -> u64 {
    let row = (cfg.n_kv_heads * cfg.head_dim) as u64;
    cfg.count(LayerKind::Attention) as u64 * 2 * kv_type.bytes_for(row)
}

/// Name of the token-embedding tensor.
pub const TOKEN_EMBD: &str = "token_embd.weight";
/// Name of the output (lm_head) tensor.
pub const OUTPUT: &str = "output.weight";

/// Whether `name` is a routed-expert tensor: any dot-separated part ends in `_exps`
/// (`blk.N.ffn_gate_exps.weight`, `ffn_up_exps`, `ffn_down_exps`, the fused `ffn_gate_up_exps`).
/// Shared-expert tensors (`*_shexp`) are dense.
pub fn is_routed_expert(name: &str) -> bool {
    name.split('.').any(|part| part.ends_with("_exps"))
}

/// The block index of a `blk.N.*` tensor name, or `None` for global tensors.
pub fn block_index(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let (index, _) = rest.split_once('.')?;
    index.parse().ok()
}

/// Count and bytes of the tensors of one ggml type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeTotal {
    pub ty: GgmlType,
    pub count: usize,
    pub bytes: u64,
}

/// Count and bytes per ggml type, in type-id order.
pub fn bytes_by_type<'a>(tensors: impl IntoIterator<Item = &'a TensorInfo>) -> Vec<TypeTotal> {
    let mut map: BTreeMap<u32, TypeTotal> = BTreeMap::new();
    for t in tensors {
        let e = map.entry(t.ty.id()).or_insert(TypeTotal {
            ty: t.ty,
            count: 0,
            bytes: 0,
        });
        e.count += 1;
        e.bytes += t.n_bytes;
    }
    map.into_values().collect()
}

/// Sizes that need only the tensor table (any GGUF file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSizes {
    pub n_tensors: usize,
    /// Sum of every tensor's bytes.
    pub tensor_bytes: u64,
    /// Count and bytes per ggml type, in type-id order.
    pub by_type: Vec<TypeTotal>,
    /// Bytes of every tensor that is not a routed-expert tensor (embedding and head included).
    pub dense_bytes: u64,
    /// Bytes of every routed-expert tensor (`*_exps`), all experts, MTP block included.
    pub expert_bytes: u64,
}

impl FileSizes {
    /// Tallies the tensor table of `file`.
    pub fn of(file: &GgufFile) -> FileSizes {
        Self::from_tensors(file.tensors())
    }

    /// Tallies a list of tensor infos.
    pub fn from_tensors(tensors: &[TensorInfo]) -> FileSizes {
        let expert_bytes = tensors
            .iter()
            .filter(|t| is_routed_expert(&t.name))
            .map(|t| t.n_bytes)
            .sum();
        let tensor_bytes: u64 = tensors.iter().map(|t| t.n_bytes).sum();
        FileSizes {
            n_tensors: tensors.len(),
            tensor_bytes,
            by_type: bytes_by_type(tensors),
            dense_bytes: tensor_bytes - expert_bytes,
            expert_bytes,
        }
    }
}

/// The byte breakdown of one block (a trunk layer or the MTP block).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSizes {
    /// Block index (`blk.N`).
    pub index: usize,
    /// Mixer kind. The MTP block is a full-attention layer.
    pub kind: LayerKind,
    /// Whether this is an MTP (next-n prediction) block rather than a trunk layer.
    pub is_mtp: bool,
    pub n_tensors: usize,
    /// Bytes of the tensors that are not routed experts (read in full every token).
    pub dense_bytes: u64,
    /// Bytes of the routed-expert tensors, all experts.
    pub expert_bytes: u64,
    /// Bytes of one expert: the sum over this block's expert tensors of `n_bytes / n_experts`.
    pub expert_slab_bytes: u64,
    /// Bytes of the top-k experts a token reads: `n_experts_used × expert_slab_bytes`.
    pub top_k_expert_bytes: u64,
}

impl LayerSizes {
    /// All bytes stored for this block.
    pub fn total_bytes(&self) -> u64 {
        self.dense_bytes + self.expert_bytes
    }

    /// Bytes this block reads per decode token: dense + top-k experts.
    pub fn per_token_bytes(&self) -> u64 {
        self.dense_bytes + self.top_k_expert_bytes
    }
}

/// What one decode step (batch 1) of the trunk reads from the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeBytes {
    /// Trunk tensors that are not routed experts, plus global tensors other than the embedding
    /// and the head (`output_norm`). The MTP block is excluded.
    pub dense: u64,
    /// The top-k routed experts of every trunk layer.
    pub experts: u64,
    /// The output projection (`output.weight`, or `token_embd.weight` when tied).
    pub head: u64,
    /// One row of `token_embd.weight`.
    pub embedding_row: u64,
}

impl DecodeBytes {
    /// Sum of the four parts.
    pub fn total(&self) -> u64 {
        self.dense + self.experts + self.head + self.embedding_row
    }
}

/// Sizes of a Qwen3-Next model file: the generic tallies plus the per-layer split, bytes per
/// decode token, KV and recurrent-state sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSizes {
    pub file: FileSizes,
    /// Bytes of `token_embd.weight`.
    pub token_embd_bytes: u64,
    /// Bytes of `output.weight`, `None` when the file has none (the head is then `token_embd`).
    pub output_bytes: Option<u64>,
    /// Bytes of the global tensors other than the embedding and the head (`output_norm.weight`).
    pub other_global_bytes: u64,
    /// Trunk layers in order, one per `Config::layer_kinds` entry.
    pub layers: Vec<LayerSizes>,
    /// The MTP blocks (0 or 1) that have tensors in the file.
    pub mtp: Vec<LayerSizes>,
    /// What one trunk decode step reads.
    pub decode: DecodeBytes,
    /// KV-cache values per position (trunk attention layers).
    pub kv_values_per_position: u64,
    /// KV-cache values per position of the MTP blocks' own attention (0 without MTP).
    pub mtp_kv_values_per_position: u64,
    /// Recurrent-state values of one sequence (DeltaNet conv history + delta-rule state).
    pub recurrent_state_values: u64,
}

impl ModelSizes {
    /// Splits the tensors of `file` by block using `cfg` (from [`Config::from_gguf`] on the same
    /// file). Fails when a tensor belongs to a block beyond `block_count`, when the embedding is
    /// missing, or when an expert tensor cannot be cut into `n_experts` equal slabs.
    pub fn new(file: &GgufFile, cfg: &Config) -> Result<ModelSizes, ModelError> {
        Self::from_tensors(file.tensors(), cfg)
    }

    /// Like [`ModelSizes::new`], from a tensor table.
    pub fn from_tensors(tensors: &[TensorInfo], cfg: &Config) -> Result<ModelSizes, ModelError> {
        let n_blocks = cfg.n_layers + cfg.nextn_layers;
        let mut blocks: Vec<LayerSizes> = (0..n_blocks)
            .map(|i| LayerSizes {
                index: i,
                kind: cfg
                    .layer_kinds
                    .get(i)
                    .copied()
                    .unwrap_or(LayerKind::Attention),
                is_mtp: i >= cfg.n_layers,
                n_tensors: 0,
                dense_bytes: 0,
                expert_bytes: 0,
                expert_slab_bytes: 0,
                top_k_expert_bytes: 0,
            })
            .collect();

        let mut token_embd: Option<&TensorInfo> = None;
        let mut output_bytes = None;
        let mut other_global_bytes = 0;
        for t in tensors {
            let Some(i) = block_index(&t.name) else {
                match t.name.as_str() {
                    TOKEN_EMBD => token_embd = Some(t),
                    OUTPUT => output_bytes = Some(t.n_bytes),
                    _ => other_global_bytes += t.n_bytes,
                }
                continue;
            };
            let block = blocks.get_mut(i).ok_or_else(|| {
                ModelError::BadConfig(format!(
                    "tensor {} belongs to block {i}, but the file declares {n_blocks} blocks \
                     ({} trunk + {} MTP)",
                    t.name, cfg.n_layers, cfg.nextn_layers
                ))
            })?;
            block.n_tensors += 1;
            if is_routed_expert(&t.name) {
                block.expert_bytes += t.n_bytes;
                block.expert_slab_bytes += expert_slab_bytes(t, cfg.n_experts)?;
            } else {
                block.dense_bytes += t.n_bytes;
            }
        }
        for b in &mut blocks {
            b.top_k_expert_bytes = b.expert_slab_bytes * cfg.n_experts_used as u64;
        }
        let token_embd = token_embd.ok_or_else(|| ModelError::MissingTensor(TOKEN_EMBD.into()))?;

        // MTP blocks count only when their tensors are stored.
        let mtp: Vec<LayerSizes> = blocks
            .split_off(cfg.n_layers)
            .into_iter()
            .filter(|b| b.n_tensors > 0)
            .collect();
        let layers = blocks;

        let decode = DecodeBytes {
            dense: other_global_bytes + layers.iter().map(|l| l.dense_bytes).sum::<u64>(),
            experts: layers.iter().map(|l| l.top_k_expert_bytes).sum(),
            head: output_bytes.unwrap_or(token_embd.n_bytes),
            embedding_row: token_embd.row_bytes(),
        };
        let mtp_kv_values_per_position = (mtp.len() * 2 * cfg.n_kv_heads * cfg.head_dim) as u64;

        Ok(ModelSizes {
            file: FileSizes::from_tensors(tensors),
            token_embd_bytes: token_embd.n_bytes,
            output_bytes,
            other_global_bytes,
            layers,
            mtp,
            decode,
            kv_values_per_position: cfg.kv_values_per_position() as u64,
            mtp_kv_values_per_position,
            recurrent_state_values: cfg.recurrent_state_values() as u64,
        })
    }

    /// Bytes of the head actually used (`output.weight`, or `token_embd.weight` when tied).
    pub fn head_bytes(&self) -> u64 {
        self.decode.head
    }

    /// Whether the head falls back to the token embedding (no `output.weight`).
    pub fn head_is_tied(&self) -> bool {
        self.output_bytes.is_none()
    }

    /// What one MTP draft step reads of the MTP block itself (dense + its top-k experts), `None`
    /// without an MTP block. The head and the embedding row it also reads are not included.
    pub fn mtp_per_token_bytes(&self) -> Option<u64> {
        if self.mtp.is_empty() {
            None
        } else {
            Some(self.mtp.iter().map(LayerSizes::per_token_bytes).sum())
        }
    }

    /// All bytes of the MTP block(s) (0 without MTP).
    pub fn mtp_total_bytes(&self) -> u64 {
        self.mtp.iter().map(LayerSizes::total_bytes).sum()
    }

    /// KV-cache bytes per position of the trunk with `kv_type` entries (same as the free
    /// [`kv_bytes_per_position`]; KV rows are whole Q8_0 blocks whenever q8_0 is allowed, see
    /// [`KvType::check_head_dim`], so counting the values at once is exact).
    pub fn kv_bytes_per_position(&self, kv_type: KvType) -> u64 {
        kv_type.bytes_for(self.kv_values_per_position)
    }

    /// KV-cache bytes per position of the MTP block's own attention with `kv_type` entries.
    pub fn mtp_kv_bytes_per_position(&self, kv_type: KvType) -> u64 {
        kv_type.bytes_for(self.mtp_kv_values_per_position)
    }

    /// KV-cache bytes per position with f32 entries.
    pub fn kv_bytes_per_position_f32(&self) -> u64 {
        self.kv_values_per_position * 4
    }

    /// KV-cache bytes per position with f16 entries.
    pub fn kv_bytes_per_position_f16(&self) -> u64 {
        self.kv_values_per_position * 2
    }

    /// Recurrent-state bytes of one sequence, kept in f32.
    pub fn recurrent_state_bytes_f32(&self) -> u64 {
        self.recurrent_state_values * 4
    }
}

/// Bytes of one expert of a routed-expert tensor: experts lie along the last dimension, each a
/// contiguous slab of `n_bytes / n_experts` bytes.
fn expert_slab_bytes(t: &TensorInfo, n_experts: usize) -> Result<u64, ModelError> {
    let bad = |message: String| ModelError::Tensor {
        tensor: t.name.clone(),
        message,
    };
    let last = t.dims.last().copied().unwrap_or(1);
    if t.dims.len() != 3 || last == 0 || last != n_experts as u64 {
        return Err(bad(format!(
            "a routed-expert tensor must have 3 dims with ne2 = expert_count {n_experts}, found {:?}",
            t.dims
        )));
    }
    if !t.n_bytes.is_multiple_of(last) {
        return Err(bad(format!(
            "{} bytes do not split into {last} equal expert slabs",
            t.n_bytes
        )));
    }
    Ok(t.n_bytes / last)
}
