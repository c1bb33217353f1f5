//! `TokenizerBundle`: `tokenizer.json` + `tokenizer_config.json` +
//! `chat_template.jinja`, read the way transformers 5 reads a model folder.

use crate::data::hub::{self, RepoKind};
use crate::data::DataError;
use serde_json::Value;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Where the tokenizer files are. `tokenizer_config` and `chat_template`
/// are optional.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerPaths {
    /// `tokenizer.json` (required).
    pub tokenizer_json: PathBuf,
    /// `tokenizer_config.json`.
    pub tokenizer_config: Option<PathBuf>,
    /// `chat_template.jinja` (takes precedence over the config's template).
    pub chat_template: Option<PathBuf>,
}

impl TokenizerPaths {
    /// The files of an HF model folder (those that exist).
    pub fn in_dir(dir: &Path) -> Self {
        let opt = |name: &str| {
            let p = dir.join(name);
            p.is_file().then_some(p)
        };
        TokenizerPaths {
            tokenizer_json: dir.join("tokenizer.json"),
            tokenizer_config: opt("tokenizer_config.json"),
            chat_template: opt("chat_template.jinja"),
        }
    }
}

/// A token's `(start, end)` byte offsets in the text it came from.
pub type ByteSpan = (usize, usize);

/// The pad token the collator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PadToken {
    /// Token id written at padded positions (labels there are always -100).
    pub id: u32,
    /// True when the tokenizer declares no pad token and `id` is the EOS
    /// (or, lacking that, token 0).
    pub is_fallback: bool,
}

/// A tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct TokenizerBundle {
    /// The fast tokenizer, with any truncation/padding baked into
    /// tokenizer.json switched off (transformers switches them off too
    /// unless asked).
    pub tokenizer: Tokenizer,
    /// The folder or file it came from (for messages).
    pub origin: PathBuf,
    /// `bos_token` string.
    pub bos_token: Option<String>,
    /// `eos_token` string.
    pub eos_token: Option<String>,
    /// `pad_token` string as declared (no fallback).
    pub pad_token: Option<String>,
    /// `unk_token` string.
    pub unk_token: Option<String>,
    /// Id of `bos_token`.
    pub bos_token_id: Option<u32>,
    /// Id of `eos_token`.
    pub eos_token_id: Option<u32>,
    /// Id of the declared `pad_token` (see [`TokenizerBundle::pad`] for the fallback).
    pub pad_token_id: Option<u32>,
    /// Id of `unk_token`.
    pub unk_token_id: Option<u32>,
    /// `add_bos_token` from tokenizer_config.json, if set.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token` from tokenizer_config.json, if set.
    pub add_eos_token: Option<bool>,
    /// `model_max_length`, if set and sensible (< 1e12).
    pub model_max_length: Option<usize>,
    /// The chat template source, if the model has one.
    pub chat_template: Option<String>,
    /// Where the chat template came from (file path, or file + `#name`).
    pub chat_template_origin: Option<String>,
    special_ids: HashSet<u32>,
    added_ids: HashSet<u32>,
    prefix_shortcut: bool,
}

impl std::fmt::Debug for TokenizerBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenizerBundle")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("pad_token", &self.pad_token)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl TokenizerBundle {
    /// Loads from an HF model folder (`tokenizer.json`, optional
    /// `tokenizer_config.json`, `chat_template.jinja`).
    pub fn load(model_dir: &Path) -> Result<Self, DataError> {
        if !model_dir.join("tokenizer.json").is_file() {
            return Err(DataError::Tokenizer {
                path: model_dir.join("tokenizer.json"),
                message: "not found; the model folder needs a fast tokenizer (tokenizer.json). Convert a slow tokenizer with transformers (`AutoTokenizer.from_pretrained(..).save_pretrained(..)`)".into(),
            });
        }
        let mut b = Self::from_paths(&TokenizerPaths::in_dir(model_dir))?;
        b.origin = model_dir.to_path_buf();
        Ok(b)
    }

    /// Loads from a local model folder or a hub model id (through the HF
    /// cache; downloads only the tokenizer files unless `HF_HUB_OFFLINE`).
    pub fn from_source(source: &str) -> Result<Self, DataError> {
        let p = Path::new(source);
        if p.is_dir() {
            return Self::load(p);
        }
        if p.is_file() && p.file_name().is_some_and(|n| n == "tokenizer.json") {
            let dir = p.parent().unwrap_or(Path::new("."));
            return Self::load(dir);
        }
        if hub::looks_like_hub_id(source) {
            let wanted = |f: &str| {
                matches!(
                    f,
                    "tokenizer.json" | "tokenizer_config.json" | "chat_template.jinja"
                )
            };
            let snap = hub::resolve_repo(
                source,
                RepoKind::Model,
                &hub::hub_cache_dir(),
                hub::hub_offline(),
                &wanted,
            )?;
            return Self::load(&snap);
        }
        Err(DataError::NotFound {
            path: source.to_string(),
            hint: "set `model.source` to a model folder with tokenizer.json or a hub id like `HuggingFaceTB/SmolLM2-135M`".into(),
        })
    }

    /// Loads from explicit file paths.
    pub fn from_paths(paths: &TokenizerPaths) -> Result<Self, DataError> {
        let mut tokenizer =
            Tokenizer::from_file(&paths.tokenizer_json).map_err(|e| DataError::Tokenizer {
                path: paths.tokenizer_json.clone(),
                message: e.to_string(),
            })?;
        // Fixed padding/truncation saved in tokenizer.json would silently
        // cut or pad every sample; transformers disables them per call.
        tokenizer
            .with_truncation(None)
            .map_err(|e| DataError::Tokenizer {
                path: paths.tokenizer_json.clone(),
                message: e.to_string(),
            })?;
        tokenizer.with_padding(None);

        let config: Value = match &paths.tokenizer_config {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| DataError::io(p, e))?;
                serde_json::from_str(&text).map_err(|e| DataError::TokenizerConfig {
                    path: p.clone(),
                    message: format!("invalid JSON: {e}"),
                })?
            }
            None => Value::Object(Default::default()),
        };
        let cfg_path = paths
            .tokenizer_config
            .clone()
            .unwrap_or_else(|| PathBuf::from("tokenizer_config.json"));

        let (chat_template, chat_template_origin) = chat_template_of(paths, &config, &cfg_path)?;
        let origin = paths
            .tokenizer_json
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        Self::from_tokenizer(
            tokenizer,
            &config,
            &cfg_path,
            chat_template.zip(chat_template_origin),
            origin,
        )
    }

    /// Builds the bundle from a tokenizer already in memory (a GGUF file's, say):
    /// `config` plays `tokenizer_config.json` (`cfg_path` names it in messages),
    /// `chat_template` is `(source, origin)`.
    pub fn from_tokenizer(
        tokenizer: Tokenizer,
        config: &Value,
        cfg_path: &Path,
        chat_template: Option<(String, String)>,
        origin: PathBuf,
    ) -> Result<Self, DataError> {
        let (chat_template, chat_template_origin) = match chat_template {
            Some((t, o)) => (Some(t), Some(o)),
            None => (None, None),
        };
        let token_str = |key: &str| config_token(config, cfg_path, key);
        let bos_token = token_str("bos_token")?;
        let eos_token = token_str("eos_token")?;
        let pad_token = token_str("pad_token")?;
        let unk_token = token_str("unk_token")?;
        let id_of = |t: &Option<String>| t.as_deref().and_then(|s| tokenizer.token_to_id(s));

        let model_max_length = config
            .get("model_max_length")
            .and_then(Value::as_f64)
            .filter(|v| *v > 0.0 && *v < 1e12)
            .map(|v| v as usize);
        let added = tokenizer.get_added_tokens_decoder();
        let special_ids: HashSet<u32> = added
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| *id)
            .collect();
        let added_ids: HashSet<u32> = added.keys().copied().collect();

        let mut bundle = TokenizerBundle {
            bos_token_id: id_of(&bos_token),
            eos_token_id: id_of(&eos_token),
            pad_token_id: id_of(&pad_token),
            unk_token_id: id_of(&unk_token),
            bos_token,
            eos_token,
            pad_token,
            unk_token,
            add_bos_token: config.get("add_bos_token").and_then(Value::as_bool),
            add_eos_token: config.get("add_eos_token").and_then(Value::as_bool),
            model_max_length,
            chat_template,
            chat_template_origin,
            special_ids,
            added_ids,
            prefix_shortcut: false,
            origin,
            tokenizer,
        };
        bundle.prefix_shortcut = bundle.prefix_shortcut_allowed();
        Ok(bundle)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// The pad token for collation: the declared one, else EOS (reported as
    /// the `NoPadToken` lint), else id 0.
    pub fn pad(&self) -> PadToken {
        match (self.pad_token_id, self.eos_token_id) {
            (Some(id), _) => PadToken {
                id,
                is_fallback: false,
            },
            (None, Some(eos)) => PadToken {
                id: eos,
                is_fallback: true,
            },
            (None, None) => PadToken {
                id: 0,
                is_fallback: true,
            },
        }
    }

    /// Whether `id` is an added token flagged special (e.g. `<|im_end|>`).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// Id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Tokenises one text. `add_special_tokens` runs the post-processor
    /// (e.g. a Llama BOS), then `add_bos_token` from the config is applied.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        let enc = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| e.to_string())?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens {
            self.apply_bos_setting(text, &mut ids);
        }
        Ok(ids)
    }

    /// Tokenises many texts in parallel (see [`TokenizerBundle::encode`]).
    pub fn encode_batch(
        &self,
        texts: Vec<String>,
        add_special_tokens: bool,
    ) -> Result<Vec<Vec<u32>>, String> {
        use rayon::prelude::*;
        // encode_batch_fast parallelises with tokenizers' own rayon use; we
        // own the split so batches of short texts stay cheap.
        texts
            .par_iter()
            .map(|t| self.encode(t, add_special_tokens))
            .collect()
    }

    fn apply_bos_setting(&self, text: &str, ids: &mut Vec<u32>) {
        let (Some(bos_id), Some(bos)) = (self.bos_token_id, self.bos_token.as_deref()) else {
            return;
        };
        match self.add_bos_token {
            Some(true) if ids.first() != Some(&bos_id) => ids.insert(0, bos_id),
            Some(false) if ids.first() == Some(&bos_id) && !text.starts_with(bos) => {
                ids.remove(0);
            }
            _ => {}
        }
    }

    /// Tokenises without special tokens, with byte offsets into `text`.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<ByteSpan>), String> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| e.to_string())?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// `len(encode(prefix, false))`, computed cheaply when `prefix` is a
    /// prefix of `full` (whose tokens and byte offsets are given): the
    /// tokens up to the last added token inside `prefix` are shared with
    /// `full` (added tokens cut the text into independently tokenised
    /// pieces), so only the text after it is tokenised. Falls back to
    /// tokenising `prefix` when that argument does not hold for this
    /// tokenizer.
    pub fn prefix_token_count(
        &self,
        full: &str,
        full_ids: &[u32],
        full_offsets: &[ByteSpan],
        prefix: &str,
    ) -> Result<usize, String> {
        if self.prefix_shortcut && full.starts_with(prefix) && full_ids.len() == full_offsets.len()
        {
            let cut = (0..full_ids.len()).rev().find(|&j| {
                self.added_ids.contains(&full_ids[j]) && full_offsets[j].1 <= prefix.len()
            });
            if let Some(j) = cut {
                let end = full_offsets[j].1;
                let tail = prefix.get(end..).ok_or("offset inside a character")?;
                let tail_len = if tail.is_empty() {
                    0
                } else {
                    self.encode(tail, false)?.len()
                };
                return Ok(j + 1 + tail_len);
            }
        }
        Ok(self.encode(prefix, false)?.len())
    }

    /// Turns the prefix shortcut of [`TokenizerBundle::prefix_token_count`]
    /// on or off (it is on when the tokenizer allows it); for tests and
    /// diagnostics.
    pub fn set_prefix_shortcut(&mut self, on: bool) {
        self.prefix_shortcut = on && self.prefix_shortcut_allowed();
    }

    /// Added tokens split the text into pieces that are tokenised
    /// independently; that makes a prefix's token count computable from the
    /// full text's tokens, as long as no added token eats neighbouring text
    /// and nothing depends on a piece's position (Metaspace's "first"
    /// prepend scheme, normalizers).
    fn prefix_shortcut_allowed(&self) -> bool {
        let plain_added = self
            .tokenizer
            .get_added_tokens_decoder()
            .values()
            .all(|t| !t.lstrip && !t.rstrip && !t.single_word && !t.normalized);
        let pre = serde_json::to_string(&self.tokenizer.get_pre_tokenizer()).unwrap_or_default();
        plain_added
            && self.tokenizer.get_normalizer().is_none()
            && pre.contains("ByteLevel")
            && !pre.contains("Metaspace")
    }

    /// Whether the prefix shortcut is in use.
    pub fn prefix_shortcut(&self) -> bool {
        self.prefix_shortcut
    }

    /// Decodes ids (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_default()
    }

    /// The bytes each of `ids` stands for (part of a UTF-8 character where byte-level BPE
    /// split one; see [`crate::text::token_bytes`]).
    pub fn token_bytes(&self, ids: &[u32]) -> Vec<Vec<u8>> {
        crate::text::token_bytes(&self.tokenizer, ids)
    }

    /// The text each token contributes, in order: a token completing a
    /// multi-byte character carries it, the tokens before it carry "".
    pub fn token_texts(&self, ids: &[u32]) -> Vec<String> {
        let mut stream = self.tokenizer.decode_stream(false);
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            match stream.step(id) {
                Ok(Some(s)) => out.push(s),
                Ok(None) => out.push(String::new()),
                // Out-of-vocabulary ids (pre-tokenised data) decode to nothing.
                Err(_) => {
                    out.push(format!("<id {id}>"));
                    stream = self.tokenizer.decode_stream(false);
                }
            }
        }
        out
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A special token of tokenizer_config.json: a string, or `{"content": ...}` (absent or null: none).
fn config_token(config: &Value, cfg_path: &Path, key: &str) -> Result<Option<String>, DataError> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(DataError::TokenizerConfig {
                path: cfg_path.to_path_buf(),
                message: format!("`{key}` is an object without a string `content`"),
            }),
        },
        Some(other) => Err(DataError::TokenizerConfig {
            path: cfg_path.to_path_buf(),
            message: format!("`{key}` must be a string or {{\"content\": ...}}, found {other}"),
        }),
    }
}

/// The chat template and where it came from: chat_template.jinja when there is one, else
/// tokenizer_config.json's `chat_template` (a string, or the list entry named "default").
fn chat_template_of(
    paths: &TokenizerPaths,
    config: &Value,
    cfg_path: &Path,
) -> Result<(Option<String>, Option<String>), DataError> {
    let mut chat_template = None;
    let mut chat_template_origin = None;
    if let Some(p) = &paths.chat_template {
        let text = std::fs::read_to_string(p).map_err(|e| DataError::io(p, e))?;
        chat_template = Some(text);
        chat_template_origin = Some(p.display().to_string());
    } else {
        match config.get("chat_template") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                chat_template = Some(s.clone());
                chat_template_origin = Some(cfg_path.display().to_string());
            }
            Some(Value::Array(list)) => {
                // transformers: a list of {name, template}; "default" is used.
                let named = |n: &str| {
                    list.iter().find_map(|t| {
                        (t.get("name").and_then(Value::as_str) == Some(n))
                            .then(|| t.get("template").and_then(Value::as_str))
                            .flatten()
                    })
                };
                match named("default") {
                    Some(t) => {
                        chat_template = Some(t.to_string());
                        chat_template_origin =
                            Some(format!("{}#default", cfg_path.display()));
                    }
                    None => {
                        return Err(DataError::TokenizerConfig {
                            path: cfg_path.to_path_buf(),
                            message: "`chat_template` is a list without a template named \"default\"; add one or put the template in chat_template.jinja".into(),
                        })
                    }
                }
            }
            Some(other) => {
                return Err(DataError::TokenizerConfig {
                    path: cfg_path.to_path_buf(),
                    message: format!(
                    "`chat_template` must be a string or a list of {{name, template}}, found {}",
                    type_name(other)
                ),
                })
            }
        }
    }
    Ok((chat_template, chat_template_origin))
}
