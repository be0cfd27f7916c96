//! The OpenAI endpoints end to end against the tiny model.

mod common;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_chat_and_completions() {
    let (server, base) = start(options()).await;
    let c = client();

    let h: Value = get_json(&c, &format!("{base}/health")).await;
    assert_eq!(h["status"], "ok");
    let m: Value = get_json(&c, &format!("{base}/v1/models")).await;
    assert_eq!(m["object"], "list");
    let model_id = m["data"][0]["id"].as_str().unwrap().to_string();

    // Non-streaming chat, greedy, with unknown fields that real clients send.
    let req = json!({
        "model": model_id,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
        "max_tokens": 12, "temperature": 0, "seed": 1,
        "stream_options": null, "store": false, "parallel_tool_calls": true,
        "metadata": {"x": 1}, "user": "u", "logit_bias": {},
    });
    let (status, r) = post(&c, &format!("{base}/v1/chat/completions"), &req).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    let text = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let usage = &r["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
    let n = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=12).contains(&n));
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + n
    );
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
    let finish = r["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(finish == "stop" || finish == "length");
    if n == 12 {
        assert_eq!(finish, "length");
    }

    // The same request streamed gives the same text (greedy).
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let (events, done) = post_sse(&c, &format!("{base}/v1/chat/completions"), &sreq).await;
    assert!(done);
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let last = events.last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_eq!(last["usage"]["completion_tokens"].as_u64().unwrap(), n);
    let fin: Vec<&Value> = events
        .iter()
        .filter(|e| {
            !e["choices"][0]["finish_reason"].is_null()
                && e["choices"].as_array().is_some_and(|a| !a.is_empty())
        })
        .collect();
    assert_eq!(fin.len(), 1);
    assert_eq!(fin[0]["choices"][0]["finish_reason"], finish);

    // Completions with a text prompt and with token ids, and logprobs.
    let (status, r) = post(
        &c,
        &format!("{base}/v1/completions"),
        &json!({"prompt": "The", "max_tokens": 5, "temperature": 0, "logprobs": 2, "return_token_ids": true}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    let ids = r["redlite"]["prompt_token_ids"].clone();
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(
        lp["tokens"].as_array().unwrap().len(),
        r["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    assert!(lp["token_logprobs"][0].as_f64().unwrap() <= 0.0);
    let (status, r2) = post(
        &c,
        &format!("{base}/v1/completions"),
        &json!({"prompt": ids, "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{r2}");
    assert_eq!(r2["choices"][0]["text"], r["choices"][0]["text"]);

    // Stop strings: the text ends before the stop string.
    let full = r["choices"][0]["text"].as_str().unwrap().to_string();
    if let Some(cut) = full.char_indices().nth(2).map(|(i, _)| i) {
        let stop = full[cut..].chars().take(2).collect::<String>();
        if !stop.trim().is_empty() {
            let (_, r3) = post(
                &c,
                &format!("{base}/v1/completions"),
                &json!({"prompt": "The", "max_tokens": 5, "temperature": 0, "stop": [stop.clone()]}),
            )
            .await;
            let t = r3["choices"][0]["text"].as_str().unwrap();
            assert!(!t.contains(&stop), "{t:?} contains {stop:?}");
            assert!(full.starts_with(t));
            assert_eq!(r3["choices"][0]["finish_reason"], "stop");
        }
    }

    // Metrics.
    let m = get_text(&c, &format!("{base}/metrics")).await;
    assert!(m.contains("redlite_requests_total"));
    assert!(m.contains("redlite_queue_depth "));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_enforced() {
    let mut opts = options();
    opts.api_key = Some("sekrit".into());
    let (server, base) = start(opts).await;
    let c = client();
    let body = json!({"prompt": "a", "max_tokens": 1});
    let r = c
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
    let r = c
        .post(format!("{base}/v1/completions"))
        .bearer_auth("sekrit")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // /health needs no key.
    let r = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    server.shutdown().await;
}
