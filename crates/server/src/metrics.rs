//! Counters for `GET /metrics` (Prometheus text format).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use redlite_engine::speculative::SpecStats;

/// Server-wide counters, updated by the handlers and the worker.
#[derive(Debug, Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub reprefill_tokens: AtomicU64,
    pub prompt_micros: AtomicU64,
    pub decode_micros: AtomicU64,
    pub reprefill_micros: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_bytes: AtomicUsize,
    /// Requests decoded speculatively, and their decode passes, verified rows, draft tokens
    /// proposed and accepted, passes that carried drafts, tokens and decode time.
    pub spec_requests: AtomicU64,
    pub spec_passes: AtomicU64,
    pub spec_rows: AtomicU64,
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub spec_draft_steps: AtomicU64,
    /// Passes the MTP gate left without drafts (MTP measured not to pay).
    pub spec_mtp_left_out: AtomicU64,
    pub spec_completion_tokens: AtomicU64,
    pub spec_decode_micros: AtomicU64,
}

impl Metrics {
    pub fn add_prompt(&self, computed: usize, cached: usize, time: Duration) {
        self.prompt_tokens
            .fetch_add((computed + cached) as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        if cached > 0 {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
        }
        self.prompt_micros
            .fetch_add(time.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn add_decode(&self, tokens: usize, time: Duration) {
        self.completion_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        self.decode_micros
            .fetch_add(time.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn add_reprefill(&self, tokens: usize, time: Duration) {
        self.reprefill_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        self.reprefill_micros
            .fetch_add(time.as_micros() as u64, Ordering::Relaxed);
    }

    /// A request decoded speculatively: `tokens` generated in `time`.
    pub fn add_spec(&self, s: &SpecStats, tokens: usize, time: Duration) {
        let t = s.total();
        let add = |a: &AtomicU64, v: usize| a.fetch_add(v as u64, Ordering::Relaxed);
        add(&self.spec_requests, 1);
        add(&self.spec_passes, s.forward_passes);
        add(&self.spec_rows, s.rows);
        add(&self.spec_drafted, t.drafted);
        add(&self.spec_accepted, t.accepted);
        add(&self.spec_draft_steps, t.steps);
        add(&self.spec_mtp_left_out, s.mtp_gated);
        add(&self.spec_completion_tokens, tokens);
        add(&self.spec_decode_micros, time.as_micros() as usize);
    }

    /// The Prometheus exposition text.
    pub fn render(&self, queue_depth: usize) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(s, "# HELP redlite_{name} {help}");
            let _ = writeln!(s, "# TYPE redlite_{name} {kind}");
            let _ = writeln!(s, "redlite_{name} {value}");
        };
        let prompt = get(&self.prompt_tokens);
        let cached = get(&self.cached_tokens);
        let computed = prompt - cached;
        let rate = |tokens: u64, micros: u64| {
            if micros == 0 {
                0.0
            } else {
                tokens as f64 / (micros as f64 / 1e6)
            }
        };
        metric(
            "requests_total",
            "counter",
            "HTTP API requests received.",
            get(&self.requests) as f64,
        );
        metric(
            "request_errors_total",
            "counter",
            "Requests answered with an error.",
            get(&self.errors) as f64,
        );
        metric(
            "requests_cancelled_total",
            "counter",
            "Generations cancelled by a client disconnect.",
            get(&self.cancelled) as f64,
        );
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens received (computed plus cached).",
            prompt as f64,
        );
        metric(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens resumed from the prefix cache.",
            cached as f64,
        );
        metric(
            "completion_tokens_total",
            "counter",
            "Tokens generated.",
            get(&self.completion_tokens) as f64,
        );
        metric(
            "reprefill_tokens_total",
            "counter",
            "Tokens re-run in prefill mode to align cache checkpoints.",
            get(&self.reprefill_tokens) as f64,
        );
        metric(
            "prompt_tokens_per_second",
            "gauge",
            "Average prefill speed over computed prompt tokens.",
            rate(computed, get(&self.prompt_micros)),
        );
        metric(
            "decode_tokens_per_second",
            "gauge",
            "Average decode speed.",
            rate(get(&self.completion_tokens), get(&self.decode_micros)),
        );
        metric(
            "prompt_cache_hits_total",
            "counter",
            "Requests that resumed a cached prefix.",
            get(&self.cache_hits) as f64,
        );
        metric(
            "prompt_cache_bytes",
            "gauge",
            "Bytes held by the prefix cache (estimate).",
            self.cache_bytes.load(Ordering::Relaxed) as f64,
        );
        let drafted = get(&self.spec_drafted);
        let accepted = get(&self.spec_accepted);
        metric(
            "spec_requests_total",
            "counter",
            "Requests decoded speculatively.",
            get(&self.spec_requests) as f64,
        );
        metric(
            "spec_passes_total",
            "counter",
            "Decode forward passes of speculative requests (verify passes, with or without drafts).",
            get(&self.spec_passes) as f64,
        );
        metric(
            "spec_rows_total",
            "counter",
            "Rows those passes verified (pending tokens plus drafts).",
            get(&self.spec_rows) as f64,
        );
        metric(
            "spec_draft_tokens_total",
            "counter",
            "Draft tokens proposed (prompt lookup and MTP).",
            drafted as f64,
        );
        metric(
            "spec_draft_tokens_accepted_total",
            "counter",
            "Draft tokens accepted.",
            accepted as f64,
        );
        metric(
            "spec_mtp_left_out_passes_total",
            "counter",
            "Passes without MTP drafts because MTP passes were measured to cost more per token than plain steps.",
            get(&self.spec_mtp_left_out) as f64,
        );
        metric(
            "spec_acceptance_rate",
            "gauge",
            "Accepted over proposed draft tokens.",
            if drafted == 0 {
                0.0
            } else {
                accepted as f64 / drafted as f64
            },
        );
        metric(
            "spec_mean_accepted_length",
            "gauge",
            "Accepted draft tokens per verify pass that carried drafts.",
            accepted as f64 / get(&self.spec_draft_steps).max(1) as f64,
        );
        metric(
            "spec_decode_tokens_per_second",
            "gauge",
            "Average decode speed of speculative requests.",
            rate(
                get(&self.spec_completion_tokens),
                get(&self.spec_decode_micros),
            ),
        );
        metric(
            "queue_depth",
            "gauge",
            "Generation requests waiting or running.",
            queue_depth as f64,
        );
        s
    }
}
