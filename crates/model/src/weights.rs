//! The model's weights, read from GGUF and dequantized to f32 for the oracle.
//! Each tensor is checked against the shape the config implies; a mismatch names the tensor.

use redlite_gguf::{GgufFile, TensorInfo};

use crate::config::{Config, LayerKind};
use crate::ops::Matrix;
use crate::ModelError;

/// Gated full attention (one layer).
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// `[n_heads · 2 · head_dim, hidden]`: per head, `head_dim` query rows then `head_dim` gate rows.
    pub wq: Matrix,
    /// `[n_kv_heads · head_dim, hidden]`.
    pub wk: Matrix,
    pub wv: Matrix,
    /// `[hidden, n_heads · head_dim]`.
    pub wo: Matrix,
    /// `[head_dim]`, shared by all heads.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

/// Gated DeltaNet (one layer), always in the split layout: a legacy grouped `ssm_in` is un-grouped
/// into `qkv` and `z` rows at load time (a row permutation, so no value changes).
#[derive(Debug, Clone)]
pub struct DeltaNetWeights {
    /// `[conv_channels, hidden]`: rows are q (all QK heads), k (all QK heads), v (all V heads).
    pub qkv: Matrix,
    /// `[n_v · v_dim, hidden]`: the output gate z of every V head.
    pub z: Matrix,
    /// `[2 · n_v, hidden]`, HF's grouped order: per QK head g, `r` β-logits then `r` a-logits
    /// (r = V heads per QK head).
    pub ba: Matrix,
    /// `[conv_channels, conv_kernel]`: tap `j` of channel `c` at `c·kernel + j`; the last tap is the current token.
    pub conv: Vec<f32>,
    /// `[n_v]`.
    pub dt_bias: Vec<f32>,
    /// `[n_v]`, stored as `−exp(A_log)`.
    pub a: Vec<f32>,
    /// `[v_dim]`, the gated RMSNorm weight (no +1 folded).
    pub norm: Vec<f32>,
    /// `[hidden, n_v · v_dim]`.
    pub out: Matrix,
}

#[derive(Debug, Clone)]
pub enum MixerWeights {
    Attention(AttentionWeights),
    DeltaNet(DeltaNetWeights),
}

/// One SwiGLU feed-forward: `down(silu(gate·x) ⊙ up·x)`.
#[derive(Debug, Clone)]
pub struct FfnWeights {
    /// `[ff, hidden]`.
    pub gate: Matrix,
    pub up: Matrix,
    /// `[hidden, ff]`.
    pub down: Matrix,
}

/// Routed experts plus the sigmoid-gated shared expert.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `[n_experts, hidden]`.
    pub router: Matrix,
    pub experts: Vec<FfnWeights>,
    pub shared: FfnWeights,
    /// `[hidden]`: the scalar gate of the shared expert is `sigmoid(shared_gate · x)`.
    pub shared_gate: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub mixer: MixerWeights,
    pub post_attention_norm: Vec<f32>,
    pub moe: MoeWeights,
}

/// The multi-token-prediction block (`blk.N.nextn.*` plus a full-attention decoder layer).
#[derive(Debug, Clone)]
pub struct MtpWeights {
    /// Norm of the next token's embedding.
    pub enorm: Vec<f32>,
    /// Norm of the trunk's final hidden state.
    pub hnorm: Vec<f32>,
    /// `[hidden, 2·hidden]`, input = `[enorm(e) | hnorm(h)]`.
    pub eh_proj: Matrix,
    pub layer: LayerWeights,
    pub shared_head_norm: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct Weights {
    /// `[vocab, hidden]`.
    pub token_embd: Matrix,
    pub output_norm: Vec<f32>,
    /// `[vocab, hidden]` (falls back to `token_embd` when the file has no `output.weight`).
    pub output: Matrix,
    pub layers: Vec<LayerWeights>,
    pub mtp: Option<MtpWeights>,
}

/// Reads and shape-checks tensors.
struct Loader<'a> {
    file: &'a GgufFile,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    fn check_dims(&self, t: &TensorInfo, expected: &[u64]) -> Result<(), ModelError> {
        // Trailing 1s are insignificant ([2048] and [2048, 1] are the same vector).
        let trim = |d: &[u64]| -> Vec<u64> {
            let mut v = d.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if trim(&t.dims) != trim(expected) {
            return Err(ModelError::BadShape {
                tensor: t.name.clone(),
                expected: expected.to_vec(),
                found: t.dims.clone(),
            });
        }
        Ok(())
    }

    fn f32_data(&self, t: &TensorInfo) -> Result<Vec<f32>, ModelError> {
        redlite_gguf::quant::dequantize_to_vec(t.ty, self.file.tensor_data(t)).map_err(|e| {
            ModelError::Tensor {
                tensor: t.name.clone(),
                message: e.to_string(),
            }
        })
    }

    /// A tensor of exactly `dims` (ne0 first), dequantized.
    fn tensor(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.info(name)?;
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        self.check_dims(t, &dims)?;
        self.f32_data(t)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        self.tensor(name, &[len])
    }

    /// A linear layer `in → out` (GGUF `[in, out]`) as a `[out, in]` matrix.
    fn matrix(&self, name: &str, inp: usize, out: usize) -> Result<Matrix, ModelError> {
        Ok(Matrix {
            rows: out,
            cols: inp,
            data: self.tensor(name, &[inp, out])?,
        })
    }

    /// Stacked experts `[in, out, n]` split into `n` matrices `[out, in]`.
    fn experts(
        &self,
        name: &str,
        inp: usize,
        out: usize,
        n: usize,
    ) -> Result<Vec<Matrix>, ModelError> {
        let data = self.tensor(name, &[inp, out, n])?;
        Ok(data
            .chunks_exact(inp * out)
            .map(|c| Matrix {
                rows: out,
                cols: inp,
                data: c.to_vec(),
            })
            .collect())
    }
}

impl Weights {
    pub fn load(file: &GgufFile, cfg: &Config) -> Result<Weights, ModelError> {
        let l = Loader { file };
        let h = cfg.hidden;
        let token_embd = l.matrix("token_embd.weight", h, cfg.vocab)?;
        let output = if file.tensor("output.weight").is_some() {
            l.matrix("output.weight", h, cfg.vocab)?
        } else {
            token_embd.clone()
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for (i, &kind) in cfg.layer_kinds.iter().enumerate() {
            layers.push(load_layer(&l, cfg, i, kind)?);
        }
        let mtp = if cfg.nextn_layers > 0
            && file
                .tensor(&format!("blk.{}.nextn.eh_proj.weight", cfg.n_layers))
                .is_some()
        {
            let i = cfg.n_layers;
            let p = |n: &str| format!("blk.{i}.nextn.{n}");
            Some(MtpWeights {
                enorm: l.vector(&p("enorm.weight"), h)?,
                hnorm: l.vector(&p("hnorm.weight"), h)?,
                eh_proj: l.matrix(&p("eh_proj.weight"), 2 * h, h)?,
                layer: load_layer(&l, cfg, i, LayerKind::Attention)?,
                shared_head_norm: l.vector(&p("shared_head_norm.weight"), h)?,
            })
        } else {
            None
        };
        Ok(Weights {
            token_embd,
            output_norm: l.vector("output_norm.weight", h)?,
            output,
            layers,
            mtp,
        })
    }
}

fn load_layer(
    l: &Loader,
    cfg: &Config,
    i: usize,
    kind: LayerKind,
) -> Result<LayerWeights, ModelError> {
    let h = cfg.hidden;
    let p = |n: &str| format!("blk.{i}.{n}");
    let mixer = match kind {
        LayerKind::Attention => {
            let (nh, nkv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
            MixerWeights::Attention(AttentionWeights {
                wq: l.matrix(&p("attn_q.weight"), h, nh * 2 * hd)?,
                wk: l.matrix(&p("attn_k.weight"), h, nkv * hd)?,
                wv: l.matrix(&p("attn_v.weight"), h, nkv * hd)?,
                wo: l.matrix(&p("attn_output.weight"), nh * hd, h)?,
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

fn load_delta_net(l: &Loader, cfg: &Config, i: usize) -> Result<DeltaNetWeights, ModelError> {
    let h = cfg.hidden;
    let p = |n: &str| format!("blk.{i}.{n}");
    let (nk, nv, dk, dv) = (cfg.dn_k_heads, cfg.dn_v_heads, cfg.dn_k_dim, cfg.dn_v_dim);
    let channels = cfg.dn_conv_channels();
    let (qkv, z) = if l.file.tensor(&p("attn_qkv.weight")).is_some() {
        (
            l.matrix(&p("attn_qkv.weight"), h, channels)?,
            l.matrix(&p("attn_gate.weight"), h, nv * dv)?,
        )
    } else if l.file.tensor(&p("ssm_in.weight")).is_some() {
        let grouped = l.matrix(&p("ssm_in.weight"), h, channels + nv * dv)?;
        ungroup_qkvz(&grouped, nk, dk, (nv / nk) * dv)
    } else {
        return Err(ModelError::MissingTensor(format!(
            "{} (or the legacy {})",
            p("attn_qkv.weight"),
            p("ssm_in.weight")
        )));
    };
    Ok(DeltaNetWeights {
        qkv,
        z,
        ba: l.matrix(&p("ssm_ba.weight"), h, 2 * nv)?,
        conv: l.tensor(&p("ssm_conv1d.weight"), &[cfg.conv_kernel, channels])?,
        dt_bias: l.vector(&p("ssm_dt.bias"), nv)?,
        a: l.vector(&p("ssm_a"), nv)?,
        norm: l.vector(&p("ssm_norm.weight"), dv)?,
        out: l.matrix(&p("ssm_out.weight"), nv * dv, h)?,
    })
}

/// Un-group HF's `in_proj_qkvz` rows. Per QK head g the grouped matrix holds
/// `[q_g (dk) | k_g (dk) | v_g (vw) | z_g (vw)]` rows (vw = V heads per QK head × v dim);
/// the split layout wants `[q_0 … q_{nk−1} | k_0 … | v_0 …]` and `[z_0 …]`.
fn ungroup_qkvz(grouped: &Matrix, nk: usize, dk: usize, vw: usize) -> (Matrix, Matrix) {
    let cols = grouped.cols;
    let group = 2 * dk + 2 * vw;
    let rows_of = |g: usize, start: usize, n: usize| -> &[f32] {
        let r0 = g * group + start;
        &grouped.data[r0 * cols..(r0 + n) * cols]
    };
    let mut qkv = Vec::with_capacity(nk * (2 * dk + vw) * cols);
    for g in 0..nk {
        qkv.extend_from_slice(rows_of(g, 0, dk));
    }
    for g in 0..nk {
        qkv.extend_from_slice(rows_of(g, dk, dk));
    }
    for g in 0..nk {
        qkv.extend_from_slice(rows_of(g, 2 * dk, vw));
    }
    let mut z = Vec::with_capacity(nk * vw * cols);
    for g in 0..nk {
        z.extend_from_slice(rows_of(g, 2 * dk + vw, vw));
    }
    (
        Matrix {
            rows: nk * (2 * dk + vw),
            cols,
            data: qkv,
        },
        Matrix {
            rows: nk * vw,
            cols,
            data: z,
        },
    )
}

fn load_moe(l: &Loader, cfg: &Config, i: usize) -> Result<MoeWeights, ModelError> {
    let h = cfg.hidden;
    let p = |n: &str| format!("blk.{i}.{n}");
    let (ne, ff) = (cfg.n_experts, cfg.expert_ff);
    let (gates, ups) = if l.file.tensor(&p("ffn_gate_exps.weight")).is_some() {
        (
            l.experts(&p("ffn_gate_exps.weight"), h, ff, ne)?,
            l.experts(&p("ffn_up_exps.weight"), h, ff, ne)?,
        )
    } else {
        // The fused form: per expert, `ff` gate rows then `ff` up rows.
        let fused = l.experts(&p("ffn_gate_up_exps.weight"), h, 2 * ff, ne)?;
        fused
            .into_iter()
            .map(|m| {
                let (g, u) = m.data.split_at(ff * h);
                (
                    Matrix {
                        rows: ff,
                        cols: h,
                        data: g.to_vec(),
                    },
                    Matrix {
                        rows: ff,
                        cols: h,
                        data: u.to_vec(),
                    },
                )
            })
            .unzip()
    };
    let downs = l.experts(&p("ffn_down_exps.weight"), ff, h, ne)?;
    let experts = gates
        .into_iter()
        .zip(ups)
        .zip(downs)
        .map(|((gate, up), down)| FfnWeights { gate, up, down })
        .collect();
    let sff = cfg.shared_ff;
    Ok(MoeWeights {
        router: l.matrix(&p("ffn_gate_inp.weight"), h, ne)?,
        experts,
        shared: FfnWeights {
            gate: l.matrix(&p("ffn_gate_shexp.weight"), h, sff)?,
            up: l.matrix(&p("ffn_up_shexp.weight"), h, sff)?,
            down: l.matrix(&p("ffn_down_shexp.weight"), sff, h)?,
        },
        shared_gate: l.vector(&p("ffn_gate_inp_shexp.weight"), h)?,
    })
}
