//! Functions longer than a limit, outside tests: free fns, methods, trait default methods
//! (nested fns are measured on their own too). The length is the lines from the `fn`
//! keyword to the closing brace, blank and comment lines included; attributes and doc
//! comments above the `fn` are not counted.
//!
//! Left out: `#[test]` fns, `#[cfg(test)]` items and modules (inline, or the files a
//! `#[cfg(test)] mod name;` loads), and files under a `tests/` or `benches/` directory
//! below a given directory.

use std::path::{Path, PathBuf};

use syn::visit::{self, Visit};

use crate::attrs::{self, ModDir};

#[derive(Debug)]
pub struct LongFn {
    pub file: PathBuf,
    pub line: usize,
    /// `Type::method`, `outer::inner`, `free_fn`.
    pub name: String,
    pub lines: usize,
}

/// Directories not descended into.
const SKIPPED_DIRS: &[&str] = &["tests", "benches", "target", "node_modules"];

/// The `.rs` files at or under `paths`, sorted.
pub fn rust_files(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
        let entries =
            std::fs::read_dir(dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
        for entry in entries {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if path.is_dir() {
                if !name.starts_with('.') && !SKIPPED_DIRS.contains(&name) {
                    walk(&path, out)?;
                }
            } else if name.ends_with(".rs") {
                out.push(path);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    for path in paths {
        if path.is_dir() {
            walk(path, &mut out)?;
        } else if path.is_file() {
            out.push(path.clone());
        } else {
            anyhow::bail!("{}: no such file or directory", path.display());
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Every fn over `max_lines` in `files`, longest first.
pub fn find(files: &[PathBuf], max_lines: usize) -> anyhow::Result<Vec<LongFn>> {
    let parsed: Vec<(PathBuf, syn::File)> = files
        .iter()
        .map(|f| Ok((f.clone(), attrs::parse(f)?)))
        .collect::<anyhow::Result<_>>()?;
    // Files that `#[cfg(test)] mod name;` loads, and the directories of their submodules.
    let mut test_paths = Vec::new();
    for (file, ast) in &parsed {
        test_files(
            &ast.items,
            &ModDir::of_file(file, is_mod_rs_like(file)),
            false,
            &mut test_paths,
        );
    }
    let mut found = Vec::new();
    for (file, ast) in &parsed {
        if test_paths.iter().any(|t| file.starts_with(t)) {
            continue;
        }
        let mut finder = Finder {
            file,
            max_lines,
            owner: Vec::new(),
            found: &mut found,
        };
        finder.visit_file(ast);
    }
    found.sort_by(|a, b| {
        b.lines
            .cmp(&a.lines)
            .then_with(|| a.file.cmp(&b.file))
            .then(a.line.cmp(&b.line))
    });
    Ok(found)
}

fn is_mod_rs_like(file: &Path) -> bool {
    matches!(
        file.file_name().and_then(|n| n.to_str()),
        Some("lib.rs" | "main.rs" | "mod.rs" | "build.rs")
    )
}

fn test_files(items: &[syn::Item], dir: &ModDir, in_test: bool, out: &mut Vec<PathBuf>) {
    for item in items {
        let syn::Item::Mod(m) = item else { continue };
        let test = in_test || attrs::is_test(&m.attrs);
        let path = attrs::path_attr(&m.attrs);
        let name = m.ident.to_string();
        match &m.content {
            Some((_, items)) => test_files(items, &dir.inline(&name, path.as_deref()), test, out),
            None if test => {
                if let Ok(loaded) = dir.declared(&name, path.as_deref()) {
                    out.push(loaded.file);
                    out.push(loaded.child_dir);
                }
            }
            None => {}
        }
    }
}

struct Finder<'a> {
    file: &'a Path,
    max_lines: usize,
    /// Enclosing impl type, trait, or fn names.
    owner: Vec<String>,
    found: &'a mut Vec<LongFn>,
}

impl Finder<'_> {
    fn measure(&mut self, sig: &syn::Signature, block: &syn::Block) {
        let start = sig.fn_token.span.start().line;
        let end = block.brace_token.span.close().end().line;
        let lines = end + 1 - start;
        if lines > self.max_lines {
            let mut name = self.owner.clone();
            name.push(sig.ident.to_string());
            self.found.push(LongFn {
                file: self.file.to_path_buf(),
                line: start,
                name: name.join("::"),
                lines,
            });
        }
    }

    fn inside(&mut self, owner: String, f: impl FnOnce(&mut Self)) {
        self.owner.push(owner);
        f(self);
        self.owner.pop();
    }
}

fn type_name(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(p) => p
            .path
            .segments
            .last()
            .map_or("_".into(), |s| s.ident.to_string()),
        syn::Type::Reference(r) => type_name(&r.elem),
        _ => "_".into(),
    }
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        if !attrs::is_test(attrs::item_attrs(item)) {
            visit::visit_item(self, item);
        }
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        self.inside(type_name(&item.self_ty), |s| {
            visit::visit_item_impl(s, item)
        });
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.inside(item.ident.to_string(), |s| visit::visit_item_trait(s, item));
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        self.measure(&item.sig, &item.block);
        self.inside(item.sig.ident.to_string(), |s| {
            visit::visit_item_fn(s, item)
        });
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if attrs::is_test(&item.attrs) {
            return;
        }
        self.measure(&item.sig, &item.block);
        self.inside(item.sig.ident.to_string(), |s| {
            visit::visit_impl_item_fn(s, item)
        });
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if attrs::is_test(&item.attrs) {
            return;
        }
        if let Some(block) = &item.default {
            self.measure(&item.sig, block);
        }
        self.inside(item.sig.ident.to_string(), |s| {
            visit::visit_trait_item_fn(s, item)
        });
    }
}
