//! Bad model files give errors that name the problem: another architecture, a missing tensor,
//! a tensor of the wrong shape.

use std::path::PathBuf;
use std::sync::Arc;

use redlite_gguf::{GgufFile, GgufWriter, MetaValue};
use redlite_model::{Model, ModelError, Oracle};

fn fixture() -> GgufFile {
    let p = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference/models/tiny-Q8_0.gguf"
    ));
    GgufFile::open(p).unwrap()
}

/// The fixture rewritten with `edit_kv` applied to each metadata value and tensors filtered/renamed by `edit_tensor`.
fn rewrite(
    edit_kv: impl Fn(&str, &MetaValue) -> MetaValue,
    edit_tensor: impl Fn(&str, &[u64]) -> Option<(String, Vec<u64>)>,
) -> Result<Model, ModelError> {
    let src = fixture();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.add_kv(k.clone(), edit_kv(k, v)).unwrap();
    }
    for t in src.tensors() {
        if let Some((name, dims)) = edit_tensor(&t.name, &t.dims) {
            let data = src.tensor_data(t).to_vec();
            let bytes_per_elem = data.len() as u64 / t.n_elements;
            let n: u64 = dims.iter().product();
            let mut data = data;
            if n != t.n_elements {
                data.resize((n * bytes_per_elem) as usize, 0);
            }
            w.add_tensor(name, &dims, t.ty, data).unwrap();
        }
    }
    let bytes = w.to_bytes().unwrap();
    Model::from_gguf(Arc::new(GgufFile::from_bytes(bytes)?), Oracle)
}

#[test]
fn other_architecture_is_unsupported() {
    let err = rewrite(
        |k, v| {
            if k == "general.architecture" {
                MetaValue::String("llama".into())
            } else {
                v.clone()
            }
        },
        |n, d| Some((n.to_string(), d.to_vec())),
    )
    .err()
    .unwrap();
    assert!(
        matches!(err, ModelError::UnsupportedArchitecture(ref a) if a == "llama"),
        "{err}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let err = rewrite(
        |_, v| v.clone(),
        |n, d| (n != "blk.1.ssm_out.weight").then(|| (n.to_string(), d.to_vec())),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("blk.1.ssm_out.weight"), "{err}");
}

#[test]
fn wrong_shape_names_tensor_and_expected_shape() {
    // A 2-D F32 router whose expert count does not match expert_count.
    let err = rewrite(
        |_, v| v.clone(),
        |n, d| {
            if n == "blk.2.ffn_gate_inp.weight" {
                Some((n.to_string(), vec![d[0], d[1] + 1]))
            } else {
                Some((n.to_string(), d.to_vec()))
            }
        },
    )
    .err()
    .unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains("blk.2.ffn_gate_inp.weight") && msg.contains("[256, 4]"),
        "{msg}"
    );
}

#[test]
fn impossible_hyperparameters_are_refused_at_load() {
    // (key, value, what the message must say): each loaded before and gave NaN logits or no
    // trunk layers.
    let cases: [(&str, MetaValue, &str); 6] = [
        (
            "qwen3next.attention.layer_norm_rms_epsilon",
            MetaValue::F32(f32::NAN),
            "layer_norm_rms_epsilon must be finite and > 0",
        ),
        (
            "qwen3next.attention.layer_norm_rms_epsilon",
            MetaValue::F32(-1.0),
            "layer_norm_rms_epsilon must be finite and > 0",
        ),
        (
            "qwen3next.rope.freq_base",
            MetaValue::F32(0.0),
            "rope.freq_base must be finite and > 0",
        ),
        (
            "qwen3next.context_length",
            MetaValue::U32(0),
            "context_length must be non-zero",
        ),
        (
            "qwen3next.nextn_predict_layers",
            MetaValue::U32(99),
            "leaves no trunk layers",
        ),
        (
            "qwen3next.block_count",
            MetaValue::U32(1),
            "leaves no trunk layers",
        ),
    ];
    for (key, value, says) in cases {
        let err = rewrite(
            |k, v| if k == key { value.clone() } else { v.clone() },
            |n, d| Some((n.to_string(), d.to_vec())),
        )
        .err()
        .unwrap_or_else(|| panic!("{key} = {value:?} loaded"));
        assert!(err.to_string().contains(says), "{key}: {err}");
    }
}
