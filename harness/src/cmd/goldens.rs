use std::path::{Path, PathBuf};
use std::process::Command as Process;

use anyhow::{bail, Result};
use harness::goldens::{check_dir, goldens_root, machine_layers, reference_key, resolve, Layer};
use harness::parity::gates::{groups, registry, Registered};
use harness::{machine, oracle};

#[derive(clap::Subcommand)]
pub enum Command {
    /// Show, for this machine, which layer each golden resolves to: its override
    /// (goldens/<machine-key>/NAME) or the reference set (goldens/NAME).
    List,
    /// Verify that every golden, in every layer, has complete provenance and names a
    /// generator script that exists.
    Check,
    /// Re-run the oracle scripts (in oracles/.venv) for NAMEs (default: all). On the
    /// reference machine they rewrite the reference set; anywhere else they write this
    /// machine's override dir and never touch the reference set.
    Regen { names: Vec<String> },
    /// Write (once) the l1-vocab gate's model NAME (a tiny model resized to a real
    /// tokenizer's vocabulary, `vocab-qwen3`, …) into the cache dir and print its path: the
    /// oracle script reads the same bytes.
    VocabModel { name: String },
}

/// The goldens and their generators come from the gate table (`registry`).
pub fn run(command: Command) -> Result<()> {
    let root = goldens_root();
    let key = machine::machine_key();
    let reference = reference_key(&root);
    match command {
        Command::List => list(&root, &key, reference.as_deref()),
        Command::Check => check(&root),
        Command::Regen { names } => regen(&key, reference.as_deref(), &names),
        Command::VocabModel { name } => {
            let pairing = harness::parity::vocab::Pairing::named(&name)?;
            println!(
                "{}",
                harness::parity::vocab::materialize(pairing)?.display()
            );
            Ok(())
        }
    }
}

fn list(root: &Path, key: &str, reference: Option<&str>) -> Result<()> {
    println!(
        "machine key {key}; reference {}; goldens {}",
        reference.unwrap_or("(no goldens/REFERENCE)"),
        root.display()
    );
    for g in registry() {
        match resolve(root, key, &g.name) {
            Ok((dir, Layer::Machine)) => {
                println!("  {:<28} override   {}", g.name, dir.display())
            }
            Ok((dir, Layer::Reference)) => {
                println!("  {:<28} reference  {}", g.name, dir.display())
            }
            Err(_) => println!("  {:<28} MISSING", g.name),
        }
    }
    let layers = machine_layers(root, &groups());
    if !layers.is_empty() {
        println!("machine layers present: {}", layers.join(", "));
    }
    Ok(())
}

fn check(root: &Path) -> Result<()> {
    let repo = oracle::repo_root();
    let mut problems = Vec::new();
    let mut checked = 0;
    let layers: Vec<PathBuf> = std::iter::once(root.to_owned())
        .chain(
            machine_layers(root, &groups())
                .into_iter()
                .map(|k| root.join(k)),
        )
        .collect();
    for layer in &layers {
        for g in registry() {
            let dir = layer.join(&g.name);
            if dir.is_dir() {
                checked += 1;
                problems.extend(check_dir(&dir, &repo));
            } else if layer == root {
                problems.push(format!("{}: registered golden is missing", dir.display()));
            }
        }
    }
    for p in &problems {
        println!("  {p}");
    }
    if !problems.is_empty() {
        bail!("{} problem(s) in {checked} golden dirs", problems.len());
    }
    println!("{checked} golden dirs: provenance complete, generators present");
    Ok(())
}

fn regen(key: &str, reference: Option<&str>, names: &[String]) -> Result<()> {
    let python = oracle::python();
    if !python.exists() {
        bail!(
            "no oracle venv at {}: create it with `bash oracles/setup.sh`",
            oracle::venv_dir().display()
        );
    }
    let all = registry();
    if let Some(n) = names.iter().find(|n| !all.iter().any(|g| &g.name == *n)) {
        bail!("unknown golden `{n}` (see `harness goldens list`)");
    }
    let chosen: Vec<Registered> = all
        .into_iter()
        .filter(|g| names.is_empty() || names.contains(&g.name))
        .collect();
    let target = if reference == Some(key) {
        "the reference set (this is the reference machine)".to_owned()
    } else {
        format!("goldens/{key}/ (reference set untouched)")
    };
    println!("regenerating into {target}");
    let mut done: Vec<(&str, Vec<String>)> = Vec::new();
    for g in &chosen {
        let call = (g.script, g.args.clone());
        if done.contains(&call) {
            continue; // make_models.py writes all models at once
        }
        println!("  {} ← oracles/{} {}", g.name, g.script, g.args.join(" "));
        let status = Process::new(&python)
            .arg(oracle::repo_root().join("oracles").join(g.script))
            .args(&g.args)
            .env("HARNESS_MACHINE", key)
            .status()?;
        if !status.success() {
            bail!("oracles/{} failed ({status})", g.script);
        }
        done.push(call);
    }
    Ok(())
}
