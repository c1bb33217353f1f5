//! `[[grpo.reward]]`: one reward function as the run config writes it, and its validation.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::reward_error::RewardError;

/// The dataset column an `accuracy` reward reads when `column` is not set.
pub const DEFAULT_COLUMN: &str = "answer";
/// How long a `command` reward waits for each score line when `timeout_secs` is not set.
pub const DEFAULT_TIMEOUT_SECS: f64 = 60.0;

/// What a reward function computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardKind {
    /// 1.0 when the completion's final answer equals the row's `column` (default `answer`),
    /// else 0.0. The final answer is the first capture group of the last match of `pattern`
    /// when set (the whole match if the group did not take part), else the content of the
    /// last `\boxed{…}`, else the last number (`-3`, `2.5`, `1,234`). The row's value is a
    /// JSON number or string; a string is cut after its last `####` (GSM8K's solutions), or
    /// to its last `\boxed{…}` when it has one. Both sides compare as numbers when both parse
    /// (`12` = `12.0`, `1,234` = `1234`, `$5` = `5`; a trailing `.` is dropped), else as
    /// trimmed text with runs of whitespace made one space.
    Accuracy,
    /// 1.0 when `pattern` matches the whole completion after trimming (as if written
    /// `(?s)^(?:pattern)$`: `.` crosses newlines), else 0.0.
    Format,
    /// 0 up to `target_tokens` completion tokens, then −(tokens − target) / target, down to
    /// −1 at twice the target and beyond.
    Length,
    /// A program (`command = ["python3", "reward.py"]`) started once per run in the run
    /// config's folder. For each completion it reads one JSON object per line on stdin — the
    /// row's own columns with `prompt` and `completion` (text) beside them — and writes one
    /// finite number per line on stdout, in order. A batch is written at once; it must answer
    /// with as many lines. `timeout_secs` (default 60) bounds the wait for each line.
    /// `PYTHONUNBUFFERED=1` is set so Python's `print` reaches the pipe at once.
    Command,
}

impl RewardKind {
    /// The name in the run config.
    pub fn as_str(self) -> &'static str {
        match self {
            RewardKind::Accuracy => "accuracy",
            RewardKind::Format => "format",
            RewardKind::Length => "length",
            RewardKind::Command => "command",
        }
    }
}

impl std::fmt::Display for RewardKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn default_weight() -> f64 {
    1.0
}

/// One `[[grpo.reward]]` entry. Keys of another kind than `kind` are refused by [`validate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardSpec {
    /// What it computes.
    pub kind: RewardKind,
    /// Its weight in the summed reward (TRL's `reward_weights`); 0 logs it without training
    /// on it.
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// The name in the metrics (`rewards/<name>/mean`). Default: the kind; for a command the
    /// file stem of its first argument with an extension (`reward.py` → `reward`), else of
    /// its program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `accuracy`: the dataset column holding the answer (default `answer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub column: Option<String>,
    /// `accuracy`: a regex whose first group is the answer; `format`: the regex the
    /// completion must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<String>,
    /// `length`: the completion length in tokens beyond which the penalty starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_tokens: Option<usize>,
    /// `command`: the program and its arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// `command`: the longest wait for each score line, in seconds (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<f64>,
}

impl RewardSpec {
    fn of_kind(kind: RewardKind) -> Self {
        RewardSpec {
            kind,
            weight: 1.0,
            name: None,
            column: None,
            pattern: None,
            target_tokens: None,
            command: None,
            timeout_secs: None,
        }
    }

    /// An `accuracy` reward on `column`.
    pub fn accuracy(column: &str) -> Self {
        RewardSpec {
            column: Some(column.to_string()),
            ..Self::of_kind(RewardKind::Accuracy)
        }
    }

    /// A `format` reward for `pattern`.
    pub fn format(pattern: &str) -> Self {
        RewardSpec {
            pattern: Some(pattern.to_string()),
            ..Self::of_kind(RewardKind::Format)
        }
    }

    /// A `length` reward with a target of `target_tokens`.
    pub fn length(target_tokens: usize) -> Self {
        RewardSpec {
            target_tokens: Some(target_tokens),
            ..Self::of_kind(RewardKind::Length)
        }
    }

    /// A `command` reward running `argv`.
    pub fn command<S: AsRef<str>>(argv: &[S]) -> Self {
        RewardSpec {
            command: Some(argv.iter().map(|a| a.as_ref().to_string()).collect()),
            ..Self::of_kind(RewardKind::Command)
        }
    }

    /// The same with `weight`.
    pub fn with_weight(self, weight: f64) -> Self {
        RewardSpec { weight, ..self }
    }

    /// The same named `name`.
    pub fn named(self, name: &str) -> Self {
        RewardSpec {
            name: Some(name.to_string()),
            ..self
        }
    }

    /// Its name in the metrics: `name` when set, else the default the field describes.
    pub fn name(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        match (self.kind, self.command.as_deref()) {
            (RewardKind::Command, Some([program, args @ ..])) => {
                let script = args
                    .iter()
                    .find(|a| !a.starts_with('-') && Path::new(a.as_str()).extension().is_some());
                file_stem(script.unwrap_or(program))
            }
            _ => self.kind.as_str().to_string(),
        }
    }

    /// `accuracy`'s column.
    pub fn column(&self) -> &str {
        self.column.as_deref().unwrap_or(DEFAULT_COLUMN)
    }

    /// `command`'s wait for each line.
    pub fn timeout_secs(&self) -> f64 {
        self.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS)
    }
}

fn file_stem(path: &str) -> String {
    Path::new(path)
        .file_stem()
        .map_or_else(|| path.to_string(), |s| s.to_string_lossy().into_owned())
}

/// Checks every entry: names unique and usable in a metric name, weights finite, the keys of
/// its kind present (and no other kind's), regexes that compile, a non-empty command, a
/// positive `target_tokens` and `timeout_secs`. The first problem is returned.
pub fn validate(specs: &[RewardSpec]) -> Result<(), RewardError> {
    let mut seen = HashSet::new();
    for spec in specs {
        let name = spec.name();
        if name.trim().is_empty() || name.contains('/') || name != name.trim() {
            return Err(RewardError::BadName { name });
        }
        if !seen.insert(name.clone()) {
            return Err(RewardError::DuplicateName { name });
        }
        validate_one(&name, spec)?;
    }
    Ok(())
}

fn validate_one(name: &str, spec: &RewardSpec) -> Result<(), RewardError> {
    let reward = name.to_string();
    if !(spec.weight.is_finite() && (spec.weight as f32).is_finite()) {
        return Err(RewardError::BadWeight {
            reward,
            weight: spec.weight,
        });
    }
    check_keys(name, spec)?;
    match spec.kind {
        RewardKind::Accuracy => {
            if let Some(p) = &spec.pattern {
                compile(name, p, false)?;
            }
        }
        RewardKind::Format => {
            compile(name, spec.pattern.as_deref().unwrap_or_default(), true)?;
        }
        RewardKind::Length => {
            if spec.target_tokens == Some(0) {
                return Err(RewardError::BadTargetTokens { reward });
            }
        }
        RewardKind::Command => {
            let empty = spec
                .command
                .as_ref()
                .is_none_or(|argv| argv.first().is_none_or(|program| program.trim().is_empty()));
            if empty {
                return Err(RewardError::EmptyCommand { reward });
            }
            let t = spec.timeout_secs();
            if !(t > 0.0 && t.is_finite() && t <= 86_400.0 * 365.0) {
                return Err(RewardError::BadTimeout {
                    reward,
                    timeout_secs: t,
                });
            }
        }
    }
    Ok(())
}

/// The keys a kind takes besides `kind`, `weight` and `name`.
pub(super) fn keys_of(kind: RewardKind) -> &'static [&'static str] {
    match kind {
        RewardKind::Accuracy => &["column", "pattern"],
        RewardKind::Format => &["pattern"],
        RewardKind::Length => &["target_tokens"],
        RewardKind::Command => &["command", "timeout_secs"],
    }
}

/// The kind's required key is there; no key of another kind is.
fn check_keys(name: &str, spec: &RewardSpec) -> Result<(), RewardError> {
    let set = [
        ("column", spec.column.is_some()),
        ("pattern", spec.pattern.is_some()),
        ("target_tokens", spec.target_tokens.is_some()),
        ("command", spec.command.is_some()),
        ("timeout_secs", spec.timeout_secs.is_some()),
    ];
    let allowed = keys_of(spec.kind);
    if let Some((key, _)) = set.iter().find(|(key, on)| *on && !allowed.contains(key)) {
        return Err(RewardError::ForeignKey {
            reward: name.to_string(),
            kind: spec.kind,
            key,
        });
    }
    let required = match spec.kind {
        RewardKind::Accuracy => None,
        RewardKind::Format => Some("pattern"),
        RewardKind::Length => Some("target_tokens"),
        RewardKind::Command => Some("command"),
    };
    match required {
        Some(key) if !set.iter().any(|(k, on)| *k == key && *on) => Err(RewardError::MissingKey {
            reward: name.to_string(),
            kind: spec.kind,
            key,
        }),
        _ => Ok(()),
    }
}

/// Compiles a pattern; `whole` anchors it to the whole text, `.` crossing newlines.
pub(super) fn compile(name: &str, pattern: &str, whole: bool) -> Result<regex::Regex, RewardError> {
    let full = if whole {
        format!("(?s)^(?:{pattern})$")
    } else {
        pattern.to_string()
    };
    // Compiled alone first, so an error points into the user's pattern, not the wrapper.
    regex::Regex::new(pattern)
        .and_then(|_| regex::Regex::new(&full))
        .map_err(|source| RewardError::BadPattern {
            reward: name.to_string(),
            pattern: pattern.to_string(),
            source: Box::new(source),
        })
}
