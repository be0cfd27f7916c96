//! The model worker: one thread that owns the model and the prefix cache and runs one request at
//! a time, taking jobs from a queue and sending events back to the HTTP handler.
//!
//! A request goes through:
//! 1. **match**: the longest common prefix with a cached conversation (see [`crate::cache`]);
//! 2. **prefill** from the last aligned checkpoint at or before that prefix, in pieces split at
//!    multiples of [`CHUNK`], keeping checkpoints on the way;
//! 3. **decode** one token at a time (`Mode::Step`), streaming text with stop strings held back;
//!    with speculative decoding (`--spec`, or the request's `spec` field) each step drafts a few
//!    tokens (prompt lookup, MTP) and verifies them in one pass ([`redlite_engine::speculative`]):
//!    every token is still sampled from logits bit-identical to a one-token step, with the same
//!    sampler calls, so the reply is the same as without;
//! 4. **re-prefill**: the state is rewound to the last checkpoint of the prompt and the prompt's
//!    tail plus the reply are run again in prefill mode, so that the next turn resumes from
//!    checkpoints that are bit-identical to what a fresh server computes for the same tokens.
//!
//! A job whose event receiver is gone (the client disconnected) is cancelled at the next
//! prefill piece or decode step.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use redlite_engine::sampler::{log_softmax, Sampler, SamplerConfig};
use redlite_engine::speculative::{SpecConfig, SpecMode, SpecStats, Speculator};
use redlite_model::delta_rule::CHUNK;
use redlite_model::{Backend, Mode, Model, ModelError, SequenceState, Snapshot};
use redlite_tokenizer::stream::StreamDecoder;
use redlite_tokenizer::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::cache::{align_down, Entry, PrefixCache};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::persist::{snapshots_of, Identity, StateStore};

/// The prompt of a job.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Text, tokenized with special tokens parsed (after the cached prefix).
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

/// One generation request.
pub struct Job {
    pub prompt: Prompt,
    /// Upper bound on generated tokens (`None`: until the context is full).
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    /// Stop strings: generation ends before the first occurrence, which is not returned.
    pub stop: Vec<String>,
    /// Report log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Also report the token ids and a hash of each step's logits (debugging, tests).
    pub debug: bool,
    /// Keep generating past stop tokens.
    pub ignore_eos: bool,
    /// Speculative decoding mode for this job (`None`: the server's default).
    pub spec: Option<SpecMode>,
    pub events: UnboundedSender<Event>,
}

/// The log-probability of a generated token and its strongest alternatives.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context size.
    Length,
    /// The client went away.
    Cancelled,
}

impl Finish {
    pub fn as_openai(self) -> &'static str {
        match self {
            Finish::Stop | Finish::Cancelled => "stop",
            Finish::Length => "length",
        }
    }
}

/// Token counts and timings of a finished job.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens resumed from the cache (not computed).
    pub cached_tokens: usize,
    /// Generated tokens (a stop token is not counted).
    pub completion_tokens: usize,
    /// The stop string that ended generation, if one did.
    pub stop_string: Option<String>,
    pub prompt_time: Duration,
    pub decode_time: Duration,
    /// What speculative decoding did (`None` when it was off).
    pub spec: Option<SpecStats>,
}

/// Debug details of a job (with [`Job::debug`]).
#[derive(Debug, Clone, Default)]
pub struct DebugInfo {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// FNV-1a hash of the bits of each decode step's logits.
    pub logits_hashes: Vec<u64>,
}

/// What the worker tells the handler, in this order: `Started`, any number of `Delta`, `Done`
/// (or a single `Error`).
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// New text (possibly empty: held back for a stop string or an incomplete character) and,
    /// when asked for, the log-probability of the token that produced it.
    Delta {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
        usage: Usage,
        debug: Option<DebugInfo>,
    },
    Error(ApiError),
}

/// Worker settings.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Context size in tokens (prompt plus reply).
    pub ctx: usize,
    /// Tokens per prefill forward call at most (a multiple of [`CHUNK`]).
    pub prefill_batch: usize,
    /// Keep a checkpoint every this many positions (a multiple of [`CHUNK`]), besides the last
    /// aligned position of every turn.
    pub checkpoint_interval: usize,
    pub cache_entries: usize,
    pub cache_bytes: usize,
    /// Replies to emit instead of sampling, in order (tests); each ends with a stop token.
    pub replay: Vec<String>,
    /// Persist cached conversations here (and load them at start).
    pub state_dir: Option<std::path::PathBuf>,
    /// Speculative decoding settings (the mode is the default of jobs that do not choose one).
    pub spec: SpecConfig,
}

/// With MTP drafting, the MTP cache of a request is built from the hidden states of at most
/// this many of the prompt's last computed positions (a prefix resumed from the cache has none:
/// its slots are missing, which only makes the drafts less informed, never the output different).
const MTP_PROMPT_WINDOW: usize = 2048;

/// The handle the HTTP side holds: a queue into the worker thread.
#[derive(Clone)]
pub struct WorkerHandle {
    tx: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
}

impl WorkerHandle {
    /// Queue a job. Fails only if the worker thread is gone.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        self.queued.fetch_add(1, Ordering::SeqCst);
        self.tx.send(job).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            ApiError::internal("the model worker has stopped")
        })
    }

    /// Jobs waiting or running.
    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }
}

/// Start the worker thread.
pub fn spawn<B: Backend + 'static>(
    model: Model<B>,
    tokenizer: Arc<Tokenizer>,
    opts: WorkerOptions,
    metrics: Arc<Metrics>,
) -> std::io::Result<WorkerHandle> {
    let store = match &opts.state_dir {
        Some(dir) => Some(StateStore::new(
            dir,
            Identity::of(&model),
            opts.cache_entries.max(1),
        )?),
        None => None,
    };
    let (tx, rx) = mpsc::channel::<Job>();
    let queued = Arc::new(AtomicUsize::new(0));
    let q = queued.clone();
    std::thread::Builder::new()
        .name("redlite-worker".into())
        .spawn(move || {
            let mut w = Worker::new(model, tokenizer, opts, metrics, store);
            while let Ok(job) = rx.recv() {
                let events = job.events.clone();
                let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| w.run(job)));
                if outcome.is_err() {
                    // The state may be half-updated: forget every cached conversation.
                    w.cache.clear();
                    let _ = events.send(Event::Error(ApiError::internal(
                        "internal error while generating (see the server log)",
                    )));
                }
                q.fetch_sub(1, Ordering::SeqCst);
            }
        })?;
    Ok(WorkerHandle { tx, queued })
}

struct Worker<B: Backend> {
    model: Model<B>,
    tokenizer: Arc<Tokenizer>,
    opts: WorkerOptions,
    cache: PrefixCache,
    metrics: Arc<Metrics>,
    replay_next: usize,
    store: Option<StateStore>,
}

/// Raised inside the worker to abandon a job.
enum Abort {
    Cancelled,
    Api(ApiError),
}

impl From<ModelError> for Abort {
    fn from(e: ModelError) -> Abort {
        Abort::Api(ApiError::internal(format!("model error: {e}")))
    }
}

impl<B: Backend> Worker<B> {
    fn new(
        model: Model<B>,
        tokenizer: Arc<Tokenizer>,
        mut opts: WorkerOptions,
        metrics: Arc<Metrics>,
        store: Option<StateStore>,
    ) -> Worker<B> {
        opts.prefill_batch = align_down(opts.prefill_batch).max(CHUNK);
        opts.checkpoint_interval = align_down(opts.checkpoint_interval).max(CHUNK);
        let cfg = &model.config;
        let mut cache = PrefixCache::new(
            opts.cache_entries.max(1),
            opts.cache_bytes,
            cfg.kv_values_per_position() * 4,
            cfg.recurrent_state_values() * 4,
        );
        if let Some(store) = &store {
            for (ids, state, file) in store.load_all(&model.new_state()) {
                let snaps = snapshots_of(&state);
                let mut entry = Entry::new(&tokenizer, ids, state, snaps);
                entry.file = Some(file);
                cache.insert(entry);
            }
            metrics.cache_bytes.store(cache.bytes(), Ordering::Relaxed);
        }
        Worker {
            model,
            tokenizer,
            opts,
            cache,
            metrics,
            replay_next: 0,
            store,
        }
    }

    fn run(&mut self, job: Job) {
        if job.events.is_closed() {
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match self.generate(&job) {
            Ok(()) => {}
            Err(Abort::Cancelled) => {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Err(Abort::Api(e)) => {
                let _ = job.events.send(Event::Error(e));
            }
        }
    }

    /// Tokenize the prompt, resuming the longest cached prefix. Returns the ids, the cache entry
    /// to resume (if any) and how many leading ids it shares.
    fn tokenize(&mut self, prompt: &Prompt) -> Result<(Vec<u32>, Option<Entry>, usize), Abort> {
        let tok = &self.tokenizer;
        match prompt {
            Prompt::Text(text) => {
                let text = match (tok.add_bos_token(), tok.bos_token_id()) {
                    (true, Some(bos)) => {
                        let mut t =
                            String::from_utf8_lossy(tok.piece(bos).unwrap_or(&[])).into_owned();
                        t.push_str(text);
                        t
                    }
                    _ => text.clone(),
                };
                let encode = |s: &str| {
                    tok.encode(s, true).map_err(|e| {
                        Abort::Api(ApiError::bad_request(format!("cannot tokenize: {e}")))
                    })
                };
                match self.cache.best_text_match(&text) {
                    Some((i, k)) => {
                        let entry = self.cache.entry(i);
                        let mut ids = entry.ids[..k].to_vec();
                        let off = if k == 0 { 0 } else { entry.ends[k - 1] };
                        ids.extend(encode(&text[off..])?);
                        let shared = self.cache.entry(i).id_match(&ids);
                        Ok((ids, Some(self.cache.take(i)), shared))
                    }
                    None => Ok((encode(&text)?, None, 0)),
                }
            }
            Prompt::Ids(ids) => {
                let vocab = self.model.config.vocab.min(tok.vocab_size());
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(Abort::Api(ApiError::bad_request(format!(
                        "token id {bad} is outside the vocabulary (size {vocab})"
                    ))));
                }
                match self.cache.best_id_match(ids) {
                    Some((i, k)) => Ok((ids.clone(), Some(self.cache.take(i)), k)),
                    None => Ok((ids.clone(), None, 0)),
                }
            }
        }
    }

    fn generate(&mut self, job: &Job) -> Result<(), Abort> {
        let t0 = Instant::now();
        let (prompt, entry, shared) = self.tokenize(&job.prompt)?;
        let n = prompt.len();
        if n == 0 {
            if let Some(e) = entry {
                self.cache.insert(e);
            }
            return Err(Abort::Api(ApiError::bad_request("the prompt is empty")));
        }
        if n >= self.opts.ctx {
            if let Some(e) = entry {
                self.cache.insert(e);
            }
            return Err(Abort::Api(ApiError::context_exceeded(n, self.opts.ctx)));
        }

        // Resume from the last checkpoint at or before the shared prefix; at least the last
        // prompt token is always computed (its logits start the reply).
        let (mut state, mut snaps, start, file) = match entry {
            Some(e) => {
                let c = e.checkpoint_at_or_before(shared.min(n - 1));
                if c == 0 {
                    self.cache.insert(e);
                    (self.model.new_state(), BTreeMap::new(), 0, None)
                } else {
                    let Entry {
                        mut state,
                        mut snaps,
                        file,
                        ..
                    } = e;
                    let snap = snaps.get(&c).expect("checkpoint exists");
                    state.restore(snap)?;
                    snaps.retain(|&p, _| p <= c);
                    (state, snaps, c, file)
                }
            }
            None => (self.model.new_state(), BTreeMap::new(), 0, None),
        };

        let turn_end = align_down(n);
        let interval = self.opts.checkpoint_interval;
        let keep = |p: usize| p == turn_end || p.is_multiple_of(interval);
        let cancel = || job.events.is_closed();
        let mut spec = match self.speculator(job) {
            Ok(s) => s,
            Err(e) => {
                self.save(prompt, n, state, snaps, false, file);
                return Err(e);
            }
        };
        // The prompt rows' hidden states for the MTP cache, from `mtp_from` on.
        let mut rows = spec.as_ref().filter(|s| s.uses_mtp()).map(|_| Vec::new());
        let mtp_from = n.saturating_sub(MTP_PROMPT_WINDOW).max(start);
        let prefilled = self.prefill(
            &mut state,
            &mut snaps,
            &prompt,
            n,
            keep,
            &cancel,
            rows.as_mut().map(|r| (r, mtp_from)),
        );
        let hidden = match prefilled {
            Ok(h) => h,
            Err(e) => {
                self.save(prompt, n, state, snaps, false, file);
                return Err(e);
            }
        };
        let prompt_time = t0.elapsed();
        self.metrics.add_prompt(n - start, start, prompt_time);
        let _ = job.events.send(Event::Started {
            prompt_tokens: n,
            cached_tokens: start,
        });

        let logits = self
            .model
            .lm_head(std::slice::from_ref(&hidden))
            .pop()
            .unwrap_or_default();
        let t1 = Instant::now();
        if let (Some(s), Some(mut rows)) = (spec.as_mut(), rows) {
            // Slots of the computed prompt rows but the last (whose successor is not sampled yet).
            rows.pop();
            let first = n - 1 - rows.len();
            s.feed_prompt(&self.model, rows, &prompt[first + 1..n])?;
        }
        let out = self.decode(job, &mut state, &prompt, logits, hidden, spec.as_mut());
        let decode_time = t1.elapsed();
        let (generated, finish, debug, stop_string) = out?;
        let spec_stats = spec.map(|s| s.stats().clone());
        if let Some(s) = &spec_stats {
            self.metrics.add_spec(
                s,
                completion_tokens_of(&generated, &self.tokenizer),
                decode_time,
            );
        }
        let completion_tokens = completion_tokens_of(&generated, &self.tokenizer);
        self.metrics.add_decode(completion_tokens, decode_time);
        let mut debug = debug;
        if let Some(d) = debug.as_mut() {
            d.prompt_ids = prompt.clone();
        }
        let usage = Usage {
            prompt_tokens: n,
            cached_tokens: start,
            completion_tokens,
            stop_string,
            prompt_time,
            decode_time,
            spec: spec_stats,
        };
        let _ = job.events.send(Event::Done {
            finish,
            usage,
            debug,
        });
        let extend = finish != Finish::Cancelled;
        if !extend {
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        let mut ids = prompt;
        ids.extend_from_slice(&generated);
        self.save(ids, n, state, snaps, extend, file);
        Ok(())
    }

    /// Run `ids[state.pos..end]` in prefill mode, in pieces split at the multiples of [`CHUNK`]
    /// where `keep` wants a checkpoint (taken there) and at most `prefill_batch` long. Returns the
    /// final hidden state of the last token. With `rows = Some((out, from))`, the hidden states
    /// of the positions `from..end` are appended to `out` (for the MTP cache).
    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &self,
        state: &mut SequenceState,
        snaps: &mut BTreeMap<usize, Snapshot>,
        ids: &[u32],
        end: usize,
        keep: impl Fn(usize) -> bool,
        cancel: &dyn Fn() -> bool,
        mut rows: Option<(&mut Vec<Vec<f32>>, usize)>,
    ) -> Result<Vec<f32>, Abort> {
        let mut last = Vec::new();
        while state.pos < end {
            let pos = state.pos;
            let mut b = align_down(pos) + CHUNK;
            while b < end && !keep(b) && b - pos < self.opts.prefill_batch {
                b += CHUNK;
            }
            let stop = b.min(end);
            if let Some((out, from)) = rows.as_mut() {
                let mut hidden =
                    self.model
                        .forward_hidden(state, &ids[pos..stop], Mode::Prefill)?;
                last = hidden.last().cloned().unwrap_or_default();
                let skip = from.saturating_sub(pos).min(hidden.len());
                out.extend(hidden.drain(skip..));
            } else {
                // No row but the last is read: the last layer skips the others' outputs.
                last = self
                    .model
                    .forward_last(state, &ids[pos..stop], Mode::Prefill)?
                    .unwrap_or_default();
            }
            if stop.is_multiple_of(CHUNK) && keep(stop) {
                snaps.insert(stop, state.snapshot());
            }
            if cancel() {
                return Err(Abort::Cancelled);
            }
        }
        Ok(last)
    }

    /// The speculative decoding of `job` (`None`: off). Asking for MTP drafts from a model
    /// without an MTP block is a bad request.
    fn speculator(&self, job: &Job) -> Result<Option<Speculator>, Abort> {
        let mode = job.spec.unwrap_or(self.opts.spec.mode);
        if mode == SpecMode::Off {
            return Ok(None);
        }
        if mode == SpecMode::Mtp && !self.model.has_mtp() {
            return Err(Abort::Api(ApiError::bad_param(
                "spec",
                "this model has no MTP block: use spec 'lookup' or 'both'",
            )));
        }
        let cfg = SpecConfig {
            mode,
            ..self.opts.spec.clone()
        };
        Ok(Some(Speculator::new(&self.model, &cfg)?))
    }

    /// The decode loop: `logits` and `hidden` are the prompt's last row's. Returns the generated
    /// ids (a final stop token included), why it ended, the debug record and the stop string.
    ///
    /// With `spec`, every step verifies `pending` and its drafts in one pass and hands the rows'
    /// logits to [`Reply::take`] in order while the sampled token equals the draft: the same
    /// sampler calls on bit-identical logits as one step per token, hence the same reply.
    #[allow(clippy::type_complexity)]
    fn decode(
        &mut self,
        job: &Job,
        state: &mut SequenceState,
        prompt: &[u32],
        logits: Vec<f32>,
        mut last_hidden: Vec<f32>,
        mut spec: Option<&mut Speculator>,
    ) -> Result<(Vec<u32>, Finish, Option<DebugInfo>, Option<String>), Abort> {
        let budget = self.opts.ctx - prompt.len();
        let replay = self.next_replay();
        let mut reply = Reply::new(job, &self.tokenizer, prompt, budget, replay);
        if reply.max_tokens == 0 {
            return Ok(reply.finish(Finish::Length));
        }
        let mut next = reply.take(&logits);
        // The whole loop in one pass on the backend's threads, as `generate` runs it: one
        // hand-off per reply instead of one per step (and the lm_head inside the pass).
        let model = &self.model;
        let finish = model.backend.run_pass(|| -> Result<Finish, Abort> {
            Ok(loop {
                let pending = match next {
                    Next::Continue(id) => id,
                    Next::End(f) => break f,
                };
                let Some(sp) = spec.as_deref_mut() else {
                    let mut hidden = model.forward_hidden(state, &[pending], Mode::Step)?;
                    let logits = model
                        .lm_head(&[hidden.pop().unwrap_or_default()])
                        .pop()
                        .unwrap_or_default();
                    next = reply.take(&logits);
                    continue;
                };
                let room = reply.max_tokens - reply.produced;
                let v = sp.verify(model, state, &reply.history, pending, &last_hidden, room)?;
                let mut accepted = 0;
                for (i, row) in v.logits.iter().enumerate() {
                    next = reply.take(row);
                    match next {
                        Next::Continue(y) if v.drafts().get(i) == Some(&y) => accepted += 1,
                        _ => break,
                    }
                }
                // `pending` and the accepted drafts are fed; after an end the state is not used
                // again before `save` restores a checkpoint, so any count within the rows will do.
                last_hidden = sp.commit(model, state, v, accepted, accepted + 1)?;
            })
        })?;
        Ok(reply.finish(finish))
    }

    /// The next replay reply as ids, if replaying.
    fn next_replay(&mut self) -> Option<Vec<u32>> {
        let text = self.opts.replay.get(self.replay_next)?;
        self.replay_next += 1;
        Some(self.tokenizer.encode(text, true).unwrap_or_default())
    }

    /// `ids` is the conversation (prompt, then the reply). Re-prefill it from the prompt's last checkpoint up to its last aligned
    /// position (with `extend`; a cancelled job keeps only what it computed) and put it in the
    /// cache.
    fn save(
        &mut self,
        ids: Vec<u32>,
        prompt_len: usize,
        mut state: SequenceState,
        mut snaps: BTreeMap<usize, Snapshot>,
        extend: bool,
        file: Option<std::path::PathBuf>,
    ) {
        // The checkpoint at the prompt's last aligned position (or the latest one before it).
        let from = snaps
            .range(..=align_down(prompt_len))
            .next_back()
            .map_or(0, |(&p, _)| p);
        snaps.retain(|&p, _| p <= from);
        let restored = match snaps.get(&from) {
            Some(s) => state.restore(s).is_ok(),
            None => {
                state.reset();
                true
            }
        };
        if !restored {
            return;
        }
        let end = if extend { align_down(ids.len()) } else { from };
        let interval = self.opts.checkpoint_interval;
        let keep = |p: usize| p == end || p.is_multiple_of(interval);
        if state.pos < end {
            let t = Instant::now();
            if self
                .prefill(&mut state, &mut snaps, &ids, end, keep, &|| false, None)
                .is_err()
            {
                return;
            }
            self.metrics.add_reprefill(end - from, t.elapsed());
        }
        let mut entry = Entry::new(&self.tokenizer, ids, state, snaps);
        entry.file = file;
        if let Some(store) = &self.store {
            if entry.state.pos > 0 {
                match store.save(&entry.ids, &entry.state, entry.file.as_deref()) {
                    Ok(path) => entry.file = Some(path),
                    Err(e) => eprintln!("redlite: cannot write a state file: {e}"),
                }
            }
        }
        self.cache.insert(entry);
        self.metrics
            .cache_bytes
            .store(self.cache.bytes(), Ordering::Relaxed);
    }
}

/// Generated tokens (a stop token is not counted).
fn completion_tokens_of(generated: &[u32], tok: &Tokenizer) -> usize {
    generated
        .iter()
        .filter(|id| !tok.stop_token_ids().contains(id))
        .count()
}

/// What [`Reply::take`] decided.
#[derive(Clone, Copy)]
enum Next {
    /// The token was emitted; feed it and continue.
    Continue(u32),
    End(Finish),
}

/// The per-token side of the decode loop: sampling (or replay), log-probabilities, the debug
/// record, stop tokens and strings, streaming, the token budget and cancellation.
struct Reply<'a> {
    job: &'a Job,
    tok: Arc<Tokenizer>,
    stop_ids: Vec<u32>,
    max_tokens: usize,
    /// Tokens emitted so far (a stop token is not).
    produced: usize,
    sampler: Sampler,
    /// The prompt and every generated token.
    history: Vec<u32>,
    generated: Vec<u32>,
    debug: Option<DebugInfo>,
    text: TextStream,
    decoder: StreamDecoder,
    replay: Option<Vec<u32>>,
}

impl<'a> Reply<'a> {
    fn new(
        job: &'a Job,
        tok: &Arc<Tokenizer>,
        prompt: &[u32],
        budget: usize,
        replay: Option<Vec<u32>>,
    ) -> Reply<'a> {
        Reply {
            job,
            tok: tok.clone(),
            stop_ids: tok.stop_token_ids().to_vec(),
            max_tokens: job.max_tokens.unwrap_or(budget).min(budget),
            produced: 0,
            sampler: Sampler::new(job.sampling.clone()),
            history: prompt.to_vec(),
            generated: Vec::new(),
            debug: job.debug.then(DebugInfo::default),
            text: TextStream::new(&job.stop),
            decoder: StreamDecoder::new().with_skip_special(true),
            replay,
        }
    }

    /// Choose the next token from `logits` and emit it.
    fn take(&mut self, logits: &[f32]) -> Next {
        if let Some(d) = self.debug.as_mut() {
            d.logits_hashes.push(fnv1a(logits));
        }
        let id = match &self.replay {
            Some(r) => r
                .get(self.generated.len())
                .copied()
                .unwrap_or_else(|| self.stop_ids.first().copied().unwrap_or(0)),
            None => self.sampler.sample(logits, &self.history),
        };
        let logprob = self.job.logprobs.map(|top| token_logprob(logits, id, top));
        self.generated.push(id);
        self.history.push(id);
        if self.stop_ids.contains(&id) && !self.job.ignore_eos {
            return Next::End(Finish::Stop);
        }
        self.produced += 1;
        if let Some(d) = self.debug.as_mut() {
            d.completion_ids.push(id);
        }
        let piece = self.decoder.push(&self.tok, id);
        let (emit, hit_stop) = self.text.push(&piece);
        let delta = Event::Delta {
            text: emit,
            logprob,
        };
        if self.job.events.send(delta).is_err() {
            return Next::End(Finish::Cancelled);
        }
        if hit_stop {
            return Next::End(Finish::Stop);
        }
        if self.produced >= self.max_tokens {
            return Next::End(Finish::Length);
        }
        if self.job.events.is_closed() {
            return Next::End(Finish::Cancelled);
        }
        Next::Continue(id)
    }

    /// Flush the held-back text (unless cancelled) and hand back the generated ids, the finish
    /// reason, the debug record and the stop string reached.
    fn finish(mut self, finish: Finish) -> (Vec<u32>, Finish, Option<DebugInfo>, Option<String>) {
        if finish == Finish::Cancelled {
            return (self.generated, finish, self.debug, None);
        }
        if !self.text.stopped() {
            let tail = self.decoder.finish();
            let (mut emit, _) = self.text.push(&tail);
            emit.push_str(&self.text.flush());
            if !emit.is_empty() {
                let _ = self.job.events.send(Event::Delta {
                    text: emit,
                    logprob: None,
                });
            }
        }
        let matched = self.text.matched();
        (self.generated, finish, self.debug, matched)
    }
}

/// Log-probability of `id` and the `top` most likely tokens under `logits`.
fn token_logprob(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let lp = log_softmax(logits);
    let chosen = lp.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let mut alts: Vec<(u32, f32)> = Vec::new();
    if top > 0 {
        let mut order: Vec<u32> = (0..lp.len() as u32).collect();
        let k = top.min(order.len());
        order.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
            lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b))
        });
        order.truncate(k);
        order.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
        alts = order.into_iter().map(|t| (t, lp[t as usize])).collect();
    }
    TokenLogprob {
        id,
        logprob: chosen,
        top: alts,
    }
}

/// FNV-1a over the bit patterns of a float slice.
fn fnv1a(values: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Generated text with stop strings: text that might be the start of a stop string is held
/// back until it is known not to be.
pub struct TextStream {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    stopped: bool,
    matched: Option<String>,
}

impl TextStream {
    pub fn new(stops: &[String]) -> TextStream {
        TextStream {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            text: String::new(),
            emitted: 0,
            stopped: false,
            matched: None,
        }
    }

    /// Add text; returns what can be shown now and whether a stop string was reached (the text
    /// before it is returned, the stop string and anything after it are not).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.text.push_str(piece);
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (from + i, s)))
            .min_by_key(|(i, _)| *i);
        if let Some((at, s)) = hit {
            self.matched = Some(s.clone());
            let at = at.max(self.emitted);
            let out = self.text[self.emitted..at].to_string();
            self.emitted = at;
            self.stopped = true;
            return (out, true);
        }
        // Hold back the longest suffix that is a proper prefix of a stop string.
        let mut safe = self.text.len();
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.text.ends_with(&s[..i]) {
                    safe = safe.min(self.text.len() - i);
                }
            }
        }
        let safe = safe.max(self.emitted);
        let out = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        (out, false)
    }

    /// Everything not yet shown (at the end of generation).
    pub fn flush(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that was reached.
    pub fn matched(&self) -> Option<String> {
        self.matched.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::TextStream;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let mut t = TextStream::new(&["END".to_string()]);
        assert_eq!(t.push("hello E"), ("hello ".to_string(), false));
        assert_eq!(t.push("N"), (String::new(), false));
        assert_eq!(t.push("Dx"), (String::new(), true));
        let mut t = TextStream::new(&["END".to_string()]);
        assert_eq!(t.push("a EN"), ("a ".to_string(), false));
        assert_eq!(t.push("o"), ("ENo".to_string(), false));
        assert_eq!(t.flush(), "");
        let mut t = TextStream::new(&[]);
        assert_eq!(t.push("é"), ("é".to_string(), false));
    }
}
