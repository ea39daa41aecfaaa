//! The tool fields' checks: every bad form is a 400 naming its field.

use super::*;
use serde_json::json;

fn weather() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "d",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"]}}}, {"type": "function", "function": {"name": "get_time"}}])
}

#[test]
fn tools_and_choices_parse() {
    let plan = tool_plan(Some(&weather()), None, None).unwrap().unwrap();
    assert_eq!(plan.choice, ToolChoice::Auto);
    assert!(plan.parallel && plan.active() && !plan.forced());
    assert_eq!(plan.names(), vec!["get_weather", "get_time"]);
    assert_eq!(plan.functions[1].parameters, json!({"type": "object"}));
    assert_eq!(plan.call_grammar(), None);

    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let plan = tool_plan(Some(&weather()), Some(&named), Some(&json!(false)))
        .unwrap()
        .unwrap();
    assert_eq!(plan.choice, ToolChoice::Named("get_weather".into()));
    assert!(!plan.parallel && plan.forced());
    let Some(GrammarSpec::JsonSchema(g)) = plan.call_grammar() else {
        panic!("a named choice has a grammar");
    };
    assert_eq!(g["properties"]["name"]["const"], "get_weather");
    assert_eq!(g["properties"]["arguments"]["required"], json!(["city"]));

    let plan = tool_plan(Some(&weather()), Some(&json!("required")), None)
        .unwrap()
        .unwrap();
    let Some(GrammarSpec::JsonSchema(g)) = plan.call_grammar() else {
        panic!("required has a grammar");
    };
    assert_eq!(g["anyOf"].as_array().map(Vec::len), Some(2));

    let none = tool_plan(Some(&weather()), Some(&json!("none")), None)
        .unwrap()
        .unwrap();
    assert!(!none.active());
    assert_eq!(tool_plan(None, None, None).unwrap(), None);
    assert_eq!(
        tool_plan(Some(&json!([])), Some(&json!("none")), None).unwrap(),
        None
    );
}

#[test]
fn bad_tool_fields_name_their_param() {
    let cases = [
        (json!({"tools": {}}), "tools"),
        (json!({"tools": [1]}), "tools[0]"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f"}}]}),
            "tools[1].function.name",
        ),
        (
            json!({"tools": weather(), "tool_choice": "always"}),
            "tool_choice",
        ),
        (json!({"tools": weather(), "tool_choice": 3}), "tool_choice"),
        (
            json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": weather(), "parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
        ),
    ];
    for (req, param) in cases {
        let err = tool_plan(
            req.get("tools"),
            req.get("tool_choice"),
            req.get("parallel_tool_calls"),
        )
        .expect_err(&req.to_string());
        assert_eq!(err.param(), Some(param), "{req}: {err}");
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
    }
}

#[test]
fn assistant_tool_calls_get_object_arguments_for_the_template() {
    let calls = json!([{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]);
    let out = message_tool_calls(1, Some(&calls)).unwrap().unwrap();
    assert_eq!(out[0]["function"]["arguments"], json!({"city": "Paris"}));
    assert_eq!(out[0]["id"], "call_1");
    assert_eq!(message_tool_calls(1, Some(&json!([]))).unwrap(), None);
    let bad = json!([{"function": {"name": "f", "arguments": "{oops"}}]);
    let err = message_tool_calls(2, Some(&bad)).unwrap_err();
    assert_eq!(
        err.param(),
        Some("messages[2].tool_calls[0].function.arguments")
    );
    let err = message_tool_calls(0, Some(&json!([{"type": "function"}]))).unwrap_err();
    assert_eq!(err.param(), Some("messages[0].tool_calls[0].function"));
}
