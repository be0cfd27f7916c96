//! Every fixture model, the imatrix file and the Qwen3 vocabulary open; tensor tables match
//! `models/index.json` (count, ggml type of every tensor, per-type counts, file size, key metadata).

mod common;

use std::collections::BTreeMap;

use common::reference;
use redlite_gguf::{GgufFile, MetaValue};

#[test]
fn fixture_models_match_index_json() {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(reference("models/index.json")).unwrap()).unwrap();
    let models = index["models"].as_object().unwrap();
    assert!(models.len() >= 10);
    for (label, m) in models {
        let file = m["file"].as_str().unwrap();
        let f = GgufFile::open(reference("models").join(file))
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(f.file_size(), m["bytes"].as_u64().unwrap(), "{file}");
        assert_eq!(f.version(), 3, "{file}");
        assert_eq!(f.architecture().unwrap(), "qwen3next", "{file}");
        assert_eq!(
            f.tensors().len() as u64,
            m["n_tensors"].as_u64().unwrap(),
            "{file}"
        );

        // Every tensor's type, by name, and nothing else.
        let expected: BTreeMap<&str, &str> = m["tensor_types"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str().unwrap()))
            .collect();
        let actual: BTreeMap<&str, &str> = f
            .tensors()
            .iter()
            .map(|t| (t.name.as_str(), t.ty.name()))
            .collect();
        assert_eq!(actual, expected, "{file}: tensor types");

        let mut counts: BTreeMap<String, u64> = BTreeMap::new();
        for t in f.tensors() {
            *counts.entry(t.ty.name().to_string()).or_default() += 1;
        }
        let expected_counts: BTreeMap<String, u64> = m["type_counts"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
            .collect();
        assert_eq!(counts, expected_counts, "{file}: type counts");

        for key in [
            "qwen3next.block_count",
            "qwen3next.nextn_predict_layers",
            "general.file_type",
        ] {
            assert_eq!(
                f.get_u64(key).unwrap(),
                m[key].as_u64().unwrap(),
                "{file}: {key}"
            );
        }

        // Tensor data slices are exactly n_bytes, inside the data section, aligned.
        for t in f.tensors() {
            assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
            assert_eq!(t.offset % f.alignment(), 0);
            assert!(f.data_offset() + t.offset + t.n_bytes <= f.file_size());
        }
    }
}

#[test]
fn qwen3_vocab_opens() {
    let f = GgufFile::open(reference("tokenizer/qwen3-vocab.gguf")).unwrap();
    assert_eq!(f.architecture().unwrap(), "qwen3next");
    assert!(f.tensors().is_empty());
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "qwen2");
    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 151_936);
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 151_645);
    assert_eq!(tokens[151_645], "<|im_end|>");
    let types = f.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert_eq!(types.len(), tokens.len());
    assert!(!f.get_str_array("tokenizer.ggml.merges").unwrap().is_empty());
    assert!(f
        .get_str("tokenizer.chat_template")
        .unwrap()
        .contains("<|im_start|>"));
}

#[test]
fn imatrix_opens() {
    let f = GgufFile::open(reference("models/tiny.imatrix.gguf")).unwrap();
    assert_eq!(f.get_str("general.type").unwrap(), "imatrix");
    assert_eq!(f.get_str_array("imatrix.datasets").unwrap().len(), 1);
    assert_eq!(f.get_u32("imatrix.chunk_size").unwrap(), 128);
    assert_eq!(f.tensors().len(), 96);
    for t in f.tensors() {
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
    }
}

#[test]
fn typed_accessors_on_a_real_file() {
    let f = GgufFile::open(reference("models/tiny-Q4_K_M.gguf")).unwrap();
    // Integer accessors convert across widths when the value fits.
    let n = f.get_u32("qwen3next.block_count").unwrap();
    assert_eq!(n, 5);
    assert_eq!(f.get_i64("qwen3next.block_count").unwrap(), 5);
    assert_eq!(f.get_opt_u32("qwen3next.block_count").unwrap(), Some(5));
    assert_eq!(f.get_opt_u32("no.such.key").unwrap(), None);
    assert_eq!(f.get_opt_str("no.such.key").unwrap(), None);

    // Errors name the key and the type found.
    let e = f.get_u32("no.such.key").unwrap_err();
    assert!(matches!(e.kind(), redlite_gguf::GgufErrorKind::MissingKey));
    assert!(e.to_string().contains("no.such.key"), "{e}");
    let e = f.get_u32("general.architecture").unwrap_err();
    assert!(
        matches!(e.kind(), redlite_gguf::GgufErrorKind::TypeMismatch { found, .. } if found == "string")
    );
    assert!(e.to_string().contains("general.architecture"), "{e}");
    assert!(f.get_opt_u32("general.architecture").is_err());
    let e = f.get_str("tokenizer.ggml.tokens").unwrap_err();
    assert!(e.to_string().contains("array[string]"), "{e}");

    assert!(
        f.get_f32("qwen3next.attention.layer_norm_rms_epsilon")
            .unwrap()
            > 0.0
    );
    assert_eq!(
        f.get_bool_array("qwen3next.attention.recurrent_layers")
            .unwrap(),
        [true, true, true, false, false]
    );
    assert_eq!(f.get_str("general.type").unwrap(), "model");
    assert_eq!(f.get_u32("general.quantization_version").unwrap(), 2);
    for (k, v) in f.metadata() {
        assert_eq!(f.get(k), Some(v));
        assert!(!v.type_name().is_empty());
        let _ = v.to_string();
    }
    assert!(matches!(
        f.get("general.architecture"),
        Some(MetaValue::String(s)) if s == "qwen3next"
    ));
}
