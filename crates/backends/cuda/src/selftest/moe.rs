//! Self-test of the mixture-of-experts kernels (`ops::moe`): routers, routed experts in each form,
//! the combine.

use super::*;

impl Runner<'_> {
    /// Every IQ2_XXS part on 8-bit activations (`REDLITE_CUDA_Q8_MOE_DOWN`): the activations
    /// against f64 on the q8 input, their q8 rows bit for bit the quantisation of those f32
    /// activations, and the output against f64 on both q8 inputs.
    pub(super) fn experts_q8_down(&mut self) {
        let ty = GgmlType::IQ2XXS;
        for (hidden, ff) in [(2048usize, 512usize), (512, 256)] {
            let (n_exp, chosen, weights) = (6usize, [1usize, 2, 4], [0.45f32, 0.35, 0.2]);
            let [gate, up, down] = self.random_experts(ty, (hidden, ff), n_exp);
            let x = self.rng.normals(hidden, 1.0);
            let r = (|| {
                let parts = upload_experts(self.gpu, [&gate, &up, &down], &chosen)?;
                let set = expert_set(ty, &parts);
                let (y, act, actq) = ops::moe_experts_q8_down(
                    self.gpu,
                    &set,
                    &weights,
                    &ops::q8_row(&x),
                    (hidden, ff),
                )?;
                // The top-k inside the gate/up blocks (`moe_gate_up_route_q8q_iq2_xxs`): on
                // logits whose top 3 of 64 are the set's experts, moe_router_warp's ids and
                // weights and the activations above, bit for bit.
                let ne = 64usize;
                let logits: Vec<f32> = (0..ne)
                    .map(|e| {
                        let u = self.rng.uniform() as f32;
                        if e < chosen.len() {
                            4.0 + u
                        } else {
                            u - 2.0
                        }
                    })
                    .collect();
                let (ids_r, wts_r, act_r, actq_r) = ops::moe_gate_up_route_q8q(
                    self.gpu,
                    false,
                    &set,
                    &logits,
                    &ops::q8_row(&x),
                    (hidden, ff),
                )?;
                // The two-rows-a-warp form (`moe_gate_up_route2_q8q_iq2_xxs`): the same bits.
                let (ids_2, wts_2, act_2, actq_2) = ops::moe_gate_up_route_q8q(
                    self.gpu,
                    true,
                    &set,
                    &logits,
                    &ops::q8_row(&x),
                    (hidden, ff),
                )?;
                same_route(
                    "route2",
                    (&ids_2, &wts_2, &act_2, &actq_2),
                    (&ids_r, &wts_r, &act_r, &actq_r),
                )?;
                // The experts in slots of one buffer (every expert resident): the parts found at
                // the table's first entries + id · slot stride (`dstride`), the same bits as
                // through the table entries.
                let slot_logits: Vec<f32> = (0..n_exp)
                    .map(|_| 4.0 * self.rng.uniform() as f32)
                    .collect();
                let slots = |direct| {
                    ops::moe_route_down_q8_slots(
                        self.gpu,
                        [&gate[..], &up[..], &down[..]],
                        &slot_logits,
                        chosen.len(),
                        &ops::q8_row(&x),
                        (hidden, ff),
                        direct,
                    )
                };
                let (y_t, act_t, actq_t) = slots(false)?;
                let (y_d, act_d, actq_d) = slots(true)?;
                same_bits("direct expert parts: output differs", &y_d, &y_t)?;
                same_bits("direct expert parts: activations differ", &act_d, &act_t)?;
                same_bytes("direct expert parts: q8 rows differ", &actq_d, &actq_t)?;
                // The router, its top-k and the gate/up in one launch with a grid barrier
                // (`moe_route_gate_up_q8q_iq2_xxs`, the model's decode path): every output the
                // two launches' (`matvec3_x_f32`, `moe_gate_up_route2`) bit for bit.
                let router = self.rng.normals(n_exp * hidden, 0.05);
                let gate_vec = self.rng.normals(hidden, 0.05);
                let xq = ops::q8_row(&x);
                let route = |form| {
                    ops::moe_route_gate_up_slots(
                        self.gpu,
                        [&gate[..], &up[..], &down[..]],
                        &router,
                        &gate_vec,
                        (&x, &xq),
                        chosen.len(),
                        (hidden, ff),
                        form,
                    )
                };
                let separate = route(ops::RouteForm::Separate)?;
                // The fused kernel.
                same_fused_route(&route(ops::RouteForm::Fused)?, &separate)?;
                let kernel = ops::RouterKernel::warp(ne)
                    .ok_or_else(|| CudaError::Invalid("no warp router for this shape".into()))?;
                let (ids_ref, wts_ref) =
                    ops::moe_router(self.gpu, kernel, &logits, ne, chosen.len())?;
                if ids_r != ids_ref || ids_r != [0, 1, 2] {
                    return Err(CudaError::Invalid(format!(
                        "routed gate/up ids {ids_r:?}, moe_router_warp {ids_ref:?}"
                    )));
                }
                same_bits(
                    "routed gate/up weights differ from moe_router_warp",
                    &wts_r,
                    &wts_ref,
                )?;
                same_bits("routed gate/up activations differ", &act_r, &act)?;
                same_bytes("routed gate/up q8 rows differ", &actq_r, &actq)?;
                let expect: Vec<u8> = act.chunks(ff).flat_map(ops::q8_row).collect();
                same_bytes(
                    "moe_gate_up_tab_q8q: the q8 rows differ from its quantised activations",
                    &actq,
                    &expect,
                )?;
                let deq = |b: &[u8]| {
                    dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()))
                };
                let xq = quantize_q8_blocks(&x);
                let (mut ref_act, mut reference) = (Vec::new(), vec![0.0f64; hidden]);
                for (i, &e) in chosen.iter().enumerate() {
                    let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                    for r in 0..ff {
                        let gv = dot64(&g[r * hidden..(r + 1) * hidden], &xq);
                        let uv = dot64(&u[r * hidden..(r + 1) * hidden], &xq);
                        ref_act.push(silu64(gv) * uv);
                    }
                    // The down rows against the kernel's own activations, quantised.
                    let aq = quantize_q8_blocks(&act[i * ff..(i + 1) * ff]);
                    for (r, o) in reference.iter_mut().enumerate() {
                        *o += f64::from(weights[i]) * dot64(&d[r * ff..(r + 1) * ff], &aq);
                    }
                }
                Ok((
                    rel_err(&y, &reference).max(rel_err(&act, &ref_act)),
                    TOL_F32,
                ))
            })();
            self.record(
                "experts q8 down IQ2_XXS",
                format!("k=3 of {n_exp}, {hidden}/{ff}, activations and their q8 rows, routed gate/up = moe_router_warp + gate/up bit for bit, direct parts = table bit for bit, fused route = router + route2 bit for bit"),
                r,
            );
        }
    }

    /// The routed experts of several tokens (a verify's rows) on 8-bit activations: the one-token
    /// kernels on a grid of tokens against f64, and the token-tile kernels
    /// (`moe_gate_up_tok_q8q_iq2_xxs`, `moe_down_combine_tok_q8_iq2_xxs`) bit for bit against them,
    /// tiles that leave a partial last tile, through the table and at direct slots.
    pub(super) fn experts_q8_tokens(&mut self) {
        let ty = GgmlType::IQ2XXS;
        for (hidden, ff) in [(2048usize, 512usize), (512, 256)] {
            let (n_exp, n, k) = (6usize, 7usize, 3usize);
            let [gate, up, down] = self.random_experts(ty, (hidden, ff), n_exp);
            let x = self.rng.normals(n * hidden, 1.0);
            let mut ids = Vec::new();
            for _ in 0..n {
                let mut row: Vec<i32> = Vec::new();
                while row.len() < k {
                    let e = self.rng.below(n_exp) as i32;
                    if !row.contains(&e) {
                        row.push(e);
                    }
                }
                ids.extend(row);
            }
            let weights: Vec<f32> = (0..n * k)
                .map(|_| 0.1 + self.rng.uniform() as f32)
                .collect();
            let tiles = [(1usize, 1usize), (2, 3), (4, 8), (3, 5)];
            let r = (|| {
                let xq: Vec<u8> = x.chunks(hidden).flat_map(ops::q8_row).collect();
                let parts = [&gate[..], &up[..], &down[..]];
                let run = |t, direct| {
                    ops::moe_experts_q8_tokens(
                        self.gpu,
                        parts,
                        &ids,
                        &weights,
                        &xq,
                        (hidden, ff),
                        t,
                        direct,
                    )
                };
                let (y, act, actq) = run((0, 0), false)?;
                for direct in [false, true] {
                    for &t in &tiles {
                        let (y_t, act_t, actq_t) = run(t, direct)?;
                        let what = format!("token tiles {t:?} (direct {direct})");
                        same_bits(&format!("{what}: activations differ"), &act_t, &act)?;
                        same_bytes(&format!("{what}: q8 rows differ"), &actq_t, &actq)?;
                        same_bits(&format!("{what}: outputs differ"), &y_t, &y)?;
                    }
                }
                let deq = |b: &[u8]| {
                    dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()))
                };
                let (mut ref_act, mut reference) = (Vec::new(), Vec::new());
                let gl = 1.0 / (1.0 + (-0.25f64).exp());
                for t in 0..n {
                    let xq = quantize_q8_blocks(&x[t * hidden..(t + 1) * hidden]);
                    let mut out: Vec<f64> = (0..hidden)
                        .map(|i| ((t * hidden + i) % 7) as f64 * 0.25 + gl * 0.5)
                        .collect();
                    for c in 0..k {
                        let (e, w) = (ids[t * k + c] as usize, weights[t * k + c]);
                        let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                        for r in 0..ff {
                            let gv = dot64(&g[r * hidden..(r + 1) * hidden], &xq);
                            let uv = dot64(&u[r * hidden..(r + 1) * hidden], &xq);
                            ref_act.push(silu64(gv) * uv);
                        }
                        let at = (t * k + c) * ff;
                        let aq = quantize_q8_blocks(&act[at..at + ff]);
                        for (r, o) in out.iter_mut().enumerate() {
                            *o += f64::from(w) * dot64(&d[r * ff..(r + 1) * ff], &aq);
                        }
                    }
                    reference.extend(out);
                }
                Ok((
                    rel_err(&y, &reference).max(rel_err(&act, &ref_act)),
                    TOL_F32,
                ))
            })();
            self.record(
                "experts q8 tokens IQ2_XXS",
                format!(
                    "n={n} k={k} of {n_exp}, {hidden}/{ff}, one-token kernels on a grid against f64, token tiles {tiles:?} bit for bit, table and direct"
                ),
                r,
            );
        }
    }

    /// `swiglu_q8`: silu(gate) · up against f64, and its q8 rows bit for bit the quantisation of
    /// its own output (what `matvec_norm3_q8` would stage from it).
    pub(super) fn swiglu_q8(&mut self) {
        let (n, len) = (3usize, 512usize);
        let g = self.rng.normals(n * len, 2.0);
        let u = self.rng.normals(n * len, 1.0);
        let r = (|| {
            let (out, xq) = ops::swiglu_q8(self.gpu, &g, &u, len)?;
            let expect: Vec<u8> = out.chunks(len).flat_map(ops::q8_row).collect();
            same_bytes(
                "swiglu_q8: the q8 rows differ from the quantised output",
                &xq,
                &expect,
            )?;
            let reference: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&a, &b)| silu64(f64::from(a)) * f64::from(b))
                .collect();
            Ok((rel_err(&out, &reference), TOL_F32))
        })();
        self.record(
            "swiglu_q8",
            format!("n={n} of {len}, q8 rows of its output"),
            r,
        );
    }

    /// The fused route kernel's top-k on a model-sized router (512 experts, top 10), where
    /// its block-wide selection (`TOPK_PAR`) sees many warps and its candidates: random logits,
    /// each logit four times (ties at the threshold, broken by the lower id) and each 128 times
    /// (more candidates than it holds: warp 0's rounds instead). Every output the separate
    /// kernels' (`matvec3_x_f32`, `moe_gate_up_route2_q8q_iq2_xxs`) bit for bit.
    pub(super) fn route_topk_many(&mut self) {
        let ty = GgmlType::IQ2XXS;
        let (hidden, ff, ne, k) = (256usize, 64usize, 512usize, 10usize);
        let [gate, up, down] = self.random_experts(ty, (hidden, ff), ne);
        let x = self.rng.normals(hidden, 1.0);
        let xq = ops::q8_row(&x);
        let gate_vec = self.rng.normals(hidden, 0.05);
        let base = self.rng.normals(ne * hidden, 0.05);
        for copies in [1usize, 4, 128] {
            let distinct = ne / copies;
            let router: Vec<f32> = (0..ne)
                .flat_map(|e| base[(e % distinct) * hidden..(e % distinct + 1) * hidden].to_vec())
                .collect();
            let route = |gpu, form| {
                ops::moe_route_gate_up_slots(
                    gpu,
                    [&gate[..], &up[..], &down[..]],
                    &router,
                    &gate_vec,
                    (&x, &xq),
                    k,
                    (hidden, ff),
                    form,
                )
            };
            let r = (|| {
                let separate = route(self.gpu, ops::RouteForm::Separate)?;
                same_fused_route(&route(self.gpu, ops::RouteForm::Fused)?, &separate)?;
                Ok((0.0, 0.0))
            })();
            self.record(
                "moe_route_gate_up_q8q_iq2_xxs",
                format!(
                    "top-{k} of {ne}, each logit {copies}x, {hidden}/{ff}: = router + route2 bit for bit"
                ),
                r,
            );
        }
    }

    /// `n` random experts of type `ty`: gate and up `[ff][hidden]`, down `[hidden][ff]`.
    pub(super) fn random_experts(
        &mut self,
        ty: GgmlType,
        (hidden, ff): (usize, usize),
        n: usize,
    ) -> [Vec<Vec<u8>>; 3] {
        let mut make = |rows, cols| -> Vec<Vec<u8>> {
            (0..n)
                .map(|_| random_weights(&mut self.rng, ty, rows, cols))
                .collect()
        };
        [make(ff, hidden), make(ff, hidden), make(hidden, ff)]
    }

    /// The routed experts with IQ2_XXS gate/up on a q8 row (`moe_gate_up_tab_q8_iq2_xxs`, then the
    /// f32 down kernel) against f64 on the same 8-bit activations; 2048 and 512 wide.
    pub(super) fn experts_q8(&mut self) {
        let ty = GgmlType::IQ2XXS;
        for (hidden, ff) in [(2048usize, 512usize), (512, 256)] {
            let (n_exp, chosen, weights) = (6usize, [0usize, 3, 5], [0.5f32, 0.3, 0.2]);
            let [gate, up, down] = self.random_experts(ty, (hidden, ff), n_exp);
            let x = self.rng.normals(hidden, 1.0);
            let r = (|| {
                let parts = upload_experts(self.gpu, [&gate, &up, &down], &chosen)?;
                let set = expert_set(ty, &parts);
                let y =
                    ops::moe_experts_q8(self.gpu, &set, &weights, &ops::q8_row(&x), (hidden, ff))?;
                let deq = |b: &[u8]| {
                    dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()))
                };
                let xq = quantize_q8_blocks(&x);
                let mut reference = vec![0.0f64; hidden];
                for (i, &e) in chosen.iter().enumerate() {
                    let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                    let act: Vec<f32> = (0..ff)
                        .map(|r| {
                            let gv = dot64(&g[r * hidden..(r + 1) * hidden], &xq);
                            let uv = dot64(&u[r * hidden..(r + 1) * hidden], &xq);
                            (silu64(gv) * uv) as f32
                        })
                        .collect();
                    for (r, o) in reference.iter_mut().enumerate() {
                        *o += f64::from(weights[i]) * dot64(&d[r * ff..(r + 1) * ff], &act);
                    }
                }
                Ok((rel_err(&y, &reference), TOL_F32))
            })();
            self.record(
                "experts q8 IQ2_XXS",
                format!("k=3 of {n_exp}, {hidden}/{ff}, gate/up on a q8 row"),
                r,
            );
        }
    }

    pub(super) fn experts(&mut self, ty: GgmlType) {
        let (n_exp, k, hidden, ff) = (8usize, 3usize, 512usize, 512usize);
        let gate: Vec<Vec<u8>> = (0..n_exp)
            .map(|_| random_weights(&mut self.rng, ty, ff, hidden))
            .collect();
        let up: Vec<Vec<u8>> = (0..n_exp)
            .map(|_| random_weights(&mut self.rng, ty, ff, hidden))
            .collect();
        let down: Vec<Vec<u8>> = (0..n_exp)
            .map(|_| random_weights(&mut self.rng, ty, hidden, ff))
            .collect();
        let chosen = [1usize, 4, 6];
        let weights = [0.5f32, 0.3, 0.2];
        let x = self.rng.normals(hidden, 1.0);
        let r = (|| {
            let parts = upload_experts(self.gpu, [&gate, &up, &down], &chosen)?;
            let set = expert_set(ty, &parts);
            // The pointer-array kernels and the table kernels the model runs, same reference.
            let y = ops::moe_experts(self.gpu, &set, &weights, &x, ff)?;
            let yt = ops::moe_experts_tab(self.gpu, &set, &weights, &x, ff)?;
            let deq =
                |b: &[u8]| dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()));
            let mut reference = vec![0.0f64; hidden];
            for (i, &e) in chosen.iter().enumerate() {
                let (g, u, d) = (deq(&gate[e])?, deq(&up[e])?, deq(&down[e])?);
                let act: Vec<f32> = (0..ff)
                    .map(|r| {
                        let gv = dot64(&g[r * hidden..(r + 1) * hidden], &x);
                        let uv = dot64(&u[r * hidden..(r + 1) * hidden], &x);
                        (silu64(gv) * uv) as f32
                    })
                    .collect();
                for (r, o) in reference.iter_mut().enumerate() {
                    *o += f64::from(weights[i]) * dot64(&d[r * ff..(r + 1) * ff], &act);
                }
            }
            Ok((
                rel_err(&y, &reference).max(rel_err(&yt, &reference)),
                TOL_F32,
            ))
        })();
        self.record(
            &format!("experts {}", ty.name()),
            format!("k={k} of {n_exp}, {hidden}/{ff}, pointers + table"),
            r,
        );
    }

    /// Both router kernels (the block-wide one and the one-warp one the model runs, launched
    /// with 512 threads: its block-wide top-k, moe.cu's `TOPK_PAR`) on the model's shape and on
    /// an expert count that leaves lane slots empty; then logits on a 0.25 grid, so that many
    /// tie (the lower id first, as the reference).
    pub(super) fn router(&mut self) {
        for (n_expert, k, ties) in [(512usize, 10usize, false), (60, 8, false), (512, 10, true)] {
            self.router_case(ops::RouterKernel::block(n_expert), n_expert, k, ties);
            if let Some(kernel) = ops::RouterKernel::warp(n_expert) {
                self.router_case(kernel, n_expert, k, ties);
            }
        }
    }

    pub(super) fn router_case(
        &mut self,
        kernel: ops::RouterKernel,
        n_expert: usize,
        k: usize,
        ties: bool,
    ) {
        let tokens = 3usize;
        let mut logits = self.rng.normals(tokens * n_expert, 2.0);
        if ties {
            logits
                .iter_mut()
                .for_each(|v| *v = (*v * 4.0).round() / 4.0);
        }
        let r = (|| {
            let (idx, w) = ops::moe_router(self.gpu, kernel, &logits, n_expert, k)?;
            let mut ref_w = Vec::new();
            let mut mismatches = 0usize;
            for t in 0..tokens {
                let l = &logits[t * n_expert..(t + 1) * n_expert];
                let m = l
                    .iter()
                    .fold(f64::NEG_INFINITY, |a, &b| a.max(f64::from(b)));
                let p: Vec<f64> = l.iter().map(|&v| (f64::from(v) - m).exp()).collect();
                let s: f64 = p.iter().sum();
                let mut order: Vec<usize> = (0..n_expert).collect();
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                let mut top: Vec<usize> = order[..k].to_vec();
                let total: f64 = top.iter().map(|&e| p[e] / s).sum();
                top.sort_unstable();
                for (j, &e) in top.iter().enumerate() {
                    if idx[t * k + j] != e as i32 {
                        mismatches += 1;
                    }
                    ref_w.push(p[e] / s / total);
                }
            }
            if mismatches > 0 {
                return Ok((mismatches as f64, 0.0));
            }
            Ok((rel_err(&w, &ref_w), TOL_F32))
        })();
        let ties = if ties { ", tied logits" } else { "" };
        self.record(
            kernel.name,
            format!("{tokens} tokens, top-{k} of {n_expert}{ties}"),
            r,
        );
    }

    /// Routed experts with the choice as device data, several tokens at once.
    pub(super) fn experts_ids(&mut self, ty: GgmlType) {
        let (n_exp, k, hidden, ff, n) = (8usize, 3usize, 256usize, 256usize, 3usize);
        let gate = random_weights(&mut self.rng, ty, n_exp * ff, hidden);
        let up = random_weights(&mut self.rng, ty, n_exp * ff, hidden);
        let down = random_weights(&mut self.rng, ty, n_exp * hidden, ff);
        let ids: Vec<i32> = vec![1, 4, 6, 0, 2, 7, 7, 3, 5];
        let weights: Vec<f32> = vec![0.5, 0.3, 0.2, 0.6, 0.3, 0.1, 0.4, 0.4, 0.2];
        let x = self.rng.normals(n * hidden, 1.0);
        let r = (|| {
            let t = ExpertTensors {
                ty,
                gate: &gate,
                up: &up,
                down: &down,
                n_exp,
            };
            let y = ops::moe_experts_ids(self.gpu, &t, &ids, &weights, &x, hidden, ff, k)?;
            let deq =
                |b: &[u8]| dequantize_to_vec(ty, b).map_err(|e| CudaError::Invalid(e.to_string()));
            let (g, u, d) = (deq(&gate)?, deq(&up)?, deq(&down)?);
            let mut reference = vec![0.0f64; n * hidden];
            for tk in 0..n {
                let xt = &x[tk * hidden..(tk + 1) * hidden];
                for j in 0..k {
                    let e = ids[tk * k + j] as usize;
                    let act: Vec<f32> = (0..ff)
                        .map(|r| {
                            let row = (e * ff + r) * hidden;
                            let gv = dot64(&g[row..row + hidden], xt);
                            let uv = dot64(&u[row..row + hidden], xt);
                            (silu64(gv) * uv) as f32
                        })
                        .collect();
                    for r in 0..hidden {
                        let row = (e * hidden + r) * ff;
                        reference[tk * hidden + r] +=
                            f64::from(weights[tk * k + j]) * dot64(&d[row..row + ff], &act);
                    }
                }
            }
            Ok((rel_err(&y, &reference), TOL_F32))
        })();
        self.record(
            &format!("experts_ids {}", ty.name()),
            format!("{n} tokens, k={k} of {n_exp}, {hidden}/{ff}"),
            r,
        );
    }

    pub(super) fn moe_combine(&mut self) {
        let (n, hidden) = (3usize, 2048usize);
        let x = self.rng.normals(n * hidden, 1.0);
        let routed = self.rng.normals(n * hidden, 1.0);
        let shared = self.rng.normals(n * hidden, 1.0);
        let gl = self.rng.normals(n, 2.0);
        let r = ops::moe_combine(self.gpu, &x, &routed, &shared, &gl).map(|y| {
            let reference: Vec<f64> = (0..n * hidden)
                .map(|i| {
                    let s = 1.0 / (1.0 + (-f64::from(gl[i / hidden])).exp());
                    f64::from(x[i]) + f64::from(routed[i]) + s * f64::from(shared[i])
                })
                .collect();
            (rel_err(&y, &reference), TOL_F32)
        });
        self.record("moe_combine", format!("{n}x{hidden}"), r);
    }
}
