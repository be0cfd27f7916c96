//! Tool calls and streaming with exact expected output, using the replay switch (the model's
//! replies are given, not sampled).

mod common;

use common::*;
use serde_json::{json, Value};

const XML_CALL: &str = "Let me check.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>";
const JSON_CALLS: &str = "<tool_call>\n{\"name\": \"grep\", \"arguments\": {\"pattern\": \"fn main\", \"count\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"é.rs\"}}\n</tool_call>";
const FINAL: &str = "The file is fine. ✓";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["path"]}}},
        {"type": "function", "function": {"name": "grep", "description": "Search",
            "parameters": {"type": "object", "properties": {
                "pattern": {"type": "string"}, "count": {"type": "integer"}}}}}
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_tool_calls_parse_and_stream_exactly() {
    let mut opts = options();
    opts.replay = vec![
        XML_CALL.to_string(),
        JSON_CALLS.to_string(),
        FINAL.to_string(),
        XML_CALL.to_string(),
    ];
    let (server, base) = start(opts).await;
    let c = client();
    let chat = format!("{base}/v1/chat/completions");
    let mut messages = vec![json!({"role": "user", "content": "Check src/main.rs"})];

    // 1. XML form, not streamed.
    let (status, r) = post(&c, &chat, &json!({"messages": messages, "tools": tools()})).await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Let me check.\n");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "read_file");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"path": "src/main.rs", "limit": 40}));
    messages.push(choice["message"].clone());
    messages
        .push(json!({"role": "tool", "tool_call_id": calls[0]["id"], "content": "fn main() {}"}));

    // 2. Two JSON-form calls, streamed: one delta per call, indices 0 and 1.
    let (events, done) = post_sse(
        &c,
        &chat,
        &json!({"messages": messages, "tools": tools(), "stream": true}),
    )
    .await;
    assert!(done);
    let deltas: Vec<&Value> = events.iter().map(|e| &e["choices"][0]["delta"]).collect();
    let calls: Vec<&Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 2, "{events:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[1]["index"], 1);
    assert_eq!(calls[0]["function"]["name"], "grep");
    assert_eq!(calls[1]["function"]["name"], "read_file");
    let a0: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(a0, json!({"pattern": "fn main", "count": 2}));
    let a1: Value =
        serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(a1, json!({"path": "é.rs"}));
    assert!(calls[0]["id"].as_str().unwrap() != calls[1]["id"].as_str().unwrap());
    let content: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    assert_eq!(
        content, "\n",
        "only the newline between the calls is content"
    );
    let fin: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str().map(|_| e))
        .collect();
    assert_eq!(fin.len(), 1);
    assert_eq!(fin[0]["choices"][0]["finish_reason"], "tool_calls");

    // 3. Plain text, streamed: the exact text arrives, ending with finish_reason "stop".
    let (events, done) = post_sse(
        &c,
        &chat,
        &json!({"messages": messages, "tools": tools(), "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await;
    assert!(done);
    let content: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, FINAL);
    let last = events.last().unwrap();
    assert!(last["usage"]["completion_tokens"].as_u64().unwrap() > 3);

    // 4. tool_choice "none": the tool-call text is left as content.
    let (status, r) = post(
        &c,
        &chat,
        &json!({"messages": messages, "tools": tools(), "tool_choice": "none"}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["content"], XML_CALL);
    assert!(r["choices"][0]["message"]["tool_calls"].is_null());
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_cancels_generation() {
    let (server, base) = start(options()).await;
    let c = client();
    // A long generation, streamed; drop the response after the first event.
    let resp = c
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "Once upon a time", "max_tokens": 3000, "temperature": 1, "ignore_eos": true,
                      "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    drop(resp);
    // The worker notices and the next request is served promptly.
    let t = std::time::Instant::now();
    let (status, _) = post(
        &c,
        &format!("{base}/v1/completions"),
        &json!({"prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    assert!(t.elapsed().as_secs_f64() < 10.0, "took {:?}", t.elapsed());
    let m = get_text(&c, &format!("{base}/metrics")).await;
    assert!(m.contains("redlite_requests_cancelled_total 1"), "{m}");
    server.shutdown().await;
}
