//! The binaries of the examples that the CLI tests drive, as users run them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The binary of example `name`, built once per test process: `cargo test --test X`
/// does not build examples, so it is built here — also when it exists, so that a stale
/// binary is never tested (cargo does nothing when it is fresh).
pub fn example_binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = built.get(name) {
        return path.clone();
    }
    let root = workspace_root();
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    // A cargo profile to build the examples with (default `dev`), for a target
    // directory shared with other checkouts of the workspace.
    let profile = std::env::var("RETRYSAFE_EXAMPLE_PROFILE").unwrap_or_else(|_| "dev".to_owned());
    let dir = if profile == "dev" {
        "debug"
    } else {
        profile.as_str()
    };
    let path = target
        .join(dir)
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "--profile", &profile, "--example", name])
        .current_dir(&root)
        .status()
        .expect("run cargo build");
    assert!(status.success(), "cargo build --example {name} failed");
    assert!(path.exists(), "no example binary at {}", path.display());
    built.insert(name.to_owned(), path.clone());
    path
}

/// Example `name` run with an argument that is not UTF-8 answers with its usage and
/// exit code 2, writing nothing on stdout.
pub fn assert_non_utf8_argument_is_a_usage_error(name: &str) {
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"http://127.0.0.1:1/\xff");
    let output = Command::new(example_binary(name))
        .arg(bad)
        .output()
        .expect("run the example");
    assert_eq!(output.status.code(), Some(2));
    assert!(output.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("not valid UTF-8"), "{stderr}");
    assert!(stderr.contains("usage:"), "{stderr}");
}

/// The workspace's root: the `retrysafe` package, whose examples these are.
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent()
        .and_then(std::path::Path::parent)
        .map(PathBuf::from)
        .expect("this crate lives in crates/ of the workspace")
}
