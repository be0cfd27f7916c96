//! Renders the reference chat cases (transformers `apply_chat_template` output) with the Qwen3
//! template and requires byte-exact equality.

use redlite_gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
use redlite_tokenizer::chat_template::{ChatTemplate, ChatTemplateError, RenderOptions};
use serde_json::{json, Value};

const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/reference");

/// Opens a GGUF file under the reference folder and compiles its chat template.
fn template_from(rel: &str) -> ChatTemplate {
    let path = format!("{REFERENCE}/{rel}");
    let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    ChatTemplate::from_gguf(&gguf).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Converts a case's `kwargs` object to [`RenderOptions`].
fn options(kwargs: &Value) -> RenderOptions {
    let mut opts = RenderOptions::default();
    for (k, v) in kwargs.as_object().expect("kwargs is an object") {
        match k.as_str() {
            "add_generation_prompt" => opts.add_generation_prompt = v.as_bool().unwrap(),
            "enable_thinking" => opts.enable_thinking = v.as_bool(),
            "tools" => opts.tools = Some(v.clone()),
            _ => {
                opts.extra.insert(k.clone(), v.clone());
            }
        }
    }
    opts
}

#[test]
fn qwen3_chat_cases_render_byte_exact() {
    let path = format!("{REFERENCE}/tokenizer/chat_cases.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let tmpl = template_from("tokenizer/qwen3-vocab.gguf");
    assert_eq!(tmpl.eos_token(), Some("<|im_end|>"));
    let mut n = 0;
    let mut failures = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let case: Value = serde_json::from_str(line).unwrap();
        let want = case["rendered"].as_str().unwrap();
        let got = tmpl
            .render(&case["messages"], &options(&case["kwargs"]))
            .unwrap_or_else(|e| panic!("case {i}: {e}"));
        if got != want {
            failures.push(format!("case {i}:\n--- want\n{want:?}\n--- got\n{got:?}"));
        }
        n += 1;
    }
    assert_eq!(n, 21, "expected 21 chat cases");
    assert!(
        failures.is_empty(),
        "{} of {n} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// README §2/§3: prompt P3 is the ChatML render of a system + user message with
/// `add_generation_prompt=true`; every small model carries that template.
#[test]
fn small_model_chatml_renders_prompt_p3() {
    let prompts_path = format!("{REFERENCE}/logits/prompts.json");
    let prompts: Value = serde_json::from_str(
        &std::fs::read_to_string(&prompts_path).unwrap_or_else(|e| panic!("{prompts_path}: {e}")),
    )
    .unwrap();
    let want = prompts["P3"]["text"].as_str().expect("P3 text");
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant that writes short, correct code."},
        {"role": "user", "content": "Write a Python function that returns the sum of the squares of a list of integers, and explain it in one sentence."}
    ]);
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let dir = format!("{REFERENCE}/models");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("tiny-") && n.ends_with(".gguf"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 9,
        "expected the tiny-*.gguf models, found {files:?}"
    );
    for name in &files {
        let tmpl = template_from(&format!("models/{name}"));
        assert_eq!(tmpl.eos_token(), Some("<|im_end|>"), "{name}");
        let got = tmpl.render(&messages, &opts).unwrap();
        assert_eq!(got, want, "{name}");
        // Without the generation prompt the assistant header is absent.
        let plain = tmpl.render(&messages, &RenderOptions::default()).unwrap();
        assert_eq!(format!("{plain}<|im_start|>assistant\n"), want, "{name}");
    }
}

/// Builds an in-memory GGUF holding only the given metadata.
fn gguf_with(kvs: Vec<(&str, MetaValue)>) -> GgufFile {
    let mut w = GgufWriter::new();
    w.add_kv(
        "general.architecture",
        MetaValue::String("qwen3next".into()),
    )
    .unwrap();
    for (k, v) in kvs {
        w.add_kv(k, v).unwrap();
    }
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

#[test]
fn gguf_metadata_errors_are_clear() {
    // No template at all.
    let err = ChatTemplate::from_gguf(&gguf_with(vec![])).unwrap_err();
    assert!(
        matches!(err, ChatTemplateError::MissingTemplate(_)),
        "{err}"
    );
    assert!(err.to_string().contains("tokenizer.chat_template"), "{err}");
    // Template of the wrong type.
    let err = ChatTemplate::from_gguf(&gguf_with(vec![(
        "tokenizer.chat_template",
        MetaValue::U32(1),
    )]))
    .unwrap_err();
    assert!(matches!(err, ChatTemplateError::Gguf(_)), "{err}");
    // EOS id past the end of the token list.
    let tokens = MetaValue::Array(MetaArray::String(vec!["a".into(), "b".into()]));
    let err = ChatTemplate::from_gguf(&gguf_with(vec![
        (
            "tokenizer.chat_template",
            MetaValue::String("{{ eos_token }}".into()),
        ),
        ("tokenizer.ggml.tokens", tokens.clone()),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(7)),
    ]))
    .unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    // A template that does not compile reports its line.
    let err = ChatTemplate::from_gguf(&gguf_with(vec![(
        "tokenizer.chat_template",
        MetaValue::String("ok\n{% for %}".into()),
    )]))
    .unwrap_err();
    assert!(
        matches!(err, ChatTemplateError::Syntax { line: Some(2), .. }),
        "{err}"
    );
    // Token strings reach the template.
    let t = ChatTemplate::from_gguf(&gguf_with(vec![
        (
            "tokenizer.chat_template",
            MetaValue::String("{{ bos_token }}|{{ eos_token }}".into()),
        ),
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.bos_token_id", MetaValue::U32(0)),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(1)),
    ]))
    .unwrap();
    assert_eq!(
        t.render(&json!([]), &RenderOptions::default()).unwrap(),
        "a|b"
    );
}

/// End to end: the rendered prompt tokenizes (special tokens parsed) to the reference ids.
#[test]
fn qwen3_chat_cases_tokenize_to_reference_ids() {
    let path = format!("{REFERENCE}/tokenizer/qwen3-vocab.gguf");
    let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let tmpl = ChatTemplate::from_gguf(&gguf).unwrap();
    let tokenizer = redlite_tokenizer::tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
    let cases = format!("{REFERENCE}/tokenizer/chat_cases.jsonl");
    let text = std::fs::read_to_string(&cases).unwrap_or_else(|e| panic!("{cases}: {e}"));
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let case: Value = serde_json::from_str(line).unwrap();
        let want: Vec<u32> = serde_json::from_value(case["rendered_ids"].clone()).unwrap();
        let rendered = tmpl
            .render(&case["messages"], &options(&case["kwargs"]))
            .unwrap();
        let got = tokenizer.encode(&rendered, true).unwrap();
        assert_eq!(got, want, "case {i}");
    }
}
