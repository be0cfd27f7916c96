//! Speculative decoding on the device: the verify pass over the pending token and its drafts,
//! `keep` (the rollback to the accepted rows) and the MTP drafts.

use super::*;

impl CudaModel {
    /// A speculative verify pass: run `tokens` (the pending token, then the drafts) after the
    /// sequence, every row exactly as a one-token [`CudaModel::decode`] step at its position
    /// computes it (the same kernels per row; attention split over the cache per row; bit for
    /// bit), and return every row's logits. The DeltaNet states after each row are kept, so
    /// [`CudaModel::keep`] can end the sequence after any row. Needs `max_verify >= tokens.len()`.
    pub fn verify(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, CudaError> {
        self.verify_rows(tokens, false)?;
        let vocab = self.config.vocab;
        let mut flat = vec![0.0f32; tokens.len() * vocab];
        self.download(&mut flat, self.sc.logits)?;
        self.experts.after_forward(&self.stream, tokens.len())?;
        Ok(flat.chunks_exact(vocab).map(|r| r.to_vec()).collect())
    }

    /// [`CudaModel::verify`] leaving the logits on the device, for [`CudaModel::sample_row`] or
    /// [`CudaModel::row_logits`] (sampled speculative decoding: a row is drawn only once the
    /// drafts before it were accepted).
    pub fn verify_on_device(&mut self, tokens: &[u32]) -> Result<(), CudaError> {
        self.verify_rows(tokens, false)?;
        self.sync()?;
        self.experts.after_forward(&self.stream, tokens.len())
    }

    /// Row `row` of the last verify pass's logits (read back).
    pub fn row_logits(&self, row: usize) -> Result<Vec<f32>, CudaError> {
        let vocab = self.config.vocab;
        self.check_verified_row(row)?;
        let mut v = vec![0.0f32; vocab];
        self.download(&mut v, self.sc.logits + (4 * row * vocab) as u64)?;
        Ok(v)
    }

    /// Draw a token from row `row` of the last verify pass's logits on the GPU, as
    /// [`CudaModel::decode`] draws from a step's (`u` uniform in [0, 1)).
    pub fn sample_row(&mut self, row: usize, s: &GpuSampling, u: f32) -> Result<u32, CudaError> {
        self.check_verified_row(row)?;
        self.bind()?;
        self.upload_u(u, s)?;
        let at = self.sc.logits + (4 * row * self.config.vocab) as u64;
        self.enqueue_sample(at, s)?;
        self.read_out()
    }

    pub(super) fn check_verified_row(&self, row: usize) -> Result<(), CudaError> {
        match self.verified {
            Some((_, n)) if row < n => Ok(()),
            _ => Err(CudaError::Invalid(format!(
                "row {row} of a verify pass: the last call was not a verify pass of more rows"
            ))),
        }
    }

    /// [`CudaModel::verify`] that returns every row's greedy token (argmax on the GPU; only the
    /// ids come back).
    pub fn verify_greedy(&mut self, tokens: &[u32]) -> Result<Vec<u32>, CudaError> {
        self.verify_rows(tokens, true)?;
        let [ids] = self.read_ids([(self.sc.out, tokens.len())], "reading the verified tokens")?;
        self.experts.after_forward(&self.stream, tokens.len())?;
        Ok(ids)
    }

    /// The forward of a verify pass (and, `greedy`, every row's argmax into `out`).
    pub(super) fn verify_rows(&mut self, tokens: &[u32], greedy: bool) -> Result<(), CudaError> {
        let n = tokens.len();
        if n == 0 || n > self.opts.max_verify {
            return Err(CudaError::Invalid(format!(
                "a verify pass of {n} rows (the model was loaded for 1..={} rows)",
                self.opts.max_verify
            )));
        }
        self.bind()?;
        self.mtp_make_room(n)?;
        self.upload_input(tokens)?;
        let start = self.pos;
        let profiled = self.profile_verify == Some(self.verify_passes);
        self.verify_passes += 1;
        if profiled {
            self.profiler(true)?;
        }
        let graph = self.small_graphs
            && self.opts.graphs
            && !profiled
            && n <= SMALL_GRAPH_ROWS
            && !self.experts.bounded();
        let body = |m: &mut Self| -> Result<(), CudaError> {
            m.enqueue_forward(n, Head::All, Rows::Steps)?;
            if greedy {
                m.argmax(m.sc.logits, n)?;
            }
            Ok(())
        };
        let enqueued = if graph {
            self.verify_graph((n, greedy), body)
        } else {
            body(self)
        };
        if profiled {
            self.profiler(false)?;
        }
        enqueued?;
        self.mtp_record(tokens, true)?;
        self.pos += n;
        self.last_row = n - 1;
        self.verified = Some((start, n));
        Ok(())
    }

    /// A verify pass's launches `body` (ids and position already uploaded) for `key` = (rows,
    /// greedy): replayed from a graph once that many rows have been seen often enough.
    pub(super) fn verify_graph(
        &mut self,
        key: (usize, bool),
        mut body: impl FnMut(&mut Self) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        if !self.verify_graphs.contains_key(&key) {
            let uses = self.verify_uses.entry(key).or_insert(0);
            *uses += 1;
            if *uses < VERIFY_GRAPH_AFTER {
                return body(self);
            }
            match self.capture(&mut body)? {
                Some(g) => self.verify_graphs.insert(key, g),
                None => return body(self),
            };
        }
        self.verify_graphs[&key]
            .launch()
            .map_err(|e| CudaError::driver("replaying a verify graph", e))
    }

    /// `f`'s launches captured into a graph (not run); `None` when every one of
    /// [`CAPTURE_TRIES`] captures was invalidated from outside (then nothing was enqueued or
    /// run: the caller runs `f` without a graph). A call of another thread can invalidate a
    /// capture whatever its mode (public reports name device-wide synchronisation; a read-back
    /// on another stream did not, session 50), and the capture lock covers only the captures and
    /// stream creation (session 50: `mtp_gpu`'s parallel tests, a model a thread, failed so 2
    /// runs in 5 on one H100); `f` must be safe to call again (launches only).
    pub(super) fn capture(
        &mut self,
        mut f: impl FnMut(&mut Self) -> Result<(), CudaError>,
    ) -> Result<Option<CudaGraph>, CudaError> {
        for _ in 0..CAPTURE_TRIES {
            let _capturing = crate::device::capture_lock();
            self.stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| CudaError::driver("beginning a graph capture", e))?;
            let enqueued = f(self);
            let captured = self
                .stream
                .end_capture(sys::CUgraphInstantiate_flags_enum(0));
            if matches!(&captured, Err(e) if e.0 == INVALIDATED)
                || matches!(&enqueued, Err(e) if e.driver_code() == Some(INVALIDATED as u32))
            {
                self.captures_invalidated += 1;
                continue;
            }
            let captured = captured.map_err(|e| CudaError::driver("ending a graph capture", e))?;
            enqueued?;
            return captured
                .map(Some)
                .ok_or_else(|| CudaError::Invalid("a graph capture came back empty".into()));
        }
        Ok(None)
    }

    /// Keep the first `rows` rows (1..=its rows) of the last verify pass: the sequence then ends
    /// after row `rows - 1`, its state bit-identical to decoding only those tokens (the DeltaNet
    /// states copied back from that row's trace; the attention caches' later rows are
    /// overwritten before anything reads them).
    pub fn keep(&mut self, rows: usize) -> Result<(), CudaError> {
        let Some((start, n)) = self.verified.take() else {
            return Err(CudaError::Invalid(
                "keep needs a verify pass just before it".into(),
            ));
        };
        if rows == 0 || rows > n {
            return Err(CudaError::Invalid(format!(
                "keep {rows} rows of a verify pass of {n}"
            )));
        }
        if rows < n {
            self.bind()?;
            let c = &self.config;
            let s_floats = c.dn_v_heads * c.dn_k_dim * c.dn_v_dim;
            let conv_floats = (c.conv_kernel - 1) * c.dn_conv_channels();
            let row = rows - 1;
            if let Some((table, layers)) = self.dn_restore {
                // One launch for every layer's two states (ordered on the model's stream).
                let f = self.k.dn_restore.clone();
                let per = (s_floats + conv_floats) / 4;
                self.launch(
                    "dn_restore",
                    &f,
                    (blocks(per, 256).min(64), layers as u32, 1),
                    256,
                    0,
                    &[
                        A::P(table),
                        A::I(i32_of(s_floats, "state floats")?),
                        A::I(i32_of(conv_floats, "conv state floats")?),
                        A::I(i32_of(row, "row")?),
                    ],
                )?;
            } else {
                let (conv_bytes, s_bytes) = (4 * conv_floats, 4 * s_floats);
                for l in &self.layers {
                    if let DevMixer::DeltaNet {
                        conv_state,
                        s,
                        conv_trace,
                        s_trace,
                        ..
                    } = &l.mixer
                    {
                        for (dst, src, len) in [
                            (*s, *s_trace + (row * s_bytes) as u64, s_bytes),
                            (
                                *conv_state,
                                *conv_trace + (row * conv_bytes) as u64,
                                conv_bytes,
                            ),
                        ] {
                            // SAFETY: `src` is row `row` < max_verify of a trace of `len`-byte
                            // states, `dst` a state of `len` bytes; ordered on the model's stream.
                            unsafe {
                                cu::memcpy_dtod_async(dst, src, len, self.stream.cu_stream())
                            }
                            .map_err(|e| CudaError::driver("restoring a DeltaNet state", e))?;
                        }
                    }
                }
            }
        }
        self.pos = start + rows;
        self.last_row = rows - 1;
        if let Some(m) = self.mtp.as_mut() {
            // Row `rows - 1` is the last trunk row now; the rows after it leave the queue.
            m.queue.keep(rows);
        }
        Ok(())
    }

    /// Whether the MTP block is loaded ([`CudaModelOptions::mtp`] and a file that has one).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Up to `k` greedy MTP drafts after `pending` (the token sampled from the last trunk row,
    /// not yet run): the queued slots and `(last row, pending)` run through the MTP block in
    /// one batched pass, then the block is chained on its own output (each draft's shared-head
    /// norm and token the next slot's inputs; the chained slots are dropped afterwards). The
    /// drafts are proposals only: the verify pass decides what is kept, so they need not match
    /// the CPU's bits. Needs a trunk call since the last draft.
    pub fn mtp_draft(&mut self, pending: u32, k: usize) -> Result<Vec<u32>, CudaError> {
        let mut m = self.mtp.take().ok_or_else(|| {
            CudaError::Invalid("the model was loaded without an MTP block".into())
        })?;
        let r = self.mtp_draft_with(&mut m, pending, k);
        self.mtp = Some(m);
        r
    }

    pub(super) fn mtp_draft_with(
        &mut self,
        m: &mut DevMtp,
        pending: u32,
        k: usize,
    ) -> Result<Vec<u32>, CudaError> {
        let n = self.mtp_begin(m, pending)?;
        let profiled = self.profile_draft == Some(self.mtp_drafts);
        self.mtp_drafts += 1;
        if k > 0
            && k <= MAX_GRAPH_DRAFTS
            && n <= SMALL_GRAPH_ROWS.min(self.opts.max_batch)
            && self.small_graphs
            && self.opts.graphs
            && !profiled
        {
            return self.mtp_draft_graph(m, k);
        }
        if profiled {
            self.profiler(true)?;
        }
        let d = self.mtp_flush(m, true)?;
        let mut drafts = Vec::with_capacity(k);
        if let Some(d) = d {
            drafts.push(d);
        }
        while !drafts.is_empty() && drafts.len() < k {
            let t = m.queue.slots() + drafts.len() - 1;
            let prev = drafts[drafts.len() - 1];
            self.mtp_step(m, (m.head_row, true), &[prev], t, true)?;
            drafts.push(self.read_out()?);
        }
        if profiled {
            self.profiler(false)?;
        }
        Ok(drafts)
    }

    /// [`Self::mtp_draft_with`] as one graph per (queued slots, drafts): the queued slots, the
    /// head, and each chained step after `argmax_chain` moved the last draft into the input
    /// on the device; one read of the drafts at the end.
    pub(super) fn mtp_draft_graph(
        &mut self,
        m: &mut DevMtp,
        k: usize,
    ) -> Result<Vec<u32>, CudaError> {
        let n = self.mtp_upload_draft(m, k)?;
        let probs = self.mtp_min_prob > 0.0;
        if !m.draft_graphs.contains_key(&(n, k, probs)) {
            if let Some(g) = self.capture(|s| s.mtp_enqueue_draft(m, n, k))? {
                m.draft_graphs.insert((n, k, probs), g);
            }
        }
        match m.draft_graphs.get(&(n, k, probs)) {
            Some(g) => g
                .launch()
                .map_err(|e| CudaError::driver("replaying an MTP draft graph", e))?,
            None => self.mtp_enqueue_draft(m, n, k)?,
        }
        if !probs {
            let [drafts] = self.read_ids([(m.drafts, k)], "reading the MTP drafts")?;
            m.queue.ran();
            return Ok(drafts);
        }
        // The probabilities come back as their bits (positive floats: read_ids' clamp of
        // negative values does not touch them).
        let [mut drafts, bits] = self.read_ids(
            [(m.drafts, k), (m.draft_probs, k)],
            "reading the MTP drafts and their probabilities",
        )?;
        m.queue.ran();
        // As the CPU's drafter: the chain stops after the first draft below the threshold.
        if let Some(i) = bits
            .iter()
            .position(|&b| f32::from_bits(b) < self.mtp_min_prob)
        {
            drafts.truncate(i + 1);
        }
        Ok(drafts)
    }

    /// Token ids read back: for each `(src, n)`, `n` i32 at `src` (copies on the model's stream,
    /// one synchronization for all; negative values as 0).
    pub(super) fn read_ids<const N: usize>(
        &self,
        srcs: [(u64, usize); N],
        what: &str,
    ) -> Result<[Vec<u32>; N], CudaError> {
        let mut bufs: [Vec<i32>; N] = std::array::from_fn(|i| vec![0i32; srcs[i].1]);
        for (buf, (src, _)) in bufs.iter_mut().zip(srcs) {
            // SAFETY: `src` holds at least `buf.len()` i32 (the callers' buffers); the copy is
            // complete after the synchronization below, before `buf` is read or dropped.
            unsafe { cu::memcpy_dtoh_async(buf, src, self.stream.cu_stream()) }
                .map_err(|e| CudaError::driver(what, e))?;
        }
        self.sync()?;
        Ok(bufs.map(|b| b.into_iter().map(|d| d.max(0) as u32).collect()))
    }

    /// A draft graph's input: the queued slots' position and tokens (room for `k` chained slots
    /// after them checked). Returns the queued slots.
    pub(super) fn mtp_upload_draft(&mut self, m: &DevMtp, k: usize) -> Result<usize, CudaError> {
        let (n, t0) = (m.queue.queued(), m.queue.slots());
        if t0 + n + k > self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "MTP slots {t0}..{} exceed the {} positions allocated (--ctx)",
                t0 + n + k,
                self.opts.max_context
            )));
        }
        let mut input = Vec::with_capacity(n + 1);
        input.push(i32_of(t0, "position")?);
        input.extend(m.queue.tokens().iter().map(|&t| t as i32));
        // SAFETY: `input` holds 1 + max_batch i32 (the callers checked n <= max_batch).
        unsafe { cu::memcpy_htod_async(self.sc.input, &input, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the MTP token ids", e))?;
        Ok(n)
    }

    /// A whole draft's launches: the `n` queued slots, the head, and each chained step after
    /// `argmax_chain` moved the last draft into the input; the `k` drafts land in `drafts`.
    pub(super) fn mtp_enqueue_draft(
        &mut self,
        m: &mut DevMtp,
        n: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        self.mtp_enqueue(m, (m.q, false), n)?;
        self.mtp_head(m, n, Some((0, n)))?;
        for j in 1..k {
            self.mtp_enqueue(m, (m.head_row, true), 1)?;
            self.mtp_head(m, 1, Some((j, 1)))?;
        }
        Ok(())
    }

    /// A draft's start: the waiting row's slot completed with `pending`; returns the queued
    /// slots.
    pub(super) fn mtp_begin(&mut self, m: &mut DevMtp, pending: u32) -> Result<usize, CudaError> {
        if pending as usize >= self.config.vocab {
            return Err(CudaError::Invalid(format!(
                "token id {pending} is outside the vocabulary (size {})",
                self.config.vocab
            )));
        }
        m.queue.complete(pending).map_err(CudaError::Invalid)?;
        self.bind()?;
        Ok(m.queue.queued())
    }

    /// The probability below which a graphed MTP draft stops (after that draft; 0: never), as
    /// the CPU drafter's `--spec-mtp-min-prob` (`REDLITE_CUDA_MTP_MIN_PROB` sets it at load).
    pub fn set_mtp_min_prob(&mut self, p: f32) {
        self.mtp_min_prob = p;
    }

    /// Run the queued slots through the MTP block (chunks of at most `max_batch`), keeping the
    /// last trunk row's hidden state (when queued) as the queue's first row. `head`: the last
    /// chunk goes on through the head, and its last slot's greedy draft is returned (`None` when
    /// nothing was queued).
    pub(super) fn mtp_flush(
        &mut self,
        m: &mut DevMtp,
        head: bool,
    ) -> Result<Option<u32>, CudaError> {
        let (n, h) = (m.queue.queued(), self.config.hidden);
        let mut c0 = 0;
        let mut draft = None;
        while c0 < n {
            let c1 = (c0 + self.opts.max_batch).min(n);
            let tokens = m.queue.tokens()[c0..c1].to_vec();
            let (hid, t) = (m.q + (4 * c0 * h) as u64, m.queue.slots() + c0);
            let with_head = head && c1 == n;
            self.mtp_step(m, (hid, false), &tokens, t, with_head)?;
            if with_head {
                draft = Some(self.read_out()?);
            }
            c0 = c1;
        }
        let (n, move_last) = m.queue.ran();
        if move_last {
            // SAFETY: rows `n` (> 0) and 0 of `q` (queue rows > n) do not overlap.
            unsafe {
                cu::memcpy_dtod_async(
                    m.q,
                    m.q + (4 * n * h) as u64,
                    4 * h,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| CudaError::driver("moving the last MTP row", e))?;
        }
        Ok(draft)
    }

    /// Before a trunk call of `n` tokens: room in the MTP queue for its rows (the queued slots
    /// run first when there is not).
    pub(super) fn mtp_make_room(&mut self, n: usize) -> Result<(), CudaError> {
        let Some(mut m) = self.mtp.take() else {
            return Ok(());
        };
        let r = if m.queue.needs_flush(n) {
            self.mtp_flush(&mut m, false).map(|_| ())
        } else {
            Ok(())
        };
        self.mtp = Some(m);
        r
    }

    /// After a trunk call of `tokens` (its rows' final hidden states in `x`): the last row's slot
    /// before the call gets its token (`tokens[0]`), each row but the last becomes a slot with
    /// the next token, the last row waits for its token. `verify`: remember where the rows start,
    /// for [`CudaModel::keep`].
    pub(super) fn mtp_record(&mut self, tokens: &[u32], verify: bool) -> Result<(), CudaError> {
        let Some(mut m) = self.mtp.take() else {
            return Ok(());
        };
        let (n, h) = (tokens.len(), self.config.hidden);
        let first = m.queue.record(tokens, verify);
        let r = self.rms_norm(
            self.sc.x,
            self.output_norm,
            m.q + (4 * first * h) as u64,
            n,
            h,
        );
        self.mtp = Some(m);
        r
    }

    /// The MTP block over `tokens.len()` slots from position `t0`: slot i takes hidden row i at
    /// `hid.0` (`hid.1`: a last step's output, its shared-head norm first) and `tokens[i]`; its
    /// output (before the shared-head norm) lands in `x`. `head`: then
    /// the last slot's draft into `out` ([`Self::mtp_head`]). Eager launches: the drafts that fit
    /// a graph take [`Self::mtp_draft_graph`]; this path serves the first draft after a long
    /// prompt and the queue's flushes.
    pub(super) fn mtp_step(
        &mut self,
        m: &mut DevMtp,
        hid: (u64, bool),
        tokens: &[u32],
        t0: usize,
        head: bool,
    ) -> Result<(), CudaError> {
        let n = tokens.len();
        if t0 + n > self.opts.max_context {
            return Err(CudaError::Invalid(format!(
                "MTP slots {t0}..{} exceed the {} positions allocated (--ctx)",
                t0 + n,
                self.opts.max_context
            )));
        }
        let mut input = Vec::with_capacity(n + 1);
        input.push(i32_of(t0, "position")?);
        input.extend(tokens.iter().map(|&t| t as i32));
        // SAFETY: `input` holds 1 + max_batch i32 (n <= max_batch: the callers' chunks).
        unsafe { cu::memcpy_htod_async(self.sc.input, &input, self.stream.cu_stream()) }
            .map_err(|e| CudaError::driver("uploading the MTP token ids", e))?;
        self.mtp_enqueue(m, hid, n)?;
        if head {
            self.mtp_head(m, n, None)?;
        }
        Ok(())
    }

    /// The draft of the last of `n` slots in `x` (that row kept as `head_row`, the next chained
    /// slot's input): the lm_head with the shared-head norm folded in, the greedy token into
    /// `out`. `link = Some((j, adv))` (a draft graph): also drafts[j] = the token and the next
    /// chained step's input (the position `adv` on, the token), by `argmax_chain`.
    pub(super) fn mtp_head(
        &mut self,
        m: &mut DevMtp,
        n: usize,
        link: Option<(usize, usize)>,
    ) -> Result<(), CudaError> {
        let h = self.config.hidden;
        self.stage = "mtp";
        let last = self.sc.x + (4 * (n - 1) * h) as u64;
        m.head_row = last;
        let (norm, out) = (m.shared_head_norm, self.output.clone());
        self.with_split((self.head_lane_iters, 1), |s| {
            s.matvec_normed(last, Some(norm), &[(&out, s.sc.logits)], 1)
        })?;
        let probs = if self.mtp_min_prob > 0.0 {
            m.draft_probs
        } else {
            0
        };
        let chain = link.map(|(j, adv)| {
            [
                A::P(self.sc.input),
                A::P(m.drafts),
                A::I(j as i32),
                A::I(adv as i32),
                A::P(probs),
            ]
        });
        self.argmax_launch(self.sc.logits, 1, chain)
    }

    /// [`Self::mtp_step`]'s launches (the ids and position already uploaded).
    pub(super) fn mtp_enqueue(
        &mut self,
        m: &mut DevMtp,
        (hid, pre): (u64, bool),
        n: usize,
    ) -> Result<(), CudaError> {
        let h = self.config.hidden;
        self.stage = "mtp";
        let (x, cat) = (self.sc.x, m.cat);
        // The embedding and both input norms in one launch.
        let f = self.embed_cat2_f.clone();
        self.launch(
            "embed_cat2",
            &f,
            (n as u32, 2, 1),
            256,
            0,
            &[
                A::P(self.embed),
                A::P(self.sc.input + 4),
                A::P(hid),
                A::P(m.enorm),
                A::P(m.hnorm),
                A::P(if pre { m.shared_head_norm } else { 0 }),
                A::P(cat),
                A::I(h as i32),
                A::F(self.config.rms_eps),
            ],
        )?;
        let rows = if n > 1 && n <= self.opts.max_verify {
            Rows::Steps
        } else {
            Rows::Prompt
        };
        self.gemm_now = self.gemm && rows == Rows::Prompt && n >= GEMM_MIN_TOKENS;
        std::mem::swap(&mut self.experts, &mut m.experts);
        let r = (|| {
            let eh = m.eh_proj.clone();
            self.matvec(&eh, cat, x, n)?;
            let l = &m.layer;
            self.stage = "attn";
            self.enqueue_attention(&l.mixer, (l.attn_norm, l.post_norm), n, rows)?;
            self.stage = "moe";
            self.enqueue_moe(&l.moe, n)
        })();
        std::mem::swap(&mut self.experts, &mut m.experts);
        self.gemm_now = false;
        r
    }
}
