//! The tokenizer half of a GGUF header, from a Hugging Face folder (`tokenizer.json`,
//! `tokenizer_config.json`, `chat_template.jinja`, `config.json`), as llama.cpp's converter
//! writes it:
//! - byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2) → `tokenizer.ggml.model = "gpt2"` with
//!   its merges and the pre-tokenizer llama.cpp must use (`tokenizer.ggml.pre`), read from
//!   the pre-tokenizer's structure and regex rather than a hash of test strings;
//! - SentencePiece-style BPE (byte fallback, `▁` for spaces: Mistral, DictaLM, Llama 2) →
//!   `"llama"` with one score per token. The scores are minus the rank of the merge that
//!   makes the token, so llama.cpp's highest-score-first merging replays exactly the BPE
//!   merge order (its converter's `-1000` for every token would merge left to right).
//!
//! Anything else (WordPiece, Unigram, an unknown pre-tokenizer) is refused with the reason:
//! a file llama.cpp tokenizes differently from transformers answers garbled.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::model::ModelConfig;

use super::error::GgufError;
use super::writer::MetaValue;

/// llama.cpp's token types (`llama_token_type`), the same numbers as SentencePiece's.
pub mod token_type {
    /// An ordinary token.
    pub const NORMAL: i32 = 1;
    /// The unknown token.
    pub const UNKNOWN: i32 = 2;
    /// A special token (never produced from text unless parsed as special).
    pub const CONTROL: i32 = 3;
    /// An added, non-special token.
    pub const USER_DEFINED: i32 = 4;
    /// A padding slot past the tokenizer's vocabulary.
    pub const UNUSED: i32 = 5;
    /// A `<0xNN>` byte-fallback token.
    pub const BYTE: i32 = 6;
}

/// The tokenizer metadata plus what the Ollama Modelfile needs.
#[derive(Debug, Clone, PartialEq)]
pub struct VocabMetadata {
    /// `tokenizer.*` keys.
    pub metadata: Vec<(String, MetaValue)>,
    /// Texts of the tokens that end a turn (EOS and the template's end-of-turn markers).
    pub stop_tokens: Vec<String>,
    /// The chat template, if the model has one.
    pub chat_template: Option<String>,
}

fn tok_err(path: &Path, message: impl Into<String>) -> GgufError {
    GgufError::Tokenizer {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>, GgufError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| tok_err(path, e.to_string()))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| tok_err(path, format!("not valid JSON: {e}")))
}

/// A special token named in `tokenizer_config.json` (`"</s>"` or `{"content": "</s>"}`).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Which pre-tokenizer llama.cpp must use for a byte-level BPE `tokenizer.json`.
fn byte_level_pre(tok: &Value, path: &Path) -> Result<&'static str, GgufError> {
    let pre = tok.get("pre_tokenizer").cloned().unwrap_or(Value::Null);
    let kind = |v: &Value| {
        v.get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let parts: Vec<Value> = match kind(&pre).as_str() {
        "Sequence" => pre
            .get("pretokenizers")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default(),
        "" => vec![],
        _ => vec![pre.clone()],
    };
    let kinds: Vec<String> = parts.iter().map(kind).collect();
    let byte_level_regex = |v: &Value| v.get("use_regex").and_then(Value::as_bool).unwrap_or(true);
    let split_regex = |v: &Value| {
        v.get("pattern")
            .and_then(|p| p.get("Regex"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let found = match kinds
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        // llama.cpp spells GPT-2's pre-tokenizer `gpt-2` (its model type is `gpt2`); `gpt2`
        // here makes llama.cpp refuse the file ("unknown pre-tokenizer type").
        ["ByteLevel"] if byte_level_regex(&parts[0]) => Some("gpt-2"),
        ["Digits", "ByteLevel"]
            if parts[0].get("individual_digits").and_then(Value::as_bool) == Some(true)
                && byte_level_regex(&parts[1]) =>
        {
            Some("smollm")
        }
        ["Split", "ByteLevel"] if !byte_level_regex(&parts[1]) => {
            let re = split_regex(&parts[0]);
            let words = r"[^\r\n\p{L}\p{N}]?\p{L}+";
            if re.contains(words) && re.contains(r"\p{N}{1,3}") {
                Some("llama-bpe")
            } else if re.contains(words) && re.contains(r"|\p{N}|") {
                Some("qwen2")
            } else {
                None
            }
        }
        _ => None,
    };
    found.ok_or_else(|| GgufError::Unsupported {
        what: format!("the pre-tokenizer of {}", path.display()),
        hint: format!(
            "llama.cpp would split text differently from transformers ({}); supported are GPT-2, SmolLM, Llama 3 and Qwen2 byte-level BPE and SentencePiece BPE",
            if kinds.is_empty() { "none".to_string() } else { kinds.join(" + ") }
        ),
    })
}

/// Whether a BPE `tokenizer.json` is SentencePiece-style (`▁` for spaces, byte fallback).
fn is_sentencepiece(tok: &Value) -> bool {
    let model = &tok["model"];
    let byte_fallback = model.get("byte_fallback").and_then(Value::as_bool) == Some(true);
    let text = |k: &str| tok.get(k).map(Value::to_string).unwrap_or_default();
    byte_fallback
        && (text("normalizer").contains('▁') || text("pre_tokenizer").contains("Metaspace"))
}

/// Merges as `"a b"` strings (tokenizers writes `["a", "b"]` pairs since 0.20).
fn merges_of(model: &Value) -> Vec<String> {
    model
        .get("merges")
        .and_then(Value::as_array)
        .map(|m| {
            m.iter()
                .filter_map(|x| match x {
                    Value::String(s) => Some(s.clone()),
                    Value::Array(pair) => {
                        let a = pair.first()?.as_str()?;
                        let b = pair.get(1)?.as_str()?;
                        Some(format!("{a} {b}"))
                    }
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The chat template: `chat_template.jinja`, else `tokenizer_config.json`'s (a string, or
/// the `default` of a list of named templates).
pub fn chat_template(model_dir: &Path, tok_config: Option<&Value>) -> Option<String> {
    if let Ok(text) = std::fs::read_to_string(model_dir.join("chat_template.jinja")) {
        return Some(text);
    }
    match tok_config?.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}

/// Reads the tokenizer of `model_dir` into GGUF metadata for a model of `cfg`.
pub fn vocab_metadata(model_dir: &Path, cfg: &ModelConfig) -> Result<VocabMetadata, GgufError> {
    let path = model_dir.join("tokenizer.json");
    let tok = read_json(&path)?.ok_or_else(|| {
        tok_err(
            &path,
            "missing: GGUF needs the tokenizer inside the file (copy tokenizer.json into the model folder)",
        )
    })?;
    let tok_config = read_json(&model_dir.join("tokenizer_config.json"))?;
    let model = &tok["model"];
    let model_type = model.get("type").and_then(Value::as_str).unwrap_or("BPE");
    if model_type != "BPE" {
        return Err(GgufError::Unsupported {
            what: format!("a {model_type} tokenizer ({})", path.display()),
            hint: "only BPE tokenizers (byte-level or SentencePiece-style) are written".into(),
        });
    }
    let sentencepiece = is_sentencepiece(&tok);
    let pre = if sentencepiece {
        None
    } else {
        Some(byte_level_pre(&tok, &path)?)
    };

    let (by_id, added) = token_table(&tok);
    check_fits(&by_id, cfg.vocab_size, &path)?;
    let id_of: HashMap<&str, u32> = by_id.iter().map(|(id, t)| (t.as_str(), *id)).collect();
    let special_id = |key: &str| -> Option<u32> {
        let text = token_text(tok_config.as_ref().and_then(|c| c.get(key)))?;
        id_of.get(text.as_str()).copied()
    };
    let unk_id = special_id("unk_token").or_else(|| {
        model
            .get("unk_token")
            .and_then(Value::as_str)
            .and_then(|t| id_of.get(t).copied())
    });
    let merges = merges_of(model);

    let (tokens, types, scores) = token_rows(
        &by_id,
        &added,
        cfg.vocab_size,
        unk_id,
        sentencepiece,
        &merges,
    );

    let mut kv = vocab_entries(pre, tokens, types, scores, merges);
    let bos = special_id("bos_token").or(cfg.bos_token_id);
    let eos = special_id("eos_token").or_else(|| cfg.eos_token_ids.first().copied());
    let pad = special_id("pad_token").or(cfg.pad_token_id);
    for (key, id) in [
        ("bos_token_id", bos),
        ("eos_token_id", eos),
        ("unknown_token_id", unk_id),
        ("padding_token_id", pad),
    ] {
        if let Some(id) = id {
            kv.push((format!("tokenizer.ggml.{key}"), MetaValue::U32(id)));
        }
    }
    let (add_bos, add_eos) = add_flags(&tok, tok_config.as_ref(), bos.and_then(|b| by_id.get(&b)));
    kv.push((
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(add_bos),
    ));
    kv.push((
        "tokenizer.ggml.add_eos_token".into(),
        MetaValue::Bool(add_eos),
    ));
    if sentencepiece {
        let prefix = adds_space_prefix(&tok);
        kv.push((
            "tokenizer.ggml.add_space_prefix".into(),
            MetaValue::Bool(prefix),
        ));
    }
    let template = chat_template(model_dir, tok_config.as_ref());
    if let Some(t) = &template {
        kv.push(("tokenizer.chat_template".into(), MetaValue::Str(t.clone())));
    }
    let stop_tokens = stop_tokens(
        eos.and_then(|e| by_id.get(&e)).cloned(),
        &cfg.eos_token_ids
            .iter()
            .filter_map(|e| by_id.get(e).cloned())
            .collect::<Vec<_>>(),
        template.as_deref(),
        &id_of,
    );
    Ok(VocabMetadata {
        metadata: kv,
        stop_tokens,
        chat_template: template,
    })
}

/// Whether the post-processor template puts the BOS token first.
fn post_processor_adds(tok: &Value, bos: Option<&String>) -> bool {
    let Some(bos) = bos else { return false };
    let single = tok
        .get("post_processor")
        .and_then(|p| p.get("single"))
        .map(Value::to_string)
        .unwrap_or_default();
    single.contains(&format!("\"id\":{}", Value::String(bos.clone())))
}

fn looks_special(text: &str) -> bool {
    (text.starts_with("<|") && text.ends_with("|>"))
        || (text.starts_with('<') && text.ends_with('>') && !text.contains(' '))
}

fn is_byte_token(text: &str) -> bool {
    text.len() == 6 && text.starts_with("<0x") && text.ends_with('>')
}

/// EOS, the config's other EOS ids, and the usual end-of-turn markers the template uses.
fn stop_tokens(
    eos: Option<String>,
    config_eos: &[String],
    template: Option<&str>,
    id_of: &HashMap<&str, u32>,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |t: String| {
        if !t.is_empty() && !out.contains(&t) {
            out.push(t);
        }
    };
    if let Some(e) = eos {
        push(e);
    }
    for e in config_eos {
        push(e.clone());
    }
    for marker in [
        "<|im_end|>",
        "<|eot_id|>",
        "<|end|>",
        "<end_of_turn>",
        "</s>",
    ] {
        if id_of.contains_key(marker) && template.is_some_and(|t| t.contains(marker)) {
            push(marker.to_string());
        }
    }
    out
}

/// Every id's text (the BPE vocabulary plus the added tokens) and, for added tokens,
/// whether they are special.
fn token_table(tok: &Value) -> (HashMap<u32, String>, HashMap<u32, bool>) {
    let model = &tok["model"];
    let mut by_id: HashMap<u32, String> = HashMap::new();
    if let Some(vocab) = model.get("vocab").and_then(Value::as_object) {
        for (text, id) in vocab {
            if let Some(id) = id.as_u64() {
                by_id.insert(id as u32, text.clone());
            }
        }
    }
    let mut added: HashMap<u32, bool> = HashMap::new();
    for t in tok
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let (Some(id), Some(text)) = (
            t.get("id").and_then(Value::as_u64),
            t.get("content").and_then(Value::as_str),
        ) else {
            continue;
        };
        by_id.insert(id as u32, text.to_string());
        added.insert(
            id as u32,
            t.get("special").and_then(Value::as_bool).unwrap_or(false),
        );
    }
    (by_id, added)
}

/// One row per embedding row: text, llama.cpp token type and SentencePiece score. Rows past
/// the tokenizer's vocabulary are `[PADn]`, unused (as llama.cpp's converter writes them).
fn token_rows(
    by_id: &HashMap<u32, String>,
    added: &HashMap<u32, bool>,
    vocab_size: usize,
    unk_id: Option<u32>,
    sentencepiece: bool,
    merges: &[String],
) -> (Vec<String>, Vec<i32>, Vec<f32>) {
    let merge_rank: HashMap<String, usize> = merges
        .iter()
        .enumerate()
        .map(|(rank, m)| (m.replacen(' ', "", 1), rank))
        .collect();
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    let mut scores = Vec::with_capacity(vocab_size);
    for id in 0..vocab_size as u32 {
        let Some(text) = by_id.get(&id) else {
            tokens.push(format!("[PAD{id}]"));
            types.push(token_type::UNUSED);
            scores.push(-1000.0);
            continue;
        };
        let ty = match added.get(&id) {
            Some(true) => token_type::CONTROL,
            Some(false) if looks_special(text) => token_type::CONTROL,
            Some(false) => token_type::USER_DEFINED,
            None if Some(id) == unk_id => token_type::UNKNOWN,
            None if sentencepiece && is_byte_token(text) => token_type::BYTE,
            None => token_type::NORMAL,
        };
        let score = match merge_rank.get(text) {
            Some(&rank) if ty == token_type::NORMAL => -(rank as f32),
            _ => 0.0,
        };
        tokens.push(text.clone());
        types.push(ty);
        scores.push(score);
    }
    (tokens, types, scores)
}

/// Whether a SentencePiece tokenizer puts `▁` before the first word.
fn adds_space_prefix(tok: &Value) -> bool {
    let text = |k: &str| tok.get(k).map(Value::to_string).unwrap_or_default();
    text("normalizer").contains("Prepend")
        || text("pre_tokenizer").contains("\"prepend_scheme\":\"first\"")
        || text("pre_tokenizer").contains("\"prepend_scheme\":\"always\"")
}

/// `add_bos_token` / `add_eos_token`: tokenizer_config.json's, else whether the
/// post-processor puts BOS first.
fn add_flags(tok: &Value, tok_config: Option<&Value>, bos: Option<&String>) -> (bool, bool) {
    let flag = |k: &str| tok_config.and_then(|c| c.get(k)).and_then(Value::as_bool);
    let add_bos = flag("add_bos_token").unwrap_or_else(|| post_processor_adds(tok, bos));
    (add_bos, flag("add_eos_token").unwrap_or(false))
}

/// The model, pre-tokenizer and vocabulary keys (`pre` is `None` for SentencePiece, which
/// keeps scores instead of merges).
fn vocab_entries(
    pre: Option<&str>,
    tokens: Vec<String>,
    types: Vec<i32>,
    scores: Vec<f32>,
    merges: Vec<String>,
) -> Vec<(String, MetaValue)> {
    let sentencepiece = pre.is_none();
    let model = if sentencepiece { "llama" } else { "gpt2" };
    let mut kv = vec![
        (
            "tokenizer.ggml.model".to_string(),
            MetaValue::Str(model.into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            MetaValue::Str(pre.unwrap_or("default").into()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            MetaValue::StrArray(tokens),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            MetaValue::I32Array(types),
        ),
    ];
    if sentencepiece {
        kv.push(("tokenizer.ggml.scores".into(), MetaValue::F32Array(scores)));
    } else {
        kv.push(("tokenizer.ggml.merges".into(), MetaValue::StrArray(merges)));
    }
    kv
}

/// Refuses a tokenizer with ids past the embedding's rows.
fn check_fits(
    by_id: &HashMap<u32, String>,
    vocab_size: usize,
    path: &Path,
) -> Result<(), GgufError> {
    let largest = by_id.keys().copied().max().map_or(0, |m| m as usize + 1);
    if largest > vocab_size {
        return Err(tok_err(
            path,
            format!(
                "it has token ids up to {} but config.json's vocab_size is {}: the embedding has no row for them",
                largest - 1,
                vocab_size
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn model_config(vocab: usize) -> ModelConfig {
        let raw = json!({"model_type": "mistral", "vocab_size": vocab, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2});
        ModelConfig::from_json_str(&raw.to_string(), "test").unwrap()
    }

    /// A SentencePiece-style tokenizer.json as transformers saves Mistral's: byte fallback,
    /// `▁` for spaces, merges in rank order.
    fn sentencepiece_folder(dir: &Path) {
        let mut vocab = serde_json::Map::new();
        for (i, t) in [
            "<unk>", "<s>", "</s>", "<0x0A>", "▁", "a", "b", "▁a", "ab", "▁ab",
        ]
        .iter()
        .enumerate()
        {
            vocab.insert(t.to_string(), json!(i));
        }
        let tok = json!({
            "added_tokens": [
                {"id": 0, "content": "<unk>", "special": true},
                {"id": 1, "content": "<s>", "special": true},
                {"id": 2, "content": "</s>", "special": true}],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null,
            "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>",
                      "vocab": vocab, "merges": ["▁ a", "a b", "▁a b"]}
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let cfg = json!({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                         "add_bos_token": true, "chat_template": "[INST] {{ messages }} [/INST]"});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    }

    #[test]
    fn a_sentencepiece_tokenizer_is_written_with_scores_that_replay_its_merges() {
        let dir = tempfile::tempdir().unwrap();
        sentencepiece_folder(dir.path());
        let v = vocab_metadata(dir.path(), &model_config(12)).unwrap();
        let get = |k: &str| {
            v.metadata
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, val)| val.clone())
                .unwrap_or_else(|| panic!("{k} missing"))
        };
        assert_eq!(get("tokenizer.ggml.model"), MetaValue::Str("llama".into()));
        let MetaValue::F32Array(scores) = get("tokenizer.ggml.scores") else {
            panic!("scores")
        };
        // "▁a" is merge 0, "ab" merge 1, "▁ab" merge 2: higher score merges first.
        assert_eq!(&scores[7..10], &[0.0, -1.0, -2.0]);
        let MetaValue::I32Array(types) = get("tokenizer.ggml.token_type") else {
            panic!("types")
        };
        assert_eq!(types[0], token_type::CONTROL);
        assert_eq!(types[3], token_type::BYTE);
        assert_eq!(types[5], token_type::NORMAL);
        // Two embedding rows past the tokenizer: padding tokens, unused.
        assert_eq!(types[10..], [token_type::UNUSED, token_type::UNUSED]);
        assert_eq!(get("tokenizer.ggml.add_bos_token"), MetaValue::Bool(true));
        assert_eq!(
            get("tokenizer.ggml.add_space_prefix"),
            MetaValue::Bool(true)
        );
        assert_eq!(get("tokenizer.ggml.bos_token_id"), MetaValue::U32(1));
        assert!(v.stop_tokens.contains(&"</s>".to_string()));
        assert!(!v.metadata.iter().any(|(k, _)| k == "tokenizer.ggml.merges"));
    }

    #[test]
    fn an_unknown_pre_tokenizer_is_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let tok = json!({"pre_tokenizer": {"type": "Whitespace"},
                         "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}});
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let err = vocab_metadata(dir.path(), &model_config(4))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Whitespace") && err.contains("differently"),
            "{err}"
        );
    }
}
