//! The real Qwen3 vocabulary (`shared/reference/tokenizer/qwen3-vocab.gguf`) against the 300
//! Hugging Face cases of `cases.jsonl`.

use std::sync::OnceLock;

use redlite_gguf::GgufFile;
use redlite_tokenizer::stream::StreamDecoder;
use redlite_tokenizer::tokenizer::{TokenType, Tokenizer};
use serde::Deserialize;

const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/reference");

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    ids_plain: Vec<u32>,
    llamacpp_ids: Vec<u32>,
    llamacpp_ids_plain: Vec<u32>,
    decoded: String,
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = format!("{REFERENCE}/tokenizer/qwen3-vocab.gguf");
        let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{path}: {e}"))
    })
}

fn cases() -> Vec<Case> {
    let path = format!("{REFERENCE}/tokenizer/cases.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let cases: Vec<Case> = text
        .lines()
        .enumerate()
        .map(|(i, l)| serde_json::from_str(l).unwrap_or_else(|e| panic!("{path}:{}: {e}", i + 1)))
        .collect();
    assert_eq!(cases.len(), 300);
    cases
}

#[test]
fn ids_equal_hugging_face_for_all_cases() {
    let tok = tokenizer();
    let mut failures = Vec::new();
    for (i, c) in cases().iter().enumerate() {
        let got = tok.encode(&c.text, true).unwrap();
        if got != c.ids {
            failures.push(format!(
                "case {i} {:?}: got {got:?}, HF {:?}",
                c.text, c.ids
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Without `parse_special`, CONTROL tokens are text. Hugging Face marks only ids
/// 151643–151656 special, while the GGUF stores the fim/repo tokens (151659–151664) as CONTROL
/// too, so cases containing those follow llama.cpp's plain ids instead; everything else equals
/// HF's `ids_plain`.
#[test]
fn plain_ids_equal_hugging_face_except_gguf_control_fim_tokens() {
    let tok = tokenizer();
    let fim_like = |t: &str| (151659..=151664).any(|id| t.contains(tok.token_text(id).unwrap()));
    let mut failures = Vec::new();
    let mut fim_cases = 0;
    for (i, c) in cases().iter().enumerate() {
        let got = tok.encode(&c.text, false).unwrap();
        let expected = if fim_like(&c.text) {
            fim_cases += 1;
            &c.llamacpp_ids_plain
        } else {
            &c.ids_plain
        };
        if &got != expected {
            failures.push(format!(
                "case {i} {:?}: got {got:?}, expected {expected:?}",
                c.text
            ));
        }
    }
    assert!(fim_cases >= 1);
    assert!(
        failures.is_empty(),
        "{} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// llama.cpp does not NFC-normalize; on every case whose text is already NFC (HF's decode
/// gives the text back unchanged) our ids equal llama.cpp's too. README §1: 16 cases differ.
#[test]
fn ids_equal_llama_cpp_where_nfc_changes_nothing() {
    let tok = tokenizer();
    let (mut compared, mut non_nfc) = (0, 0);
    for (i, c) in cases().iter().enumerate() {
        if c.decoded != c.text {
            non_nfc += 1;
            continue;
        }
        compared += 1;
        assert_eq!(
            tok.encode(&c.text, true).unwrap(),
            c.llamacpp_ids,
            "case {i}"
        );
    }
    assert_eq!((compared, non_nfc), (284, 16));
}

#[test]
fn decode_reproduces_hugging_face_and_round_trips() {
    let tok = tokenizer();
    for (i, c) in cases().iter().enumerate() {
        let decoded = tok.decode(&c.ids, false).unwrap();
        assert_eq!(decoded, c.decoded, "case {i}");
        // `decoded` is the NFC form of the text; tokenizing it again gives the same ids.
        assert_eq!(
            tok.encode(&decoded, true).unwrap(),
            c.ids,
            "case {i} re-encode"
        );
        // Streaming one id at a time gives the same text.
        let mut stream = StreamDecoder::new();
        let mut streamed = String::new();
        for &id in &c.ids {
            streamed += &stream.push(tok, id);
        }
        streamed += &stream.finish();
        assert_eq!(streamed, c.decoded, "case {i} streamed");
    }
}

#[test]
fn vocabulary_facts() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 151_936);
    assert_eq!(tok.eos_token_id(), Some(151_645));
    assert_eq!(tok.bos_token_id(), Some(151_643));
    assert_eq!(tok.padding_token_id(), Some(151_643));
    assert!(!tok.add_bos_token());
    assert_eq!(tok.stop_token_ids(), &[151_645, 151_643]);
    assert_eq!(tok.token_id("<|im_start|>"), Some(151_644));
    assert_eq!(tok.token_id("<think>"), Some(151_667));
    assert_eq!(tok.token_id("Ġthe"), Some(279));
    assert!(tok.is_special(151_645));
    assert!(!tok.is_special(151_667));
    assert!(!tok.is_special(279));
    assert_eq!(tok.token_type(151_669), Some(TokenType::Unused));
    assert_eq!(tok.token_bytes(279), b" the");
    assert_eq!(tok.token_bytes(151_644), b"<|im_start|>");
    // Padding entries are never produced from text and decode to nothing.
    let pad = tok.token_text(151_700).unwrap().to_string();
    assert!(pad.starts_with("[PAD"), "{pad}");
    assert!(!tok.encode(&pad, true).unwrap().contains(&151_700));
    assert_eq!(tok.decode(&[151_700], false).unwrap(), "");
}

#[test]
fn skip_special_drops_control_tokens_only() {
    let tok = tokenizer();
    let text = "<|im_start|>assistant\n<think>\nok\n</think>\n\nHi<|im_end|>";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(ids[0], 151_644);
    assert_eq!(*ids.last().unwrap(), 151_645);
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "assistant\n<think>\nok\n</think>\n\nHi"
    );
    let mut stream = StreamDecoder::new().with_skip_special(true);
    let streamed: String = ids.iter().map(|&id| stream.push(tok, id)).collect();
    assert_eq!(streamed, "assistant\n<think>\nok\n</think>\n\nHi");
}

#[test]
fn stream_never_emits_half_a_character() {
    let tok = tokenizer();
    let text = "🦙🦀 中文 👨‍👩‍👧‍👦 🇩🇪 ❤️ 한국어 Привет";
    let ids = tok.encode(text, true).unwrap();
    // Some emoji must indeed be split over several tokens for this test to mean anything.
    assert!(ids
        .iter()
        .any(|&id| std::str::from_utf8(&tok.token_bytes(id)).is_err()));
    let mut stream = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        let piece = stream.push(tok, id);
        assert!(
            !piece.contains('\u{fffd}'),
            "replacement char after id {id}"
        );
        out += &piece;
    }
    assert!(!stream.has_pending());
    out += &stream.finish();
    assert_eq!(out, text);
}

#[test]
fn decode_rejects_unknown_ids() {
    let tok = tokenizer();
    let err = tok.decode(&[1, 151_936], false).unwrap_err();
    assert!(err.to_string().contains("151936"), "{err}");
    let mut stream = StreamDecoder::new();
    assert!(stream.try_push(tok, u32::MAX).is_err());
    assert_eq!(stream.push(tok, u32::MAX), "");
    assert!(tok.token_bytes(u32::MAX).is_empty());
}

/// The rendered chat prompts of `chat_cases.jsonl` tokenize to HF's `rendered_ids`.
#[test]
fn rendered_chat_prompts_tokenize_like_hugging_face() {
    #[derive(Deserialize)]
    struct ChatCase {
        rendered: String,
        rendered_ids: Vec<u32>,
    }
    let path = format!("{REFERENCE}/tokenizer/chat_cases.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let tok = tokenizer();
    let mut n = 0;
    for (i, line) in text.lines().enumerate() {
        let c: ChatCase =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{path}:{}: {e}", i + 1));
        assert_eq!(
            tok.encode(&c.rendered, true).unwrap(),
            c.rendered_ids,
            "chat case {i}"
        );
        assert_eq!(
            tok.decode(&c.rendered_ids, false).unwrap(),
            c.rendered,
            "chat case {i}"
        );
        n += 1;
    }
    assert_eq!(n, 21);
}
