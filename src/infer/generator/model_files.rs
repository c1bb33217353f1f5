//! What a loaded model is called, the token ids that end its generation, and its chat template,
//! read from its files.

use super::*;

/// The last path component of a name or path, lower-cased (`org/Name` → `name`).
pub(super) fn short_name(s: &str) -> String {
    s.trim_end_matches(['/', '\\'])
        .rsplit(['/', '\\'])
        .next()
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// Names a model folder or source goes by: its own, the hub id of an HF cache snapshot
/// (`models--org--name/snapshots/<hash>`), and `_name_or_path` from config.json.
pub(super) fn model_names(source: &str, dir: &Path, config: &ModelConfig) -> Vec<String> {
    let mut names = vec![short_name(source)];
    if let Some(n) = dir.file_name() {
        names.push(short_name(&n.to_string_lossy()));
    }
    for comp in dir.components() {
        let c = comp.as_os_str().to_string_lossy();
        if let Some(rest) = c.strip_prefix("models--") {
            if let Some(name) = rest.rsplit("--").next() {
                names.push(name.to_ascii_lowercase());
            }
        }
    }
    if let Some(n) = config.raw.get("_name_or_path").and_then(Value::as_str) {
        names.push(short_name(n));
    }
    names.retain(|n| !n.is_empty());
    names
}

/// `base_model_name_or_path` of an adapter folder, if stated.
pub(super) fn adapter_base_name(adapter: &Path) -> Option<String> {
    let text = std::fs::read_to_string(adapter.join("adapter_config.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v.get("base_model_name_or_path")
        .and_then(Value::as_str)
        .filter(|s| !s.trim().is_empty())
        .map(str::to_string)
}

/// End-of-sequence ids: config.json's, generation_config.json's (may be a list), and the
/// tokenizer's EOS.
pub(crate) fn eos_ids(
    config: &ModelConfig,
    dirs: &[&Path],
    tokenizer: &TokenizerBundle,
) -> Vec<u32> {
    let mut ids = config.eos_token_ids.clone();
    for dir in dirs {
        let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        match v.get("eos_token_id") {
            Some(Value::Number(n)) => ids.extend(n.as_u64().map(|x| x as u32)),
            Some(Value::Array(a)) => {
                ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32))
            }
            _ => {}
        }
    }
    ids.extend(tokenizer.eos_token_id);
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The tokenizer's chat template, compiled.
pub(super) fn template_of(
    tokenizer: &TokenizerBundle,
    name: &str,
) -> Result<Option<ChatTemplate>, InferError> {
    let template = match &tokenizer.chat_template {
        Some(src) => Some(
            ChatTemplate::new(
                src,
                TemplateTokens {
                    bos_token: tokenizer.bos_token.clone(),
                    eos_token: tokenizer.eos_token.clone(),
                    pad_token: tokenizer.pad_token.clone(),
                    unk_token: tokenizer.unk_token.clone(),
                },
            )
            .map_err(|e| InferError::Template {
                model: name.to_string(),
                message: e.to_string(),
            })?,
        ),
        None => None,
    };
    Ok(template)
}
