//! `redlite-convert`: a Hugging Face `Qwen3NextForCausalLM` checkpoint folder (config.json,
//! *.safetensors, tokenizer.json, tokenizer_config.json) → a GGUF file in llama.cpp's layout.
//!
//! Transforms (those of llama.cpp's `Qwen3NextModel` converter):
//! * every `*norm.weight` gets +1 (the zero-centred `(1 + w)` RMSNorm folded into the weight),
//!   except the DeltaNet output norm `linear_attn.norm.weight`;
//! * `A_log` → `ssm_a` = −exp(A_log); `dt_bias` → `ssm_dt.bias`; `conv1d.weight` [C,1,K] → 2-D;
//! * `in_proj_qkvz` (grouped per key head: q_g, k_g, v_g, z_g) is un-grouped into
//!   `attn_qkv` = [all q | all k | all v] and `attn_gate` = all z;
//! * per-expert `experts.{e}.{gate,up,down}_proj` (or the fused `gate_up_proj` / `down_proj`
//!   3-D parameters of newer transformers) are stacked into `ffn_{gate,up,down}_exps`;
//! * the MTP block (`mtp.*`) becomes an extra layer `blk.{N}` with `nextn.eh_proj` (mtp.fc),
//!   `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm` and `qwen3next.nextn_predict_layers`;
//! * the tokenizer becomes `tokenizer.ggml.*` (gpt2 model, `pre` = qwen2) with the chat template.
//!
//! Norms, routers (`ffn_gate_inp*`), `ssm_conv1d`, `ssm_a`, `ssm_dt.bias` and every 1-D tensor are
//! F32; other weights take the requested type (Q8_0 falls back to F16 for rows not a multiple of 32).
//! The +1 is added in f32 (llama.cpp adds it in the checkpoint's dtype, which can round for BF16
//! checkpoints). Tensors are produced one at a time while the file is written.

mod encode;
mod error;
mod hf;
mod tokenizer;

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use redlite_gguf::{GgmlType, GgufWriter, MetaArray, MetaValue};

pub use encode::{encode, quantize_q8_0};
pub use error::{ConvertError, Result};
pub use hf::{Checkpoint, HfConfig};
pub use tokenizer::HfTokenizer;

/// The type of the converted weight matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
    F16,
    Bf16,
    Q8_0,
}

impl OutType {
    fn ggml(self) -> GgmlType {
        match self {
            OutType::F32 => GgmlType::F32,
            OutType::F16 => GgmlType::F16,
            OutType::Bf16 => GgmlType::BF16,
            OutType::Q8_0 => GgmlType::Q8_0,
        }
    }

    /// `general.file_type` (llama_ftype).
    fn file_type(self) -> u32 {
        match self {
            OutType::F32 => 0,
            OutType::F16 => 1,
            OutType::Q8_0 => 7,
            OutType::Bf16 => 32,
        }
    }
}

impl FromStr for OutType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<OutType, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(OutType::F32),
            "f16" => Ok(OutType::F16),
            "bf16" => Ok(OutType::Bf16),
            "q8_0" => Ok(OutType::Q8_0),
            _ => Err(format!("unknown output type '{s}' (f32, f16, bf16, q8_0)")),
        }
    }
}

impl fmt::Display for OutType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OutType::F32 => "f32",
            OutType::F16 => "f16",
            OutType::Bf16 => "bf16",
            OutType::Q8_0 => "q8_0",
        })
    }
}

/// Conversion settings.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    pub out_type: OutType,
    /// `general.name`; defaults to the checkpoint folder's name.
    pub name: Option<String>,
    /// `tokenizer.ggml.pre`.
    pub tokenizer_pre: String,
    /// Write the MTP block when the checkpoint has one.
    pub include_mtp: bool,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            out_type: OutType::F16,
            name: None,
            tokenizer_pre: "qwen2".into(),
            include_mtp: true,
        }
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub tensors: usize,
    pub bytes: u64,
    pub block_count: usize,
    pub nextn_layers: usize,
    /// Count of tensors per GGUF type name.
    pub type_counts: Vec<(String, usize)>,
}

/// How one GGUF tensor is made from checkpoint tensors.
#[derive(Debug, Clone)]
enum Recipe {
    Plain(String),
    NormPlusOne(String),
    NegExp(String),
    /// Un-grouped `in_proj_qkvz` rows: `[q | k | v]` (gate = false) or `z` (gate = true).
    Qkvz {
        name: String,
        gate: bool,
    },
    /// Per-expert 2-D tensors stacked along a new outer axis.
    Stack(Vec<String>),
    /// A fused 3-D `[E, rows, cols]` parameter, whole or one half of its rows per expert.
    Fused {
        name: String,
        half: Option<usize>,
    },
}

#[derive(Debug, Clone)]
struct Planned {
    name: String,
    /// ne0 first.
    dims: Vec<u64>,
    ty: GgmlType,
    recipe: Recipe,
}

/// The GGUF type a tensor is written with.
fn tensor_type(name: &str, dims: &[u64], out: OutType) -> GgmlType {
    let force_f32 = dims.len() == 1
        || name.ends_with("norm.weight")
        || name.contains("ffn_gate_inp")
        || name.contains("ssm_conv1d")
        || !name.ends_with(".weight");
    if force_f32 {
        return GgmlType::F32;
    }
    match out {
        OutType::Q8_0 if !dims[0].is_multiple_of(32) => GgmlType::F16,
        o => o.ggml(),
    }
}

struct Planner<'c> {
    ckpt: &'c Checkpoint,
    cfg: &'c HfConfig,
    out: OutType,
    used: BTreeSet<String>,
    plan: Vec<Planned>,
}

impl Planner<'_> {
    /// Checks that `hf` has `shape` and marks it used.
    fn take(&mut self, hf: &str, shape: &[usize]) -> Result<()> {
        let got = self.ckpt.shape(hf)?;
        if got != shape {
            return Err(ConvertError::tensor(
                hf,
                format!("shape {got:?}, expected {shape:?} from config.json"),
            ));
        }
        self.used.insert(hf.to_string());
        Ok(())
    }

    fn push(&mut self, name: String, dims: Vec<u64>, recipe: Recipe) {
        let ty = tensor_type(&name, &dims, self.out);
        self.plan.push(Planned {
            name,
            dims,
            ty,
            recipe,
        });
    }

    /// A linear layer `[out, in]` → GGUF `[in, out]`.
    fn linear(&mut self, hf: &str, gguf: String, out_f: usize, in_f: usize) -> Result<()> {
        self.take(hf, &[out_f, in_f])?;
        self.push(
            gguf,
            vec![in_f as u64, out_f as u64],
            Recipe::Plain(hf.into()),
        );
        Ok(())
    }

    /// A (1 + w) RMSNorm weight, +1 folded in.
    fn norm(&mut self, hf: &str, gguf: String, n: usize) -> Result<()> {
        self.take(hf, &[n])?;
        self.push(gguf, vec![n as u64], Recipe::NormPlusOne(hf.into()));
        Ok(())
    }

    fn attention(&mut self, p: &str, b: &str) -> Result<()> {
        let c = self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        self.linear(
            &format!("{p}self_attn.q_proj.weight"),
            format!("{b}attn_q.weight"),
            2 * nq * hd,
            h,
        )?;
        self.linear(
            &format!("{p}self_attn.k_proj.weight"),
            format!("{b}attn_k.weight"),
            nkv * hd,
            h,
        )?;
        self.linear(
            &format!("{p}self_attn.v_proj.weight"),
            format!("{b}attn_v.weight"),
            nkv * hd,
            h,
        )?;
        self.linear(
            &format!("{p}self_attn.o_proj.weight"),
            format!("{b}attn_output.weight"),
            h,
            nq * hd,
        )?;
        self.norm(
            &format!("{p}self_attn.q_norm.weight"),
            format!("{b}attn_q_norm.weight"),
            hd,
        )?;
        self.norm(
            &format!("{p}self_attn.k_norm.weight"),
            format!("{b}attn_k_norm.weight"),
            hd,
        )?;
        Ok(())
    }

    fn delta_net(&mut self, p: &str, b: &str) -> Result<()> {
        let c = self.cfg;
        let h = c.hidden_size;
        let (nk, nv) = (c.linear_num_key_heads, c.linear_num_value_heads);
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let key_dim = nk * dk;
        let value_dim = nv * dv;
        let conv_dim = 2 * key_dim + value_dim;
        let kern = c.linear_conv_kernel_dim;
        let qkvz = format!("{p}linear_attn.in_proj_qkvz.weight");
        self.take(&qkvz, &[2 * key_dim + 2 * value_dim, h])?;
        self.push(
            format!("{b}attn_qkv.weight"),
            vec![h as u64, conv_dim as u64],
            Recipe::Qkvz {
                name: qkvz.clone(),
                gate: false,
            },
        );
        self.push(
            format!("{b}attn_gate.weight"),
            vec![h as u64, value_dim as u64],
            Recipe::Qkvz {
                name: qkvz,
                gate: true,
            },
        );
        self.linear(
            &format!("{p}linear_attn.in_proj_ba.weight"),
            format!("{b}ssm_ba.weight"),
            2 * nv,
            h,
        )?;
        let conv = format!("{p}linear_attn.conv1d.weight");
        self.take(&conv, &[conv_dim, 1, kern])?;
        self.push(
            format!("{b}ssm_conv1d.weight"),
            vec![kern as u64, conv_dim as u64],
            Recipe::Plain(conv),
        );
        let dt = format!("{p}linear_attn.dt_bias");
        self.take(&dt, &[nv])?;
        self.push(
            format!("{b}ssm_dt.bias"),
            vec![nv as u64],
            Recipe::Plain(dt),
        );
        let a = format!("{p}linear_attn.A_log");
        self.take(&a, &[nv])?;
        self.push(format!("{b}ssm_a"), vec![nv as u64], Recipe::NegExp(a));
        let norm = format!("{p}linear_attn.norm.weight");
        self.take(&norm, &[dv])?;
        self.push(
            format!("{b}ssm_norm.weight"),
            vec![dv as u64],
            Recipe::Plain(norm),
        );
        self.linear(
            &format!("{p}linear_attn.out_proj.weight"),
            format!("{b}ssm_out.weight"),
            h,
            value_dim,
        )?;
        Ok(())
    }

    fn moe(&mut self, p: &str, b: &str) -> Result<()> {
        let c = self.cfg;
        let (h, e, ff, sff) = (
            c.hidden_size,
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        let router = format!("{p}mlp.gate.weight");
        self.linear(&router, format!("{b}ffn_gate_inp.weight"), e, h)?;
        let per_expert = format!("{p}mlp.experts.0.gate_proj.weight");
        let (eh, ei, ee) = (h as u64, ff as u64, e as u64);
        if self.ckpt.contains(&per_expert) {
            for (proj, gguf, shape, dims) in [
                ("gate_proj", "ffn_gate_exps", [ff, h], vec![eh, ei, ee]),
                ("up_proj", "ffn_up_exps", [ff, h], vec![eh, ei, ee]),
                ("down_proj", "ffn_down_exps", [h, ff], vec![ei, eh, ee]),
            ] {
                let mut names = Vec::with_capacity(e);
                for x in 0..e {
                    let n = format!("{p}mlp.experts.{x}.{proj}.weight");
                    self.take(&n, &shape)?;
                    names.push(n);
                }
                self.push(format!("{b}{gguf}.weight"), dims, Recipe::Stack(names));
            }
        } else {
            let fused = |base: &str| -> String {
                let n = format!("{p}mlp.experts.{base}");
                if self.ckpt.contains(&n) {
                    n
                } else {
                    format!("{n}.weight")
                }
            };
            let gate_up = fused("gate_up_proj");
            let down = fused("down_proj");
            self.take(&gate_up, &[e, 2 * ff, h])?;
            self.take(&down, &[e, h, ff])?;
            self.push(
                format!("{b}ffn_gate_exps.weight"),
                vec![eh, ei, ee],
                Recipe::Fused {
                    name: gate_up.clone(),
                    half: Some(0),
                },
            );
            self.push(
                format!("{b}ffn_up_exps.weight"),
                vec![eh, ei, ee],
                Recipe::Fused {
                    name: gate_up,
                    half: Some(1),
                },
            );
            self.push(
                format!("{b}ffn_down_exps.weight"),
                vec![ei, eh, ee],
                Recipe::Fused {
                    name: down,
                    half: None,
                },
            );
        }
        let gi = format!("{p}mlp.shared_expert_gate.weight");
        self.take(&gi, &[1, h])?;
        self.push(
            format!("{b}ffn_gate_inp_shexp.weight"),
            vec![h as u64, 1],
            Recipe::Plain(gi),
        );
        self.linear(
            &format!("{p}mlp.shared_expert.gate_proj.weight"),
            format!("{b}ffn_gate_shexp.weight"),
            sff,
            h,
        )?;
        self.linear(
            &format!("{p}mlp.shared_expert.up_proj.weight"),
            format!("{b}ffn_up_shexp.weight"),
            sff,
            h,
        )?;
        self.linear(
            &format!("{p}mlp.shared_expert.down_proj.weight"),
            format!("{b}ffn_down_shexp.weight"),
            h,
            sff,
        )?;
        Ok(())
    }

    fn layer(&mut self, p: &str, b: &str, attention: bool) -> Result<()> {
        let h = self.cfg.hidden_size;
        self.norm(
            &format!("{p}input_layernorm.weight"),
            format!("{b}attn_norm.weight"),
            h,
        )?;
        if attention {
            self.attention(p, b)?;
        } else {
            self.delta_net(p, b)?;
        }
        self.moe(p, b)?;
        self.norm(
            &format!("{p}post_attention_layernorm.weight"),
            format!("{b}post_attention_norm.weight"),
            h,
        )?;
        Ok(())
    }
}

/// Reads the f32 data of one planned tensor.
fn produce(ckpt: &Checkpoint, cfg: &HfConfig, recipe: &Recipe) -> Result<Vec<f32>> {
    Ok(match recipe {
        Recipe::Plain(n) => ckpt.read_f32(n)?,
        Recipe::NormPlusOne(n) => ckpt.read_f32(n)?.into_iter().map(|v| v + 1.0).collect(),
        Recipe::NegExp(n) => ckpt.read_f32(n)?.into_iter().map(|v| -v.exp()).collect(),
        Recipe::Qkvz { name, gate } => {
            let w = ckpt.read_f32(name)?;
            let h = cfg.hidden_size;
            let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
            let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
            let r = nv / nk;
            let group = 2 * dk + 2 * r * dv;
            // Row ranges inside one key-head group: q, k, v, z.
            let parts: Vec<(usize, usize)> = if *gate {
                vec![(2 * dk + r * dv, r * dv)]
            } else {
                vec![(0, dk), (dk, dk), (2 * dk, r * dv)]
            };
            let mut out = Vec::with_capacity(w.len());
            for (start, len) in parts {
                for g in 0..nk {
                    let row0 = g * group + start;
                    out.extend_from_slice(&w[row0 * h..(row0 + len) * h]);
                }
            }
            out
        }
        Recipe::Stack(names) => {
            let mut out = Vec::new();
            for n in names {
                out.extend(ckpt.read_f32(n)?);
            }
            out
        }
        Recipe::Fused { name, half } => {
            let w = ckpt.read_f32(name)?;
            match half {
                None => w,
                Some(k) => {
                    let shape = ckpt.shape(name)?;
                    let (e, rows, cols) = (shape[0], shape[1], shape[2]);
                    let half_len = rows / 2 * cols;
                    let mut out = Vec::with_capacity(e * half_len);
                    for x in 0..e {
                        let s = x * rows * cols + k * half_len;
                        out.extend_from_slice(&w[s..s + half_len]);
                    }
                    out
                }
            }
        }
    })
}

/// Converts the checkpoint folder `hf_dir` into the GGUF file `out`.
pub fn convert(hf_dir: &Path, out: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    let cfg = HfConfig::from_json(&hf::read_json(&hf_dir.join("config.json"))?)?;
    cfg.validate()?;
    let ckpt = Checkpoint::open(hf_dir)?;
    let tok = HfTokenizer::load(hf_dir, &cfg)?;

    let mut pl = Planner {
        ckpt: &ckpt,
        cfg: &cfg,
        out: opts.out_type,
        used: BTreeSet::new(),
        plan: Vec::new(),
    };
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    pl.linear(
        "model.embed_tokens.weight",
        "token_embd.weight".into(),
        v,
        h,
    )?;
    for i in 0..cfg.num_hidden_layers {
        pl.layer(
            &format!("model.layers.{i}."),
            &format!("blk.{i}."),
            cfg.full_attention[i],
        )?;
    }
    let has_mtp = ckpt.names().any(|n| n.starts_with("mtp."));
    let nextn = if has_mtp && opts.include_mtp {
        if ckpt.names().any(|n| n.starts_with("mtp.layers.1.")) {
            return Err(ConvertError::Config(
                "more than one MTP layer is not supported".into(),
            ));
        }
        let b = format!("blk.{}.", cfg.num_hidden_layers);
        pl.layer("mtp.layers.0.", &b, true)?;
        pl.linear(
            "mtp.fc.weight",
            format!("{b}nextn.eh_proj.weight"),
            h,
            2 * h,
        )?;
        pl.norm(
            "mtp.pre_fc_norm_embedding.weight",
            format!("{b}nextn.enorm.weight"),
            h,
        )?;
        pl.norm(
            "mtp.pre_fc_norm_hidden.weight",
            format!("{b}nextn.hnorm.weight"),
            h,
        )?;
        pl.norm(
            "mtp.norm.weight",
            format!("{b}nextn.shared_head_norm.weight"),
            h,
        )?;
        1
    } else {
        0
    };
    pl.norm("model.norm.weight", "output_norm.weight".into(), h)?;
    if ckpt.contains("lm_head.weight") {
        pl.linear("lm_head.weight", "output.weight".into(), v, h)?;
    } else if !cfg.tie_word_embeddings {
        return Err(ConvertError::MissingTensor("lm_head.weight".into()));
    }
    let unused: Vec<&str> = ckpt
        .names()
        .filter(|n| !pl.used.contains(*n) && (opts.include_mtp || !n.starts_with("mtp.")))
        .collect();
    if !unused.is_empty() {
        let mut list = unused[..unused.len().min(8)].join(", ");
        if unused.len() > 8 {
            list.push_str(&format!(", ... ({} in all)", unused.len()));
        }
        return Err(ConvertError::UnusedTensors(list));
    }
    let plan = pl.plan;

    let block_count = cfg.num_hidden_layers + nextn;
    let name = opts.name.clone().unwrap_or_else(|| {
        hf_dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "qwen3next".into())
    });
    let mut w = GgufWriter::new();
    let a = "qwen3next";
    let u = |x: usize| MetaValue::U32(x as u32);
    let mut recurrent: Vec<bool> = cfg.full_attention.iter().map(|f| !f).collect();
    recurrent.extend(std::iter::repeat_n(false, nextn));
    let mut kv: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::String(a.into())),
        ("general.type".into(), MetaValue::String("model".into())),
        ("general.name".into(), MetaValue::String(name)),
        (format!("{a}.block_count"), u(block_count)),
        (
            format!("{a}.context_length"),
            u(cfg.max_position_embeddings),
        ),
        (format!("{a}.embedding_length"), u(h)),
        (format!("{a}.feed_forward_length"), u(cfg.intermediate_size)),
        (
            format!("{a}.attention.head_count"),
            u(cfg.num_attention_heads),
        ),
        (
            format!("{a}.attention.head_count_kv"),
            u(cfg.num_key_value_heads),
        ),
        (
            format!("{a}.rope.freq_base"),
            MetaValue::F32(cfg.rope_theta as f32),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(cfg.rms_norm_eps as f32),
        ),
        (format!("{a}.expert_count"), u(cfg.num_experts)),
        (format!("{a}.expert_used_count"), u(cfg.num_experts_per_tok)),
        (format!("{a}.attention.key_length"), u(cfg.head_dim)),
        (format!("{a}.attention.value_length"), u(cfg.head_dim)),
        (
            "general.file_type".into(),
            MetaValue::U32(opts.out_type.file_type()),
        ),
        (
            format!("{a}.expert_feed_forward_length"),
            u(cfg.moe_intermediate_size),
        ),
        (
            format!("{a}.expert_shared_feed_forward_length"),
            u(cfg.shared_expert_intermediate_size),
        ),
    ];
    if nextn > 0 {
        kv.push((format!("{a}.nextn_predict_layers"), u(nextn)));
    }
    kv.extend([
        (
            format!("{a}.ssm.conv_kernel"),
            u(cfg.linear_conv_kernel_dim),
        ),
        (format!("{a}.ssm.state_size"), u(cfg.linear_key_head_dim)),
        (format!("{a}.ssm.group_count"), u(cfg.linear_num_key_heads)),
        (
            format!("{a}.ssm.time_step_rank"),
            u(cfg.linear_num_value_heads),
        ),
        (
            format!("{a}.ssm.inner_size"),
            u(cfg.linear_value_head_dim * cfg.linear_num_value_heads),
        ),
        (
            format!("{a}.attention.recurrent_layers"),
            MetaValue::Array(MetaArray::Bool(recurrent)),
        ),
        (
            format!("{a}.full_attention_interval"),
            u(cfg.full_attention_interval),
        ),
        (format!("{a}.rope.dimension_count"), u(cfg.rope_dims())),
        ("general.quantization_version".into(), MetaValue::U32(2)),
    ]);
    kv.extend(tok.metadata(&opts.tokenizer_pre));
    for (k, v) in kv {
        w.add_kv(k, v)?;
    }
    for t in &plan {
        w.add_tensor_deferred(t.name.clone(), &t.dims, t.ty)?;
    }
    let mut failure: Option<ConvertError> = None;
    let written = w.write_streaming_to_path(out, |d, sink| {
        let t = &plan[d.index];
        let data = produce(&ckpt, &cfg, &t.recipe).map_err(|e| {
            let msg = e.to_string();
            failure = Some(e);
            std::io::Error::other(msg)
        })?;
        let expected: u64 = t.dims.iter().product();
        if data.len() as u64 != expected {
            let e = ConvertError::tensor(
                &t.name,
                format!("{} values for dims {:?}", data.len(), t.dims),
            );
            let msg = e.to_string();
            failure = Some(e);
            return Err(std::io::Error::other(msg));
        }
        sink.write_all(&encode(t.ty, &data))
    });
    let bytes = match (written, failure) {
        (_, Some(e)) => return Err(e),
        (r, None) => r?,
    };
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for t in &plan {
        *counts.entry(format!("{:?}", t.ty)).or_default() += 1;
    }
    Ok(ConvertReport {
        tensors: plan.len(),
        bytes,
        block_count,
        nextn_layers: nextn,
        type_counts: counts.into_iter().collect(),
    })
}
