//! Speculative decoding in the server: with `--spec` or a request's `spec` field, the reply is
//! the same as without (text, token ids, logprobs and the hash of every logits row a token was
//! sampled from), for greedy and seeded sampling; the statistics reach the response and
//! `/metrics`. Fixture: tiny-Q8_0, which has an MTP block.

mod common;

use common::*;
use redlite_engine::spec_bench::rewrite_prompt;
use redlite_engine::speculative::{SpecConfig, SpecMode};
use serde_json::{json, Value};

/// The file-rewrite request (20 lines of held-out Python): long prompt-lookup drafts, with
/// rejections in the middle of drafts.
fn rewrite_request() -> String {
    let text = std::fs::read_to_string(HELDOUT).unwrap();
    let file: String = text
        .lines()
        .skip(27)
        .take(20)
        .collect::<Vec<_>>()
        .join("\n");
    rewrite_prompt(&file, "Add a comment line at the top.")
}

/// What must not change with speculation.
fn fingerprint(r: &Value) -> Value {
    json!({
        "text": r["choices"][0]["text"],
        "finish": r["choices"][0]["finish_reason"],
        "ids": r["redlite"]["completion_token_ids"],
        "logits": r["redlite"]["logits_fnv"],
        "logprobs": r["choices"][0]["logprobs"],
        "completion_tokens": r["usage"]["completion_tokens"],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_replies_equal_plain_ones() {
    // MTP drafts on every step without a draft from lookup (the gate's timing would decide
    // otherwise, and the checks below count drafts).
    let mut opts = options();
    opts.spec.mtp_gate = false;
    let (server, base) = start(opts).await;
    let c = client();
    let url = format!("{base}/v1/completions");
    let prompt = rewrite_request();
    let cases = [
        json!({"temperature": 0, "max_tokens": 48, "ignore_eos": true, "logprobs": 2}),
        json!({"temperature": 0.7, "top_k": 40, "top_p": 0.95, "repeat_penalty": 1.05,
               "seed": 7, "max_tokens": 40}),
    ];
    for case in cases {
        let mut req = case.clone();
        req["prompt"] = json!(prompt);
        req["return_token_ids"] = json!(true);
        let (status, plain) = post(&c, &url, &req).await;
        assert_eq!(status, 200, "{plain}");
        assert!(plain["usage"]["speculative"].is_null());
        let want = fingerprint(&plain);
        for mode in ["lookup", "mtp", "both"] {
            req["spec"] = json!(mode);
            let (status, r) = post(&c, &url, &req).await;
            assert_eq!(status, 200, "{r}");
            assert_eq!(fingerprint(&r), want, "spec {mode}, {case}");
            let s = &r["usage"]["speculative"];
            assert_eq!(s["mode"], mode, "{r}");
            let drafted = s["drafted"].as_u64().unwrap();
            let accepted = s["accepted"].as_u64().unwrap();
            assert!(accepted <= drafted);
            assert_eq!(r["timings"]["draft_n"].as_u64(), Some(drafted));
            assert_eq!(r["timings"]["draft_n_accepted"].as_u64(), Some(accepted));
            let n = r["usage"]["completion_tokens"].as_u64().unwrap();
            let passes = s["passes"].as_u64().unwrap();
            if case["temperature"] == 0 {
                // Greedy over a file rewrite: drafts are made and save passes.
                assert!(drafted > 0 && accepted > 0, "spec {mode}: {s}");
                assert!(
                    passes + accepted >= n - 1 && passes < n - 1,
                    "spec {mode}: {s}"
                );
            }
        }
        req.as_object_mut().unwrap().remove("spec");
    }

    // Streaming with speculation gives the same text.
    let req = json!({"prompt": prompt, "temperature": 0, "max_tokens": 48, "ignore_eos": true,
                     "stream": true, "spec": "both"});
    let (events, done) = post_sse(&c, &url, &req).await;
    assert!(done);
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    let (_, plain) = post(
        &c,
        &url,
        &json!({"prompt": prompt, "temperature": 0, "max_tokens": 48, "ignore_eos": true}),
    )
    .await;
    assert_eq!(streamed, plain["choices"][0]["text"].as_str().unwrap());

    // A bad mode is a 400 naming the field.
    let (status, r) = post(&c, &url, &json!({"prompt": "a", "spec": "always"})).await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(r["error"]["param"], "spec");
    assert_eq!(
        r["error"]["message"],
        "unknown speculation mode 'always' (expected off, lookup, mtp or both)"
    );
    // Also on the chat endpoint; the message does not blame the model configuration.
    let (status, r) = post(
        &c,
        &url.replace("/v1/completions", "/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "a"}], "spec": "banana"}),
    )
    .await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(r["error"]["param"], "spec");
    assert_eq!(
        r["error"]["message"],
        "unknown speculation mode 'banana' (expected off, lookup, mtp or both)"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_default_mode_and_metrics() {
    let mut opts = options();
    opts.spec = SpecConfig::with_mode(SpecMode::Both);
    let (server, base) = start(opts).await;
    let c = client();
    let url = format!("{base}/v1/completions");
    let prompt = rewrite_request();
    let req = json!({"prompt": prompt, "temperature": 0, "max_tokens": 40, "ignore_eos": true});
    let (status, r) = post(&c, &url, &req).await;
    assert_eq!(status, 200, "{r}");
    let s = &r["usage"]["speculative"];
    assert_eq!(s["mode"], "both", "{r}");
    // A request may turn it off.
    let mut off = req.clone();
    off["spec"] = json!("off");
    let (_, r2) = post(&c, &url, &off).await;
    assert!(r2["usage"]["speculative"].is_null());
    assert_eq!(r2["choices"][0]["text"], r["choices"][0]["text"]);

    let m = get_text(&c, &format!("{base}/metrics")).await;
    let value = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("redlite_{name} ")))
            .unwrap_or_else(|| panic!("no {name} in {m}"))
            .parse()
            .unwrap()
    };
    assert_eq!(value("spec_requests_total"), 1.0);
    assert_eq!(
        value("spec_draft_tokens_total"),
        s["drafted"].as_u64().unwrap() as f64
    );
    assert_eq!(
        value("spec_draft_tokens_accepted_total"),
        s["accepted"].as_u64().unwrap() as f64
    );
    assert_eq!(
        value("spec_passes_total"),
        s["passes"].as_u64().unwrap() as f64
    );
    assert_eq!(
        value("spec_mtp_left_out_passes_total"),
        s["mtp"]["left_out_passes"].as_u64().unwrap() as f64
    );
    let rate = value("spec_acceptance_rate");
    assert!(rate > 0.0 && rate <= 1.0, "{m}");
    assert!(value("spec_mean_accepted_length") > 0.0);
    assert!(value("spec_decode_tokens_per_second") > 0.0);
    server.shutdown().await;
}

/// The same on the CPU backend (multi-row kernels in the verify pass, 2 threads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_replies_equal_plain_ones_on_the_cpu_backend() {
    use redlite_engine::{load_model_from, AnyModel, BackendChoice};
    let file = std::sync::Arc::new(redlite_gguf::GgufFile::open(TINY).expect("tiny model"));
    let AnyModel::Cpu(model) = load_model_from(file, BackendChoice::Cpu, 2).expect("loads") else {
        panic!("not the CPU backend");
    };
    let server = redlite_server::start(model, options())
        .await
        .expect("starts");
    let base = format!("http://{}", server.addr());
    let c = client();
    let url = format!("{base}/v1/completions");
    let mut req = json!({"prompt": rewrite_request(), "temperature": 0, "max_tokens": 48,
                         "ignore_eos": true, "return_token_ids": true});
    let (status, plain) = post(&c, &url, &req).await;
    assert_eq!(status, 200, "{plain}");
    for mode in ["lookup", "mtp", "both"] {
        req["spec"] = json!(mode);
        let (status, r) = post(&c, &url, &req).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(fingerprint(&r), fingerprint(&plain), "spec {mode}");
        assert!(r["usage"]["speculative"]["accepted"].as_u64().unwrap() > 0);
    }
    server.shutdown().await;
}
