//! The docs name what exists (issue #56): every source path, module path and type that
//! `ARCHITECTURE.md` and `CODE_STYLE.md` name in backticks exists, and every relative link of
//! the Markdown pages (the README, those two, `docs/*.md`) points at a file, and at a heading
//! of it when the link names one. A failure names the doc, the line and what is missing.
//!
//! What counts as a name, in a backticked span outside fenced code blocks:
//! - a path: `src/…`, `tests/…`, `scripts/…`, `docs/…`, `assets/…`, `examples/…`, `.ci/…`
//!   (from the repository root), a module-relative path such as `train/render.rs` or
//!   `model/ops` (resolved under `src/`), or a bare `name.rs` (some file of that name under
//!   `src/` or `tests/`) or `NAME.md` (at the root or in `docs/`); `{a,b}` alternatives are
//!   each checked, `…` among them is skipped, and a span with a placeholder (`<panel>`), a
//!   glob (`*`) or a home or parent folder (`~/`, `../`) is not a repository path;
//! - a module path: `train::plan_request`, `crate::gui::tests::slow_disk` (its first segment
//!   a top-level module of the crate): each segment a module file, and the first one that is
//!   not must be a word of its parent module's file (an item or a re-export);
//! - a type: `PlanRequest`, `RunState::apply`, `Trainer::spawn_with(config, …)`: each
//!   CamelCase identifier a word of some source file under `src/`.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The docs whose backticked names are checked against the source.
const NAMING_DOCS: [&str; 2] = ["ARCHITECTURE.md", "CODE_STYLE.md"];

/// Folders of the repository a path may start from.
const REPO_DIRS: [&str; 7] = [
    "src/",
    "tests/",
    "scripts/",
    "docs/",
    "assets/",
    "examples/",
    ".ci/",
];

fn files_under(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            files_under(&p, ext, out);
        } else if p.extension().is_some_and(|x| x == ext) {
            out.push(p);
        }
    }
}

/// The lines of a Markdown text outside fenced code blocks, numbered from 1.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut in_fence = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if !in_fence {
            out.push((i + 1, line));
        }
    }
    out
}

/// The backticked spans of a line.
fn code_spans(line: &str) -> Vec<&str> {
    line.split('`').skip(1).step_by(2).collect()
}

/// `a/{b,c}.rs` as `a/b.rs` and `a/c.rs`; an alternative `…` (and more) is skipped.
fn expand(token: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (token.find('{'), token.find('}')) else {
        return vec![token.to_string()];
    };
    if close < open {
        return vec![token.to_string()];
    }
    let (head, tail) = (&token[..open], &token[close + 1..]);
    token[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|alt| !alt.is_empty() && !alt.contains('…'))
        .flat_map(|alt| expand(&format!("{head}{alt}{tail}")))
        .collect()
}

fn is_ident(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// Whether `token` names a file or folder of the repository (see the module doc).
fn is_path(token: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "_./{},-+…".contains(c);
    if token.is_empty() || !token.chars().all(allowed) || token.starts_with("../") {
        return false;
    }
    if REPO_DIRS.iter().any(|d| token.starts_with(d)) {
        return true;
    }
    if token.contains('/') {
        let with_suffix = [".rs", ".md", ".toml", ".sh", ".py", "/"]
            .iter()
            .any(|s| token.ends_with(s));
        // `model/ops`: identifiers, the first a folder of `src/`.
        let module_dir = token.split('/').all(is_ident)
            && token
                .split('/')
                .next()
                .is_some_and(|first| root().join("src").join(first).is_dir());
        return with_suffix || module_dir;
    }
    (token.ends_with(".rs") || token.ends_with(".md"))
        && token.chars().filter(|&c| c == '.').count() == 1
        && is_ident(token.trim_end_matches(".rs").trim_end_matches(".md"))
}

/// The first of `token`'s expansions that does not exist, if any.
fn missing_path(token: &str, sources: &[PathBuf]) -> Option<String> {
    for p in expand(token) {
        let in_folder = p.contains('/');
        let p = p.trim_end_matches('/');
        let found = if in_folder {
            root().join(p).exists() || root().join("src").join(p).exists()
        } else if p.ends_with(".md") {
            root().join(p).exists() || root().join("docs").join(p).exists()
        } else {
            sources
                .iter()
                .any(|s| s.file_name().is_some_and(|n| n == p))
        };
        if !found {
            return Some(p.to_string());
        }
    }
    None
}

/// The file of module `crate::{segments}`: `src/a/b.rs` or `src/a/b/mod.rs`.
fn module_file(segments: &[&str]) -> Option<PathBuf> {
    let base = root().join("src").join(segments.join("/"));
    [base.with_extension("rs"), base.join("mod.rs")]
        .into_iter()
        .find(|p| p.is_file())
}

/// Whether `word` occurs in `text` as a whole identifier.
fn has_word(text: &str, word: &str) -> bool {
    let is_id = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        !before.is_some_and(is_id) && !after.is_some_and(is_id)
    })
}

/// For a module path (`train::plan_request`, `crate::gui::tests::slow_disk`): `None` when it
/// is not one of the crate's (its first segment no top-level module), else the part that
/// does not exist, if any.
fn missing_module_item(token: &str) -> Option<Option<String>> {
    let t = token.strip_prefix("crate::").unwrap_or(token);
    let end = t
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(t.len());
    let segments: Vec<&str> = t[..end].split("::").collect();
    if segments.len() < 2
        || !segments.iter().all(|s| is_ident(s))
        || !segments[0].starts_with(|c: char| c.is_ascii_lowercase())
        || module_file(&segments[..1]).is_none()
    {
        return None;
    }
    let mut depth = 1;
    while depth < segments.len() {
        if module_file(&segments[..=depth]).is_some() {
            depth += 1;
            continue;
        }
        let parent = module_file(&segments[..depth]).expect("walked");
        let text = std::fs::read_to_string(&parent).unwrap();
        if !has_word(&text, segments[depth]) {
            return Some(Some(segments[..=depth].join("::")));
        }
        break;
    }
    Some(None)
}

/// The CamelCase identifiers of a type-like span (`RunState::apply`, `Placed`,
/// `Trainer::spawn_with(config, …)`); empty when the span is something else.
fn type_names(token: &str) -> Vec<&str> {
    let head = token.split(['(', ' ', '<', '{']).next().unwrap_or("");
    let parts: Vec<&str> = head.split("::").collect();
    let camel = |s: &str| {
        is_ident(s)
            && s.starts_with(|c: char| c.is_ascii_uppercase())
            && s.chars().any(|c| c.is_ascii_lowercase())
    };
    if parts.is_empty() || parts.len() > 2 || !camel(parts[0]) || !parts.iter().all(|p| is_ident(p))
    {
        return Vec::new();
    }
    parts.into_iter().filter(|p| camel(p)).collect()
}

#[test]
fn architecture_and_code_style_name_only_what_exists() {
    let mut sources = Vec::new();
    files_under(&root().join("src"), "rs", &mut sources);
    files_under(&root().join("tests"), "rs", &mut sources);
    let source_text: String = sources
        .iter()
        .filter(|p| p.starts_with(root().join("src")))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let mut bad = Vec::new();
    for doc in NAMING_DOCS {
        let text = std::fs::read_to_string(root().join(doc)).unwrap();
        for (line, prose) in prose_lines(&text) {
            for token in code_spans(prose) {
                if is_path(token) {
                    if let Some(p) = missing_path(token, &sources) {
                        bad.push(format!(
                            "{doc}:{line}: `{token}` names {p}, which does not exist"
                        ));
                    }
                } else if let Some(missing) = missing_module_item(token) {
                    if let Some(m) = missing {
                        bad.push(format!("{doc}:{line}: `{token}`: no {m} in src/"));
                    }
                } else {
                    for name in type_names(token) {
                        if !has_word(&source_text, name) {
                            bad.push(format!("{doc}:{line}: `{token}`: no {name} in src/"));
                        }
                    }
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "the docs name paths, modules or types that do not exist (fix the doc, or the name):\n{}",
        bad.join("\n")
    );
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings.
fn anchors(text: &str) -> Vec<String> {
    prose_lines(text)
        .into_iter()
        .filter_map(|(_, l)| l.strip_prefix('#'))
        .map(|h| anchor(h.trim_start_matches('#')))
        .collect()
}

/// The targets of a line's Markdown links (`[text](target)`, images included).
fn link_targets(line: &str) -> Vec<&str> {
    line.match_indices("](")
        .filter_map(|(i, _)| {
            let rest = &line[i + 2..];
            let end = rest.find(')')?;
            Some(rest[..end].split_whitespace().next().unwrap_or(""))
        })
        .collect()
}

#[test]
fn markdown_links_point_at_files_and_headings_that_exist() {
    let mut docs: Vec<PathBuf> = ["README.md", "ARCHITECTURE.md", "CODE_STYLE.md"]
        .iter()
        .map(|d| root().join(d))
        .collect();
    files_under(&root().join("docs"), "md", &mut docs);
    let mut bad = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        let name = doc.strip_prefix(root()).unwrap().display().to_string();
        for (line, prose) in prose_lines(&text) {
            for target in link_targets(prose) {
                if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, heading) = target.split_once('#').unwrap_or((target, ""));
                let path = if file.is_empty() {
                    doc.clone()
                } else {
                    doc.parent().unwrap().join(file)
                };
                if !path.exists() {
                    bad.push(format!("{name}:{line}: link to {target}: no file {file}"));
                } else if !heading.is_empty() && path.extension().is_some_and(|x| x == "md") {
                    let there = std::fs::read_to_string(&path).unwrap();
                    if !anchors(&there).iter().any(|a| a == heading) {
                        bad.push(format!(
                            "{name}:{line}: link to {target}: no heading #{heading}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "Markdown links that point nowhere:\n{}",
        bad.join("\n")
    );
}

/// The scanners themselves: what they must take as a name, and what they must leave alone.
#[test]
fn the_doc_scanners_tell_names_from_prose() {
    for t in [
        "src/plan/mod.rs",
        "tests/it/layering.rs",
        "train/render.rs",
        "gui/jobs/",
        "model/ops",
        "model/decoder/{layer,load,forward}.rs",
        "amx_tile.rs",
        "CODE_STYLE.md",
    ] {
        assert!(is_path(t), "not taken as a path: {t}");
    }
    for t in [
        "~/.cache/tunestudio/kernel-paths.json",
        "../shared",
        "<output>/metrics.jsonl",
        "gui/panels/<panel>.rs",
        "tests/*.rs",
        "run.toml",
        "HF_HOME/HF_HUB_CACHE",
        "bf16/f16",
        "tunestudio plan --config run.toml",
    ] {
        assert!(!is_path(t), "taken as a path: {t}");
    }
    assert_eq!(
        expand("train/step/{build,run,…}.rs"),
        ["train/step/build.rs", "train/step/run.rs"]
    );
    let sources = vec![root().join("src/model/ops/bf16_gemm/amx_tile.rs")];
    assert_eq!(missing_path("src/plan/mod.rs", &sources), None);
    assert_eq!(missing_path("gguf/", &sources), None);
    assert_eq!(missing_path("docs/", &sources), None);
    assert_eq!(missing_path("nowhere/", &sources), Some("nowhere".into()));
    assert_eq!(
        missing_path("model/decoder/{layer,gone}.rs", &sources),
        Some("model/decoder/gone.rs".into())
    );
    assert_eq!(missing_path("amx_tile.rs", &sources), None);
    assert_eq!(
        missing_path("amx_gemm_gone.rs", &sources),
        Some("amx_gemm_gone.rs".into())
    );

    assert_eq!(missing_module_item("train::plan_request"), Some(None));
    assert_eq!(
        missing_module_item("crate::gui::tests::slow_disk"),
        Some(None)
    );
    assert_eq!(
        missing_module_item("train::no_such_fn"),
        Some(Some("train::no_such_fn".into()))
    );
    assert_eq!(missing_module_item("candle_nn::VarBuilder"), None);
    assert_eq!(missing_module_item("tunestudio plan"), None);

    assert_eq!(type_names("RunState::apply"), ["RunState"]);
    assert_eq!(
        type_names("Trainer::spawn_with(config, waker)"),
        ["Trainer"]
    );
    assert_eq!(type_names("Action::Toast"), ["Action", "Toast"]);
    assert!(type_names("HF_TOKEN").is_empty());
    assert!(type_names("fp32").is_empty());

    assert!(has_word("pub fn plan_request(", "plan_request"));
    assert!(!has_word("pub fn local_plan_request(", "plan_request"));

    assert_eq!(
        anchor(" Against llama.cpp's own path"),
        "against-llamacpps-own-path"
    );
    assert_eq!(
        anchor("2026-12-04 — AMD EPYC (AVX2 + FMA only)"),
        "2026-12-04--amd-epyc-avx2--fma-only"
    );
    assert_eq!(
        link_targets("see [a](docs/a.md#x) and ![b](b.png \"t\")"),
        ["docs/a.md#x", "b.png"]
    );
    let fenced = "# Top\n```sh\n# not a heading [x](gone.md)\n```\n## Next";
    assert_eq!(anchors(fenced), ["top", "next"]);
}
