//! The Unicode Bidirectional Algorithm (UAX #9) for display: which way a paragraph runs, and
//! a line of it cut into pieces in visual order, left to right.
//!
//! A paragraph is the text up to a newline. Its direction comes from its first strong
//! character (rules P2–P3): a Hebrew instruction runs right to left even when the chat
//! template around it is English, because every template line is a paragraph of its own.
//! A paragraph with no strong character (digits or punctuation only) keeps the direction of
//! the one before it, so a lone "42." under a Hebrew line stays on the right.
//!
//! The embedding levels come from the `unicode-bidi` crate; numbers and Latin words inside
//! Hebrew keep running left to right (they get an even level inside the odd one), and
//! brackets in right-to-left pieces are mirrored (rule L4).

use std::ops::Range;
use unicode_bidi::{Level, ParagraphBidiInfo};

/// The direction a paragraph or a piece of it runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Left to right (Latin, Cyrillic, CJK, digits).
    Ltr,
    /// Right to left (Hebrew, Arabic).
    Rtl,
}

impl Direction {
    /// Whether it runs right to left.
    pub fn is_rtl(self) -> bool {
        self == Direction::Rtl
    }

    fn level(self) -> Level {
        match self {
            Direction::Ltr => Level::ltr(),
            Direction::Rtl => Level::rtl(),
        }
    }
}

/// The direction of the first strong character of `text` (rules P2–P3: text inside
/// isolates is skipped), `None` when it has none (digits, punctuation, whitespace). Only the
/// first paragraph counts.
pub fn first_strong_direction(text: &str) -> Option<Direction> {
    match unicode_bidi::get_base_direction(text) {
        unicode_bidi::Direction::Ltr => Some(Direction::Ltr),
        unicode_bidi::Direction::Rtl => Some(Direction::Rtl),
        unicode_bidi::Direction::Mixed => None,
    }
}

/// Whether `text` holds a right-to-left letter (Hebrew, Arabic): text without one reads the
/// same in logical and visual order, and can be shown as it is.
pub fn has_rtl_letters(text: &str) -> bool {
    use unicode_bidi::{bidi_class, BidiClass};
    text.chars()
        .any(|c| matches!(bidi_class(c), BidiClass::R | BidiClass::AL))
}

/// A piece of a line in visual order: bytes of the paragraph drawn as one unit, their
/// characters reversed (and brackets mirrored) when `rtl`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VisualPiece {
    /// Byte range in the paragraph's text (logical order).
    pub range: Range<usize>,
    /// Whether the piece runs right to left (an odd embedding level).
    pub rtl: bool,
}

/// One paragraph analysed for display.
pub struct BidiParagraph<'a> {
    info: ParagraphBidiInfo<'a>,
    direction: Direction,
}

impl<'a> BidiParagraph<'a> {
    /// Analyses `text` (one paragraph: a trailing newline at most) running in `direction`.
    pub fn new(text: &'a str, direction: Direction) -> Self {
        BidiParagraph {
            info: ParagraphBidiInfo::new(text, Some(direction.level())),
            direction,
        }
    }

    /// Analyses `text` in the direction of its first strong character, `fallback` when it
    /// has none.
    pub fn auto(text: &'a str, fallback: Direction) -> Self {
        Self::new(text, first_strong_direction(text).unwrap_or(fallback))
    }

    /// The paragraph's direction: right-to-left paragraphs are right-aligned.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// The paragraph's text, in logical order.
    pub fn text(&self) -> &'a str {
        self.info.text
    }

    /// Whether any character resolved to a right-to-left level (else the logical order is
    /// the visual order).
    pub fn has_rtl(&self) -> bool {
        self.info.has_rtl()
    }

    /// The pieces of `line` (a byte range of the paragraph, e.g. what fits one row of the
    /// screen) from left to right. A piece never crosses one of `cuts` (byte offsets, e.g.
    /// token boundaries), so each piece belongs to one token.
    pub fn visual_pieces(&self, line: Range<usize>, cuts: &[usize]) -> Vec<VisualPiece> {
        if line.is_empty() {
            return Vec::new();
        }
        let (levels, runs) = self.info.visual_runs(line);
        let mut out = Vec::new();
        for run in runs {
            let rtl = levels[run.start].is_rtl();
            let mut parts = split_at_cuts(run, cuts);
            if rtl {
                parts.reverse();
            }
            out.extend(parts.into_iter().map(|range| VisualPiece { range, rtl }));
        }
        out
    }

    /// A piece's characters in display order, left to right.
    pub fn piece_text(&self, piece: &VisualPiece) -> String {
        visual_chars(&self.text()[piece.range.clone()], piece.rtl)
    }

    /// `line` as displayed, left to right.
    pub fn visual_line(&self, line: Range<usize>) -> String {
        self.visual_pieces(line, &[])
            .iter()
            .map(|p| self.piece_text(p))
            .collect()
    }
}

/// `text` in display order: reversed with brackets mirrored when `rtl`, else unchanged.
/// Characters are reversed one by one, so a combining mark ends up before its base letter;
/// [`crate::text::for_script_shaper`] puts marks back for a shaper.
pub fn visual_chars(text: &str, rtl: bool) -> String {
    if rtl {
        text.chars().rev().map(mirror).collect()
    } else {
        text.to_string()
    }
}

/// The mirrored form of a bracket-like character (Bidi_Mirroring_Glyph), else `c`.
pub fn mirror(c: char) -> char {
    const PAIRS: &[(char, char)] = &[
        ('(', ')'),
        ('[', ']'),
        ('{', '}'),
        ('<', '>'),
        ('«', '»'),
        ('‹', '›'),
        ('≤', '≥'),
        ('⁅', '⁆'),
        ('〈', '〉'),
        ('⟨', '⟩'),
        ('（', '）'),
        ('［', '］'),
        ('｛', '｝'),
        ('「', '」'),
        ('『', '』'),
        ('【', '】'),
        ('《', '》'),
    ];
    PAIRS
        .iter()
        .find_map(|&(a, b)| {
            if c == a {
                Some(b)
            } else if c == b {
                Some(a)
            } else {
                None
            }
        })
        .unwrap_or(c)
}

/// `run` cut at every offset of `cuts` strictly inside it, in logical order.
fn split_at_cuts(run: Range<usize>, cuts: &[usize]) -> Vec<Range<usize>> {
    let mut parts = Vec::new();
    let mut start = run.start;
    for &c in cuts {
        if c > start && c < run.end {
            parts.push(start..c);
            start = c;
        }
    }
    parts.push(start..run.end);
    parts
}

/// `text` as displayed, left to right: each line (paragraph) in the direction of its first
/// strong character, the previous line's when it has none (left to right at the start),
/// with newlines kept. For tests and for places that show whole lines.
pub fn visual_order(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut direction = Direction::Ltr;
    for para in text.split_inclusive('\n') {
        let body = para.strip_suffix('\n').unwrap_or(para);
        let p = BidiParagraph::auto(body, direction);
        direction = p.direction();
        out.push_str(&p.visual_line(0..body.len()));
        if para.len() > body.len() {
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pure_hebrew_is_reversed() {
        assert_eq!(first_strong_direction("שלום עולם"), Some(Direction::Rtl));
        assert_eq!(visual_order("שלום עולם"), "םלוע םולש");
    }

    #[test]
    fn digits_and_an_english_word_stay_left_to_right_inside_hebrew() {
        // "I was born in-1990 in GPU." (logical order).
        let logical = "נולדתי ב-1990 ב GPU.";
        // Read left to right on screen: the period ends the RTL paragraph on the left, the
        // Latin word and the number keep their own order.
        assert_eq!(visual_order(logical), ".GPU ב 1990-ב יתדלונ");
    }

    #[test]
    fn arabic_is_reversed() {
        assert_eq!(
            first_strong_direction("مرحبا بالعالم"),
            Some(Direction::Rtl)
        );
        assert_eq!(visual_order("مرحبا بالعالم"), "ملاعلاب ابحرم");
    }

    #[test]
    fn ltr_paragraph_with_a_hebrew_phrase_reverses_only_the_phrase() {
        assert_eq!(
            first_strong_direction("Say שלום עולם now"),
            Some(Direction::Ltr)
        );
        assert_eq!(visual_order("Say שלום עולם now"), "Say םלוע םולש now");
    }

    #[test]
    fn brackets_are_mirrored_in_right_to_left_text() {
        // "(hello) world" in Hebrew: the parentheses must still open towards the word.
        assert_eq!(visual_order("(שלום) עולם"), "םלוע (םולש)");
        assert_eq!(visual_order("[א] <ב>"), "<ב> [א]");
        // A whole sentence: "There are 7 days in a week (from Sunday to Saturday)."
        assert_eq!(
            visual_order("יש 7 ימים בשבוע (מיום ראשון עד שבת)."),
            ".(תבש דע ןושאר םוימ) עובשב םימי 7 שי"
        );
    }

    #[test]
    fn each_line_takes_its_own_direction() {
        assert_eq!(
            visual_order("Question:\nמה שלומך?\n42."),
            "Question:\n?ךמולש המ\n.42"
        );
    }

    #[test]
    fn pieces_do_not_cross_token_boundaries() {
        let text = "שלום עולם";
        let p = BidiParagraph::auto(text, Direction::Ltr);
        assert!(p.has_rtl());
        // Tokens: "שלום", " עולם".
        let cut = "שלום".len();
        let pieces = p.visual_pieces(0..text.len(), &[cut]);
        assert_eq!(
            pieces,
            vec![
                VisualPiece {
                    range: cut..text.len(),
                    rtl: true
                },
                VisualPiece {
                    range: 0..cut,
                    rtl: true
                },
            ]
        );
        assert_eq!(p.piece_text(&pieces[0]), "םלוע ");
    }

    #[test]
    fn rtl_letters_are_detected() {
        assert!(has_rtl_letters("Say שלום"));
        assert!(has_rtl_letters("مرحبا"));
        assert!(!has_rtl_letters("你好, world 42"));
    }

    #[test]
    fn neutral_only_text_has_no_direction() {
        assert_eq!(first_strong_direction("1234 ..."), None);
        assert_eq!(visual_order(""), "");
        assert_eq!(visual_order("plain English"), "plain English");
    }
}
