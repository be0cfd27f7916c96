//! Bad or unsupported tokenizer metadata gives clear errors, never a panic. The GGUF files are
//! built in memory with `GgufWriter`.

use redlite_gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use redlite_tokenizer::tokenizer::{Tokenizer, TokenizerError, VocabData};

/// The 256 gpt2 byte-level symbols, in byte order.
fn byte_symbols() -> Vec<String> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let code = if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
                u32::from(b)
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(code).unwrap().to_string()
        })
        .collect()
}

/// A tiny valid vocabulary: 256 byte symbols, `he`, `hel`, `hello`, `<|end|>` (control),
/// `<x>` (user-defined) and `[PAD]` (unused).
fn tiny_vocab() -> VocabData {
    let mut tokens = byte_symbols();
    let mut types = vec![1; 256];
    for (t, ty) in [
        ("he", 1),
        ("ll", 1),
        ("hell", 1),
        ("hello", 1),
        ("<|end|>", 3),
        ("<x>", 4),
        ("[PAD]", 5),
    ] {
        tokens.push(t.to_string());
        types.push(ty);
    }
    VocabData {
        model: "gpt2".into(),
        pre: Some("qwen2".into()),
        tokens,
        token_types: Some(types),
        merges: vec!["h e".into(), "l l".into(), "he ll".into(), "hell o".into()],
        eos_token_id: Some(260),
        bos_token_id: None,
        padding_token_id: None,
        add_bos_token: false,
    }
}

fn to_gguf(v: &VocabData) -> GgufFile {
    let mut w = GgufWriter::new();
    let mut kv = |k: &str, val: MetaValue| w.add_kv(k, val).unwrap();
    kv(
        "general.architecture",
        MetaValue::String("qwen3next".into()),
    );
    kv("tokenizer.ggml.model", MetaValue::String(v.model.clone()));
    if let Some(pre) = &v.pre {
        kv("tokenizer.ggml.pre", MetaValue::String(pre.clone()));
    }
    kv(
        "tokenizer.ggml.tokens",
        MetaValue::Array(MetaArray::String(v.tokens.clone())),
    );
    if let Some(t) = &v.token_types {
        kv(
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(t.clone())),
        );
    }
    kv(
        "tokenizer.ggml.merges",
        MetaValue::Array(MetaArray::String(v.merges.clone())),
    );
    if let Some(eos) = v.eos_token_id {
        kv("tokenizer.ggml.eos_token_id", MetaValue::U32(eos));
    }
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

fn build_err(v: VocabData) -> TokenizerError {
    Tokenizer::from_gguf(&to_gguf(&v)).unwrap_err()
}

#[test]
fn tiny_vocabulary_works() {
    let tok = Tokenizer::from_gguf(&to_gguf(&tiny_vocab())).unwrap();
    // Ids: 256 he, 257 ll, 258 hell, 259 hello, 260 <|end|>, 261 <x>, 262 [PAD].
    assert_eq!(tok.encode("hello", true).unwrap(), [259]);
    assert_eq!(tok.encode("hello<|end|>", true).unwrap(), [259, 260]);
    assert_eq!(
        tok.encode("<x>hello<|end|>", false).unwrap()[..2],
        [261, 259]
    );
    assert!(tok.encode("<|end|>", false).unwrap().len() > 1);
    assert!(!tok.encode("[PAD]", true).unwrap().contains(&262));
    assert_eq!(tok.encode("", true).unwrap(), Vec::<u32>::new());
    assert_eq!(tok.decode(&[259, 260, 262], false).unwrap(), "hello<|end|>");
    assert_eq!(tok.decode(&[259, 260, 262, 261], true).unwrap(), "hello<x>");
    assert_eq!(tok.stop_token_ids(), &[260]);
}

#[test]
fn unsupported_model_is_rejected() {
    let mut v = tiny_vocab();
    v.model = "llama".into();
    let e = build_err(v);
    assert!(
        matches!(e, TokenizerError::UnsupportedModel(ref m) if m == "llama"),
        "{e}"
    );
    assert!(e.to_string().contains("gpt2"), "{e}");
}

#[test]
fn unsupported_or_missing_pre_tokenizer_is_rejected() {
    let mut v = tiny_vocab();
    v.pre = Some("llama-bpe".into());
    let e = build_err(v);
    assert!(e.to_string().contains("llama-bpe"), "{e}");
    let mut v = tiny_vocab();
    v.pre = None;
    assert!(matches!(
        build_err(v),
        TokenizerError::UnsupportedPreTokenizer(_)
    ));
}

#[test]
fn missing_keys_name_the_key() {
    let mut w = GgufWriter::new();
    w.add_kv("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .unwrap();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let e = Tokenizer::from_gguf(&file).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.tokens"), "{e}");

    let file = GgufFile::from_bytes(GgufWriter::new().to_bytes().unwrap()).unwrap();
    let e = Tokenizer::from_gguf(&file).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.model"), "{e}");
}

#[test]
fn wrong_value_type_is_an_error() {
    let v = tiny_vocab();
    let mut w = GgufWriter::new();
    w.add_kv("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .unwrap();
    w.add_kv("tokenizer.ggml.pre", MetaValue::String("qwen2".into()))
        .unwrap();
    w.add_kv(
        "tokenizer.ggml.tokens",
        MetaValue::Array(MetaArray::String(v.tokens)),
    )
    .unwrap();
    w.add_kv("tokenizer.ggml.merges", MetaValue::U32(3))
        .unwrap();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let e = Tokenizer::from_gguf(&file).unwrap_err();
    assert!(e.to_string().contains("tokenizer.ggml.merges"), "{e}");
}

#[test]
fn inconsistent_metadata_is_rejected() {
    let mut v = tiny_vocab();
    v.token_types.as_mut().unwrap().pop();
    assert!(matches!(
        build_err(v),
        TokenizerError::TokenTypeCount { .. }
    ));

    let mut v = tiny_vocab();
    v.token_types.as_mut().unwrap()[7] = 9;
    assert!(matches!(
        build_err(v),
        TokenizerError::InvalidTokenType { id: 7, value: 9 }
    ));

    let mut v = tiny_vocab();
    v.merges.push("nospace".into());
    assert!(matches!(
        build_err(v),
        TokenizerError::InvalidMerge { index: 4, .. }
    ));

    let mut v = tiny_vocab();
    v.merges.push("x yz".into()); // "xyz" is not a token
    assert!(matches!(build_err(v), TokenizerError::Build(_)));

    let mut v = tiny_vocab();
    v.eos_token_id = Some(100_000);
    assert!(matches!(
        build_err(v),
        TokenizerError::SpecialIdOutOfRange { name: "eos", .. }
    ));

    let mut v = tiny_vocab();
    v.tokens[b'a' as usize] = "aa".into();
    assert!(matches!(
        build_err(v),
        TokenizerError::MissingByteToken(b'a', 'a')
    ));
}
