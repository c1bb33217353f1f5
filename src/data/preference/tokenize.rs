//! Tokenising a preference pair, as TRL's `DPOTrainer` does.
//!
//! * Conversational pairs: the prompt is the chat template rendered with the generation
//!   prompt (`apply_chat_template(prompt, add_generation_prompt=True)`); each completion is
//!   the rendered conversation with the answer (`prompt + chosen`), tokenised, minus the
//!   prompt's tokens. Tokens are taken without extra special tokens, as
//!   `apply_chat_template(tokenize=True)` does. When the full conversation's first tokens are
//!   not the prompt's tokens (a template that renders the prompt differently once an answer
//!   follows, or a tokenizer that merges across the boundary) the completion still starts
//!   after as many tokens as the prompt has, and the pair is flagged
//!   ([`PairCompletion::prompt_differs`], an error-level lint).
//! * Plain-text pairs (TRL's non-conversational data): the prompt tokenised with the
//!   tokenizer's special tokens (a BOS where the model wants one), each completion tokenised
//!   on its own without them and closed with EOS, so no token straddles the boundary.
//!
//! Every completion token is trained (TRL's completion mask) except the turns of a
//! LLaMA-Factory v1 conversation whose `loss_weight` is 0. When the last trained turn does not
//! end with a special token (the template did not close it), EOS is appended, as for SFT.
//!
//! Truncation keeps the prompt's *end* (`max_prompt_length`: the question nearest the answer
//! matters most) and each completion's *start* (`max_completion_length`), as TRL does.

use super::example::PreferenceExample;
use crate::data::labels::{TokenizedSample, IGNORE_INDEX};
use crate::data::template::{ChatMessage, ChatTemplate};
use crate::data::tokenizer::TokenizerBundle;
use crate::data::DataError;
use serde::{Deserialize, Serialize};

/// The two truncation lengths of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairLimits {
    /// Prompt tokens kept (its end); `None` = all.
    pub max_prompt_length: Option<usize>,
    /// Tokens kept of each completion (its start); `None` = all.
    pub max_completion_length: Option<usize>,
}

impl Default for PairLimits {
    /// 512 + 512: TRL's `max_prompt_length` default, and a completion limit that keeps TRL's
    /// `max_length` of 1024 for the whole sequence.
    fn default() -> Self {
        PairLimits {
            max_prompt_length: Some(512),
            max_completion_length: Some(512),
        }
    }
}

/// What the pair tokeniser needs.
#[derive(Clone, Copy)]
pub struct PairContext<'a> {
    /// The tokenizer.
    pub tok: &'a TokenizerBundle,
    /// The chat template (required for conversational pairs).
    pub template: Option<&'a ChatTemplate>,
    /// Truncation lengths.
    pub limits: PairLimits,
}

/// Which answer of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairSide {
    /// The preferred answer.
    Chosen,
    /// The dispreferred answer.
    Rejected,
}

/// One completion of a pair, after truncation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairCompletion {
    /// Token ids (after the prompt).
    pub ids: Vec<u32>,
    /// Labels, one per id; [`IGNORE_INDEX`] where a turn is not trained.
    pub labels: Vec<i64>,
    /// Tokens before truncation.
    pub full_len: usize,
    /// EOS was appended because nothing closed the answer.
    pub eos_appended: bool,
    /// The rendered conversation with this answer does not start with the prompt's tokens.
    pub prompt_differs: bool,
    /// The answer's text is empty or whitespace.
    pub blank: bool,
}

impl PairCompletion {
    /// Tokens truncation removed from the end.
    pub fn cut(&self) -> usize {
        self.full_len - self.ids.len()
    }

    /// Whether truncation removed tokens.
    pub fn is_truncated(&self) -> bool {
        self.cut() > 0
    }

    /// Labels that are not ignored.
    pub fn num_trained(&self) -> usize {
        self.labels.iter().filter(|&&l| l != IGNORE_INDEX).count()
    }
}

/// A tokenised preference pair: one prompt and two completions. The model sees
/// `prompt_ids + completion.ids`; labels are [`IGNORE_INDEX`] on the prompt (and, once
/// collated, on padding).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreferencePair {
    /// Index of the source row in its dataset.
    pub row: usize,
    /// Rendered with the chat template.
    pub is_chat: bool,
    /// Prompt token ids, after truncation (its end is kept).
    pub prompt_ids: Vec<u32>,
    /// Prompt tokens before truncation.
    pub prompt_full_len: usize,
    /// The preferred completion.
    pub chosen: PairCompletion,
    /// The dispreferred completion.
    pub rejected: PairCompletion,
}

impl PreferencePair {
    /// Tokens truncation removed from the prompt's start.
    pub fn prompt_cut(&self) -> usize {
        self.prompt_full_len - self.prompt_ids.len()
    }

    /// One of the completions.
    pub fn completion(&self, side: PairSide) -> &PairCompletion {
        match side {
            PairSide::Chosen => &self.chosen,
            PairSide::Rejected => &self.rejected,
        }
    }

    /// Length of `prompt + completion` for one side.
    pub fn sequence_len(&self, side: PairSide) -> usize {
        self.prompt_ids.len() + self.completion(side).ids.len()
    }

    /// The longer of the two sequences (what a batch pads to).
    pub fn len(&self) -> usize {
        self.sequence_len(PairSide::Chosen)
            .max(self.sequence_len(PairSide::Rejected))
    }

    /// Whether both sequences are empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Completion tokens the log-probability scores: trained labels at positions `1..` of
    /// the sequence (a causal LM predicts token `i` from tokens `..i`, so a label at
    /// position 0 is never scored).
    pub fn scored_tokens(&self, side: PairSide) -> usize {
        let c = self.completion(side);
        let skip_first = self.prompt_ids.is_empty() && c.labels.first() != Some(&IGNORE_INDEX);
        c.num_trained() - usize::from(skip_first && !c.labels.is_empty())
    }

    /// Whether both completions have a scored token (a pair without one has no
    /// log-probability to compare).
    pub fn trainable(&self) -> bool {
        self.scored_tokens(PairSide::Chosen) > 0 && self.scored_tokens(PairSide::Rejected) > 0
    }

    /// `prompt + completion` of one side as a sample (labels ignored on the prompt).
    pub fn sample(&self, side: PairSide) -> TokenizedSample {
        let c = self.completion(side);
        let mut input_ids = self.prompt_ids.clone();
        input_ids.extend_from_slice(&c.ids);
        let mut labels = vec![IGNORE_INDEX; self.prompt_ids.len()];
        labels.extend_from_slice(&c.labels);
        TokenizedSample {
            row: self.row,
            segments: vec![input_ids.len()],
            rows: vec![self.row],
            input_ids,
            labels,
            weights: None,
        }
    }
}

/// Tokenises and labels one preference example. `location` names the row in errors.
pub fn tokenize_pair(
    row: usize,
    ex: &PreferenceExample,
    ctx: &PairContext<'_>,
    location: &dyn Fn() -> String,
) -> Result<PreferencePair, DataError> {
    let (prompt_ids, chosen, rejected) = match ex {
        PreferenceExample::Text {
            prompt,
            chosen,
            rejected,
        } => {
            let enc_err = |message: String| DataError::Encode { row, message };
            let prompt_ids = ctx.tok.encode(prompt, true).map_err(enc_err)?;
            let chosen = text_completion(chosen, ctx.tok).map_err(enc_err)?;
            let rejected = text_completion(rejected, ctx.tok).map_err(enc_err)?;
            (prompt_ids, chosen, rejected)
        }
        PreferenceExample::Chat {
            prompt,
            chosen,
            rejected,
        } => {
            let tmpl = ctx.template.ok_or_else(|| DataError::TemplateRender {
                location: location(),
                message: "conversational pairs need a chat template and none was given".into(),
            })?;
            let chat = ChatPair {
                tok: ctx.tok,
                tmpl,
                prompt,
                location,
            };
            let prompt_ids = chat.encode(&chat.render(prompt, true)?)?;
            let chosen = chat.completion(chosen, &prompt_ids)?;
            let rejected = chat.completion(rejected, &prompt_ids)?;
            (prompt_ids, chosen, rejected)
        }
    };
    let limits = ctx.limits;
    let mut pair = PreferencePair {
        row,
        is_chat: ex.is_chat(),
        prompt_full_len: prompt_ids.len(),
        prompt_ids,
        chosen,
        rejected,
    };
    if let Some(m) = limits.max_prompt_length {
        let cut = pair.prompt_ids.len().saturating_sub(m);
        pair.prompt_ids.drain(..cut);
    }
    if let Some(m) = limits.max_completion_length {
        for c in [&mut pair.chosen, &mut pair.rejected] {
            c.ids.truncate(m);
            c.labels.truncate(m);
        }
    }
    Ok(pair)
}

/// A plain-text completion: its own tokens (no special tokens) closed with EOS.
fn text_completion(text: &str, tok: &TokenizerBundle) -> Result<PairCompletion, String> {
    let mut ids = tok.encode(text, false)?;
    let mut eos_appended = false;
    if let Some(eos) = tok.eos_token_id {
        if ids.last() != Some(&eos) {
            ids.push(eos);
            eos_appended = true;
        }
    }
    Ok(PairCompletion {
        labels: ids.iter().map(|&i| i64::from(i)).collect(),
        full_len: ids.len(),
        ids,
        eos_appended,
        prompt_differs: false,
        blank: text.trim().is_empty(),
    })
}

/// The pieces a conversational pair's completions are cut from.
struct ChatPair<'a> {
    tok: &'a TokenizerBundle,
    tmpl: &'a ChatTemplate,
    prompt: &'a [ChatMessage],
    location: &'a dyn Fn() -> String,
}

impl ChatPair<'_> {
    fn err(&self, message: String) -> DataError {
        DataError::TemplateRender {
            location: (self.location)(),
            message,
        }
    }

    fn render(&self, messages: &[ChatMessage], gen: bool) -> Result<String, DataError> {
        self.tmpl.render(messages, gen).map_err(|m| self.err(m))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        self.tok
            .encode(text, false)
            .map_err(|m| self.err(format!("tokenising failed: {m}")))
    }

    /// `tokens(render(prompt + answer)) − tokens(prompt)`, labelled by turn.
    fn completion(
        &self,
        answer: &[ChatMessage],
        prompt_ids: &[u32],
    ) -> Result<PairCompletion, DataError> {
        let blank = answer.iter().all(|m| m.content.trim().is_empty());
        if answer.is_empty() {
            return Ok(PairCompletion {
                ids: Vec::new(),
                labels: Vec::new(),
                full_len: 0,
                eos_appended: false,
                prompt_differs: false,
                blank,
            });
        }
        let mut msgs = self.prompt.to_vec();
        msgs.extend_from_slice(answer);
        let full = self.encode(&self.render(&msgs, false)?)?;
        let p = prompt_ids.len();
        let prompt_differs = full.get(..p) != Some(prompt_ids);
        let mut ids = full.get(p..).unwrap_or_default().to_vec();
        let mut labels = self.turn_labels(answer, &ids, p)?;
        let eos_appended = self.close_with_eos(answer, &mut ids, &mut labels);
        Ok(PairCompletion {
            full_len: ids.len(),
            ids,
            labels,
            eos_appended,
            prompt_differs,
            blank,
        })
    }

    /// Every token trained, except the turns whose `loss_weight` is 0: those are found by
    /// rendering the conversation up to each turn (the prefix rule of the SFT labels).
    fn turn_labels(
        &self,
        answer: &[ChatMessage],
        ids: &[u32],
        p: usize,
    ) -> Result<Vec<i64>, DataError> {
        let trained = |m: &ChatMessage| m.loss_weight.is_none_or(|w| w > 0.0);
        let mut labels: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
        if answer.iter().all(trained) {
            return Ok(labels);
        }
        let mut start = 0;
        for (j, m) in answer.iter().enumerate() {
            let end = if j + 1 == answer.len() {
                ids.len()
            } else {
                let mut upto = self.prompt.to_vec();
                upto.extend_from_slice(&answer[..=j]);
                let n = self.encode(&self.render(&upto, false)?)?.len();
                n.saturating_sub(p).clamp(start, ids.len())
            };
            if !trained(m) {
                labels[start..end].fill(IGNORE_INDEX);
            }
            start = end;
        }
        Ok(labels)
    }

    /// Appends EOS (trained) when the last turn is trained and the template did not close it
    /// with a special token (trailing whitespace tokens aside); whether it did.
    fn close_with_eos(
        &self,
        answer: &[ChatMessage],
        ids: &mut Vec<u32>,
        labels: &mut Vec<i64>,
    ) -> bool {
        let (Some(eos), Some(&last_label)) = (self.tok.eos_token_id, labels.last()) else {
            return false;
        };
        if last_label == IGNORE_INDEX || answer.is_empty() {
            return false;
        }
        let last = ids.len() - 1;
        let closed = self.tok.is_special(ids[last])
            || (last > 0
                && self.tok.is_special(ids[last - 1])
                && self.tok.decode(&ids[last..]).trim().is_empty());
        if closed {
            return false;
        }
        ids.push(eos);
        labels.push(i64::from(eos));
        true
    }
}
