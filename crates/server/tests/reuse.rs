//! State reuse across turns: the second turn of a long conversation computes only its new tokens
//! (plus at most one prefill chunk), and its output and logits are bit-identical to a fresh
//! server computing the same token sequence in one pass.

mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_resumes_and_matches_a_fresh_server() {
    let (server, base) = start(options()).await;
    let c = client();
    let chat = format!("{base}/v1/chat/completions");
    let user1 = heldout(8000);
    let turn1 = json!({
        "messages": [{"role": "user", "content": user1}],
        "max_tokens": 24, "temperature": 0, "return_token_ids": true,
    });
    let (status, r1) = post(&c, &chat, &turn1).await;
    assert_eq!(status, 200, "{r1}");
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(p1 >= 2000, "first prompt has only {p1} tokens");
    assert_eq!(r1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply1 = r1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let ids1: Vec<u64> = serde_json::from_value(r1["redlite"]["prompt_token_ids"].clone()).unwrap();
    let gen1: Vec<u64> =
        serde_json::from_value(r1["redlite"]["completion_token_ids"].clone()).unwrap();

    // Turn 2 re-sends the whole conversation.
    let turn2 = json!({
        "messages": [{"role": "user", "content": user1},
                     {"role": "assistant", "content": reply1},
                     {"role": "user", "content": "Now say it again, shorter."}],
        "max_tokens": 16, "temperature": 0, "return_token_ids": true, "logprobs": true, "top_logprobs": 3,
    });
    let (status, r2) = post(&c, &chat, &turn2).await;
    assert_eq!(status, 200, "{r2}");
    let ids2: Vec<u64> = serde_json::from_value(r2["redlite"]["prompt_token_ids"].clone()).unwrap();
    let p2 = r2["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let cached2 = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    assert_eq!(ids2.len(), p2);
    // The re-sent reply maps to the exact ids the model generated.
    let mut conv1 = ids1.clone();
    conv1.extend(&gen1);
    assert_eq!(
        &ids2[..conv1.len()],
        &conv1[..],
        "turn 2 does not extend turn 1's ids"
    );
    // New tokens: everything after the first turn's prompt and reply (the reply's stop token,
    // if it ended on one, is part of the cached conversation).
    let finished_on_stop = r1["choices"][0]["finish_reason"] == "stop";
    let old = conv1.len() + usize::from(finished_on_stop);
    let new_tokens = p2 - old;
    let computed = p2 - cached2;
    assert!(
        computed <= new_tokens + 64,
        "turn 2 computed {computed} prompt tokens for {new_tokens} new ones"
    );
    assert!(
        cached2 > 0 && cached2.is_multiple_of(64),
        "cached {cached2}"
    );

    // A fresh server given the same token sequence computes it in one pass.
    let (fresh, fbase) = start(options()).await;
    let (status, f) = post(
        &c,
        &format!("{fbase}/v1/completions"),
        &json!({"prompt": ids2, "max_tokens": 16, "temperature": 0, "return_token_ids": true, "logprobs": 3}),
    )
    .await;
    assert_eq!(status, 200, "{f}");
    assert_eq!(f["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        f["redlite"]["completion_token_ids"], r2["redlite"]["completion_token_ids"],
        "generated ids differ"
    );
    assert_eq!(
        f["redlite"]["logits_fnv"], r2["redlite"]["logits_fnv"],
        "logits are not bit-identical"
    );
    // Log-probabilities agree exactly too.
    let warm: Vec<f64> = r2["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap())
        .collect();
    let cold: Vec<f64> = f["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(warm, cold);
    let fresh_text = f["choices"][0]["text"].as_str().unwrap();
    assert_eq!(
        r2["choices"][0]["message"]["content"].as_str().unwrap(),
        fresh_text
    );

    // Turn 2 again (a retry): resumed from the checkpoint at or before its last token.
    let (_, r3) = post(&c, &chat, &turn2).await;
    let cached3 = r3["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    assert!(p2 - cached3 <= 64, "retry computed {} tokens", p2 - cached3);
    assert_eq!(r3["redlite"]["logits_fnv"], r2["redlite"]["logits_fnv"]);

    let m = get_text(&c, &format!("{base}/metrics")).await;
    assert!(m.contains("redlite_prompt_cache_hits_total 2"), "{m}");
    fresh.shutdown().await;
    server.shutdown().await;
}
