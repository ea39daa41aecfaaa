//! Checks of single request fields: ranges of the sampling numbers, `logit_bias`, `stop`, `n`,
//! `seed`, `max_tokens`, message content parts and the body's `kv_cache`. Each returns a typed value or
//! the `ApiError` naming the field.

use crate::error::ApiError;
use kvq_cache::CacheSpec;
use kvq_engine::SamplingParams;
use serde_json::Value;

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// The longest stop string accepted, in bytes (each generated token is matched against them).
pub const MAX_STOP_BYTES: usize = 4096;
/// Most `top_logprobs` in the chat API.
pub const MAX_TOP_LOGPROBS: i64 = 20;
/// Most `logprobs` in the legacy completions API.
pub const MAX_LEGACY_LOGPROBS: i64 = 5;

/// The sampling fields both endpoints share, as sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct SamplingInput<'a> {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<&'a serde_json::Number>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<&'a Value>,
}

fn in_range(param: &str, v: f64, lo: f64, hi: f64, lo_open: bool) -> Result<f32, ApiError> {
    let ok = v.is_finite() && (if lo_open { v > lo } else { v >= lo }) && v <= hi;
    if ok {
        Ok(v as f32)
    } else {
        let open = if lo_open { "greater than" } else { "at least" };
        Err(ApiError::invalid(
            param,
            format!("'{param}' must be {open} {lo} and at most {hi}; got {v}."),
        ))
    }
}

/// Checks every sampling number and builds the engine's `SamplingParams`.
pub fn sampling(s: &SamplingInput<'_>) -> Result<SamplingParams, ApiError> {
    let mut p = SamplingParams::default();
    if let Some(t) = s.temperature {
        p.temperature = in_range("temperature", t, 0.0, 2.0, false)?;
    }
    if let Some(v) = s.top_p {
        p.top_p = in_range("top_p", v, 0.0, 1.0, true)?;
    }
    if let Some(k) = s.top_k {
        p.top_k = usize::try_from(k).map_err(|_| {
            ApiError::invalid("top_k", format!("'top_k' must be at least 0; got {k}."))
        })?;
    }
    if let Some(v) = s.min_p {
        p.min_p = in_range("min_p", v, 0.0, 1.0, false)?;
    }
    if let Some(n) = s.seed {
        p.seed = Some(seed(n)?);
    }
    if let Some(v) = s.frequency_penalty {
        p.frequency_penalty = in_range("frequency_penalty", v, -2.0, 2.0, false)?;
    }
    if let Some(v) = s.presence_penalty {
        p.presence_penalty = in_range("presence_penalty", v, -2.0, 2.0, false)?;
    }
    if let Some(v) = s.repetition_penalty {
        if !(v.is_finite() && v > 0.0) {
            return Err(ApiError::invalid(
                "repetition_penalty",
                format!("'repetition_penalty' must be greater than 0; got {v}."),
            ));
        }
        p.repetition_penalty = v as f32;
    }
    p.logit_bias = logit_bias(s.logit_bias)?;
    Ok(p)
}

/// `seed`: any integer; a negative one is taken as its two's-complement bits.
pub fn seed(n: &serde_json::Number) -> Result<u64, ApiError> {
    if let Some(u) = n.as_u64() {
        Ok(u)
    } else if let Some(i) = n.as_i64() {
        Ok(i as u64)
    } else {
        Err(ApiError::invalid(
            "seed",
            format!("'seed' must be an integer; got {n}."),
        ))
    }
}

/// `max_tokens` (or `max_completion_tokens`): at least 1.
pub fn max_tokens(param: &str, v: Option<i64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n >= 1 => usize::try_from(n)
            .map(Some)
            .map_err(|_| ApiError::invalid(param, format!("'{param}' is too large: {n}."))),
        Some(n) => Err(ApiError::invalid(
            param,
            format!("'{param}' must be at least 1; got {n}."),
        )),
    }
}

/// `stop`: a string or an array of at most four non-empty strings.
pub fn stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = |msg: String| ApiError::invalid("stop", msg);
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) if s.is_empty() => {
            Err(bad("'stop' must not be an empty string.".into()))
        }
        Some(Value::String(s)) if s.len() > MAX_STOP_BYTES => Err(bad(format!(
            "'stop' strings may be at most {MAX_STOP_BYTES} bytes long; got {}.",
            s.len()
        ))),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP_STRINGS {
                return Err(bad(format!(
                    "'stop' may hold at most {MAX_STOP_STRINGS} strings; got {}.",
                    items.len()
                )));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    Value::String(s) if s.len() > MAX_STOP_BYTES => Err(bad(format!(
                        "'stop[{i}]' may be at most {MAX_STOP_BYTES} bytes long; got {}.",
                        s.len()
                    ))),
                    Value::String(s) if !s.is_empty() => Ok(s.clone()),
                    Value::String(_) => Err(bad(format!("'stop[{i}]' must not be empty."))),
                    other => Err(bad(format!(
                        "'stop[{i}]' must be a string; got {}.",
                        kind(other)
                    ))),
                })
                .collect()
        }
        Some(other) => Err(bad(format!(
            "'stop' must be a string or an array of strings; got {}.",
            kind(other)
        ))),
    }
}

/// `n`: 1 up to the server's limit.
pub fn n(v: Option<i64>, max_n: usize) -> Result<usize, ApiError> {
    let max = max_n.max(1);
    match v {
        None => Ok(1),
        Some(n) if n >= 1 && (n as u64) <= max as u64 => Ok(n as usize),
        Some(n) if max == 1 => Err(ApiError::invalid(
            "n",
            format!("'n' must be 1 (this server generates one choice per request); got {n}."),
        )),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("'n' must be between 1 and {max}; got {n}."),
        )),
    }
}

/// The text of a message's `content`: a string, `null`, or an array of text parts (concatenated).
pub fn content(index: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let pparam = format!("{param}[{j}]");
                let Value::Object(obj) = part else {
                    return Err(ApiError::invalid(
                        &pparam,
                        format!("'{pparam}' must be an object; got {}.", kind(part)),
                    ));
                };
                match obj.get("type") {
                    Some(Value::String(t)) if t == "text" => {}
                    Some(Value::String(t)) => {
                        return Err(ApiError::invalid(
                            format!("{pparam}.type"),
                            format!(
                                "Content parts of type '{t}' are not supported; only 'text' parts are."
                            ),
                        ));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{pparam}.type"),
                            format!("'{pparam}.type' must be the string 'text'."),
                        ));
                    }
                }
                match obj.get("text") {
                    Some(Value::String(s)) => text.push_str(s),
                    _ => {
                        return Err(ApiError::invalid(
                            format!("{pparam}.text"),
                            format!("'{pparam}.text' must be a string."),
                        ));
                    }
                }
            }
            Ok(text)
        }
        Some(other) => Err(ApiError::invalid(
            &param,
            format!(
                "'{param}' must be a string or an array of text parts; got {}.",
                kind(other)
            ),
        )),
    }
}

/// The body's `kv_cache`: `{"method": str, "bits": int}`, or just the method name.
pub fn kv_cache(v: Option<&Value>) -> Result<Option<CacheSpec>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(CacheSpec {
            method: Some(s.clone()),
            bits: None,
        })),
        Some(Value::Object(obj)) => {
            let method = match obj.get("method") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(other) => {
                    return Err(ApiError::invalid(
                        "kv_cache.method",
                        format!("'kv_cache.method' must be a string; got {}.", kind(other)),
                    ));
                }
            };
            let bits = match obj.get("bits") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => Some(
                    n.as_u64()
                        .and_then(|b| u8::try_from(b).ok())
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "kv_cache.bits",
                                format!(
                                    "'kv_cache.bits' must be an integer from 0 to 255; got {n}."
                                ),
                            )
                        })?,
                ),
                Some(other) => {
                    return Err(ApiError::invalid(
                        "kv_cache.bits",
                        format!("'kv_cache.bits' must be an integer; got {}.", kind(other)),
                    ));
                }
            };
            Ok(Some(CacheSpec { method, bits }))
        }
        Some(other) => Err(ApiError::invalid(
            "kv_cache",
            format!(
                "'kv_cache' must be an object {{\"method\": ..., \"bits\": ...}}; got {}.",
                kind(other)
            ),
        )),
    }
}

/// A JSON value's kind, for messages.
pub fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The most a `logit_bias` entry may add or subtract (OpenAI's range).
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// `logit_bias`: an object mapping token ids (as strings) to a bias in -100..=100. The ids are
/// checked against the vocabulary by the engine.
pub fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let obj = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(obj)) => obj,
        Some(other) => {
            return Err(ApiError::invalid(
                "logit_bias",
                format!(
                    "'logit_bias' must be an object mapping token ids to a bias; got {}.",
                    kind(other)
                ),
            ));
        }
    };
    let mut out = Vec::with_capacity(obj.len());
    for (key, value) in obj {
        let id = key.trim().parse::<u32>().map_err(|_| {
            ApiError::invalid(
                "logit_bias",
                format!(
                    "'logit_bias' keys must be token ids (non-negative integers); got {key:?}."
                ),
            )
        })?;
        let bias = value
            .as_f64()
            .filter(|b| b.is_finite() && b.abs() <= MAX_LOGIT_BIAS)
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!(
                        "'logit_bias[\"{key}\"]' must be a number from -{MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}; got {value}."
                    ),
                )
            })?;
        out.push((id, bias as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}
