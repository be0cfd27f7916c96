//! Reading a Hugging Face checkpoint folder: `config.json` and the `*.safetensors` files (one file
//! or a sharded set), memory-mapped, with every tensor readable as f32.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{ConvertError, Result};

/// Reads and parses a JSON file.
pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ConvertError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// The Qwen3-Next hyperparameters the converter needs, read from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    /// `true` for a full-attention layer, `false` for a Gated DeltaNet layer.
    pub full_attention: Vec<bool>,
    pub full_attention_interval: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub partial_rotary_factor: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub tie_word_embeddings: bool,
    /// MTP layers declared by the config (`num_nextn_predict_layers` / `mtp_num_hidden_layers`), if any.
    pub nextn_layers: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
}

fn get_usize(v: &Value, key: &str) -> Result<usize> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| ConvertError::Config(format!("missing or non-integer '{key}'")))
}

fn opt_usize(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(Value::as_u64).map(|x| x as usize)
}

/// A token id field that may also be a list (the first entry is taken, as llama.cpp does).
fn opt_token_id(v: &Value, key: &str) -> Option<u32> {
    match v.get(key)? {
        Value::Array(a) => a.first()?.as_u64().map(|x| x as u32),
        x => x.as_u64().map(|x| x as u32),
    }
}

impl HfConfig {
    /// Parses a Qwen3-Next `config.json` value.
    pub fn from_json(v: &Value) -> Result<HfConfig> {
        let arch = v
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .unwrap_or("");
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        if arch != "Qwen3NextForCausalLM" && model_type != "qwen3_next" {
            return Err(ConvertError::Config(format!(
                "not a Qwen3-Next checkpoint (architectures[0] = '{arch}', model_type = '{model_type}')"
            )));
        }
        let num_hidden_layers = get_usize(v, "num_hidden_layers")?;
        let interval = opt_usize(v, "full_attention_interval").unwrap_or(4);
        if interval == 0 {
            return Err(ConvertError::Config("full_attention_interval is 0".into()));
        }
        let full_attention = match v.get("layer_types").and_then(Value::as_array) {
            Some(types) => {
                if types.len() != num_hidden_layers {
                    return Err(ConvertError::Config(format!(
                        "layer_types has {} entries for {num_hidden_layers} layers",
                        types.len()
                    )));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(true),
                        Some("linear_attention") => Ok(false),
                        other => Err(ConvertError::Config(format!(
                            "unknown layer type {other:?}"
                        ))),
                    })
                    .collect::<Result<Vec<bool>>>()?
            }
            None => (0..num_hidden_layers)
                .map(|i| (i + 1) % interval == 0)
                .collect(),
        };
        let rope = v.get("rope_parameters").or_else(|| v.get("rope_scaling"));
        let rope_get = |key: &str| {
            rope.and_then(|r| r.get(key))
                .and_then(Value::as_f64)
                .or_else(|| v.get(key).and_then(Value::as_f64))
        };
        let mlp_only = v
            .get("mlp_only_layers")
            .and_then(Value::as_array)
            .map(|a| !a.is_empty())
            .unwrap_or(false);
        let sparse_step = opt_usize(v, "decoder_sparse_step").unwrap_or(1);
        if mlp_only || sparse_step != 1 {
            return Err(ConvertError::Config(
                "dense (mlp_only) layers are not supported: every layer must be MoE".into(),
            ));
        }
        let hidden_size = get_usize(v, "hidden_size")?;
        let num_attention_heads = get_usize(v, "num_attention_heads")?;
        Ok(HfConfig {
            vocab_size: get_usize(v, "vocab_size")?,
            hidden_size,
            intermediate_size: opt_usize(v, "intermediate_size").unwrap_or(0),
            num_hidden_layers,
            full_attention,
            full_attention_interval: interval,
            num_attention_heads,
            num_key_value_heads: get_usize(v, "num_key_value_heads")?,
            head_dim: opt_usize(v, "head_dim").unwrap_or(hidden_size / num_attention_heads.max(1)),
            partial_rotary_factor: rope_get("partial_rotary_factor").unwrap_or(0.25),
            rope_theta: rope_get("rope_theta").unwrap_or(10_000.0),
            max_position_embeddings: get_usize(v, "max_position_embeddings")?,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            linear_num_key_heads: get_usize(v, "linear_num_key_heads")?,
            linear_num_value_heads: get_usize(v, "linear_num_value_heads")?,
            linear_key_head_dim: get_usize(v, "linear_key_head_dim")?,
            linear_value_head_dim: get_usize(v, "linear_value_head_dim")?,
            linear_conv_kernel_dim: get_usize(v, "linear_conv_kernel_dim")?,
            num_experts: get_usize(v, "num_experts")?,
            num_experts_per_tok: get_usize(v, "num_experts_per_tok")?,
            moe_intermediate_size: get_usize(v, "moe_intermediate_size")?,
            shared_expert_intermediate_size: get_usize(v, "shared_expert_intermediate_size")?,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            nextn_layers: opt_usize(v, "num_nextn_predict_layers")
                .or_else(|| opt_usize(v, "mtp_num_hidden_layers")),
            bos_token_id: opt_token_id(v, "bos_token_id"),
            eos_token_id: opt_token_id(v, "eos_token_id"),
            pad_token_id: opt_token_id(v, "pad_token_id"),
        })
    }

    /// Checks the shape relations the GGUF layout relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ConvertError::Config(m));
        if self.num_experts == 0 || self.num_experts_per_tok == 0 {
            return bad("num_experts and num_experts_per_tok must be positive".into());
        }
        if self.num_experts_per_tok > self.num_experts {
            return bad("num_experts_per_tok exceeds num_experts".into());
        }
        if self.linear_num_key_heads == 0
            || !self
                .linear_num_value_heads
                .is_multiple_of(self.linear_num_key_heads)
        {
            return bad("linear_num_value_heads must be a multiple of linear_num_key_heads".into());
        }
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return bad("num_attention_heads must be a multiple of num_key_value_heads".into());
        }
        if self.hidden_size == 0 || self.head_dim == 0 || self.vocab_size == 0 {
            return bad("hidden_size, head_dim and vocab_size must be positive".into());
        }
        Ok(())
    }

    /// Rotary dimensions per head, `int(head_dim × partial_rotary_factor)`.
    pub fn rope_dims(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }
}

/// Where one checkpoint tensor lives.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range inside the file's mmap (header included in the offset).
    start: usize,
    end: usize,
}

/// The tensors of a checkpoint folder, memory-mapped.
pub struct Checkpoint {
    files: Vec<(PathBuf, Mmap)>,
    entries: BTreeMap<String, Entry>,
}

impl Checkpoint {
    /// Maps every `*.safetensors` file of `dir` (sorted by name) and indexes their tensors.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let rd = std::fs::read_dir(dir).map_err(|source| ConvertError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut paths = Vec::new();
        for e in rd {
            let e = e.map_err(|source| ConvertError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
            let p = e.path();
            if p.extension().and_then(|x| x.to_str()) == Some("safetensors") {
                paths.push(p);
            }
        }
        paths.sort();
        if paths.is_empty() {
            return Err(ConvertError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no *.safetensors file in the folder",
                ),
            });
        }
        let mut files = Vec::new();
        let mut entries = BTreeMap::new();
        for path in paths {
            let f = File::open(&path).map_err(|source| ConvertError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the file is opened read-only and only read; a concurrent writer would be a
            // misuse of the converter, as with any memory-mapped input.
            let mmap = unsafe { Mmap::map(&f) }.map_err(|source| ConvertError::Io {
                path: path.clone(),
                source,
            })?;
            let (header_len, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| ConvertError::Safetensors {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            let base = 8 + header_len;
            let idx = files.len();
            for (name, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                let entry = Entry {
                    file: idx,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + a,
                    end: base + b,
                };
                if entries.insert(name.clone(), entry).is_some() {
                    return Err(ConvertError::Safetensors {
                        path: path.clone(),
                        message: format!("tensor '{name}' appears in more than one file"),
                    });
                }
            }
            files.push((path, mmap));
        }
        Ok(Checkpoint { files, entries })
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The shape of tensor `name` (row-major, PyTorch order).
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        self.entries
            .get(name)
            .map(|e| e.shape.as_slice())
            .ok_or_else(|| ConvertError::MissingTensor(name.to_string()))
    }

    /// Reads tensor `name` as f32 (row-major). F32, F16 and BF16 tensors are supported.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| ConvertError::MissingTensor(name.to_string()))?;
        let (path, mmap) = &self.files[e.file];
        let bytes = mmap
            .get(e.start..e.end)
            .ok_or_else(|| ConvertError::Safetensors {
                path: path.clone(),
                message: format!("tensor '{name}' data lies outside the file"),
            })?;
        let n: usize = e.shape.iter().product();
        let width = match e.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(ConvertError::tensor(
                    name,
                    format!("unsupported dtype {other:?} (F32, F16 and BF16 are)"),
                ))
            }
        };
        if bytes.len() != n * width {
            return Err(ConvertError::tensor(
                name,
                format!(
                    "{} data bytes for shape {:?} of {:?}",
                    bytes.len(),
                    e.shape,
                    e.dtype
                ),
            ));
        }
        let out = match e.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        };
        Ok(out)
    }
}
