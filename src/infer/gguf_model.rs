//! A GGUF file as a chat model: candle-transformers' quantized Llama (also Mistral, which
//! llama.cpp files as `llama`) and Qwen2 run it, with the tokenizer and chat template the
//! file carries, so the Playground and `tunestudio generate` test exactly what was exported.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::quantized::gguf_file::Content;
use candle_core::{Device, IndexOp, Tensor};
use candle_transformers::models::{quantized_llama, quantized_qwen2};
use serde_json::json;

use crate::data::tokenizer::TokenizerBundle;
use crate::gguf::tokenizer::tokenizer_from_gguf;
use crate::gguf::GgufError;
use crate::model::ModelConfig;

use super::error::InferError;

enum Weights {
    Llama(quantized_llama::ModelWeights),
    Qwen2(quantized_qwen2::ModelWeights),
}

/// A loaded GGUF model. Its key/value cache lives inside the weights, so one generation at a
/// time holds it (the lock).
pub struct GgufModel {
    weights: Mutex<Weights>,
    config: ModelConfig,
    path: PathBuf,
    device: Device,
}

fn invalid(path: &Path, message: impl Into<String>) -> InferError {
    InferError::from(GgufError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    })
}

/// The `config.json` equivalent of a GGUF header (for context length, vocabulary, EOS).
fn config_of(content: &Content, path: &Path) -> Result<ModelConfig, InferError> {
    let md = &content.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .ok_or_else(|| invalid(path, "general.architecture is missing"))?;
    if arch != "llama" && arch != "qwen2" {
        return Err(invalid(
            path,
            format!(
                "architecture `{arch}`: tunestudio runs llama (Llama, Mistral) and qwen2 files"
            ),
        ));
    }
    let u = |k: &str| -> Result<u32, InferError> {
        md.get(&format!("{arch}.{k}"))
            .and_then(|v| v.to_u32().ok())
            .ok_or_else(|| invalid(path, format!("{arch}.{k} is missing")))
    };
    let f = |k: &str, default: f32| {
        md.get(&format!("{arch}.{k}"))
            .and_then(|v| v.to_f32().ok())
            .unwrap_or(default)
    };
    let tokens = md
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.to_vec().ok())
        .map_or(0, |t| t.len());
    let vocab = u("vocab_size").map(|v| v as usize).unwrap_or(tokens);
    let id = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
    let raw = json!({
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": u("embedding_length")?,
        "intermediate_size": u("feed_forward_length")?,
        "num_hidden_layers": u("block_count")?,
        "num_attention_heads": u("attention.head_count")?,
        "num_key_value_heads": u("attention.head_count_kv")?,
        "rms_norm_eps": f("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": f("rope.freq_base", 10000.0),
        "max_position_embeddings": u("context_length")?,
        "tie_word_embeddings": !content.tensor_infos.contains_key("output.weight"),
        "bos_token_id": id("tokenizer.ggml.bos_token_id"),
        "eos_token_id": id("tokenizer.ggml.eos_token_id"),
    });
    ModelConfig::from_json_str(&raw.to_string(), &path.display().to_string())
        .map_err(InferError::Model)
}

impl GgufModel {
    /// Loads `path` onto `device`; also returns the tokenizer stored in the file (an error
    /// for SentencePiece files, whose merges GGUF does not keep).
    pub fn open(
        path: &Path,
        device: &Device,
    ) -> Result<(Self, Result<TokenizerBundle, InferError>), InferError> {
        let mut file =
            std::fs::File::open(path).map_err(|e| InferError::from(GgufError::io(path, e)))?;
        let content = Content::read(&mut file).map_err(|e| invalid(path, e.to_string()))?;
        let config = config_of(&content, path)?;
        let tokenizer = tokenizer_bundle(&content, path);
        let weights = match config.architecture {
            crate::model::Architecture::Qwen2 => Weights::Qwen2(
                quantized_qwen2::ModelWeights::from_gguf(content, &mut file, device)
                    .map_err(|e| invalid(path, e.to_string()))?,
            ),
            _ => Weights::Llama(
                quantized_llama::ModelWeights::from_gguf(content, &mut file, device)
                    .map_err(|e| invalid(path, e.to_string()))?,
            ),
        };
        Ok((
            Self {
                weights: Mutex::new(weights),
                config,
                path: path.to_path_buf(),
                device: device.clone(),
            },
            tokenizer,
        ))
    }

    /// The header as a model config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Starts a sequence: clears the cache and holds the model until the session drops.
    pub fn session(&self) -> GgufSession<'_> {
        let mut weights = self
            .weights
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match &mut *weights {
            Weights::Llama(w) => w.clear_kv_cache(),
            Weights::Qwen2(w) => w.clear_kv_cache(),
        }
        GgufSession {
            weights,
            pos: 0,
            device: self.device.clone(),
        }
    }
}

/// One sequence being run through a [`GgufModel`].
pub struct GgufSession<'a> {
    weights: std::sync::MutexGuard<'a, Weights>,
    pos: usize,
    /// Where the weights are: the token ids go there too.
    device: Device,
}

impl GgufSession<'_> {
    /// Feeds `ids` after what was fed before; returns the last position's logits (f32).
    pub fn forward(&mut self, ids: &[u32]) -> Result<Vec<f32>, InferError> {
        let x = Tensor::new(ids, &self.device)?.unsqueeze(0)?;
        let logits = match &mut *self.weights {
            Weights::Llama(w) => w.forward(&x, self.pos)?,
            Weights::Qwen2(w) => w.forward(&x, self.pos)?,
        };
        self.pos += ids.len();
        let logits = logits.i(0)?.to_dtype(candle_core::DType::F32)?;
        Ok(logits.to_vec1::<f32>()?)
    }

    /// Tokens fed so far.
    pub fn len(&self) -> usize {
        self.pos
    }

    /// Whether nothing was fed yet.
    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
}

fn tokenizer_bundle(content: &Content, path: &Path) -> Result<TokenizerBundle, InferError> {
    let parts = tokenizer_from_gguf(content, path)?;
    let tokenizer: tokenizers::Tokenizer = parts
        .tokenizer_json
        .to_string()
        .parse()
        .map_err(|e: tokenizers::Error| invalid(path, format!("its tokenizer: {e}")))?;
    let origin = path.display().to_string();
    Ok(TokenizerBundle::from_tokenizer(
        tokenizer,
        &parts.config,
        path,
        parts
            .chat_template
            .map(|t| (t, format!("{origin}#tokenizer.chat_template"))),
        path.to_path_buf(),
    )?)
}
