//! Chat template rendering (`tokenizer.chat_template`) with minijinja.
//!
//! Hugging Face `transformers` renders chat templates with Jinja2 in an
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` plus the `loopcontrols`
//! extension, a few globals (`raise_exception`, `strftime_now`) and its own `tojson` filter
//! (`json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`). This module
//! reproduces that environment on top of minijinja so that a template renders byte for byte what
//! `apply_chat_template(messages, tokenize=False, **kwargs)` produces:
//!
//! * whitespace control: `trim_blocks` and `lstrip_blocks` on, one trailing newline of the template
//!   source dropped (Jinja2's default `keep_trailing_newline=False`);
//! * Python string / dict / list methods (`startswith`, `split`, `strip('\n')`, `items()`, ...)
//!   through minijinja-contrib's `pycompat` callback, plus a few it lacks (`rsplit`, `removeprefix`,
//!   `partition`, character-based `find`/`index`, ...);
//! * `tojson` writing JSON exactly like Python's `json.dumps` (`", "` / `": "` separators, no HTML
//!   escaping, floats in Python `repr` form, `indent`, `separators`, `sort_keys`, `ensure_ascii`);
//! * `{{ value }}` printing Python-style (`None`, `True`, `['a', 1]`, `1e+16`);
//! * `raise_exception(msg)` surfacing as [`ChatTemplateError::Raised`];
//! * `{% generation %}` / `{% endgeneration %}` (transformers' assistant-mask extension) accepted
//!   and rendered as plain blocks.
//!
//! The context holds `messages`, `tools` (None when absent), `documents` (None),
//! `add_generation_prompt`, `enable_thinking` (only when set, so `enable_thinking is defined` works
//! as in Python), `bos_token` / `eos_token` when known, and any extra keyword arguments.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::Map;

/// Name under which the template is registered in the minijinja environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Marker prefixed to the detail of errors created by `raise_exception`, so that they can be told
/// apart from ordinary render errors when converting to [`ChatTemplateError`].
const RAISE_MARKER: &str = "\u{0}raise_exception\u{0}";

/// Errors from compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    /// The template source does not parse.
    #[error("chat template does not compile: {message}{}", fmt_location(*.line, .line_text))]
    Syntax {
        /// minijinja's description of the problem.
        message: String,
        /// 1-based line in the template source, when known.
        line: Option<usize>,
        /// The text of that line.
        line_text: Option<String>,
    },
    /// The template called `raise_exception(message)`.
    #[error("chat template raised an exception: {message}{}", fmt_location(*.line, .line_text))]
    Raised {
        /// The message passed to `raise_exception`.
        message: String,
        /// 1-based line in the template source, when known.
        line: Option<usize>,
        /// The text of that line.
        line_text: Option<String>,
    },
    /// Rendering failed (unknown method, type error, undefined value, ...).
    #[error("chat template render failed: {message}{}", fmt_location(*.line, .line_text))]
    Render {
        /// minijinja's description of the problem.
        message: String,
        /// 1-based line in the template source, when known.
        line: Option<usize>,
        /// The text of that line.
        line_text: Option<String>,
    },
    /// The GGUF file has no usable `tokenizer.chat_template`.
    #[error("GGUF metadata has no chat template: {0}")]
    MissingTemplate(String),
    /// The GGUF metadata needed for the template could not be read.
    #[error("reading chat template metadata from GGUF: {0}")]
    Gguf(String),
}

/// Formats " (template line N: `text`)" for error messages.
fn fmt_location(line: Option<usize>, text: &Option<String>) -> String {
    match (line, text) {
        (Some(l), Some(t)) => format!(" (template line {l}: `{}`)", t.trim()),
        (Some(l), None) => format!(" (template line {l})"),
        _ => String::new(),
    }
}

/// Result type of this module.
pub type Result<T, E = ChatTemplateError> = std::result::Result<T, E>;

/// Per-render options, mirroring the keyword arguments of `apply_chat_template`.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Tool (function) schemas, exposed to the template as `tools` (None when absent).
    pub tools: Option<serde_json::Value>,
    /// Append the header that opens the assistant's turn.
    pub add_generation_prompt: bool,
    /// Exposed as `enable_thinking` only when set (templates test `enable_thinking is defined`).
    pub enable_thinking: Option<bool>,
    /// Any further keyword arguments, passed to the template context as is. They override
    /// `bos_token` / `eos_token` but not the named fields above.
    pub extra: Map<String, serde_json::Value>,
}

/// A compiled chat template plus the special-token strings exposed to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source` with transformers-compatible settings. `bos_token` / `eos_token` are
    /// exposed to the template under those names when given.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let source = rewrite_generation_tags(source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| convert_error(&e, &source, true))?;
        Ok(Self {
            env,
            source,
            bos_token,
            eos_token,
        })
    }

    /// Reads `tokenizer.chat_template` from a GGUF file, with the BOS/EOS token strings taken from
    /// `tokenizer.ggml.tokens` at `tokenizer.ggml.bos_token_id` / `eos_token_id` when present.
    pub fn from_gguf(gguf: &redlite_gguf::GgufFile) -> Result<Self> {
        const KEY: &str = "tokenizer.chat_template";
        if gguf.get(KEY).is_none() {
            return Err(ChatTemplateError::MissingTemplate(format!("no {KEY} key")));
        }
        let source = gguf
            .get_str(KEY)
            .map_err(|e| ChatTemplateError::Gguf(format!("{KEY}: {e}")))?
            .to_string();
        let token_at = |key: &str| -> Result<Option<String>> {
            let Some(id) = gguf
                .get_opt_u32(key)
                .map_err(|e| ChatTemplateError::Gguf(format!("{key}: {e}")))?
            else {
                return Ok(None);
            };
            let tokens = gguf
                .get_str_array("tokenizer.ggml.tokens")
                .map_err(|e| ChatTemplateError::Gguf(format!("tokenizer.ggml.tokens: {e}")))?;
            let token = tokens.get(id as usize).ok_or_else(|| {
                ChatTemplateError::Gguf(format!(
                    "{key} = {id} is out of range ({} tokens)",
                    tokens.len()
                ))
            })?;
            Ok(Some(token.to_string()))
        };
        let bos = token_at("tokenizer.ggml.bos_token_id")?;
        let eos = token_at("tokenizer.ggml.eos_token_id")?;
        Self::new(&source, bos, eos)
    }

    /// The template source (after the `{% generation %}` rewrite).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS token string exposed as `bos_token`, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string exposed as `eos_token`, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders `messages` (a JSON array of `{role, content, ...}` objects) to the prompt text.
    pub fn render(&self, messages: &serde_json::Value, opts: &RenderOptions) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = Vec::new();
        if let Some(bos) = &self.bos_token {
            ctx.push(("bos_token".into(), Value::from(bos.as_str())));
        }
        if let Some(eos) = &self.eos_token {
            ctx.push(("eos_token".into(), Value::from(eos.as_str())));
        }
        for (k, v) in &opts.extra {
            ctx.push((k.clone(), Value::from_serialize(v)));
        }
        ctx.push(("messages".into(), Value::from_serialize(messages)));
        ctx.push((
            "tools".into(),
            opts.tools
                .as_ref()
                .map(Value::from_serialize)
                .unwrap_or(Value::from(())),
        ));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(opts.add_generation_prompt),
        ));
        if let Some(t) = opts.enable_thinking {
            ctx.push(("enable_thinking".into(), Value::from(t)));
        }
        // Later entries win, like Python's `**` merging.
        let ctx: Value = ctx
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
            .into();
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| convert_error(&e, &self.source, false))?;
        tmpl.render(ctx)
            .map_err(|e| convert_error(&e, &self.source, false))
    }
}

/// Replaces transformers' `{% generation %}` / `{% endgeneration %}` tags (used to build assistant
/// masks) by an always-true `if` block, keeping their whitespace-control markers.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = split_ws_marker_front(inner);
        let (body, trail) = split_ws_marker_back(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                let _ = write!(out, "{{%{lead} {r} {trail}%}}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_ws_marker_front(s: &str) -> (&str, &str) {
    match s.as_bytes().first() {
        Some(b'-' | b'+') => (&s[..1], &s[1..]),
        _ => ("", s),
    }
}

fn split_ws_marker_back(s: &str) -> (&str, &str) {
    match s.as_bytes().last() {
        Some(b'-' | b'+') => (&s[..s.len() - 1], &s[s.len() - 1..]),
        _ => (s, ""),
    }
}

/// Converts a minijinja error into a [`ChatTemplateError`] carrying the offending template line.
fn convert_error(err: &Error, source: &str, compiling: bool) -> ChatTemplateError {
    let line = err.line();
    let line_text = line.and_then(|l| source.lines().nth(l.checked_sub(1)?).map(str::to_string));
    if let Some(msg) = find_raised(err) {
        return ChatTemplateError::Raised {
            message: msg,
            line,
            line_text,
        };
    }
    let mut message = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    let mut src = std::error::Error::source(err);
    while let Some(s) = src {
        let _ = write!(message, ": {s}");
        src = s.source();
    }
    if compiling || err.kind() == ErrorKind::SyntaxError {
        ChatTemplateError::Syntax {
            message,
            line,
            line_text,
        }
    } else {
        ChatTemplateError::Render {
            message,
            line,
            line_text,
        }
    }
}

/// Finds a `raise_exception` message in an error or its chain of sources.
fn find_raised(err: &Error) -> Option<String> {
    if let Some(msg) = err.detail().and_then(|d| d.strip_prefix(RAISE_MARKER)) {
        return Some(msg.to_string());
    }
    let mut src = std::error::Error::source(err);
    while let Some(s) = src {
        if let Some(e) = s.downcast_ref::<Error>() {
            if let Some(msg) = e.detail().and_then(|d| d.strip_prefix(RAISE_MARKER)) {
                return Some(msg.to_string());
            }
        }
        src = s.source();
    }
    None
}

/// `raise_exception(message)`: aborts rendering with the template's message.
fn raise_exception(message: Value) -> std::result::Result<Value, Error> {
    let text = match message.as_str() {
        Some(s) => s.to_string(),
        None => py_str(&message),
    };
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISE_MARKER}{text}"),
    ))
}

/// `strftime_now(format)`: the local time formatted with a C `strftime` format string.
fn strftime_now(format: &str) -> std::result::Result<Value, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format string {format:?}"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format with {format:?}"),
        )
    })?;
    Ok(Value::from(out))
}

// ---------------------------------------------------------------------------------------------
// Python-style output of `{{ value }}`
// ---------------------------------------------------------------------------------------------

/// Writes values the way Jinja2 (i.e. Python's `str()`) prints them: strings raw, `None`,
/// `True`/`False`, floats in `repr` form, lists and dicts as Python literals, undefined as "".
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    _state: &State<'_, '_>,
    value: &Value,
) -> std::result::Result<(), Error> {
    let text = py_str(value);
    out.write_str(&text).map_err(Error::from)
}

/// Python `str(value)`.
pub fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        _ => {
            let mut s = String::new();
            py_repr_into(value, &mut s);
            s
        }
    }
}

/// Python `repr(value)` appended to `out`.
fn py_repr_into(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_repr(value, false)),
        ValueKind::String => py_str_repr_into(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr_into(&item, out);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    py_repr_into(&key, out);
                    out.push_str(": ");
                    py_repr_into(&value.get_item(&key).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python `repr(str)`: single quotes unless the string contains `'` but no `"`.
fn py_str_repr_into(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// A number as Python prints it (ints as digits, floats as `repr`). `json` selects JSON's
/// spelling of non-finite floats (`NaN`, `Infinity`) instead of Python's (`nan`, `inf`).
fn number_repr(value: &Value, json: bool) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) => python_float_repr(f, json),
        Err(_) => value.to_string(),
    }
}

/// Python's `repr(float)`: the shortest digits that round-trip, in fixed notation when the decimal
/// exponent is in [-4, 16) (always with a fractional part, `1.0`), otherwise `1e+16` / `1.5e-05`.
pub fn python_float_repr(x: f64, json: bool) -> String {
    if x.is_nan() {
        return if json { "NaN" } else { "nan" }.to_string();
    }
    if x.is_infinite() {
        let s = if json { "Infinity" } else { "inf" };
        return if x < 0.0 {
            format!("-{s}")
        } else {
            s.to_string()
        };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, e.g. "-1.2345e-7".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

// ---------------------------------------------------------------------------------------------
// tojson: Python json.dumps
// ---------------------------------------------------------------------------------------------

/// Options of Python's `json.dumps` that the `tojson` filter exposes.
#[derive(Debug, Clone)]
pub struct JsonDumpsOptions {
    /// Escape every non-ASCII character as `\uXXXX` (Python's default; transformers passes False).
    pub ensure_ascii: bool,
    /// Pretty-print with this indentation string per level (`indent=2` → two spaces).
    pub indent: Option<String>,
    /// Separator between items; default `", "`, or `","` when indenting.
    pub item_separator: String,
    /// Separator between a key and its value; default `": "`.
    pub key_separator: String,
    /// Sort object keys.
    pub sort_keys: bool,
}

impl Default for JsonDumpsOptions {
    /// transformers' defaults: `ensure_ascii=False`, compact one-line output with spaces.
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// The `tojson` filter with transformers' signature:
/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson_filter(value: &Value, args: &[Value]) -> std::result::Result<Value, Error> {
    let (positional, kwargs) = match args.split_last() {
        Some((last, rest)) if last.is_kwargs() => (rest, Some(Kwargs::try_from(last.clone())?)),
        _ => (args, None),
    };
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > NAMES.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments (ensure_ascii, indent, separators, sort_keys)",
        ));
    }
    let mut slots: [Option<Value>; 4] = Default::default();
    for (slot, v) in slots.iter_mut().zip(positional) {
        *slot = Some(v.clone());
    }
    if let Some(kwargs) = &kwargs {
        for (i, name) in NAMES.iter().enumerate() {
            if let Some(v) = kwargs.get::<Option<Value>>(name)? {
                if slots[i].is_some() {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("tojson got multiple values for argument '{name}'"),
                    ));
                }
                slots[i] = Some(v);
            }
        }
        kwargs.assert_all_used()?;
    }
    let [ensure_ascii, indent, separators, sort_keys] = slots;
    let mut opts = JsonDumpsOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..Default::default()
    };
    match indent {
        None => {}
        Some(v) if v.is_none() => {}
        Some(v) => {
            opts.indent = Some(if let Some(s) = v.as_str() {
                s.to_string()
            } else if v.is_integer() {
                let n = i64::try_from(v.clone())?;
                " ".repeat(n.clamp(0, 1024) as usize)
            } else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "tojson: indent must be an int or a string, not {}",
                        v.kind()
                    ),
                ));
            });
            opts.item_separator = ",".into();
        }
    }
    if let Some(sep) = separators.filter(|v| !v.is_none()) {
        let parts: Vec<Value> = sep.try_iter()?.collect();
        match parts.as_slice() {
            [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                opts.item_separator = a.as_str().unwrap_or_default().to_string();
                opts.key_separator = b.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ))
            }
        }
    }
    let mut out = String::new();
    json_dumps_into(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Python `json.dumps(value, **opts)` for a minijinja value.
pub fn json_dumps(value: &Value, opts: &JsonDumpsOptions) -> std::result::Result<String, Error> {
    let mut out = String::new();
    json_dumps_into(value, opts, 0, &mut out)?;
    Ok(out)
}

/// Python `json.dumps(value, **opts)` for a serde_json value (key order as stored).
pub fn json_dumps_serde(
    value: &serde_json::Value,
    opts: &JsonDumpsOptions,
) -> std::result::Result<String, Error> {
    json_dumps(&Value::from_serialize(value), opts)
}

fn json_newline(opts: &JsonDumpsOptions, depth: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn json_dumps_into(
    value: &Value,
    opts: &JsonDumpsOptions,
    depth: usize,
    out: &mut String,
) -> std::result::Result<(), Error> {
    if depth > 512 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number_repr(value, true)),
        ValueKind::String => json_string_into(value.as_str().unwrap_or_default(), opts, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                json_newline(opts, depth + 1, out);
                json_dumps_into(item, opts, depth + 1, out)?;
            }
            json_newline(opts, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                json_newline(opts, depth + 1, out);
                json_string_into(k, opts, out);
                out.push_str(&opts.key_separator);
                json_dumps_into(v, opts, depth + 1, out)?;
            }
            json_newline(opts, depth, out);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: object of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A dict key as `json.dumps` converts it: strings as is, numbers/bools/None spelled as JSON.
fn json_key(key: &Value) -> std::result::Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => Ok(number_repr(key, true)),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::None => Ok("null".into()),
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

/// A JSON string literal as Python's `json` encoder writes it.
fn json_string_into(s: &str, opts: &JsonDumpsOptions, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            // With ensure_ascii Python escapes everything outside ' '..='~', DEL included.
            c if opts.ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// Python methods on values
// ---------------------------------------------------------------------------------------------

/// Unknown-method callback: the Python `str`/`list` methods minijinja-contrib's pycompat lacks or
/// gets subtly different (character offsets, empty separators), then pycompat for the rest.
fn python_methods(
    state: &State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    if let Some(s) = value.as_str() {
        if let Some(rv) = extra_string_method(s, method, args)? {
            return Ok(rv);
        }
    } else if value.kind() == ValueKind::Seq && method == "index" {
        let (needle,): (&Value,) = minijinja::value::from_args(args)?;
        return value
            .try_iter()?
            .position(|x| &x == needle)
            .map(Value::from)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("list.index(x): {needle} is not in list"),
                )
            });
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Resolves a Python slice bound (negative = from the end, clamped) over `len` characters.
fn slice_bound(v: Option<i64>, len: usize, default: usize) -> usize {
    match v {
        None => default,
        Some(i) if i < 0 => len.saturating_sub(i.unsigned_abs() as usize),
        Some(i) => (i as usize).min(len),
    }
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// Python string methods handled here; `Ok(None)` hands the call on to pycompat.
fn extra_string_method(
    s: &str,
    method: &str,
    args: &[Value],
) -> std::result::Result<Option<Value>, Error> {
    use minijinja::value::from_args;
    let rv = match method {
        "find" | "rfind" | "index" | "rindex" => {
            let (sub, start, end): (&str, Option<i64>, Option<i64>) = from_args(args)?;
            let chars: Vec<char> = s.chars().collect();
            let start = slice_bound(start, chars.len(), 0);
            let end = slice_bound(end, chars.len(), chars.len());
            let needle: Vec<char> = sub.chars().collect();
            let found = if start > end || needle.len() > end - start {
                None
            } else {
                let mut positions = (start..=end - needle.len())
                    .filter(|&i| chars[i..i + needle.len()] == needle[..]);
                if method.starts_with('r') {
                    positions.next_back()
                } else {
                    positions.next()
                }
            };
            match (found, method) {
                (Some(i), _) => Value::from(i as i64),
                (None, "find" | "rfind") => Value::from(-1i64),
                (None, _) => return Err(invalid(format!("str.{method}: substring not found"))),
            }
        }
        "split" | "rsplit" => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let maxsplit = maxsplit.filter(|m| *m >= 0).map(|m| m as usize);
            let parts: Vec<String> = match sep {
                Some("") => return Err(invalid(format!("str.{method}: empty separator"))),
                Some(sep) => match (maxsplit, method) {
                    (None, _) => s.split(sep).map(str::to_string).collect(),
                    (Some(n), "split") => s.splitn(n + 1, sep).map(str::to_string).collect(),
                    (Some(n), _) => {
                        let mut v: Vec<String> =
                            s.rsplitn(n + 1, sep).map(str::to_string).collect();
                        v.reverse();
                        v
                    }
                },
                None => split_whitespace_py(s, maxsplit, method == "rsplit"),
            };
            Value::from(parts)
        }
        "removeprefix" => {
            let (p,): (&str,) = from_args(args)?;
            Value::from(s.strip_prefix(p).unwrap_or(s))
        }
        "removesuffix" => {
            let (p,): (&str,) = from_args(args)?;
            Value::from(s.strip_suffix(p).unwrap_or(s))
        }
        "partition" | "rpartition" => {
            let (sep,): (&str,) = from_args(args)?;
            if sep.is_empty() {
                return Err(invalid(format!("str.{method}: empty separator")));
            }
            let hit = if method == "partition" {
                s.find(sep)
            } else {
                s.rfind(sep)
            };
            let parts = match hit {
                Some(i) => [&s[..i], sep, &s[i + sep.len()..]],
                None if method == "partition" => [s, "", ""],
                None => ["", "", s],
            };
            Value::from(parts.iter().map(|p| Value::from(*p)).collect::<Vec<_>>())
        }
        "zfill" => {
            let (width,): (i64,) = from_args(args)?;
            let n = s.chars().count();
            let width = width.max(0) as usize;
            if n >= width {
                Value::from(s)
            } else {
                let (sign, rest) = match s.chars().next() {
                    Some(c @ ('+' | '-')) => (c.to_string(), &s[1..]),
                    _ => (String::new(), s),
                };
                Value::from(format!("{sign}{}{rest}", "0".repeat(width - n)))
            }
        }
        "ljust" | "rjust" | "center" => {
            let (width, fill): (i64, Option<&str>) = from_args(args)?;
            let fill = fill.unwrap_or(" ");
            let mut fc = fill.chars();
            let (Some(fill), None) = (fc.next(), fc.next()) else {
                return Err(invalid(format!(
                    "str.{method}: the fill character must be exactly one character long"
                )));
            };
            let n = s.chars().count();
            let pad = (width.max(0) as usize).saturating_sub(n);
            let (left, right) = match method {
                "ljust" => (0, pad),
                "rjust" => (pad, 0),
                // CPython puts the extra character on the left when both pad and width are odd.
                _ => {
                    let left = pad / 2 + (pad & width as usize & 1);
                    (left, pad - left)
                }
            };
            let f = fill.to_string();
            Value::from(format!("{}{s}{}", f.repeat(left), f.repeat(right)))
        }
        "swapcase" => {
            let () = from_args(args)?;
            Value::from(
                s.chars()
                    .flat_map(|c| -> Box<dyn Iterator<Item = char>> {
                        if c.is_uppercase() {
                            Box::new(c.to_lowercase())
                        } else if c.is_lowercase() {
                            Box::new(c.to_uppercase())
                        } else {
                            Box::new(std::iter::once(c))
                        }
                    })
                    .collect::<String>(),
            )
        }
        "casefold" => {
            let () = from_args(args)?;
            Value::from(s.to_lowercase())
        }
        _ => return Ok(None),
    };
    Ok(Some(rv))
}

/// Python `str.split()` / `str.rsplit()` without a separator: runs of whitespace separate, leading
/// and trailing whitespace is dropped, at most `maxsplit` splits (the remainder keeps its inner
/// whitespace and is stripped only on the side that was split).
fn split_whitespace_py(s: &str, maxsplit: Option<usize>, from_right: bool) -> Vec<String> {
    let Some(max) = maxsplit else {
        return s.split_whitespace().map(str::to_string).collect();
    };
    let mut parts = Vec::new();
    if !from_right {
        let mut rest = s.trim_start();
        while !rest.is_empty() {
            if parts.len() == max {
                parts.push(rest.to_string());
                break;
            }
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            parts.push(rest[..end].to_string());
            rest = rest[end..].trim_start();
        }
    } else {
        let mut rest = s.trim_end();
        while !rest.is_empty() {
            if parts.len() == max {
                parts.push(rest.to_string());
                break;
            }
            let start = rest
                .rfind(char::is_whitespace)
                .map(|i| i + rest[i..].chars().next().map_or(1, char::len_utf8))
                .unwrap_or(0);
            parts.push(rest[start..].to_string());
            rest = rest[..start].trim_end();
        }
        parts.reverse();
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render_str(src: &str, ctx: serde_json::Value) -> Result<String> {
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into()))?;
        let opts = RenderOptions {
            extra: ctx.as_object().cloned().unwrap_or_default(),
            ..Default::default()
        };
        t.render(&json!([]), &opts)
    }

    fn r(src: &str, ctx: serde_json::Value) -> String {
        render_str(src, ctx).unwrap_or_else(|e| panic!("{src}: {e}"))
    }

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (-2.5, "-2.5"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.0, "123456789012345.0"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e-4, "0.0001"),
            (1.5e-5, "1.5e-05"),
            (1e-310, "1e-310"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (-0.0, "-0.0"),
            (100.0, "100.0"),
            (0.30000000000000004, "0.30000000000000004"),
        ];
        for (x, want) in cases {
            assert_eq!(python_float_repr(x, true), want, "{x:e}");
        }
        assert_eq!(python_float_repr(f64::NAN, true), "NaN");
        assert_eq!(python_float_repr(f64::NEG_INFINITY, true), "-Infinity");
        assert_eq!(python_float_repr(f64::INFINITY, false), "inf");
    }

    #[test]
    fn tojson_like_json_dumps() {
        let v = json!({"name": "f", "b": [1, 2.0, 1e20, true, null, {}], "nested": {"z": {"y": []}}, "s": "<&'\">"});
        // Python: json.dumps(v, ensure_ascii=False)
        assert_eq!(
            r("{{ v|tojson }}", json!({"v": v})),
            r#"{"name": "f", "b": [1, 2.0, 1e+20, true, null, {}], "nested": {"z": {"y": []}}, "s": "<&'\">"}"#
        );
        // indent=2 → "," item separator, no trailing spaces, empty containers compact.
        assert_eq!(
            r(
                "{{ v|tojson(indent=2) }}",
                json!({"v": {"a": [1, {"b": null}], "c": {}}})
            ),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": {}\n}"
        );
        assert_eq!(
            r(
                "{{ v|tojson(separators=(',', ':'), sort_keys=true) }}",
                json!({"v": {"b": 1, "a": [1, 2]}})
            ),
            r#"{"a":[1,2],"b":1}"#
        );
    }

    #[test]
    fn tojson_unicode_and_escapes() {
        let ctx = json!({"v": "héllo 你好 🦙\n\t\u{1}\\\u{7f}"});
        assert_eq!(
            r("{{ v|tojson }}", ctx.clone()),
            "\"héllo 你好 🦙\\n\\t\\u0001\\\\\u{7f}\""
        );
        assert_eq!(
            r("{{ v|tojson(ensure_ascii=true) }}", ctx),
            "\"h\\u00e9llo \\u4f60\\u597d \\ud83e\\udd99\\n\\t\\u0001\\\\\\u007f\""
        );
    }

    #[test]
    fn tojson_keeps_key_order() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"z": 1, "a": 2, "m": {"y": 1, "b": 2}}"#).unwrap();
        assert_eq!(
            json_dumps_serde(&v, &JsonDumpsOptions::default()).unwrap(),
            r#"{"z": 1, "a": 2, "m": {"y": 1, "b": 2}}"#
        );
    }

    #[test]
    fn python_string_methods() {
        let ctx = json!({"s": "  Hello, World  ", "t": "a<think>b</think>\n\nc"});
        assert_eq!(
            r(
                "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}",
                ctx.clone()
            ),
            "Hello, World|Hello, World  |  Hello, World"
        );
        assert_eq!(
            r("{{ t.split('</think>')[-1].lstrip('\\n') }}", ctx.clone()),
            "c"
        );
        assert_eq!(
            r(
                "{{ t.split('</think>')[0].split('<think>')[-1] }}",
                ctx.clone()
            ),
            "b"
        );
        assert_eq!(
            r(
                "{{ s.strip().upper() }} {{ s.strip().lower() }}",
                ctx.clone()
            ),
            "HELLO, WORLD hello, world"
        );
        assert_eq!(r("{{ s.strip()[::-1] }}", ctx.clone()), "dlroW ,olleH");
        assert_eq!(r("{{ s.strip()[1:4] }}", ctx.clone()), "ell");
        assert_eq!(
            r("{{ s.replace('l', 'L') }}", ctx.clone()),
            "  HeLLo, WorLd  "
        );
        assert_eq!(
            r(
                "{{ s.strip().startswith('Hell') }} {{ s.strip().endswith(('x', 'ld')) }}",
                ctx.clone()
            ),
            "True True"
        );
        assert_eq!(
            r(
                "{{ 'a b  c'.split() }} {{ 'a,b,c'.rsplit(',', 1) }}",
                json!({})
            ),
            "['a', 'b', 'c'] ['a,b', 'c']"
        );
        assert_eq!(
            r(
                "{{ ' a b  c '.split(None, 1) }} {{ ' a b  c '.rsplit(None, 1) }}",
                json!({})
            ),
            "['a', 'b  c '] [' a b', 'c']"
        );
        assert_eq!(
            r(
                "{{ 'héllo'.find('l') }} {{ 'héllo'.rfind('l') }} {{ 'abc'.find('z') }}",
                json!({})
            ),
            "2 3 -1"
        );
        assert_eq!(
            r(
                "{{ 'a=b=c'.partition('=') }} {{ 'a=b=c'.rpartition('=') }}",
                json!({})
            ),
            "['a', '=', 'b=c'] ['a=b', '=', 'c']"
        );
        assert_eq!(r("{{ 'tool_x'.removeprefix('tool_') }} {{ '42'.zfill(5) }} [{{ 'ab'.center(5, '*') }}]", json!({})), "x 00042 [**ab*]");
        assert_eq!(
            r(
                "{{ '<tool_response>x</tool_response>'.startswith('<tool_response>') }}",
                json!({})
            ),
            "True"
        );
    }

    #[test]
    fn python_style_output() {
        assert_eq!(
            r(
                "{{ none }} {{ true }} {{ 1.0 }} {{ 3 }} {{ [1, 'a', none] }} {{ x }}",
                json!({"x": {"k": "it's"}})
            ),
            "None True 1.0 3 [1, 'a', None] {'k': \"it's\"}"
        );
        assert_eq!(r("[{{ undefined_var }}]", json!({})), "[]");
        assert_eq!(r("{{ bos_token }}x{{ eos_token }}", json!({})), "<s>x</s>");
    }

    #[test]
    fn whitespace_control_like_hf() {
        // trim_blocks + lstrip_blocks, and one trailing newline of the source dropped.
        let src = "{% for m in ['a', 'b'] %}\n    {% if m == 'a' %}\nA\n    {% else %}\nB\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(r(src, json!({})), "A\nB\n");
    }

    #[test]
    fn namespaces_and_loop_controls() {
        let src = "{% set ns = namespace(n=0) %}{% for i in range(10) %}{% if i == 5 %}{% break %}{% endif %}{% if i % 2 %}{% continue %}{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}";
        assert_eq!(r(src, json!({})), "6");
    }

    #[test]
    fn raise_exception_is_reported() {
        let src = "line one\n{% if x %}\n{{ raise_exception('Conversation roles must alternate') }}\n{% endif %}";
        let err = render_str(src, json!({"x": true})).unwrap_err();
        match &err {
            ChatTemplateError::Raised { message, line, .. } => {
                assert_eq!(message, "Conversation roles must alternate");
                assert_eq!(*line, Some(3));
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert!(err
            .to_string()
            .contains("Conversation roles must alternate"));
    }

    #[test]
    fn errors_carry_the_template_line() {
        let err = ChatTemplate::new("ok\n{% if %}\n", None, None).unwrap_err();
        assert!(
            matches!(err, ChatTemplateError::Syntax { line: Some(2), .. }),
            "{err}"
        );
        let err = render_str("a\nb {{ 'x'.no_such_method() }}", json!({})).unwrap_err();
        match &err {
            ChatTemplateError::Render {
                line, line_text, ..
            } => {
                assert_eq!(*line, Some(2));
                assert!(line_text
                    .as_deref()
                    .unwrap_or("")
                    .contains("no_such_method"));
            }
            other => panic!("unexpected error {other:?}"),
        }
    }

    #[test]
    fn strftime_now_formats() {
        let out = r("{{ strftime_now('%Y-%m-%d') }}", json!({}));
        assert_eq!(out.len(), 10, "{out}");
        assert!(render_str("{{ strftime_now('%Q%') }}", json!({})).is_err());
    }

    #[test]
    fn generation_tags_are_accepted() {
        let src = "{% for m in messages %}{%- generation %}{{ m }}{%- endgeneration %}{% endfor %}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let out = t
            .render(&json!(["a", "b"]), &RenderOptions::default())
            .unwrap();
        assert_eq!(out, "ab");
    }

    #[test]
    fn options_reach_the_context() {
        let src = "{{ tools is none }} {{ add_generation_prompt }} {{ enable_thinking is defined }} {{ custom }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let mut opts = RenderOptions::default();
        opts.extra.insert("custom".into(), json!("yes"));
        assert_eq!(t.render(&json!([]), &opts).unwrap(), "True False False yes");
        opts.enable_thinking = Some(false);
        opts.add_generation_prompt = true;
        opts.tools = Some(json!([{"a": 1}]));
        assert_eq!(t.render(&json!([]), &opts).unwrap(), "False True True yes");
    }

    #[test]
    fn python_dict_and_list_methods() {
        let ctx = json!({"d": {"b": 1, "a": [1, 2]}, "l": ["x", "y", "x"]});
        assert_eq!(
            r(
                "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                ctx.clone()
            ),
            "b=1;a=[1, 2];"
        );
        assert_eq!(
            r(
                "{{ d.get('a') }} {{ d.get('zz', 'dflt') }} {{ d.get('zz') }} {{ d.keys()|list }}",
                ctx.clone()
            ),
            "[1, 2] dflt None ['b', 'a']"
        );
        assert_eq!(
            r(
                "{{ l.index('y') }} {{ l.count('x') }} {{ ', '.join(l) }}",
                ctx
            ),
            "1 2 x, y, x"
        );
    }
}
