//! Reading the settings the planner needs from a run config (`run.toml`).
//!
//! Tolerant on purpose: the planner reads only `[model] source`, `[data]
//! max_length`, a few `[training]` keys, `[lora]` and `[devices]`, ignores every
//! other key, and accepts common aliases, so a config that the trainer would
//! reject for an unrelated reason can still be planned.

use super::{
    parse_devices_with, DeviceSpec, LoraSpec, PlanError, PlanRequest, Precision, Strategy,
};
use crate::model::ModelConfig;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The planner-relevant subset of a run config; every field is optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct RunConfigSettings {
    /// `[model]`.
    pub model: ModelKeys,
    /// `[data]`.
    pub data: DataKeys,
    /// `[training]`.
    pub training: TrainingKeys,
    /// `[lora]`.
    pub lora: LoraKeys,
    /// `[devices]`.
    pub devices: DevicesKeys,
}

/// `[model]` keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ModelKeys {
    /// Model folder, `config.json` file, or hub id.
    #[serde(alias = "path", alias = "id", alias = "name", alias = "config")]
    pub source: Option<String>,
}

/// `[data]` keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct DataKeys {
    /// Tokens per row.
    #[serde(
        alias = "seq_len",
        alias = "max_seq_len",
        alias = "cutoff_len",
        alias = "max_seq_length"
    )]
    pub max_length: Option<usize>,
}

/// `[training]` keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct TrainingKeys {
    /// `fp32`, `bf16-mixed`, `bf16`, `fp16-mixed`.
    pub precision: Option<String>,
    /// Rows per micro-batch.
    #[serde(alias = "batch_size", alias = "per_device_train_batch_size")]
    pub micro_batch: Option<usize>,
    /// Micro-batches per optimizer step.
    #[serde(alias = "gradient_accumulation_steps", alias = "accumulation")]
    pub gradient_accumulation: Option<usize>,
    /// Recompute layers in backward.
    #[serde(alias = "gradient_checkpointing", alias = "checkpointing")]
    pub activation_checkpointing: Option<bool>,
    /// Where AdamW's state lives (`"none"` or `"host"`).
    pub optimizer_offload: Option<crate::model::OptimizerOffload>,
}

/// `[lora]` keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct LoraKeys {
    /// Whether LoRA is on (off unless `enabled = true`, as in the trainer).
    pub enabled: Option<bool>,
    /// Rank.
    #[serde(alias = "rank")]
    pub r: Option<usize>,
    /// Adapted layers.
    pub target_modules: Option<Vec<String>>,
}

/// `[devices]` keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct DevicesKeys {
    /// Device strings (`cpu`, `cuda:0=80GiB`, ...).
    pub devices: Option<Vec<String>>,
    /// `single`, `layer-split`, `data-parallel`.
    pub strategy: Option<String>,
}

impl RunConfigSettings {
    /// Parses the planner's subset of a run config's TOML text.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, PlanError> {
        toml::from_str(text).map_err(|e| PlanError::RunConfig {
            origin: origin.to_string(),
            message: format!("{} (fix the TOML syntax or the key's type)", e.message()),
        })
    }

    /// Reads a run config file.
    pub fn from_file(path: &Path) -> Result<Self, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|e| PlanError::RunConfig {
            origin: path.display().to_string(),
            message: format!("cannot read it: {e}"),
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }
}

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

/// Builds a plan request from a run config. `devices` overrides `[devices] devices`;
/// a bare `cuda:N` there is planned against `gpu_capacity(N)` (what the driver reports,
/// see `crate::devices::DeviceInventory::gpu_capacity_bytes`), `cuda:N=80GiB` against its size.
pub fn request_from_run_config(
    settings: &RunConfigSettings,
    base_dir: &Path,
    devices: Option<Vec<DeviceSpec>>,
    gpu_capacity: &dyn Fn(usize) -> Option<u64>,
) -> Result<PlanRequest, PlanError> {
    let source = settings
        .model
        .source
        .as_deref()
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| PlanError::RunConfig {
            origin: "[model]".into(),
            message: "`source` is missing: set it to a model folder or hub id".into(),
        })?;
    let model = ModelConfig::from_file(&model_config_path(source, base_dir)?)?;
    let t = &settings.training;
    let precision = match &t.precision {
        Some(p) => p.parse::<Precision>()?,
        None => Precision::Fp32,
    };
    let strategy = match &settings.devices.strategy {
        Some(s) => s.parse::<Strategy>()?,
        None => Strategy::Single,
    };
    let devices = match devices {
        Some(d) => d,
        None => {
            let list = settings
                .devices
                .devices
                .clone()
                .unwrap_or_else(|| vec!["cpu".to_string()]);
            parse_devices_with(&list.join(","), gpu_capacity)?
        }
    };
    // As in the trainer, `[lora]` only applies with `enabled = true`.
    let lora_on = settings.lora.enabled.unwrap_or(false);
    let lora = if lora_on {
        let mut spec = LoraSpec::all_linear(settings.lora.r.unwrap_or(8));
        if let Some(t) = &settings.lora.target_modules {
            spec.target_modules = t.clone();
        }
        Some(spec)
    } else {
        None
    };
    Ok(PlanRequest {
        model,
        precision,
        micro_batch: t.micro_batch.unwrap_or(1),
        gradient_accumulation: t.gradient_accumulation.unwrap_or(1),
        seq_len: settings.data.max_length.unwrap_or(2048),
        activation_checkpointing: t.activation_checkpointing.unwrap_or(false),
        optimizer_offload: t.optimizer_offload == Some(crate::model::OptimizerOffload::Host),
        lora,
        strategy,
        devices,
        ops: crate::model::OpsMode::from_env().unwrap_or_default(),
    })
}
