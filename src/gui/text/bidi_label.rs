//! A wrapped label for text that may hold right-to-left lines (an answer, a dataset row).

use std::ops::Range;

use eframe::egui::{self, Color32, FontId, RichText, Sense, Ui};
use tunestudio::text::{has_rtl_letters, BidiParagraph, Direction};

/// Draws `text` wrapped to the available width. Text with a Hebrew or Arabic letter is laid
/// out with the bidirectional algorithm: each line (paragraph) runs in the direction of its
/// first strong character, in visual order, right-aligned when right to left. Other text is
/// a plain selectable label, as before.
pub fn bidi_label(ui: &mut Ui, text: &str, font: FontId, color: Color32) -> egui::Response {
    if !has_rtl_letters(text) {
        let rich = RichText::new(text).font(font).color(color);
        return ui.add(egui::Label::new(rich).wrap().selectable(true));
    }
    let width = ui.available_width().max(40.0);
    let response = ui
        .vertical(|ui| {
            ui.spacing_mut().item_spacing.y = 0.0;
            let mut direction = Direction::Ltr;
            for para in text.split('\n') {
                let p = BidiParagraph::auto(para, direction);
                direction = p.direction();
                for line in wrap(ui, para, &font, width) {
                    draw_line(ui, &p, line, &font, color, width);
                }
            }
        })
        .response;
    // Screen readers read the logical order.
    response.widget_info(|| egui::WidgetInfo::labeled(egui::Role::Label, true, text));
    response
}

/// One screen line of a paragraph, in visual order, right-aligned for right-to-left text.
fn draw_line(
    ui: &mut Ui,
    p: &BidiParagraph<'_>,
    line: Range<usize>,
    font: &FontId,
    color: Color32,
    width: f32,
) {
    let visual = p.visual_line(line);
    let galley = super::visual_galley(ui, &visual, font.clone(), color);
    // An empty line's galley still has one row, so blank lines keep their height.
    let (rect, _) = ui.allocate_exact_size(egui::vec2(width, galley.size().y), Sense::hover());
    let x = if p.direction().is_rtl() {
        rect.right() - galley.size().x
    } else {
        rect.left()
    };
    if ui.is_rect_visible(rect) {
        ui.painter()
            .galley(egui::pos2(x, rect.top()), galley, color);
    }
}

/// The byte ranges of `para` that fit one screen line each: egui wraps the logical text (a
/// line holds the same characters in either order, so it is as wide), and each of its rows
/// becomes one line to reorder.
fn wrap(ui: &Ui, para: &str, font: &FontId, width: f32) -> Vec<Range<usize>> {
    if para.is_empty() {
        // One empty line: a blank line keeps its height.
        return std::iter::once(0..0).collect();
    }
    let galley = ui
        .painter()
        .layout(para.to_string(), font.clone(), Color32::WHITE, width);
    // Byte offset of every character boundary.
    let bounds: Vec<usize> = para
        .char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(para.len()))
        .collect();
    let last = bounds.len() - 1;
    let mut out = Vec::with_capacity(galley.rows.len());
    let mut start = 0;
    for row in &galley.rows {
        let end = (start + row.glyphs.len()).min(last);
        if end > start {
            out.push(bounds[start]..bounds[end]);
        }
        start = end;
    }
    // Whatever the rows did not count (they should count every character) joins the end.
    match out.last_mut() {
        Some(l) => l.end = para.len(),
        None => out.push(0..para.len()),
    }
    out
}
