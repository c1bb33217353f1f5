//! Where a model's files are, found without reading its weights: a local folder (with or
//! without weights) or a hub id resolved through [`super::hub`].

use std::path::{Path, PathBuf};

use super::error::ModelError;

/// A model's folder, its `config.json`, and whether it has safetensors weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLocation {
    /// The folder (config, tokenizer, weights).
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config: PathBuf,
    /// Whether it holds safetensors weights (none: only a random initialisation can run).
    pub has_weights: bool,
}

/// Finds the model `source` names (a folder or a hub id) without reading its weights. A local
/// folder without weights needs only its `config.json` (a random initialisation);
/// [`super::resolve_model`] insists on weights, so it is only asked when there are some, or
/// for hub ids.
pub fn locate_model(source: &str) -> Result<ModelLocation, ModelError> {
    let local = Path::new(source);
    if local.is_dir() && !has_weights(local) {
        return Ok(ModelLocation {
            dir: local.to_path_buf(),
            config: local.join("config.json"),
            has_weights: false,
        });
    }
    let files = super::resolve_model(source)?;
    Ok(ModelLocation {
        has_weights: !files.weights.is_empty(),
        dir: files.dir,
        config: files.config,
    })
}

/// Whether a folder holds safetensors weights.
fn has_weights(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        })
        .unwrap_or(false)
}
