//! Turning a checkpoint into something other tools load: the PEFT adapter alone, the base
//! model with the adapter merged in, or the fully fine-tuned model (both as Hugging Face
//! model folders with the tokenizer files copied beside them).
//!
//! Every export starts from a `checkpoint-<step>` folder (its `run.toml` names the base
//! model), so it works in a later session too. The weights are rebuilt in f32 and, for mixed
//! precision runs, taken from the optimizer's f32 master copy rather than the bf16/f16 one.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};

use crate::model::CausalLm;

use super::checkpoint;
use super::config::{ModelDtype, RunConfig};
use super::error::TrainError;
use super::step::build_model;

/// The largest shard `save_pretrained` writes (as transformers' default, 5 GB).
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Tokenizer files copied next to exported weights.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
];

fn ck_err(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Reads the run config saved in a checkpoint.
pub fn checkpoint_config(checkpoint_dir: &Path) -> Result<RunConfig, TrainError> {
    let path = checkpoint_dir.join(checkpoint::CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        ck_err(
            checkpoint_dir,
            format!(
                "cannot read {} ({e}); is this a `checkpoint-<step>` folder?",
                checkpoint::CONFIG_FILE
            ),
        )
    })?;
    let base = checkpoint_dir.to_path_buf();
    Ok(RunConfig::from_toml_str(&text, &base)?)
}

/// Rebuilds the checkpoint's trained model in f32 on the CPU.
pub(crate) fn load_trained_model(
    checkpoint_dir: &Path,
) -> Result<(CausalLm, RunConfig, PathBuf), TrainError> {
    let mut config = checkpoint_config(checkpoint_dir)?;
    let state = checkpoint::read_state(checkpoint_dir)?;
    config.model.dtype = ModelDtype::F32;
    config.training.activation_checkpointing = false;
    let (model, model_dir) = build_model(&config, &Device::Cpu)?;
    let trained = checkpoint::load_tensors(
        &checkpoint_dir.join(checkpoint::TRAINABLE_FILE),
        &Device::Cpu,
    )?;
    let masters = if state.precision.master_weights() {
        checkpoint::load_tensors(
            &checkpoint_dir.join(checkpoint::OPTIMIZER_FILE),
            &Device::Cpu,
        )?
    } else {
        Default::default()
    };
    for p in model.params_mut_vars() {
        let (name, var) = p;
        let t = masters
            .get(&format!("master.{name}"))
            .or_else(|| trained.get(&name))
            .ok_or_else(|| {
                ck_err(
                    checkpoint_dir,
                    format!("`{}` has no tensor `{name}`", checkpoint::TRAINABLE_FILE),
                )
            })?;
        let t = t
            .to_dtype(DType::F32)
            .map_err(|e| ck_err(checkpoint_dir, e.to_string()))?;
        var.set(&t).map_err(|e| {
            ck_err(
                checkpoint_dir,
                format!("`{name}` does not fit the model: {e}"),
            )
        })?;
    }
    Ok((model, config, model_dir))
}

/// Copies the model's tokenizer files into `dest`.
fn copy_tokenizer(model_dir: &Path, dest: &Path) -> Result<(), TrainError> {
    for f in TOKENIZER_FILES {
        let src = model_dir.join(f);
        if src.is_file() {
            std::fs::copy(&src, dest.join(f)).map_err(|cause| TrainError::Io {
                path: dest.join(f),
                cause,
            })?;
        }
    }
    Ok(())
}

/// Writes the LoRA adapter of `checkpoint_dir` to `dest` in PEFT's layout
/// (`adapter_config.json` + `adapter_model.safetensors`).
pub fn export_adapter(checkpoint_dir: &Path, dest: &Path) -> Result<PathBuf, TrainError> {
    let state = checkpoint::read_state(checkpoint_dir)?;
    if !state.lora {
        return Err(ck_err(
            checkpoint_dir,
            "this run trained every weight (no LoRA), so there is no adapter; use export_full",
        ));
    }
    let (model, _, _) = load_trained_model(checkpoint_dir)?;
    model.save_adapter(dest).map_err(|e| TrainError::Model {
        context: format!("cannot write the adapter to `{}`", dest.display()),
        cause: e,
    })?;
    Ok(dest.to_path_buf())
}

/// Merges the LoRA adapter of `checkpoint_dir` into the base weights and saves a complete
/// Hugging Face model folder (weights as `dtype`, config, tokenizer) in `dest`.
pub fn export_merged(
    checkpoint_dir: &Path,
    dest: &Path,
    dtype: DType,
) -> Result<PathBuf, TrainError> {
    let state = checkpoint::read_state(checkpoint_dir)?;
    if !state.lora {
        return Err(ck_err(
            checkpoint_dir,
            "this run has no LoRA adapter to merge; use export_full",
        ));
    }
    let (mut model, _, model_dir) = load_trained_model(checkpoint_dir)?;
    model.merge_lora().map_err(|e| TrainError::Model {
        context: "cannot merge the adapter".into(),
        cause: e,
    })?;
    save_model(&model, &model_dir, dest, dtype)
}

/// Saves the fully fine-tuned model of `checkpoint_dir` as a Hugging Face model folder.
/// For a LoRA run this is the same as [`export_merged`].
pub fn export_full(
    checkpoint_dir: &Path,
    dest: &Path,
    dtype: DType,
) -> Result<PathBuf, TrainError> {
    let state = checkpoint::read_state(checkpoint_dir)?;
    if state.lora {
        return export_merged(checkpoint_dir, dest, dtype);
    }
    let (model, _, model_dir) = load_trained_model(checkpoint_dir)?;
    save_model(&model, &model_dir, dest, dtype)
}

fn save_model(
    model: &CausalLm,
    model_dir: &Path,
    dest: &Path,
    dtype: DType,
) -> Result<PathBuf, TrainError> {
    std::fs::create_dir_all(dest).map_err(|cause| TrainError::Io {
        path: dest.to_path_buf(),
        cause,
    })?;
    model
        .save_pretrained(dest, dtype, MAX_SHARD_BYTES)
        .map_err(|e| TrainError::Model {
            context: format!("cannot save the model to `{}`", dest.display()),
            cause: e,
        })?;
    copy_tokenizer(model_dir, dest)?;
    Ok(dest.to_path_buf())
}

/// Helper view: `(name, var)` of the trainable parameters.
trait TrainableVars {
    fn params_mut_vars(&self) -> Vec<(String, candle_core::Var)>;
}

impl TrainableVars for CausalLm {
    fn params_mut_vars(&self) -> Vec<(String, candle_core::Var)> {
        self.params()
            .iter()
            .filter(|p| p.trainable)
            .map(|p| (p.name.clone(), p.var.clone()))
            .collect()
    }
}
