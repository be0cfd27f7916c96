//! `model::layout` against the facts sheet (full-size 80B-A3B tensor list, no data written) and
//! against a real llama.cpp file (the tiny reference fixture, same names, shapes and F32 set).

use std::collections::{BTreeMap, HashSet};

use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::layout::{Layout, LayoutParams, LayoutTypes, TensorRole};

const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/reference");

fn full() -> Layout {
    Layout::new(LayoutParams::qwen3next_80b_a3b(), LayoutTypes::default()).unwrap()
}

#[test]
fn full_size_layout_has_843_tensors_with_the_documented_shapes() {
    let l = full();
    assert_eq!(l.tensors.len(), 843);
    let names: HashSet<&str> = l.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names.len(), 843, "duplicate names");
    let by: BTreeMap<&str, (&[u64], GgmlType)> = l
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), (t.dims.as_slice(), t.ty)))
        .collect();
    let q4 = GgmlType::Q4K;
    let f32 = GgmlType::F32;
    let iq2 = GgmlType::IQ2XXS;
    let expect: &[(&str, &[u64], GgmlType)] = &[
        ("token_embd.weight", &[2048, 151936], q4),
        ("output_norm.weight", &[2048], f32),
        ("output.weight", &[2048, 151936], GgmlType::Q6K),
        ("blk.0.attn_norm.weight", &[2048], f32),
        ("blk.0.post_attention_norm.weight", &[2048], f32),
        ("blk.0.ffn_gate_inp.weight", &[2048, 512], f32),
        ("blk.0.ffn_gate_exps.weight", &[2048, 512, 512], iq2),
        ("blk.0.ffn_up_exps.weight", &[2048, 512, 512], iq2),
        ("blk.0.ffn_down_exps.weight", &[512, 2048, 512], iq2),
        ("blk.0.ffn_gate_inp_shexp.weight", &[2048], f32),
        ("blk.0.ffn_gate_shexp.weight", &[2048, 512], q4),
        ("blk.0.ffn_up_shexp.weight", &[2048, 512], q4),
        ("blk.0.ffn_down_shexp.weight", &[512, 2048], q4),
        ("blk.0.attn_qkv.weight", &[2048, 8192], q4),
        ("blk.0.attn_gate.weight", &[2048, 4096], q4),
        ("blk.0.ssm_ba.weight", &[2048, 64], q4),
        ("blk.0.ssm_conv1d.weight", &[4, 8192], f32),
        ("blk.0.ssm_dt.bias", &[32], f32),
        ("blk.0.ssm_a", &[32], f32),
        ("blk.0.ssm_norm.weight", &[128], f32),
        ("blk.0.ssm_out.weight", &[4096, 2048], q4),
        ("blk.47.attn_q.weight", &[2048, 8192], q4),
        ("blk.47.attn_k.weight", &[2048, 512], q4),
        ("blk.47.attn_v.weight", &[2048, 512], q4),
        ("blk.47.attn_output.weight", &[4096, 2048], q4),
        ("blk.47.attn_q_norm.weight", &[256], f32),
        ("blk.47.attn_k_norm.weight", &[256], f32),
    ];
    for &(name, dims, ty) in expect {
        let (d, t) = by.get(name).unwrap_or_else(|| panic!("missing {name}"));
        assert_eq!((*d, *t), (dims, ty), "{name}");
    }
    // Attention on layers 3, 7, ..., 47; DeltaNet elsewhere.
    for i in 0..48 {
        let attn = by.contains_key(format!("blk.{i}.attn_q.weight").as_str());
        let dn = by.contains_key(format!("blk.{i}.attn_qkv.weight").as_str());
        assert_eq!(attn, (i + 1) % 4 == 0, "layer {i}");
        assert_eq!(dn, !attn, "layer {i}");
    }
    assert!(!by.keys().any(|n| n.starts_with("blk.48.")));
    // Every non-float tensor is a matrix, every F32 one a small vector/taps/router.
    for t in &l.tensors {
        assert_eq!(t.ty == f32, t.role != TensorRole::Matrix, "{}", t.name);
    }
    // ≈ 21.5 GB with Q4_K dense + IQ2_XXS experts + Q6_K head.
    let gb = l.total_bytes() as f64 / 1e9;
    assert!((21.0..22.0).contains(&gb), "{gb} GB");
}

#[test]
fn full_size_metadata_and_mtp_block() {
    let mut p = LayoutParams::qwen3next_80b_a3b();
    p.mtp = true;
    let l = Layout::new(p, LayoutTypes::default()).unwrap();
    assert_eq!(l.tensors.len(), 843 + 16 + 4);
    let eh = l
        .tensors
        .iter()
        .find(|t| t.name == "blk.48.nextn.eh_proj.weight")
        .unwrap();
    assert_eq!(eh.dims, [4096, 2048]);
    let md: BTreeMap<String, _> = l.metadata().into_iter().collect();
    let u = |k: &str| md[&format!("qwen3next.{k}")].as_integer().unwrap();
    assert_eq!(u("block_count"), 49);
    assert_eq!(u("nextn_predict_layers"), 1);
    assert_eq!(u("embedding_length"), 2048);
    assert_eq!(u("expert_count"), 512);
    assert_eq!(u("expert_used_count"), 10);
    assert_eq!(u("ssm.inner_size"), 4096);
    assert_eq!(u("ssm.state_size"), 128);
    assert_eq!(u("ssm.group_count"), 16);
    assert_eq!(u("ssm.time_step_rank"), 32);
    assert_eq!(u("rope.dimension_count"), 64);
    assert_eq!(u("context_length"), 262144);
    assert_eq!(md["general.architecture"].as_str(), Some("qwen3next"));
}

#[test]
fn layers_option_keeps_the_pattern_and_types_must_fit_rows() {
    let mut p = LayoutParams::qwen3next_80b_a3b();
    p.n_layers = 6;
    let l = Layout::new(p.clone(), LayoutTypes::default()).unwrap();
    assert_eq!(l.tensors.len(), 3 + 5 * 18 + 16);
    // Q4_0 fits every row (multiples of 32); a tiny hidden size does not fit K-quants.
    let types = LayoutTypes {
        dense: GgmlType::Q4_0,
        experts: GgmlType::Q8_0,
        head: GgmlType::F16,
    };
    assert!(Layout::new(p.clone(), types).is_ok());
    p.hidden = 96;
    let err = Layout::new(p, LayoutTypes::default()).unwrap_err();
    assert!(err.to_string().contains("not whole"), "{err}");
}

#[test]
fn tiny_layout_matches_the_llama_cpp_fixture() {
    let f = GgufFile::open(format!("{REFERENCE}/models/tiny-Q4_K_M.gguf")).unwrap();
    let mut p = LayoutParams::qwen3next_tiny();
    p.mtp = true;
    let l = Layout::new(p, LayoutTypes::default()).unwrap();
    let ours: BTreeMap<&str, (&[u64], bool)> = l
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), (t.dims.as_slice(), t.ty == GgmlType::F32)))
        .collect();
    let theirs: BTreeMap<&str, (&[u64], bool)> = f
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), (t.dims.as_slice(), t.ty == GgmlType::F32)))
        .collect();
    assert_eq!(ours, theirs);
    // Same qwen3next.* keys and values.
    for (k, v) in l.metadata() {
        if k.starts_with("qwen3next.") {
            let got = f.get(&k).unwrap_or_else(|| panic!("fixture lacks {k}"));
            assert_eq!(got, &v, "{k}");
        }
    }
    for (k, _) in f.metadata() {
        if k.starts_with("qwen3next.") {
            assert!(l.metadata().iter().any(|(m, _)| m == k), "we lack {k}");
        }
    }
}
