//! Semantic checks of a [`RunConfig`]: every problem is collected, by field name; and the
//! readers that report them beside the type errors, all at once ([`RunConfig::load`],
//! [`RunConfig::from_toml_str`]).
//!
//! The config's types and their parsing (`train/config.rs`) know nothing of the checks: this
//! module sits above them (`config ← validate`), so the two do not import each other.

use std::path::{Path, PathBuf};

use super::config::{InitMode, ModelDtype, RunConfig};
use super::error::{ConfigError, ConfigProblem};
use crate::settings::{ShardMode, Strategy};

impl RunConfig {
    /// Reads, parses and validates a run config; relative paths in it resolve
    /// against the file's folder. Every problem is reported at once.
    pub fn load(path: &Path) -> Result<RunConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
            path: path.to_path_buf(),
            cause,
        })?;
        let base_dir = path
            .parent()
            .map(Path::to_path_buf)
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or_else(|| PathBuf::from("."));
        let origin = path.display().to_string();
        let (config, mut problems) = RunConfig::parse_unchecked(&text, &origin, base_dir)?;
        problems.extend(config.validate());
        if problems.is_empty() {
            Ok(config)
        } else {
            Err(ConfigError::Invalid { origin, problems })
        }
    }

    /// Parses a config from TOML text without the semantic checks of [`RunConfig::validate`]
    /// (type errors, unknown keys and unknown enum values are still reported, all at once, with
    /// the semantic problems beside them).
    pub fn from_toml_str(text: &str, base_dir: &Path) -> Result<RunConfig, ConfigError> {
        let origin = "<text>";
        let (config, mut problems) =
            RunConfig::parse_unchecked(text, origin, base_dir.to_path_buf())?;
        if problems.is_empty() {
            return Ok(config);
        }
        problems.extend(config.validate());
        Err(ConfigError::Invalid {
            origin: origin.to_string(),
            problems,
        })
    }

    /// Semantic checks of every field; an empty list means the config is usable.
    /// Includes file-system checks (model folder present, output folder writable).
    pub fn validate(&self) -> Vec<ConfigProblem> {
        validate(self)
    }
}

/// Every problem of `config` (empty = usable).
pub fn validate(config: &RunConfig) -> Vec<ConfigProblem> {
    let mut p = Vec::new();
    model_problems(config, &mut p);
    p.extend(config.training.problems());
    lora_problems(config, &mut p);
    data_problems(config, &mut p);
    // [checkpoint] / [eval] have no invalid values (0 = off / keep all) beyond their types.
    devices_problems(config, &mut p);
    preference_problems(config, &mut p);
    grpo_problems(config, &mut p);
    output_dir_problems(config, &mut p);
    p
}

/// `[training] method` and `[preference]`: the settings a preference run reads, and which
/// reference fits the run (`adapter-disabled` needs LoRA; `copy` is for full fine-tuning).
fn preference_problems(config: &RunConfig, p: &mut Vec<ConfigProblem>) {
    use super::config::{DpoLoss, ReferenceMode, TrainingMethod};
    let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
    let method = config.training.method;
    if !method.is_preference() {
        return;
    }
    let pref = &config.preference;
    if !(pref.beta > 0.0 && pref.beta.is_finite()) {
        bad(
            "preference.beta",
            format!("must be > 0 (got {}); TRL's default is 0.1", pref.beta),
        );
    }
    if !(0.0..0.5).contains(&pref.label_smoothing) {
        bad(
            "preference.label_smoothing",
            format!("must be in [0, 0.5) (got {})", pref.label_smoothing),
        );
    }
    if pref.max_prompt_length == 0 || pref.max_completion_length == 0 {
        bad(
            "preference.max_prompt_length",
            "the prompt and completion lengths must be ≥ 1".into(),
        );
    }
    if method == TrainingMethod::Orpo
        && (pref.loss != DpoLoss::Sigmoid || pref.label_smoothing != 0.0)
    {
        bad(
            "preference.loss",
            "ORPO has its own loss: `loss` and `label_smoothing` are DPO's; remove them or set training.method = \"dpo\"".into(),
        );
    }
    let lora = config.lora.enabled;
    if pref.reference == ReferenceMode::AdapterDisabled && !lora {
        bad(
            "preference.reference",
            "`adapter-disabled` takes the base with the LoRA adapters switched off as the reference, and this run has no adapters; set [lora] enabled = true, or with full fine-tuning use \"copy\" (a frozen copy of the starting weights) or \"precomputed\" (the reference log-probabilities computed once before the first step)".into(),
        );
    }
    if pref.reference == ReferenceMode::Copy && lora {
        bad(
            "preference.reference",
            "`copy` holds a second copy of the weights, which LoRA does not need: the base with the adapters switched off is the reference; use \"adapter-disabled\" or \"precomputed\"".into(),
        );
    }
    if config.data.packing {
        bad(
            "data.packing",
            "preference pairs are not packed; set packing = false".into(),
        );
    }
}

/// `[grpo]`: the settings a GRPO run reads (TRL's ranges) and its reward functions.
fn grpo_problems(config: &RunConfig, p: &mut Vec<ConfigProblem>) {
    if !config.training.method.is_grpo() {
        return;
    }
    p.extend(config.grpo.problems());
    if config.data.packing {
        p.push(ConfigProblem::new(
            "data.packing",
            "GRPO prompts are not packed; set packing = false",
        ));
    }
}

/// `[model]`: the source is a model folder or a hub id; the dtype matches the precision.
fn model_problems(config: &RunConfig, p: &mut Vec<ConfigProblem>) {
    let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
    let src = config.model.source.trim();
    if src.is_empty() {
        bad(
            "model.source",
            "is empty; give a model folder (with config.json) or a hub id such as `HuggingFaceTB/SmolLM2-135M`".into(),
        );
    } else {
        let local = config.resolve_path(Path::new(src));
        if local.is_dir() {
            if !local.join("config.json").is_file() {
                bad(
                    "model.source",
                    format!("the folder `{}` has no config.json; point it at a Hugging Face model folder", local.display()),
                );
            } else if config.model.init == InitMode::Pretrained && !has_safetensors(&local) {
                bad(
                    "model.init",
                    format!("is `pretrained` but `{}` has no *.safetensors weights; use `init = \"random\"` or add the weights", local.display()),
                );
            }
        } else if looks_like_path(src) {
            bad(
                "model.source",
                format!("no folder `{}` (relative paths start at the config file's folder); fix the path or give a hub id `org/name`", local.display()),
            );
        } else if !is_hub_id(src) {
            bad(
                "model.source",
                format!("`{src}` is neither a folder nor a hub id of the form `org/name`"),
            );
        }
    }
    let precision = config.training.precision;
    if let Some(dtype) = config.model.dtype.to_dtype() {
        if dtype != precision.compute_dtype() {
            bad(
                "model.dtype",
                format!(
                    "`{}` does not match `training.precision = \"{}\"` (which computes in {:?}); remove `dtype` or set it to `auto`",
                    dtype_name(config.model.dtype),
                    precision,
                    precision.compute_dtype()
                ),
            );
        }
    }
    if config.model.quantize.is_on() && !config.lora.enabled {
        bad(
            "model.quantize",
            format!(
                "is `{}` but `[lora] enabled` is false: a quantized base is frozen, so it trains only LoRA adapters (QLoRA); set `lora.enabled = true` or `quantize = \"none\"`",
                config.model.quantize
            ),
        );
    }
}

/// `[lora]` (when enabled): rank, alpha, dropout and target modules.
fn lora_problems(config: &RunConfig, p: &mut Vec<ConfigProblem>) {
    let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
    let l = &config.lora;
    if l.enabled {
        if l.r < 1 {
            bad("lora.r", format!("must be ≥ 1 (got {})", l.r));
        }
        if !(l.alpha.is_finite() && l.alpha > 0.0) {
            bad("lora.alpha", format!("must be > 0 (got {})", l.alpha));
        }
        if !(0.0..1.0).contains(&l.dropout) {
            bad(
                "lora.dropout",
                format!("must be in [0, 1) (got {})", l.dropout),
            );
        }
        if l.target_modules.is_empty() {
            bad(
                "lora.target_modules",
                "is empty; list linear layers such as [\"q_proj\", \"v_proj\"]".into(),
            );
        }
    }
}

/// `[data]`: the data module checks its own ranges; its message names the setting.
fn data_problems(config: &RunConfig, p: &mut Vec<ConfigProblem>) {
    let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
    if let Err(e) = config.data.validate() {
        match &e {
            crate::data::DataError::Config { setting, message } => bad(setting, message.clone()),
            other => bad("data", other.to_string()),
        }
    }
}

/// `[devices]`: device names, and a strategy that matches their count.
fn devices_problems(config: &RunConfig, p: &mut Vec<ConfigProblem>) {
    let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
    let d = &config.devices;
    if d.devices.is_empty() {
        bad(
            "devices.devices",
            "is empty; use [\"cpu\"] or [\"cuda:0\", ...]".into(),
        );
    }
    for (i, dev) in d.devices.iter().enumerate() {
        if !is_device_name(dev) {
            bad(
                &format!("devices.devices[{i}]"),
                format!("`{dev}` is not a device name; use `cpu`, `cpu:N` (logical CPU device), `cuda:N`, `cuda:N=80GiB` or `metal:N`"),
            );
        }
    }
    // An unknown strategy is a parse error (`[devices] strategy` is a `Strategy`), reported
    // with the accepted names before validation runs.
    if d.strategy == Strategy::Single && d.devices.len() > 1 {
        bad(
            "devices.strategy",
            format!(
                "is `single` but {} devices are listed; use `layer-split` or `data-parallel`, or list one device",
                d.devices.len()
            ),
        );
    }
    // ZeRO-3 gathers a layer at a time: GRPO's rollouts would need the whole model on every
    // rank at each token, and a quantized base is not divided. Refused by name rather than
    // run as something else.
    if d.strategy == Strategy::Sharded && d.shard == ShardMode::Everything {
        if config.training.method.is_grpo() {
            bad(
                "devices.shard",
                "`everything` (ZeRO-3) does not run GRPO: its rollouts generate from the whole model; use `gradients-and-optimizer` (ZeRO-2)".into(),
            );
        }
        if config.model.quantize.is_on() {
            bad(
                "devices.shard",
                "`everything` (ZeRO-3) does not divide a quantized base (`model.quantize`); use `gradients-and-optimizer` (ZeRO-2), whose QLoRA keeps the 4-bit base whole on every rank".into(),
            );
        }
    }
}

/// `output_dir`: set, and a folder that takes files (or can be created).
fn output_dir_problems(config: &RunConfig, p: &mut Vec<ConfigProblem>) {
    let mut bad = |field: &str, message: String| p.push(ConfigProblem::new(field, message));
    if config.output_dir.as_os_str().is_empty() {
        bad(
            "output_dir",
            "is empty; give a folder for checkpoints and metrics".into(),
        );
    } else if let Err(msg) = check_writable(&config.output_path()) {
        bad("output_dir", msg);
    }
}

fn dtype_name(d: ModelDtype) -> &'static str {
    match d {
        ModelDtype::Auto => "auto",
        ModelDtype::F32 => "f32",
        ModelDtype::Bf16 => "bf16",
        ModelDtype::F16 => "f16",
    }
}

fn has_safetensors(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        })
        .unwrap_or(false)
}

fn looks_like_path(s: &str) -> bool {
    s.starts_with('.')
        || s.starts_with('/')
        || s.starts_with('~')
        || s.contains('\\')
        || s.matches('/').count() > 1
}

/// `org/name` with the characters the hub allows.
pub(crate) fn is_hub_id(s: &str) -> bool {
    let ok = |part: &str| {
        !part.is_empty()
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    match s.split_once('/') {
        Some((org, name)) => ok(org) && ok(name),
        None => ok(s),
    }
}

/// `cpu`, `cpu:N` (logical CPU device N), `cuda:N`, `metal:N`; `cpu:N` and `cuda:N` may carry
/// the memory to plan for (`cuda:0=80GiB`, the what-if form the planner reads).
fn is_device_name(s: &str) -> bool {
    let (name, size) = match s.split_once('=') {
        Some((n, size)) => (n, Some(size)),
        None => (s, None),
    };
    if size.is_some_and(|t| crate::plan::parse_bytes(t.trim()).is_err()) {
        return false;
    }
    match name.split_once(':') {
        Some(("cpu" | "cuda", n)) => n.parse::<usize>().is_ok(),
        Some(("metal", n)) => size.is_none() && n.parse::<usize>().is_ok(),
        _ => size.is_none() && matches!(name, "cpu" | "cuda" | "metal"),
    }
}

/// Checks that `dir` exists and takes files, or that it can be created.
/// Uses a probe file because permission bits do not tell the whole story (read-only mounts, ACLs).
fn check_writable(dir: &Path) -> Result<(), String> {
    if dir.exists() {
        if !dir.is_dir() {
            return Err(format!(
                "`{}` exists and is not a folder; choose another output_dir",
                dir.display()
            ));
        }
        let probe = dir.join(format!(".tunestudio-write-test-{}", std::process::id()));
        return match std::fs::write(&probe, b"") {
            Ok(()) => {
                let _ = std::fs::remove_file(&probe);
                Ok(())
            }
            Err(e) => Err(format!(
                "cannot write into `{}` ({e}); choose a folder you can write to",
                dir.display()
            )),
        };
    }
    // Walk up to the first existing ancestor: it must be a writable folder.
    let mut ancestor = dir.parent();
    while let Some(a) = ancestor {
        if a.as_os_str().is_empty() {
            return check_writable(Path::new("."));
        }
        if a.exists() {
            if !a.is_dir() {
                return Err(format!(
                    "cannot create `{}`: `{}` is a file, not a folder; choose another output_dir",
                    dir.display(),
                    a.display()
                ));
            }
            return check_writable(a).map_err(|_| {
                format!(
                    "cannot create `{}`: `{}` is not writable; choose another output_dir",
                    dir.display(),
                    a.display()
                )
            });
        }
        ancestor = a.parent();
    }
    Err(format!(
        "cannot create `{}`; choose another output_dir",
        dir.display()
    ))
}
