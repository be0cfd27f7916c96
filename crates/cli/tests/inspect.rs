//! `redlite inspect` end to end: the JSON report of a fixture, the text report, files that are
//! not models, `--dequant` against `dequantize_to_vec`, and error handling (never a panic).

mod common;

use std::path::PathBuf;

use common::{redlite, reference};
use redlite_gguf::quant::dequantize_to_vec;
use redlite_gguf::GgufFile;
use serde_json::Value;

fn ok_stdout(args: &[&str]) -> String {
    let out = redlite(args);
    assert!(
        out.status.success(),
        "redlite {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

fn json(args: &[&str]) -> Value {
    serde_json::from_str(&ok_stdout(args)).expect("valid JSON")
}

/// A fresh path in the temp dir, unique per test and process.
fn temp_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("redlite-inspect-{}-{tag}.f32", std::process::id()))
}

// Hand-computed bytes of tiny-Q8_0.gguf (see crates/model/tests/sizing.rs for the per-tensor
// derivation): per decode token 3 × 505,248 + 495,104 + 1,024 dense, 4 layers × top-2 of 4 experts
// × 3 tensors × 69,632, head 256 × 4160 / 32 × 34 = 1,131,520, embedding row 256 / 32 × 34 = 272.
const Q8_DENSE: u64 = 3 * 505_248 + 495_104 + 1_024;
const Q8_EXPERTS: u64 = 4 * 2 * 3 * 69_632;
const Q8_HEAD: u64 = 1_131_520;
const Q8_ROW: u64 = 272;

#[test]
fn json_report_of_tiny_q8_0() {
    let path = reference("models/tiny-Q8_0.gguf");
    let v = json(&["inspect", path.to_str().unwrap(), "--json"]);

    assert_eq!(v["architecture"], "qwen3next");
    assert_eq!(v["name"], "Hf_Tiny");
    assert_eq!(v["gguf_version"], 3);
    assert_eq!(v["alignment"], 32);
    assert_eq!(
        v["file_size"].as_u64(),
        Some(std::fs::metadata(&path).unwrap().len())
    );
    assert_eq!(v["tensor_count"], 93);
    let by_type: Vec<(String, u64)> = v["by_type"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["type"].as_str().unwrap().to_string(),
                t["count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(by_type, vec![("F32".into(), 40), ("Q8_0".into(), 53)]);
    // 5 blocks (4 trunk + MTP) × 3 expert tensors × [256, 256, 4] Q8_0 (278,528 B).
    assert_eq!(v["expert_bytes"], 15 * 278_528);
    assert_eq!(
        v["dense_bytes"].as_u64().unwrap() + v["expert_bytes"].as_u64().unwrap(),
        v["tensor_bytes"].as_u64().unwrap()
    );

    let c = &v["config"];
    for (k, want) in [
        ("hidden", 256),
        ("n_layers", 4),
        ("vocab", 4160),
        ("n_heads", 4),
        ("n_kv_heads", 2),
        ("head_dim", 64),
        ("rope_dims", 16),
        ("conv_kernel", 4),
        ("dn_k_heads", 2),
        ("dn_v_heads", 4),
        ("dn_k_dim", 64),
        ("dn_v_dim", 64),
        ("n_experts", 4),
        ("n_experts_used", 2),
        ("expert_ff", 256),
        ("shared_ff", 256),
        ("nextn_layers", 1),
    ] {
        assert_eq!(c[k], want, "config.{k}");
    }
    assert_eq!(c["rope_theta"].as_f64(), Some(1e7));
    assert!(c["rms_eps"].is_number() && c["context_length"].is_number());
    assert_eq!(c["layer_kinds"].as_array().unwrap().len(), 4);
    assert_eq!(v["layer_pattern"], "\"DDDA\"");

    let s = &v["sizes"];
    let d = &s["decode_per_token"];
    assert_eq!(d["dense"], Q8_DENSE);
    assert_eq!(d["experts"], Q8_EXPERTS);
    assert_eq!(d["head"], Q8_HEAD);
    assert_eq!(d["head_tensor"], "output.weight");
    assert_eq!(d["head_type"], "Q8_0");
    assert_eq!(d["embedding_row"], Q8_ROW);
    assert_eq!(d["total"], Q8_DENSE + Q8_EXPERTS + Q8_HEAD + Q8_ROW);
    // MTP: attention layer dense (495,104) + eh_proj 512 × 256 / 32 × 34 + 3 norms, top-2 experts.
    assert_eq!(s["mtp"]["dense"], 495_104 + 139_264 + 3 * 1_024);
    assert_eq!(s["mtp"]["experts_top_k"], 2 * 3 * 69_632);
    assert_eq!(s["kv_bytes_per_position"]["f32"], 1_024);
    assert_eq!(s["kv_bytes_per_position"]["f16"], 512);
    // q8_0: 256 values / 32 × 34 bytes.
    assert_eq!(s["kv_bytes_per_position"]["q8_0"], 272);
    assert_eq!(s["recurrent_state_bytes_f32"], 215_040);
    let layers = s["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 5);
    assert_eq!(layers[3]["kind"], "attention");
    assert_eq!(layers[4]["mtp"], true);
    assert!(v.get("tensors").is_none());
}

#[test]
fn json_tensor_list() {
    let path = reference("models/tiny-CF2.gguf");
    let v = json(&["inspect", path.to_str().unwrap(), "--json", "--tensors"]);
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 93);
    let out = tensors
        .iter()
        .find(|t| t["name"] == "output.weight")
        .unwrap();
    assert_eq!(out["type"], "Q6_K");
    assert_eq!(out["dims"], serde_json::json!([256, 4160]));
    assert_eq!(out["bytes"], 256 * 4160 / 256 * 210);
    assert!(out["offset"].is_u64());
    // CF2 reads IQ2_XXS experts: 4 layers × 2 × 3 × (256 × 256 / 256 × 66).
    assert_eq!(
        v["sizes"]["decode_per_token"]["experts"],
        4 * 2 * 3 * 16_896
    );
}

#[test]
fn text_report() {
    let path = reference("models/tiny-Q8_0.gguf");
    let text = ok_stdout(&["inspect", path.to_str().unwrap(), "--tensors", "--layers"]);
    for needle in [
        "architecture:   qwen3next",
        "Hf_Tiny",
        "version 3, alignment 32",
        "\"DDDA\" + 1 MTP block",
        "Q8_0",
        "bytes read per decode token",
        "4,814,832 B", // the per-token total, = Q8_DENSE + Q8_EXPERTS + Q8_HEAD + Q8_ROW
        "1,671,168 B", // top-k experts
        "215,040 B",   // recurrent state
        "blk.4.nextn.eh_proj.weight",
        "per layer:",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    assert_eq!(Q8_DENSE + Q8_EXPERTS + Q8_HEAD + Q8_ROW, 4_814_832);
}

#[test]
fn vocab_only_file_is_described_without_a_model_config() {
    let path = reference("tokenizer/qwen3-vocab.gguf");
    let text = ok_stdout(&["inspect", path.to_str().unwrap()]);
    assert!(text.contains("model config unavailable"), "{text}");
    assert!(text.contains("tensors:        0"), "{text}");
    let v = json(&["inspect", path.to_str().unwrap(), "--json"]);
    assert_eq!(v["tensor_count"], 0);
    assert!(v["config"].is_null());
    assert!(v["config_unavailable"].is_string());
}

fn check_dequant(model: &str, tensor: &str) {
    let path = reference(model);
    let out_path = temp_path(tensor);
    let v = json(&[
        "inspect",
        path.to_str().unwrap(),
        "--tensor",
        tensor,
        "--dequant",
        out_path.to_str().unwrap(),
        "--json",
    ]);
    let written = std::fs::read(&out_path).expect("dequant output");
    std::fs::remove_file(&out_path).ok();

    let f = GgufFile::open(&path).unwrap();
    let t = f.tensor(tensor).unwrap();
    assert_eq!(v["name"], tensor);
    assert_eq!(written.len() as u64, t.n_elements * 4);
    let want = dequantize_to_vec(t.ty, f.tensor_data(t)).unwrap();
    let want: Vec<u8> = want.iter().flat_map(|x| x.to_le_bytes()).collect();
    assert!(written == want, "{model} {tensor}: bytes differ");
}

#[test]
fn dequant_writes_le_f32_equal_to_dequantize_to_vec() {
    check_dequant("models/tiny-CF2.gguf", "blk.0.ffn_down_exps.weight"); // IQ2_XXS
    check_dequant("models/tiny-CF2.gguf", "output.weight"); // Q6_K
    check_dequant("models/tiny-Q8_0.gguf", "token_embd.weight"); // Q8_0
    check_dequant("models/tiny-Q8_0.gguf", "blk.0.ssm_conv1d.weight"); // F32
}

#[test]
fn tensor_without_dequant_prints_its_entry() {
    let path = reference("models/tiny-CF2.gguf");
    let text = ok_stdout(&[
        "inspect",
        path.to_str().unwrap(),
        "--tensor",
        "blk.3.attn_q.weight",
    ]);
    assert!(text.contains("blk.3.attn_q.weight"), "{text}");
    assert!(text.contains("[256, 512]"), "{text}");
    assert!(text.contains("Q4_K"), "{text}");
}

/// Fails with a message and exit status 1, never a panic.
fn fails_cleanly(args: &[&str], needle: &str) {
    let out = redlite(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert!(stderr.contains(needle), "{args:?}: {stderr}");
}

#[test]
fn errors_have_context() {
    let missing = reference("models/does-not-exist.gguf");
    fails_cleanly(
        &["inspect", missing.to_str().unwrap()],
        "does-not-exist.gguf",
    );
    let bad = reference("broken/bad_magic.gguf");
    fails_cleanly(&["inspect", bad.to_str().unwrap()], "bad magic");
    let truncated = reference("broken/truncated_in_tensor_data.gguf");
    fails_cleanly(
        &["inspect", truncated.to_str().unwrap()],
        "truncated_in_tensor_data",
    );
    let tiny = reference("models/tiny-CF2.gguf");
    fails_cleanly(
        &[
            "inspect",
            tiny.to_str().unwrap(),
            "--tensor",
            "no.such.tensor",
        ],
        "no tensor named \"no.such.tensor\"",
    );
    let unwritable = "/nonexistent-dir/out.f32";
    fails_cleanly(
        &[
            "inspect",
            tiny.to_str().unwrap(),
            "--tensor",
            "output.weight",
            "--dequant",
            unwritable,
        ],
        unwritable,
    );
    // --dequant needs --tensor: a usage error from clap (status 2).
    let out = redlite(&["inspect", tiny.to_str().unwrap(), "--dequant", "x.f32"]);
    assert_eq!(out.status.code(), Some(2));
}

/// Full-size layout (see crates/model/tests/sizing.rs): REDLITE_FULLSIZE=/path/to/file.gguf.
#[test]
#[ignore = "needs REDLITE_FULLSIZE=/path/to/full-size.gguf"]
fn full_size_json() {
    let Some(path) = std::env::var_os("REDLITE_FULLSIZE") else {
        eprintln!("REDLITE_FULLSIZE is not set; skipping");
        return;
    };
    let v = json(&["inspect", path.to_str().unwrap(), "--json"]);
    assert_eq!(v["tensor_count"], 843);
    assert_eq!(v["layer_pattern"], "\"DDDA\" ×12");
    assert_eq!(
        v["sizes"]["decode_per_token"]["experts"],
        10u64 * 3 * 2048 * 512 * 48 * 66 / 256
    );
}
