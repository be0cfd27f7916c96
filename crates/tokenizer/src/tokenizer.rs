//! The gpt2 byte-level BPE tokenizer (pre-tokenizer `qwen2`) built from GGUF metadata.
//!
//! A GGUF file describes its tokenizer with `tokenizer.ggml.*` keys: the token strings (in gpt2
//! byte-level form, e.g. `Ġthe` for " the"), one type per token, the BPE merges as `"left right"`
//! strings, and a few special ids. [`Tokenizer`] rebuilds from them what Hugging Face's
//! `tokenizer.json` describes for the Qwen2/Qwen3 family:
//!
//! * an NFC normalizer (llama.cpp does not normalize; we follow Hugging Face, so decomposed
//!   accents such as `e\u{301}` tokenize like the precomposed `é`),
//! * a `Split` pre-tokenizer with the Qwen2 regex, then the byte-level mapping (no prefix space),
//! * the BPE model from the tokens and merges,
//! * added tokens: CONTROL (type 3) and USER_DEFINED (type 4) tokens are matched literally in the
//!   input before anything else is done to it (leftmost match, longest one first). CONTROL
//!   tokens are the *special* ones: they are matched only when `parse_special` is set and are
//!   dropped by `decode(.., skip_special = true)`. USER_DEFINED tokens (`<think>`,
//!   `<tool_call>`, …) are always matched, like Hugging Face's non-special added tokens.
//!   UNUSED tokens (the `[PAD…]` padding of the embedding matrix) are never matched and decode
//!   to nothing.
//!
//! The normalizer, pre-tokenizer and BPE model of the `tokenizers` crate do the work for the text
//! between added tokens; decoding is done here, byte for byte, the way Hugging Face's byte-level
//! decoder does it (concatenate every token's bytes, then decode UTF-8 with replacement
//! characters).

use std::collections::HashMap;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{SplitDelimiterBehavior, TokenizerImpl};

/// The Qwen2 pre-tokenizer regex (Hugging Face `tokenizer.json` of Qwen2/Qwen2.5/Qwen3).
pub const QWEN2_PRE_TOKENIZER_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Errors from building or using a [`Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required `tokenizer.ggml.*` key is missing or has the wrong type.
    #[error("reading the tokenizer from GGUF metadata: {0}")]
    Gguf(redlite_gguf::GgufError),
    /// `tokenizer.ggml.model` names a tokenizer family this crate does not implement.
    #[error("unsupported tokenizer model `{0}` (only `gpt2` byte-level BPE is supported)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    #[error("unsupported pre-tokenizer `{0}` (supported: `qwen2`)")]
    UnsupportedPreTokenizer(String),
    /// `tokenizer.ggml.token_type` does not have one entry per token.
    #[error("{tokens} tokens but {types} token types")]
    TokenTypeCount { tokens: usize, types: usize },
    /// A token type outside 1..=6.
    #[error("token {id} has invalid type {value} (valid: 1..=6)")]
    InvalidTokenType { id: usize, value: i32 },
    /// A merge that is not two non-empty pieces separated by one space.
    #[error("merge #{index} `{merge}` is not of the form `left right`")]
    InvalidMerge { index: usize, merge: String },
    /// A byte-level BPE vocabulary must contain a token for each of the 256 bytes.
    #[error("vocabulary has no token for byte 0x{0:02x} (byte-level symbol `{1}`)")]
    MissingByteToken(u8, char),
    /// A special-token id (eos, bos, padding) is not a valid token id.
    #[error("{name} token id {id} is out of range (vocabulary size {vocab_size})")]
    SpecialIdOutOfRange {
        name: &'static str,
        id: u32,
        vocab_size: usize,
    },
    /// More tokens than `u32` ids can address.
    #[error("vocabulary of {0} tokens is too large")]
    VocabTooLarge(usize),
    /// The `tokenizers` crate refused the model or pre-tokenizer.
    #[error("building the BPE tokenizer: {0}")]
    Build(String),
    /// The `tokenizers` crate failed while encoding.
    #[error("encoding text: {0}")]
    Encode(String),
    /// A token id at or past the vocabulary size.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
}

/// Token type as stored in `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 1: an ordinary BPE token (byte-level encoded text).
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: a control token such as `<|im_end|>`; *special*.
    Control,
    /// 4: a user-defined added token such as `<think>`, stored as plain text.
    UserDefined,
    /// 5: unused, e.g. the `[PAD…]` entries that pad the embedding matrix.
    Unused,
    /// 6: a byte token `<0xAB>`.
    Byte,
}

impl TokenType {
    /// Converts the GGUF integer; `None` outside 1..=6.
    pub fn from_gguf(value: i32) -> Option<TokenType> {
        Some(match value {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }
}

/// The tokenizer description read from GGUF metadata (`tokenizer.ggml.*`), before validation.
#[derive(Debug, Clone, Default)]
pub struct VocabData {
    /// `tokenizer.ggml.model`, e.g. `gpt2`.
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `qwen2`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`: token strings, the index is the id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: one [`TokenType`] integer per token; `None` = all normal.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub padding_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token` (false when absent).
    pub add_bos_token: bool,
}

impl VocabData {
    /// Reads the `tokenizer.ggml.*` keys of a GGUF file. `tokenizer.ggml.model` and
    /// `tokenizer.ggml.tokens` are required; for a `gpt2` model `tokenizer.ggml.merges` too.
    pub fn from_gguf(file: &redlite_gguf::GgufFile) -> Result<VocabData, TokenizerError> {
        let model = file.get_str("tokenizer.ggml.model")?.to_string();
        if model != "gpt2" {
            // Checked here too so that a non-BPE file fails on the model, not on missing merges.
            return Err(TokenizerError::UnsupportedModel(model));
        }
        let token_types = match file.get("tokenizer.ggml.token_type") {
            Some(_) => Some(file.get_i32_array("tokenizer.ggml.token_type")?),
            None => None,
        };
        Ok(VocabData {
            model,
            pre: file.get_opt_str("tokenizer.ggml.pre")?.map(str::to_string),
            tokens: file.get_str_array("tokenizer.ggml.tokens")?.to_vec(),
            token_types,
            merges: file.get_str_array("tokenizer.ggml.merges")?.to_vec(),
            eos_token_id: file.get_opt_u32("tokenizer.ggml.eos_token_id")?,
            bos_token_id: file.get_opt_u32("tokenizer.ggml.bos_token_id")?,
            padding_token_id: file.get_opt_u32("tokenizer.ggml.padding_token_id")?,
            add_bos_token: file
                .get_opt_bool("tokenizer.ggml.add_bos_token")?
                .unwrap_or(false),
        })
    }
}

/// Inverse of gpt2's `bytes_to_unicode`: maps a byte-level symbol back to its byte.
///
/// gpt2 represents every byte by a printable character: the bytes `!`..=`~`, `¡`..=`¬` and
/// `®`..=`ÿ` stand for themselves, the other 68 bytes (controls, space, DEL, NBSP, soft hyphen)
/// become U+0100, U+0101, … in increasing byte order.
struct ByteLevelTable {
    /// `byte_of[c]` for every char `c < 256 + 68`.
    byte_of: [Option<u8>; 324],
    /// The symbol of each byte.
    char_of: [char; 256],
}

impl ByteLevelTable {
    fn new() -> ByteLevelTable {
        let mut byte_of = [None; 324];
        let mut char_of = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let code = if printable {
                u32::from(b)
            } else {
                next += 1;
                next - 1
            };
            // `code` < 324 and never a surrogate, so this always succeeds.
            let c = char::from_u32(code).unwrap_or('\u{FFFD}');
            byte_of[code as usize] = Some(b);
            char_of[usize::from(b)] = c;
        }
        ByteLevelTable { byte_of, char_of }
    }

    /// The bytes a byte-level token stands for; `None` if some char is not a byte symbol.
    fn decode(&self, token: &str) -> Option<Vec<u8>> {
        token
            .chars()
            .map(|c| self.byte_of.get(c as usize).copied().flatten())
            .collect()
    }
}

/// Parses a byte token `<0xAB>`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The added tokens (CONTROL and USER_DEFINED), matched literally in the raw input text.
#[derive(Debug, Clone, Default)]
struct AddedTokens {
    /// `(content, id, special)`.
    entries: Vec<(String, u32, bool)>,
    /// For each first byte, indices into `entries`, longest content first.
    by_first_byte: HashMap<u8, Vec<usize>>,
}

impl AddedTokens {
    fn new(entries: Vec<(String, u32, bool)>) -> AddedTokens {
        let mut by_first_byte: HashMap<u8, Vec<usize>> = HashMap::new();
        for (i, (content, _, _)) in entries.iter().enumerate() {
            if let Some(&b) = content.as_bytes().first() {
                by_first_byte.entry(b).or_default().push(i);
            }
        }
        for list in by_first_byte.values_mut() {
            // Longest first (ties: lower id first) so the first hit is the longest match.
            list.sort_by_key(|&i| (std::cmp::Reverse(entries[i].0.len()), entries[i].1));
        }
        AddedTokens {
            entries,
            by_first_byte,
        }
    }

    /// The longest added token starting at byte `pos` of `text`: `(id, length in bytes)`.
    /// Special (CONTROL) tokens are considered only when `parse_special` is set.
    fn match_at(&self, text: &[u8], pos: usize, parse_special: bool) -> Option<(u32, usize)> {
        let candidates = self.by_first_byte.get(text.get(pos)?)?;
        candidates.iter().find_map(|&i| {
            let (content, id, special) = &self.entries[i];
            let hit = (parse_special || !special) && text[pos..].starts_with(content.as_bytes());
            hit.then_some((*id, content.len()))
        })
    }
}

/// The concrete `tokenizers` pipeline for the text between added tokens.
type BpePipeline = TokenizerImpl<BPE, NFC, Sequence, ByteLevel, ByteLevel>;

/// A gpt2 byte-level BPE tokenizer built from GGUF metadata. See the module documentation.
pub struct Tokenizer {
    /// NFC → Split(Qwen2 regex) → ByteLevel → BPE, without added tokens.
    pipeline: BpePipeline,
    /// Added tokens matched before the pipeline runs.
    added: AddedTokens,
    /// Token strings as stored in the GGUF.
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// First id of each token string (for [`Tokenizer::token_id`]).
    ids: HashMap<String, u32>,
    /// The decoded bytes of every token, concatenated; token `i` is
    /// `piece_bytes[piece_start[i]..piece_start[i + 1]]`.
    piece_bytes: Vec<u8>,
    piece_start: Vec<usize>,
    eos: Option<u32>,
    bos: Option<u32>,
    padding: Option<u32>,
    add_bos: bool,
    stop_ids: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("added_tokens", &self.added.entries.len())
            .field("eos", &self.eos)
            .field("bos", &self.bos)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.
    pub fn from_gguf(file: &redlite_gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_vocab(VocabData::from_gguf(file)?)
    }

    /// Builds the tokenizer from already extracted metadata.
    pub fn from_vocab(data: VocabData) -> Result<Tokenizer, TokenizerError> {
        if data.model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(data.model));
        }
        let pre_regex = match data.pre.as_deref() {
            Some("qwen2") => QWEN2_PRE_TOKENIZER_REGEX,
            Some(other) => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
            None => {
                return Err(TokenizerError::UnsupportedPreTokenizer(
                    "(tokenizer.ggml.pre missing)".to_string(),
                ))
            }
        };
        let n = data.tokens.len();
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::VocabTooLarge(n));
        }
        let types: Vec<TokenType> = match &data.token_types {
            None => vec![TokenType::Normal; n],
            Some(raw) if raw.len() != n => {
                return Err(TokenizerError::TokenTypeCount {
                    tokens: n,
                    types: raw.len(),
                })
            }
            Some(raw) => raw
                .iter()
                .enumerate()
                .map(|(id, &value)| {
                    TokenType::from_gguf(value)
                        .ok_or(TokenizerError::InvalidTokenType { id, value })
                })
                .collect::<Result<_, _>>()?,
        };
        for (name, id) in [
            ("eos", data.eos_token_id),
            ("bos", data.bos_token_id),
            ("padding", data.padding_token_id),
        ] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::SpecialIdOutOfRange {
                    name,
                    id,
                    vocab_size: n,
                });
            }
        }

        // Token string → first id with that string (GGUF vocabularies should not repeat a
        // string, but if one does, the first occurrence wins rather than failing).
        let mut ids: HashMap<String, u32> = HashMap::with_capacity(n);
        for (id, token) in data.tokens.iter().enumerate() {
            ids.entry(token.clone()).or_insert(id as u32);
        }

        let table = ByteLevelTable::new();
        for (b, &c) in table.char_of.iter().enumerate() {
            if !ids.contains_key(c.encode_utf8(&mut [0; 4]) as &str) {
                return Err(TokenizerError::MissingByteToken(b as u8, c));
            }
        }

        let pipeline = build_pipeline(&ids, &data.merges, pre_regex)?;

        let mut added = Vec::new();
        for (id, (token, ty)) in data.tokens.iter().zip(&types).enumerate() {
            match ty {
                TokenType::Control => added.push((token.clone(), id as u32, true)),
                TokenType::UserDefined => added.push((token.clone(), id as u32, false)),
                _ => {}
            }
        }

        let mut piece_bytes = Vec::new();
        let mut piece_start = Vec::with_capacity(n + 1);
        for (token, ty) in data.tokens.iter().zip(&types) {
            piece_start.push(piece_bytes.len());
            match ty {
                TokenType::Control | TokenType::UserDefined => {
                    piece_bytes.extend_from_slice(token.as_bytes())
                }
                TokenType::Unused => {}
                TokenType::Byte if parse_byte_token(token).is_some() => {
                    piece_bytes.extend(parse_byte_token(token))
                }
                // Like Hugging Face's byte-level decoder: a token with a char that is not a
                // byte symbol is taken as its UTF-8 text.
                _ => match table.decode(token) {
                    Some(bytes) => piece_bytes.extend_from_slice(&bytes),
                    None => piece_bytes.extend_from_slice(token.as_bytes()),
                },
            }
        }
        piece_start.push(piece_bytes.len());

        let mut stop_ids: Vec<u32> = data.eos_token_id.into_iter().collect();
        for name in ["<|endoftext|>", "<|im_end|>"] {
            if let Some(&id) = ids.get(name) {
                if !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }

        Ok(Tokenizer {
            pipeline,
            added: AddedTokens::new(added),
            tokens: data.tokens,
            types,
            ids,
            piece_bytes,
            piece_start,
            eos: data.eos_token_id,
            bos: data.bos_token_id,
            padding: data.padding_token_id,
            add_bos: data.add_bos_token,
            stop_ids,
        })
    }

    /// Tokenizes `text`. With `parse_special`, CONTROL tokens written in the text (such as
    /// `<|im_start|>`) become their ids; without it they are tokenized as ordinary text.
    /// USER_DEFINED tokens (`<think>`, …) are recognised either way. No BOS is added; see
    /// [`Tokenizer::add_bos_token`].
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let bytes = text.as_bytes();
        let mut out = Vec::new();
        let mut segment_start = 0;
        let mut pos = 0;
        while pos < bytes.len() {
            match self.added.match_at(bytes, pos, parse_special) {
                Some((id, len)) => {
                    // Added tokens are non-empty UTF-8 strings, so a match starts and ends on
                    // char boundaries and these slices cannot fail.
                    self.encode_plain(&text[segment_start..pos], &mut out)?;
                    out.push(id);
                    pos += len;
                    segment_start = pos;
                }
                None => pos += 1,
            }
        }
        self.encode_plain(&text[segment_start..], &mut out)?;
        Ok(out)
    }

    /// Runs the BPE pipeline on text that contains no added token and appends the ids.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        let encoding = self
            .pipeline
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    /// Turns ids back into text: the bytes of all tokens, decoded as UTF-8 with invalid
    /// sequences replaced by U+FFFD (as Hugging Face's byte-level decoder does). With
    /// `skip_special`, CONTROL tokens are left out. UNUSED tokens decode to nothing.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(self.piece(id)?);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The raw bytes token `id` stands for (possibly part of a UTF-8 character); empty for
    /// UNUSED tokens and for ids out of range.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.piece(id).map(<[u8]>::to_vec).unwrap_or_default()
    }

    /// The bytes of token `id`, borrowed.
    pub fn piece(&self, id: u32) -> Result<&[u8], TokenizerError> {
        let i = id as usize;
        match (self.piece_start.get(i), self.piece_start.get(i + 1)) {
            (Some(&start), Some(&end)) => Ok(&self.piece_bytes[start..end]),
            _ => Err(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.tokens.len(),
            }),
        }
    }

    /// Number of token ids (including padding entries).
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// `tokenizer.ggml.eos_token_id`.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos
    }

    /// `tokenizer.ggml.bos_token_id`.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// `tokenizer.ggml.padding_token_id`.
    pub fn padding_token_id(&self) -> Option<u32> {
        self.padding
    }

    /// `tokenizer.ggml.add_bos_token`: whether a prompt should start with the BOS id.
    pub fn add_bos_token(&self) -> bool {
        self.add_bos
    }

    /// Ids that end generation: EOS, plus `<|endoftext|>` and `<|im_end|>` when present.
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The id of a token given its GGUF string (byte-level form for normal tokens, e.g. `Ġthe`;
    /// plain text for added tokens, e.g. `<|im_end|>`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// The GGUF string of token `id`.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of token `id`.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    /// Whether `id` is a special (CONTROL) token: matched in text only with `parse_special`,
    /// skipped by `decode(.., skip_special = true)`.
    pub fn is_special(&self, id: u32) -> bool {
        self.token_type(id) == Some(TokenType::Control)
    }
}

/// Builds NFC → Split(regex, isolated) → ByteLevel(no prefix space, no regex) → BPE.
fn build_pipeline(
    ids: &HashMap<String, u32>,
    merges: &[String],
    pre_regex: &str,
) -> Result<BpePipeline, TokenizerError> {
    let vocab: Vocab = ids.iter().map(|(k, &v)| (k.clone(), v)).collect();
    let merges = merges
        .iter()
        .enumerate()
        .map(|(index, merge)| match merge.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.to_string(), b.to_string())),
            _ => Err(TokenizerError::InvalidMerge {
                index,
                merge: merge.clone(),
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| TokenizerError::Build(e.to_string()))?;
    let split = Split::new(
        SplitPattern::Regex(pre_regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex: {e}")))?;
    let byte_level = ByteLevel::new(false, false, false);
    let pre = Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(byte_level),
    ]);
    let mut pipeline = TokenizerImpl::new(bpe);
    pipeline
        .with_normalizer(Some(NFC))
        .with_pre_tokenizer(Some(pre))
        .with_post_processor(Some(byte_level))
        .with_decoder(Some(byte_level));
    Ok(pipeline)
}

// By hand, not `#[from]`: the message above already includes the GGUF error's text, and as a
// `source` it would be printed twice in a context chain.
impl From<redlite_gguf::GgufError> for TokenizerError {
    fn from(e: redlite_gguf::GgufError) -> Self {
        TokenizerError::Gguf(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2() {
        let t = ByteLevelTable::new();
        assert_eq!(t.char_of[b' ' as usize], 'Ġ');
        assert_eq!(t.char_of[b'\n' as usize], 'Ċ');
        assert_eq!(t.char_of[b'a' as usize], 'a');
        assert_eq!(t.char_of[0xAD], 'Ń');
        assert_eq!(t.decode("Ġhello"), Some(b" hello".to_vec()));
        assert_eq!(t.decode("中"), None);
    }

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xzz>"), None);
        assert_eq!(parse_byte_token("<0x0>"), None);
    }
}
