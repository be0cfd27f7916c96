//! Test helpers: start a real server on 127.0.0.1 (ephemeral port) with the tiny fixture model.
#![allow(dead_code)]

use redlite_model::Model;
use redlite_server::{Server, ServerOptions};
use serde_json::Value;

pub const TINY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/reference/models/tiny-Q8_0.gguf"
);
pub const HELDOUT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/reference/logits/heldout.txt"
);

pub fn options() -> ServerOptions {
    ServerOptions {
        port: 0,
        ..ServerOptions::default()
    }
}

pub async fn start(opts: ServerOptions) -> (Server, String) {
    let model = Model::load(TINY).expect("loading the tiny model");
    let server = redlite_server::start(model, opts).await.expect("starting");
    let base = format!("http://{}", server.addr());
    (server, base)
}

pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// GET; returns the body as text.
pub async fn get_text(c: &reqwest::Client, url: &str) -> String {
    let r = c.get(url).send().await.expect("request");
    r.text().await.expect("body")
}

/// GET; returns the body parsed as JSON.
pub async fn get_json(c: &reqwest::Client, url: &str) -> Value {
    let r = c.get(url).send().await.expect("request");
    r.json().await.expect("JSON body")
}

/// POST JSON; returns the status and the body parsed as JSON.
pub async fn post(c: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = c.post(url).json(body).send().await.expect("request");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    (status, v)
}

/// POST with `stream: true`; returns the `data:` payloads (without the final `[DONE]`) and
/// whether `[DONE]` came.
pub async fn post_sse(c: &reqwest::Client, url: &str, body: &Value) -> (Vec<Value>, bool) {
    let r = c.post(url).json(body).send().await.expect("request");
    assert_eq!(r.status().as_u16(), 200, "streaming request failed");
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
    let text = r.text().await.expect("body");
    let mut events = Vec::new();
    let mut done = false;
    for line in text.lines() {
        let Some(d) = line
            .strip_prefix("data: ")
            .or_else(|| line.strip_prefix("data:"))
        else {
            continue;
        };
        if d.trim() == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(d).unwrap_or_else(|_| panic!("bad event {d}")));
        }
    }
    (events, done)
}

/// Text of the held-out fixture, cut to about `bytes` bytes on a char boundary.
pub fn heldout(bytes: usize) -> String {
    let t = std::fs::read_to_string(HELDOUT).expect("heldout.txt");
    let mut end = bytes.min(t.len());
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    t[..end].to_string()
}
