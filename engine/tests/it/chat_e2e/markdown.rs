//! The page's markdown renderer (renderMarkdown in chat.html) on a table of inputs, each
//! with the HTML its DOM serializes to: the blocks and inline forms models write, and the
//! untrusted ones (raw HTML, script URLs, images) that must come out as text or links.

use serde_json::Value;

use super::browser::{js, CannedPage, Fixture, Plant};

/// (markdown, the rendered nodes' HTML). Code blocks carry their bar (language, Copy).
pub const CASES: &[(&str, &str)] = &[
    ("# Title\n## Sub #", "<h1>Title</h1><h2>Sub</h2>"),
    ("#hashtag", "<p>#hashtag</p>"),
    ("a\nb\n\nc", "<p>a<br>b</p><p>c</p>"),
    ("**b** *i* ***bi*** ~~s~~ `c`", "<p><strong>b</strong> <em>i</em> <strong><em>bi</em></strong> <del>s</del> <code>c</code></p>"),
    ("snake_case_name and 2 * 3 * 4", "<p>snake_case_name and 2 * 3 * 4</p>"),
    ("\\*not\\* `` a ` b ``", "<p>*not* <code>a ` b</code></p>"),
    ("- a\n- b\n  - c\n- d", "<ul><li>a</li><li>b<ul><li>c</li></ul></li><li>d</li></ul>"),
    ("3. x\n4. y", "<ol start=\"3\"><li>x</li><li>y</li></ol>"),
    ("1. **Step**: do\n   - sub", "<ol><li><strong>Step</strong>: do<ul><li>sub</li></ul></li></ol>"),
    ("> q\n> r", "<blockquote><p>q<br>r</p></blockquote>"),
    ("---", "<hr>"),
    ("Table:\n| a | b |\n|:--|--:|\n| `x\\|y` | 2 |", "<p>Table:</p><table><thead><tr><th style=\"text-align: left;\">a</th><th style=\"text-align: right;\">b</th></tr></thead><tbody><tr><td style=\"text-align: left;\"><code>x|y</code></td><td style=\"text-align: right;\">2</td></tr></tbody></table>"),
    ("```js\nlet a = 1 < 2;\n```", "<div class=\"code\"><div class=\"code-bar\"><span class=\"lang\">js</span><button class=\"copy\" type=\"button\">Copy</button></div><pre><code class=\"language-js\">let a = 1 &lt; 2;</code></pre></div>"),
    ("~~~\nopen", "<div class=\"code\"><div class=\"code-bar\"><span class=\"lang\">text</span><button class=\"copy\" type=\"button\">Copy</button></div><pre><code>open</code></pre></div>"),
    ("[x](https://a.example/p?q=1)", "<p><a href=\"https://a.example/p?q=1\" target=\"_blank\" rel=\"noopener noreferrer nofollow\">x</a></p>"),
    ("see https://a.example/x_y. and <http://b.example>", "<p>see <a href=\"https://a.example/x_y\" target=\"_blank\" rel=\"noopener noreferrer nofollow\">https://a.example/x_y</a>. and <a href=\"http://b.example/\" target=\"_blank\" rel=\"noopener noreferrer nofollow\">http://b.example</a></p>"),
    ("[https://a.example](https://a.example)", "<p><a href=\"https://a.example/\" target=\"_blank\" rel=\"noopener noreferrer nofollow\">https://a.example</a></p>"),
    ("[j](javascript:alert(1)) [d](data:text/html,x) [r](/v1/models) [v](vbscript:x)", "<p>[j](javascript:alert(1)) [d](data:text/html,x) [r](/v1/models) [v](vbscript:x)</p>"),
    ("![alt](https://img.example/a.png)", "<p><a href=\"https://img.example/a.png\" target=\"_blank\" rel=\"noopener noreferrer nofollow\">alt</a></p>"),
    ("<b onclick=\"x()\">hi</b> <script>x()</script>", "<p>&lt;b onclick=\"x()\"&gt;hi&lt;/b&gt; &lt;script&gt;x()&lt;/script&gt;</p>"),
    ("`<img src=x onerror=y>`", "<p><code>&lt;img src=x onerror=y&gt;</code></p>"),
];

/// Each case's rendering, in one evaluation: [markdown, got] for those that differ.
pub fn mismatches(
    fx: &Fixture,
    plant: Option<&Plant>,
) -> Result<Vec<(String, String, String)>, String> {
    let page = CannedPage::start(fx, plant, vec![], (900, 500))?;
    page.open("")?;
    let inputs: Vec<&str> = CASES.iter().map(|c| c.0).collect();
    let got = js(
        &page.tab,
        &format!(
            "{}.map(md => {{ const d = document.createElement('div'); d.appendChild(renderMarkdown(md)); return d.innerHTML; }})",
            serde_json::to_string(&inputs).unwrap()
        ),
    )?;
    let got: Vec<String> = match got {
        Value::Array(v) => v
            .iter()
            .map(|s| s.as_str().unwrap_or("").to_owned())
            .collect(),
        other => return Err(format!("renderMarkdown gave {other}")),
    };
    Ok(CASES
        .iter()
        .zip(got)
        .filter(|((_, want), got)| want != got)
        .map(|((md, want), got)| (md.to_string(), want.to_string(), got))
        .collect())
}
