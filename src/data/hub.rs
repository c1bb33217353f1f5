//! Hugging Face hub repositories through the local HF cache
//! (`<cache>/datasets--org--name/snapshots/<rev>/`), downloading with
//! hf-hub only when the cache lacks them and `HF_HUB_OFFLINE` is not set; the endpoint, token
//! and cache are the environment's ([`crate::hub_env`]).

use crate::data::DataError;
use crate::hub_env::{HubEnv, HubError};
use std::path::{Path, PathBuf};

pub use crate::hub_env::{repo_cache_folder, RepoKind};

/// The HF hub cache folder: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (as huggingface_hub resolves it; [`HubEnv`] reads it for
/// models and datasets alike).
pub fn hub_cache_dir() -> PathBuf {
    HubEnv::from_env().cache_dir
}

/// Whether `HF_HUB_OFFLINE` asks for no network access.
pub fn hub_offline() -> bool {
    HubEnv::from_env().offline
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
    // A snapshot holds what was downloaded so far: a model's config.json without its
    // tokenizer, say, when that download was cut off. Only one with a wanted file is used.
    if let Some(snap) = cached_snapshot(cache_dir, kind, id, rev) {
        if has_wanted_file(&snap, &snap, wanted) {
            return Ok(snap);
        }
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

/// Whether any file under `dir` (named relative to `root`) is `wanted`.
fn has_wanted_file(root: &Path, dir: &Path, wanted: &dyn Fn(&str) -> bool) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let path = e.path();
        if path.is_dir() {
            return has_wanted_file(root, &path, wanted);
        }
        path.is_file()
            && path
                .strip_prefix(root)
                .is_ok_and(|rel| wanted(&rel.to_string_lossy().replace('\\', "/")))
    })
}

fn download(
    id: &str,
    rev: &str,
    kind: RepoKind,
    cache_dir: &Path,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<PathBuf, DataError> {
    let hub_err = |e: HubError| DataError::Hub {
        id: id.to_string(),
        message: e.to_string(),
    };
    let repo = HubEnv::from_env()
        .with_cache(cache_dir.to_path_buf(), false)
        .repo(kind, id, rev)
        .map_err(hub_err)?;
    let listed = repo.files().map_err(hub_err)?;
    let files: Vec<&String> = listed.iter().filter(|f| wanted(f)).collect();
    if files.is_empty() {
        return Err(DataError::Hub {
            id: id.to_string(),
            message: format!(
                "revision {rev} has no usable files (found: {})",
                listed.join(", ")
            ),
        });
    }
    let mut snapshot = None;
    for f in files {
        let local = repo.get(f).map_err(hub_err)?;
        // The snapshot folder is the file's path minus the repo-relative part.
        let depth = Path::new(f).components().count();
        let mut dir = local.clone();
        for _ in 0..depth {
            dir.pop();
        }
        snapshot = Some(dir);
    }
    snapshot.ok_or_else(|| DataError::Hub {
        id: id.to_string(),
        message: "nothing was downloaded".into(),
    })
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
