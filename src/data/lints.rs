//! Dataset lints: problems that silently ruin a fine-tune, each with a
//! severity, a count and example rows.

use crate::data::labels::{DropReason, LabelledRow, IGNORE_INDEX};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// How bad a lint is. `Error` makes `tunestudio preview` exit non-zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Worth knowing.
    Info,
    /// Probably not what you want.
    Warning,
    /// Training on this would be wrong.
    Error,
}

/// What a lint is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LintKind {
    /// Trained labels differ from the input ids (e.g. `labels = [1]*len`, or
    /// pre-shifted labels).
    LabelsMismatch,
    /// Padding positions (attention mask 0) have labels.
    PaddingTrained,
    /// The tokenizer has no pad token; EOS is used.
    NoPadToken,
    /// Rows with no trained token (dropped).
    ZeroTrainedTokens,
    /// Truncation cut trained tokens.
    CompletionTruncated,
    /// Pre-tokenised rows without EOS.
    MissingEos,
    /// EOS was appended to rows (informational).
    EosAppended,
    /// Empty or whitespace rows / completions.
    EmptyRows,
    /// Identical token sequences.
    DuplicateRows,
    /// The prompt alone reaches `max_length`.
    PromptTooLong,
    /// Chat data but the tokenizer has no chat template.
    ChatWithoutTemplate,
    /// The template rewrites earlier turns when more follow.
    TemplateNotPrefixStable,
    /// Per-turn loss weights other than 0/1.
    NonBinaryLossWeights,
    /// Settings: the learning rate is far outside the usual range for the method.
    LearningRate,
    /// Settings: a high learning rate with no warm-up.
    NoWarmup,
    /// Settings: an effective batch of one row with a high learning rate.
    TinyEffectiveBatch,
    /// Settings: many epochs over a small dataset.
    ManyEpochs,
    /// Settings: `max_length` far above the data's longest row.
    MaxLengthOversized,
    /// Settings: half precision on a CPU with no half-precision arithmetic (each product
    /// widens its operands to f32).
    HalfPrecisionWidened,
    /// Preference pairs whose chosen and rejected completions are the same tokens.
    PairIdentical,
    /// Preference pairs with a completion that is empty (after truncation).
    PairCompletionEmpty,
    /// Preference pairs whose rendered conversations do not start with the prompt's tokens.
    PairPromptMismatch,
    /// Preference pairs with a completion whose every token is masked.
    PairCompletionMasked,
    /// Preference pairs whose completions lose tokens to `max_completion_length`.
    PairCompletionTruncated,
    /// Preference pairs whose prompts lose their start to `max_prompt_length`.
    PairPromptTruncated,
    /// GRPO prompts whose start is cut by `grpo.max_prompt_length`.
    GrpoPromptTruncated,
    /// GRPO prompts that repeat an earlier prompt's tokens.
    GrpoDuplicatePrompt,
    /// GRPO rows without the column an accuracy reward reads.
    GrpoMissingAnswerColumn,
    /// GRPO prompts with no token, or only whitespace as their text.
    GrpoEmptyPrompt,
    /// Every previewed GRPO group had equal rewards: every advantage 0, nothing to learn.
    GrpoZeroAdvantage,
}

impl LintKind {
    /// Every kind, for listing the names an override may use.
    pub const ALL: [LintKind; 30] = [
        LintKind::LabelsMismatch,
        LintKind::PaddingTrained,
        LintKind::NoPadToken,
        LintKind::ZeroTrainedTokens,
        LintKind::CompletionTruncated,
        LintKind::MissingEos,
        LintKind::EosAppended,
        LintKind::EmptyRows,
        LintKind::DuplicateRows,
        LintKind::PromptTooLong,
        LintKind::ChatWithoutTemplate,
        LintKind::TemplateNotPrefixStable,
        LintKind::NonBinaryLossWeights,
        LintKind::LearningRate,
        LintKind::NoWarmup,
        LintKind::TinyEffectiveBatch,
        LintKind::ManyEpochs,
        LintKind::MaxLengthOversized,
        LintKind::HalfPrecisionWidened,
        LintKind::PairIdentical,
        LintKind::PairCompletionEmpty,
        LintKind::PairPromptMismatch,
        LintKind::PairCompletionMasked,
        LintKind::PairCompletionTruncated,
        LintKind::PairPromptTruncated,
        LintKind::GrpoPromptTruncated,
        LintKind::GrpoDuplicatePrompt,
        LintKind::GrpoMissingAnswerColumn,
        LintKind::GrpoEmptyPrompt,
        LintKind::GrpoZeroAdvantage,
    ];

    /// The name a user overrides it by (`[data] allow = ["labels-mismatch"]`,
    /// `--allow-lint labels-mismatch`).
    pub fn id(self) -> &'static str {
        match self {
            LintKind::LabelsMismatch => "labels-mismatch",
            LintKind::PaddingTrained => "padding-trained",
            LintKind::NoPadToken => "no-pad-token",
            LintKind::ZeroTrainedTokens => "zero-trained-tokens",
            LintKind::CompletionTruncated => "completion-truncated",
            LintKind::MissingEos => "missing-eos",
            LintKind::EosAppended => "eos-appended",
            LintKind::EmptyRows => "empty-rows",
            LintKind::DuplicateRows => "duplicate-rows",
            LintKind::PromptTooLong => "prompt-too-long",
            LintKind::ChatWithoutTemplate => "chat-without-template",
            LintKind::TemplateNotPrefixStable => "template-not-prefix-stable",
            LintKind::NonBinaryLossWeights => "non-binary-loss-weights",
            LintKind::LearningRate => "learning-rate",
            LintKind::NoWarmup => "no-warmup",
            LintKind::TinyEffectiveBatch => "tiny-effective-batch",
            LintKind::ManyEpochs => "many-epochs",
            LintKind::MaxLengthOversized => "max-length-oversized",
            LintKind::HalfPrecisionWidened => "half-precision-widened",
            LintKind::PairIdentical => "pair-identical",
            LintKind::PairCompletionEmpty => "pair-completion-empty",
            LintKind::PairPromptMismatch => "pair-prompt-mismatch",
            LintKind::PairCompletionMasked => "pair-completion-masked",
            LintKind::PairCompletionTruncated => "pair-completion-truncated",
            LintKind::PairPromptTruncated => "pair-prompt-truncated",
            LintKind::GrpoPromptTruncated => "grpo-prompt-truncated",
            LintKind::GrpoDuplicatePrompt => "grpo-duplicate-prompt",
            LintKind::GrpoMissingAnswerColumn => "grpo-missing-answer-column",
            LintKind::GrpoEmptyPrompt => "grpo-empty-prompt",
            LintKind::GrpoZeroAdvantage => "grpo-zero-advantage",
        }
    }

    /// The kind named `id` (kebab-case as [`LintKind::id`], or snake_case as in JSON).
    pub fn from_id(id: &str) -> Option<LintKind> {
        let id = id.trim().replace('_', "-");
        LintKind::ALL.into_iter().find(|k| k.id() == id)
    }
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lint {
    /// What.
    pub kind: LintKind,
    /// How bad.
    pub severity: Severity,
    /// How many rows (or 1 for dataset-wide findings).
    pub count: usize,
    /// Up to 5 example row indices (dataset row numbers).
    pub examples: Vec<usize>,
    /// The explanation and the fix.
    pub message: String,
}

/// The rollout preview's finding: all `completions` previewed got the same reward `value`
/// within their groups, so every advantage is 0 (a warning: a hard task can start there, but a
/// reward that never varies is a bug in the reward).
pub fn grpo_zero_advantage(completions: usize, value: f64, rewards: &[String]) -> Lint {
    Lint {
        kind: LintKind::GrpoZeroAdvantage,
        severity: Severity::Warning,
        count: completions,
        examples: Vec::new(),
        message: format!(
            "every previewed group's {completions} completions got equal rewards (the first {value}) from {}: every advantage is 0, so these prompts teach nothing. Check that the reward can differ between completions (a format pattern that never matches, an answer column that is never found), or raise grpo.temperature for more varied completions",
            rewards.join(", ")
        ),
    }
}

/// Whether any lint is an error (the CLI's exit decision).
pub fn has_errors(lints: &[Lint]) -> bool {
    lints.iter().any(|l| l.severity == Severity::Error)
}

/// The error-level lints that stop a run: every error whose name is not in `allow`.
pub fn blocking<'a>(lints: &'a [Lint], allow: &[String]) -> Vec<&'a Lint> {
    lints
        .iter()
        .filter(|l| l.severity == Severity::Error)
        .filter(|l| !allow.iter().any(|a| LintKind::from_id(a) == Some(l.kind)))
        .collect()
}

const MAX_EXAMPLES: usize = 5;

/// The rows behind one lint: how many, and the first few.
#[derive(Default)]
pub(crate) struct Acc {
    pub(crate) count: usize,
    examples: Vec<usize>,
}

impl Acc {
    pub(crate) fn add(&mut self, row: usize) {
        self.count += 1;
        if self.examples.len() < MAX_EXAMPLES {
            self.examples.push(row);
        }
    }
}

/// Dataset-level facts the row lints cannot see.
#[derive(Debug, Clone, Copy, Default)]
pub struct LintContext {
    /// The tokenizer declares no pad token.
    pub no_pad_token: bool,
    /// Chat-formatted data.
    pub is_chat: bool,
    /// The tokenizer has no chat template (a fallback ChatML is used).
    pub no_chat_template: bool,
    /// Truncation length.
    pub max_length: usize,
}

/// Lints over labelled rows (most severe first).
pub fn lint_rows(rows: &[LabelledRow], ctx: &LintContext) -> Vec<Lint> {
    let t = Tally::of(rows);
    let mut out = Vec::new();
    label_lints(&mut out, &t, ctx);
    format_lints(&mut out, &t, ctx);
    out.sort_by_key(|l| std::cmp::Reverse(l.severity));
    out
}

/// The rows behind each lint, counted in one pass over the labelled rows.
#[derive(Default)]
struct Tally {
    rows: usize,
    mismatch: Acc,
    mismatch_tokens: usize,
    shifted: usize,
    pad_trained: Acc,
    zero: Acc,
    trunc: Acc,
    trunc_away: usize,
    missing_eos: Acc,
    eos_appended: Acc,
    empty: Acc,
    dup: Acc,
    too_long: Acc,
    unstable: Acc,
    weights: Acc,
}

impl Tally {
    fn of(rows: &[LabelledRow]) -> Self {
        let mut t = Tally {
            rows: rows.len(),
            ..Tally::default()
        };
        let mut seen: HashMap<u64, usize> = HashMap::with_capacity(rows.len());
        for r in rows {
            let row = r.sample.row;
            if r.labels_mismatch > 0 {
                t.mismatch.add(row);
                t.mismatch_tokens += r.labels_mismatch;
                t.shifted += usize::from(r.labels_pre_shifted);
            }
            if r.padding_trained > 0 {
                t.pad_trained.add(row);
            }
            match r.dropped {
                Some(DropReason::NoTrainedTokens) => t.zero.add(row),
                Some(DropReason::PromptTooLong) => t.too_long.add(row),
                Some(DropReason::Empty) => t.empty.add(row),
                _ => {}
            }
            if r.blank && r.dropped != Some(DropReason::Empty) {
                t.empty.add(row);
            }
            if r.completion_truncated {
                t.trunc.add(row);
                t.trunc_away += usize::from(r.dropped == Some(DropReason::CompletionTruncatedAway));
            }
            for (flag, acc) in [
                (r.missing_eos, &mut t.missing_eos),
                (r.eos_appended, &mut t.eos_appended),
                (r.prefix_unstable, &mut t.unstable),
                (r.non_binary_weights, &mut t.weights),
            ] {
                if flag {
                    acc.add(row);
                }
            }
            if !r.sample.input_ids.is_empty() {
                let h = hash_ids(&r.sample.input_ids, &r.sample.labels);
                if seen.insert(h, row).is_some() {
                    t.dup.add(row);
                }
            }
        }
        t
    }

    /// `c` rows as a percentage of all rows.
    fn pct(&self, c: usize) -> f64 {
        100.0 * c as f64 / self.rows.max(1) as f64
    }
}

/// A lint for the rows in `acc`, when there are any.
pub(crate) fn push(
    out: &mut Vec<Lint>,
    kind: LintKind,
    severity: Severity,
    acc: &Acc,
    message: String,
) {
    if acc.count > 0 {
        out.push(Lint {
            kind,
            severity,
            count: acc.count,
            examples: acc.examples.clone(),
            message,
        });
    }
}

/// What the labels and the truncation do to the rows: wrong labels, trained padding, prompts
/// or completions cut by max_length, rows with nothing to train, empty rows.
fn label_lints(out: &mut Vec<Lint>, t: &Tally, ctx: &LintContext) {
    let shift_note = if t.shifted * 2 >= t.mismatch.count.max(1) {
        " They look pre-shifted (labels[i] == input_ids[i+1]): causal LMs shift labels themselves, so give labels aligned with input_ids."
    } else {
        ""
    };
    let c = t.mismatch.count;
    push(
        out,
        LintKind::LabelsMismatch,
        Severity::Error,
        &t.mismatch,
        format!(
            "{c} rows ({:.1}%) have {} trained labels that differ from their input_ids; labels must equal input_ids where trained and -100 elsewhere.{shift_note}",
            t.pct(c),
            t.mismatch_tokens
        ),
    );
    let c = t.pad_trained.count;
    push(
        out,
        LintKind::PaddingTrained,
        Severity::Error,
        &t.pad_trained,
        format!("{c} rows train on padding (attention_mask 0 with a label other than -100); set those labels to -100. The padded positions are dropped here."),
    );
    let c = t.too_long.count;
    push(
        out,
        LintKind::PromptTooLong,
        Severity::Warning,
        &t.too_long,
        format!(
            "{c} rows ({:.1}%) have a prompt of at least max_length = {} tokens, leaving nothing to train; they are dropped. Raise max_length or shorten the prompts.",
            t.pct(c),
            ctx.max_length
        ),
    );
    let c = t.trunc.count;
    push(
        out,
        LintKind::CompletionTruncated,
        Severity::Warning,
        &t.trunc,
        format!(
            "{c} rows ({:.1}%) lose trained tokens to truncation at max_length = {} ({} lose all of them and are dropped); the model will not learn how those answers end. Raise max_length.",
            t.pct(c),
            ctx.max_length,
            t.trunc_away
        ),
    );
    let c = t.zero.count;
    // Some rows without a trained token are normal (a system-only row); all of them means
    // the labels or the mask are wrong and nothing would be learned.
    let zero_severity = if c == t.rows && t.rows > 0 {
        Severity::Error
    } else {
        Severity::Warning
    };
    push(
        out,
        LintKind::ZeroTrainedTokens,
        zero_severity,
        &t.zero,
        format!("{c} rows have no trained token (e.g. no assistant turn, or every label -100) and are dropped."),
    );
    let c = t.empty.count;
    push(
        out,
        LintKind::EmptyRows,
        Severity::Warning,
        &t.empty,
        format!("{c} rows have an empty or whitespace-only text/completion (empty plain-text rows are dropped; an empty completion teaches the model to stop at once)."),
    );
}

/// The format around the tokens: the chat template, EOS, duplicates, loss weights, padding.
fn format_lints(out: &mut Vec<Lint>, t: &Tally, ctx: &LintContext) {
    if ctx.is_chat && ctx.no_chat_template {
        out.push(Lint {
            kind: LintKind::ChatWithoutTemplate,
            severity: Severity::Warning,
            count: 1,
            examples: Vec::new(),
            message: "chat data, but the tokenizer has no chat template; a ChatML fallback is used, so the model learns a new format. Add chat_template.jinja to the model folder if the model has its own.".into(),
        });
    }
    let c = t.unstable.count;
    push(
        out,
        LintKind::TemplateNotPrefixStable,
        Severity::Warning,
        &t.unstable,
        format!("in {c} rows the chat template renders a conversation prefix differently from the same turns inside the full conversation (e.g. it drops earlier reasoning); masks follow token counts of the prefixes and may be off by a few tokens. Check these rows in the preview."),
    );
    let c = t.missing_eos.count;
    push(
        out,
        LintKind::MissingEos,
        Severity::Warning,
        &t.missing_eos,
        format!("{c} pre-tokenised rows contain no EOS token; the model will not learn to stop. Append the EOS id when tokenising."),
    );
    let c = t.dup.count;
    push(
        out,
        LintKind::DuplicateRows,
        if t.pct(c) > 5.0 { Severity::Warning } else { Severity::Info },
        &t.dup,
        format!("{c} rows ({:.1}%) repeat an earlier row's tokens exactly; duplicates weigh those examples more.", t.pct(c)),
    );
    let c = t.weights.count;
    push(
        out,
        LintKind::NonBinaryLossWeights,
        Severity::Info,
        &t.weights,
        format!("{c} rows use per-turn loss weights other than 0/1; the batches carry per-token weights."),
    );
    let c = t.eos_appended.count;
    push(
        out,
        LintKind::EosAppended,
        Severity::Info,
        &t.eos_appended,
        format!("{c} rows did not end with EOS; it was appended and is trained so the model learns to stop."),
    );
    if ctx.no_pad_token {
        out.push(Lint {
            kind: LintKind::NoPadToken,
            severity: Severity::Info,
            count: 1,
            examples: Vec::new(),
            message: "the tokenizer has no pad token; EOS pads batches. Padding is masked by position (labels -100, attention 0), so trained EOS tokens are unaffected.".into(),
        });
    }
}

fn hash_ids(ids: &[u32], labels: &[i64]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ids.hash(&mut h);
    // Two rows with the same tokens but different masks are not duplicates.
    labels
        .iter()
        .map(|&l| l == IGNORE_INDEX)
        .collect::<Vec<_>>()
        .hash(&mut h);
    h.finish()
}
