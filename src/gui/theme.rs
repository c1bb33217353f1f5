//! Colours, number formatting and small widget helpers shared by every panel.
//!
//! Every input widget goes through a helper here that ties it to its visible
//! label (`labelled_by`), so screen readers and UI tests find it by name, and
//! attaches the tooltip that explains the setting.

use eframe::egui::{self, Color32, RichText, Ui};

/// Trained tokens (label = token): green.
pub const TRAINED: Color32 = Color32::from_rgb(46, 160, 67);
/// Masked prompt tokens (label −100): grey.
pub const MASKED: Color32 = Color32::from_rgb(120, 124, 132);
/// Label differs from the token: a data bug.
pub const MISMATCH: Color32 = Color32::from_rgb(214, 69, 65);
/// Padding added by the collator: dim.
pub const PADDING: Color32 = Color32::from_rgb(70, 72, 78);
/// Errors and out-of-memory.
pub const ERROR: Color32 = Color32::from_rgb(229, 83, 75);
/// Warnings and tight fits.
pub const WARNING: Color32 = Color32::from_rgb(219, 161, 37);
/// Things that are fine.
pub const OK: Color32 = Color32::from_rgb(63, 185, 80);
/// Accent for the current selection and headings.
pub const ACCENT: Color32 = Color32::from_rgb(88, 166, 255);

/// Colours of the memory components, in stacking order (the same in the bars,
/// the legend and the run charts).
pub const MEM_WEIGHTS: Color32 = Color32::from_rgb(88, 166, 255);
/// f32 master weights.
pub const MEM_MASTER: Color32 = Color32::from_rgb(121, 192, 255);
/// Gradients.
pub const MEM_GRADIENTS: Color32 = Color32::from_rgb(163, 113, 247);
/// Optimizer moments.
pub const MEM_OPTIMIZER: Color32 = Color32::from_rgb(219, 97, 162);
/// Activations kept for backward.
pub const MEM_ACTIVATIONS: Color32 = Color32::from_rgb(240, 136, 62);
/// Logits and the loss.
pub const MEM_LOGITS: Color32 = Color32::from_rgb(219, 171, 9);
/// Short-lived buffers.
pub const MEM_TEMPORARIES: Color32 = Color32::from_rgb(139, 148, 158);
/// The collectives' buffers (data parallel's all-reduce, sharding's reduce-scatter and
/// all-gather).
pub const MEM_COLLECTIVE: Color32 = Color32::from_rgb(86, 211, 196);
/// Runtime overhead (CUDA context).
pub const MEM_OVERHEAD: Color32 = Color32::from_rgb(110, 118, 129);

/// Distinct line colours for per-device series and run overlays.
pub const SERIES: [Color32; 6] = [
    Color32::from_rgb(88, 166, 255),
    Color32::from_rgb(240, 136, 62),
    Color32::from_rgb(63, 185, 80),
    Color32::from_rgb(219, 97, 162),
    Color32::from_rgb(163, 113, 247),
    Color32::from_rgb(219, 171, 9),
];

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Bytes for people ("12.41 GiB", "812 MiB"): the crate's one formatter.
pub use tunestudio::units::format_bytes as bytes;

/// Bytes as GiB (for chart axes).
pub fn gib(b: u64) -> f64 {
    b as f64 / GIB
}

/// A count with thousands separators ("7,241,732,096").
pub fn count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A parameter count in short form ("7.24 B", "135 M", "1.2 M").
pub fn params(n: u64) -> String {
    let f = n as f64;
    if f >= 1e9 {
        format!("{:.2} B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.1} M", f / 1e6)
    } else if f >= 1e3 {
        format!("{:.1} K", f / 1e3)
    } else {
        n.to_string()
    }
}

/// Seconds as "1h 02m", "3m 05s" or "12s".
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "–".into();
    }
    let s = secs.round() as u64;
    if s >= 3600 {
        format!("{}h {:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{}m {:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// A panel heading with a one-line explanation under it.
pub fn heading(ui: &mut Ui, title: &str, subtitle: &str) {
    ui.add_space(4.0);
    ui.label(RichText::new(title).size(22.0).strong());
    if !subtitle.is_empty() {
        ui.label(RichText::new(subtitle).weak());
    }
    ui.add_space(8.0);
}

/// A section title inside a panel.
pub fn section(ui: &mut Ui, title: &str) {
    ui.add_space(10.0);
    ui.label(
        RichText::new(title)
            .size(15.0)
            .strong()
            .color(ui.visuals().strong_text_color()),
    );
    ui.add_space(2.0);
}

/// A striped two-column grid of statistics; `add` gets a `row(name, value)` writer.
pub fn stats_grid(ui: &mut Ui, id: &str, add: impl FnOnce(&mut dyn FnMut(&str, String))) {
    egui::Grid::new(id)
        .num_columns(2)
        .spacing([16.0, 4.0])
        .striped(true)
        .show(ui, |ui| {
            let mut row = |k: &str, v: String| {
                ui.label(RichText::new(k).weak());
                ui.label(v);
                ui.end_row();
            };
            add(&mut row);
        });
}

/// "1,200 (1,140 train / 60 validation)", with " — shown {noun} only" when the preview did
/// not read the whole file.
pub fn split_counts(
    total: usize,
    train: usize,
    validation: usize,
    full_scan: bool,
    noun: &str,
) -> String {
    format!(
        "{} ({} train / {} validation){}",
        count(total as u64),
        count(train as u64),
        count(validation as u64),
        if full_scan {
            String::new()
        } else {
            format!(" — shown {noun} only")
        }
    )
}

/// A card: a framed group with a little padding.
pub fn card<R>(ui: &mut Ui, add: impl FnOnce(&mut Ui) -> R) -> R {
    egui::Frame::group(ui.style())
        .inner_margin(10.0)
        .corner_radius(6.0)
        .show(ui, |ui| {
            ui.set_min_width(ui.available_width());
            add(ui)
        })
        .inner
}

/// An error message box with its fix.
pub fn error_box(ui: &mut Ui, title: &str, message: &str) {
    egui::Frame::new()
        .fill(ERROR.gamma_multiply(0.15))
        .stroke(egui::Stroke::new(1.0, ERROR))
        .inner_margin(8.0)
        .corner_radius(4.0)
        .show(ui, |ui| {
            ui.set_min_width(ui.available_width());
            ui.label(RichText::new(title).strong().color(ERROR));
            ui.add(egui::Label::new(message).wrap());
        });
}

/// A background job's error: the message, then what to do (once).
pub fn job_error(ui: &mut Ui, title: &str, e: &crate::gui::error::JobError) {
    error_box(ui, title, &e.to_string());
}

/// A small note ("not available yet", hints).
pub fn note(ui: &mut Ui, text: &str) {
    ui.add(egui::Label::new(RichText::new(text).italics().weak()).wrap());
}

/// A label for a form row; returns its response so the widget can be tied to it.
fn form_label(ui: &mut Ui, label: &str, tip: &str) -> egui::Response {
    let r = ui.label(label);
    if tip.is_empty() {
        r
    } else {
        r.on_hover_text(tip)
    }
}

/// A labelled drag value in a two-column grid row.
pub fn drag_row<N: egui::emath::Numeric>(
    ui: &mut Ui,
    label: &str,
    tip: &str,
    value: &mut N,
    range: std::ops::RangeInclusive<N>,
    speed: f64,
    suffix: &str,
) -> egui::Response {
    let l = form_label(ui, label, tip);
    let mut dv = egui::DragValue::new(value).range(range).speed(speed);
    if !suffix.is_empty() {
        dv = dv.suffix(suffix.to_string());
    }
    let r = ui.add(dv).labelled_by(l.id);
    let r = if tip.is_empty() {
        r
    } else {
        r.on_hover_text(tip)
    };
    ui.end_row();
    r
}

/// A labelled checkbox in a grid row (the checkbox carries its own name too).
pub fn check_row(
    ui: &mut Ui,
    label: &str,
    tip: &str,
    value: &mut bool,
    text: &str,
) -> egui::Response {
    let l = form_label(ui, label, tip);
    let r = ui.checkbox(value, text).labelled_by(l.id);
    let r = if tip.is_empty() {
        r
    } else {
        r.on_hover_text(tip)
    };
    ui.end_row();
    r
}

/// A labelled single-line text field in a grid row.
pub fn text_row(
    ui: &mut Ui,
    label: &str,
    tip: &str,
    value: &mut String,
    hint: &str,
) -> egui::Response {
    let l = form_label(ui, label, tip);
    let r = ui
        .add(
            egui::TextEdit::singleline(value)
                .hint_text(hint)
                .desired_width(320.0),
        )
        .labelled_by(l.id);
    let r = if tip.is_empty() {
        r
    } else {
        r.on_hover_text(tip)
    };
    ui.end_row();
    r
}

/// A labelled combo box in a grid row over `(value, name)` choices.
pub fn combo_row<T: PartialEq + Copy>(
    ui: &mut Ui,
    id: &str,
    label: &str,
    tip: &str,
    value: &mut T,
    choices: &[(T, &str)],
) -> bool {
    let l = form_label(ui, label, tip);
    let current = choices
        .iter()
        .find(|(v, _)| v == value)
        .map_or("?", |(_, n)| *n)
        .to_string();
    let mut changed = false;
    let r = egui::ComboBox::from_id_salt(id)
        .selected_text(current)
        .width(180.0)
        .show_ui(ui, |ui| {
            for (v, name) in choices {
                if ui.selectable_value(value, *v, *name).changed() {
                    changed = true;
                }
            }
        })
        .response
        .labelled_by(l.id);
    if !tip.is_empty() {
        r.on_hover_text(tip);
    }
    ui.end_row();
    changed
}

/// A coloured dot and a caption, for legends.
pub fn legend_item(ui: &mut Ui, color: Color32, text: &str) {
    ui.horizontal(|ui| {
        let (rect, _) = ui.allocate_exact_size(egui::vec2(10.0, 10.0), egui::Sense::hover());
        ui.painter().rect_filled(rect, 2.0, color);
        ui.label(RichText::new(text).small());
    });
}

/// The named override of an error-level lint (of the data or the settings): ticking it adds
/// the lint to `[data] allow`, which the run records.
pub fn allow_lint_checkbox(ui: &mut Ui, allow: &mut Vec<String>, id: &str) {
    let mut ticked = false;
    ui.checkbox(
        &mut ticked,
        format!("Train anyway despite `{id}` (adds it to [data] allow; recorded in the run)"),
    );
    if ticked {
        allow.push(id.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_bytes_for_people() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(2048), "2 KiB");
        assert_eq!(bytes(812 * 1024 * 1024), "812 MiB");
        assert_eq!(bytes((1.5 * GIB) as u64), "1.50 GiB");
        assert_eq!(bytes((80.0 * GIB) as u64), "80.0 GiB");
    }

    #[test]
    fn formats_counts_and_durations() {
        assert_eq!(count(7_251_169_280), "7,251,169,280");
        assert_eq!(count(999), "999");
        assert_eq!(params(134_515_008), "134.5 M");
        assert_eq!(duration(3725.0), "1h 02m");
        assert_eq!(duration(65.0), "1m 05s");
        assert_eq!(duration(f64::NAN), "–");
    }
}
