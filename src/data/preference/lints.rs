//! Lints for preference pairs: the same [`Lint`] kinds, severities and blocking rule as the
//! SFT lints ([`crate::data::lints`]); an error stops a run unless allowed by name.
//!
//! Why each level:
//! * identical completions: the DPO loss of such a pair is a constant (ln 2) with no
//!   gradient, and the pair says nothing about a preference: a data mistake (error);
//! * an empty completion: nothing to score, and IPO/ORPO average over zero tokens (error);
//! * a conversation that does not start with the prompt's tokens: the model would be
//!   trained on a prompt it never sees at inference (a template mistake, error);
//! * a completion whose every token is masked: its log-probability is 0 whatever the model
//!   does (error);
//! * truncation: the pair still trains, but on cut answers (warning with the share).

use super::tokenize::{PairSide, PreferencePair};
use crate::data::lints::{push, Acc, Lint, LintKind, Severity};
use serde::{Deserialize, Serialize};

/// Dataset-level facts the pair lints cannot see in the pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairLintContext {
    /// The truncation lengths the pairs were cut to.
    pub limits: super::tokenize::PairLimits,
    /// Conversational pairs rendered with the ChatML fallback (the tokenizer has no template).
    pub no_chat_template: bool,
}

/// The pairs behind each lint, counted in one pass.
#[derive(Default)]
struct Tally {
    pairs: usize,
    identical: Acc,
    identical_by_truncation: usize,
    empty: Acc,
    mismatch: Acc,
    masked: Acc,
    completion_cut: Acc,
    completion_cut_tokens: usize,
    prompt_cut: Acc,
    blank: Acc,
    chat: bool,
}

impl Tally {
    fn of(pairs: &[PreferencePair]) -> Self {
        let mut t = Tally {
            pairs: pairs.len(),
            ..Tally::default()
        };
        for p in pairs {
            let (c, r) = (&p.chosen, &p.rejected);
            t.chat |= p.is_chat;
            if !c.ids.is_empty() && c.ids == r.ids && c.labels == r.labels {
                t.identical.add(p.row);
                // Cut answers may differ only after the limit: the message says so.
                t.identical_by_truncation += usize::from(c.is_truncated() || r.is_truncated());
            }
            if c.ids.is_empty() || r.ids.is_empty() {
                t.empty.add(p.row);
            } else if p.scored_tokens(PairSide::Chosen) == 0
                || p.scored_tokens(PairSide::Rejected) == 0
            {
                t.masked.add(p.row);
            }
            if c.prompt_differs || r.prompt_differs {
                t.mismatch.add(p.row);
            }
            if c.is_truncated() || r.is_truncated() {
                t.completion_cut.add(p.row);
                t.completion_cut_tokens += c.cut() + r.cut();
            }
            if p.prompt_cut() > 0 {
                t.prompt_cut.add(p.row);
            }
            if c.blank || r.blank {
                t.blank.add(p.row);
            }
        }
        t
    }

    /// `c` pairs as a percentage of all pairs.
    fn pct(&self, c: usize) -> f64 {
        100.0 * c as f64 / self.pairs.max(1) as f64
    }
}

/// Lints over tokenised pairs (most severe first). Example rows are dataset row numbers.
pub fn lint_pairs(pairs: &[PreferencePair], ctx: &PairLintContext) -> Vec<Lint> {
    let t = Tally::of(pairs);
    let mut out = Vec::new();
    error_lints(&mut out, &t);
    truncation_lints(&mut out, &t, ctx);
    if t.chat && ctx.no_chat_template {
        out.push(Lint {
            kind: LintKind::ChatWithoutTemplate,
            severity: Severity::Warning,
            count: 1,
            examples: Vec::new(),
            message: "conversational pairs, but the tokenizer has no chat template; a ChatML fallback is used, so the model learns a new format. Add chat_template.jinja to the model folder if the model has its own.".into(),
        });
    }
    let c = t.blank.count;
    push(
        &mut out,
        LintKind::EmptyRows,
        Severity::Warning,
        &t.blank,
        format!("{c} pairs have an empty or whitespace-only chosen or rejected answer; the model learns to prefer or avoid saying nothing."),
    );
    out.sort_by_key(|l| std::cmp::Reverse(l.severity));
    out
}

/// The pairs that would train wrongly or not at all.
fn error_lints(out: &mut Vec<Lint>, t: &Tally) {
    let c = t.identical.count;
    push(
        out,
        LintKind::PairIdentical,
        Severity::Error,
        &t.identical,
        format!(
            "{c} pairs ({:.1}%) have the same chosen and rejected tokens ({} of them are cut by truncation and may differ only after it); such a pair has no preference to learn (its DPO loss is ln 2 with no gradient). Fix the data, or raise max_completion_length.",
            t.pct(c),
            t.identical_by_truncation
        ),
    );
    let c = t.empty.count;
    push(
        out,
        LintKind::PairCompletionEmpty,
        Severity::Error,
        &t.empty,
        format!("{c} pairs have an empty chosen or rejected completion (after truncation); there is nothing to score. Fix the data or raise max_completion_length."),
    );
    let c = t.mismatch.count;
    push(
        out,
        LintKind::PairPromptMismatch,
        Severity::Error,
        &t.mismatch,
        format!("in {c} pairs the conversation rendered with the answer does not start with the prompt's tokens (the chat template renders the prompt differently once an answer follows, or the tokenizer merges across the boundary); chosen and rejected would be scored after different prompts. Check the chat template."),
    );
    let c = t.masked.count;
    push(
        out,
        LintKind::PairCompletionMasked,
        Severity::Error,
        &t.masked,
        format!("{c} pairs have a completion whose every token is masked (e.g. loss_weight 0 on the answer); its log-probability is 0 whatever the model does."),
    );
}

/// Pairs cut by the two truncation lengths.
fn truncation_lints(out: &mut Vec<Lint>, t: &Tally, ctx: &PairLintContext) {
    let limit = |l: Option<usize>| l.map_or_else(|| "none".to_string(), |n| n.to_string());
    let c = t.completion_cut.count;
    push(
        out,
        LintKind::PairCompletionTruncated,
        Severity::Warning,
        &t.completion_cut,
        format!(
            "{c} pairs ({:.1}%) lose completion tokens to max_completion_length = {} ({} tokens in all); the model compares the answers' beginnings only and does not learn how they end. Raise max_completion_length.",
            t.pct(c),
            limit(ctx.limits.max_completion_length),
            t.completion_cut_tokens
        ),
    );
    let c = t.prompt_cut.count;
    push(
        out,
        LintKind::PairPromptTruncated,
        Severity::Warning,
        &t.prompt_cut,
        format!(
            "{c} pairs ({:.1}%) lose the start of their prompt to max_prompt_length = {} (the end, nearest the answer, is kept). Raise max_prompt_length.",
            t.pct(c),
            limit(ctx.limits.max_prompt_length)
        ),
    );
}
