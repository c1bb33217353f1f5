//! Tokens grouped into whole characters.
//!
//! Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) splits most Hebrew, Arabic and CJK
//! characters over two or three tokens, each holding part of the character's UTF-8 bytes.
//! Such a token has no text of its own, so it is shown together with its neighbours: a
//! group ends at the first token boundary where every character begun is complete.

use std::ops::Range;

/// Consecutive tokens whose bytes together are whole characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenGroup {
    /// The tokens (indices into the sequence).
    pub tokens: Range<usize>,
    /// The characters they form. Bytes that are no valid UTF-8 (a character cut by
    /// truncation, a stray byte) are written `\xHH`, so every byte shows.
    pub text: String,
}

impl TokenGroup {
    /// Whether the group spans several tokens (a character split between them).
    pub fn is_split(&self) -> bool {
        self.tokens.len() > 1
    }
}

/// A group never spans more tokens than this: a character has at most 4 bytes, so only a
/// run of broken bytes could reach it, and it must not swallow a whole row.
const MAX_GROUP_TOKENS: usize = 8;

/// Groups `tokens` (each one's bytes) so that every group's bytes are whole characters. A
/// token that forms whole characters alone is a group of one.
pub fn group_tokens<B: AsRef<[u8]>>(tokens: &[B]) -> Vec<TokenGroup> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut pending = 0usize;
    let mut bytes = Vec::new();
    for (i, token) in tokens.iter().enumerate() {
        let token = token.as_ref();
        // A character left incomplete before a token that does not continue it: the
        // earlier tokens form a (broken) group of their own.
        if pending > 0 && token.first().is_some_and(|&b| !is_continuation(b)) {
            out.push(close(start..i, &mut bytes));
            start = i;
            pending = 0;
        }
        for &b in token {
            pending = still_expected(pending, b);
        }
        bytes.extend_from_slice(token);
        if pending == 0 || i + 1 - start >= MAX_GROUP_TOKENS {
            out.push(close(start..i + 1, &mut bytes));
            start = i + 1;
            pending = 0;
        }
    }
    if start < tokens.len() {
        out.push(close(start..tokens.len(), &mut bytes));
    }
    out
}

fn close(tokens: Range<usize>, bytes: &mut Vec<u8>) -> TokenGroup {
    let text = escape_invalid(bytes);
    bytes.clear();
    TokenGroup { tokens, text }
}

fn is_continuation(b: u8) -> bool {
    b & 0xC0 == 0x80
}

/// Continuation bytes still expected after byte `b`, given `pending` before it.
fn still_expected(pending: usize, b: u8) -> usize {
    if is_continuation(b) {
        // A stray continuation byte completes nothing: it is shown escaped.
        return pending.saturating_sub(1);
    }
    match b {
        0xC2..=0xDF => 1,
        0xE0..=0xEF => 2,
        0xF0..=0xF4 => 3,
        _ => 0,
    }
}

/// `bytes` as text, each invalid byte written `\xHH`.
pub fn escape_invalid(mut bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    loop {
        match std::str::from_utf8(bytes) {
            Ok(s) => {
                out.push_str(s);
                return out;
            }
            Err(e) => {
                let (valid, rest) = bytes.split_at(e.valid_up_to());
                // `valid_up_to` marks a valid prefix, so nothing is replaced here.
                out.push_str(&String::from_utf8_lossy(valid));
                let bad = e.error_len().unwrap_or(rest.len());
                for b in &rest[..bad] {
                    out.push_str(&format!("\\x{b:02X}"));
                }
                bytes = &rest[bad..];
            }
        }
    }
}

/// `bytes` in hex, space-separated (`D7 A9`), for token tooltips.
pub fn hex_bytes(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(tokens: &[&[u8]]) -> Vec<(Range<usize>, String)> {
        group_tokens(tokens)
            .into_iter()
            .map(|g| (g.tokens, g.text))
            .collect()
    }

    #[test]
    fn whole_tokens_are_groups_of_one() {
        assert_eq!(
            groups(&[b"Hello", b" world"]),
            vec![(0..1, "Hello".into()), (1..2, " world".into())]
        );
    }

    #[test]
    fn a_split_character_joins_its_tokens() {
        // "ש" is D7 A9, "你" is E4 BD A0.
        let t: &[&[u8]] = &[b" \xD7", b"\xA9", b"\xE4", b"\xBD\xA0", b"!"];
        assert_eq!(
            groups(t),
            vec![(0..2, " ש".into()), (2..4, "你".into()), (4..5, "!".into())]
        );
    }

    #[test]
    fn tokens_sharing_two_characters_form_one_group() {
        // "של" = D7 A9 D7 9C split as [D7] [A9 D7] [9C].
        let t: &[&[u8]] = &[b"\xD7", b"\xA9\xD7", b"\x9C"];
        assert_eq!(groups(t), vec![(0..3, "של".into())]);
    }

    #[test]
    fn a_cut_character_shows_its_bytes() {
        // Truncation cut "ש" after its first byte; then a pad token.
        let t: &[&[u8]] = &[b"a", b"\xD7", b"<pad>"];
        assert_eq!(
            groups(t),
            vec![
                (0..1, "a".into()),
                (1..2, "\\xD7".into()),
                (2..3, "<pad>".into())
            ]
        );
        assert_eq!(groups(&[b"\xA9"]), vec![(0..1, "\\xA9".into())]);
        assert_eq!(groups(&[b"\xE4\xBD"]), vec![(0..1, "\\xE4\\xBD".into())]);
    }

    #[test]
    fn hex_is_spaced() {
        assert_eq!(hex_bytes(&[0xD7, 0xA9]), "D7 A9");
    }
}
