//! The model's tool-call syntax parsed out of its reply: Hermes/Qwen2.5 `<tool_call>{"name",
//! "arguments"}</tool_call>` blocks, or a reply that is one bare `{"name", "arguments"}` object
//! (what a forced `tool_choice` grammar produces). `ToolStream` does the same for a streamed
//! reply: text that cannot be part of a call is passed on at once, a call is held until the
//! reply ends and then returned whole.

use crate::openai::{FunctionOut, ToolCallOut};
use crate::validate::tools::ToolPlan;
use serde_json::Value;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// What parsing looks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolMode {
    names: Vec<String>,
    forced: bool,
    parallel: bool,
}

impl ToolMode {
    /// The mode for `plan`; `None` when replies are not searched for calls.
    pub fn of(plan: Option<&ToolPlan>) -> Option<Self> {
        let plan = plan.filter(|p| p.active())?;
        Some(Self {
            names: plan.names(),
            forced: plan.forced(),
            parallel: plan.parallel,
        })
    }
}

/// One call, its arguments as the JSON text OpenAI sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

impl ParsedCall {
    /// The response form, with a fresh id.
    pub fn into_out(self) -> ToolCallOut {
        ToolCallOut {
            id: crate::generation::new_id("call_"),
            kind: "function",
            function: FunctionOut {
                name: self.name,
                arguments: self.arguments,
            },
        }
    }
}

/// `{"name": <known>, "arguments" | "parameters": <object or JSON text>}` as a call.
fn call_from(v: &Value, mode: &ToolMode) -> Option<ParsedCall> {
    let name = v.get("name")?.as_str()?;
    if !mode.names.iter().any(|n| n == name) {
        return None;
    }
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let args = match args {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => return None,
    };
    Some(ParsedCall {
        name: name.to_string(),
        arguments: serde_json::to_string(&args).ok()?,
    })
}

fn parse_json_call(text: &str, mode: &ToolMode) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    call_from(&v, mode)
}

/// Splits a whole reply into its text and its calls. With no call found, the text is the
/// reply unchanged; with calls, it is what stands outside them (trimmed; `None` if empty).
pub fn parse_reply(text: &str, mode: &ToolMode) -> (Option<String>, Vec<ParsedCall>) {
    let unchanged = || (Some(text.to_string()), Vec::new());
    if mode.forced || text.trim_start().starts_with('{') {
        return match parse_json_call(text, mode) {
            Some(call) => (None, vec![call]),
            None => unchanged(),
        };
    }
    let mut calls = Vec::new();
    let mut outside = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        outside.push_str(&rest[..at]);
        let body = &rest[at + OPEN.len()..];
        let (inner, after) = match body.find(CLOSE) {
            Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
            None => (body, ""),
        };
        match parse_json_call(inner, mode) {
            Some(call) => calls.push(call),
            None => return unchanged(),
        }
        rest = after;
    }
    outside.push_str(rest);
    if calls.is_empty() {
        return unchanged();
    }
    if !mode.parallel {
        calls.truncate(1);
    }
    let outside = outside.trim();
    ((!outside.is_empty()).then(|| outside.to_string()), calls)
}

/// A streamed reply's call detection for one choice.
#[derive(Debug, Clone)]
pub struct ToolStream {
    mode: ToolMode,
    text: String,
    /// Bytes of `text` already passed on as content.
    sent: usize,
    /// A call may have started at `sent`: everything from there waits for the end.
    holding: bool,
}

impl ToolStream {
    pub fn new(mode: ToolMode) -> Self {
        let holding = mode.forced;
        Self {
            mode,
            text: String::new(),
            sent: 0,
            holding,
        }
    }

    /// Takes the next piece of the reply; returns the content that can be sent now.
    pub fn push(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        if self.holding {
            return String::new();
        }
        let rest = &self.text[self.sent..];
        if self.sent == 0 {
            let lead = rest.trim_start();
            // A bare JSON call, or only whitespace so far: wait.
            if lead.starts_with('{') {
                self.holding = true;
                return String::new();
            }
            if lead.is_empty() {
                return String::new();
            }
        }
        if let Some(at) = rest.find(OPEN) {
            self.holding = true;
            // Only whitespace before the first call: it is no content (as in `parse_reply`).
            if self.sent == 0 && rest[..at].trim().is_empty() {
                return String::new();
            }
            let out = rest[..at].to_string();
            self.sent += at;
            return out;
        }
        // Keep back a tail that may be the start of the tag.
        let keep = (1..OPEN.len().min(rest.len() + 1))
            .rev()
            .find(|&k| {
                rest.is_char_boundary(rest.len() - k) && OPEN.starts_with(&rest[rest.len() - k..])
            })
            .unwrap_or(0);
        let out = &rest[..rest.len() - keep];
        if self.sent == 0 && out.trim().is_empty() {
            return String::new();
        }
        let out = out.to_string();
        self.sent += out.len();
        out
    }

    /// The reply ended: the content still to send and the calls found.
    pub fn finish(self) -> (String, Vec<ParsedCall>) {
        let held = &self.text[self.sent..];
        let (content, calls) = parse_reply(held, &self.mode);
        match calls.is_empty() {
            true => (held.to_string(), calls),
            false => (content.unwrap_or_default(), calls),
        }
    }
}

#[cfg(test)]
#[path = "tool_calls_tests.rs"]
mod tests;
