//! Images in the chat page (issue 41; docs/serve.md, "The chat page"): attached with the
//! picker (the file input given files, then its change event, as after the dialog), by a
//! drop on the composer (dragenter/dragover/drop carrying a DataTransfer with the file, as
//! the browser fires them for a file dragged in) and by a paste into the message box;
//! shown as thumbnails each with a ×, sent as a content list (the text part, then one
//! image_url part per image, in order, each a data: URL of exactly the file's bytes), shown
//! in the sent message, sent again by Regenerate; a 400 naming an image shown as that
//! error, the refused exchange kept out of the next request; the limits (a non-image, an
//! image over 20 MB, a 9th image) named in a notice, nothing else attached.
//!
//! The chat requests are answered and captured as in canned.rs; each check has a planted
//! page that must fail it (chat_e2e.rs). The live case with a vision model: live_image.rs.

use base64::Engine as _;
use serde_json::{json, Value};
use std::path::PathBuf;

use super::browser::{click, js, sse, type_into, wait_js, CannedPage, Fixture, Plant, Reply};
use super::canned::Outcome;
use crate::common;

/// The images: two picked, one dropped (in between, the second is removed).
const PICKED: [&str; 2] = ["images/rgb_17x11.png", "images/jpeg444_61x45.jpg"];
const DROPPED: &str = "images/webp_lossy_52x36.webp";
const TEXT: &str = "What is in these?";
const ANSWER: &str = "A red square and a photo.";
const AGAIN: &str = "Two pictures.";
const REFUSED_TEXT: &str = "And this one?";
const REFUSAL: &str = "this model reads text only: the server runs no vision tower for it";
const FOLLOW_UP: &str = "Thanks";

fn image_path(name: &str) -> PathBuf {
    common::goldens().join("vision").join(name)
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The data: URL a browser reads the file `name` as (its type from the extension).
pub(super) fn data_url(name: &str) -> String {
    let mime = match name.rsplit('.').next() {
        Some("png") => "image/png",
        Some("jpg") => "image/jpeg",
        Some("webp") => "image/webp",
        other => panic!("no type for {other:?}"),
    };
    let bytes = std::fs::read(image_path(name)).unwrap();
    format!("data:{mime};base64,{}", b64(&bytes))
}

pub(super) fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

/// `names` as a file dialog returns them: set as the file input's files, then its change
/// event. (DOM.setFileInputFiles would be closer to the dialog, but under the
/// `headless_chrome` crate the tests used before, a file it set was now and then unreadable
/// by the page — FileReader's NotReadableError on either the first or a later pick — so the
/// files are made in the page from their bytes.)
fn pick(page: &CannedPage, names: &[&str]) -> Result<(), String> {
    let files: Vec<Value> = names
        .iter()
        .map(|n| {
            let url = data_url(n);
            let (head, data) = url.split_once(";base64,").unwrap();
            let file = n.rsplit('/').next().unwrap();
            json!([file, head.trim_start_matches("data:"), data])
        })
        .collect();
    js(
        &page.tab,
        &format!(
            "(() => {{ const input = document.getElementById('attach-input'); \
              input.files = {}; \
              input.dispatchEvent(new Event('input', {{ bubbles: true }})); \
              input.dispatchEvent(new Event('change', {{ bubbles: true }})); return true; }})()",
            file_list(&Value::Array(files))
        ),
    )
    .map(|_| ())
}

/// A JavaScript expression making a FileList of `files` ([name, type, base64 bytes] or
/// [name, type, a size in zero bytes]).
pub(super) fn file_list(files: &Value) -> String {
    format!(
        "(() => {{ const dt = new DataTransfer(); \
          for (const [name, type, data] of {files}) {{ \
            const bytes = typeof data === 'number' ? new Uint8Array(data) : Uint8Array.from(atob(data), c => c.charCodeAt(0)); \
            dt.items.add(new File([bytes], name, {{ type }})); }} \
          return dt; }})().files"
    )
}

/// Drops `files` (as for `file_list`) on the composer: dragenter, dragover and drop, each
/// carrying them, as the browser fires them for files dragged in.
fn drop_files(page: &CannedPage, files: &Value) -> Result<(), String> {
    js(
        &page.tab,
        &format!(
            "(() => {{ const dt = new DataTransfer(); \
              for (const f of {}) dt.items.add(f); \
              const at = document.getElementById('form'); \
              for (const type of ['dragenter', 'dragover', 'drop']) \
                at.dispatchEvent(new DragEvent(type, {{ dataTransfer: dt, bubbles: true, cancelable: true }})); \
              return true; }})()",
            file_list(files)
        ),
    )
    .map(|_| ())
}

/// The thumbnails waiting to be sent (their data: URLs), once the page has read what it
/// was given (it marks the form data-reading meanwhile); an error unless there are `n`.
fn attached(page: &CannedPage, n: usize, what: &str) -> Result<Vec<String>, String> {
    wait_js(
        &page.tab,
        "document.getElementById('form').dataset.reading === undefined",
        what,
    )?;
    let got = js(
        &page.tab,
        "[Array.from(document.querySelectorAll('#attachments .thumb img')).map(i => i.src), \
          document.getElementById('attach-notice').textContent]",
    )?;
    let srcs: Vec<String> = serde_json::from_value(got[0].clone()).unwrap_or_default();
    ensure(srcs.len() == n, || {
        format!(
            "{what}: {} thumbnails, want {n} (the notice: {})",
            srcs.len(),
            got[1]
        )
    })?;
    Ok(srcs)
}

fn same_urls(got: &[String], want: &[String], what: &str) -> Result<(), String> {
    let short = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|u| format!("{}…({} chars)", &u[..u.len().min(40)], u.len()))
            .collect()
    };
    ensure(got == want, || {
        format!("{what}: {:?}, want {:?}", short(got), short(want))
    })
}

/// The chat requests' replies: the answer and the regenerated one (unless `fresh`: the page
/// starts with the refused message), a refusal naming the refused message's image, the
/// follow-up's answer.
fn replies(fresh: bool) -> Vec<Reply> {
    let answer = |text: &str| {
        Reply::sse(sse(
            &[json!({"role": "assistant", "content": text})],
            "stop",
        ))
    };
    let mut out = if fresh {
        vec![]
    } else {
        vec![answer(ANSWER), answer(AGAIN)]
    };
    let at = if fresh { 0 } else { 2 };
    out.push(Reply::json(
        400,
        json!({"error": {"message": format!("{REFUSAL} (engine serve does not run vision towers yet: docs/vision.md); send the request without images"),
            "type": "invalid_request_error", "param": format!("messages[{at}].content[1]"), "code": null}}),
    ));
    out.push(answer("Fine."));
    out
}

/// Every check, in order, on `plant`'s page (None: the served page), up to and including
/// `last` when given (a planted page needs only the check it must fail). The refusal's
/// checks and the limits' hold on a page of their own too: for those `last`, the steps
/// before them are skipped (the refused message is then the first).
pub fn run(fx: &Fixture, plant: Option<&Plant>, last: Option<&str>) -> Result<Outcome, String> {
    let fresh = matches!(last, Some("paste" | "error" | "after-error" | "limits"));
    let page = CannedPage::start_with_replies(fx, plant, replies(fresh), None, (1000, 800))?;
    page.open("")?;
    let mut out = Outcome::default();
    let history = if fresh {
        vec![]
    } else {
        match exchange(&page, &mut out, last)? {
            Some(history) => history,
            None => return Ok(out),
        }
    };
    if last != Some("limits") && !refused(&page, &mut out, last, history)? {
        return Ok(out);
    }
    out.check("limits", limits(&page));
    if plant.is_none() {
        page.screenshot("chat-images.png")?;
    }
    let errors = page.intercept_errors();
    if !errors.is_empty() {
        return Err(format!("the interception failed: {errors:?}"));
    }
    Ok(out)
}

/// Two images picked, one dropped, the second removed, the message sent, shown, and
/// regenerated; the history it leaves, or None when stopped at `last`.
fn exchange(
    page: &CannedPage,
    out: &mut Outcome,
    last: Option<&str>,
) -> Result<Option<Vec<Value>>, String> {
    let [a, b] = PICKED.map(data_url);
    let c = data_url(DROPPED);

    pick(page, &PICKED)?;
    out.check(
        "picker",
        attached(page, 2, "the picked images' thumbnails")
            .and_then(|got| same_urls(&got, &[a.clone(), b.clone()], "picked")),
    );
    if last == Some("picker") {
        return Ok(None);
    }

    let dropped = std::fs::read(image_path(DROPPED)).unwrap();
    drop_files(
        page,
        &json!([["dropped.webp", "image/webp", b64(&dropped)]]),
    )?;
    out.check(
        "drop",
        attached(page, 3, "the dropped image's thumbnail")
            .and_then(|got| same_urls(&got, &[a.clone(), b.clone(), c.clone()], "after the drop")),
    );
    if last == Some("drop") {
        return Ok(None);
    }

    // × on the second: the first and the third stay, in order.
    out.check(
        "remove",
        click(&page.tab, "#attachments .thumb:nth-child(2) .remove")
            .and_then(|()| attached(page, 2, "the thumbnails after a ×"))
            .and_then(|got| same_urls(&got, &[a.clone(), c.clone()], "after removing the second")),
    );
    if last == Some("remove") {
        return Ok(None);
    }

    type_into(&page.tab, "#input", TEXT)?;
    page.tab.press_key("Enter")?;
    wait_js(
        &page.tab,
        "document.querySelectorAll('.msg.assistant[data-done]').length === 1",
        "the answer to the message with images",
    )?;
    let model = js(&page.tab, "document.getElementById('model').value")?;
    let sent_user = json!({"role": "user", "content": [
        {"type": "text", "text": TEXT},
        {"type": "image_url", "image_url": {"url": a}},
        {"type": "image_url", "image_url": {"url": c}},
    ]});
    out.check("request", {
        let requests = page.requests();
        let want = json!({"model": model, "messages": [sent_user], "stream": true});
        match requests.first() {
            Some(got) if got == &want => Ok(()),
            Some(got) => Err(format!(
                "the request was {}, want {}",
                abbreviate(got),
                abbreviate(&want)
            )),
            None => Err("no chat request was sent".into()),
        }
    });
    if last == Some("request") {
        return Ok(None);
    }

    // The sent message shows its text and thumbnails, the composer is empty, the answer
    // is shown finished.
    out.check("shown", (|| {
        let got = js(
            &page.tab,
            "(u => ({ text: u.firstChild && u.firstChild.nodeType === 3 ? u.firstChild.data : null, \
               thumbs: Array.from(u.querySelectorAll('.thumbs img')).map(i => i.src), \
               waiting: document.querySelectorAll('#attachments .thumb').length, \
               strip_hidden: document.getElementById('attachments').hidden, \
               answer: document.querySelector('.msg.assistant .content').textContent, \
               error: document.querySelector('.msg.assistant').classList.contains('error'), \
               finish: document.querySelector('.msg.assistant').dataset.finish }))(document.querySelector('.msg.user'))",
        )?;
        let thumbs: Vec<String> = serde_json::from_value(got["thumbs"].clone()).unwrap_or_default();
        same_urls(&thumbs, &[a.clone(), c.clone()], "the sent message's thumbnails").and_then(
            |()| {
                let rest = json!({"text": got["text"], "waiting": got["waiting"],
                    "strip_hidden": got["strip_hidden"], "answer": got["answer"],
                    "error": got["error"], "finish": got["finish"]});
                let want = json!({"text": TEXT, "waiting": 0, "strip_hidden": true,
                    "answer": ANSWER, "error": false, "finish": "stop"});
                ensure(rest == want, || format!("the page shows {rest}, want {want}"))
            },
        )
    })());
    if last == Some("shown") {
        return Ok(None);
    }

    out.check(
        "regenerate",
        (|| {
            click(&page.tab, ".turn.assistant .actions button.regen")?;
            wait_js(
                &page.tab,
                &format!(
                    "document.querySelectorAll('.msg.assistant[data-done]').length === 1 && \
                 document.querySelector('.msg.assistant .content').textContent === '{AGAIN}'"
                ),
                "the regenerated answer",
            )?;
            let requests = page.requests();
            match (requests.first(), requests.get(1)) {
                (Some(first), Some(again)) if again == first => Ok(()),
                (Some(first), Some(again)) => Err(format!(
                    "Regenerate sent {}, want the first request {}",
                    abbreviate(again),
                    abbreviate(first)
                )),
                _ => Err(format!("{} requests, want 2", requests.len())),
            }
        })(),
    );
    if last == Some("regenerate") {
        return Ok(None);
    }

    Ok(Some(vec![
        sent_user,
        json!({"role": "assistant", "content": AGAIN}),
    ]))
}

/// A message whose image (pasted) the server refuses after `history`: the page shows the
/// refusal, naming the image, and the next message goes without it. False when stopped
/// (at `last`, or the paste failed).
fn refused(
    page: &CannedPage,
    out: &mut Outcome,
    last: Option<&str>,
    history: Vec<Value>,
) -> Result<bool, String> {
    let done = history.len() / 2;
    // Pasted into the message box (a paste event whose clipboard holds the file).
    js(
        &page.tab,
        &format!(
            "(() => {{ const dt = new DataTransfer(); for (const f of {}) dt.items.add(f); \
              document.getElementById('input').dispatchEvent(new ClipboardEvent('paste', \
                {{ clipboardData: dt, bubbles: true, cancelable: true }})); return true; }})()",
            file_list(&json!([[
                "image.png",
                "image/png",
                b64(&std::fs::read(image_path(PICKED[0])).unwrap())
            ]]))
        ),
    )?;
    let pasted = attached(page, 1, "the pasted image's thumbnail")
        .and_then(|got| same_urls(&got, &[data_url(PICKED[0])], "pasted"));
    let ok = pasted.is_ok();
    out.check("paste", pasted);
    if !ok || last == Some("paste") {
        return Ok(false);
    }
    type_into(&page.tab, "#input", REFUSED_TEXT)?;
    page.tab.press_key("Enter")?;
    wait_js(
        &page.tab,
        &format!(
            "document.querySelectorAll('.msg.assistant[data-done]').length === {}",
            done + 1
        ),
        "the refused request to end",
    )?;
    out.check("error", (|| {
        let got = js(
            &page.tab,
            "(m => [m.classList.contains('error'), (m.querySelector('.err') || {}).textContent])(Array.from(document.querySelectorAll('.msg.assistant')).pop())",
        )?;
        let text = got[1].as_str().unwrap_or_default();
        ensure(
            got[0] == true && text.starts_with(&format!("error: image 1: {REFUSAL}")),
            || format!("the refused request shows {got}, want an error naming image 1: {REFUSAL}…"),
        )
    })());
    if last == Some("error") {
        return Ok(false);
    }

    // The next message goes without the refused one (its image would be refused again).
    out.check(
        "after-error",
        (|| {
            type_into(&page.tab, "#input", FOLLOW_UP)?;
            page.tab.press_key("Enter")?;
            wait_js(
                &page.tab,
                &format!(
                    "document.querySelectorAll('.msg.assistant[data-done]').length === {}",
                    done + 2
                ),
                "the follow-up's answer",
            )?;
            let requests = page.requests();
            let got = requests.last().map(|r| r["messages"].clone());
            let mut want = history.clone();
            want.push(json!({"role": "user", "content": FOLLOW_UP}));
            let want = Value::Array(want);
            ensure(got.as_ref() == Some(&want), || {
                format!(
                    "the follow-up sent {}, want {}",
                    got.as_ref().map_or("nothing".into(), abbreviate),
                    abbreviate(&want)
                )
            })
        })(),
    );
    Ok(last != Some("after-error"))
}

/// The limits: a text file, a 21 MB PNG and nine good images dropped at once on an empty
/// composer: the first eight good ones attached, the rest named in the notice.
fn limits(page: &CannedPage) -> Result<(), String> {
    let a = data_url(PICKED[0]);
    let png = b64(&std::fs::read(image_path(PICKED[0])).unwrap());
    let mut files = vec![
        json!(["notes.txt", "text/plain", b64(b"not an image")]),
        json!(["huge.png", "image/png", 21 << 20]),
    ];
    files.extend((1..=9).map(|k| json!([format!("img{k}.png"), "image/png", png])));
    drop_files(page, &Value::Array(files))?;
    let got = attached(page, 8, "eight of the dropped images")?;
    same_urls(&got, &vec![a.clone(); 8], "the attached images")?;
    let notice = js(
        &page.tab,
        "(n => n.hidden || n.offsetHeight === 0 ? null : n.textContent)(document.getElementById('attach-notice'))",
    )?;
    let text = notice.as_str().unwrap_or_default();
    ensure(
        text.contains("\u{201c}notes.txt\u{201d} is not a PNG, JPEG, WebP or GIF image")
            && text.contains("\u{201c}huge.png\u{201d} is 21.0 MB")
            && text.contains("\u{201c}img9.png\u{201d}: a message takes at most 8 images")
            && !text.contains("img8.png"),
        || format!("the notice reads {notice}, want notes.txt, huge.png and img9.png named"),
    )
}

/// A request body with each data: URL cut short (they run to thousands of characters).
fn abbreviate(v: &Value) -> String {
    let mut v = v.clone();
    fn walk(v: &mut Value) {
        match v {
            Value::String(s) if s.starts_with("data:") && s.len() > 60 => {
                *s = format!("{}…({} chars)", &s[..40], s.len());
            }
            Value::Array(a) => a.iter_mut().for_each(walk),
            Value::Object(o) => o.values_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v.to_string()
}
