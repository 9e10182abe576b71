//! GRPO's reward functions, given as data (`--reward-spec FILE`, a JSON list), no Python:
//!
//! - `{"kind": "exact_match", "field": "answer"}`: 1 when the completion, trimmed, equals
//!   the example's `field` (a string), trimmed; else 0.
//! - `{"kind": "regex", "pattern": "…"}`: 1 when the pattern matches somewhere in the
//!   completion (anchor it with `^…$` for a full match); else 0.
//! - `{"kind": "json_schema", "schema": {…}}`: 1 when the completion parses as JSON and
//!   the value is valid against the schema; else 0.
//! - `{"kind": "length", "target": N, "unit": "chars" | "tokens"}`: max(0, 1 − |n − N| / N).
//! - `{"kind": "http", "url": "http://…", "timeout_s": 30}`: one POST per batch of
//!   `{"items": [{"prompt", "completion", "example"}]}`, answered by `{"rewards": [r | null]}`
//!   (null: that completion is not scored by this function).
//!
//! Each entry may carry a `weight` (default 1, TRL's `reward_weights`). A completion's
//! reward is the weighted sum over the functions that scored it (`grpo::advantages`).

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

/// One reward function as the spec file states it.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
enum Spec {
    ExactMatch {
        field: String,
        #[serde(default = "one")]
        weight: f64,
    },
    Regex {
        pattern: String,
        #[serde(default = "one")]
        weight: f64,
    },
    JsonSchema {
        schema: Value,
        #[serde(default = "one")]
        weight: f64,
    },
    Length {
        target: usize,
        #[serde(default)]
        unit: LengthUnit,
        #[serde(default = "one")]
        weight: f64,
    },
    Http {
        url: String,
        #[serde(default = "thirty")]
        timeout_s: u64,
        #[serde(default = "one")]
        weight: f64,
    },
}

fn one() -> f64 {
    1.0
}

fn thirty() -> u64 {
    30
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
enum LengthUnit {
    #[default]
    Chars,
    Tokens,
}

/// A compiled reward function.
enum Scorer {
    Exact(String),
    Regex(regex::Regex),
    Schema(Box<jsonschema::Validator>),
    Length(usize, LengthUnit),
    Http(String, Duration),
}

/// The reward functions of a run, checked and compiled before any step.
pub struct Rewards {
    scorers: Vec<Scorer>,
    pub weights: Vec<f64>,
}

/// One completion to score.
pub struct Scored<'a> {
    pub prompt: &'a str,
    pub completion: &'a str,
    pub completion_tokens: usize,
    /// The data line the prompt came from (exact_match reads its fields; http gets it).
    pub example: &'a Value,
}

impl Rewards {
    /// The spec in `text` (a JSON list), each entry checked: an unknown kind or field, a
    /// regex or schema that does not compile, a zero length target, a non-http URL or a
    /// weight that is not finite is an error naming the entry.
    pub fn parse(text: &str) -> Result<Rewards, String> {
        let specs: Vec<Value> = serde_json::from_str(text)
            .map_err(|e| format!("the reward spec must be a JSON list of functions: {e}"))?;
        if specs.is_empty() {
            return Err("the reward spec lists no functions".into());
        }
        let (mut scorers, mut weights) = (Vec::new(), Vec::new());
        for (i, v) in specs.into_iter().enumerate() {
            let at = |e: String| format!("reward spec entry {}: {e}", i + 1);
            let spec: Spec = serde_json::from_value(v).map_err(|e| at(e.to_string()))?;
            let (scorer, weight) = Self::compile(spec).map_err(at)?;
            if !weight.is_finite() {
                return Err(at("`weight` must be a finite number".into()));
            }
            scorers.push(scorer);
            weights.push(weight);
        }
        Ok(Rewards { scorers, weights })
    }

    fn compile(spec: Spec) -> Result<(Scorer, f64), String> {
        Ok(match spec {
            Spec::ExactMatch { field, weight } => (Scorer::Exact(field), weight),
            Spec::Regex { pattern, weight } => {
                let re = regex::Regex::new(&pattern).map_err(|e| format!("bad regex: {e}"))?;
                (Scorer::Regex(re), weight)
            }
            Spec::JsonSchema { schema, weight } => {
                let v = jsonschema::validator_for(&schema)
                    .map_err(|e| format!("bad JSON schema: {e}"))?;
                (Scorer::Schema(Box::new(v)), weight)
            }
            Spec::Length {
                target,
                unit,
                weight,
            } => {
                if target == 0 {
                    return Err("`target` must be at least 1".into());
                }
                (Scorer::Length(target, unit), weight)
            }
            Spec::Http {
                url,
                timeout_s,
                weight,
            } => {
                if !url.starts_with("http://") && !url.starts_with("https://") {
                    return Err(format!(
                        "`url` must be an http:// or https:// URL, not {url:?}"
                    ));
                }
                (
                    Scorer::Http(url, Duration::from_secs(timeout_s.max(1))),
                    weight,
                )
            }
        })
    }

    /// The fields every example must carry for these functions (exact_match's).
    pub fn required_fields(&self) -> Vec<&str> {
        self.scorers
            .iter()
            .filter_map(|s| match s {
                Scorer::Exact(f) => Some(f.as_str()),
                _ => None,
            })
            .collect()
    }

    /// Every completion's score by every function: [completions][functions] (None: not
    /// scored). An endpoint that fails or answers out of shape is an error naming it.
    pub fn score(&self, items: &[Scored]) -> Result<Vec<Vec<Option<f64>>>, String> {
        let mut columns = Vec::with_capacity(self.scorers.len());
        for s in &self.scorers {
            columns.push(match s {
                Scorer::Http(url, timeout) => http_scores(url, *timeout, items)?,
                local => items
                    .iter()
                    .map(|it| Some(local_score(local, it)))
                    .collect(),
            });
        }
        Ok((0..items.len())
            .map(|i| columns.iter().map(|c| c[i]).collect())
            .collect())
    }
}

fn local_score(s: &Scorer, it: &Scored) -> f64 {
    let hit = |b: bool| if b { 1.0 } else { 0.0 };
    match s {
        Scorer::Exact(field) => hit(it.example[field.as_str()]
            .as_str()
            .is_some_and(|want| want.trim() == it.completion.trim())),
        Scorer::Regex(re) => hit(re.is_match(it.completion)),
        Scorer::Schema(v) => hit(serde_json::from_str::<Value>(it.completion.trim())
            .is_ok_and(|value| v.is_valid(&value))),
        Scorer::Length(target, unit) => {
            let n = match unit {
                LengthUnit::Chars => it.completion.chars().count(),
                LengthUnit::Tokens => it.completion_tokens,
            };
            let off = (n as f64 - *target as f64).abs() / *target as f64;
            (1.0 - off).max(0.0)
        }
        Scorer::Http(..) => unreachable!("scored by http_scores"),
    }
}

fn http_scores(url: &str, timeout: Duration, items: &[Scored]) -> Result<Vec<Option<f64>>, String> {
    let body = json!({
        "items": items.iter().map(|it| json!({
            "prompt": it.prompt,
            "completion": it.completion,
            "example": it.example,
        })).collect::<Vec<_>>(),
    });
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .build()
        .into();
    let fail = |e: String| format!("reward endpoint {url}: {e}");
    let answer: Value = agent
        .post(url)
        .send_json(&body)
        .map_err(|e| fail(e.to_string()))?
        .body_mut()
        .read_json()
        .map_err(|e| fail(format!("the answer is not JSON: {e}")))?;
    let rewards = answer["rewards"]
        .as_array()
        .filter(|r| r.len() == items.len())
        .ok_or_else(|| {
            fail(format!(
                "expected {{\"rewards\": [...]}} with {} numbers or nulls",
                items.len()
            ))
        })?;
    rewards
        .iter()
        .map(|r| match r {
            Value::Null => Ok(None),
            v => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| fail(format!("a reward must be a finite number or null, not {v}"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{Rewards, Scored};
    use serde_json::json;

    fn scored<'a>(completion: &'a str, example: &'a serde_json::Value) -> Scored<'a> {
        Scored {
            prompt: "p",
            completion,
            completion_tokens: 3,
            example,
        }
    }

    #[test]
    fn each_local_kind_scores_as_its_spec_says() {
        let spec = r#"[{"kind": "exact_match", "field": "answer"},
            {"kind": "regex", "pattern": "^[A-Z ]+$", "weight": 0.5},
            {"kind": "json_schema", "schema": {"type": "object", "required": ["a"]}},
            {"kind": "length", "target": 4},
            {"kind": "length", "target": 3, "unit": "tokens"}]"#;
        let r = Rewards::parse(spec).unwrap();
        assert_eq!(r.weights, [1.0, 0.5, 1.0, 1.0, 1.0]);
        let ex = json!({"answer": " HI "});
        let got = r
            .score(&[scored("HI", &ex), scored("{\"a\": 1}", &ex)])
            .unwrap();
        assert_eq!(
            got[0],
            [Some(1.0), Some(1.0), Some(0.0), Some(0.5), Some(1.0)]
        );
        assert_eq!(
            got[1],
            [Some(0.0), Some(0.0), Some(1.0), Some(0.0), Some(1.0)]
        );
    }

    #[test]
    fn a_bad_spec_entry_is_named() {
        for (spec, says) in [
            ("[]", "no functions"),
            (r#"[{"kind": "exact"}]"#, "entry 1"),
            (r#"[{"kind": "regex", "pattern": "("}]"#, "bad regex"),
            (r#"[{"kind": "length", "target": 0}]"#, "at least 1"),
            (r#"[{"kind": "http", "url": "ftp://x"}]"#, "http://"),
            (
                r#"[{"kind": "regex", "pattern": "a", "colour": 1}]"#,
                "colour",
            ),
        ] {
            let e = Rewards::parse(spec).err().unwrap();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }

    /// A one-shot endpoint on a free local port: it reads one request and answers `body`.
    fn endpoint(body: &'static str) -> (String, std::thread::JoinHandle<String>) {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/reward", listener.local_addr().unwrap());
        let serve = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut length = 0;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut request = vec![0; length];
            reader.read_exact(&mut request).unwrap();
            let mut stream = stream;
            write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            String::from_utf8(request).unwrap()
        });
        (url, serve)
    }

    #[test]
    fn an_http_endpoint_scores_the_batch_and_a_malformed_answer_is_named() {
        let ex = json!({"answer": "x"});
        let (url, serve) = endpoint(r#"{"rewards": [0.25, null]}"#);
        let spec = format!(r#"[{{"kind": "http", "url": "{url}", "weight": 2}}]"#);
        let r = Rewards::parse(&spec).unwrap();
        let got = r.score(&[scored("a", &ex), scored("b", &ex)]).unwrap();
        assert_eq!(got, [[Some(0.25)], [None]]);
        let sent: serde_json::Value = serde_json::from_str(&serve.join().unwrap()).unwrap();
        assert_eq!(sent["items"][1]["completion"], "b");
        assert_eq!(sent["items"][0]["example"]["answer"], "x");
        let (url, serve) = endpoint(r#"{"rewards": [1.0]}"#);
        let spec = format!(r#"[{{"kind": "http", "url": "{url}"}}]"#);
        let e = Rewards::parse(&spec)
            .unwrap()
            .score(&[scored("a", &ex), scored("b", &ex)]);
        serve.join().unwrap();
        let e = e.unwrap_err();
        assert!(e.contains(&url) && e.contains("2 numbers"), "{e}");
    }
}
