//! Where a model's shape comes from: the `config.json` a model source names.
//!
//! (A run config becomes a plan request in one place only, beside the run config's own type:
//! `train::plan_adapter`; the planner does not know the run config.)

use super::PlanError;
use std::path::{Path, PathBuf};

/// Where a model source's `config.json` is: a folder, a `.json` file, or (through
/// [`crate::model::resolve_model`]) a hub id already in the local cache.
pub fn model_config_path(source: &str, base_dir: &Path) -> Result<PathBuf, PlanError> {
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
    Ok(crate::model::resolve_model(source)?.config)
}
