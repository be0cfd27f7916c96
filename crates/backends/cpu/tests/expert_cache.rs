//! The expert cache changes where expert bytes come from, never the result: logits with the cache
//! at its minimum (one expert per block), at in-between sizes and under every eviction policy are
//! bit-identical to every expert resident (the memory map), for prompt and step-by-step decoding,
//! with cross-layer prefetch on and off.

use redlite_cpu::CpuBackend;
use redlite_expert_cache::{CacheConfig, CacheSize, Policy};
use redlite_model::{Mode, Model};

fn fixture(name: &str) -> String {
    format!(
        "{}/../../../../shared/reference/models/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

const IDS: [u32; 12] = [1, 17, 256, 999, 2048, 31, 7, 4000, 12, 3071, 600, 5];

/// Prompt logits of the first 8 ids, then 4 steps.
fn logits(path: &str, config: CacheConfig) -> (Vec<Vec<f32>>, Model<CpuBackend>) {
    let model = Model::load_with(path, CpuBackend::with_threads_and_cache(0, config)).unwrap();
    let mut state = model.new_state();
    let mut rows = model.forward(&mut state, &IDS[..8], Mode::Prefill).unwrap();
    for &id in &IDS[8..] {
        rows.extend(model.forward(&mut state, &[id], Mode::Step).unwrap());
    }
    (rows, model)
}

/// Bytes of one expert slot of `path`'s cache (from a run at the smallest cache).
fn slot_bytes(path: &str) -> u64 {
    logits(path, bounded(CacheSize::Min, Policy::Lru))
        .1
        .backend
        .expert_cache_stats()
        .unwrap()
        .slot_bytes
}

fn bounded(size: CacheSize, policy: Policy) -> CacheConfig {
    CacheConfig {
        size,
        policy,
        direct_io: true,
        overlap: true,
        prefetch: true,
    }
}

#[test]
fn cached_logits_are_bit_identical_to_full_residency() {
    for name in ["tiny-Q4_K_M.gguf", "tiny-IQ2_XXS.gguf", "tiny-Q8_0.gguf"] {
        let path = fixture(name);
        let (reference, full) = logits(&path, CacheConfig::default());
        let stats = full.backend.expert_cache_stats().unwrap();
        assert_eq!(
            (stats.misses, stats.slots),
            (0, 0),
            "{name}: unbounded reads nothing"
        );

        // Smallest cache: 5 blocks (4 layers + MTP) × 1 slot; then 2 of 4 experts per block.
        let min = logits(&path, bounded(CacheSize::Min, Policy::Lru));
        assert!(
            min.0 == reference,
            "{name}: --expert-cache min changed the logits"
        );
        let s = min.1.backend.expert_cache_stats().unwrap();
        assert_eq!(s.slots, 5, "{name}");
        assert!(s.misses > 0 && s.bytes_read > 0, "{name}: {s:?}");

        let slot = s.slot_bytes;
        for policy in [Policy::Lru, Policy::Lfu, Policy::LayerQuota] {
            let (rows, m) = logits(&path, bounded(CacheSize::Bytes(10 * slot), policy));
            assert!(
                rows == reference,
                "{name}: {policy} cache changed the logits"
            );
            let s = m.backend.expert_cache_stats().unwrap();
            assert_eq!(s.slots, 10, "{name} {policy}");
            assert!(s.hits > 0, "{name} {policy}: {s:?}");
        }
    }
}

#[test]
fn a_cache_below_one_expert_per_block_is_refused_at_load() {
    let path = fixture("tiny-Q4_K_M.gguf");
    let err = Model::load_with(
        &path,
        CpuBackend::with_threads_and_cache(0, bounded(CacheSize::Bytes(4096), Policy::Lru)),
    )
    .err()
    .expect("too small");
    assert!(err.to_string().contains("minimum"), "{err}");
}

#[test]
fn a_prompt_pass_reads_its_experts_through_the_cache() {
    let path = fixture("tiny-Q4_K_M.gguf");
    let backend = CpuBackend::with_threads_and_cache(0, bounded(CacheSize::Min, Policy::Lru));
    let model = Model::load_with(&path, backend).unwrap();
    let mut state = model.new_state();
    model.forward(&mut state, &IDS, Mode::Prefill).unwrap();
    let s = model.backend.expert_cache_stats().unwrap();
    assert!(s.misses > 0 && s.bytes_read > 0, "{s:?}");
}

#[test]
fn prefetching_loads_guesses_and_leaves_the_logits_bit_identical() {
    for name in ["tiny-Q4_K_M.gguf", "tiny-IQ2_XXS.gguf"] {
        let path = fixture(name);
        let (reference, _) = logits(&path, CacheConfig::default());
        let slot = slot_bytes(&path);
        let mut prefetched = 0;
        for slots in [5, 7, 10, 15] {
            for prefetch in [true, false] {
                let config = CacheConfig {
                    prefetch,
                    ..bounded(CacheSize::Bytes(slots * slot), Policy::Lru)
                };
                let (rows, m) = logits(&path, config);
                assert!(
                    rows == reference,
                    "{name}: {slots} slots, prefetch {prefetch} changed the logits"
                );
                let s = m.backend.expert_cache_stats().unwrap();
                assert!(s.prefetch_hits <= s.hits, "{name}: {s:?}");
                if prefetch {
                    prefetched += s.prefetched;
                } else {
                    assert_eq!(s.prefetched, 0, "{name}: prefetch off: {s:?}");
                }
            }
        }
        assert!(prefetched > 0, "{name}: nothing was prefetched");
    }
}

/// A verify-sized step of two tokens (its MoE blocks as (expert, token) pairs, `moe_rows`) reads
/// its experts through the cache in rounds, the shared expert in the first: its logits equal the
/// one-token steps' with every expert resident, at the smallest cache and at 10 slots.
#[test]
fn a_two_row_step_through_the_cache_is_bit_identical() {
    for name in ["tiny-Q4_K_M.gguf", "tiny-IQ2_XXS.gguf", "tiny-Q8_0.gguf"] {
        let path = fixture(name);
        let (reference, _) = logits(&path, CacheConfig::default());
        let slot = slot_bytes(&path);
        for size in [CacheSize::Min, CacheSize::Bytes(10 * slot)] {
            let backend = CpuBackend::with_threads_and_cache(0, bounded(size, Policy::Lru));
            let model = Model::load_with(&path, backend).unwrap();
            let mut state = model.new_state();
            model.forward(&mut state, &IDS[..8], Mode::Prefill).unwrap();
            let rows = model.forward(&mut state, &IDS[8..10], Mode::Step).unwrap();
            assert!(rows[..] == reference[8..10], "{name} {size:?}");
        }
    }
}
