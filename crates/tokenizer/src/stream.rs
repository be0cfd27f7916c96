//! Streaming detokenizer: never emits half a UTF-8 character.
//!
//! A byte-level BPE token can end in the middle of a multi-byte character (an emoji is often
//! split over two or three tokens). [`StreamDecoder`] collects the bytes of the tokens fed to
//! it and hands back only the text that is complete so far; an incomplete character waits for
//! the next token. Invalid byte sequences become U+FFFD as soon as they are known to be
//! invalid, and [`StreamDecoder::finish`] flushes a trailing incomplete character as U+FFFD.
//! The concatenation of everything returned equals [`Tokenizer::decode`] of all the ids.

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Incremental detokenizer. It does not borrow the tokenizer, so it can live next to an
/// `Arc<Tokenizer>` in a session; pass the tokenizer to [`StreamDecoder::push`].
///
/// ```no_run
/// # fn demo(tok: &redlite_tokenizer::tokenizer::Tokenizer, ids: &[u32]) {
/// use redlite_tokenizer::stream::StreamDecoder;
/// let mut stream = StreamDecoder::new().with_skip_special(true);
/// for &id in ids {
///     print!("{}", stream.push(tok, id));
/// }
/// print!("{}", stream.finish());
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    /// Bytes of a character that is not complete yet (at most 3).
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder that keeps special tokens, like `Tokenizer::decode(.., false)`.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Sets whether special (CONTROL) tokens such as `<|im_end|>` are dropped.
    pub fn with_skip_special(mut self, skip_special: bool) -> StreamDecoder {
        self.skip_special = skip_special;
        self
    }

    /// Feeds one token id; returns the text that became complete (possibly empty). An id
    /// outside the vocabulary contributes nothing (as in Hugging Face's decode); use
    /// [`StreamDecoder::try_push`] to get an error instead.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.try_push(tokenizer, id).unwrap_or_default()
    }

    /// Like [`StreamDecoder::push`], but an id outside the vocabulary is an error.
    pub fn try_push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        let piece = tokenizer.piece(id)?;
        if self.skip_special && tokenizer.is_special(id) {
            return Ok(String::new());
        }
        Ok(self.push_bytes(piece))
    }

    /// Feeds raw bytes; returns the text that became complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    out.push_str(valid);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` was just checked, so this conversion cannot fail.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        // An invalid sequence: replace it, as `String::from_utf8_lossy` would.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[len..];
                        }
                        // A character cut short by the end of the input: wait for more bytes.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }

    /// Whether bytes of an incomplete character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: returns U+FFFD for a trailing incomplete character (empty otherwise)
    /// and resets the decoder.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::StreamDecoder;

    /// Feeds `bytes` in the given chunk sizes and checks the pieces and the total.
    fn stream(bytes: &[u8], chunks: &[usize]) -> Vec<String> {
        let mut d = StreamDecoder::new();
        let mut out = Vec::new();
        let mut at = 0;
        for &n in chunks {
            out.push(d.push_bytes(&bytes[at..at + n]));
            at += n;
        }
        out.push(d.finish());
        let joined: String = out.concat();
        assert_eq!(joined, String::from_utf8_lossy(bytes));
        out
    }

    #[test]
    fn emoji_split_over_chunks_waits_for_completion() {
        let s = "a🦙b".as_bytes(); // 1 + 4 + 1 bytes
        assert_eq!(stream(s, &[2, 1, 1, 2]), ["a", "", "", "🦙b", ""]);
    }

    #[test]
    fn cjk_split() {
        let s = "中文".as_bytes(); // 3 + 3
        assert_eq!(stream(s, &[1, 3, 2]), ["", "中", "文", ""]);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let s = b"x\xffy\xe4\xb8";
        assert_eq!(stream(s, &[2, 1, 2]), ["x\u{fffd}", "y", "", "\u{fffd}"]);
    }

    #[test]
    fn truncated_sequence_followed_by_ascii() {
        // E4 B8 then 'z': the two bytes are one invalid sequence, as in from_utf8_lossy.
        let s = b"\xe4\xb8z";
        assert_eq!(stream(s, &[1, 1, 1]), ["", "", "\u{fffd}z", ""]);
    }
}
