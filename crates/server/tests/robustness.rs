//! Hostile and malformed requests: every one gets a 4xx JSON error in OpenAI's shape, and the
//! server keeps answering.

mod common;

use common::*;
use serde_json::{json, Value};

/// Raw bodies (and content types) that must all be refused with a 4xx.
fn bad_bodies() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"{".to_vec(),
        b"}".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        b"42".to_vec(),
        b"\"messages\"".to_vec(),
        b"{\"messages\": [}".to_vec(),
        b"{\"messages\": \"hi\"}".to_vec(),
        b"{\"messages\": []}".to_vec(),
        b"{\"messages\": null}".to_vec(),
        b"{\"messages\": [1, 2]}".to_vec(),
        b"{\"messages\": [{\"role\": 5}]}".to_vec(),
        b"{\"messages\": [{\"content\": \"no role\"}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": 7}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}"
            .to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": [3]}]}".to_vec(),
        b"{\"messages\": [{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": 3}]}"
            .to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}".to_vec(),
        // Invalid UTF-8 inside a string and outside.
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
        b"\xff\xff\xff\xff".to_vec(),
        b"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"max_tokens\": 1e999}"
            .to_vec(),
        // Deep nesting (serde_json's recursion limit).
        format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
        format!("{{\"messages\": {}}}", "[".repeat(5000)).into_bytes(),
    ];
    let msg = json!([{"role": "user", "content": "hi"}]);
    let bad_fields: Vec<(&str, Value)> = vec![
        ("max_tokens", json!(0)),
        ("max_tokens", json!(-5)),
        ("max_tokens", json!("ten")),
        ("max_tokens", json!(1.5)),
        ("max_tokens", json!(1e300)),
        ("max_tokens", json!(u64::MAX)),
        ("max_tokens", json!([1])),
        ("temperature", json!(-1)),
        ("temperature", json!(99)),
        ("temperature", json!("hot")),
        ("temperature", json!(1e308)),
        ("top_p", json!(1.5)),
        ("top_p", json!(-0.1)),
        ("top_p", json!({})),
        ("top_k", json!(-3)),
        ("min_p", json!(2)),
        ("presence_penalty", json!(5)),
        ("frequency_penalty", json!(-5)),
        ("repeat_penalty", json!(-1)),
        ("repeat_penalty", json!(0)),
        ("seed", json!("abc")),
        ("seed", json!(1e40)),
        ("seed", json!(-1.5)),
        ("n", json!(3)),
        ("n", json!(0)),
        ("stop", json!(5)),
        ("stop", json!([1, 2])),
        ("stop", json!(vec!["x"; 100])),
        ("stop", json!("y".repeat(5000))),
        ("stream", json!("yes")),
        ("stream", json!(1)),
        ("logprobs", json!("true")),
        ("top_logprobs", json!(99)),
        ("top_logprobs", json!(-1)),
        ("tools", json!("all")),
        ("tools", json!(5)),
        ("tools", json!([{"type": "banana"}])),
        ("tools", json!([{"type": "function", "function": {}}])),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
        ),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "missing"}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": "x"}}),
        ),
        ("chat_template_kwargs", json!([1])),
        ("stream_options", json!("x")),
        ("model", json!(5)),
    ];
    for (k, v) in bad_fields {
        let mut body = json!({"messages": msg.clone()});
        body[k] = v;
        out.push(serde_json::to_vec(&body).unwrap());
    }
    out
}

fn bad_completion_bodies() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for p in [
        json!(null),
        json!(5),
        json!([]),
        json!([[]]),
        json!(["a", "b"]),
        json!([1, -2]),
        json!([1, 4_294_967_296u64]),
        json!([999_999]),
        json!([1.5]),
        json!({"text": "x"}),
        json!(""),
        json!([[1], [2]]),
    ] {
        out.push(serde_json::to_vec(&json!({"prompt": p, "max_tokens": 1})).unwrap());
    }
    out.push(b"{\"max_tokens\": 1}".to_vec());
    out.push(serde_json::to_vec(&json!({"prompt": "x", "logprobs": 50})).unwrap());
    out.push(
        serde_json::to_vec(&json!({"prompt": "x", "max_tokens": 1, "echo": 1, "n": 2})).unwrap(),
    );
    // A prompt longer than the context.
    out.push(serde_json::to_vec(&json!({"prompt": vec![5u32; 5000], "max_tokens": 1})).unwrap());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_4xx_and_server_survives() {
    let mut opts = options();
    opts.max_body_bytes = 256 << 10;
    let (server, base) = start(opts).await;
    let c = client();
    let chat = format!("{base}/v1/chat/completions");
    let compl = format!("{base}/v1/completions");
    let mut cases: Vec<(String, Vec<u8>, &str)> = Vec::new();
    for b in bad_bodies() {
        cases.push((chat.clone(), b.clone(), "application/json"));
        cases.push((chat.clone(), b, "text/plain"));
    }
    for b in bad_completion_bodies() {
        cases.push((compl.clone(), b.clone(), "application/json"));
        cases.push((compl.clone(), b, "application/x-www-form-urlencoded"));
    }
    // Oversized bodies (over the 256 KiB limit), valid JSON and not.
    let big = serde_json::to_vec(
        &json!({"messages": [{"role": "user", "content": "x".repeat(300_000)}]}),
    )
    .unwrap();
    cases.push((chat.clone(), big.clone(), "application/json"));
    cases.push((compl.clone(), vec![b'{'; 400_000], "application/json"));
    // Unknown paths.
    cases.push((
        format!("{base}/v1/nothing"),
        b"{}".to_vec(),
        "application/json",
    ));
    cases.push((
        format!("{base}/v1/chat/completions/../../etc/passwd"),
        b"{}".to_vec(),
        "application/json",
    ));
    // Pseudo-random byte soup (fixed seed).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..340 {
        let len = (i * 37) % 300 + 1;
        let mut b = Vec::with_capacity(len);
        for _ in 0..len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.push((x & 0xff) as u8);
        }
        if i % 3 == 0 {
            b.insert(0, b'{');
        }
        cases.push((
            if i % 2 == 0 {
                chat.clone()
            } else {
                compl.clone()
            },
            b,
            "application/json",
        ));
    }
    assert!(cases.len() >= 500, "{} cases", cases.len());

    for (url, body, ct) in &cases {
        let r = c
            .post(url)
            .header("content-type", *ct)
            .body(body.clone())
            .send()
            .await
            .expect("the server answers");
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        let preview = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
        assert!(
            (400..500).contains(&status),
            "{url} {preview:?} -> {status} {text}"
        );
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("{preview:?}: not JSON: {text}"));
        assert!(v["error"]["message"].is_string(), "{preview:?}: {v}");
        assert!(v["error"]["type"].is_string(), "{preview:?}: {v}");
    }
    // GET on a POST route, POST on a GET route.
    let r = c.get(&chat).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let r = c.post(format!("{base}/v1/models")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);

    let h = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(h.status().as_u16(), 200);
    // And a valid request still works, with unknown fields.
    let (status, v) = post(
        &c,
        &chat,
        &json!({"messages": [{"role": "developer", "content": "x"}, {"role": "user", "content": "hi"}],
                "max_tokens": 2, "temperature": 0, "foo": {"bar": [1, 2]}, "store": true}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    server.shutdown().await;
}

/// One chat request with `extra` merged into a valid body: (status, error param, message).
async fn chat_error(c: &reqwest::Client, url: &str, extra: Value) -> (u16, Value, String) {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (status, v) = post(c, url, &body).await;
    let message = v["error"]["message"].as_str().unwrap_or("").to_string();
    (status, v["error"]["param"].clone(), message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_tools_and_fields_are_named() {
    let (server, base) = start(options()).await;
    let c = client();
    let chat = format!("{base}/v1/chat/completions");
    let f = |name: Value, params: Value| json!({"type": "function", "function": {"name": name, "parameters": params}});
    let good = f(json!("read"), json!({"type": "object"}));
    // (extra fields, param, a piece of the message)
    let cases = [
        (
            json!({"tools": [{"type": "banana"}]}),
            "tools[0].type",
            "must be \"function\", got \"banana\"",
        ),
        (
            json!({"tools": [good, {"type": "function", "function": {}}]}),
            "tools[1].function.name",
            "must be a non-empty string",
        ),
        (
            json!({"tools": [f(json!(""), json!({}))]}),
            "tools[0].function.name",
            "non-empty string",
        ),
        (
            json!({"tools": [f(json!(7), json!({}))]}),
            "tools[0].function.name",
            "non-empty string",
        ),
        (
            json!({"tools": [{"type": "function", "function": "read"}]}),
            "tools[0].function",
            "must be an object",
        ),
        (json!({"tools": [3]}), "tools[0]", "must be an object"),
        (
            json!({"tools": [f(json!("read"), json!("notaschema"))]}),
            "tools[0].function.parameters",
            "must be a JSON Schema object",
        ),
        (
            json!({"tools": [good], "tool_choice": {"type": "function", "function": {"name": "missing"}}}),
            "tool_choice",
            "'missing', which is not in 'tools'",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "missing"}}}),
            "tool_choice",
            "'missing', which is not in 'tools'",
        ),
        (
            json!({"tools": [good], "tool_choice": {"type": "function"}}),
            "tool_choice",
            "'tool_choice.function.name' must be a string",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}),
            "response_format",
            "'response_format.json_schema.schema' must be a JSON Schema object",
        ),
        (
            json!({"repeat_penalty": 0}),
            "repeat_penalty",
            "must be greater than 0 and at most 10, got 0",
        ),
        (
            json!({"repeat_penalty": -0.5}),
            "repeat_penalty",
            "must be greater than 0 and at most 10, got -0.5",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content",
            "'messages[0].content': a text part has no 'text' string",
        ),
        (
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
            "'messages[0].content' must be a string or a list of text parts",
        ),
    ];
    for (extra, param, msg) in cases {
        let (status, p, m) = chat_error(&c, &chat, extra.clone()).await;
        assert_eq!(status, 400, "{extra}: {m}");
        assert_eq!(p, param, "{extra}: {m}");
        assert!(m.contains(msg), "{extra}: {m:?} lacks {msg:?}");
    }
    // Still accepted: a tool with no schema or a null one, a flat function tool, a
    // tool_choice naming a given function, an object schema in response_format, a small
    // repeat_penalty.
    let ok = [
        json!({"tools": [{"type": "function", "function": {"name": "read"}}]}),
        json!({"tools": [f(json!("read"), Value::Null)]}),
        json!({"tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]}),
        json!({"tools": [good], "tool_choice": {"type": "function", "function": {"name": "read"}}}),
        json!({"tools": [good], "tool_choice": "required"}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"repeat_penalty": 0.01}),
    ];
    for extra in ok {
        let (status, _, m) = chat_error(&c, &chat, extra.clone()).await;
        assert_eq!(status, 200, "{extra}: {m}");
    }
    server.shutdown().await;
}
