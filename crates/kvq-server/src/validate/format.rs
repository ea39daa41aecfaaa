//! `response_format`, OpenAI's structured outputs: `{"type": "text"}`, `{"type": "json_object"}`
//! and `{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}`,
//! checked here and turned into the grammar the engine enforces (`kvq_engine::grammar`).

use super::fields::kind;
use crate::error::ApiError;
use kvq_engine::GrammarSpec;
use serde_json::Value;

/// The grammar `response_format` asks for: `None` for free text (absent, null or `text`).
pub fn response_format(v: Option<&Value>) -> Result<Option<GrammarSpec>, ApiError> {
    let obj = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(obj)) => obj,
        Some(other) => {
            return Err(ApiError::invalid(
                "response_format",
                format!(
                    "'response_format' must be an object like {{\"type\": \"json_object\"}}; got {}.",
                    kind(other)
                ),
            ));
        }
    };
    match obj.get("type") {
        Some(Value::String(t)) if t == "text" => Ok(None),
        Some(Value::String(t)) if t == "json_object" => Ok(Some(GrammarSpec::JsonObject)),
        Some(Value::String(t)) if t == "json_schema" => json_schema(obj.get("json_schema")),
        Some(Value::String(t)) => Err(ApiError::invalid(
            "response_format.type",
            format!(
                "'response_format.type' must be 'text', 'json_object' or 'json_schema'; got '{t}'."
            ),
        )),
        _ => Err(ApiError::invalid(
            "response_format.type",
            "'response_format.type' is required and must be a string.",
        )),
    }
}

/// `json_schema`: a `name` as OpenAI restricts it, an optional `description` and `strict`, and
/// the `schema` (an object; absent means any JSON object).
fn json_schema(v: Option<&Value>) -> Result<Option<GrammarSpec>, ApiError> {
    const P: &str = "response_format.json_schema";
    let Some(Value::Object(js)) = v else {
        return Err(ApiError::invalid(
            P,
            "'response_format.json_schema' is required with type 'json_schema': an object with \
             'name' and 'schema'.",
        ));
    };
    match js.get("name") {
        Some(Value::String(n)) if super::tools::valid_name(n) => {}
        _ => {
            return Err(ApiError::invalid(
                "response_format.json_schema.name",
                "'response_format.json_schema.name' is required: 1 to 64 letters, digits, \
                 underscores or dashes.",
            ));
        }
    }
    if !matches!(
        js.get("description"),
        None | Some(Value::Null | Value::String(_))
    ) {
        return Err(ApiError::invalid(
            "response_format.json_schema.description",
            "'response_format.json_schema.description' must be a string.",
        ));
    }
    if !matches!(js.get("strict"), None | Some(Value::Null | Value::Bool(_))) {
        return Err(ApiError::invalid(
            "response_format.json_schema.strict",
            "'response_format.json_schema.strict' must be a boolean.",
        ));
    }
    match js.get("schema") {
        None | Some(Value::Null) => Ok(Some(GrammarSpec::JsonObject)),
        Some(s @ Value::Object(_)) => Ok(Some(GrammarSpec::JsonSchema(s.clone()))),
        Some(other) => Err(ApiError::invalid(
            "response_format.json_schema.schema",
            format!(
                "'response_format.json_schema.schema' must be a JSON Schema object; got {}.",
                kind(other)
            ),
        )),
    }
}

/// The 400 for a schema the grammar compiler refused (an unsupported keyword, a bad `$ref`).
pub fn schema_error(e: kvq_engine::GrammarError) -> ApiError {
    match e {
        kvq_engine::GrammarError::Schema(msg) => ApiError::invalid(
            "response_format.json_schema.schema",
            format!("'response_format.json_schema.schema' cannot be enforced: {msg}"),
        ),
        other => ApiError::unsupported("response_format", other.to_string()),
    }
}

/// The 400 for a forced tool call whose `parameters` schema the grammar compiler refused.
pub fn tool_schema_error(e: kvq_engine::GrammarError) -> ApiError {
    match e {
        kvq_engine::GrammarError::Schema(msg) => ApiError::invalid(
            "tools",
            format!("A tool's 'function.parameters' schema cannot be enforced: {msg}"),
        ),
        other => ApiError::unsupported("tool_choice", other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn formats_become_grammars() {
        assert_eq!(response_format(None).unwrap(), None);
        assert_eq!(
            response_format(Some(&json!({"type": "text"}))).unwrap(),
            None
        );
        assert_eq!(
            response_format(Some(&json!({"type": "json_object"}))).unwrap(),
            Some(GrammarSpec::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let f = json!({"type": "json_schema", "json_schema": {"name": "a_b-1", "strict": true,
            "description": "d", "schema": schema}});
        assert_eq!(
            response_format(Some(&f)).unwrap(),
            Some(GrammarSpec::JsonSchema(schema))
        );
        let no_schema = json!({"type": "json_schema", "json_schema": {"name": "x"}});
        assert_eq!(
            response_format(Some(&no_schema)).unwrap(),
            Some(GrammarSpec::JsonObject)
        );
    }

    #[test]
    fn malformed_formats_name_the_field() {
        for (f, param) in [
            (json!("json"), "response_format"),
            (json!({"type": "yaml"}), "response_format.type"),
            (json!({}), "response_format.type"),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "has space"}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}),
                "response_format.json_schema.strict",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "description": 1}}),
                "response_format.json_schema.description",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": true}}),
                "response_format.json_schema.schema",
            ),
        ] {
            let err = response_format(Some(&f)).expect_err(&f.to_string());
            assert_eq!(err.param(), Some(param), "{f}");
            assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        }
    }
}
