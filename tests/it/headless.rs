//! The headless build (`cargo build --no-default-features`: the CLI without the studio).
//!
//! CI (`.ci/run`) runs the library's unit tests once, in the default build, because the library
//! is the same code with or without the `gui` feature; the first test here keeps that true.
//! What the feature changes is the binary, so CI runs the binary's tests and the tests that
//! start it a second time, headless; the second test is one of those.

use std::path::{Path, PathBuf};

/// The files of the library's module tree: `src/lib.rs` and, for each `mod name;` it declares,
/// `src/name.rs` and everything under `src/name/` (the crate declares no `#[path]` modules).
fn library_files(src: &Path) -> Vec<PathBuf> {
    let lib = src.join("lib.rs");
    let text = std::fs::read_to_string(&lib).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    let mut files = vec![lib];
    for line in text.lines() {
        let line = line.trim();
        let Some(decl) = line.strip_suffix(';') else {
            continue;
        };
        let Some((_, name)) = decl.split_once("mod ") else {
            continue;
        };
        if line.starts_with("//") || !name.chars().all(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let file = src.join(format!("{name}.rs"));
        let dir = src.join(name);
        assert!(
            file.is_file() || dir.is_dir(),
            "src/lib.rs declares `mod {name};` but neither {} nor {} exists",
            file.display(),
            dir.display()
        );
        if file.is_file() {
            files.push(file);
        }
        if dir.is_dir() {
            files.extend(rust_files(&dir));
        }
    }
    files
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Why CI does not run the library's tests twice: no file of the library depends on the
/// `gui` feature (the studio lives in the binary, `src/main.rs` → `src/gui`). A library line
/// gated on it would be tested in one build only; gate it in the binary instead, or have CI
/// run the library's tests headless too (`.ci/run`).
#[test]
fn the_library_is_the_same_code_with_or_without_the_gui_feature() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = library_files(&src);
    assert!(
        files
            .iter()
            .any(|f| f.ends_with("src/train/mod.rs") || f.ends_with("src/train.rs")),
        "the module walk missed the library's modules: {files:?}"
    );
    let mut hits = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (i, line) in text.lines().enumerate() {
            let squeezed: String = line.chars().filter(|c| !c.is_whitespace()).collect();
            if squeezed.contains("feature=\"gui\"") {
                hits.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        hits.is_empty(),
        "the library depends on the `gui` feature (CI tests the library in the default build \
         only):\n{}",
        hits.join("\n")
    );
}

/// Why CI type-checks the `cuda`/`nccl` code in the headless build only (`scripts/build-cuda.sh
/// check`, every target without the studio): no studio file (`src/gui`) names either feature,
/// and no line anywhere gates on `gui` together with one of them. Such a line would be checked
/// by no build; check the studio with CUDA too (the script's `--gui` build) before adding one.
#[test]
fn no_cuda_line_is_studio_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut hits = Vec::new();
    for dir in ["src", "tests", "examples", "benches"] {
        let dir = root.join(dir);
        if !dir.is_dir() {
            continue;
        }
        for file in rust_files(&dir) {
            let in_studio = file.starts_with(root.join("src/gui"));
            let text = std::fs::read_to_string(&file).unwrap();
            for (i, line) in text.lines().enumerate() {
                let squeezed: String = line.chars().filter(|c| !c.is_whitespace()).collect();
                let gpu =
                    squeezed.contains("feature=\"cuda\"") || squeezed.contains("feature=\"nccl\"");
                if gpu && (in_studio || squeezed.contains("feature=\"gui\"")) {
                    hits.push(format!("{}:{}: {}", file.display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        hits.is_empty(),
        "cuda/nccl code only the studio build compiles (CI type-checks the headless one):\n{}",
        hits.join("\n")
    );
}

/// A dependency's spec as a table (`"1"` is `{ version = "1" }`), without `optional`.
fn dependency_spec(spec: &toml::Value) -> toml::value::Table {
    let mut table = match spec {
        toml::Value::String(version) => {
            toml::value::Table::from_iter([("version".to_string(), version.clone().into())])
        }
        toml::Value::Table(table) => table.clone(),
        other => panic!("not a dependency spec: {other}"),
    };
    table.remove("optional");
    table
}

/// Why the headless tests cost CI little: every dependency the `gui` feature enables is also a
/// dev-dependency with the same spec, so a headless test build resolves every crate with the
/// default build's features and reuses its compiled dependencies (Cargo.toml says what a
/// mismatch cost). A new studio dependency, or a changed feature list, must be mirrored.
#[test]
fn every_gui_dependency_is_mirrored_as_a_dev_dependency_with_the_same_spec() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let manifest: toml::Table = std::fs::read_to_string(&path).unwrap().parse().unwrap();
    let gui = manifest["features"]["gui"]
        .as_array()
        .expect("a `gui` feature");
    let names: Vec<&str> = gui
        .iter()
        .filter_map(|f| f.as_str()?.strip_prefix("dep:"))
        .collect();
    assert!(names.contains(&"eframe"), "gui = {gui:?}");
    let mut wrong = Vec::new();
    for name in names {
        let normal = dependency_spec(&manifest["dependencies"][name]);
        match manifest["dev-dependencies"].get(name) {
            Some(dev) if dependency_spec(dev) == normal => {}
            Some(dev) => wrong.push(format!("{name}: dev {dev} ≠ {normal}")),
            None => wrong.push(format!("{name}: not in [dev-dependencies] (want {normal})")),
        }
    }
    assert!(
        wrong.is_empty(),
        "[dev-dependencies] must repeat the `gui` feature's dependencies:\n{}",
        wrong.join("\n")
    );
}

/// The headless binary started without a subcommand (the studio's way in) says in one line
/// that this build has no studio and where to look, instead of a panic or a silent exit.
#[cfg(not(feature = "gui"))]
#[test]
fn the_headless_binary_without_a_subcommand_says_it_has_no_studio() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .output()
        .expect("start tunestudio");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("this build has no GUI"), "{stderr}");
    assert!(stderr.contains("--help"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}
