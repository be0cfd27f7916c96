//! A Gated DeltaNet layer's launches: the in-projections, the causal conv, the delta rule over
//! the recurrent state, the gated RMSNorm and the out-projection.

use super::*;

impl CudaModel {
    pub(super) fn enqueue_delta_net(
        &mut self,
        m: &DevMixer,
        (attn_norm, post_norm): (u64, u64),
        n: usize,
        rows: Rows,
    ) -> Result<(), CudaError> {
        let DevMixer::DeltaNet {
            qkv,
            z,
            ba,
            out,
            conv_w,
            dt_bias,
            a,
            norm,
            conv_state,
            s,
            conv_trace,
            s_trace,
        } = m
        else {
            return Ok(());
        };
        // The states after every row, for a verify pass.
        let (s_tr, conv_tr) = match rows {
            Rows::Steps => (*s_trace, *conv_trace),
            Rows::Prompt => (0, 0),
        };
        let c = &self.config;
        let (nk, nv, dk, dv) = (c.dn_k_heads, c.dn_v_heads, c.dn_k_dim, c.dn_v_dim);
        let (ch, kern, eps) = (c.dn_conv_channels(), c.conv_kernel, c.rms_eps);
        let q_scale = 1.0 / (dk as f32).sqrt();
        let sc = &self.sc;
        let (x, qkv_b, conv, z_b, ba_b, beta, g, o, gated) = (
            sc.x, sc.qkv, sc.conv, sc.z, sc.ba, sc.beta, sc.g, sc.o, sc.gated,
        );
        // Prompts through the GEMMs take the five-kernel form: its delta rule runs nv × dv/32
        // blocks (the fused kernel nk), each one token after another.
        let fused = dn_fused(c).filter(|_| !self.gemm_now || self.dn_fused_prompt);
        if self.skipped("z_rows") {
            // Timing diagnostics only (`REDLITE_CUDA_SKIP=dn:z_rows`): the in-projection launch
            // without the output gate's rows, which only the gated norm at the mixer's end reads.
            self.matvec_normed(x, Some(attn_norm), &[(qkv, qkv_b), (ba, ba_b)], n)?;
        } else {
            self.matvec_normed(x, Some(attn_norm), &[(qkv, qkv_b), (z, z_b), (ba, ba_b)], n)?;
        }
        if let Some((threads, shared)) = fused {
            // Conv, q/k norm, gates, delta rule and gated norm in one launch.
            let r = nv / nk;
            let cols = self.dn_cols;
            let (name, f, grid, threads, shared) = match cols {
                Some((grid, threads, shared)) if n > 1 && self.dn_rows => (
                    "dn_fused_cols_rows",
                    self.k.dn_fused_cols_rows.clone(),
                    grid,
                    threads,
                    shared,
                ),
                Some((grid, threads, shared)) => (
                    "dn_fused_cols",
                    self.k.dn_fused_cols.clone(),
                    grid,
                    threads,
                    shared,
                ),
                None => (
                    "dn_fused_seq",
                    self.k.dn_fused_seq.clone(),
                    nk as u32,
                    threads,
                    shared,
                ),
            };
            let mut args = vec![
                A::P(qkv_b),
                A::P(*conv_state),
                A::P(*conv_w),
                A::P(ba_b),
                A::P(*a),
                A::P(*dt_bias),
                A::P(*s),
                A::P(z_b),
                A::P(*norm),
                A::P(gated),
                A::I(n as i32),
                A::I(ch as i32),
                A::I(nk as i32),
                A::I(dk as i32),
                A::I(dv as i32),
                A::I(r as i32),
                A::I(kern as i32),
                A::F(L2_NORM_EPS),
                A::F(q_scale),
                A::F(eps),
                A::P(s_tr),
                A::P(conv_tr),
                A::I(self.dn_early as i32 | (self.dn_pre as i32) << 1),
            ];
            if cols.is_some() {
                // The gated norm's rows and the per-QK-head barrier counters.
                args.extend([A::P(self.sc.o), A::P(self.sc.dn_counter)]);
            }
            self.launch(name, &f, (grid, 1, 1), threads, shared, &args)?;
            return self.matvec_residual(out, gated, post_norm, n);
        }
        // The conv: one thread per channel over the tokens (the state updated in place), or for a
        // prompt by (channel, 32-token tile) blocks and then the state shift.
        let (f, name, tiles) = if self.gemm_now {
            (
                self.k.dn_conv_prompt.clone(),
                "dn_conv_prompt",
                n.div_ceil(32),
            )
        } else {
            (self.k.dn_conv_seq.clone(), "dn_conv_seq", 1)
        };
        self.launch(
            name,
            &f,
            (blocks(ch, 128), tiles as u32, 1),
            128,
            0,
            &[
                A::P(qkv_b),
                A::P(*conv_state),
                A::P(*conv_w),
                A::P(conv),
                A::I(n as i32),
                A::I(ch as i32),
                A::I(kern as i32),
            ],
        )?;
        if self.gemm_now {
            let f = self.k.dn_conv_shift.clone();
            self.launch(
                "dn_conv_shift",
                &f,
                (blocks(ch, 128), 1, 1),
                128,
                0,
                &[
                    A::P(qkv_b),
                    A::P(*conv_state),
                    A::I(n as i32),
                    A::I(ch as i32),
                    A::I(kern as i32),
                ],
            )?;
        }
        let f = self.k.dn_qk_norm.clone();
        self.launch(
            "dn_qk_norm",
            &f,
            ((2 * nk) as u32, n as u32, 1),
            128,
            0,
            &[
                A::P(conv),
                A::I(ch as i32),
                A::I(nk as i32),
                A::I(dk as i32),
                A::F(L2_NORM_EPS),
                A::F(q_scale),
            ],
        )?;
        let f = self.k.dn_gates.clone();
        self.launch(
            "dn_gates",
            &f,
            (blocks(nv, 64), n as u32, 1),
            64,
            0,
            &[
                A::P(ba_b),
                A::P(*a),
                A::P(*dt_bias),
                A::P(beta),
                A::P(g),
                A::I(nv as i32),
                A::I((nv / nk) as i32),
            ],
        )?;
        // Prompts: the barrier-free form when the shape has one (`REDLITE_CUDA_DN_WARP=0`: not).
        // Same arguments, but dn_delta_warp_<dk> has dk in its name.
        let warp =
            crate::ops::delta_warp_launch(nv, dk, dv).filter(|_| self.gemm_now && self.dn_warp);
        let mut args = vec![
            A::P(conv),
            A::P(beta),
            A::P(g),
            A::P(*s),
            A::P(o),
            A::I(n as i32),
            A::I(ch as i32),
            A::I(nk as i32),
        ];
        let (what, f, (grid, block, shared)) = match warp {
            Some((name, grid)) => (
                "dn_delta_warp",
                self.gpu.func(&name)?.clone(),
                (grid, 128, 0),
            ),
            None => {
                args.push(A::I(dk as i32));
                let f = self.k.dn_delta_seq.clone();
                ("dn_delta_seq", f, delta_seq_launch(nv, dk, dv))
            }
        };
        args.push(A::I(dv as i32));
        self.launch(what, &f, grid, block, shared, &args)?;
        let f = self.k.rms_norm_gated.clone();
        self.launch(
            "rms_norm_gated",
            &f,
            ((n * nv) as u32, 1, 1),
            128,
            0,
            &[
                A::P(o),
                A::P(*norm),
                A::P(z_b),
                A::P(gated),
                A::I(dv as i32),
                A::F(eps),
            ],
        )?;
        self.matvec_residual(out, gated, post_norm, n)
    }
}
