//! What a resume changes: the run config a checkpoint was made with (its `run.toml`) against
//! the one it resumes with. Each changed setting is named with what it does to the run; a
//! change that breaks the exact continuation (another model, other data or data order,
//! another precision or LoRA shape) is refused unless allowed
//! (`tunestudio train --allow-config-change`). Another device strategy or device count is
//! not: every strategy computes the same step, and a checkpoint holds the optimizer state
//! whole whatever strategy wrote it.

use std::collections::BTreeMap;

use super::config::RunConfig;

/// One setting that differs between the checkpoint's run config and the resumed one.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigChange {
    /// `section.key`, as in the run config.
    pub setting: String,
    /// The checkpoint's value (TOML).
    pub before: String,
    /// The resumed run's value (TOML).
    pub after: String,
    /// What the change does to the run.
    pub effect: String,
    /// Whether the run can no longer continue exactly as the uninterrupted one would have.
    pub breaks_resume: bool,
}

impl std::fmt::Display for ConfigChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} → {}: {}",
            self.setting, self.before, self.after, self.effect
        )
    }
}

/// Settings that only say where things go or how often they are reported or saved.
const NEUTRAL: &[&str] = &[
    "output_dir",
    "base_dir",
    "checkpoint.",
    "eval.",
    "data.allow",
];

/// Settings whose change makes a different run, not a continued one.
const BREAKING: &[(&str, &str)] = &[
    ("model.", "another model or weights"),
    ("data.", "other rows or another row order"),
    ("training.precision", "another precision"),
    ("training.seed", "other random draws (data order, dropout)"),
    ("lora.", "another adapter shape"),
    ("training.method", "another training objective"),
    (
        "preference.max_",
        "other pair truncation (other tokens, another reference)",
    ),
];

/// Every setting that differs, in the run config's order.
pub fn config_changes(checkpoint: &RunConfig, resumed: &RunConfig) -> Vec<ConfigChange> {
    let before = flatten(checkpoint);
    let after = flatten(resumed);
    let mut keys: Vec<&String> = before.keys().chain(after.keys()).collect();
    keys.sort();
    keys.dedup();
    let missing = "(unset)".to_string();
    keys.into_iter()
        .filter(|k| before.get(*k) != after.get(*k))
        .filter(|k| !NEUTRAL.iter().any(|n| k.starts_with(n)))
        .map(|k| {
            let breaking = BREAKING.iter().find(|(prefix, _)| k.starts_with(prefix));
            ConfigChange {
                setting: k.clone(),
                before: before.get(k).unwrap_or(&missing).clone(),
                after: after.get(k).unwrap_or(&missing).clone(),
                effect: match breaking {
                    Some((_, what)) => format!("{what}: the run cannot continue exactly"),
                    None => effect_of(k, checkpoint, resumed),
                },
                breaks_resume: breaking.is_some(),
            }
        })
        .collect()
}

fn effect_of(key: &str, before: &RunConfig, after: &RunConfig) -> String {
    let effective = RunConfig::effective_batch;
    match key {
        "training.micro_batch" | "training.gradient_accumulation" | "devices.devices" => {
            let (b, a) = (effective(before), effective(after));
            if a == b {
                format!("the effective batch stays {a} rows; the data continues at the same row")
            } else {
                format!(
                    "the effective batch goes from {b} to {a} rows per step (each step's gradient averages {} as many rows), and the data position is kept by rows",
                    if a < b { "fewer" } else { "more" }
                )
            }
        }
        "devices.strategy" | "devices.shard" => {
            "the same step on another placement (single, layer split, data parallel and sharded compute one update; the checkpoint holds the optimizer state whole, so it is divided afresh)".into()
        }
        "training.max_steps" | "training.epochs" => {
            "the run's length changes, and with it the learning-rate schedule's decay".into()
        }
        k if k.starts_with("training.learning_rate")
            || k.starts_with("training.schedule")
            || k.starts_with("training.warmup") =>
        {
            "the learning rate follows the new schedule from the next step".into()
        }
        _ => "takes effect from the next step".into(),
    }
}

/// The run config as `section.key → value` (TOML text).
fn flatten(config: &RunConfig) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(value) = toml::Value::try_from(config.with_absolute_paths()) else {
        return out;
    };
    fn walk(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    walk("", &value, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_smaller_micro_batch_is_named_with_both_effective_batches() {
        let before = RunConfig::default();
        let mut after = before.clone();
        after.training.micro_batch = before.training.micro_batch * 4;
        let changes = config_changes(&before, &after);
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!(changes[0].setting, "training.micro_batch");
        assert!(!changes[0].breaks_resume);
        assert!(
            changes[0].effect.contains("from 1 to 4 rows"),
            "{}",
            changes[0]
        );
    }

    #[test]
    fn another_method_or_pair_cut_breaks_the_resume_and_another_beta_does_not() {
        let before = RunConfig::default();
        let mut after = before.clone();
        after.training.method = super::super::config::TrainingMethod::Dpo;
        after.preference.max_completion_length += 1;
        after.preference.beta = 0.2;
        let changes = config_changes(&before, &after);
        let breaking: Vec<&str> = changes
            .iter()
            .filter(|c| c.breaks_resume)
            .map(|c| c.setting.as_str())
            .collect();
        assert_eq!(
            breaking,
            ["preference.max_completion_length", "training.method"],
            "{changes:?}"
        );
        assert!(changes
            .iter()
            .any(|c| c.setting == "preference.beta" && !c.breaks_resume));
    }

    /// A sharded run's checkpoint resumes on one device, or on a layer split: the same step.
    #[test]
    fn another_strategy_or_device_count_continues_the_run() {
        use crate::settings::Strategy;
        let mut before = RunConfig::default();
        before.devices.devices = vec!["cpu:0".into(), "cpu:1".into()];
        before.devices.strategy = Strategy::Sharded;
        before.training.micro_batch = 2;
        for strategy in [
            Strategy::Single,
            Strategy::LayerSplit,
            Strategy::DataParallel,
        ] {
            let mut after = before.clone();
            after.devices.strategy = strategy;
            let changes = config_changes(&before, &after);
            assert_eq!(changes.len(), 1, "{changes:?}");
            assert!(!changes[0].breaks_resume, "{}", changes[0]);
            assert!(changes[0].effect.contains("same step"), "{}", changes[0]);
        }
    }

    #[test]
    fn another_lora_rank_breaks_the_resume_and_the_output_folder_does_not() {
        let before = RunConfig::default();
        let mut after = before.clone();
        after.lora.r += 8;
        after.output_dir = "elsewhere".into();
        after.checkpoint.save_every += 1;
        let changes = config_changes(&before, &after);
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!(changes[0].setting, "lora.r");
        assert!(changes[0].breaks_resume);
    }
}
