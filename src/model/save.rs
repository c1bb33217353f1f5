//! Saving models in Hugging Face's layout: `config.json` + `model.safetensors`, or
//! `model-0000k-of-0000N.safetensors` shards with `model.safetensors.index.json`.

use super::decoder::CausalLm;
use super::error::ModelError;
use super::weights::write_safetensors;
use candle_core::{DType, Tensor};
use serde_json::json;
use std::path::{Path, PathBuf};

/// transformers' name of a dtype in `config.json`.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

/// Writes into a fresh temporary folder beside `dir`, then moves the result into place:
/// a new `dir` is renamed in one step; files of an existing `dir` are replaced one rename
/// each (so a crash never leaves a half-written file under a final name).
pub(crate) fn replace_dir_atomically(
    dir: &Path,
    write: impl FnOnce(&Path) -> Result<(), ModelError>,
) -> Result<Vec<PathBuf>, ModelError> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| ModelError::io(&parent, e))?;
    let base = dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    let tmp = parent.join(format!(".{base}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let mut written = Vec::new();
    for entry in std::fs::read_dir(&tmp).map_err(|e| ModelError::io(&tmp, e))? {
        let entry = entry.map_err(|e| ModelError::io(&tmp, e))?;
        written.push(entry.file_name());
    }
    if !dir.exists() {
        std::fs::rename(&tmp, dir).map_err(|e| ModelError::io(dir, e))?;
    } else {
        for name in &written {
            let to = dir.join(name);
            std::fs::rename(tmp.join(name), &to).map_err(|e| ModelError::io(&to, e))?;
        }
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(written.into_iter().map(|n| dir.join(n)).collect())
}

impl CausalLm {
    /// Saves `config.json` (with `dtype` updated) and the weights as `dtype`, sharded when
    /// they exceed `max_shard_bytes` (0 = never shard). A tied `lm_head` is not written;
    /// LoRA factors are not part of the base model (merge them first with
    /// [`CausalLm::merge_lora`] to save a merged model).
    pub fn save_pretrained(
        &self,
        dir: &Path,
        dtype: DType,
        max_shard_bytes: u64,
    ) -> Result<(), ModelError> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(ModelError::Input(format!(
                "cannot save weights as {dtype:?}; choose f32, bf16 or f16"
            )));
        }
        if self.quantization().is_on() {
            return Err(ModelError::Input(format!(
                "the base is quantized ({}): merge the adapter first (merge_lora dequantizes it) or save the adapter alone",
                self.quantization()
            )));
        }
        let elem = dtype.size_in_bytes() as u64;
        let tensors: Vec<(String, Tensor)> = self
            .config
            .parameter_shapes()
            .into_iter()
            .filter_map(|(name, _)| {
                self.param(&name)
                    .map(|p| (name.clone(), p.var.as_tensor().clone()))
            })
            .collect();
        // Greedy sharding in model order, like transformers' `shard_checkpoint`.
        let mut shards: Vec<Vec<(String, Tensor)>> = vec![vec![]];
        let mut cur = 0u64;
        let mut total = 0u64;
        for (name, t) in tensors {
            let bytes = t.elem_count() as u64 * elem;
            total += bytes;
            let last = shards.len() - 1;
            if max_shard_bytes > 0 && cur + bytes > max_shard_bytes && !shards[last].is_empty() {
                shards.push(vec![]);
                cur = 0;
            }
            cur += bytes;
            let last = shards.len() - 1;
            shards[last].push((name, t));
        }
        let mut config = self.config.raw.clone();
        if let Some(obj) = config.as_object_mut() {
            obj.insert("dtype".into(), json!(dtype_name(dtype)));
            if obj.contains_key("torch_dtype") {
                obj.insert("torch_dtype".into(), json!(dtype_name(dtype)));
            }
        }
        let n = shards.len();
        replace_dir_atomically(dir, |tmp| {
            let path = tmp.join("config.json");
            let text = serde_json::to_string_pretty(&config)
                .map_err(|e| ModelError::Input(format!("cannot serialise config.json: {e}")))?;
            std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
            if n == 1 {
                write_safetensors(&tmp.join("model.safetensors"), &shards[0], dtype)?;
            } else {
                let mut weight_map = serde_json::Map::new();
                for (k, shard) in shards.iter().enumerate() {
                    let file = format!("model-{:05}-of-{:05}.safetensors", k + 1, n);
                    write_safetensors(&tmp.join(&file), shard, dtype)?;
                    for (name, _) in shard {
                        weight_map.insert(name.clone(), json!(file));
                    }
                }
                let index = json!({
                    "metadata": {"total_size": total},
                    "weight_map": weight_map,
                });
                let path = tmp.join("model.safetensors.index.json");
                let text = serde_json::to_string_pretty(&index)
                    .map_err(|e| ModelError::Input(format!("cannot serialise the index: {e}")))?;
                std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
            }
            Ok(())
        })?;
        // A previous save with a different layout would leave files that now contradict
        // the new one (a stale index makes loaders ignore model.safetensors).
        let stale: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().to_string())
                    .unwrap_or_default();
                let is_weights = name == "model.safetensors"
                    || name == "model.safetensors.index.json"
                    || (name.starts_with("model-") && name.ends_with(".safetensors"));
                let current = if n == 1 {
                    name == "model.safetensors"
                } else {
                    name == "model.safetensors.index.json"
                        || name.ends_with(&format!("-of-{n:05}.safetensors"))
                };
                is_weights && !current
            })
            .collect();
        for p in stale {
            std::fs::remove_file(&p).map_err(|e| ModelError::io(&p, e))?;
        }
        Ok(())
    }
}
