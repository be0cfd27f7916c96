//! OpenAI-compatible endpoints: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use redlite_engine::sampler::SamplerConfig;
use redlite_engine::speculative::SpecMode;
use redlite_tokenizer::chat_template::RenderOptions;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::error::{ApiError, Flavor};
use crate::toolcall::{Piece, ToolCallParser, ToolSchemas};
use crate::worker::{DebugInfo, Event, Finish, Job, Prompt, TokenLogprob, Usage};
use crate::AppState;

/// Longest accepted stop string, in bytes, and most stop strings.
const MAX_STOP_LEN: usize = 1024;
const MAX_STOPS: usize = 16;
/// Most alternatives per token in log-probabilities.
const MAX_TOP_LOGPROBS: i64 = 20;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Generation settings shared by the endpoints. Unknown fields are ignored.
#[derive(Debug, Deserialize, Default)]
pub struct CommonParams {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
    #[serde(default)]
    pub repeat_penalty: Option<f64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub n: Option<i64>,
    /// Extension: return prompt/completion token ids and logits hashes under `redlite`.
    #[serde(default)]
    pub return_token_ids: Option<bool>,
    /// Extension (as llama.cpp): keep generating past stop tokens.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// Extension: speculative decoding for this request, `off`, `lookup`, `mtp` or `both`
    /// (default: the server's `--spec`). The reply is the same either way.
    #[serde(default)]
    pub spec: Option<String>,
}

/// What the common parameters turn into.
pub struct Settings {
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    pub debug: bool,
    pub ignore_eos: bool,
    pub spec: Option<SpecMode>,
}

fn check_range(name: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::bad_param(
            name,
            format!("'{name}' must be between {lo} and {hi}, got {x}"),
        )),
        _ => Ok(()),
    }
}

impl CommonParams {
    /// Validate and convert. `max_tokens` is clamped to the context later by the worker.
    pub fn settings(&self, ctx: usize) -> Result<Settings, ApiError> {
        check_range("temperature", self.temperature, 0.0, 2.0)?;
        check_range("top_p", self.top_p, 0.0, 1.0)?;
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        // It scales repeated tokens' logits (as llama.cpp's); the sampler would quietly read
        // 0 or less as 1 (off).
        if let Some(x) = self.repeat_penalty.filter(|x| !(*x > 0.0 && *x <= 10.0)) {
            return Err(ApiError::bad_param(
                "repeat_penalty",
                format!("'repeat_penalty' must be greater than 0 and at most 10, got {x}"),
            ));
        }
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::bad_param("n", "only n = 1 is supported"));
            }
        }
        let top_k = match self.top_k {
            Some(k) if k < 0 => {
                return Err(ApiError::bad_param("top_k", "'top_k' must be >= 0"));
            }
            Some(k) => k as usize,
            None => 20,
        };
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            Some(m) if m < 1 => {
                return Err(ApiError::bad_param(
                    "max_tokens",
                    format!("'max_tokens' must be at least 1, got {m}"),
                ));
            }
            Some(m) => Some((m as u64).min(ctx as u64) as usize),
            None => None,
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOPS || stop.iter().any(|s| s.len() > MAX_STOP_LEN) {
            return Err(ApiError::bad_param(
                "stop",
                format!("at most {MAX_STOPS} stop strings of at most {MAX_STOP_LEN} bytes"),
            ));
        }
        let seed = match self.seed {
            Some(s) => s as u64,
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
        };
        // Qwen3's recommended sampling where the request does not say.
        let sampling = SamplerConfig {
            temperature: self.temperature.unwrap_or(0.7) as f32,
            top_k,
            top_p: self.top_p.unwrap_or(0.8) as f32,
            min_p: self.min_p.unwrap_or(0.0) as f32,
            repeat_penalty: self.repeat_penalty.unwrap_or(1.0) as f32,
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            seed,
            ..SamplerConfig::default()
        };
        Ok(Settings {
            stream: self.stream.unwrap_or(false),
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            max_tokens,
            sampling,
            stop,
            debug: self.return_token_ids.unwrap_or(false),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            spec: self.spec.as_deref().map(parse_spec).transpose()?,
        })
    }
}

/// The request's `spec` field.
fn parse_spec(mode: &str) -> Result<SpecMode, ApiError> {
    SpecMode::parse(mode).map_err(|e| ApiError::bad_param("spec", e.to_string()))
}

/// Parse a JSON body into `T`, with OpenAI-shaped errors for every failure.
pub fn parse_body<T: for<'de> Deserialize<'de>>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes =
        body.map_err(|r| ApiError::new(r.status(), "invalid_request_error", r.body_text()))?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Only checked for shape: the reply is not constrained to it.
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// Check one function tool's name and parameter schema (`schema_key`: `parameters` or
/// `input_schema`); `prefix` names the object holding them in errors.
pub fn check_function(prefix: &str, f: &Value, schema_key: &str) -> Result<(), ApiError> {
    match f.get("name") {
        Some(Value::String(s)) if !s.is_empty() => {}
        _ => {
            let field = format!("{prefix}.name");
            return Err(ApiError::bad_param(
                &field,
                format!("'{field}' must be a non-empty string"),
            ));
        }
    }
    match f.get(schema_key) {
        None | Some(Value::Null | Value::Object(_)) => Ok(()),
        Some(_) => {
            let field = format!("{prefix}.{schema_key}");
            Err(ApiError::bad_param(
                &field,
                format!("'{field}' must be a JSON Schema object"),
            ))
        }
    }
}

/// Check OpenAI `tools`: function tools with a name and an object schema. As the tool-call
/// parser, a tool without a `function` object is read as the function itself.
fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, t) in tools.iter().enumerate() {
        let field = format!("tools[{i}]");
        let Value::Object(obj) = t else {
            return Err(ApiError::bad_param(
                &field,
                format!("'{field}' must be an object"),
            ));
        };
        match obj.get("type") {
            None => {}
            Some(Value::String(s)) if s == "function" => {}
            Some(other) => {
                return Err(ApiError::bad_param(
                    &format!("{field}.type"),
                    format!("'{field}.type' must be \"function\", got {other}"),
                ))
            }
        }
        match obj.get("function") {
            None => check_function(&field, t, "parameters")?,
            Some(f @ Value::Object(_)) => {
                check_function(&format!("{field}.function"), f, "parameters")?
            }
            Some(_) => {
                return Err(ApiError::bad_param(
                    &format!("{field}.function"),
                    format!("'{field}.function' must be an object"),
                ))
            }
        }
    }
    Ok(())
}

/// `tool_choice` naming a function (`{"type": "function", "function": {"name": ...}}`): that
/// function must be among `tools`.
fn check_tool_choice(choice: Option<&Value>, tools: &[Value]) -> Result<(), ApiError> {
    let Some(Value::Object(c)) = choice else {
        return Ok(());
    };
    if c.get("type").and_then(Value::as_str) != Some("function") {
        return Ok(());
    }
    let Some(name) = c
        .get("function")
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
    else {
        return Err(ApiError::bad_param(
            "tool_choice",
            "'tool_choice.function.name' must be a string",
        ));
    };
    let known = tools.iter().any(|t| {
        t.get("function")
            .unwrap_or(t)
            .get("name")
            .and_then(Value::as_str)
            == Some(name)
    });
    if !known {
        return Err(ApiError::bad_param(
            "tool_choice",
            format!("'tool_choice' names the function '{name}', which is not in 'tools'"),
        ));
    }
    Ok(())
}

/// `response_format`: a `json_schema` one's `schema` must be an object.
fn check_response_format(format: Option<&Value>) -> Result<(), ApiError> {
    let Some(f) = format else {
        return Ok(());
    };
    if f.get("type").and_then(Value::as_str) != Some("json_schema") {
        return Ok(());
    }
    match f.get("json_schema").and_then(|j| j.get("schema")) {
        None | Some(Value::Null | Value::Object(_)) => Ok(()),
        Some(_) => Err(ApiError::bad_param(
            "response_format",
            "'response_format.json_schema.schema' must be a JSON Schema object",
        )),
    }
}

/// Flatten message content (a string, null, or a list of text parts) to a string.
pub fn content_text(content: Option<&Value>, field: &str) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match p {
                    Value::String(s) => out.push_str(s),
                    Value::Object(o) => {
                        match (o.get("type").and_then(Value::as_str), o.get("text")) {
                            (Some("text") | None, Some(Value::String(t))) => out.push_str(t),
                            (Some("text") | None, _) => {
                                return Err(ApiError::bad_param(
                                    field,
                                    format!("'{field}': a text part has no 'text' string"),
                                ))
                            }
                            (Some(t), _) => {
                                return Err(ApiError::bad_param(
                                    field,
                                    format!(
                                        "'{field}': content parts of type '{t}' are not supported (text only)"
                                    ),
                                ))
                            }
                        }
                    }
                    _ => {
                        return Err(ApiError::bad_param(
                            field,
                            format!("'{field}': content parts must be strings or objects"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::bad_param(
            field,
            format!("'{field}' must be a string or a list of text parts"),
        )),
    }
}

/// Bring OpenAI messages into the shape chat templates expect: string content, `developer` as
/// `system`, tool-call arguments as objects.
pub fn normalize_messages(messages: &[Value]) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let Value::Object(obj) = m else {
            return Err(ApiError::bad_param(
                &field,
                format!("{field} must be an object"),
            ));
        };
        let role = match obj.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
            Some(r) => {
                return Err(ApiError::bad_param(
                    &field,
                    format!("{field} has an unknown role '{r}'"),
                ))
            }
            None => return Err(ApiError::bad_param(&field, format!("{field} has no role"))),
        };
        let mut msg = obj.clone();
        msg.insert("role".into(), Value::String(role.into()));
        let content = content_text(obj.get("content"), &format!("{field}.content"))?;
        msg.insert("content".into(), Value::String(content));
        if let Some(calls) = obj.get("tool_calls") {
            let Value::Array(calls) = calls else {
                return Err(ApiError::bad_param(&field, "tool_calls must be a list"));
            };
            let mut fixed = Vec::new();
            for c in calls {
                let mut c = c.clone();
                if let Some(Value::Object(f)) = c.get_mut("function") {
                    if let Some(Value::String(a)) = f.get("arguments") {
                        if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(a) {
                            f.insert("arguments".into(), v);
                        }
                    }
                } else {
                    return Err(ApiError::bad_param(&field, "a tool call has no function"));
                }
                fixed.push(c);
            }
            msg.insert("tool_calls".into(), Value::Array(fixed));
        }
        out.push(Value::Object(msg));
    }
    Ok(Value::Array(out))
}

/// Results of a finished generation, collected.
#[derive(Default)]
pub struct Collected {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<Finish>,
    pub usage: Usage,
    pub debug: Option<DebugInfo>,
}

/// Queue a job and wait until its prompt is processed (or it failed). Returns the event
/// receiver, the prompt's tokens and how many of them were resumed from the cache.
pub async fn start_job(
    app: &AppState,
    prompt: Prompt,
    settings: &Settings,
    logprobs: Option<usize>,
) -> Result<(UnboundedReceiver<Event>, usize, usize), ApiError> {
    let (tx, mut rx) = unbounded_channel();
    app.worker.submit(Job {
        prompt,
        max_tokens: settings.max_tokens,
        sampling: settings.sampling.clone(),
        stop: settings.stop.clone(),
        logprobs,
        debug: settings.debug,
        ignore_eos: settings.ignore_eos,
        spec: settings.spec,
        events: tx,
    })?;
    match rx.recv().await {
        Some(Event::Started {
            prompt_tokens,
            cached_tokens,
        }) => Ok((rx, prompt_tokens, cached_tokens)),
        Some(Event::Error(e)) => Err(e),
        _ => Err(ApiError::internal("the model worker stopped")),
    }
}

/// Wait for the rest of a job.
pub async fn collect(rx: &mut UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let mut c = Collected::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta { text, logprob } => {
                c.text.push_str(&text);
                c.logprobs.extend(logprob);
            }
            Event::Done {
                finish,
                usage,
                debug,
            } => {
                c.finish = Some(finish);
                c.usage = usage;
                c.debug = debug;
                return Ok(c);
            }
            Event::Error(e) => return Err(e),
            Event::Started { .. } => {}
        }
    }
    Err(ApiError::internal("the model worker stopped"))
}

pub fn usage_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    });
    if let Some(s) = spec_json(u) {
        v["speculative"] = s;
    }
    v
}

/// Extension: what speculative decoding did for a request (`None` when it was off).
pub fn spec_json(u: &Usage) -> Option<Value> {
    let s = u.spec.as_ref()?;
    let t = s.total();
    let mode = format!("{:?}", s.mode).to_lowercase();
    let decode_s = u.decode_time.as_secs_f64();
    Some(json!({
        "mode": mode,
        "passes": s.forward_passes,
        "rows": s.rows,
        "drafted": t.drafted,
        "accepted": t.accepted,
        "acceptance_rate": t.acceptance_rate(),
        "mean_accepted_length": t.mean_accepted(),
        "tokens_per_pass": s.tokens_per_pass(),
        "lookup": {"drafted": s.lookup.drafted, "accepted": s.lookup.accepted},
        "mtp": {"drafted": s.mtp.drafted, "accepted": s.mtp.accepted, "left_out_passes": s.mtp_gated},
        "draft_ms": s.draft_time.as_secs_f64() * 1e3,
        "tokens_per_second": if decode_s > 0.0 { u.completion_tokens as f64 / decode_s } else { 0.0 },
    }))
}

pub fn timings_json(u: &Usage) -> Value {
    let mut v = json!({
        "prompt_n": u.prompt_tokens - u.cached_tokens,
        "cache_n": u.cached_tokens,
        "prompt_ms": u.prompt_time.as_secs_f64() * 1e3,
        "predicted_n": u.completion_tokens,
        "predicted_ms": u.decode_time.as_secs_f64() * 1e3,
    });
    // As llama.cpp's server reports its drafts.
    if let Some(s) = &u.spec {
        v["draft_n"] = json!(s.total().drafted);
        v["draft_n_accepted"] = json!(s.total().accepted);
    }
    v
}

pub fn debug_json(d: &DebugInfo) -> Value {
    json!({
        "prompt_token_ids": d.prompt_ids,
        "completion_token_ids": d.completion_ids,
        "logits_fnv": d.logits_hashes.iter().map(|h| format!("{h:016x}")).collect::<Vec<_>>(),
    })
}

fn token_json(app: &AppState, id: u32, logprob: f32) -> Value {
    let bytes = app.tokenizer.token_bytes(id);
    json!({
        "token": String::from_utf8_lossy(&bytes),
        "logprob": logprob,
        "bytes": bytes,
    })
}

/// Chat-style log-probabilities of some tokens.
fn chat_logprobs(app: &AppState, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut t = token_json(app, lp.id, lp.logprob);
            t["top_logprobs"] = Value::Array(
                lp.top
                    .iter()
                    .map(|&(id, l)| token_json(app, id, l))
                    .collect(),
            );
            t
        })
        .collect();
    json!({ "content": content })
}

fn tool_call_json(call: &crate::toolcall::ToolCall, id: &str) -> Value {
    json!({
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

/// Runs one request handler: counts the request, and an error (answered in `flavor`'s shape).
pub(crate) async fn counted(
    app: &AppState,
    flavor: Flavor,
    inner: impl Future<Output = Result<Response, ApiError>>,
) -> Response {
    app.metrics.requests.fetch_add(1, Ordering::Relaxed);
    match inner.await {
        Ok(r) => r,
        Err(e) => {
            app.metrics.errors.fetch_add(1, Ordering::Relaxed);
            e.with_flavor(flavor).into_response()
        }
    }
}

pub async fn chat_completions(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    counted(&app, Flavor::OpenAi, chat_inner(app.clone(), body)).await
}

async fn chat_inner(
    app: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    let settings = req.common.settings(app.ctx)?;
    let messages = normalize_messages(&req.messages)?;
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top = req.top_logprobs.unwrap_or(0);
    if !(0..=MAX_TOP_LOGPROBS).contains(&top) {
        return Err(ApiError::bad_param(
            "top_logprobs",
            format!("'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}"),
        ));
    }
    let logprobs = want_logprobs.then_some(top as usize);
    let given_tools = req.tools.as_deref().unwrap_or_default();
    check_tools(given_tools)?;
    check_tool_choice(req.tool_choice.as_ref(), given_tools)?;
    check_response_format(req.response_format.as_ref())?;
    let tools_off = matches!(&req.tool_choice, Some(Value::String(s)) if s == "none");
    let tools: Vec<Value> = req.tools.clone().unwrap_or_default();
    let use_tools = !tools.is_empty() && !tools_off;
    let prompt = render_chat(
        &app,
        &messages,
        use_tools.then_some(&tools),
        req.chat_template_kwargs.as_ref(),
    )?;
    let schemas = ToolSchemas::from_tools(&tools);

    let id = app.next_id("chatcmpl");
    let (mut rx, _, _) = start_job(&app, Prompt::Text(prompt), &settings, logprobs).await?;
    if settings.stream {
        let streamer = ChatStreamer {
            app: app.clone(),
            id,
            parser: use_tools.then(|| ToolCallParser::new(schemas)),
            n_calls: 0,
            include_usage: settings.include_usage,
            want_logprobs,
            sent_role: false,
        };
        return Ok(sse_response(rx, streamer));
    }
    let c = collect(&mut rx).await?;
    let finish = c.finish.unwrap_or(Finish::Stop);
    let (content, calls) = if use_tools {
        let mut text = String::new();
        let mut calls = Vec::new();
        for p in crate::toolcall::parse_all(&c.text, &schemas) {
            match p {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(call) => {
                    let cid = format!(
                        "call_{}_{}",
                        id.trim_start_matches("chatcmpl-"),
                        calls.len()
                    );
                    calls.push(tool_call_json(&call, &cid));
                }
            }
        }
        (text, calls)
    } else {
        (c.text.clone(), Vec::new())
    };
    let mut message = json!({"role": "assistant", "content": content});
    let finish_reason = if calls.is_empty() {
        finish.as_openai()
    } else {
        message["tool_calls"] = Value::Array(calls);
        if message["content"] == "" {
            message["content"] = Value::Null;
        }
        "tool_calls"
    };
    let mut resp = json!({
        "id": id,
        "object": "chat.completion",
        "created": app.created,
        "model": app.model_name,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": if want_logprobs { chat_logprobs(&app, &c.logprobs) } else { Value::Null },
            "finish_reason": finish_reason,
        }],
        "usage": usage_json(&c.usage),
        "timings": timings_json(&c.usage),
    });
    if let Some(d) = &c.debug {
        resp["redlite"] = debug_json(d);
    }
    Ok(Json(resp).into_response())
}

/// Render the chat template.
pub fn render_chat(
    app: &AppState,
    messages: &Value,
    tools: Option<&Vec<Value>>,
    kwargs: Option<&Map<String, Value>>,
) -> Result<String, ApiError> {
    let Some(template) = &app.template else {
        return Err(ApiError::bad_request(
            "this model has no chat template; use /v1/completions",
        ));
    };
    let extra = kwargs.cloned().unwrap_or_default();
    let enable_thinking = extra.get("enable_thinking").and_then(Value::as_bool);
    let opts = RenderOptions {
        tools: tools.map(|t| Value::Array(t.clone())),
        add_generation_prompt: true,
        enable_thinking,
        extra,
    };
    template
        .render(messages, &opts)
        .map_err(|e| ApiError::bad_request(format!("cannot render the conversation: {e}")))
}

/// Turns worker events into SSE events of one API.
pub trait Streamer: Send + 'static {
    /// Events for one worker event; `true` once the stream is over.
    fn on_event(&mut self, ev: Event) -> (Vec<SseEvent>, bool);
}

/// An SSE response fed by a job's events. Dropping it (client gone) drops the receiver, which
/// cancels the job.
pub fn sse_response(rx: UnboundedReceiver<Event>, streamer: impl Streamer) -> Response {
    let s = stream::unfold(
        (rx, streamer, VecDeque::<SseEvent>::new(), false),
        |(mut rx, mut st, mut queue, mut done)| async move {
            loop {
                if let Some(e) = queue.pop_front() {
                    return Some((Ok::<_, Infallible>(e), (rx, st, queue, done)));
                }
                if done {
                    return None;
                }
                let (events, end) = match rx.recv().await {
                    Some(ev) => st.on_event(ev),
                    None => {
                        st.on_event(Event::Error(ApiError::internal("the model worker stopped")))
                    }
                };
                queue.extend(events);
                done = end;
            }
        },
    );
    sse(s)
}

fn sse(s: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static) -> Response {
    Sse::new(s.boxed())
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

struct ChatStreamer {
    app: Arc<AppState>,
    id: String,
    parser: Option<ToolCallParser>,
    n_calls: usize,
    include_usage: bool,
    want_logprobs: bool,
    sent_role: bool,
}

impl ChatStreamer {
    fn chunk(&self, delta: Value, logprobs: Value, finish: Value) -> SseEvent {
        data(&json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.app.created,
            "model": self.app.model_name,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }))
    }

    fn pieces(&mut self, pieces: Vec<Piece>, logprob: Option<TokenLogprob>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        let mut text = String::new();
        for p in pieces {
            match p {
                Piece::Text(t) => text.push_str(&t),
                Piece::Call(call) => {
                    if !text.is_empty() {
                        out.push(self.chunk(json!({"content": text}), Value::Null, Value::Null));
                        text.clear();
                    }
                    let cid = format!(
                        "call_{}_{}",
                        self.id.trim_start_matches("chatcmpl-"),
                        self.n_calls
                    );
                    let mut tc = tool_call_json(&call, &cid);
                    tc["index"] = json!(self.n_calls);
                    self.n_calls += 1;
                    out.push(self.chunk(json!({"tool_calls": [tc]}), Value::Null, Value::Null));
                }
            }
        }
        let lp = match (&logprob, self.want_logprobs) {
            (Some(lp), true) => chat_logprobs(&self.app, std::slice::from_ref(lp)),
            _ => Value::Null,
        };
        if !text.is_empty() || !lp.is_null() {
            out.push(self.chunk(json!({"content": text}), lp, Value::Null));
        }
        out
    }
}

impl Streamer for ChatStreamer {
    fn on_event(&mut self, ev: Event) -> (Vec<SseEvent>, bool) {
        let mut out = Vec::new();
        if !self.sent_role {
            self.sent_role = true;
            out.push(self.chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                Value::Null,
            ));
        }
        match ev {
            Event::Started { .. } => (out, false),
            Event::Delta { text, logprob } => {
                let pieces = match &mut self.parser {
                    Some(p) => p.push(&text),
                    None if text.is_empty() => Vec::new(),
                    None => vec![Piece::Text(text)],
                };
                out.extend(self.pieces(pieces, logprob));
                (out, false)
            }
            Event::Done {
                finish,
                usage,
                debug,
            } => {
                if let Some(p) = &mut self.parser {
                    let rest = p.finish();
                    out.extend(self.pieces(rest, None));
                }
                let reason = if self.n_calls > 0 {
                    "tool_calls"
                } else {
                    finish.as_openai()
                };
                out.push(self.chunk(json!({}), Value::Null, json!(reason)));
                if self.include_usage || debug.is_some() {
                    let mut u = json!({
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.app.created,
                        "model": self.app.model_name,
                        "choices": [],
                        "usage": usage_json(&usage),
                    });
                    if let Some(d) = &debug {
                        u["redlite"] = debug_json(d);
                    }
                    out.push(data(&u));
                }
                out.push(SseEvent::default().data("[DONE]"));
                (out, true)
            }
            Event::Error(e) => {
                out.push(data(&e.body()));
                (out, true)
            }
        }
    }
}

/// `prompt` of `/v1/completions`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    #[serde(default)]
    pub logprobs: Option<i64>,
    #[serde(flatten)]
    pub common: CommonParams,
}

pub async fn completions(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    counted(&app, Flavor::OpenAi, completions_inner(app.clone(), body)).await
}

async fn completions_inner(
    app: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    let settings = req.common.settings(app.ctx)?;
    let one = || ApiError::bad_param("prompt", "exactly one prompt is supported");
    let prompt = match req.prompt {
        PromptField::Text(t) => Prompt::Text(t),
        PromptField::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
        PromptField::Ids(ids) if !ids.is_empty() => Prompt::Ids(ids),
        PromptField::IdLists(mut v) if v.len() == 1 => Prompt::Ids(v.remove(0)),
        _ => return Err(one()),
    };
    let logprobs = match req.logprobs {
        None => None,
        Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => Some(n as usize),
        Some(_) => {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}"),
            ))
        }
    };
    let id = app.next_id("cmpl");
    let (mut rx, _, _) = start_job(&app, prompt, &settings, logprobs).await?;
    if settings.stream {
        let streamer = CompletionStreamer {
            app: app.clone(),
            id,
            include_usage: settings.include_usage,
            offset: 0,
        };
        return Ok(sse_response(rx, streamer));
    }
    let c = collect(&mut rx).await?;
    let lp = if logprobs.is_some() {
        completion_logprobs(&app, &c.logprobs, 0)
    } else {
        Value::Null
    };
    let mut resp = json!({
        "id": id,
        "object": "text_completion",
        "created": app.created,
        "model": app.model_name,
        "choices": [{
            "text": c.text,
            "index": 0,
            "logprobs": lp,
            "finish_reason": c.finish.unwrap_or(Finish::Stop).as_openai(),
        }],
        "usage": usage_json(&c.usage),
        "timings": timings_json(&c.usage),
    });
    if let Some(d) = &c.debug {
        resp["redlite"] = debug_json(d);
    }
    Ok(Json(resp).into_response())
}

/// Legacy completion log-probabilities.
fn completion_logprobs(app: &AppState, lps: &[TokenLogprob], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top = Vec::new();
    let mut offsets = Vec::new();
    for lp in lps {
        let t = String::from_utf8_lossy(&app.tokenizer.token_bytes(lp.id)).into_owned();
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        token_logprobs.push(lp.logprob);
        let mut m = Map::new();
        for &(id, l) in &lp.top {
            let t = String::from_utf8_lossy(&app.tokenizer.token_bytes(id)).into_owned();
            m.insert(t, json!(l));
        }
        top.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

struct CompletionStreamer {
    app: Arc<AppState>,
    id: String,
    include_usage: bool,
    offset: usize,
}

impl CompletionStreamer {
    fn chunk(&self, text: &str, logprobs: Value, finish: Value) -> SseEvent {
        data(&json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.app.created,
            "model": self.app.model_name,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
        }))
    }
}

impl Streamer for CompletionStreamer {
    fn on_event(&mut self, ev: Event) -> (Vec<SseEvent>, bool) {
        match ev {
            Event::Started { .. } => (Vec::new(), false),
            Event::Delta { text, logprob } => {
                let lp = match &logprob {
                    Some(lp) => {
                        completion_logprobs(&self.app, std::slice::from_ref(lp), self.offset)
                    }
                    None => Value::Null,
                };
                self.offset += text.len();
                if text.is_empty() && lp.is_null() {
                    return (Vec::new(), false);
                }
                (vec![self.chunk(&text, lp, Value::Null)], false)
            }
            Event::Done {
                finish,
                usage,
                debug,
            } => {
                let mut out = vec![self.chunk("", Value::Null, json!(finish.as_openai()))];
                if self.include_usage || debug.is_some() {
                    let mut u = json!({
                        "id": self.id, "object": "text_completion", "created": self.app.created,
                        "model": self.app.model_name, "choices": [], "usage": usage_json(&usage),
                    });
                    if let Some(d) = &debug {
                        u["redlite"] = debug_json(d);
                    }
                    out.push(data(&u));
                }
                out.push(SseEvent::default().data("[DONE]"));
                (out, true)
            }
            Event::Error(e) => (vec![data(&e.body())], true),
        }
    }
}

pub async fn models(State(app): State<Arc<AppState>>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": app.model_name,
            "object": "model",
            "created": app.created,
            "owned_by": "redlite",
            "meta": {"n_ctx": app.ctx, "n_vocab": app.tokenizer.vocab_size()},
        }],
    }))
    .into_response()
}
