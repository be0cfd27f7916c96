//! The tokenizer as `tokenizer.ggml.*` metadata, from a Hugging Face `tokenizer.json` (byte-level
//! BPE) and `tokenizer_config.json`, written the way llama.cpp's converter writes a Qwen2-style
//! vocabulary: tokens by id padded to the model's vocabulary size with `[PAD{id}]`, token types,
//! merges as "a b" strings, special token ids and the chat template.

use std::collections::BTreeMap;
use std::path::Path;

use redlite_gguf::{MetaArray, MetaValue};
use serde_json::Value;

use crate::error::{ConvertError, Result};
use crate::hf::{read_json, HfConfig};

/// llama.cpp token types.
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

/// A tokenizer read from a checkpoint folder.
#[derive(Debug, Clone)]
pub struct HfTokenizer {
    /// Token text by id (padded to the model vocabulary).
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

/// A `*_token` entry of tokenizer_config.json: a string or an object with "content".
fn token_content(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

impl HfTokenizer {
    /// Reads `tokenizer.json` and (optionally) `tokenizer_config.json` / `chat_template.jinja`
    /// from `dir`; `vocab_size` is the model's embedding row count.
    pub fn load(dir: &Path, cfg: &HfConfig) -> Result<HfTokenizer> {
        let tj = read_json(&dir.join("tokenizer.json"))?;
        let tc_path = dir.join("tokenizer_config.json");
        let tc = if tc_path.exists() {
            Some(read_json(&tc_path)?)
        } else {
            None
        };
        let model = tj
            .get("model")
            .ok_or_else(|| ConvertError::Tokenizer("tokenizer.json has no 'model'".into()))?;
        if model.get("type").and_then(Value::as_str) != Some("BPE") {
            return Err(ConvertError::Tokenizer(
                "only byte-level BPE tokenizers (model.type = BPE) are supported".into(),
            ));
        }
        let mut by_id: BTreeMap<u32, (String, i32)> = BTreeMap::new();
        let vocab = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or_else(|| ConvertError::Tokenizer("model.vocab is missing".into()))?;
        for (text, id) in vocab {
            let id = id
                .as_u64()
                .ok_or_else(|| ConvertError::Tokenizer(format!("vocab id of {text:?}")))?;
            by_id.insert(id as u32, (text.clone(), TOKEN_NORMAL));
        }
        if let Some(added) = tj.get("added_tokens").and_then(Value::as_array) {
            for a in added {
                let id = a.get("id").and_then(Value::as_u64);
                let content = a.get("content").and_then(Value::as_str);
                let (Some(id), Some(content)) = (id, content) else {
                    return Err(ConvertError::Tokenizer(format!("bad added token {a}")));
                };
                let special = a.get("special").and_then(Value::as_bool).unwrap_or(false);
                // As llama.cpp: special added tokens, and added tokens that look like
                // `<|...|>`, are control tokens; the others are user-defined.
                let looks_special = content.starts_with("<|") && content.ends_with("|>");
                let ty = if special || looks_special {
                    TOKEN_CONTROL
                } else {
                    TOKEN_USER_DEFINED
                };
                by_id.insert(id as u32, (content.to_string(), ty));
            }
        }
        let n_tok = by_id.keys().next_back().map_or(0, |&m| m as usize + 1);
        if n_tok > cfg.vocab_size {
            return Err(ConvertError::Tokenizer(format!(
                "{n_tok} token ids but the model has only {} embedding rows",
                cfg.vocab_size
            )));
        }
        let mut tokens = Vec::with_capacity(cfg.vocab_size);
        let mut token_types = Vec::with_capacity(cfg.vocab_size);
        for id in 0..cfg.vocab_size as u32 {
            match by_id.remove(&id) {
                Some((t, ty)) => {
                    tokens.push(t);
                    token_types.push(ty);
                }
                None => {
                    tokens.push(format!("[PAD{id}]"));
                    token_types.push(TOKEN_UNUSED);
                }
            }
        }
        let merges = match model.get("merges").and_then(Value::as_array) {
            Some(ms) => ms
                .iter()
                .map(|m| match m {
                    Value::String(s) => Ok(s.clone()),
                    Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                        (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                        _ => Err(ConvertError::Tokenizer(format!("bad merge {m}"))),
                    },
                    _ => Err(ConvertError::Tokenizer(format!("bad merge {m}"))),
                })
                .collect::<Result<Vec<String>>>()?,
            None => Vec::new(),
        };
        let find =
            |text: &str| -> Option<u32> { tokens.iter().position(|t| t == text).map(|i| i as u32) };
        let from_tc = |key: &str| -> Option<u32> {
            tc.as_ref()
                .and_then(|c| c.get(key))
                .and_then(token_content)
                .and_then(find)
        };
        let bos = from_tc("bos_token").or(cfg.bos_token_id);
        let eos = from_tc("eos_token").or(cfg.eos_token_id);
        let pad = from_tc("pad_token").or(cfg.pad_token_id);
        let add_bos = tc
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let mut chat_template = tc
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let jinja = dir.join("chat_template.jinja");
        if chat_template.is_none() && jinja.exists() {
            chat_template =
                Some(
                    std::fs::read_to_string(&jinja).map_err(|source| ConvertError::Io {
                        path: jinja.clone(),
                        source,
                    })?,
                );
        }
        for (what, id) in [("bos", bos), ("eos", eos), ("pad", pad)] {
            if let Some(id) = id {
                if id as usize >= cfg.vocab_size {
                    return Err(ConvertError::Tokenizer(format!(
                        "{what} token id {id} is outside the vocabulary"
                    )));
                }
            }
        }
        Ok(HfTokenizer {
            tokens,
            token_types,
            merges,
            bos,
            eos,
            pad,
            add_bos,
            chat_template,
        })
    }

    /// The `tokenizer.*` metadata entries, in llama.cpp's order.
    pub fn metadata(&self, pre: &str) -> Vec<(String, MetaValue)> {
        let mut kv = vec![
            (
                "tokenizer.ggml.model".to_string(),
                MetaValue::String("gpt2".into()),
            ),
            (
                "tokenizer.ggml.pre".to_string(),
                MetaValue::String(pre.into()),
            ),
            (
                "tokenizer.ggml.tokens".to_string(),
                MetaValue::Array(MetaArray::String(self.tokens.clone())),
            ),
            (
                "tokenizer.ggml.token_type".to_string(),
                MetaValue::Array(MetaArray::I32(self.token_types.clone())),
            ),
            (
                "tokenizer.ggml.merges".to_string(),
                MetaValue::Array(MetaArray::String(self.merges.clone())),
            ),
        ];
        if let Some(id) = self.eos {
            kv.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(id)));
        }
        if let Some(id) = self.pad {
            kv.push(("tokenizer.ggml.padding_token_id".into(), MetaValue::U32(id)));
        }
        if let Some(id) = self.bos {
            kv.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(id)));
        }
        kv.push((
            "tokenizer.ggml.add_bos_token".into(),
            MetaValue::Bool(self.add_bos),
        ));
        kv.push((
            "tokenizer.ggml.add_eos_token".into(),
            MetaValue::Bool(false),
        ));
        if let Some(t) = &self.chat_template {
            kv.push((
                "tokenizer.chat_template".into(),
                MetaValue::String(t.clone()),
            ));
        }
        kv
    }
}
