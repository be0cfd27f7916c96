//! Perplexity against llama.cpp's own figures (`llama-perplexity -c 128` on logits/heldout.txt,
//! reference README §3): within 0.5 %.

use std::path::PathBuf;
use std::sync::Arc;

use redlite_engine::perplexity::{perplexity, PerplexityOptions};
use redlite_gguf::GgufFile;
use redlite_model::{Model, Oracle};
use redlite_tokenizer::tokenizer::Tokenizer;

fn reference() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference"
    ))
}

/// Runs the whole held-out text at ctx 128 as llama-perplexity does and returns (ppl, stderr).
fn heldout_ppl(model_file: &str) -> (f64, f64, usize) {
    let file = Arc::new(GgufFile::open(reference().join("models").join(model_file)).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::from_gguf(file, Oracle).unwrap();
    let mut text = std::fs::read_to_string(reference().join("logits/heldout.txt")).unwrap();
    if text.ends_with('\n') {
        text.pop();
    }
    assert!(!tokenizer.add_bos_token(), "this vocabulary adds no BOS");
    let tokens = tokenizer.encode(&text, false).unwrap();
    let opts = PerplexityOptions {
        ctx: 128,
        max_chunks: None,
        bos: None,
        parallel_chunks: std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let report = perplexity(&model, &tokens, &opts, |_| {}).unwrap();
    assert_eq!(report.chunks, tokens.len() / 128);
    assert_eq!(report.stats.count, report.chunks * 63);
    (report.ppl(), report.ppl_stderr().unwrap(), report.chunks)
}

fn check(model_file: &str, llama_ppl: f64, llama_err: f64) {
    let (ppl, err, chunks) = heldout_ppl(model_file);
    let rel = (ppl - llama_ppl).abs() / llama_ppl;
    eprintln!(
        "{model_file}: redlite PPL {ppl:.4} ± {err:.5} over {chunks} chunks; llama.cpp {llama_ppl} ± {llama_err} ({:+.3} %)",
        100.0 * (ppl / llama_ppl - 1.0)
    );
    assert!(
        rel <= 0.005,
        "{model_file}: PPL {ppl} is {:.3} % from llama.cpp's {llama_ppl}",
        100.0 * rel
    );
    // The error estimate is the same formula over the same tokens: it should agree closely too.
    assert!(
        (err - llama_err).abs() / llama_err <= 0.01,
        "stderr {err} vs {llama_err}"
    );
}

#[test]
fn heldout_ppl_f16_matches_llama_cpp() {
    check("tiny-F16.gguf", 64.4894, 2.06004);
}

#[test]
fn heldout_ppl_q8_0_matches_llama_cpp() {
    check("tiny-Q8_0.gguf", 64.5198, 2.06178);
}

/// Chunks are independent: running them side by side changes nothing, the running estimates
/// end at the final figure, and a BOS swap changes only the first token's input.
#[test]
fn parallel_chunks_and_running_estimates_are_consistent() {
    let file = Arc::new(GgufFile::open(reference().join("models/tiny-Q4_K_M.gguf")).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::from_gguf(file, Oracle).unwrap();
    let text = std::fs::read_to_string(reference().join("logits/heldout.txt")).unwrap();
    let tokens = tokenizer.encode(&text, false).unwrap();
    let run = |parallel_chunks, bos| {
        let opts = PerplexityOptions {
            ctx: 32,
            max_chunks: Some(4),
            bos,
            parallel_chunks,
        };
        let mut seen = Vec::new();
        let r = perplexity(&model, &tokens, &opts, |c| {
            seen.push((c.index, c.total, c.chunk.count))
        })
        .unwrap();
        (r, seen)
    };
    let (serial, seen) = run(1, None);
    let (parallel, _) = run(2, None);
    assert_eq!(seen, (0..4).map(|i| (i, 4, 15)).collect::<Vec<_>>());
    assert_eq!(serial.stats, parallel.stats);
    assert_eq!(serial.running_ppl, parallel.running_ppl);
    assert_eq!(*serial.running_ppl.last().unwrap(), serial.ppl());
    assert_eq!(serial.stats.count, 4 * 15);
    let (with_bos, _) = run(1, Some(4096));
    assert_ne!(with_bos.stats, serial.stats);
    assert!(with_bos.ppl().is_finite());
}

#[test]
fn too_short_text_is_an_error() {
    let model = Model::load(reference().join("models/tiny-Q4_K_M.gguf")).unwrap();
    let opts = PerplexityOptions {
        ctx: 64,
        ..Default::default()
    };
    let err = perplexity(&model, &[1; 100], &opts, |_| {}).unwrap_err();
    assert!(err.to_string().contains("at least 128"), "{err}");
    let opts = PerplexityOptions {
        ctx: 2,
        ..Default::default()
    };
    assert!(perplexity(&model, &[1; 100], &opts, |_| {}).is_err());
}
