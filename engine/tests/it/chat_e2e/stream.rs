//! The chat page while an answer streams: the test feeds the response piece by piece
//! (a script run before the page's own answers the page's fetch of the chat endpoint with
//! a stream the test writes into through window.__feed / window.__end) and checks the DOM
//! between pieces: the Thinking section open while the model reasons, closed once the
//! answer starts and after; an unclosed code fence already a code block.

use serde_json::json;

use super::browser::{js, wait_js, wait_js_within, CannedPage, Fixture, Plant, SETTLED_TIMEOUT};

const FEED_STUB: &str = r#"(() => {
  const realFetch = window.fetch;
  window.fetch = (url, init) => {
    if (url !== "/v1/chat/completions") return realFetch(url, init);
    window.__sent = init.body;
    const enc = new TextEncoder();
    const stream = new ReadableStream({ start(c) {
      window.__feed = s => c.enqueue(enc.encode(s));
      window.__end = () => c.close();
    } });
    return Promise.resolve(new Response(stream, { status: 200, headers: { "Content-Type": "text/event-stream" } }));
  };
})();"#;

fn feed(page: &CannedPage, delta: serde_json::Value) -> Result<(), String> {
    let event = format!(
        "data: {}\n\n",
        json!({"choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
    );
    let call = format!("window.__feed({})", serde_json::to_string(&event).unwrap());
    js(&page.tab, &call).map(|_| ())
}

const MSG: &str = "document.querySelector('.msg.assistant')";

/// The streamed exchange, from the page's first-message link; `plant`'s page if given,
/// in a tab of `fx`'s browser.
pub fn run(fx: &Fixture, plant: Option<&Plant>) -> Result<(), String> {
    let page = CannedPage::start(fx, plant, vec![], (900, 700))?;
    page.tab.add_script(FEED_STUB)?;
    page.open("?q=Why%3F")?;
    let tab = &page.tab;
    wait_js(
        tab,
        "typeof window.__feed === 'function'",
        "the page to ask",
    )?;
    let sent = js(tab, "JSON.parse(window.__sent).messages")?;
    if sent != json!([{"role": "user", "content": "Why?"}]) {
        return Err(format!("the link's first message was sent as {sent}"));
    }
    feed(
        &page,
        json!({"role": "assistant", "reasoning": "Step one."}),
    )?;
    wait_js(
        tab,
        &format!(
            "{MSG}.dataset.streaming === 'true' && \
             {MSG}.querySelector('details.thinking .reasoning').textContent === 'Step one.'"
        ),
        "the first reasoning piece",
    )?;
    // The page sets the section's state in the same redraw that shows the piece waited for
    // just before, so the state is read back, not waited for (SETTLED_TIMEOUT).
    let open = |what: &str| {
        wait_js_within(
            tab,
            &format!("{MSG}.querySelector('details.thinking').open === true"),
            what,
            SETTLED_TIMEOUT,
        )
    };
    open("the Thinking section to be open while the model reasons")?;
    feed(&page, json!({"reasoning": " Step two."}))?;
    wait_js(
        tab,
        &format!(
            "{MSG}.querySelector('details.thinking .reasoning').textContent === 'Step one. Step two.'"
        ),
        "the second reasoning piece",
    )?;
    open("the Thinking section to stay open while the model reasons")?;
    feed(&page, json!({"content": "```rust\nfn main() {"}))?;
    wait_js(
        tab,
        &format!(
            "{MSG}.dataset.streaming === 'true' && \
             {MSG}.querySelector('.content pre > code').textContent === 'fn main() {{'"
        ),
        "an unclosed code fence shown as a code block while it streams",
    )?;
    let closed = |what: &str| {
        wait_js_within(
            tab,
            &format!("{MSG}.querySelector('details.thinking').open === false"),
            what,
            SETTLED_TIMEOUT,
        )
    };
    closed("the Thinking section to close once the answer starts")?;
    feed(&page, json!({"content": "\n}\n```\n\nDone."}))?;
    js(tab, "window.__end()")?;
    wait_js(
        tab,
        &format!(
            "{MSG}.dataset.done === 'true' && {MSG}.dataset.streaming === undefined && \
             {MSG}.querySelector('.content pre > code').textContent === 'fn main() {{\\n}}' && \
             {MSG}.querySelector('.content p').textContent === 'Done.'"
        ),
        "the finished answer",
    )?;
    closed("the Thinking section to be closed after the answer")?;
    page.screenshot(if plant.is_some() {
        "chat-stream-planted.png"
    } else {
        "chat-stream.png"
    })?;
    Ok(())
}
