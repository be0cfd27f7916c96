//! Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, seeded RNG.
//!
//! One step of [`Sampler::sample`] goes through, in this order:
//!
//! 1. **penalties** over the last `penalty_last_n` tokens of `history`, as llama.cpp's
//!    `penalties` sampler does: for a token seen `c > 0` times, a positive logit is divided by
//!    `repeat_penalty` and a non-positive one multiplied by it, then
//!    `c * frequency_penalty + presence_penalty` is subtracted;
//! 2. **greedy** when `temperature <= 0`, or so small that the largest logit divided by it
//!    overflows f32 (where the tempered softmax is all on the largest logit anyway): the argmax
//!    of the penalised logits, lowest id on ties;
//! 3. otherwise **temperature** (logits divided by it), **top-k** (keep the k largest),
//!    **top-p** (keep the smallest prefix of the sorted distribution whose mass reaches `top_p`),
//!    **min-p** (keep tokens whose probability is at least `min_p` times the largest),
//!    softmax over what is left and a draw with a seeded ChaCha8 RNG: the same seed and the same
//!    inputs give the same tokens on every platform.
//!
//! The order of step 3 is Hugging Face's (temperature first). llama.cpp's default chain applies
//! temperature last (top-k/top-p/min-p see the untempered distribution); at temperature 1 the two
//! agree.
//!
//! NaN logits are treated as `-inf` (never chosen); the sampler never panics on its input.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampling settings. The default is greedy decoding with every filter and penalty off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; `<= 0` (or NaN) selects greedy decoding.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's; 0 disables.
    pub min_p: f32,
    /// llama.cpp-style repetition penalty (> 1 discourages repeats); 1 disables.
    pub repeat_penalty: f32,
    /// Subtracted once from the logit of every token present in the penalty window.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the penalty window.
    pub frequency_penalty: f32,
    /// How many of the most recent `history` tokens the penalties look at: 0 disables the
    /// penalties, a negative value means the whole history (llama.cpp's `-1`).
    pub penalty_last_n: i32,
    /// RNG seed.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding (the default).
    pub fn greedy() -> Self {
        Self::default()
    }

    /// llama.cpp's default sampling settings (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
    /// no penalties) with the given seed.
    pub fn llama_cpp_defaults(seed: u64) -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            seed,
            ..Self::default()
        }
    }

    /// Whether this configuration decodes greedily.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// Whether any penalty is active.
    fn has_penalties(&self) -> bool {
        self.penalty_last_n != 0
            && (self.repeat_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

/// The outcome of one sampling step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    /// The chosen token id.
    pub token: u32,
    /// Its probability under the distribution it was drawn from: after penalties, temperature
    /// and the truncations, renormalised. For greedy decoding: the softmax (temperature 1) of the
    /// penalised logits.
    pub prob: f32,
}

/// A stateful sampler: the configuration plus its RNG.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha8Rng,
    /// Scratch buffer for penalised logits (reused across steps).
    scratch: Vec<f32>,
    /// Scratch buffer of (token, logit) candidates.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `cfg`, its RNG seeded with `cfg.seed`. Out-of-range settings are clamped
    /// to their neutral value: `top_p` outside (0, 1] and NaN → 1, `min_p` to [0, 1] (NaN → 0),
    /// a non-positive or NaN `repeat_penalty` → 1, NaN presence/frequency penalties → 0.
    pub fn new(mut cfg: SamplerConfig) -> Self {
        if !(cfg.top_p > 0.0 && cfg.top_p <= 1.0) {
            cfg.top_p = 1.0;
        }
        cfg.min_p = if cfg.min_p.is_nan() {
            0.0
        } else {
            cfg.min_p.clamp(0.0, 1.0)
        };
        if !(cfg.repeat_penalty > 0.0 && cfg.repeat_penalty.is_finite()) {
            cfg.repeat_penalty = 1.0;
        }
        if !cfg.presence_penalty.is_finite() {
            cfg.presence_penalty = 0.0;
        }
        if !cfg.frequency_penalty.is_finite() {
            cfg.frequency_penalty = 0.0;
        }
        let rng = ChaCha8Rng::seed_from_u64(cfg.seed);
        Self {
            cfg,
            rng,
            scratch: Vec::new(),
            candidates: Vec::new(),
        }
    }

    /// The (sanitised) configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Restarts the RNG from `seed` (also stored in the configuration).
    pub fn reseed(&mut self, seed: u64) {
        self.cfg.seed = seed;
        self.rng = ChaCha8Rng::seed_from_u64(seed);
    }

    /// Picks the next token from `logits` (one per vocabulary entry) given the tokens so far
    /// (`history`, used by the penalties). Returns 0 when `logits` is empty.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.cfg.is_greedy() {
            // The token alone: no softmax for its probability (an f64 `exp` per vocabulary
            // entry, ≈ 50 µs a row at a 10K vocabulary, which `sample_detailed` pays).
            if !self.cfg.has_penalties() {
                return greedy_token(logits);
            }
            let mut work = std::mem::take(&mut self.scratch);
            work.clear();
            work.extend_from_slice(logits);
            apply_penalties(&mut work, history, &self.cfg);
            let token = greedy_token(&work);
            self.scratch = work;
            return token;
        }
        self.sample_detailed(logits, history).map_or(0, |s| s.token)
    }

    /// Like [`Sampler::sample`], also returning the chosen token's probability; `None` when
    /// `logits` is empty.
    pub fn sample_detailed(&mut self, logits: &[f32], history: &[u32]) -> Option<Sampled> {
        if logits.is_empty() {
            return None;
        }
        let mut work = std::mem::take(&mut self.scratch);
        work.clear();
        work.extend(
            logits
                .iter()
                .map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l }),
        );
        if self.cfg.has_penalties() {
            apply_penalties(&mut work, history, &self.cfg);
        }
        let result = if self.cfg.is_greedy() {
            let token = argmax(&work).unwrap_or(0);
            let prob = softmax_prob_of(&work, token as usize);
            Sampled { token, prob }
        } else {
            self.sample_filtered(&work)
        };
        self.scratch = work;
        Some(result)
    }

    /// Step 3 of the module docs, on penalised, NaN-free logits.
    fn sample_filtered(&mut self, logits: &[f32]) -> Sampled {
        let inv_t = 1.0 / self.cfg.temperature;
        let cands = &mut self.candidates;
        cands.clear();
        cands.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| **l > f32::NEG_INFINITY)
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        if cands.is_empty() {
            // Every logit is -inf: nothing is preferable; fall back to the lowest id.
            return Sampled {
                token: 0,
                prob: 1.0 / logits.len() as f32,
            };
        }
        if self.cfg.top_k > 0 && self.cfg.top_k < cands.len() {
            cands.select_nth_unstable_by(self.cfg.top_k - 1, candidate_order);
            cands.truncate(self.cfg.top_k);
        }

        // Unnormalised softmax weights exp(l - max); `total` normalises them.
        let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        if !inv_t.is_finite() || max == f32::INFINITY {
            // A temperature so small (e.g. 1e-38) that the largest logit / T overflows: the
            // tempered softmax is all on the largest logit, i.e. greedy decoding (the weights
            // would be NaN here).
            let token = argmax(logits).unwrap_or(0);
            let prob = softmax_prob_of(logits, token as usize);
            return Sampled { token, prob };
        }
        let weight = |l: f32| f64::from(l - max).exp();
        let total: f64 = cands.iter().map(|c| weight(c.1)).sum();

        if self.cfg.top_p < 1.0 {
            let keep = top_p_prefix(cands, f64::from(self.cfg.top_p) * total, weight);
            cands.truncate(keep);
        }
        let mut probs: Vec<f64> = cands.iter().map(|c| weight(c.1) / total).collect();

        // min-p: relative to the most likely remaining token (renormalisation does not change
        // the ratio).
        if self.cfg.min_p > 0.0 {
            let p_max = probs.iter().copied().fold(0.0, f64::max);
            let threshold = f64::from(self.cfg.min_p) * p_max;
            let mut j = 0;
            for i in 0..probs.len() {
                if probs[i] >= threshold {
                    probs[j] = probs[i];
                    cands[j] = cands[i];
                    j += 1;
                }
            }
            probs.truncate(j);
            cands.truncate(j);
        }

        // Draw: u uniform in [0, mass), walk the cumulative distribution.
        let mass: f64 = probs.iter().sum();
        let u = self.rng.random::<f64>() * mass;
        let mut cum = 0.0;
        let mut chosen = probs.len() - 1;
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if u < cum {
                chosen = i;
                break;
            }
        }
        Sampled {
            token: cands[chosen].0,
            prob: (probs[chosen] / mass) as f32,
        }
    }
}

/// Highest logit first, lowest id first among equals: a total, deterministic order.
fn candidate_order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Top-p: sorts the head of `cands` (descending, see [`candidate_order`]) and returns the length
/// of the smallest prefix whose weight reaches `target` (at least 1; all when never reached).
///
/// Equivalent to sorting everything, but only sorts as many candidates as needed: it selects the
/// best `k` (O(n)), sorts those and widens `k` fourfold while their mass falls short.
fn top_p_prefix(cands: &mut [(u32, f32)], target: f64, weight: impl Fn(f32) -> f64) -> usize {
    let n = cands.len();
    let mut k = n.min(256);
    loop {
        if k < n {
            cands.select_nth_unstable_by(k - 1, candidate_order);
        }
        cands[..k].sort_unstable_by(candidate_order);
        let mut cum = 0.0;
        for (i, c) in cands[..k].iter().enumerate() {
            cum += weight(c.1);
            if cum >= target {
                return i + 1;
            }
        }
        if k == n {
            return n;
        }
        k = n.min(k.saturating_mul(4));
    }
}

/// Applies llama.cpp's repetition, frequency and presence penalties in place to the tokens that
/// occur in the last `cfg.penalty_last_n` entries of `history` (ids outside `logits` are ignored).
pub fn apply_penalties(logits: &mut [f32], history: &[u32], cfg: &SamplerConfig) {
    let window = match usize::try_from(cfg.penalty_last_n) {
        Ok(0) => return,
        Ok(n) => &history[history.len().saturating_sub(n)..],
        Err(_) => history, // negative: the whole history
    };
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in window {
        if (t as usize) < logits.len() {
            *counts.entry(t).or_insert(0) += 1;
        }
    }
    for (&t, &c) in &counts {
        let l = &mut logits[t as usize];
        if *l <= 0.0 {
            *l *= cfg.repeat_penalty;
        } else {
            *l /= cfg.repeat_penalty;
        }
        *l -= c as f32 * cfg.frequency_penalty + cfg.presence_penalty;
    }
}

/// Index of the largest value, lowest index on ties, NaN ignored; `None` when empty or all NaN.
pub fn argmax(values: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// The greedy token of `logits` with NaN read as `-inf`, lowest id on ties, 0 for an empty or
/// all-NaN/`-inf` row: the same token as [`argmax`] of the NaN-mapped row (what
/// [`Sampler::sample_detailed`] picks), found by a 16-lane maximum and a search for its first
/// occurrence (both vectorise; the scalar `argmax` loop does not).
fn greedy_token(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            // `v > m` is false for NaN: NaN never raises the maximum.
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(chunks.remainder()) {
        max = if v > max { v } else { max };
    }
    if max == f32::NEG_INFINITY {
        // Every entry is -inf or NaN: all map to -inf, the first one wins.
        return 0;
    }
    logits
        .iter()
        .position(|&v| v == max)
        .map_or(0, |i| i as u32)
}

/// The largest logit, NaN skipped; `-inf` for an empty or all-NaN row.
pub fn max_logit(logits: &[f32]) -> f32 {
    logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `ln Σ exp(v)` over the non-NaN `logits`, max-subtracted and accumulated in f64
/// (`max + ln Σ exp(v − max)`, the subtraction in f64). `None` when the largest logit is not
/// finite (empty row, all `-inf`, or a `+inf` present).
pub fn log_sum_exp_f64(logits: &[f32]) -> Option<f64> {
    let max = max_logit(logits);
    if !max.is_finite() {
        return None;
    }
    let max = f64::from(max);
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| (f64::from(v) - max).exp())
        .sum();
    Some(max + sum.ln())
}

/// Softmax of `logits` (max-subtracted, f64 accumulation). `-inf` maps to 0; NaN is treated as
/// `-inf`. All `-inf` (or empty) gives a uniform distribution (empty output for empty input).
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = max_logit(logits);
    if max == f32::NEG_INFINITY {
        let n = logits.len();
        return vec![1.0 / n as f32; n];
    }
    if max == f32::INFINITY {
        // +inf entries share the whole mass.
        let n_inf = logits.iter().filter(|v| **v == f32::INFINITY).count() as f32;
        return logits
            .iter()
            .map(|&v| if v == f32::INFINITY { 1.0 / n_inf } else { 0.0 })
            .collect();
    }
    let exps: Vec<f64> = logits
        .iter()
        .map(|&v| {
            if v.is_nan() {
                0.0
            } else {
                f64::from(v - max).exp()
            }
        })
        .collect();
    let total: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / total) as f32).collect()
}

/// Log-softmax of `logits` (`v - max - ln Σ exp(v - max)`, f64 accumulation). NaN is treated as
/// `-inf`; all `-inf` gives `-ln n` everywhere.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = max_logit(logits);
    if !max.is_finite() {
        return softmax(logits).iter().map(|p| p.ln()).collect();
    }
    let total: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| f64::from(v - max).exp())
        .sum();
    let lse = f64::from(max) + total.ln();
    logits
        .iter()
        .map(|&v| {
            if v.is_nan() {
                f32::NEG_INFINITY
            } else {
                (f64::from(v) - lse) as f32
            }
        })
        .collect()
}

/// softmax(logits)[index] without materialising the whole distribution.
fn softmax_prob_of(logits: &[f32], index: usize) -> f32 {
    let max = max_logit(logits);
    if !max.is_finite() {
        return softmax(logits).get(index).copied().unwrap_or(0.0);
    }
    let total: f64 = logits.iter().map(|&v| f64::from(v - max).exp()).sum();
    logits
        .get(index)
        .map_or(0.0, |&v| (f64::from(v - max).exp() / total) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            seed,
            ..Default::default()
        }
    }

    /// Draws `n` tokens and returns the per-token frequencies.
    fn frequencies(sampler: &mut Sampler, logits: &[f32], n: usize) -> Vec<f64> {
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[sampler.sample(logits, &[]) as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    #[test]
    fn tiny_temperatures_pick_the_largest_logit() {
        // 1 / 1e-45 is +inf in f32 and 30 / 1e-38 overflows: the tempered weights were NaN and
        // the draw fell to the last id. The limit of the softmax is the argmax.
        let logits = [0.5, 30.0, -2.0, 29.5, 0.0];
        for t in [1e-45, 1e-38, 1e-30] {
            let mut s = Sampler::new(cfg(t, 7));
            for _ in 0..20 {
                assert_eq!(s.sample(&logits, &[]), 1, "temperature {t}");
            }
        }
        // A small temperature that does not overflow still samples: at 0.2, ids 1 and 3 take
        // ≈ 0.924 and ≈ 0.076.
        let f = frequencies(&mut Sampler::new(cfg(0.2, 3)), &logits, 4000);
        assert!(
            (f[1] - 0.924).abs() < 0.03 && (f[3] - 0.076).abs() < 0.03,
            "{f:?}"
        );
    }

    #[test]
    fn greedy_picks_argmax_lowest_index_on_ties() {
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.5], &[]), 1);
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, 3.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, -5.0, f32::NAN], &[]), 1);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 3], &[]), 0);
        assert_eq!(s.sample(&[], &[]), 0);
        assert!(s.sample_detailed(&[], &[]).is_none());
        let d = s.sample_detailed(&[0.0, (3.0f32).ln()], &[]).unwrap();
        assert_eq!(d.token, 1);
        assert!((d.prob - 0.75).abs() < 1e-6, "{}", d.prob);
    }

    #[test]
    fn greedy_sample_is_the_detailed_token() {
        // `sample`'s greedy shortcut against `sample_detailed` (NaN mapped to -inf, then the
        // argmax), on rows with NaN, ±inf, signed zeros, ties and lengths around 16 lanes.
        let specials = [
            f32::NAN,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.0,
            -0.0,
            1.0,
            -1.0,
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for penalties in [false, true] {
            let config = SamplerConfig {
                repeat_penalty: if penalties { 1.3 } else { 1.0 },
                presence_penalty: if penalties { 0.5 } else { 0.0 },
                ..SamplerConfig::greedy()
            };
            let mut fast = Sampler::new(config.clone());
            let mut slow = Sampler::new(config);
            for len in [1usize, 2, 15, 16, 17, 31, 33, 100] {
                for _ in 0..200 {
                    let row: Vec<f32> = (0..len)
                        .map(|_| {
                            let r = next();
                            if r % 4 == 0 {
                                specials[(r >> 8) as usize % specials.len()]
                            } else {
                                ((r >> 16) % 9) as f32 - 4.0
                            }
                        })
                        .collect();
                    let history: Vec<u32> = (0..4).map(|_| (next() % len as u64) as u32).collect();
                    let want = slow.sample_detailed(&row, &history).unwrap().token;
                    assert_eq!(fast.sample(&row, &history), want, "{row:?} {history:?}");
                }
            }
        }
        let mut s = Sampler::new(SamplerConfig::greedy());
        assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY], &[]), 0);
        assert_eq!(s.sample(&[f32::NAN; 20], &[]), 0);
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.01)
            .collect();
        let want = argmax(&logits).unwrap();
        for seed in 0..20 {
            let mut s = Sampler::new(SamplerConfig {
                top_k: 1,
                ..cfg(1.3, seed)
            });
            let d = s.sample_detailed(&logits, &[]).unwrap();
            assert_eq!(d.token, want);
            assert_eq!(d.prob, 1.0);
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplerConfig::llama_cpp_defaults(seed));
            let mut hist = Vec::new();
            for _ in 0..200 {
                let t = s.sample(&logits, &hist);
                hist.push(t);
            }
            hist
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        // reseed restarts the stream.
        let mut s = Sampler::new(cfg(1.0, 7));
        let a: Vec<u32> = (0..50).map(|_| s.sample(&logits, &[])).collect();
        s.reseed(7);
        let b: Vec<u32> = (0..50).map(|_| s.sample(&logits, &[])).collect();
        assert_eq!(a, b);
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_mass() {
        // probabilities 0.5, 0.25, 0.125, 0.125 (as logits of their logs)
        let probs = [0.125f32, 0.5, 0.125, 0.25];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        // top_p 0.7: 0.5 < 0.7, 0.75 >= 0.7 → keep {1, 3}, renormalised to 2/3, 1/3.
        let mut s = Sampler::new(SamplerConfig {
            top_p: 0.7,
            ..cfg(1.0, 1)
        });
        let f = frequencies(&mut s, &logits, 20_000);
        assert_eq!(f[0], 0.0);
        assert_eq!(f[2], 0.0);
        assert!((f[1] - 2.0 / 3.0).abs() < 0.02, "{f:?}");
        // Exactly reaching the mass stops there: top_p 0.5 keeps only token 1.
        let mut s = Sampler::new(SamplerConfig {
            top_p: 0.5,
            ..cfg(1.0, 2)
        });
        for _ in 0..100 {
            let d = s.sample_detailed(&logits, &[]).unwrap();
            assert_eq!((d.token, d.prob), (1, 1.0));
        }
    }

    #[test]
    fn min_p_cuts_relative_to_the_best() {
        // p = 0.5, 0.25, 0.125, 0.125; min_p 0.3 → threshold 0.15 keeps {1, 3}.
        let probs = [0.125f32, 0.5, 0.125, 0.25];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(SamplerConfig {
            min_p: 0.3,
            ..cfg(1.0, 3)
        });
        let f = frequencies(&mut s, &logits, 20_000);
        assert_eq!(f[0] + f[2], 0.0, "{f:?}");
        assert!((f[3] - 1.0 / 3.0).abs() < 0.02, "{f:?}");
        // min_p 0.2 (threshold 0.1) keeps all four.
        let mut s = Sampler::new(SamplerConfig {
            min_p: 0.2,
            ..cfg(1.0, 3)
        });
        let f = frequencies(&mut s, &logits, 20_000);
        assert!(f.iter().all(|&x| x > 0.0), "{f:?}");
    }

    #[test]
    fn penalties_like_llama_cpp() {
        let cfg = SamplerConfig {
            repeat_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            penalty_last_n: 3,
            ..Default::default()
        };
        let mut logits = vec![4.0, -1.0, 2.0, 0.0, 1.0];
        // Token 4 is outside the window (last 3 = [1, 0, 1]); id 99 is out of range.
        apply_penalties(
            &mut logits,
            &[4, 99, 1, 0, 1],
            &SamplerConfig {
                penalty_last_n: 4,
                ..cfg.clone()
            },
        );
        // window [99, 1, 0, 1]: token 0 once → 4/2 - 0.5 - 0.25 = 1.25
        //                       token 1 twice → -1*2 - 1.0 - 0.25 = -3.25
        assert_eq!(logits, vec![1.25, -3.25, 2.0, 0.0, 1.0]);
        // Greedy on penalised logits: token 0 (4.0) loses to token 2.
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 3.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[4.0, 0.0, 2.0], &[0]), 2);
        // penalty_last_n 0 disables; negative means the whole history.
        let mut l = vec![4.0, 1.0];
        apply_penalties(
            &mut l,
            &[0],
            &SamplerConfig {
                penalty_last_n: 0,
                ..cfg.clone()
            },
        );
        assert_eq!(l, vec![4.0, 1.0]);
        let mut l = vec![4.0, 1.0];
        apply_penalties(
            &mut l,
            &[0, 1, 1, 1, 1],
            &SamplerConfig {
                penalty_last_n: -1,
                ..cfg
            },
        );
        assert_eq!(l, vec![1.25, 0.5 - 2.0 - 0.25]);
    }

    #[test]
    fn temperature_one_matches_softmax() {
        let logits = [1.0f32, 0.0, 2.0, -1.0, 0.5, 1.5];
        let want = softmax(&logits);
        let mut s = Sampler::new(cfg(1.0, 12345));
        let f = frequencies(&mut s, &logits, 20_000);
        for (i, (&p, &q)) in want.iter().zip(&f).enumerate() {
            // ~4.5 standard deviations of a binomial proportion, and a few percent relative.
            let sd = (f64::from(p) * (1.0 - f64::from(p)) / 20_000.0).sqrt();
            assert!(
                (f64::from(p) - q).abs() < 4.5 * sd,
                "token {i}: want {p}, got {q}"
            );
        }
        // Temperature 0.5 sharpens exactly like softmax(2 * logits).
        let doubled: Vec<f32> = logits.iter().map(|l| l * 2.0).collect();
        let want = softmax(&doubled);
        let mut s = Sampler::new(cfg(0.5, 99));
        let f = frequencies(&mut s, &logits, 20_000);
        for (&p, &q) in want.iter().zip(&f) {
            let sd = (f64::from(p) * (1.0 - f64::from(p)) / 20_000.0).sqrt();
            assert!(
                (f64::from(p) - q).abs() < 4.5 * sd + 1e-9,
                "want {p}, got {q}"
            );
        }
    }

    #[test]
    fn prob_of_sampled_token_is_renormalised() {
        let logits = [0.0f32, 0.0, f32::NEG_INFINITY, f32::NAN];
        let mut s = Sampler::new(cfg(1.0, 5));
        for _ in 0..50 {
            let d = s.sample_detailed(&logits, &[]).unwrap();
            assert!(d.token < 2);
            assert!((d.prob - 0.5).abs() < 1e-6);
        }
    }

    #[test]
    fn softmax_and_log_softmax() {
        let p = softmax(&[1.0, 2.0, 3.0]);
        let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|x| x.exp()).collect();
        let z: f64 = e.iter().sum();
        for (a, b) in p.iter().zip(&e) {
            assert!((f64::from(*a) - b / z).abs() < 1e-7);
        }
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        for (a, b) in lp.iter().zip(&p) {
            assert!((a - b.ln()).abs() < 1e-6);
        }
        // Large logits do not overflow.
        let p = softmax(&[1000.0, 1000.0]);
        assert_eq!(p, vec![0.5, 0.5]);
        let lp = log_softmax(&[1000.0, f32::NEG_INFINITY]);
        assert_eq!(lp, vec![0.0, f32::NEG_INFINITY]);
        assert_eq!(
            softmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]),
            vec![0.5, 0.5]
        );
        assert!(softmax(&[]).is_empty());
    }

    #[test]
    fn bad_settings_are_neutralised() {
        let s = Sampler::new(SamplerConfig {
            top_p: 0.0,
            min_p: f32::NAN,
            repeat_penalty: -1.0,
            presence_penalty: f32::INFINITY,
            ..cfg(f32::NAN, 0)
        });
        let c = s.config();
        assert_eq!(
            (c.top_p, c.min_p, c.repeat_penalty, c.presence_penalty),
            (1.0, 0.0, 1.0, 0.0)
        );
        assert!(c.is_greedy());
    }

    #[test]
    fn partial_top_p_equals_full_sort() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for &(n, scale) in &[
            (10usize, 1.0f32),
            (300, 0.1),
            (5000, 0.01),
            (5000, 3.0),
            (20_000, 0.5),
        ] {
            for &top_p in &[0.1f64, 0.5, 0.9, 0.999, 0.99999] {
                let mut cands: Vec<(u32, f32)> = (0..n as u32)
                    .map(|i| (i, (rng.random::<f32>() * 20.0).round() * scale))
                    .collect();
                let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
                let weight = |l: f32| f64::from(l - max).exp();
                let total: f64 = cands.iter().map(|c| weight(c.1)).sum();
                let mut full = cands.clone();
                full.sort_by(candidate_order);
                let mut cum = 0.0;
                let want = full
                    .iter()
                    .position(|c| {
                        cum += weight(c.1);
                        cum >= top_p * total
                    })
                    .map_or(n, |i| i + 1);
                let keep = top_p_prefix(&mut cands, top_p * total, weight);
                assert_eq!(keep, want, "n {n} scale {scale} top_p {top_p}");
                assert_eq!(&cands[..keep], &full[..keep]);
            }
        }
    }
}
