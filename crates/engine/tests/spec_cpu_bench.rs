//! Speculative-decoding benchmarks in process CPU time, for a machine shared with other jobs
//! (where wall-clock time swings 2×): the CPU time of every thread of this process, read from
//! `/proc/self/task/*/schedstat` (Linux), around each measured call. Ignored by default:
//!
//! ```text
//! SPEC_MODEL=models/redlite-demo.gguf SPEC_THREADS=1 cargo test --release -p redlite-engine \
//!     --test spec_cpu_bench -- --ignored --nocapture --test-threads 1
//! ```
//!
//! `SPEC_MODEL` (relative to the repository root, or absolute), `SPEC_THREADS` (default 1),
//! `SPEC_KS` (verify: draft lengths, default `1,3,7,15`), `SPEC_CONTEXT` (verify: context
//! tokens, default 16), `SPEC_REPS` (default 3), `SPEC_FILE` (rewrite: the source file, default
//! `/tmp/colorsys_60.py`), `SPEC_N` (rewrite: a fixed number of tokens, no stop tokens, the
//! older benchmark; default `whole`: the whole file back, its token count + 64 at most, stopping
//! at end-of-sequence, like `redlite spec-bench rewrite` without `-n`), `SPEC_MODES` (rewrite: the
//! configurations, the first being the baseline; default `off,lookup,mtp,both`; see
//! `spec_configs`). `forced_rewrite_cpu_time` times the rewrite teacher-forced (the passes
//! prompt lookup would make if the model wrote the expected answer).

use std::sync::Arc;
use std::time::{Duration, Instant};

use redlite_engine::generate::{generate, GenerateOptions};
use redlite_engine::sampler::{Sampler, SamplerConfig};
use redlite_engine::spec_bench::{lookup_replay, rewrite_budget, rewrite_prompt, ReplayPass};
use redlite_engine::speculative::{generate_speculative, SpecConfig, SpecMode};
use redlite_engine::{load_model_from, with_model, AnyModel, BackendChoice};
use redlite_gguf::GgufFile;
use redlite_model::Mode;
use redlite_tokenizer::tokenizer::Tokenizer;

fn var(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_string())
}

fn num(key: &str, default: usize) -> usize {
    var(key, &default.to_string()).parse().expect(key)
}

/// CPU time of all threads of this process so far.
fn cpu_time() -> Duration {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let path = task.expect("task entry").path().join("schedstat");
        if let Ok(text) = std::fs::read_to_string(path) {
            ns += text
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Duration::from_nanos(ns)
}

fn load() -> (AnyModel, Arc<GgufFile>) {
    let path = var("SPEC_MODEL", "models/redlite-demo.gguf");
    let path = if path.starts_with('/') {
        path
    } else {
        format!("../../{path}")
    };
    let file = Arc::new(GgufFile::open(&path).expect("model file"));
    let model = load_model_from(file.clone(), BackendChoice::Cpu, num("SPEC_THREADS", 1))
        .expect("model loads");
    (model, file)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A K+1-row verify (`begin_trace`, the rows, `Model::keep(1)`), a 1-row step and the K+1 rows
/// untraced, each from the same state; medians of CPU and wall time.
#[test]
#[ignore]
fn verify_cost_cpu_time() {
    let (model, _) = load();
    let ks: Vec<usize> = var("SPEC_KS", "1,3,7,15")
        .split(',')
        .map(|k| k.parse().expect("SPEC_KS"))
        .collect();
    let reps = num("SPEC_REPS", 3).max(1);
    let context = num("SPEC_CONTEXT", 16).max(1);
    let tokens: Vec<u32> = (0..64u32).map(|i| 100 + i * 37).collect();
    println!("| K | rows | verify cpu ms | 1-row cpu ms | ratio | untraced cpu ms | untraced ratio | verify wall ms | 1-row wall ms |");
    println!("|---|---|---|---|---|---|---|---|---|");
    with_model!(&model, m => {
        let mut state = m.new_state();
        let prompt: Vec<u32> = (0..context).map(|i| tokens[i % 64]).collect();
        m.forward(&mut state, &prompt, Mode::Prefill).unwrap();
        let snap = state.snapshot();
        for &k in &ks {
            let rows: Vec<u32> = (0..=k).map(|i| tokens[(context + i) % 64]).collect();
            let mut cpu = [Vec::new(), Vec::new(), Vec::new()];
            let mut wall = [Vec::new(), Vec::new(), Vec::new()];
            for rep in 0..=reps {
                for which in 0..3 {
                    let (c0, w0) = (cpu_time(), Instant::now());
                    match which {
                        0 => {
                            state.begin_trace();
                            m.forward(&mut state, &rows, Mode::Step).unwrap();
                            m.keep(&mut state, 1).unwrap();
                        }
                        1 => {
                            m.forward(&mut state, &rows[..1], Mode::Step).unwrap();
                        }
                        _ => {
                            m.forward(&mut state, &rows, Mode::Step).unwrap();
                        }
                    }
                    let (c, w) = (cpu_time() - c0, w0.elapsed());
                    state.restore(&snap).unwrap();
                    // Repetition 0 warms up.
                    if rep > 0 {
                        cpu[which].push(c);
                        wall[which].push(w);
                    }
                }
            }
            let [v, d, u] = cpu.map(median);
            let [vw, dw, _] = wall.map(median);
            println!(
                "| {k} | {} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.2}x | {:.1} | {:.1} |",
                k + 1,
                ms(v),
                ms(d),
                v.as_secs_f64() / d.as_secs_f64(),
                ms(u),
                u.as_secs_f64() / d.as_secs_f64(),
                ms(vw),
                ms(dw)
            );
        }
    });
}

/// The file-rewrite prompt of `redlite spec-bench rewrite` (`$SPEC_FILE`, default
/// /tmp/colorsys_60.py) as token ids.
fn rewrite_prompt_ids(file: &GgufFile) -> Vec<u32> {
    rewrite_task(file).0
}

/// The text of `$SPEC_FILE` (default /tmp/colorsys_60.py).
fn rewrite_file() -> String {
    let path = var("SPEC_FILE", "/tmp/colorsys_60.py");
    std::fs::read_to_string(&path).expect("SPEC_FILE")
}

/// The file-rewrite prompt, the token budget and the stop tokens: `$SPEC_N` tokens without stops,
/// or (`whole`, the default) the whole file back ([`rewrite_budget`]) stopping at end-of-sequence.
fn rewrite_task(file: &GgufFile) -> (Vec<u32>, usize, Vec<u32>) {
    let tokenizer = Tokenizer::from_gguf(file).expect("tokenizer");
    let text = rewrite_file();
    let edit =
        "Rewrite this file with one change: add a comment line at the top saying it was reviewed.";
    let prompt = tokenizer
        .encode(&rewrite_prompt(&text, edit), false)
        .expect("encode");
    match var("SPEC_N", "whole").as_str() {
        "whole" => {
            let file_tokens = tokenizer.encode(&text, false).expect("encode").len();
            let stops = tokenizer.stop_token_ids().to_vec();
            (prompt, rewrite_budget(file_tokens), stops)
        }
        n => (prompt, n.parse().expect("SPEC_N"), Vec::new()),
    }
}

/// The configurations of `$SPEC_MODES` (or `default`), the first being the baseline:
/// `mode[:key=value...]`, keys `mtp` (MTP drafts), `max` (lookup draft cap), `nmin`/`nmax`
/// (n-gram range), `p` (MTP chaining threshold, percent), `follow` (0: prompt lookup searches
/// afresh for every draft), `vocab` (MTP draft vocabulary's lowest ids; 0: the whole one).
fn spec_configs(default: &str) -> Vec<(String, SpecConfig)> {
    var("SPEC_MODES", default)
        .split(',')
        .map(|c| {
            let mut parts = c.split(':');
            let mut spec =
                SpecConfig::with_mode(SpecMode::parse(parts.next().unwrap()).expect("mode"));
            for kv in parts {
                let (k, v) = kv.split_once('=').expect("key=value");
                let v: usize = v.parse().expect("number");
                match k {
                    "mtp" => spec.mtp_draft = Some(v),
                    "max" => spec.max_draft = v,
                    "nmin" => spec.ngram_min = v,
                    "nmax" => spec.ngram_max = v,
                    "p" => spec.mtp_min_prob = v as f32 / 100.0,
                    "follow" => spec.lookup_follow = v != 0,
                    "vocab" => spec.mtp_vocab = Some(v),
                    _ => panic!("unknown key {k}"),
                }
            }
            (c.to_string(), spec)
        })
        .collect()
}

/// The file rewrite of `redlite spec-bench rewrite` (greedy), decode CPU time
/// plainly and per speculation mode: each run's CPU time minus that of the same run stopped
/// after its first token (the prompt pass), medians over the repetitions.
#[test]
#[ignore]
fn file_rewrite_cpu_time() {
    let (model, file) = load();
    let (prompt, n, stop_ids) = rewrite_task(&file);
    let reps = num("SPEC_REPS", 3).max(1);
    println!(
        "prompt {} tokens, up to {n} generated, {} stop tokens",
        prompt.len(),
        stop_ids.len()
    );
    let configs = spec_configs("off,lookup,mtp,both");
    println!("| spec | tokens | passes | rows | decode cpu s | tok per cpu-s | speed-up (cpu) | decode wall s | speed-up (wall) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    with_model!(&model, m => {
        let run = |spec: &SpecConfig, max_tokens: usize| {
            let opts = GenerateOptions { max_tokens, stop_ids: stop_ids.clone() };
            let mut state = m.new_state();
            let mut sampler = Sampler::new(SamplerConfig::greedy());
            let c0 = cpu_time();
            let (wall, generated, passes) = if spec.mode == SpecMode::Off {
                let (_, s) = generate(m, &mut state, &prompt, &mut sampler, &opts, |_| true)
                    .unwrap();
                let steps = s.generated_tokens.saturating_sub(1);
                (s.decode_time, s.generated_tokens, (steps, steps))
            } else {
                let (_, s, ss) = generate_speculative(
                    m, &mut state, &prompt, &mut sampler, &opts, spec, |_| true,
                )
                .unwrap();
                (s.decode_time, s.generated_tokens, (ss.forward_passes, ss.rows))
            };
            (cpu_time() - c0, wall, generated, passes)
        };
        // Repetitions interleave the configurations (A/B under a changing load).
        let mut cpu = vec![Vec::new(); configs.len()];
        let mut wall = vec![Vec::new(); configs.len()];
        let mut passes = vec![(0, 0); configs.len()];
        let mut generated = vec![0; configs.len()];
        for _ in 0..reps {
            for (i, (_, spec)) in configs.iter().enumerate() {
                let (prompt_only, _, _, _) = run(spec, 1);
                let (all, w, g, p) = run(spec, n);
                cpu[i].push(all.saturating_sub(prompt_only));
                wall[i].push(w);
                passes[i] = p;
                generated[i] = g;
            }
        }
        let mut base = None;
        for (i, (name, _)) in configs.iter().enumerate() {
            let (c, w) = (
                median(cpu[i].clone()).as_secs_f64(),
                median(wall[i].clone()).as_secs_f64(),
            );
            let (base_cpu, base_wall) = *base.get_or_insert((c, w));
            println!(
                "| {name} | {} | {} | {} | {c:.3} | {:.1} | {:.2}x | {w:.3} | {:.2}x |",
                generated[i],
                passes[i].0,
                passes[i].1,
                generated[i].saturating_sub(1) as f64 / c,
                base_cpu / c,
                base_wall / w
            );
        }
    });
}

/// The file rewrite teacher-forced: the verify passes greedy prompt lookup would make if the
/// model's answer were the expected one (`# Reviewed.`, the file, the closing fence;
/// [`lookup_replay`]), timed on the model against plain decoding's one-token steps over the same
/// tokens. The demo model does not write the file back (it loops), so this measures what the
/// engine gains on a real rewrite; the tokens the model would sample are not checked. Lookup
/// configurations only (`$SPEC_MODES`, default `off,lookup,lookup:follow=0`); the search itself
/// runs before the timing (its wall time is printed).
#[test]
#[ignore]
fn forced_rewrite_cpu_time() {
    let (model, file) = load();
    let prompt = rewrite_prompt_ids(&file);
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let target = tokenizer
        .encode(&format!("# Reviewed.\n{}\n```", rewrite_file()), false)
        .expect("encode");
    let reps = num("SPEC_REPS", 3).max(1);
    let configs = spec_configs("off,lookup,lookup:follow=0");
    let plans: Vec<Vec<ReplayPass>> = configs
        .iter()
        .map(|(name, spec)| match spec.mode {
            SpecMode::Off => target[..target.len() - 1]
                .iter()
                .map(|&t| ReplayPass {
                    tokens: vec![t],
                    kept: 1,
                })
                .collect(),
            SpecMode::Lookup => {
                let t = Instant::now();
                let plan = lookup_replay(&prompt, &target, spec);
                println!("{name}: drafting {:.2} ms", ms(t.elapsed()));
                plan
            }
            _ => panic!("{name}: the teacher-forced rewrite replays prompt lookup only"),
        })
        .collect();
    println!(
        "prompt {} tokens, answer {} tokens (teacher-forced)",
        prompt.len(),
        target.len()
    );
    println!("| spec | passes | rows | accepted | decode cpu s | speed-up (cpu) | decode wall s | speed-up (wall) |");
    println!("|---|---|---|---|---|---|---|---|");
    with_model!(&model, m => {
        let mut state = m.new_state();
        m.forward(&mut state, &prompt, Mode::Prefill).unwrap();
        let snap = state.snapshot();
        let mut cpu = vec![Vec::new(); configs.len()];
        let mut wall = vec![Vec::new(); configs.len()];
        // Repetitions interleave the configurations (A/B under a changing load).
        for _ in 0..reps {
            for (i, plan) in plans.iter().enumerate() {
                state.restore(&snap).unwrap();
                let (c0, w0) = (cpu_time(), Instant::now());
                for pass in plan {
                    let drafted = pass.tokens.len() > 1;
                    if drafted {
                        state.begin_trace();
                    }
                    m.forward(&mut state, &pass.tokens, Mode::Step).unwrap();
                    if drafted {
                        m.keep(&mut state, pass.kept).unwrap();
                    }
                }
                cpu[i].push(cpu_time() - c0);
                wall[i].push(w0.elapsed());
            }
        }
        let mut base = None;
        for (i, (name, _)) in configs.iter().enumerate() {
            let (c, w) = (
                median(cpu[i].clone()).as_secs_f64(),
                median(wall[i].clone()).as_secs_f64(),
            );
            let (base_cpu, base_wall) = *base.get_or_insert((c, w));
            let rows: usize = plans[i].iter().map(|p| p.tokens.len()).sum();
            let kept: usize = plans[i].iter().map(|p| p.kept).sum();
            println!(
                "| {name} | {} | {rows} | {} | {c:.3} | {:.2}x | {w:.3} | {:.2}x |",
                plans[i].len(),
                kept - plans[i].len(),
                base_cpu / c,
                base_wall / w
            );
        }
    });
}

/// Where an MTP draft's time goes, after the file-rewrite prompt (its MTP slots built): CPU and
/// wall time of the lm_head of one row, of the MTP block over 1 and 4 slots (the chained draft and a
/// catch-up pass), of 64 slots (a catch-up after a prompt-lookup stretch), of the drafter's
/// catch-up form over 4 and 64 slots, and of a 1-row trunk step for scale; medians.
#[test]
#[ignore]
fn mtp_draft_cost_cpu_time() {
    let (model, file) = load();
    let prompt = rewrite_prompt_ids(&file);
    let reps = num("SPEC_REPS", 3).max(1) * 10;
    with_model!(&model, m => {
        let mut state = m.new_state();
        let hidden = m.forward_hidden(&mut state, &prompt, Mode::Prefill).unwrap();
        let mut mtp = m.new_mtp_state();
        let n = prompt.len();
        m.mtp_hidden(&mut mtp, &hidden[..n - 2], &prompt[1..n - 1], 0).unwrap();
        let t = mtp.kv.len();
        let snap = state.snapshot();
        // (CPU ms, wall ms), medians.
        let time = |f: &mut dyn FnMut()| {
            let (mut c, mut w) = (Vec::new(), Vec::new());
            for rep in 0..=reps {
                let (c0, w0) = (cpu_time(), Instant::now());
                f();
                if rep > 0 {
                    c.push(cpu_time() - c0);
                    w.push(w0.elapsed());
                }
            }
            (ms(median(c)), ms(median(w)))
        };
        let last = &hidden[n - 2..n - 1];
        let head = time(&mut || {
            m.lm_head(last);
        });
        // `k` slots through the whole block (`mtp_hidden`), or in the drafter's catch-up form
        // (`mtp_catch_up`: key / value rows only for all slots but the last).
        let mut slots = |k: usize, catch_up: bool| {
            let hs = vec![last[0].clone(); k];
            let toks = vec![prompt[n - 1]; k];
            time(&mut || {
                if catch_up {
                    m.mtp_catch_up(&mut mtp, &hs, &toks, t).unwrap();
                } else {
                    m.mtp_hidden(&mut mtp, &hs, &toks, t).unwrap();
                }
                mtp.kv.truncate(t);
            })
        };
        let (one, four, sixty_four) = (slots(1, false), slots(4, false), slots(64, false));
        let (cu_four, cu_sixty_four) = (slots(4, true), slots(64, true));
        let step = time(&mut || {
            m.forward(&mut state, &prompt[n - 1..], Mode::Step).unwrap();
            state.restore(&snap).unwrap();
        });
        println!(
            "context {n}, CPU / wall ms: lm_head 1 row {:.3} / {:.3}, MTP block 1 slot {:.3} / {:.3}, 4 slots {:.3} / {:.3}, 64 slots {:.3} / {:.3}, catch-up 4 slots {:.3} / {:.3}, 64 slots {:.3} / {:.3}, trunk step (with lm_head) {:.3} / {:.3}",
            head.0, head.1, one.0, one.1, four.0, four.1, sixty_four.0, sixty_four.1,
            cu_four.0, cu_four.1, cu_sixty_four.0, cu_sixty_four.1, step.0, step.1
        );
    });
}
