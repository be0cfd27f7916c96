//! The CPU backend against the float64 reference: per fixture file, over the stored rows of all
//! its prompts, mean KL(exact ‖ redlite-cpu) ≤ max(1e-5, 2 × llama.cpp's mean KL from exact)
//! (issue 4's acceptance line; llama.cpp's figure is `stats.kl_mean` in logits/index.json,
//! weighted by rows).

use std::collections::BTreeMap;
use std::path::PathBuf;

use redlite_cpu::CpuBackend;
use redlite_model::{Mode, Model};
use serde_json::Value;

fn reference() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../../shared/reference"
    ))
}

fn read_f32(path: &PathBuf) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// KL(p ‖ q) in nats for logits `p_logits`, `q_logits`, computed in f64.
fn kl(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let lse = |x: &[f32]| {
        let m = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        m + x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()
    };
    let (lp, lq) = (lse(p_logits), lse(q_logits));
    p_logits
        .iter()
        .zip(q_logits)
        .map(|(&a, &b)| {
            let lpa = a as f64 - lp;
            lpa.exp() * (lpa - (b as f64 - lq))
        })
        .sum()
}

#[test]
fn cpu_backend_is_at_least_as_close_to_exact_as_llama_cpp() {
    let root = reference();
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("logits/index.json")).unwrap())
            .unwrap();
    // model → (sum of our KL, sum of llama.cpp's KL × rows, rows)
    let mut per_model: BTreeMap<String, (f64, f64, usize)> = BTreeMap::new();
    let backend = CpuBackend::with_threads(0);
    let mut loaded: BTreeMap<String, Model<CpuBackend>> = BTreeMap::new();
    for e in index["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| !e["exact_path"].is_null())
    {
        let name = e["model"].as_str().unwrap().to_string();
        let model = loaded.entry(name.clone()).or_insert_with(|| {
            Model::load_with(
                root.join(e["model_file"].as_str().unwrap()),
                backend.clone(),
            )
            .unwrap()
        });
        let tokens: Vec<u32> = e["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let positions: Vec<usize> = e["positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        let exact = read_f32(&root.join("logits").join(e["exact_path"].as_str().unwrap()));
        let vocab = model.config.vocab;
        let ours = model
            .forward(&mut model.new_state(), &tokens, Mode::Prefill)
            .unwrap();
        let entry = per_model.entry(name).or_default();
        for (i, &p) in positions.iter().enumerate() {
            entry.0 += kl(&exact[i * vocab..(i + 1) * vocab], &ours[p]);
        }
        entry.1 += e["stats"]["kl_mean"].as_f64().unwrap() * positions.len() as f64;
        entry.2 += positions.len();
    }
    let mut failures = Vec::new();
    for (model, (ours, theirs, rows)) in &per_model {
        let (ours, theirs) = (ours / *rows as f64, theirs / *rows as f64);
        let bound = (2.0 * theirs).max(1e-5);
        println!("{model:>10}: mean KL(exact‖cpu) {ours:.3e}   llama.cpp {theirs:.3e}   bound {bound:.3e}");
        if ours > bound {
            failures.push(format!("{model}: {ours:.3e} > {bound:.3e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}
