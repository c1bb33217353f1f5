//! The request `tunestudio plan` plans: a run config — the file given with `--config`, else
//! the run config's defaults — with the flags written into it, through the one adapter
//! (`train::plan_request`). The flags have no defaults of their own.

use anyhow::Context;
use std::path::Path;
use tunestudio::model::ModelConfig;
use tunestudio::plan::{self, PlanRequest};
use tunestudio::settings::Quantization;
use tunestudio::train::{self, RunConfig};

use super::PlanArgs;

/// The request for these arguments, with the run config read with `--config`.
pub(super) fn request_and_config(
    args: &PlanArgs,
) -> anyhow::Result<(PlanRequest, Option<RunConfig>)> {
    let gpu_capacity = tunestudio::devices::driver_gpu_capacity();
    let devices = match &args.devices {
        Some(d) => Some(plan::parse_devices_with(
            d,
            &plan::MachineMemory {
                host_bytes: tunestudio::devices::host_memory_bytes(),
                gpu_bytes: &gpu_capacity,
            },
        )?),
        None => None,
    };
    let file = match &args.config {
        Some(path) => Some(read_config(path, &args.set)?),
        None if !args.set.is_empty() => Some(read_sets_alone(&args.set)?),
        None => None,
    };
    let mut config = file.clone().unwrap_or_default();
    let file = file.filter(|_| args.config.is_some());
    let model = match (&args.model_config, &file) {
        (Some(m), _) => {
            ModelConfig::from_file(&tunestudio::model::model_config_path(m, Path::new("."))?)?
        }
        (None, Some(c)) => train::plan_model(c)?,
        // `--set model.source=…` without a run config.
        (None, None) if !config.model.source.trim().is_empty() => train::plan_model(&config)?,
        (None, None) => anyhow::bail!(
            "give the model: --model-config path/to/config.json (or a model folder), or --config run.toml"
        ),
    };
    apply_flags(&mut config, args)?;
    let devices = match devices {
        Some(d) => d,
        // The config's devices, or the run config's default (`cpu`: the host's memory).
        None => train::plan_devices(&config, &gpu_capacity)?,
    };
    let mut req = train::plan_request(&config, model, devices);
    if file.is_none() {
        // No run config, no process to plan: the training tensors only.
        req.process = None;
    }
    if let Some(o) = &args.ops {
        req.ops = o.parse()?;
    }
    // A dry run measures this process's resident set, so the data is not tokenized here a
    // second time: its plan counts every loss row (the upper bound).
    if file.is_some() && !args.dry_run {
        req.trained_tokens = data_trained_tokens(&config);
    }
    Ok((req, file.map(|_| config)))
}

/// The run config at `path`, read leniently (`train::read_run_config_leniently`), with the
/// `--set` keys written into it and a note for each key it leaves out.
fn read_config(path: &Path, sets: &[String]) -> anyhow::Result<RunConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the run config {}", path.display()))?;
    let base = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    read_with_sets(&text, &path.display().to_string(), base, sets)
}

/// The run config's defaults with the `--set` keys written into them (no `--config`).
fn read_sets_alone(sets: &[String]) -> anyhow::Result<RunConfig> {
    read_with_sets("", "--set", Path::new("."), sets)
}

/// `text` read leniently after each `--set KEY=VALUE` replaced (or added) its key. A key the
/// run config does not have, or a value of the wrong kind, is an error that names the `--set`;
/// what the file itself gets wrong stays a note, as without `--set`.
fn read_with_sets(
    text: &str,
    origin: &str,
    base: &Path,
    sets: &[String],
) -> anyhow::Result<RunConfig> {
    let mut table: toml::Table = toml::from_str(text)
        .with_context(|| format!("{origin} is not valid TOML (fix the syntax)"))?;
    let mut keys = Vec::with_capacity(sets.len());
    for set in sets {
        keys.push(set_key(&mut table, set)?);
    }
    let text = toml::to_string(&table)?;
    let (config, ignored) = train::read_run_config_leniently(&text, origin, base)?;
    for p in &ignored {
        match keys.iter().find(|(key, _)| p.field == *key) {
            Some((_, set)) => {
                anyhow::bail!("--set {set}: {p} (the run config's keys: docs/run-config.md)")
            }
            None => eprintln!("note: {origin} ignores {p}"),
        }
    }
    Ok(config)
}

/// Writes one `--set section.key=value` into `table`: the value as TOML (`8`, `true`, `0.5`,
/// `"text"`, `[1, 2]`), or as a string when it is not TOML (`host`). Returns the dotted key and
/// the `--set` itself.
fn set_key(table: &mut toml::Table, set: &str) -> anyhow::Result<(String, String)> {
    let Some((key, value)) = set.split_once('=') else {
        anyhow::bail!("--set {set}: write it as KEY=VALUE, e.g. --set grpo.num_generations=8");
    };
    let key = key.trim();
    let value = value.trim();
    let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    let path: Vec<&str> = key.split('.').collect();
    let Some((last, sections)) = path.split_last().filter(|_| !key.is_empty()) else {
        anyhow::bail!("--set {set}: the key is empty (e.g. --set training.micro_batch=2)");
    };
    let mut at = table;
    for section in sections {
        let entry = at
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        at = match entry {
            toml::Value::Table(t) => t,
            _ => anyhow::bail!("--set {set}: `{section}` is a value, not a section"),
        };
    }
    at.insert(last.to_string(), parsed);
    Ok((key.to_string(), set.to_string()))
}

/// Writes the settings flags into `config` (each replaces the config's value).
fn apply_flags(config: &mut RunConfig, args: &PlanArgs) -> anyhow::Result<()> {
    let t = &mut config.training;
    if let Some(p) = &args.precision {
        t.precision = p.parse()?;
    }
    if let Some(v) = args.micro_batch {
        t.micro_batch = v;
    }
    if let Some(v) = args.accumulation {
        t.gradient_accumulation = v;
    }
    if args.checkpointing {
        t.activation_checkpointing = true;
    }
    if args.optimizer_offload {
        t.optimizer_offload = tunestudio::model::OptimizerOffload::Host;
    }
    if let Some(v) = args.seq_len {
        train::apply_plan::set_seq_len(config, v);
    }
    if let Some(s) = &args.strategy {
        config.devices.strategy = s.parse()?;
    }
    apply_shard_flag(config, args)?;
    apply_lora_flags(config, args)
}

/// `--shard`: what sharded data parallel divides; it implies `--strategy sharded`, and another
/// `--strategy` with it is a mistake.
fn apply_shard_flag(config: &mut RunConfig, args: &PlanArgs) -> anyhow::Result<()> {
    let Some(mode) = &args.shard else {
        return Ok(());
    };
    let sharded = tunestudio::settings::Strategy::Sharded;
    if args.strategy.is_some() && config.devices.strategy != sharded {
        anyhow::bail!(
            "--shard {mode} divides the training state of sharded data parallel, but --strategy is {}: use --strategy sharded, or leave --shard out",
            config.devices.strategy
        );
    }
    config.devices.shard = mode.parse().map_err(plan::PlanError::from)?;
    config.devices.strategy = sharded;
    Ok(())
}

/// `--lora-r`, `--lora-targets` (every linear layer by default) and `--quantize` (QLoRA: only
/// under LoRA).
fn apply_lora_flags(config: &mut RunConfig, args: &PlanArgs) -> anyhow::Result<()> {
    if let Some(r) = args.lora_r {
        config.lora.enabled = true;
        config.lora.r = r;
        config.lora.target_modules = match &args.lora_targets {
            Some(t) => t
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            None => plan::LoraSpec::all_linear(r).target_modules,
        };
        config.model.quantize = Quantization::None;
    } else if args.lora_targets.is_some() {
        anyhow::bail!("--lora-targets needs --lora-r (the adapter rank)");
    }
    if let Some(q) = &args.quantize {
        let q: Quantization = q.parse()?;
        if q.is_on() && !config.lora.enabled {
            anyhow::bail!(
                "--quantize {q} needs LoRA (a quantized base is frozen): add --lora-r 16"
            );
        }
        config.model.quantize = q;
    }
    Ok(())
}

/// The trained tokens of the run's data, for the loss's rows (`PlanRequest::trained_tokens`):
/// the dataset tokenized as the trainer will (a flag's micro-batch or shorter sequence length
/// applies to the counts). `None`, with a note, when it cannot be read: the plan then counts
/// every position.
fn data_trained_tokens(config: &RunConfig) -> Option<plan::TrainedTokens> {
    match train::samples::trained_tokens(config) {
        Ok(t) => t,
        Err(e) => {
            eprintln!(
                "note: the loss is planned for every position of every row, since the data \
                 could not be tokenized: {e}"
            );
            None
        }
    }
}
