//! A layer's mixture of experts: the router and its top-k, the routed experts' gate/up, SwiGLU
//! and down with the weighted sum, and the shared expert with its sigmoid gate.

use super::*;

impl CudaModel {
    /// The router launch of `res_norm_router` for a layer's MoE when `norm_router` applies to
    /// this call: the top-k in the gate/up kernel ([`Self::top_k_in_gate_up`], the conditions
    /// `enqueue_moe` checks too) with the paired gate/up rows, and an F32 router and shared-expert
    /// gate of the hidden width.
    pub(super) fn norm_router_for(&self, m: &DevMoe, n: usize) -> Option<NormRouter> {
        let c = &self.config;
        let (h, ne) = (c.hidden, c.n_experts);
        let applies = self.norm_router
            && !self.gemm_now
            && self.top_k_in_gate_up(&m.experts, n)
            && self.moe_gu_pair
            && self.x_router
            && h.is_multiple_of(32)
            && h <= MVF_MAX_COLS
            && m.router.ty == GgmlType::F32
            && m.sh_gate_vec.ty == GgmlType::F32
            && m.router.cols == h
            && m.sh_gate_vec.cols == h
            && m.router.rows == ne;
        applies.then(|| NormRouter {
            split: MvfSplit {
                parts: mvf_parts(GgmlType::F32, h, self.router_split.0),
                rows: self.router_split.1,
            },
            router: m.router.clone(),
            gate: m.sh_gate_vec.clone(),
        })
    }

    /// Whether a call of `n` tokens may take its top-k inside the gate/up kernel's blocks
    /// (`moe_gate_up_route*_q8q_iq2_xxs`): one token, IQ2_XXS experts on 8-bit activations with
    /// their q8 down kernel, the warp router's limits (k ≤ 32, at most 512 experts). The
    /// conditions `enqueue_moe` and `norm_router_for` share; each adds its own.
    pub(super) fn top_k_in_gate_up(&self, e: &DevExperts, n: usize) -> bool {
        let c = &self.config;
        self.route_in_gate_up
            && n == 1
            && self.q8_moe
            && self.q8_moe_down
            && e.q8_down_f.is_some()
            && c.expert_ff.is_multiple_of(32)
            && self.router.1.name == "moe_router_warp"
            && c.n_experts_used <= 32
            && c.n_experts <= 32 * 16
    }

    pub(super) fn enqueue_moe(&mut self, m: &DevMoe, n: usize) -> Result<(), CudaError> {
        // The logits already written by `res_norm_router` (this layer's `matvec_residual`).
        let logits_ready = std::mem::take(&mut self.logits_ready);
        let c = &self.config;
        let (h, ne, k, ff) = (c.hidden, c.n_experts, c.n_experts_used, c.expert_ff);
        let sc = &self.sc;
        let (x, xn, rlog, wts, act) = (sc.x, sc.xn, sc.rlog, sc.wts, sc.act);
        let (shared, gl) = (sc.shared, sc.gl);
        let e = &m.experts;
        // Each layer's ids stay until the call ends: the expert cache reads them afterwards.
        let (ids, tab) = (self.experts.ids(e.layer, n), self.experts.table(e.layer));
        // Expert e's parts at the table's first entries + e · dstride (every expert resident), or
        // 0: through the table.
        let dstride = if self.moe_direct {
            self.experts.direct_stride().unwrap_or(0)
        } else {
            0
        };
        // The shared expert reads only xn: on the side stream from the start, beside the router,
        // the top-k and the routed gate/up.
        let drv = |e| CudaError::driver("forking the shared expert's stream", e);
        self.side.fork.record(&self.stream).map_err(drv)?;
        self.side.stream.wait(&self.side.fork).map_err(drv)?;
        let main = std::mem::replace(&mut self.stream, self.side.stream.clone());
        self.stage = "shared";
        let shared_done = self.enqueue_shared_expert(m, n);
        self.stage = "moe";
        self.stream = main;
        shared_done?;
        self.side.join.record(&self.side.stream).map_err(drv)?;
        // Router logits and the shared expert's gate logit (both rows of xn) in one launch, with
        // its own row split (`router_split`: 512 rows of 2048 f32 fill only part of the GPU at
        // the matrices' split), then the top-k.
        // IQ2_XXS gate, up and down all on 8-bit activations (the default), or IQ2_XXS gate/up on
        // the q8 row of xn when matvec_res wrote it, or f32 activations.
        let q8_down = e
            .q8_down_f
            .clone()
            .filter(|_| self.q8_moe && self.q8_moe_down && self.xq_fresh && ff.is_multiple_of(32));
        let routed_gemm =
            self.gemm_now && ne <= 1024 && h.is_multiple_of(GEMM_BK) && ff.is_multiple_of(GEMM_BK);
        // A one-token call's top-k inside the gate/up kernel's blocks
        // (`moe_gate_up_route_q8q_iq2_xxs`).
        let route_in_gate_up = self.top_k_in_gate_up(e, n) && q8_down.is_some() && !routed_gemm;
        // The router, its top-k and the gate/up in one launch (grid barrier): every block of it
        // resident at once; the router's rows with matvec3_x_f32's split (its bits).
        let route_fused = Some(self.k.moe_route_fused.clone())
            .filter(|(_, per_sm)| {
                self.all_resident(((ff / 32) * k) as u32, *per_sm)
                    && ROUTE_FUSED_THREADS == crate::ops::q8q_threads()
            })
            .filter(|_| {
                route_in_gate_up
                    && !logits_ready
                    && self.route_fused
                    && self.moe_gu_pair
                    && self.x_router
                    && m.router.ty == GgmlType::F32
                    && m.sh_gate_vec.ty == GgmlType::F32
                    && m.router.cols == h
                    && m.sh_gate_vec.cols == h
                    && m.router.rows == ne
                    && h <= MVF_MAX_COLS
                    && self.router_split.1 == 1
            });
        let route_fused = route_fused.filter(|_| q8_down.is_some()).map(|(f, _)| f);
        // The fused route kernel computes the logits itself (below, with the gate/up); a
        // one-token call's top-k runs inside the gate/up kernel's blocks.
        if route_fused.is_none() {
            if !logits_ready {
                self.with_split(self.router_split, |s| {
                    s.matvec_normed(xn, None, &[(&m.router, rlog), (&m.sh_gate_vec, gl)], n)
                })?;
            }
            if !route_in_gate_up {
                let (f, rk) = self.router.clone();
                self.launch(
                    rk.name,
                    &f,
                    (n as u32, 1, 1),
                    rk.threads,
                    rk.shared,
                    &[
                        A::P(rlog),
                        A::I(ne as i32),
                        A::I(k as i32),
                        A::P(ids),
                        A::P(wts),
                    ],
                )?;
            }
        }
        if routed_gemm {
            return self.enqueue_routed_gemm(e, n, (ids, tab), drv);
        }
        let q8_down_on = q8_down.is_some();
        // The routed gate/up kernels' arguments after the logits (after the router's, for the
        // fused kernel): n_expert, the table, ids, weights, xq, act, its q8 rows, sizes, dstride.
        let routed_tail = [
            A::I(ne as i32),
            A::P(tab),
            A::P(ids),
            A::P(wts),
            A::P(self.sc.xq),
            A::P(act),
            A::P(self.sc.act_q),
            A::I(ff as i32),
            A::I(h as i32),
            A::I(k as i32),
            A::P(dstride),
        ];
        let (down_f, down_act) = match q8_down {
            Some((_, dn_f)) if route_fused.is_some() => {
                let act_q = self.sc.act_q;
                let f = route_fused.clone().expect("checked above");
                let grid = ((ff / 32) * k) as u32;
                let counter = self
                    .grid_counter("moe_route_gate_up", grid)
                    .ok_or_else(|| CudaError::Invalid("out of grid_sync counters".into()))?;
                self.launch(
                    "moe_route_gate_up_q8q",
                    &f,
                    (grid, 1, 1),
                    ROUTE_FUSED_THREADS,
                    0,
                    &[
                        A::P(xn),
                        A::I(h as i32),
                        A::I(mvf_parts(GgmlType::F32, h, self.router_split.0) as i32),
                        A::P(m.router.ptr),
                        A::P(rlog),
                        A::I(ne as i32),
                        A::P(m.sh_gate_vec.ptr),
                        A::P(gl),
                        A::I(m.sh_gate_vec.rows as i32),
                    ]
                    .into_iter()
                    .chain(routed_tail)
                    .chain([A::P(counter)])
                    .collect::<Vec<_>>(),
                )?;
                (dn_f, act_q)
            }
            Some((_, dn_f)) if route_in_gate_up => {
                let act_q = self.sc.act_q;
                let f = if self.moe_gu_pair {
                    self.k.moe_gate_up_route2.clone()
                } else {
                    self.k.moe_gate_up_route.clone()
                };
                self.launch(
                    "moe_gate_up_route_q8q",
                    &f,
                    ((ff / 32) as u32, k as u32, n as u32),
                    crate::ops::q8q_threads(),
                    0,
                    &[A::P(rlog)]
                        .into_iter()
                        .chain(routed_tail)
                        .collect::<Vec<_>>(),
                )?;
                (dn_f, act_q)
            }
            Some((gu_f, dn_f)) => {
                let act_q = self.sc.act_q;
                let mut args = vec![
                    A::P(tab),
                    A::P(ids),
                    A::P(self.sc.xq),
                    A::P(act),
                    A::P(act_q),
                    A::I(ff as i32),
                    A::I(h as i32),
                    A::I(k as i32),
                    A::P(dstride),
                ];
                let tok = e.q8_tok_f.as_ref().filter(|_| n > 1 && self.moe_tok.0 > 0);
                let (name, f, z, threads) = match tok {
                    Some((f, _)) => (
                        "moe_gate_up_tok_q8q",
                        f.clone(),
                        push_token_tile(&mut args, n, self.moe_tok.0),
                        crate::ops::q8q_tok_threads(),
                    ),
                    None => (
                        "moe_gate_up_tab_q8q",
                        gu_f,
                        n,
                        crate::ops::q8q_threads_for(n),
                    ),
                };
                self.launch(
                    name,
                    &f,
                    ((ff / 32) as u32, k as u32, z as u32),
                    threads,
                    0,
                    &args,
                )?;
                (dn_f, act_q)
            }
            None => {
                let (gate_up_f, input) = match &e.gate_up_q8_f {
                    Some(f) if self.q8_moe && self.xq_fresh => (f.clone(), self.sc.xq),
                    _ => (e.gate_up_f.clone(), xn),
                };
                self.launch(
                    "moe_gate_up_tab",
                    &gate_up_f,
                    (blocks(ff, e.warps * self.moe_rows), k as u32, n as u32),
                    32 * e.warps,
                    0,
                    &[
                        A::P(tab),
                        A::P(ids),
                        A::P(input),
                        A::P(act),
                        A::I(ff as i32),
                        A::I(h as i32),
                        A::I(k as i32),
                    ],
                )?;
                (e.down_f.clone(), act)
            }
        };
        self.stream.wait(&self.side.join).map_err(drv)?;
        // x += sum of the weighted routed experts + sigmoid(g) · shared, in one launch (the q8
        // kernel takes `dstride` too).
        let mut args = vec![
            A::P(tab),
            A::P(ids),
            A::P(wts),
            A::P(down_act),
            A::P(x),
            A::P(shared),
            A::P(gl),
            A::I(h as i32),
            A::I(ff as i32),
            A::I(k as i32),
            A::P(dstride),
        ];
        if !q8_down_on {
            args.truncate(10);
        }
        let tok = e
            .q8_tok_f
            .as_ref()
            .filter(|_| q8_down_on && n > 1 && self.moe_tok.1 > 0);
        let (name, f, y) = match tok {
            Some((_, f)) => (
                "moe_down_combine_tok",
                f.clone(),
                push_token_tile(&mut args, n, self.moe_tok.1),
            ),
            None => ("moe_down_combine_tab", down_f, n),
        };
        self.launch(
            name,
            &f,
            (blocks(h * self.moe_down_parts(e), e.warps), y as u32, 1),
            32 * e.warps,
            0,
            &args,
        )?;
        Ok(())
    }

    /// The routed experts of a prompt's `n` tokens on the tensor cores, after the router: the
    /// (token, choice) pairs grouped by expert, one `moe_gemm` over every expert's gate and up
    /// rows, SwiGLU, one over the down rows, then `x += Σ weight · down + sigmoid(g) · shared` per
    /// token (once the shared expert's stream has joined).
    pub(super) fn enqueue_routed_gemm(
        &mut self,
        e: &DevExperts,
        n: usize,
        (ids, tab): (u64, u64),
        drv: impl Fn(cudarc::driver::DriverError) -> CudaError,
    ) -> Result<(), CudaError> {
        let c = &self.config;
        let (h, ne, k, ff) = (c.hidden, c.n_experts, c.n_experts_used, c.expert_ff);
        let sc = &self.sc;
        let (x, xn, wts, act, shared, gl) = (sc.x, sc.xn, sc.wts, sc.act, sc.shared, sc.gl);
        let (off, pairs, gu, down) = (sc.pair_off, sc.pairs, sc.gu, sc.down);
        let f = self.k.moe_group.clone();
        self.launch(
            "moe_group",
            &f,
            (1, 1, 1),
            1024,
            0,
            &[
                A::P(ids),
                A::I((n * k) as i32),
                A::I(ne as i32),
                A::P(off),
                A::P(pairs),
            ],
        )?;
        // gate and up: parts 0 and 1 of every expert, rows into gu[p][0 .. 2 ff).
        self.launch(
            "moe_gemm gate/up",
            &e.gemm_gate_up_f,
            ((2 * ff.div_ceil(GEMM_BM)) as u32, ne as u32, 1),
            GEMM_THREADS,
            0,
            &[
                A::P(tab),
                A::I(0),
                A::I(2),
                A::P(off),
                A::P(pairs),
                A::P(xn),
                A::I(k as i32),
                A::P(gu),
                A::I(ff as i32),
                A::I(h as i32),
                A::I((2 * ff) as i32),
            ],
        )?;
        let f = self.k.swiglu_pairs.clone();
        self.elementwise(&f, &[A::P(gu), A::P(act), A::I(ff as i32)], n * k * ff)?;
        self.launch(
            "moe_gemm down",
            &e.gemm_down_f,
            (h.div_ceil(GEMM_BM) as u32, ne as u32, 1),
            GEMM_THREADS,
            0,
            &[
                A::P(tab),
                A::I(2),
                A::I(1),
                A::P(off),
                A::P(pairs),
                A::P(act),
                A::I(1),
                A::P(down),
                A::I(h as i32),
                A::I(ff as i32),
                A::I(h as i32),
            ],
        )?;
        self.stream.wait(&self.side.join).map_err(drv)?;
        let f = self.k.moe_combine_pairs.clone();
        self.launch(
            "moe_combine_pairs",
            &f,
            (blocks(h, 256), n as u32, 1),
            256,
            0,
            &[
                A::P(x),
                A::P(down),
                A::P(wts),
                A::P(shared),
                A::P(gl),
                A::I(h as i32),
                A::I(k as i32),
            ],
        )
    }

    /// The shared expert of `n` tokens into `shared` (on whatever stream `self.stream` is).
    pub(super) fn enqueue_shared_expert(&mut self, m: &DevMoe, n: usize) -> Result<(), CudaError> {
        let sff = self.config.shared_ff;
        let sc = &self.sc;
        let (xn, xq, sg, su, sa, shared) = (sc.xn, sc.xq, sc.sg, sc.su, sc.sa, sc.shared);
        // Gate and up rows read the same xn: one launch when they share a type (on the q8 row
        // of xn matvec_res wrote, when there is one and they are Q4_K).
        let xq_fits = self.xq_shared
            && self.xq_fresh
            && m.sh_gate.ty == m.sh_up.ty
            && m.sh_gate.cols == m.sh_up.cols
            && self.q8_fits(m.sh_gate.ty, m.sh_gate.cols);
        if xq_fits {
            self.matvec_q8x((xq, 0), &[(&m.sh_gate, sg), (&m.sh_up, su)], n)?;
        } else {
            self.matvec_normed(xn, None, &[(&m.sh_gate, sg), (&m.sh_up, su)], n)?;
        }
        if self.xq_shared
            && !self.gemm_now
            && sff.is_multiple_of(32)
            && self.q8_fits(m.sh_down.ty, m.sh_down.cols)
        {
            // The activation quantised where it is made, then the down rows on it (no staging;
            // not for prompts through the GEMMs: this reads the weights once per token).
            let xq_sa = self.sc.xq_sa;
            let f = self.k.swiglu_q8.clone();
            self.launch(
                "swiglu_q8",
                &f,
                (blocks(sff, 256), n as u32, 1),
                256,
                0,
                &[A::P(sg), A::P(su), A::P(sa), A::P(xq_sa), A::I(sff as i32)],
            )?;
            return self.matvec_q8x((xq_sa, 0), &[(&m.sh_down, shared)], n);
        }
        let f = self.k.swiglu.clone();
        self.elementwise(&f, &[A::P(sg), A::P(su), A::P(sa)], n * sff)?;
        if self.q8_fits(m.sh_down.ty, m.sh_down.cols) {
            // One matrix through the fused kernel (no norm weights): the 8-bit form.
            return self.matvec_normed(sa, None, &[(&m.sh_down, shared)], n);
        }
        self.matvec(&m.sh_down, sa, shared, n)
    }
}

/// The most tokens a block of `moe_gate_up_tok_q8q_iq2_xxs` takes (the kernel's `GU_TOK_MAX`).
pub const MOE_TOK_GU_MAX: usize = 4;
/// The most tokens a block of `moe_down_combine_tok_q8_iq2_xxs` takes (its `DOWN_TOK_MAX`).
pub const MOE_TOK_DOWN_MAX: usize = 8;

/// A token-tile kernel's last two arguments for a call of `n` tokens with `tile` of them a block
/// (`n`, the tile clamped to `n`); returns the grid's extent over the tokens.
pub(super) fn push_token_tile(args: &mut Vec<A>, n: usize, tile: usize) -> usize {
    let tile = tile.clamp(1, n.max(1));
    args.extend([A::I(n as i32), A::I(tile as i32)]);
    n.div_ceil(tile)
}

/// [`CudaModel::moe_tok`] from `REDLITE_CUDA_MOE_TOK` (`g:d`, `g,d` or one number for both;
/// default `0:8`: the down kernel's token tiles only. Session 28 on the H200: the full-size
/// 8-row verify 8.64 against 8.82 ms, 16 rows 14.91 against 15.29, 2 and 4 rows even; the
/// gate/up tiles lost at 2 and 4 rows and gained less than the down's at 8).
pub(super) fn moe_tok_tiles() -> (usize, usize) {
    let Ok(v) = std::env::var("REDLITE_CUDA_MOE_TOK") else {
        return (0, MOE_TOK_DOWN_MAX);
    };
    let mut it = v
        .split([',', ':'])
        .map(|p| p.trim().parse::<usize>().unwrap_or(0));
    let g = it.next().unwrap_or(0);
    let d = it.next().unwrap_or(g);
    (g.min(MOE_TOK_GU_MAX), d.min(MOE_TOK_DOWN_MAX))
}
