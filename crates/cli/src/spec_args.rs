//! The speculative-decoding tuning flags shared by `generate`, `serve` and `spec-bench`: one
//! definition, with the defaults taken from [`SpecConfig::default`]. The mode itself (`--spec`,
//! or spec-bench's `--modes`) stays with each command, whose help text differs.

use redlite_engine::speculative::{SpecConfig, SpecMode};

#[derive(clap::Args, Debug, Clone)]
pub struct SpecArgs {
    /// Prompt lookup: longest n-gram to match.
    #[arg(long, default_value_t = SpecConfig::default().ngram_max)]
    pub spec_ngram_max: usize,
    /// Prompt lookup: shortest n-gram to match.
    #[arg(long, default_value_t = SpecConfig::default().ngram_min)]
    pub spec_ngram_min: usize,
    /// Prompt lookup: most tokens per draft.
    #[arg(long, default_value_t = SpecConfig::default().max_draft)]
    pub spec_max_draft: usize,
    /// Prompt lookup: always draft --spec-max-draft tokens instead of adapting to acceptance.
    #[arg(long)]
    pub spec_fixed: bool,
    /// Prompt lookup: search afresh for every draft instead of continuing the last draft's source.
    #[arg(long)]
    pub spec_no_follow: bool,
    /// MTP: most chained draft tokens per step (default: 4 on the CPU, 3 with --backend cuda).
    #[arg(long)]
    pub spec_mtp_draft: Option<usize>,
    /// MTP: stop chaining after a draft whose MTP probability is below this (0: never).
    #[arg(long, default_value_t = SpecConfig::default().mtp_min_prob)]
    pub spec_mtp_min_prob: f32,
    /// MTP: the draft head scores only the N lowest token ids plus the context's tokens (0: the
    /// whole vocabulary; default: an eighth of the vocabulary, at least 2048). Changes which
    /// drafts are proposed, never the output.
    #[arg(long)]
    pub spec_mtp_vocab: Option<usize>,
    /// MTP: draft whenever lookup has none, instead of only while MTP passes are measured to
    /// cost less per token than plain steps.
    #[arg(long)]
    pub spec_mtp_always: bool,
    /// MTP: the drafts attend over the last N to 2N slots of the MTP cache only (0: all), so a draft
    /// costs the same at any context length (the CPU's drafter; `--backend cuda` attends over
    /// every slot). Changes which drafts are proposed, never the output.
    #[arg(long, default_value_t = SpecConfig::default().mtp_window)]
    pub spec_mtp_window: usize,
}

impl SpecArgs {
    /// The engine's configuration for `mode` with these settings.
    pub fn config(&self, mode: SpecMode) -> SpecConfig {
        SpecConfig {
            mode,
            ngram_max: self.spec_ngram_max,
            ngram_min: self.spec_ngram_min,
            max_draft: self.spec_max_draft,
            adaptive: !self.spec_fixed,
            lookup_follow: !self.spec_no_follow,
            mtp_draft: self.spec_mtp_draft,
            mtp_min_prob: self.spec_mtp_min_prob,
            mtp_vocab: self.spec_mtp_vocab,
            mtp_gate: !self.spec_mtp_always,
            mtp_window: self.spec_mtp_window,
        }
    }
}
