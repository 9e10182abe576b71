//! The checks can fail: planted cycles and a planted long fn are found, an acyclic crate
//! passes (the cycle fixtures under tests/fixtures/; the long-fn crate is written by
//! `long_fixture`, so no repeated lines are committed, and the Python modules by
//! `py_fixture`, so that the only Python committed stays in oracles/).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A fn of `lines` lines in all (signature and closing brace included), indented `indent`.
fn planted_fn(attr: &str, sig: &str, lines: usize, indent: &str) -> String {
    let mut out = String::new();
    if !attr.is_empty() {
        out += &format!("{indent}{attr}\n");
    }
    out += &format!("{indent}{sig} {{\n");
    for i in 0..lines - 2 {
        out += &format!("{indent}    let _x{i} = {i};\n");
    }
    out + &format!("{indent}}}\n")
}

/// A crate with planted long fns: `long` (120 lines, at lib.rs:9) and `S::just_over` (101,
/// at lib.rs:232) are over 100 lines; `S::at_limit` (100) is not; the test-only ones (a
/// `#[test]` fn, a `#[cfg(test)]` fn, a `#[cfg(test)] mod`, and tests/) are left out.
fn long_fixture() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("long");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src")).expect("fixture dir");
    std::fs::create_dir_all(dir.join("tests")).expect("fixture dir");
    let mut lib =
        String::from("//! Planted long fns.\n\n\n#[cfg(test)]\nmod tests;\n\npub struct S;\n\n");
    lib += &planted_fn("", "pub fn long()", 120, "");
    lib += "\nimpl S {\n";
    lib += &planted_fn("", "pub fn at_limit()", 100, "    ");
    lib += "\n";
    lib += &planted_fn("", "pub fn just_over()", 101, "    ");
    lib += "}\n\n";
    lib += &planted_fn("#[test]", "fn long_test()", 150, "");
    lib += "\n";
    lib += &planted_fn("#[cfg(all(test, unix))]", "fn long_helper()", 150, "");
    let in_tests = planted_fn("", "pub fn long_in_test_module()", 150, "");
    std::fs::write(dir.join("src/lib.rs"), lib).expect("fixture");
    std::fs::write(dir.join("src/tests.rs"), &in_tests).expect("fixture");
    std::fs::write(dir.join("tests/it.rs"), &in_tests).expect("fixture");
    dir
}

/// Run the tool from this crate's directory: (exit code, stdout).
fn codeshape(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_codeshape"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run codeshape");
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    (out.status.code().expect("exit code"), stdout)
}

#[test]
fn planted_cycles_are_found_with_their_edges() {
    let (code, out) = codeshape(&["cycles", "tests/fixtures/cyclic/src"]);
    assert_eq!(code, 1);
    assert!(out.contains("2 cycle(s)"), "{out}");
    assert!(out.contains("cycle 1 under crate: {a, b}"), "{out}");
    assert!(out.contains("cycle 2 under b: {deep, other}"), "{out}");
    // Each edge with the line that makes it: a `use`, a path in code, one in a macro.
    for edge in [
        "a -> b:\n      tests/fixtures/cyclic/src/a.rs:1 (use)",
        "b -> a:\n      tests/fixtures/cyclic/src/b/deep.rs:3 (path)",
        "b::deep -> b::other:\n      tests/fixtures/cyclic/src/b/deep.rs:7 (use)",
        "b::other -> b::deep:\n      tests/fixtures/cyclic/src/b/other.rs:4 (path)",
    ] {
        assert!(out.contains(edge), "missing {edge:?} in\n{out}");
    }
    // `c -> a` is an edge but in no cycle.
    assert!(!out.contains("c -> a"), "{out}");
}

#[test]
fn an_acyclic_crate_passes() {
    let (code, out) = codeshape(&["cycles", "tests/fixtures/acyclic/src"]);
    assert_eq!(code, 0);
    // a, b, b::deep, b::renamed (#[path]) and the root; the test module is left out. The
    // edges: a -> b, b::renamed -> b::deep.
    assert!(
        out.contains("5 modules, 2 edges between sibling modules, 0 cycle(s)"),
        "{out}"
    );
}

#[test]
fn a_missing_module_file_is_an_error() {
    let dir = long_fixture().join("tests");
    let (code, _) = codeshape(&["cycles", dir.to_str().expect("utf-8 path")]);
    assert_eq!(code, 2);
}

#[test]
fn planted_long_fns_are_found_outside_tests() {
    let fixture = long_fixture();
    let dir = fixture.to_str().expect("utf-8 path");
    let (code, out) = codeshape(&["long-fns", "--allow", "1", dir]);
    assert_eq!(code, 1, "two fns over an allowance of one");
    assert!(out.contains("2 fn(s) over 100 lines"), "{out}");
    assert!(out.contains("long/src/lib.rs:9: long (120 lines)"), "{out}");
    assert!(
        out.contains("long/src/lib.rs:232: S::just_over (101 lines)"),
        "{out}"
    );
    assert!(
        !out.contains("at_limit") && !out.contains("long_test") && !out.contains("long_helper"),
        "{out}"
    );
    assert!(!out.contains("long_in_test_module"), "{out}");

    let (code, _) = codeshape(&["long-fns", "--allow", "2", dir]);
    assert_eq!(code, 0);
    let (code, out) = codeshape(&["long-fns", "--max-lines", "120", "--allow", "0", dir]);
    assert_eq!(code, 0, "{out}");
}

/// A flat directory of Python modules with a planted cycle: `top` imports `mid` at module
/// level, `mid` imports `low` inside a function (a lazy import), `low` imports `top` through
/// importlib; `other` imports `top` and names `mid` only in its docstring and a comment.
/// Without `lazy`, mid's import is gone and so is the cycle.
fn py_fixture(name: &str, lazy: bool) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("sub")).expect("fixture dir");
    let lazy = if lazy {
        "    from low import helper\n"
    } else {
        ""
    };
    let files = [
        ("top.py", "import os\nimport mid\n".to_owned()),
        ("mid.py", format!("def f():\n{lazy}    return 1\n")),
        (
            "low.py",
            "import importlib\nTOP = importlib.import_module('top')\n".to_owned(),
        ),
        (
            "other.py",
            "\"\"\"Not `import mid`.\"\"\"\nimport top  # from mid import x\n".to_owned(),
        ),
        // Not a module of the directory: subdirectories are not read.
        ("sub/deep.py", "import top\n".to_owned()),
    ];
    for (file, text) in files {
        std::fs::write(dir.join(file), text).expect("fixture");
    }
    dir
}

#[test]
fn a_planted_python_cycle_is_found_with_its_edges() {
    let dir = py_fixture("py-cyclic", true);
    let shown = dir.display().to_string();
    let (code, out) = codeshape(&["py-cycles", &shown]);
    assert_eq!(code, 1);
    assert!(
        out.contains("4 modules, 4 edges between them (4 imports), 1 cycle(s)"),
        "{out}"
    );
    assert!(out.contains("  cycle 1: {low, mid, top}"), "{out}");
    for edge in [
        format!("    low -> top:\n      {shown}/low.py:2 (dynamic)"),
        format!("    mid -> low:\n      {shown}/mid.py:2 (from, in a block)"),
        format!("    top -> mid:\n      {shown}/top.py:2 (import)"),
    ] {
        assert!(out.contains(&edge), "missing {edge:?} in\n{out}");
    }
    assert!(!out.contains("other ->"), "other is in no cycle: {out}");
}

#[test]
fn python_modules_without_a_cycle_pass() {
    let dir = py_fixture("py-acyclic", false);
    let (code, out) = codeshape(&["py-cycles", dir.to_str().expect("utf-8 path")]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("4 modules, 3 edges between them (3 imports), 0 cycle(s)"),
        "{out}"
    );
    let missing = dir.join("missing");
    let (code, _) = codeshape(&["py-cycles", missing.to_str().expect("utf-8 path")]);
    assert_eq!(code, 2);
}
