//! Unit tests of the renderer: Python-isms real templates use, tojson, strftime_now,
//! continue_final_message, the kwargs and special-token context.

use super::*;

fn template(source: &str, config: serde_json::Value) -> ChatTemplate {
    ChatTemplate::from_source(source, &config).unwrap()
}

fn render(
    source: &str,
    messages: serde_json::Value,
    args: &RenderArgs,
) -> Result<String, LoadError> {
    let messages = messages.as_array().unwrap().clone();
    template(source, serde_json::json!({"bos_token": "<s>"})).render_json(&messages, args)
}

fn one(source: &str) -> String {
    render(
        source,
        serde_json::json!([{"role": "user", "content": "hi"}]),
        &RenderArgs::default(),
    )
    .unwrap()
}

#[test]
fn python_isms_render_as_jinja2_does() {
    assert_eq!(one("{{ messages[::-1][0].content.upper() }}"), "HI");
    assert_eq!(
        one("{{ ' a b '.strip() }}|{{ '\u{1c}x'.strip() }}|{{ 'xyx'.strip('x') }}"),
        "a b|x|y"
    );
    assert_eq!(one("{{ 'a</think>b'.split('</think>')[-1] }}"), "b");
    assert_eq!(
        one("{{ 'abc'.startswith('ab') }} {{ none }} {{ [1, 'a', 2.0] }}"),
        "True None [1, 'a', 2.0]"
    );
    assert_eq!(one("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"), "1");
    assert_eq!(
        one("{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}{{ v }}{% endfor %}"),
        "b1a2"
    );
    assert_eq!(
        one("{{ bos_token }}{{ tools is none }}{{ documents is none }}{{ x is defined }}"),
        "<s>TrueTrueFalse"
    );
    assert_eq!(
        one("{{ ' x '|trim }}{{ 3|string }}{{ true|string }}"),
        "x3True"
    );
    assert_eq!(one("{{ messages[0]['content'] is string }}"), "True");
}

#[test]
fn raise_exception_is_an_error_with_its_message() {
    let e = render(
        "{{ raise_exception('roles must alternate') }}",
        serde_json::json!([{"role": "user", "content": "hi"}]),
        &RenderArgs::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("roles must alternate"), "{e}");
}

#[test]
fn tojson_is_transformers_tojson() {
    assert_eq!(
        one("{{ {'a': '<b> & é', 'n': [1, 1.5, none, true]}|tojson }}"),
        r#"{"a": "<b> & é", "n": [1, 1.5, null, true]}"#
    );
    assert_eq!(
        one("{{ {'b': 1, 'a': [2]}|tojson(indent=2, sort_keys=true) }}"),
        "{\n  \"a\": [\n    2\n  ],\n  \"b\": 1\n}"
    );
    assert_eq!(
        one("{{ {'a': 1}|tojson(separators=(',', ':')) }}"),
        r#"{"a":1}"#
    );
    assert_eq!(one("{{ 'é'|tojson(ensure_ascii=true) }}"), r#""\u00e9""#);
    assert!(render(
        "{{ nothing|tojson }}",
        serde_json::json!([]),
        &RenderArgs::default()
    )
    .is_err());
    let _planted = crate::plant::on(crate::plant::Defect::TemplateTojsonEscapesHtml);
    if crate::plant::COMPILED_IN {
        assert_eq!(one("{{ '<a>'|tojson }}"), r#""\u003ca\u003e""#);
    }
}

#[test]
fn strftime_now_reads_the_pinned_clock() {
    let now = chrono::NaiveDate::from_ymd_opt(2024, 7, 26)
        .unwrap()
        .and_hms_opt(9, 5, 0)
        .unwrap();
    let t = template(
        "{{ strftime_now('%d %b %Y %H:%M %A %B %-d %j') }}",
        serde_json::json!({}),
    )
    .with_now(now);
    assert_eq!(
        t.render(&[], false).unwrap(),
        "26 Jul 2024 09:05 Friday July 26 208"
    );
    let bad = template("{{ strftime_now('%Q') }}", serde_json::json!({})).with_now(now);
    assert!(bad.render(&[], false).is_err());
}

#[test]
fn kwargs_override_special_tokens_and_cannot_repeat_render_arguments() {
    let mut args = RenderArgs::default();
    args.kwargs.insert("enable_thinking".into(), false.into());
    args.kwargs.insert("bos_token".into(), "<B>".into());
    let out = render(
        "{{ bos_token }}{{ enable_thinking is false }}",
        serde_json::json!([]),
        &args,
    )
    .unwrap();
    assert_eq!(out, "<B>True");
    args.kwargs.insert("messages".into(), serde_json::json!([]));
    let e = render("x", serde_json::json!([]), &args)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("got multiple values for keyword argument 'messages'"),
        "{e}"
    );
}

const TURNS: &str =
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}\
{% if add_generation_prompt %}<assistant>{% endif %}";

#[test]
fn continue_final_message_leaves_the_last_turn_open() {
    let messages = serde_json::json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello, "},
    ]);
    let args = RenderArgs {
        continue_final_message: true,
        ..RenderArgs::default()
    };
    assert_eq!(
        render(TURNS, messages.clone(), &args).unwrap(),
        "<user>hi</user><assistant>Hello, "
    );
    // A template that trims: the trailing space goes too, as in transformers.
    let trims = TURNS.replace("{{ m.content }}", "{{ m.content|trim }}");
    assert_eq!(
        render(&trims, messages.clone(), &args).unwrap(),
        "<user>hi</user><assistant>Hello,"
    );
    let both = RenderArgs {
        add_generation_prompt: true,
        ..args.clone()
    };
    let e = render(TURNS, messages, &both).unwrap_err().to_string();
    assert!(
        e.contains("continue_final_message and add_generation_prompt are not compatible"),
        "{e}"
    );
}

#[test]
fn tools_and_documents_must_be_lists_of_dicts() {
    let args = RenderArgs {
        tools: Some(serde_json::json!(["not a schema"])),
        ..RenderArgs::default()
    };
    let e = render(TURNS, serde_json::json!([]), &args)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Tools should either be a JSON schema"), "{e}");
    let args = RenderArgs {
        documents: Some(serde_json::json!([1])),
        ..RenderArgs::default()
    };
    let e = render(TURNS, serde_json::json!([]), &args)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Documents should be a list of dicts"), "{e}");
}

#[test]
fn generation_blocks_render_their_body() {
    assert_eq!(one("{% generation %}a{% endgeneration %}b"), "ab");
}
