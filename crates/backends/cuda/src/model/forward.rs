//! The forward pass as a sequence of launches: embedding, every layer, the final norm, the
//! lm_head and the draw.

use super::*;

impl CudaModel {
    /// Embedding, every layer, final norm and the lm_head for `n` tokens whose ids and start
    /// position are already in `input`.
    pub(super) fn enqueue_forward(
        &mut self,
        n: usize,
        head: Head,
        rows: Rows,
    ) -> Result<(), CudaError> {
        self.gemm_now = self.gemm && rows == Rows::Prompt && n >= GEMM_MIN_TOKENS;
        let r = self.enqueue_forward_rows(n, head, rows);
        self.gemm_now = false;
        r
    }

    pub(super) fn enqueue_forward_rows(
        &mut self,
        n: usize,
        head: Head,
        rows: Rows,
    ) -> Result<(), CudaError> {
        let h = self.config.hidden;
        let x = self.sc.x;
        self.embedding(n)?;
        for i in 0..self.layers.len() {
            self.enqueue_layer(i, n, rows)?;
        }
        match head {
            Head::None => Ok(()),
            Head::Last => {
                let last = x + (4 * (n - 1) * h) as u64;
                self.lm_head(last, 1)
            }
            Head::All => self.lm_head(x, n),
        }
    }

    /// The embedding rows of the `n` token ids in `input` into `x`.
    pub(super) fn embedding(&mut self, n: usize) -> Result<(), CudaError> {
        let f = self.embed_f.clone();
        self.launch(
            "embedding",
            &f,
            (n as u32, 1, 1),
            256,
            0,
            &[
                A::P(self.embed),
                A::P(self.sc.input + 4),
                A::P(self.sc.x),
                A::I(self.config.hidden as i32),
            ],
        )
    }

    /// Final norm and lm_head of `n` rows of `x` into the logits, with its own row split
    /// (`head_lane_iters`).
    pub(super) fn lm_head(&mut self, x: u64, n: usize) -> Result<(), CudaError> {
        let out = self.output.clone();
        // A prompt's last row alone (Head::Last) takes the matvec, not a 1-token GEMM (ncu: 1.2
        // ms for the Q6_K head against 0.26).
        let gemm = self.gemm_now;
        self.gemm_now = gemm && n >= GEMM_MIN_TOKENS;
        self.stage = "head";
        let r = self.with_split((self.head_lane_iters, 1), |m| {
            m.matvec_normed(x, Some(m.output_norm), &[(&out, m.sc.logits)], n)
        });
        self.gemm_now = gemm;
        r
    }

    /// `f` with the fused matvecs' row split set to `(lane_iters, rows per warp)`, then the
    /// split restored.
    pub(super) fn with_split<R>(
        &mut self,
        (iters, rows): (usize, usize),
        f: impl FnOnce(&mut Self) -> R,
    ) -> R {
        let iters = std::mem::replace(&mut self.mvf_lane_iters, iters);
        let rows = std::mem::replace(&mut self.mvf_rows, rows);
        let r = f(self);
        self.mvf_lane_iters = iters;
        self.mvf_rows = rows;
        r
    }

    /// One decode step (the captured part): forward of one token, then the draw into `out`.
    pub(super) fn enqueue_step(&mut self, s: &GpuSampling) -> Result<(), CudaError> {
        self.enqueue_forward(1, Head::Last, Rows::Prompt)?;
        self.enqueue_sample(self.sc.logits, s)
    }

    /// Each of `rows` rows of logits at `logits`: its greedy token into `out` (`argmax`, the row
    /// cut into [`ARGMAX_SLICES`] blocks: one block took 61 µs of a 4 ms step for 151,936 logits).
    pub(super) fn argmax(&mut self, logits: u64, rows: usize) -> Result<(), CudaError> {
        self.argmax_launch(logits, rows, None)
    }

    /// `argmax` of `rows` rows into `out`, or with `chain` (`argmax_chain`'s further arguments:
    /// input, drafts, j, adv, probs) the one-row `argmax_chain` of an MTP draft graph.
    pub(super) fn argmax_launch(
        &mut self,
        logits: u64,
        rows: usize,
        chain: Option<[A; 5]>,
    ) -> Result<(), CudaError> {
        let (name, f) = match chain {
            Some(_) => ("argmax_chain", self.k.argmax_chain.clone()),
            None => ("argmax", self.k.argmax.clone()),
        };
        let mut args = vec![
            A::P(logits),
            A::I(self.config.vocab as i32),
            A::P(self.sc.out),
            A::P(self.sc.argmax_part),
            A::P(self.sc.argmax_counter),
        ];
        args.extend(chain.into_iter().flatten());
        self.launch(
            name,
            &f,
            (self.argmax_slices as u32, rows as u32, 1),
            256,
            0,
            &args,
        )
    }

    pub(super) fn enqueue_sample(&mut self, row: u64, s: &GpuSampling) -> Result<(), CudaError> {
        let vocab = self.config.vocab as i32;
        if s.is_greedy() {
            return self.argmax(row, 1);
        }
        if !s.supported() || s.top_k > self.config.vocab {
            return Err(CudaError::Invalid(format!(
                "GPU sampling: top-k {} not in 1..={MAX_SAMPLE_TOP_K}",
                s.top_k
            )));
        }
        let top_p = if s.top_p > 0.0 && s.top_p <= 1.0 {
            s.top_p
        } else {
            1.0
        };
        let min_p = if s.min_p.is_nan() {
            0.0
        } else {
            s.min_p.clamp(0.0, 1.0)
        };
        let f = self.k.sample_topk.clone();
        self.launch(
            "sample_topk",
            &f,
            (1, 1, 1),
            1024,
            0,
            &[
                A::P(row),
                A::I(vocab),
                A::I(s.top_k as i32),
                A::F(1.0 / s.temperature),
                A::F(top_p),
                A::F(min_p),
                A::P(self.sc.u),
                A::P(self.sc.out),
            ],
        )
    }

    /// One layer: the mixer reads `rms_norm(x, attn_norm)` (normalised inside its projection
    /// kernel), adds its output to `x` in its output projection, whose last block also writes
    /// `xn = rms_norm(x, post_norm)` for the MoE.
    pub(super) fn enqueue_layer(
        &mut self,
        i: usize,
        n: usize,
        rows: Rows,
    ) -> Result<(), CudaError> {
        let norms = (self.layers[i].attn_norm, self.layers[i].post_norm);
        // A clone of the layer's handles (addresses and kernel handles), so `self` stays free.
        let mixer = self.layers[i].mixer.clone();
        if let Some(nv) = self.nvtx.as_ref().filter(|_| self.in_profile) {
            let kind = match &mixer {
                DevMixer::Attention { .. } => "attention",
                DevMixer::DeltaNet { .. } => "deltanet",
            };
            nv.push(&format!("layer {i}"));
            nv.push(&format!("layer {i} {kind}"));
        }
        self.next_router = self.norm_router_for(&self.layers[i].moe, n);
        match &mixer {
            DevMixer::Attention { .. } => {
                self.stage = "attn";
                self.enqueue_attention(&mixer, norms, n, rows)?
            }
            DevMixer::DeltaNet { .. } => {
                self.stage = "dn";
                self.enqueue_delta_net(&mixer, norms, n, rows)?
            }
        }
        self.stage = "moe";
        if let Some(nv) = self.nvtx.as_ref().filter(|_| self.in_profile) {
            nv.pop();
        }
        let moe = self.layers[i].moe.clone();
        let nvtx = self.nvtx.as_ref().filter(|_| self.in_profile);
        if let Some(nv) = nvtx {
            nv.push(&format!("layer {i} moe"));
        }
        let r = self.enqueue_moe(&moe, n);
        if let Some(nv) = self.nvtx.as_ref().filter(|_| self.in_profile) {
            nv.pop();
            nv.pop();
        }
        r
    }
}
