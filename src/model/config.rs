//! `config.json` of Hugging Face Llama / Mistral / Qwen2 models, parsed into one
//! [`ModelConfig`] with the same defaults transformers applies.

use super::error::ModelError;
use serde_json::Value;
use std::path::Path;

/// The decoder families this engine implements (they differ only in biases and windows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `model_type: llama` (also SmolLM, TinyLlama, ...).
    Llama,
    /// `model_type: mistral` (sliding-window attention when configured).
    Mistral,
    /// `model_type: qwen2` (q/k/v projections always have biases).
    Qwen2,
}

impl Architecture {
    /// The `model_type` string transformers uses.
    pub fn model_type(&self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
        }
    }
}

/// Llama-3 style RoPE frequency scaling (`rope_type: llama3`).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    /// Overall scaling factor of long wavelengths.
    pub factor: f64,
    /// Wavelengths longer than `original_max / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_max / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// A parsed HF `config.json`; field names follow transformers.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which decoder family.
    pub architecture: Architecture,
    /// Rows of the embedding matrix (and of `lm_head`).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Optional llama3 RoPE scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest context the config declares.
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Sliding attention window (query i sees keys j with i - window < j <= i).
    pub sliding_window: Option<usize>,
    /// q/k/v (and for Llama o) projections carry biases.
    pub attention_bias: bool,
    /// MLP projections carry biases (Llama `mlp_bias`).
    pub mlp_bias: bool,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s).
    pub eos_token_ids: Vec<u32>,
    /// Padding token, if declared.
    pub pad_token_id: Option<u32>,
    /// The original JSON (kept for saving).
    pub raw: Value,
}

fn cfg_err(origin: &str, message: impl Into<String>) -> ModelError {
    ModelError::Config {
        origin: origin.to_string(),
        message: message.into(),
    }
}

fn get_usize(v: &Value, key: &str, origin: &str) -> Result<Option<usize>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            cfg_err(
                origin,
                format!("`{key}` must be a non-negative integer, found {x}"),
            )
        }),
    }
}

fn req_usize(v: &Value, key: &str, origin: &str) -> Result<usize, ModelError> {
    get_usize(v, key, origin)?
        .ok_or_else(|| cfg_err(origin, format!("required field `{key}` is missing")))
}

fn get_f64(v: &Value, key: &str, origin: &str) -> Result<Option<f64>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| cfg_err(origin, format!("`{key}` must be a number, found {x}"))),
    }
}

fn get_bool(v: &Value, key: &str, origin: &str) -> Result<Option<bool>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| cfg_err(origin, format!("`{key}` must be true or false, found {x}"))),
    }
}

fn token_ids(v: &Value, key: &str, origin: &str) -> Result<Vec<u32>, ModelError> {
    let bad = || {
        cfg_err(
            origin,
            format!("`{key}` must be a token id or a list of token ids"),
        )
    };
    match v.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| x.as_u64().map(|n| n as u32).ok_or_else(bad))
            .collect(),
        Some(x) => Ok(vec![x.as_u64().ok_or_else(bad)? as u32]),
    }
}

fn parse_rope_scaling(obj: &Value, origin: &str) -> Result<Option<RopeScaling>, ModelError> {
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let f = |key: &str| -> Result<f64, ModelError> {
                get_f64(obj, key, origin)?
                    .ok_or_else(|| cfg_err(origin, format!("llama3 rope scaling needs `{key}`")))
            };
            Ok(Some(RopeScaling {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: get_usize(
                    obj,
                    "original_max_position_embeddings",
                    origin,
                )?
                .ok_or_else(|| {
                    cfg_err(
                        origin,
                        "llama3 rope scaling needs `original_max_position_embeddings`",
                    )
                })?,
            }))
        }
        other => Err(cfg_err(
            origin,
            format!("rope type `{other}` is not supported (supported: default, llama3)"),
        )),
    }
}

/// The architecture named by `model_type` (Llama, Mistral or Qwen2).
fn architecture_of(raw: &Value, origin: &str) -> Result<Architecture, ModelError> {
    let model_type = raw
        .get("model_type")
        .and_then(|t| t.as_str())
        .ok_or_else(|| cfg_err(origin, "required field `model_type` is missing"))?;
    match model_type {
        "llama" => Ok(Architecture::Llama),
        "mistral" => Ok(Architecture::Mistral),
        "qwen2" => Ok(Architecture::Qwen2),
        other => Err(ModelError::UnsupportedArchitecture {
            origin: origin.to_string(),
            model_type: other.to_string(),
        }),
    }
}

/// RoPE's theta (the architecture's default when unset) and scaling. transformers 5 moved
/// both into `rope_parameters`; older configs keep `rope_theta` / `rope_scaling` at the top
/// level.
fn rope_of(
    raw: &Value,
    origin: &str,
    architecture: Architecture,
) -> Result<(f64, Option<RopeScaling>), ModelError> {
    let rope_params = raw.get("rope_parameters").filter(|v| v.is_object());
    let rope_theta = match rope_params.and_then(|p| p.get("rope_theta")) {
        Some(t) => t
            .as_f64()
            .ok_or_else(|| cfg_err(origin, "`rope_parameters.rope_theta` must be a number"))?,
        None => get_f64(raw, "rope_theta", origin)?.unwrap_or(match architecture {
            Architecture::Qwen2 => 1_000_000.0,
            _ => 10_000.0,
        }),
    };
    let rope_scaling = match rope_params {
        Some(p) => parse_rope_scaling(p, origin)?,
        None => match raw.get("rope_scaling") {
            Some(s) if s.is_object() => parse_rope_scaling(s, origin)?,
            _ => None,
        },
    };
    Ok((rope_theta, rope_scaling))
}

impl ModelConfig {
    /// Reads and parses a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        if !path.exists() {
            return Err(ModelError::MissingFile {
                path: path.to_path_buf(),
                hint: "a Hugging Face model folder needs config.json next to its weights".into(),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses the text of a `config.json`; `origin` names it in errors.
    pub fn from_json_str(json: &str, origin: &str) -> Result<Self, ModelError> {
        let raw: Value = serde_json::from_str(json)
            .map_err(|e| cfg_err(origin, format!("not valid JSON: {e}")))?;
        if !raw.is_object() {
            return Err(cfg_err(origin, "the top level must be a JSON object"));
        }
        let architecture = architecture_of(&raw, origin)?;
        let vocab_size = req_usize(&raw, "vocab_size", origin)?;
        let hidden_size = req_usize(&raw, "hidden_size", origin)?;
        let intermediate_size = req_usize(&raw, "intermediate_size", origin)?;
        let num_hidden_layers = req_usize(&raw, "num_hidden_layers", origin)?;
        let num_attention_heads = req_usize(&raw, "num_attention_heads", origin)?;
        if num_attention_heads == 0 || hidden_size == 0 || vocab_size == 0 {
            return Err(cfg_err(
                origin,
                "vocab_size, hidden_size and num_attention_heads must be positive",
            ));
        }
        let num_key_value_heads =
            get_usize(&raw, "num_key_value_heads", origin)?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(cfg_err(
                origin,
                format!("num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})"),
            ));
        }
        let head_dim = match get_usize(&raw, "head_dim", origin)? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(cfg_err(origin, "hidden_size is not a multiple of num_attention_heads and no head_dim is given"));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim % 2 != 0 || head_dim == 0 {
            return Err(cfg_err(
                origin,
                format!("head_dim must be even for RoPE, found {head_dim}"),
            ));
        }
        let rms_norm_eps = get_f64(&raw, "rms_norm_eps", origin)?.unwrap_or(1e-6);
        let (rope_theta, rope_scaling) = rope_of(&raw, origin, architecture)?;
        let max_position_embeddings =
            get_usize(&raw, "max_position_embeddings", origin)?.unwrap_or(2048);
        let tie_word_embeddings =
            // LlamaConfig, MistralConfig and Qwen2Config all default to untied.
            get_bool(&raw, "tie_word_embeddings", origin)?.unwrap_or(false);
        let sliding_window = match architecture {
            Architecture::Llama => None,
            Architecture::Mistral => get_usize(&raw, "sliding_window", origin)?,
            Architecture::Qwen2 => {
                if get_bool(&raw, "use_sliding_window", origin)?.unwrap_or(false) {
                    get_usize(&raw, "sliding_window", origin)?
                } else {
                    None
                }
            }
        };
        let attention_bias = match architecture {
            Architecture::Llama => get_bool(&raw, "attention_bias", origin)?.unwrap_or(false),
            Architecture::Mistral => false,
            Architecture::Qwen2 => true,
        };
        let mlp_bias = match architecture {
            Architecture::Llama => get_bool(&raw, "mlp_bias", origin)?.unwrap_or(false),
            _ => false,
        };
        let bos_token_id = token_ids(&raw, "bos_token_id", origin)?.first().copied();
        let eos_token_ids = token_ids(&raw, "eos_token_id", origin)?;
        let pad_token_id = token_ids(&raw, "pad_token_id", origin)?.first().copied();
        Ok(Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            sliding_window,
            attention_bias,
            mlp_bias,
            bos_token_id,
            eos_token_ids,
            pad_token_id,
            raw,
        })
    }

    /// Whether q/k/v projections carry a bias.
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias
    }

    /// Whether `o_proj` carries a bias (Llama with `attention_bias` only; Qwen2 never).
    pub fn o_bias(&self) -> bool {
        self.architecture == Architecture::Llama && self.attention_bias
    }

    /// The parameters of decoder layer `layer`, HF names and shapes, in model order.
    pub fn layer_parameter_shapes(&self, layer: usize) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let i = self.intermediate_size;
        let p = format!("model.layers.{layer}");
        let mut out = Vec::new();
        let mut lin = |name: &str, out_f: usize, in_f: usize, bias: bool| {
            out.push((format!("{p}.{name}.weight"), vec![out_f, in_f]));
            if bias {
                out.push((format!("{p}.{name}.bias"), vec![out_f]));
            }
        };
        lin("self_attn.q_proj", q, h, self.qkv_bias());
        lin("self_attn.k_proj", kv, h, self.qkv_bias());
        lin("self_attn.v_proj", kv, h, self.qkv_bias());
        lin("self_attn.o_proj", h, q, self.o_bias());
        lin("mlp.gate_proj", i, h, self.mlp_bias);
        lin("mlp.up_proj", i, h, self.mlp_bias);
        lin("mlp.down_proj", h, i, self.mlp_bias);
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        out
    }

    /// Every parameter as transformers builds it: HF names and shapes, in model order
    /// (`lm_head.weight` only when untied).
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![self.vocab_size, self.hidden_size],
        )];
        for l in 0..self.num_hidden_layers {
            out.extend(self.layer_parameter_shapes(l));
        }
        out.push(("model.norm.weight".to_string(), vec![self.hidden_size]));
        if !self.tie_word_embeddings {
            out.push((
                "lm_head.weight".to_string(),
                vec![self.vocab_size, self.hidden_size],
            ));
        }
        out
    }

    /// Number of parameters exactly as transformers counts them (tied weights once).
    pub fn num_parameters(&self) -> u64 {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }

    /// The sliding window of decoder layer `layer`, as transformers assigns it: an explicit
    /// `layer_types` list wins ("sliding_attention" layers get the window); otherwise Qwen2
    /// slides only from layer `max_window_layers` (default 28) on, and Mistral everywhere.
    pub fn layer_sliding_window(&self, layer: usize) -> Option<usize> {
        let window = self.sliding_window?;
        if let Some(types) = self.raw.get("layer_types").and_then(Value::as_array) {
            return (types.get(layer).and_then(Value::as_str) == Some("sliding_attention"))
                .then_some(window);
        }
        match self.architecture {
            Architecture::Qwen2 => {
                let from = self
                    .raw
                    .get("max_window_layers")
                    .and_then(Value::as_u64)
                    .unwrap_or(28) as usize;
                (layer >= from).then_some(window)
            }
            _ => Some(window),
        }
    }

    /// Query heads per key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }
}
