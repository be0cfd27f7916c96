//! The GPU expert cache is exact: with the cache at its minimum (one expert per layer), at other
//! bounded sizes and under every policy, `CudaModel`'s logits are bit-identical to full
//! residency, prompt (one forward call) and step (the replayed decode graph) alike: the same
//! kernels read the same bytes, from a device slot or over PCIe from pinned host memory.
//!
//! Needs a GPU: `#[ignore]`d; run on the device with `--ignored` (bench/gpu_cache.sh).
//! Fixtures: `$REDLITE_TEST_MODELS` or `shared/reference/models`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::models;
use redlite_cuda::{
    CudaModel, CudaModelOptions, ExpertCacheSize, ExpertPolicy, ExpertStats, Gpu, GpuSampling,
};

/// A prompt of varied ids, then greedy steps: `(prompt logits, step logits, counters)`.
type Run = (Vec<Vec<f32>>, Vec<Vec<f32>>, ExpertStats);

fn run(gpu: &Arc<Gpu>, name: &str, experts: ExpertCacheSize, policy: ExpertPolicy) -> Run {
    let path = models().join(format!("tiny-{name}.gguf"));
    let opts = CudaModelOptions {
        max_context: 256,
        max_batch: 32,
        graphs: true,
        experts,
        expert_policy: policy,
        max_verify: 0,
        mtp: false,
        kv_type: common::kv_type(),
    };
    let mut m = CudaModel::load(gpu.clone(), &path, opts)
        .unwrap_or_else(|e| panic!("{name} {experts:?}: {e}"));
    let vocab = m.config.vocab as u32;
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let prefill = m.forward_logits(&prompt).expect("forward");
    m.reset().expect("reset");
    let mut steps = Vec::new();
    let mut token = prompt[0];
    for i in 1..=prompt.len() {
        // The prompt's ids first (teacher forcing), then the model's own greedy choices.
        let next = m
            .decode(token, &GpuSampling::greedy(), 0.0)
            .expect("decode");
        steps.push(m.last_logits().expect("logits"));
        token = prompt.get(i).copied().unwrap_or(next);
    }
    for _ in 0..40 {
        token = m
            .decode(token, &GpuSampling::greedy(), 0.0)
            .expect("decode");
        steps.push(m.last_logits().expect("logits"));
    }
    (prefill, steps, m.expert_cache().stats())
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| common::same_bits(x, y))
}

#[test]
#[ignore = "needs a GPU"]
fn bounded_expert_cache_gives_the_logits_of_full_residency() {
    let gpu = Arc::new(Gpu::new(0).expect("a CUDA device"));
    for name in ["Q4_K_M", "IQ2_XXS", "CF2"] {
        let (p_all, s_all, st_all) = run(&gpu, name, ExpertCacheSize::All, ExpertPolicy::Lfu);
        assert_eq!(st_all.misses, 0, "{name}: full residency never misses");
        // Slot bytes of the tiny fixtures are a few KiB: 2 and 3 slots per layer of 4 experts.
        let probe = CudaModel::load(
            gpu.clone(),
            models().join(format!("tiny-{name}.gguf")),
            CudaModelOptions {
                max_context: 8,
                max_batch: 8,
                graphs: false,
                experts: ExpertCacheSize::Min,
                expert_policy: ExpertPolicy::Static,
                max_verify: 0,
                mtp: false,
                kv_type: common::kv_type(),
            },
        )
        .expect("load");
        let slot = probe.expert_cache().slot_stride() as u64;
        let layers = probe.config.n_layers as u64;
        drop(probe);
        let sizes = [
            ExpertCacheSize::Min,
            ExpertCacheSize::Bytes(2 * layers * slot),
            ExpertCacheSize::Bytes(3 * layers * slot),
        ];
        for size in sizes {
            for policy in [ExpertPolicy::Lfu, ExpertPolicy::Lru, ExpertPolicy::Static] {
                let (p, s, st) = run(&gpu, name, size, policy);
                println!(
                    "{name} {size:?} {policy:?}: hit rate {:.3}, {} misses, {} promotions",
                    st.hit_rate(),
                    st.misses,
                    st.promotions
                );
                assert!(
                    st.misses > 0,
                    "{name} {size:?} {policy:?}: a bounded cache misses"
                );
                assert!(
                    same_bits(&p, &p_all),
                    "{name} {size:?} {policy:?}: prompt logits differ from full residency"
                );
                assert!(
                    same_bits(&s, &s_all),
                    "{name} {size:?} {policy:?}: step logits differ from full residency"
                );
                if policy == ExpertPolicy::Lru {
                    assert!(st.promotions > 0, "{name} {size:?}: LRU promotes");
                }
            }
        }
    }
}
