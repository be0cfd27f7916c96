//! The oracle forward against the float64 Hugging Face reference (`../shared/reference/logits/`).
//! Tolerances are the issue's: max |Δ| / max |ref| ≤ 1e-4 for logits (prefill and step paths)
//! and MTP logits; greedy continuations identical except at float32 ties (top-2 gap < 1e-4).

use std::collections::HashMap;
use std::path::PathBuf;

use redlite_model::{Mode, Model};
use serde_json::Value;

fn reference() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference"
    ))
}

fn read_f32(path: &PathBuf) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

struct Entry {
    model: String,
    model_file: PathBuf,
    prompt: String,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    exact: PathBuf,
    mtp_exact: Option<PathBuf>,
    greedy_exact: Vec<u32>,
}

fn entries() -> Vec<Entry> {
    let root = reference();
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("logits/index.json")).unwrap())
            .unwrap();
    index["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| !e["exact_path"].is_null())
        .map(|e| Entry {
            model: e["model"].as_str().unwrap().to_string(),
            model_file: root.join(e["model_file"].as_str().unwrap()),
            prompt: e["prompt"].as_str().unwrap().to_string(),
            tokens: ids(&e["token_ids"]),
            positions: e["positions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect(),
            exact: root.join("logits").join(e["exact_path"].as_str().unwrap()),
            mtp_exact: e["mtp_exact_path"]
                .as_str()
                .map(|p| root.join("logits").join(p)),
            greedy_exact: ids(&e["greedy_exact"]),
        })
        .collect()
}

/// max |a − b| / max |b| over all values.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let max_ref = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let max_d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    max_d / max_ref
}

fn stored_rows(all: &[Vec<f32>], positions: &[usize]) -> Vec<f32> {
    positions
        .iter()
        .flat_map(|&p| all[p].iter().copied())
        .collect()
}

fn models() -> HashMap<PathBuf, Model> {
    let mut m = HashMap::new();
    for e in entries() {
        m.entry(e.model_file.clone())
            .or_insert_with(|| Model::load(&e.model_file).unwrap());
    }
    m
}

#[test]
fn logits_match_exact_reference_prefill_and_step() {
    let models = models();
    let mut worst = 0f32;
    for e in entries() {
        let model = &models[&e.model_file];
        let reference = read_f32(&e.exact);
        for mode in [Mode::Prefill, Mode::Step] {
            let mut state = model.new_state();
            let logits = match mode {
                Mode::Prefill => model.forward(&mut state, &e.tokens, mode).unwrap(),
                Mode::Step => e
                    .tokens
                    .iter()
                    .flat_map(|&t| model.forward(&mut state, &[t], mode).unwrap())
                    .collect(),
            };
            let err = rel_err(&stored_rows(&logits, &e.positions), &reference);
            println!(
                "{:>10} {} {:?}: max|Δ|/max|ref| = {err:.2e}",
                e.model, e.prompt, mode
            );
            worst = worst.max(err);
            assert!(
                err <= 1e-4,
                "{} {} {:?}: relative error {err:.3e} > 1e-4",
                e.model,
                e.prompt,
                mode
            );
        }
    }
    println!("worst relative error: {worst:.2e}");
}

#[test]
fn mtp_logits_match_exact_reference() {
    let models = models();
    let mut checked = 0;
    for e in entries() {
        let Some(path) = &e.mtp_exact else { continue };
        let model = &models[&e.model_file];
        let mut state = model.new_state();
        let hidden = model
            .forward_hidden(&mut state, &e.tokens, Mode::Prefill)
            .unwrap();
        let mut mtp = model.new_mtp_state();
        let mut logits = Vec::new();
        for (t, h) in hidden.iter().enumerate().take(e.tokens.len() - 1) {
            logits.extend(model.mtp_logits(&mut mtp, h, e.tokens[t + 1], t).unwrap());
        }
        let err = rel_err(&logits, &read_f32(path));
        println!(
            "{:>10} {} MTP: max|Δ|/max|ref| = {err:.2e}",
            e.model, e.prompt
        );
        assert!(
            err <= 1e-4,
            "{} {} MTP: relative error {err:.3e} > 1e-4",
            e.model,
            e.prompt
        );
        checked += 1;
    }
    assert_eq!(checked, 6, "F16 and Q8_0 × 3 prompts carry MTP references");
}

fn argmax_and_gap(logits: &[f32]) -> (u32, f32) {
    let mut best = (0usize, f32::NEG_INFINITY);
    let mut second = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best.1 {
            second = best.1;
            best = (i, v);
        } else if v > second {
            second = v;
        }
    }
    (best.0 as u32, best.1 - second)
}

#[test]
fn greedy_continuations_match_exact_reference() {
    let models = models();
    for e in entries() {
        let model = &models[&e.model_file];
        let mut state = model.new_state();
        let mut logits = model
            .forward(&mut state, &e.tokens, Mode::Prefill)
            .unwrap()
            .pop()
            .unwrap();
        for (step, &want) in e.greedy_exact.iter().enumerate() {
            let (got, gap) = argmax_and_gap(&logits);
            if got != want {
                // Only an exact float32 tie may diverge; report it.
                println!(
                    "{} {} step {step}: got {got}, reference {want}, top-2 gap {gap:.2e}",
                    e.model, e.prompt
                );
                assert!(
                    gap < 1e-4,
                    "{} {} diverges at step {step} with gap {gap:.3e}",
                    e.model,
                    e.prompt
                );
                break;
            }
            logits = model
                .forward(&mut state, &[got], Mode::Step)
                .unwrap()
                .pop()
                .unwrap();
        }
    }
}

#[test]
fn legacy_and_split_deltanet_layouts_agree() {
    let root = reference().join("models");
    let split = Model::load(root.join("tiny-CF2.gguf")).unwrap();
    let legacy = Model::load(root.join("tiny-LEGACY_CF2.gguf")).unwrap();
    let e = entries().into_iter().find(|e| e.prompt == "P1").unwrap();
    let a = split
        .forward(&mut split.new_state(), &e.tokens, Mode::Prefill)
        .unwrap()
        .concat();
    let b = legacy
        .forward(&mut legacy.new_state(), &e.tokens, Mode::Prefill)
        .unwrap()
        .concat();
    let err = rel_err(&b, &a);
    println!("legacy vs split: {err:.2e}");
    assert!(err <= 1e-6);
}

#[test]
fn chunked_and_step_deltanet_agree() {
    let root = reference().join("models");
    let model = Model::load(root.join("tiny-Q8_0.gguf")).unwrap();
    for e in entries().into_iter().filter(|e| e.model == "Q8_0") {
        let a = model
            .forward(&mut model.new_state(), &e.tokens, Mode::Prefill)
            .unwrap()
            .concat();
        let mut st = model.new_state();
        let b: Vec<f32> = e
            .tokens
            .iter()
            .flat_map(|&t| model.forward(&mut st, &[t], Mode::Step).unwrap().concat())
            .collect();
        let err = rel_err(&a, &b);
        println!("{} chunked vs step: {err:.2e}", e.prompt);
        assert!(err <= 1e-5, "{}: chunked vs step {err:.3e}", e.prompt);
    }
}

#[test]
fn snapshot_restore_resumes_exactly() {
    let model = Model::load(reference().join("models/tiny-Q8_0.gguf")).unwrap();
    let e = entries()
        .into_iter()
        .find(|e| e.model == "Q8_0" && e.prompt == "P1")
        .unwrap();
    let (head, tail) = e.tokens.split_at(10);
    let mut state = model.new_state();
    model.forward(&mut state, head, Mode::Prefill).unwrap();
    let snap = state.snapshot();
    let first = model.forward(&mut state, tail, Mode::Step).unwrap();
    // Cannot rewind DeltaNet state by truncation alone.
    assert!(state.truncate(10).is_err());
    state.restore(&snap).unwrap();
    assert_eq!(state.pos, 10);
    let again = model.forward(&mut state, tail, Mode::Step).unwrap();
    assert!(
        first == again,
        "restored state must reproduce the same logits bit for bit"
    );
    state.truncate(0).unwrap();
    assert_eq!(state.pos, 0);
    model.forward(&mut state, head, Mode::Prefill).unwrap();
    let fresh = model.forward(&mut state, tail, Mode::Step).unwrap();
    assert!(
        fresh == first,
        "a reset state must reproduce the same logits bit for bit"
    );
}

#[test]
fn bad_token_id_is_an_error() {
    let model = Model::load(reference().join("models/tiny-Q8_0.gguf")).unwrap();
    let err = model
        .forward(&mut model.new_state(), &[1, 99_999], Mode::Prefill)
        .unwrap_err();
    assert!(err.to_string().contains("99999"), "{err}");
}

#[test]
fn prefill_in_aligned_pieces_is_bit_identical() {
    let model = Model::load(reference().join("models/tiny-Q4_K_M.gguf")).unwrap();
    let e = entries()
        .into_iter()
        .find(|e| e.model == "Q4_K_M" && e.prompt == "P2")
        .unwrap();
    let at_once = model
        .forward(&mut model.new_state(), &e.tokens, Mode::Prefill)
        .unwrap();
    // Pieces split at multiples of the 64-token chunk (including a piece that starts mid-way
    // through nothing but ends on a boundary) reproduce the single pass exactly.
    let mut state = model.new_state();
    let mut pieces = Vec::new();
    for r in [0..64, 64..192, 192..e.tokens.len()] {
        pieces.extend(
            model
                .forward(&mut state, &e.tokens[r], Mode::Prefill)
                .unwrap(),
        );
    }
    assert!(
        pieces == at_once,
        "aligned pieces must equal the single prefill bit for bit"
    );
}

#[test]
fn multi_row_step_is_bit_identical_and_rolls_back_exactly() {
    let model = Model::load(reference().join("models/tiny-IQ2_XXS.gguf")).unwrap();
    let e = entries()
        .into_iter()
        .find(|e| e.model == "IQ2_XXS" && e.prompt == "P1")
        .unwrap();
    let (head, tail) = e.tokens.split_at(12);
    let tail = &tail[..8];
    // One token at a time.
    let mut one = model.new_state();
    model.forward(&mut one, head, Mode::Prefill).unwrap();
    let singles: Vec<Vec<f32>> = tail
        .iter()
        .flat_map(|&t| model.forward(&mut one, &[t], Mode::Step).unwrap())
        .collect();
    // All 8 rows in one stepped pass while recording, then keep 5 and continue.
    let mut multi = model.new_state();
    model.forward(&mut multi, head, Mode::Prefill).unwrap();
    multi.begin_trace();
    let rows = model.forward(&mut multi, tail, Mode::Step).unwrap();
    assert!(
        rows == singles,
        "each row of a multi-row step equals the one-token step bit for bit"
    );
    multi.keep(5).unwrap();
    assert_eq!(multi.pos, 12 + 5);
    let resumed = model.forward(&mut multi, &tail[5..], Mode::Step).unwrap();
    assert!(
        resumed[..] == singles[5..],
        "rolled-back state continues exactly"
    );
    // keep(0) returns to where recording began.
    multi.begin_trace();
    model.forward(&mut multi, &tail[..2], Mode::Step).unwrap();
    multi.keep(0).unwrap();
    assert_eq!(multi.pos, 12 + 8);
}
