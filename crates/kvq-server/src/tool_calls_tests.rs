//! Tool-call parsing of whole and streamed replies.

use super::*;

fn mode(forced: bool, parallel: bool) -> ToolMode {
    ToolMode {
        names: vec!["get_weather".into(), "get_time".into()],
        forced,
        parallel,
    }
}

fn call(name: &str, args: &str) -> ParsedCall {
    ParsedCall {
        name: name.into(),
        arguments: args.into(),
    }
}

#[test]
fn qwen_blocks_become_calls_and_the_rest_stays_text() {
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let (content, calls) = parse_reply(text, &mode(false, true));
    assert_eq!(content.as_deref(), Some("Let me check."));
    assert_eq!(
        calls,
        vec![
            call("get_weather", r#"{"city":"Paris"}"#),
            call("get_time", "{}")
        ]
    );
    // parallel_tool_calls: false keeps the first.
    let (_, calls) = parse_reply(text, &mode(false, false));
    assert_eq!(calls.len(), 1);
}

#[test]
fn unknown_names_broken_json_and_plain_json_stay_text() {
    for text in [
        "The weather is fine.",
        "<tool_call>\n{\"name\": \"launch_rockets\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n",
        "{\"city\": \"Paris\"}",
    ] {
        let (content, calls) = parse_reply(text, &mode(false, true));
        assert!(calls.is_empty(), "{text}");
        assert_eq!(content.as_deref(), Some(text));
    }
}

#[test]
fn bare_and_forced_json_calls_parse_with_string_or_parameters_arguments() {
    let (content, calls) = parse_reply(
        "  {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
        &mode(false, true),
    );
    assert_eq!(content, None);
    assert_eq!(calls, vec![call("get_weather", r#"{"city":"Oslo"}"#)]);
    let (_, calls) = parse_reply(
        "{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"UTC\\\"}\"}",
        &mode(true, true),
    );
    assert_eq!(calls, vec![call("get_time", r#"{"tz":"UTC"}"#)]);
}

/// Streams `pieces` and returns (content sent while streaming + at the end, calls).
fn stream(pieces: &[&str], m: ToolMode) -> (String, Vec<ParsedCall>) {
    let mut s = ToolStream::new(m);
    let mut sent = String::new();
    for p in pieces {
        sent.push_str(&s.push(p));
    }
    let (tail, calls) = s.finish();
    sent.push_str(&tail);
    (sent, calls)
}

#[test]
fn a_stream_passes_text_on_and_holds_a_call_until_the_end() {
    let mut s = ToolStream::new(mode(false, true));
    assert_eq!(s.push("Sure"), "Sure");
    // "<tool" may be the tag: held.
    assert_eq!(s.push(", one moment <tool"), ", one moment ");
    assert_eq!(s.push("_call>\n{\"name\": \"get_time\", "), "");
    assert_eq!(s.push("\"arguments\": {}}\n</tool_call>"), "");
    let (tail, calls) = s.finish();
    assert_eq!(tail, "");
    assert_eq!(calls, vec![call("get_time", "{}")]);

    // A '<' that is not the tag is released; the whole text arrives in order.
    let text = ["a < b", "<to", "o> c ", "é"];
    let (sent, calls) = stream(&text, mode(false, true));
    assert!(calls.is_empty());
    assert_eq!(sent, text.concat());
}

#[test]
fn a_streamed_reply_gives_what_the_whole_reply_gives() {
    let replies = [
        "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",
        "{\"name\": \"get_time\", \"arguments\": {}}",
        "{\"not\": \"a call\"}",
        "Plain answer with a <b>tag</b>.",
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"ci",
    ];
    for text in replies {
        for forced in [false, true] {
            let m = mode(forced, true);
            let (content, want) = parse_reply(text, &m);
            // Cut at every char boundary into two pieces.
            for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                let (sent, calls) = stream(&[&text[..cut], &text[cut..]], m.clone());
                assert_eq!(calls, want, "{text} cut at {cut}");
                match want.is_empty() {
                    true => assert_eq!(sent, text, "{text} cut at {cut}"),
                    false => assert_eq!(sent, content.clone().unwrap_or_default()),
                }
            }
        }
    }
}
