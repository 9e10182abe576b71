//! The image cases of chat_e2e (issue 41): the canned image case and a planted page for
//! each of its checks (attach.rs), and the live case on a vision model with its planted
//! page (live_image.rs). Each is a claim run by chat_e2e.rs's one test.

use super::browser::{e2e_dir, Fixture, Plant};
use super::{attach, caught, live_image};

pub fn the_page_attaches_images_and_sends_them_in_order(fx: &Fixture) {
    let out =
        attach::run(fx, None, None).unwrap_or_else(|e| panic!("the image case did not run: {e}"));
    println!("{}", out.report());
    assert!(out.failed.is_empty(), "{}", out.report());
    assert_eq!(out.passed.len(), 10, "{}", out.report());
    println!(
        "screenshot: {}",
        e2e_dir().join("chat-images.png").display()
    );
}

/// A planted page must fail the image case's `check`; returns why it did.
fn attach_plant_fails(fx: &Fixture, check: &str, plant: Plant) -> String {
    let out = attach::run(fx, Some(&plant), Some(check))
        .unwrap_or_else(|e| panic!("the image case did not run: {e}"));
    caught(&out, "attach", check)
}

pub fn a_picker_taking_only_the_first_file_is_caught(fx: &Fixture) {
    let _ = attach_plant_fails(
        fx,
        "picker",
        Plant {
            from: "addFiles(fileInput.files)",
            to: "addFiles([fileInput.files[0]])",
        },
    );
}

pub fn a_page_taking_drops_on_the_text_box_only_is_caught(fx: &Fixture) {
    let _ = attach_plant_fails(
        fx,
        "drop",
        Plant {
            from: "window.addEventListener(\"drop\"",
            to: "input.addEventListener(\"drop\"",
        },
    );
}

pub fn a_page_ignoring_pasted_images_is_caught(fx: &Fixture) {
    let _ = attach_plant_fails(
        fx,
        "paste",
        Plant {
            from: "const files = Array.from((e.clipboardData && e.clipboardData.files) || []);",
            to: "const files = [];",
        },
    );
}

pub fn a_remove_button_dropping_the_last_image_is_caught(fx: &Fixture) {
    let _ = attach_plant_fails(
        fx,
        "remove",
        Plant {
            from: "attached.splice(k, 1);",
            to: "attached.pop();",
        },
    );
}

pub fn a_page_sending_images_out_of_order_is_caught(fx: &Fixture) {
    let _ = attach_plant_fails(
        fx,
        "request",
        Plant {
            from: "for (const a of images) parts.push(",
            to: "for (const a of images.slice().reverse()) parts.push(",
        },
    );
}

pub fn a_sent_message_without_its_thumbnails_is_caught(fx: &Fixture) {
    let _ = attach_plant_fails(
        fx,
        "shown",
        Plant {
            from: "if (images.length) {\n    const thumbs",
            to: "if (false) {\n    const thumbs",
        },
    );
}

pub fn a_page_dropping_images_from_its_history_is_caught(fx: &Fixture) {
    // The images leave the history once answered: Regenerate sends the text alone.
    let _ = attach_plant_fails(
        fx,
        "regenerate",
        Plant {
            from: "  } else {\n    messages.push(message);\n  }",
            to: "  } else {\n    messages.push(message);\n    for (const m of messages) if (Array.isArray(m.content)) m.content = m.content.filter(p => p.type === \"text\");\n  }",
        },
    );
}

pub fn a_page_hiding_the_servers_refusal_is_caught(fx: &Fixture) {
    let why = attach_plant_fails(
        fx,
        "error",
        Plant {
            from: "throw new Error(refusal(j.error, body, res.status));",
            to: "throw new Error(\"HTTP \" + res.status);",
        },
    );
    assert!(why.contains("HTTP 400"), "{why}");
}

pub fn a_page_resending_a_refused_image_is_caught(fx: &Fixture) {
    let _ = attach_plant_fails(
        fx,
        "after-error",
        Plant {
            from: "t.wrap.unsent = messages.pop();",
            to: "t.wrap.unsent = messages[messages.length - 1];",
        },
    );
}

pub fn a_page_attaching_any_file_is_caught(fx: &Fixture) {
    let why = attach_plant_fails(
        fx,
        "limits",
        Plant {
            from: "const isImage = f => IMAGE_TYPES.includes(f.type);",
            to: "const isImage = f => true;",
        },
    );
    assert!(why.contains("data:text/plain"), "{why}");
}

pub fn the_page_sends_an_image_to_a_vision_model_and_shows_its_answer(fx: &Fixture) {
    let answer = live_image::live(fx, None).unwrap_or_else(|e| panic!("{e}"));
    println!("tiny-gemma3-vl's answer in the page: {answer:?}");
    println!(
        "screenshot: {}",
        e2e_dir().join("chat-image-live.png").display()
    );
}

pub fn a_page_sending_the_image_before_the_text_is_caught_by_the_vision_model(fx: &Fixture) {
    // The page's request with its content list turned around (images first): the model's
    // prompt, and so its greedy answer, is then not mlx-vlm's for text-then-image.
    let script = r#"const realFetch = window.fetch;
window.fetch = (url, init) => {
  if (url === "/v1/chat/completions" && init && typeof init.body === "string") {
    const body = JSON.parse(init.body);
    for (const m of body.messages) if (Array.isArray(m.content)) m.content.reverse();
    init = Object.assign({}, init, { body: JSON.stringify(body) });
  }
  return realFetch(url, init);
};"#;
    let err = match live_image::live(fx, Some(script)) {
        Ok(answer) => panic!("planted defect not caught: the answer {answer:?}"),
        Err(err) => err,
    };
    assert!(err.contains("mlx-vlm's greedy answer is"), "{err}");
    println!("caught: {err}");
}
