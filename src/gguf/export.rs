//! One GGUF export: plan every tensor (name, shape, type) and the header from the config and
//! the tokenizer, then stream the weights through merge → permute → quantize → write, one
//! tensor at a time, quantizing each tensor's rows on every core.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::model::ModelConfig;

use super::error::GgufError;
use super::metadata::{check_supported, model_metadata, permutes_qk, rope_freq_factors};
use super::names::{gguf_name, permute_qk, NameContext};
use super::quant::{tensor_type, GgufQuant};
use super::source::WeightSource;
use super::vocab::{vocab_metadata, VocabMetadata};
use super::writer::{file_bytes, GgufWriter, MetaValue, TensorInfo};

/// Where a planned tensor's data comes from.
#[derive(Debug, Clone, PartialEq)]
enum Origin {
    /// An HF weight, permuted for llama.cpp's RoPE when `permute_heads` is set.
    Weight {
        hf: String,
        permute_heads: Option<usize>,
    },
    /// Values computed from the config (Llama-3's `rope_freqs`).
    Values(Vec<f32>),
}

/// One tensor of the file to write.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTensor {
    /// Name, shape and type in the file.
    pub info: TensorInfo,
    origin: Origin,
}

/// Everything about a GGUF file that is known before a weight is read.
#[derive(Debug, Clone)]
pub struct GgufPlan {
    /// The header's key/values.
    pub metadata: Vec<(String, MetaValue)>,
    /// The tensors, in file order.
    pub tensors: Vec<PlannedTensor>,
    /// The file's size in bytes.
    pub file_bytes: u64,
    /// The chosen file type.
    pub quant: GgufQuant,
    /// End-of-turn token texts (for the Ollama Modelfile).
    pub stop_tokens: Vec<String>,
    /// Whether the header carries a chat template.
    pub has_chat_template: bool,
    /// The chat template, if any (for the Modelfile's TEMPLATE).
    pub chat_template: Option<String>,
}

/// The tensors of a model of `cfg` in file order, without the header (no I/O).
fn plan_tensors(cfg: &ModelConfig, quant: GgufQuant) -> Vec<PlannedTensor> {
    let ctx = NameContext {
        layers: cfg.num_hidden_layers,
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        permute_qk: permutes_qk(cfg),
    };
    let tied = cfg.tie_word_embeddings;
    let mut out = Vec::new();
    if let Some(factors) = rope_freq_factors(cfg) {
        out.push(PlannedTensor {
            info: TensorInfo {
                name: "rope_freqs.weight".into(),
                shape: vec![factors.len()],
                ty: GgmlDType::F32,
            },
            origin: Origin::Values(factors),
        });
    }
    for (hf, shape) in cfg.parameter_shapes() {
        let Some(g) = gguf_name(&hf, &ctx) else {
            continue;
        };
        let row_len = *shape.last().unwrap_or(&1);
        let ty = if shape.len() < 2 {
            GgmlDType::F32
        } else {
            tensor_type(quant, g.role, row_len, tied)
        };
        out.push(PlannedTensor {
            info: TensorInfo {
                name: g.name,
                shape,
                ty,
            },
            origin: Origin::Weight {
                hf,
                permute_heads: g.permute_heads,
            },
        });
    }
    out
}

/// The bytes the tensors of a `quant` export of `cfg` take (the file is this plus the
/// header, mostly the tokenizer: ~1–5 MB). Pure arithmetic, for the studio's size preview.
pub fn predicted_tensor_bytes(cfg: &ModelConfig, quant: GgufQuant) -> u64 {
    plan_tensors(cfg, quant)
        .iter()
        .map(|t| t.info.bytes().div_ceil(32) * 32)
        .sum()
}

/// Plans the export of the model in `model_dir` (its `config.json` parsed as `cfg`).
pub fn plan_export(
    cfg: &ModelConfig,
    model_dir: &Path,
    quant: GgufQuant,
    name: &str,
) -> Result<GgufPlan, GgufError> {
    check_supported(cfg)?;
    let VocabMetadata {
        metadata: vocab,
        stop_tokens,
        chat_template,
    } = vocab_metadata(model_dir, cfg)?;
    let mut metadata = model_metadata(cfg, quant, name);
    metadata.extend(vocab);
    let tensors = plan_tensors(cfg, quant);
    let infos: Vec<TensorInfo> = tensors.iter().map(|t| t.info.clone()).collect();
    Ok(GgufPlan {
        file_bytes: file_bytes(&metadata, &infos),
        metadata,
        tensors,
        quant,
        stop_tokens,
        has_chat_template: chat_template.is_some(),
        chat_template,
    })
}

/// How far an export is, for progress bars.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportProgress {
    /// Tensors written so far.
    pub done: usize,
    /// Tensors in the file.
    pub total: usize,
    /// Bytes written so far.
    pub bytes_done: u64,
    /// The file's size.
    pub bytes_total: u64,
    /// The tensor just written.
    pub tensor: String,
}

/// The bytes of `t` (f32, row-major) stored as `ty`; quantized types are quantized in row
/// chunks on every core (rows are independent blocks, so the chunks concatenate).
pub fn encode_tensor(t: &Tensor, ty: GgmlDType, name: &str) -> Result<Vec<u8>, GgufError> {
    let err = |e| GgufError::tensor(name, e);
    let flat = |t: &Tensor, dtype: DType| -> Result<Tensor, GgufError> {
        t.to_dtype(dtype).and_then(|t| t.flatten_all()).map_err(err)
    };
    match ty {
        GgmlDType::F32 => Ok(flat(t, DType::F32)?
            .to_vec1::<f32>()
            .map_err(err)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()),
        GgmlDType::F16 => Ok(flat(t, DType::F16)?
            .to_vec1::<half::f16>()
            .map_err(err)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()),
        GgmlDType::BF16 => Ok(flat(t, DType::BF16)?
            .to_vec1::<half::bf16>()
            .map_err(err)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()),
        _ => {
            let rows = t.dims().first().copied().unwrap_or(1);
            let threads = rayon::current_num_threads().max(1);
            // A few chunks per thread balance rows of uneven cost; 16 rows at least keeps
            // candle's per-call overhead small.
            let chunk = rows.div_ceil(threads * 4).max(16);
            let starts: Vec<usize> = (0..rows).step_by(chunk).collect();
            let parts: Vec<Vec<u8>> = starts
                .par_iter()
                .map(|&start| {
                    let n = chunk.min(rows - start);
                    // A fresh buffer: candle's quantizer reads the storage from its start,
                    // ignoring a narrowed view's offset.
                    let cols = t.elem_count() / rows.max(1);
                    let values = t
                        .narrow(0, start, n)
                        .and_then(|p| p.flatten_all())
                        .and_then(|p| p.to_vec1::<f32>())
                        .map_err(err)?;
                    let part = Tensor::from_vec(values, (n, cols), &Device::Cpu).map_err(err)?;
                    let q = QTensor::quantize(&part, ty).map_err(err)?;
                    Ok(q.data().map_err(err)?.to_vec())
                })
                .collect::<Result<_, GgufError>>()?;
            Ok(parts.concat())
        }
    }
}

/// Writes `plan` to `dest` from `source`. `progress` is told after each tensor and may stop
/// the export (`ControlFlow::Break`): then nothing is left at `dest` (nor a temporary file).
pub fn write_gguf(
    plan: &GgufPlan,
    source: &dyn WeightSource,
    dest: &Path,
    replace: bool,
    progress: &mut dyn FnMut(&ExportProgress) -> ControlFlow<()>,
) -> Result<PathBuf, GgufError> {
    let infos: Vec<TensorInfo> = plan.tensors.iter().map(|t| t.info.clone()).collect();
    let mut writer = GgufWriter::create(dest, replace, &plan.metadata, infos)?;
    let header_bytes = plan.file_bytes
        - plan
            .tensors
            .iter()
            .map(|t| t.info.bytes().div_ceil(32) * 32)
            .sum::<u64>();
    let mut bytes_done = header_bytes;
    for (i, t) in plan.tensors.iter().enumerate() {
        let name = &t.info.name;
        let data = match &t.origin {
            Origin::Values(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Origin::Weight { hf, permute_heads } => {
                let w = source.load_f32(hf)?;
                if w.dims() != t.info.shape.as_slice() {
                    return Err(GgufError::Unsupported {
                        what: format!("weight `{hf}` of shape {:?}", w.dims()),
                        hint: format!("config.json implies {:?}", t.info.shape),
                    });
                }
                let w = match permute_heads {
                    Some(heads) => permute_qk(&w, *heads).map_err(|e| GgufError::tensor(hf, e))?,
                    None => w,
                };
                encode_tensor(&w, t.info.ty, hf)?
            }
        };
        writer.write_tensor(name, &data)?;
        bytes_done += t.info.bytes().div_ceil(32) * 32;
        let step = ExportProgress {
            done: i + 1,
            total: plan.tensors.len(),
            bytes_done,
            bytes_total: plan.file_bytes,
            tensor: name.clone(),
        };
        if progress(&step).is_break() {
            drop(writer);
            return Err(GgufError::Cancelled {
                path: dest.to_path_buf(),
            });
        }
    }
    writer.finish()
}

/// Dequantizes one tensor of a written file (for checks): candle's reader, on the CPU.
pub fn read_tensor_f32(path: &Path, name: &str) -> Result<Tensor, GgufError> {
    let invalid = |m: String| GgufError::Invalid {
        path: path.to_path_buf(),
        message: m,
    };
    let mut f = std::fs::File::open(path).map_err(|e| GgufError::io(path, e))?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)
        .map_err(|e| invalid(e.to_string()))?;
    content
        .tensor(&mut f, name, &Device::Cpu)
        .and_then(|q| q.dequantize(&Device::Cpu))
        .map_err(|e| invalid(format!("tensor `{name}`: {e}")))
}
