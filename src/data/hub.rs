//! Hugging Face hub repositories through the local HF cache
//! (`<cache>/datasets--org--name/snapshots/<rev>/`), downloading with
//! hf-hub only when the cache lacks them and `HF_HUB_OFFLINE` is not set.

use crate::data::DataError;
use std::path::{Path, PathBuf};

/// Which kind of hub repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoKind {
    /// `models--org--name`.
    Model,
    /// `datasets--org--name`.
    Dataset,
}

impl RepoKind {
    fn folder_prefix(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }
}

/// The HF hub cache folder: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (as huggingface_hub resolves it).
pub fn hub_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(home) = std::env::var_os("HF_HOME") {
        return PathBuf::from(home).join("hub");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache").join("huggingface").join("hub")
}

/// Whether `HF_HUB_OFFLINE` asks for no network access.
pub fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
        .unwrap_or(false)
}

/// Whether `s` has the shape of a hub id (`org/name` or `org/name@rev`,
/// no further slashes, no data-file extension).
pub fn looks_like_hub_id(s: &str) -> bool {
    let id = s.split('@').next().unwrap_or(s);
    let parts: Vec<&str> = id.split('/').collect();
    let ok_part = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let has_data_ext = [".json", ".jsonl", ".csv", ".parquet", ".txt"]
        .iter()
        .any(|e| id.to_ascii_lowercase().ends_with(e));
    parts.len() == 2 && parts.iter().all(|p| ok_part(p)) && !has_data_ext
}

/// Splits `org/name@rev` into the id and the revision (default `main`).
pub fn split_revision(s: &str) -> (&str, &str) {
    match s.split_once('@') {
        Some((id, rev)) if !rev.is_empty() => (id, rev),
        Some((id, _)) => (id, "main"),
        None => (s, "main"),
    }
}

/// The repository's folder in the cache: `<cache>/datasets--org--name`.
pub fn repo_cache_folder(cache_dir: &Path, kind: RepoKind, id: &str) -> PathBuf {
    cache_dir.join(format!(
        "{}--{}",
        kind.folder_prefix(),
        id.replace('/', "--")
    ))
}

/// The cached snapshot folder of `id` at `revision` (a branch/tag name
/// resolved through `refs/`, or a commit hash), if it is in the cache.
pub fn cached_snapshot(
    cache_dir: &Path,
    kind: RepoKind,
    id: &str,
    revision: &str,
) -> Option<PathBuf> {
    let repo = repo_cache_folder(cache_dir, kind, id);
    let direct = repo.join("snapshots").join(revision);
    if revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit()) && direct.is_dir() {
        return Some(direct);
    }
    let commit = std::fs::read_to_string(repo.join("refs").join(revision)).ok()?;
    let snap = repo.join("snapshots").join(commit.trim());
    snap.is_dir().then_some(snap)
}

/// Resolves `id_at_rev` to a local snapshot folder: the cache first; then,
/// unless `offline`, hf-hub downloads the files for which `wanted` is true.
pub fn resolve_repo(
    id_at_rev: &str,
    kind: RepoKind,
    cache_dir: &Path,
    offline: bool,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<PathBuf, DataError> {
    let (id, rev) = split_revision(id_at_rev);
    if let Some(snap) = cached_snapshot(cache_dir, kind, id, rev) {
        return Ok(snap);
    }
    let cli_kind = match kind {
        RepoKind::Model => "model",
        RepoKind::Dataset => "dataset",
    };
    if offline {
        return Err(DataError::Hub {
            id: id_at_rev.to_string(),
            message: format!(
                "not in the HF cache at {} and HF_HUB_OFFLINE is set; download it first (`huggingface-cli download --repo-type {cli_kind} {id} --revision {rev}`) or unset HF_HUB_OFFLINE",
                cache_dir.display()
            ),
        });
    }
    download(id, rev, kind, cache_dir, wanted)
}

fn download(
    id: &str,
    rev: &str,
    kind: RepoKind,
    cache_dir: &Path,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<PathBuf, DataError> {
    use hf_hub::{api::sync::ApiBuilder, Cache, Repo, RepoType};
    let hub_err = |message: String| DataError::Hub {
        id: id.to_string(),
        message,
    };
    let api = ApiBuilder::from_cache(Cache::new(cache_dir.to_path_buf()))
        .with_progress(false)
        .build()
        .map_err(|e| hub_err(format!("cannot start the hub client: {e}")))?;
    let repo_type = match kind {
        RepoKind::Model => RepoType::Model,
        RepoKind::Dataset => RepoType::Dataset,
    };
    let repo = api.repo(Repo::with_revision(
        id.to_string(),
        repo_type,
        rev.to_string(),
    ));
    let info = repo.info().map_err(|e| {
        hub_err(format!(
            "cannot list the repository (revision {rev}): {e}; check the id, your network, or HF_TOKEN for gated repositories"
        ))
    })?;
    let files: Vec<String> = info
        .siblings
        .iter()
        .map(|s| s.rfilename.clone())
        .filter(|f| wanted(f))
        .collect();
    if files.is_empty() {
        return Err(hub_err(format!(
            "revision {rev} has no usable files (found: {})",
            info.siblings
                .iter()
                .map(|s| s.rfilename.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mut snapshot = None;
    for f in &files {
        let local = repo
            .get(f)
            .map_err(|e| hub_err(format!("downloading {f} failed: {e}")))?;
        // The snapshot folder is the file's path minus the repo-relative part.
        let depth = Path::new(f).components().count();
        let mut dir = local.clone();
        for _ in 0..depth {
            dir.pop();
        }
        snapshot = Some(dir);
    }
    snapshot.ok_or_else(|| hub_err("nothing was downloaded".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_id_shapes() {
        assert!(looks_like_hub_id("tatsu-lab/alpaca"));
        assert!(looks_like_hub_id("org/name@v1.0"));
        assert!(!looks_like_hub_id("data/train.jsonl"));
        assert!(!looks_like_hub_id("a/b/c"));
        assert!(!looks_like_hub_id("single"));
        assert!(!looks_like_hub_id("../x"));
        assert_eq!(split_revision("a/b@dev"), ("a/b", "dev"));
        assert_eq!(split_revision("a/b"), ("a/b", "main"));
    }

    #[test]
    fn cache_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = repo_cache_folder(tmp.path(), RepoKind::Dataset, "org/name");
        assert!(repo.ends_with("datasets--org--name"));
        let sha = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(repo.join("snapshots").join(sha)).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs").join("main"), sha).unwrap();
        let snap = cached_snapshot(tmp.path(), RepoKind::Dataset, "org/name", "main").unwrap();
        assert!(snap.ends_with(sha));
        assert!(cached_snapshot(tmp.path(), RepoKind::Dataset, "org/name", sha).is_some());
        assert!(cached_snapshot(tmp.path(), RepoKind::Model, "org/name", "main").is_none());
        let err = resolve_repo("org/other", RepoKind::Dataset, tmp.path(), true, &|_| true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
    }
}
