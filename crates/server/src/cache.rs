//! The prefix cache: recent conversations with their sequence state and aligned checkpoints.
//!
//! A conversation is kept as the token ids the model saw (prompt plus the ids it generated), the
//! bytes those ids stand for, its [`SequenceState`] (KV caches up to the last checkpoint) and
//! [`Snapshot`]s of the recurrent state at multiples of [`CHUNK`] positions. A new prompt resumes
//! from the last checkpoint at or before its longest common prefix with a cached conversation.
//!
//! Prompts given as text are matched on **bytes** against the bytes of the cached ids: a client
//! re-sending a reply gets the exact ids the model generated (which a re-tokenization of the
//! reply's text need not reproduce); only the text after the common prefix is tokenized.
//!
//! Checkpoints sit at absolute multiples of the prefill chunk, where the chunked prefill is
//! bit-identical to one pass over the whole prompt, so a resumed computation equals a fresh one.

use std::collections::BTreeMap;

use redlite_model::delta_rule::CHUNK;
use redlite_model::{SequenceState, Snapshot};
use redlite_tokenizer::tokenizer::Tokenizer;

/// One cached conversation.
pub struct Entry {
    /// Token ids of the conversation (prompt and generated reply, stop token included).
    pub ids: Vec<u32>,
    /// The bytes of `ids`, concatenated.
    pub bytes: Vec<u8>,
    /// `ends[i]`: byte offset in `bytes` where token `i` ends.
    pub ends: Vec<usize>,
    /// The state; its position is the last checkpoint (everything after it is recomputed anyway).
    pub state: SequenceState,
    /// Recurrent-state checkpoints by position (multiples of [`CHUNK`], all `<= state.pos`).
    pub snaps: BTreeMap<usize, Snapshot>,
    /// The state file holding this conversation (with `--state-dir`).
    pub file: Option<std::path::PathBuf>,
    last_used: u64,
}

impl Entry {
    pub fn new(
        tokenizer: &Tokenizer,
        ids: Vec<u32>,
        state: SequenceState,
        snaps: BTreeMap<usize, Snapshot>,
    ) -> Entry {
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(ids.len());
        for &id in &ids {
            bytes.extend_from_slice(tokenizer.piece(id).unwrap_or(&[]));
            ends.push(bytes.len());
        }
        Entry {
            ids,
            bytes,
            ends,
            state,
            snaps,
            file: None,
            last_used: 0,
        }
    }

    /// How many leading tokens of this entry a prompt with these bytes shares, matching whole
    /// tokens only and never ending inside a UTF-8 character of `prompt`.
    pub fn text_match(&self, prompt: &str) -> usize {
        let p = prompt.as_bytes();
        let common = p
            .iter()
            .zip(&self.bytes)
            .take_while(|(a, b)| a == b)
            .count();
        let mut k = self.ends.partition_point(|&e| e <= common);
        while k > 0 && !prompt.is_char_boundary(self.ends[k - 1]) {
            k -= 1;
        }
        k
    }

    /// The longest common prefix of `ids` with this entry, in tokens.
    pub fn id_match(&self, ids: &[u32]) -> usize {
        ids.iter()
            .zip(&self.ids)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// The last checkpoint at or before `pos` (0 when none).
    pub fn checkpoint_at_or_before(&self, pos: usize) -> usize {
        self.snaps.range(..=pos).next_back().map_or(0, |(&p, _)| p)
    }

    fn bytes_estimate(&self, kv_bytes_per_pos: usize, snap_bytes: usize) -> usize {
        self.state.pos * kv_bytes_per_pos + self.snaps.len() * snap_bytes + self.bytes.len() * 2
    }
}

/// The cache: a few entries, least recently used evicted first, bounded in count and bytes.
pub struct PrefixCache {
    entries: Vec<Entry>,
    max_entries: usize,
    budget_bytes: usize,
    kv_bytes_per_pos: usize,
    snap_bytes: usize,
    clock: u64,
}

impl PrefixCache {
    pub fn new(
        max_entries: usize,
        budget_bytes: usize,
        kv_bytes_per_pos: usize,
        snap_bytes: usize,
    ) -> PrefixCache {
        PrefixCache {
            entries: Vec::new(),
            max_entries,
            budget_bytes,
            kv_bytes_per_pos,
            snap_bytes,
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held by all entries (estimate: KV caches, snapshots, token bytes).
    pub fn bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|e| e.bytes_estimate(self.kv_bytes_per_pos, self.snap_bytes))
            .sum()
    }

    /// The entry sharing the most leading tokens with a text prompt: `(index, tokens)`.
    pub fn best_text_match(&self, prompt: &str) -> Option<(usize, usize)> {
        self.best_by(|e| e.text_match(prompt))
    }

    /// The entry sharing the most leading tokens with an id prompt: `(index, tokens)`.
    pub fn best_id_match(&self, ids: &[u32]) -> Option<(usize, usize)> {
        self.best_by(|e| e.id_match(ids))
    }

    fn best_by(&self, score: impl Fn(&Entry) -> usize) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, u64)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let k = score(e);
            if k == 0 {
                continue;
            }
            if best.is_none_or(|(_, bk, bt)| k > bk || (k == bk && e.last_used > bt)) {
                best = Some((i, k, e.last_used));
            }
        }
        best.map(|(i, k, _)| (i, k))
    }

    pub fn entry(&self, index: usize) -> &Entry {
        &self.entries[index]
    }

    /// Remove and return an entry (the caller extends it and inserts it back).
    pub fn take(&mut self, index: usize) -> Entry {
        self.entries.swap_remove(index)
    }

    /// Add an entry as the most recently used one, then evict least recently used entries
    /// (never this one) while over the count or byte budget.
    pub fn insert(&mut self, mut entry: Entry) {
        if entry.snaps.is_empty() {
            return; // nothing to resume from
        }
        self.clock += 1;
        entry.last_used = self.clock;
        self.entries.push(entry);
        while self.entries.len() > 1
            && (self.entries.len() > self.max_entries || self.bytes() > self.budget_bytes)
        {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    self.entries.swap_remove(i);
                }
                None => break,
            }
        }
        // A single entry over budget keeps only its latest checkpoints.
        if self.entries.len() == 1 {
            if let Some(e) = self.entries.first_mut() {
                while e.snaps.len() > 1
                    && e.bytes_estimate(self.kv_bytes_per_pos, self.snap_bytes) > self.budget_bytes
                {
                    let first = *e.snaps.keys().next().expect("non-empty");
                    e.snaps.remove(&first);
                }
            }
        }
    }

    /// Drop everything (after an internal error left a state in doubt).
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

/// The largest multiple of [`CHUNK`] not above `pos`.
pub fn align_down(pos: usize) -> usize {
    pos - pos % CHUNK
}

#[cfg(test)]
mod tests {
    use super::*;
    use redlite_model::Config;

    fn tiny_state(pos: usize) -> SequenceState {
        let model = redlite_model::Model::load(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../shared/reference/models/tiny-Q8_0.gguf"
        ))
        .expect("tiny model");
        let cfg: &Config = &model.config;
        let mut s = SequenceState::new(cfg);
        s.pos = pos;
        s
    }

    fn entry(ids: Vec<u32>, pos: usize) -> Entry {
        let state = tiny_state(pos);
        let mut snaps = BTreeMap::new();
        snaps.insert(pos, state.snapshot());
        Entry {
            bytes: ids.iter().flat_map(|i| i.to_le_bytes()).collect(),
            ends: (1..=ids.len()).map(|i| i * 4).collect(),
            ids,
            state,
            snaps,
            file: None,
            last_used: 0,
        }
    }

    #[test]
    fn best_match_and_lru_eviction() {
        let mut c = PrefixCache::new(2, usize::MAX, 0, 0);
        c.insert(entry(vec![1, 2, 3, 4], 64));
        c.insert(entry(vec![1, 2, 9], 64));
        assert_eq!(
            c.best_id_match(&[1, 2, 3, 7])
                .map(|(i, k)| (c.entry(i).ids[2], k)),
            Some((3, 3))
        );
        assert_eq!(c.best_id_match(&[5]), None);
        // A third entry evicts the least recently used (the first).
        c.insert(entry(vec![7, 7], 64));
        assert_eq!(c.len(), 2);
        assert_eq!(c.best_id_match(&[1, 2, 3]).map(|(_, k)| k), Some(2));
        // Text matching stops at whole tokens and char boundaries.
        let e = entry(vec![0x41, 0x42], 64);
        assert_eq!(e.text_match("A\0\0\0B\0\0\0C"), 2);
        assert_eq!(e.text_match("A\0\0\0X"), 1);
        assert_eq!(e.checkpoint_at_or_before(63), 0);
        assert_eq!(e.checkpoint_at_or_before(64), 64);
    }

    #[test]
    fn byte_budget_evicts_and_trims_checkpoints() {
        // Each entry: 64 positions × 10 bytes + snapshots × 1000 bytes (+ token bytes).
        let mut c = PrefixCache::new(8, 3000, 10, 1000);
        c.insert(entry(vec![1], 64));
        c.insert(entry(vec![2], 64));
        assert_eq!(c.len(), 1, "the older entry is evicted over budget");
        let mut big = entry(vec![3], 64);
        for p in [0usize, 1, 2, 3] {
            big.snaps.insert(p, big.state.snapshot());
        }
        c.insert(big);
        assert_eq!(c.len(), 1);
        assert!(c.bytes() <= 3000 || c.entry(0).snaps.len() == 1);
        assert_eq!(
            c.entry(0).snaps.keys().last(),
            Some(&64),
            "the latest checkpoint stays"
        );
    }
}
