//! Uploading a GGUF file's model: the weights in their quantized layout, the expert cache,
//! the scratch buffers and the checks of the shapes the kernels take.

use super::*;

impl CudaModel {
    /// Upload an open GGUF file's model to `gpu`.
    pub fn from_gguf(
        gpu: Arc<Gpu>,
        file: Arc<GgufFile>,
        opts: CudaModelOptions,
    ) -> Result<CudaModel, CudaError> {
        let config = Config::from_gguf(&file).map_err(model_err)?;
        check_config(&config, &opts)?;
        let weights = Weights::load(&file, &config, &HostLoader).map_err(model_err)?;
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::driver("binding the context", e))?;
        let stream = crate::device::new_stream(&gpu.ctx)
            .map_err(|e| CudaError::driver("creating the model's stream", e))?;
        let mut arena = Arena {
            ctx: gpu.ctx.clone(),
            ptrs: Vec::new(),
            bytes: 0,
        };
        let f = |name: &str| gpu.func(name).cloned();
        // An attention kernel in the form for the cache's element type.
        let fkv = |name: &str| {
            gpu.func(&crate::ops::kv_kernel(name, opts.kv_type)?)
                .cloned()
        };
        // A kernel with the blocks of `threads` an SM holds at once (for grid barriers).
        let with_blocks_per_sm =
            |name: &str, threads: u32| -> Result<(CudaFunction, u32), CudaError> {
                let k = f(name)?;
                let per_sm = k
                    .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
                    .map_err(|e| CudaError::driver("occupancy", e))?;
                Ok((k, per_sm))
            };
        // The decode attention's split kernel of 4 positions a warp step (its forms: below).
        let gqa4_name = attn_gqa4_kernel(
            opts.kv_type,
            (config.n_heads, config.n_kv_heads, config.head_dim),
        )?;
        let k = Kernels {
            rms_norm: f("rms_norm")?,
            rms_norm_gated: f("rms_norm_gated")?,
            argmax_chain: f("argmax_chain")?,
            dn_restore: f("dn_restore")?,
            swiglu: f("swiglu")?,
            dn_conv_seq: f("dn_conv_seq")?,
            dn_conv_prompt: f("dn_conv_prompt")?,
            dn_conv_shift: f("dn_conv_shift")?,
            dn_qk_norm: f("dn_qk_norm")?,
            dn_gates: f("dn_gates")?,
            dn_delta_seq: f("dn_delta_seq")?,
            dn_fused_seq: f("dn_fused_seq")?,
            dn_fused_cols: f("dn_fused_cols")?,
            dn_fused_cols_rows: f("dn_fused_cols_rows")?,
            attn_qk_prep: fkv("attn_qk_prep")?,
            attn_causal: fkv("attn_causal")?,
            attn_prompt: fkv("attn_prompt")?,
            attn_split: fkv("attn_split")?,
            attn_split_gqa: fkv("attn_split_gqa")?,
            attn_split_gqa4: f(&gqa4_name)?,
            attn_merge: f("attn_merge")?,
            argmax: f("argmax")?,
            sample_topk: f("sample_topk")?,
            moe_group: f("moe_group")?,
            matvec_q8x: f("matvec_q8x_q4_k")?,
            matvec_q8x_q6k: f("matvec_q8x_q6_k")?,
            matvec_q8x_tok: f("matvec_q8x_tok_q4_k")?,
            matvec_q8x_tok_q6k: f("matvec_q8x_tok_q6_k")?,
            matvec_q8x_xr_q6k: f("matvec_q8x_xr_q6_k")?,
            matvec_q8x_mma: {
                let k = f("matvec_q8x_mma_q4_k")?;
                q8x_mma_opt_in(&k)?;
                k
            },
            swiglu_q8: f("swiglu_q8")?,
            rms_norm_q8: f("rms_norm_q8")?,
            matvec3_x_f32: f("matvec3_x_f32")?,
            matvec3_x_tok_f32: f("matvec3_x_tok_f32")?,
            res_norm_q8: f("res_norm_q8")?,
            res_norm_router: f("res_norm_router")?,
            moe_gate_up_route: f("moe_gate_up_route_q8q_iq2_xxs")?,
            moe_gate_up_route2: f("moe_gate_up_route2_q8q_iq2_xxs")?,
            moe_route_fused: with_blocks_per_sm(
                "moe_route_gate_up_q8q_iq2_xxs",
                ROUTE_FUSED_THREADS,
            )?,
            swiglu_pairs: f("swiglu_pairs")?,
            moe_combine_pairs: f("moe_combine_pairs")?,
        };

        // Token embedding, straight from the file.
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| CudaError::Invalid("missing tensor token_embd.weight".into()))?
            .clone();
        let embed_f = f(&format!("embed_{}", type_suffix(embd.ty)))?;
        let embed_cat2_f = f(&format!("embed_cat2_{}", type_suffix(embd.ty)))?;
        let embed = arena.upload(file.tensor_data(&embd))?;

        let output_norm = arena.upload_f32(&weights.output_norm)?;
        let output = dev_linear(&gpu, &mut arena, &weights.output)?;
        let mut layers = Vec::with_capacity(weights.layers.len());
        for (i, w) in weights.layers.iter().enumerate() {
            layers.push(dev_layer(&gpu, &mut arena, &config, &opts, i, w)?);
        }
        let sc = scratch(&mut arena, &config, &opts)?;
        let dn_restore = dn_restore_table(&mut arena, &config, &opts, &layers)?;
        // Before the trunk's experts: a memory budget leaves them what the MTP block takes.
        let mtp = match (&weights.mtp, opts.mtp) {
            (Some(w), true) => Some(dev_mtp(&gpu, &mut arena, &config, &opts, w)?),
            _ => None,
        };
        let side = MoeSide::new(&gpu.ctx)?;
        let (blas, blas_off) =
            match PromptBlas::new(&mut arena, &file, &config, &opts, (&stream, &side.stream))? {
                Ok(b) => (Some(b), None),
                Err(why) => (None, Some(why)),
            };
        // The experts last, so that a memory budget gives them what the rest leaves.
        let experts = dev_experts(&gpu, &mut arena, &config, &opts, &weights.layers)?;
        let router_kernel = RouterKernel::for_model(config.n_experts);
        let router = (gpu.func(router_kernel.name)?.clone(), router_kernel);
        let mvf_lane_iters = env_parse("REDLITE_CUDA_MVF_LANE_ITERS").unwrap_or(4);
        let mvf_rows = mvf_rows_from_env(false);
        let pdl = gpu.info.compute_capability.0 >= 9 && env_switch("REDLITE_CUDA_PDL", true);
        // P = 4 (`attn_split_gqa4`): 303.3 tok/s against 303.0 with 2 (short), 257.3 against 254.4
        // at position 32,768 on the H200.
        let gqa_p = env_parse::<usize>("REDLITE_CUDA_ATTN_GQA").unwrap_or(4);
        let attn_gqa = (gqa_p > 0
            && crate::ops::attn_split_gqa_fits(config.n_heads, config.n_kv_heads, config.head_dim))
        .then_some(gqa_p);
        // `attn_split_gqa` runs one block per SM (242 / 255 registers a thread): as many chunks as fill
        // one wave (66 on the H200: 247.8 tok/s at position 32,768 against 233.8 with 128).
        // The gqa4 kernel: as many chunks as fill one wave of its blocks (one an SM but for
        // `attn_split_gqa8xh3_h`: two blocks a KV head, half its query heads each, three an SM).
        let (nh, nkv, hd) = (config.n_heads, config.n_kv_heads, config.head_dim);
        if attn_gqa == Some(4) && !crate::ops::attn_split_takes(&gqa4_name, nh, nkv, hd) {
            return Err(CudaError::Invalid(format!(
                "{gqa4_name} does not take head_dim {hd} with {nh} query heads over {nkv} KV heads"
            )));
        }
        let attn_head_blocks = match attn_gqa {
            Some(4) => crate::ops::attn_split_head_blocks(&gqa4_name),
            _ => 1,
        };
        let attn_default_splits = if attn_gqa == Some(4) {
            let sms = gpu.info.sm_count;
            crate::ops::attn_split_wave(&k.attn_split_gqa4, &gqa4_name, nh, nkv, sms)?.2
        } else if attn_gqa.is_some() {
            (gpu.info.sm_count / config.n_kv_heads.max(1)).max(1)
        } else {
            ATTN_DEFAULT_SPLITS
        };
        let dn_cols = crate::ops::dn_cols_launch(crate::ops::DeltaDims {
            nk: config.dn_k_heads,
            nv: config.dn_v_heads,
            dk: config.dn_k_dim,
            dv: config.dn_v_dim,
        })
        .filter(|_| env_switch("REDLITE_CUDA_DN_COLS", true))
        .filter(|&(grid, threads, shared)| {
            [&k.dn_fused_cols, &k.dn_fused_cols_rows].iter().all(|f| {
                f.occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)
                    .is_ok_and(|per_sm| per_sm as usize * gpu.info.sm_count >= grid as usize)
            })
        });
        let mut model = CudaModel {
            config,
            opts,
            gpu,
            stream,
            k,
            embed_f,
            embed_cat2_f,
            embed,
            output_norm,
            output,
            layers,
            sc,
            pos: 0,
            last_row: 0,
            graph: None,
            launches: 0,
            step_launches: None,
            decode_steps: 0,
            nvtx: None,
            in_profile: false,
            mvf_lane_iters,
            mvf_rows,
            res_rows: mvf_rows_from_env(true),
            res_lane_iters: env_parse("REDLITE_CUDA_RES_LANE_ITERS")
                .unwrap_or(mvf_lane_iters)
                .max(1),
            token_tile: token_tile_from_env(),
            gemm: env_switch("REDLITE_CUDA_GEMM", true),
            gemm_now: false,
            attn_mma: env_switch("REDLITE_CUDA_ATTN_MMA", true),
            attn_gqa,
            attn_head_blocks,
            rope_table: env_switch("REDLITE_CUDA_ROPE_TABLE", true),
            dn_fused_prompt: env_switch("REDLITE_CUDA_DN_PROMPT_FUSED", false),
            dn_warp: env_switch("REDLITE_CUDA_DN_WARP", true),
            attn_splits: env_parse("REDLITE_CUDA_ATTN_SPLITS")
                .unwrap_or(attn_default_splits)
                .clamp(1, ATTN_MAX_SPLITS),
            attn_min_chunk: env_parse("REDLITE_CUDA_ATTN_MIN_CHUNK")
                .unwrap_or(ATTN_DEFAULT_MIN_CHUNK)
                .max(4)
                .next_multiple_of(4),
            head_lane_iters: env_parse("REDLITE_CUDA_HEAD_LANE_ITERS").unwrap_or(8),
            router_split: (
                env_parse("REDLITE_CUDA_ROUTER_LANE_ITERS").unwrap_or(4),
                env_parse("REDLITE_CUDA_ROUTER_ROWS")
                    .unwrap_or(1)
                    .clamp(1, MVF_MAX_ROWS),
            ),
            router,
            pdl,
            q8: env_switch("REDLITE_CUDA_Q8", true),
            q8_rows: q8_rows_from_env(),
            q8_res: env_switch("REDLITE_CUDA_Q8_RES", false),
            q8_res_rows: env_parse("REDLITE_CUDA_Q8_RES_ROWS")
                .unwrap_or(2)
                .clamp(1, 16),
            q8_moe: env_switch("REDLITE_CUDA_Q8_MOE", true),
            q8_q6k: env_switch("REDLITE_CUDA_Q8_Q6K", true),
            xq_shared: env_switch("REDLITE_CUDA_XQ_SHARED", true),
            xq_norm: env_switch("REDLITE_CUDA_XQ_NORM", true),
            q8x_tile: env_parse("REDLITE_CUDA_Q8X_TILE").unwrap_or(8).clamp(1, 8),
            q8x_tile_rows: env_parse("REDLITE_CUDA_Q8X_TILE_ROWS")
                .unwrap_or(2)
                .clamp(1, 16),
            q8x_mma: env_parse("REDLITE_CUDA_Q8X_MMA").unwrap_or(6),
            x_tok: env_switch("REDLITE_CUDA_X_TOK", true),
            x_router: env_switch("REDLITE_CUDA_X_ROUTER", true),
            moe_gu_pair: env_switch("REDLITE_CUDA_MOE_GU_PAIR", true),
            route_fused: env_switch("REDLITE_CUDA_ROUTE_FUSED", true),
            norm_router: env_switch("REDLITE_CUDA_NORM_ROUTER", true),
            norm_router_direct: env_switch("REDLITE_CUDA_NORM_ROUTER_DIRECT", true),
            next_router: None,
            logits_ready: false,
            dn_early: env_switch("REDLITE_CUDA_DN_EARLY", true),
            dn_cols,
            dn_rows: env_switch("REDLITE_CUDA_DN_ROWS", true),
            dn_pre: env_switch("REDLITE_CUDA_DN_PRE", true),
            grid_counters: Vec::new(),
            moe_direct: env_switch("REDLITE_CUDA_MOE_DIRECT", true),
            route_in_gate_up: env_switch("REDLITE_CUDA_ROUTE_IN_GATE_UP", true),
            res_norm_split: env_switch("REDLITE_CUDA_RES_NORM_SPLIT", true),
            skip: env_list("REDLITE_CUDA_SKIP"),
            noop: env_list("REDLITE_CUDA_NOOP"),
            stage: "",
            norm_slices: env_parse("REDLITE_CUDA_NORM_SLICES")
                .unwrap_or(crate::ops::NORM_SLICES)
                .clamp(1, 64),
            argmax_slices: env_parse("REDLITE_CUDA_ARGMAX_SLICES")
                .unwrap_or(ARGMAX_SLICES)
                .clamp(1, ARGMAX_SLICES),
            xq_fresh: false,
            q8_moe_down: env_switch("REDLITE_CUDA_Q8_MOE_DOWN", true),
            moe_down_parts: moe_down_parts_from_env(),
            moe_tok: moe_tok_tiles(),
            res_tok_rows: env_parse("REDLITE_CUDA_RES_TOK_ROWS").unwrap_or(0).min(2),
            res_xr: env_parse("REDLITE_CUDA_RES_XR").unwrap_or(2),
            head_xr: env_parse("REDLITE_CUDA_HEAD_XR").unwrap_or(2),
            moe_rows: env_parse("REDLITE_CUDA_MOE_ROWS").unwrap_or(1).clamp(1, 8),
            verified: None,
            profile_step: env_parse("REDLITE_CUDA_PROFILE_STEP"),
            verify_passes: 0,
            captures_invalidated: 0,
            profile_verify: env_parse("REDLITE_CUDA_PROFILE_VERIFY"),
            mtp_drafts: 0,
            profile_draft: env_parse("REDLITE_CUDA_PROFILE_DRAFT"),
            mtp_min_prob: env_parse("REDLITE_CUDA_MTP_MIN_PROB").unwrap_or(0.0),
            experts,
            mtp,
            small_graphs: env_switch("REDLITE_CUDA_SMALL_GRAPHS", true),
            verify_graphs: HashMap::new(),
            verify_uses: HashMap::new(),
            dn_restore,
            side,
            blas,
            blas_off,
            arena,
        };
        model.fill_rope_table()?;
        model.reset()?;
        Ok(model)
    }

    /// `rope_table` into `Scratch::rope_cs`, once.
    pub(super) fn fill_rope_table(&mut self) -> Result<(), CudaError> {
        let half = self.config.rope_dims / 2;
        if half == 0 {
            return Ok(());
        }
        let f = self.gpu.func("rope_table")?.clone();
        let args = [
            A::P(self.sc.rope_cs),
            A::I(self.opts.max_context as i32),
            A::I(self.config.rope_dims as i32),
            A::D(self.config.rope_theta),
        ];
        let grid = (self.opts.max_context as u32, half.div_ceil(32) as u32, 1);
        // SAFETY: rope_table(cs, positions, rope_dims, theta); cs holds max_context rows of half
        // pairs.
        unsafe { launch_ex(&self.stream, &f, (grid, 32, 0), &args, false) }
            .map_err(|e| CudaError::driver("launching rope_table", e))?;
        self.stream
            .synchronize()
            .map_err(|e| CudaError::driver("computing the RoPE table", e))
    }
}

/// The shapes the kernels handle.
pub(super) fn check_config(c: &Config, o: &CudaModelOptions) -> Result<(), CudaError> {
    let bad = |m: String| Err(CudaError::Invalid(m));
    if o.max_batch == 0 || o.max_batch > 65_535 || o.max_context == 0 {
        return bad(format!(
            "max batch {} (1..=65535) and max context {} (> 0)",
            o.max_batch, o.max_context
        ));
    }
    i32_of(o.max_context, "max context")?;
    if o.max_verify > o.max_batch.min(MAX_VERIFY_ROWS) {
        return bad(format!(
            "{} verify rows (at most the max batch {} and {MAX_VERIFY_ROWS})",
            o.max_verify, o.max_batch
        ));
    }
    if o.max_verify > 0 && dn_fused(c).is_none() {
        return bad(
            "speculative verify on the GPU needs the fused DeltaNet kernel, which does not take this shape"
                .into(),
        );
    }
    if c.n_experts_used == 0 || c.n_experts_used > MAX_EXPERTS_USED.min(c.n_experts) {
        return bad(format!(
            "{} experts used of {} (the router kernel takes up to {MAX_EXPERTS_USED})",
            c.n_experts_used, c.n_experts
        ));
    }
    if !c.head_dim.is_multiple_of(32) || c.head_dim > MAX_HEAD_DIM || c.rope_dims > c.head_dim {
        return bad(format!(
            "head dim {} (a multiple of 32, at most {MAX_HEAD_DIM}), rope dims {}",
            c.head_dim, c.rope_dims
        ));
    }
    crate::ops::kv_kernel("", o.kv_type)?;
    if c.n_kv_heads == 0 || !c.n_heads.is_multiple_of(c.n_kv_heads) {
        return bad(format!(
            "{} heads over {} KV heads",
            c.n_heads, c.n_kv_heads
        ));
    }
    if c.conv_kernel == 0 || c.conv_kernel > 8 || c.dn_k_dim > 1024 || c.dn_k_heads == 0 {
        return bad(format!(
            "DeltaNet conv kernel {} (1..=8), k dim {} (<= 1024)",
            c.conv_kernel, c.dn_k_dim
        ));
    }
    if !c.dn_v_heads.is_multiple_of(c.dn_k_heads) {
        return bad(format!(
            "{} V heads over {} QK heads",
            c.dn_v_heads, c.dn_k_heads
        ));
    }
    Ok(())
}

pub(super) fn matvec_kernel(gpu: &Gpu, ty: GgmlType) -> Result<CudaFunction, CudaError> {
    gpu.func(&format!("matvec_{}", type_suffix(ty))).cloned()
}

/// Upload one linear layer.
pub(super) fn dev_linear(
    gpu: &Gpu,
    arena: &mut Arena,
    w: &HostLinear,
) -> Result<DevLinear, CudaError> {
    let rb = row_bytes(w.ty, w.cols)?;
    let bytes = w.bytes();
    if bytes.len() != w.rows * rb {
        return Err(CudaError::Invalid(format!(
            "{}: {} bytes for {} rows of {} {} values",
            w.name,
            bytes.len(),
            w.rows,
            w.cols,
            w.ty.name()
        )));
    }
    Ok(DevLinear {
        rows: w.rows,
        cols: w.cols,
        ptr: arena.upload(bytes)?,
        f: matvec_kernel(gpu, w.ty)?,
        ty: w.ty,
    })
}

/// A small f32 vector as a 1-row F32 matrix (the shared expert's gate).
pub(super) fn dev_row(gpu: &Gpu, arena: &mut Arena, v: &[f32]) -> Result<DevLinear, CudaError> {
    Ok(DevLinear {
        rows: 1,
        cols: v.len(),
        ptr: arena.upload_f32(v)?,
        f: matvec_kernel(gpu, GgmlType::F32)?,
        ty: GgmlType::F32,
    })
}

/// When the experts (each `len` bytes) sit in one mapped file at a fixed stride of at least `len`
/// (the slabs of one 3-D tensor, or the gate or up halves of a fused one): the file, the byte
/// range covering all of them and the stride.
pub fn expert_span<'a>(
    ws: &[&'a HostLinear],
    len: usize,
) -> Option<(&'a Arc<GgufFile>, std::ops::Range<usize>, usize)> {
    let (file, r0) = ws.first()?.file_range()?;
    let stride = match ws.get(1) {
        Some(w) => w.file_range()?.1.start.checked_sub(r0.start)?,
        None => len,
    };
    if stride < len {
        return None;
    }
    let regular = ws.iter().enumerate().all(|(e, w)| {
        w.file_range().is_some_and(|(f, r)| {
            Arc::ptr_eq(f, file) && r.start == r0.start + e * stride && r.len() == len
        })
    });
    regular.then(|| {
        (
            file,
            r0.start..r0.start + (ws.len() - 1) * stride + len,
            stride,
        )
    })
}

/// The routed experts of every layer into the expert cache (all resident, or the slots
/// `opts.experts` leaves room for, the rest in pinned host memory). Every layer's experts must
/// share one type and shape per part (gate and up alike).
pub(super) fn dev_experts(
    gpu: &Gpu,
    arena: &mut Arena,
    c: &Config,
    opts: &CudaModelOptions,
    layers: &[LayerWeights<HostLoader>],
) -> Result<ExpertCache, CudaError> {
    let part_len =
        |w: &HostLinear| -> Result<usize, CudaError> { Ok(row_bytes(w.ty, w.cols)? * w.rows) };
    let mut experts: ExpertBytes<'_> = Vec::with_capacity(layers.len());
    let mut layouts = Vec::with_capacity(layers.len());
    for w in layers {
        let first = w
            .moe
            .experts
            .first()
            .ok_or_else(|| CudaError::Invalid("a MoE layer without routed experts".into()))?;
        let (g0, d0) = (&first.gate, &first.down);
        let mut layer = Vec::with_capacity(w.moe.experts.len());
        for e in &w.moe.experts {
            for (p, like) in [(&e.gate, g0), (&e.up, g0), (&e.down, d0)] {
                if p.ty != like.ty || p.rows != like.rows || p.cols != like.cols {
                    return Err(CudaError::Invalid(format!(
                        "{}: the routed experts of a layer differ in type or shape ({} {}x{} vs {} {}x{} of {}); the GPU expert kernels take one type per part and layer",
                        p.name,
                        p.ty.name(),
                        p.rows,
                        p.cols,
                        like.ty.name(),
                        like.rows,
                        like.cols,
                        like.name
                    )));
                }
            }
            layer.push([e.gate.bytes(), e.up.bytes(), e.down.bytes()]);
        }
        experts.push(layer);
        layouts.push(ExpertLayout::new(part_len(g0)?, part_len(d0)?));
    }
    let stride = layouts.iter().map(|l| l.slot_bytes).max().unwrap_or(0);
    let used = match opts.experts {
        ExpertCacheSize::Budget(_) => device_used()?,
        _ => 0,
    };
    let per_layer = slots_per_layer(opts.experts, experts.len(), c.n_experts, stride, used)?;
    let mut alloc = |n: usize| arena.alloc(n);
    ExpertCache::new(
        &gpu.ctx,
        &mut alloc,
        &experts,
        layouts,
        c.n_experts_used,
        opts.max_batch,
        per_layer,
        opts.expert_policy,
    )
}

/// `dn_restore`'s table of the DeltaNet layers' states and traces (`None` without verify traces,
/// DeltaNet layers, or state sizes in whole float4s).
pub(super) fn dn_restore_table(
    arena: &mut Arena,
    c: &Config,
    o: &CudaModelOptions,
    layers: &[DevLayer],
) -> Result<Option<(u64, usize)>, CudaError> {
    let s_floats = c.dn_v_heads * c.dn_k_dim * c.dn_v_dim;
    let conv_floats = (c.conv_kernel - 1) * c.dn_conv_channels();
    if o.max_verify == 0 || !s_floats.is_multiple_of(4) || !conv_floats.is_multiple_of(4) {
        return Ok(None);
    }
    let mut t: Vec<u8> = Vec::new();
    let mut n = 0;
    for l in layers {
        if let DevMixer::DeltaNet {
            conv_state,
            s,
            conv_trace,
            s_trace,
            ..
        } = &l.mixer
        {
            for p in [*s, *s_trace, *conv_state, *conv_trace] {
                t.extend_from_slice(&p.to_le_bytes());
            }
            n += 1;
        }
    }
    if n == 0 {
        return Ok(None);
    }
    Ok(Some((arena.upload(&t)?, n)))
}

/// The MTP block: its decoder layer (own attention cache, experts in a resident cache of their
/// own), norms, eh_proj, and the slot queue's buffers.
pub(super) fn dev_mtp(
    gpu: &Gpu,
    arena: &mut Arena,
    c: &Config,
    o: &CudaModelOptions,
    w: &MtpWeights<HostLoader>,
) -> Result<DevMtp, CudaError> {
    let h = c.hidden;
    if w.eh_proj.rows != h || w.eh_proj.cols != 2 * h {
        return Err(CudaError::Invalid(format!(
            "{}: {}x{}, the MTP block needs {h}x{}",
            w.eh_proj.name,
            w.eh_proj.rows,
            w.eh_proj.cols,
            2 * h
        )));
    }
    let layer = dev_layer(gpu, arena, c, o, 0, &w.layer)?;
    let resident = CudaModelOptions {
        experts: ExpertCacheSize::All,
        ..*o
    };
    let experts = dev_experts(gpu, arena, c, &resident, std::slice::from_ref(&w.layer))?;
    let q_rows = o.max_batch.max(o.max_verify) + 2;
    Ok(DevMtp {
        enorm: arena.upload_f32(&w.enorm)?,
        hnorm: arena.upload_f32(&w.hnorm)?,
        eh_proj: dev_linear(gpu, arena, &w.eh_proj)?,
        layer,
        shared_head_norm: arena.upload_f32(&w.shared_head_norm)?,
        experts,
        q: arena.f32s(q_rows * h)?,
        queue: MtpQueue::new(q_rows),
        cat: arena.f32s(o.max_batch * 2 * h)?,
        head_row: 0,
        draft_graphs: HashMap::new(),
        drafts: arena.zeros(4 * MAX_GRAPH_DRAFTS)?,
        draft_probs: arena.zeros(4 * MAX_GRAPH_DRAFTS)?,
    })
}

pub(super) fn dev_layer(
    gpu: &Gpu,
    arena: &mut Arena,
    c: &Config,
    o: &CudaModelOptions,
    layer: usize,
    w: &LayerWeights<HostLoader>,
) -> Result<DevLayer, CudaError> {
    // Per-row copies of a state for the verify pass, when there is one.
    let trace = |arena: &mut Arena, n: usize| -> Result<u64, CudaError> {
        if o.max_verify == 0 {
            Ok(0)
        } else {
            arena.f32s(o.max_verify * n)
        }
    };
    let mixer = match &w.mixer {
        MixerWeights::Attention(a) => {
            // Bytes of each cache: [max_context][kv_heads][head_dim] of the KV type.
            let kv = o
                .kv_type
                .bytes_for((o.max_context * c.n_kv_heads * c.head_dim) as u64)
                as usize;
            DevMixer::Attention {
                wq: dev_linear(gpu, arena, &a.wq)?,
                wk: dev_linear(gpu, arena, &a.wk)?,
                wv: dev_linear(gpu, arena, &a.wv)?,
                wo: dev_linear(gpu, arena, &a.wo)?,
                q_norm: arena.upload_f32(&a.q_norm)?,
                k_norm: arena.upload_f32(&a.k_norm)?,
                kc: arena.zeros(kv)?,
                vc: arena.zeros(kv)?,
            }
        }
        MixerWeights::DeltaNet(d) => DevMixer::DeltaNet {
            qkv: dev_linear(gpu, arena, &d.qkv)?,
            z: dev_linear(gpu, arena, &d.z)?,
            ba: dev_linear(gpu, arena, &d.ba)?,
            out: dev_linear(gpu, arena, &d.out)?,
            conv_w: arena.upload_f32(&d.conv)?,
            dt_bias: arena.upload_f32(&d.dt_bias)?,
            a: arena.upload_f32(&d.a)?,
            norm: arena.upload_f32(&d.norm)?,
            conv_state: arena.f32s((c.conv_kernel - 1) * c.dn_conv_channels())?,
            s: arena.f32s(c.dn_v_heads * c.dn_k_dim * c.dn_v_dim)?,
            conv_trace: trace(arena, (c.conv_kernel - 1) * c.dn_conv_channels())?,
            s_trace: trace(arena, c.dn_v_heads * c.dn_k_dim * c.dn_v_dim)?,
        },
    };
    let m = &w.moe;
    let expert = m
        .experts
        .first()
        .ok_or_else(|| CudaError::Invalid("a MoE layer without experts".into()))?;
    if expert.gate.ty != expert.up.ty {
        return Err(CudaError::Invalid(format!(
            "{} and {}: gate and up experts differ in type",
            expert.gate.name, expert.up.name
        )));
    }
    let experts = DevExperts {
        layer,
        gate_up_f: gpu
            .func(&format!("moe_gate_up_tab_{}", type_suffix(expert.gate.ty)))?
            .clone(),
        gate_up_q8_f: match expert.gate.ty {
            GgmlType::IQ2XXS => Some(gpu.func("moe_gate_up_tab_q8_iq2_xxs")?.clone()),
            _ => None,
        },
        q8_down_f: match (expert.gate.ty, expert.down.ty) {
            (GgmlType::IQ2XXS, GgmlType::IQ2XXS) => Some((
                gpu.func("moe_gate_up_tab_q8q_iq2_xxs")?.clone(),
                gpu.func("moe_down_combine_tab_q8_iq2_xxs")?.clone(),
            )),
            _ => None,
        },
        q8_tok_f: match (expert.gate.ty, expert.down.ty) {
            (GgmlType::IQ2XXS, GgmlType::IQ2XXS) => Some((
                gpu.func("moe_gate_up_tok_q8q_iq2_xxs")?.clone(),
                gpu.func("moe_down_combine_tok_q8_iq2_xxs")?.clone(),
            )),
            _ => None,
        },
        down_f: gpu
            .func(&format!(
                "moe_down_combine_tab_{}",
                type_suffix(expert.down.ty)
            ))?
            .clone(),
        warps: moe_warps(),
        down_ty: expert.down.ty,
        gemm_gate_up_f: gpu
            .func(&format!("moe_gemm_{}", type_suffix(expert.gate.ty)))?
            .clone(),
        gemm_down_f: gpu
            .func(&format!("moe_gemm_{}", type_suffix(expert.down.ty)))?
            .clone(),
    };
    Ok(DevLayer {
        attn_norm: arena.upload_f32(&w.attn_norm)?,
        post_norm: arena.upload_f32(&w.post_attention_norm)?,
        mixer,
        moe: DevMoe {
            router: dev_linear(gpu, arena, &m.router)?,
            experts,
            sh_gate: dev_linear(gpu, arena, &m.shared.gate)?,
            sh_up: dev_linear(gpu, arena, &m.shared.up)?,
            sh_down: dev_linear(gpu, arena, &m.shared.down)?,
            sh_gate_vec: dev_row(gpu, arena, &m.shared_gate)?,
        },
    })
}

/// Activation buffers for `max_batch` tokens.
pub(super) fn scratch(
    arena: &mut Arena,
    c: &Config,
    o: &CudaModelOptions,
) -> Result<Scratch, CudaError> {
    let b = o.max_batch;
    let (h, ch, vw, nv) = (
        c.hidden,
        c.dn_conv_channels(),
        c.dn_value_width(),
        c.dn_v_heads,
    );
    let (qw, kvw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let (ne, k, ff, sff) = (c.n_experts, c.n_experts_used, c.expert_ff, c.shared_ff);
    let mut f = |n: usize| arena.f32s(b * n);
    Ok(Scratch {
        x: f(h)?,
        xn: f(h)?,
        qkv: f(ch)?,
        conv: f(ch)?,
        z: f(vw)?,
        ba: f(2 * nv)?,
        beta: f(nv)?,
        g: f(nv)?,
        o: f(vw)?,
        gated: f(vw)?,
        qg: f(2 * qw)?,
        kn: f(kvw)?,
        vn: f(kvw)?,
        q: f(qw)?,
        gate: f(qw)?,
        att: f(qw)?,
        rlog: f(ne)?,
        wts: f(k)?,
        act: f(k * ff)?,
        sg: f(sff)?,
        su: f(sff)?,
        sa: f(sff)?,
        shared: f(h)?,
        gl: f(1)?,
        logits: f(c.vocab)?,
        input: arena.alloc(4 * (b + 1))?,
        out: arena.alloc(4 * o.max_verify.max(1))?,
        u: arena.alloc(4)?,
        counter: arena.zeros(4 * b)?,
        grid_counter: arena.zeros(8 * GRID_COUNTERS)?,
        dn_counter: arena.zeros(8 * c.dn_k_heads.max(1))?,
        argmax_part: arena.alloc(8 * ARGMAX_SLICES * o.max_verify.max(1))?,
        argmax_counter: arena.zeros(4 * o.max_verify.max(1))?,
        xq: arena.alloc(b * crate::ops::q8_row_bytes(h))?,
        xq_sa: arena.alloc(b * crate::ops::q8_row_bytes(sff))?,
        act_q: arena.alloc(b * k * crate::ops::q8_row_bytes(ff))?,
        xq_in: arena.alloc(b * crate::ops::q8_row_bytes(MVF_MAX_COLS))?,
        pair_off: arena.alloc(4 * (ne + 1))?,
        pairs: arena.alloc(4 * b * k)?,
        gu: arena.f32s(b * k * 2 * ff)?,
        down: arena.f32s(b * k * h)?,
        attn_part: arena
            .f32s(o.max_verify.max(1) * c.n_heads * attn_splits(o) * (c.head_dim + 2))?,
        xq_inv: arena.f32s(b)?,
        rope_cs: arena.alloc(8 * o.max_context * (c.rope_dims / 2).max(1))?,
    })
}
