//! Preview: the rows exactly as the trainer will see them — every token as a
//! chip coloured by what the loss does with it — plus the length histogram
//! against the cutoff and the lints, each jumping to an example row.

use eframe::egui::{self, RichText, Ui};
use egui_plot::{Bar, BarChart, Plot, VLine};

use tunestudio::data::{DataPreview, Lint, RowPreview, Severity, SplitName, TokenClass};

use crate::gui::action::Action;
use crate::gui::error::JobError;
use crate::gui::session::Session;
use crate::gui::shared::PanelContext;
use crate::gui::text;
use crate::gui::theme;

/// Preference pairs: the Preview's view of DPO / ORPO data, a struct that owns its state.
pub mod pairs;
/// GRPO rollouts: the Preview of a GRPO run, a struct that owns its state.
pub mod rollouts;

/// At most this many chips per row are drawn (the rest are counted), so a
/// 32k-token row cannot stall a frame.
pub(crate) const MAX_CHIPS_PER_ROW: usize = 600;

/// The Preview panel: the rows shown and the preview built for them.
#[derive(Debug, Default)]
pub struct PreviewPanel {
    /// First row shown (a batch of `micro_batch` rows starts here).
    pub start_row: usize,
    /// The last preview.
    pub preview: Option<DataPreview>,
    /// The last error.
    pub error: Option<JobError>,
    /// Whether a preview is being built.
    pub loading: bool,
    /// Request sequence number.
    pub seq: u64,
    /// The settings key of the last request.
    pub key: String,
    /// Row to highlight (jumped to from a lint).
    pub highlight: Option<usize>,
    /// The preview of preference pairs, when the data holds them (then `preview` is `None`).
    pub pairs: pairs::PairPreviewPanel,
    /// The rollout preview, when the run is GRPO (then `preview` is `None`).
    pub rollouts: rollouts::RolloutPreviewPanel,
}

impl PreviewPanel {
    /// Draws the Preview panel.
    pub fn show(
        &mut self,
        ui: &mut Ui,
        s: &mut Session,
        cx: &PanelContext,
        actions: &mut Vec<Action>,
    ) {
        let pp = self;
        theme::heading(
            ui,
            "Preview",
            "Each token as the trainer sees it. Green tokens are trained on; grey ones are context (label −100); dim ones are padding.",
        );

        navigator(ui, pp, s, cx);

        // A GRPO run previews the completions it samples, when asked.
        if s.config.training.method.is_grpo() {
            if let Some(e) = &pp.error {
                theme::job_error(ui, "The rollouts could not be sampled", e);
            }
            let (start, loading) = (pp.start_row, pp.loading);
            pp.rollouts.show(ui, &s.config, start, loading, actions);
            return;
        }

        if let Some(e) = &pp.error {
            theme::job_error(ui, "The preview could not be built", e);
            if cx.model.is_none() {
                theme::note(ui, "Load a model with a tokenizer first (Model panel).");
            }
            return;
        }
        if pp.pairs.preview().is_some() {
            let method = s.config.training.method;
            let highlight = pp.highlight;
            pp.pairs.show(ui, method, highlight, actions);
            return;
        }
        let Some(p) = pp.preview.clone() else {
            if cx.model.is_none() {
                theme::note(ui, "Load a model first: the preview needs its tokenizer.");
            } else {
                ui.horizontal(|ui| {
                    ui.add(egui::Spinner::new());
                    ui.label("tokenising…");
                });
            }
            return;
        };

        legend(ui, &p);
        for row in &p.rows {
            row_card(ui, row, pp.highlight == Some(row.index));
        }

        ui.columns(2, |cols| {
            theme::section(&mut cols[0], "Token lengths");
            histogram(&mut cols[0], &p);
            theme::section(&mut cols[1], "Statistics");
            stats(&mut cols[1], &p);
        });

        theme::section(ui, &format!("Lints ({})", p.lints.len()));
        lint_list(ui, &p.lints, actions);
    }
}

/// The lints, worst first, each with buttons that jump to its example rows (shared with the
/// pair preview).
pub(crate) fn lint_list(ui: &mut Ui, lints: &[Lint], actions: &mut Vec<Action>) {
    if lints.is_empty() {
        ui.label(RichText::new("No problems found.").color(theme::OK));
    }
    for lint in lints {
        let (color, word) = match lint.severity {
            Severity::Error => (theme::ERROR, "error"),
            Severity::Warning => (theme::WARNING, "warning"),
            Severity::Info => (theme::ACCENT, "info"),
        };
        egui::Frame::new()
            .stroke(egui::Stroke::new(1.0, color.gamma_multiply(0.6)))
            .inner_margin(8.0)
            .corner_radius(4.0)
            .show(ui, |ui| {
                ui.set_min_width(ui.available_width());
                ui.horizontal(|ui| {
                    ui.label(RichText::new(word).strong().color(color));
                    ui.label(RichText::new(format!("{:?}", lint.kind)).monospace().weak());
                    ui.label(RichText::new(format!("{} row(s)", lint.count)).weak());
                });
                ui.add(egui::Label::new(&lint.message).wrap());
                if !lint.examples.is_empty() {
                    ui.horizontal_wrapped(|ui| {
                        ui.label(RichText::new("examples:").weak());
                        for &r in &lint.examples {
                            if ui
                                .small_button(format!("row {r}"))
                                .on_hover_text("Show this row")
                                .clicked()
                            {
                                actions.push(Action::JumpToRow(r));
                            }
                        }
                    });
                }
            });
        ui.add_space(4.0);
    }
}

fn navigator(ui: &mut Ui, pp: &mut PreviewPanel, s: &mut Session, cx: &PanelContext) {
    let total = pp
        .preview
        .as_ref()
        .map(|p| p.num_rows)
        .or_else(|| pp.pairs.preview().map(|p| p.num_rows))
        .or_else(|| pp.rollouts.preview().map(|p| p.num_prompts))
        .or_else(|| cx.dataset.as_ref().map(|d| d.num_rows))
        .unwrap_or(0);
    let batch = s.config.training.micro_batch.clamp(1, 16);
    let unit = s.config.training.method.micro_batch_unit();
    ui.horizontal(|ui| {
        let prev = ui
            .add_enabled(pp.start_row > 0, egui::Button::new("◀ Previous"))
            .on_hover_text("The previous batch of rows");
        if prev.clicked() {
            pp.start_row = pp.start_row.saturating_sub(batch);
            pp.highlight = None;
        }
        let l = ui.label("First row");
        let max = total.saturating_sub(1);
        ui.add(
            egui::DragValue::new(&mut pp.start_row)
                .range(0..=max)
                .speed(1.0),
        )
        .labelled_by(l.id)
        .on_hover_text(
            "Rows are shown in batches of the micro-batch size, padded as the collator pads them",
        );
        let next = ui
            .add_enabled(pp.start_row + batch < total, egui::Button::new("Next ▶"))
            .on_hover_text("The next batch of rows");
        if next.clicked() {
            pp.start_row = (pp.start_row + batch).min(max);
            pp.highlight = None;
        }
        if total > 0 {
            ui.label(
                RichText::new(format!(
                    "{unit} {}–{} of {} (one micro-batch of {batch})",
                    pp.start_row,
                    (pp.start_row + batch).min(total) - 1,
                    theme::count(total as u64)
                ))
                .weak(),
            );
        }
        if pp.loading {
            ui.add(egui::Spinner::new().size(14.0));
        }
    });
    ui.add_space(4.0);
}

fn legend(ui: &mut Ui, p: &DataPreview) {
    let mut counts = [0usize; 4];
    for r in &p.rows {
        for t in &r.tokens {
            counts[class_index(t.class)] += 1;
        }
    }
    ui.horizontal(|ui| {
        theme::legend_item(ui, theme::TRAINED, &format!("trained: {}", counts[0]));
        theme::legend_item(ui, theme::MASKED, &format!("masked: {}", counts[2]));
        theme::legend_item(ui, theme::PADDING, &format!("padding: {}", counts[3]));
        if counts[1] > 0 {
            theme::legend_item(
                ui,
                theme::MISMATCH,
                &format!("label ≠ token: {}", counts[1]),
            );
        }
        ui.separator();
        ui.label(
            RichText::new(format!(
                "format {} · {} · template: {}",
                p.format.name(),
                if p.completions_only {
                    "completions only"
                } else {
                    "every token trained"
                },
                p.chat_template_origin.as_deref().unwrap_or("none")
            ))
            .small()
            .weak(),
        );
    });
    ui.add_space(4.0);
}

fn class_index(c: TokenClass) -> usize {
    match c {
        TokenClass::Trained => 0,
        TokenClass::Mismatch => 1,
        TokenClass::Masked => 2,
        TokenClass::Padding => 3,
    }
}

fn row_card(ui: &mut Ui, row: &RowPreview, highlighted: bool) {
    let stroke = if highlighted {
        egui::Stroke::new(2.0, theme::ACCENT)
    } else {
        egui::Stroke::new(1.0, ui.visuals().widgets.noninteractive.bg_stroke.color)
    };
    egui::Frame::new()
        .stroke(stroke)
        .inner_margin(10.0)
        .corner_radius(6.0)
        .show(ui, |ui| {
            ui.set_min_width(ui.available_width());
            ui.horizontal_wrapped(|ui| {
                ui.label(RichText::new(format!("Row {}", row.index)).strong());
                let split = match row.split {
                    SplitName::Train => "train",
                    SplitName::Validation => "validation",
                };
                ui.label(RichText::new(split).color(theme::ACCENT));
                ui.label(RichText::new(&row.location).weak());
                ui.label(
                    RichText::new(format!(
                        "{} tokens · {} trained{}",
                        row.num_tokens,
                        row.num_trained,
                        if row.full_len > row.num_tokens {
                            format!(" · {} before truncation", row.full_len)
                        } else {
                            String::new()
                        }
                    ))
                    .weak(),
                );
                if row.completion_truncated {
                    ui.label(RichText::new("completion truncated").color(theme::WARNING));
                } else if row.truncated {
                    ui.label(RichText::new("truncated").color(theme::WARNING));
                }
                if let Some(d) = row.dropped {
                    ui.label(
                        RichText::new(format!("dropped: {}", d.describe())).color(theme::ERROR),
                    );
                }
            });
            ui.add_space(4.0);
            text::token_row(ui, row, MAX_CHIPS_PER_ROW);
            if row.tokens.len() > MAX_CHIPS_PER_ROW {
                ui.label(
                    RichText::new(format!(
                        "… {} more tokens",
                        row.tokens.len() - MAX_CHIPS_PER_ROW
                    ))
                    .weak(),
                );
            }
        });
    ui.add_space(6.0);
}

fn histogram(ui: &mut Ui, p: &DataPreview) {
    let h = &p.stats.histogram;
    if h.counts.is_empty() || h.bin_width == 0 {
        theme::note(ui, "No lengths to show.");
        return;
    }
    let w = h.bin_width as f64;
    let bars: Vec<Bar> = h
        .counts
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let start = i as f64 * w;
            let over = start + w > h.cutoff as f64;
            Bar::new(start + w / 2.0, c as f64)
                .width(w * 0.92)
                .fill(if over { theme::WARNING } else { theme::ACCENT })
                .name(format!(
                    "{}–{} tokens",
                    start as usize,
                    (start + w) as usize - 1
                ))
        })
        .collect();
    let truncated = p.stats.num_truncated;
    Plot::new("length-histogram")
        .height(200.0)
        .allow_scroll(false)
        .allow_zoom(false)
        .allow_drag(false)
        .x_axis_label("tokens per row (before truncation)")
        .y_axis_label("rows")
        .show(ui, |plot| {
            plot.bar_chart(BarChart::new("rows", bars));
            plot.vline(
                VLine::new(
                    format!("max_length {} ({truncated} truncated)", h.cutoff),
                    h.cutoff as f64,
                )
                .color(theme::ERROR)
                .width(2.0),
            );
        });
    ui.label(
        RichText::new(format!(
            "cutoff at max_length = {}: {} row(s) truncated ({:.1} %)",
            h.cutoff,
            truncated,
            100.0 * p.stats.truncated_fraction
        ))
        .small()
        .weak(),
    );
}

fn stats(ui: &mut Ui, p: &DataPreview) {
    let st = &p.stats;
    theme::stats_grid(ui, "preview-stats", |row| {
        row(
            "rows",
            theme::split_counts(
                p.num_rows,
                p.num_train_rows,
                p.num_validation_rows,
                p.full_scan,
                "rows",
            ),
        );
        row(
            "samples kept",
            format!(
                "{} ({} dropped)",
                theme::count(st.num_samples as u64),
                st.num_dropped
            ),
        );
        row(
            "tokens",
            format!(
                "{} total · {} trained ({:.1} %)",
                theme::count(st.total_tokens as u64),
                theme::count(st.trained_tokens as u64),
                100.0 * st.trained_fraction
            ),
        );
        row(
            "length",
            format!(
                "mean {:.0} · median {} · max {}",
                st.mean_length, st.median_length, st.max_length_seen
            ),
        );
        row(
            "padding waste",
            format!(
                "{:.1} % at batch {} ({:.1} % grouped by length)",
                100.0 * st.padding_waste,
                st.batch_size,
                100.0 * st.padding_waste_grouped
            ),
        );
        row(
            "packing",
            format!(
                "{} sequences of {} ({:.1} % full)",
                theme::count(st.packed_sequences as u64),
                p.max_length,
                100.0 * st.packing_efficiency
            ),
        );
        row(
            "pad token",
            format!(
                "id {}{}",
                p.pad_id,
                if p.pad_is_fallback {
                    " (EOS fallback)"
                } else {
                    ""
                }
            ),
        );
    });
}
