//! Perplexity by llama.cpp's method (`llama-perplexity`), so the figures compare one to one.
//!
//! The whole text is tokenized once (a BOS is put in front of each chunk only when the vocabulary
//! asks for one) and cut into non-overlapping chunks of `ctx` tokens; a trailing partial chunk is
//! dropped. Each chunk runs from an empty sequence state. Only the second half of each chunk is
//! scored: with `first = ctx / 2`, the logits at positions `first ..= ctx − 2` predict tokens
//! `first + 1 ..= ctx − 1`, i.e. `ctx − first − 1` predictions per chunk. The estimate is
//! `exp(mean NLL)`, and its error `ppl · sqrt((E[nll²] − E[nll]²) / (n − 1))`, as llama.cpp
//! prints them (`Final estimate: PPL = … +/- …`).

use std::thread;

use redlite_model::{Backend, Mode, Model, ModelError};

use crate::sampler::log_sum_exp_f64;

/// Errors from a perplexity run.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    #[error("context size {0} is too small: it must be at least 4 tokens")]
    ContextTooSmall(usize),
    #[error(
        "the text tokenizes to only {tokens} tokens; a context of {ctx} needs at least {} (two chunks, as llama-perplexity requires)",
        2 * ctx
    )]
    TooFewTokens { tokens: usize, ctx: usize },
    #[error("chunk {chunk}: {source}")]
    Model {
        chunk: usize,
        #[source]
        source: ModelError,
    },
    #[error("chunk {chunk}: the model returned {got} logit rows for {expected} tokens")]
    RowCount {
        chunk: usize,
        got: usize,
        expected: usize,
    },
}

/// How to run a perplexity measurement.
#[derive(Debug, Clone)]
pub struct PerplexityOptions {
    /// Tokens per chunk (llama.cpp's `-c`).
    pub ctx: usize,
    /// Evaluate at most this many chunks (llama.cpp's `--chunks`); `None`: all full chunks.
    pub max_chunks: Option<usize>,
    /// Replace the first token of each chunk with this id (llama.cpp does so when the vocabulary's
    /// `add_bos_token` is set). `None` for vocabularies without a BOS, such as Qwen's.
    pub bos: Option<u32>,
    /// How many chunks run at the same time, one thread each (at least 1). Chunks are independent,
    /// so the result does not depend on it.
    pub parallel_chunks: usize,
}

impl Default for PerplexityOptions {
    fn default() -> Self {
        PerplexityOptions {
            ctx: 512,
            max_chunks: None,
            bos: None,
            parallel_chunks: 1,
        }
    }
}

/// Running sums of per-token negative log-likelihoods (nats).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NllStats {
    pub sum: f64,
    pub sum_sq: f64,
    pub count: usize,
}

impl NllStats {
    /// Adds one token's negative log-likelihood.
    pub fn push(&mut self, nll: f64) {
        self.sum += nll;
        self.sum_sq += nll * nll;
        self.count += 1;
    }

    /// Adds another set of sums.
    pub fn merge(&mut self, other: &NllStats) {
        self.sum += other.sum;
        self.sum_sq += other.sum_sq;
        self.count += other.count;
    }

    /// Mean negative log-likelihood (NaN when empty).
    pub fn mean_nll(&self) -> f64 {
        self.sum / self.count as f64
    }

    /// `exp(mean NLL)`.
    pub fn ppl(&self) -> f64 {
        self.mean_nll().exp()
    }

    /// The standard error of the perplexity estimate as llama.cpp computes it:
    /// `ppl · sqrt((E[nll²] − E[nll]²) / (n − 1))`. `None` when it is undefined (fewer than two
    /// tokens, or a non-positive variance).
    pub fn ppl_stderr(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = self.sum_sq / n - mean * mean;
        (var > 0.0).then(|| (var / (n - 1.0)).sqrt() * self.ppl())
    }
}

/// The outcome of one chunk, reported as soon as it (and every chunk before it) is done.
#[derive(Debug, Clone, Copy)]
pub struct ChunkResult {
    /// 0-based chunk index.
    pub index: usize,
    /// Number of chunks that will be evaluated.
    pub total: usize,
    /// This chunk's scored tokens.
    pub chunk: NllStats,
    /// All scored tokens so far (chunks `0 ..= index`): `running.ppl()` is the figure llama.cpp
    /// prints as `[index+1]ppl,`.
    pub running: NllStats,
}

/// The result of a whole run.
#[derive(Debug, Clone)]
pub struct PerplexityReport {
    /// Tokens in the text (after BOS handling; before chunking).
    pub n_tokens: usize,
    pub ctx: usize,
    pub chunks: usize,
    pub stats: NllStats,
    /// Running estimate after each chunk.
    pub running_ppl: Vec<f64>,
}

impl PerplexityReport {
    pub fn ppl(&self) -> f64 {
        self.stats.ppl()
    }

    pub fn ppl_stderr(&self) -> Option<f64> {
        self.stats.ppl_stderr()
    }

    /// llama.cpp's running line: `[1]64.1234,[2]…,`.
    pub fn running_line(&self) -> String {
        self.running_ppl
            .iter()
            .enumerate()
            .map(|(i, p)| format!("[{}]{:.4},", i + 1, p))
            .collect()
    }
}

/// Negative log-likelihood of `token` under `softmax(logits)`: `max + ln Σ exp(l − max) − l[token]`,
/// accumulated in f64. Infinite when the token is out of range or has zero probability.
pub fn token_nll(logits: &[f32], token: u32) -> f64 {
    match (logits.get(token as usize), log_sum_exp_f64(logits)) {
        (Some(&target), Some(lse)) if !target.is_nan() => lse - f64::from(target),
        _ => f64::INFINITY,
    }
}

/// Index of the first scored logit row in a chunk of `ctx` tokens (llama.cpp's `first`).
pub fn first_scored(ctx: usize) -> usize {
    ctx / 2
}

/// Number of full chunks a text of `n_tokens` gives, capped by `max_chunks`.
pub fn chunk_count(n_tokens: usize, ctx: usize, max_chunks: Option<usize>) -> usize {
    let full = n_tokens / ctx.max(1);
    max_chunks.map_or(full, |m| m.min(full))
}

/// Scores one chunk: runs `tokens` (exactly `ctx` of them) from an empty state and sums the NLL of
/// tokens `first + 1 ..` given the logits at `first ..`.
pub fn score_chunk<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    bos: Option<u32>,
    index: usize,
) -> Result<NllStats, PerplexityError> {
    let mut input = tokens.to_vec();
    if let (Some(b), Some(t0)) = (bos, input.first_mut()) {
        *t0 = b;
    }
    let mut state = model.new_state();
    let hidden = model
        .forward_hidden(&mut state, &input, Mode::Prefill)
        .map_err(|source| PerplexityError::Model {
            chunk: index,
            source,
        })?;
    if hidden.len() != tokens.len() {
        return Err(PerplexityError::RowCount {
            chunk: index,
            got: hidden.len(),
            expected: tokens.len(),
        });
    }
    // Only the scored rows go through the lm_head.
    let first = first_scored(tokens.len());
    let logits = model.lm_head(&hidden[first..tokens.len() - 1]);
    let mut stats = NllStats::default();
    // The target is the original token (llama.cpp restores it after swapping in the BOS).
    for (row, &target) in logits.iter().zip(&tokens[first + 1..]) {
        stats.push(token_nll(row, target));
    }
    Ok(stats)
}

/// Perplexity of `model` over `tokens` (the whole tokenized text). `on_chunk` sees each chunk's
/// result in order, as it completes.
pub fn perplexity<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    opts: &PerplexityOptions,
    mut on_chunk: impl FnMut(&ChunkResult),
) -> Result<PerplexityReport, PerplexityError> {
    let ctx = opts.ctx;
    if ctx < 4 {
        return Err(PerplexityError::ContextTooSmall(ctx));
    }
    if tokens.len() < 2 * ctx {
        return Err(PerplexityError::TooFewTokens {
            tokens: tokens.len(),
            ctx,
        });
    }
    let total = chunk_count(tokens.len(), ctx, opts.max_chunks);
    let width = opts.parallel_chunks.max(1);
    let mut running = NllStats::default();
    let mut running_ppl = Vec::with_capacity(total);
    let mut next = 0;
    while next < total {
        let group: Vec<usize> = (next..total.min(next + width)).collect();
        let results: Vec<Result<NllStats, PerplexityError>> = if group.len() == 1 {
            vec![score_chunk(
                model,
                &tokens[next * ctx..(next + 1) * ctx],
                opts.bos,
                next,
            )]
        } else {
            thread::scope(|s| {
                let handles: Vec<_> = group
                    .iter()
                    .map(|&i| {
                        s.spawn(move || {
                            score_chunk(model, &tokens[i * ctx..(i + 1) * ctx], opts.bos, i)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            })
        };
        for (i, r) in group.iter().zip(results) {
            let chunk = r?;
            running.merge(&chunk);
            running_ppl.push(running.ppl());
            on_chunk(&ChunkResult {
                index: *i,
                total,
                chunk,
                running,
            });
        }
        next += group.len();
    }
    Ok(PerplexityReport {
        n_tokens: tokens.len(),
        ctx,
        chunks: total,
        stats: running,
        running_ppl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_nll_matches_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0, -1.0];
        let lse = logits.iter().map(|&v| f64::from(v).exp()).sum::<f64>().ln();
        for t in 0..4u32 {
            let want = lse - f64::from(logits[t as usize]);
            assert!((token_nll(&logits, t) - want).abs() < 1e-12);
        }
        assert_eq!(token_nll(&logits, 4), f64::INFINITY);
        // Uniform over n: nll = ln n.
        assert!((token_nll(&[0.5; 8], 3) - 8f64.ln()).abs() < 1e-12);
        // -inf entries are just zero probability.
        assert!((token_nll(&[0.0, f32::NEG_INFINITY], 0)).abs() < 1e-12);
        assert_eq!(token_nll(&[0.0, f32::NEG_INFINITY], 1), f64::INFINITY);
    }

    #[test]
    fn stats_follow_llama_cpp_formulas() {
        let mut s = NllStats::default();
        for v in [1.0, 2.0, 3.0, 4.0] {
            s.push(v);
        }
        assert_eq!(s.count, 4);
        assert!((s.mean_nll() - 2.5).abs() < 1e-12);
        assert!((s.ppl() - 2.5f64.exp()).abs() < 1e-9);
        // E[v²] − E[v]² = 7.5 − 6.25 = 1.25; /(n−1) = 1.25/3.
        let want = (1.25f64 / 3.0).sqrt() * 2.5f64.exp();
        assert!((s.ppl_stderr().unwrap() - want).abs() < 1e-9);
        let mut one = NllStats::default();
        one.push(1.0);
        assert_eq!(one.ppl_stderr(), None);
        let mut flat = NllStats::default();
        flat.push(2.0);
        flat.push(2.0);
        assert_eq!(flat.ppl_stderr(), None);
    }

    #[test]
    fn chunking_drops_the_partial_tail() {
        assert_eq!(first_scored(128), 64);
        assert_eq!(first_scored(7), 3);
        assert_eq!(chunk_count(1000, 128, None), 7);
        assert_eq!(chunk_count(1000, 128, Some(3)), 3);
        assert_eq!(chunk_count(1000, 128, Some(30)), 7);
        assert_eq!(chunk_count(127, 128, None), 0);
    }

    #[test]
    fn running_line_format() {
        let r = PerplexityReport {
            n_tokens: 0,
            ctx: 4,
            chunks: 2,
            stats: NllStats::default(),
            running_ppl: vec![64.51234, 65.0],
        };
        assert_eq!(r.running_line(), "[1]64.5123,[2]65.0000,");
    }
}
