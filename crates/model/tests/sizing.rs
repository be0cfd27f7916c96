//! `redlite_model::sizing` against hand calculations.
//!
//! The expected numbers are worked out here from each tensor's shape and the block sizes of its
//! ggml type (the tensor lists were read with gguf-py's `GGUFReader`), not copied from the code's
//! output. The tiny models: hidden 256, 4 trunk layers (3 DeltaNet + 1 attention) + 1 MTP block,
//! 4 routed experts (top-2) of width 256, shared expert 256, vocab 4160.

use std::path::PathBuf;

use redlite_gguf::{GgmlType, GgufFile, TensorInfo};
use redlite_model::sizing::{
    block_index, is_routed_expert, kv_bytes_per_position, FileSizes, ModelSizes,
};
use redlite_model::{Config, KvType, LayerKind, ModelError};

fn model_path(file: &str) -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference/models"
    ))
    .join(file)
}

fn open(file: &str) -> (GgufFile, Config) {
    let f = GgufFile::open(model_path(file)).expect("open fixture");
    let cfg = Config::from_gguf(&f).expect("config");
    (f, cfg)
}

// Bytes of n elements of each type: elements / block elements × block bytes.
fn f32(n: u64) -> u64 {
    n * 4
}
fn q8_0(n: u64) -> u64 {
    assert_eq!(n % 32, 0);
    n / 32 * 34
}
fn q4_k(n: u64) -> u64 {
    assert_eq!(n % 256, 0);
    n / 256 * 144
}
fn q6_k(n: u64) -> u64 {
    assert_eq!(n % 256, 0);
    n / 256 * 210
}
fn iq2_xxs(n: u64) -> u64 {
    assert_eq!(n % 256, 0);
    n / 256 * 66
}

const H: u64 = 256; // hidden
const VOCAB: u64 = 4160;
const E: u64 = 4; // routed experts
const K: u64 = 2; // experts used per token
const FF: u64 = 256; // expert width
const SFF: u64 = 256; // shared expert width

/// Dense (non-expert) bytes of a tiny DeltaNet layer, tensor by tensor; `q` sizes the 2-D weights.
fn deltanet_dense(q: fn(u64) -> u64) -> u64 {
    [
        q(H * 256),   // attn_gate [256, 256] (z: 4 V heads × 64)
        f32(H),       // attn_norm [256]
        q(H * 512),   // attn_qkv [256, 512] (q 128 | k 128 | v 256)
        q(SFF * H),   // ffn_down_shexp [256, 256]
        f32(H * E),   // ffn_gate_inp [256, 4]
        f32(H),       // ffn_gate_inp_shexp [256]
        q(H * SFF),   // ffn_gate_shexp [256, 256]
        q(H * SFF),   // ffn_up_shexp [256, 256]
        f32(H),       // post_attention_norm [256]
        f32(4),       // ssm_a [4]
        q(H * 8),     // ssm_ba [256, 8]
        f32(4 * 512), // ssm_conv1d [4, 512]
        f32(4),       // ssm_dt.bias [4]
        f32(64),      // ssm_norm [64]
        q(256 * H),   // ssm_out [256, 256]
    ]
    .iter()
    .sum()
}

/// Dense bytes of a tiny full-attention layer (trunk layer 3, or the attention part of the MTP block).
fn attention_dense(q: fn(u64) -> u64) -> u64 {
    [
        q(H * 128), // attn_k [256, 128]
        f32(64),    // attn_k_norm [64]
        f32(H),     // attn_norm [256]
        q(256 * H), // attn_output [256, 256]
        q(H * 512), // attn_q [256, 512] (4 heads × (64 q + 64 gate))
        f32(64),    // attn_q_norm [64]
        q(H * 128), // attn_v [256, 128]
        q(SFF * H), // ffn_down_shexp
        f32(H * E), // ffn_gate_inp [256, 4]
        f32(H),     // ffn_gate_inp_shexp
        q(H * SFF), // ffn_gate_shexp
        q(H * SFF), // ffn_up_shexp
        f32(H),     // post_attention_norm
    ]
    .iter()
    .sum()
}

/// Extra dense tensors of the MTP block (`blk.4.nextn.*`).
fn nextn_extra(q: fn(u64) -> u64) -> u64 {
    q(512 * H) // eh_proj [512, 256]
        + 3 * f32(H) // enorm, hnorm, shared_head_norm
}

/// The three routed-expert tensors of a layer ([256, 256, 4] each): all experts, and the k of E
/// a token reads (each expert is a contiguous quarter of each tensor).
fn experts(q: fn(u64) -> u64) -> (u64, u64) {
    let all = 3 * q(H * FF * E);
    let one_expert = 3 * q(H * FF);
    (all, K * one_expert)
}

struct Expected {
    n_tensors: usize,
    token_embd: u64,
    output: u64,
    embedding_row: u64,
    layer_dense: [u64; 4],
    layer_experts_all: [u64; 4],
    layer_experts_top_k: [u64; 4],
    mtp_dense: u64,
    mtp_experts_all: u64,
    mtp_experts_top_k: u64,
}

fn check(file: &str, want: &Expected) {
    let (f, cfg) = open(file);
    let s = ModelSizes::new(&f, &cfg).expect("sizes");

    assert_eq!(s.file.n_tensors, want.n_tensors);
    assert_eq!(s.token_embd_bytes, want.token_embd);
    assert_eq!(s.output_bytes, Some(want.output));
    assert!(!s.head_is_tied());
    assert_eq!(s.other_global_bytes, f32(H), "output_norm");

    let kinds = [
        LayerKind::DeltaNet,
        LayerKind::DeltaNet,
        LayerKind::DeltaNet,
        LayerKind::Attention,
    ];
    assert_eq!(s.layers.len(), 4);
    for (i, l) in s.layers.iter().enumerate() {
        assert_eq!(l.index, i);
        assert_eq!(l.kind, kinds[i]);
        assert!(!l.is_mtp);
        assert_eq!(l.dense_bytes, want.layer_dense[i], "layer {i} dense");
        assert_eq!(
            l.expert_bytes, want.layer_experts_all[i],
            "layer {i} experts"
        );
        assert_eq!(
            l.top_k_expert_bytes, want.layer_experts_top_k[i],
            "layer {i} top-k experts"
        );
        assert_eq!(l.n_tensors, if i < 3 { 18 } else { 16 });
    }

    // Per decode token: dense trunk + output_norm, top-k experts, head, one embedding row.
    let dense = want.layer_dense.iter().sum::<u64>() + f32(H);
    let top_k = want.layer_experts_top_k.iter().sum::<u64>();
    assert_eq!(s.decode.dense, dense);
    assert_eq!(s.decode.experts, top_k);
    assert_eq!(s.decode.head, want.output);
    assert_eq!(s.decode.embedding_row, want.embedding_row);
    assert_eq!(
        s.decode.total(),
        dense + top_k + want.output + want.embedding_row
    );

    // MTP block (blk.4).
    assert_eq!(s.mtp.len(), 1);
    let m = &s.mtp[0];
    assert_eq!((m.index, m.kind, m.is_mtp), (4, LayerKind::Attention, true));
    assert_eq!(m.n_tensors, 20);
    assert_eq!(m.dense_bytes, want.mtp_dense);
    assert_eq!(m.expert_bytes, want.mtp_experts_all);
    assert_eq!(m.top_k_expert_bytes, want.mtp_experts_top_k);
    assert_eq!(
        s.mtp_per_token_bytes(),
        Some(want.mtp_dense + want.mtp_experts_top_k)
    );

    // Whole-file split: experts = every *_exps tensor, dense = the rest.
    let all_experts = want.layer_experts_all.iter().sum::<u64>() + want.mtp_experts_all;
    let all_dense = want.token_embd
        + want.output
        + f32(H)
        + want.layer_dense.iter().sum::<u64>()
        + want.mtp_dense;
    assert_eq!(s.file.expert_bytes, all_experts);
    assert_eq!(s.file.dense_bytes, all_dense);
    assert_eq!(s.file.tensor_bytes, all_experts + all_dense);
    let by_type_total: u64 = s.file.by_type.iter().map(|t| t.bytes).sum();
    assert_eq!(by_type_total, s.file.tensor_bytes);

    // KV: 1 attention layer × 2 KV heads × 64 × {K, V} = 256 values per position.
    assert_eq!(s.kv_values_per_position, 256);
    assert_eq!(s.kv_bytes_per_position_f32(), 1024);
    assert_eq!(s.kv_bytes_per_position_f16(), 512);
    // Per KV type: f32 4 B, f16 2 B per value, q8_0 34 B per 32 values (256 / 32 × 34 = 272).
    for (t, bytes) in [(KvType::F32, 1024), (KvType::F16, 512), (KvType::Q8_0, 272)] {
        assert_eq!(s.kv_bytes_per_position(t), bytes, "{t}");
        assert_eq!(kv_bytes_per_position(&cfg, t), bytes, "{t}");
        assert_eq!(s.mtp_kv_bytes_per_position(t), bytes, "{t} (MTP)");
    }
    assert_eq!(s.mtp_kv_values_per_position, 256);
    // Recurrent state: 3 DeltaNet layers × (3 conv taps × 512 channels + 4 V heads × 64 × 64).
    assert_eq!(s.recurrent_state_values, 3 * (3 * 512 + 4 * 64 * 64));
    assert_eq!(s.recurrent_state_bytes_f32(), 215_040);
}

#[test]
fn tiny_q8_0_by_hand() {
    let (all, top_k) = experts(q8_0);
    // Spelled out once: a [256, 256, 4] Q8_0 tensor is 262144 / 32 × 34 = 278,528 B; one expert
    // is a quarter, 69,632 B; top-2 of three tensors = 2 × 3 × 69,632 = 417,792 B.
    assert_eq!((all, top_k), (3 * 278_528, 417_792));
    let dn = deltanet_dense(q8_0);
    let at = attention_dense(q8_0);
    assert_eq!(dn, 505_248);
    assert_eq!(at, 495_104);
    check(
        "tiny-Q8_0.gguf",
        &Expected {
            n_tensors: 93,
            token_embd: q8_0(H * VOCAB),
            output: q8_0(H * VOCAB),
            embedding_row: q8_0(H),
            layer_dense: [dn, dn, dn, at],
            layer_experts_all: [all; 4],
            layer_experts_top_k: [top_k; 4],
            mtp_dense: at + nextn_extra(q8_0),
            mtp_experts_all: all,
            mtp_experts_top_k: top_k,
        },
    );
    let (f, cfg) = open("tiny-Q8_0.gguf");
    let s = ModelSizes::new(&f, &cfg).unwrap();
    let types: Vec<_> = s.file.by_type.iter().map(|t| (t.ty, t.count)).collect();
    assert_eq!(types, vec![(GgmlType::F32, 40), (GgmlType::Q8_0, 53)]);
    // Bytes per decode token: 3 × 505,248 + 495,104 + 1,024 dense, 4 × 417,792 experts,
    // 1,131,520 head, 272 embedding row.
    assert_eq!(s.decode.total(), 2_011_872 + 1_671_168 + 1_131_520 + 272);
}

#[test]
fn tiny_cf2_by_hand() {
    // CF2: trunk experts IQ2_XXS, MTP experts Q4_K, other 2-D weights Q4_K, head Q6_K.
    let (all, top_k) = experts(iq2_xxs);
    // [256, 256, 4] IQ2_XXS = 1024 blocks × 66 = 67,584 B; one expert 16,896 B.
    assert_eq!((all, top_k), (3 * 67_584, 2 * 3 * 16_896));
    let (mtp_all, mtp_top_k) = experts(q4_k);
    assert_eq!((mtp_all, mtp_top_k), (3 * 147_456, 2 * 3 * 36_864));
    let dn = deltanet_dense(q4_k);
    let at = attention_dense(q4_k);
    check(
        "tiny-CF2.gguf",
        &Expected {
            n_tensors: 93,
            token_embd: q4_k(H * VOCAB),
            output: q6_k(H * VOCAB),
            embedding_row: q4_k(H),
            layer_dense: [dn, dn, dn, at],
            layer_experts_all: [all; 4],
            layer_experts_top_k: [top_k; 4],
            mtp_dense: at + nextn_extra(q4_k),
            mtp_experts_all: mtp_all,
            mtp_experts_top_k: mtp_top_k,
        },
    );
    let (f, cfg) = open("tiny-CF2.gguf");
    let s = ModelSizes::new(&f, &cfg).unwrap();
    assert_eq!(s.decode.head, 873_600);
    assert_eq!(s.decode.embedding_row, 144);
}

#[test]
fn generic_tallies_of_a_vocab_only_file() {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference/tokenizer/qwen3-vocab.gguf"
    ));
    let f = GgufFile::open(path).unwrap();
    let s = FileSizes::of(&f);
    assert_eq!(
        (s.n_tensors, s.tensor_bytes, s.dense_bytes, s.expert_bytes),
        (0, 0, 0, 0)
    );
    assert!(s.by_type.is_empty());
    // No tensors, so no model config (the vocabulary size comes from token_embd).
    assert!(Config::from_gguf(&f).is_err());
}

#[test]
fn name_helpers() {
    assert!(is_routed_expert("blk.0.ffn_gate_exps.weight"));
    assert!(is_routed_expert("blk.47.ffn_down_exps.weight"));
    assert!(is_routed_expert("blk.1.ffn_gate_up_exps.weight"));
    assert!(!is_routed_expert("blk.0.ffn_gate_shexp.weight"));
    assert!(!is_routed_expert("blk.0.ffn_gate_inp.weight"));
    assert!(!is_routed_expert("token_embd.weight"));
    assert_eq!(block_index("blk.12.attn_q.weight"), Some(12));
    assert_eq!(block_index("blk.4.nextn.eh_proj.weight"), Some(4));
    assert_eq!(block_index("output.weight"), None);
    assert_eq!(block_index("blk.x.attn_q.weight"), None);
}

fn tiny_tensors() -> (Vec<TensorInfo>, Config) {
    let (f, cfg) = open("tiny-CF2.gguf");
    (f.tensors().to_vec(), cfg)
}

#[test]
fn tied_head_falls_back_to_the_embedding() {
    let (mut tensors, cfg) = tiny_tensors();
    tensors.retain(|t| t.name != "output.weight");
    let s = ModelSizes::from_tensors(&tensors, &cfg).unwrap();
    assert!(s.head_is_tied());
    assert_eq!(s.decode.head, q4_k(H * VOCAB));
}

#[test]
fn file_without_mtp_tensors_has_no_mtp_sizes() {
    let (mut tensors, cfg) = tiny_tensors();
    tensors.retain(|t| block_index(&t.name) != Some(4));
    let s = ModelSizes::from_tensors(&tensors, &cfg).unwrap();
    assert!(s.mtp.is_empty());
    assert_eq!(s.mtp_per_token_bytes(), None);
    assert_eq!(s.mtp_kv_values_per_position, 0);
}

#[test]
fn inconsistent_files_are_errors_not_panics() {
    let (tensors, cfg) = tiny_tensors();

    // A block beyond block_count.
    let mut extra = tensors.clone();
    let mut t = extra[3].clone();
    t.name = "blk.9.attn_norm.weight".into();
    extra.push(t);
    let e = ModelSizes::from_tensors(&extra, &cfg).unwrap_err();
    assert!(matches!(e, ModelError::BadConfig(_)), "{e}");

    // An expert tensor whose last dim is not expert_count.
    let mut wrong = tensors.clone();
    let exps = wrong
        .iter_mut()
        .find(|t| t.name == "blk.0.ffn_up_exps.weight")
        .unwrap();
    exps.dims = vec![256, 1024];
    let e = ModelSizes::from_tensors(&wrong, &cfg).unwrap_err();
    assert!(matches!(e, ModelError::Tensor { .. }), "{e}");

    // No token embedding.
    let mut no_embd = tensors.clone();
    no_embd.retain(|t| t.name != "token_embd.weight");
    let e = ModelSizes::from_tensors(&no_embd, &cfg).unwrap_err();
    assert!(matches!(e, ModelError::MissingTensor(_)), "{e}");

    // A config with zero experts must not divide by zero.
    let mut zero = cfg.clone();
    zero.n_experts = 0;
    assert!(ModelSizes::from_tensors(&tensors, &zero).is_err());
}

/// Full-size Qwen3-Next layout (make it with `shared/tools/make_qwen3next_random.py`, ≈20 GB) at
/// REDLITE_FULLSIZE: 843 tensors; the routed experts a token reads at IQ2_XXS are
/// 10 experts × 3 tensors × 2048 × 512 weights × 48 layers at 66 bytes per 256 weights.
#[test]
#[ignore = "needs REDLITE_FULLSIZE=/path/to/full-size.gguf"]
fn full_size_layout() {
    let Some(path) = std::env::var_os("REDLITE_FULLSIZE") else {
        eprintln!("REDLITE_FULLSIZE is not set; skipping");
        return;
    };
    let f = GgufFile::open(&path).expect("open REDLITE_FULLSIZE");
    let cfg = Config::from_gguf(&f).expect("config");
    let s = ModelSizes::new(&f, &cfg).expect("sizes");
    assert_eq!(s.file.n_tensors, 843);
    assert_eq!(s.layers.len(), 48);
    assert_eq!(s.decode.experts, 10 * 3 * 2048 * 512 * 48 * 66 / 256);
    assert_eq!(s.decode.experts, 389_283_840);
    // 12 attention layers × 2 KV heads × 256 × {K, V}.
    assert_eq!(s.kv_bytes_per_position_f32(), 49_152);
    assert_eq!(s.kv_bytes_per_position_f16(), 24_576);
    // q8_0: 12 × 2 × (512 / 32) blocks × 34 bytes.
    assert_eq!(kv_bytes_per_position(&cfg, KvType::Q8_0), 13_056);
    assert_eq!(s.recurrent_state_bytes_f32(), 79_036_416);
}
