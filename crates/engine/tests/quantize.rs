//! `redlite quantize` against the reference files made by llama-quantize.
//!
//! CF2 acceptance: quantizing `tiny-F16.gguf` with the `cf2` recipe and the reference imatrix
//! (`tiny.imatrix.gguf`, llama-imatrix's output) gives the type of `tiny-CF2.gguf` on every
//! tensor, and on prompts P1–P3 its oracle logits are within 1.5× of `tiny-CF2.gguf`'s mean KL
//! from the F16 file's exact (float64) logits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use redlite_engine::imatrix::Imatrix;
use redlite_engine::parity::{kl_divergence, rows_from_le_bytes};
use redlite_engine::quantize::{plan, quantize_file, QuantizeError, QuantizeOptions, Recipe};
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::{Mode, Model};

fn reference() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/reference")
}

fn model_path(name: &str) -> PathBuf {
    reference().join("models").join(name)
}

fn types_of(path: &Path) -> BTreeMap<String, GgmlType> {
    let f = GgufFile::open(path).unwrap();
    f.tensors().iter().map(|t| (t.name.clone(), t.ty)).collect()
}

/// One reference prompt: its ids, the stored positions and the exact F16 logits at them.
type Prompt = (Vec<u32>, Vec<usize>, Vec<Vec<f32>>);

/// Every stored row of P1–P3.
fn prompts() -> Vec<Prompt> {
    let text = std::fs::read_to_string(reference().join("logits/prompts.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    ["P1", "P2", "P3"]
        .iter()
        .map(|p| {
            let ids: Vec<u32> = json[p]["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let positions: Vec<usize> = json[p]["positions"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let bytes =
                std::fs::read(reference().join(format!("logits/F16__{p}__exact.bin"))).unwrap();
            let rows = rows_from_le_bytes(&bytes, 4160).unwrap();
            assert_eq!(rows.len(), positions.len());
            (ids, positions, rows)
        })
        .collect()
}

/// Mean KL(exact F16 ‖ oracle(file)) over every stored row of P1–P3.
fn mean_kl_from_f16_exact(path: &Path) -> f64 {
    let model = Model::load(path).unwrap();
    let (mut sum, mut n) = (0.0, 0usize);
    for (ids, positions, exact) in prompts() {
        let mut state = model.new_state();
        let logits = model.forward(&mut state, &ids, Mode::Prefill).unwrap();
        for (&pos, want) in positions.iter().zip(&exact) {
            sum += kl_divergence(want, &logits[pos]);
            n += 1;
        }
    }
    sum / n as f64
}

#[test]
fn cf2_recipe_matches_llama_quantize_types_and_quality() {
    let imatrix = Imatrix::load(model_path("tiny.imatrix.gguf")).unwrap();
    let dir = std::env::temp_dir().join(format!("redlite-quantize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("tiny-CF2-redlite.gguf");
    let opts = QuantizeOptions {
        recipe: Recipe::Cf2,
        imatrix: Some(&imatrix),
        imatrix_path: Some("tiny.imatrix.gguf".into()),
        threads: 0,
        allow_requantize: false,
    };
    let report = quantize_file(&model_path("tiny-F16.gguf"), &out, &opts, |_, _| {}).unwrap();

    // The type of every tensor, as llama-quantize chose it.
    let ours = types_of(&out);
    let theirs = types_of(&model_path("tiny-CF2.gguf"));
    assert_eq!(ours, theirs, "tensor types differ from tiny-CF2.gguf");
    // Only the MTP block's experts fell back (no imatrix data for blk.4).
    for c in report.tensors.iter().filter(|c| c.note.is_some()) {
        assert!(c.name.starts_with("blk.4."), "{}: {:?}", c.name, c.note);
    }
    let f = GgufFile::open(&out).unwrap();
    let llama = GgufFile::open(model_path("tiny-CF2.gguf")).unwrap();
    // Our quantizers are bit-exact with ggml's, so every tensor is llama-quantize's byte for byte.
    for t in f.tensors() {
        assert!(
            f.tensor_data(t) == llama.tensor_bytes(&t.name).unwrap(),
            "{} ({}) differs from tiny-CF2.gguf",
            t.name,
            t.ty
        );
    }
    // Metadata: the same keys in the same order, equal values except the imatrix path.
    let keys = |g: &GgufFile| {
        g.metadata()
            .iter()
            .map(|(k, _)| k.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&f), keys(&llama));
    for (k, v) in f.metadata() {
        if k != "quantize.imatrix.file" {
            assert_eq!(Some(v), llama.get(k), "metadata {k}");
        }
    }
    assert_eq!(f.get_u32("general.file_type").unwrap(), 14);
    assert_eq!(f.get_u32("quantize.imatrix.chunks_count").unwrap(), 124);

    // Quality: mean KL from the F16 file's exact logits, ours vs llama-quantize's.
    let kl_ours = mean_kl_from_f16_exact(&out);
    let kl_llama = mean_kl_from_f16_exact(&model_path("tiny-CF2.gguf"));
    eprintln!("mean KL from F16 exact on P1-P3: redlite cf2 {kl_ours:.6}, tiny-CF2.gguf {kl_llama:.6} (ratio {:.3})", kl_ours / kl_llama);
    assert!(
        kl_ours <= 1.5 * kl_llama,
        "redlite cf2 KL {kl_ours} > 1.5 × llama-quantize's {kl_llama}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn q4_k_m_recipe_matches_llama_quantize_types() {
    let file = GgufFile::open(model_path("tiny-F16.gguf")).unwrap();
    let imatrix = Imatrix::load(model_path("tiny.imatrix.gguf")).unwrap();
    let choices = plan(&file, Recipe::Q4KM, Some(&imatrix), false).unwrap();
    let ours: BTreeMap<String, GgmlType> = choices.iter().map(|c| (c.name.clone(), c.to)).collect();
    assert_eq!(ours, types_of(&model_path("tiny-Q4_K_M.gguf")));
}

#[test]
fn clear_errors() {
    let file = GgufFile::open(model_path("tiny-F16.gguf")).unwrap();
    assert!(matches!(
        plan(&file, Recipe::Cf2, None, false),
        Err(QuantizeError::NeedsImatrix { .. })
    ));
    assert!(matches!(
        plan(&file, Recipe::Whole(GgmlType::IQ2XXS), None, false),
        Err(QuantizeError::NeedsImatrix { .. })
    ));
    // The imatrix file has no architecture.
    let not_model = GgufFile::open(model_path("tiny.imatrix.gguf")).unwrap();
    assert!(matches!(
        plan(&not_model, Recipe::Cf2, None, false),
        Err(QuantizeError::NotQwen3Next(_))
    ));
    // Already quantized input.
    let q8 = GgufFile::open(model_path("tiny-Q8_0.gguf")).unwrap();
    assert!(matches!(
        plan(&q8, Recipe::Whole(GgmlType::Q4K), None, false),
        Err(QuantizeError::Requantize { .. })
    ));
    assert!(matches!(
        Recipe::named("q2_k_xl"),
        Err(QuantizeError::UnknownRecipe(_))
    ));
}
