//! The model half of a GGUF header: `general.*` and `{arch}.*` keys from `config.json`, as
//! llama.cpp's `convert_hf_to_gguf.py` writes them for Llama, Mistral and Qwen2, and the
//! `rope_freqs` tensor of Llama-3 RoPE scaling.

use crate::model::{Architecture, ModelConfig};

use super::error::GgufError;
use super::quant::GgufQuant;
use super::writer::MetaValue;

/// llama.cpp's architecture name: Mistral is a Llama to llama.cpp (as in its converter).
pub fn gguf_architecture(cfg: &ModelConfig) -> &'static str {
    match cfg.architecture {
        Architecture::Llama | Architecture::Mistral => "llama",
        Architecture::Qwen2 => "qwen2",
    }
}

/// Whether llama.cpp's RoPE for this architecture rotates adjacent pairs, so the Q/K rows
/// must be permuted from transformers' half-split order (llama's "norm" RoPE; qwen2 uses
/// "neox", the same order as transformers).
pub fn permutes_qk(cfg: &ModelConfig) -> bool {
    gguf_architecture(cfg) == "llama"
}

/// Refuses what llama.cpp would run differently from transformers.
pub fn check_supported(cfg: &ModelConfig) -> Result<(), GgufError> {
    if cfg.architecture == Architecture::Qwen2 && cfg.sliding_window.is_some() {
        return Err(GgufError::Unsupported {
            what: "a Qwen2 model with `use_sliding_window: true`".into(),
            hint: "llama.cpp's qwen2 runs full attention; export a Hugging Face folder instead"
                .into(),
        });
    }
    if !cfg.head_dim.is_multiple_of(2) {
        return Err(GgufError::Unsupported {
            what: format!("head width {}", cfg.head_dim),
            hint: "llama.cpp's RoPE needs an even head width".into(),
        });
    }
    Ok(())
}

/// `general.*` and `{arch}.*` keys. `name` is the model's display name.
pub fn model_metadata(cfg: &ModelConfig, quant: GgufQuant, name: &str) -> Vec<(String, MetaValue)> {
    let arch = gguf_architecture(cfg);
    let key = |k: &str| format!("{arch}.{k}");
    let mut kv = vec![
        (
            "general.architecture".to_string(),
            MetaValue::Str(arch.into()),
        ),
        ("general.type".to_string(), MetaValue::Str("model".into())),
        ("general.name".to_string(), MetaValue::Str(name.to_string())),
        (
            "general.file_type".to_string(),
            MetaValue::U32(quant.file_type()),
        ),
        // ggml's quantization format revision (2 since 2023; what llama.cpp writes today).
        (
            "general.quantization_version".to_string(),
            MetaValue::U32(2),
        ),
        (key("vocab_size"), MetaValue::U32(cfg.vocab_size as u32)),
        (
            key("context_length"),
            MetaValue::U32(cfg.max_position_embeddings as u32),
        ),
        (
            key("embedding_length"),
            MetaValue::U32(cfg.hidden_size as u32),
        ),
        (
            key("block_count"),
            MetaValue::U32(cfg.num_hidden_layers as u32),
        ),
        (
            key("feed_forward_length"),
            MetaValue::U32(cfg.intermediate_size as u32),
        ),
        (
            key("attention.head_count"),
            MetaValue::U32(cfg.num_attention_heads as u32),
        ),
        (
            key("attention.head_count_kv"),
            MetaValue::U32(cfg.num_key_value_heads as u32),
        ),
        (
            key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(cfg.rms_norm_eps as f32),
        ),
        (key("rope.freq_base"), MetaValue::F32(cfg.rope_theta as f32)),
        (
            key("rope.dimension_count"),
            MetaValue::U32(cfg.head_dim as u32),
        ),
    ];
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size {
        kv.push((
            key("attention.key_length"),
            MetaValue::U32(cfg.head_dim as u32),
        ));
        kv.push((
            key("attention.value_length"),
            MetaValue::U32(cfg.head_dim as u32),
        ));
    }
    if let (Architecture::Mistral, Some(window)) = (cfg.architecture, cfg.sliding_window) {
        kv.push((
            key("attention.sliding_window"),
            MetaValue::U32(window as u32),
        ));
    }
    kv
}

/// Llama-3 RoPE scaling as llama.cpp stores it: one factor per rotated pair, in a
/// `rope_freqs.weight` vector (its converter's `generate_extra_tensors`).
pub fn rope_freq_factors(cfg: &ModelConfig) -> Option<Vec<f32>> {
    let s = cfg.rope_scaling.as_ref()?;
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    let factors = (0..cfg.head_dim / 2)
        .map(|i| {
            let freq = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / cfg.head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                1.0 / ((1.0 - smooth) / s.factor + smooth)
            };
            f as f32
        })
        .collect();
    Some(factors)
}
