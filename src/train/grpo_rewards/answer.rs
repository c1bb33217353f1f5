//! The `accuracy` reward's answers: the final answer of a completion, the reference answer of
//! a dataset row, and whether the two agree (as numbers when both are numbers).

use std::sync::OnceLock;

use regex::Regex;
use serde_json::Value;

/// A number as people write one: an optional minus, digits with optional thousands commas
/// (`1,234`), an optional decimal part.
const NUMBER: &str = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?";

fn number_regex() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(NUMBER).expect("a fixed, tested pattern"))
}

fn whole_number_regex() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(&format!("^{NUMBER}$")).expect("a fixed, tested pattern"))
}

/// The completion's final answer by the default rule: the last `\boxed{…}`'s content, else the
/// last number.
pub(super) fn final_answer(text: &str) -> Option<&str> {
    last_boxed(text).or_else(|| last_number(text))
}

/// The final answer by a user's pattern: the last match's first group (the whole match when
/// the pattern has no group or the group did not take part).
pub(super) fn pattern_answer<'t>(pattern: &Regex, text: &'t str) -> Option<&'t str> {
    let caps = pattern.captures_iter(text).last()?;
    caps.get(1).or_else(|| caps.get(0)).map(|m| m.as_str())
}

/// The content of the last `\boxed{…}` whose braces balance.
pub(super) fn last_boxed(text: &str) -> Option<&str> {
    const OPEN: &str = "\\boxed{";
    text.rmatch_indices(OPEN).find_map(|(at, _)| {
        let start = at + OPEN.len();
        let mut depth = 1usize;
        for (i, c) in text[start..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(&text[start..start + i]);
                    }
                }
                _ => {}
            }
        }
        None
    })
}

/// The last number in the text. A minus sign right after a letter or digit is a hyphen or a
/// subtraction (`x-3`, `12-5`), not the number's sign.
pub(super) fn last_number(text: &str) -> Option<&str> {
    let m = number_regex().find_iter(text).last()?;
    let s = m.as_str();
    let after_word = text[..m.start()]
        .chars()
        .next_back()
        .is_some_and(char::is_alphanumeric);
    Some(if after_word && s.starts_with('-') {
        &s[1..]
    } else {
        s
    })
}

/// The row's reference answer: a number as written; a string cut after its last `####`
/// (GSM8K), else to its last `\boxed{…}`, else trimmed. `None` for null, booleans, arrays and
/// objects.
pub(super) fn reference_answer(value: &Value) -> Option<String> {
    match value {
        Value::Number(n) => Some(n.to_string()),
        Value::String(s) => Some(match s.rfind("####") {
            Some(at) => s[at + 4..].trim().to_string(),
            None => last_boxed(s).unwrap_or(s).trim().to_string(),
        }),
        _ => None,
    }
}

/// The text as a number: `12`, `-3.5`, `1,234`, `$5`, `+2`, `12.` (a sentence's full stop).
pub(super) fn parse_number(text: &str) -> Option<f64> {
    let t = text.trim();
    let t = t.strip_suffix('.').unwrap_or(t);
    let t = t.strip_prefix('$').unwrap_or(t);
    let t = t.strip_prefix('+').unwrap_or(t);
    if !whole_number_regex().is_match(t) {
        return None;
    }
    t.replace(',', "").parse().ok()
}

/// Whether a completion's answer equals the reference: as numbers when both parse, else as
/// trimmed text with whitespace runs made one space.
pub(super) fn answers_match(answer: &str, reference: &str) -> bool {
    match (parse_number(answer), parse_number(reference)) {
        (Some(a), Some(b)) => a == b,
        _ => normalize(answer) == normalize(reference),
    }
}

fn normalize(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
