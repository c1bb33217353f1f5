//! A preview row's tokens as chips laid out as the text reads.
//!
//! The row is cut into paragraphs after every token holding a newline; each paragraph runs
//! in the direction of its first strong character, its chips wrap line by line and every
//! line is put in visual order (right-aligned when right to left), the text inside a chip
//! too. Tokens that hold only part of a character (byte-level BPE) are drawn as one chip
//! showing the character, split into one stripe per token: each stripe is coloured by its
//! own token's class and shows that token on hover.

use std::ops::Range;

use eframe::egui::{self, Color32, FontId, Rect, RichText, Sense, Ui};
use tunestudio::data::{RowPreview, TokenClass, TokenSpan};
use tunestudio::text::{hex_bytes, visible, BidiParagraph, Direction, TokenGroup, VisualPiece};

use crate::gui::theme;

/// Padding inside a chip.
const PAD: egui::Vec2 = egui::vec2(4.0, 2.0);
/// Space between chips on a line.
const GAP: f32 = 2.0;
/// Narrowest stripe of a split character, so every token stays hoverable.
const MIN_STRIPE: f32 = 7.0;

fn chip_font() -> FontId {
    FontId::monospace(12.5)
}

/// The colour of a token class.
pub fn class_color(c: TokenClass) -> Color32 {
    match c {
        TokenClass::Trained => theme::TRAINED,
        TokenClass::Mismatch => theme::MISMATCH,
        TokenClass::Masked => theme::MASKED,
        TokenClass::Padding => theme::PADDING,
    }
}

/// What a token class means, in words.
pub fn class_name(c: TokenClass) -> &'static str {
    match c {
        TokenClass::Trained => "trained",
        TokenClass::Mismatch => "trained, label differs from token",
        TokenClass::Masked => "masked",
        TokenClass::Padding => "padding",
    }
}

/// Stands for a special token in the text the bidirectional algorithm sees: one neutral
/// character (U+FFFC, class ON), so `<|im_end|>` moves as one unit and is never reordered
/// inside, and it takes the direction of the text around it.
const SPECIAL_PLACEHOLDER: &str = "\u{FFFC}";

/// A row's groups with the text each one shows and where it sits in the row's text.
struct RowText<'a> {
    row: &'a RowPreview,
    groups: Vec<TokenGroup>,
    /// Whether each group is one special token.
    special: Vec<bool>,
    /// Byte offset of each group in `text`, then `text.len()`.
    starts: Vec<usize>,
    /// The groups' text as the bidirectional algorithm sees it.
    text: String,
}

impl<'a> RowText<'a> {
    fn new(row: &'a RowPreview, limit: usize) -> Self {
        let mut groups = row.groups(limit);
        // A token with no bytes at all (none is known to exist) still needs a chip.
        for g in groups.iter_mut().filter(|g| g.text.is_empty()) {
            g.text = format!("<{}>", row.tokens[g.tokens.start].id);
        }
        let special: Vec<bool> = groups
            .iter()
            .map(|g| !g.is_split() && row.tokens[g.tokens.start].special)
            .collect();
        let mut starts = Vec::with_capacity(groups.len() + 1);
        let mut text = String::new();
        for (g, &sp) in groups.iter().zip(&special) {
            starts.push(text.len());
            text.push_str(if sp { SPECIAL_PLACEHOLDER } else { &g.text });
        }
        starts.push(text.len());
        RowText {
            row,
            groups,
            special,
            starts,
            text,
        }
    }

    /// The characters a piece shows, in display order, whitespace made visible.
    fn piece_text(&self, p: &BidiParagraph<'_>, piece: &VisualPiece, group: usize) -> String {
        if self.special[group] {
            visible(&self.groups[group].text)
        } else {
            visible(&p.piece_text(piece))
        }
    }

    /// The group holding byte `at` of the text.
    fn group_at(&self, at: usize) -> usize {
        self.starts.partition_point(|&s| s <= at).saturating_sub(1)
    }

    /// Groups per paragraph: a paragraph ends after a group holding a newline.
    fn paragraphs(&self) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        for (i, g) in self.groups.iter().enumerate() {
            if g.text.contains('\n') {
                out.push(start..i + 1);
                start = i + 1;
            }
        }
        if start < self.groups.len() {
            out.push(start..self.groups.len());
        }
        out
    }
}

/// Draws the first `limit` tokens of `row` (the caller reports the rest).
pub fn token_row(ui: &mut Ui, row: &RowPreview, limit: usize) {
    let rt = RowText::new(row, limit);
    if rt.groups.is_empty() {
        return;
    }
    let width = ui.available_width().max(60.0);
    let widths: Vec<f32> = rt.groups.iter().map(|g| chip_width(ui, g)).collect();
    ui.vertical(|ui| {
        ui.spacing_mut().item_spacing.y = 3.0;
        let mut direction = Direction::Ltr;
        for para in rt.paragraphs() {
            let offset = rt.starts[para.start];
            let p = BidiParagraph::auto(&rt.text[offset..rt.starts[para.end]], direction);
            direction = p.direction();
            let cuts: Vec<usize> = para.clone().map(|g| rt.starts[g] - offset).collect();
            for line in break_lines(&widths[para.clone()], width) {
                let (a, b) = (para.start + line.start, para.start + line.end);
                let pieces = p.visual_pieces(rt.starts[a] - offset..rt.starts[b] - offset, &cuts);
                draw_line(ui, &rt, &p, offset, &pieces, width);
            }
        }
    });
}

/// The width of a group's chip (the same in logical and visual order).
fn chip_width(ui: &Ui, g: &TokenGroup) -> f32 {
    let galley = ui
        .painter()
        .layout_no_wrap(visible(&g.text), chip_font(), Color32::WHITE);
    (galley.size().x + 2.0 * PAD.x).max(MIN_STRIPE * g.tokens.len() as f32)
}

/// Greedy line breaking of chips of `widths` into lines at most `max` wide.
fn break_lines(widths: &[f32], max: f32) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut used = 0.0;
    for (i, w) in widths.iter().enumerate() {
        if i > start && used + GAP + w > max {
            out.push(start..i);
            start = i;
            used = 0.0;
        }
        used += if i == start { *w } else { GAP + w };
    }
    if start < widths.len() {
        out.push(start..widths.len());
    }
    out
}

/// One chip on screen: a visual piece of one group.
struct Chip {
    group: usize,
    galley: std::sync::Arc<egui::Galley>,
    width: f32,
    /// Whether the piece starts its group (its stripes carry the accessible names).
    first: bool,
    rtl: bool,
    /// Where the piece starts in the row's text (unique per row: part of the widget ids).
    at: usize,
}

fn draw_line(
    ui: &mut Ui,
    rt: &RowText<'_>,
    p: &BidiParagraph<'_>,
    offset: usize,
    pieces: &[VisualPiece],
    width: f32,
) {
    let chips: Vec<Chip> = pieces
        .iter()
        .map(|piece| {
            let at = offset + piece.range.start;
            let group = rt.group_at(at);
            let g = &rt.groups[group];
            let visual = rt.piece_text(p, piece, group);
            let galley = super::visual_galley(ui, &visual, chip_font(), text_color(rt, g));
            let width = (galley.size().x + 2.0 * PAD.x).max(MIN_STRIPE * g.tokens.len() as f32);
            Chip {
                group,
                galley,
                width,
                first: at == rt.starts[group],
                rtl: piece.rtl,
                at,
            }
        })
        .collect();
    let total =
        chips.iter().map(|c| c.width).sum::<f32>() + GAP * chips.len().saturating_sub(1) as f32;
    let height = chips.iter().map(|c| c.galley.size().y).fold(0.0, f32::max) + 2.0 * PAD.y;
    let (line, _) = ui.allocate_exact_size(egui::vec2(width, height), Sense::hover());
    let mut x = if p.direction().is_rtl() {
        line.right() - total
    } else {
        line.left()
    };
    for chip in &chips {
        let rect = Rect::from_min_size(egui::pos2(x, line.top()), egui::vec2(chip.width, height));
        draw_chip(ui, rt, chip, rect);
        x += chip.width + GAP;
    }
}

fn text_color(rt: &RowText<'_>, g: &TokenGroup) -> Color32 {
    let all_padding = rt.row.tokens[g.tokens.clone()]
        .iter()
        .all(|t| t.class == TokenClass::Padding);
    if all_padding {
        Color32::from_gray(150)
    } else {
        Color32::WHITE
    }
}

/// A chip: one stripe per token of its group (right to left in right-to-left text), the
/// group's characters on top.
fn draw_chip(ui: &mut Ui, rt: &RowText<'_>, chip: &Chip, rect: Rect) {
    let g = &rt.groups[chip.group];
    let k = g.tokens.len();
    let stripe = rect.width() / k as f32;
    for (j, t) in g.tokens.clone().enumerate() {
        let slot = if chip.rtl { k - 1 - j } else { j };
        let r = Rect::from_min_size(
            egui::pos2(rect.left() + slot as f32 * stripe, rect.top()),
            egui::vec2(stripe, rect.height()),
        );
        let id = ui.scope_id().with(("token", rt.row.index, t, chip.at));
        let response = ui.interact(r, id, Sense::hover());
        let token = &rt.row.tokens[t];
        if ui.is_rect_visible(r) {
            let color = class_color(token.class);
            let fill = match token.class {
                TokenClass::Padding => color,
                _ => color.gamma_multiply(if response.hovered() { 1.0 } else { 0.75 }),
            };
            let radius = if k == 1 { 3.0 } else { 0.0 };
            ui.painter().rect_filled(r, radius, fill);
        }
        if chip.first {
            let label = accessible_name(g, token, t, j);
            response.widget_info(|| egui::WidgetInfo::labeled(egui::Role::Label, true, &label));
        }
        response.on_hover_ui(|ui| tooltip(ui, g, token, j));
    }
    if ui.is_rect_visible(rect) {
        if k > 1 {
            // One outline around a split character: its stripes are one unit.
            let stroke = egui::Stroke::new(1.0, Color32::from_white_alpha(90));
            ui.painter()
                .rect_stroke(rect, 0.0, stroke, egui::StrokeKind::Inside);
        }
        let pos = rect.center() - chip.galley.size() / 2.0;
        ui.painter()
            .galley(pos, chip.galley.clone(), Color32::WHITE);
    }
}

/// `token כ part 1/2 (masked, id 162, position 24)`: what a screen reader (and a test)
/// reads for one token.
fn accessible_name(g: &TokenGroup, token: &TokenSpan, position: usize, j: usize) -> String {
    let part = if g.is_split() {
        format!(" part {}/{}", j + 1, g.tokens.len())
    } else {
        String::new()
    };
    format!(
        "token {}{part} ({}, id {}, position {position})",
        visible(&g.text),
        class_name(token.class),
        token.id
    )
}

fn tooltip(ui: &mut Ui, g: &TokenGroup, t: &TokenSpan, j: usize) {
    egui::Grid::new("chip-tip").num_columns(2).show(ui, |ui| {
        let mut row = |k: &str, v: RichText| {
            ui.label(RichText::new(k).weak());
            ui.label(v);
            ui.end_row();
        };
        if g.is_split() {
            row(
                "characters",
                RichText::new(format!("{:?}", g.text)).monospace(),
            );
            row(
                "this token",
                RichText::new(format!(
                    "part {} of {}: the characters' bytes are split between tokens",
                    j + 1,
                    g.tokens.len()
                )),
            );
        } else {
            row("text", RichText::new(format!("{:?}", t.text)).monospace());
        }
        row("token id", RichText::new(t.id.to_string()).monospace());
        row(
            "bytes",
            RichText::new(hex_bytes(t.shown_bytes())).monospace(),
        );
        row("label", RichText::new(t.label.to_string()).monospace());
        row(
            "class",
            RichText::new(class_name(t.class)).color(class_color(t.class)),
        );
        if t.weight != 0.0 && t.weight != 1.0 {
            row("loss weight", RichText::new(format!("{}", t.weight)));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_break_greedily_and_keep_wide_chips() {
        assert_eq!(break_lines(&[10.0, 10.0, 10.0], 25.0), vec![0..2, 2..3]);
        assert_eq!(break_lines(&[50.0, 10.0], 25.0), vec![0..1, 1..2]);
        assert!(break_lines(&[], 25.0).is_empty());
    }
}
