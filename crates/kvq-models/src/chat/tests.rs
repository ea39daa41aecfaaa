//! Chat template tests: rendering of real templates (SmolLM2, Llama-2 style, Gemma turns,
//! ChatML), their errors, tojson and strftime_now.
use super::*;

fn user(text: &str) -> ChatMessage {
    ChatMessage::new("user", text)
}

/// SmolLM2's template as read from the GGUF (kept here so the test also runs without the file).
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const SMOLLM2_EXPECTED: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

fn smollm2_gguf() -> Option<candle_core::quantized::gguf_file::Content> {
    let dir = std::env::var_os("KVQ_MODELS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../../models").into());
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let Ok(mut file) = std::fs::File::open(&path) else {
        eprintln!("skipping GGUF part: {} not found", path.display());
        return None;
    };
    Some(candle_core::quantized::gguf_file::Content::read(&mut file).unwrap())
}

fn smollm2_template_from_gguf() -> Option<String> {
    let content = smollm2_gguf()?;
    Some(
        content.metadata["tokenizer.chat_template"]
            .to_string()
            .unwrap()
            .clone(),
    )
}

#[test]
fn smollm2_template() {
    let mut sources = vec![SMOLLM2_TEMPLATE.to_owned()];
    if let Some(from_gguf) = smollm2_template_from_gguf() {
        assert_eq!(from_gguf, SMOLLM2_TEMPLATE);
        sources.push(from_gguf);
    }
    for source in sources {
        let t = ChatTemplate::new(&source, Some("<|im_start|>"), Some("<|im_end|>")).unwrap();
        let q = [user("What is the capital of France?")];
        assert_eq!(t.render(&q, true).unwrap(), SMOLLM2_EXPECTED);
        let without = SMOLLM2_EXPECTED
            .strip_suffix("<|im_start|>assistant\n")
            .unwrap();
        assert_eq!(t.render(&q, false).unwrap(), without);
        let sys = [ChatMessage::new("system", "Be brief."), user("Hi")];
        assert_eq!(
            t.render(&sys, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(t.source(), source);
    }
}

#[test]
fn tokenizer_template_or_chatml() {
    let Some(content) = smollm2_gguf() else {
        return;
    };
    let tok = Tokenizer::from_gguf(&content).unwrap();
    let t = ChatTemplate::for_tokenizer(&tok).unwrap();
    assert_eq!(Some(t.source()), tok.chat_template());
    let prompt = t
        .render(&[user("What is the capital of France?")], true)
        .unwrap();
    assert_eq!(prompt, SMOLLM2_EXPECTED);
    let ids = tok.encode(&prompt, true).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
}

#[test]
fn gemma_turns_fold_the_system_message_into_the_first_user_turn() {
    let t = ChatTemplate::gemma(Some("<bos>"));
    let msgs = [
        ChatMessage::new("system", "S"),
        user("U "),
        ChatMessage::new("assistant", "A"),
        user("V"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<bos><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n\
         <start_of_turn>user\nV<end_of_turn>\n<start_of_turn>model\n"
    );
}

#[test]
fn transcript_asks_questions_and_stops_at_the_next_one() {
    let t = ChatTemplate::transcript(Some("<bos>"));
    let msgs = [
        ChatMessage::new("system", " Be brief. "),
        user("What is 2 + 2? "),
        ChatMessage::new("assistant", " 4"),
        user("And 3 + 3?"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<bos>Be brief.\n\nQuestion: What is 2 + 2?\nAnswer: 4\nQuestion: And 3 + 3?\nAnswer:"
    );
    assert_eq!(t.stop_strings(), ["\nQuestion:"]);
    // Without a BOS string the template starts with the text itself.
    let t = ChatTemplate::transcript(None);
    assert_eq!(
        t.render(&[user("Hi")], true).unwrap(),
        "Question: Hi\nAnswer:"
    );
    assert!(ChatTemplate::chatml().stop_strings().is_empty());
}

#[test]
fn chatml_fallback() {
    let t = ChatTemplate::chatml();
    let msgs = [
        ChatMessage::new("system", "S"),
        user("U"),
        ChatMessage::new("assistant", "A"),
    ];
    assert_eq!(
        t.render(&msgs, false).unwrap(),
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    );
    assert!(t.render(&[], true).unwrap() == "<|im_start|>assistant\n");
}

/// A Llama-2 style template: system folded into the first turn, strict alternation.
const INLINE: &str = r#"{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'].strip() %}
{% set loop_messages = messages[1:] %}
{% else %}
{% set system = 'Default system.' %}
{% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if loop.first %}
{{ bos_token }}[SYS]{{ system }}[/SYS]
{% endif %}
{% if message['role'] == 'user' %}
[INST] {{ message['content'].strip() }} [/INST]
{% elif message.content.startswith('#') %}
{{ message.content.split('#')[-1] | trim }}{{ eos_token }}
{% else %}
{{ message['content'].replace('  ', ' ') }}{{ eos_token }}
{% endif %}
{% endfor %}
{% if add_generation_prompt and messages[-1].role == 'user' %}
>
{% endif %}"#;

#[test]
fn inline_python_methods_and_blocks() {
    let t = ChatTemplate::new(INLINE, Some("<s>"), Some("</s>")).unwrap();
    let msgs = [
        ChatMessage::new("system", "  Be nice.  "),
        user("  Hello  "),
        ChatMessage::new("assistant", "Hi  there"),
        user("Again"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<s>[SYS]Be nice.[/SYS]\n[INST] Hello [/INST]\nHi there</s>\n[INST] Again [/INST]\n>\n"
    );
    let msgs = [user("Q"), ChatMessage::new("assistant", "#x# answer ")];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<s>[SYS]Default system.[/SYS]\n[INST] Q [/INST]\nanswer</s>\n"
    );
}

#[test]
fn raise_exception_is_template_error() {
    let t = ChatTemplate::new(INLINE, Some("<s>"), Some("</s>")).unwrap();
    let err = t.render(&[user("a"), user("b")], true).unwrap_err();
    match err {
        ModelError::Template(msg) => {
            assert_eq!(
                msg,
                "Conversation roles must alternate user/assistant/user/assistant/..."
            )
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn compile_error_is_template_error() {
    let err = ChatTemplate::new("{% for m in messages %}{{ m.role }", None, None).unwrap_err();
    assert!(
        matches!(err, ModelError::Template(ref m) if m.starts_with("compiling")),
        "{err}"
    );
}

#[test]
fn lenient_undefined_and_missing_tokens() {
    let src = "{% if tools is defined %}T{% endif %}{{ messages[0].tool_calls.name }}[{{ bos_token }}]{% for m in nothing %}x{% endfor %}";
    let t = ChatTemplate::new(src, None, None).unwrap();
    assert_eq!(t.render(&[user("u")], false).unwrap(), "[]");
    let err = ChatTemplate::new("{{ 'a' + 1 }}", None, None)
        .unwrap()
        .render(&[], false)
        .unwrap_err();
    assert!(matches!(err, ModelError::Template(_)));
}

#[test]
fn tojson_like_python() {
    // transformers renders with `json.dumps(..., sort_keys=False)`: keys keep the client's order
    // (serde_json's preserve_order, set for the whole workspace).
    let src = "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ messages | tojson }}|{{ 'é<' | tojson }}";
    let t = ChatTemplate::new(src, None, None).unwrap();
    let extra = serde_json::json!({"tools": [{"name": "get_weather", "parameters": {"city": "string", "days": 3, "x": 1.5, "ok": true, "n": null}}]});
    let out = t
        .render_with(&[user("hi \"you\"")], false, Some(&extra))
        .unwrap();
    let parts: Vec<&str> = out.split('|').collect();
    assert_eq!(
        parts[0],
        r#"[{"name": "get_weather", "parameters": {"city": "string", "days": 3, "x": 1.5, "ok": true, "n": null}}]"#
    );
    assert_eq!(
        parts[1],
        "{\n  \"name\": \"get_weather\",\n  \"parameters\": {\n    \"city\": \"string\",\n    \"days\": 3,\n    \"x\": 1.5,\n    \"ok\": true,\n    \"n\": null\n  }\n}"
    );
    assert_eq!(parts[2], r#"[{"role": "user", "content": "hi \"you\""}]"#);
    assert_eq!(parts[3], r#""é<""#);
    let bad = t.render_with(&[], false, Some(&serde_json::json!([1])));
    assert!(matches!(bad, Err(ModelError::Template(_))));
}

#[test]
fn strftime_formats() {
    // 2024-07-26 00:00:00 UTC, a Friday.
    let t = 1_721_952_000;
    assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
    assert_eq!(
        strftime("%A %B %-d, %y %H:%M:%S %j %%", t + 3_723),
        "Friday July 26, 24 01:02:03 208 %"
    );
    assert_eq!(
        strftime("%Y-%m-%d %I%p %q", 951_782_400),
        "2000-02-29 12AM %q"
    );
    assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
    assert_eq!(strftime("%Y-%m-%d", -86_400), "1969-12-31");
    let now = ChatTemplate::new("{{ strftime_now('%Y') }}", None, None).unwrap();
    assert_eq!(now.render(&[], false).unwrap().len(), 4);
}

#[test]
fn send_sync_clone() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<ChatTemplate>();
    assert!(format!("{:?}", ChatTemplate::chatml()).contains("im_start"));
}

/// A hostile template's render errors; the error names the bound it hit.
fn render_error(source: &str) -> String {
    let t = ChatTemplate::new(source, None, None).expect("compiles");
    let start = std::time::Instant::now();
    let err = t
        .render(&[user("hi")], true)
        .expect_err("must fail")
        .to_string();
    assert!(start.elapsed().as_secs() < 20, "took {:?}", start.elapsed());
    err
}

#[test]
fn endless_loops_run_out_of_fuel() {
    let err = render_error(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    );
    assert!(err.contains("fuel"), "{err}");
}

#[test]
fn output_is_bounded() {
    // 100k x 1 KiB = 100 MiB of output, past the 16 MiB bound.
    let err = render_error("{% for a in range(100000) %}{{ 'x' * 1024 }}{% endfor %}");
    assert!(err.contains("exceeds 16 MiB"), "{err}");
}

#[test]
fn recursion_is_bounded() {
    let err = render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    assert!(err.contains("recursion"), "{err}");
}

#[test]
fn tojson_bounds_indent_and_depth() {
    let err = render_error("{{ messages | tojson(indent=1000000000000) }}");
    assert!(err.contains("indent is at most"), "{err}");
    let err = render_error(
        "{% set ns = namespace(v=[]) %}{% for i in range(300) %}{% set ns.v = [ns.v] %}{% endfor %}{{ ns.v | tojson }}",
    );
    assert!(err.contains("nested deeper"), "{err}");
}

#[test]
fn real_conversations_fit_the_fuel() {
    // 1,000 turns through SmolLM2's template use a small part of the fuel.
    let t = ChatTemplate::new(SMOLLM2_TEMPLATE, None, None).expect("compiles");
    let msgs: Vec<ChatMessage> = (0..1000)
        .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "hello"))
        .collect();
    let out = t.render(&msgs, true).expect("renders");
    assert!(out.len() > 1000 * 5);
}

#[test]
fn template_engine_panics_are_template_errors() {
    // minijinja 2.24 panics on a negative-step slice of an empty string; kvq contains it.
    let t = ChatTemplate::new("{{ messages[0].content[::-1] }}", None, None).expect("compiles");
    let err = t.render(&[user("")], false).expect_err("contained");
    assert!(matches!(err, ModelError::Template(_)), "{err}");
    assert_eq!(t.render(&[user("ab")], false).expect("renders"), "ba");
}

#[test]
fn the_deepest_value_the_fuel_builds_is_printed_hashed_and_dropped() {
    // 40-deep list literals around the last value, 16,000 times: 640,000 levels within the
    // fuel. minijinja prints, hashes and drops values recursively: on a worker thread's stack
    // this aborted the process (found by the chat_template fuzz target).
    let wrap = format!("{}ns.v{}", "[".repeat(40), "]".repeat(40));
    let build = |n: usize| {
        format!(
            "{{% set ns = namespace(v=[]) %}}{{% for i in range({n}) %}}{{% set ns.v = {wrap} %}}{{% endfor %}}"
        )
    };
    for (op, want) in [
        ("{{ (ns.v ~ '')|length }}", "1280002"),
        ("{{ {ns.v: 1}|length }}", "1"),
        ("{{ ns.v|length }}", "1"),
    ] {
        let t = ChatTemplate::new(&(build(16_000) + op), None, None).expect("compiles");
        assert_eq!(
            t.render(&[user("hi")], true).expect("renders"),
            want,
            "{op}"
        );
    }
    // Running out of fuel part-way drops the deepest value the fuel allows.
    let err = render_error(&(build(100_000) + "{{ ns.v }}"));
    assert!(err.contains("fuel"), "{err}");
}

#[test]
fn pprint_is_not_offered() {
    // Its indentation is quadratic in a value's depth, before the output bound sees a byte.
    let err = render_error("{{ messages|pprint }}");
    assert!(err.contains("pprint"), "{err}");
}

#[test]
fn real_templates_use_a_small_part_of_the_fuel() {
    for (name, src, most) in [
        ("smollm2", SMOLLM2_TEMPLATE, 30_000),
        ("gemma", super::GEMMA_TEMPLATE, 60_000),
    ] {
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(1 << 40));
        env.add_function("fuel", |state: &minijinja::State| {
            state.fuel_levels().map_or(0, |x| x.0)
        });
        env.add_template_owned("t", format!("{src}{{{{ '|' ~ fuel() }}}}"))
            .expect("compiles");
        let msgs: Vec<ChatMessage> = (0..1000)
            .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "hello"))
            .collect();
        let out = env
            .get_template("t")
            .and_then(|t| {
                t.render(minijinja::context! { messages => msgs, add_generation_prompt => true })
            })
            .expect("renders");
        let used: u64 = out
            .rsplit('|')
            .next()
            .and_then(|x| x.parse().ok())
            .expect("fuel");
        assert!(used <= most, "{name}: 1,000 turns took {used} instructions");
        assert!(used * 10 <= super::TEMPLATE_FUEL, "{name}: {used}");
    }
}
