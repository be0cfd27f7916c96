//! A gated full-attention layer's launches: q·gate, k, v; QK-norm, RoPE and the KV write; the
//! split attention over the cache and its merge with the sigmoid output gate; the out-projection.

use super::*;

impl CudaModel {
    pub(super) fn enqueue_attention(
        &mut self,
        m: &DevMixer,
        (attn_norm, post_norm): (u64, u64),
        n: usize,
        rows: Rows,
    ) -> Result<(), CudaError> {
        let DevMixer::Attention {
            wq,
            wk,
            wv,
            wo,
            q_norm,
            k_norm,
            kc,
            vc,
        } = m
        else {
            return Ok(());
        };
        let c = &self.config;
        let (nh, nkv, hd, rd) = (c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims);
        let (theta, eps) = (c.rope_theta, c.rms_eps);
        let scale = 1.0 / (hd as f32).sqrt();
        let sc = &self.sc;
        let (x, qg, kn, vn, q, gate, att, part) = (
            sc.x,
            sc.qg,
            sc.kn,
            sc.vn,
            sc.q,
            sc.gate,
            sc.att,
            sc.attn_part,
        );
        let pos = sc.input;
        let rope_cs = if self.rope_table { sc.rope_cs } else { 0 };
        self.matvec_normed(x, Some(attn_norm), &[(wq, qg), (wk, kn), (wv, vn)], n)?;
        let f = self.k.attn_qk_prep.clone();
        self.launch(
            "attn_qk_prep",
            &f,
            ((nh + nkv) as u32, n as u32, 1),
            128,
            0,
            &[
                A::P(qg),
                A::P(kn),
                A::P(vn),
                A::P(q),
                A::P(gate),
                A::P(*kc),
                A::P(*vc),
                A::P(*q_norm),
                A::P(*k_norm),
                A::P(pos),
                A::I(nh as i32),
                A::I(nkv as i32),
                A::I(hd as i32),
                A::I(rd as i32),
                A::D(theta),
                A::F(eps),
                A::P(rope_cs),
            ],
        )?;
        if n == 1 || rows == Rows::Steps {
            // Decode (each row at its own position): the cache split into chunks
            // (flash-decoding), then the chunks merged and the output gate applied.
            let splits = attn_splits(&self.opts).min(self.attn_splits);
            let f = match self.attn_gqa {
                Some(4) => self.k.attn_split_gqa4.clone(),
                Some(_) => self.k.attn_split_gqa.clone(),
                None => self.k.attn_split.clone(),
            };
            let (gx, block) = crate::ops::attn_split_block(nh, nkv, self.attn_head_blocks);
            self.launch(
                "attn_split",
                &f,
                (gx, splits as u32, n as u32),
                block,
                0,
                &[
                    A::P(q),
                    A::P(*kc),
                    A::P(*vc),
                    A::P(part),
                    A::P(pos),
                    A::I(nh as i32),
                    A::I(nkv as i32),
                    A::I(hd as i32),
                    A::F(scale),
                    A::I(self.attn_min_chunk as i32),
                ],
            )?;
            let f = self.k.attn_merge.clone();
            self.launch(
                "attn_merge",
                &f,
                (nh as u32, hd.div_ceil(32) as u32, n as u32),
                256,
                0,
                &[
                    A::P(part),
                    A::P(gate),
                    A::P(att),
                    A::P(pos),
                    A::I(splits as i32),
                    A::I(hd as i32),
                    A::I(self.attn_min_chunk as i32),
                ],
            )?;
        } else if self.gemm_now && crate::ops::attn_prompt_fits(nh, nkv, hd) {
            // A prompt: a GQA group of query rows per block, K/V staged once for all of them; on
            // the tensor cores (flash-attention form, head_dim 64/128/256) unless switched off.
            // The two kernels take the same arguments but for head_dim (the tensor-core one has
            // it in its name).
            let mut args = vec![
                A::P(q),
                A::P(*kc),
                A::P(*vc),
                A::P(gate),
                A::P(att),
                A::P(pos),
                A::I(n as i32),
                A::I(nh as i32),
                A::I(nkv as i32),
                A::F(scale),
            ];
            let (name, f, (grid, block, shared)) =
                match crate::ops::attn_prompt_mma(nh, nkv, hd).filter(|_| self.attn_mma) {
                    Some(launch) => {
                        let (name, grid, block, shared) = launch(n);
                        let name = crate::ops::kv_kernel(name, self.opts.kv_type)?;
                        let f = self.gpu.func(&name)?.clone();
                        (name, f, (grid, block, shared))
                    }
                    None => {
                        args.insert(9, A::I(hd as i32));
                        (
                            "attn_prompt".to_string(),
                            self.k.attn_prompt.clone(),
                            crate::ops::attn_prompt_launch(n, nh, nkv, hd),
                        )
                    }
                };
            self.launch(&name, &f, grid, block, shared, &args)?;
        } else {
            let f = self.k.attn_causal.clone();
            self.launch(
                "attn_causal",
                &f,
                (nh as u32, n as u32, 1),
                128,
                0,
                &[
                    A::P(q),
                    A::P(*kc),
                    A::P(*vc),
                    A::P(gate),
                    A::P(att),
                    A::P(pos),
                    A::I(nkv as i32),
                    A::I(hd as i32),
                    A::F(scale),
                ],
            )?;
        }
        self.matvec_residual(wo, att, post_norm, n)
    }
}
