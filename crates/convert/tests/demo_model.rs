//! The shipped demo model `models/redlite-demo.gguf` against its reference logits
//! (`models/redlite-demo.ref/`: the trained PyTorch model evaluated in f32 on the file's own
//! dequantized weights). The oracle must match every stored trunk and MTP row within
//! max |Δ| ≤ 1e-4 · max |ref|, on both DeltaNet paths (prefill and step).

use std::path::PathBuf;

use redlite_model::{Mode, Model};
use serde_json::Value;

fn models_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models"))
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

#[test]
fn demo_model_matches_pytorch_reference() {
    let dir = models_dir();
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("redlite-demo.ref/ref.json")).unwrap(),
    )
    .unwrap();
    let vocab = meta["vocab"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(dir.join("redlite-demo.ref/logits.bin")).unwrap();
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut rows = all.chunks_exact(vocab);
    let model = Model::load(dir.join("redlite-demo.gguf")).unwrap();
    assert!(model.has_mtp());
    let as_usize = |v: &Value| -> Vec<usize> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect()
    };
    let mut worst = 0f32;
    for p in meta["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = as_usize(&p["ids"]).into_iter().map(|x| x as u32).collect();
        let trunk_rows = as_usize(&p["rows"]);
        let mtp_rows = as_usize(&p["mtp_rows"]);
        let want_trunk: Vec<&[f32]> = trunk_rows.iter().map(|_| rows.next().unwrap()).collect();
        let want_mtp: Vec<&[f32]> = mtp_rows.iter().map(|_| rows.next().unwrap()).collect();
        for mode in [Mode::Prefill, Mode::Step] {
            let mut st = model.new_state();
            let hidden = model.forward_hidden(&mut st, &ids, mode).unwrap();
            let logits = model.lm_head(&hidden);
            for (&t, want) in trunk_rows.iter().zip(&want_trunk) {
                let e = rel_err(&logits[t], want);
                worst = worst.max(e);
                assert!(
                    e <= 1e-4,
                    "{:?} {mode:?} trunk row {t}: rel err {e}",
                    p["text"]
                );
            }
            let n = ids.len();
            let mut ms = model.new_mtp_state();
            let mh = model
                .mtp_hidden(&mut ms, &hidden[..n - 1], &ids[1..], 0)
                .unwrap();
            let mtp_logits = model.lm_head(&mh);
            for (&t, want) in mtp_rows.iter().zip(&want_mtp) {
                let e = rel_err(&mtp_logits[t], want);
                worst = worst.max(e);
                assert!(
                    e <= 1e-4,
                    "{:?} {mode:?} MTP slot {t}: rel err {e}",
                    p["text"]
                );
            }
        }
        let greedy = p["greedy_next"].as_u64().unwrap() as usize;
        let last = want_trunk.last().unwrap();
        let arg = last
            .iter()
            .enumerate()
            .fold(0, |b, (i, &x)| if x > last[b] { i } else { b });
        assert_eq!(arg, greedy);
    }
    assert!(
        rows.next().is_none(),
        "logits.bin has more rows than ref.json lists"
    );
    eprintln!("worst relative error {worst:e}");
}
