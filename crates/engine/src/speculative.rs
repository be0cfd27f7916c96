//! Speculative decoding: cheap drafts of the next few tokens, verified by the model in one
//! batched forward pass, with output identical to plain decoding.
//!
//! # Draft sources
//!
//! * **Prompt lookup** ([`lookup_draft`]): the last `n` tokens of the context (prompt and
//!   everything generated so far) are searched for an earlier occurrence, longest `n` first
//!   (`ngram_max` down to `ngram_min`), most recent occurrence first; the tokens that followed
//!   it are the draft. Rewriting a file the model has just read makes these drafts long and
//!   mostly right. [`LookupDrafter`] remembers where its last draft was copied from: while the
//!   model keeps agreeing with that source, the next draft continues it without a new search.
//!   The draft length adapts to recent acceptance: a fully accepted draft doubles the rows of
//!   the next one (up to `max_draft`), a rejection shrinks it to one more than was accepted.
//! * **MTP** (the model's `nextn` block, [`MtpDrafter`]): slot `t` takes the trunk's final hidden
//!   state `h_t` and token `x_(t+1)` and predicts `x_(t+2)`. Chained drafting follows vLLM's
//!   MTP proposer: draft `d1` comes from `(h_t, x_(t+1))`; draft `d(j+1)` from the MTP block's
//!   own output hidden state of the previous slot (after its shared-head norm) and `dj`, at the
//!   next slot. Chained slots are speculative: their KV entries are dropped after drafting, and
//!   once the verify pass has produced the trunk's real hidden states the accepted slots are
//!   recomputed from those (one batched MTP pass, no lm_head). The MTP cache therefore always
//!   holds exactly what a non-speculative MTP run would. The prompt's slots are run right after
//!   the prompt pass (counted in the prompt time).
//!   `both` uses prompt lookup when it finds a match and MTP otherwise.
//!   [`MtpGate`] keeps MTP drafting to where it pays: it times one-token passes and MTP passes
//!   (per token they emit) as they happen and leaves the drafts out while plain steps are
//!   cheaper per token, trying the other kind now and then (a machine where a verify row costs
//!   nearly as much as a step, such as a small model on a CPU, gains nothing from MTP).
//!
//! # Verification and exactness
//!
//! The pending token and its `K` drafts go through one `Mode::Step` forward of `K + 1` rows.
//! Each row's logits are bit-identical to a one-token step (a guarantee of the model and its
//! backends), and [`redlite_model::SequenceState::keep`] rolls the DeltaNet states back to the
//! last accepted row from a per-row recording and truncates the KV caches, without recomputing.
//!
//! # Acceptance rule
//!
//! Both draft sources propose tokens deterministically (prompt lookup copies tokens, MTP drafts
//! are the argmax of the MTP logits): the draft distribution `q` is a point mass on the drafted
//! token `d`. The standard speculative-sampling rule (accept `d` with probability
//! `min(1, p(d)/q(d)) = p(d)`; on rejection draw from `norm(max(0, p − q))`, which is `p`
//! without `d`) is then exactly: *draw `y` from the target distribution `p` with the ordinary
//! sampler, accept the draft if `y == d`, else emit `y` and stop*. That is what
//! [`generate_speculative`] does, row after row, with the same sampler, the same history and the
//! same RNG draws as [`crate::generate`] — so the output distribution is unchanged, and for a
//! given seed the tokens are the same as without speculation (greedy or not).

use std::time::{Duration, Instant};

use redlite_model::{Backend, Mode, Model, ModelError, MtpState, SequenceState};

use crate::generate::{GenerateOptions, GenerationStats};
use crate::sampler::{argmax, Sampler};

/// Which draft source(s) to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecMode {
    /// No drafts: one token per forward pass.
    #[default]
    Off,
    /// Prompt lookup only.
    Lookup,
    /// The model's MTP head only.
    Mtp,
    /// Prompt lookup when it finds a match, MTP otherwise.
    Both,
}

/// A speculation mode name that [`SpecMode::parse`] does not know (a setting or request field,
/// not a model problem).
#[derive(Debug, thiserror::Error)]
#[error("unknown speculation mode '{0}' (expected off, lookup, mtp or both)")]
pub struct UnknownSpecMode(pub String);

impl SpecMode {
    pub const NAMES: &'static [&'static str] = &["off", "lookup", "mtp", "both"];

    pub fn parse(name: &str) -> Result<SpecMode, UnknownSpecMode> {
        match name {
            "off" => Ok(SpecMode::Off),
            "lookup" => Ok(SpecMode::Lookup),
            "mtp" => Ok(SpecMode::Mtp),
            "both" => Ok(SpecMode::Both),
            other => Err(UnknownSpecMode(other.to_string())),
        }
    }

    pub fn uses_lookup(self) -> bool {
        matches!(self, SpecMode::Lookup | SpecMode::Both)
    }

    pub fn uses_mtp(self) -> bool {
        matches!(self, SpecMode::Mtp | SpecMode::Both)
    }
}

/// Speculative decoding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    pub mode: SpecMode,
    /// Longest n-gram prompt lookup tries to match.
    pub ngram_max: usize,
    /// Shortest n-gram prompt lookup accepts as a match (at least 1).
    pub ngram_min: usize,
    /// Most tokens one prompt-lookup draft may hold.
    pub max_draft: usize,
    /// Adapt the prompt-lookup draft length to recent acceptance (otherwise always `max_draft`).
    pub adaptive: bool,
    /// Prompt lookup follows its source across passes ([`LookupDrafter`]); otherwise every
    /// draft is a fresh n-gram search.
    pub lookup_follow: bool,
    /// Most MTP drafts per step (chained through the MTP block's own hidden state); `None`:
    /// the drafter's own default ([`MTP_DRAFT`] for this engine's drafter, the CUDA model's loop
    /// its own).
    pub mtp_draft: Option<usize>,
    /// MTP chaining stops after a draft whose MTP probability is below this (0: always
    /// `mtp_draft` drafts): a draft that is probably wrong makes the ones after it useless.
    pub mtp_min_prob: f32,
    /// MTP drafts score only part of the vocabulary (see [`DraftVocab`]): the `mtp_vocab` lowest
    /// token ids plus every token of the context; `None`: [`default_mtp_vocab`]; `Some(0)`: the
    /// whole vocabulary. Only which drafts are proposed depends on it; the verify pass scores
    /// every token.
    pub mtp_vocab: Option<usize>,
    /// MTP drafts only while they pay ([`MtpGate`]); otherwise whenever lookup has no draft.
    pub mtp_gate: bool,
    /// The MTP block's attention while drafting covers the last `mtp_window` to
    /// `2 mtp_window` slots only (0: every slot), so a draft step costs the same at any context
    /// length. Only which drafts
    /// are proposed depends on it. (The engine's drafter: the CUDA model's own MTP loop attends
    /// over every slot.)
    pub mtp_window: usize,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            mode: SpecMode::Off,
            ngram_max: 8,
            ngram_min: 2,
            // 127: +5 % on the demo file rewrite against 63 (2.16 / 2.14× vs 2.03 / 2.06× plain,
            // docs/perf-ledger.md); the GPU's verify passes take at most MAX_VERIFY_ROWS (64)
            // rows and clamp the drafts to that.
            max_draft: 127,
            adaptive: true,
            lookup_follow: true,
            mtp_draft: None,
            mtp_min_prob: 0.5,
            mtp_vocab: None,
            mtp_gate: true,
            // The demo's file rewrite on the CPU (`spec-bench rewrite -t 2 --rounds 5`,
            // docs/speculative.md, session 59), 4 drafts: MTP 1.44–1.61× with 256, 1.26–1.33×
            // attending over every slot (a draft step's attention then costs the context).
            mtp_window: 256,
        }
    }
}

/// Chained MTP drafts a pass of this engine's drafter (the CPU backends) when none is given.
/// The demo's file rewrite on the CPU with the drafts' sliding window (`spec-bench rewrite -t 2
/// --rounds 5`, docs/speculative.md, session 59): 4 drafts 1.38–1.61× (median of sixteen runs
/// 1.50×, 3.45 tokens a pass), 3 drafts 1.40–1.47× (2.8–3.0 tokens a pass). The CUDA model's
/// loop keeps 3 (its chain has no probability cut: 4 lost there in session 21).
pub const MTP_DRAFT: usize = 4;

impl SpecConfig {
    /// Most chained MTP drafts a pass of this engine's drafter.
    pub fn mtp_drafts(&self) -> usize {
        self.mtp_draft.unwrap_or(MTP_DRAFT)
    }
}

/// The draft vocabulary's lowest ids when none is given: an eighth of the vocabulary, at least
/// 2,048 (the demo model's file rewrite: 2,048 of 10,240 ids accept as many drafts as the whole
/// head, 1,024 fewer: 83 % against 96 %).
pub fn default_mtp_vocab(vocab: usize) -> usize {
    (vocab / 8).max(2048)
}

impl SpecConfig {
    /// The defaults with `mode`.
    pub fn with_mode(mode: SpecMode) -> SpecConfig {
        SpecConfig {
            mode,
            ..SpecConfig::default()
        }
    }
}

/// Counters of one draft source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftCounters {
    /// Verify passes that carried at least one draft of this source.
    pub steps: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
}

impl DraftCounters {
    /// Accepted over drafted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / (self.drafted.max(1)) as f64
    }

    /// Mean accepted drafts per verify pass that carried drafts.
    pub fn mean_accepted(&self) -> f64 {
        self.accepted as f64 / (self.steps.max(1)) as f64
    }

    /// One verify pass's `drafted` drafts of this source, `accepted` of them kept.
    pub fn add(&mut self, drafted: usize, accepted: usize) {
        if drafted > 0 {
            self.steps += 1;
            self.drafted += drafted;
            self.accepted += accepted;
        }
    }
}

/// What speculation did during one [`generate_speculative`] call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    pub mode: SpecMode,
    /// Decode forward passes of the trunk (verify passes, including those without drafts).
    pub forward_passes: usize,
    /// Rows those passes computed in total.
    pub rows: usize,
    pub lookup: DraftCounters,
    pub mtp: DraftCounters,
    /// Passes without MTP drafts because [`MtpGate`] found plain steps cheaper per token.
    pub mtp_gated: usize,
    /// Time spent drafting (lookup search and MTP passes, including the MTP cache catch-up).
    pub draft_time: Duration,
}

impl SpecStats {
    /// Both sources together.
    pub fn total(&self) -> DraftCounters {
        DraftCounters {
            steps: self.lookup.steps + self.mtp.steps,
            drafted: self.lookup.drafted + self.mtp.drafted,
            accepted: self.lookup.accepted + self.mtp.accepted,
        }
    }

    /// Tokens emitted per decode forward pass: accepted drafts plus the one token every pass
    /// samples itself (1.0 without speculation).
    pub fn tokens_per_pass(&self) -> f64 {
        (self.forward_passes + self.total().accepted) as f64 / (self.forward_passes.max(1)) as f64
    }

    /// One line for logs: `spec lookup: 12 passes, 40/52 drafts accepted (76.9%), ...`.
    pub fn summary(&self) -> String {
        let t = self.total();
        format!(
            "spec {:?}: {} passes ({} rows), drafts accepted {}/{} ({:.1}%), mean accepted length {:.2}, {:.2} tokens/pass [lookup {}/{}, mtp {}/{}, mtp left out {} passes], drafting {:.1} ms",
            self.mode,
            self.forward_passes,
            self.rows,
            t.accepted,
            t.drafted,
            100.0 * t.acceptance_rate(),
            t.mean_accepted(),
            self.tokens_per_pass(),
            self.lookup.accepted,
            self.lookup.drafted,
            self.mtp.accepted,
            self.mtp.drafted,
            self.mtp_gated,
            self.draft_time.as_secs_f64() * 1e3,
        )
    }
}

/// Prompt lookup: find an earlier occurrence of the last `n` tokens of `context` (`n` from
/// `ngram_max` down to `ngram_min`, longest first) and return the `max_len` tokens that followed
/// it. Empty when nothing matches.
///
/// Among the occurrences of the longest matching `n`-gram, the most recent one followed by at
/// least `max_len` tokens of context wins. Failing that, the most recent occurrence is used and
/// its continuation, on reaching the end of the context, goes on into the draft itself (token `j`
/// of the draft is token `start + j` of `context ++ draft`): a match at distance `d` from the end
/// predicts that the last `d` tokens repeat, so a repeated line or a token loop still gets a
/// full-length draft.
pub fn lookup_draft(
    context: &[u32],
    ngram_max: usize,
    ngram_min: usize,
    max_len: usize,
) -> Vec<u32> {
    match lookup_match(context, ngram_max, ngram_min, max_len) {
        Some(start) => copy_draft(context, start, max_len),
        None => Vec::new(),
    }
}

/// The search of [`lookup_draft`]: the position in `context` of the token after the chosen
/// earlier occurrence of the context's last `n` tokens (`None`: no match, or `max_len` 0).
fn lookup_match(
    context: &[u32],
    ngram_max: usize,
    ngram_min: usize,
    max_len: usize,
) -> Option<usize> {
    let len = context.len();
    if max_len == 0 {
        return None;
    }
    for n in (ngram_min.max(1)..=ngram_max).rev() {
        if n >= len {
            continue;
        }
        let suffix = &context[len - n..];
        // Candidate starts `s < len - n` (the suffix itself excluded), most recent first.
        let mut matches = (0..len - n).rev().filter(|&s| context[s..s + n] == *suffix);
        let Some(recent) = matches.next() else {
            continue;
        };
        let chosen = std::iter::once(recent)
            .chain(matches)
            .find(|&s| s + n + max_len <= len)
            .unwrap_or(recent);
        return Some(chosen + n);
    }
    None
}

/// `len` tokens copied from `context` at `start < context.len()`: token `j` is token `start + j`
/// of `context ++ draft` (a copy that reaches the end of the context repeats its last
/// `context.len() - start` tokens).
fn copy_draft(context: &[u32], start: usize, len: usize) -> Vec<u32> {
    let end = context.len();
    let mut draft = Vec::with_capacity(len);
    for j in 0..len {
        let i = start + j;
        draft.push(if i < end { context[i] } else { draft[i - end] });
    }
    draft
}

/// Prompt lookup with a memory: where in the context the last draft was copied from, so that the
/// next draft continues the same copy instead of searching again.
///
/// After a verify pass that accepted `a` of the drafts copied from `start`, the token the model
/// emitted itself (the new `pending`) is compared with the source's token `start + a`:
/// * equal (the usual case after a fully accepted draft): the next draft continues at
///   `start + a + 1`, no search — the copy stays aligned with its source even where the last few
///   tokens also occur elsewhere;
/// * different (the model departed from the source): a fresh n-gram search; when it finds
///   nothing and the source had been followed for at least `ngram_max` accepted tokens (a copy
///   in progress, not a chance match), the continuation is still tried as a one-token
///   substitution (`start + a + 1`: the model replaced one token and goes on with the source) —
///   once: a guess rejected at its first token forgets the source.
///
/// The draft length is [`DraftLength`]'s (adapted to acceptance).
pub struct LookupDrafter {
    ngram_max: usize,
    ngram_min: usize,
    /// Follow the source across passes (otherwise every draft is a fresh [`lookup_draft`]).
    follow: bool,
    len: DraftLength,
    /// Start of the last draft's copy in the context.
    start: Option<usize>,
    /// Context position the source predicts for the token after the accepted drafts.
    next: Option<usize>,
    /// The last draft was the substitution guess.
    guessed: bool,
    /// Tokens accepted from the current source since it was found.
    run: usize,
}

impl LookupDrafter {
    pub fn new(cfg: &SpecConfig) -> LookupDrafter {
        LookupDrafter {
            ngram_max: cfg.ngram_max,
            ngram_min: cfg.ngram_min,
            follow: cfg.lookup_follow,
            len: DraftLength::new(cfg),
            start: None,
            next: None,
            guessed: false,
            run: 0,
        }
    }

    /// Up to `room` drafts after `context` (which ends with the pending token); empty when no
    /// source is found.
    pub fn draft(&mut self, context: &[u32], room: usize) -> Vec<u32> {
        let k = self.len.current().min(room);
        self.start = None;
        if k == 0 {
            return Vec::new();
        }
        let (search, fallback) = match (self.follow, self.next.take(), context.split_last()) {
            (true, Some(at), Some((&pending, _))) if at + 1 < context.len() => {
                if context[at] == pending {
                    (false, Some(at + 1))
                } else if self.run >= self.ngram_max {
                    (true, Some(at + 1))
                } else {
                    (true, None)
                }
            }
            _ => (true, None),
        };
        let found = if search {
            lookup_match(context, self.ngram_max, self.ngram_min, k)
        } else {
            None
        };
        self.guessed = search && found.is_none() && fallback.is_some();
        if found.is_some() {
            self.run = 0;
        }
        let start = found.or(fallback);
        self.start = start;
        start.map_or_else(Vec::new, |s| copy_draft(context, s, k))
    }

    /// After the verify pass of the last draft (`drafted` tokens, `accepted` of them kept).
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        self.len.update(drafted, accepted);
        let guess_failed = self.guessed && accepted == 0;
        self.next = match self.start.take() {
            Some(s) if drafted > 0 && !guess_failed => Some(s + accepted),
            _ => None,
        };
        self.run = if self.next.is_some() {
            self.run + accepted
        } else {
            0
        };
    }

    /// The last pass did not use a lookup draft: forget the source.
    pub fn forget(&mut self) {
        self.start = None;
        self.next = None;
        self.guessed = false;
        self.run = 0;
    }
}

/// The MTP head as a draft source, with its KV cache and the slots whose inputs are known but not
/// yet run (they are run lazily, batched, when the next MTP draft is needed).
pub struct MtpDrafter {
    state: MtpState,
    /// Slots `state.slots()..`: (trunk hidden state at position t, token t+1).
    queue: Vec<(Vec<f32>, u32)>,
    /// Slots the drafts attend over (0: all; [`SpecConfig::mtp_window`]).
    window: usize,
    /// The draft head's part of the vocabulary (`None`: the whole lm_head).
    vocab: Option<DraftVocab>,
    /// The last catch-up run over queued slots ([`MtpDrafter::flush`]): its time and slots.
    last_flush: Option<(Duration, usize)>,
}

/// The part of the vocabulary MTP drafts are chosen from, and the lm_head's rows for it.
///
/// A drafted token is only a proposal: the verify pass scores the whole vocabulary, so the
/// output never depends on this set, only the acceptance does. The lm_head is a large share of a
/// draft's cost (the demo model: 4.2 MB of its 5.7 MB a draft; the 80B: 255 MB against the MTP
/// block's ≈ 30 MB), and the tokens a draft gets right are mostly common ones or ones already in
/// the context (FR-Spec and EAGLE-3 draft over a frequency-ranked part of the vocabulary for the
/// same reason). The set is the `base` lowest ids (byte-level BPE numbers its merges by
/// frequency, so low ids are the common tokens) plus every token seen in the context. Tokens
/// first seen go into a small second head, rebuilt as they come (a few rows); once it holds
/// [`DraftVocab::MERGE_AT`] rows it is merged into the main one.
struct DraftVocab {
    /// Token ids of the main head's rows, then of the recent head's, in row order.
    main_ids: Vec<u32>,
    recent_ids: Vec<u32>,
    /// `seen[id]`: `id` is in one of the heads (or about to be).
    seen: Vec<bool>,
    /// History tokens already scanned.
    scanned: usize,
    /// The backend's linear layers (`B::Linear`) of the two heads' lm_head rows; `None`: to be
    /// (re)built.
    main: Option<Box<dyn std::any::Any + Send + Sync>>,
    recent: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl DraftVocab {
    /// Rows of the recent head at which it is merged into the main head (a merge copies the
    /// main head's rows once: about a draft's worth of lm_head bytes).
    const MERGE_AT: usize = 64;

    fn new(base: usize, vocab: usize) -> DraftVocab {
        let base = base.min(vocab);
        let mut seen = vec![false; vocab];
        seen[..base].fill(true);
        DraftVocab {
            main_ids: (0..base as u32).collect(),
            recent_ids: Vec::new(),
            seen,
            scanned: 0,
            main: None,
            recent: None,
        }
    }

    /// Add the context tokens `history[scanned..]`.
    fn scan(&mut self, history: &[u32]) {
        if history.len() < self.scanned {
            self.scanned = 0; // a different sequence: the set only ever grows
        }
        for &t in &history[self.scanned..] {
            if let Some(s) = self.seen.get_mut(t as usize) {
                if !*s {
                    *s = true;
                    self.recent_ids.push(t);
                    self.recent = None;
                }
            }
        }
        self.scanned = history.len();
        if self.recent_ids.len() >= Self::MERGE_AT {
            self.main_ids.append(&mut self.recent_ids);
            self.main = None;
        }
    }

    /// The draft logits of `hidden` (entry `i` belongs to [`DraftVocab::id`]`(i)`).
    fn logits<B: Backend>(
        &mut self,
        model: &Model<B>,
        hidden: &[f32],
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(self.main_ids.len() + self.recent_ids.len());
        for (ids, head) in [
            (&self.main_ids, &mut self.main),
            (&self.recent_ids, &mut self.recent),
        ] {
            if ids.is_empty() {
                continue;
            }
            if head.is_none() {
                *head = Some(Box::new(model.head_rows(ids)?));
            }
            let w = head
                .as_ref()
                .and_then(|h| h.downcast_ref::<B::Linear>())
                .ok_or_else(|| ModelError::State("draft head of another backend".into()))?;
            let mut y = vec![0.0; ids.len()];
            model.backend.linear(w, hidden, 1, &mut y);
            out.extend_from_slice(&y);
        }
        Ok(out)
    }

    /// The token id of draft logit `i`.
    fn id(&self, i: usize) -> u32 {
        match self.main_ids.get(i) {
            Some(&t) => t,
            None => self.recent_ids[i - self.main_ids.len()],
        }
    }
}

impl MtpDrafter {
    /// A drafter whose draft head scores the `vocab` lowest token ids plus the context's tokens
    /// (`None`: [`default_mtp_vocab`]; 0, or at least the vocabulary: the whole lm_head), and
    /// whose drafts attend over the last `window` to `2 window` slots only (0: all of them): the
    /// cache keeps those rows (positions stay absolute), so a draft step's attention costs the
    /// window, not the context. Only which drafts are proposed depends on either.
    pub fn new<B: Backend>(
        model: &Model<B>,
        vocab: Option<usize>,
        window: usize,
    ) -> Result<MtpDrafter, ModelError> {
        if !model.has_mtp() {
            return Err(ModelError::NoMtp);
        }
        let full = model.config.vocab;
        let vocab = vocab.unwrap_or_else(|| default_mtp_vocab(full));
        Ok(MtpDrafter {
            state: model.new_mtp_state(),
            queue: Vec::new(),
            window,
            vocab: (vocab > 0 && vocab < full).then(|| DraftVocab::new(vocab, full)),
            last_flush: None,
        })
    }

    /// Slots known so far (run or queued).
    pub fn slots(&self) -> usize {
        self.state.slots() + self.queue.len()
    }

    /// Record slot `slots()`: the trunk's hidden state at that position and the token after it.
    pub fn push(&mut self, hidden: Vec<f32>, next_token: u32) {
        self.queue.push((hidden, next_token));
    }

    /// Run the queued slots (one batched MTP pass); returns the MTP output hidden state of the
    /// last one.
    fn flush<B: Backend>(&mut self, model: &Model<B>) -> Result<Option<Vec<f32>>, ModelError> {
        if self.queue.is_empty() {
            return Ok(None);
        }
        let started = Instant::now();
        let (hidden, tokens): (Vec<Vec<f32>>, Vec<u32>) =
            std::mem::take(&mut self.queue).into_iter().unzip();
        let t0 = self.state.slots();
        let out = model.mtp_catch_up(&mut self.state, &hidden, &tokens, t0)?;
        // With a window: drop the rows before it once they make up as many again (one move of
        // the window's rows per `window` slots), so the drafts attend over `window` to
        // `2 window` slots.
        if self.window > 0 && self.state.kv.len() >= 2 * self.window {
            self.state.keep_last(self.window);
        }
        self.last_flush = Some((started.elapsed(), tokens.len()));
        Ok(out)
    }

    /// Up to `k` chained drafts after the last pushed slot (which must be the newest position:
    /// the trunk's last hidden state and the token just sampled). `history` is the context (it
    /// widens the draft vocabulary). The chained slots are removed from the cache afterwards.
    pub fn draft<B: Backend>(
        &mut self,
        model: &Model<B>,
        history: &[u32],
        k: usize,
        min_prob: f32,
    ) -> Result<Vec<u32>, ModelError> {
        let mut drafts = Vec::with_capacity(k);
        let Some(mut hidden) = self.flush(model)? else {
            return Ok(drafts);
        };
        if let Some(v) = self.vocab.as_mut() {
            v.scan(history);
        }
        let keep = self.state.slots();
        while drafts.len() < k {
            // Logits of the draft vocabulary or of every token.
            let logits = match self.vocab.as_mut() {
                Some(v) => v.logits(model, &hidden)?,
                None => model
                    .lm_head(std::slice::from_ref(&hidden))
                    .pop()
                    .unwrap_or_default(),
            };
            let Some(top) = argmax(&logits) else { break };
            let d = self.vocab.as_ref().map_or(top, |v| v.id(top as usize));
            drafts.push(d);
            if drafts.len() == k || (min_prob > 0.0 && top_prob(&logits, top) < min_prob) {
                break;
            }
            let t = self.state.slots();
            hidden = model
                .mtp_hidden(&mut self.state, &[hidden], &[d], t)?
                .pop()
                .ok_or_else(|| ModelError::State("MTP pass returned no row".into()))?;
        }
        self.state.truncate(keep);
        Ok(drafts)
    }
}

/// Softmax probability of token `top`, the argmax of `logits`. The exponentials through the
/// vector `exp` (`f32::exp` bit for bit: the same sum as a scalar loop, ≈ 10 µs less a draft
/// over the demo's 2,144 draft logits, session 59).
fn top_prob(logits: &[f32], top: u32) -> f32 {
    let max = logits[top as usize];
    let mut e: Vec<f32> = logits.iter().map(|&l| l - max).collect();
    redlite_cpu::vexp::exp_in_place(&mut e);
    1.0 / e.iter().sum::<f32>()
}

/// Adaptive prompt-lookup draft length (`adaptive`, else always `max_draft`): it starts at 3
/// drafts, a fully accepted draft doubles the verify pass's rows (`K + 1` → `2(K + 1)`: 4, 8, 16,
/// 32, 64, 128 rows, up to `max_draft` drafts), a rejection after `a` accepted drafts sets it to
/// `a + 1`. Passes of a power-of-two number of rows fill the CPU's multi-row kernels (16 rows per
/// weight pass for Q8_0): a 33-row pass costs about as much more than a 32-row one as a whole
/// extra pass's weight reads.
pub struct DraftLength {
    current: usize,
    max: usize,
    adaptive: bool,
}

impl DraftLength {
    pub fn new(cfg: &SpecConfig) -> DraftLength {
        let max = cfg.max_draft;
        DraftLength {
            current: if cfg.adaptive { max.min(3) } else { max },
            max,
            adaptive: cfg.adaptive,
        }
    }

    /// Tokens to draft next.
    pub fn current(&self) -> usize {
        self.current
    }

    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if !self.adaptive || drafted == 0 {
            return;
        }
        self.current = if accepted == drafted {
            (2 * (self.current + 1) - 1).min(self.max)
        } else {
            (accepted + 1).min(self.max)
        };
    }
}

/// Whether MTP drafts pay on this machine and model, from the passes as they happen: a pass
/// without drafts against an MTP pass per token it emits. An MTP pass costs its chained drafts,
/// its verify rows and the MTP block's catch-up over the tokens it keeps (timed per slot, since
/// after a stretch without MTP the catch-up covers the whole stretch at once). MTP drafts while
/// its cost per token is at most a plain pass's; otherwise the passes go without drafts. A pass
/// of the other kind now and then keeps both figures current, and the two figures age
/// differently: what an MTP pass emits depends on the text (a stretch the model finds
/// predictable, then one it does not), what a plain pass costs hardly does. So while MTP is off,
/// an MTP pass runs every [`MtpGate::PROBE`] passes and the MTP figures restart from it (judged
/// by what MTP does on the text at hand, not by the stretch that turned it off); while MTP is
/// on, a plain pass runs every `PROBE` passes at first and then at twice the interval each
/// time, up to [`MtpGate::PROBE_MAX`].
/// Which passes draft changes only the speed: the output is that of plain decoding either way.
#[derive(Debug, Default)]
pub struct MtpGate {
    /// Smoothed seconds of a pass without drafts.
    plain: Option<f64>,
    /// Smoothed seconds of an MTP pass (without its catch-up) and tokens it emitted.
    mtp: Option<(f64, f64)>,
    /// Smoothed seconds of the MTP block's catch-up per slot.
    catch_up: Option<f64>,
    /// Passes without drafts timed so far.
    plain_passes: usize,
    /// MTP passes so far.
    mtp_passes: usize,
    /// Catch-ups timed so far.
    catch_ups: usize,
    /// Passes since the kind not chosen last ran.
    since_other: usize,
    /// The MTP figures' values so far in their current run (they restart at a probe while MTP is
    /// off).
    mtp_run: usize,
    /// The next MTP pass is a probe while MTP is off: the MTP figures restart from it.
    restart_mtp: bool,
    /// Passes between plain probes while MTP is on (0: not yet set, `PROBE`).
    plain_probe: usize,
}

impl MtpGate {
    /// MTP passes before the first pass without drafts (to time one): the tokens an MTP pass
    /// emits vary from 1 to the draft length + 1 from pass to pass, and the first passes of a
    /// reply often accept little, so the first estimate wants a few of them.
    const WARM: usize = 16;
    /// Passes between runs of the kind the figures do not favour (MTP probes; the first plain
    /// probes).
    const PROBE: usize = 16;
    /// The longest interval between plain probes while MTP stays on.
    const PROBE_MAX: usize = 256;
    /// The smoothed figures average their first `WINDOW` values, then weigh a new one by
    /// 1 / `WINDOW` (session 43: with a weight of 1/4 after four MTP passes, the noise of the
    /// tokens a pass emits turned MTP off for stretches of 32 passes where it paid).
    const WINDOW: usize = 16;

    /// `old` updated with the `n`-th value `new` of its series.
    fn smooth(old: Option<f64>, new: f64, n: usize) -> Option<f64> {
        let w = 1.0 / n.clamp(1, Self::WINDOW) as f64;
        Some(old.map_or(new, |o| o + w * (new - o)))
    }

    /// Whether the next pass should carry MTP drafts.
    pub fn wants_mtp(&mut self) -> bool {
        if self.mtp_passes < Self::WARM {
            return true;
        }
        let (Some(plain), Some((mtp, tokens))) = (self.plain, self.mtp) else {
            // A pass without drafts to time (MTP has been timed by now).
            return false;
        };
        let per_token = (mtp + self.catch_up.unwrap_or(0.0) * tokens) / tokens.max(1.0);
        let favoured = per_token <= plain;
        if !favoured {
            self.plain_probe = Self::PROBE;
        }
        let interval = if favoured {
            self.plain_probe.max(Self::PROBE)
        } else {
            Self::PROBE
        };
        self.since_other += 1;
        if self.since_other >= interval {
            self.since_other = 0;
            if favoured {
                // A plain probe; the next one waits twice as long.
                self.plain_probe = (2 * interval).min(Self::PROBE_MAX);
            } else {
                self.restart_mtp = true;
            }
            return !favoured;
        }
        favoured
    }

    /// A pass without drafts took `secs`.
    pub fn record_plain(&mut self, secs: f64) {
        self.plain_passes += 1;
        self.plain = Self::smooth(self.plain, secs, self.plain_passes);
    }

    /// An MTP pass took `secs` (without its catch-up) and emitted `tokens`.
    pub fn record_mtp(&mut self, secs: f64, tokens: usize) {
        self.mtp_passes += 1;
        if std::mem::take(&mut self.restart_mtp) {
            self.mtp_run = 0;
        }
        self.mtp_run += 1;
        let n = self.mtp_run;
        let s = Self::smooth(self.mtp.map(|m| m.0), secs, n);
        let t = Self::smooth(self.mtp.map(|m| m.1), tokens as f64, n);
        self.mtp = s.zip(t);
    }

    /// The MTP block caught up on `slots` slots in `secs`.
    pub fn record_catch_up(&mut self, secs: f64, slots: usize) {
        if slots > 0 {
            self.catch_ups += 1;
            self.catch_up = Self::smooth(self.catch_up, secs / slots as f64, self.catch_ups);
        }
    }
}

/// Which source produced the current draft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Lookup,
    Mtp,
}

/// One verify pass: the rows fed (`pending` and its drafts) and what the trunk computed for them.
pub struct Verify {
    /// `[pending, d_1, .., d_K]`.
    pub tokens: Vec<u32>,
    /// Logits of every row: row `i` is what the token after `tokens[..=i]` is sampled from.
    pub logits: Vec<Vec<f32>>,
    /// Final hidden states of every row (the MTP slots of accepted tokens are built from them).
    hidden: Vec<Vec<f32>>,
    source: Source,
    /// Seconds the pass took (drafting included) and, of those, the MTP catch-up's seconds and
    /// slots ([`MtpGate`]).
    secs: f64,
    catch_up: Option<(f64, usize)>,
}

impl Verify {
    /// The draft tokens `d_1 .. d_K` (empty: a plain one-token step).
    pub fn drafts(&self) -> &[u32] {
        &self.tokens[1..]
    }
}

/// The draft sources of one sequence and their statistics: the part of speculative decoding
/// that a decode loop drives step by step (this module's [`generate_speculative`], the server's
/// worker). Per step: [`Speculator::verify`] drafts after `pending` and runs the verify pass;
/// the caller samples the rows in order (accepting while the sampled token equals the draft),
/// then [`Speculator::commit`] rolls the state back to the tokens it keeps.
pub struct Speculator {
    cfg: SpecConfig,
    mtp: Option<MtpDrafter>,
    /// Whether MTP drafts pay (`None`: always draft, `mtp_gate` off or no MTP).
    gate: Option<MtpGate>,
    lookup: LookupDrafter,
    stats: SpecStats,
}

impl Speculator {
    /// Draft sources for `cfg` on `model`. `SpecMode::Mtp` on a model without an MTP block is an
    /// error; `SpecMode::Both` then uses prompt lookup alone.
    pub fn new<B: Backend>(model: &Model<B>, cfg: &SpecConfig) -> Result<Speculator, ModelError> {
        let use_mtp = cfg.mode.uses_mtp()
            && cfg.mtp_drafts() > 0
            && (cfg.mode == SpecMode::Mtp || model.has_mtp());
        Ok(Speculator {
            cfg: cfg.clone(),
            mtp: if use_mtp {
                Some(MtpDrafter::new(model, cfg.mtp_vocab, cfg.mtp_window)?)
            } else {
                None
            },
            gate: (use_mtp && cfg.mtp_gate).then(MtpGate::default),
            lookup: LookupDrafter::new(cfg),
            stats: SpecStats {
                mode: cfg.mode,
                ..SpecStats::default()
            },
        })
    }

    /// Whether MTP drafts are on (the MTP cache then wants the prompt's hidden states).
    pub fn uses_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// The statistics so far.
    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    /// Feed the MTP cache the prompt rows whose successors are known: `hidden[i]` is the trunk's
    /// final hidden state of a prompt token and `next[i]` the token after it, for consecutive
    /// positions (the first slot of an empty cache, or right after the slots fed before). Run
    /// at once (one batched MTP pass). Nothing happens without MTP.
    pub fn feed_prompt<B: Backend>(
        &mut self,
        model: &Model<B>,
        hidden: Vec<Vec<f32>>,
        next: &[u32],
    ) -> Result<(), ModelError> {
        if let Some(m) = self.mtp.as_mut() {
            for (h, &t) in hidden.into_iter().zip(next) {
                m.push(h, t);
            }
            m.flush(model)?;
        }
        Ok(())
    }

    /// Draft after `pending` (the token sampled last, emitted, not yet fed; `history` ends with
    /// it, `last_hidden` is the trunk's hidden state of the token before it), at most
    /// `budget - 1` drafts, then run `pending` and the drafts through the trunk in one
    /// `Mode::Step` pass (recorded for [`Speculator::commit`] when there are drafts).
    pub fn verify<B: Backend>(
        &mut self,
        model: &Model<B>,
        state: &mut SequenceState,
        history: &[u32],
        pending: u32,
        last_hidden: &[f32],
        budget: usize,
    ) -> Result<Verify, ModelError> {
        // Drafting, the layers and the lm_head as one pass on the backend's threads (the CPU
        // pool stays warm between them instead of being handed each region from outside).
        model
            .backend
            .run_pass(|| self.draft_and_verify(model, state, history, pending, last_hidden, budget))
    }

    /// The body of [`Speculator::verify`].
    fn draft_and_verify<B: Backend>(
        &mut self,
        model: &Model<B>,
        state: &mut SequenceState,
        history: &[u32],
        pending: u32,
        last_hidden: &[f32],
        budget: usize,
    ) -> Result<Verify, ModelError> {
        let td = Instant::now();
        if let Some(m) = self.mtp.as_mut() {
            m.last_flush = None;
        }
        let (drafts, source) = self.draft(model, history, pending, last_hidden, budget)?;
        self.stats.draft_time += td.elapsed();
        let catch_up = self
            .mtp
            .as_ref()
            .and_then(|m| m.last_flush)
            .map(|(t, n)| (t.as_secs_f64(), n));

        let mut tokens = Vec::with_capacity(drafts.len() + 1);
        tokens.push(pending);
        tokens.extend_from_slice(&drafts);
        if !drafts.is_empty() {
            state.begin_trace();
        }
        let hidden = model.forward_hidden(state, &tokens, Mode::Step)?;
        let logits = model.lm_head(&hidden);
        self.stats.forward_passes += 1;
        self.stats.rows += tokens.len();
        Ok(Verify {
            tokens,
            logits,
            hidden,
            source,
            secs: td.elapsed().as_secs_f64(),
            catch_up,
        })
    }

    /// Up to `budget - 1` drafts after `pending`: prompt lookup first (when on), else MTP.
    fn draft<B: Backend>(
        &mut self,
        model: &Model<B>,
        history: &[u32],
        pending: u32,
        last_hidden: &[f32],
        budget: usize,
    ) -> Result<(Vec<u32>, Source), ModelError> {
        let room = budget.saturating_sub(1);
        if let Some(m) = self.mtp.as_mut() {
            m.push(last_hidden.to_vec(), pending);
        }
        if self.cfg.mode.uses_lookup() {
            let d = self.lookup.draft(history, room);
            if !d.is_empty() {
                return Ok((d, Source::Lookup));
            }
        }
        if let Some(m) = self.mtp.as_mut() {
            let k = self.cfg.mtp_drafts().min(room);
            if k > 0 {
                if self.gate.as_mut().is_none_or(MtpGate::wants_mtp) {
                    let d = m.draft(model, history, k, self.cfg.mtp_min_prob)?;
                    return Ok((d, Source::Mtp));
                }
                self.stats.mtp_gated += 1;
            }
        }
        Ok((Vec::new(), Source::Lookup))
    }

    /// After the caller sampled the rows of `v`: `accepted` drafts matched, and the first `fed`
    /// rows' tokens (`pending` and accepted drafts; at least 1) are now part of the sequence.
    /// Rolls `state` back to them, updates the draft length, the MTP queue and the statistics;
    /// returns the trunk's hidden state of the last kept row (the next step's `last_hidden`).
    pub fn commit<B: Backend>(
        &mut self,
        model: &Model<B>,
        state: &mut SequenceState,
        v: Verify,
        accepted: usize,
        fed: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let drafted = v.drafts().len();
        let fed = fed.clamp(1, v.tokens.len());
        if let Some(g) = self.gate.as_mut() {
            if let Some((secs, slots)) = v.catch_up {
                g.record_catch_up(secs, slots);
            }
            if drafted == 0 {
                g.record_plain(v.secs - v.catch_up.map_or(0.0, |c| c.0));
            } else if v.source == Source::Mtp {
                g.record_mtp(v.secs - v.catch_up.map_or(0.0, |c| c.0), accepted + 1);
            }
        }
        match v.source {
            Source::Lookup => {
                self.stats.lookup.add(drafted, accepted);
                self.lookup.update(drafted, accepted);
            }
            Source::Mtp => {
                self.stats.mtp.add(drafted, accepted);
                self.lookup.forget();
            }
        }
        if drafted > 0 {
            model.keep(state, fed)?;
        }
        let mut hidden = v.hidden;
        if let Some(m) = self.mtp.as_mut() {
            // Slots of the newly fed tokens after `pending`: (h at that row, the token after it).
            for (h, &t) in hidden.iter().zip(&v.tokens[1..fed]) {
                m.push(h.clone(), t);
            }
        }
        hidden.truncate(fed);
        Ok(hidden.pop().expect("at least one row"))
    }
}

/// Like [`crate::generate`], with speculative decoding per `spec`: the same tokens for the same
/// sampler settings and seed, usually in fewer forward passes. `state` must be empty when MTP
/// drafting is on (the MTP cache is built from the prompt's hidden states). `SpecMode::Mtp` on a
/// model without an MTP block is an error; `SpecMode::Both` then uses prompt lookup alone.
pub fn generate_speculative<B: Backend>(
    model: &Model<B>,
    state: &mut SequenceState,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions,
    spec: &SpecConfig,
    on_token: impl FnMut(u32) -> bool + Send,
) -> Result<(Vec<u32>, GenerationStats, SpecStats), ModelError> {
    generate_speculative_observed(model, state, prompt, sampler, opts, spec, on_token, |_| {})
}

/// [`generate_speculative`], also showing `on_logits` the logits each generated token (and the
/// final stop token, if any) was sampled from, in order — for tests that compare them bit for
/// bit with plain decoding.
#[allow(clippy::too_many_arguments)]
pub fn generate_speculative_observed<B: Backend>(
    model: &Model<B>,
    state: &mut SequenceState,
    prompt: &[u32],
    sampler: &mut Sampler,
    opts: &GenerateOptions,
    spec: &SpecConfig,
    mut on_token: impl FnMut(u32) -> bool + Send,
    mut on_logits: impl FnMut(&[f32]) + Send,
) -> Result<(Vec<u32>, GenerationStats, SpecStats), ModelError> {
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut out = Vec::new();
    let mut spec_state = Speculator::new(model, spec)?;
    if prompt.is_empty() || opts.max_tokens == 0 {
        return Ok((out, stats, spec_state.stats));
    }
    if spec_state.uses_mtp() && state.pos != 0 {
        return Err(ModelError::State(format!(
            "MTP drafting needs an empty sequence (it holds {} tokens)",
            state.pos
        )));
    }
    let mut history: Vec<u32> = prompt.to_vec();

    // Prompt: with MTP every row's hidden state feeds the MTP cache (run now, as part of the
    // prompt's cost: one batched catch-up); only the last row needs logits.
    let t0 = Instant::now();
    let mut last_hidden = if spec_state.uses_mtp() {
        let mut hidden = model.forward_hidden(state, prompt, Mode::Prefill)?;
        let last = hidden.pop().expect("non-empty prompt");
        spec_state.feed_prompt(model, hidden, &prompt[1..])?;
        last
    } else {
        model
            .forward_last(state, prompt, Mode::Prefill)?
            .expect("non-empty prompt")
    };
    let logits = model
        .lm_head(std::slice::from_ref(&last_hidden))
        .pop()
        .expect("one row");
    stats.prompt_time = t0.elapsed();

    let t1 = Instant::now();
    // `pending`: the token sampled last, emitted but not yet fed to the trunk.
    let mut pending = sampler.sample(&logits, &history);
    on_logits(&logits);
    let mut done = false;
    if opts.stop_ids.contains(&pending) {
        stats.stopped_on_eos = true;
        done = true;
    } else {
        out.push(pending);
        history.push(pending);
        done |= !on_token(pending) || out.len() >= opts.max_tokens;
    }

    // The whole loop in one pass on the backend's threads, as plain decoding runs it
    // ([`crate::generate`]): one hand-off per generation instead of one per verify pass.
    model.backend.run_pass(|| -> Result<(), ModelError> {
        while !done {
            let budget = opts.max_tokens - out.len();
            let v = spec_state.verify(model, state, &history, pending, &last_hidden, budget)?;

            // Accept drafts while the sampler agrees; the first disagreement is the next token.
            let mut accepted = 0;
            let mut next = None;
            for (i, row) in v.logits.iter().enumerate() {
                let y = sampler.sample(row, &history);
                on_logits(row);
                if opts.stop_ids.contains(&y) {
                    stats.stopped_on_eos = true;
                    done = true;
                    break;
                }
                out.push(y);
                history.push(y);
                if !on_token(y) || out.len() >= opts.max_tokens {
                    done = true;
                }
                if v.drafts().get(i) == Some(&y) {
                    accepted += 1;
                    if done {
                        break;
                    }
                } else {
                    next = Some(y);
                    break;
                }
            }

            // Keep the rows whose input tokens are now part of the sequence: `pending` and the
            // accepted drafts (when the budget ran out on an accepted draft, that draft was emitted
            // but, as in plain decoding, not fed).
            let fed = if next.is_some() || stats.stopped_on_eos {
                accepted + 1
            } else {
                accepted
            };
            last_hidden = spec_state.commit(model, state, v, accepted, fed)?;
            if let Some(y) = next {
                pending = y;
            }
        }
        Ok(())
    })?;
    stats.generated_tokens = out.len();
    stats.decode_time = t1.elapsed();
    Ok((out, stats, spec_state.stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_prefers_longest_most_recent_match() {
        // ... 1 2 3 9 ... 1 2 3 7 8 ... 2 3 → the 2-gram [2 3] last occurred before 7 8.
        let ctx = [1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 4, 2, 3];
        assert_eq!(lookup_draft(&ctx, 3, 1, 4), vec![7, 8, 4, 2]);
        // A longer draft than the recent match's continuation: the older match has room.
        assert_eq!(lookup_draft(&ctx, 3, 1, 7), vec![9, 5, 1, 2, 3, 7, 8]);
        // No occurrence has room: the most recent one's continuation repeats its period.
        assert_eq!(lookup_draft(&ctx, 3, 1, 12).len(), 12);
        assert_eq!(lookup_draft(&ctx[5..], 3, 1, 7), vec![7, 8, 4, 2, 3, 7, 8]);
        // 1-grams only: the most recent earlier 3.
        assert_eq!(lookup_draft(&ctx, 1, 1, 2), vec![7, 8]);
        assert_eq!(lookup_draft(&ctx, 3, 1, 0), Vec::<u32>::new());
        assert_eq!(lookup_draft(&[5, 6, 7], 3, 2, 4), Vec::<u32>::new());
        assert_eq!(lookup_draft(&[], 3, 1, 4), Vec::<u32>::new());
        // A token loop: the draft keeps repeating it.
        assert_eq!(lookup_draft(&[1, 1, 1], 2, 1, 4), vec![1, 1, 1, 1]);
        assert_eq!(lookup_draft(&[5, 1, 2, 1, 2], 2, 2, 5), vec![1, 2, 1, 2, 1]);
    }

    #[test]
    fn lookup_drafter_follows_its_source() {
        let cfg = SpecConfig {
            ngram_max: 2,
            ngram_min: 2,
            max_draft: 4,
            adaptive: false,
            ..SpecConfig::default()
        };
        let mut d = LookupDrafter::new(&cfg);
        // A source 1..9, a decoy `6 7 0 0 0 0`, and a copy of the source begun: `1 2`.
        let mut ctx = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 6, 7, 0, 0, 0, 0, 1, 2];
        assert_eq!(d.draft(&ctx, 32), vec![3, 4, 5, 6]);
        // All accepted, and the model's own token 7 is the source's next: continue at 8 where a
        // fresh search of `6 7` would pick the decoy.
        d.update(4, 4);
        ctx.extend([3, 4, 5, 6, 7]);
        assert_eq!(lookup_draft(&ctx, 2, 2, 4), vec![0, 0, 0, 0]);
        assert_eq!(d.draft(&ctx, 32), vec![8, 9, 6, 7]);
        // One accepted, then the model writes 5 for 9: no n-gram match, so after a copy of 5
        // tokens the continuation is tried as a substitution (skip the 9).
        d.update(4, 1);
        ctx.extend([8, 5]);
        assert_eq!(lookup_draft(&ctx, 2, 2, 4), Vec::<u32>::new());
        assert_eq!(d.draft(&ctx, 32), vec![6, 7, 0, 0]);
        // The guess rejected at once: the source is forgotten.
        d.update(4, 0);
        ctx.push(11);
        assert_eq!(d.draft(&ctx, 32), Vec::<u32>::new());
        // The budget caps the draft; without `lookup_follow` every draft is `lookup_draft`.
        let mut plain = LookupDrafter::new(&SpecConfig {
            lookup_follow: false,
            ..cfg
        });
        let ctx = [
            1, 2, 3, 4, 5, 6, 7, 8, 9, 6, 7, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7,
        ];
        assert_eq!(plain.draft(&ctx, 3), vec![0, 0, 0]);
        plain.update(3, 3);
        assert_eq!(plain.draft(&ctx, 32), lookup_draft(&ctx, 2, 2, 4));
    }

    #[test]
    fn draft_length_adapts() {
        let mut d = DraftLength::new(&SpecConfig::default());
        assert_eq!(d.current, 3);
        d.update(3, 3);
        assert_eq!(d.current, 7);
        d.update(7, 7);
        d.update(15, 15);
        assert_eq!(d.current, 31);
        d.update(31, 31);
        assert_eq!(d.current, 63);
        d.update(63, 63);
        assert_eq!(d.current, 127);
        d.update(127, 127);
        assert_eq!(d.current, 127);
        d.update(127, 2);
        assert_eq!(d.current, 3);
        d.update(0, 0);
        assert_eq!(d.current, 3);
        let fixed = DraftLength::new(&SpecConfig {
            adaptive: false,
            max_draft: 10,
            ..SpecConfig::default()
        });
        assert_eq!(fixed.current(), 10);
    }

    /// The gate drafts through its warm-up, then times a plain pass, then follows the cheaper
    /// kind per token: while plain passes win, an MTP probe every `PROBE` passes, whose timing
    /// restarts the MTP figures; while MTP wins, plain probes at doubling intervals.
    #[test]
    fn mtp_gate_follows_the_cheaper_kind() {
        let mut g = MtpGate::default();
        for _ in 0..MtpGate::WARM {
            assert!(g.wants_mtp());
            // 3 ms a pass for 2 tokens (catch-up 0.1 ms a slot): 1.6 ms a token.
            g.record_catch_up(0.0002, 2);
            g.record_mtp(0.003, 2);
        }
        assert!(!g.wants_mtp(), "a plain pass is timed first");
        g.record_plain(0.001);
        // Plain 1 ms a token beats MTP's 1.6: plain passes, with an MTP probe every PROBE.
        let runs: Vec<bool> = (0..2 * MtpGate::PROBE).map(|_| g.wants_mtp()).collect();
        assert_eq!(runs.iter().filter(|&&m| m).count(), 2, "{runs:?}");
        assert!(runs[MtpGate::PROBE - 1] && runs[2 * MtpGate::PROBE - 1]);
        // The probe finds the text predictable (5 tokens for 2 ms, 0.5 ms a token): the MTP
        // figures restart from it, so MTP is on from the next pass.
        g.record_mtp(0.002, 5);
        assert!(g.wants_mtp());
        // While it stays cheap, plain probes come after 16, 32, 64, … passes, up to PROBE_MAX.
        let mut plain_at = Vec::new();
        for pass in 1..2000 {
            if g.wants_mtp() {
                g.record_mtp(0.002, 5);
            } else {
                g.record_plain(0.001);
                plain_at.push(pass);
            }
        }
        let gaps: Vec<usize> = plain_at.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(plain_at[0], MtpGate::PROBE - 1, "{plain_at:?}");
        assert_eq!(&gaps[..4], [32, 64, 128, 256], "{plain_at:?}");
        assert!(
            gaps[4..].iter().all(|&d| d == MtpGate::PROBE_MAX),
            "{plain_at:?}"
        );
        // Without a probe from the off state the MTP figures are smoothed: one bad pass does
        // not turn MTP off, a stretch of them does, and MTP probes come every PROBE passes.
        g.record_mtp(0.003, 1);
        assert!(g.wants_mtp());
        for _ in 0..MtpGate::WINDOW {
            g.record_mtp(0.003, 1);
        }
        let runs: Vec<bool> = (0..2 * MtpGate::PROBE).map(|_| g.wants_mtp()).collect();
        assert_eq!(runs.iter().filter(|&&m| m).count(), 2, "{runs:?}");
    }

    #[test]
    fn top_prob_is_the_softmax_of_the_argmax() {
        let p = top_prob(&[0.0, 3.0f32.ln(), f32::NEG_INFINITY], 1);
        assert!((p - 0.75).abs() < 1e-6, "{p}");
        // The scalar definition bit for bit, on logits of a draft head's size.
        let logits: Vec<f32> = (0..2144)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.013 - 6.0)
            .collect();
        let top = argmax(&logits).unwrap();
        let max = logits[top as usize];
        let scalar = 1.0 / logits.iter().map(|&l| (l - max).exp()).sum::<f32>();
        assert_eq!(top_prob(&logits, top).to_bits(), scalar.to_bits());
    }

    #[test]
    fn mode_names_parse() {
        for name in SpecMode::NAMES {
            SpecMode::parse(name).unwrap();
        }
        assert!(SpecMode::parse("sometimes").is_err());
    }
}
