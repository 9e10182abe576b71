//! What both checks need to know about attributes and `mod` declarations: whether an item is
//! test-only, and which file a `mod name;` declaration loads.

use std::path::{Path, PathBuf};

use syn::punctuated::Punctuated;
use syn::{Attribute, Item, Meta, Token};

/// Whether the attributes make an item test-only: `#[test]` (or `#[tokio::test]` and the
/// like), or a `#[cfg(..)]` whose predicate cannot hold outside `cfg(test)`.
pub fn is_test(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|attr| {
        let path = attr.path();
        if path.segments.last().is_some_and(|s| s.ident == "test") {
            return true;
        }
        path.is_ident("cfg") && attr.parse_args::<Meta>().is_ok_and(|m| requires_test(&m))
    })
}

/// Whether a cfg predicate implies `test`: `test`, `all(.., test, ..)`, `any(..)` of
/// predicates that each imply it. `not(..)` and anything else does not.
fn requires_test(meta: &Meta) -> bool {
    match meta {
        Meta::Path(p) => p.is_ident("test"),
        Meta::List(list) => {
            let Ok(nested) = list.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
            else {
                return false;
            };
            if list.path.is_ident("all") {
                nested.iter().any(requires_test)
            } else if list.path.is_ident("any") {
                !nested.is_empty() && nested.iter().all(requires_test)
            } else {
                false
            }
        }
        Meta::NameValue(_) => false,
    }
}

/// The attributes of any item.
pub fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// The value of a `#[path = "..."]` attribute, if any.
pub fn path_attr(attrs: &[Attribute]) -> Option<String> {
    attrs.iter().find_map(|attr| match &attr.meta {
        Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// Where the items of a module are, as the compiler looks for them.
#[derive(Clone, Debug)]
pub struct ModDir {
    /// The file the module's items are written in.
    pub file: PathBuf,
    /// The directory that `mod name;` inside the module looks in (`a/` for `a.rs`, the
    /// file's own directory for `lib.rs`, `main.rs`, `mod.rs` and `#[path]` files,
    /// one more level per inline `mod x { }`).
    pub child_dir: PathBuf,
    /// Whether these are the top-level items of `file` (not inside an inline module):
    /// `#[path]` is then relative to the file's directory rather than `child_dir`.
    pub top_level: bool,
}

impl ModDir {
    /// A crate root (`lib.rs`, `main.rs`) or any file loaded as a module.
    pub fn of_file(file: &Path, mod_rs_like: bool) -> ModDir {
        let parent = file.parent().unwrap_or(Path::new("")).to_path_buf();
        let child_dir = if mod_rs_like {
            parent
        } else {
            file.with_extension("")
        };
        ModDir {
            file: file.to_path_buf(),
            child_dir,
            top_level: true,
        }
    }

    /// An inline `mod name { }` inside this module.
    pub fn inline(&self, name: &str, path: Option<&str>) -> ModDir {
        let child_dir = match path {
            Some(p) => self.path_base().join(p),
            None => self.child_dir.join(name),
        };
        ModDir {
            file: self.file.clone(),
            child_dir,
            top_level: false,
        }
    }

    /// The file a `mod name;` inside this module loads, and its `ModDir`.
    pub fn declared(&self, name: &str, path: Option<&str>) -> anyhow::Result<ModDir> {
        if let Some(p) = path {
            let file = self.path_base().join(p);
            anyhow::ensure!(
                file.is_file(),
                "{}: #[path] module {name}: {} not found",
                self.file.display(),
                file.display()
            );
            return Ok(ModDir::of_file(&file, true));
        }
        let flat = self.child_dir.join(format!("{name}.rs"));
        let nested = self.child_dir.join(name).join("mod.rs");
        if flat.is_file() {
            Ok(ModDir::of_file(&flat, false))
        } else if nested.is_file() {
            Ok(ModDir::of_file(&nested, true))
        } else {
            anyhow::bail!(
                "{}: module {name}: neither {} nor {} exists",
                self.file.display(),
                flat.display(),
                nested.display()
            )
        }
    }

    fn path_base(&self) -> PathBuf {
        if self.top_level {
            self.file.parent().unwrap_or(Path::new("")).to_path_buf()
        } else {
            self.child_dir.clone()
        }
    }
}

/// Parse one source file.
pub fn parse(file: &Path) -> anyhow::Result<syn::File> {
    let text =
        std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    syn::parse_file(&text).map_err(|e| {
        let at = e.span().start();
        anyhow::anyhow!("{}:{}:{}: {e}", file.display(), at.line, at.column + 1)
    })
}
