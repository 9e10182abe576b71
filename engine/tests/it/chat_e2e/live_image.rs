//! The chat page with a vision model (issue 41's claim: "the chat page's browser test sends
//! an image and shows the answer"): a real `engine serve` on tiny-gemma3-vl (fixture weights
//! with the goldens/vision/generate overlay, as vision_generate.rs assembles it); the page
//! is given an image through its file input and a message, sends them, and shows the
//! model's answer, which must be mlx-vlm's greedy answer to that image and prompt
//! (goldens/vision/generate/generate.json). Planted (chat_e2e.rs): a page sending the image
//! before the text gets another answer.

use serde_json::{json, Value};
use std::time::{Duration, Instant};

use super::attach::{data_url, ensure, file_list};
use super::browser::{e2e_dir, js, type_into, wait_js, wait_js_within, Fixture};
use crate::common::{self, server::stats};

/// The image and the prompt of vision_generate's one-image tiny-gemma3-vl case.
const LIVE_IMAGE: &str = "images/rgb_64x64.png";
const LIVE_PROMPT: &str = "Describe this.";

/// mlx-vlm's greedy answer to LIVE_PROMPT with LIVE_IMAGE on tiny-gemma3-vl and its length
/// in tokens (goldens/vision/generate/generate.json, made by oracles/gen_vision_generate.py).
fn live_golden() -> (String, usize) {
    let path = common::goldens().join("vision/generate/generate.json");
    let golden: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let case = golden["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| {
            c["model"] == "tiny-gemma3-vl"
                && c["images"] == json!([LIVE_IMAGE])
                && c["prompt"] == LIVE_PROMPT
        })
        .unwrap_or_else(|| {
            panic!(
                "{}: no tiny-gemma3-vl case for {LIVE_IMAGE}",
                path.display()
            )
        });
    (
        case["text"].as_str().unwrap().to_owned(),
        case["generated"].as_array().unwrap().len(),
    )
}

/// The live claim: a real `engine serve` on tiny-gemma3-vl; the page (as the server serves
/// it) gets an image through its picker and a message, sends them, and shows the model's
/// answer finished — not an error, and mlx-vlm's greedy answer to that image and prompt —
/// while the server counts one completed request.
/// `planted`: a script run before the page's own (the planted page's edit).
pub fn live(fx: &Fixture, planted: Option<&str>) -> Result<String, String> {
    let dir = common::vision::assembled("tiny-gemma3-vl");
    let server = common::server::serve_dir(dir.path(), &["--no-open"]);
    let case_tab = fx.tab((900, 600))?;
    let tab = &case_tab.0;
    if let Some(script) = planted {
        tab.add_script(script)?;
    }
    // Greedy, as long as the golden's answer: settings as the page keeps them.
    let (want, tokens) = live_golden();
    tab.add_script(&format!(
            r#"localStorage.setItem("engine-chat-settings", JSON.stringify({{ temperature: "0", maxTokens: "{tokens}" }}));"#
        ),
    )?;
    let url = format!("http://127.0.0.1:{}/#/chat", server.port);
    tab.navigate(&url)
        .map_err(|x| format!("loading {url}: {x}"))?;
    wait_js(
        tab,
        "document.getElementById('model').dataset.refreshed >= 1",
        "the page to list the vision model",
    )?;
    let before = stats(server.port);
    let url = data_url(LIVE_IMAGE);
    let data = url.split_once(";base64,").unwrap().1;
    js(
        tab,
        &format!(
            "(() => {{ const input = document.getElementById('attach-input'); input.files = {}; \
              input.dispatchEvent(new Event('change', {{ bubbles: true }})); return true; }})()",
            file_list(&json!([["rgb_64x64.png", "image/png", data]]))
        ),
    )?;
    wait_js(
        tab,
        "document.querySelectorAll('#attachments .thumb img').length === 1 && !document.getElementById('form').dataset.reading",
        "the picked image's thumbnail",
    )?;
    type_into(tab, "#input", LIVE_PROMPT)?;
    tab.press_key("Enter")?;
    wait_js_within(
        tab,
        "document.querySelectorAll('.msg.assistant[data-done]').length === 1",
        "the vision model's answer to finish",
        Duration::from_secs(60),
    )?;
    let got = js(
        tab,
        "(m => ({ error: m.classList.contains('error'), text: m.innerText, \
           answer: m.querySelector('.content').textContent, finish: m.dataset.finish || null, \
           thumbs: Array.from(document.querySelectorAll('.msg.user .thumbs img')).map(i => i.src) }))(document.querySelector('.msg.assistant'))",
    )?;
    let png = tab.screenshot_png()?;
    let shot = if planted.is_some() {
        "chat-image-live-planted.png"
    } else {
        "chat-image-live.png"
    };
    std::fs::write(e2e_dir().join(shot), png).map_err(|x| x.to_string())?;
    ensure(got["error"] == false, || {
        format!("the page's answer is an error: {}", got["text"])
    })?;
    ensure(got["thumbs"] == json!([data_url(LIVE_IMAGE)]), || {
        "the sent message does not show the picked image".into()
    })?;
    let answer = got["answer"].as_str().unwrap_or_default().to_owned();
    ensure(!answer.trim().is_empty(), || {
        format!("the page finished with an empty answer: {got}")
    })?;
    ensure(answer == want, || {
        format!("the page shows the answer {answer:?}; mlx-vlm's greedy answer is {want:?}")
    })?;
    ensure(got["finish"] == "stop" || got["finish"] == "length", || {
        format!("the answer has no finish reason: {got}")
    })?;
    // The server counts the request completed just after its last token went out.
    let count = |st: &Value, key: &str| st[key].as_u64().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = stats(server.port);
        if count(&now, "completed") == count(&before, "completed") + 1
            && count(&now, "completion_tokens") > count(&before, "completion_tokens")
        {
            return Ok(answer);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the server did not count the page's request completed with tokens: {now}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
