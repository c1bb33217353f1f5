//! What can go wrong with a reward function: its entry, the row it reads, or its program.
//! Every message names the function (`rewards/<name>`), what happened and the fix.

use std::path::PathBuf;

use super::spec::{keys_of, RewardKind};

/// A reward function's entry is wrong, or scoring failed.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// A name that cannot be a metric name.
    #[error("the reward name `{name}` cannot name a metric (rewards/<name>/mean): give a non-empty `name` without `/` or surrounding spaces")]
    BadName { name: String },
    /// Two entries with the same name.
    #[error("two [[grpo.reward]] entries are named `{name}` (a name defaults to the kind, or to a command's script): give each a distinct `name`")]
    DuplicateName { name: String },
    /// A weight that is not a finite f32.
    #[error("rewards/{reward}: weight = {weight} is not a finite number: use e.g. 1.0 (0 logs the reward without training on it)")]
    BadWeight { reward: String, weight: f64 },
    /// A key of another kind.
    #[error("rewards/{reward}: `{key}` is not a key of a {kind} reward (its keys: {}): remove it, or set the kind it belongs to", keys_list(*.kind))]
    ForeignKey {
        reward: String,
        kind: RewardKind,
        key: &'static str,
    },
    /// The kind's required key is missing.
    #[error("rewards/{reward}: a {kind} reward needs `{key}`: {}", example(*.kind))]
    MissingKey {
        reward: String,
        kind: RewardKind,
        key: &'static str,
    },
    /// A regex that does not compile.
    #[error("rewards/{reward}: the pattern `{pattern}` is not a valid regular expression: {source}\nfix the pattern (Rust regex syntax, no look-around); in TOML write it as a literal string, '\\d+', so each backslash stays one")]
    BadPattern {
        reward: String,
        pattern: String,
        source: Box<regex::Error>,
    },
    /// `target_tokens = 0`.
    #[error("rewards/{reward}: target_tokens must be ≥ 1: the completion length, in tokens, beyond which the penalty starts")]
    BadTargetTokens { reward: String },
    /// `command = []` or an empty program.
    #[error("rewards/{reward}: the command is empty: give the program and its arguments, e.g. command = [\"python3\", \"reward.py\"]")]
    EmptyCommand { reward: String },
    /// A timeout that is not a positive number of seconds.
    #[error("rewards/{reward}: timeout_secs = {timeout_secs} must be a positive number of seconds (default 60)")]
    BadTimeout { reward: String, timeout_secs: f64 },
    /// The row has no such column.
    #[error("rewards/{reward}: completion {index} of the batch: the dataset row has no column `{column}` (its columns: {}): set `column` to the one holding the answer, or add `{column}` to every row", columns.join(", "))]
    MissingColumn {
        reward: String,
        column: String,
        index: usize,
        columns: Vec<String>,
    },
    /// The column holds neither a string nor a number.
    #[error("rewards/{reward}: completion {index} of the batch: the column `{column}` holds {value}, not a string or number: give every row an answer such as \"42\" or 42")]
    BadColumnValue {
        reward: String,
        column: String,
        index: usize,
        value: String,
    },
    /// The program could not be started.
    #[error("rewards/{reward}: could not start `{command}` (in {}): {source}; {}", work_dir.display(), start_fix(source))]
    Start {
        reward: String,
        command: String,
        work_dir: PathBuf,
        source: std::io::Error,
    },
    /// The program exited (or was killed) before answering the whole batch.
    #[error("rewards/{reward}: `{command}` stopped ({status}) after {scored} of {expected} scores{}\nfix the program — try it by hand: echo '{{\"prompt\": \"…\", \"completion\": \"…\"}}' | {command} — it must keep reading stdin until it closes and write one number per line", tail(stderr_tail))]
    Exited {
        reward: String,
        command: String,
        status: String,
        scored: usize,
        expected: usize,
        stderr_tail: String,
    },
    /// A line that is not a finite number.
    #[error("rewards/{reward}: `{command}` wrote {line:?} as score line {line_number} of {expected}, not a finite number{}\nit must write exactly one number per input line on stdout (e.g. print(score, flush=True)); send logs to stderr", tail(stderr_tail))]
    NotANumber {
        reward: String,
        command: String,
        line: String,
        line_number: usize,
        expected: usize,
        stderr_tail: String,
    },
    /// Fewer lines than completions (stdout closed), or more.
    #[error("rewards/{reward}: `{command}` {what} (a batch of {expected} completions){}\nit must write exactly one line per input line, in order, and keep running until stdin closes", tail(stderr_tail))]
    WrongCount {
        reward: String,
        command: String,
        what: String,
        expected: usize,
        stderr_tail: String,
    },
    /// No score line within the timeout.
    #[error("rewards/{reward}: `{command}` wrote no score within timeout_secs = {timeout_secs} (it had written {scored} of {expected}){}\nmake sure it flushes each line (print(score, flush=True)), make it faster, or raise timeout_secs", tail(stderr_tail))]
    Timeout {
        reward: String,
        command: String,
        timeout_secs: f64,
        scored: usize,
        expected: usize,
        stderr_tail: String,
    },
    /// Reading the program's output failed.
    #[error("rewards/{reward}: reading the output of `{command}` failed: {source}")]
    Io {
        reward: String,
        command: String,
        source: std::io::Error,
    },
    /// The program was stopped by an earlier error.
    #[error("rewards/{reward}: `{command}` was stopped by an earlier error; start the reward functions again after fixing it")]
    Stopped { reward: String, command: String },
}

impl RewardError {
    /// The reward function concerned, when there is one.
    pub fn reward(&self) -> Option<&str> {
        match self {
            RewardError::BadName { .. } => None,
            RewardError::DuplicateName { name } => Some(name),
            RewardError::BadWeight { reward, .. }
            | RewardError::ForeignKey { reward, .. }
            | RewardError::MissingKey { reward, .. }
            | RewardError::BadPattern { reward, .. }
            | RewardError::BadTargetTokens { reward }
            | RewardError::EmptyCommand { reward }
            | RewardError::BadTimeout { reward, .. }
            | RewardError::MissingColumn { reward, .. }
            | RewardError::BadColumnValue { reward, .. }
            | RewardError::Start { reward, .. }
            | RewardError::Exited { reward, .. }
            | RewardError::NotANumber { reward, .. }
            | RewardError::WrongCount { reward, .. }
            | RewardError::Timeout { reward, .. }
            | RewardError::Io { reward, .. }
            | RewardError::Stopped { reward, .. } => Some(reward),
        }
    }
}

fn keys_list(kind: RewardKind) -> String {
    keys_of(kind).join(", ")
}

fn example(kind: RewardKind) -> &'static str {
    match kind {
        RewardKind::Accuracy => "e.g. column = \"answer\"",
        RewardKind::Format => {
            "the regex the whole completion must match, e.g. pattern = '<think>.*</think>\\s*<answer>.*</answer>'"
        }
        RewardKind::Length => "the length in tokens beyond which the penalty starts, e.g. target_tokens = 200",
        RewardKind::Command => "the program and its arguments, e.g. command = [\"python3\", \"reward.py\"]",
    }
}

fn start_fix(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::NotFound => {
            "install the program or give its path (a relative path with a `/` starts at the run config's folder)"
        }
        std::io::ErrorKind::PermissionDenied => "make the program executable (chmod +x) or run it through its interpreter",
        _ => "check the command",
    }
}

/// The stderr tail, as the end of a message.
fn tail(stderr_tail: &str) -> String {
    if stderr_tail.trim().is_empty() {
        "; it wrote nothing on stderr".to_string()
    } else {
        let indented: String = stderr_tail
            .trim_end()
            .lines()
            .map(|l| format!("\n  | {l}"))
            .collect();
        format!("; the end of its stderr:{indented}")
    }
}
