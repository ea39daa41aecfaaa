//! `tools`, `tool_choice` and `parallel_tool_calls` checked into a `ToolPlan`, and the
//! conversation's tool turns (an assistant's `tool_calls`, a `tool` message's `tool_call_id`)
//! turned into the form chat templates expect. Every error names the field at fault.

use crate::error::ApiError;
use kvq_engine::GrammarSpec;
use serde_json::{Map, Value, json};

/// How the model may call the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer in text; the tools are not shown to the model.
    None,
    /// The model decides: its tool-call syntax is parsed out of the reply.
    Auto,
    /// Some call must be made (enforced by the grammar).
    Required,
    /// This function must be called (enforced by the grammar).
    Named(String),
}

/// One function the client offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    /// The JSON schema of its arguments (`{"type": "object"}` when the client gave none).
    pub parameters: Value,
}

/// The checked tool fields of a chat request.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPlan {
    pub functions: Vec<Function>,
    /// The tools as the client sent them, for the chat template's `tools` variable.
    pub template_tools: Vec<Value>,
    pub choice: ToolChoice,
    /// More than one call may be returned (OpenAI's default: true).
    pub parallel: bool,
}

impl ToolPlan {
    /// Whether the grammar must produce a call.
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// Whether replies are searched for calls at all.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The names a parsed call may have.
    pub fn names(&self) -> Vec<String> {
        self.functions.iter().map(|f| f.name.clone()).collect()
    }

    /// For a forced choice: JSON `{"name": <one of the allowed>, "arguments": <its schema>}`.
    pub fn call_grammar(&self) -> Option<GrammarSpec> {
        let call = |f: &Function| {
            json!({
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        match &self.choice {
            ToolChoice::Named(name) => {
                let f = self.functions.iter().find(|f| &f.name == name)?;
                Some(GrammarSpec::JsonSchema(call(f)))
            }
            ToolChoice::Required => {
                let any: Vec<Value> = self.functions.iter().map(call).collect();
                Some(GrammarSpec::JsonSchema(json!({"anyOf": any})))
            }
            ToolChoice::None | ToolChoice::Auto => None,
        }
    }

    /// The instruction given to a model whose chat template cannot show tools, so that a
    /// forced call's arguments are informed.
    pub fn plain_instruction(&self) -> String {
        let list: Vec<String> = self
            .template_tools
            .iter()
            .map(|t| serde_json::to_string(t).unwrap_or_default())
            .collect();
        format!(
            "You can call these functions:\n{}\nTo call one, reply with a JSON object \
             {{\"name\": <function name>, \"arguments\": <arguments object>}}.",
            list.join("\n")
        )
    }
}

fn bad(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

fn absent(v: Option<&Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

/// OpenAI's rule for function names: 1 to 64 of `a-z A-Z 0-9 _ -`.
pub(crate) fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn function(i: usize, tool: &Value) -> Result<Function, ApiError> {
    let at = format!("tools[{i}]");
    let Some(obj) = tool.as_object() else {
        return Err(bad(&at, format!("'{at}' must be an object.")));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => {}
        _ => {
            return Err(bad(
                format!("{at}.type"),
                format!("'{at}.type' must be \"function\" (the only tool type served)."),
            ));
        }
    }
    let Some(f) = obj.get("function").and_then(Value::as_object) else {
        return Err(bad(
            format!("{at}.function"),
            format!("'{at}.function' must be an object with a 'name'."),
        ));
    };
    let name = match f.get("name").and_then(Value::as_str) {
        Some(n) if valid_name(n) => n.to_string(),
        _ => {
            return Err(bad(
                format!("{at}.function.name"),
                format!("'{at}.function.name' must be 1 to 64 letters, digits, '_' or '-'."),
            ));
        }
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(bad(
                format!("{at}.function.parameters"),
                format!("'{at}.function.parameters' must be a JSON schema object."),
            ));
        }
    };
    Ok(Function { name, parameters })
}

/// Checks the three tool fields. `None`: no tools (or an empty list) and no forcing choice.
pub fn tool_plan(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<&Value>,
) -> Result<Option<ToolPlan>, ApiError> {
    let list: &[Value] = match tools {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("tools", "'tools' must be an array of function tools.")),
    };
    let mut functions = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let f = function(i, t)?;
        if functions.iter().any(|g: &Function| g.name == f.name) {
            return Err(bad(
                format!("tools[{i}].function.name"),
                format!("Two tools are named '{}'.", f.name),
            ));
        }
        functions.push(f);
    }
    let parallel = match parallel {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(bad(
                "parallel_tool_calls",
                "'parallel_tool_calls' must be a boolean.",
            ));
        }
    };
    let choice = match choice {
        None | Some(Value::Null) if functions.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!(
                        "'tool_choice' must be \"none\", \"auto\", \"required\" or \
                         {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got \"{other}\"."
                    ),
                ));
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Named(n.to_string()),
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "'tool_choice' as an object must be {\"type\": \"function\", \
                         \"function\": {\"name\": ...}}.",
                    ));
                }
            }
        }
        Some(_) => {
            return Err(bad(
                "tool_choice",
                "'tool_choice' must be a string or a function object.",
            ));
        }
    };
    match &choice {
        ToolChoice::None if functions.is_empty() => return Ok(None),
        ToolChoice::Auto | ToolChoice::Required if functions.is_empty() => {
            return Err(bad(
                "tool_choice",
                "'tool_choice' other than \"none\" needs a non-empty 'tools'.",
            ));
        }
        ToolChoice::Named(n) if !functions.iter().any(|f| &f.name == n) => {
            return Err(bad(
                "tool_choice",
                format!("'tool_choice' names the function '{n}', which is not in 'tools'."),
            ));
        }
        _ => {}
    }
    Ok(Some(ToolPlan {
        functions,
        template_tools: list.to_vec(),
        choice,
        parallel,
    }))
}

/// An assistant message's `tool_calls`, in the form templates read: each call's `arguments`
/// (a JSON string in OpenAI's API) parsed into an object.
pub fn message_tool_calls(i: usize, calls: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let list = match calls {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(bad(
                format!("messages[{i}].tool_calls"),
                format!("'messages[{i}].tool_calls' must be an array."),
            ));
        }
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let at = format!("messages[{i}].tool_calls[{j}]");
        let f = call.get("function").and_then(Value::as_object);
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
        let (Some(f), Some(name)) = (f, name) else {
            return Err(bad(
                format!("{at}.function"),
                format!("'{at}.function' must be an object with a 'name' and 'arguments'."),
            ));
        };
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                bad(
                    format!("{at}.function.arguments"),
                    format!("'{at}.function.arguments' is not JSON: {e}."),
                )
            })?,
            Some(v) => v.clone(),
        };
        let mut c = json!({"type": "function", "function": {"name": name, "arguments": arguments}});
        if let Some(id) = call.get("id").filter(|v| !absent(Some(v))) {
            c["id"] = id.clone();
        }
        out.push(c);
    }
    Ok(Some(Value::Array(out)))
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
