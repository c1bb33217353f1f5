//! The inference layer's error type: every message names the model, adapter or setting at
//! fault and says how to fix it.

use crate::data::DataError;
use crate::model::ModelError;
use std::path::PathBuf;

/// Everything that can go wrong while loading a model for generation or generating.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Loading the tokenizer failed.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A GGUF file could not be read or run.
    #[error(transparent)]
    Gguf(Box<crate::gguf::GgufError>),
    /// The adapter says it was trained on a different base model.
    #[error("the adapter in {adapter} was trained on `{adapter_base}`, but the model loaded is `{model}`: load the adapter on the base model it was trained on, or (if the base was only renamed or moved) turn off the base check (`--ignore-adapter-base`)")]
    AdapterBaseMismatch {
        /// The adapter folder.
        adapter: PathBuf,
        /// `base_model_name_or_path` from `adapter_config.json`.
        adapter_base: String,
        /// The model that was loaded (folder or hub id).
        model: String,
    },
    /// An adapter tensor does not fit the base model's layers.
    #[error("the adapter in {adapter} does not fit the model `{model}`: `{tensor}` has shape {found:?} but this model needs {expected:?}; the adapter was trained on a different base model (load it on that one)")]
    AdapterShapeMismatch {
        /// The adapter folder.
        adapter: PathBuf,
        /// The model that was loaded.
        model: String,
        /// The adapter tensor.
        tensor: String,
        /// The shape this model needs.
        expected: Vec<usize>,
        /// The shape stored in the adapter.
        found: Vec<usize>,
    },
    /// The tokenizer produces ids the model has no embedding for.
    #[error("the tokenizer of {tokenizer} has {tokenizer_vocab} tokens but the model `{model}` has vocab_size {model_vocab}: the tokenizer belongs to another model; use the model's own tokenizer")]
    VocabMismatch {
        /// Where the tokenizer came from.
        tokenizer: PathBuf,
        /// Its vocabulary size (with added tokens).
        tokenizer_vocab: usize,
        /// The model.
        model: String,
        /// `vocab_size` from config.json.
        model_vocab: usize,
    },
    /// The prompt (or the chat's last message) holds no text.
    #[error(
        "the prompt is empty: type some text (in chat mode, the last message must not be empty)"
    )]
    EmptyPrompt,
    /// A generation setting is out of range.
    #[error("invalid generation setting `{setting}`: {message}")]
    InvalidSetting {
        /// The setting's name (`max_new_tokens`, `temperature`, ...).
        setting: &'static str,
        /// What is wrong and which values are allowed.
        message: String,
    },
    /// The prompt does not fit in the model's context.
    #[error("the prompt has {prompt_tokens} tokens but `{model}` handles at most {context_tokens} (max_position_embeddings in config.json): shorten the prompt or the chat history")]
    PromptTooLong {
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// The model's context length.
        context_tokens: usize,
        /// The model.
        model: String,
    },
    /// Chat mode was asked of a model without a chat template.
    #[error("`{model}` has no chat template (no chat_template.jinja and none in tokenizer_config.json): use plain completion mode for base models, or add a chat template to the model folder")]
    NoChatTemplate {
        /// The model.
        model: String,
    },
    /// The chat template failed to compile or render.
    #[error("the chat template of `{model}` failed: {message}")]
    Template {
        /// The model.
        model: String,
        /// The template engine's message.
        message: String,
    },
    /// The tokenizer could not encode the prompt.
    #[error("the tokenizer could not encode the prompt: {0}")]
    Tokenize(String),
    /// The model produced NaN/infinite logits everywhere (broken weights or overflow in f16).
    #[error("the model produced no finite logit at generated token {step}: the weights are broken or overflow in this dtype (try --dtype f32)")]
    NonFiniteLogits {
        /// 0-based index of the token being generated.
        step: usize,
    },
    /// A tensor operation failed.
    #[error("tensor operation failed during generation: {0}")]
    Candle(#[from] candle_core::Error),
}

impl From<crate::gguf::GgufError> for InferError {
    fn from(e: crate::gguf::GgufError) -> Self {
        // Boxed: the GGUF error is large and every inference result carries this type.
        InferError::Gguf(Box::new(e))
    }
}
