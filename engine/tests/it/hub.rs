//! `--model org/name[@revision]` end to end: the engine finds a repo in a Hugging Face hub
//! cache laid out as the hub writes it (blobs/ + snapshot symlinks + refs/), offline, and an
//! absent repo is an error that says how to download it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const MAIN: &str = "0123456789abcdef0123456789abcdef01234567";
const TRAINED: &str = "89abcdef0123456789abcdef0123456789abcdef";

fn goldens() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../goldens/models")
}

/// Puts goldens/models/`model` into `cache` as `repo` at `commit` (files in blobs/, named
/// by their sha256 as the hub does, linked from snapshots/<commit>/) and points `refs/<name>`
/// at it.
fn add_to_cache(cache: &Path, repo: &str, model: &str, commit: &str, name: &str) {
    use sha2::Digest;
    let folder = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = folder.join("snapshots").join(commit);
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    std::fs::create_dir_all(folder.join("refs")).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    for f in std::fs::read_dir(goldens().join(model)).unwrap().flatten() {
        let bytes = std::fs::read(f.path()).unwrap();
        let hash = format!("{:x}", sha2::Sha256::digest(&bytes));
        std::fs::write(folder.join("blobs").join(&hash), &bytes).unwrap();
        let link = Path::new("../../blobs").join(&hash);
        std::os::unix::fs::symlink(link, snapshot.join(f.file_name())).unwrap();
    }
    std::fs::write(folder.join("refs").join(name), commit).unwrap();
}

/// `engine ARGS` with only `env` of the hub's variables set (HOME too, for `~/.cache`).
fn engine(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_engine"));
    for var in [
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "XDG_CACHE_HOME",
        "HOME",
    ] {
        cmd.env_remove(var);
    }
    for (var, value) in env {
        cmd.env(var, value);
    }
    cmd.args(args).output().unwrap()
}

/// What every generate here prints: 12 greedy tokens of a raw prompt, text only.
const PROMPT: [&str; 7] = [
    "--ignore-chat-template",
    "--prompt",
    "The little robot",
    "-m",
    "12",
    "--verbose",
    "False",
];

fn generate(model: &str, env: &[(&str, &Path)]) -> Output {
    let mut args = vec!["generate", "--model", model];
    args.extend(PROMPT);
    engine(&args, env)
}

fn text(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The repo id prints what the model directory prints, from each place the cache can be
/// (HF_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub);
/// `@revision` and `@<commit>` pick the other snapshot. The planted half: the other
/// snapshot (another model) prints something else, so the comparison tells them apart.
#[test]
fn generate_finds_a_repo_id_in_the_hub_cache() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    let hub = root.join("home/.cache/huggingface/hub");
    add_to_cache(&hub, "org/tiny-llama", "tiny-llama", MAIN, "main");
    add_to_cache(
        &hub,
        "org/tiny-llama",
        "tiny-llama-trained",
        TRAINED,
        "trained",
    );
    let direct = text(&generate(
        goldens().join("tiny-llama").to_str().unwrap(),
        &[],
    ));
    let trained = text(&generate(
        goldens().join("tiny-llama-trained").to_str().unwrap(),
        &[],
    ));
    assert_ne!(direct, trained, "the two snapshots must print differently");
    let home = root.join("home");
    let xdg = root.join("home/.cache");
    let hf_home = root.join("home/.cache/huggingface");
    for env in [
        vec![("HF_HUB_CACHE", hub.as_path())],
        vec![("HF_HOME", hf_home.as_path())],
        vec![("XDG_CACHE_HOME", xdg.as_path())],
        vec![("HOME", home.as_path())],
    ] {
        assert_eq!(text(&generate("org/tiny-llama", &env)), direct, "{env:?}");
    }
    let env = [("HF_HUB_CACHE", hub.as_path())];
    assert_eq!(text(&generate("org/tiny-llama@trained", &env)), trained);
    let at_commit = format!("org/tiny-llama@{TRAINED}");
    assert_eq!(text(&generate(&at_commit, &env)), trained);
    // --draft-model resolves the same way: speculation prints the target's greedy text.
    add_to_cache(&hub, "org/draft", "tiny-llama-draft", MAIN, "main");
    let target = goldens().join("tiny-llama-trained");
    let mut args = vec!["generate", "--model", target.to_str().unwrap()];
    args.extend(["--draft-model", "org/draft"]);
    args.extend(PROMPT);
    assert_eq!(text(&engine(&args, &env)), trained);
    // HF_HUB_CACHE wins over HF_HOME: an empty HF_HUB_CACHE dir has no such repo.
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let both = [
        ("HF_HUB_CACHE", empty.as_path()),
        ("HF_HOME", hf_home.as_path()),
    ];
    assert!(!generate("org/tiny-llama", &both).status.success());
}

/// An absent repo id: generate, serve and train each refuse it before loading anything, with
/// the cache searched and the command to download it.
#[test]
fn an_absent_repo_id_says_how_to_download_it() {
    let root = tempfile::tempdir().unwrap();
    let hub = root.path();
    let env = [("HF_HUB_CACHE", hub)];
    let cache = hub.display();
    let want = format!(
        "error: invalid value 'org/absent' for '--model <MODEL>': no such directory, and the \
         Hugging Face repo org/absent is not in the local hub cache {cache} \
         ({cache}/models--org--absent not found); the engine never downloads: fetch it first \
         with `hf download org/absent` (or `huggingface-cli download org/absent`), or set \
         HF_HUB_CACHE to the cache that holds it\n"
    );
    for args in [
        vec!["generate", "--model", "org/absent", "--prompt", "hi"],
        vec!["serve", "--model", "org/absent"],
        vec!["train", "--model", "org/absent", "--data", "x"],
    ] {
        let out = engine(&args, &env);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        let first = err.split("\n\n").next().unwrap();
        assert_eq!(format!("{first}\n"), want, "{args:?}");
    }
    add_to_cache(hub, "org/absent", "tiny-llama", MAIN, "main");
    let out = engine(
        &["generate", "--model", "org/absent@v9", "--prompt", "hi"],
        &env,
    );
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("org/absent at revision v9")
            && err.contains("refs/v9 not found")
            && err.contains("`hf download org/absent --revision v9`"),
        "{err}"
    );
}
