//! A model + tokenizer ready to answer prompts: loading (base folder, fine-tuned folder, or
//! base + PEFT adapter), prompt formatting (chat template or plain completion) and the
//! generation loop.

use super::engine::{InferModel, KvCache};
use super::error::InferError;
use super::gguf_model::{GgufModel, GgufSession};
use super::sampling::{Sampler, SamplingParams};
use super::text::{IncrementalDecoder, StopMatcher};
use crate::data::{ChatMessage, ChatTemplate, TemplateTokens, TokenizerBundle};
use crate::model::{resolve_model, CausalLm, ModelConfig, ModelError};
use candle_core::{DType, Device};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

mod model_files;

pub(crate) use model_files::eos_ids;
use model_files::*;

/// Prompt tokens decoded with the output so the first output token decodes in context
/// (SentencePiece drops a leading space when a token is decoded alone).
const DECODE_CONTEXT_TOKENS: usize = 5;

/// What to load.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// A model folder (base or fully fine-tuned HF folder) or a hub id.
    pub model: String,
    /// A PEFT LoRA adapter folder to attach (unmerged) to `model`.
    pub adapter: Option<PathBuf>,
    /// Where to read the tokenizer from instead (a folder or hub id). By default: the
    /// adapter folder when it holds `tokenizer.json` (training may change the chat
    /// template), else the model folder.
    pub tokenizer: Option<String>,
    /// Parameter dtype (f32 is the fast, exact choice on CPUs).
    pub dtype: DType,
    /// The device to run on.
    pub device: Device,
    /// Refuse an adapter whose `base_model_name_or_path` names another model.
    pub check_adapter_base: bool,
    /// Run the base quantized (QLoRA's base, e.g. to try an adapter trained on it).
    pub quantize: crate::settings::Quantization,
}

impl ModelSpec {
    /// `model` in f32 on the CPU, no adapter.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            adapter: None,
            tokenizer: None,
            dtype: DType::F32,
            device: Device::Cpu,
            quantize: crate::settings::Quantization::None,
            check_adapter_base: true,
        }
    }

    /// The same with a PEFT adapter attached.
    pub fn with_adapter(mut self, adapter: impl Into<PathBuf>) -> Self {
        self.adapter = Some(adapter.into());
        self
    }
}

/// What the model is asked.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Plain completion (base models): the text is tokenised as is, with the tokenizer's
    /// special tokens (e.g. a BOS), and continued.
    Completion(String),
    /// A conversation rendered with the model's chat template plus the assistant prefix.
    Chat {
        /// A system prompt put first (when `None`, the template's default applies).
        system: Option<String>,
        /// The turns so far (`user` / `assistant`), the last one normally `user`.
        messages: Vec<ChatMessage>,
    },
    /// Token ids fed as they are.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// A one-turn chat.
    pub fn chat(system: Option<&str>, user: &str) -> Self {
        Prompt::Chat {
            system: system.map(str::to_string),
            messages: vec![ChatMessage::new("user", user)],
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// The output contained this stop string.
    StopString(String),
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The model's context (`max_position_embeddings`) is full.
    ContextFull,
    /// The caller cancelled (or stopped listening).
    Cancelled,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::Eos => write!(f, "end of sequence"),
            StopReason::StopString(s) => write!(f, "stop string {s:?}"),
            StopReason::MaxTokens => write!(f, "max new tokens"),
            StopReason::ContextFull => write!(f, "context full"),
            StopReason::Cancelled => write!(f, "cancelled"),
        }
    }
}

/// The result of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationOutput {
    /// Every generated id (an end-of-sequence token included).
    pub token_ids: Vec<u32>,
    /// The text shown: exactly the concatenation of the streamed token texts (special
    /// tokens skipped, a stop string cut off; on cancel, text held back for a possible stop
    /// string or an unfinished character is dropped, and so is a character the end cut).
    pub text: String,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Generated tokens (`token_ids.len()`).
    pub tokens: usize,
    /// `tokens / total_secs`: end-to-end rate, prompt processing included.
    pub tokens_per_sec: f64,
    /// Rate of the tokens after the first (`(tokens - 1) / decode_secs`), 0 with one token.
    pub decode_tokens_per_sec: f64,
    /// Seconds spent on the prompt (which yields the first token).
    pub prefill_secs: f64,
    /// Seconds spent on the tokens after the first.
    pub decode_secs: f64,
    /// Seconds from the start of the prompt pass to the end.
    pub total_secs: f64,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// The output ended inside a character (`max_new_tokens` or the context cut it between
    /// its byte tokens); its bytes are left out of `text` rather than shown as U+FFFD.
    pub cut_character: bool,
}

/// One streamed token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenEvent {
    /// The token id.
    pub id: u32,
    /// The text released with this token: may be empty (part of a multi-byte character, a
    /// special token, or text held back while it may be a stop string) or hold several
    /// characters (what was held back).
    pub text: String,
}

/// A loaded model with its tokenizer, chat template and end-of-sequence ids.
pub struct Generator {
    model: Backend,
    tokenizer: TokenizerBundle,
    template: Option<ChatTemplate>,
    eos_ids: Vec<u32>,
    name: String,
    adapter: Option<PathBuf>,
}

/// What runs the tokens: the project's decoder, or a GGUF file through candle-transformers.
enum Backend {
    Native(Box<InferModel>),
    Gguf(Box<GgufModel>),
}

/// One sequence in flight: the cache (the GGUF model keeps its own, behind a lock).
enum Sequence<'a> {
    Native(&'a InferModel, KvCache),
    Gguf(GgufSession<'a>),
}

impl Sequence<'_> {
    fn forward(&mut self, ids: &[u32]) -> Result<Vec<f32>, InferError> {
        match self {
            Sequence::Native(model, cache) => model.forward(ids, cache),
            Sequence::Gguf(session) => session.forward(ids),
        }
    }
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator")
            .field("name", &self.name)
            .field("adapter", &self.adapter)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

impl Generator {
    /// Loads the model (and adapter) and its tokenizer.
    pub fn load(spec: &ModelSpec) -> Result<Self, InferError> {
        let as_path = Path::new(&spec.model);
        if as_path.is_file()
            && as_path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            return Self::load_gguf(spec);
        }
        let files = resolve_model(&spec.model)?;
        let mut lm =
            CausalLm::load_files_quantized(&files, spec.dtype, &spec.device, spec.quantize)?;
        let mut name = spec.model.clone();
        if let Some(adapter) = &spec.adapter {
            if spec.check_adapter_base {
                if let Some(base) = adapter_base_name(adapter) {
                    let wanted = short_name(&base);
                    if !model_names(&spec.model, &files.dir, lm.config()).contains(&wanted) {
                        return Err(InferError::AdapterBaseMismatch {
                            adapter: adapter.clone(),
                            adapter_base: base,
                            model: spec.model.clone(),
                        });
                    }
                }
            }
            lm.load_adapter(adapter).map_err(|e| match e {
                ModelError::ShapeMismatch {
                    name: tensor,
                    expected,
                    found,
                    ..
                } => InferError::AdapterShapeMismatch {
                    adapter: adapter.clone(),
                    model: spec.model.clone(),
                    tensor,
                    expected,
                    found,
                },
                other => InferError::Model(other),
            })?;
            name = format!("{} + {}", spec.model, adapter.display());
        }
        let tokenizer = match (&spec.tokenizer, &spec.adapter) {
            (Some(src), _) => TokenizerBundle::from_source(src)?,
            (None, Some(a)) if a.join("tokenizer.json").is_file() => TokenizerBundle::load(a)?,
            (None, _) => TokenizerBundle::load(&files.dir)?,
        };
        let mut dirs: Vec<&Path> = vec![files.dir.as_path()];
        if let Some(a) = &spec.adapter {
            dirs.push(a.as_path());
        }
        let eos = eos_ids(lm.config(), &dirs, &tokenizer);
        let mut g = Self::from_model(&lm, tokenizer, &name)?;
        g.eos_ids = eos;
        g.adapter = spec.adapter.clone();
        Ok(g)
    }

    /// Loads a GGUF file (`spec.model`), with its own tokenizer unless `spec.tokenizer`
    /// names another; adapters and quantization settings do not apply (the file is final).
    fn load_gguf(spec: &ModelSpec) -> Result<Self, InferError> {
        let path = PathBuf::from(&spec.model);
        if let Some(adapter) = &spec.adapter {
            return Err(InferError::InvalidSetting {
                setting: "adapter",
                message: format!(
                    "`{}` is a GGUF file, whose adapter (if any) is already merged; load {} on the Hugging Face model instead",
                    path.display(),
                    adapter.display()
                ),
            });
        }
        let (model, own_tokenizer) = GgufModel::open(&path, &spec.device)?;
        let tokenizer = match &spec.tokenizer {
            Some(src) => TokenizerBundle::from_source(src)?,
            None => own_tokenizer?,
        };
        let name = spec.model.clone();
        let template = template_of(&tokenizer, &name)?;
        let eos_ids = eos_ids(model.config(), &[], &tokenizer);
        Ok(Self {
            model: Backend::Gguf(Box::new(model)),
            tokenizer,
            template,
            eos_ids,
            name,
            adapter: None,
        })
    }

    /// Wraps an already loaded model (its storage is shared, not copied) with `tokenizer`;
    /// `name` is used in messages.
    pub fn from_model(
        model: &CausalLm,
        tokenizer: TokenizerBundle,
        name: &str,
    ) -> Result<Self, InferError> {
        let config = model.config();
        let tok_vocab = tokenizer.vocab_size();
        if tok_vocab > config.vocab_size {
            return Err(InferError::VocabMismatch {
                tokenizer: tokenizer.origin.clone(),
                tokenizer_vocab: tok_vocab,
                model: name.to_string(),
                model_vocab: config.vocab_size,
            });
        }
        let template = template_of(&tokenizer, name)?;
        let eos_ids = eos_ids(config, &[], &tokenizer);
        Ok(Self {
            model: Backend::Native(Box::new(InferModel::from_causal_lm(model)?)),
            tokenizer,
            template,
            eos_ids,
            name: name.to_string(),
            adapter: None,
        })
    }

    /// The model as given (`folder` or `folder + adapter`), for titles and messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The adapter folder attached, if any.
    pub fn adapter(&self) -> Option<&Path> {
        self.adapter.as_deref()
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        match &self.model {
            Backend::Native(m) => m.config(),
            Backend::Gguf(m) => m.config(),
        }
    }

    /// The inference model (for token-level use); `None` for a GGUF file.
    pub fn model(&self) -> Option<&InferModel> {
        match &self.model {
            Backend::Native(m) => Some(m),
            Backend::Gguf(_) => None,
        }
    }

    /// Whether this runs a GGUF file.
    pub fn is_gguf(&self) -> bool {
        matches!(self.model, Backend::Gguf(_))
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &TokenizerBundle {
        &self.tokenizer
    }

    /// Whether chat mode is available (the tokenizer has a chat template).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Ids that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Replaces the end-of-sequence ids.
    pub fn set_eos_token_ids(&mut self, ids: Vec<u32>) {
        self.eos_ids = ids;
    }

    /// The most tokens (prompt + output) the model handles.
    pub fn context_tokens(&self) -> usize {
        self.config().max_position_embeddings
    }

    /// The exact text the model sees for `prompt` (the rendered chat template in chat
    /// mode); `None` for [`Prompt::Tokens`].
    pub fn render_prompt(&self, prompt: &Prompt) -> Result<Option<String>, InferError> {
        match prompt {
            Prompt::Completion(text) => {
                if text.trim().is_empty() {
                    return Err(InferError::EmptyPrompt);
                }
                Ok(Some(text.clone()))
            }
            Prompt::Chat { system, messages } => {
                if messages.last().is_none_or(|m| m.content.trim().is_empty()) {
                    return Err(InferError::EmptyPrompt);
                }
                let template =
                    self.template
                        .as_ref()
                        .ok_or_else(|| InferError::NoChatTemplate {
                            model: self.name.clone(),
                        })?;
                let mut all = Vec::with_capacity(messages.len() + 1);
                if let Some(s) = system {
                    all.push(ChatMessage::new("system", s.as_str()));
                }
                all.extend(messages.iter().cloned());
                let text = template
                    .render(&all, true)
                    .map_err(|message| InferError::Template {
                        model: self.name.clone(),
                        message,
                    })?;
                Ok(Some(text))
            }
            Prompt::Tokens(_) => Ok(None),
        }
    }

    /// The prompt's token ids: completions with the tokenizer's special tokens, rendered
    /// chats without (the template writes them, as transformers' `apply_chat_template`).
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, InferError> {
        let ids = match (prompt, self.render_prompt(prompt)?) {
            (Prompt::Tokens(ids), _) => ids.clone(),
            (Prompt::Completion(_), Some(text)) => self
                .tokenizer
                .encode(&text, true)
                .map_err(InferError::Tokenize)?,
            (_, Some(text)) => self
                .tokenizer
                .encode(&text, false)
                .map_err(InferError::Tokenize)?,
            (_, None) => Vec::new(),
        };
        if ids.is_empty() {
            return Err(InferError::EmptyPrompt);
        }
        Ok(ids)
    }

    /// Generates a reply to `prompt`, calling `on_token` for every token (return `false`
    /// from it to stop). `cancel` is checked before each token.
    pub fn generate(
        &self,
        prompt: &Prompt,
        params: &SamplingParams,
        cancel: &AtomicBool,
        on_token: &mut dyn FnMut(TokenEvent) -> bool,
    ) -> Result<GenerationOutput, InferError> {
        params.validate()?;
        let ids = self.encode_prompt(prompt)?;
        self.generate_ids(&ids, params, cancel, on_token)
    }

    /// [`Generator::generate`] from token ids.
    pub fn generate_ids(
        &self,
        prompt_ids: &[u32],
        params: &SamplingParams,
        cancel: &AtomicBool,
        on_token: &mut dyn FnMut(TokenEvent) -> bool,
    ) -> Result<GenerationOutput, InferError> {
        params.validate()?;
        if prompt_ids.is_empty() {
            return Err(InferError::EmptyPrompt);
        }
        let context = self.context_tokens();
        if prompt_ids.len() >= context {
            return Err(InferError::PromptTooLong {
                prompt_tokens: prompt_ids.len(),
                context_tokens: context,
                model: self.name.clone(),
            });
        }
        let start = Instant::now();
        let mut seq = match &self.model {
            Backend::Native(m) => Sequence::Native(
                m,
                m.new_cache((prompt_ids.len() + params.max_new_tokens).min(context)),
            ),
            Backend::Gguf(m) => Sequence::Gguf(m.session()),
        };
        let mut logits = seq.forward(prompt_ids)?;
        let prefill_secs = start.elapsed().as_secs_f64();

        let tok = &self.tokenizer.tokenizer;
        let ctx_from = prompt_ids.len().saturating_sub(DECODE_CONTEXT_TOKENS);
        let mut decoder = IncrementalDecoder::new(
            |ids: &[u32]| tok.decode(ids, true).unwrap_or_default(),
            &prompt_ids[ctx_from..],
        );
        let mut stops = StopMatcher::new(&params.stop_strings);
        let mut sampler = Sampler::new(params);
        let mut all_ids = prompt_ids.to_vec();
        let mut generated = Vec::new();
        let mut text = String::new();
        let stop_reason = loop {
            if cancel.load(Ordering::Relaxed) {
                break StopReason::Cancelled;
            }
            let id =
                sampler
                    .next_token(&mut logits, &all_ids)
                    .ok_or(InferError::NonFiniteLogits {
                        step: generated.len(),
                    })?;
            generated.push(id);
            all_ids.push(id);
            let is_eos = params.stop_on_eos && self.eos_ids.contains(&id);
            let check = stops.push(&decoder.push(id));
            let mut release = check.release;
            let reason = if let Some(s) = check.stopped {
                Some(StopReason::StopString(s))
            } else if is_eos {
                Some(StopReason::Eos)
            } else if generated.len() >= params.max_new_tokens {
                Some(StopReason::MaxTokens)
            } else if all_ids.len() >= context {
                Some(StopReason::ContextFull)
            } else {
                None
            };
            if matches!(
                reason,
                Some(StopReason::Eos | StopReason::MaxTokens | StopReason::ContextFull)
            ) {
                // The end is known before this token is sent: release all held text with it.
                let tail = decoder.flush();
                release.push_str(&stops.push(&tail).release);
                release.push_str(&stops.flush());
            }
            text.push_str(&release);
            if !on_token(TokenEvent { id, text: release }) {
                break StopReason::Cancelled;
            }
            if let Some(r) = reason {
                break r;
            }
            logits = seq.forward(&[id])?;
        };
        let total_secs = start.elapsed().as_secs_f64();
        let decode_secs = (total_secs - prefill_secs).max(0.0);
        let n = generated.len();
        Ok(GenerationOutput {
            prompt_tokens: prompt_ids.len(),
            tokens: n,
            tokens_per_sec: if total_secs > 0.0 {
                n as f64 / total_secs
            } else {
                0.0
            },
            decode_tokens_per_sec: if n > 1 && decode_secs > 0.0 {
                (n - 1) as f64 / decode_secs
            } else {
                0.0
            },
            prefill_secs,
            decode_secs,
            total_secs,
            token_ids: generated,
            text,
            stop_reason,
            cut_character: decoder.dropped_partial(),
        })
    }
}
