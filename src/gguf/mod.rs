//! GGUF export: a fine-tuned Llama, Mistral or Qwen2 model as one file that llama.cpp,
//! Ollama and LM Studio run, written in-process (no llama.cpp toolchain), streaming one
//! tensor at a time, with llama.cpp's names, metadata, tokenizer, Q/K order and quantization
//! mixes; and the Ollama `Modelfile` beside it.
//!
//! - [`quant`]: the file types (`f16` … `q4_k_m`) and llama.cpp's per-tensor type rules;
//! - [`names`]: HF → llama.cpp tensor names and the Q/K permutation;
//! - [`metadata`], [`vocab`]: the header's model and tokenizer keys;
//! - [`writer`]: the streaming GGUF v3 writer (temporary name, then rename);
//! - [`source`]: where weights come from (files, with an adapter merged as they stream);
//! - [`export`]: plan and write one file;
//! - [`modelfile`]: Ollama's `Modelfile`.

pub mod error;
pub mod export;
pub mod metadata;
pub mod modelfile;
pub mod names;
pub mod quant;
pub mod source;
pub mod tokenizer;
pub mod vocab;
pub mod writer;

pub use error::GgufError;
pub use export::{
    encode_tensor, plan_export, predicted_tensor_bytes, read_tensor_f32, write_gguf,
    ExportProgress, GgufPlan,
};
pub use modelfile::{modelfile_text, ModelfileSpec};
pub use quant::GgufQuant;
pub use source::{FileSource, LoraMerge, ModelSource, NamedFiles, WeightSource};
