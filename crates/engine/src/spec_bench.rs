//! Benchmarks of speculative decoding.
//!
//! * [`verify_cost`]: the time of one `K + 1`-row verify pass (`Mode::Step` with the DeltaNet
//!   states recorded per row, logits of every row, then the rollback) against a 1-row decode
//!   step, on whatever context the state holds. The weights dominate a decode step, so a
//!   multi-row pass that reads each weight once should cost far less than `K + 1` steps.
//! * [`file_rewrite`]: give the model a source file and ask for it back with a small edit;
//!   decode speed with and without speculation, the outputs checked identical. By default the
//!   model writes the whole file back ([`rewrite_budget`] tokens at most, stopping at
//!   end-of-sequence), as a coding agent does; [`Reproduction`] says how much of the file the
//!   answer actually holds.

use std::time::{Duration, Instant};

use redlite_model::{Backend, Mode, Model, ModelError};

use crate::generate::{generate, GenerateOptions, GenerationStats};
use crate::sampler::{Sampler, SamplerConfig};
use crate::speculative::{generate_speculative, LookupDrafter, SpecConfig, SpecMode, SpecStats};

/// One row of the verify-cost table.
#[derive(Debug, Clone)]
pub struct VerifyCost {
    /// Drafted tokens; the pass has `k + 1` rows.
    pub k: usize,
    /// Median time of the `k + 1`-row pass (checkpoints, forward with logits, rollback to one
    /// kept row).
    pub verify: Duration,
    /// Median time of a 1-row decode step measured alongside.
    pub decode: Duration,
    /// Median time of the same `k + 1`-row forward without recording DeltaNet states (the
    /// difference to `verify` is the cost of the per-row checkpoints).
    pub untraced: Duration,
}

impl VerifyCost {
    /// Verify time over 1-row decode time.
    pub fn ratio(&self) -> f64 {
        self.verify.as_secs_f64() / self.decode.as_secs_f64().max(1e-12)
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Prefill `context` tokens (token ids `tokens` cycled), then for each `k` time `reps` verify
/// passes of `k + 1` rows, `reps` plain 1-row steps and `reps` untraced `k + 1`-row passes, each
/// restored from a snapshot (outside the timing) so every measurement starts from the same state. `on_row` sees each finished row (for progress output).
pub fn verify_cost<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    context: usize,
    ks: &[usize],
    reps: usize,
    mut on_row: impl FnMut(&VerifyCost),
) -> Result<Vec<VerifyCost>, ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::BadConfig("verify_cost needs token ids".into()));
    }
    let pick = |i: usize| tokens[i % tokens.len()];
    let mut state = model.new_state();
    let prompt: Vec<u32> = (0..context.max(1)).map(pick).collect();
    model.forward(&mut state, &prompt, Mode::Prefill)?;
    let mut out = Vec::with_capacity(ks.len());
    for &k in ks {
        let rows: Vec<u32> = (0..=k).map(|i| pick(context + i)).collect();
        let mut verify = Vec::with_capacity(reps);
        let mut decode = Vec::with_capacity(reps);
        let mut untraced = Vec::with_capacity(reps);
        // Repetition 0 is a warm-up (it touches the pages the measurement reads).
        let snap = state.snapshot();
        for rep in 0..=reps {
            // A verify that keeps one row (the first draft rejected): checkpoints, rows, rollback.
            let t = Instant::now();
            state.begin_trace();
            model.forward(&mut state, &rows, Mode::Step)?;
            model.keep(&mut state, 1)?;
            let tv = t.elapsed();
            state.restore(&snap)?;
            // A plain decode step.
            let t = Instant::now();
            model.forward(&mut state, &rows[..1], Mode::Step)?;
            let td = t.elapsed();
            state.restore(&snap)?;
            // The rows without checkpoints.
            let t = Instant::now();
            model.forward(&mut state, &rows, Mode::Step)?;
            let tu = t.elapsed();
            state.restore(&snap)?;
            if rep > 0 {
                verify.push(tv);
                decode.push(td);
                untraced.push(tu);
            }
        }
        let row = VerifyCost {
            k,
            verify: median(verify),
            decode: median(decode),
            untraced: median(untraced),
        };
        on_row(&row);
        out.push(row);
    }
    Ok(out)
}

/// One row of the file-rewrite table.
#[derive(Debug, Clone)]
pub struct RewriteRun {
    pub mode: SpecMode,
    pub generated: usize,
    pub decode: Duration,
    pub decode_tok_per_s: f64,
    /// `None` for the plain run.
    pub spec: Option<SpecStats>,
    /// The tokens equal the plain run's.
    pub identical: bool,
    /// The generated token ids.
    pub tokens: Vec<u32>,
}

impl RewriteRun {
    /// The plain (non-speculative) run of a rewrite.
    pub fn plain(tokens: Vec<u32>, stats: &GenerationStats) -> RewriteRun {
        RewriteRun {
            mode: SpecMode::Off,
            generated: stats.generated_tokens,
            decode: stats.decode_time,
            decode_tok_per_s: stats.decode_tok_per_s(),
            spec: None,
            identical: true,
            tokens,
        }
    }

    /// A speculative run in `mode`, compared with the plain run's tokens `base`.
    pub fn speculative(
        mode: SpecMode,
        tokens: Vec<u32>,
        stats: &GenerationStats,
        spec: SpecStats,
        base: &[u32],
    ) -> RewriteRun {
        RewriteRun {
            mode,
            generated: stats.generated_tokens,
            decode: stats.decode_time,
            decode_tok_per_s: stats.decode_tok_per_s(),
            spec: Some(spec),
            identical: tokens == base,
            tokens,
        }
    }
}

/// Extra tokens a whole-file rewrite may generate beyond the file's own token count (the edit,
/// the closing fence).
pub const REWRITE_MARGIN: usize = 64;

/// Token budget of a whole-file rewrite: the file's tokens plus [`REWRITE_MARGIN`].
pub fn rewrite_budget(file_tokens: usize) -> usize {
    file_tokens + REWRITE_MARGIN
}

/// How much of the file a rewrite's answer reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reproduction {
    /// The file's tokens.
    pub file_tokens: usize,
    /// Generated tokens.
    pub generated: usize,
    /// Longest common subsequence of the file's and the answer's tokens: file tokens
    /// reproduced in order.
    pub in_order: usize,
    /// Longest span of the file copied verbatim (tokens).
    pub longest_copy: usize,
    /// Non-blank lines of the file that appear in the answer in order (line-level common
    /// subsequence).
    pub lines: usize,
    /// The file's non-blank lines.
    pub file_lines: usize,
}

/// Compare a rewrite's answer with the file it was asked to give back (token ids and text).
pub fn reproduction(
    file_ids: &[u32],
    answer_ids: &[u32],
    file_text: &str,
    answer_text: &str,
) -> Reproduction {
    // Blank lines would match anywhere: only lines with text count.
    let text_lines = |t: &'_ str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect()
    };
    let (file_lines, answer_lines) = (text_lines(file_text), text_lines(answer_text));
    Reproduction {
        file_tokens: file_ids.len(),
        generated: answer_ids.len(),
        in_order: common_subsequence(file_ids, answer_ids),
        longest_copy: longest_common_span(file_ids, answer_ids),
        lines: common_subsequence(&file_lines, &answer_lines),
        file_lines: file_lines.len(),
    }
}

/// Length of the longest common subsequence of `a` and `b` (one row of the table at a time).
fn common_subsequence<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    let mut prev = vec![0usize; b.len() + 1];
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        for (j, y) in b.iter().enumerate() {
            row[j + 1] = if x == y {
                prev[j] + 1
            } else {
                row[j].max(prev[j + 1])
            };
        }
        std::mem::swap(&mut prev, &mut row);
    }
    prev[b.len()]
}

/// Length of the longest span that `a` and `b` share (longest common substring).
fn longest_common_span<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    let mut prev = vec![0usize; b.len() + 1];
    let mut row = vec![0usize; b.len() + 1];
    let mut best = 0;
    for x in a {
        for (j, y) in b.iter().enumerate() {
            row[j + 1] = if x == y { prev[j] + 1 } else { 0 };
            best = best.max(row[j + 1]);
        }
        std::mem::swap(&mut prev, &mut row);
    }
    best
}

/// The file-rewrite prompt: the file, an instruction, and the opening of the answer.
pub fn rewrite_prompt(file_text: &str, edit: &str) -> String {
    format!(
        "Here is a source file:\n\n```\n{file_text}\n```\n\n{edit} Reply with the whole file and nothing else.\n\n```\n"
    )
}

/// Greedy generation of up to `max_tokens` after `prompt` (stopping at `stop_ids`), plainly and
/// with each of `modes` (`SpecMode::Off` is always run first as the baseline). A whole-file
/// rewrite passes [`rewrite_budget`] and the model's end-of-sequence ids; the fixed-length
/// variant a token count and no stop ids.
pub fn file_rewrite<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    max_tokens: usize,
    stop_ids: &[u32],
    modes: &[SpecMode],
    spec: &SpecConfig,
    mut on_run: impl FnMut(&RewriteRun),
) -> Result<Vec<RewriteRun>, ModelError> {
    let opts = GenerateOptions {
        max_tokens,
        stop_ids: stop_ids.to_vec(),
    };
    let (base, stats) = generate(
        model,
        &mut model.new_state(),
        prompt,
        &mut Sampler::new(SamplerConfig::greedy()),
        &opts,
        |_| true,
    )?;
    let plain = RewriteRun::plain(base.clone(), &stats);
    on_run(&plain);
    let mut out = vec![plain];
    for &mode in modes.iter().filter(|m| **m != SpecMode::Off) {
        if matches!(mode, SpecMode::Mtp | SpecMode::Both) && !model.has_mtp() {
            continue;
        }
        let cfg = SpecConfig {
            mode,
            ..spec.clone()
        };
        let (ids, stats, s) = generate_speculative(
            model,
            &mut model.new_state(),
            prompt,
            &mut Sampler::new(SamplerConfig::greedy()),
            &opts,
            &cfg,
            |_| true,
        )?;
        let run = RewriteRun::speculative(mode, ids, &stats, s, &base);
        on_run(&run);
        out.push(run);
    }
    Ok(out)
}

/// One verify pass of a replayed rewrite ([`lookup_replay`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayPass {
    /// The rows fed: the pending token and its drafts.
    pub tokens: Vec<u32>,
    /// Rows kept: the pending token and the accepted drafts.
    pub kept: usize,
}

/// The verify passes greedy prompt-lookup decoding makes when the model's answer is `target` —
/// as if the model wrote exactly the expected rewrite: drafts from a [`LookupDrafter`] over the
/// prompt and the answer so far, accepted while they equal the target, capped by the budget of
/// `target.len()` tokens as in [`generate_speculative`]. `target[0]` comes from the prompt pass;
/// the passes then feed `target[..len - 1]`, as plain decoding's `len - 1` steps do.
pub fn lookup_replay(prompt: &[u32], target: &[u32], spec: &SpecConfig) -> Vec<ReplayPass> {
    let mut drafter = LookupDrafter::new(spec);
    let mut passes = Vec::new();
    let Some(&first) = target.first() else {
        return passes;
    };
    let mut history = prompt.to_vec();
    history.push(first);
    // Tokens of `target` emitted so far.
    let mut done = 1;
    while done < target.len() {
        let drafts = drafter.draft(&history, target.len() - done - 1);
        let accepted = drafts
            .iter()
            .zip(&target[done..])
            .take_while(|(d, t)| d == t)
            .count();
        drafter.update(drafts.len(), accepted);
        let mut tokens = vec![target[done - 1]];
        tokens.extend_from_slice(&drafts);
        passes.push(ReplayPass {
            tokens,
            kept: accepted + 1,
        });
        // The accepted drafts and the token the model samples after them.
        history.extend_from_slice(&target[done..done + accepted + 1]);
        done += accepted + 1;
    }
    passes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproduction_counts_tokens_spans_and_lines() {
        let file = [1, 2, 3, 4, 5, 6];
        // A comment token in front, one token changed, the end missing.
        let answer = [9, 1, 2, 3, 7, 5];
        let r = reproduction(&file, &answer, "a\nb\n\nc\nd", "# new\na\n\nc\nd\nd");
        assert_eq!(r.in_order, 4);
        assert_eq!(r.longest_copy, 3);
        assert_eq!((r.lines, r.file_lines), (3, 4));
        assert_eq!((r.file_tokens, r.generated), (6, 6));
        assert_eq!(common_subsequence::<u32>(&[], &[1]), 0);
        assert_eq!(longest_common_span(&[1, 2], &[3]), 0);
    }

    #[test]
    fn replay_feeds_the_target_like_plain_decoding() {
        // The prompt holds the answer's text; the answer copies it with a new first token.
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        let target = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11];
        for follow in [true, false] {
            let spec = SpecConfig {
                ngram_min: 1,
                lookup_follow: follow,
                ..SpecConfig::default()
            };
            let passes = lookup_replay(&prompt, &target, &spec);
            // The kept rows are the target's tokens before the last, in order.
            let fed: Vec<u32> = passes
                .iter()
                .flat_map(|p| p.tokens[..p.kept].to_vec())
                .collect();
            assert_eq!(fed, target[..target.len() - 1]);
            assert!(passes.len() < target.len() - 1, "{passes:?}");
            assert!(passes.iter().all(|p| p.kept <= p.tokens.len()));
        }
        assert!(lookup_replay(&prompt, &[], &SpecConfig::default()).is_empty());
    }
}
