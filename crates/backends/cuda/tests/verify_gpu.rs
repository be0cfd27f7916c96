//! Speculative verify on the GPU is exact: every row of a `CudaModel::verify` pass has the logits
//! of a one-token `decode` step at its position, bit for bit, and `keep` after a rejection leaves
//! the sequence as if only the kept rows had been decoded (the next step's logits compared).
//!
//! Needs a GPU: `#[ignore]`d; run on the device with `--ignored` (bench/gpu_check.sh).
//! Fixtures: `$REDLITE_TEST_MODELS` or `shared/reference/models`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;

use common::{models, same_bits};
use redlite_cuda::{CudaModel, CudaModelOptions, ExpertCacheSize, Gpu, GpuSampling};

fn load(gpu: &Arc<Gpu>, name: &str, experts: ExpertCacheSize) -> CudaModel {
    let opts = CudaModelOptions {
        max_context: 256,
        max_batch: 32,
        graphs: true,
        experts,
        max_verify: 16,
        kv_type: common::kv_type(),
        ..CudaModelOptions::default()
    };
    CudaModel::load(
        gpu.clone(),
        models().join(format!("tiny-{name}.gguf")),
        opts,
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Prompt, then `tokens` decoded one by one: the logits after each.
fn decode_each(m: &mut CudaModel, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    m.reset().expect("reset");
    m.prefill(prompt).expect("prefill");
    tokens
        .iter()
        .map(|&t| {
            m.decode(t, &GpuSampling::greedy(), 0.0).expect("decode");
            m.last_logits().expect("logits")
        })
        .collect()
}

/// Every verify row's logits are the decode step's, bit for bit.
fn assert_rows_are_steps(verified: &[Vec<f32>], stepped: &[Vec<f32>], what: &str) {
    for (i, (v, s)) in verified.iter().zip(stepped).enumerate() {
        assert!(
            same_bits(v, s),
            "{what}: verify row {i} differs from the decode step"
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn verify_rows_are_decode_steps_and_keep_rolls_back_exactly() {
    let gpu = Arc::new(Gpu::new(0).expect("a CUDA device"));
    for name in ["Q4_K_M", "IQ2_XXS", "CF2"] {
        for experts in [ExpertCacheSize::All, ExpertCacheSize::Min] {
            let mut m = load(&gpu, name, experts);
            let vocab = m.config.vocab as u32;
            let prompt: Vec<u32> = (0..37u32).map(|i| (i * 7919 + 13) % vocab).collect();
            // The pending token and 7 drafts, then the token that follows a rejection.
            let rows: Vec<u32> = (0..8u32).map(|i| (i * 104_729 + 5) % vocab).collect();
            let next = (rows[3] + 1) % vocab;
            let stepped = decode_each(&mut m, &prompt, &rows);

            m.reset().expect("reset");
            m.prefill(&prompt).expect("prefill");
            let verified = m.verify(&rows).expect("verify");
            assert_rows_are_steps(&verified, &stepped, &format!("{name} {experts:?}"));
            // Reject after 4 rows: keep 4, then step `next`.
            m.keep(4).expect("keep");
            m.decode(next, &GpuSampling::greedy(), 0.0).expect("decode");
            let after_keep = m.last_logits().expect("logits");
            let mut kept = rows[..4].to_vec();
            kept.push(next);
            let reference = decode_each(&mut m, &prompt, &kept);
            assert!(
                same_bits(&after_keep, reference.last().expect("rows")),
                "{name} {experts:?}: the step after keep(4) differs from never having drafted"
            );
            // Greedy verify: the rows' argmax ids, and keeping every row changes nothing.
            m.reset().expect("reset");
            m.prefill(&prompt).expect("prefill");
            let ids = m.verify_greedy(&rows).expect("verify_greedy");
            let want: Vec<u32> = stepped
                .iter()
                .map(|l| {
                    l.iter()
                        .enumerate()
                        .fold(
                            (0, f32::NEG_INFINITY),
                            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
                        )
                        .0 as u32
                })
                .collect();
            assert_eq!(
                ids, want,
                "{name} {experts:?}: greedy ids of the verify rows"
            );
            m.keep(rows.len()).expect("keep all");
            eprintln!("{name} {experts:?}: 8 verify rows = 8 decode steps; keep(4) exact");
        }
    }
}

/// Verify passes replayed from their captured graph (a row count's third pass on) keep the
/// decode steps' logits bit for bit, and a row drawn by `sample_row` after `verify_on_device` is
/// the token `decode` draws at that step with the same uniform (sampled speculative decoding
/// emits plain generation's tokens).
#[test]
#[ignore = "needs a GPU"]
fn verify_graphs_and_sampled_rows_match_decode_steps() {
    let gpu = Arc::new(Gpu::new(0).expect("a CUDA device"));
    let sampling = GpuSampling {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.0,
    };
    for name in ["Q4_K_M", "IQ2_XXS", "CF2"] {
        let mut m = load(&gpu, name, ExpertCacheSize::All);
        let vocab = m.config.vocab as u32;
        let prompt: Vec<u32> = (0..29u32).map(|i| (i * 6007 + 3) % vocab).collect();
        let rows: Vec<u32> = (0..5u32).map(|i| (i * 104_729 + 11) % vocab).collect();
        let stepped = decode_each(&mut m, &prompt, &rows);
        for pass in 0..4 {
            m.reset().expect("reset");
            m.prefill(&prompt).expect("prefill");
            let verified = m.verify(&rows).expect("verify");
            assert_rows_are_steps(&verified, &stepped, &format!("{name}, verify pass {pass}"));
        }
        let us: Vec<f32> = (0..rows.len())
            .map(|i| (i as f32 * 0.37 + 0.05) % 1.0)
            .collect();
        m.reset().expect("reset");
        m.prefill(&prompt).expect("prefill");
        let drawn: Vec<u32> = rows
            .iter()
            .zip(&us)
            .map(|(&t, &u)| m.decode(t, &sampling, u).expect("decode"))
            .collect();
        for pass in 0..4 {
            m.reset().expect("reset");
            m.prefill(&prompt).expect("prefill");
            m.verify_on_device(&rows).expect("verify_on_device");
            for (i, (&u, &want)) in us.iter().zip(&drawn).enumerate() {
                let got = m.sample_row(i, &sampling, u).expect("sample_row");
                assert_eq!(got, want, "{name}: pass {pass}, row {i} drew another token");
            }
            let row = m.row_logits(2).expect("row_logits");
            assert!(same_bits(&row, &stepped[2]), "{name}: row_logits(2)");
        }
        eprintln!("{name}: verify graphs = decode steps; sampled rows = decode draws");
    }
}

/// Graph captures while another thread loads, runs and drops models on the same GPU (what
/// `mtp_gpu`'s parallel tests do, where a capture once came back invalidated: `CudaModel::capture`
/// then captures again, at worst runs those launches without a graph). Every step's logits must be
/// the undisturbed run's, bit for bit, on both threads, and no call may fail. (Session 50: in nine
/// runs on H100s no capture here was invalidated; it checks the two threads' results, and prints
/// the count.)
#[test]
#[ignore = "needs a GPU"]
fn captures_survive_another_threads_models() {
    let gpu = Arc::new(Gpu::new(0).expect("a CUDA device"));
    let prompt: Vec<u32> = (0..12u32).map(|i| (i * 131 + 7) % 200).collect();
    let tokens = [17u32, 301, 5, 88];
    // Per thread: load a fresh model (its step graph is captured at its first decode), decode,
    // compare, drop; `rounds` times, with `own_gpu` each round on a `Gpu` of its own (its module
    // loaded and unloaded, as each `mtp_gpu` test does). Returns the captures invalidated.
    let run = |gpu: Arc<Gpu>, name: &'static str, rounds: usize, own_gpu: bool| {
        let (prompt, tokens) = (prompt.clone(), tokens);
        move || {
            let want = decode_each(
                &mut load(&gpu, name, ExpertCacheSize::All),
                &prompt,
                &tokens,
            );
            let mut invalidated = 0;
            for round in 0..rounds {
                let gpu = if own_gpu {
                    Arc::new(Gpu::new(0).expect("a CUDA device"))
                } else {
                    gpu.clone()
                };
                let mut m = load(&gpu, name, ExpertCacheSize::All);
                let got = decode_each(&mut m, &prompt, &tokens);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(same_bits(g, w), "{name}, round {round}: step {i} differs");
                }
                invalidated += m.captures_invalidated();
            }
            invalidated
        }
    };
    let other = std::thread::spawn(run(gpu.clone(), "IQ2_XXS", 40, true));
    let here = run(gpu.clone(), "CF2", 40, false)();
    let there = other.join().expect("the other thread");
    eprintln!(
        "2 × 40 models loaded, captured, run and dropped on two threads, one with a Gpu a model \
         ({here} + {there} captures invalidated and tried again): logits unchanged"
    );
}
