//! Chat templates: renders a conversation into a prompt with a Hugging Face style Jinja template (minijinja with Python compatibility).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};

use crate::tokenizer::Tokenizer;
use crate::{ModelError, Result};

const TEMPLATE_NAME: &str = "chat";

/// Bounds on a render, since a template comes from a model file and may be hostile: at most
/// this many bytes out (a prompt past any context window), ...
pub const MAX_RENDER_BYTES: usize = 16 << 20;
/// ... at most this many template instructions (minijinja's fuel: a 1,000-turn conversation
/// takes 23,000 through SmolLM2's template and 44,000 through Gemma's) ...
pub const TEMPLATE_FUEL: u64 = 1_000_000;
/// ... on a stack this large (virtual: pages are touched only by as deep a value as a template
/// builds). The fuel builds at most one level per instruction; formatting 1M levels took more
/// than 256 MiB of stack and less than 1 GiB, and chat/tests.rs formats, hashes and drops
/// 640,000 ...
const RENDER_STACK_BYTES: usize = 1 << 30;
/// ... macro and include nesting at most this deep (minijinja's own cap is 500 frames; real
/// templates nest a few) ...
pub const TEMPLATE_RECURSION_LIMIT: usize = 64;
/// ... and `tojson` at most this deep and indented at most this wide.
const MAX_JSON_DEPTH: usize = 128;
const MAX_JSON_INDENT: usize = 64;

/// Gemma's turns (`<start_of_turn>user|model\n...<end_of_turn>\n`), for Gemma GGUFs that carry no
/// template; a system message goes before the first user message, as Gemma's own template does.
pub const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + message['content'] | trim + '<end_of_turn>\n' }}{% if role == 'user' %}{% set ns.system = '' %}{% endif %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// A plain question-and-answer transcript, for base models (not instruction-tuned) that ship no
/// template: they continue `Question: ...\nAnswer:` with an answer where they continue chat turns
/// they never learned with noise. A system message is a preamble paragraph; generation stops at
/// the next question ([`TRANSCRIPT_STOP`]).
pub const TRANSCRIPT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] | trim + '\n\n' }}{% elif message['role'] == 'user' %}{{ 'Question: ' + message['content'] | trim + '\n' }}{% else %}{{ 'Answer: ' + message['content'] | trim + '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}";

/// Where an answer in [`TRANSCRIPT_TEMPLATE`] ends: the model starting the next question.
pub const TRANSCRIPT_STOP: &str = "\nQuestion:";

/// Plain ChatML, for instruction-tuned models that ship no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// One turn of a conversation, as templates see it (`message['role']`, `message.content`, and
/// for tool use `message.tool_calls` and `message.tool_call_id`, left undefined when absent).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, in transformers' form: `[{"id", "type": "function",
    /// "function": {"name", "arguments": <object>}}]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's answer to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A compiled chat template plus the special tokens it may refer to.
///
/// The environment mirrors `transformers`' `apply_chat_template`: `trim_blocks` and
/// `lstrip_blocks` on, Python string/dict methods (`.strip()`, `.split()`, `.items()`, ...),
/// `raise_exception(msg)`, `strftime_now(fmt)` (UTC) and a Python-compatible `tojson` filter
/// (`", "`/`": "` separators, no HTML escaping, optional `indent`). Undefined values are lenient
/// and chainable (`message.tool_calls.x` is undefined, not an error).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    stop: Vec<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("stop", &self.stop)
            .finish()
    }
}

/// Carries the message of `raise_exception` through minijinja's error chain.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedException(String);

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(
        Error::new(ErrorKind::InvalidOperation, "raise_exception called")
            .with_source(RaisedException(msg)),
    )
}

fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    strftime(&fmt, secs)
}

fn template_error(err: &Error) -> ModelError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return ModelError::Template(raised.0.clone());
        }
        source = e.source();
    }
    let mut msg = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        let _ = write!(msg, ": {e}");
        source = e.source();
    }
    ModelError::Template(msg)
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is [`ModelError::Template`].
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_undefined_behavior(UndefinedBehavior::Chainable);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // Pretty-printing a nested value indents every level: quadratic in the depth, before
        // the output bound sees a byte. Chat templates do not use it.
        env.remove_filter("pprint");
        crate::contain::contained(|| env.add_template_owned(TEMPLATE_NAME, source.to_owned()))
            .map_err(|panic| {
                ModelError::Template(format!("compiling: the template engine failed: {panic}"))
            })?
            .map_err(|e| ModelError::Template(format!("compiling: {e}")))?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
            stop: Vec::new(),
        })
    }

    /// Strings that end an answer in this template's format besides the EOS token (e.g. the next
    /// question of a transcript); chat requests stop on them as on their own `stop`.
    pub fn stop_strings(&self) -> &[String] {
        &self.stop
    }

    /// Plain ChatML (`<|im_start|>role\ncontent<|im_end|>\n`), for models without a template.
    pub fn chatml() -> ChatTemplate {
        // The source is a constant that the tests compile.
        Self::new(CHATML_TEMPLATE, None, Some("<|im_end|>"))
            .expect("the built-in ChatML template compiles")
    }

    /// Gemma's turns, for Gemma models without a template.
    pub fn gemma(bos_token: Option<&str>) -> ChatTemplate {
        // The source is a constant that the tests compile.
        Self::new(GEMMA_TEMPLATE, bos_token, Some("<end_of_turn>"))
            .expect("the built-in Gemma template compiles")
    }

    /// A question-and-answer transcript, for base models without a template.
    pub fn transcript(bos_token: Option<&str>) -> ChatTemplate {
        // The source is a constant that the tests compile.
        let mut template = Self::new(TRANSCRIPT_TEMPLATE, bos_token, None)
            .expect("the built-in transcript template compiles");
        template.stop = vec![TRANSCRIPT_STOP.to_owned()];
        template
    }

    /// The tokenizer's own template (GGUF `tokenizer.chat_template` or tokenizer_config.json),
    /// else ChatML; with the tokenizer's BOS/EOS strings.
    pub fn for_tokenizer(tok: &Tokenizer) -> Result<ChatTemplate> {
        match tok.chat_template() {
            Some(source) => Self::new(source, tok.bos_token(), tok.eos_token()),
            None => {
                tracing::warn!("tokenizer has no chat template; using ChatML");
                Ok(Self::chatml())
            }
        }
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the prompt ends where the assistant's answer begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, None)
    }

    /// Like [`render`](Self::render), with extra top-level variables from a JSON object
    /// (e.g. `tools`, `enable_thinking`); they cannot override `messages` or the special tokens.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: Option<&serde_json::Value>,
    ) -> Result<String> {
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        match extra {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Object(map)) => {
                for (k, v) in map {
                    ctx.insert(k.clone(), Value::from_serialize(v));
                }
            }
            Some(_) => {
                return Err(ModelError::Template(
                    "extra context must be a JSON object".into(),
                ));
            }
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(&e))?;
        // minijinja formats, hashes and drops nested values recursively, and a template can nest
        // one level per instruction (`{% set ns.v = [[[ns.v]]] %}` in a loop): on a worker's
        // stack that overflows and aborts the process. The render runs on a thread of its own
        // whose stack holds the deepest value the fuel allows.
        // Everything that may hold a template value (the error too) stays on that thread.
        let render = move || -> Result<String> {
            let mut out = BoundedWriter::default();
            let rendered = crate::contain::contained(|| template.render_captured_to(ctx, &mut out))
                .map_err(|panic| {
                    ModelError::Template(format!("the template engine failed: {panic}"))
                })?;
            match rendered {
                Ok(_) => {}
                Err(_) if out.overflowed => {
                    return Err(ModelError::Template(format!(
                        "the rendered prompt exceeds {} MiB",
                        MAX_RENDER_BYTES >> 20
                    )));
                }
                Err(e) => return Err(template_error(&e)),
            }
            String::from_utf8(out.buf)
                .map_err(|e| ModelError::Template(format!("the output is not UTF-8: {e}")))
        };
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("kvq-template".into())
                .stack_size(RENDER_STACK_BYTES)
                .spawn_scoped(scope, render)
                .map_err(|e| {
                    ModelError::Template(format!("could not start the template renderer: {e}"))
                })?
                .join()
                .map_err(|_| ModelError::Template("the template renderer failed".into()))?
        })
    }
}

/// Collects a render, failing (and saying so) past [`MAX_RENDER_BYTES`].
#[derive(Default)]
struct BoundedWriter {
    buf: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + data.len() > MAX_RENDER_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("render output limit"));
        }
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`,
/// keeping map order as minijinja iterates it.
fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    // ensure_ascii / sort_keys / separators are accepted; only the defaults are implemented.
    for key in ["ensure_ascii", "sort_keys", "separators"] {
        let _: Option<Value> = kwargs.get(key)?;
    }
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    if indent.is_some_and(|n| n > MAX_JSON_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: indent is at most {MAX_JSON_INDENT}"),
        ));
    }
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

fn newline(out: &mut String, indent: Option<usize>, level: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    level: usize,
) -> std::result::Result<(), Error> {
    if level > MAX_JSON_DEPTH || out.len() > MAX_RENDER_BYTES {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: the value is nested deeper than {MAX_JSON_DEPTH} or longer than {} MiB",
                MAX_RENDER_BYTES >> 20
            ),
        ));
    }
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                let _ = write!(out, "{value}");
            } else {
                let f = f64::try_from(value.clone())?;
                if f.is_finite() {
                    let _ = write!(out, "{}", serde_json::Value::from(f));
                } else if f.is_nan() {
                    out.push_str("NaN");
                } else {
                    out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
                }
            }
        }
        ValueKind::String | ValueKind::Plain => {
            let s = value
                .as_str()
                .map_or_else(|| value.to_string(), str::to_owned);
            out.push_str(&serde_json::Value::from(s).to_string());
        }
        ValueKind::Map | ValueKind::Seq | ValueKind::Iterable => {
            let is_map = value.kind() == ValueKind::Map;
            let items: Vec<Value> = value.try_iter()?.collect();
            out.push(if is_map { '{' } else { '[' });
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, level + 1);
                if is_map {
                    let name = item
                        .as_str()
                        .map_or_else(|| item.to_string(), str::to_owned);
                    out.push_str(&serde_json::Value::from(name).to_string());
                    out.push_str(": ");
                    write_json(out, &value.get_item(item)?, indent, level + 1)?;
                } else {
                    write_json(out, item, indent, level + 1)?;
                }
            }
            if !items.is_empty() {
                newline(out, indent, level);
            }
            out.push(if is_map { '}' } else { ']' });
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("cannot serialize a {} to JSON", value.kind()),
            ));
        }
    }
    Ok(())
}

const MONTHS: &str =
    "January February March April May June July August September October November December";
const WEEKDAYS: &str = "Sunday Monday Tuesday Wednesday Thursday Friday Saturday";

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, usize, i64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of the 400-year era
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March-based year
    let mp = (5 * doy + 2) / 153; // March = 0
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, usize::try_from(month).unwrap_or(1), day)
}

/// A small `strftime` over UTC seconds since the epoch: `%Y %y %m %d %e %j %B %b %h %A %a %H %I %M %S %p %%`,
/// with `%-d`-style unpadded variants. Unknown directives are copied through.
fn strftime(fmt: &str, secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (sod / 3600, sod / 60 % 60, sod % 60);
    let weekday = usize::try_from((days + 4).rem_euclid(7)).unwrap_or(0);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let month_days = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    let yday = month_days.iter().take(month - 1).sum::<i64>() + day;
    let month_name = MONTHS.split(' ').nth(month - 1).unwrap_or("");
    let weekday_name = WEEKDAYS.split(' ').nth(weekday).unwrap_or("");
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.next_if_eq(&'-').is_some();
        let num = |out: &mut String, v: i64, width: usize| {
            let _ = if unpadded {
                write!(out, "{v}")
            } else {
                write!(out, "{v:0width$}")
            };
        };
        match chars.next() {
            Some('Y') => num(&mut out, year, 4),
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month as i64, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:>2}");
            }
            Some('j') => num(&mut out, yday, 3),
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b' | 'h') => out.push_str(month_name.get(..3).unwrap_or(month_name)),
            Some('A') => out.push_str(weekday_name),
            Some('a') => out.push_str(weekday_name.get(..3).unwrap_or(weekday_name)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests;
