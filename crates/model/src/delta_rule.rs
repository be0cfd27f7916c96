//! The gated delta rule of one V head, as a one-token recurrence and as the chunked prompt algorithm.
//!
//! State `S ∈ R^{dk×dv}` (row-major `S[k][v]`). Per token, with decay α = exp(g) and write strength β:
//! `S ← α·S;  m = Sᵀk;  δ = β·(v − m);  S ← S + k ⊗ δ;  o = Sᵀq`.
//! The chunked form (HF `torch_chunk_gated_delta_rule`, chunk 64) computes the same outputs and final
//! state for a run of tokens with matrix products inside each chunk.

/// Which form of the delta rule a run of tokens uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaRule {
    /// The one-token recurrence, token after token.
    Step,
    /// The chunked prompt algorithm; `pos0` is the absolute position of the first token.
    Chunked { pos0: usize },
}

/// The delta rule for every V head of a layer, one head after another (the oracle's way; fast
/// backends run heads in parallel). `states` is `[heads, dk, dv]`; `traces`, when given (step
/// form only), receives each head's state after every token. Returns each head's `o`, `[t, dv]`.
pub fn delta_rule_heads(
    heads: &[HeadInputs],
    states: &mut [f32],
    rule: DeltaRule,
    mut traces: Option<&mut [Vec<f32>]>,
) -> Vec<Vec<f32>> {
    let per = heads.first().map_or(0, |h| h.dk * h.dv);
    heads
        .iter()
        .zip(states.chunks_exact_mut(per.max(1)))
        .enumerate()
        .map(|(h, (inp, s))| match rule {
            DeltaRule::Chunked { pos0 } => delta_rule_chunked(inp, pos0, s),
            DeltaRule::Step => {
                delta_rule_step_traced(inp, s, traces.as_deref_mut().and_then(|t| t.get_mut(h)))
            }
        })
        .collect()
}

/// Inputs of one V head for `t` tokens: q and k are `[t, dk]` (already L2-normalised, q scaled),
/// v is `[t, dv]`, β and g are `[t]`.
pub struct HeadInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: &'a [f32],
    pub g: &'a [f32],
    pub dk: usize,
    pub dv: usize,
}

impl HeadInputs<'_> {
    fn len(&self) -> usize {
        self.beta.len()
    }
}

/// Token-by-token recurrence. Returns `o` as `[t, dv]` and updates `s` in place.
pub fn delta_rule_step(inp: &HeadInputs, s: &mut [f32]) -> Vec<f32> {
    delta_rule_step_traced(inp, s, None)
}

/// [`delta_rule_step`], appending a copy of the state after every token to `trace` when given
/// (`[t, dk, dv]`; speculative verification rolls back to any of them).
#[inline(always)]
pub fn delta_rule_step_traced(
    inp: &HeadInputs,
    s: &mut [f32],
    mut trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    let (dk, dv) = (inp.dk, inp.dv);
    let mut out = vec![0.0f32; inp.len() * dv];
    let mut m = vec![0.0f32; dv];
    for t in 0..inp.len() {
        let q = &inp.q[t * dk..(t + 1) * dk];
        let k = &inp.k[t * dk..(t + 1) * dk];
        let v = &inp.v[t * dv..(t + 1) * dv];
        let alpha = inp.g[t].exp();
        for x in s.iter_mut() {
            *x *= alpha;
        }
        // m = Sᵀk
        m.fill(0.0);
        for (ki, row) in k.iter().zip(s.chunks_exact(dv)) {
            for (mj, sj) in m.iter_mut().zip(row) {
                *mj += sj * ki;
            }
        }
        // S += k ⊗ β(v − m)
        for (ki, row) in k.iter().zip(s.chunks_exact_mut(dv)) {
            for j in 0..dv {
                row[j] += ki * (inp.beta[t] * (v[j] - m[j]));
            }
        }
        // o = Sᵀq
        let o = &mut out[t * dv..(t + 1) * dv];
        for (qi, row) in q.iter().zip(s.chunks_exact(dv)) {
            for (oj, sj) in o.iter_mut().zip(row) {
                *oj += sj * qi;
            }
        }
        if let Some(trace) = trace.as_deref_mut() {
            trace.extend_from_slice(s);
        }
    }
    out
}

/// Chunk length of the prompt algorithm.
pub const CHUNK: usize = 64;

/// Chunked algorithm. Returns `o` as `[t, dv]` and updates `s` in place. Within a chunk of C rows,
/// with cumulative log-decay `G_i = Σ_{j≤i} g_j` and `D_ij = exp(G_i − G_j)` (i ≥ j):
/// `T = (I + strictly_lower(diag(β)·K·Kᵀ ⊙ D))⁻¹`, `U = T·diag(β)·V`, `W = T·diag(β·exp(G))·K`;
/// then `V' = U − W·S`, `O = diag(exp(G))·Q·S + lower(Q·Kᵀ ⊙ D)·V'`,
/// `S ← exp(G_C)·S + (diag(exp(G_C − G))·K)ᵀ·V'`.
///
/// Chunks are aligned to absolute positions: `pos0` is the position of the first token, and chunk
/// boundaries fall on multiples of [`CHUNK`], so a prompt computed in pieces split at such
/// multiples is bit-identical to the prompt computed at once.
#[inline(always)]
pub fn delta_rule_chunked(inp: &HeadInputs, pos0: usize, s: &mut [f32]) -> Vec<f32> {
    let (dk, dv) = (inp.dk, inp.dv);
    let n = inp.len();
    let mut out = vec![0.0f32; n * dv];
    let mut start = 0;
    while start < n {
        let c = (CHUNK - (pos0 + start) % CHUNK).min(n - start);
        let rows = start..start + c;
        let q = &inp.q[rows.start * dk..rows.end * dk];
        let k = &inp.k[rows.start * dk..rows.end * dk];
        let v = &inp.v[rows.start * dv..rows.end * dv];
        let beta = &inp.beta[rows.clone()];
        // Cumulative log-decay inside the chunk. (Padding rows of the reference have g = 0 and
        // β = 0, so stopping at c rows gives the same result.)
        let mut gcum = vec![0.0f32; c];
        let mut acc = 0.0f32;
        for i in 0..c {
            acc += inp.g[start + i];
            gcum[i] = acc;
        }
        let decay = |i: usize, j: usize| (gcum[i] - gcum[j]).exp();
        let kr = |i: usize| &k[i * dk..(i + 1) * dk];
        let qr = |i: usize| &q[i * dk..(i + 1) * dk];

        // A = −(Kβ·Kᵀ ⊙ D), strictly lower triangular.
        let mut a = vec![0.0f32; c * c];
        for i in 0..c {
            for j in 0..i {
                let kb_k: f32 = kr(i).iter().zip(kr(j)).map(|(x, y)| beta[i] * x * y).sum();
                a[i * c + j] = -(kb_k * decay(i, j));
            }
        }
        // Forward substitution, row by row, each row using the original values of itself and the
        // already-updated rows above: A[i, :i] += Σ_m A[i, m]·A[m, :i]. Then T = A + I.
        for i in 1..c {
            let row: Vec<f32> = a[i * c..i * c + i].to_vec();
            for j in 0..i {
                let mut sum = 0.0f32;
                for m in 0..i {
                    sum += row[m] * a[m * c + j];
                }
                a[i * c + j] = row[j] + sum;
            }
        }
        for i in 0..c {
            a[i * c + i] = 1.0;
        }
        let t = a;

        // U = T·(β⊙V), W = T·(β⊙exp(G)⊙K).
        let mut u = vec![0.0f32; c * dv];
        let mut w = vec![0.0f32; c * dk];
        for i in 0..c {
            for j in 0..=i {
                let tij = t[i * c + j];
                if tij == 0.0 {
                    continue;
                }
                for x in 0..dv {
                    u[i * dv + x] += tij * (v[j * dv + x] * beta[j]);
                }
                let bg = beta[j] * gcum[j].exp();
                for x in 0..dk {
                    w[i * dk + x] += tij * (k[j * dk + x] * bg);
                }
            }
        }

        // V' = U − W·S.
        let mut vnew = u;
        for i in 0..c {
            for x in 0..dk {
                let wx = w[i * dk + x];
                let srow = &s[x * dv..(x + 1) * dv];
                for y in 0..dv {
                    vnew[i * dv + y] -= wx * srow[y];
                }
            }
        }

        // O = (Q⊙exp(G))·S + (Q·Kᵀ ⊙ D, lower incl. diagonal)·V'.
        for i in 0..c {
            let o = &mut out[(start + i) * dv..(start + i + 1) * dv];
            let eg = gcum[i].exp();
            for x in 0..dk {
                let qx = qr(i)[x] * eg;
                let srow = &s[x * dv..(x + 1) * dv];
                for y in 0..dv {
                    o[y] += qx * srow[y];
                }
            }
            for j in 0..=i {
                let qk: f32 = qr(i).iter().zip(kr(j)).map(|(x, y)| x * y).sum();
                let aij = qk * decay(i, j);
                for y in 0..dv {
                    o[y] += aij * vnew[j * dv + y];
                }
            }
        }

        // S ← exp(G_last)·S + Σ_j (k_j·exp(G_last − G_j)) ⊗ V'_j.
        let glast = gcum[c - 1];
        let el = glast.exp();
        for x in s.iter_mut() {
            *x *= el;
        }
        for j in 0..c {
            let f = (glast - gcum[j]).exp();
            for x in 0..dk {
                let kx = k[j * dk + x] * f;
                let srow = &mut s[x * dv..(x + 1) * dv];
                for y in 0..dv {
                    srow[y] += kx * vnew[j * dv + y];
                }
            }
        }
        start += c;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small deterministic generator for test data.
    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn chunked_equals_step() {
        let (dk, dv) = (16, 12);
        for &n in &[1usize, 5, 64, 65, 150] {
            let mut seed = n as u64;
            let unit = |len: usize, seed: &mut u64| -> Vec<f32> {
                let mut v: Vec<f32> = (0..len).map(|_| lcg(seed)).collect();
                for row in v.chunks_mut(dk) {
                    let norm: f32 = row.iter().map(|x| x * x).sum::<f32>().sqrt();
                    row.iter_mut().for_each(|x| *x /= norm);
                }
                v
            };
            let q = unit(n * dk, &mut seed);
            let k = unit(n * dk, &mut seed);
            let v: Vec<f32> = (0..n * dv).map(|_| lcg(&mut seed)).collect();
            let beta: Vec<f32> = (0..n).map(|_| 0.5 + 0.5 * lcg(&mut seed).abs()).collect();
            let g: Vec<f32> = (0..n).map(|_| -0.3 * lcg(&mut seed).abs()).collect();
            let s0: Vec<f32> = (0..dk * dv).map(|_| 0.1 * lcg(&mut seed)).collect();
            let inp = HeadInputs {
                q: &q,
                k: &k,
                v: &v,
                beta: &beta,
                g: &g,
                dk,
                dv,
            };
            let (mut s1, mut s2) = (s0.clone(), s0.clone());
            let o1 = delta_rule_step(&inp, &mut s1);
            let o2 = delta_rule_chunked(&inp, 7, &mut s2);
            let max_ref = o1.iter().fold(0f32, |m, x| m.max(x.abs()));
            let max_d = o1
                .iter()
                .zip(&o2)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                max_d / max_ref < 1e-5,
                "n={n}: outputs differ by {max_d} (max {max_ref})"
            );
            let sd = s1
                .iter()
                .zip(&s2)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(sd < 1e-5, "n={n}: states differ by {sd}");
        }
    }
}
