//! Whitespace and control characters made visible, for token chips and the CLI preview:
//! a token that is only a space or a newline must still show something.

/// The visible form of one character: a space is `·`, a newline `\n`, a tab `\t`, other
/// control characters `\u{…}`; anything else is itself.
pub fn visible_char(c: char, out: &mut String) {
    match c {
        ' ' => out.push('·'),
        '\n' => out.push_str("\\n"),
        '\t' => out.push_str("\\t"),
        '\r' => out.push_str("\\r"),
        c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
        c => out.push(c),
    }
}

/// `text` with every character in its visible form (see [`visible_char`]).
pub fn visible(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        visible_char(c, &mut out);
    }
    out
}

/// [`visible`], but spaces stay spaces (the terminal preview separates tokens by position).
pub fn visible_keep_spaces(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            ' ' => out.push(' '),
            c => visible_char(c, &mut out),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whitespace_shows() {
        assert_eq!(visible(" the"), "·the");
        assert_eq!(visible("\n\n"), "\\n\\n");
        assert_eq!(visible("\u{7}"), "\\u{7}");
        assert_eq!(visible("שלום"), "שלום");
        assert_eq!(visible_keep_spaces(" a\n"), " a\\n");
    }
}
