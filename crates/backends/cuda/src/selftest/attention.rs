//! Self-test of the attention kernels (`ops::attention`): RoPE, decode, split and prompt
//! attention over each KV type.

use super::*;

impl Runner<'_> {
    pub(super) fn rope(&mut self) {
        let (heads, hd, rd, theta) = (16usize, 256usize, 64usize, 10_000_000.0f64);
        for (tokens, pos0) in [(1usize, 0usize), (3, 100), (2, 70_000)] {
            let x = self.rng.normals(tokens * heads * hd, 1.0);
            let r = ops::rope_neox(self.gpu, &x, heads, hd, rd, pos0, theta).map(|y| {
                let mut reference: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
                let half = rd / 2;
                for (i, head) in reference.chunks_exact_mut(hd).enumerate() {
                    let pos = (pos0 + i / heads) as f64;
                    for j in 0..half {
                        let angle = pos * theta.powf(-2.0 * j as f64 / rd as f64);
                        // The kernel rounds sin and cos to f32, as the oracle does.
                        let (s, c) = (f64::from(angle.sin() as f32), f64::from(angle.cos() as f32));
                        let (a, b) = (head[j], head[j + half]);
                        head[j] = a * c - b * s;
                        head[j + half] = b * c + a * s;
                    }
                }
                (rel_err(&y, &reference), TOL_F32)
            });
            self.record(
                "rope_neox",
                format!("{tokens}x{heads}x{hd}, rot {rd}, pos {pos0}"),
                r,
            );
        }
    }

    pub(super) fn attention(&mut self) {
        let (heads, nkv, hd) = (16usize, 2usize, 256usize);
        let scale = 1.0 / (hd as f32).sqrt();
        for n in [1usize, 37, 1000] {
            let q = self.rng.normals(heads * hd, 1.0);
            let kc = self.rng.normals(n * nkv * hd, 1.0);
            let vc = self.rng.normals(n * nkv * hd, 1.0);
            let r = ops::attn_decode(self.gpu, &q, &kc, &vc, heads, nkv, hd, scale).map(|o| {
                let reference: Vec<f64> = (0..heads)
                    .flat_map(|h| {
                        let qh = &q[h * hd..(h + 1) * hd];
                        attention_row64(qh, &kc, &vc, (n, nkv, h / (heads / nkv)), scale)
                    })
                    .collect();
                (rel_err(&o, &reference), TOL_F32)
            });
            self.record(
                "attn_decode",
                format!("{heads}/{nkv} heads x{hd}, {n} positions"),
                r,
            );
        }
    }

    /// QK-norm + RoPE + KV write, then causal attention, for prompt runs and single steps.
    pub(super) fn attention_seq(&mut self) {
        let d = AttnDims {
            heads: 16,
            nkv: 2,
            hd: 256,
            rope_dims: 64,
            theta: 10_000_000.0,
            eps: 1e-6,
        };
        let (hd, nkv, heads) = (d.hd, d.nkv, d.heads);
        let scale = 1.0 / (hd as f32).sqrt();
        for (n, pos0, ctx) in [
            (7usize, 0usize, 16usize),
            (1, 999, 1024),
            (5, 30, 40),
            (37, 20, 64),
        ] {
            let qg = self.rng.normals(n * heads * 2 * hd, 1.0);
            let kn = self.rng.normals(n * nkv * hd, 1.0);
            let vn = self.rng.normals(n * nkv * hd, 1.0);
            let qn: Vec<f32> = (0..hd).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let kw: Vec<f32> = (0..hd).map(|_| 0.5 + self.rng.uniform() as f32).collect();
            let kc0 = self.rng.normals(ctx * nkv * hd, 1.0);
            let vc0 = self.rng.normals(ctx * nkv * hd, 1.0);
            // RoPE's angles from the table or computed, the cache in f32 or f16.
            let gpu = self.gpu;
            let qk_prep = |table, kv| {
                ops::attn_qk_prep(gpu, &qg, &kn, &vn, &qn, &kw, &kc0, &vc0, pos0, d, table, kv)
            };
            let r = qk_prep(false, KvType::F32).map(|(q, gate, kc, vc)| {
                let eps = f64::from(d.eps);
                let (mut rq, mut rg) = (Vec::new(), Vec::new());
                let mut rk: Vec<f64> = kc0.iter().map(|&v| f64::from(v)).collect();
                let mut rv: Vec<f64> = vc0.iter().map(|&v| f64::from(v)).collect();
                for t in 0..n {
                    let pos = pos0 + t;
                    for h in 0..heads {
                        let at = (t * heads + h) * 2 * hd;
                        rq.extend(qk_norm_rope64(
                            &qg[at..at + hd],
                            &qn,
                            eps,
                            pos,
                            d.rope_dims,
                            d.theta,
                        ));
                        rg.extend(qg[at + hd..at + 2 * hd].iter().map(|&v| f64::from(v)));
                    }
                    for g in 0..nkv {
                        let at = (t * nkv + g) * hd;
                        let k =
                            qk_norm_rope64(&kn[at..at + hd], &kw, eps, pos, d.rope_dims, d.theta);
                        let c = (pos * nkv + g) * hd;
                        rk[c..c + hd].copy_from_slice(&k);
                        for i in 0..hd {
                            rv[c + i] = f64::from(vn[at + i]);
                        }
                    }
                }
                let e = rel_err(&q, &rq)
                    .max(rel_err(&gate, &rg))
                    .max(rel_err(&kc, &rk))
                    .max(rel_err(&vc, &rv));
                (e, TOL_F32)
            });
            self.record(
                "attn_qk_prep",
                format!(
                    "{n} tokens at {pos0}, {heads}/{nkv} heads x{hd}, rot {}",
                    d.rope_dims
                ),
                r,
            );
            // RoPE from rope_table's rows (the model's way) against the angles computed in the
            // kernel: every output bit for bit.
            let r = (|| {
                let (a, b) = (qk_prep(true, KvType::F32)?, qk_prep(false, KvType::F32)?);
                let n_diff =
                    bits_differ(&a.0, &b.0) + bits_differ(&a.1, &b.1) + bits_differ(&a.2, &b.2);
                // Values that differ (bound 0: bit-identical).
                Ok((n_diff as f64, 0.0))
            })();
            self.record(
                "attn_qk_prep rope_table",
                format!("{n} tokens at {pos0}, table vs computed angles, bit for bit"),
                r,
            );
            // The f16 cache: q and the gate as the f32 kernel's, the caches its values rounded
            // to f16, bit for bit.
            let r = (|| {
                let (a, b) = (qk_prep(true, KvType::F32)?, qk_prep(true, KvType::F16)?);
                let n_diff = bits_differ(&a.0, &b.0)
                    + bits_differ(&a.1, &b.1)
                    + bits_differ(&round_f16(&a.2), &b.2)
                    + bits_differ(&round_f16(&a.3), &b.3);
                // Values that differ (bound 0: bit-identical).
                Ok((n_diff as f64, 0.0))
            })();
            self.record(
                "attn_qk_prep_h",
                format!("{n} tokens at {pos0}, f16 cache vs the f32 kernel's rounded, bit for bit"),
                r,
            );

            let q = self.rng.normals(n * heads * hd, 1.0);
            let kc32 = self.rng.normals(ctx * nkv * hd, 1.0);
            let vc32 = self.rng.normals(ctx * nkv * hd, 1.0);
            let (kc16, vc16) = (round_f16(&kc32), round_f16(&vc32));
            // attn_causal, attn_prompt (a GQA group of rows per block) and its tensor-core form
            // (f16 inputs: TOL_ATTN_F16) on the same data; each on an f32 and an f16 cache (the
            // reference on the cache's values rounded to f16).
            for (kind, kv) in [
                ops::AttnKind::Causal,
                ops::AttnKind::Prompt,
                ops::AttnKind::PromptMma,
            ]
            .into_iter()
            .flat_map(|k| [(k, KvType::F32), (k, KvType::F16)])
            {
                let (kc, vc) = match kv {
                    KvType::F16 => (&kc16, &vc16),
                    _ => (&kc32, &vc32),
                };
                let r =
                    ops::attn_causal(self.gpu, &q, kc, vc, pos0, heads, nkv, hd, scale, kind, kv)
                        .map(|o| {
                            let reference: Vec<f64> = (0..n * heads)
                                .flat_map(|th| {
                                    let (t, h) = (th / heads, th % heads);
                                    let qh = &q[th * hd..(th + 1) * hd];
                                    let at = (pos0 + t + 1, nkv, h / (heads / nkv));
                                    attention_row64(qh, kc, vc, at, scale)
                                })
                                .collect();
                            let tol = if kind == ops::AttnKind::PromptMma {
                                TOL_ATTN_F16
                            } else {
                                TOL_F32
                            };
                            (rel_err(&o, &reference), tol)
                        });
                let name = match kind {
                    ops::AttnKind::Causal => "attn_causal",
                    ops::AttnKind::Prompt => "attn_prompt",
                    ops::AttnKind::PromptMma => "attn_prompt_mma",
                };
                self.record(
                    &ops::kv_kernel(name, kv).unwrap_or_default(),
                    format!("{n} tokens at {pos0}, {heads}/{nkv} heads x{hd}"),
                    r,
                );
            }
        }
        self.attention_split(d);
    }

    /// Decode attention split over the cache (`attn_split` + `attn_merge`), with and without the
    /// output gate, against the f64 softmax: short (one chunk) and long (many chunks, the last
    /// one partial).
    /// Each on an f32 and an f16 cache (`_h`; the reference on the values rounded to f16).
    pub(super) fn attention_split(&mut self, d: AttnDims) {
        for kv in [KvType::F32, KvType::F16] {
            self.attention_split_kernel(d, None, kv);
            if ops::attn_split_gqa_fits(d.heads, d.nkv, d.hd) {
                self.attention_split_kernel(d, Some(2), kv);
                self.attention_split_kernel(d, Some(4), kv);
                self.attention_split_named(d, "attn_split_gqa4x", kv);
                if kv == KvType::F16 {
                    // 8 rows a warp step, and the next step's rows loaded ahead: f16 only.
                    self.attention_split_named(d, "attn_split_gqa8x", kv);
                    self.attention_split_named(d, "attn_split_gqa4xp", kv);
                    if ops::attn_split_takes("attn_split_gqa8xh3", d.heads, d.nkv, d.hd) {
                        self.attention_split_named(d, "attn_split_gqa8xh3", kv);
                    }
                    // On the tensor cores (Q and P in f16: the prompt kernels' tolerance).
                    if ops::attn_split_takes("attn_split_mma", d.heads, d.nkv, d.hd) {
                        self.attention_split_named(d, "attn_split_mma", kv);
                    }
                }
            }
        }
    }

    /// [`Self::attention_split`] through `attn_split` or (`gqa` = P) `attn_split_gqa{,4}`.
    pub(super) fn attention_split_kernel(&mut self, d: AttnDims, gqa: Option<usize>, kv: KvType) {
        self.attention_split_named(d, gqa.map_or("attn_split", ops::attn_split_gqa_kernel), kv);
    }

    /// [`Self::attention_split`] through the split kernel `name` on a cache of `kv`.
    pub(super) fn attention_split_named(&mut self, d: AttnDims, name: &str, kv: KvType) {
        let kernel = ops::kv_kernel(name, kv).unwrap_or_default();
        let round = |x: Vec<f32>| if kv == KvType::F16 { round_f16(&x) } else { x };
        let tol = if name.contains("mma") {
            TOL_ATTN_F16
        } else {
            TOL_F32
        };
        let (hd, nkv, heads) = (d.hd, d.nkv, d.heads);
        let scale = 1.0 / (hd as f32).sqrt();
        for (pos0, ctx, splits, gated) in [
            (0usize, 8usize, 4usize, false),
            (40, 64, 4, true),
            (4001, 4096, 64, true),
        ] {
            let q = self.rng.normals(heads * hd, 1.0);
            let kc = round(self.rng.normals(ctx * nkv * hd, 1.0));
            let vc = round(self.rng.normals(ctx * nkv * hd, 1.0));
            let gate = self.rng.normals(heads * hd, 2.0);
            let g_opt = gated.then_some(gate.as_slice());
            let r = ops::attn_split_merge_with(
                self.gpu,
                name,
                kv,
                &q,
                &kc,
                &vc,
                g_opt,
                pos0,
                (heads, nkv, hd),
                scale,
                (splits, 64),
            )
            .map(|o| {
                let len = pos0 + 1;
                let mut reference = vec![0.0f64; heads * hd];
                for h in 0..heads {
                    let g = h / (heads / nkv);
                    let qh = &q[h * hd..(h + 1) * hd];
                    let sc: Vec<f64> = (0..len)
                        .map(|j| {
                            dot64(qh, &kc[(j * nkv + g) * hd..(j * nkv + g + 1) * hd])
                                * f64::from(scale)
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let p: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let sum: f64 = p.iter().sum();
                    for i in 0..hd {
                        let a: f64 = p
                            .iter()
                            .enumerate()
                            .map(|(j, pj)| pj / sum * f64::from(vc[(j * nkv + g) * hd + i]))
                            .sum();
                        let gv = if gated {
                            1.0 / (1.0 + (-f64::from(gate[h * hd + i])).exp())
                        } else {
                            1.0
                        };
                        reference[h * hd + i] = a * gv;
                    }
                }
                (rel_err(&o, &reference), tol)
            });
            self.record(
                &kernel,
                format!(
                    "1 token at {pos0}, {splits} splits, {heads}/{nkv} heads x{hd}{}",
                    if gated { ", gated" } else { "" }
                ),
                r,
            );
        }
        self.attention_split_rows(d, name, kv);
    }

    /// Several rows in one `attn_split` + `attn_merge` (the verify pass of speculative decoding):
    /// row t bit for bit what a one-row call at `pos0 + t` computes.
    pub(super) fn attention_split_rows(&mut self, d: AttnDims, name: &str, kv: KvType) {
        let (hd, nkv, heads) = (d.hd, d.nkv, d.heads);
        let scale = 1.0 / (hd as f32).sqrt();
        let (rows, pos0, ctx, splits) = (5usize, 1021usize, 4096usize, 64usize);
        let q = self.rng.normals(rows * heads * hd, 1.0);
        let kc = self.rng.normals(ctx * nkv * hd, 1.0);
        let vc = self.rng.normals(ctx * nkv * hd, 1.0);
        let gate = self.rng.normals(rows * heads * hd, 2.0);
        let dims = (heads, nkv, hd);
        let r = (|| {
            let all = ops::attn_split_merge_with(
                self.gpu,
                name,
                kv,
                &q,
                &kc,
                &vc,
                Some(&gate),
                pos0,
                dims,
                scale,
                (splits, 64),
            )?;
            let w = heads * hd;
            let mut differ = 0usize;
            for t in 0..rows {
                let one = ops::attn_split_merge_with(
                    self.gpu,
                    name,
                    kv,
                    &q[t * w..(t + 1) * w],
                    &kc,
                    &vc,
                    Some(&gate[t * w..(t + 1) * w]),
                    pos0 + t,
                    dims,
                    scale,
                    (splits, 64),
                )?;
                differ += one
                    .iter()
                    .zip(&all[t * w..(t + 1) * w])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
            }
            // Values that differ from the one-row calls (bound 0: bit-identical).
            Ok((differ as f64, 0.0))
        })();
        self.record(
            &format!("{} rows", ops::kv_kernel(name, kv).unwrap_or_default()),
            format!("{rows} rows at {pos0}.., {splits} splits, {heads}/{nkv} heads x{hd}, vs one row each"),
            r,
        );
    }
}

/// Softmax attention of one query row `qh` over cache positions `0..len` of KV head `g` (`kc`,
/// `vc`: `[position][nkv][head_dim]`), in f64.
pub(super) fn attention_row64(
    qh: &[f32],
    kc: &[f32],
    vc: &[f32],
    (len, nkv, g): (usize, usize, usize),
    scale: f32,
) -> Vec<f64> {
    let hd = qh.len();
    let at = |j: usize| (j * nkv + g) * hd;
    let sc: Vec<f64> = (0..len)
        .map(|j| dot64(qh, &kc[at(j)..at(j) + hd]) * f64::from(scale))
        .collect();
    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let p: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = p.iter().sum();
    let mut out = vec![0.0f64; hd];
    for (j, pj) in p.iter().enumerate() {
        for (i, o) in out.iter_mut().enumerate() {
            *o += pj / sum * f64::from(vc[at(j) + i]);
        }
    }
    out
}

/// RMSNorm with weight, then NeoX RoPE at `pos` (sine and cosine rounded to f32 like the kernel).
pub(super) fn qk_norm_rope64(
    x: &[f32],
    w: &[f32],
    eps: f64,
    pos: usize,
    rd: usize,
    theta: f64,
) -> Vec<f64> {
    let n = x.len();
    let ms = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    let mut h: Vec<f64> = x
        .iter()
        .zip(w)
        .map(|(&v, &g)| f64::from(v) * inv * f64::from(g))
        .collect();
    let half = rd / 2;
    for j in 0..half {
        let angle = pos as f64 * theta.powf(-2.0 * j as f64 / rd as f64);
        let (s, c) = (f64::from(angle.sin() as f32), f64::from(angle.cos() as f32));
        let (a, b) = (h[j], h[j + half]);
        h[j] = a * c - b * s;
        h[j + half] = b * c + a * s;
    }
    h
}
