//! Tokenisation and label masks.
//!
//! * Plain text: every token trained; EOS appended (and trained) when the
//!   tokenizer did not end the text with it.
//! * Prompt/completion (no template, as TRL does for non-conversational
//!   data): `prompt + completion` tokenised with special tokens; the first
//!   `len(tokenize(prompt))` labels are -100 when training on completions
//!   only; EOS appended.
//! * Chat (chat, ShareGPT, LLaMA-Factory v1, and alpaca rows turned into a
//!   user/assistant exchange): the conversation is rendered with the
//!   model's template and tokenised *without* extra special tokens, as
//!   `apply_chat_template(tokenize=True)` does. An assistant turn `k` is
//!   trained from `len(tokenize(render(messages[:k], add_generation_prompt=True)))`
//!   to `len(tokenize(render(messages[:k+1])))` — the prefix-rendering rule
//!   TRL and LLaMA-Factory use. Other turns are masked unless they carry a
//!   positive `loss_weight`; a `loss_weight` of 0 masks a turn. When the
//!   final trained turn does not end with a special token (the template did
//!   not close it), EOS is appended and trained.
//! * Pre-tokenised: labels as given (or a copy of `input_ids`); positions
//!   whose `attention_mask` is 0 are padding and are removed (the collator
//!   re-pads).
//!
//! Truncation keeps the first `max_length` tokens (the prompt's start).
//! Samples left with no trained token are dropped (with a reason).
//!
//! "Trained" counts positions `1..` only: a causal LM predicts token `i`
//! from tokens `..i`, so the label at position 0 never reaches the loss.

use crate::data::formats::Example;
use crate::data::template::{ChatMessage, ChatTemplate};
use crate::data::tokenizer::TokenizerBundle;
use crate::data::DataError;
use serde::{Deserialize, Serialize};

/// The label value the loss ignores (defined by the loss, [`crate::model::IGNORE_INDEX`]).
pub use crate::model::IGNORE_INDEX;

/// A tokenised, labelled training sample (or a packed sequence of several).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizedSample {
    /// Index of the source row in its dataset (the first row, when packed).
    pub row: usize,
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// Labels, same length; [`IGNORE_INDEX`] = not trained.
    pub labels: Vec<i64>,
    /// Per-token loss weights, only when some trained weight is not 1.0
    /// (0.0 where the label is ignored).
    pub weights: Option<Vec<f32>>,
    /// Lengths of the samples packed into this sequence (one entry when
    /// not packed); they sum to `input_ids.len()`.
    pub segments: Vec<usize>,
    /// Source rows of the packed samples (one entry when not packed).
    pub rows: Vec<usize>,
}

impl TokenizedSample {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Number of tokens the loss sees (labels at positions `1..` that are
    /// not ignored).
    pub fn num_trained(&self) -> usize {
        self.labels
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count()
    }
}

/// Why a row produced no training sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DropReason {
    /// The text/completion is empty or whitespace.
    Empty,
    /// Every label is ignored (e.g. no assistant turn, all -100).
    NoTrainedTokens,
    /// The prompt alone fills `max_length`.
    PromptTooLong,
    /// Truncation removed every trained token.
    CompletionTruncatedAway,
}

impl DropReason {
    /// A short description.
    pub fn describe(self) -> &'static str {
        match self {
            DropReason::Empty => "empty or whitespace text",
            DropReason::NoTrainedTokens => "no trained token",
            DropReason::PromptTooLong => "prompt longer than max_length",
            DropReason::CompletionTruncatedAway => "completion truncated away",
        }
    }
}

/// One row after labelling, with the facts the lints and the preview need.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelledRow {
    /// The sample after truncation (kept for dropped rows too, for display).
    pub sample: TokenizedSample,
    /// The rendered/concatenated text (only when asked for).
    pub text: Option<String>,
    /// Tokens before truncation.
    pub full_len: usize,
    /// Index of the first trained position before truncation.
    pub first_trained: Option<usize>,
    /// Why the row is not trained on.
    pub dropped: Option<DropReason>,
    /// Truncated to `max_length`.
    pub truncated: bool,
    /// Truncation removed trained tokens.
    pub completion_truncated: bool,
    /// EOS was appended because nothing closed the text/turn.
    pub eos_appended: bool,
    /// Pre-tokenised row without an EOS token.
    pub missing_eos: bool,
    /// Trained positions whose label differs from the token.
    pub labels_mismatch: usize,
    /// The mismatching labels look shifted by one (`labels[i] == input_ids[i+1]`).
    pub labels_pre_shifted: bool,
    /// Positions with `attention_mask` 0 whose label is not ignored.
    pub padding_trained: usize,
    /// A rendered prefix was not a prefix of the full rendering (the
    /// template rewrites earlier turns; masks follow token counts).
    pub prefix_unstable: bool,
    /// Some trained token has a loss weight other than 1.
    pub non_binary_weights: bool,
    /// The trained text is empty or whitespace.
    pub blank: bool,
}

/// What the labeller needs.
#[derive(Clone, Copy)]
pub struct LabelContext<'a> {
    /// The tokenizer.
    pub tok: &'a TokenizerBundle,
    /// The chat template (required for chat examples).
    pub template: Option<&'a ChatTemplate>,
    /// Mask prompts / non-assistant turns.
    pub completions_only: bool,
    /// Truncation length.
    pub max_length: usize,
    /// Keep the rendered text in [`LabelledRow::text`].
    pub keep_text: bool,
}

/// Tokenises and labels one example. `location` names the row in errors.
pub fn label_example(
    row: usize,
    ex: &Example,
    ctx: &LabelContext<'_>,
    location: &dyn Fn() -> String,
) -> Result<LabelledRow, DataError> {
    let enc_err = |message: String| DataError::Encode { row, message };
    let mut out = LabelledRow {
        sample: TokenizedSample {
            row,
            input_ids: Vec::new(),
            labels: Vec::new(),
            weights: None,
            segments: Vec::new(),
            rows: vec![row],
        },
        text: None,
        full_len: 0,
        first_trained: None,
        dropped: None,
        truncated: false,
        completion_truncated: false,
        eos_appended: false,
        missing_eos: false,
        labels_mismatch: 0,
        labels_pre_shifted: false,
        padding_trained: 0,
        prefix_unstable: false,
        non_binary_weights: false,
        blank: ex.is_blank(),
    };
    let eos = ctx.tok.eos_token_id;
    let (mut ids, mut labels, weights): (Vec<u32>, Vec<i64>, Option<Vec<f32>>);
    match ex {
        Example::Text { text } => {
            ids = ctx.tok.encode(text, true).map_err(enc_err)?;
            labels = ids.iter().map(|&i| i as i64).collect();
            weights = None;
            out.eos_appended = push_eos(&mut ids, &mut labels, eos);
            if ctx.keep_text {
                out.text = Some(text.clone());
            }
            if out.blank {
                out.dropped = Some(DropReason::Empty);
            }
        }
        Example::PromptCompletion { prompt, completion } => {
            let full = format!("{prompt}{completion}");
            ids = ctx.tok.encode(&full, true).map_err(enc_err)?;
            labels = ids.iter().map(|&i| i as i64).collect();
            weights = None;
            if ctx.completions_only {
                let p = ctx.tok.encode(prompt, true).map_err(enc_err)?.len();
                for l in labels.iter_mut().take(p) {
                    *l = IGNORE_INDEX;
                }
            }
            out.eos_appended = push_eos(&mut ids, &mut labels, eos);
            if ctx.keep_text {
                out.text = Some(full);
            }
        }
        Example::Chat { messages } => {
            let tmpl = ctx.template.ok_or_else(|| DataError::TemplateRender {
                location: location(),
                message: "chat data needs a chat template and none was given".into(),
            })?;
            let r = label_chat(messages, tmpl, ctx, location)?;
            ids = r.ids;
            labels = r.labels;
            weights = r.weights;
            out.prefix_unstable = r.prefix_unstable;
            out.eos_appended = r.eos_appended;
            if ctx.keep_text {
                out.text = Some(r.text);
            }
        }
        Example::Pretokenized {
            input_ids,
            labels: given,
            attention_mask,
        } => {
            (ids, labels) = label_pretokenized(
                input_ids,
                given.as_deref(),
                attention_mask.as_deref(),
                ctx,
                &mut out,
                location,
            )?;
            weights = None;
        }
    }

    Ok(finish(out, ids, labels, weights, ctx))
}

/// Appends the EOS token (trained) unless the ids end with it; whether it was appended.
fn push_eos(ids: &mut Vec<u32>, labels: &mut Vec<i64>, eos: Option<u32>) -> bool {
    match eos {
        Some(e) if ids.last() != Some(&e) => {
            ids.push(e);
            labels.push(e as i64);
            true
        }
        _ => false,
    }
}

/// Pretokenized rows: the attended ids with their labels (the ids themselves when none are
/// given), noting trained padding, labels that differ from the ids (or look pre-shifted), a
/// missing EOS, and ids outside the vocabulary (an error).
fn label_pretokenized(
    input_ids: &[u32],
    given: Option<&[i64]>,
    attention_mask: Option<&[u32]>,
    ctx: &LabelContext<'_>,
    out: &mut LabelledRow,
    location: &dyn Fn() -> String,
) -> Result<(Vec<u32>, Vec<i64>), DataError> {
    let eos = ctx.tok.eos_token_id;
    let mut ids = Vec::with_capacity(input_ids.len());
    let mut labels = Vec::with_capacity(input_ids.len());
    for (i, &id) in input_ids.iter().enumerate() {
        let label = given.map_or(id as i64, |l| l[i]);
        if attention_mask.is_some_and(|m| m[i] == 0) {
            if label != IGNORE_INDEX {
                out.padding_trained += 1;
            }
            continue;
        }
        ids.push(id);
        labels.push(label);
    }
    let mismatched: Vec<usize> = (0..ids.len())
        .filter(|&i| labels[i] != IGNORE_INDEX && labels[i] != ids[i] as i64)
        .collect();
    out.labels_mismatch = mismatched.len();
    if !mismatched.is_empty() {
        let shifted = mismatched
            .iter()
            .filter(|&&i| i + 1 < ids.len() && labels[i] == ids[i + 1] as i64)
            .count();
        out.labels_pre_shifted = shifted * 10 >= mismatched.len() * 9;
    }
    out.missing_eos = eos.is_some_and(|e| !ids.contains(&e));
    let vocab = ctx.tok.vocab_size() as u32;
    if let Some(bad) = ids.iter().find(|&&i| i >= vocab) {
        return Err(DataError::BadRow {
            location: location(),
            message: format!(
                "input_ids holds {bad}, outside the tokenizer's vocabulary of {vocab}; was the data tokenised with another tokenizer?"
            ),
        });
    }
    Ok((ids, labels))
}

/// Truncates to `max_length`, keeps the weights only when they are not all 0/1, and drops a
/// row left with nothing to train (saying why).
fn finish(
    mut out: LabelledRow,
    mut ids: Vec<u32>,
    mut labels: Vec<i64>,
    mut weights: Option<Vec<f32>>,
    ctx: &LabelContext<'_>,
) -> LabelledRow {
    out.full_len = ids.len();
    out.first_trained = labels.iter().position(|&l| l != IGNORE_INDEX);
    if ids.len() > ctx.max_length {
        out.truncated = true;
        out.completion_truncated = labels[ctx.max_length..].iter().any(|&l| l != IGNORE_INDEX);
        ids.truncate(ctx.max_length);
        labels.truncate(ctx.max_length);
        if let Some(w) = weights.as_mut() {
            w.truncate(ctx.max_length);
        }
    }
    if let Some(w) = &weights {
        out.non_binary_weights = w
            .iter()
            .zip(&labels)
            .any(|(&w, &l)| l != IGNORE_INDEX && w != 1.0);
        if !out.non_binary_weights {
            weights = None;
        }
    }
    out.sample.segments = vec![ids.len()];
    out.sample.input_ids = ids;
    out.sample.labels = labels;
    out.sample.weights = weights;
    if out.dropped.is_none() && out.sample.num_trained() == 0 {
        out.dropped = Some(match out.first_trained {
            Some(f) if f >= ctx.max_length => DropReason::PromptTooLong,
            Some(_) if out.completion_truncated => DropReason::CompletionTruncatedAway,
            _ => DropReason::NoTrainedTokens,
        });
    }
    out
}

struct ChatLabels {
    text: String,
    ids: Vec<u32>,
    labels: Vec<i64>,
    weights: Option<Vec<f32>>,
    prefix_unstable: bool,
    eos_appended: bool,
}

fn label_chat(
    messages: &[ChatMessage],
    tmpl: &ChatTemplate,
    ctx: &LabelContext<'_>,
    location: &dyn Fn() -> String,
) -> Result<ChatLabels, DataError> {
    let render_err = |message: String| DataError::TemplateRender {
        location: location(),
        message,
    };
    let tok = ctx.tok;
    let text = tmpl.render(messages, false).map_err(render_err)?;
    // Offsets let prefix token counts reuse these tokens (see
    // `TokenizerBundle::prefix_token_count`).
    let (mut ids, offsets) = if ctx.completions_only && tok.prefix_shortcut() {
        tok.encode_with_offsets(&text)
    } else {
        tok.encode(&text, false).map(|ids| (ids, Vec::new()))
    }
    .map_err(|message| render_err(format!("tokenising failed: {message}")))?;
    let n = messages.len();
    let mut prefix_unstable = false;
    let (mut labels, mut weights): (Vec<i64>, Vec<f32>);
    let mut any_weight = false;
    let mut last_trained_turn = None;
    if !ctx.completions_only {
        labels = ids.iter().map(|&i| i as i64).collect();
        weights = vec![1.0; ids.len()];
        last_trained_turn = n.checked_sub(1);
    } else {
        labels = vec![IGNORE_INDEX; ids.len()];
        weights = vec![0.0; ids.len()];
        // Token count of render(messages[..k], gen); memoised because an
        // end of one turn is the start of the next.
        let mut memo: Vec<(usize, bool, usize)> = Vec::new();
        let mut count = |k: usize, gen: bool| -> Result<usize, DataError> {
            if k >= n && !gen {
                return Ok(ids.len());
            }
            if let Some(&(_, _, c)) = memo.iter().find(|(mk, mg, _)| *mk == k && *mg == gen) {
                return Ok(c);
            }
            let c = match tmpl.render(&messages[..k], gen) {
                Ok(prefix) => {
                    if !text.starts_with(&prefix) {
                        prefix_unstable = true;
                    }
                    tok.prefix_token_count(&text, &ids, &offsets, &prefix)
                        .map_err(|m| render_err(format!("tokenising failed: {m}")))?
                }
                // Some templates refuse an empty conversation: it renders nothing.
                Err(_) if k == 0 => 0,
                Err(e) => return Err(render_err(e)),
            };
            memo.push((k, gen, c));
            Ok(c)
        };
        for (k, m) in messages.iter().enumerate() {
            let is_assistant = m.role == "assistant";
            let w = m
                .loss_weight
                .unwrap_or(if is_assistant { 1.0 } else { 0.0 });
            if w <= 0.0 {
                continue;
            }
            let start = count(k, is_assistant)?;
            let end = count(k + 1, false)?.min(ids.len());
            for i in start..end {
                labels[i] = ids[i] as i64;
                weights[i] = w;
            }
            if w != 1.0 {
                any_weight = true;
            }
            if end > start {
                last_trained_turn = Some(k);
            }
        }
    }
    // Append EOS when the final turn is trained and the template did not
    // close it with a special token (ignoring trailing whitespace tokens).
    let mut eos_appended = false;
    if let (Some(eos), Some(k)) = (tok.eos_token_id, last_trained_turn) {
        if k + 1 == n && !ids.is_empty() && labels.last() != Some(&IGNORE_INDEX) {
            let last = ids.len() - 1;
            let closed = tok.is_special(ids[last])
                || (last > 0
                    && tok.is_special(ids[last - 1])
                    && tok.decode(&ids[last..]).trim().is_empty());
            if !closed {
                let w = weights[last];
                ids.push(eos);
                labels.push(eos as i64);
                weights.push(w);
                eos_appended = true;
            }
        }
    }
    Ok(ChatLabels {
        text,
        ids,
        labels,
        weights: any_weight.then_some(weights),
        prefix_unstable,
        eos_appended,
    })
}

/// Packs samples into sequences of at most `max_length` tokens (first-fit
/// decreasing, deterministic). Samples are concatenated; each keeps its own
/// EOS, and the first label of every sample after the first is ignored so a
/// sample is never trained to follow the previous one — the packed sequence
/// trains exactly the tokens the samples train alone. Attention *does*
/// cross sample boundaries (the model takes no per-sample position ids or
/// segment mask), as with HF's default packing; [`TokenizedSample::segments`]
/// records the boundaries for a future varlen attention.
pub fn pack(samples: &[TokenizedSample], max_length: usize) -> Vec<TokenizedSample> {
    let mut order: Vec<usize> = (0..samples.len()).collect();
    order.sort_by(|&a, &b| samples[b].len().cmp(&samples[a].len()).then(a.cmp(&b)));
    let mut bins: Vec<(usize, Vec<usize>)> = Vec::new(); // (used, members)
    for i in order {
        let len = samples[i].len().min(max_length);
        match bins.iter_mut().find(|(used, _)| used + len <= max_length) {
            Some(bin) => {
                bin.0 += len;
                bin.1.push(i);
            }
            None => bins.push((len, vec![i])),
        }
    }
    // Keep the output in a stable, source-like order.
    bins.sort_by_key(|(_, members)| members.iter().copied().min().unwrap_or(0));
    bins.into_iter()
        .map(|(used, mut members)| {
            members.sort_unstable();
            let any_weights = members.iter().any(|&m| samples[m].weights.is_some());
            let mut out = TokenizedSample {
                row: samples[members[0]].row,
                input_ids: Vec::with_capacity(used),
                labels: Vec::with_capacity(used),
                weights: any_weights.then(|| Vec::with_capacity(used)),
                segments: Vec::with_capacity(members.len()),
                rows: Vec::with_capacity(members.len()),
            };
            for (j, &m) in members.iter().enumerate() {
                let s = &samples[m];
                let len = s.len().min(max_length);
                out.input_ids.extend_from_slice(&s.input_ids[..len]);
                let start = out.labels.len();
                out.labels.extend_from_slice(&s.labels[..len]);
                if j > 0 && len > 0 {
                    out.labels[start] = IGNORE_INDEX;
                }
                if let Some(w) = out.weights.as_mut() {
                    match &s.weights {
                        Some(sw) => w.extend_from_slice(&sw[..len]),
                        None => w.extend(s.labels[..len].iter().map(|&l| {
                            if l == IGNORE_INDEX {
                                0.0
                            } else {
                                1.0
                            }
                        })),
                    }
                    if j > 0 && len > 0 {
                        w[start] = 0.0;
                    }
                }
                out.segments.push(len);
                out.rows.push(s.row);
            }
            out
        })
        .collect()
}

#[cfg(test)]
mod tests;
