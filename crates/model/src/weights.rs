//! The model's weights, read from GGUF and checked against the shapes the config implies (a
//! mismatch names the tensor). Linear layers are prepared by the backend; small vectors (norms,
//! conv taps, decay parameters) are dequantized to f32.

use std::sync::Arc;

use redlite_gguf::{GgufFile, TensorInfo};

use crate::backend::{Backend, ExpertPart, ExpertTag, LinearData, LinearSource};
use crate::config::{Config, LayerKind};
use crate::ModelError;

/// Gated full attention (one layer).
pub struct AttentionWeights<B: Backend> {
    /// `[n_heads · 2 · head_dim, hidden]`: per head, `head_dim` query rows then `head_dim` gate rows.
    pub wq: B::Linear,
    /// `[n_kv_heads · head_dim, hidden]`.
    pub wk: B::Linear,
    pub wv: B::Linear,
    /// `[hidden, n_heads · head_dim]`.
    pub wo: B::Linear,
    /// `[head_dim]`, shared by all heads.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

/// Gated DeltaNet (one layer), always in the split layout: a legacy grouped `ssm_in` is un-grouped
/// into `qkv` and `z` rows at load time (a row permutation of raw bytes, so no value changes).
pub struct DeltaNetWeights<B: Backend> {
    /// `[conv_channels, hidden]`: rows are q (all QK heads), k (all QK heads), v (all V heads).
    pub qkv: B::Linear,
    /// `[n_v · v_dim, hidden]`: the output gate z of every V head.
    pub z: B::Linear,
    /// `[2 · n_v, hidden]`, HF's grouped order: per QK head g, `r` β-logits then `r` a-logits
    /// (r = V heads per QK head).
    pub ba: B::Linear,
    /// `[conv_channels, conv_kernel]`: tap `j` of channel `c` at `c·kernel + j`; the last tap is the current token.
    pub conv: Vec<f32>,
    /// `conv` transposed, `[conv_kernel, conv_channels]`: tap `j` of every channel as one row, so
    /// a token's channels go through each tap together (vectorised).
    pub conv_taps: Vec<f32>,
    /// `[n_v]`.
    pub dt_bias: Vec<f32>,
    /// `[n_v]`, stored as `−exp(A_log)`.
    pub a: Vec<f32>,
    /// `[v_dim]`, the gated RMSNorm weight (no +1 folded).
    pub norm: Vec<f32>,
    /// `[hidden, n_v · v_dim]`.
    pub out: B::Linear,
}

pub enum MixerWeights<B: Backend> {
    Attention(AttentionWeights<B>),
    DeltaNet(DeltaNetWeights<B>),
}

/// One SwiGLU feed-forward: `down(silu(gate·x) ⊙ up·x)`.
pub struct FfnWeights<B: Backend> {
    /// `[ff, hidden]`.
    pub gate: B::Linear,
    pub up: B::Linear,
    /// `[hidden, ff]`.
    pub down: B::Linear,
}

/// Routed experts plus the sigmoid-gated shared expert.
pub struct MoeWeights<B: Backend> {
    /// `[n_experts, hidden]`.
    pub router: B::Linear,
    pub experts: Vec<FfnWeights<B>>,
    pub shared: FfnWeights<B>,
    /// `[hidden]`: the scalar gate of the shared expert is `sigmoid(shared_gate · x)`.
    pub shared_gate: Vec<f32>,
}

pub struct LayerWeights<B: Backend> {
    pub attn_norm: Vec<f32>,
    pub mixer: MixerWeights<B>,
    pub post_attention_norm: Vec<f32>,
    pub moe: MoeWeights<B>,
}

/// The multi-token-prediction block (`blk.N.nextn.*` plus a full-attention decoder layer).
pub struct MtpWeights<B: Backend> {
    /// Norm of the next token's embedding.
    pub enorm: Vec<f32>,
    /// Norm of the trunk's final hidden state.
    pub hnorm: Vec<f32>,
    /// `[hidden, 2·hidden]`, input = `[enorm(e) | hnorm(h)]`.
    pub eh_proj: B::Linear,
    pub layer: LayerWeights<B>,
    pub shared_head_norm: Vec<f32>,
}

/// The token embedding table, left quantized in the file; rows are dequantized on lookup.
pub struct Embedding {
    file: Arc<GgufFile>,
    tensor: TensorInfo,
    pub hidden: usize,
    pub vocab: usize,
}

impl Embedding {
    /// Row `id`, dequantized.
    pub fn row(&self, id: u32) -> Result<Vec<f32>, ModelError> {
        if id as usize >= self.vocab {
            return Err(ModelError::TokenOutOfRange {
                id,
                vocab: self.vocab,
            });
        }
        let row_bytes = self.tensor.ty.row_bytes(self.hidden as u64).unwrap_or(0) as usize;
        let data = self.file.tensor_data(&self.tensor);
        let bytes = &data[id as usize * row_bytes..(id as usize + 1) * row_bytes];
        redlite_gguf::quant::dequantize_to_vec(self.tensor.ty, bytes).map_err(|e| {
            ModelError::Tensor {
                tensor: self.tensor.name.clone(),
                message: e.to_string(),
            }
        })
    }
}

pub struct Weights<B: Backend> {
    pub token_embd: Embedding,
    pub output_norm: Vec<f32>,
    /// `[vocab, hidden]` (the token embedding when the file has no `output.weight`).
    pub output: B::Linear,
    pub layers: Vec<LayerWeights<B>>,
    pub mtp: Option<MtpWeights<B>>,
}

/// Reads and shape-checks tensors.
struct Loader<'a, B: Backend> {
    file: &'a Arc<GgufFile>,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    /// The tensor `name`, which must have exactly `dims` (ne0 first; trailing 1s ignored).
    fn checked(&self, name: &str, dims: &[usize]) -> Result<&TensorInfo, ModelError> {
        let t = self.info(name)?;
        let trim = |d: &[u64]| -> Vec<u64> {
            let mut v = d.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if trim(&t.dims) != trim(&expected) {
            return Err(ModelError::BadShape {
                tensor: t.name.clone(),
                expected,
                found: t.dims.clone(),
            });
        }
        Ok(t)
    }

    /// A small tensor of exactly `dims`, dequantized to f32.
    fn f32_tensor(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.checked(name, dims)?;
        redlite_gguf::quant::dequantize_to_vec(t.ty, self.file.tensor_data(t)).map_err(|e| {
            ModelError::Tensor {
                tensor: t.name.clone(),
                message: e.to_string(),
            }
        })
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        self.f32_tensor(name, &[len])
    }

    /// Byte range of the whole tensor inside the file.
    fn file_range(&self, t: &TensorInfo) -> std::ops::Range<usize> {
        let start = (self.file.data_offset() + t.offset) as usize;
        start..start + t.n_bytes as usize
    }

    /// A linear layer `in → out` (GGUF `[in, out]`).
    fn linear(&self, name: &str, inp: usize, out: usize) -> Result<B::Linear, ModelError> {
        let t = self.checked(name, &[inp, out])?;
        self.backend.load_linear(LinearSource {
            name: t.name.clone(),
            ty: t.ty,
            rows: out,
            cols: inp,
            data: LinearData::Mapped {
                file: self.file,
                range: self.file_range(t),
            },
            expert: None,
        })
    }

    /// Stacked experts `[in, out, n]`: one linear layer per expert, each its own contiguous slab.
    fn experts(
        &self,
        layer: usize,
        part: ExpertPart,
        name: &str,
        inp: usize,
        out: usize,
        n: usize,
    ) -> Result<Vec<B::Linear>, ModelError> {
        let t = self.checked(name, &[inp, out, n])?;
        let range = self.file_range(t);
        let slab = range.len() / n;
        (0..n)
            .map(|e| {
                self.backend.load_linear(LinearSource {
                    name: format!("{name}[{e}]"),
                    ty: t.ty,
                    rows: out,
                    cols: inp,
                    data: LinearData::Mapped {
                        file: self.file,
                        range: range.start + e * slab..range.start + (e + 1) * slab,
                    },
                    expert: Some(ExpertTag {
                        layer,
                        expert: e,
                        part,
                    }),
                })
            })
            .collect()
    }
}

impl<B: Backend> Weights<B> {
    pub fn load(file: &Arc<GgufFile>, cfg: &Config, backend: &B) -> Result<Weights<B>, ModelError> {
        let l = Loader { file, backend };
        let h = cfg.hidden;
        let embd = l.checked("token_embd.weight", &[h, cfg.vocab])?.clone();
        if embd.ty.row_bytes(h as u64).is_none() {
            return Err(ModelError::Tensor {
                tensor: embd.name.clone(),
                message: format!("row of {h} is not a whole number of {} blocks", embd.ty),
            });
        }
        let output = if l.has("output.weight") {
            l.linear("output.weight", h, cfg.vocab)?
        } else {
            l.linear("token_embd.weight", h, cfg.vocab)?
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (i, &kind) in cfg.layer_kinds.iter().enumerate() {
            layers.push(load_layer(&l, cfg, i, kind)?);
        }
        let mtp_layer = cfg.n_layers;
        let mtp = if has_mtp_block(file, cfg) {
            let p = |n: &str| format!("blk.{mtp_layer}.nextn.{n}");
            Some(MtpWeights {
                enorm: l.vector(&p("enorm.weight"), h)?,
                hnorm: l.vector(&p("hnorm.weight"), h)?,
                eh_proj: l.linear(&p("eh_proj.weight"), 2 * h, h)?,
                layer: load_layer(&l, cfg, mtp_layer, LayerKind::Attention)?,
                shared_head_norm: l.vector(&p("shared_head_norm.weight"), h)?,
            })
        } else {
            None
        };
        backend.weights_loaded(file)?;
        Ok(Weights {
            token_embd: Embedding {
                file: file.clone(),
                tensor: embd,
                hidden: h,
                vocab: cfg.vocab,
            },
            output_norm: l.vector("output_norm.weight", h)?,
            output,
            layers,
            mtp,
        })
    }
}

fn load_layer<B: Backend>(
    l: &Loader<B>,
    cfg: &Config,
    i: usize,
    kind: LayerKind,
) -> Result<LayerWeights<B>, ModelError> {
    let h = cfg.hidden;
    let p = |n: &str| format!("blk.{i}.{n}");
    let mixer = match kind {
        LayerKind::Attention => {
            let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
            MixerWeights::Attention(AttentionWeights {
                wq: l.linear(&p("attn_q.weight"), h, nh * 2 * hd)?,
                wk: l.linear(&p("attn_k.weight"), h, nkv * hd)?,
                wv: l.linear(&p("attn_v.weight"), h, nkv * hd)?,
                wo: l.linear(&p("attn_output.weight"), nh * hd, h)?,
                q_norm: l.vector(&p("attn_q_norm.weight"), hd)?,
                k_norm: l.vector(&p("attn_k_norm.weight"), hd)?,
            })
        }
        LayerKind::DeltaNet => MixerWeights::DeltaNet(load_delta_net(l, cfg, i)?),
    };
    Ok(LayerWeights {
        attn_norm: l.vector(&p("attn_norm.weight"), h)?,
        mixer,
        post_attention_norm: l.vector(&p("post_attention_norm.weight"), h)?,
        moe: load_moe(l, cfg, i)?,
    })
}

fn load_delta_net<B: Backend>(
    l: &Loader<B>,
    cfg: &Config,
    i: usize,
) -> Result<DeltaNetWeights<B>, ModelError> {
    let h = cfg.hidden;
    let p = |n: &str| format!("blk.{i}.{n}");
    let (nk, nv, dk, dv) = (cfg.dn_k_heads, cfg.dn_v_heads, cfg.dn_k_dim, cfg.dn_v_dim);
    let channels = cfg.dn_conv_channels();
    let (qkv, z) = if l.has(&p("attn_qkv.weight")) {
        (
            l.linear(&p("attn_qkv.weight"), h, channels)?,
            l.linear(&p("attn_gate.weight"), h, nv * dv)?,
        )
    } else if l.has(&p("ssm_in.weight")) {
        let t = l.checked(&p("ssm_in.weight"), &[h, channels + nv * dv])?;
        let row_bytes = t.ty.row_bytes(h as u64).unwrap_or(0) as usize;
        let (qkv_bytes, z_bytes) =
            ungroup_qkvz(l.file.tensor_data(t), row_bytes, nk, dk, (nv / nk) * dv);
        let source = |suffix: &str, rows: usize, bytes: Vec<u8>| LinearSource {
            name: format!("{}{suffix}", t.name),
            ty: t.ty,
            rows,
            cols: h,
            data: LinearData::Owned(bytes),
            expert: None,
        };
        (
            l.backend
                .load_linear(source("[qkv]", channels, qkv_bytes))?,
            l.backend.load_linear(source("[z]", nv * dv, z_bytes))?,
        )
    } else {
        return Err(ModelError::MissingTensor(format!(
            "{} (or the legacy {})",
            p("attn_qkv.weight"),
            p("ssm_in.weight")
        )));
    };
    let conv = l.f32_tensor(&p("ssm_conv1d.weight"), &[cfg.conv_kernel, channels])?;
    let kern = cfg.conv_kernel;
    let conv_taps = (0..kern * channels)
        .map(|i| conv[(i % channels) * kern + i / channels])
        .collect();
    Ok(DeltaNetWeights {
        qkv,
        z,
        ba: l.linear(&p("ssm_ba.weight"), h, 2 * nv)?,
        conv,
        conv_taps,
        dt_bias: l.vector(&p("ssm_dt.bias"), nv)?,
        a: l.vector(&p("ssm_a"), nv)?,
        norm: l.vector(&p("ssm_norm.weight"), dv)?,
        out: l.linear(&p("ssm_out.weight"), nv * dv, h)?,
    })
}

/// Un-group HF's `in_proj_qkvz` rows (raw bytes, `row_bytes` per row). Per QK head g the grouped
/// matrix holds `[q_g (dk) | k_g (dk) | v_g (vw) | z_g (vw)]` rows (vw = V heads per QK head × v dim);
/// the split layout wants `[q_0 … q_{nk−1} | k_0 … | v_0 …]` and `[z_0 …]`.
fn ungroup_qkvz(
    grouped: &[u8],
    row_bytes: usize,
    nk: usize,
    dk: usize,
    vw: usize,
) -> (Vec<u8>, Vec<u8>) {
    let group = 2 * dk + 2 * vw;
    let rows_of = |g: usize, start: usize, n: usize| -> &[u8] {
        let r0 = g * group + start;
        &grouped[r0 * row_bytes..(r0 + n) * row_bytes]
    };
    let mut qkv = Vec::with_capacity(nk * (2 * dk + vw) * row_bytes);
    for g in 0..nk {
        qkv.extend_from_slice(rows_of(g, 0, dk));
    }
    for g in 0..nk {
        qkv.extend_from_slice(rows_of(g, dk, dk));
    }
    for g in 0..nk {
        qkv.extend_from_slice(rows_of(g, 2 * dk, vw));
    }
    let mut z = Vec::with_capacity(nk * vw * row_bytes);
    for g in 0..nk {
        z.extend_from_slice(rows_of(g, 2 * dk + vw, vw));
    }
    (qkv, z)
}

fn load_moe<B: Backend>(
    l: &Loader<B>,
    cfg: &Config,
    i: usize,
) -> Result<MoeWeights<B>, ModelError> {
    let h = cfg.hidden;
    let p = |n: &str| format!("blk.{i}.{n}");
    let (ne, ff) = (cfg.n_experts, cfg.expert_ff);
    let (gates, ups) = if l.has(&p("ffn_gate_exps.weight")) {
        (
            l.experts(i, ExpertPart::Gate, &p("ffn_gate_exps.weight"), h, ff, ne)?,
            l.experts(i, ExpertPart::Up, &p("ffn_up_exps.weight"), h, ff, ne)?,
        )
    } else {
        // The fused form `[h, 2·ff, n]`: per expert, `ff` gate rows then `ff` up rows.
        let t = l.checked(&p("ffn_gate_up_exps.weight"), &[h, 2 * ff, ne])?;
        let range = l.file_range(t);
        let slab = range.len() / ne;
        let half = slab / 2;
        let part = |e: usize, k: usize, what: &str, which: ExpertPart| {
            let start = range.start + e * slab + k * half;
            l.backend.load_linear(LinearSource {
                name: format!("{}[{e}].{what}", t.name),
                ty: t.ty,
                rows: ff,
                cols: h,
                data: LinearData::Mapped {
                    file: l.file,
                    range: start..start + half,
                },
                expert: Some(ExpertTag {
                    layer: i,
                    expert: e,
                    part: which,
                }),
            })
        };
        let mut gates = Vec::with_capacity(ne);
        let mut ups = Vec::with_capacity(ne);
        for e in 0..ne {
            gates.push(part(e, 0, "gate", ExpertPart::Gate)?);
            ups.push(part(e, 1, "up", ExpertPart::Up)?);
        }
        (gates, ups)
    };
    let downs = l.experts(i, ExpertPart::Down, &p("ffn_down_exps.weight"), ff, h, ne)?;
    let experts = gates
        .into_iter()
        .zip(ups)
        .zip(downs)
        .map(|((gate, up), down)| FfnWeights { gate, up, down })
        .collect();
    let sff = cfg.shared_ff;
    Ok(MoeWeights {
        router: l.linear(&p("ffn_gate_inp.weight"), h, ne)?,
        experts,
        shared: FfnWeights {
            gate: l.linear(&p("ffn_gate_shexp.weight"), h, sff)?,
            up: l.linear(&p("ffn_up_shexp.weight"), h, sff)?,
            down: l.linear(&p("ffn_down_shexp.weight"), sff, h)?,
        },
        shared_gate: l.vector(&p("ffn_gate_inp_shexp.weight"), h)?,
    })
}

/// Whether `file` carries the MTP block (`nextn_predict_layers` > 0 and its `eh_proj`): the
/// weights load it then ([`Weights::load`]).
pub fn has_mtp_block(file: &GgufFile, cfg: &Config) -> bool {
    cfg.nextn_layers > 0
        && file
            .tensor(&format!("blk.{}.nextn.eh_proj.weight", cfg.n_layers))
            .is_some()
}
