//! The fused expert path gives exactly what composing one matvec per product gives.

use std::path::PathBuf;

use redlite_cpu::CpuBackend;
use redlite_model::backend::{swiglu, Backend};
use redlite_model::Model;

#[test]
fn fused_routed_experts_equal_per_product_matvecs_bit_for_bit() {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../../shared/reference/models/tiny-IQ2_XXS.gguf"
    ));
    let model = Model::load_with(path, CpuBackend::with_threads(0)).unwrap();
    let b = &model.backend;
    let x: Vec<f32> = (0..model.config.hidden)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
        .collect();
    for layer in &model.weights.layers {
        let experts = &layer.moe.experts;
        let chosen = [(3usize, 0.625f32), (0, 0.375)];
        let fused = b.routed_experts(experts, &chosen, &x);
        let mut reference = vec![0.0f32; x.len()];
        for &(e, w) in &chosen {
            for (o, v) in reference.iter_mut().zip(swiglu(b, &experts[e], &x)) {
                *o += w * v;
            }
        }
        assert!(fused == reference);
    }
}
