//! Comparing two sets of logits row by row: KL divergence, top-1 agreement, largest logit
//! difference, and the first step where two greedy continuations part.
//!
//! The *reference* is the distribution taken as true (the float64 "exact" logits, or llama.cpp's),
//! the *candidate* is redlite's. `kl` is KL(reference ‖ candidate) = Σ p_ref · (ln p_ref − ln p_cand)
//! in nats, the direction `llama-perplexity --kl-divergence` and the reference README use;
//! `kl_reverse` is KL(candidate ‖ reference), which puts redlite in the reference's place.

use redlite_model::{Backend, Mode, Model, ModelError};

/// Errors from a comparison.
#[derive(Debug, thiserror::Error)]
pub enum ParityError {
    #[error("row {row}: reference has {reference} logits, candidate {candidate}")]
    WidthMismatch {
        row: usize,
        reference: usize,
        candidate: usize,
    },
    #[error("row {0}: empty logit row")]
    EmptyRow(usize),
}

/// Log-softmax in f64 (max-subtracted). NaN counts as `-inf`.
pub fn log_softmax_f64(logits: &[f32]) -> Vec<f64> {
    let Some(lse) = crate::sampler::log_sum_exp_f64(logits) else {
        // All -inf (or +inf present): fall back to the f32 helper's conventions.
        return crate::sampler::log_softmax(logits)
            .iter()
            .map(|&v| f64::from(v))
            .collect();
    };
    logits
        .iter()
        .map(|&v| {
            if v.is_nan() {
                f64::NEG_INFINITY
            } else {
                f64::from(v) - lse
            }
        })
        .collect()
}

/// KL(P ‖ Q) in nats from log-probabilities; terms with p = 0 contribute nothing.
pub fn kl_from_log_probs(log_p: &[f64], log_q: &[f64]) -> f64 {
    log_p
        .iter()
        .zip(log_q)
        .filter(|(lp, _)| lp.is_finite())
        .map(|(&lp, &lq)| lp.exp() * (lp - lq))
        .sum::<f64>()
        .max(0.0)
}

/// KL(softmax(p) ‖ softmax(q)) in nats.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    kl_from_log_probs(&log_softmax_f64(p_logits), &log_softmax_f64(q_logits))
}

/// Index of the largest value, lowest index on ties (the greedy sampler's rule); NaN is skipped.
pub fn argmax(values: &[f32]) -> Option<usize> {
    crate::sampler::argmax(values).map(|i| i as usize)
}

/// How one candidate row compares with its reference row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowComparison {
    /// KL(reference ‖ candidate).
    pub kl: f64,
    /// KL(candidate ‖ reference).
    pub kl_reverse: f64,
    /// max |reference − candidate| over the row.
    pub max_abs: f32,
    /// max |reference| over the row (for relative error).
    pub max_ref: f32,
    pub top1_ref: usize,
    pub top1_cand: usize,
    /// Reference logit gap between its top two entries (how close a top-1 disagreement was to a tie).
    pub ref_top2_gap: f32,
}

impl RowComparison {
    pub fn top1_agree(&self) -> bool {
        self.top1_ref == self.top1_cand
    }
}

/// Gap between the largest and second-largest finite value (infinite for a single entry).
pub fn top2_gap(values: &[f32]) -> f32 {
    let mut best = f32::NEG_INFINITY;
    let mut second = f32::NEG_INFINITY;
    for &v in values.iter().filter(|v| !v.is_nan()) {
        if v > best {
            second = best;
            best = v;
        } else if v > second {
            second = v;
        }
    }
    best - second
}

/// Compares one row. `row` is only used in errors.
pub fn compare_row(
    row: usize,
    reference: &[f32],
    candidate: &[f32],
) -> Result<RowComparison, ParityError> {
    if reference.len() != candidate.len() {
        return Err(ParityError::WidthMismatch {
            row,
            reference: reference.len(),
            candidate: candidate.len(),
        });
    }
    let (Some(top1_ref), Some(top1_cand)) = (argmax(reference), argmax(candidate)) else {
        return Err(ParityError::EmptyRow(row));
    };
    let lr = log_softmax_f64(reference);
    let lc = log_softmax_f64(candidate);
    let max_abs = reference
        .iter()
        .zip(candidate)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let max_ref = reference.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    Ok(RowComparison {
        kl: kl_from_log_probs(&lr, &lc),
        kl_reverse: kl_from_log_probs(&lc, &lr),
        max_abs,
        max_ref,
        top1_ref,
        top1_cand,
        ref_top2_gap: top2_gap(reference),
    })
}

/// Aggregate over many rows (possibly from several prompts).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ParityStats {
    pub rows: usize,
    pub kl_sum: f64,
    pub kl_max: f64,
    pub kl_reverse_sum: f64,
    pub kl_reverse_max: f64,
    pub top1_agree: usize,
    pub max_abs: f32,
    /// Largest max |Δ| / max |ref| over the rows.
    pub max_rel: f32,
}

impl ParityStats {
    pub fn push(&mut self, r: &RowComparison) {
        self.rows += 1;
        self.kl_sum += r.kl;
        self.kl_max = self.kl_max.max(r.kl);
        self.kl_reverse_sum += r.kl_reverse;
        self.kl_reverse_max = self.kl_reverse_max.max(r.kl_reverse);
        self.top1_agree += usize::from(r.top1_agree());
        self.max_abs = self.max_abs.max(r.max_abs);
        if r.max_ref > 0.0 {
            self.max_rel = self.max_rel.max(r.max_abs / r.max_ref);
        }
    }

    pub fn merge(&mut self, o: &ParityStats) {
        self.rows += o.rows;
        self.kl_sum += o.kl_sum;
        self.kl_max = self.kl_max.max(o.kl_max);
        self.kl_reverse_sum += o.kl_reverse_sum;
        self.kl_reverse_max = self.kl_reverse_max.max(o.kl_reverse_max);
        self.top1_agree += o.top1_agree;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.max_rel = self.max_rel.max(o.max_rel);
    }

    /// Mean KL(reference ‖ candidate) per row (0 when empty).
    pub fn kl_mean(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.kl_sum / self.rows as f64
        }
    }

    /// Mean KL(candidate ‖ reference) per row (0 when empty).
    pub fn kl_reverse_mean(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.kl_reverse_sum / self.rows as f64
        }
    }

    /// Fraction of rows whose argmax agrees (1 when empty).
    pub fn top1_rate(&self) -> f64 {
        if self.rows == 0 {
            1.0
        } else {
            self.top1_agree as f64 / self.rows as f64
        }
    }
}

/// Compares matching rows of two logit sets.
pub fn compare_rows<R: AsRef<[f32]>, C: AsRef<[f32]>>(
    reference: &[R],
    candidate: &[C],
) -> Result<(ParityStats, Vec<RowComparison>), ParityError> {
    let mut stats = ParityStats::default();
    let mut rows = Vec::with_capacity(reference.len());
    for (i, (r, c)) in reference.iter().zip(candidate).enumerate() {
        let cmp = compare_row(i, r.as_ref(), c.as_ref())?;
        stats.push(&cmp);
        rows.push(cmp);
    }
    Ok((stats, rows))
}

/// The first index where two token sequences differ (including one ending before the other);
/// `None` when they are identical.
pub fn first_divergence(a: &[u32], b: &[u32]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// Splits a flat little-endian f32 buffer into rows of `width`. Errors when the length does not
/// divide.
pub fn rows_from_le_bytes(bytes: &[u8], width: usize) -> Option<Vec<Vec<f32>>> {
    if width == 0 || !bytes.len().is_multiple_of(4 * width) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4 * width)
            .map(|row| {
                row.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            })
            .collect(),
    )
}

/// What redlite does with one prompt: the logits of every prompt position and a greedy
/// continuation.
#[derive(Debug, Clone, Default)]
pub struct PromptRun {
    /// `[prompt.len()][vocab]`: row i predicts token i + 1.
    pub logits: Vec<Vec<f32>>,
    /// Greedy tokens after the prompt (argmax, lowest id on ties; no stop token).
    pub greedy: Vec<u32>,
    /// At each greedy step, the gap between the top two logits the token was chosen from (a
    /// divergence at a step whose gap is within float rounding is a tie, not a bug).
    pub greedy_gaps: Vec<f32>,
}

/// Runs `prompt` from an empty state (in `mode`: one prefill pass, or one token per step) and
/// then `n_greedy` greedy tokens, one forward step each, as the reference continuations were made.
pub fn run_prompt<B: Backend>(
    model: &Model<B>,
    prompt: &[u32],
    mode: Mode,
    n_greedy: usize,
) -> Result<PromptRun, ModelError> {
    let mut state = model.new_state();
    let logits = match mode {
        Mode::Prefill => model.forward(&mut state, prompt, Mode::Prefill)?,
        Mode::Step => {
            let mut rows = Vec::with_capacity(prompt.len());
            for &id in prompt {
                rows.extend(model.forward(&mut state, &[id], Mode::Step)?);
            }
            rows
        }
    };
    let mut run = PromptRun {
        logits,
        ..Default::default()
    };
    let Some(mut last) = run.logits.last().cloned() else {
        return Ok(run);
    };
    for step in 0..n_greedy {
        let token = argmax(&last).unwrap_or(0) as u32;
        run.greedy.push(token);
        run.greedy_gaps.push(top2_gap(&last));
        if step + 1 < n_greedy {
            last = model
                .forward(&mut state, &[token], Mode::Step)?
                .pop()
                .unwrap_or_default();
        }
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_and_shift_invariant() {
        let a = [1.0f32, 2.0, 0.5, -3.0];
        let b: Vec<f32> = a.iter().map(|v| v + 7.0).collect();
        assert!(kl_divergence(&a, &a).abs() < 1e-15);
        assert!(kl_divergence(&a, &b).abs() < 1e-12);
    }

    #[test]
    fn kl_matches_hand_value() {
        // P = (0.5, 0.5), Q = (0.25, 0.75): KL = 0.5 ln 2 + 0.5 ln(2/3).
        let p = [0.0f32, 0.0];
        let q = [0.0f32, 3f32.ln()];
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_divergence(&p, &q) - want).abs() < 1e-7);
        let rev = 0.25 * 0.5f64.ln() + 0.75 * 1.5f64.ln();
        assert!((kl_divergence(&q, &p) - rev).abs() < 1e-7);
    }

    #[test]
    fn kl_ignores_zero_probability_reference_terms() {
        let p = [0.0f32, f32::NEG_INFINITY];
        let q = [0.0f32, 0.0];
        assert!((kl_divergence(&p, &q) - 2f64.ln()).abs() < 1e-12);
        assert_eq!(kl_divergence(&q, &p), f64::INFINITY);
    }

    #[test]
    fn row_comparison_and_stats() {
        let r = [[0.0f32, 1.0, 2.0], [3.0, 0.0, 0.0]];
        let c = [[0.0f32, 1.0, 2.5], [0.0, 3.0, 0.0]];
        let (stats, rows) = compare_rows(&r, &c).unwrap();
        assert_eq!(stats.rows, 2);
        assert_eq!(stats.top1_agree, 1);
        assert!(rows[0].top1_agree() && !rows[1].top1_agree());
        assert_eq!(rows[1].top1_ref, 0);
        assert_eq!(rows[1].top1_cand, 1);
        assert_eq!(stats.max_abs, 3.0);
        assert!((stats.max_rel - 1.0).abs() < 1e-7);
        assert!((rows[0].ref_top2_gap - 1.0).abs() < 1e-7);
        assert!((stats.top1_rate() - 0.5).abs() < 1e-12);
        assert!(stats.kl_max >= rows[0].kl && stats.kl_mean() > 0.0);
        let bad = compare_rows(&[[0.0f32, 1.0]], &[[0.0f32]]);
        assert!(matches!(bad, Err(ParityError::WidthMismatch { .. })));
    }

    #[test]
    fn divergence_points() {
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_divergence(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_divergence(&[], &[]), None);
    }

    #[test]
    fn rows_from_bytes() {
        let vals = [1.0f32, -2.0, 3.5, 0.25];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let rows = rows_from_le_bytes(&bytes, 2).unwrap();
        assert_eq!(rows, vec![vec![1.0, -2.0], vec![3.5, 0.25]]);
        assert!(rows_from_le_bytes(&bytes, 3).is_none());
        assert!(rows_from_le_bytes(&bytes, 0).is_none());
    }
}
