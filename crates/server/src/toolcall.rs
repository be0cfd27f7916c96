//! Tool calls in the model's output, parsed as the text streams in.
//!
//! Two forms are recognised inside `<tool_call>` … `</tool_call>`:
//! - Qwen3-Coder's XML form:
//!   `<function=NAME><parameter=KEY>value</parameter>…</function>`; a value is kept as a string
//!   when the tool's schema says the parameter is a string (or does not know it), otherwise it is
//!   read as JSON when it parses (numbers, booleans, objects, arrays) and kept as a string if not;
//! - the JSON form `{"name": NAME, "arguments": {…}}`.
//!
//! Text outside the tags is content. A block that parses as neither form is passed on as
//! content, tags and all.

use std::collections::HashMap;

use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A parsed tool call: the function name and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A piece of the model's output.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Parameter types by tool name and parameter name, from the request's `tools`.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    tools: HashMap<String, HashMap<String, String>>,
}

impl ToolSchemas {
    /// Read OpenAI-style tools (`{"type":"function","function":{"name","parameters"}}`) or
    /// Anthropic-style ones (`{"name","input_schema"}`).
    pub fn from_tools(tools: &[Value]) -> ToolSchemas {
        let mut out = HashMap::new();
        for t in tools {
            let f = t.get("function").unwrap_or(t);
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                continue;
            };
            let schema = f.get("parameters").or_else(|| f.get("input_schema"));
            let mut params = HashMap::new();
            if let Some(Value::Object(props)) = schema.and_then(|s| s.get("properties")) {
                for (k, v) in props {
                    let ty = match v.get("type") {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(a)) => a
                            .iter()
                            .filter_map(Value::as_str)
                            .find(|s| *s != "null")
                            .unwrap_or("string")
                            .to_string(),
                        _ => "any".to_string(),
                    };
                    params.insert(k.clone(), ty);
                }
            }
            out.insert(name.to_string(), params);
        }
        ToolSchemas { tools: out }
    }

    fn param_type(&self, tool: &str, param: &str) -> Option<&str> {
        self.tools.get(tool)?.get(param).map(String::as_str)
    }
}

/// Incremental parser: feed text as it is generated, get content and complete tool calls.
#[derive(Debug, Default)]
pub struct ToolCallParser {
    schemas: ToolSchemas,
    buf: String,
    in_call: bool,
}

impl ToolCallParser {
    pub fn new(schemas: ToolSchemas) -> ToolCallParser {
        ToolCallParser {
            schemas,
            buf: String::new(),
            in_call: false,
        }
    }

    /// Add generated text; returns the pieces that are complete. Text that could be the start
    /// of `<tool_call>` is held back until it is known.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CLOSE) else {
                    break;
                };
                let body = self.buf[..end].to_string();
                self.buf.drain(..end + CLOSE.len());
                self.in_call = false;
                out.push(match parse_call(&body, &self.schemas) {
                    Some(call) => Piece::Call(call),
                    None => Piece::Text(format!("{OPEN}{body}{CLOSE}")),
                });
            } else if let Some(start) = self.buf.find(OPEN) {
                if start > 0 {
                    out.push(Piece::Text(self.buf[..start].to_string()));
                }
                self.buf.drain(..start + OPEN.len());
                self.in_call = true;
            } else {
                let keep = partial_suffix(&self.buf, OPEN);
                let cut = self.buf.len() - keep;
                if cut > 0 {
                    out.push(Piece::Text(self.buf[..cut].to_string()));
                    self.buf.drain(..cut);
                }
                break;
            }
        }
        out
    }

    /// End of the output: an unterminated call is parsed if it can be, otherwise returned as text.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            return vec![match parse_call(&rest, &self.schemas) {
                Some(call) => Piece::Call(call),
                None => Piece::Text(format!("{OPEN}{rest}")),
            }];
        }
        if rest.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Text(rest)]
        }
    }
}

/// Parse a whole output at once.
pub fn parse_all(text: &str, schemas: &ToolSchemas) -> Vec<Piece> {
    let mut p = ToolCallParser::new(schemas.clone());
    let mut out = p.push(text);
    out.extend(p.finish());
    out
}

/// Length of the longest suffix of `s` that is a proper prefix of `pat`.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len())
        .rev()
        .find(|&n| s.len() >= n && s.is_char_boundary(s.len() - n) && s.ends_with(&pat[..n]))
        .unwrap_or(0)
}

/// Parse the body between `<tool_call>` and `</tool_call>`.
pub fn parse_call(body: &str, schemas: &ToolSchemas) -> Option<ToolCall> {
    let t = body.trim();
    if t.starts_with('{') {
        parse_json_call(t)
    } else {
        parse_xml_call(t, schemas)
    }
}

fn parse_json_call(t: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(t).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(Value::Object(Map::new()));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

fn parse_xml_call(t: &str, schemas: &ToolSchemas) -> Option<ToolCall> {
    let rest = t.strip_prefix("<function=")?;
    let gt = rest.find('>')?;
    let name = rest[..gt].trim().to_string();
    if name.is_empty() {
        return None;
    }
    let mut rest = &rest[gt + 1..];
    let mut args = Map::new();
    while let Some(p) = rest.find("<parameter=") {
        let after = &rest[p + "<parameter=".len()..];
        let gt = after.find('>')?;
        let key = after[..gt].trim().to_string();
        let value_start = &after[gt + 1..];
        // The value ends at `</parameter>`, or (when the model left it out) at the next
        // parameter or the end of the function.
        let (end, skip) = [
            ("</parameter>", "</parameter>".len()),
            ("<parameter=", 0),
            ("</function>", 0),
        ]
        .iter()
        .filter_map(|(pat, skip)| value_start.find(pat).map(|i| (i, *skip)))
        .min_by_key(|(i, _)| *i)
        .unwrap_or((value_start.len(), 0));
        let mut value = &value_start[..end];
        value = value.strip_prefix('\n').unwrap_or(value);
        value = value.strip_suffix('\n').unwrap_or(value);
        args.insert(
            key.clone(),
            convert_value(value, schemas.param_type(&name, &key)),
        );
        rest = &value_start[end + skip..];
    }
    Some(ToolCall {
        name,
        arguments: Value::Object(args).to_string(),
    })
}

fn convert_value(value: &str, ty: Option<&str>) -> Value {
    match ty {
        None | Some("string") | Some("str") | Some("text") => Value::String(value.to_string()),
        Some(_) => {
            serde_json::from_str(value.trim()).unwrap_or_else(|_| Value::String(value.to_string()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schemas() -> ToolSchemas {
        ToolSchemas::from_tools(&[json!({"type": "function", "function": {
            "name": "read", "parameters": {"type": "object", "properties": {
                "path": {"type": "string"}, "limit": {"type": "integer"},
                "opts": {"type": "object"}}}}})])
    }

    #[test]
    fn xml_form_with_types() {
        let out = parse_all(
            "Let me look.\n<tool_call>\n<function=read>\n<parameter=path>\nsrc/a.rs\n</parameter>\n<parameter=limit>\n20\n</parameter>\n<parameter=opts>\n{\"x\": [1]}\n</parameter>\n</function>\n</tool_call>",
            &schemas(),
        );
        assert_eq!(out[0], Piece::Text("Let me look.\n".into()));
        let Piece::Call(c) = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!(c.name, "read");
        let args: Value = serde_json::from_str(&c.arguments).unwrap();
        assert_eq!(
            args,
            json!({"path": "src/a.rs", "limit": 20, "opts": {"x": [1]}})
        );
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn json_form_and_streaming_split() {
        let text = "a<tool_call>\n{\"name\": \"f\", \"arguments\": {\"k\": 1}}\n</tool_call>b";
        let mut p = ToolCallParser::new(ToolSchemas::default());
        let mut out = Vec::new();
        for ch in text.chars() {
            out.extend(p.push(&ch.to_string()));
        }
        out.extend(p.finish());
        let calls: Vec<_> = out
            .iter()
            .filter_map(|p| match p {
                Piece::Call(c) => Some(c.clone()),
                _ => None,
            })
            .collect();
        let text: String = out
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(
            calls,
            vec![ToolCall {
                name: "f".into(),
                arguments: "{\"k\":1}".into()
            }]
        );
        assert_eq!(text, "ab");
    }

    #[test]
    fn broken_block_is_text() {
        let out = parse_all("<tool_call>nonsense</tool_call>", &ToolSchemas::default());
        assert_eq!(
            out,
            vec![Piece::Text("<tool_call>nonsense</tool_call>".into())]
        );
        let out = parse_all("x <tool_ca", &ToolSchemas::default());
        assert_eq!(
            out,
            vec![Piece::Text("x ".into()), Piece::Text("<tool_ca".into())]
        );
    }
}
