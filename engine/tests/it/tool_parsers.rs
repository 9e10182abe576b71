//! The glm47, kimi_k2, minimax_m2 and longcat tool parsers against mlx-lm 0.32.2's own
//! (goldens/tool_parsers/index.json, from oracles/gen_tool_parsers.py): every tool-call
//! text parses to the calls mlx-lm's parser returned (arguments as its `json.dumps` wrote
//! them, the model's ids, any other keys), or fails where it raised; every whole answer
//! splits into the reasoning, content and calls mlx_lm.server's state machine gave. Each
//! parser's planted defect must fail the gate. Also: mlx-lm's parser choice for the
//! template markers of the model families that use these formats.

use std::sync::Arc;

use engine::plant::{self, Defect};
use engine::serve::tools::machine::State;
use engine::serve::tools::split::Splitter;
use engine::serve::tools::value::PyValue;
use engine::serve::tools::{infer_family, Family, Markers, Thinking};
use serde_json::{json, Value};

use crate::common::goldens;

fn golden() -> Value {
    let path = goldens().join("tool_parsers").join("index.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// A parsed call as the golden records it: its keys in order, `arguments` dumped.
fn call_json(call: &PyValue) -> Value {
    let mut v = call.to_json();
    if let (Some(obj), Some(args)) = (v.as_object_mut(), call.get("arguments")) {
        obj.insert("arguments".into(), json!(args.dumps().unwrap()));
    }
    v
}

/// Each parser's mismatches with mlx-lm (one line each), and its case count.
fn parser_mismatches(g: &Value, only: Option<&str>) -> (Vec<String>, usize) {
    let (mut bad, mut n) = (Vec::new(), 0);
    for case in g["cases"].as_array().unwrap() {
        let name = case["parser"].as_str().unwrap();
        if only.is_some_and(|o| o != name) {
            continue;
        }
        n += 1;
        let family = Family::from_name(name).unwrap();
        let tools = case["tools"].as_bool().unwrap().then_some(&g["tools"]);
        let text = case["text"].as_str().unwrap();
        let got = family.parse(text, tools);
        let want = &case["expect"];
        let ok = match (&got, want.get("calls")) {
            (Ok(calls), Some(Value::Array(w))) => calls.iter().map(call_json).eq(w.iter().cloned()),
            (Err(_), None) => true,
            _ => false,
        };
        if !ok {
            let got = got.map(|c| c.iter().map(call_json).collect::<Vec<_>>());
            bad.push(format!(
                "{name} {:?}: ours {got:?}, mlx-lm {want}",
                case["label"]
            ));
        }
    }
    (bad, n)
}

/// The whole answers: pieces through the splitter, as mlx_lm.server's handler took them.
fn stream_mismatches(g: &Value) -> Vec<String> {
    let mut bad = Vec::new();
    for s in g["streams"].as_array().unwrap() {
        let family = Family::from_name(s["parser"].as_str().unwrap()).unwrap();
        let think = |i: usize| s["think"][i].as_str().unwrap().to_owned();
        let markers = Markers {
            thinking: Some(Thinking {
                start: think(0),
                end: think(1),
                start_ids: vec![1],
                end_ids: vec![2],
            }),
            tools: Some(family),
            structural: Vec::new(),
        };
        let machine = Arc::new(markers.machine());
        let mut split = Splitter::new(&markers, machine, Some(g["tools"].clone()), State::Normal);
        let pieces: Vec<&str> = s["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        let eos = s["eos"].as_bool().unwrap();
        let mut deltas = Vec::new();
        for (i, piece) in pieces.iter().enumerate() {
            let last = i + 1 == pieces.len() && !eos;
            deltas.extend(if last {
                split.push_last(piece)
            } else {
                split.push(piece)
            });
        }
        deltas.push(split.finish(eos).0);
        let content: String = deltas.iter().map(|d| d.text.as_str()).collect();
        let reasoning: String = deltas.iter().map(|d| d.reasoning.as_str()).collect();
        let calls: Vec<Value> = deltas
            .iter()
            .flat_map(|d| &d.tool_calls)
            .map(|c| json!({"name": c.name, "arguments": c.arguments, "id": c.id}))
            .collect();
        let want = &s["expect"];
        let want_calls: Vec<Value> = want["calls"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&calls)
            .map(|(w, c)| {
                let mut w = w.clone();
                // A call without the model's own id gets a fresh one: compare its presence.
                if w.get("id").is_none() {
                    w["id"] = c["id"].clone();
                }
                w
            })
            .collect();
        let same = content == want["content"]
            && reasoning == want["reasoning"]
            && calls.len() == want["calls"].as_array().unwrap().len()
            && calls == want_calls;
        if !same {
            bad.push(format!(
                "stream {:?}: ours content {content:?} reasoning {reasoning:?} calls {calls:?}; \
                 mlx-lm {want}",
                s["pieces"]
            ));
        }
    }
    bad
}

#[test]
fn the_parsers_give_what_mlx_lm_gives_and_each_planted_defect_fails() {
    let g = golden();
    for name in ["glm47", "kimi_k2", "minimax_m2", "longcat"] {
        let (bad, n) = parser_mismatches(&g, Some(name));
        assert!(n >= 10, "{name}: {n} cases, want at least 10");
        assert!(
            bad.is_empty(),
            "{name}: {} of {n} differ:\n{}",
            bad.len(),
            bad.join("\n")
        );
    }
    let bad = stream_mismatches(&g);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    // Planted: each parser's defect must fail its own cases.
    for (defect, name) in [
        (Defect::Glm47StringArgsDeserialized, "glm47"),
        (Defect::KimiK2IdWithoutPrefix, "kimi_k2"),
        (Defect::MinimaxWholeNumbersFloat, "minimax_m2"),
        (Defect::LongcatJsonIgnored, "longcat"),
    ] {
        let _on = plant::on(defect).unwrap();
        let (bad, _) = parser_mismatches(&g, Some(name));
        assert!(
            !bad.is_empty(),
            "{defect:?} planted, yet {name}'s cases pass"
        );
    }
}

/// mlx-lm's `_infer_tool_parser` on the tool-call markers of each family's chat template
/// (the marker lines only; every family of these formats, and ones mlx-lm gives none).
#[test]
fn the_parser_is_chosen_from_the_template_as_mlx_lm_chooses_it() {
    let none = |_: &str| false;
    let rows: [(&str, &str, Option<Family>); 9] = [
        ("GLM-4.5 / 4.6 / 4.7 (glm4_moe, glm4_moe_lite)",
         "<tool_call>{{ tc.name }}\n{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>",
         Some(Family::Glm47)),
        ("Kimi K2 / K2.5",
         "<|tool_calls_section_begin|><|tool_call_begin|>{{ tool_call.id }}<|tool_call_argument_begin|>{{ args }}<|tool_call_end|><|tool_calls_section_end|>",
         Some(Family::KimiK2)),
        ("MiniMax M2",
         "<minimax:tool_call>\n<invoke name=\"{{ tool_call.name }}\">\n<parameter name=\"{{ k }}\">{{ v }}</parameter>\n</invoke>\n</minimax:tool_call>",
         Some(Family::MinimaxM2)),
        ("LongCat",
         "<longcat_tool_call>{{ name }}<longcat_arg_key>{{ k }}</longcat_arg_key><longcat_arg_value>{{ v }}</longcat_arg_value></longcat_tool_call>",
         Some(Family::Longcat)),
        // MiniMax's markers win over the <tool_call> JSON rule further down mlx-lm's list.
        ("MiniMax M2 beside a JSON example",
         "<minimax:tool_call> … <tool_call>{{ tool_call.name }}</tool_call>",
         Some(Family::MinimaxM2)),
        ("DeepSeek V3 / V3.1 / V3.2",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tool['function']['name'] }}",
         None),
        ("Hermes-style JSON (Qwen 2.5 / 3)",
         "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>",
         Some(Family::JsonTools)),
        ("Mistral 3 / Ministral 3", "[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}", Some(Family::Mistral)),
        ("Llama 4 (pythonic calls, no mlx-lm marker)", "<|python_start|>[{{ name }}(…)]<|python_end|>", None),
    ];
    for (family, template, want) in rows {
        assert_eq!(infer_family(Some(template), &none), want, "{family}");
    }
    // The vocabulary is asked only when the template names no format.
    let lfm = |t: &str| t == "<|tool_call_start|>" || t == "<|tool_call_end|>";
    assert_eq!(infer_family(Some("<arg_key>"), &lfm), Some(Family::Glm47));
    assert_eq!(infer_family(Some("plain"), &lfm), Some(Family::Pythonic));
}
