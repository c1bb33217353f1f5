//! The Preview of preference pairs (DPO, ORPO): when the data holds pairs (TRL's
//! `prompt` / `chosen` / `rejected`, LLaMA-Factory's ranking formats), each pair's prompt and
//! its two completions as the trainer tokenises them — every token a chip coloured by its
//! label class (the prompt masked, the completions trained), what truncation cut, the lengths —
//! then the pair stats and the pair lints. The chips are the SFT preview's
//! ([`crate::gui::text::token_row`]), so right-to-left text reads as it does there.
//!
//! The panel owns its state: the last pair preview (built by the preview job,
//! [`crate::gui::jobs::Jobs::preview`]) with its parts already shaped as rows for the chip
//! renderer, and the layout of the two completions.

use eframe::egui::{self, Color32, RichText, Ui};

use tunestudio::data::preference::{PairPreview, PartPreview, PreferencePreview};
use tunestudio::data::{RowPreview, SplitName};
use tunestudio::train::{RunConfig, TrainingMethod};

use super::{lint_list, MAX_CHIPS_PER_ROW};
use crate::gui::action::Action;
use crate::gui::session::Panel;
use crate::gui::text;
use crate::gui::theme;

/// How a pair's two completions are laid out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PairLayout {
    /// Chosen and rejected in two columns under the prompt.
    #[default]
    SideBySide,
    /// Chosen above rejected, each the full width.
    Stacked,
}

/// A pair's three parts as rows the chip renderer draws.
#[derive(Debug, Clone)]
struct PairRows {
    prompt: RowPreview,
    chosen: RowPreview,
    rejected: RowPreview,
}

/// The pair preview: its state and its view.
#[derive(Debug, Default)]
pub struct PairPreviewPanel {
    preview: Option<PreferencePreview>,
    /// One entry per shown pair, in the preview's order.
    rows: Vec<PairRows>,
    /// How the completions are laid out.
    pub layout: PairLayout,
}

impl PairPreviewPanel {
    /// Takes a new pair preview (the preview job's answer).
    pub fn set(&mut self, p: PreferencePreview) {
        self.rows = p.pairs.iter().map(pair_rows).collect();
        self.preview = Some(p);
    }

    /// What the plan needs of the pairs: their longest (prompt + the longer completion), once
    /// the preview has scanned them all at `config`'s lengths (`None` before, or while the
    /// preview is of other lengths), as `tunestudio plan --config` derives it.
    pub fn trained_tokens(&self, config: &RunConfig) -> Option<tunestudio::plan::TrainedTokens> {
        let p = self.preview.as_ref().filter(|p| p.full_scan)?;
        let want = &config.preference;
        let limits = p.limits;
        (limits.max_prompt_length == Some(want.max_prompt_length)
            && limits.max_completion_length == Some(want.max_completion_length))
        .then(|| {
            tunestudio::plan::TrainedTokens::from_counts(
                want.max_prompt_length + want.max_completion_length,
                p.stats.max_sequence,
                std::iter::empty(),
            )
        })
    }

    /// Forgets the pair preview (the data is not pairs, or it could not be read).
    pub fn clear(&mut self) {
        self.preview = None;
        self.rows.clear();
    }

    /// The last pair preview.
    pub fn preview(&self) -> Option<&PreferencePreview> {
        self.preview.as_ref()
    }

    /// Draws the pairs, their stats and lints; `method` is the run's (`[training] method`),
    /// `highlight` a pair jumped to from a lint.
    pub fn show(
        &mut self,
        ui: &mut Ui,
        method: TrainingMethod,
        highlight: Option<usize>,
        actions: &mut Vec<Action>,
    ) {
        let Some(p) = &self.preview else {
            return;
        };
        method_note(ui, method, actions);
        legend(ui, p, &mut self.layout);
        for (pair, rows) in p.pairs.iter().zip(&self.rows) {
            pair_card(ui, pair, rows, self.layout, highlight == Some(pair.index));
        }
        theme::section(ui, "Pair statistics");
        stats(ui, p);
        theme::section(ui, &format!("Pair lints ({})", p.lints.len()));
        lint_list(ui, &p.lints, actions);
    }
}

/// A part of a pair as a preview row (its tokens, lengths and truncation).
fn part_row(pair: &PairPreview, part: &PartPreview, completion: bool) -> RowPreview {
    RowPreview {
        index: pair.index,
        location: pair.location.clone(),
        split: pair.split,
        text: None,
        tokens: part.tokens.clone(),
        num_tokens: part.num_tokens(),
        num_trained: part.num_trained,
        full_len: part.full_len,
        truncated: part.cut > 0,
        completion_truncated: completion && part.cut > 0,
        dropped: None,
    }
}

fn pair_rows(p: &PairPreview) -> PairRows {
    PairRows {
        prompt: part_row(p, &p.prompt, false),
        chosen: part_row(p, &p.chosen, true),
        rejected: part_row(p, &p.rejected, true),
    }
}

/// What the run's method does with these pairs; SFT does not train on them as pairs.
fn method_note(ui: &mut Ui, method: TrainingMethod, actions: &mut Vec<Action>) {
    match method {
        TrainingMethod::Sft => {
            ui.horizontal_wrapped(|ui| {
                ui.label(
                    RichText::new(
                        "⚠ This dataset holds preference pairs, and the run trains with SFT: \
                         choose DPO or ORPO under Objective in Training to learn from the pairs.",
                    )
                    .color(theme::WARNING),
                );
                if ui
                    .button("Open Training")
                    .on_hover_text("The method switch (SFT, DPO, ORPO) is in the Training panel")
                    .clicked()
                {
                    actions.push(Action::Goto(Panel::Training));
                }
            });
        }
        TrainingMethod::Dpo => theme::note(
            ui,
            "DPO: each step raises the chosen completion's log-probability against the rejected one's, \
             relative to the reference model, after the same prompt.",
        ),
        TrainingMethod::Orpo => theme::note(
            ui,
            "ORPO: each step trains the chosen completion (its NLL) and raises its odds against the rejected one's; \
             no reference model.",
        ),
        TrainingMethod::Grpo => theme::note(
            ui,
            "GRPO samples its own completions: it reads the pairs' prompts only and ignores chosen and rejected.",
        ),
    }
}

fn legend(ui: &mut Ui, p: &PreferencePreview, layout: &mut PairLayout) {
    ui.horizontal_wrapped(|ui| {
        theme::legend_item(ui, theme::MASKED, "prompt (masked)");
        theme::legend_item(ui, theme::TRAINED, "completion (trained)");
        theme::legend_item(ui, theme::WARNING, "cut by truncation");
        ui.separator();
        ui.label(
            RichText::new(format!(
                "format {} (preference pairs) · template: {} · prompt ≤ {} tokens (keeps its end) · completions ≤ {} (keep their start)",
                p.format.name(),
                p.chat_template_origin,
                limit(p.limits.max_prompt_length),
                limit(p.limits.max_completion_length),
            ))
            .small()
            .weak(),
        );
        ui.separator();
        ui.radio_value(layout, PairLayout::SideBySide, "side by side")
            .on_hover_text("Chosen and rejected in two columns");
        ui.radio_value(layout, PairLayout::Stacked, "stacked")
            .on_hover_text("Chosen above rejected, each the full width");
    });
    ui.add_space(4.0);
}

fn limit(n: Option<usize>) -> String {
    n.map_or_else(|| "∞".into(), |n| n.to_string())
}

fn pair_card(ui: &mut Ui, pair: &PairPreview, rows: &PairRows, layout: PairLayout, lit: bool) {
    let stroke = if lit {
        egui::Stroke::new(2.0, theme::ACCENT)
    } else {
        egui::Stroke::new(1.0, ui.visuals().widgets.noninteractive.bg_stroke.color)
    };
    ui.push_id(("pair", pair.index), |ui| {
        egui::Frame::new()
            .stroke(stroke)
            .inner_margin(10.0)
            .corner_radius(6.0)
            .show(ui, |ui| {
                ui.set_min_width(ui.available_width());
                ui.horizontal_wrapped(|ui| {
                    ui.label(RichText::new(format!("Pair {}", pair.index)).strong());
                    let split = match pair.split {
                        SplitName::Train => "train",
                        SplitName::Validation => "validation",
                    };
                    ui.label(RichText::new(split).color(theme::ACCENT));
                    ui.label(RichText::new(&pair.location).weak());
                    ui.label(
                        RichText::new(format!(
                            "prompt {} · chosen {} · rejected {} tokens",
                            pair.prompt.num_tokens(),
                            pair.chosen.num_tokens(),
                            pair.rejected.num_tokens()
                        ))
                        .weak(),
                    );
                });
                ui.add_space(4.0);
                part(ui, "prompt", theme::MASKED, &pair.prompt, &rows.prompt);
                ui.add_space(6.0);
                match layout {
                    PairLayout::SideBySide => {
                        ui.columns(2, |cols| {
                            part(
                                &mut cols[0],
                                "chosen",
                                theme::OK,
                                &pair.chosen,
                                &rows.chosen,
                            );
                            part(
                                &mut cols[1],
                                "rejected",
                                theme::ERROR,
                                &pair.rejected,
                                &rows.rejected,
                            );
                        });
                    }
                    PairLayout::Stacked => {
                        part(ui, "chosen", theme::OK, &pair.chosen, &rows.chosen);
                        ui.add_space(6.0);
                        part(ui, "rejected", theme::ERROR, &pair.rejected, &rows.rejected);
                    }
                }
            });
    });
    ui.add_space(6.0);
}

/// One part: its name, lengths and truncation, then its tokens.
fn part(ui: &mut Ui, name: &str, color: Color32, p: &PartPreview, row: &RowPreview) {
    ui.push_id(name, |ui| {
        ui.vertical(|ui| {
            ui.horizontal_wrapped(|ui| {
                ui.label(RichText::new(name).strong().color(color));
                let trained = if name == "prompt" {
                    "masked".to_string()
                } else {
                    format!("{} trained", p.num_trained)
                };
                ui.label(RichText::new(format!("{} tokens · {trained}", p.num_tokens())).weak());
                if p.cut > 0 {
                    let whence = if name == "prompt" {
                        "its start"
                    } else {
                        "its end"
                    };
                    ui.label(
                        RichText::new(format!(
                            "{} of {} cut from {whence}",
                            p.cut, p.full_len
                        ))
                        .color(theme::WARNING),
                    );
                }
                if p.eos_appended {
                    ui.label(RichText::new("EOS appended").weak())
                        .on_hover_text("Nothing closed the answer, so the tokeniser appended EOS");
                }
                if p.prompt_differs {
                    ui.label(RichText::new("prompt tokens differ").color(theme::WARNING))
                        .on_hover_text(
                            "The conversation rendered with this answer does not start with the prompt's tokens",
                        );
                }
            });
            if p.cut > 0 && name == "prompt" {
                ui.label(RichText::new(format!("⋯ {} tokens cut", p.cut)).color(theme::WARNING));
            }
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
            if p.cut > 0 && name != "prompt" {
                ui.label(RichText::new(format!("⋯ {} tokens cut", p.cut)).color(theme::WARNING));
            }
        });
    });
}

fn stats(ui: &mut Ui, p: &PreferencePreview) {
    let st = &p.stats;
    theme::stats_grid(ui, "pair-stats", |row| {
        row(
            "pairs",
            theme::split_counts(
                p.num_rows,
                p.num_train_rows,
                p.num_validation_rows,
                p.full_scan,
                "pairs",
            ),
        );
        row(
            "prompt",
            format!("mean {:.1} · max {} tokens", st.mean_prompt, st.max_prompt),
        );
        row(
            "completions",
            format!(
                "chosen mean {:.1} · rejected mean {:.1} tokens",
                st.mean_chosen, st.mean_rejected
            ),
        );
        row(
            "longest sequence",
            format!("{} tokens (prompt + completion)", st.max_sequence),
        );
        let n = st.num_pairs.max(1) as f64;
        row(
            "truncated",
            format!(
                "{} prompt(s) ({:.1} %) lost their start · {} pair(s) ({:.1} %) a completion's end",
                st.num_prompt_cut,
                100.0 * st.num_prompt_cut as f64 / n,
                st.num_completion_cut,
                100.0 * st.num_completion_cut as f64 / n
            ),
        );
    });
}
