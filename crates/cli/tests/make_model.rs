//! `redlite make-model` end to end on the small `qwen3next-tiny` layout with the real Qwen3
//! vocabulary: the file loads in the oracle and runs tokens to finite logits; `inspect` reads it;
//! errors (unknown type/layout, existing output) are reported, not panics.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{redlite, reference};
use redlite_gguf::GgufFile;
use redlite_model::{Mode, Model};

/// A fresh path in the temp dir, unique per test and process.
fn temp_path(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!(
        "redlite-make-model-{}-{tag}.gguf",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&p);
    p
}

fn make(out: &Path, extra: &[&str]) -> Output {
    let vocab = reference("tokenizer/qwen3-vocab.gguf");
    let mut args = vec![
        "make-model",
        out.to_str().unwrap(),
        "--layout",
        "qwen3next-tiny",
        "--vocab",
        vocab.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    redlite(&args)
}

fn run_tokens(path: &Path) {
    let model = Model::load(path).expect("oracle loads the file");
    let tokens = [151644u32, 872, 198, 9707, 11, 1879];
    for mode in [Mode::Prefill, Mode::Step] {
        let mut st = model.new_state();
        let logits = model.forward(&mut st, &tokens, mode).unwrap();
        assert_eq!(logits.len(), tokens.len());
        for row in &logits {
            assert_eq!(row.len(), 151936);
            assert!(row.iter().all(|v| v.is_finite()), "non-finite logits");
        }
    }
}

#[test]
fn tiny_layout_with_mtp_loads_and_runs_in_the_oracle() {
    let out = temp_path("mtp");
    let r = make(
        &out,
        &[
            "--layers",
            "4",
            "--experts",
            "IQ2_XXS",
            "--dense",
            "Q4_K",
            "--mtp",
        ],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(String::from_utf8_lossy(&r.stdout).contains("wrote"));

    let f = GgufFile::open(&out).unwrap();
    assert_eq!(f.tensors().len(), 3 + 3 * 18 + 16 + 20);
    assert_eq!(f.get_u32("qwen3next.block_count").unwrap(), 5);
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        151936
    );
    drop(f);
    let model = Model::load(&out).unwrap();
    assert!(model.has_mtp());
    drop(model);
    run_tokens(&out);

    let inspect = redlite(&["inspect", out.to_str().unwrap()]);
    assert!(inspect.status.success());
    let _ = std::fs::remove_file(&out);
}

#[test]
fn other_types_and_layer_counts() {
    let out = temp_path("types");
    let r = make(
        &out,
        &[
            "--layers",
            "6",
            "--experts",
            "IQ1_M",
            "--dense",
            "Q8_0",
            "--head",
            "Q4_0",
            "--seed",
            "9",
        ],
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(f.tensors().len(), 3 + 5 * 18 + 16);
    drop(f);
    run_tokens(&out);

    // The output exists now: refused without --force, replaced with it.
    let again = make(&out, &["--layers", "4"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let forced = make(&out, &["--layers", "4", "--force"]);
    assert!(forced.status.success());
    assert_eq!(
        GgufFile::open(&out).unwrap().tensors().len(),
        3 + 3 * 18 + 16
    );
    let _ = std::fs::remove_file(&out);
}

#[test]
fn bad_arguments_are_errors() {
    let out = temp_path("bad");
    for (extra, needle) in [
        (&["--dense", "Q9_K"][..], "unknown type"),
        (&["--layers", "0"][..], "n_layers is 0"),
    ] {
        let r = make(&out, extra);
        assert!(!r.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(err.contains(needle), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let r = redlite(&["make-model", out.to_str().unwrap(), "--layout", "llama"]);
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("unknown layout"));
    let r = redlite(&[
        "make-model",
        out.to_str().unwrap(),
        "--vocab",
        "/nonexistent/vocab.gguf",
    ]);
    assert!(!r.status.success());
    assert!(!out.exists());
}
