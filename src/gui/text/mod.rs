//! Model text on screen: every place that shows dataset rows or generated answers draws it
//! through here, so Hebrew and Arabic read right to left and byte-split tokens show the
//! characters they form. The text logic itself (bidi, byte groups) is the library's
//! [`tunestudio::text`]; this is the egui drawing around it.

pub mod bidi_label;
pub mod token_row;

pub use bidi_label::bidi_label;
pub use token_row::token_row;

use eframe::egui::{self, Color32, FontId, Ui};
use std::sync::Arc;

/// Lays out `visual` (characters in display order) as one line. egui shapes runs of Hebrew
/// and Arabic letters right to left itself, so they are handed back in logical order.
fn visual_galley(ui: &Ui, visual: &str, font: FontId, color: Color32) -> Arc<egui::Galley> {
    let text = tunestudio::text::for_script_shaper(visual);
    ui.painter().layout_no_wrap(text, font, color)
}
