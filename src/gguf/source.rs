//! Where the weights of an export come from, one tensor at a time, in f32 and with any LoRA
//! adapter merged: memory-mapped safetensors (the base model's shards, a run's trained
//! tensors, a PEFT adapter), or a model already in memory (a run from a random start, whose
//! base exists nowhere on disk).

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

use crate::model::weights::Checkpoint;
use crate::model::CausalLm;

use super::error::GgufError;

/// Supplies the weights of an HF-named model, merged and in f32.
pub trait WeightSource: Send + Sync {
    /// The weight named `name` (an HF name: `model.layers.0.self_attn.q_proj.weight`).
    fn load_f32(&self, name: &str) -> Result<Tensor, GgufError>;
}

/// A safetensors file (or set) whose tensor names carry a prefix and maybe a suffix.
pub struct NamedFiles {
    files: Checkpoint,
    /// Prepended to an HF name (`"master."`, `"base_model.model."`).
    prefix: String,
    description: String,
}

impl NamedFiles {
    /// Maps `paths`; `prefix` is what their names put before the HF name.
    pub fn open(paths: &[PathBuf], prefix: &str) -> Result<Self, GgufError> {
        let files = Checkpoint::open(paths).map_err(|cause| GgufError::Model {
            context: "cannot open the weights".into(),
            cause,
        })?;
        Ok(Self {
            files,
            prefix: prefix.to_string(),
            description: crate::model::weights::display_files(paths),
        })
    }

    fn get(&self, name: &str) -> Result<Option<Tensor>, GgufError> {
        let key = format!("{}{name}", self.prefix);
        // PEFT's in-memory state dicts carry the adapter name (`.default.`).
        let alt = key.replace(".weight", ".default.weight");
        let key = if self.files.contains(&key) {
            key
        } else if self.files.contains(&alt) {
            alt
        } else {
            return Ok(None);
        };
        let t = self
            .files
            .load(&key, None, DType::F32, &Device::Cpu)
            .map_err(|cause| GgufError::Model {
                context: format!("cannot read `{key}` from {}", self.description),
                cause,
            })?;
        // Streaming: the mapped pages of this tensor are not needed again.
        self.files.release(&key);
        Ok(Some(t))
    }
}

/// A LoRA adapter to fold in as it streams: `W + scale · B A`.
pub struct LoraMerge {
    /// Where `{module}.lora_A.weight` / `.lora_B.weight` live (in preference order: the
    /// optimizer's f32 masters first).
    pub factors: Vec<NamedFiles>,
    /// `alpha / r`.
    pub scale: f64,
}

/// Weights read from files: trained tensors (first match wins) over the base model.
pub struct FileSource {
    /// Tensors that replace the base's (a run's masters, then its trained tensors).
    pub overrides: Vec<NamedFiles>,
    /// The base model's shards; `None` when every weight is in `overrides`.
    pub base: Option<NamedFiles>,
    /// An adapter to merge.
    pub lora: Option<LoraMerge>,
}

fn first_of(files: &[NamedFiles], name: &str) -> Result<Option<Tensor>, GgufError> {
    for f in files {
        if let Some(t) = f.get(name)? {
            return Ok(Some(t));
        }
    }
    Ok(None)
}

impl WeightSource for FileSource {
    fn load_f32(&self, name: &str) -> Result<Tensor, GgufError> {
        let w = match first_of(&self.overrides, name)? {
            Some(t) => t,
            None => match &self.base {
                Some(base) => base.get(name)?.ok_or_else(|| GgufError::Model {
                    context: "the base model is incomplete".into(),
                    cause: crate::model::ModelError::MissingTensor {
                        name: name.to_string(),
                        file: base.description.clone(),
                    },
                })?,
                None => {
                    return Err(GgufError::Unsupported {
                        what: format!("weight `{name}`"),
                        hint: "it is in neither the checkpoint nor a base model file".into(),
                    })
                }
            },
        };
        let Some(lora) = &self.lora else { return Ok(w) };
        let Some(module) = name.strip_suffix(".weight") else {
            return Ok(w);
        };
        let a = first_of(&lora.factors, &format!("{module}.lora_A.weight"))?;
        let b = first_of(&lora.factors, &format!("{module}.lora_B.weight"))?;
        match (a, b) {
            (Some(a), Some(b)) => {
                let delta = b.matmul(&a).map_err(|e| GgufError::tensor(name, e))?;
                (w + (delta * lora.scale).map_err(|e| GgufError::tensor(name, e))?)
                    .map_err(|e| GgufError::tensor(name, e))
            }
            (None, None) => Ok(w),
            _ => Err(GgufError::Unsupported {
                what: format!("the adapter of `{module}`"),
                hint: "it has lora_A without lora_B (or the reverse); the adapter file is damaged"
                    .into(),
            }),
        }
    }
}

/// A model in memory (its adapter, if any, already merged).
pub struct ModelSource(pub CausalLm);

impl WeightSource for ModelSource {
    fn load_f32(&self, name: &str) -> Result<Tensor, GgufError> {
        let p = self.0.param(name).ok_or_else(|| GgufError::Unsupported {
            what: format!("weight `{name}`"),
            hint: "the model in memory has no such parameter".into(),
        })?;
        p.var
            .as_tensor()
            .to_dtype(DType::F32)
            .map_err(|e| GgufError::tensor(name, e))
    }
}
