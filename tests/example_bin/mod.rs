//! The binaries of the examples that the CLI tests drive, as users run them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The binary of example `name`, built once per test process: `cargo test --test X`
/// does not build examples, so it is built here — also when it exists, so that a stale
/// binary is never tested (cargo does nothing when it is fresh).
pub(crate) fn example_binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let path = target
        .join("debug")
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--example", name])
        .current_dir(&root)
        .status()
        .expect("run cargo build");
    assert!(status.success(), "cargo build --example {name} failed");
    assert!(path.exists(), "no example binary at {}", path.display());
    built.insert(name.to_owned(), path.clone());
    path
}
