//! Forward passes from several threads at once on one CPU backend (a server's sequences): each
//! gets what it gets alone, and none waits on another for good (the pool's warm-keepers of one
//! pass must not hold a thread another pass needs).

use std::path::PathBuf;
use std::sync::Arc;

use redlite_cpu::CpuBackend;
use redlite_model::{Mode, Model};

fn model() -> Model<CpuBackend> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../../shared/reference/models/tiny-Q4_K_M.gguf"
    ));
    Model::load_with(path, CpuBackend::with_threads(2)).unwrap()
}

/// Logits of `steps` decode steps after a short prompt, starting from token `first`.
fn decode(model: &Model<CpuBackend>, first: u32, steps: usize) -> Vec<Vec<f32>> {
    let mut state = model.new_state();
    model
        .forward(&mut state, &[first, 5, 9], Mode::Prefill)
        .unwrap();
    (0..steps)
        .flat_map(|i| {
            let id = first + 11 * i as u32;
            model.forward(&mut state, &[id], Mode::Step).unwrap()
        })
        .collect()
}

#[test]
fn concurrent_passes_equal_lone_passes() {
    let model = Arc::new(model());
    let alone: Vec<_> = (0..3u32).map(|t| decode(&model, 1 + t, 24)).collect();
    let handles: Vec<_> = (0..3u32)
        .map(|t| {
            let model = model.clone();
            std::thread::spawn(move || decode(&model, 1 + t, 24))
        })
        .collect();
    for (t, h) in handles.into_iter().enumerate() {
        assert!(h.join().unwrap() == alone[t], "thread {t}");
    }
}
