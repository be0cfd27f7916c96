//! Launching kernels: the host side of a call, the matrix-vector products in each form (one token,
//! token tiles, tensor cores, with a fused norm or residual) and the prompt GEMMs.

use super::*;

impl CudaModel {
    // ----- host side of a call -----

    /// Wait for the stream, then start (`true`) or stop the CUDA profiler (`--profile-step`,
    /// `REDLITE_CUDA_PROFILE_VERIFY`).
    pub(super) fn profiler(&self, start: bool) -> Result<(), CudaError> {
        self.sync()?;
        let (r, what) = if start {
            // SAFETY: no arguments; the profiler API of the bound context.
            (unsafe { sys::cuProfilerStart() }, "cuProfilerStart")
        } else {
            // SAFETY: as above.
            (unsafe { sys::cuProfilerStop() }, "cuProfilerStop")
        };
        r.result().map_err(|e| CudaError::driver(what, e))
    }

    pub(super) fn bind(&self) -> Result<(), CudaError> {
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("binding the context", e))
    }

    pub(super) fn sync(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("synchronizing the model's stream", e))
    }

    pub(super) fn download(&self, dst: &mut [f32], src: u64) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: `src` addresses at least `dst.len()` floats of a live buffer; synchronized below.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("device-to-host copy", e))?;
        self.sync()
    }

    pub(super) fn read_out(&self) -> Result<u32, CudaError> {
        let [id] = self.read_ids([(self.sc.out, 1)], "reading the sampled token")?;
        Ok(id[0])
    }

    /// Check `tokens` and copy `[pos, ids...]` to the device.
    pub(super) fn upload_input(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        let c = &self.config;
        if self.pos + tokens.len() > self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "context full: {} + {} tokens exceed the {} positions allocated (--ctx)",
                self.pos,
                tokens.len(),
                self.opts.max_context
            )));
        }
        let mut input = Vec::with_capacity(tokens.len() + 1);
        input.push(i32_of(self.pos, "position")?);
        for &t in tokens {
            if t as usize >= c.vocab {
                return Err(CudaError::Invalid(format!(
                    "token id {t} is outside the vocabulary (size {})",
                    c.vocab
                )));
            }
            input.push(t as i32);
        }
        // SAFETY: `input` holds 1 + max_batch i32 (checked by the callers); pageable memory is
        // staged before the call returns.
        unsafe { cu::memcpy_htod_async(self.sc.input, &input, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the token ids", e))
    }

    pub(super) fn upload_u(&mut self, u: f32, s: &GpuSampling) -> Result<(), CudaError> {
        if s.is_greedy() {
            return Ok(());
        }
        let v = [u.clamp(0.0, 1.0 - f32::EPSILON)];
        // SAFETY: `u` holds one f32.
        unsafe { cu::memcpy_htod_async(self.sc.u, &v, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the sampler draw", e))
    }

    pub(super) fn run_chunk(&mut self, tokens: &[u32], head: Head) -> Result<(), CudaError> {
        if tokens.is_empty() {
            return Ok(());
        }
        self.bind()?;
        self.mtp_make_room(tokens.len())?;
        self.upload_input(tokens)?;
        self.enqueue_forward(tokens.len(), head, Rows::Prompt)?;
        self.mtp_record(tokens, false)?;
        self.pos += tokens.len();
        self.verified = None;
        self.last_row = if head == Head::All {
            tokens.len() - 1
        } else {
            0
        };
        self.sync()?;
        self.experts.after_forward(&self.stream, tokens.len())
    }

    // ----- kernels only from here: nothing below touches the host (capturable) -----

    pub(super) fn launch(
        &mut self,
        what: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[A],
    ) -> Result<(), CudaError> {
        if self.skipped(what) {
            return Ok(());
        }
        let noop;
        let f = if Self::listed(&self.noop, self.stage, what) {
            noop = self.gpu.func("noop_pdl")?.clone();
            // The launch keeps its dynamic shared memory: past the default 48 KiB (as
            // `matvec_q8x_mma_q4_k`'s) the stand-in is opted in to those bytes, else the
            // driver refuses the launch.
            if shared > 48 * 1024 {
                noop.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .map_err(|e| CudaError::driver("the noop_pdl stand-in's shared memory limit", e))?;
            }
            &noop
        } else {
            f
        };
        // Decode steps and verify rows only: on prompts the GEMMs' many-wave grids lost by it
        // (4,096 tokens 10,985 → 9,728 tok/s on the H200).
        if self.pdl && !self.gemm_now {
            return self.launch_pdl(what, f, grid, block, shared, args);
        }
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                A::P(v) => b.arg(v),
                A::I(v) => b.arg(v),
                A::F(v) => b.arg(v),
                A::D(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: every kernel's arguments are listed in its declared order with its types
        // (pointers as u64 device addresses of live buffers sized for `max_batch` tokens).
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::driver(what, e))?;
        self.launches += 1;
        Ok(())
    }

    /// Whether `REDLITE_CUDA_SKIP` leaves this launch out (timing diagnostics).
    pub(super) fn skipped(&self, what: &str) -> bool {
        Self::listed(&self.skip, self.stage, what)
    }

    /// Whether launch `what` of `stage` is in a `REDLITE_CUDA_SKIP`-style list (`*`: all): an
    /// entry names it and no `!`-entry does (`*,!embedding,!moe:matvec3_x`: all but those two).
    pub(super) fn listed(list: &[String], stage: &str, what: &str) -> bool {
        let names = |s: &str| match s.split_once(':') {
            Some((st, name)) => st == stage && (name == "*" || name == what),
            None => s == what || s == "*",
        };
        list.iter().any(|s| !s.starts_with('!') && names(s))
            && !list.iter().any(|s| s.strip_prefix('!').is_some_and(names))
    }

    /// The `grid_sync` counter for launches of `kernel` with `blocks` blocks (its barrier target
    /// assumes every launch on a counter has the same grid), or `None` when all are taken.
    pub(super) fn grid_counter(&mut self, kernel: &'static str, blocks: u32) -> Option<u64> {
        let key = (kernel, blocks);
        let i = match self.grid_counters.iter().position(|k| *k == key) {
            Some(i) => i,
            None if self.grid_counters.len() < GRID_COUNTERS => {
                self.grid_counters.push(key);
                self.grid_counters.len() - 1
            }
            None => return None,
        };
        Some(self.sc.grid_counter + 8 * i as u64)
    }

    /// Whether a grid of `blocks` can be resident at once at `per_sm` blocks an SM.
    pub(super) fn all_resident(&self, blocks: u32, per_sm: u32) -> bool {
        (per_sm as usize) * self.gpu.info.sm_count >= blocks as usize
    }

    /// [`Self::launch`] through `cuLaunchKernelEx` with the programmatic-stream-serialization
    /// attribute (the kernel waits in `pdl_enter` for the grid before it).
    pub(super) fn launch_pdl(
        &mut self,
        what: &str,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &[A],
    ) -> Result<(), CudaError> {
        // SAFETY: as in `launch`: the arguments are the kernel's, in order and of its types.
        unsafe { launch_ex(&self.stream, f, (grid, block, shared), args, true) }
            .map_err(|e| CudaError::driver(what, e))?;
        self.launches += 1;
        Ok(())
    }

    /// `y[t] = W · x[t]` for `n` rows.
    pub(super) fn matvec(
        &mut self,
        w: &DevLinear,
        x: u64,
        y: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        if self.gemm_fits(w) {
            return self.gemm(w, x, y, n, false);
        }
        let args = [
            A::P(w.ptr),
            A::P(x),
            A::P(y),
            A::I(w.rows as i32),
            A::I(w.cols as i32),
        ];
        let f = w.f.clone();
        self.launch(
            "matvec",
            &f,
            (blocks(w.rows, MATVEC_WARPS), n as u32, 1),
            32 * MATVEC_WARPS,
            0,
            &args,
        )
    }

    /// `y_m[t] = W_m · rms_norm(x[t], nw)` (with `nw`; without, `W_m · x[t]`) for matrices that
    /// read the same input (all of width `cols`): one `matvec_norm3_<type>` launch per run of up
    /// to three of one type, each block normalising `x[t]` itself. Wider inputs than its shared
    /// memory holds go through `rms_norm` into `xn` and plain matvecs.
    pub(super) fn matvec_normed(
        &mut self,
        x: u64,
        nw: Option<u64>,
        mats: &[(&DevLinear, u64)],
        n: usize,
    ) -> Result<(), CudaError> {
        if self.gemm_now {
            let (big, rest): (Vec<_>, Vec<_>) = mats.iter().partition(|(w, _)| self.gemm_fits(w));
            if let Some((w0, _)) = big.first() {
                // Normalise once into xn (free at a mixer's input; the MoE passes xn itself
                // without norm weights), then one GEMM per matrix.
                let input = match nw {
                    Some(nw) => {
                        let xn = self.sc.xn;
                        self.rms_norm(x, nw, xn, n, w0.cols)?;
                        xn
                    }
                    None => x,
                };
                for (w, y) in &big {
                    self.gemm(w, input, *y, n, false)?;
                }
                return self.matvec_normed_fused(x, nw, &rest, n);
            }
        }
        self.matvec_normed_fused(x, nw, mats, n)
    }

    /// [`Self::matvec_normed`] through the fused matvec kernels.
    pub(super) fn matvec_normed_fused(
        &mut self,
        x: u64,
        nw: Option<u64>,
        mats: &[(&DevLinear, u64)],
        n: usize,
    ) -> Result<(), CudaError> {
        let Some(cols) = mats.first().map(|(w, _)| w.cols) else {
            return Ok(());
        };
        if cols > MVF_MAX_COLS || mats.iter().any(|(w, _)| w.cols != cols) {
            let input = match nw {
                Some(nw) => {
                    let xn = self.sc.xn;
                    self.rms_norm(x, nw, xn, n, cols)?;
                    xn
                }
                None => x,
            };
            for (w, y) in mats {
                self.matvec(w, input, *y, n)?;
            }
            return Ok(());
        }
        let nw = nw.unwrap_or(0);
        let mut normed_q8 = false;
        let mut i = 0;
        while i < mats.len() {
            let ty = mats[i].0.ty;
            let mut group = vec![mats[i]];
            while group.len() < 3
                && i + group.len() < mats.len()
                && mats[i + group.len()].0.ty == ty
            {
                group.push(mats[i + group.len()]);
            }
            i += group.len();
            // Several tokens: the token-tile kernel when it is on (weights read once per tile).
            let tile = token_tile(self.token_tile, n, cols);
            let q8 = self.q8_fits(ty, cols);
            if q8 && (tile == 1 || self.q8x_tile > 1) && nw != 0 && self.xq_norm {
                // The norm and its q8 row once per token, then the rows without staging.
                let (xq, invs) = (self.sc.xq_in, self.sc.xq_inv);
                if !normed_q8 {
                    let f = self.k.rms_norm_q8.clone();
                    self.launch(
                        "rms_norm_q8",
                        &f,
                        (self.norm_slices as u32, n as u32, 1),
                        MVF_THREADS,
                        0,
                        &[
                            A::P(x),
                            A::P(nw),
                            A::F(self.config.rms_eps),
                            A::I(cols as i32),
                            A::P(xq),
                            A::P(invs),
                        ],
                    )?;
                    normed_q8 = true;
                }
                self.matvec_q8x((xq, invs), &group, n)?;
                continue;
            }
            if ty == GgmlType::F32 && (tile == 1 || self.x_tok) && nw == 0 && self.x_router {
                // x read in place; several tokens (a verify pass) in tiles, the same bits.
                let split = MvfSplit {
                    parts: mvf_parts(ty, cols, self.mvf_lane_iters),
                    rows: if tile > 1 { 1 } else { self.mvf_rows },
                };
                let f = if tile > 1 {
                    self.k.matvec3_x_tok_f32.clone()
                } else {
                    self.k.matvec3_x_f32.clone()
                };
                let mut args = vec![
                    A::P(x),
                    A::I(cols as i32),
                    A::I(split.arg() | (tile << 16) as i32),
                ];
                if tile > 1 {
                    args.push(A::I(n as i32));
                }
                let grid_x = push_mats3(&mut args, &group, split.rows_per_block());
                self.launch(
                    "matvec3_x",
                    &f,
                    (grid_x, n.div_ceil(tile) as u32, 1),
                    MVF_THREADS,
                    0,
                    &args,
                )?;
                continue;
            }
            let kernel = match (tile > 1, q8) {
                (true, false) => "matvec_norm3_tok",
                (false, false) => "matvec_norm3",
                (true, true) => "matvec_norm3_tok_q8",
                (false, true) => "matvec_norm3_q8",
            };
            let f = self
                .gpu
                .func(&format!("{kernel}_{}", type_suffix(ty)))?
                .clone();
            let split = MvfSplit {
                parts: mvf_parts(ty, cols, self.mvf_lane_iters),
                rows: match (tile > 1, q8) {
                    (true, _) => 1,
                    (false, true) => self.q8_rows,
                    (false, false) => self.mvf_rows,
                },
            };
            let shared = if q8 {
                tile * crate::ops::q8_row_bytes(cols)
            } else {
                4 * tile * cols
            };
            let rows_per_block = split.rows_per_block();
            let mut args = vec![
                A::P(x),
                A::P(nw),
                A::F(self.config.rms_eps),
                A::I(cols as i32),
                A::I(split.arg() | (tile << 16) as i32),
            ];
            if tile > 1 {
                args.push(A::I(n as i32));
            }
            let grid_x = push_mats3(&mut args, &group, rows_per_block);
            self.launch(
                "matvec_norm3",
                &f,
                (grid_x, n.div_ceil(tile) as u32, 1),
                MVF_THREADS,
                shared as u32,
                &args,
            )?;
        }
        Ok(())
    }

    /// Warps per row of `moe_down_combine_tab` (`REDLITE_CUDA_MOE_DOWN_PARTS`: 1, 2, 4 … up to the
    /// block's warps; default 2: 232.0 / 232.2 tok/s against 224.1 / 224.2 with 1 and 232.2 / 231.3
    /// with 4 on the H200; group-decoded expert types only, others take 1).
    pub(super) fn moe_down_parts(&self, e: &DevExperts) -> usize {
        let grouped = matches!(e.down_ty, GgmlType::IQ2XXS | GgmlType::Q4K | GgmlType::Q8_0);
        if !grouped || !self.config.hidden.is_multiple_of(e.warps as usize) {
            return 1;
        }
        fit_down_parts(self.moe_down_parts, e.warps)
    }

    /// Whether the fused matvec of a `ty` matrix `cols` wide takes 8-bit activations.
    pub(super) fn q8_fits(&self, ty: GgmlType, cols: usize) -> bool {
        let ty_ok = ty == GgmlType::Q4K || (self.q8_q6k && ty == GgmlType::Q6K);
        self.q8 && ty_ok && cols.is_multiple_of(256)
    }

    /// `y_m[t] = W_m · xq[t]` for up to three Q4_K matrices of one width on the q8 rows a
    /// producer wrote (`matvec_q8x_q4_k`: the rows of `matvec_norm3_q8_q4_k` without its staging).
    /// `invs` (0: none) scales token t's outputs by `invs[t]` (the 1 / rms of [`Self::rms_norm_q8`]).
    pub(super) fn matvec_q8x(
        &mut self,
        (xq, invs): (u64, u64),
        mats: &[(&DevLinear, u64)],
        n: usize,
    ) -> Result<(), CudaError> {
        let (cols, ty) = (mats[0].0.cols, mats[0].0.ty);
        if ty == GgmlType::Q4K && self.q8x_mma != 0 && n >= self.q8x_mma {
            if let Some(smem) = q8x_mma_smem(cols) {
                return self.matvec_q8x_mma((xq, invs), mats, n, smem);
            }
        }
        // Several tokens: the weights once per tile (`matvec_q8x_tok_*`, the same bits).
        let tile = if n > 1 { self.q8x_tile.min(n) } else { 1 };
        let split = MvfSplit {
            parts: mvf_parts(ty, cols, self.mvf_lane_iters),
            rows: if tile > 1 {
                self.q8x_tile_rows
            } else {
                self.q8_rows
            },
        };
        let mut args = vec![
            A::P(xq),
            A::P(invs),
            A::I(cols as i32),
            A::I(split.arg() | (tile << 16) as i32),
        ];
        if tile > 1 {
            args.push(A::I(n as i32));
        }
        // The Q6_K head of a verify pass in one slice a row: its q8 values in registers
        // (`matvec_q8x_xr_q6_k`, 16 rows × 8 tokens a block; the same bits).
        if ty == GgmlType::Q6K
            && tile > 1
            && self.head_xr != 0
            && n >= self.head_xr
            && split.parts == 1
        {
            let grid_x = push_mats3(&mut args, mats, HEAD_XR_ROWS);
            let f = self.k.matvec_q8x_xr_q6k.clone();
            return self.launch(
                "matvec_q8x",
                &f,
                (grid_x, n.div_ceil(XR_TOKENS) as u32, 1),
                MVF_THREADS,
                0,
                &args,
            );
        }
        let grid_x = push_mats3(&mut args, mats, split.rows_per_block());
        let f = match (ty == GgmlType::Q6K, tile > 1) {
            (true, false) => self.k.matvec_q8x_q6k.clone(),
            (false, false) => self.k.matvec_q8x.clone(),
            (true, true) => self.k.matvec_q8x_tok_q6k.clone(),
            (false, true) => self.k.matvec_q8x_tok.clone(),
        };
        self.launch(
            "matvec_q8x",
            &f,
            (grid_x, n.div_ceil(tile) as u32, 1),
            MVF_THREADS,
            0,
            &args,
        )
    }

    /// [`Self::matvec_q8x`] through `matvec_q8x_mma_q4_k`: 16 rows × 8 tokens a block, the
    /// one-token kernel's slices (`parts`) and sums emulated, so the same bits.
    pub(super) fn matvec_q8x_mma(
        &mut self,
        (xq, invs): (u64, u64),
        mats: &[(&DevLinear, u64)],
        n: usize,
        smem: u32,
    ) -> Result<(), CudaError> {
        let (cols, ty) = (mats[0].0.cols, mats[0].0.ty);
        let parts = mvf_parts(ty, cols, self.mvf_lane_iters);
        let mut args = vec![
            A::P(xq),
            A::P(invs),
            A::I(cols as i32),
            A::I(parts as i32),
            A::I(n as i32),
        ];
        let grid_x = push_mats3(&mut args, mats, 16);
        let f = self.k.matvec_q8x_mma.clone();
        self.launch(
            "matvec_q8x",
            &f,
            (grid_x, n.div_ceil(8) as u32, 1),
            MVF_THREADS,
            smem,
            &args,
        )
    }

    /// The mixer's output projection with the residual and the next norm folded in:
    /// `x[t] += W · a[t]`, then `xn[t] = rms_norm(x[t], post_norm)` (by the last block per token).
    pub(super) fn matvec_residual(
        &mut self,
        w: &DevLinear,
        a: u64,
        post_norm: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let (x, xn, counter) = (self.sc.x, self.sc.xn, self.sc.counter);
        self.xq_fresh = false;
        self.logits_ready = false;
        let router = self.next_router.take();
        if self.gemm_fits(w) {
            self.gemm(w, a, x, n, true)?;
            return self.rms_norm(x, post_norm, xn, n, self.config.hidden);
        }
        let xq = self.next_xq();
        self.xq_fresh = xq != 0;
        let q8 = self.q8_res && w.ty == GgmlType::Q4K && self.q8_fits(w.ty, w.cols);
        let name = if q8 {
            "matvec_res_q8_q4_k".to_string()
        } else {
            format!("matvec_res_{}", type_suffix(w.ty))
        };
        let f = self.gpu.func(&name)?.clone();
        let split = MvfSplit {
            parts: mvf_parts(w.ty, w.cols, self.res_lane_iters),
            rows: if q8 { self.q8_res_rows } else { self.res_rows },
        };
        // The next norm in the last block, or (null norm weights there) by `res_norm_q8` after.
        let split_norm = self.res_norm_split;
        let nw_in_kernel = if split_norm { 0 } else { post_norm };
        let shared = if q8 {
            crate::ops::q8_row_bytes(w.cols) as u32
        } else {
            0
        };
        let tile = token_tile(self.token_tile, n, w.cols);
        if self.x_tok && tile > 1 && split_norm && !q8 {
            // Several tokens (a verify pass): the weights once per tile, the same bits; Q4_K
            // with `res_tok_rows` 2: two rows a warp group sharing each token's activation loads.
            let xr = w.ty == GgmlType::Q4K && self.res_xr != 0 && n >= self.res_xr;
            let two = !xr && res_tok_rows(self.res_tok_rows, n) == 2 && w.ty == GgmlType::Q4K;
            let name = if xr {
                "matvec_res_xr_q4_k".to_string()
            } else if two {
                "matvec_res_tok2_q4_k".to_string()
            } else {
                format!("matvec_res_tok_{}", type_suffix(w.ty))
            };
            let f = self.gpu.func(&name)?.clone();
            let split = MvfSplit {
                parts: split.parts,
                rows: if two { 2 } else { 1 },
            };
            let grid = if xr {
                (blocks(w.rows, RES_XR_ROWS), n.div_ceil(XR_TOKENS) as u32, 1)
            } else {
                (
                    blocks(w.rows, split.rows_per_block()),
                    n.div_ceil(tile) as u32,
                    1,
                )
            };
            self.launch(
                "matvec_res_tok",
                &f,
                grid,
                MVF_THREADS,
                0,
                &[
                    A::P(w.ptr),
                    A::P(a),
                    A::P(x),
                    A::I(w.rows as i32),
                    A::I(w.cols as i32),
                    A::I(split.arg() | (tile << 16) as i32),
                    A::I(n as i32),
                ],
            )?;
        } else {
            self.launch(
                "matvec_res",
                &f,
                (blocks(w.rows, split.rows_per_block()), n as u32, 1),
                MVF_THREADS,
                shared,
                &[
                    A::P(w.ptr),
                    A::P(a),
                    A::P(x),
                    A::I(w.rows as i32),
                    A::I(w.cols as i32),
                    A::I(split.arg()),
                    A::P(nw_in_kernel),
                    A::P(xn),
                    A::P(counter),
                    A::F(self.config.rms_eps),
                    A::P(xq),
                ],
            )?;
        }
        if !split_norm {
            return Ok(());
        }
        // res_norm_q8's arguments, the first of res_norm_router's.
        let norm_args = [
            A::P(x),
            A::I(w.rows as i32),
            A::P(post_norm),
            A::P(xn),
            A::F(self.config.rms_eps),
            A::P(xq),
        ];
        if let Some(r) = router.filter(|_| n == 1 && xq != 0) {
            // The next norm and the router's logits on it in one launch (`norm_router`).
            let f = self.k.res_norm_router.clone();
            let slices = self.norm_slices;
            let early = if self.norm_router_direct { 2 } else { 1 };
            let mut args = norm_args.to_vec();
            args.extend([A::I(slices as i32), A::I(r.split.arg()), A::I(early)]);
            let (rlog, gl) = (self.sc.rlog, self.sc.gl);
            let grid_x = push_mats3(
                &mut args,
                &[(&r.router, rlog), (&r.gate, gl)],
                r.split.rows_per_block(),
            );
            self.launch(
                "res_norm_router",
                &f,
                (
                    crate::ops::res_norm_router_blocks(grid_x, slices as u32, early),
                    1,
                    1,
                ),
                MVF_THREADS,
                4 * w.rows as u32,
                &args,
            )?;
            self.logits_ready = true;
            return Ok(());
        }
        let f = self.k.res_norm_q8.clone();
        self.launch(
            "res_norm_q8",
            &f,
            (self.norm_slices as u32, n as u32, 1),
            MVF_THREADS,
            0,
            &norm_args,
        )
    }

    /// Where the output projection's next norm also writes its q8 row: `sc.xq` when an 8-bit MoE
    /// kernel will read it, else null.
    pub(super) fn next_xq(&self) -> u64 {
        if (self.q8_moe || self.xq_shared) && self.config.hidden.is_multiple_of(32) {
            self.sc.xq
        } else {
            0
        }
    }

    /// Whether `w` goes through [`Self::gemm`] in the call being enqueued.
    pub(super) fn gemm_fits(&self, w: &DevLinear) -> bool {
        self.gemm_now && w.cols.is_multiple_of(GEMM_BK)
    }

    /// `y[t] (+)= W · x[t]` for the `n` tokens of a prompt on the tensor cores (`gemm_<type>`).
    pub(super) fn gemm(
        &mut self,
        w: &DevLinear,
        x: u64,
        y: u64,
        n: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        if self.gemm_blas(w, x, y, n, accumulate)? {
            return Ok(());
        }
        // f32 weights (the router: its logits pick the experts) keep f32 inputs.
        let (name, threads) = match w.ty {
            GgmlType::F32 => ("gemm_f32_simt".to_string(), 256),
            ty => (format!("gemm_{}", type_suffix(ty)), GEMM_THREADS),
        };
        let f = self.gpu.func(&name)?.clone();
        self.launch(
            "gemm",
            &f,
            (
                w.rows.div_ceil(GEMM_BM) as u32,
                n.div_ceil(GEMM_BN) as u32,
                1,
            ),
            threads,
            0,
            &[
                A::P(w.ptr),
                A::P(x),
                A::P(y),
                A::I(w.rows as i32),
                A::I(w.cols as i32),
                A::I(n as i32),
                A::I(accumulate as i32),
            ],
        )
    }

    /// [`Self::gemm`] through cuBLAS ([`PromptBlas`]) when it applies; `false` when it does not
    /// (nothing enqueued).
    pub(super) fn gemm_blas(
        &mut self,
        w: &DevLinear,
        x: u64,
        y: u64,
        n: usize,
        accumulate: bool,
    ) -> Result<bool, CudaError> {
        let side = Arc::ptr_eq(&self.stream, &self.side.stream);
        let Some(pb) = &self.blas else {
            return Ok(false);
        };
        let lane = if side { &pb.side } else { &pb.main };
        let (rows, cols) = (w.rows, w.cols);
        if w.ty == GgmlType::F32 {
            // f32 weights (the router) straight from their buffer, f32 inputs.
            if !pb.f32 || n < pb.min_tokens || rows < 64 {
                return Ok(false);
            }
            lane.blas
                .gemm_f32((w.ptr, x, y), (rows, cols, n), accumulate)?;
            self.launches += 1;
            return Ok(true);
        }
        if n < pb.min_tokens || rows < 64 || rows * cols > lane.w_elems || n * cols > lane.x_elems {
            return Ok(false);
        }
        let (wh, xh) = (lane.wh, lane.xh);
        let f = self
            .gpu
            .func(&format!("dequant_f16_{}", type_suffix(w.ty)))?
            .clone();
        let groups = rows * cols / 16;
        self.launch(
            "dequant_f16",
            &f,
            (blocks(groups, 256), 1, 1),
            256,
            0,
            &[A::P(w.ptr), A::P(wh), A::I(rows as i32), A::I(cols as i32)],
        )?;
        let f = self.gpu.func("f32_to_f16")?.clone();
        let len4 = n * cols / 4;
        self.launch(
            "f32_to_f16",
            &f,
            (blocks(len4, 256), 1, 1),
            256,
            0,
            &[A::P(x), A::P(xh), A::I(i32_of(len4, "activations")?)],
        )?;
        let pb = self.blas.as_ref().expect("checked above");
        let lane = if side { &pb.side } else { &pb.main };
        lane.blas
            .gemm_f16((wh, xh, y), (rows, cols, n), accumulate)?;
        self.launches += 1;
        Ok(true)
    }

    pub(super) fn rms_norm(
        &mut self,
        x: u64,
        w: u64,
        y: u64,
        rows: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let f = self.k.rms_norm.clone();
        let eps = self.config.rms_eps;
        self.launch(
            "rms_norm",
            &f,
            (rows as u32, 1, 1),
            256,
            0,
            &[A::P(x), A::P(w), A::P(y), A::I(n as i32), A::F(eps)],
        )
    }

    pub(super) fn elementwise(
        &mut self,
        f: &CudaFunction,
        args: &[A],
        len: usize,
    ) -> Result<(), CudaError> {
        let mut all = args.to_vec();
        all.push(A::I(len as i32));
        self.launch("element-wise", f, (blocks(len, 256), 1, 1), 256, 0, &all)
    }
}

/// The `(w, y, rows)` arguments of up to three matrices for the fused matvec kernels (absent
/// ones as nulls and 0 rows), appended to `args`; returns the blocks they take at `rpb` rows a
/// block.
pub(super) fn push_mats3(args: &mut Vec<A>, mats: &[(&DevLinear, u64)], rpb: u32) -> u32 {
    let mut grid_x = 0;
    for m in 0..3 {
        match mats.get(m) {
            Some((w, y)) => {
                args.extend([A::P(w.ptr), A::P(*y), A::I(w.rows as i32)]);
                grid_x += blocks(w.rows, rpb);
            }
            None => args.extend([A::P(0), A::P(0), A::I(0)]),
        }
    }
    grid_x
}

#[cfg(test)]
mod tests {
    use super::CudaModel;

    fn list(s: &str) -> Vec<String> {
        s.split(',').map(String::from).collect()
    }

    #[test]
    fn launch_lists_take_stages_wildcards_and_exclusions() {
        let l = list("moe_router_warp,dn:*");
        assert!(CudaModel::listed(&l, "moe", "moe_router_warp"));
        assert!(CudaModel::listed(&l, "dn", "matvec_q8x"));
        assert!(!CudaModel::listed(&l, "attn", "matvec_q8x"));
        let l = list("*,!embedding,!moe:matvec3_x");
        assert!(!CudaModel::listed(&l, "head", "embedding"));
        assert!(!CudaModel::listed(&l, "moe", "matvec3_x"));
        assert!(CudaModel::listed(&l, "shared", "matvec3_x"));
        assert!(CudaModel::listed(&l, "dn", "dn_fused_cols_rows"));
        assert!(!CudaModel::listed(&list("!embedding"), "head", "matvec"));
    }
}
