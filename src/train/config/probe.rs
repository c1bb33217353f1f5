//! Reading a run config key by key: each key that does not deserialise is its own problem,
//! named by its field (serde stops at the first), and is left out.

use std::path::PathBuf;

use super::{
    CheckpointSection, ConfigProblem, DataConfig, DevicesSection, EvalSection, LoraSection,
    ModelSection, PreferenceSection, TrainingSection, SECTIONS,
};

/// Deserialises every key of every known section on its own, so that each bad key gives its
/// own problem (serde stops at the first); bad keys are removed from `table`.
pub(super) fn probe_and_strip(table: &mut toml::Table) -> Vec<ConfigProblem> {
    let mut problems = Vec::new();
    let keys: Vec<String> = table.keys().cloned().collect();
    for key in keys {
        let Some(value) = table.get(&key).cloned() else {
            continue;
        };
        let bad = match key.as_str() {
            "output_dir" => probe_value::<PathBuf>(&value).err(),
            "model" => probe_section::<ModelSection>(&key, table, &mut problems),
            "training" => probe_section::<TrainingSection>(&key, table, &mut problems),
            "lora" => probe_section::<LoraSection>(&key, table, &mut problems),
            "eval" => probe_section::<EvalSection>(&key, table, &mut problems),
            "checkpoint" => probe_section::<CheckpointSection>(&key, table, &mut problems),
            "devices" => probe_section::<DevicesSection>(&key, table, &mut problems),
            "preference" => probe_section::<PreferenceSection>(&key, table, &mut problems),
            "grpo" => probe_section::<super::GrpoSection>(&key, table, &mut problems),
            "data" => probe_section::<DataConfig>(&key, table, &mut problems),
            _ => Some(format!(
                "unknown setting; expected one of {}",
                SECTIONS
                    .iter()
                    .map(|s| format!("`{s}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        };
        if let Some(message) = bad {
            problems.push(ConfigProblem::new(&key, message));
            table.remove(&key);
        }
    }
    problems
}

pub(super) fn probe_value<T: serde::de::DeserializeOwned>(
    value: &toml::Value,
) -> Result<T, String> {
    value
        .clone()
        .try_into::<T>()
        .map_err(|e| e.message().trim().to_string())
}

/// Probes the keys of one section; returns `Some` only when the section itself is not a table.
fn probe_section<T: serde::de::DeserializeOwned>(
    section: &str,
    table: &mut toml::Table,
    problems: &mut Vec<ConfigProblem>,
) -> Option<String> {
    let Some(toml::Value::Table(inner)) = table.get_mut(section) else {
        return Some("must be a table (a `[section]`)".to_string());
    };
    let keys: Vec<String> = inner.keys().cloned().collect();
    for key in keys {
        let Some(value) = inner.get(&key).cloned() else {
            continue;
        };
        let mut single = toml::Table::new();
        single.insert(key.clone(), value);
        if let Err(e) = toml::Value::Table(single).try_into::<T>() {
            problems.push(ConfigProblem::new(
                &format!("{section}.{key}"),
                e.message().trim().to_string(),
            ));
            inner.remove(&key);
        }
    }
    None
}
