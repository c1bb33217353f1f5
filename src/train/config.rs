//! The run config: everything a training run needs, as the TOML file the studio
//! saves and `tunestudio train --config run.toml` reads.
//!
//! Paths inside a config are relative to the folder of the config file
//! ([`RunConfig::base_dir`]); a config built in memory resolves them against the
//! current directory.

use crate::data::DataConfig;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use super::error::{ConfigError, ConfigProblem};
use crate::settings::{Quantization, ShardMode, Strategy};

mod grpo;
mod method;
mod probe;
mod training;

use probe::probe_and_strip;

pub use grpo::{GrpoLossType, GrpoSection, ScaleRewards};
pub use method::{DpoLoss, PreferenceSection, ReferenceMode, TrainingMethod};
pub use training::TrainingSection;

/// A complete training run description (`run.toml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Where checkpoints, `metrics.jsonl` and exports are written.
    pub output_dir: PathBuf,
    /// `[model]`: which model to fine-tune and how to initialise it.
    pub model: ModelSection,
    /// `[data]`: dataset, format, template and tokenisation (owned by [`crate::data`]).
    pub data: DataConfig,
    /// `[training]`: optimisation settings.
    pub training: TrainingSection,
    /// `[lora]`: low-rank adapters instead of full fine-tuning.
    pub lora: LoraSection,
    /// `[eval]`: evaluation on the validation split.
    pub eval: EvalSection,
    /// `[checkpoint]`: how often to save and how many to keep.
    pub checkpoint: CheckpointSection,
    /// `[devices]`: where to train.
    pub devices: DevicesSection,
    /// `[preference]`: the loss and reference of `training.method = "dpo"` or `"orpo"`.
    pub preference: PreferenceSection,
    /// `[grpo]`: sampling, rewards and the loss of `training.method = "grpo"`.
    pub grpo: GrpoSection,
    /// The folder relative paths are resolved against (the config file's folder).
    /// Not written to the file.
    #[serde(skip)]
    pub base_dir: PathBuf,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            output_dir: PathBuf::from("runs/run"),
            model: ModelSection::default(),
            data: DataConfig::default(),
            training: TrainingSection::default(),
            lora: LoraSection::default(),
            eval: EvalSection::default(),
            checkpoint: CheckpointSection::default(),
            devices: DevicesSection::default(),
            preference: PreferenceSection::default(),
            grpo: GrpoSection::default(),
            base_dir: PathBuf::new(),
        }
    }
}

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// A local Hugging Face model folder (relative to the config file) or a hub id (`org/name`).
    pub source: String,
    /// Compute dtype of the weights. `auto` follows `training.precision`
    /// (fp32 → f32, bf16 / bf16-mixed → bf16, fp16-mixed → f16).
    pub dtype: ModelDtype,
    /// `pretrained` loads the weights, `random` initialises from `training.seed`,
    /// `auto` loads the weights when the folder has any and initialises randomly otherwise.
    pub init: InitMode,
    /// QLoRA: store the frozen base linears quantized (`none`, `q8_0`, `q4_k`; needs
    /// `[lora] enabled`). See [`crate::settings::Quantization`].
    pub quantize: Quantization,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            source: String::new(),
            dtype: ModelDtype::Auto,
            init: InitMode::Auto,
            quantize: Quantization::None,
        }
    }
}

/// Weight dtype requested in `[model] dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum ModelDtype {
    /// Derived from the precision mode.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// 32-bit float.
    #[serde(rename = "f32")]
    F32,
    /// bfloat16.
    #[serde(rename = "bf16")]
    Bf16,
    /// IEEE half.
    #[serde(rename = "f16")]
    F16,
}

impl ModelDtype {
    /// The candle dtype, or `None` for `auto`.
    pub fn to_dtype(self) -> Option<candle_core::DType> {
        match self {
            ModelDtype::Auto => None,
            ModelDtype::F32 => Some(candle_core::DType::F32),
            ModelDtype::Bf16 => Some(candle_core::DType::BF16),
            ModelDtype::F16 => Some(candle_core::DType::F16),
        }
    }
}

/// How the model's weights are initialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum InitMode {
    /// Pretrained weights when the folder has safetensors files, random otherwise.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// Load the weights (an error when there are none).
    #[serde(rename = "pretrained")]
    Pretrained,
    /// Random initialisation from `training.seed` (the config's architecture only).
    #[serde(rename = "random")]
    Random,
}

impl RunConfig {
    /// Switches `[training] method` to `method`, leaving settings the new method would refuse
    /// at values it accepts: ORPO has its own loss, so DPO's `ipo` loss and label smoothing go
    /// back to `sigmoid` and 0 (the settings lint would stop the run otherwise).
    pub fn set_method(&mut self, method: TrainingMethod) {
        let before = self.training.method;
        self.training.method = method;
        if method == TrainingMethod::Orpo && before != TrainingMethod::Orpo {
            self.preference.loss = DpoLoss::Sigmoid;
            self.preference.label_smoothing = 0.0;
        }
    }
}

/// `[lora]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    /// Train low-rank adapters (base weights frozen) instead of every weight.
    pub enabled: bool,
    /// Adapter rank.
    pub r: usize,
    /// Scaling numerator (scale = alpha / r).
    pub alpha: f64,
    /// Dropout on the adapter input.
    pub dropout: f64,
    /// Linear layers to adapt, by their short name (`q_proj`, `v_proj`, ...).
    pub target_modules: Vec<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            enabled: false,
            r: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: crate::model::LINEAR_MODULES
                .iter()
                .map(|s| s.to_string())
                .collect(),
        }
    }
}

impl LoraSection {
    /// The model's LoRA settings.
    pub fn to_model_config(&self) -> crate::model::LoraConfig {
        crate::model::LoraConfig {
            r: self.r,
            alpha: self.alpha,
            dropout: self.dropout,
            target_modules: self.target_modules.clone(),
        }
    }
}

/// `[eval]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalSection {
    /// Evaluate every this many optimizer steps (and at the end); 0 = only at the end.
    pub eval_every: u64,
    /// Cap on validation micro-batches per evaluation; 0 = the whole split.
    pub max_batches: usize,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            eval_every: 50,
            max_batches: 0,
        }
    }
}

/// `[checkpoint]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointSection {
    /// Save every this many optimizer steps; 0 = only at the end.
    pub save_every: u64,
    /// Keep only the newest K checkpoints; 0 keeps all.
    pub keep_last: usize,
    /// Save a checkpoint when training completes.
    pub save_final: bool,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection {
            save_every: 100,
            keep_last: 2,
            save_final: true,
        }
    }
}

/// `[devices]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevicesSection {
    /// Devices to train on: `cpu`, `cuda:0`, `cuda:1`, ...
    pub devices: Vec<String>,
    /// `single`, `layer-split` (pipeline: layers spread over the devices), `data-parallel` or
    /// `sharded` (data parallel with the training state divided over the ranks).
    pub strategy: Strategy,
    /// Under `sharded`: `gradients-and-optimizer` (ZeRO-2) or `everything` (ZeRO-3).
    pub shard: ShardMode,
}

impl Default for DevicesSection {
    fn default() -> Self {
        DevicesSection {
            devices: vec!["cpu".to_string()],
            strategy: Strategy::Single,
            shard: ShardMode::default(),
        }
    }
}

/// The strategies `[devices] strategy` accepts.
pub const STRATEGIES: &[&str] = Strategy::NAMES;

/// Top-level keys of the run config, for error messages.
const SECTIONS: &[&str] = &[
    "output_dir",
    "model",
    "data",
    "training",
    "lora",
    "eval",
    "checkpoint",
    "devices",
    "preference",
    "grpo",
];

impl RunConfig {
    /// Data-parallel ranks of `[devices]` ([`crate::settings::Strategy::ranks`]).
    pub fn data_parallel_ranks(&self) -> usize {
        self.devices.strategy.ranks(self.devices.devices.len())
    }

    /// Samples per optimizer step over the run's data-parallel ranks
    /// ([`TrainingSection::effective_batch`]).
    pub fn effective_batch(&self) -> usize {
        self.training.effective_batch(self.data_parallel_ranks())
    }

    /// A config from a parsed TOML table, tolerantly: every key that does not deserialise
    /// (unknown, or of the wrong type) is left out, at its default, and returned as a problem
    /// instead of failing. No semantic checks. `tunestudio plan --config` reads configs this way.
    pub fn from_table_lenient(
        mut table: toml::Table,
        base_dir: &Path,
    ) -> (RunConfig, Vec<ConfigProblem>) {
        let mut problems = probe_and_strip(&mut table);
        let mut config: RunConfig = match toml::Value::Table(table).try_into() {
            Ok(c) => c,
            Err(e) => {
                // Unreachable in practice: every key left deserialised on its own.
                problems.push(ConfigProblem::new("<config>", e.message().to_string()));
                RunConfig::default()
            }
        };
        config.base_dir = base_dir.to_path_buf();
        (config, problems)
    }

    /// Parses `text` without the semantic checks: the config with every key that deserialised,
    /// and a problem for each key that did not (type errors, unknown keys, unknown enum
    /// values, all at once). A TOML syntax error is an error. The readers that validate too
    /// (`RunConfig::load`, `RunConfig::from_toml_str`) sit above, in `train/validate.rs`.
    pub(crate) fn parse_unchecked(
        text: &str,
        origin: &str,
        base_dir: PathBuf,
    ) -> Result<(RunConfig, Vec<ConfigProblem>), ConfigError> {
        let mut table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            origin: origin.to_string(),
            message: e.to_string(),
        })?;
        let mut problems = probe_and_strip(&mut table);
        // With the offending keys removed the rest deserialises, so semantic checks can
        // run on it too and the user sees every problem in one go.
        let mut config: RunConfig = match toml::Value::Table(table).try_into() {
            Ok(c) => c,
            Err(e) => {
                problems.push(ConfigProblem::new("<config>", e.message().to_string()));
                return Err(ConfigError::Invalid {
                    origin: origin.to_string(),
                    problems,
                });
            }
        };
        config.base_dir = base_dir;
        Ok((config, problems))
    }

    /// Writes the config as TOML (atomically: a temporary file renamed over `path`).
    pub fn save(&self, path: &Path) -> Result<(), ConfigError> {
        let text = self.to_toml_string()?;
        let tmp = path.with_extension("toml.tmp");
        let write_err = |cause| ConfigError::Write {
            path: path.to_path_buf(),
            cause,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(write_err)?;
        }
        std::fs::write(&tmp, text).map_err(write_err)?;
        std::fs::rename(&tmp, path).map_err(write_err)
    }

    /// The config as TOML text.
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        toml::to_string_pretty(self).map_err(|e| ConfigError::Serialize(e.to_string()))
    }

    /// A path from the config resolved against [`RunConfig::base_dir`].
    pub fn resolve_path(&self, p: &Path) -> PathBuf {
        if p.is_absolute() || self.base_dir.as_os_str().is_empty() {
            p.to_path_buf()
        } else {
            normalize(&self.base_dir.join(p))
        }
    }

    /// The output folder, resolved.
    pub fn output_path(&self) -> PathBuf {
        self.resolve_path(&self.output_dir)
    }

    /// `model.source` resolved: a local folder relative to the config file when one
    /// exists there, otherwise the text as given (a hub id or an absolute path).
    pub fn model_source(&self) -> String {
        let src = self.model.source.trim();
        let candidate = self.resolve_path(Path::new(src));
        if !src.is_empty() && candidate.is_dir() {
            candidate.display().to_string()
        } else {
            src.to_string()
        }
    }

    /// A data path from `[data]` resolved: relative to the config file when a file or
    /// folder exists there, otherwise as written (a hub dataset id).
    fn resolve_data_path(&self, p: &str) -> String {
        let candidate = self.resolve_path(Path::new(p));
        if !p.trim().is_empty() && candidate.exists() {
            candidate.display().to_string()
        } else {
            p.to_string()
        }
    }

    /// `[data]` with its paths resolved against the config file's folder.
    pub fn resolved_data(&self) -> DataConfig {
        let mut d = self.data.clone();
        d.path = self.resolve_data_path(&d.path);
        d.validation_path = d
            .validation_path
            .as_deref()
            .map(|p| self.resolve_data_path(p));
        d
    }

    /// A copy with every local path made absolute, so it can be saved anywhere
    /// (checkpoints keep such a copy as `run.toml`).
    pub fn with_absolute_paths(&self) -> RunConfig {
        let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
        let mut c = self.clone();
        c.output_dir = abs(self.output_path());
        let src = self.model_source();
        if Path::new(&src).is_dir() {
            c.model.source = abs(PathBuf::from(&src)).display().to_string();
        }
        let mut data = self.resolved_data();
        if Path::new(&data.path).exists() {
            data.path = abs(PathBuf::from(&data.path)).display().to_string();
        }
        if let Some(v) = data.validation_path.as_mut() {
            if Path::new(v.as_str()).exists() {
                *v = abs(PathBuf::from(v.as_str())).display().to_string();
            }
        }
        c.data = data;
        c
    }

    /// The precision mode's compute dtype, or the explicit `[model] dtype`.
    pub fn compute_dtype(&self) -> candle_core::DType {
        self.model
            .dtype
            .to_dtype()
            .unwrap_or_else(|| self.training.precision.compute_dtype())
    }
}

/// Removes `.` and folds `dir/..` lexically (`assets/../runs` → `runs`) so paths in messages
/// read naturally; a leading `..` is kept.
fn normalize(p: &Path) -> PathBuf {
    use std::path::Component;
    let mut out: Vec<Component<'_>> = Vec::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => match out.last() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                Some(Component::RootDir) | Some(Component::Prefix(_)) => {}
                _ => out.push(c),
            },
            other => out.push(other),
        }
    }
    if out.is_empty() {
        return PathBuf::from(".");
    }
    out.iter().collect()
}
