//! Anthropic Messages API with replayed model turns: tool_use blocks, tool_result round trip,
//! the SSE event sequence and error shapes.

mod common;

use common::*;
use serde_json::{json, Value};

const CALL: &str = "I will read it.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/lib.rs\n</parameter>\n</function>\n</tool_call>";
const FINAL: &str = "It defines the server.";

fn tools() -> Value {
    json!([{"name": "read_file", "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_tool_use_round_trip_and_stream() {
    let mut opts = options();
    opts.replay = vec![CALL.into(), FINAL.into(), CALL.into()];
    let (server, base) = start(opts).await;
    let c = client();
    let url = format!("{base}/v1/messages");
    let mut messages = vec![json!({"role": "user", "content": "What is in src/lib.rs?"})];

    let (status, r) = post(
        &c,
        &url,
        &json!({"model": "x", "max_tokens": 200, "system": "You are terse.",
                "messages": messages, "tools": tools(), "metadata": {"user_id": "u"}}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["type"], "message");
    assert_eq!(r["stop_reason"], "tool_use");
    let content = r["content"].as_array().unwrap();
    assert_eq!(
        content[0],
        json!({"type": "text", "text": "I will read it.\n"})
    );
    assert_eq!(content[1]["type"], "tool_use");
    assert_eq!(content[1]["name"], "read_file");
    assert_eq!(content[1]["input"], json!({"path": "src/lib.rs"}));
    assert!(r["usage"]["input_tokens"].as_u64().unwrap() > 0);
    let tool_id = content[1]["id"].clone();
    messages.push(json!({"role": "assistant", "content": content}));
    messages.push(json!({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": tool_id, "content": "pub mod server;"}]}));

    // Streamed final answer: the exact event sequence.
    let resp = c
        .post(&url)
        .json(&json!({"max_tokens": 200, "messages": messages, "tools": tools(), "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let body = resp.text().await.unwrap();
    let mut names = Vec::new();
    let mut text = String::new();
    let mut stop_reason = Value::Null;
    let mut cached = 0;
    for block in body.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = "";
        let mut data = Value::Null;
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n;
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = serde_json::from_str(d).unwrap();
            }
        }
        assert_eq!(data["type"], name, "{block}");
        names.push(name.to_string());
        match name {
            "message_start" => {
                cached = data["message"]["usage"]["cache_read_input_tokens"]
                    .as_u64()
                    .unwrap()
            }
            "content_block_delta" => text.push_str(data["delta"]["text"].as_str().unwrap()),
            "message_delta" => stop_reason = data["delta"]["stop_reason"].clone(),
            _ => {}
        }
    }
    assert_eq!(
        names,
        ["message_start", "ping", "content_block_start"]
            .iter()
            .chain(std::iter::repeat_n(&"content_block_delta", names.len() - 6))
            .chain(["content_block_stop", "message_delta", "message_stop"].iter())
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
    );
    assert_eq!(text, FINAL);
    assert_eq!(stop_reason, "end_turn");
    // The first turn's conversation was resumed (short here, so possibly nothing aligned).
    let _ = cached;

    // Streamed tool use.
    let resp = c
        .post(&url)
        .json(
            &json!({"max_tokens": 200, "messages": [{"role": "user", "content": "again"}],
                      "tools": tools(), "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let body = resp.text().await.unwrap();
    assert!(body.contains("\"type\":\"tool_use\""), "{body}");
    assert!(body.contains("\"type\":\"input_json_delta\""), "{body}");
    assert!(body.contains("\"stop_reason\":\"tool_use\""), "{body}");

    // Errors in Anthropic's shape.
    let (status, e) = post(
        &c,
        &url,
        &json!({"messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(e["type"], "error");
    assert_eq!(e["error"]["type"], "invalid_request_error");
    let (status, e) = post(
        &c,
        &url,
        &json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
    )
    .await;
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["type"], "error");

    let (status, n) = post(
        &c,
        &format!("{base}/v1/messages/count_tokens"),
        &json!({"messages": [{"role": "user", "content": "hello"}]}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(n["input_tokens"].as_u64().unwrap() > 1);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_invalid_fields_are_named() {
    let (server, base) = start(options()).await;
    let c = client();
    let url = format!("{base}/v1/messages");
    let user = |content: Value| json!([{"role": "user", "content": content}]);
    // (extra fields over a valid request, a piece of the message)
    let cases = [
        (
            json!({"tools": [{"input_schema": {}}]}),
            "'tools[0].name' must be a non-empty string",
        ),
        (
            json!({"tools": [{"name": ""}]}),
            "'tools[0].name' must be a non-empty string",
        ),
        (
            json!({"tools": [{"name": "read", "input_schema": "x"}]}),
            "'tools[0].input_schema' must be a JSON Schema object",
        ),
        (
            json!({"tools": tools(), "tool_choice": {"type": "tool", "name": "missing"}}),
            "'tool_choice' names the tool 'missing', which is not in 'tools'",
        ),
        (
            json!({"tool_choice": {"type": "tool", "name": "read_file"}}),
            "not in 'tools'",
        ),
        (
            json!({"system": 5}),
            "'system' must be a string or a list of text parts",
        ),
        (
            json!({"system": [{"type": "text"}]}),
            "'system': a text part has no 'text' string",
        ),
        (
            json!({"messages": user(json!([{"type": "text"}]))}),
            "'messages[0].content[0]': a text block has no 'text' string",
        ),
        (
            json!({"messages": user(json!([{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]}]))}),
            "'messages[0].content[0].content': a text part has no 'text' string",
        ),
        (
            json!({"messages": user(json!([{"type": "tool_result", "tool_use_id": "t", "content": 5}]))}),
            "'messages[0].content[0].content' must be a string or a list of text parts",
        ),
        (
            json!({"spec": "banana"}),
            "unknown speculation mode 'banana' (expected off, lookup, mtp or both)",
        ),
        (
            json!({"repeat_penalty": 0}),
            "'repeat_penalty' must be greater than 0",
        ),
    ];
    for (extra, msg) in cases {
        let mut body = json!({"max_tokens": 1, "messages": user(json!("hi"))});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, e) = post(&c, &url, &body).await;
        assert_eq!(status, 400, "{extra}: {e}");
        assert_eq!(e["type"], "error");
        assert_eq!(e["error"]["type"], "invalid_request_error");
        let m = e["error"]["message"].as_str().unwrap();
        assert!(m.contains(msg), "{extra}: {m:?} lacks {msg:?}");
        assert!(!m.contains("model configuration"), "{m}");
    }
    // Still accepted: a tool without a schema, a tool_choice naming a given tool.
    for extra in [
        json!({"tools": [{"name": "read"}]}),
        json!({"tools": tools(), "tool_choice": {"type": "tool", "name": "read_file"}}),
        json!({"tools": tools(), "tool_choice": {"type": "any"}}),
    ] {
        let mut body = json!({"max_tokens": 1, "messages": user(json!("hi"))});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, r) = post(&c, &url, &body).await;
        assert_eq!(status, 200, "{extra}: {r}");
    }
    server.shutdown().await;
}
