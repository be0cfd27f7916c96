//! End-to-end checks of `redlite logits` and `redlite generate` against the float64 reference.

mod common;

use std::process::Command;

use common::{read_f32, redlite, reference};
use serde_json::Value;

fn entry(model: &str, prompt: &str) -> Value {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(reference("logits/index.json")).unwrap())
            .unwrap();
    index["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["model"] == model && e["prompt"] == prompt)
        .unwrap()
        .clone()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn join(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn logits_command_matches_exact_reference() {
    let e = entry("F16", "P1");
    let tokens = ids(&e["token_ids"]);
    let vocab = e["vocab"].as_u64().unwrap() as usize;
    let reference_rows = read_f32(&reference("logits").join(e["exact_path"].as_str().unwrap()));
    for mode in ["prefill", "step"] {
        let out = std::env::temp_dir().join(format!(
            "redlite-logits-test-{}-{mode}.bin",
            std::process::id()
        ));
        let status = Command::new(env!("CARGO_BIN_EXE_redlite"))
            .args(["logits", "-m"])
            .arg(reference("models/tiny-F16.gguf"))
            .args(["--ids", &join(&tokens), "--mode", mode, "--out"])
            .arg(&out)
            .status()
            .unwrap();
        assert!(status.success());
        let ours = read_f32(&out);
        std::fs::remove_file(&out).ok();
        assert_eq!(ours.len(), tokens.len() * vocab, "[n_ids, vocab] f32");
        // P1 stores every position, so the files line up row for row.
        let max_ref = reference_rows.iter().fold(0f32, |m, x| m.max(x.abs()));
        let max_d = ours
            .iter()
            .zip(&reference_rows)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(max_d / max_ref <= 1e-4, "{mode}: {}", max_d / max_ref);
    }
}

#[test]
fn greedy_generate_matches_exact_reference() {
    let e = entry("Q4_K_M", "P3");
    let model = reference("models/tiny-Q4_K_M.gguf");
    let out = redlite(&[
        "generate",
        "-m",
        model.to_str().unwrap(),
        "--ids",
        &join(&ids(&e["token_ids"])),
        "-n",
        "24",
        "--ignore-eos",
        "--print-ids",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout.lines().last().unwrap();
    let got: Vec<u32> = serde_json::from_str(last).unwrap();
    assert_eq!(got, ids(&e["greedy_exact"])[..24]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("tok/s"));
}

#[test]
fn unknown_backend_and_missing_file_are_clear_errors() {
    let out = redlite(&[
        "logits",
        "-m",
        "/nonexistent.gguf",
        "--ids",
        "1,2",
        "--out",
        "/tmp/x.bin",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nonexistent.gguf"));
}

#[test]
fn backend_cuda_without_a_gpu_says_so_and_runs_on_the_cpu() {
    let e = entry("Q4_K_M", "P3");
    let model = reference("models/tiny-Q4_K_M.gguf");
    let out = redlite(&[
        "generate",
        "-m",
        model.to_str().unwrap(),
        "--backend",
        "cuda",
        // Exact on a GPU too (the CUDA backend's default cache is f16).
        "--kv-type",
        "f32",
        "--ids",
        &join(&ids(&e["token_ids"])),
        "-n",
        "8",
        "--ignore-eos",
        "--print-ids",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let got: Vec<u32> = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(got, ids(&e["greedy_exact"])[..8]);
    if stderr.contains("warning: --backend cuda") {
        assert!(stderr.contains("using the CPU backend instead"), "{stderr}");
    }
}

/// The failing command's stderr, after checking that it failed (not a panic: exit code 1).
fn fails(args: &[&str]) -> String {
    let out = redlite(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    err
}

#[test]
fn bad_options_are_clear_errors_not_panics_or_hangs() {
    let model = reference("models/tiny-Q4_K_M.gguf");
    let m = model.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "-m", m, "-p", "hi", "-n", "2"];
        a.extend_from_slice(extra);
        fails(&a)
    };
    // A thread count past the limit fails at once (it used to start threads for minutes).
    assert!(gen(&["-t", "100000"]).contains("at most 1024"));
    assert!(gen(&["--temp", "NaN"]).contains("--temp must be a finite number"));
    assert!(gen(&["--temp", "inf"]).contains("--temp must be a finite number"));
    assert!(gen(&["--top-p", "NaN"]).contains("--top-p"));
    assert!(gen(&["--min-p", "2"]).contains("--min-p must be between 0 and 1"));
    assert!(gen(&["--repeat-penalty", "0"]).contains("--repeat-penalty"));
    // A directory is not a model file, and the OS error is not printed twice.
    let dir = std::env::temp_dir();
    let err = fails(&["generate", "-m", dir.to_str().unwrap(), "-p", "hi"]);
    assert!(err.contains("is a directory, not a GGUF file"), "{err}");
    let err = fails(&["generate", "-m", "/nonexistent-redlite.gguf", "-p", "hi"]);
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    // serve's options, checked before the model loads.
    let serve = |extra: &[&str]| {
        let mut a = vec!["serve", "-m", m, "--port", "1"];
        a.extend_from_slice(extra);
        fails(&a)
    };
    assert!(serve(&["--ctx", "1"]).contains("--ctx must be at least 2"));
    assert!(serve(&["--ctx", "99999999"]).contains("exceeds the model's context length"));
    assert!(serve(&["--checkpoint-interval", "63"]).contains("multiple of 64"));
    assert!(serve(&["--api-key="]).contains("--api-key is empty"));
    let err = serve(&["--state-dir", m]);
    assert!(
        err.contains("--state-dir") && err.contains("not a directory"),
        "{err}"
    );
    // perplexity with no chunks to score.
    let err = fails(&["perplexity", "-m", m, "-f", "/dev/null", "--chunks", "0"]);
    assert!(err.contains("--chunks must be at least 1"), "{err}");
}

#[test]
fn generate_stops_at_the_models_context() {
    // tiny-Q4_K_M's context_length is 4096: -n past it is clamped with a warning.
    let model = reference("models/tiny-Q4_K_M.gguf");
    let out = redlite(&[
        "generate",
        "-m",
        model.to_str().unwrap(),
        "--ids",
        "1,2,3",
        "-n",
        "100000",
        "--ignore-eos",
        "--print-ids",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("generating at most 4093 tokens"), "{err}");
}
