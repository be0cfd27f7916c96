//! The gated delta rule on the CPU: the oracle's own step and chunked kernels, compiled for the
//! widest vector unit present (they are `#[inline(always)]`, so the wrapper's target features
//! apply), with the V heads of a layer spread over the thread pool.
//!
//! The inner loops run across the value dimension (independent lanes, no reassociation), so the
//! vectorised code computes exactly what the oracle computes. The chunked prompt algorithm is the
//! oracle's, rearranged into register-tiled products ([`gemm_acc`]) whose every element still
//! sees the oracle's operations in the oracle's order.

use rayon::prelude::*;
#[cfg(doc)]
use redlite_model::delta_rule::delta_rule_chunked;
#[cfg(any(doc, test))]
use redlite_model::delta_rule::delta_rule_step_traced;
use redlite_model::delta_rule::{DeltaRule, HeadInputs, CHUNK};

use crate::kernels::Isa;

/// One head, compiled for the running CPU.
fn one_head(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::active() >= Isa::Avx512 {
            // SAFETY: `Isa::active` only reports AVX-512 when the CPU supports it.
            return unsafe { one_head_avx512(inp, s, rule, trace) };
        }
        if Isa::active() >= Isa::Avx2 {
            // SAFETY: as above, for AVX2 + FMA.
            return unsafe { one_head_avx2(inp, s, rule, trace) };
        }
    }
    one_head_portable(inp, s, rule, trace)
}

#[inline(always)]
fn one_head_portable(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    match rule {
        DeltaRule::Step => step_two_pass(inp, s, trace),
        DeltaRule::Chunked { pos0 } => chunked_fast(inp, pos0, s),
    }
}

/// The recurrent step of [`delta_rule_step_traced`] in two passes over the state per token
/// instead of four: (1) decay each row of S and add it into `m = Sᵀk`; (2) add `k ⊗ β(v − m)` to
/// each row and the updated row into `o = Sᵀq`. Every element sees the oracle's operations in the
/// oracle's order (the rows are visited in order in both passes, and `β(v − m)` is the same value
/// the oracle forms per element), so it is bit-identical; the state (64 KiB per 128×128 head, in
/// L2) is read twice and written twice per token instead of read four times.
#[inline(always)]
fn step_two_pass(inp: &HeadInputs, s: &mut [f32], mut trace: Option<&mut Vec<f32>>) -> Vec<f32> {
    let (dk, dv, n) = (inp.dk, inp.dv, inp.beta.len());
    let mut out = vec![0.0f32; n * dv];
    let mut m = vec![0.0f32; dv];
    let mut delta = vec![0.0f32; dv];
    for t in 0..n {
        let q = &inp.q[t * dk..(t + 1) * dk];
        let k = &inp.k[t * dk..(t + 1) * dk];
        let v = &inp.v[t * dv..(t + 1) * dv];
        let (alpha, beta) = (inp.g[t].exp(), inp.beta[t]);
        // S ← αS, m = Sᵀk.
        m.fill(0.0);
        for (ki, row) in k.iter().zip(s.chunks_exact_mut(dv)) {
            for (mj, sj) in m.iter_mut().zip(row.iter_mut()) {
                *sj *= alpha;
                *mj += *sj * ki;
            }
        }
        // S += k ⊗ β(v − m), o = Sᵀq.
        for ((dj, vj), mj) in delta.iter_mut().zip(v).zip(&m) {
            *dj = beta * (vj - mj);
        }
        let o = &mut out[t * dv..(t + 1) * dv];
        for ((ki, qi), row) in k.iter().zip(q).zip(s.chunks_exact_mut(dv)) {
            for ((sj, dj), oj) in row.iter_mut().zip(&delta).zip(o.iter_mut()) {
                *sj += ki * dj;
                *oj += *sj * qi;
            }
        }
        if let Some(trace) = trace.as_deref_mut() {
            trace.extend_from_slice(s);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn one_head_avx512(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    if rule == DeltaRule::Step && inp.dv.is_multiple_of(16) {
        match inp.dv / 16 {
            1 => return step_registers::<1>(inp, s, trace),
            2 => return step_registers::<2>(inp, s, trace),
            3 => return step_registers::<3>(inp, s, trace),
            4 => return step_registers::<4>(inp, s, trace),
            6 => return step_registers::<6>(inp, s, trace),
            8 => return step_registers::<8>(inp, s, trace),
            _ => {}
        }
    }
    one_head_portable(inp, s, rule, trace)
}

/// [`step_two_pass`] for `dv = 16·N` with `m = Sᵀk` and `o = Sᵀq` held in `N` registers across
/// the rows (compiled on their own, the loops kept them in memory: every row's add waited on the
/// previous row's store). Same operations per element in the same order (a separate multiply and
/// add, rows in order), so bit-identical to the oracle.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn step_registers<const N: usize>(
    inp: &HeadInputs,
    s: &mut [f32],
    mut trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    use core::arch::x86_64::*;
    let (dk, dv, n) = (inp.dk, inp.dv, inp.beta.len());
    debug_assert_eq!(dv, 16 * N);
    assert!(s.len() >= dk * dv && inp.q.len() >= n * dk && inp.k.len() >= n * dk);
    assert!(inp.v.len() >= n * dv && inp.g.len() >= n);
    let mut out = vec![0.0f32; n * dv];
    if trace.is_none() && n > 1 {
        return step_registers_pipelined::<N>(inp, s, out);
    }
    for t in 0..n {
        let q = &inp.q[t * dk..(t + 1) * dk];
        let k = &inp.k[t * dk..(t + 1) * dk];
        let v = &inp.v[t * dv..(t + 1) * dv];
        let alpha = _mm512_set1_ps(inp.g[t].exp());
        let beta = _mm512_set1_ps(inp.beta[t]);
        // S ← αS, m = Sᵀk.
        let mut m = [_mm512_setzero_ps(); N];
        for (i, &ki) in k.iter().enumerate() {
            let row = s.as_mut_ptr().add(i * dv);
            let kv = _mm512_set1_ps(ki);
            for (c, mc) in m.iter_mut().enumerate() {
                let sv = _mm512_mul_ps(_mm512_loadu_ps(row.add(16 * c)), alpha);
                _mm512_storeu_ps(row.add(16 * c), sv);
                *mc = _mm512_add_ps(*mc, _mm512_mul_ps(sv, kv));
            }
        }
        // δ = β(v − m); S += k ⊗ δ, o = Sᵀq.
        let delta: [__m512; N] = core::array::from_fn(|c| {
            _mm512_mul_ps(
                beta,
                _mm512_sub_ps(_mm512_loadu_ps(v.as_ptr().add(16 * c)), m[c]),
            )
        });
        let mut o = [_mm512_setzero_ps(); N];
        for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
            let row = s.as_mut_ptr().add(i * dv);
            let (kv, qv) = (_mm512_set1_ps(ki), _mm512_set1_ps(qi));
            for (c, oc) in o.iter_mut().enumerate() {
                let sv = _mm512_add_ps(
                    _mm512_loadu_ps(row.add(16 * c)),
                    _mm512_mul_ps(kv, delta[c]),
                );
                _mm512_storeu_ps(row.add(16 * c), sv);
                *oc = _mm512_add_ps(*oc, _mm512_mul_ps(sv, qv));
            }
        }
        for (c, oc) in o.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(t * dv + 16 * c), *oc);
        }
        if let Some(trace) = trace.as_deref_mut() {
            trace.extend_from_slice(s);
        }
    }
    out
}

/// [`step_registers`] for several rows without a trace, with row `t`'s second loop (`S += k ⊗ δ`,
/// `o = Sᵀq`) and row `t + 1`'s first loop (`S ← αS`, `m = Sᵀk`) in one pass over the state rows:
/// the two running sums are independent chains, so the core overlaps their add latencies
/// (each loop alone is one serial add chain per 16 lanes). Every state element still gets row
/// `t`'s update before row `t + 1`'s decay, and `o`, `m` add their terms in the same row order,
/// so the values are bit-identical to [`step_registers`] (and the oracle).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn step_registers_pipelined<const N: usize>(
    inp: &HeadInputs,
    s: &mut [f32],
    mut out: Vec<f32>,
) -> Vec<f32> {
    use core::arch::x86_64::*;
    let (dk, dv, n) = (inp.dk, inp.dv, inp.beta.len());
    debug_assert!(n > 0 && dv == 16 * N && out.len() >= n * dv);
    let alpha_of = |t: usize| _mm512_set1_ps(inp.g[t].exp());
    // Row 0's first loop alone.
    let mut m = [_mm512_setzero_ps(); N];
    {
        let k = &inp.k[..dk];
        let alpha = alpha_of(0);
        for (i, &ki) in k.iter().enumerate() {
            let row = s.as_mut_ptr().add(i * dv);
            let kv = _mm512_set1_ps(ki);
            for (c, mc) in m.iter_mut().enumerate() {
                let sv = _mm512_mul_ps(_mm512_loadu_ps(row.add(16 * c)), alpha);
                _mm512_storeu_ps(row.add(16 * c), sv);
                *mc = _mm512_add_ps(*mc, _mm512_mul_ps(sv, kv));
            }
        }
    }
    for t in 0..n {
        let q = &inp.q[t * dk..(t + 1) * dk];
        let k = &inp.k[t * dk..(t + 1) * dk];
        let v = &inp.v[t * dv..(t + 1) * dv];
        let beta = _mm512_set1_ps(inp.beta[t]);
        let delta: [__m512; N] = core::array::from_fn(|c| {
            _mm512_mul_ps(
                beta,
                _mm512_sub_ps(_mm512_loadu_ps(v.as_ptr().add(16 * c)), m[c]),
            )
        });
        let mut o = [_mm512_setzero_ps(); N];
        if t + 1 < n {
            let k1 = &inp.k[(t + 1) * dk..(t + 2) * dk];
            let alpha1 = alpha_of(t + 1);
            let mut m1 = [_mm512_setzero_ps(); N];
            for i in 0..dk {
                let row = s.as_mut_ptr().add(i * dv);
                let (kv, qv) = (_mm512_set1_ps(k[i]), _mm512_set1_ps(q[i]));
                let kv1 = _mm512_set1_ps(k1[i]);
                for c in 0..N {
                    let sv = _mm512_add_ps(
                        _mm512_loadu_ps(row.add(16 * c)),
                        _mm512_mul_ps(kv, delta[c]),
                    );
                    o[c] = _mm512_add_ps(o[c], _mm512_mul_ps(sv, qv));
                    let sv = _mm512_mul_ps(sv, alpha1);
                    _mm512_storeu_ps(row.add(16 * c), sv);
                    m1[c] = _mm512_add_ps(m1[c], _mm512_mul_ps(sv, kv1));
                }
            }
            m = m1;
        } else {
            for i in 0..dk {
                let row = s.as_mut_ptr().add(i * dv);
                let (kv, qv) = (_mm512_set1_ps(k[i]), _mm512_set1_ps(q[i]));
                for c in 0..N {
                    let sv = _mm512_add_ps(
                        _mm512_loadu_ps(row.add(16 * c)),
                        _mm512_mul_ps(kv, delta[c]),
                    );
                    _mm512_storeu_ps(row.add(16 * c), sv);
                    o[c] = _mm512_add_ps(o[c], _mm512_mul_ps(sv, qv));
                }
            }
        }
        for (c, oc) in o.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(t * dv + 16 * c), *oc);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn one_head_avx2(
    inp: &HeadInputs,
    s: &mut [f32],
    rule: DeltaRule,
    trace: Option<&mut Vec<f32>>,
) -> Vec<f32> {
    one_head_portable(inp, s, rule, trace)
}

/// The chunked algorithm of [`delta_rule_chunked`], rearranged for the vector unit and
/// bit-identical to it: every output element sees the same f32 operations in the same order
/// (products are formed once and reused, inner products run across independent outputs instead
/// of one sequential reduction at a time). Returns `o` as `[t, dv]` and updates `s` in place.
#[inline(always)]
fn chunked_fast(inp: &HeadInputs, pos0: usize, s: &mut [f32]) -> Vec<f32> {
    let (dk, dv) = (inp.dk, inp.dv);
    let n = inp.beta.len();
    let mut out = vec![0.0f32; n * dv];
    let mut start = 0;
    while start < n {
        let c = (CHUNK - (pos0 + start) % CHUNK).min(n - start);
        let rows = start..start + c;
        chunk(
            ChunkInputs {
                q: &inp.q[rows.start * dk..rows.end * dk],
                k: &inp.k[rows.start * dk..rows.end * dk],
                v: &inp.v[rows.start * dv..rows.end * dv],
                beta: &inp.beta[rows.clone()],
                g: &inp.g[rows.clone()],
                dk,
                dv,
            },
            s,
            &mut out[rows.start * dv..rows.end * dv],
        );
        start += c;
    }
    out
}

/// One chunk of `c` rows of a head.
struct ChunkInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    beta: &'a [f32],
    g: &'a [f32],
    dk: usize,
    dv: usize,
}

/// One chunk (see [`delta_rule_chunked`] for the maths): `o` (`[c, dv]`, zero on entry) gets the
/// chunk's outputs, `s` goes from the state before the chunk to the state after it.
#[inline(always)]
fn chunk(x: ChunkInputs, s: &mut [f32], o: &mut [f32]) {
    let (dk, dv, c) = (x.dk, x.dv, x.beta.len());
    // Cumulative log-decay and the decays D_ij = exp(G_i − G_j) (j ≤ i), each exp taken once.
    let mut gcum = vec![0.0f32; c];
    let mut acc = 0.0f32;
    for (gc, &g) in gcum.iter_mut().zip(x.g) {
        acc += g;
        *gc = acc;
    }
    let mut decay = vec![0.0f32; c * c];
    for i in 0..c {
        for j in 0..=i {
            decay[i * c + j] = (gcum[i] - gcum[j]).exp();
        }
    }
    // Kᵀ, `[dk, c]`: the right operand of Kβ·Kᵀ and Q·Kᵀ.
    let mut kt = vec![0.0f32; dk * c];
    for i in 0..c {
        for e in 0..dk {
            kt[e * c + i] = x.k[i * dk + e];
        }
    }

    // A = −(Kβ·Kᵀ ⊙ D), strictly lower; each inner product a sum from −0.0 in element order (as
    // `Iterator::sum`), the factor β_i·k_ie formed first.
    let mut kb = vec![0.0f32; c * dk];
    for i in 0..c {
        for e in 0..dk {
            kb[i * dk + e] = x.beta[i] * x.k[i * dk + e];
        }
    }
    let mut a = vec![-0.0f32; c * c];
    gemm_acc::<false>(&mut a, c, &kb, dk, &kt, c, |_| dk);
    for i in 0..c {
        for j in 0..c {
            a[i * c + j] = if j < i {
                -(a[i * c + j] * decay[i * c + j])
            } else {
                0.0
            };
        }
    }
    // Forward substitution: row i += Σ_m row_i[m]·(updated row m), sums from 0.0 in m order,
    // across all j of the row at once. Then T = A + I.
    let mut row = vec![0.0f32; c];
    let mut sums = vec![0.0f32; c];
    for i in 1..c {
        row[..i].copy_from_slice(&a[i * c..i * c + i]);
        sums[..i].fill(0.0);
        for m in 0..i {
            let r = row[m];
            for (sj, &amj) in sums[..i].iter_mut().zip(&a[m * c..m * c + i]) {
                *sj += r * amj;
            }
        }
        for (aij, (&rj, &sj)) in a[i * c..i * c + i].iter_mut().zip(row.iter().zip(&sums)) {
            *aij = rj + sj;
        }
    }
    for i in 0..c {
        a[i * c + i] = 1.0;
    }
    let t = a;

    // U = T·(β⊙V), W = T·(β⊙exp(G)⊙K) (zero entries of T skipped, as the reference does).
    let mut vb = vec![0.0f32; c * dv];
    let mut kbg = vec![0.0f32; c * dk];
    for j in 0..c {
        for y in 0..dv {
            vb[j * dv + y] = x.v[j * dv + y] * x.beta[j];
        }
        let bg = x.beta[j] * gcum[j].exp();
        for e in 0..dk {
            kbg[j * dk + e] = x.k[j * dk + e] * bg;
        }
    }
    let mut u = vec![0.0f32; c * dv];
    let mut w = vec![0.0f32; c * dk];
    for i in 0..c {
        for j in 0..=i {
            let tij = t[i * c + j];
            if tij == 0.0 {
                continue;
            }
            for (uy, &vy) in u[i * dv..(i + 1) * dv]
                .iter_mut()
                .zip(&vb[j * dv..(j + 1) * dv])
            {
                *uy += tij * vy;
            }
            for (we, &ke) in w[i * dk..(i + 1) * dk]
                .iter_mut()
                .zip(&kbg[j * dk..(j + 1) * dk])
            {
                *we += tij * ke;
            }
        }
    }

    // V' = U − W·S.
    let mut vnew = u;
    gemm_acc::<true>(&mut vnew, dv, &w, dk, s, dv, |_| dk);

    // O = (Q⊙exp(G))·S + (Q·Kᵀ ⊙ D, lower incl. diagonal)·V'.
    let mut qe = vec![0.0f32; c * dk];
    for i in 0..c {
        let eg = gcum[i].exp();
        for e in 0..dk {
            qe[i * dk + e] = x.q[i * dk + e] * eg;
        }
    }
    gemm_acc::<false>(o, dv, &qe, dk, s, dv, |_| dk);
    let mut p = vec![-0.0f32; c * c];
    gemm_acc::<false>(&mut p, c, x.q, dk, &kt, c, |_| dk);
    for i in 0..c {
        for j in 0..=i {
            p[i * c + j] *= decay[i * c + j];
        }
    }
    gemm_acc::<false>(o, dv, &p, c, &vnew, dv, |i| i + 1);

    // S ← exp(G_last)·S + Σ_j (k_j·exp(G_last − G_j)) ⊗ V'_j.
    let glast = gcum[c - 1];
    let el = glast.exp();
    for v in s.iter_mut() {
        *v *= el;
    }
    let f: Vec<f32> = gcum.iter().map(|&gj| (glast - gj).exp()).collect();
    let mut kf = vec![0.0f32; dk * c];
    for j in 0..c {
        for e in 0..dk {
            kf[e * c + j] = x.k[j * dk + e] * f[j];
        }
    }
    gemm_acc::<false>(s, dv, &kf, c, &vnew, dv, |_| c);
}

/// Rows of a register tile of [`gemm_acc`].
const TILE_ROWS: usize = 4;
/// Columns of a register tile of [`gemm_acc`] (one 512-bit vector of f32).
const TILE_COLS: usize = 16;

/// `C[i][y] ±= Σ_{x < inner(i)} A[i][x]·B[x][y]`, for every element one product and one add (or
/// subtract, `SUB`) per x, in x order, starting from the value C holds (no fused multiply-add, no
/// reassociation: exactly the scalar loop `for x { c = c ± a·b }`). `C` is `rows × ldc` with
/// `ldc` columns used, `A` is `rows × lda`, `B` is `inner × ldb` with `ldc` columns used.
/// `inner` must not decrease with `i`.
#[inline(always)]
fn gemm_acc<const SUB: bool>(
    cm: &mut [f32],
    ldc: usize,
    am: &[f32],
    lda: usize,
    bm: &[f32],
    ldb: usize,
    inner: impl Fn(usize) -> usize,
) {
    let rows = cm.len() / ldc;
    let step = |acc: f32, a: f32, b: f32| if SUB { acc - a * b } else { acc + a * b };
    let mut i0 = 0;
    while i0 < rows {
        let ri = TILE_ROWS.min(rows - i0);
        let common = inner(i0);
        let mut y0 = 0;
        while y0 < ldc {
            let cy = TILE_COLS.min(ldc - y0);
            if ri == TILE_ROWS && cy == TILE_COLS {
                // Full register tile over the x range every row has.
                let mut acc = [[0.0f32; TILE_COLS]; TILE_ROWS];
                for (r, accr) in acc.iter_mut().enumerate() {
                    accr.copy_from_slice(&cm[(i0 + r) * ldc + y0..][..TILE_COLS]);
                }
                for xx in 0..common {
                    let b: &[f32; TILE_COLS] =
                        bm[xx * ldb + y0..][..TILE_COLS].try_into().expect("tile");
                    for (r, accr) in acc.iter_mut().enumerate() {
                        let a = am[(i0 + r) * lda + xx];
                        for l in 0..TILE_COLS {
                            accr[l] = step(accr[l], a, b[l]);
                        }
                    }
                }
                for (r, accr) in acc.iter().enumerate() {
                    cm[(i0 + r) * ldc + y0..][..TILE_COLS].copy_from_slice(accr);
                }
                // Rows whose x range goes further.
                for r in 0..TILE_ROWS {
                    let i = i0 + r;
                    let crow = &mut cm[i * ldc + y0..][..TILE_COLS];
                    for xx in common..inner(i) {
                        let a = am[i * lda + xx];
                        for (cv, &b) in crow.iter_mut().zip(&bm[xx * ldb + y0..][..TILE_COLS]) {
                            *cv = step(*cv, a, b);
                        }
                    }
                }
            } else {
                for i in i0..i0 + ri {
                    let crow = &mut cm[i * ldc + y0..][..cy];
                    for xx in 0..inner(i) {
                        let a = am[i * lda + xx];
                        for (cv, &b) in crow.iter_mut().zip(&bm[xx * ldb + y0..][..cy]) {
                            *cv = step(*cv, a, b);
                        }
                    }
                }
            }
            y0 += cy;
        }
        i0 += ri;
    }
}

/// Below this much state traffic (bytes per token × tokens, all heads) the heads run serially.
const PARALLEL_MIN_WORK_BYTES: usize = 256 * 1024;

/// Every head of a layer, in parallel (serially when the work is small).
pub fn delta_rule_parallel(
    heads: &[HeadInputs],
    states: &mut [f32],
    rule: DeltaRule,
    traces: Option<&mut [Vec<f32>]>,
) -> Vec<Vec<f32>> {
    run_heads(heads, states, None, rule, traces)
}

/// [`delta_rule_parallel`], each head's starting state first copied into its part of `initial`
/// (same layout) by the task that is about to read it (a verify's checkpoint: one pass over the
/// state instead of a copy of every layer's before the verify and a read here).
pub fn delta_rule_parallel_keeping(
    heads: &[HeadInputs],
    states: &mut [f32],
    initial: &mut [f32],
    rule: DeltaRule,
) -> Vec<Vec<f32>> {
    assert_eq!(initial.len(), states.len(), "checkpoint of another shape");
    run_heads(heads, states, Some(initial), rule, None)
}

fn run_heads(
    heads: &[HeadInputs],
    states: &mut [f32],
    initial: Option<&mut [f32]>,
    rule: DeltaRule,
    traces: Option<&mut [Vec<f32>]>,
) -> Vec<Vec<f32>> {
    let per = heads.first().map_or(1, |h| (h.dk * h.dv).max(1));
    let mut traces: Vec<Option<&mut Vec<f32>>> = match traces {
        Some(t) => t.iter_mut().map(Some).collect(),
        None => heads.iter().map(|_| None).collect(),
    };
    let mut initial: Vec<Option<&mut [f32]>> = match initial {
        Some(i) => i.chunks_mut(per).map(Some).collect(),
        None => heads.iter().map(|_| None).collect(),
    };
    let head = |inp: &HeadInputs,
                s: &mut [f32],
                i: &mut Option<&mut [f32]>,
                t: &mut Option<&mut Vec<f32>>| {
        if let Some(i) = i.as_deref_mut() {
            i.copy_from_slice(s);
        }
        one_head(inp, s, rule, t.as_deref_mut())
    };
    // State bytes touched per token times tokens: a tiny model's one-token step runs on the
    // calling thread (the hand-off to the pool costs more); each head is computed the same.
    let work = heads.iter().map(|h| h.beta.len()).sum::<usize>() * per * 4;
    if work < PARALLEL_MIN_WORK_BYTES {
        // Split only over threads the pass keeps warm (see `team`).
        let mut items: Vec<_> = heads
            .iter()
            .zip(states.chunks_mut(per))
            .zip(initial.iter_mut())
            .zip(traces.iter_mut())
            .map(|x| (x, Vec::new()))
            .collect();
        crate::team::for_each_mut_or_serial(&mut items, |((((inp, s), i), t), out)| {
            *out = head(inp, s, i, t);
        });
        items.into_iter().map(|(_, out)| out).collect()
    } else {
        heads
            .par_iter()
            .zip(states.par_chunks_mut(per))
            .zip(initial.par_iter_mut())
            .zip(traces.par_iter_mut())
            .map(|(((inp, s), i), t)| head(inp, s, i, t))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redlite_model::delta_rule::delta_rule_chunked;

    /// Random inputs of one head over `n` tokens and a starting state `s0`.
    pub(super) struct Head {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        beta: Vec<f32>,
        g: Vec<f32>,
        s0: Vec<f32>,
        dk: usize,
        dv: usize,
    }

    impl Head {
        pub(super) fn random(seed: &mut u64, dk: usize, dv: usize, n: usize) -> Head {
            let mut next = || {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            };
            let q: Vec<f32> = (0..n * dk).map(|_| next() * 0.2).collect();
            let k: Vec<f32> = (0..n * dk).map(|_| next() * 0.2).collect();
            let v: Vec<f32> = (0..n * dv).map(|_| next()).collect();
            let beta: Vec<f32> = (0..n).map(|_| next() + 0.5).collect();
            let g: Vec<f32> = (0..n).map(|_| -next().abs()).collect();
            let s0: Vec<f32> = (0..dk * dv).map(|_| next() * 0.1).collect();
            Head {
                q,
                k,
                v,
                beta,
                g,
                s0,
                dk,
                dv,
            }
        }

        pub(super) fn inputs(&self) -> HeadInputs<'_> {
            HeadInputs {
                q: &self.q,
                k: &self.k,
                v: &self.v,
                beta: &self.beta,
                g: &self.g,
                dk: self.dk,
                dv: self.dv,
            }
        }
    }

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The rearranged chunked algorithm equals the oracle's bit for bit, on full 128×128 heads
    /// and on odd shapes (partial tiles, chunks of 1 row, prompts not starting on a boundary).
    #[test]
    fn chunked_fast_equals_the_oracle_bit_for_bit() {
        let mut seed = 11u64;
        for (dk, dv, n, pos0) in [
            (128, 128, 150, 0),
            (64, 48, 70, 5),
            (24, 20, 9, 63),
            (16, 7, 2, 0),
        ] {
            let head = Head::random(&mut seed, dk, dv, n);
            let inp = head.inputs();
            let (mut s1, mut s2) = (head.s0.clone(), head.s0.clone());
            let oracle = delta_rule_chunked(&inp, pos0, &mut s1);
            let fast = one_head(&inp, &mut s2, DeltaRule::Chunked { pos0 }, None);
            assert!(same(&oracle, &fast), "outputs, dk {dk} dv {dv} n {n}");
            assert!(same(&s1, &s2), "states, dk {dk} dv {dv} n {n}");
        }
    }

    /// The two-pass recurrent step equals the oracle's four-pass step bit for bit, outputs, states
    /// and traces, on a full 128×128 head and odd shapes.
    #[test]
    fn two_pass_step_equals_the_oracle_bit_for_bit() {
        let mut seed = 17u64;
        for (dk, dv, n) in [(128, 128, 3), (64, 64, 4), (64, 48, 5), (16, 7, 1)] {
            let head = Head::random(&mut seed, dk, dv, n);
            let inp = head.inputs();
            let (mut s1, mut s2) = (head.s0.clone(), head.s0.clone());
            let (mut t1, mut t2) = (Vec::new(), Vec::new());
            let oracle = delta_rule_step_traced(&inp, &mut s1, Some(&mut t1));
            let fast = one_head(&inp, &mut s2, DeltaRule::Step, Some(&mut t2));
            assert!(same(&oracle, &fast), "outputs, dk {dk} dv {dv} n {n}");
            assert!(same(&s1, &s2), "states, dk {dk} dv {dv} n {n}");
            assert!(same(&t1, &t2), "traces, dk {dk} dv {dv} n {n}");
        }
    }

    /// Without a trace, several rows take the pipelined step (one row's update fused with the
    /// next row's decay): still the oracle's values bit for bit.
    #[test]
    fn untraced_step_rows_equal_the_oracle_bit_for_bit() {
        let mut seed = 23u64;
        for (dk, dv, n) in [
            (64, 64, 2),
            (64, 64, 17),
            (128, 128, 5),
            (64, 32, 9),
            (32, 16, 3),
            (64, 48, 4),
            (16, 7, 2),
        ] {
            let head = Head::random(&mut seed, dk, dv, n);
            let inp = head.inputs();
            let (mut s1, mut s2) = (head.s0.clone(), head.s0.clone());
            let oracle = delta_rule_step_traced(&inp, &mut s1, None);
            let fast = one_head(&inp, &mut s2, DeltaRule::Step, None);
            assert!(same(&oracle, &fast), "outputs, dk {dk} dv {dv} n {n}");
            assert!(same(&s1, &s2), "states, dk {dk} dv {dv} n {n}");
        }
    }
}

#[cfg(test)]
mod bench {
    use super::tests::Head;
    use super::*;
    use redlite_model::delta_rule::{delta_rule_chunked, delta_rule_step_traced};
    use std::time::Instant;

    /// One decode step of 36 layers × 32 heads of 128×128 (72 MiB of state, beyond the caches, as
    /// at full size), one thread: the oracle's four-pass step (compiled for this CPU through
    /// the same wrapper) vs the two-pass step:
    /// `cargo test --release -p redlite-cpu --lib delta_rule::bench -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn step_time() {
        let (dk, dv, heads) = (128, 128, 36 * 32);
        let q: Vec<f32> = (0..dk).map(|i| (i as f32 * 0.37).sin() * 0.1).collect();
        let k: Vec<f32> = (0..dk).map(|i| (i as f32 * 0.91).cos() * 0.1).collect();
        let v: Vec<f32> = (0..dv).map(|i| (i as f32 * 0.13).sin()).collect();
        let (beta, g) = ([0.7f32], [-0.05f32]);
        let inp = HeadInputs {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: &g,
            dk,
            dv,
        };
        let mut states = vec![0.01f32; heads * dk * dv];
        for round in 0..6 {
            let t0 = Instant::now();
            for s in states.chunks_exact_mut(dk * dv) {
                // SAFETY: as in `one_head` (checked before use).
                std::hint::black_box(if Isa::active() >= Isa::Avx512 {
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        oracle_step_avx512(&inp, s)
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    delta_rule_step_traced(&inp, s, None)
                } else {
                    delta_rule_step_traced(&inp, s, None)
                });
            }
            let t_oracle = t0.elapsed();
            let t0 = Instant::now();
            for s in states.chunks_exact_mut(dk * dv) {
                std::hint::black_box(one_head(&inp, s, DeltaRule::Step, None));
            }
            let t_two = t0.elapsed();
            println!("round {round}: four-pass {t_oracle:?}, two-pass {t_two:?} per step of {heads} heads");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn oracle_step_avx512(inp: &HeadInputs, s: &mut [f32]) -> Vec<f32> {
        delta_rule_step_traced(inp, s, None)
    }

    /// Time per 512-token head, oracle vs rearranged (one thread):
    /// `cargo test --release -p redlite-cpu --lib delta_rule::bench -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn chunked_head_time() {
        let (dk, dv, n) = (128, 128, 512);
        let head = Head::random(&mut 3, dk, dv, n);
        let inp = head.inputs();
        for round in 0..8 {
            let mut s = vec![0.0f32; dk * dv];
            let t0 = Instant::now();
            std::hint::black_box(one_head_portable(
                &inp,
                &mut s,
                DeltaRule::Chunked { pos0: 0 },
                None,
            ));
            let t_fast_portable = t0.elapsed();
            let t0 = Instant::now();
            std::hint::black_box(one_head(&inp, &mut s, DeltaRule::Chunked { pos0: 0 }, None));
            let t_fast = t0.elapsed();
            let t0 = Instant::now();
            std::hint::black_box(delta_rule_chunked(&inp, 0, &mut s));
            let t_oracle = t0.elapsed();
            println!("round {round}: oracle {t_oracle:?}, fast {t_fast:?} (portable build {t_fast_portable:?})");
        }
    }

    /// Time per token of a head over a 512-token prompt, the step rule (untraced) against the
    /// chunked one, for the demo's 64 × 64 and the 80B's 128 × 128 heads (one thread):
    /// `cargo test --release -p redlite-cpu --lib delta_rule::bench::step_against_chunked_time -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn step_against_chunked_time() {
        for d in [64usize, 128] {
            let (dk, dv, n) = (d, d, 512);
            let head = Head::random(&mut 5, dk, dv, n);
            let inp = head.inputs();
            let (mut best_step, mut best_chunk) = (f64::MAX, f64::MAX);
            for _ in 0..10 {
                let mut s = vec![0.0f32; dk * dv];
                let t0 = Instant::now();
                std::hint::black_box(one_head(&inp, &mut s, DeltaRule::Step, None));
                best_step = best_step.min(t0.elapsed().as_secs_f64());
                let mut s = vec![0.0f32; dk * dv];
                let t0 = Instant::now();
                std::hint::black_box(one_head(&inp, &mut s, DeltaRule::Chunked { pos0: 0 }, None));
                best_chunk = best_chunk.min(t0.elapsed().as_secs_f64());
            }
            println!(
                "{dk}x{dv}: step {:.3} us/token, chunked {:.3} us/token (best of 10, {n} tokens)",
                best_step * 1e6 / n as f64,
                best_chunk * 1e6 / n as f64
            );
        }
    }
}
