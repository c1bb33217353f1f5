//! The built-in rewards, compiled from their specs: `accuracy`, `format`, `length`.

use regex::Regex;

use super::answer::{answers_match, final_answer, pattern_answer, reference_answer};
use super::reward_error::RewardError;
use super::spec::{compile, RewardKind, RewardSpec};
use super::RewardInput;

/// A built-in reward, ready to score.
pub(super) enum Builtin {
    Accuracy {
        column: String,
        pattern: Option<Regex>,
    },
    Format {
        whole: Regex,
    },
    Length {
        target_tokens: usize,
    },
}

impl Builtin {
    /// Compiles a validated spec of a built-in kind.
    pub(super) fn compile(name: &str, spec: &RewardSpec) -> Result<Self, RewardError> {
        Ok(match spec.kind {
            RewardKind::Accuracy => Builtin::Accuracy {
                column: spec.column().to_string(),
                pattern: match &spec.pattern {
                    Some(p) => Some(compile(name, p, false)?),
                    None => None,
                },
            },
            RewardKind::Format => Builtin::Format {
                whole: compile(name, spec.pattern.as_deref().unwrap_or_default(), true)?,
            },
            RewardKind::Length => Builtin::Length {
                // `validate` requires it; 1 would only be reached by an unvalidated spec.
                target_tokens: spec.target_tokens.unwrap_or(1).max(1),
            },
            RewardKind::Command => unreachable!("command rewards are not built in"),
        })
    }

    /// The reward of completion `index` of the batch.
    pub(super) fn score(
        &self,
        name: &str,
        index: usize,
        input: &RewardInput,
    ) -> Result<f32, RewardError> {
        Ok(match self {
            Builtin::Accuracy { column, pattern } => {
                let reference = row_answer(name, column, index, input)?;
                let answer = match pattern {
                    Some(p) => pattern_answer(p, input.completion),
                    None => final_answer(input.completion),
                };
                f32::from(u8::from(
                    answer.is_some_and(|a| answers_match(a, &reference)),
                ))
            }
            Builtin::Format { whole } => {
                f32::from(u8::from(whole.is_match(input.completion.trim())))
            }
            Builtin::Length { target_tokens } => {
                length_penalty(input.completion_tokens, *target_tokens)
            }
        })
    }
}

/// 0 within the target, then −(tokens − target) / target, at least −1.
pub(super) fn length_penalty(tokens: usize, target_tokens: usize) -> f32 {
    if tokens <= target_tokens {
        return 0.0;
    }
    let over = (tokens - target_tokens) as f64;
    (-(over / target_tokens as f64)).max(-1.0) as f32
}

/// The row's reference answer, or the error naming the column.
fn row_answer(
    name: &str,
    column: &str,
    index: usize,
    input: &RewardInput,
) -> Result<String, RewardError> {
    let value = input
        .row
        .get(column)
        .ok_or_else(|| RewardError::MissingColumn {
            reward: name.to_string(),
            column: column.to_string(),
            index,
            columns: input.row.keys().cloned().collect(),
        })?;
    reference_answer(value).ok_or_else(|| {
        let mut shown = value.to_string();
        if shown.len() > 80 {
            let cut = (0..=80)
                .rev()
                .find(|&i| shown.is_char_boundary(i))
                .unwrap_or(0);
            shown.truncate(cut);
            shown.push('…');
        }
        RewardError::BadColumnValue {
            reward: name.to_string(),
            column: column.to_string(),
            index,
            value: shown,
        }
    })
}
