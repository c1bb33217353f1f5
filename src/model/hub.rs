//! Finding a model's files: a local folder, or a Hugging Face hub id resolved
//! through the local HF cache (and downloaded with hf-hub unless offline).

use super::error::ModelError;
use crate::hub_env::{repo_cache_folder, HubEnv, HubError, RepoKind};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The files of one HF model folder.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFiles {
    /// The folder holding them.
    pub dir: PathBuf,
    /// `config.json`.
    pub config: PathBuf,
    /// `model.safetensors`, or every shard named by `model.safetensors.index.json`.
    pub weights: Vec<PathBuf>,
    /// `tokenizer.json`, if present.
    pub tokenizer: Option<PathBuf>,
    /// `tokenizer_config.json`, if present.
    pub tokenizer_config: Option<PathBuf>,
    /// `chat_template.jinja`, if present.
    pub chat_template: Option<PathBuf>,
}

/// Where and how hub ids are resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct HubOptions {
    /// The HF hub cache (`models--org--name/...` lives here).
    pub cache_dir: PathBuf,
    /// Never download (HF_HUB_OFFLINE=1).
    pub offline: bool,
}

impl HubOptions {
    /// The cache and offline mode of the environment, as [`HubEnv::from_env`] reads them for
    /// models and datasets alike: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`; offline when `HF_HUB_OFFLINE` is 1/true/yes/on.
    pub fn from_env() -> Self {
        let env = HubEnv::from_env();
        Self {
            cache_dir: env.cache_dir,
            offline: env.offline,
        }
    }
}

fn optional(dir: &Path, name: &str) -> Option<PathBuf> {
    let p = dir.join(name);
    p.is_file().then_some(p)
}

/// The shard files named by a `model.safetensors.index.json`, in first-seen order.
pub fn shards_from_index(index: &Path) -> Result<Vec<String>, ModelError> {
    let text = std::fs::read_to_string(index).map_err(|e| ModelError::io(index, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
        origin: index.display().to_string(),
        message: format!("not valid JSON: {e}"),
    })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Config {
            origin: index.display().to_string(),
            message: "`weight_map` object is missing".into(),
        })?;
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    for v in map.values() {
        let f = v.as_str().ok_or_else(|| ModelError::Config {
            origin: index.display().to_string(),
            message: "`weight_map` values must be file names".into(),
        })?;
        if seen.insert(f.to_string()) {
            files.push(f.to_string());
        }
    }
    Ok(files)
}

impl ModelFiles {
    /// The files of a local HF model folder; errors name the missing file.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let config = dir.join("config.json");
        if !config.is_file() {
            return Err(ModelError::MissingFile {
                path: config,
                hint: "a Hugging Face model folder needs config.json (is this the right folder?)"
                    .into(),
            });
        }
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let weights = if index.is_file() {
            let files = shards_from_index(&index)?;
            let mut paths = Vec::new();
            for f in files {
                let p = dir.join(&f);
                if !p.is_file() {
                    return Err(ModelError::MissingFile {
                        path: p,
                        hint: format!(
                            "{} names this shard; re-download the model",
                            index.display()
                        ),
                    });
                }
                paths.push(p);
            }
            paths
        } else if single.is_file() {
            vec![single]
        } else {
            return Err(ModelError::MissingFile {
                path: single,
                hint: "no model.safetensors or model.safetensors.index.json found (PyTorch .bin checkpoints are not supported: convert them to safetensors)".into(),
            });
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
            tokenizer: optional(dir, "tokenizer.json"),
            tokenizer_config: optional(dir, "tokenizer_config.json"),
            chat_template: optional(dir, "chat_template.jinja"),
        })
    }
}

/// Whether `source` looks like `org/name` (and not a path).
fn is_hub_id(source: &str) -> bool {
    let parts: Vec<&str> = source.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && *p != "."
                && *p != ".."
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
}

/// The snapshot folder of `repo_id` in an HF cache, if `refs/main` points at one.
pub fn cached_snapshot(cache_dir: &Path, repo_id: &str) -> Option<PathBuf> {
    let repo_dir = repo_cache_folder(cache_dir, RepoKind::Model, repo_id);
    let rev = std::fs::read_to_string(repo_dir.join("refs").join("main")).ok()?;
    let snap = repo_dir.join("snapshots").join(rev.trim());
    snap.join("config.json").is_file().then_some(snap)
}

/// Resolves a local folder or a hub id with the environment's HF settings.
pub fn resolve_model(source: &str) -> Result<ModelFiles, ModelError> {
    resolve_model_in(source, &HubOptions::from_env())
}

/// Where a model source's `config.json` is: a folder or a `.json` file (relative to
/// `base_dir`), or (through [`resolve_model`]) a hub id, downloaded unless cached. The planner
/// reads no files: its callers find the model's shape here.
pub fn model_config_path(source: &str, base_dir: &Path) -> Result<PathBuf, ModelError> {
    let p = Path::new(source);
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        base_dir.join(p)
    };
    if p.is_dir() {
        return Ok(p.join("config.json"));
    }
    if p.is_file() {
        return Ok(p);
    }
    Ok(resolve_model(source)?.config)
}

/// Resolves a local folder, else `org/name` in `opts.cache_dir`, else downloads it
/// (unless `opts.offline`).
pub fn resolve_model_in(source: &str, opts: &HubOptions) -> Result<ModelFiles, ModelError> {
    let local = Path::new(source);
    if local.is_dir() {
        return ModelFiles::from_dir(local);
    }
    if !is_hub_id(source) {
        return Err(ModelError::MissingFile {
            path: local.to_path_buf(),
            hint: "give an existing model folder or a Hugging Face id like `HuggingFaceTB/SmolLM2-135M`".into(),
        });
    }
    if let Some(snap) = cached_snapshot(&opts.cache_dir, source) {
        if let Ok(files) = ModelFiles::from_dir(&snap) {
            if files.tokenizer.is_some() || opts.offline {
                return Ok(files);
            }
            // A download cut off before the tokenizer leaves a snapshot without it: fetch what
            // is missing (cached files are not fetched again). A repository without a
            // tokenizer, or no network, leaves the cached files as they are.
            return Ok(download(source, opts).unwrap_or(files));
        }
    }
    if opts.offline {
        return Err(ModelError::HubOffline {
            model: source.to_string(),
            cache: opts.cache_dir.clone(),
        });
    }
    download(source, opts)
}

/// Downloads `repo_id` at `main` into `opts.cache_dir` with the environment's endpoint and
/// token (files already cached are not fetched again).
fn download(repo_id: &str, opts: &HubOptions) -> Result<ModelFiles, ModelError> {
    let env = HubEnv::from_env().with_cache(opts.cache_dir.clone(), opts.offline);
    let hub_err = |e: HubError| match e {
        HubError::Offline { cache, .. } => ModelError::HubOffline {
            model: repo_id.to_string(),
            cache,
        },
        other => ModelError::Hub(Box::new(other)),
    };
    let repo = env
        .repo(RepoKind::Model, repo_id, "main")
        .map_err(hub_err)?;
    let config = repo.get("config.json").map_err(hub_err)?;
    let dir = config
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| opts.cache_dir.clone());
    // Sharded checkpoints have an index; single-file ones do not (the hub answers 404).
    match repo
        .get_optional("model.safetensors.index.json")
        .map_err(hub_err)?
    {
        Some(index) => {
            for shard in shards_from_index(&index)? {
                repo.get(&shard).map_err(hub_err)?;
            }
        }
        None => {
            repo.get("model.safetensors").map_err(hub_err)?;
        }
    }
    // Tokenizer files are optional (some repos keep only weights); any other failure is not.
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        repo.get_optional(f).map_err(hub_err)?;
    }
    ModelFiles::from_dir(&dir)
}
