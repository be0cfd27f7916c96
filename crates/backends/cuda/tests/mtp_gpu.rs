//! MTP drafts on the GPU (`CudaModel::mtp_draft`) against the f32 oracle's MTP block
//! (`Model::mtp_hidden` + `lm_head`), on the same context: a prompt, then verify passes of
//! `[pending, d1, d2]` kept up to the first rejection (so the MTP queue's bookkeeping after
//! `verify` + `keep`, after a prefill and after plain decode steps is what is tested). The
//! drafts are argmaxes of logits that differ by rounding between the two, so they must agree at
//! most steps, not all (a near-tie may flip); a wrong position, norm or queue entry would make
//! them disagree at most steps.
//!
//! Needs a GPU: `#[ignore]`d; run on the device with `--ignored` (bench/gpu_ab.sh).
//! Fixtures: `$REDLITE_TEST_MODELS` or `shared/reference/models`; the demo model from
//! `$REDLITE_DEMO_MODEL` or `models/redlite-demo.gguf` (from the repository root).
#![cfg(feature = "cuda")]

#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::models;
use redlite_cuda::{CudaModel, CudaModelOptions, Gpu, GpuSampling};
use redlite_model::{Mode, Model, Oracle};

/// Steps of (draft 2, verify 3 rows, keep) after the prompt.
const STEPS: usize = 24;
/// Fewest first drafts (and chained second drafts) that must equal the oracle's.
const MIN_AGREE_FIRST: f64 = 0.8;
const MIN_AGREE_SECOND: f64 = 0.7;

/// The greedy token (the lowest index on ties, as the GPU's `argmax`).
fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}

fn demo_model() -> PathBuf {
    std::env::var_os("REDLITE_DEMO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let here = PathBuf::from("models/redlite-demo.gguf");
            if here.exists() {
                here
            } else {
                PathBuf::from(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../../../models/redlite-demo.gguf"
                ))
            }
        })
}

/// The oracle's side: its sequence, MTP cache, queued slots and last hidden state.
struct OracleMtp {
    model: Model<Oracle>,
    state: redlite_model::SequenceState,
    mtp: redlite_model::MtpState,
    queue: Vec<(Vec<f32>, u32)>,
    /// The last trunk row's hidden state while its slot waits for its token (`None` once a
    /// draft ran that slot with the pending token).
    last: Option<Vec<f32>>,
}

impl OracleMtp {
    /// Run `tokens` through the trunk; queue their slots (the last row waits for its token).
    fn run(&mut self, tokens: &[u32], mode: Mode) {
        let hidden = self
            .model
            .forward_hidden(&mut self.state, tokens, mode)
            .expect("oracle forward");
        let mut rows = hidden.into_iter();
        if let Some(last) = self.last.take() {
            self.queue.push((last, tokens[0]));
        }
        let mut prev = rows.next().expect("a row");
        for (h, &t) in rows.zip(&tokens[1..]) {
            self.queue.push((std::mem::replace(&mut prev, h), t));
        }
        self.last = Some(prev);
    }

    /// `k` chained drafts after `pending`, as `CudaModel::mtp_draft` defines them.
    fn draft(&mut self, pending: u32, k: usize) -> Vec<u32> {
        let last = self.last.take().expect("a trunk call before the draft");
        self.queue.push((last, pending));
        let (hidden, toks): (Vec<Vec<f32>>, Vec<u32>) =
            std::mem::take(&mut self.queue).into_iter().unzip();
        let t0 = self.mtp.kv.len();
        let mut out = self
            .model
            .mtp_hidden(&mut self.mtp, &hidden, &toks, t0)
            .expect("oracle MTP")
            .pop()
            .expect("a row");
        let keep = self.mtp.kv.len();
        let mut drafts = Vec::new();
        for j in 0..k {
            let logits = self
                .model
                .lm_head(std::slice::from_ref(&out))
                .pop()
                .unwrap();
            let d = argmax(&logits);
            drafts.push(d);
            if j + 1 < k {
                let t = self.mtp.kv.len();
                out = self
                    .model
                    .mtp_hidden(&mut self.mtp, &[out], &[d], t)
                    .expect("oracle MTP chain")
                    .pop()
                    .expect("a row");
            }
        }
        self.mtp.kv.truncate(keep);
        drafts
    }
}

/// `path` on the GPU with its MTP block, 8 verify rows.
fn load_with_mtp(gpu: &Arc<Gpu>, path: &std::path::Path) -> CudaModel {
    let opts = CudaModelOptions {
        max_context: 512,
        max_batch: 64,
        graphs: true,
        max_verify: 8,
        mtp: true,
        kv_type: common::kv_type(),
        ..CudaModelOptions::default()
    };
    CudaModel::load(gpu.clone(), path, opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn check(gpu: &Arc<Gpu>, path: PathBuf) {
    let name = path.display().to_string();
    let mut g = load_with_mtp(gpu, &path);
    assert!(g.has_mtp(), "{name}: no MTP block loaded");
    let model = Model::load(&path).unwrap_or_else(|e| panic!("{name}: oracle: {e}"));
    let mut o = OracleMtp {
        state: model.new_state(),
        mtp: model.new_mtp_state(),
        model,
        queue: Vec::new(),
        last: None,
    };
    let vocab = g.config.vocab as u32;
    // A prompt of 40 ids spread over the vocabulary (no tokenizer needed), repeated once so the
    // model has something to continue.
    let half: Vec<u32> = (0..20u32).map(|i| (i * 7919 + 11) % vocab).collect();
    let prompt: Vec<u32> = half.iter().chain(&half).copied().collect();
    let greedy = GpuSampling::greedy();
    g.prefill(&prompt).expect("prefill");
    o.run(&prompt, Mode::Prefill);
    let mut pending = g.sample_last(&greedy, 0.0).expect("sample");
    let (mut first, mut second, mut accepted) = (0, 0, 0);
    for step in 0..STEPS {
        let dg = g.mtp_draft(pending, 2).expect("GPU drafts");
        let dc = o.draft(pending, 2);
        first += usize::from(dg[0] == dc[0]);
        second += usize::from(dg[1] == dc[1]);
        // Every third step a plain decode (the recording after `decode`), else a verify pass of
        // the GPU's drafts kept up to the first rejection.
        if step % 3 == 2 {
            let next = g.decode(pending, &greedy, 0.0).expect("decode");
            o.run(&[pending], Mode::Step);
            pending = next;
            continue;
        }
        let rows = [pending, dg[0], dg[1]];
        let ids = g.verify_greedy(&rows).expect("verify");
        let a = dg.iter().zip(&ids).take_while(|(d, y)| d == y).count();
        accepted += a;
        g.keep(1 + a).expect("keep");
        o.run(&rows[..1 + a], Mode::Step);
        pending = ids[a];
    }
    let n = STEPS as f64;
    eprintln!(
        "{name}: first drafts equal to the oracle's {first}/{STEPS}, second {second}/{STEPS}, GPU drafts accepted {accepted}"
    );
    assert!(
        first as f64 >= MIN_AGREE_FIRST * n,
        "{name}: first drafts agree {first}/{STEPS}"
    );
    assert!(
        second as f64 >= MIN_AGREE_SECOND * n,
        "{name}: second drafts agree {second}/{STEPS}"
    );
}

#[test]
#[ignore = "needs a GPU"]
fn mtp_drafts_match_the_oracle() {
    let gpu = Arc::new(Gpu::new(0).expect("GPU"));
    for f in ["tiny-IQ2_XXS", "tiny-Q4_K_M", "tiny-CF2"] {
        check(&gpu, models().join(format!("{f}.gguf")));
    }
    check(&gpu, demo_model());
}

/// Greedy speculative decoding with MTP drafts, `steps` passes of `mtp_draft` then
/// `verify_greedy`, kept to the first rejection: the sequence.
fn mtp_spec_run(g: &mut CudaModel, prompt: &[u32], steps: usize) -> Vec<u32> {
    let greedy = GpuSampling::greedy();
    g.reset().expect("reset");
    g.prefill(prompt).expect("prefill");
    let mut pending = g.sample_last(&greedy, 0.0).expect("sample");
    let mut seq = Vec::new();
    for _ in 0..steps {
        let drafts = g.mtp_draft(pending, 3).expect("mtp_draft");
        let mut rows = vec![pending];
        rows.extend_from_slice(&drafts);
        let ids = g.verify_greedy(&rows).expect("verify");
        let a = drafts.iter().zip(&ids).take_while(|(d, y)| d == y).count();
        g.keep(1 + a).expect("keep");
        seq.push(pending);
        seq.extend_from_slice(&drafts[..a]);
        pending = ids[a];
    }
    seq.push(pending);
    seq
}

/// Speculative decoding with MTP drafts (graphed drafts, graphed verify passes, `keep`) gives
/// plain greedy decoding's sequence.
#[test]
#[ignore = "needs a GPU"]
fn mtp_passes_match_plain_decoding() {
    let gpu = Arc::new(Gpu::new(0).expect("GPU"));
    let paths = ["tiny-IQ2_XXS", "tiny-CF2"]
        .iter()
        .map(|f| models().join(format!("{f}.gguf")))
        .chain([demo_model()]);
    for path in paths {
        let name = path.display().to_string();
        let mut g = load_with_mtp(&gpu, &path);
        let vocab = g.config.vocab as u32;
        let prompt: Vec<u32> = (0..24u32).map(|i| (i * 7919 + 5) % vocab).collect();
        let spec = mtp_spec_run(&mut g, &prompt, 30);
        let greedy = GpuSampling::greedy();
        g.reset().expect("reset");
        g.prefill(&prompt).expect("prefill");
        let mut plain = vec![g.sample_last(&greedy, 0.0).expect("sample")];
        while plain.len() < spec.len() {
            let t = *plain.last().expect("a token");
            plain.push(g.decode(t, &greedy, 0.0).expect("decode"));
        }
        assert_eq!(
            spec, plain,
            "{name}: speculative sequence against plain decoding"
        );
        eprintln!(
            "{name}: 30 MTP passes, {} tokens, equal to plain decoding",
            spec.len()
        );
    }
}

/// `set_mtp_min_prob`: a draft stops after its first token below the threshold, so with a
/// threshold above every probability (1.01) each draft is one token, the first of the full
/// draft's; with one below every probability (1e-30) the full draft. Each threshold drafts on
/// the same context (reset, the same prompt and pass), over prompts of several lengths.
#[test]
#[ignore = "needs a GPU"]
fn mtp_min_prob_stops_the_draft() {
    let gpu = Arc::new(Gpu::new(0).expect("GPU"));
    let greedy = GpuSampling::greedy();
    for path in [models().join("tiny-CF2.gguf"), demo_model()] {
        let name = path.display().to_string();
        let mut g = load_with_mtp(&gpu, &path);
        let vocab = g.config.vocab as u32;
        for len in 20..32u32 {
            let prompt: Vec<u32> = (0..len).map(|i| (i * 7919 + 5) % vocab).collect();
            let mut drafts = Vec::new();
            for p in [0.0f32, 1.01, 1e-30] {
                g.set_mtp_min_prob(p);
                g.reset().expect("reset");
                g.prefill(&prompt).expect("prefill");
                let pending = g.sample_last(&greedy, 0.0).expect("sample");
                // The first draft after a prompt runs eagerly (more queued slots than a graph
                // takes); one pass rejecting it leaves a short queue, whose draft is a graph.
                let first = g.mtp_draft(pending, 3).expect("mtp_draft");
                let mut rows = vec![pending];
                rows.extend_from_slice(&first);
                let ids = g.verify_greedy(&rows).expect("verify");
                g.keep(1).expect("keep");
                drafts.push(g.mtp_draft(ids[0], 3).expect("mtp_draft"));
            }
            assert_eq!(drafts[0].len(), 3, "{name}, {len} tokens: full draft");
            assert_eq!(
                drafts[1],
                drafts[0][..1],
                "{name}, {len} tokens: min prob 1.01"
            );
            assert_eq!(drafts[2], drafts[0], "{name}, {len} tokens: min prob 1e-30");
        }
        // The other tests' threads load and run models beside these captures (see
        // `CudaModel::capture`): how many were invalidated and tried again.
        eprintln!(
            "{name}: min prob checks passed, {} captures invalidated and tried again",
            g.captures_invalidated()
        );
    }
}
