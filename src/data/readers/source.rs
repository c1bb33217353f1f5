//! Where a dataset's files are: one file, a folder's data files (split by name, ignored files
//! skipped), or a hub dataset in the local cache.

use super::*;

/// The data files a source resolves to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvedSource {
    /// Training files (all data files when none is named for a split).
    pub train: Vec<PathBuf>,
    /// Files named `validation`/`valid`/`val`/`dev`/`eval` next to files
    /// named `train` (HF dataset repos' split naming).
    pub validation: Vec<PathBuf>,
    /// Files named `test` (not used for training).
    pub test: Vec<PathBuf>,
    /// `.txt` split mode resolved from `TxtSplit::Auto`.
    pub txt_per_file: bool,
}

/// Resolves a `data.path`: a local file, a folder (every data file in it,
/// recursively, sorted), or a hub dataset id through the HF cache at
/// `cache_dir` (downloading unless `offline`).
pub fn resolve_source(
    spec: &str,
    cache_dir: &Path,
    offline: bool,
) -> Result<ResolvedSource, DataError> {
    let p = Path::new(spec);
    if p.is_file() {
        if FileKind::of(p).is_none() {
            return Err(DataError::UnsupportedFile {
                path: p.to_path_buf(),
            });
        }
        return Ok(ResolvedSource {
            train: vec![p.to_path_buf()],
            ..Default::default()
        });
    }
    if p.is_dir() {
        return resolve_folder(p);
    }
    if hub::looks_like_hub_id(spec) {
        let wanted = |f: &str| FileKind::of(Path::new(f)).is_some() && !is_ignored_name(f);
        let snap = hub::resolve_repo(spec, RepoKind::Dataset, cache_dir, offline, &wanted)?;
        return resolve_folder(&snap);
    }
    Err(DataError::NotFound {
        path: spec.to_string(),
        hint: "no such file or folder, and not a hub dataset id (`org/name`); check `data.path`"
            .into(),
    })
}

/// Resolves with the default HF cache and `HF_HUB_OFFLINE`.
pub fn resolve_source_default(spec: &str) -> Result<ResolvedSource, DataError> {
    resolve_source(spec, &hub::hub_cache_dir(), hub::hub_offline())
}

fn is_ignored_name(rel: &str) -> bool {
    let name = Path::new(rel)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(rel);
    name.starts_with('.')
        || Path::new(rel)
            .components()
            .any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
        || name.eq_ignore_ascii_case("dataset_info.json")
        || name.eq_ignore_ascii_case("dataset_infos.json")
        || name.eq_ignore_ascii_case("state.json")
}

pub(super) fn resolve_folder(dir: &Path) -> Result<ResolvedSource, DataError> {
    let mut files = Vec::new();
    walk(dir, dir, &mut files)?;
    files.sort();
    if files.is_empty() {
        return Err(DataError::NoDataFiles {
            path: dir.to_path_buf(),
        });
    }
    let mut out = ResolvedSource::default();
    let mut untagged = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(dir)
            .unwrap_or(&f)
            .to_string_lossy()
            .to_lowercase();
        let words: Vec<&str> = rel
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        let has = |names: &[&str]| words.iter().any(|w| names.contains(w));
        if has(&["train"]) {
            out.train.push(f);
        } else if has(&["validation", "valid", "val", "dev", "eval"]) {
            out.validation.push(f);
        } else if has(&["test"]) {
            out.test.push(f);
        } else {
            untagged.push(f);
        }
    }
    if out.train.is_empty() {
        // No split naming: every file is training data.
        out.train = untagged;
        out.train.append(&mut out.validation);
        out.train.append(&mut out.test);
        out.train.sort();
    } else {
        out.train.append(&mut untagged);
    }
    out.txt_per_file = true;
    Ok(out)
}

fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let entries = std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let path = entry.path();
        let rel = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .to_string_lossy()
            .to_string();
        if is_ignored_name(&rel) {
            continue;
        }
        if path.is_dir() {
            walk(root, &path, out)?;
        } else if FileKind::of(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}
