//! The memory planner on the tiny fixtures and on the full-size 80B layout (no file needed).

use redlite_cpu::CpuBackend;
use redlite_engine::planner::{plan, Budget, ExpertCachePlan, PlanInput, PlanRequest, Target};
use redlite_expert_cache::CacheConfig;
use redlite_gguf::{GgmlType, GgufFile};
use redlite_model::layout::{Layout, LayoutParams, LayoutTypes};
use redlite_model::{KvType, Model};

const TINY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/reference/models/tiny-F16.gguf"
);
const TINY_Q4K: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/reference/models/tiny-Q4_K_M.gguf"
);

fn request(memory: Budget, ctx: u64) -> PlanRequest {
    PlanRequest {
        memory,
        ctx,
        target: Target::Cpu,
        kv: KvType::F32,
        ubatch: 64,
    }
}

fn full_size(experts: GgmlType) -> PlanInput {
    let types = LayoutTypes {
        experts,
        ..LayoutTypes::default()
    };
    let layout = Layout::new(LayoutParams::qwen3next_80b_a3b(), types).unwrap();
    PlanInput::from_layout(&layout).unwrap()
}

#[test]
fn tiny_min_plan_is_one_expert_per_block_and_one_byte_less_is_refused() {
    let file = GgufFile::open(TINY).unwrap();
    let input = PlanInput::from_file(&file).unwrap();
    // tiny-F16: hidden 256, expert ff 256, F16 → gate, up, down of one expert = 3 × 256 × 256 × 2.
    assert_eq!(input.expert_bytes(), 3 * 256 * 256 * 2);
    // A slot: each 128 KiB part gets one 4 KiB page of O_DIRECT slack.
    assert_eq!(input.slot_bytes(), 3 * (256 * 256 * 2 + 4096));
    // Four trunk layers plus the MTP block hold experts.
    assert_eq!(input.expert_layers(), 5);
    let all: u64 = file
        .tensors()
        .iter()
        .filter(|t| t.name.contains("_exps"))
        .map(|t| t.n_bytes)
        .sum();
    assert_eq!(input.all_expert_bytes(), all);

    let min = plan(&input, request(Budget::Min, 128)).unwrap();
    assert_eq!(
        min.experts,
        ExpertCachePlan::Slots {
            slots: 5,
            slot_bytes: 405_504,
            layers: 5,
            experts_per_layer: 1
        }
    );
    assert_eq!(min.total_bytes(), min.budget);
    let refused = plan(&input, request(Budget::Bytes(min.budget - 1), 128)).unwrap_err();
    assert_eq!(refused.needed(), min.budget);
    let text = refused.to_string();
    assert!(
        text.contains("does not fit") && text.contains("KV cache"),
        "{text}"
    );

    let all_in = plan(&input, request(Budget::Bytes(1 << 30), 128)).unwrap();
    assert_eq!(all_in.experts, ExpertCachePlan::AllResident { bytes: all });
}

#[test]
fn full_size_16gib_64k_context() {
    let input = full_size(GgmlType::IQ2XXS);
    // IQ2_XXS: 66 bytes per 256 values; gate and up 512 × 2048, down 2048 × 512.
    let expert = 3 * 512 * 2048 / 256 * 66;
    assert_eq!(input.expert_bytes(), expert);
    assert_eq!(input.expert_layers(), 48);
    assert_eq!(input.all_expert_bytes(), 48 * 512 * expert);
    // 12 attention layers × K and V × 2 KV heads × 256 = 12,288 values = 48 KiB in f32.
    assert_eq!(input.kv_bytes_per_position(KvType::F32), 48 << 10);
    assert_eq!(input.kv_bytes_per_position(KvType::F16), 24 << 10);

    let p = plan(&input, request(Budget::Bytes(16 << 30), 65_536)).unwrap();
    let kv = p.rows.iter().find(|r| r.what == "KV cache").unwrap();
    assert_eq!(kv.bytes, 3 << 30);
    let ExpertCachePlan::Slots {
        slots, slot_bytes, ..
    } = p.experts
    else {
        panic!("16 GiB cannot hold 18.6 GiB of experts: {p}");
    };
    // Each part (66 pages) gets one page of O_DIRECT slack.
    assert_eq!(slot_bytes, expert + 3 * 4096);
    assert_eq!(slots, ((16u64 << 30) - p.fixed_bytes()) / slot_bytes);
    assert!(p.total_bytes() <= 16 << 30);

    // A 4 GiB GPU cannot hold 3 GiB of KV plus the dense weights and head.
    let mut cuda = request(Budget::Bytes(4 << 30), 65_536);
    cuda.target = Target::Cuda;
    assert!(plan(&input, cuda).is_err());
}

#[test]
fn full_size_q4k_experts_all_resident_only_with_enough_memory() {
    let input = full_size(GgmlType::Q4K);
    let expert = 3 * 512 * 2048 / 256 * 144;
    assert_eq!(input.expert_bytes(), expert);
    assert_eq!(input.slot_bytes(), expert + 3 * 4096);
    let p = plan(&input, request(Budget::Bytes(20 << 30), 4096)).unwrap();
    assert!(matches!(p.experts, ExpertCachePlan::Slots { .. }));
    let p = plan(&input, request(Budget::Bytes(64 << 30), 4096)).unwrap();
    assert_eq!(
        p.experts,
        ExpertCachePlan::AllResident {
            bytes: 48 * 512 * expert
        }
    );
}

/// Loads `path` on the CPU backend with the expert cache a plan chose; returns the cache's
/// (slots, slot bytes).
fn allocated_slots(path: &str, plan: &redlite_engine::planner::Plan) -> (u64, u64) {
    let config = CacheConfig {
        size: plan.cache_size(),
        ..CacheConfig::default()
    };
    let backend = CpuBackend::with_threads_and_cache(1, config);
    let model = match Model::load_with(path, backend) {
        Ok(m) => m,
        Err(e) => panic!(
            "{path}: the cache refused the plan's {:?}: {e}",
            plan.experts
        ),
    };
    let s = model.backend.expert_cache_stats().unwrap();
    (s.slots, s.slot_bytes)
}

#[test]
fn planned_slots_are_the_slots_the_cpu_cache_allocates() {
    for path in [TINY, TINY_Q4K] {
        let file = GgufFile::open(path).unwrap();
        let input = PlanInput::from_file(&file).unwrap();
        let fixed = plan(&input, request(Budget::Min, 128))
            .unwrap()
            .fixed_bytes();
        let (expert, slot) = (input.expert_bytes(), input.slot_bytes());
        assert!(slot > expert, "{path}: slots carry O_DIRECT slack");
        // Budgets whose remainder is a whole number of experts (where counting experts rather
        // than slots would over-promise), of slots, and in between.
        for remainder in [5 * slot, 12 * expert, 12 * slot + slot / 2, 17 * expert - 1] {
            let p = plan(&input, request(Budget::Bytes(fixed + remainder), 128)).unwrap();
            let ExpertCachePlan::Slots {
                slots, slot_bytes, ..
            } = p.experts
            else {
                panic!("{path}: {remainder} bytes cannot hold every expert: {p}");
            };
            assert_eq!(slots, remainder / slot, "{path}");
            assert_eq!(
                allocated_slots(path, &p),
                (slots, slot_bytes),
                "{path}: {remainder} bytes for experts"
            );
        }
    }
}

#[test]
fn gpu_plan_counts_the_embedding_and_gpu_slots() {
    // Full size, IQ2_XXS experts: gate, up and down are 512 × 2048 values = 270,336 bytes each,
    // already multiples of 256, so a GPU slot is the expert itself (no O_DIRECT slack).
    let input = full_size(GgmlType::IQ2XXS);
    assert_eq!(input.gpu_slot_bytes(), 3 * 270_336);
    assert_eq!(input.slot_bytes_for(Target::Cuda), input.gpu_slot_bytes());
    assert_eq!(input.slot_bytes_for(Target::Cpu), input.slot_bytes());
    let mut req = request(Budget::Bytes(16 << 30), 4096);
    req.target = Target::Cuda;
    let p = plan(&input, req).unwrap();
    let embd = p.rows.iter().find(|r| r.what == "embeddings").unwrap();
    assert_eq!(embd.bytes, input.sizes.token_embd_bytes);
    let ExpertCachePlan::Slots {
        slots, slot_bytes, ..
    } = p.experts
    else {
        panic!("16 GiB cannot hold every expert: {p}");
    };
    assert_eq!(slot_bytes, 3 * 270_336);
    assert_eq!(slots, ((16u64 << 30) - p.fixed_bytes()) / slot_bytes);
    assert!(p.total_bytes() <= 16 << 30);
}
