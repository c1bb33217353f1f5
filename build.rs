//! Tells the test suite which run-time prerequisites this machine lacks, so a test that needs
//! one is reported by `cargo test` as *ignored*, with the reason, instead of passing without
//! checking anything.
//!
//! Under `CI=true` nothing is marked missing: there `.ci/run` installs every prerequisite, so a
//! missing one makes its test fail rather than disappear.

use std::path::{Path, PathBuf};

/// `(cfg name, is it present?)` for each prerequisite a test names in `cfg_attr(…, ignore)`.
fn prerequisites() -> Vec<(&'static str, bool)> {
    vec![
        ("tunestudio_missing_xvfb", on_path("xvfb-run")),
        ("tunestudio_missing_cc", on_path("cc")),
        ("tunestudio_missing_hebrew_font", hebrew_font_installed()),
    ]
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CI");
    println!("cargo:rerun-if-env-changed=PATH");
    println!("cargo:rerun-if-env-changed=HOME");
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    for (cfg, present) in prerequisites() {
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        if !present && !ci {
            println!("cargo:rustc-cfg={cfg}");
        }
    }
}

/// Whether `program` is in a `PATH` folder. Each folder is watched, so installing the program
/// (Xvfb, a C compiler) reruns this script on the next `cargo test`, without a clean build.
fn on_path(program: &str) -> bool {
    let Some(paths) = std::env::var_os("PATH") else {
        return false;
    };
    let mut found = false;
    for dir in std::env::split_paths(&paths) {
        if dir.is_dir() {
            println!("cargo:rerun-if-changed={}", dir.display());
            found |= dir.join(program).is_file();
        }
    }
    found
}

/// The font files `src/gui/fonts.rs` accepts for Hebrew, searched in the same folders.
fn hebrew_font_installed() -> bool {
    const NAMES: &[&str] = &[
        "dejavusans.ttf",
        "notosans-regular.ttf",
        "notosanshebrew-regular.ttf",
        "freesans.ttf",
        "liberationsans-regular.ttf",
    ];
    let mut dirs = vec![
        PathBuf::from("/usr/share/fonts"),
        PathBuf::from("/usr/local/share/fonts"),
    ];
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(&home).join(".local/share/fonts"));
        dirs.push(PathBuf::from(&home).join(".fonts"));
    }
    for dir in &dirs {
        if dir.is_dir() {
            println!("cargo:rerun-if-changed={}", dir.display());
        }
    }
    dirs.iter().any(|d| has_font(d, NAMES, 4))
}

fn has_font(dir: &Path, names: &[&str], depth: u32) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let path = e.path();
        if path.is_dir() {
            depth > 0 && has_font(&path, names, depth - 1)
        } else {
            let name = e.file_name().to_string_lossy().to_lowercase();
            names.iter().any(|n| name.starts_with(n))
        }
    })
}
