//! Import cycles between the Python modules of one flat directory (oracles/): each `*.py`
//! file directly in it is a module named by its stem. An edge A -> B is an import of B
//! anywhere in A's code: `import B`, `import B.x as y`, `from B import …`, `from .B import …`,
//! `from . import B`, `__import__("B")` or `importlib.import_module("B")` — at module level or
//! inside a function, class or `if` block (a lazy import is an edge all the same). Strings and
//! comments are skipped, so a docstring that shows an import is none. Names that are not
//! modules of the directory (the standard library, packages) are ignored, and so is a module
//! importing itself. A strongly connected set of more than one module is a cycle.
//!
//! The source is read with a small tokenizer (names, string literals, brackets, logical
//! lines), not a Python parser: enough to find import statements, and strict where a slip
//! would hide one (an unterminated string is an error, not the rest of the file skipped).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use crate::cycles::cycles_in;

/// One import as written: the module it names (the first dotted segment), where, and how.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Import {
    pub module: String,
    pub line: usize,
    /// `import`, `from` or `dynamic` (`__import__`, `importlib.import_module`).
    pub kind: &'static str,
    /// Written inside a block (a function, a class, an `if`), not at module level.
    pub nested: bool,
}

/// Where an edge is made.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Site {
    pub file: PathBuf,
    pub line: usize,
    pub kind: &'static str,
    pub nested: bool,
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let block = if self.nested { ", in a block" } else { "" };
        write!(
            f,
            "{}:{} ({}{block})",
            self.file.display(),
            self.line,
            self.kind
        )
    }
}

/// Edges between modules (importer, imported), each with the places that make it.
pub type Edges = BTreeMap<(String, String), BTreeSet<Site>>;

pub struct Report {
    /// The modules read (file stems), sorted.
    pub modules: Vec<String>,
    pub edges: Edges,
    /// Each cycle's modules, sorted.
    pub cycles: Vec<Vec<String>>,
}

/// The `*.py` files directly in `dir`, sorted, by module name.
fn python_files(dir: &Path) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "py") {
            let stem = path.file_stem().and_then(|s| s.to_str());
            let stem = stem.with_context(|| format!("{}: not a UTF-8 name", path.display()))?;
            out.insert(stem.to_owned(), path);
        }
    }
    anyhow::ensure!(!out.is_empty(), "{}: no .py files", dir.display());
    Ok(out)
}

/// Reads every module of `dir` and finds the cycles between them.
pub fn check_dir(dir: &Path) -> anyhow::Result<Report> {
    let files = python_files(dir)?;
    let mut sources = BTreeMap::new();
    for (name, path) in &files {
        let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
        let found = imports(&text).with_context(|| format!("{}", path.display()))?;
        sources.insert(name.clone(), (path.clone(), found));
    }
    Ok(check(&sources))
}

/// The edges and cycles of modules given with their imports (module -> (file, imports)).
pub fn check(sources: &BTreeMap<String, (PathBuf, Vec<Import>)>) -> Report {
    let mut edges = Edges::new();
    for (name, (file, found)) in sources {
        for import in found {
            if import.module == *name || !sources.contains_key(&import.module) {
                continue;
            }
            let site = Site {
                file: file.clone(),
                line: import.line,
                kind: import.kind,
                nested: import.nested,
            };
            let edge = (name.clone(), import.module.clone());
            edges.entry(edge).or_default().insert(site);
        }
    }
    let cycles = cycles_in(sources.keys(), edges.keys().map(|(a, b)| (a, b)));
    Report {
        modules: sources.keys().cloned().collect(),
        edges,
        cycles,
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Name(String),
    /// A string literal's text (escapes left as written).
    Str(String),
    Op(char),
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

/// One statement's tokens.
struct Statement {
    tokens: Vec<Token>,
    /// Inside a block: indented, or after the `:` of `if x: import y`.
    nested: bool,
}

/// String prefixes Python accepts before a quote (any case).
const PREFIXES: &[&str] = &["r", "u", "b", "f", "t", "br", "rb", "fr", "rf", "tr", "rt"];

/// Source text as statements: one ends at a newline outside brackets, at `;`, and at a `:`
/// outside brackets (so `if x: import y` holds the statement `import y`).
fn lex(src: &str) -> anyhow::Result<Vec<Statement>> {
    let mut lx = Lexer {
        chars: src.chars().collect(),
        i: 0,
        line: 1,
        line_start: 0,
        depth: 0,
        statements: Vec::new(),
        current: Vec::new(),
        nested: false,
        next_nested: None,
    };
    while let Some(&c) = lx.chars.get(lx.i) {
        match c {
            '\n' => {
                if lx.depth == 0 {
                    lx.end_statement(None);
                }
                lx.newline(lx.i + 1);
            }
            '#' => lx.skip_while(|c| c != '\n'),
            '\\' => lx.continuation(),
            '"' | '\'' => lx.string(lx.i)?,
            c if c.is_alphabetic() || c == '_' => lx.name()?,
            c if c.is_ascii_digit() => {
                lx.skip_while(|c| c.is_alphanumeric() || c == '_' || c == '.')
            }
            c if c.is_whitespace() => lx.i += 1,
            ';' => {
                lx.end_statement(Some(lx.nested));
                lx.i += 1;
            }
            ':' if lx.depth == 0 => {
                lx.end_statement(Some(true));
                lx.i += 1;
            }
            c => {
                match c {
                    '(' | '[' | '{' => lx.depth += 1,
                    ')' | ']' | '}' => lx.depth = lx.depth.saturating_sub(1),
                    _ => {}
                }
                lx.push(Tok::Op(c), lx.line, lx.indented(lx.i));
                lx.i += 1;
            }
        }
    }
    lx.end_statement(None);
    Ok(lx.statements)
}

struct Lexer {
    chars: Vec<char>,
    i: usize,
    line: usize,
    /// Where the current physical line starts (for indentation).
    line_start: usize,
    /// Open brackets: a newline inside them does not end the logical line.
    depth: usize,
    statements: Vec<Statement>,
    current: Vec<Token>,
    /// Whether the statement being read is nested.
    nested: bool,
    /// Whether the next one is, where the end of this one decided it (`:`, `;`); else its
    /// first token's column decides.
    next_nested: Option<bool>,
}

impl Lexer {
    /// Whether a token starting at `at` on the current line is indented.
    fn indented(&self, at: usize) -> bool {
        at > self.line_start
    }

    /// A token on `line` (`indented`: not at the line's first column).
    fn push(&mut self, tok: Tok, line: usize, indented: bool) {
        if self.current.is_empty() {
            self.nested = self.next_nested.take().unwrap_or(indented);
        }
        self.current.push(Token { tok, line });
    }

    /// The statement read so far ends; `next_nested` says whether the next one is nested.
    fn end_statement(&mut self, next_nested: Option<bool>) {
        if !self.current.is_empty() {
            let tokens = std::mem::take(&mut self.current);
            let nested = self.nested;
            self.statements.push(Statement { tokens, nested });
        }
        self.next_nested = next_nested;
    }

    /// Past a line break: the next line starts at `next`.
    fn newline(&mut self, next: usize) {
        self.i = next;
        self.line += 1;
        self.line_start = next;
    }

    fn skip_while(&mut self, keep: impl Fn(char) -> bool) {
        while self.chars.get(self.i).is_some_and(|&c| keep(c)) {
            self.i += 1;
        }
    }

    /// A backslash outside a string: a line continuation (before `\n` or `\r\n`), else a
    /// stray character.
    fn continuation(&mut self) {
        match (self.chars.get(self.i + 1), self.chars.get(self.i + 2)) {
            (Some('\n'), _) => self.newline(self.i + 2),
            (Some('\r'), Some('\n')) => self.newline(self.i + 3),
            _ => self.i += 1,
        }
    }

    /// A name, or a string literal when the name is a prefix right before a quote.
    fn name(&mut self) -> anyhow::Result<()> {
        let start = self.i;
        self.skip_while(|c| c.is_alphanumeric() || c == '_');
        let name: String = self.chars[start..self.i].iter().collect();
        let quoted = matches!(self.chars.get(self.i), Some('"' | '\''));
        if quoted && PREFIXES.contains(&name.to_lowercase().as_str()) {
            return self.string(start);
        }
        self.push(Tok::Name(name), self.line, self.indented(start));
        Ok(())
    }

    /// The string literal whose quote is at `self.i`, its token placed at `start` (its
    /// prefix, if any).
    fn string(&mut self, start: usize) -> anyhow::Result<()> {
        let (line, indented) = (self.line, self.indented(start));
        let q = self.chars[self.i];
        let triple = self.chars[self.i..].starts_with(&[q, q, q]);
        let width = if triple { 3 } else { 1 };
        self.i += width;
        let body = self.i;
        loop {
            let Some(&c) = self.chars.get(self.i) else {
                bail!("line {line}: unterminated string");
            };
            match c {
                '\\' => {
                    if self.chars.get(self.i + 1) == Some(&'\n') {
                        self.newline(self.i + 2);
                    } else {
                        self.i += 2;
                    }
                }
                '\n' if !triple => bail!("line {line}: unterminated string"),
                '\n' => self.newline(self.i + 1),
                c if c == q && (!triple || self.chars[self.i..].starts_with(&[q, q, q])) => {
                    let text: String = self.chars[body..self.i].iter().collect();
                    self.i += width;
                    self.push(Tok::Str(text), line, indented);
                    return Ok(());
                }
                _ => self.i += 1,
            }
        }
    }
}

/// Every import in Python source `src`.
pub fn imports(src: &str) -> anyhow::Result<Vec<Import>> {
    let mut out = Vec::new();
    for Statement {
        tokens: stmt,
        nested,
    } in lex(src)?
    {
        let mut add = |module: &str, t: &Token, kind: &'static str| {
            out.push(Import {
                module: module.to_owned(),
                line: t.line,
                kind,
                nested,
            })
        };
        match name(&stmt[0]) {
            // import a.b as c, d
            Some("import") => {
                for (module, t) in after_commas(&stmt[1..]) {
                    add(module, t, "import");
                }
            }
            // from a.b import c / from .a import c / from . import a, b
            Some("from") => {
                let dots = stmt[1..]
                    .iter()
                    .take_while(|t| t.tok == Tok::Op('.'))
                    .count();
                let rest = &stmt[1 + dots..];
                match rest.first() {
                    Some(t) if name(t) == Some("import") => {
                        for (module, t) in after_commas(&rest[1..]) {
                            add(module, t, "from");
                        }
                    }
                    Some(t) => {
                        if let Some(module) = name(t) {
                            add(module, t, "from");
                        }
                    }
                    None => {}
                }
            }
            _ => {}
        }
        // __import__("a") and importlib.import_module("a.b"), anywhere in the statement.
        for w in stmt.windows(3) {
            let call = matches!(name(&w[0]), Some("__import__" | "import_module"));
            if let (true, Tok::Op('('), Tok::Str(s)) = (call, &w[1].tok, &w[2].tok) {
                let module = s.split('.').next().unwrap_or_default();
                add(module, &w[2], "dynamic");
            }
        }
    }
    Ok(out)
}

fn name(t: &Token) -> Option<&str> {
    match &t.tok {
        Tok::Name(n) => Some(n.as_str()),
        _ => None,
    }
}

/// The first name of each comma-separated item (`a.b as c, (d, e)` -> a, d, e).
fn after_commas(tokens: &[Token]) -> Vec<(&str, &Token)> {
    let mut out = Vec::new();
    let mut expect = true;
    for t in tokens {
        match &t.tok {
            Tok::Name(n) if expect => {
                out.push((n.as_str(), t));
                expect = false;
            }
            Tok::Op(',') => expect = true,
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(src: &str) -> Vec<(String, usize, &'static str, bool)> {
        let mut out: Vec<_> = imports(src)
            .unwrap()
            .into_iter()
            .map(|i| (i.module, i.line, i.kind, i.nested))
            .collect();
        out.sort();
        out
    }

    fn row(
        m: &str,
        line: usize,
        kind: &'static str,
        nested: bool,
    ) -> (String, usize, &'static str, bool) {
        (m.to_owned(), line, kind, nested)
    }

    #[test]
    fn every_form_of_import_is_found() {
        let src = "import a\n\
                   import b.sub as bee, c\n\
                   from d.x import (y,\n    z)\n\
                   from .e import f\n\
                   from . import g, h as aitch\n\
                   def lazy():\n    from i import j\n    return __import__(\"k.sub\")\n\
                   m = importlib.import_module('l')\n\
                   if True: import n; import o\n\
                   import p; import q\n\
                   def f(): return __import__('r')\n";
        assert_eq!(
            found(src),
            vec![
                row("a", 1, "import", false),
                row("b", 2, "import", false),
                row("c", 2, "import", false),
                row("d", 3, "from", false),
                row("e", 5, "from", false),
                row("g", 6, "from", false),
                row("h", 6, "from", false),
                row("i", 8, "from", true),
                row("k", 9, "dynamic", true),
                row("l", 10, "dynamic", false),
                row("n", 11, "import", true),
                row("o", 11, "import", true),
                row("p", 12, "import", false),
                row("q", 12, "import", false),
                row("r", 13, "dynamic", true),
            ]
        );
    }

    #[test]
    fn strings_and_comments_are_no_imports() {
        let src = "\"\"\"A docstring.\n\n    import a\n    from b import c\n\"\"\"\n\
                   # import d\n\
                   x = 'import e'  # from f import g\n\
                   y = f\"{z} import h\" + rb'''\nimport i\n'''\n\
                   s = \"a \\\" quote; import j\"\n\
                   import k\n";
        assert_eq!(found(src), vec![row("k", 12, "import", false)]);
        assert!(imports("x = 'open\nimport a\n").is_err());
        assert!(imports("x = \"\"\"never closed\nimport a\n").is_err());
    }

    #[test]
    fn a_planted_cycle_is_found_with_its_edges() {
        // a -> b at the top, b -> c inside a function, c -> a through __import__: one cycle;
        // d -> a is an edge in none; e imports itself and a package that is not here.
        let sources: BTreeMap<String, (PathBuf, Vec<Import>)> = [
            ("a", "import b\nimport os\n"),
            ("b", "def f():\n    from c import g\n"),
            ("c", "x = __import__('a')\n"),
            ("d", "from a import thing\n"),
            ("e", "import e\nimport numpy\n"),
        ]
        .into_iter()
        .map(|(m, src)| {
            (
                m.to_owned(),
                (PathBuf::from(format!("{m}.py")), imports(src).unwrap()),
            )
        })
        .collect();
        let report = check(&sources);
        assert_eq!(report.cycles, vec![vec!["a", "b", "c"]]);
        let edges: Vec<String> = report
            .edges
            .iter()
            .map(|((from, to), sites)| {
                let sites: Vec<String> = sites.iter().map(|s| s.to_string()).collect();
                format!("{from} -> {to}: {}", sites.join("; "))
            })
            .collect();
        assert_eq!(
            edges,
            [
                "a -> b: a.py:1 (import)",
                "b -> c: b.py:2 (from, in a block)",
                "c -> a: c.py:1 (dynamic)",
                "d -> a: d.py:1 (from)",
            ]
        );

        // Without the lazy import there is no cycle.
        let mut acyclic = sources;
        acyclic.get_mut("b").unwrap().1.clear();
        assert!(check(&acyclic).cycles.is_empty());
    }
}
