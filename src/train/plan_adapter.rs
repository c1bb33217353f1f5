//! The one adapter from a run config to the memory planner: [`plan_request`] is the only
//! place a [`RunConfig`] becomes a [`PlanRequest`].
//!
//! Every front end plans through it, so they plan the same run with the same defaults:
//! - `tunestudio plan --config run.toml` reads the file with [`read_run_config_leniently`]
//!   (unknown keys and common aliases are tolerated) and calls [`plan_request`];
//! - the trainer's pre-flight check, its layer split and its out-of-memory refit call
//!   [`local_plan_request`] (the model's `config.json` read from disk, bare `cuda:N` planned
//!   against the memory the driver reports);
//! - the studio calls [`plan_request`] with the model it has loaded and the devices of its
//!   inventory, and its "plan is stale" key is this function's output, compared with `==`.
//!
//! # Why it lives in `train`
//! The planner ([`crate::plan`]) is the lower layer and imports nothing from the trainer:
//! `settings ← plan ← train ← cli / gui` (checked by `tests/it/layering.rs`). [`RunConfig`]
//! is the trainer's type: it carries `[data]` ([`crate::data::DataConfig`]), the schedule,
//! checkpoints and their validation, none of which the planner needs; moving it under the
//! planner would drag all of that down with it. So the adapter sits beside the type it reads
//! and the arrow still points down (train → plan). The shared value types (`Precision`,
//! `Strategy`) live in [`crate::settings`], below both.
//!
//! # What the planner reads
//! The model's shape (`[model] source`, see [`plan_model`]); `[training] precision`,
//! `micro_batch`, `gradient_accumulation`, `activation_checkpointing`, `optimizer_offload`
//! and `method` (a preference step runs 2 × `micro_batch` rows cut at `[preference]
//! max_prompt_length + max_completion_length`, and its loss takes their full logits:
//! [`crate::plan::HeadLoss::FullLogits`]); `[data] max_length`; `[lora] enabled`, and when it is on `r`,
//! `target_modules` and `[model] quantize` (QLoRA: a quantized base exists only under LoRA); `[devices] devices` (see [`plan_devices`]), `strategy` and, under `sharded`, `shard`; and the
//! training-ops path (`TUNESTUDIO_OPS`). For the process's own terms ([`process_inputs`]): the
//! sizes on disk of the tokenizer, the dataset (`[data] path`, `validation_path`) and the
//! mapped weights (none under `[model] init = "random"`), and whether the run evaluates
//! (`[data] validation_ratio`). Nothing else changes memory: the learning
//! rate, schedule, seeds, evaluation and checkpoint settings, `[lora] alpha` (a scale) and
//! `[model] dtype` (implied by the precision; validation rejects a dtype that disagrees).
//! `tests/it/plan_request.rs` proves it, field by field.
//!
//! # How a new setting is added: the one place
//! 1. Add the field to its section of [`RunConfig`] (`train/config.rs`, with its default) and
//!    its range check to `train/validate.rs`.
//! 2. If it changes memory: add it to [`PlanRequest`], model it in the planner, and read it
//!    **here, in [`plan_request`]** — the only place. The CLI, the trainer's pre-flight and
//!    the studio pick it up from there; the studio's stale-plan key is derived from the
//!    request, so it follows without an edit (there is no hand-written key to forget).
//! 3. List it in `tests/it/plan_request.rs` as read or not read by the planner: that test
//!    fails for any run-config key it does not list.

use std::path::Path;

use crate::model::{ModelConfig, OpsMode, OptimizerOffload};
use crate::plan::{self, DeviceSpec, HeadLoss, LoraSpec, PlanError, PlanRequest};

use super::config::RunConfig;
use super::error::ConfigProblem;

/// The planner's request for `config`, planning `model` on `devices`: the one place a run
/// config becomes a [`PlanRequest`] (see the module doc). No file is read but the sizes of
/// the tokenizer, dataset and weight files ([`process_inputs`]), and no device (nor any
/// variable but `TUNESTUDIO_OPS`); values are passed on as they are, so the planner reports a
/// bad one (`micro_batch = 0`) by its setting's name.
pub fn plan_request(
    config: &RunConfig,
    model: ModelConfig,
    devices: Vec<DeviceSpec>,
) -> PlanRequest {
    let t = &config.training;
    // As in the trainer, `[lora]` applies only with `enabled = true`.
    let lora = config.lora.enabled.then(|| LoraSpec {
        r: config.lora.r,
        target_modules: config.lora.target_modules.clone(),
        quantize: config.model.quantize,
    });
    // A preference step (DPO, ORPO) runs each pair's chosen and rejected rows as one batch,
    // cut at the pair's prompt + completion lengths, and its loss holds the full logits of
    // every row (`model::preference::model_sequence_logps`), not the chunked SFT loss.
    // A GRPO micro-step runs `num_generations` rows per prompt, cut at the prompt + completion
    // lengths; its log-probabilities go through the SFT loss's chunked head op on the
    // completion positions (`model::grpo::model_completion_logps`), planned at full length.
    let head_loss = head_loss(config);
    PlanRequest {
        model,
        precision: t.precision,
        micro_batch: rows_per_sample(config) * t.micro_batch,
        gradient_accumulation: t.gradient_accumulation,
        seq_len: planned_seq_len(config),
        activation_checkpointing: t.activation_checkpointing,
        optimizer_offload: t.optimizer_offload == OptimizerOffload::Host,
        lora,
        strategy: config.devices.strategy,
        // Read under `sharded` only: another strategy divides nothing, so its plan (and the
        // studio's stale-plan key) does not follow the key.
        shard: if config.devices.strategy == crate::settings::Strategy::Sharded {
            config.devices.shard
        } else {
            crate::settings::ShardMode::default()
        },
        devices,
        ops: OpsMode::from_env().unwrap_or_default(),
        process: Some(process_inputs(config)),
        // The data is not read here: the callers that have tokenized it set the bound
        // (`samples::max_trained_tokens`).
        trained_tokens: None,
        head_loss,
        reference: plan_reference(config),
        // Read under GRPO only (no other method runs groups).
        generations_per_micro_step: config
            .training
            .method
            .is_grpo()
            .then_some(config.grpo.generations_per_micro_step)
            .flatten(),
        world: Default::default(),
    }
}

/// How the run's loss holds the head's logits, by `[training] method`.
pub(crate) fn head_loss(config: &RunConfig) -> HeadLoss {
    let method = config.training.method;
    if method.is_preference() {
        HeadLoss::FullLogits
    } else if method.is_grpo() {
        HeadLoss::Completions {
            generations: config.grpo.num_generations,
            completion_tokens: config.grpo.max_completion_length,
        }
    } else {
        HeadLoss::Chunked
    }
}

/// Rows a sample puts in a micro-batch ([`HeadLoss::rows_per_sample`]): `micro_batch` counts
/// samples (rows, pairs, prompts); the request, rows.
pub(crate) fn rows_per_sample(config: &RunConfig) -> usize {
    head_loss(config).rows_per_sample()
}

/// Tokens a row is cut at: `[data] max_length`, or for a preference pair its prompt plus
/// completion lengths (`[preference] max_prompt_length + max_completion_length`).
pub(crate) fn planned_seq_len(config: &RunConfig) -> usize {
    if config.training.method.is_preference() {
        let p = &config.preference;
        p.max_prompt_length + p.max_completion_length
    } else if config.training.method.is_grpo() {
        // Sized by the longest completion allowed: a long one will come (the memory that runs
        // out after a hundred steps elsewhere).
        config.grpo.max_prompt_length + config.grpo.max_completion_length
    } else {
        config.data.max_length
    }
}

/// The reference a DPO run holds or runs during its steps ([`crate::plan::ReferencePlan`]):
/// `[preference] reference` as the trainer resolves it (`train::preference::ReferenceSource`;
/// `auto` is precomputed, ORPO has none).
pub(crate) fn plan_reference(config: &RunConfig) -> crate::plan::ReferencePlan {
    use super::preference::ReferenceSource;
    if config.training.method.is_grpo() {
        return match super::grpo::GrpoReference::of(config) {
            super::grpo::GrpoReference::None => crate::plan::ReferencePlan::Stored,
            super::grpo::GrpoReference::AdapterDisabled => {
                crate::plan::ReferencePlan::AdapterDisabled
            }
            super::grpo::GrpoReference::Copy => crate::plan::ReferencePlan::Copy,
        };
    }
    if !config.training.method.is_preference() {
        return crate::plan::ReferencePlan::Stored;
    }
    match ReferenceSource::of(config) {
        ReferenceSource::None | ReferenceSource::Precomputed => crate::plan::ReferencePlan::Stored,
        ReferenceSource::AdapterDisabled => crate::plan::ReferencePlan::AdapterDisabled,
        ReferenceSource::Copy => crate::plan::ReferencePlan::Copy,
    }
}

/// What the run's process loads besides the model, for the planner's process terms
/// ([`crate::plan::ProcessInputs`]): the sizes on disk of the model's `tokenizer.json`, of the
/// dataset files and of the safetensors weights the loader maps (none for a random
/// initialisation), and whether the run evaluates. Only file sizes are read (a `stat` each; a
/// file that is not there counts 0). The studio sets `gui` itself.
pub fn process_inputs(config: &RunConfig) -> crate::plan::ProcessInputs {
    let base = if config.base_dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        config.base_dir.as_path()
    };
    let resolve = |p: &str| {
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            base.join(p)
        }
    };
    let model_dir = crate::model::model_config_path(config.model.source.trim(), base)
        .ok()
        .and_then(|c| c.parent().map(Path::to_path_buf));
    let tokenizer_file_bytes = model_dir
        .as_ref()
        .map_or(0, |d| file_bytes(&d.join("tokenizer.json")));
    let mapped_weights_bytes = match (config.model.init, &model_dir) {
        (super::config::InitMode::Random, _) | (_, None) => 0,
        (_, Some(d)) => files_bytes(d, "safetensors"),
    };
    let data = &config.data;
    let dataset_file_bytes = data_bytes(&resolve(&data.path))
        + data
            .validation_path
            .as_deref()
            .map_or(0, |v| data_bytes(&resolve(v)));
    crate::plan::ProcessInputs {
        tokenizer_file_bytes,
        dataset_file_bytes,
        mapped_weights_bytes,
        // The trainer evaluates at the end of every run with a validation split (and every
        // `eval_every` steps), so the split alone decides.
        evaluation: data.validation_ratio > 0.0 || data.validation_path.is_some(),
        gui: false,
        single_step: false,
    }
}

fn file_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| if m.is_file() { m.len() } else { 0 })
}

/// The bytes of the files in `dir` whose extension is `ext` (not recursive).
fn files_bytes(dir: &Path, ext: &str) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == ext))
            .map(|p| file_bytes(&p))
            .sum()
    })
}

/// A dataset's bytes: the file, or the files of a folder (not recursive); 0 for a hub id.
fn data_bytes(path: &Path) -> u64 {
    if path.is_dir() {
        std::fs::read_dir(path).map_or(0, |entries| {
            entries.flatten().map(|e| file_bytes(&e.path())).sum()
        })
    } else {
        file_bytes(path)
    }
}

/// The model shape `[model] source` names: a model folder, a `config.json` file (relative to
/// the config's folder) or a hub id in the local cache.
pub fn plan_model(config: &RunConfig) -> Result<ModelConfig, PlanError> {
    let source = config.model.source.trim();
    if source.is_empty() {
        return Err(PlanError::RunConfig {
            origin: "[model]".into(),
            message: "`source` is missing: set it to a model folder or hub id".into(),
        });
    }
    let base = if config.base_dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        config.base_dir.as_path()
    };
    Ok(ModelConfig::from_file(&crate::model::model_config_path(
        source, base,
    )?)?)
}

/// `[devices] devices` as the planner's devices: a bare `cuda:N` is planned against
/// `gpu_capacity(N)` (what the driver reports, see
/// [`crate::devices::DeviceInventory::gpu_capacity_bytes`]), `cuda:N=80GiB` against its size,
/// `cpu` against the host's memory.
pub fn plan_devices(
    config: &RunConfig,
    gpu_capacity: &dyn Fn(usize) -> Option<u64>,
) -> Result<Vec<DeviceSpec>, PlanError> {
    let machine = plan::MachineMemory {
        host_bytes: crate::devices::host_memory_bytes(),
        gpu_bytes: gpu_capacity,
    };
    plan::parse_devices_with(&config.devices.devices.join(","), &machine)
}

/// [`plan_request`] for this machine: the model read from disk ([`plan_model`]) and the devices
/// as the driver reports them ([`plan_devices`]). The trainer's pre-flight check, its layer
/// split and its out-of-memory refit use it.
pub fn local_plan_request(config: &RunConfig) -> Result<PlanRequest, PlanError> {
    let model = plan_model(config)?;
    let devices = plan_devices(config, &crate::devices::driver_gpu_capacity())?;
    Ok(plan_request(config, model, devices))
}

/// Aliases `tunestudio plan --config` accepts for run-config keys, as other tools spell them:
/// `(section, alias, key)`.
const KEY_ALIASES: &[(&str, &str, &str)] = &[
    ("model", "path", "source"),
    ("model", "id", "source"),
    ("model", "name", "source"),
    ("model", "config", "source"),
    ("data", "seq_len", "max_length"),
    ("data", "max_seq_len", "max_length"),
    ("data", "cutoff_len", "max_length"),
    ("data", "max_seq_length", "max_length"),
    ("training", "batch_size", "micro_batch"),
    ("training", "per_device_train_batch_size", "micro_batch"),
    (
        "training",
        "gradient_accumulation_steps",
        "gradient_accumulation",
    ),
    ("training", "accumulation", "gradient_accumulation"),
    (
        "training",
        "gradient_checkpointing",
        "activation_checkpointing",
    ),
    ("training", "checkpointing", "activation_checkpointing"),
    ("lora", "rank", "r"),
];

/// Reads a run config for planning, tolerantly: a config the trainer would reject for an
/// unrelated reason can still be planned. Keys other tools use for the planner's settings
/// (`seq_len`, `batch_size`, `gradient_checkpointing`, `rank`, ...) and the command line's
/// spellings of precision and strategy (`bf16_mixed`, `ddp`, ...) are accepted; keys that do
/// not deserialise (unknown, or of the wrong type) are left at their defaults and returned as
/// problems, for the caller to print. A TOML syntax error, or a precision or strategy that is
/// none of the known ones, is an error.
pub fn read_run_config_leniently(
    text: &str,
    origin: &str,
    base_dir: &Path,
) -> Result<(RunConfig, Vec<ConfigProblem>), PlanError> {
    let mut table: toml::Table = toml::from_str(text).map_err(|e| PlanError::RunConfig {
        origin: origin.to_string(),
        message: format!("{} (fix the TOML syntax)", e.message()),
    })?;
    for (section, alias, key) in KEY_ALIASES {
        if let Some(toml::Value::Table(t)) = table.get_mut(*section) {
            if !t.contains_key(*key) {
                if let Some(v) = t.remove(*alias) {
                    t.insert(key.to_string(), v);
                }
            }
        }
    }
    canonical_name::<crate::settings::Precision>(&mut table, "training", "precision", |p| {
        p.name()
    })?;
    canonical_name::<crate::settings::Strategy>(&mut table, "devices", "strategy", |s| s.as_str())?;
    Ok(RunConfig::from_table_lenient(table, base_dir))
}

/// Rewrites `[section] key`, when it is a string, to the config spelling of what it parses as.
fn canonical_name<T>(
    table: &mut toml::Table,
    section: &str,
    key: &str,
    name: fn(&T) -> &'static str,
) -> Result<(), PlanError>
where
    T: std::str::FromStr,
    PlanError: From<T::Err>,
{
    if let Some(toml::Value::Table(t)) = table.get_mut(section) {
        if let Some(toml::Value::String(s)) = t.get_mut(key) {
            let parsed: T = s.parse()?;
            *s = name(&parsed).to_string();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{Precision, Strategy};

    /// The studio's and the CLI's micro-batch unit is the one the plan counts samples in.
    #[test]
    fn every_method_names_its_micro_batch_in_the_plans_unit() {
        use crate::train::TrainingMethod;
        for method in [
            TrainingMethod::Sft,
            TrainingMethod::Dpo,
            TrainingMethod::Orpo,
            TrainingMethod::Grpo,
        ] {
            let mut config = RunConfig::default();
            config.training.method = method;
            assert_eq!(
                method.micro_batch_unit(),
                head_loss(&config).sample_unit(),
                "{method:?}"
            );
        }
    }

    #[test]
    fn lenient_reading_takes_aliases_and_leaves_out_what_it_cannot_read() {
        let text = r#"
            unknown_top = 1
            [model]
            path = "m"
            [data]
            seq_len = 512
            [training]
            precision = "bf16_mixed"
            batch_size = 4
            gradient_checkpointing = true
            learning_rate = "fast"
            [lora]
            rank = 16
            [devices]
            strategy = "ddp"
            [accelerate]
            mixed_precision = "bf16"
        "#;
        let (c, problems) = read_run_config_leniently(text, "run.toml", Path::new("/x")).unwrap();
        assert_eq!(c.model.source, "m");
        assert_eq!(c.data.max_length, 512);
        assert_eq!(c.training.precision, Precision::Bf16Mixed);
        assert_eq!(c.training.micro_batch, 4);
        assert!(c.training.activation_checkpointing);
        assert_eq!(
            c.training.learning_rate,
            RunConfig::default().training.learning_rate
        );
        assert_eq!(c.lora.r, 16);
        assert_eq!(c.devices.strategy, Strategy::DataParallel);
        assert_eq!(c.base_dir, Path::new("/x"));
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        for f in ["unknown_top", "training.learning_rate", "accelerate"] {
            assert!(fields.contains(&f), "{f} not in {fields:?}");
        }
    }

    #[test]
    fn the_strict_run_config_names_the_strategies_it_accepts() {
        let err = RunConfig::from_toml_str("[devices]\nstrategy = \"zero3\"\n", Path::new("."))
            .unwrap_err()
            .to_string();
        for part in [
            "devices.strategy",
            "zero3",
            "single",
            "layer-split",
            "data-parallel",
        ] {
            assert!(err.contains(part), "{part} not in: {err}");
        }
    }

    #[test]
    fn lenient_reading_still_rejects_an_unknown_precision_or_strategy() {
        let err =
            read_run_config_leniently("[training]\nprecision = \"fp8\"\n", "r", Path::new("."))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("training.precision") && err.contains("bf16-mixed"),
            "{err}"
        );
        let err =
            read_run_config_leniently("[devices]\nstrategy = \"zero3\"\n", "r", Path::new("."))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("devices.strategy") && err.contains("layer-split"),
            "{err}"
        );
    }
}
