//! Text for a shaper that reverses right-to-left script runs itself.
//!
//! egui 0.37 shapes every run of one font with HarfBuzz (harfrust), guessing the run's
//! direction from its script: a run of Hebrew or Arabic letters comes out reversed (and
//! Arabic letters joined), while egui still places the runs themselves left to right in
//! the order given and applies no bidi between them. So a piece already in visual order
//! would be reversed a second time. [`for_script_shaper`] hands such a shaper each run of
//! right-to-left letters back in logical order, where the shaper's reversal puts it in the
//! visual order asked for; everything else (spaces, digits, Latin, punctuation, which the
//! shaper lays out left to right) stays in visual order.

use unicode_bidi::{bidi_class, BidiClass};

/// Whether `c` belongs to a right-to-left script as a shaper sees it: letters of class R
/// or AL, Arabic-Indic digits, and combining marks (they stay with their letter).
fn in_rtl_script_run(c: char) -> bool {
    matches!(bidi_class(c), BidiClass::R | BidiClass::AL | BidiClass::NSM)
        || matches!(c, '\u{0660}'..='\u{0669}' | '\u{06F0}'..='\u{06F9}')
}

/// The text that a script-guessing shaper draws as `visual` (characters in display order,
/// left to right): every run of right-to-left letters is reversed back to logical order.
pub fn for_script_shaper(visual: &str) -> String {
    let mut out = String::with_capacity(visual.len());
    let mut run: Vec<char> = Vec::new();
    for c in visual.chars() {
        if in_rtl_script_run(c) {
            run.push(c);
            continue;
        }
        out.extend(run.drain(..).rev());
        out.push(c);
    }
    out.extend(run.drain(..).rev());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::visual_order;

    #[test]
    fn hebrew_words_go_back_to_logical_order_spaces_do_not_move() {
        let visual = visual_order("שלום עולם");
        assert_eq!(visual, "םלוע םולש");
        assert_eq!(for_script_shaper(&visual), "עולם שלום");
    }

    #[test]
    fn latin_digits_and_mirrored_brackets_stay_in_visual_order() {
        let visual = visual_order("(שלום) 2024");
        assert_eq!(visual, "2024 (םולש)");
        assert_eq!(for_script_shaper(&visual), "2024 (שלום)");
        assert_eq!(for_script_shaper("plain text"), "plain text");
    }

    #[test]
    fn marks_stay_after_their_letter_for_the_shaper() {
        // "שָׁ" (shin, qamats, shin dot) reversed for display, then handed back whole.
        let logical = "\u{05E9}\u{05B8}\u{05C1}";
        let visual = visual_order(logical);
        assert_eq!(for_script_shaper(&visual), logical);
    }
}
