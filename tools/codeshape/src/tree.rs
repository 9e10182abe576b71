//! A crate's module tree, read from its root file the way the compiler finds modules, and
//! the paths each module's code refers to (in `use` items, in code, and in macro arguments).
//! Test-only items (`#[cfg(test)]` modules, `#[test]` fns) are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::visit::{self, Visit};

use crate::attrs::{self, ModDir};

/// A module's path from the crate root (empty for the root).
pub type ModPath = Vec<String>;

/// `crate` for the root, else `a::b`.
pub fn show(path: &[String]) -> String {
    if path.is_empty() {
        "crate".to_string()
    } else {
        path.join("::")
    }
}

/// Where a reference is written.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Site {
    /// `use` items sort before paths in code.
    pub kind: Kind,
    pub file: PathBuf,
    pub line: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Use,
    Path,
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Use => "use",
            Kind::Path => "path",
        };
        write!(f, "{}:{} ({kind})", self.file.display(), self.line)
    }
}

/// A path as written (`super::worker::Event`), and where.
#[derive(Debug)]
pub struct Reference {
    pub segments: Vec<String>,
    pub site: Site,
}

#[derive(Debug, Default)]
pub struct Module {
    /// Child modules, by name.
    pub children: BTreeSet<String>,
    /// Names brought in by `use` (anywhere in the module, fn bodies included), with the
    /// path as written.
    pub imports: BTreeMap<String, Vec<String>>,
    pub references: Vec<Reference>,
}

#[derive(Debug)]
pub struct Crate {
    /// The root file (`src/lib.rs`, `src/main.rs`).
    pub root: PathBuf,
    pub modules: BTreeMap<ModPath, Module>,
}

/// Read the module tree under `root` and every module's references.
pub fn load(root: &Path) -> anyhow::Result<Crate> {
    let file = attrs::parse(root)?;
    let mut loader = Loader {
        modules: BTreeMap::new(),
        stack: vec![(Vec::new(), ModDir::of_file(root, true))],
        error: None,
    };
    loader.modules.insert(Vec::new(), Module::default());
    loader.visit_file(&file);
    if let Some(e) = loader.error {
        return Err(e);
    }
    Ok(Crate {
        root: root.to_path_buf(),
        modules: loader.modules,
    })
}

impl Crate {
    /// What a path written in `module` names, as a path from the crate root, if it names
    /// something in this crate (`None` for other crates, std, generics, local items).
    pub fn resolve(&self, module: &ModPath, segments: &[String]) -> Option<ModPath> {
        self.resolve_at(module, segments, 0)
    }

    fn resolve_at(&self, module: &ModPath, segments: &[String], depth: usize) -> Option<ModPath> {
        let first = segments.first()?;
        let (mut base, rest) = match first.as_str() {
            "crate" => (Vec::new(), &segments[1..]),
            "self" | "super" => {
                let mut base = module.clone();
                let mut k = 0;
                while k < segments.len() && matches!(segments[k].as_str(), "self" | "super") {
                    if segments[k] == "super" {
                        base.pop()?;
                    }
                    k += 1;
                }
                (base, &segments[k..])
            }
            name => {
                let m = self.modules.get(module)?;
                if m.children.contains(name) {
                    let mut base = module.clone();
                    base.push(name.to_string());
                    (base, &segments[1..])
                } else if let Some(written) = m.imports.get(name) {
                    if depth > 8 || written.first() == Some(first) && written.len() == 1 {
                        return None;
                    }
                    (self.resolve_at(module, written, depth + 1)?, &segments[1..])
                } else {
                    return None;
                }
            }
        };
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The module a path from the crate root is in: its longest prefix that is a module.
    pub fn module_of(&self, path: &[String]) -> ModPath {
        (0..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|p| self.modules.contains_key(p))
            .unwrap_or_default()
    }
}

struct Loader {
    modules: BTreeMap<ModPath, Module>,
    /// The module being read, innermost last.
    stack: Vec<(ModPath, ModDir)>,
    error: Option<anyhow::Error>,
}

fn line(span: Span) -> usize {
    span.start().line
}

impl Loader {
    fn current(&mut self) -> &mut Module {
        let path = &self.stack.last().expect("inside a module").0;
        self.modules.get_mut(path).expect("module registered")
    }

    fn here(&self) -> &ModDir {
        &self.stack.last().expect("inside a module").1
    }

    fn reference(&mut self, segments: Vec<String>, kind: Kind, line: usize) {
        let file = self.here().file.clone();
        self.current().references.push(Reference {
            segments,
            site: Site { kind, file, line },
        });
    }

    /// Flatten a use tree into (name it binds, path it names, line).
    fn use_tree(&mut self, tree: &syn::UseTree, prefix: &mut Vec<String>) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(&p.tree, prefix);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let (name, path) = if n.ident == "self" {
                    (prefix.last().cloned(), prefix.clone())
                } else {
                    let mut path = prefix.clone();
                    path.push(n.ident.to_string());
                    (Some(n.ident.to_string()), path)
                };
                self.bind(name, path, line(n.ident.span()));
            }
            syn::UseTree::Rename(r) => {
                let mut path = prefix.clone();
                if r.ident != "self" {
                    path.push(r.ident.to_string());
                }
                let name = (r.rename != "_").then(|| r.rename.to_string());
                self.bind(name, path, line(r.ident.span()));
            }
            syn::UseTree::Glob(g) => self.bind(None, prefix.clone(), line(g.star_token.span)),
            syn::UseTree::Group(g) => {
                for tree in &g.items {
                    self.use_tree(tree, prefix);
                }
            }
        }
    }

    fn bind(&mut self, name: Option<String>, path: Vec<String>, line: usize) {
        if path.is_empty() {
            return;
        }
        if let Some(name) = name {
            self.current().imports.insert(name, path.clone());
        }
        self.reference(path, Kind::Use, line);
    }

    fn enter(&mut self, name: String, dir: ModDir) {
        let mut path = self.stack.last().expect("inside a module").0.clone();
        self.current().children.insert(name.clone());
        path.push(name);
        // `#[cfg(a)] mod m; #[cfg(not(a))] mod m;` is one module, read from both files.
        self.modules.entry(path.clone()).or_default();
        self.stack.push((path, dir));
    }

    /// Paths of two or more segments in a macro's tokens (`format!("{}", crate::a::f())`):
    /// macro arguments are not parsed as code, so they are scanned.
    fn scan_tokens(&mut self, tokens: TokenStream) {
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        let colon = |t: &TokenTree| matches!(t, TokenTree::Punct(p) if p.as_char() == ':');
        let colons = |i: usize| i + 1 < tokens.len() && colon(&tokens[i]) && colon(&tokens[i + 1]);
        let mut i = 0;
        while i < tokens.len() {
            match &tokens[i] {
                TokenTree::Group(g) => {
                    self.scan_tokens(g.stream());
                    i += 1;
                }
                TokenTree::Ident(first) => {
                    let extern_path = i >= 2 && colons(i - 2);
                    let mut segments = vec![first.to_string()];
                    let mut j = i + 1;
                    while colons(j) {
                        let Some(TokenTree::Ident(next)) = tokens.get(j + 2) else {
                            break;
                        };
                        segments.push(next.to_string());
                        j += 3;
                    }
                    if segments.len() >= 2 && !extern_path {
                        self.reference(segments, Kind::Path, line(first.span()));
                    }
                    i = j;
                }
                _ => i += 1,
            }
        }
    }
}

impl<'ast> Visit<'ast> for Loader {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if self.error.is_none() && !attrs::is_test(attrs::item_attrs(item)) {
            visit::visit_item(self, item);
        }
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        let test = match item {
            syn::ImplItem::Fn(f) => attrs::is_test(&f.attrs),
            syn::ImplItem::Const(c) => attrs::is_test(&c.attrs),
            syn::ImplItem::Type(t) => attrs::is_test(&t.attrs),
            _ => false,
        };
        if !test {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        let name = item.ident.to_string();
        let path = attrs::path_attr(&item.attrs);
        match &item.content {
            Some((_, items)) => {
                let dir = self.here().inline(&name, path.as_deref());
                self.enter(name, dir);
                for item in items {
                    self.visit_item(item);
                }
            }
            None => {
                let loaded = self
                    .here()
                    .declared(&name, path.as_deref())
                    .and_then(|dir| Ok((attrs::parse(&dir.file)?, dir)));
                let (file, dir) = match loaded {
                    Ok(loaded) => loaded,
                    Err(e) => {
                        self.error = Some(e);
                        return;
                    }
                };
                self.enter(name, dir);
                self.visit_file(&file);
            }
        }
        self.stack.pop();
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        // `use ::name::..` is another crate.
        if item.leading_colon.is_none() {
            self.use_tree(&item.tree, &mut Vec::new());
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() && path.segments.len() >= 2 {
            let segments = path.segments.iter().map(|s| s.ident.to_string()).collect();
            self.reference(segments, Kind::Path, line(path.segments[0].ident.span()));
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        visit::visit_macro(self, mac);
        self.scan_tokens(mac.tokens.clone());
    }

    // Attribute paths (`derive`, `serde`, `cfg`) are not references to modules.
    fn visit_attribute(&mut self, _: &'ast syn::Attribute) {}
}
