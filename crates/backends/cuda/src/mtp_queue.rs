//! The MTP slot queue of the device-resident model (`CudaModel::mtp_draft`): host bookkeeping of
//! which row of the queue buffer holds which trunk row, which token completes it, and when the
//! queued slots must run. No CUDA here, so it is tested without a GPU.
//!
//! MTP slot t is `(h_t, token t+1)`: the trunk's final hidden state at position t and the token
//! after it. A trunk call of tokens `T[0..n]` at positions `p..p+n` completes the slot of the row
//! before it (`(h_(p-1), T[0])`, when that row waits in the queue), queues `(h_(p+i), T[i+1])` for
//! its rows but the last, and leaves its last row waiting for the token sampled from it.

/// See the module documentation. Rows `0..queued()` of the buffer hold complete slots (tokens in
/// order), row `queued()` the waiting trunk row when [`MtpQueue::has_last`].
#[derive(Debug, Clone)]
pub struct MtpQueue {
    /// Rows of the buffer.
    rows: usize,
    /// The complete slots' tokens (one per queued row).
    tokens: Vec<u32>,
    /// Row `queued()` holds the last trunk row's hidden state, waiting for its token.
    has_last: bool,
    /// Slots the MTP cache holds (its positions `0..slots`).
    slots: usize,
    /// The last verify pass's first row in the buffer, until `keep`.
    verify_mark: usize,
}

impl MtpQueue {
    /// An empty queue over a buffer of `rows` rows (at least the longest trunk call + 2).
    pub fn new(rows: usize) -> MtpQueue {
        MtpQueue {
            rows,
            tokens: Vec::new(),
            has_last: false,
            slots: 0,
            verify_mark: 0,
        }
    }

    /// A new sequence.
    pub fn reset(&mut self) {
        self.tokens.clear();
        self.has_last = false;
        self.slots = 0;
        self.verify_mark = 0;
    }

    /// Complete slots queued (buffer rows `0..queued()`).
    pub fn queued(&self) -> usize {
        self.tokens.len()
    }

    /// Their tokens, in row order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Slots in the MTP cache: the queued slots run at positions `slots()..`.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Whether a trunk row waits for its token (a draft needs one).
    pub fn has_last(&self) -> bool {
        self.has_last
    }

    /// Before a trunk call of `n` rows: whether the queued slots must run first (its rows, the
    /// waiting row and the queued ones would not fit the buffer).
    pub fn needs_flush(&self, n: usize) -> bool {
        self.queued() + 2 + n > self.rows
    }

    /// A trunk call of `tokens`: returns the buffer row its first row's hidden state goes to
    /// (its rows go to consecutive rows). `verify`: [`MtpQueue::keep`] will trim it. An empty
    /// call changes nothing.
    pub fn record(&mut self, tokens: &[u32], verify: bool) -> usize {
        if tokens.is_empty() {
            return self.queued() + usize::from(self.has_last);
        }
        if self.has_last {
            self.tokens.push(tokens[0]);
        }
        let first = self.queued();
        if verify {
            self.verify_mark = first;
        }
        self.tokens.extend_from_slice(&tokens[1..]);
        self.has_last = true;
        first
    }

    /// The last verify pass keeps its first `rows` rows (1..=its rows): row `rows - 1` waits now.
    pub fn keep(&mut self, rows: usize) {
        self.tokens.truncate(self.verify_mark + rows.max(1) - 1);
        self.has_last = true;
    }

    /// A draft starts: the waiting row's slot gets `pending`, the token sampled from it (the
    /// trunk's next call then does not complete it again).
    pub fn complete(&mut self, pending: u32) -> Result<(), String> {
        if !self.has_last {
            return Err(
                "an MTP draft needs a trunk call (prefill, decode or verify) before it".into(),
            );
        }
        self.tokens.push(pending);
        self.has_last = false;
        Ok(())
    }

    /// The queued slots ran (at positions `slots()..`): returns how many, and whether the
    /// waiting row (buffer row `n`) must move to row 0.
    pub fn ran(&mut self) -> (usize, bool) {
        let n = self.queued();
        self.slots += n;
        self.tokens.clear();
        (n, n > 0 && self.has_last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sequence run through the queue the way `CudaModel` does, with the buffer's rows holding
    /// trunk positions: every slot run must be `(h_p, token p+1)` for p = 0, 1, 2, … in order.
    struct Sim {
        q: MtpQueue,
        buf: Vec<Option<usize>>,
        /// The sequence's tokens so far (position p holds seq[p]).
        seq: Vec<u32>,
        /// Slots run, in order: (position of the hidden state, token).
        ran: Vec<(usize, u32)>,
        /// Slots of the drafts' chains beyond the cache (not committed).
        drafts: usize,
    }

    impl Sim {
        fn new(rows: usize) -> Sim {
            Sim {
                q: MtpQueue::new(rows),
                buf: vec![None; rows],
                seq: Vec::new(),
                ran: Vec::new(),
                drafts: 0,
            }
        }

        fn run_queued(&mut self) {
            let (start, n) = (self.q.slots(), self.q.queued());
            for (i, &t) in self.q.tokens().iter().enumerate() {
                self.ran
                    .push((self.buf[i].expect("a queued row holds a hidden state"), t));
            }
            let (done, move_last) = self.q.ran();
            assert_eq!((done, self.q.slots()), (n, start + n));
            if move_last {
                self.buf[0] = self.buf[n];
            }
        }

        /// A trunk call of `tokens`; `kept` rows stay (a verify pass trimmed by keep).
        fn call(&mut self, tokens: &[u32], verify: bool, kept: usize) {
            if self.q.needs_flush(tokens.len()) {
                self.run_queued();
            }
            let p = self.seq.len();
            let first = self.q.record(tokens, verify);
            for i in 0..tokens.len() {
                assert!(first + i < self.buf.len(), "the rows overflow the buffer");
                self.buf[first + i] = Some(p + i);
            }
            self.seq.extend_from_slice(&tokens[..kept]);
            if verify {
                self.q.keep(kept);
            }
        }

        fn draft(&mut self, pending: u32) {
            self.q.complete(pending).expect("a waiting row");
            self.run_queued();
            self.drafts += 1;
        }

        /// Every slot run so far is the next position's, with the token after it.
        fn check(&self) {
            for (k, &(p, t)) in self.ran.iter().enumerate() {
                assert_eq!(p, k, "slot {k} ran the hidden state of position {p}");
                let want = self.seq.get(p + 1).copied();
                // The last slot may be a draft's pending token, not yet in the sequence.
                if let Some(w) = want {
                    assert_eq!(t, w, "slot {k}: token");
                }
            }
        }
    }

    #[test]
    fn slots_run_in_position_order_with_the_next_token() {
        // A long prompt in chunks (the buffer fills), drafts, verify passes with rejections,
        // plain steps, and more drafts.
        let mut s = Sim::new(10);
        let prompt: Vec<u32> = (100..125).collect();
        for chunk in prompt.chunks(8) {
            s.call(chunk, false, chunk.len());
        }
        let mut next = 500u32;
        for round in 0..40usize {
            let pending = next;
            next += 1;
            match round % 4 {
                // A plain decode step of `pending`.
                0 => s.call(&[pending], false, 1),
                // A draft, then a verify pass of pending + 3 drafts keeping 1..=4 rows.
                _ => {
                    s.draft(pending);
                    let rows = [pending, next, next + 1, next + 2];
                    let kept = 1 + round % 4 + (round / 4) % 2;
                    let kept = kept.min(4);
                    s.call(&rows, true, kept);
                    next += kept as u32 - 1;
                }
            }
            s.check();
        }
        // Every position's slot ran or is queued, but the last position's, which waits.
        assert!(s.drafts >= 30 && s.q.has_last());
        assert_eq!(s.ran.len() + s.q.queued() + 1, s.seq.len());
    }

    #[test]
    fn a_draft_needs_a_trunk_row_and_reset_empties_the_queue() {
        let mut q = MtpQueue::new(8);
        assert!(q.complete(1).is_err());
        assert_eq!(q.record(&[], false), 0, "an empty call");
        assert_eq!((q.queued(), q.has_last()), (0, false));
        q.record(&[1, 2, 3], false);
        assert_eq!((q.queued(), q.has_last()), (2, true));
        q.complete(4).expect("waiting row");
        assert!(
            q.complete(5).is_err(),
            "the waiting row was completed already"
        );
        assert_eq!(q.ran(), (3, false));
        assert_eq!(q.slots(), 3);
        // The next call does not complete the row the draft completed.
        assert_eq!(q.record(&[4, 5], true), 0);
        q.keep(1);
        assert_eq!((q.queued(), q.has_last()), (0, true));
        q.reset();
        assert_eq!((q.queued(), q.slots(), q.has_last()), (0, 0, false));
    }
}
