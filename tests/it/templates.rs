//! The template gate (`gates::TEMPLATES`, harness::parity::templates): every conversation of
//! goldens/templates/<fixture> (oracles/gen_templates.py: transformers'
//! `apply_chat_template(..., tokenize=False)` at a pinned clock) rendered by
//! `ChatTemplate::render_json` is transformers' string exactly, for the real templates
//! (qwen3, gemma3, llama3.1, llama3.2, deepseek-v3; a missing fixture fails with
//! `bash scripts/fetch_fixtures.sh`) and our own `pyisms` template; ≥ 12 rendered per
//! template, errors where transformers raised.

use harness::parity::gates::{Plant, TEMPLATES};
use harness::parity::templates::MIN_RENDERED;

#[test]
fn every_template_renders_as_transformers_does() {
    for fixture in TEMPLATES.models() {
        let r = TEMPLATES.run(fixture, None).unwrap();
        harness::announce(&r.summary());
        assert!(
            r.passed(),
            "{fixture}: {}\n{}",
            r.summary(),
            r.details().join("\n")
        );
    }
    const { assert!(MIN_RENDERED >= 12) };
}

/// Planted: tojson HTML-escapes as Jinja's own does (the tools branches of qwen3 and
/// llama3.2 and pyisms's tojson lines differ); the template kwargs are dropped
/// (enable_thinking=False renders no empty think block in qwen3; pyisms prints its kwargs);
/// the special tokens are dropped (DeepSeek V3's, Gemma 3's and Llama 3.1's templates open
/// with `bos_token`).
#[test]
fn planted_template_defects_fail() {
    for (plant, fixtures) in [
        ("tojson-html-escape", ["qwen3", "llama3.2", "pyisms"]),
        ("template-kwargs-dropped", ["qwen3", "llama3.2", "pyisms"]),
        (
            "template-special-tokens-dropped",
            ["deepseek-v3", "gemma3", "llama3.1"],
        ),
    ] {
        let plant = Plant::parse(plant).unwrap();
        for fixture in fixtures {
            let r = TEMPLATES.run(fixture, Some(&plant)).unwrap();
            println!("planted {plant:?}: {}", r.summary());
            assert!(!r.passed(), "{fixture}: {}", r.summary());
        }
    }
}
