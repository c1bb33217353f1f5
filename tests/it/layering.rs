//! The dependency arrow points one way: `settings ← plan ← train`. The planner must not
//! import the trainer (issue #21: `plan` used to take `Precision` from `train` while `train`
//! called the planner), and the shared settings types import neither.
//!
//! Reads the sources: any path through `crate::train` (or `super::…::train`, or a grouped
//! `crate::{…, train, …}`) in a file under `src/plan/` fails the test, naming file and line.

use std::path::{Path, PathBuf};

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

/// Every place in `text` that reaches module `module` of the crate root: `crate::module`,
/// `super::module` and `super::super::module` (from a nested file), and a grouped import
/// `crate::{…, module, …}` (one line or several). As `(line, excerpt)`.
fn reaches(text: &str, module: &str) -> Vec<(usize, String)> {
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    let excerpt = |at: usize| {
        let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
        text[start..end].trim().to_string()
    };
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut hits = Vec::new();
    for prefix in ["crate::", "super::super::", "super::"] {
        let needle = format!("{prefix}{module}");
        for (at, _) in text.match_indices(&needle) {
            let next = text[at + needle.len()..].chars().next();
            let prev = text[..at].chars().next_back();
            if !next.is_some_and(is_ident) && !prev.is_some_and(|c| is_ident(c) || c == ':') {
                hits.push((line_of(at), excerpt(at)));
            }
        }
        let group = format!("{prefix}{{");
        for (at, _) in text.match_indices(&group) {
            let body_start = at + group.len();
            // The matching brace (groups nest: `crate::{a::{b, c}, d}`).
            let mut depth = 1;
            let mut end = body_start;
            for (i, c) in text[body_start..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = body_start + i;
                    break;
                }
            }
            let body = &text[body_start..end];
            // Top-level items of the group: their first path segment.
            let mut depth = 0;
            let mut item_start = 0;
            let mut items = Vec::new();
            for (i, c) in body.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(&body[item_start..i]);
                        item_start = i + 1;
                    }
                    _ => {}
                }
            }
            items.push(&body[item_start..]);
            if items
                .iter()
                .any(|item| item.trim().split("::").next().map(str::trim) == Some(module))
            {
                hits.push((line_of(at), excerpt(at)));
            }
        }
    }
    hits.sort();
    hits.dedup();
    hits
}

fn violations(dir: &str, forbidden: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for file in rust_files(&root.join(dir)) {
        let text = std::fs::read_to_string(&file).unwrap();
        for module in forbidden {
            for (line, excerpt) in reaches(&text, module) {
                out.push(format!(
                    "{}:{line}: reaches `{module}`: {excerpt}",
                    file.strip_prefix(root).unwrap_or(&file).display()
                ));
            }
        }
    }
    out
}

#[test]
fn the_planner_imports_nothing_from_the_trainer() {
    let bad = violations("src/plan", &["train"]);
    assert!(
        bad.is_empty(),
        "src/plan/ must not depend on the trainer (settings ← plan ← train): move a shared type \
         to src/settings/, or the code that needs the run config to src/train/plan_adapter.rs\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_settings_import_neither_the_planner_nor_the_trainer() {
    let bad = violations("src/settings", &["train", "plan"]);
    assert!(
        bad.is_empty(),
        "src/settings/ sits below the planner and the trainer\n{}",
        bad.join("\n")
    );
}

/// The scanner itself: the spellings it must catch, and look-alikes it must not.
#[test]
fn the_scanner_catches_every_spelling() {
    for text in [
        "use crate::train::Precision;",
        "impl From<crate::train::UnknownPrecision> for X {}",
        "use super::super::train;",
        "use super::train::config;",
        "use crate::{model, train};",
        "use crate::{\n    model::ModelConfig,\n    train::{RunConfig, Precision},\n};",
        "let x = crate::train::plan_request(c);",
    ] {
        assert!(!reaches(text, "train").is_empty(), "missed: {text}");
    }
    for text in [
        "use crate::model::train_step;",
        "use crate::trainer::X;",
        "use crate::{model, plan::{train_like}};",
        "// the trainer (train/memory.rs) calls the planner",
        "use mycrate::train::X;",
    ] {
        assert!(reaches(text, "train").is_empty(), "false alarm: {text}");
    }
    assert_eq!(
        reaches("a\nb\nuse crate::{x,\n train};", "train")[0].0,
        3,
        "line of the group"
    );
}
