//! The tokenizer stored in a GGUF file, rebuilt as a Hugging Face `tokenizers` tokenizer, so
//! the Playground and `tunestudio generate` chat with an exported file using exactly what the
//! file says (tokens, merges, pre-tokenizer, special tokens, chat template) — what the user
//! ships is what they test. Byte-level BPE (`gpt2`) files only; a SentencePiece (`llama`)
//! file's merges are not stored, so its tokenizer is taken from the model folder instead.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value as GValue};
use serde_json::{json, Value};

use super::error::GgufError;
use super::vocab::token_type;

/// Llama 3's pre-tokenizer regex (llama.cpp's `llama-bpe`).
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's (digits one by one).
const REGEX_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The tokenizer of a GGUF file: `tokenizer.json` and `tokenizer_config.json` equivalents.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    /// What `tokenizer.json` would hold.
    pub tokenizer_json: Value,
    /// What `tokenizer_config.json` would hold (special tokens, `add_bos_token`).
    pub config: Value,
    /// `tokenizer.chat_template`, if present.
    pub chat_template: Option<String>,
}

fn strings(v: Option<&GValue>) -> Option<Vec<String>> {
    v?.to_vec()
        .ok()?
        .iter()
        .map(|x| x.to_string().ok().cloned())
        .collect()
}

fn ints(v: Option<&GValue>) -> Option<Vec<i32>> {
    v?.to_vec().ok()?.iter().map(|x| x.to_i32().ok()).collect()
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split_then_bytes(regex: &str) -> Value {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        byte_level(false)
    ]})
}

/// Reads the tokenizer of a parsed GGUF file (`path` names it in messages).
pub fn tokenizer_from_gguf(content: &Content, path: &Path) -> Result<GgufTokenizer, GgufError> {
    let md = &content.metadata;
    let invalid = |m: &str| GgufError::Invalid {
        path: path.to_path_buf(),
        message: m.to_string(),
    };
    let model = md
        .get("tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok())
        .ok_or_else(|| invalid("it has no tokenizer (tokenizer.ggml.model)"))?;
    if model != "gpt2" {
        return Err(GgufError::Invalid {
            path: path.to_path_buf(),
            message: format!(
                "its `{model}` tokenizer stores no merges in GGUF, so tunestudio cannot rebuild it; give the model folder's tokenizer (--tokenizer <folder>)"
            ),
        });
    }
    let (normalizer, pre_tokenizer) = pre_tokenizer_of(content, path)?;
    let tokens = strings(md.get("tokenizer.ggml.tokens"))
        .ok_or_else(|| invalid("tokenizer.ggml.tokens is missing or not a list of strings"))?;
    let types = ints(md.get("tokenizer.ggml.token_type"))
        .unwrap_or_else(|| vec![token_type::NORMAL; tokens.len()]);
    let merges = strings(md.get("tokenizer.ggml.merges"))
        .ok_or_else(|| invalid("tokenizer.ggml.merges is missing"))?;
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(**ty, token_type::CONTROL | token_type::USER_DEFINED))
        .map(|(id, (t, ty))| {
            json!({"id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": *ty == token_type::CONTROL})
        })
        .collect();
    let id_text = |key: &str| -> Option<String> {
        let id = md.get(key)?.to_u32().ok()? as usize;
        tokens.get(id).cloned()
    };
    let add_bos = md
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false);
    let bos = id_text("tokenizer.ggml.bos_token_id");
    let post = post_processor(bos.as_deref(), add_bos, &tokens);
    let tokenizer_json = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    });
    let mut config: HashMap<&str, Value> = HashMap::new();
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(t) = id_text(key) {
            config.insert(name, json!(t));
        }
    }
    config.insert("add_bos_token", json!(add_bos));
    Ok(GgufTokenizer {
        tokenizer_json,
        config: json!(config),
        chat_template: md
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .cloned(),
    })
}

/// The normalizer and pre-tokenizer of `tokenizer.ggml.pre`.
fn pre_tokenizer_of(content: &Content, path: &Path) -> Result<(Value, Value), GgufError> {
    let md = &content.metadata;
    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_else(|| "gpt-2".into());
    Ok(match pre.as_str() {
        // `gpt-2` is llama.cpp's name; `gpt2` was written by tunestudio before it matched.
        "gpt-2" | "gpt2" | "default" => (Value::Null, byte_level(true)),
        "smollm" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        ),
        "llama-bpe" | "llama3" => (Value::Null, split_then_bytes(REGEX_LLAMA3)),
        "qwen2" => (json!({"type": "NFC"}), split_then_bytes(REGEX_QWEN2)),
        other => {
            return Err(GgufError::Invalid {
                path: path.to_path_buf(),
                message: format!(
                    "its pre-tokenizer `{other}` is not one tunestudio rebuilds (gpt-2, smollm, llama-bpe, qwen2); give the model folder's tokenizer (--tokenizer <folder>)"
                ),
            })
        }
    })
}

/// A template that puts BOS first when the file says `add_bos_token`.
fn post_processor(bos: Option<&str>, add_bos: bool, tokens: &[String]) -> Value {
    match (bos, add_bos) {
        (Some(b), true) => json!({"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b: {"id": b, "ids": [tokens.iter().position(|t| t == b)], "tokens": [b]}}}),
        _ => Value::Null,
    }
}
