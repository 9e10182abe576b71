//! The chat page's model picker: the page lists every `GET /v1/models` entry, adapters
//! (`"BASE:NAME"` with `parent`) grouped under their model and unloaded models marked,
//! sends the chosen entry as each request's `model`, keeps the choice over a reload
//! (localStorage), and when the server stops listing it falls back to the first entry with
//! a visible notice.
//!
//! The tiny model's server lists one entry, so the list here is the test's own (the page's
//! GET /v1/models answered over CDP, `CannedPage::set_models`), its first entry the live
//! server's id; the chat requests are answered and captured as in canned.rs. The live
//! case (chat_e2e.rs, `run_page`) checks the picker against the real server's list.

use serde_json::{json, Value};

use super::browser::{click, http_models, js, sse, type_into, wait_js, CannedPage, Fixture, Plant};
use super::canned::Outcome;

/// The adapter's short name; its id is `BASE:pirate`.
const ADAPTER: &str = "pirate";
/// A second model the server lists but has not loaded.
const OTHER: &str = "org/second-model";

/// The server's models, the adapter listed after the other model (the page must still
/// show it under its parent), or without the adapter.
fn listing(base: &str, with_adapter: bool) -> Value {
    let mut data = vec![
        json!({"id": base, "object": "model", "owned_by": "engine", "loaded": true}),
        json!({"id": OTHER, "object": "model", "owned_by": "engine", "loaded": false}),
    ];
    if with_adapter {
        data.push(json!({"id": format!("{base}:{ADAPTER}"), "object": "model",
            "owned_by": "engine", "parent": base}));
    }
    json!({"object": "list", "data": data})
}

/// Sends `text` and waits until the page shows `n` finished answers.
fn ask(page: &CannedPage, text: &str, n: usize) -> Result<(), String> {
    type_into(&page.tab, "#input", text)?;
    page.tab.press_key("Enter")?;
    wait_js(
        &page.tab,
        &format!("document.querySelectorAll('.msg.assistant[data-done]').length === {n}"),
        &format!("answer {n}"),
    )
}

/// The `model` of the page's `k`th chat request (0-based) is `want`.
fn sent(page: &CannedPage, k: usize, want: &str) -> Result<(), String> {
    let requests = page.requests();
    let got = requests.get(k).map(|r| r["model"].clone());
    if got == Some(json!(want)) {
        Ok(())
    } else {
        Err(format!(
            "chat request {k} named the model {got:?}, want {want:?}"
        ))
    }
}

/// What the picker shows: its value, its options as [value, label, group], the notice's
/// text when it is on screen (laid out, not hidden).
fn picker_facts(page: &CannedPage) -> Result<Value, String> {
    js(
        &page.tab,
        "(p => ({ value: p.value, \
            options: Array.from(p.options).map(o => [o.value, o.textContent, \
              o.parentElement.tagName === 'OPTGROUP' ? o.parentElement.label : null]), \
            notice: (n => n.hidden || n.offsetHeight === 0 ? null : n.textContent)(document.getElementById('model-notice')) \
          }))(document.getElementById('model'))",
    )
}

/// Every picker check on `plant`'s page (None: the served page), in order, up to and
/// including `last` when given (a planted page needs only the check it must fail).
/// The served page's last state (the fallback notice) is saved as target/e2e/chat-picker.png.
pub fn run(fx: &Fixture, plant: Option<&Plant>, last: Option<&str>) -> Result<Outcome, String> {
    let base = http_models(fx.server.port)
        .into_iter()
        .next()
        .ok_or("the server lists no model")?;
    let adapter = format!("{base}:{ADAPTER}");
    let page = CannedPage::start_with_models(
        fx,
        plant,
        vec![sse(
            &[json!({"role": "assistant", "content": "Ahoy."})],
            "stop",
        )],
        Some(listing(&base, true)),
        (1000, 700),
    )?;
    page.open("")?;
    let mut out = Outcome::default();

    // Listed: the model, its adapter under it, the unloaded model marked; the first entry
    // chosen when nothing was kept.
    out.check("list", {
        let got = picker_facts(&page)?;
        let want = json!({
            "value": base,
            "options": [
                [base, base, base],
                [adapter, format!("↳ {ADAPTER} (adapter)"), base],
                [OTHER, format!("{OTHER} (not loaded)"), null],
            ],
            "notice": null,
        });
        if got == want {
            Ok(())
        } else {
            Err(format!("the picker shows {got}, want {want}"))
        }
    });

    // Chosen (as a select's change event does) and sent.
    js(
        &page.tab,
        &format!(
            "(p => {{ p.value = {a}; p.dispatchEvent(new Event('change', {{ bubbles: true }})); }})(document.getElementById('model'))",
            a = json!(adapter)
        ),
    )?;
    ask(&page, "Hello", 1)?;
    out.check("sent", sent(&page, 0, &adapter));
    if last == Some("sent") {
        return Ok(out);
    }

    // Kept over a reload, and sent again.
    page.reload()?;
    let shown = js(&page.tab, "document.getElementById('model').value")?;
    ask(&page, "Again", 1)?;
    out.check(
        "kept",
        if shown == json!(adapter) {
            sent(&page, 1, &adapter)
        } else {
            Err(format!(
                "after a reload the picker shows {shown}, want {adapter:?}"
            ))
        },
    );
    if last == Some("kept") {
        return Ok(out);
    }

    // The adapter goes away; ↻ lists again: the first entry, a notice naming the lost one.
    let before = js(
        &page.tab,
        "Number(document.getElementById('model').dataset.refreshed)",
    )?;
    page.set_models(&listing(&base, false));
    click(&page.tab, "#models-refresh")?;
    wait_js(
        &page.tab,
        &format!(
            "Number(document.getElementById('model').dataset.refreshed) > {before} && \
             !Array.from(document.getElementById('model').options).some(o => o.value === {a})",
            a = json!(adapter)
        ),
        "the picker to list the models without the adapter",
    )?;
    out.check("fallback", {
        let got = picker_facts(&page)?;
        let notice = got["notice"].as_str().unwrap_or_default();
        if got["value"] != json!(base) {
            Err(format!(
                "after the adapter went the picker shows {}, want {base:?}",
                got["value"]
            ))
        } else if !notice.contains(&adapter) {
            Err(format!(
                "no visible notice naming {adapter:?}: {}",
                got["notice"]
            ))
        } else {
            ask(&page, "Third", 2).and_then(|()| sent(&page, 2, &base))
        }
    });

    if plant.is_none() {
        page.screenshot("chat-picker.png")?;
    }
    let errors = page.intercept_errors();
    if !errors.is_empty() {
        return Err(format!("the interception failed: {errors:?}"));
    }
    Ok(out)
}
