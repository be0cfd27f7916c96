//! Speculative decoding is exact: with prompt lookup, MTP or both, every generated token is
//! sampled from logits bit-identical to plain one-token decoding, the tokens are the same (greedy
//! and seeded sampling), and after rejections the sequence state equals that of a run that never
//! drafted. Also the shortcuts of these paths: the MTP catch-up (cache rows only for all slots
//! but the last) and the prompt's last-row forward (`Model::forward_last`).

use std::path::PathBuf;
use std::sync::Arc;

use redlite_engine::sampler::{argmax, Sampler, SamplerConfig};
use redlite_engine::spec_bench;
use redlite_engine::speculative::{
    generate_speculative, generate_speculative_observed, SpecConfig, SpecMode, SpecStats,
};
use redlite_engine::{generate, load_model_from, with_model, BackendChoice, GenerateOptions};
use redlite_gguf::GgufFile;
use redlite_model::state::LayerState;
use redlite_model::{Backend, Mode, Model, SequenceState};
use redlite_tokenizer::tokenizer::Tokenizer;

fn reference() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/reference"
    ))
}

const MODES: [SpecMode; 3] = [SpecMode::Lookup, SpecMode::Mtp, SpecMode::Both];

/// A prompt built to trigger long lookups: the file-rewrite benchmark's request to copy a
/// source file back with a small edit (the file: 20 lines of held-out Python).
fn rewrite_prompt(tokenizer: &Tokenizer) -> Vec<u32> {
    let text = std::fs::read_to_string(reference().join("logits/heldout.txt")).unwrap();
    let file: String = text
        .lines()
        .skip(27)
        .take(20)
        .collect::<Vec<_>>()
        .join("\n");
    let prompt = spec_bench::rewrite_prompt(&file, "Add a comment line at the top.");
    tokenizer.encode(&prompt, false).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Plain decoding, one token per step, as `redlite_engine::generate` does; returns the tokens,
/// the logits each was chosen from, and the final state (the last token not fed).
fn plain<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>, SequenceState) {
    let mut state = model.new_state();
    let mut logits = model
        .forward(&mut state, prompt, Mode::Prefill)
        .unwrap()
        .pop()
        .unwrap();
    let mut tokens = Vec::new();
    let mut seen = Vec::new();
    loop {
        let t = argmax(&logits).unwrap();
        seen.push(logits.clone());
        tokens.push(t);
        if tokens.len() == n {
            break;
        }
        logits = model
            .forward(&mut state, &[t], Mode::Step)
            .unwrap()
            .pop()
            .unwrap();
    }
    (tokens, seen, state)
}

/// Two sequence states hold the same tokens with bit-identical KV caches and recurrent states.
fn assert_same_state(a: &SequenceState, b: &SequenceState, what: &str) {
    assert_eq!(a.pos, b.pos, "{what}: position");
    for (i, (la, lb)) in a.layers.iter().zip(&b.layers).enumerate() {
        match (la, lb) {
            (LayerState::Attention(x), LayerState::Attention(y)) => {
                assert!(
                    x.keys().to_le_bytes() == y.keys().to_le_bytes(),
                    "{what}: layer {i} keys differ"
                );
                assert!(
                    x.values().to_le_bytes() == y.values().to_le_bytes(),
                    "{what}: layer {i} values differ"
                );
            }
            (LayerState::DeltaNet(x), LayerState::DeltaNet(y)) => {
                assert!(
                    bits(&x.conv) == bits(&y.conv),
                    "{what}: layer {i} conv differs"
                );
                assert!(
                    bits(&x.s) == bits(&y.s),
                    "{what}: layer {i} delta state differs"
                );
            }
            _ => panic!("{what}: layer {i} kinds differ"),
        }
    }
}

fn greedy_opts(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: n,
        stop_ids: Vec::new(),
    }
}

/// The configuration of `mode` with MTP drafting whenever lookup has no draft: these tests
/// check the drafting path and count drafts, which the MTP gate's timing would otherwise decide
/// (`mtp_gate_keeps_the_output` runs the gate).
fn spec(mode: SpecMode) -> SpecConfig {
    SpecConfig {
        mtp_gate: false,
        ..SpecConfig::with_mode(mode)
    }
}

/// Greedy speculative decoding of `n` tokens with `cfg` from an empty sequence: the tokens, the
/// bits of every logits row sampled from, the statistics and the final state.
fn greedy_observed<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    n: usize,
    cfg: &SpecConfig,
) -> (Vec<u32>, Vec<Vec<u32>>, SpecStats, SequenceState) {
    let mut state = model.new_state();
    let mut seen = Vec::new();
    let (got, _, stats) = generate_speculative_observed(
        model,
        &mut state,
        prompt,
        &mut Sampler::new(SamplerConfig::greedy()),
        &greedy_opts(n),
        cfg,
        |_| true,
        |l| seen.push(bits(l)),
    )
    .unwrap();
    (got, seen, stats, state)
}

/// Greedy speculative decoding against plain decoding on one model, every mode.
fn check_greedy_identity<B: Backend>(model: &Model<B>, prompt: &[u32], n: usize, label: &str) {
    let (want, want_logits, want_state) = plain(model, prompt, n);
    for mode in MODES {
        let what = format!("{label} {mode:?}");
        let (got, seen, stats, state) = greedy_observed(model, prompt, n, &spec(mode));
        assert_eq!(got, want, "{what}: tokens");
        assert_eq!(seen.len(), want_logits.len(), "{what}: logits rows");
        for (i, (s, w)) in seen.iter().zip(&want_logits).enumerate() {
            assert!(
                *s == bits(w),
                "{what}: logits of token {i} are not bit-identical"
            );
        }
        assert_same_state(&state, &want_state, &what);
        eprintln!("{what}: {}", stats.summary());
        let drafted = stats.total().drafted;
        assert!(drafted > 0, "{what}: nothing was drafted");
        assert!(
            stats.forward_passes < n,
            "{what}: speculation saved no forward pass"
        );
    }
}

fn load(name: &str, backend: BackendChoice) -> (redlite_engine::AnyModel, Tokenizer) {
    let file = Arc::new(GgufFile::open(reference().join("models").join(name)).unwrap());
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    (load_model_from(file, backend, 2).unwrap(), tokenizer)
}

#[test]
fn greedy_identical_on_mtp_fixtures_oracle() {
    for name in ["tiny-F16.gguf", "tiny-Q8_0.gguf"] {
        let (model, tok) = load(name, BackendChoice::Oracle);
        let prompt = rewrite_prompt(&tok);
        with_model!(&model, m => {
            assert!(m.has_mtp(), "{name} has an MTP block");
            check_greedy_identity(m, &prompt, 40, &format!("{name} oracle"))
        });
    }
}

#[test]
fn greedy_identical_on_every_fixture_cpu() {
    // Every fixture has an MTP block (reference README: `blk.4.nextn.*`).
    for name in [
        "tiny-F16.gguf",
        "tiny-Q8_0.gguf",
        "tiny-Q6_K.gguf",
        "tiny-Q4_K_M.gguf",
        "tiny-IQ4_XS.gguf",
        "tiny-IQ3_XXS.gguf",
        "tiny-IQ2_XXS.gguf",
        "tiny-IQ1_M.gguf",
        "tiny-CF2.gguf",
        "tiny-LEGACY_CF2.gguf",
    ] {
        let (model, tok) = load(name, BackendChoice::Cpu);
        let prompt = rewrite_prompt(&tok);
        with_model!(&model, m => check_greedy_identity(m, &prompt, 40, &format!("{name} cpu")));
    }
}

/// With the MTP gate on (the default), whichever passes it leaves without drafts, the tokens and
/// every logits row are plain decoding's (greedy).
#[test]
fn mtp_gate_keeps_the_output() {
    let (model, tok) = load("tiny-Q8_0.gguf", BackendChoice::Cpu);
    let prompt = rewrite_prompt(&tok);
    with_model!(&model, m => {
        let (want, want_logits, _) = plain(m, &prompt, 40);
        for mode in [SpecMode::Mtp, SpecMode::Both] {
            let mut seen = Vec::new();
            let (got, _, stats) = generate_speculative_observed(
                m,
                &mut m.new_state(),
                &prompt,
                &mut Sampler::new(SamplerConfig::greedy()),
                &greedy_opts(40),
                &SpecConfig::with_mode(mode),
                |_| true,
                |l| seen.push(bits(l)),
            )
            .unwrap();
            assert_eq!(got, want, "{mode:?}: {}", stats.summary());
            assert!(seen == want_logits.iter().map(|l| bits(l)).collect::<Vec<_>>(), "{mode:?}: logits");
            // The gate drafts through its warm-up at least.
            assert!(stats.mtp.drafted > 0 || stats.lookup.drafted > 0, "{mode:?}: {}", stats.summary());
        }
    });
}

/// Short and unrepetitive prompts: few or no lookups; MTP still drafts every step.
#[test]
fn greedy_identical_on_a_short_prompt() {
    let (model, tok) = load("tiny-Q8_0.gguf", BackendChoice::Cpu);
    let prompt = tok.encode("def main():\n", false).unwrap();
    with_model!(&model, m => {
        let (want, _, _) = plain(m, &prompt, 24);
        for mode in MODES {
            let (got, _, _) = generate_speculative(
                m,
                &mut m.new_state(),
                &prompt,
                &mut Sampler::new(SamplerConfig::greedy()),
                &greedy_opts(24),
                &spec(mode),
                |_| true,
            )
            .unwrap();
            assert_eq!(got, want, "{mode:?}");
        }
    });
}

/// With sampling, the acceptance rule draws from the target with the ordinary sampler, so a
/// seeded run gives exactly the tokens of plain `generate`.
#[test]
fn sampling_matches_plain_generate_for_a_seed() {
    let (model, tok) = load("tiny-F16.gguf", BackendChoice::Cpu);
    let prompt = rewrite_prompt(&tok);
    let cfg = SamplerConfig {
        temperature: 0.7,
        top_k: 40,
        top_p: 0.95,
        repeat_penalty: 1.05,
        seed: 7,
        ..Default::default()
    };
    let opts = GenerateOptions {
        max_tokens: 48,
        stop_ids: tok.stop_token_ids().to_vec(),
    };
    with_model!(&model, m => {
        let (want, _) = generate(m, &mut m.new_state(), &prompt, &mut Sampler::new(cfg.clone()), &opts, |_| true).unwrap();
        for mode in MODES {
            let (got, _, stats) = generate_speculative(
                m,
                &mut m.new_state(),
                &prompt,
                &mut Sampler::new(cfg.clone()),
                &opts,
                &spec(mode),
                |_| true,
            )
            .unwrap();
            assert_eq!(got, want, "{mode:?}: {}", stats.summary());
        }
    });
}

/// The callback can stop generation in the middle of an accepted draft; the state then holds
/// exactly what plain decoding would hold (the last emitted token not fed).
#[test]
fn early_stop_inside_a_draft_leaves_the_plain_state() {
    let (model, tok) = load("tiny-F16.gguf", BackendChoice::Cpu);
    let prompt = rewrite_prompt(&tok);
    with_model!(&model, m => {
        for stop_after in [5usize, 13, 22] {
            let (want, _, want_state) = plain(m, &prompt, stop_after);
            let mut state = m.new_state();
            let mut count = 0;
            let (got, _, _) = generate_speculative(
                m,
                &mut state,
                &prompt,
                &mut Sampler::new(SamplerConfig::greedy()),
                &greedy_opts(100),
                &spec(SpecMode::Both),
                |_| {
                    count += 1;
                    count < stop_after
                },
            )
            .unwrap();
            assert_eq!(got, want);
            assert_same_state(&state, &want_state, &format!("stop after {stop_after}"));
        }
    });
}

/// A draft rejected in the middle: verify `[x, good, bad, bad, bad]`, keep the first two rows,
/// and the state is bit-identical to a run that stepped `x, good` one at a time; so are the
/// logits of every later step.
#[test]
fn rejection_mid_draft_rolls_back_exactly() {
    for backend in [BackendChoice::Oracle, BackendChoice::Cpu] {
        let (model, tok) = load("tiny-Q8_0.gguf", backend);
        let prompt = rewrite_prompt(&tok);
        with_model!(&model, m => {
            let (want, want_logits, _) = plain(m, &prompt, 8);
            // Reference: prompt, then x = want[0], good = want[1] one at a time, then the rest.
            let mut plain_state = m.new_state();
            m.forward(&mut plain_state, &prompt, Mode::Prefill).unwrap();
            m.forward(&mut plain_state, &want[..1], Mode::Step).unwrap();
            m.forward(&mut plain_state, &want[1..2], Mode::Step).unwrap();

            let mut spec = m.new_state();
            m.forward(&mut spec, &prompt, Mode::Prefill).unwrap();
            let bad = (want[2] + 1) % 4000;
            spec.begin_trace();
            let rows = m
                .forward(&mut spec, &[want[0], want[1], bad, bad, want[3]], Mode::Step)
                .unwrap();
            assert!(bits(&rows[0]) == bits(&want_logits[1]));
            assert!(bits(&rows[1]) == bits(&want_logits[2]));
            spec.keep(2).unwrap();
            assert_same_state(&spec, &plain_state, &format!("{backend:?} after rollback"));
            // Continue both with the true tokens: logits stay bit-identical.
            let a = m.forward(&mut spec, &want[2..6], Mode::Step).unwrap();
            let b: Vec<Vec<f32>> = want[2..6]
                .iter()
                .flat_map(|&t| m.forward(&mut plain_state, &[t], Mode::Step).unwrap())
                .collect();
            for (x, y) in a.iter().zip(&b) {
                assert!(bits(x) == bits(y), "{backend:?}: logits after rollback differ");
            }
            assert!(bits(&b[0]) == bits(&want_logits[3]));
        });
    }
}

/// `mtp_hidden` over several slots followed by the lm_head equals `mtp_logits` slot by slot, and
/// `mtp_catch_up` leaves the cache and last row `mtp_hidden` leaves.
#[test]
fn batched_mtp_hidden_matches_mtp_logits() {
    for (name, backend) in [
        ("tiny-F16.gguf", BackendChoice::Oracle),
        ("tiny-F16.gguf", BackendChoice::Cpu),
        ("tiny-Q8_0.gguf", BackendChoice::Cpu),
    ] {
        check_batched_mtp(name, backend);
    }
}

fn check_batched_mtp(name: &str, backend: BackendChoice) {
    let (model, tok) = load(name, backend);
    let prompt = rewrite_prompt(&tok);
    let prompt = &prompt[..40];
    with_model!(&model, m => {
        let mut st = m.new_state();
        let hidden = m.forward_hidden(&mut st, prompt, Mode::Prefill).unwrap();
        let mut one = m.new_mtp_state();
        let singles: Vec<Vec<u32>> = (0..prompt.len() - 1)
            .map(|t| bits(&m.mtp_logits(&mut one, &hidden[t], prompt[t + 1], t).unwrap()))
            .collect();
        let mut batched = m.new_mtp_state();
        let a = m.mtp_hidden(&mut batched, &hidden[..7], &prompt[1..8], 0).unwrap();
        let b = m
            .mtp_hidden(&mut batched, &hidden[7..prompt.len() - 1], &prompt[8..], 7)
            .unwrap();
        let logits = m.lm_head(&[a, b].concat());
        for (t, (l, s)) in logits.iter().zip(&singles).enumerate() {
            assert!(bits(l) == *s, "{name} {backend:?}: slot {t}");
        }
        // The drafter's catch-up form (key / value rows only for every slot but the last): the
        // same cache and the same last row, from an empty cache and from one that holds slots.
        let (mut full, mut fast) = (m.new_mtp_state(), m.new_mtp_state());
        for (a, z) in [(0, 1), (1, 9), (9, 10), (10, 39)] {
            let (hs, toks) = (&hidden[a..z], &prompt[a + 1..z + 1]);
            let want = m.mtp_hidden(&mut full, hs, toks, a).unwrap().pop().unwrap();
            let got = m.mtp_catch_up(&mut fast, hs, toks, a).unwrap().unwrap();
            assert!(bits(&got) == bits(&want), "{name} {backend:?}: catch-up {a}..{z}");
            assert_eq!(fast.kv.len(), z);
            for t in 0..z {
                let (k, v) = (fast.kv.key(t), fast.kv.value(t));
                assert!(bits(&k) == bits(&full.kv.key(t)), "{name} {backend:?}: key {t}");
                assert!(bits(&v) == bits(&full.kv.value(t)), "{name} {backend:?}: value {t}");
            }
        }
    });
}

/// `forward_last` returns `forward_hidden`'s last row bit for bit and leaves the same state (every
/// cache and recurrent state), for one token and for runs across the 64-token chunk boundary,
/// from an empty sequence and after earlier tokens; the next step's logits agree too.
#[test]
fn forward_last_is_the_last_row_of_forward_hidden() {
    for (name, backend) in [
        ("tiny-F16.gguf", BackendChoice::Oracle),
        ("tiny-Q8_0.gguf", BackendChoice::Cpu),
        ("tiny-Q4_K_M.gguf", BackendChoice::Cpu),
        ("tiny-IQ2_XXS.gguf", BackendChoice::Cpu),
    ] {
        let (model, tok) = load(name, backend);
        let prompt = rewrite_prompt(&tok);
        with_model!(&model, m => {
            let (mut full, mut last) = (m.new_state(), m.new_state());
            for r in [0..1, 1..40, 40..130, 130..131] {
                let toks = &prompt[r.clone()];
                let want = m.forward_hidden(&mut full, toks, Mode::Prefill).unwrap();
                let got = m.forward_last(&mut last, toks, Mode::Prefill).unwrap().unwrap();
                let what = format!("{name} {backend:?} tokens {r:?}");
                assert!(bits(&got) == bits(want.last().unwrap()), "{what}: last row");
                assert_same_state(&full, &last, &what);
            }
            let next = &prompt[131..132];
            let a = m.forward(&mut full, next, Mode::Step).unwrap();
            let b = m.forward(&mut last, next, Mode::Step).unwrap();
            assert!(bits(&a[0]) == bits(&b[0]), "{name} {backend:?}: next step");
            assert!(m.forward_last(&mut last, &[], Mode::Prefill).unwrap().is_none());
        });
    }
}

/// On the CPU backend a prompt's delta rule is the one-token recurrence
/// (`Backend::prompt_delta_rule`), so a prompt run leaves the state that the same tokens fed
/// one decode step at a time leave, bit for bit, and the next step's logits are the same.
#[test]
fn cpu_prompt_state_is_the_decode_steps_state() {
    for name in ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "tiny-IQ2_XXS.gguf"] {
        let (model, tok) = load(name, BackendChoice::Cpu);
        let prompt = rewrite_prompt(&tok);
        with_model!(&model, m => {
            let (mut run, mut steps) = (m.new_state(), m.new_state());
            m.forward_hidden(&mut run, &prompt[..70], Mode::Prefill).unwrap();
            for t in &prompt[..70] {
                m.forward(&mut steps, std::slice::from_ref(t), Mode::Step).unwrap();
            }
            assert_same_state(&run, &steps, &format!("{name}: 70 prompt tokens"));
            let a = m.forward(&mut run, &prompt[70..71], Mode::Step).unwrap();
            let b = m.forward(&mut steps, &prompt[70..71], Mode::Step).unwrap();
            assert!(bits(&a[0]) == bits(&b[0]), "{name}: next step");
        });
    }
}

/// The statistics add up.
#[test]
fn statistics_are_consistent() {
    let (model, tok) = load("tiny-Q8_0.gguf", BackendChoice::Cpu);
    let prompt = rewrite_prompt(&tok);
    with_model!(&model, m => {
        let n = 40;
        let (out, _, s): (Vec<u32>, _, SpecStats) = generate_speculative(
            m,
            &mut m.new_state(),
            &prompt,
            &mut Sampler::new(SamplerConfig::greedy()),
            &greedy_opts(n),
            &spec(SpecMode::Both),
            |_| true,
        )
        .unwrap();
        assert_eq!(out.len(), n);
        let t = s.total();
        assert!(t.accepted <= t.drafted);
        // The first token comes from the prompt pass; every decode pass emits its accepted
        // drafts plus one token, except that the budget may end on an accepted draft.
        assert!(s.forward_passes + t.accepted >= n - 1);
        assert!(s.forward_passes + t.accepted <= n);
        assert_eq!(s.rows, s.forward_passes + t.drafted);
        assert!((s.tokens_per_pass() - (s.forward_passes + t.accepted) as f64 / s.forward_passes as f64).abs() < 1e-12);
    });
}

/// The MTP draft head over part of the vocabulary: its rows are the lm_head's entries bit for
/// bit, and a tiny draft vocabulary (16 ids plus the context, grown and merged while
/// generating) changes only the drafts, never the output.
#[test]
fn draft_vocabulary_changes_drafts_only() {
    for (name, backend) in [
        ("tiny-F16.gguf", BackendChoice::Oracle),
        ("tiny-Q8_0.gguf", BackendChoice::Cpu),
        ("tiny-Q4_K_M.gguf", BackendChoice::Cpu),
    ] {
        let (model, tok) = load(name, backend);
        let prompt = rewrite_prompt(&tok);
        with_model!(&model, m => {
            let mut st = m.new_state();
            let hidden = m.forward_hidden(&mut st, &prompt[..5], Mode::Prefill).unwrap();
            let full = m.lm_head(&hidden[4..]);
            let ids: Vec<u32> = vec![7, 3, 4000, 1, 2048, 100, 4159, 5];
            let head = m.head_rows(&ids).unwrap();
            let mut part = vec![0.0f32; ids.len()];
            m.backend.linear(&head, &hidden[4], 1, &mut part);
            for (i, &id) in ids.iter().enumerate() {
                assert_eq!(
                    part[i].to_bits(),
                    full[0][id as usize].to_bits(),
                    "{name} {backend:?}: draft row of token {id}"
                );
            }
            assert!(m.head_rows(&[m.config.vocab as u32]).is_err());

            let (want, _, _) = plain(m, &prompt, 40);
            for vocab in [Some(16), Some(0)] {
                let cfg = SpecConfig {
                    mtp_vocab: vocab,
                    ..spec(SpecMode::Mtp)
                };
                let mut state = m.new_state();
                let (got, _, stats) = generate_speculative(
                    m,
                    &mut state,
                    &prompt,
                    &mut Sampler::new(SamplerConfig::greedy()),
                    &greedy_opts(40),
                    &cfg,
                    |_| true,
                )
                .unwrap();
                assert_eq!(got, want, "{name} {backend:?} vocab {vocab:?}: tokens");
                assert!(stats.total().accepted > 0, "{name} vocab {vocab:?}: no draft accepted");
            }
        });
    }
}

/// A sliding-window MTP drafter (the drafts attend over the last few slots; the cache drops the
/// older rows and keeps absolute positions) changes only the drafts, never the output: tokens
/// and every logits row as plain decoding's, and it still drafts tokens that are accepted.
#[test]
fn mtp_window_changes_drafts_only() {
    for (name, backend) in [
        ("tiny-F16.gguf", BackendChoice::Oracle),
        ("tiny-Q8_0.gguf", BackendChoice::Cpu),
        ("tiny-IQ2_XXS.gguf", BackendChoice::Cpu),
    ] {
        let (model, tok) = load(name, backend);
        let prompt = rewrite_prompt(&tok);
        with_model!(&model, m => {
            let (want, want_logits, want_state) = plain(m, &prompt, 40);
            for window in [1, 3, 16] {
                let what = format!("{name} {backend:?} window {window}");
                assert!(prompt.len() > 2 * window, "{what}: the prompt must outgrow the window");
                let cfg = SpecConfig { mtp_window: window, ..spec(SpecMode::Mtp) };
                let (got, seen, stats, state) = greedy_observed(m, &prompt, 40, &cfg);
                assert_eq!(got, want, "{what}: tokens");
                assert!(seen == want_logits.iter().map(|l| bits(l)).collect::<Vec<_>>(), "{what}: logits");
                assert_same_state(&state, &want_state, &what);
                assert!(stats.mtp.accepted > 0, "{what}: no draft accepted ({})", stats.summary());
            }
        });
    }
}
