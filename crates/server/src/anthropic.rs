//! Anthropic Messages API: `POST /v1/messages` (streaming or not, `tool_use` / `tool_result`
//! blocks) and `POST /v1/messages/count_tokens`.
//!
//! Messages are converted to the OpenAI-style shape the chat template takes: `tool_result`
//! blocks become `tool` messages, `tool_use` blocks the assistant's `tool_calls`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{ApiError, Flavor};
use crate::openai::{
    check_function, collect, content_text, counted, normalize_messages, parse_body, render_chat,
    sse_response, start_job, CommonParams, Streamer,
};
use crate::toolcall::{parse_all, Piece, ToolCall, ToolCallParser, ToolSchemas};
use crate::worker::{Event, Finish, Prompt, Usage};
use crate::AppState;

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub messages: Vec<Value>,
    #[serde(default)]
    pub system: Option<Value>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(flatten)]
    pub common: CommonParams,
}

/// Convert Anthropic messages (and the system prompt) to OpenAI-style ones.
fn convert_messages(system: Option<&Value>, messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        let text = content_text(Some(s), "system")?;
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
    }
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "'messages' must not be empty",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(ApiError::bad_param(
                    &field,
                    format!("{field}.role must be 'user' or 'assistant'"),
                ))
            }
        };
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            _ => {
                return Err(ApiError::bad_param(
                    &field,
                    format!("{field}.content must be a string or a list of blocks"),
                ))
            }
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let block = format!("{field}.content[{j}]");
            let kind = b.get("type").and_then(Value::as_str).unwrap_or("");
            match kind {
                "text" => match b.get("text") {
                    Some(Value::String(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::bad_param(
                            &field,
                            format!("'{block}': a text block has no 'text' string"),
                        ))
                    }
                },
                "tool_use" if role == "assistant" => {
                    let id = b.get("id").and_then(Value::as_str).unwrap_or("");
                    let Some(name) = b.get("name").and_then(Value::as_str) else {
                        return Err(ApiError::bad_param(
                            &field,
                            format!("'{block}': a tool_use block has no name"),
                        ));
                    };
                    let input = b.get("input").cloned().unwrap_or(json!({}));
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input.to_string()}}));
                }
                "tool_result" if role == "user" => {
                    let content = content_text(b.get("content"), &format!("{block}.content"))?;
                    let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or("");
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                "thinking" | "redacted_thinking" => {}
                other => {
                    return Err(ApiError::bad_param(
                        &field,
                        format!(
                            "'{block}': content blocks of type '{other}' are not supported here"
                        ),
                    ))
                }
            }
        }
        if role == "assistant" {
            let mut msg = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            out.push(msg);
        } else if !text.is_empty() || !blocks.iter().any(|b| b["type"] == "tool_result") {
            out.push(json!({"role": "user", "content": text}));
        }
    }
    Ok(out)
}

/// Anthropic tools to OpenAI-style ones, checked as the OpenAI endpoint checks its own.
fn convert_tools(tools: &[Value]) -> Result<Vec<Value>, ApiError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            check_function(&format!("tools[{i}]"), t, "input_schema")?;
            let schema = match t.get("input_schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                _ => json!({"type": "object"}),
            };
            Ok(json!({"type": "function", "function": {
                "name": t.get("name").cloned().unwrap_or(Value::Null),
                "description": t.get("description").cloned().unwrap_or(Value::Null),
                "parameters": schema,
            }}))
        })
        .collect()
}

/// `tool_choice` naming a tool (`{"type": "tool", "name": ...}`): that tool must be in `tools`.
fn check_tool_choice(choice: Option<&Value>, tools: &[Value]) -> Result<(), ApiError> {
    if choice.and_then(|c| c.get("type")).and_then(Value::as_str) != Some("tool") {
        return Ok(());
    }
    let Some(name) = choice.and_then(|c| c.get("name")).and_then(Value::as_str) else {
        return Err(ApiError::bad_param(
            "tool_choice",
            "'tool_choice.name' must be a string",
        ));
    };
    if !tools.iter().any(|t| t["function"]["name"] == name) {
        return Err(ApiError::bad_param(
            "tool_choice",
            format!("'tool_choice' names the tool '{name}', which is not in 'tools'"),
        ));
    }
    Ok(())
}

struct Prepared {
    prompt: String,
    use_tools: bool,
    schemas: ToolSchemas,
}

fn prepare(app: &AppState, req: &MessagesRequest) -> Result<Prepared, ApiError> {
    let messages = convert_messages(req.system.as_ref(), &req.messages)?;
    let messages = normalize_messages(&messages)?;
    let tools = convert_tools(req.tools.as_deref().unwrap_or(&[]))?;
    check_tool_choice(req.tool_choice.as_ref(), &tools)?;
    let none = matches!(
        req.tool_choice
            .as_ref()
            .and_then(|c| c.get("type"))
            .and_then(Value::as_str),
        Some("none")
    );
    let use_tools = !tools.is_empty() && !none;
    let prompt = render_chat(app, &messages, use_tools.then_some(&tools), None)?;
    Ok(Prepared {
        prompt,
        use_tools,
        schemas: ToolSchemas::from_tools(&tools),
    })
}

fn tool_use_block(call: &ToolCall, id: &str) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or(json!({}));
    json!({"type": "tool_use", "id": id, "name": call.name, "input": input})
}

fn stop_reason(finish: Finish, usage: &Usage, tool_calls: bool) -> (&'static str, Value) {
    if tool_calls {
        return ("tool_use", Value::Null);
    }
    match (finish, &usage.stop_string) {
        (Finish::Stop, Some(s)) => ("stop_sequence", json!(s)),
        (Finish::Length, _) => ("max_tokens", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    })
}

pub async fn messages(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    counted(&app, Flavor::Anthropic, messages_inner(app.clone(), body)).await
}

async fn messages_inner(
    app: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut req: MessagesRequest = parse_body(body)?;
    if req.common.max_tokens.is_none() {
        return Err(ApiError::bad_param(
            "max_tokens",
            "'max_tokens' is required",
        ));
    }
    if let Some(stops) = req.stop_sequences.take() {
        req.common.stop = Some(crate::openai::StopField::Many(stops));
    }
    let settings = req.common.settings(app.ctx)?;
    let p = prepare(&app, &req)?;
    let id = app.next_id("msg");
    let (mut rx, prompt_tokens, cached_tokens) =
        start_job(&app, Prompt::Text(p.prompt), &settings, None).await?;
    if settings.stream {
        let streamer = MessagesStreamer {
            app: app.clone(),
            id,
            parser: p.use_tools.then(|| ToolCallParser::new(p.schemas)),
            block: None,
            n_blocks: 0,
            n_calls: 0,
            started: false,
            prompt_tokens,
            cached_tokens,
        };
        return Ok(sse_response(rx, streamer));
    }
    let c = collect(&mut rx).await?;
    let mut content = Vec::new();
    let mut n_calls = 0;
    let pieces = if p.use_tools {
        parse_all(&c.text, &p.schemas)
    } else {
        vec![Piece::Text(c.text.clone())]
    };
    let mut text = String::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => text.push_str(&t),
            Piece::Call(call) => {
                if !text.is_empty() {
                    content.push(json!({"type": "text", "text": std::mem::take(&mut text)}));
                }
                content.push(tool_use_block(
                    &call,
                    &format!("toolu_{}_{n_calls}", id.trim_start_matches("msg-")),
                ));
                n_calls += 1;
            }
        }
    }
    if !text.is_empty() || content.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    let (reason, seq) = stop_reason(c.finish.unwrap_or(Finish::Stop), &c.usage, n_calls > 0);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": app.model_name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage_json(&c.usage),
    }))
    .into_response())
}

pub async fn count_tokens(
    State(app): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = (|| {
        let req: MessagesRequest = parse_body(body)?;
        let p = prepare(&app, &req)?;
        let n = app
            .tokenizer
            .encode(&p.prompt, true)
            .map_err(|e| ApiError::bad_request(format!("cannot tokenize: {e}")))?
            .len();
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    })();
    result.unwrap_or_else(|e| e.with_flavor(Flavor::Anthropic).into_response())
}

/// The kind of content block open in a stream.
#[derive(Clone, Copy, PartialEq)]
enum Block {
    Text,
}

struct MessagesStreamer {
    app: Arc<AppState>,
    id: String,
    parser: Option<ToolCallParser>,
    block: Option<Block>,
    n_blocks: usize,
    n_calls: usize,
    started: bool,
    prompt_tokens: usize,
    cached_tokens: usize,
}

fn ev(name: &str, data: Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

impl MessagesStreamer {
    fn close_block(&mut self, out: &mut Vec<SseEvent>) {
        if self.block.take().is_some() {
            out.push(ev(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.n_blocks - 1}),
            ));
        }
    }

    fn text(&mut self, t: &str, out: &mut Vec<SseEvent>) {
        if t.is_empty() {
            return;
        }
        if self.block != Some(Block::Text) {
            self.close_block(out);
            out.push(ev(
                "content_block_start",
                json!({"type": "content_block_start", "index": self.n_blocks,
                       "content_block": {"type": "text", "text": ""}}),
            ));
            self.block = Some(Block::Text);
            self.n_blocks += 1;
        }
        out.push(ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.n_blocks - 1,
                   "delta": {"type": "text_delta", "text": t}}),
        ));
    }

    fn call(&mut self, call: &ToolCall, out: &mut Vec<SseEvent>) {
        self.close_block(out);
        let id = format!(
            "toolu_{}_{}",
            self.id.trim_start_matches("msg-"),
            self.n_calls
        );
        self.n_calls += 1;
        let index = self.n_blocks;
        self.n_blocks += 1;
        out.push(ev(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "tool_use", "id": id, "name": call.name, "input": {}}}),
        ));
        out.push(ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
        ));
        out.push(ev(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }

    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<SseEvent>) {
        for p in pieces {
            match p {
                Piece::Text(t) => self.text(&t, out),
                Piece::Call(c) => self.call(&c, out),
            }
        }
    }
}

impl Streamer for MessagesStreamer {
    fn on_event(&mut self, event: Event) -> (Vec<SseEvent>, bool) {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            let (prompt_tokens, cached_tokens) = (self.prompt_tokens, self.cached_tokens);
            out.push(ev(
                "message_start",
                json!({"type": "message_start", "message": {
                        "id": self.id, "type": "message", "role": "assistant",
                        "model": self.app.model_name, "content": [],
                        "stop_reason": null, "stop_sequence": null,
                        "usage": {"input_tokens": prompt_tokens - cached_tokens,
                                  "cache_read_input_tokens": cached_tokens,
                                  "cache_creation_input_tokens": 0, "output_tokens": 0}}}),
            ));
            out.push(ev("ping", json!({"type": "ping"})));
        }
        match event {
            Event::Started { .. } => (out, false),
            Event::Delta { text, .. } => {
                let pieces = match &mut self.parser {
                    Some(p) => p.push(&text),
                    None => vec![Piece::Text(text)],
                };
                self.pieces(pieces, &mut out);
                (out, false)
            }
            Event::Done { finish, usage, .. } => {
                if let Some(p) = &mut self.parser {
                    let rest = p.finish();
                    self.pieces(rest, &mut out);
                }
                if self.n_blocks == 0 {
                    out.push(ev(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": 0,
                               "content_block": {"type": "text", "text": ""}}),
                    ));
                    self.block = Some(Block::Text);
                    self.n_blocks = 1;
                }
                self.close_block(&mut out);
                let (reason, seq) = stop_reason(finish, &usage, self.n_calls > 0);
                out.push(ev(
                    "message_delta",
                    json!({"type": "message_delta",
                           "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": {"output_tokens": usage.completion_tokens}}),
                ));
                out.push(ev("message_stop", json!({"type": "message_stop"})));
                (out, true)
            }
            Event::Error(e) => {
                out.push(ev("error", e.with_flavor(Flavor::Anthropic).body()));
                (out, true)
            }
        }
    }
}
