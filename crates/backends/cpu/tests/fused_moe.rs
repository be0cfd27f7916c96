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

#[test]
fn cpu_delta_rule_equals_the_oracle_bit_for_bit() {
    use redlite_model::delta_rule::{delta_rule_heads, DeltaRule, HeadInputs};
    let (nv, dk, dv, n) = (4, 64, 48, 70);
    let mut seed = 7u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    let q: Vec<f32> = (0..nv * n * dk).map(|_| next() * 0.2).collect();
    let k: Vec<f32> = (0..nv * n * dk).map(|_| next() * 0.2).collect();
    let v: Vec<f32> = (0..nv * n * dv).map(|_| next()).collect();
    let beta: Vec<f32> = (0..nv * n).map(|_| next() + 0.5).collect();
    let g: Vec<f32> = (0..nv * n).map(|_| -next().abs()).collect();
    let heads: Vec<HeadInputs> = (0..nv)
        .map(|h| HeadInputs {
            q: &q[h * n * dk..(h + 1) * n * dk],
            k: &k[h * n * dk..(h + 1) * n * dk],
            v: &v[h * n * dv..(h + 1) * n * dv],
            beta: &beta[h * n..(h + 1) * n],
            g: &g[h * n..(h + 1) * n],
            dk,
            dv,
        })
        .collect();
    let s0: Vec<f32> = (0..nv * dk * dv).map(|_| next() * 0.1).collect();
    let b = CpuBackend::with_threads(0);
    for rule in [DeltaRule::Step, DeltaRule::Chunked { pos0: 5 }] {
        let (mut s1, mut s2) = (s0.clone(), s0.clone());
        let oracle = delta_rule_heads(&heads, &mut s1, rule, None);
        let cpu = b.delta_rule(&heads, &mut s2, rule, None);
        assert!(oracle == cpu && s1 == s2, "{rule:?}");
        // Keeping the starting state (a verify's checkpoint) changes nothing else.
        let (mut s3, mut kept) = (s0.clone(), vec![0.0f32; s0.len()]);
        let cpu = b.delta_rule_keeping_initial(&heads, &mut s3, &mut kept, rule);
        assert!(oracle == cpu && s1 == s3 && kept == s0, "{rule:?} keeping");
    }
    // One row (the heads on the calling thread or the warm team, not rayon): the same.
    let one: Vec<HeadInputs> = heads
        .iter()
        .map(|h| HeadInputs {
            q: &h.q[..dk],
            k: &h.k[..dk],
            v: &h.v[..dv],
            beta: &h.beta[..1],
            g: &h.g[..1],
            dk,
            dv,
        })
        .collect();
    let (mut s1, mut s3, mut kept) = (s0.clone(), s0.clone(), vec![0.0f32; s0.len()]);
    let oracle = delta_rule_heads(&one, &mut s1, DeltaRule::Step, None);
    let cpu = b.delta_rule_keeping_initial(&one, &mut s3, &mut kept, DeltaRule::Step);
    assert!(oracle == cpu && s1 == s3 && kept == s0, "one row keeping");
}

/// A reference fixture on the CPU backend.
fn fixture_model(file: &str) -> Model<CpuBackend> {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../../shared/reference/models/"
    ))
    .join(file);
    Model::load_with(path, CpuBackend::with_threads(0)).unwrap()
}

/// `n` deterministic activation rows of `h` values (`salt` varies them between tests).
fn activation_rows(n: usize, h: usize, salt: usize) -> Vec<Vec<f32>> {
    (0..n)
        .map(|t| {
            (0..h)
                .map(|i| (((i + salt * t) * 37 % 101) as f32 - 50.0) / 40.0)
                .collect()
        })
        .collect()
}

#[test]
fn batched_routed_experts_equal_per_token_bit_for_bit() {
    let model = fixture_model("tiny-Q4_K_M.gguf");
    let b = &model.backend;
    let xs = activation_rows(5, model.config.hidden, 7);
    let chosen: Vec<Vec<(usize, f32)>> = vec![
        vec![(0, 0.5), (1, 0.5)],
        vec![(3, 0.9), (0, 0.1)],
        vec![(1, 0.3), (2, 0.7)],
        vec![(2, 0.6), (3, 0.4)],
        vec![(0, 0.2), (3, 0.8)],
    ];
    let experts = &model.weights.layers[0].moe.experts;
    let batched = b.routed_experts_rows(experts, &chosen, &xs);
    for ((x, c), got) in xs.iter().zip(&chosen).zip(&batched) {
        assert!(*got == b.routed_experts(experts, c, x));
    }
}

/// A short run's whole MoE block computed by the backend (`moe_rows`: as (expert, token) pairs
/// when the experts average at most two tokens, through the Q8_0 tiles on a small model) gives
/// every row exactly what the one-token path (`moe_token`) gives it: IQ2_XXS and Q4_K_M experts
/// (pairs), Q8_0 experts (tiles), the shared expert alongside.
#[test]
fn moe_rows_equal_moe_token_bit_for_bit() {
    for file in ["tiny-IQ2_XXS.gguf", "tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"] {
        let model = fixture_model(file);
        let b = &model.backend;
        let xs = activation_rows(3, model.config.hidden, 11);
        // 6 pairs over 4 experts: pairs.
        let chosen: Vec<Vec<(usize, f32)>> = vec![
            vec![(0, 0.5), (1, 0.5)],
            vec![(3, 0.9), (0, 0.1)],
            vec![(1, 0.3), (2, 0.7)],
        ];
        for layer in &model.weights.layers {
            let moe = &layer.moe;
            let rows = b
                .moe_rows(&moe.experts, &chosen, &moe.shared, &moe.shared_gate, &xs)
                .expect("few tokens an expert: pairs");
            for ((x, c), got) in xs.iter().zip(&chosen).zip(&rows) {
                let want = b.moe_token(&moe.experts, c, &moe.shared, &moe.shared_gate, x);
                assert!(*got == want, "{file}");
            }
        }
        // 8 pairs over 2 experts: left to the grouped products, except on Q8_0 tiles (every
        // short run, four tokens through each expert's tiles together).
        let many = vec![vec![(0, 0.5), (1, 0.5)]; 4];
        let moe = &model.weights.layers[0].moe;
        let xs4 = [xs.clone(), vec![xs[0].clone()]].concat();
        let rows = b.moe_rows(&moe.experts, &many, &moe.shared, &moe.shared_gate, &xs4);
        assert_eq!(rows.is_some(), file == "tiny-Q8_0.gguf", "{file}");
        for ((x, c), got) in xs4.iter().zip(&many).zip(rows.iter().flatten()) {
            let want = b.moe_token(&moe.experts, c, &moe.shared, &moe.shared_gate, x);
            assert!(*got == want, "{file}: four tokens an expert");
        }
    }
}
