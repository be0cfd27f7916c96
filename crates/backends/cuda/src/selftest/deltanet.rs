//! Self-test of the Gated DeltaNet kernels (`ops::deltanet`): conv, gates, the delta rule, the
//! fused and multi-token forms.

use super::*;

impl Runner<'_> {
    pub(super) fn deltanet(&mut self) {
        let d = DeltaDims {
            nk: 16,
            nv: 32,
            dk: 128,
            dv: 128,
        };
        let kern = 4usize;
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;

        // Conv step.
        let x = self.rng.normals(ch, 1.0);
        let state = self.rng.normals((kern - 1) * ch, 1.0);
        let w = self.rng.normals(kern * ch, 0.5);
        let r = ops::dn_conv_step(self.gpu, &x, &state, &w, kern).map(|(y, st)| {
            let mut reference = Vec::with_capacity(ch);
            for c in 0..ch {
                let mut acc = 0.0f64;
                for j in 0..kern - 1 {
                    acc += f64::from(w[c * kern + j]) * f64::from(state[j * ch + c]);
                }
                acc += f64::from(w[c * kern + kern - 1]) * f64::from(x[c]);
                reference.push(silu64(acc));
            }
            let mut ref_state: Vec<f64> = state[ch..].iter().map(|&v| f64::from(v)).collect();
            ref_state.extend(x.iter().map(|&v| f64::from(v)));
            (
                rel_err(&y, &reference).max(rel_err(&st, &ref_state)),
                TOL_F32,
            )
        });
        self.record("dn_conv_step", format!("{ch} ch, kernel {kern}"), r);

        // Gates.
        let r_ = d.nv / d.nk;
        let ba = self.rng.normals(2 * d.nv, 2.0);
        let a: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 8.0 + 0.1) as f32)
            .collect();
        let dt = self.rng.normals(d.nv, 1.0);
        let r = ops::dn_gates(self.gpu, &ba, &a, &dt, r_).map(|(beta, g)| {
            let mut rb = Vec::new();
            let mut rg = Vec::new();
            for h in 0..d.nv {
                let (grp, j) = (h / r_, h % r_);
                rb.push(1.0 / (1.0 + (-f64::from(ba[grp * 2 * r_ + j])).exp()));
                let z = f64::from(ba[grp * 2 * r_ + r_ + j]) + f64::from(dt[h]);
                let sp = if z > 20.0 { z } else { z.exp().ln_1p() };
                rg.push(f64::from(a[h]) * sp);
            }
            (rel_err(&beta, &rb).max(rel_err(&g, &rg)), TOL_F32)
        });
        self.record("dn_gates", format!("{} V heads", d.nv), r);

        // Delta rule step, on L2-normalised q and k like the model's.
        let mut qkv = self.rng.normals(ch, 1.0);
        for head in qkv[..2 * d.nk * d.dk].chunks_exact_mut(d.dk) {
            let n = head.iter().map(|v| v * v).sum::<f32>().sqrt();
            head.iter_mut().for_each(|v| *v /= n);
        }
        let beta: Vec<f32> = (0..d.nv).map(|_| self.rng.uniform() as f32).collect();
        let g: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 2.0) as f32)
            .collect();
        let s0 = self.rng.normals(d.nv * d.dk * d.dv, 0.1);
        let r = ops::dn_delta_step(self.gpu, &qkv, &beta, &g, &s0, d).map(|(o, s1)| {
            let mut ro = vec![0.0f64; d.nv * d.dv];
            let mut rs: Vec<f64> = s0.iter().map(|&v| f64::from(v)).collect();
            for h in 0..d.nv {
                let kh = h / (d.nv / d.nk);
                let q = &qkv[kh * d.dk..(kh + 1) * d.dk];
                let k = &qkv[d.nk * d.dk + kh * d.dk..d.nk * d.dk + (kh + 1) * d.dk];
                let v = &qkv[2 * d.nk * d.dk + h * d.dv..2 * d.nk * d.dk + (h + 1) * d.dv];
                let s = &mut rs[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
                let alpha = f64::from(g[h]).exp();
                s.iter_mut().for_each(|x| *x *= alpha);
                for j in 0..d.dv {
                    let m: f64 = (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(k[i])).sum();
                    let delta = f64::from(beta[h]) * (f64::from(v[j]) - m);
                    for i in 0..d.dk {
                        s[i * d.dv + j] += f64::from(k[i]) * delta;
                    }
                    ro[h * d.dv + j] = (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(q[i])).sum();
                }
            }
            (rel_err(&o, &ro).max(rel_err(&s1, &rs)), TOL_F32)
        });
        self.record(
            "dn_delta_step",
            format!("{}/{} heads, {}x{}", d.nk, d.nv, d.dk, d.dv),
            r,
        );
    }

    /// The DeltaNet chain of the prompt path over several tokens: conv, q/k norm, gates, and the
    /// delta rule in one launch, each against the token-by-token recurrence in f64.
    pub(super) fn deltanet_seq(&mut self) {
        let d = DeltaDims {
            nk: 4,
            nv: 8,
            dk: 128,
            dv: 128,
        };
        let (kern, n) = (4usize, 7usize);
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;

        // Conv over n tokens: dn_conv_seq, and the prompt form (dn_conv_prompt + dn_conv_shift)
        // over several token tiles.
        for (n, prompt) in [(n, false), (70, true)] {
            let x = self.rng.normals(n * ch, 1.0);
            let state = self.rng.normals((kern - 1) * ch, 1.0);
            let w = self.rng.normals(kern * ch, 0.5);
            let r = ops::dn_conv_seq(self.gpu, &x, &state, &w, ch, kern, prompt).map(|(y, st)| {
                let mut hist: Vec<f32> = state.clone();
                hist.extend_from_slice(&x);
                let mut reference = Vec::with_capacity(n * ch);
                for t in 0..n {
                    for c in 0..ch {
                        let acc: f64 = (0..kern)
                            .map(|j| f64::from(w[c * kern + j]) * f64::from(hist[(t + j) * ch + c]))
                            .sum();
                        reference.push(silu64(acc));
                    }
                }
                let ref_state: Vec<f64> = hist[n * ch..].iter().map(|&v| f64::from(v)).collect();
                (
                    rel_err(&y, &reference).max(rel_err(&st, &ref_state)),
                    TOL_F32,
                )
            });
            self.record(
                if prompt {
                    "dn_conv_prompt"
                } else {
                    "dn_conv_seq"
                },
                format!("{n} tokens, {ch} ch, kernel {kern}"),
                r,
            );
        }

        // q/k L2 norm in place.
        let raw = self.rng.normals(n * ch, 2.0);
        let q_scale = 1.0 / (d.dk as f32).sqrt();
        let r = ops::dn_qk_norm(self.gpu, &raw, ch, d.nk, d.dk, 1e-6, q_scale).map(|y| {
            let mut reference: Vec<f64> = raw.iter().map(|&v| f64::from(v)).collect();
            for t in 0..n {
                for row in 0..2 * d.nk {
                    let at = t * ch + row * d.dk;
                    let s = if row < d.nk { f64::from(q_scale) } else { 1.0 };
                    let v = l2_norm64(&raw[at..at + d.dk], 1e-6, s);
                    reference[at..at + d.dk].copy_from_slice(&v);
                }
            }
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record(
            "dn_qk_norm",
            format!("{n} tokens, 2x{} heads x{}", d.nk, d.dk),
            r,
        );

        // Gates of n tokens.
        let r_ = d.nv / d.nk;
        let ba = self.rng.normals(n * 2 * d.nv, 2.0);
        let a: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 8.0 + 0.1) as f32)
            .collect();
        let dt = self.rng.normals(d.nv, 1.0);
        let r = ops::dn_gates(self.gpu, &ba, &a, &dt, r_).map(|(beta, g)| {
            let (mut rb, mut rg) = (Vec::new(), Vec::new());
            for t in 0..n {
                let bat = &ba[t * 2 * d.nv..(t + 1) * 2 * d.nv];
                for h in 0..d.nv {
                    let (grp, j) = (h / r_, h % r_);
                    rb.push(1.0 / (1.0 + (-f64::from(bat[grp * 2 * r_ + j])).exp()));
                    let z = f64::from(bat[grp * 2 * r_ + r_ + j]) + f64::from(dt[h]);
                    let sp = if z > 20.0 { z } else { z.exp().ln_1p() };
                    rg.push(f64::from(a[h]) * sp);
                }
            }
            (rel_err(&beta, &rb).max(rel_err(&g, &rg)), TOL_F32)
        });
        self.record("dn_gates", format!("{n} tokens, {} V heads", d.nv), r);

        // The delta rule over n tokens in one launch: dn_delta_seq, and dn_delta_warp_<dk> on
        // this shape and on the tiny fixtures' (dk = dv = 64).
        self.delta_rule(d, n);
        self.delta_rule(
            DeltaDims {
                nk: 2,
                nv: 4,
                dk: 64,
                dv: 64,
            },
            n,
        );
    }

    /// `dn_delta_seq` and `dn_delta_warp_<dk>` over `n` tokens against an f64 reference.
    pub(super) fn delta_rule(&mut self, d: DeltaDims, n: usize) {
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;
        let mut qkv = self.rng.normals(n * ch, 1.0);
        for t in 0..n {
            for head in qkv[t * ch..t * ch + 2 * d.nk * d.dk].chunks_exact_mut(d.dk) {
                let norm = head.iter().map(|v| v * v).sum::<f32>().sqrt();
                head.iter_mut().for_each(|v| *v /= norm);
            }
        }
        let beta: Vec<f32> = (0..n * d.nv).map(|_| self.rng.uniform() as f32).collect();
        let g: Vec<f32> = (0..n * d.nv)
            .map(|_| -(self.rng.uniform() * 2.0) as f32)
            .collect();
        let s0 = self.rng.normals(d.nv * d.dk * d.dv, 0.1);
        let reference = || {
            let mut ro = vec![0.0f64; n * d.nv * d.dv];
            let mut rs: Vec<f64> = s0.iter().map(|&v| f64::from(v)).collect();
            for t in 0..n {
                let row = &qkv[t * ch..(t + 1) * ch];
                for h in 0..d.nv {
                    let kh = h / (d.nv / d.nk);
                    let q = &row[kh * d.dk..(kh + 1) * d.dk];
                    let k = &row[d.nk * d.dk + kh * d.dk..d.nk * d.dk + (kh + 1) * d.dk];
                    let v = &row[2 * d.nk * d.dk + h * d.dv..2 * d.nk * d.dk + (h + 1) * d.dv];
                    let s = &mut rs[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
                    let alpha = f64::from(g[t * d.nv + h]).exp();
                    s.iter_mut().for_each(|x| *x *= alpha);
                    for j in 0..d.dv {
                        let m: f64 = (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(k[i])).sum();
                        let delta = f64::from(beta[t * d.nv + h]) * (f64::from(v[j]) - m);
                        for i in 0..d.dk {
                            s[i * d.dv + j] += f64::from(k[i]) * delta;
                        }
                        ro[(t * d.nv + h) * d.dv + j] =
                            (0..d.dk).map(|i| s[i * d.dv + j] * f64::from(q[i])).sum();
                    }
                }
            }
            (ro, rs)
        };
        let (ro, rs) = reference();
        for warp in [false, true] {
            if warp && ops::delta_warp_launch(d.nv, d.dk, d.dv).is_none() {
                continue;
            }
            let r = ops::dn_delta_seq(self.gpu, &qkv, &beta, &g, &s0, d, warp)
                .map(|(o, s1)| (rel_err(&o, &ro).max(rel_err(&s1, &rs)), TOL_F32));
            self.record(
                if warp {
                    "dn_delta_warp"
                } else {
                    "dn_delta_seq"
                },
                format!("{n} tokens, {}/{} heads, {}x{}", d.nk, d.nv, d.dk, d.dv),
                r,
            );
        }
    }

    /// `dn_fused_seq` (conv, q/k norm, gates, delta rule, gated norm in one launch) against an
    /// f64 reference of the five steps, on 1, 5 and 19 tokens (each run starts from the one before's
    /// states, so the carried conv window and delta state are checked too; 19 crosses
    /// `dn_fused_cols`' 16-token chunk; the longer runs also write the
    /// states after every token, the trace of a speculative verify, checked against the
    /// reference's and, for the last token, bit for bit against the carried states).
    pub(super) fn deltanet_fused(&mut self) {
        let d = DeltaDims {
            nk: 4,
            nv: 8,
            dk: 128,
            dv: 128,
        };
        let (kern, eps, l2_eps) = (4usize, 1e-6f32, 1e-6f32);
        let ch = 2 * d.nk * d.dk + d.nv * d.dv;
        let r_ = d.nv / d.nk;
        let q_scale = 1.0 / (d.dk as f32).sqrt();
        let conv_w = self.rng.normals(kern * ch, 0.5);
        let a: Vec<f32> = (0..d.nv)
            .map(|_| -(self.rng.uniform() * 8.0 + 0.1) as f32)
            .collect();
        let dt = self.rng.normals(d.nv, 1.0);
        let norm_w: Vec<f32> = (0..d.dv).map(|_| 0.5 + self.rng.uniform() as f32).collect();
        let mut conv_state = self.rng.normals((kern - 1) * ch, 1.0);
        let mut s = self.rng.normals(d.nv * d.dk * d.dv, 0.1);
        for n in [1usize, 5, 19] {
            let qkv = self.rng.normals(n * ch, 1.0);
            let ba = self.rng.normals(n * 2 * d.nv, 2.0);
            let z = self.rng.normals(n * d.nv * d.dv, 1.0);
            let trace = n > 1;
            let run = |variant: (bool, bool)| {
                ops::dn_fused_seq(
                    self.gpu,
                    variant,
                    trace,
                    &qkv,
                    &conv_state,
                    &conv_w,
                    &ba,
                    (&a, &dt),
                    &s,
                    &z,
                    &norm_w,
                    d,
                    kern,
                    (l2_eps, q_scale, eps),
                )
            };
            let got = run((false, false));
            // dn_fused_cols (a V head's columns over several blocks; several tokens:
            // dn_fused_cols_rows, unless REDLITE_CUDA_DN_ROWS=0) and both kernels with their
            // weights and conv windows loaded before the wait, on the same inputs: every output
            // and trace the same bits as dn_fused_seq's.
            let cols_name = if n > 1 && std::env::var("REDLITE_CUDA_DN_ROWS").as_deref() != Ok("0")
            {
                "dn_fused_cols_rows"
            } else {
                "dn_fused_cols"
            };
            for (variant, name, what) in [
                ((false, true), "dn_fused_seq", "preloaded, "),
                ((true, false), cols_name, ""),
                ((true, true), cols_name, "preloaded, "),
            ] {
                let r = run(variant).and_then(|c| {
                    let g = got
                        .as_ref()
                        .map_err(|e| crate::CudaError::Invalid(e.to_string()))?;
                    same_bits("outputs differ", &c.y, &g.y)?;
                    same_bits("conv state differs", &c.conv, &g.conv)?;
                    same_bits("delta state differs", &c.state, &g.state)?;
                    same_bits("conv trace differs", &c.conv_trace, &g.conv_trace)?;
                    same_bits("state trace differs", &c.state_trace, &g.state_trace)?;
                    Ok((0.0, 0.0))
                });
                self.record(
                    name,
                    format!(
                        "{n} tokens, {}/{} heads, {}x{}{}, {what}vs dn_fused_seq bit for bit",
                        d.nk,
                        d.nv,
                        d.dk,
                        d.dv,
                        if trace { ", trace" } else { "" }
                    ),
                    r,
                );
            }
            // Reference in f64.
            let mut hist: Vec<f64> = conv_state.iter().map(|&v| f64::from(v)).collect();
            hist.extend(qkv.iter().map(|&v| f64::from(v)));
            let mut rs: Vec<f64> = s.iter().map(|&v| f64::from(v)).collect();
            let mut ry = Vec::with_capacity(n * d.nv * d.dv);
            let (mut r_st, mut r_ct) = (Vec::new(), Vec::new());
            for t in 0..n {
                let mut c_out: Vec<f64> = (0..ch)
                    .map(|c| {
                        silu64(
                            (0..kern)
                                .map(|j| f64::from(conv_w[c * kern + j]) * hist[(t + j) * ch + c])
                                .sum(),
                        )
                    })
                    .collect();
                for head in 0..2 * d.nk {
                    let v = &mut c_out[head * d.dk..(head + 1) * d.dk];
                    let inv =
                        1.0 / (v.iter().map(|x| x * x).sum::<f64>() + f64::from(l2_eps)).sqrt();
                    let sc = if head < d.nk { f64::from(q_scale) } else { 1.0 };
                    v.iter_mut().for_each(|x| *x = *x * inv * sc);
                }
                let bat = &ba[t * 2 * d.nv..(t + 1) * 2 * d.nv];
                for h in 0..d.nv {
                    let (kh, j) = (h / r_, h % r_);
                    let beta = 1.0 / (1.0 + (-f64::from(bat[kh * 2 * r_ + j])).exp());
                    let zz = f64::from(bat[kh * 2 * r_ + r_ + j]) + f64::from(dt[h]);
                    let g = f64::from(a[h]) * if zz > 20.0 { zz } else { zz.exp().ln_1p() };
                    let q = &c_out[kh * d.dk..(kh + 1) * d.dk];
                    let k = &c_out[(d.nk + kh) * d.dk..(d.nk + kh + 1) * d.dk];
                    let v = &c_out[2 * d.nk * d.dk + h * d.dv..2 * d.nk * d.dk + (h + 1) * d.dv];
                    let sh = &mut rs[h * d.dk * d.dv..(h + 1) * d.dk * d.dv];
                    sh.iter_mut().for_each(|x| *x *= g.exp());
                    let mut o = vec![0.0f64; d.dv];
                    for jj in 0..d.dv {
                        let m: f64 = (0..d.dk).map(|i| sh[i * d.dv + jj] * k[i]).sum();
                        let delta = beta * (v[jj] - m);
                        for i in 0..d.dk {
                            sh[i * d.dv + jj] += k[i] * delta;
                        }
                        o[jj] = (0..d.dk).map(|i| sh[i * d.dv + jj] * q[i]).sum();
                    }
                    let inv = 1.0
                        / (o.iter().map(|x| x * x).sum::<f64>() / d.dv as f64 + f64::from(eps))
                            .sqrt();
                    for jj in 0..d.dv {
                        let zv = f64::from(z[(t * d.nv + h) * d.dv + jj]);
                        ry.push(o[jj] * inv * f64::from(norm_w[jj]) * silu64(zv));
                    }
                }
                r_st.extend_from_slice(&rs);
                r_ct.extend_from_slice(&hist[(t + 1) * ch..(t + kern) * ch]);
            }
            let r_state: Vec<f64> = hist[n * ch..].to_vec();
            let r = got.map(|out| {
                let mut e = rel_err(&out.y, &ry)
                    .max(rel_err(&out.conv, &r_state))
                    .max(rel_err(&out.state, &rs));
                if trace {
                    e = e
                        .max(rel_err(&out.state_trace, &r_st))
                        .max(rel_err(&out.conv_trace, &r_ct));
                    let (sl, cl) = (out.state.len(), out.conv.len());
                    let same = |a: &[f32], b: &[f32]| {
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                    };
                    if !same(&out.state_trace[(n - 1) * sl..], &out.state)
                        || !same(&out.conv_trace[(n - 1) * cl..], &out.conv)
                    {
                        e = f64::INFINITY; // the last trace row must be the carried state
                    }
                }
                conv_state = out.conv;
                s = out.state;
                (e, TOL_F32)
            });
            self.record(
                "dn_fused_seq",
                format!(
                    "{n} tokens, {}/{} heads, {}x{}{}",
                    d.nk,
                    d.nv,
                    d.dk,
                    d.dv,
                    if trace { ", trace" } else { "" }
                ),
                r,
            );
        }
    }
}

/// `x · rsqrt(Σx² + eps) · scale` in f64.
pub(super) fn l2_norm64(x: &[f32], eps: f64, scale: f64) -> Vec<f64> {
    let ss: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum();
    let inv = 1.0 / (ss + eps).sqrt();
    x.iter().map(|&v| f64::from(v) * inv * scale).collect()
}
