//! Lints for GRPO prompts: the same [`Lint`] kinds, severities and blocking rule as the SFT and
//! pair lints ([`crate::data::lints`]); an error stops a run unless `[data] allow` names it.
//!
//! Why each level:
//! * an empty prompt (no token, or only whitespace where the question should be): the model
//!   is sampled from nothing, and a prompt of no token cannot be sampled at all (error);
//! * rows without the column an accuracy reward reads: every completion of those prompts
//!   fails to score, the run stops at the first one (error, found before the weights load);
//! * truncation: the prompt still trains, but the model may not see the whole question
//!   (warning);
//! * duplicates: a repeated prompt is sampled and trained more often (warning).

use super::PromptRow;
use crate::data::lints::{Lint, LintKind, Severity};
use std::collections::HashMap;

/// Example rows a lint keeps (as the other lints do) and row pairs a message names.
const MAX_EXAMPLES: usize = 5;
const MAX_NAMED: usize = 3;

/// Dataset-level facts the prompt lints cannot see in the rows.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PromptLintContext {
    /// The length prompts were cut to (`grpo.max_prompt_length`).
    pub max_prompt_length: Option<usize>,
    /// Chat prompts rendered with the ChatML fallback (the tokenizer has no template).
    pub no_chat_template: bool,
}

/// Lints over read prompts (most severe first); `blank[i]` says row `i`'s prompt text is empty
/// or whitespace.
pub(crate) fn prompt_lints(
    rows: &[PromptRow],
    blank: &[bool],
    ctx: &PromptLintContext,
) -> Vec<Lint> {
    let mut out = Vec::new();
    out.extend(empty_lint(rows, blank));
    out.extend(truncated_lint(rows, ctx));
    out.extend(duplicate_lint(rows));
    if ctx.no_chat_template && rows.iter().any(|r| r.is_chat) {
        out.push(Lint {
            kind: LintKind::ChatWithoutTemplate,
            severity: Severity::Warning,
            count: 1,
            examples: Vec::new(),
            message: "conversational prompts, but the tokenizer has no chat template; a ChatML fallback renders them, so the model is asked in a format it may not know. Add chat_template.jinja to the model folder if the model has its own.".into(),
        });
    }
    out.sort_by_key(|l| std::cmp::Reverse(l.severity));
    out
}

/// `c` of `n` rows as a percentage.
fn pct(c: usize, n: usize) -> f64 {
    100.0 * c as f64 / n.max(1) as f64
}

fn lint(kind: LintKind, severity: Severity, rows: &[usize], message: String) -> Option<Lint> {
    (!rows.is_empty()).then(|| Lint {
        kind,
        severity,
        count: rows.len(),
        examples: rows.iter().copied().take(MAX_EXAMPLES).collect(),
        message,
    })
}

/// "row 3, row 8 and row 9", the first few of `rows`.
fn named_rows(rows: &[usize]) -> String {
    let mut s = rows
        .iter()
        .take(MAX_NAMED)
        .map(|r| format!("row {r}"))
        .collect::<Vec<_>>()
        .join(", ");
    if rows.len() > MAX_NAMED {
        s.push_str(&format!(" and {} more", rows.len() - MAX_NAMED));
    }
    s
}

fn empty_lint(rows: &[PromptRow], blank: &[bool]) -> Option<Lint> {
    let empty: Vec<usize> = rows
        .iter()
        .zip(blank)
        .filter(|(r, &b)| r.prompt_ids.is_empty() || b)
        .map(|(r, _)| r.index)
        .collect();
    let none = rows.iter().filter(|r| r.prompt_ids.is_empty()).count();
    lint(
        LintKind::GrpoEmptyPrompt,
        Severity::Error,
        &empty,
        format!(
            "{} prompts are empty ({}): {none} render to no token and the rest hold only whitespace where the question should be; the model would be sampled from nothing. Fill in or remove those rows.",
            empty.len(),
            named_rows(&empty)
        ),
    )
}

fn truncated_lint(rows: &[PromptRow], ctx: &PromptLintContext) -> Option<Lint> {
    let cut: Vec<usize> = rows
        .iter()
        .filter(|r| r.cut_tokens > 0)
        .map(|r| r.index)
        .collect();
    let longest = rows
        .iter()
        .map(|r| r.len() + r.cut_tokens)
        .max()
        .unwrap_or(0);
    let limit = ctx
        .max_prompt_length
        .map_or_else(|| "its limit".to_string(), |m| m.to_string());
    lint(
        LintKind::GrpoPromptTruncated,
        Severity::Warning,
        &cut,
        format!(
            "{} prompts ({:.1}%: {}) are longer than grpo.max_prompt_length = {limit} tokens and lose their start (the end, nearest the answer, is kept), so the model may not see the whole question; the longest has {longest} tokens. Raise `grpo.max_prompt_length` to {longest} to keep every prompt whole.",
            cut.len(),
            pct(cut.len(), rows.len()),
            named_rows(&cut)
        ),
    )
}

fn duplicate_lint(rows: &[PromptRow]) -> Option<Lint> {
    let mut first: HashMap<&[u32], usize> = HashMap::with_capacity(rows.len());
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    for r in rows.iter().filter(|r| !r.prompt_ids.is_empty()) {
        if let Some(&earlier) = first.get(r.prompt_ids.as_slice()) {
            pairs.push((r.index, earlier));
        } else {
            first.insert(&r.prompt_ids, r.index);
        }
    }
    let dup: Vec<usize> = pairs.iter().map(|&(r, _)| r).collect();
    let mut named = pairs
        .iter()
        .take(MAX_NAMED)
        .map(|(r, e)| format!("row {r} repeats row {e}"))
        .collect::<Vec<_>>()
        .join(", ");
    if pairs.len() > MAX_NAMED {
        named.push_str(&format!(" and {} more", pairs.len() - MAX_NAMED));
    }
    lint(
        LintKind::GrpoDuplicatePrompt,
        Severity::Warning,
        &dup,
        format!(
            "{} prompts ({:.1}%) repeat an earlier prompt's tokens ({named}); a repeated prompt is sampled and trained more often than the others. Remove the repeats unless that weight is meant.",
            dup.len(),
            pct(dup.len(), rows.len())
        ),
    )
}

/// Column names that usually hold a reference answer, offered as the fix.
const ANSWER_COLUMNS: [&str; 8] = [
    "answer",
    "solution",
    "ground_truth",
    "output",
    "target",
    "final_answer",
    "label",
    "reference",
];

/// `grpo-missing-answer-column` (error): rows that lack `column` (or hold null in it), the
/// column the accuracy reward `reward_name` compares completions with. `None` when every row
/// has it. The message names the column, the reward, the first row without it and that row's
/// columns, and the `[[grpo.reward]]` setting that fixes it.
pub fn answer_column_lint(rows: &[PromptRow], column: &str, reward_name: &str) -> Option<Lint> {
    let missing: Vec<usize> = rows
        .iter()
        .filter(|r| r.columns.get(column).is_none_or(|v| v.is_null()))
        .map(|r| r.index)
        .collect();
    let first = rows.iter().find(|r| Some(&r.index) == missing.first())?;
    let have: Vec<&str> = first.columns.keys().map(String::as_str).collect();
    let fix = match ANSWER_COLUMNS
        .into_iter()
        .find(|c| *c != column && first.columns.get(*c).is_some_and(|v| !v.is_null()))
    {
        Some(c) => format!("set column = \"{c}\" in the reward's [[grpo.reward]] entry"),
        None => format!(
            "set column = \"...\" in the reward's [[grpo.reward]] entry to the column that holds the reference answer, or add a `{column}` column to the data"
        ),
    };
    lint(
        LintKind::GrpoMissingAnswerColumn,
        Severity::Error,
        &missing,
        format!(
            "the accuracy reward `{reward_name}` reads column `{column}`, but {} of {} rows lack it (the first is row {}, whose columns are: {}); their completions cannot be scored. Fix: {fix}.",
            missing.len(),
            rows.len(),
            first.index,
            have.join(", ")
        ),
    )
}
