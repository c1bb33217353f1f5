//! The Preview of a GRPO run (issue #59): before the first step, a few prompts' groups of
//! `num_generations` completions sampled with the run's model and settings, each completion's
//! tokens as chips, every reward function's value, the weighted reward, the advantage over its
//! group and whether it hit `max_completion_length`; then TRL's reward metrics and the lints
//! (a reward that is the same for every previewed completion fires `GrpoZeroAdvantage`: such
//! a run learns nothing). The library builds it ([`tunestudio::train::rollout_preview`]) on the
//! preview job's thread; this panel owns the last answer and draws it.

use eframe::egui::{self, RichText, Ui};

use tunestudio::data::{RowPreview, SplitName};
use tunestudio::train::rollout_preview::{PreviewCompletion, PreviewGroup, RolloutPreview};
use tunestudio::train::RunConfig;

use super::{lint_list, MAX_CHIPS_PER_ROW};
use crate::gui::action::Action;
use crate::gui::text;
use crate::gui::theme;

/// A prompt shown longer than this many characters is cut (its tokens are counted above it).
const PROMPT_CHARS_SHOWN: usize = 600;

/// The rollout preview: its state and its view.
#[derive(Debug, Default)]
pub struct RolloutPreviewPanel {
    preview: Option<RolloutPreview>,
    /// Each group's completions as rows the chip renderer draws, in the preview's order.
    rows: Vec<Vec<RowPreview>>,
    /// How many times the user asked for a sample ("Sample rollouts"): the preview job's
    /// request key (a sample loads the model, so it does not follow every edit).
    pub requests: u64,
    /// What the shown (or running) sample was drawn with ([`sampling_key`]).
    sampled_with: Option<String>,
}

/// What a sample depends on: the `[grpo]` table (rewards included), the data, the model and
/// its initialisation, the seed and the prompts shown.
fn sampling_key(config: &RunConfig, start_row: usize) -> String {
    format!(
        "{:?}|{:?}|{}|{:?}|{}|{}|{start_row}",
        config.grpo,
        config.data,
        config.model.source.trim(),
        config.model.init,
        config.training.seed,
        config.training.micro_batch,
    )
}

impl RolloutPreviewPanel {
    /// A sample of `config`'s rollouts from prompt `start_row` has started.
    pub fn sampling(&mut self, config: &RunConfig, start_row: usize) {
        self.sampled_with = Some(sampling_key(config, start_row));
    }

    /// Whether the settings changed since the shown sample was drawn.
    fn stale(&self, config: &RunConfig, start_row: usize) -> bool {
        self.sampled_with.as_deref() != Some(sampling_key(config, start_row).as_str())
    }

    /// Takes a new rollout preview (the preview job's answer).
    pub fn set(&mut self, p: RolloutPreview) {
        self.rows = p
            .groups
            .iter()
            .map(|g| g.completions.iter().map(|c| completion_row(g, c)).collect())
            .collect();
        self.preview = Some(p);
    }

    /// Forgets the rollout preview (the run is not GRPO, or the preview failed).
    pub fn clear(&mut self) {
        self.preview = None;
        self.rows.clear();
    }

    /// The last rollout preview.
    pub fn preview(&self) -> Option<&RolloutPreview> {
        self.preview.as_ref()
    }

    /// Draws the sample button, then the groups, the metrics and the lints of the last sample;
    /// `loading`: a sample is running.
    pub fn show(
        &mut self,
        ui: &mut Ui,
        config: &RunConfig,
        start_row: usize,
        loading: bool,
        actions: &mut Vec<Action>,
    ) {
        let settings = &config.grpo;
        let prompts = config.training.micro_batch.clamp(1, 16);
        ui.horizontal_wrapped(|ui| {
            let ask = ui
                .add_enabled(!loading, egui::Button::new("Sample rollouts"))
                .on_hover_text(
                    "Load the model on the CPU and sample each shown prompt's group with the run's settings",
                );
            if ask.clicked() {
                self.requests += 1;
            }
            if loading {
                ui.add(egui::Spinner::new());
                ui.label(format!(
                    "sampling {} completions for each of {prompts} prompt(s)…",
                    settings.num_generations
                ));
            } else if self.preview.is_some() && self.stale(config, start_row) {
                ui.label(
                    RichText::new("the settings changed since this sample: sample again")
                        .color(theme::WARNING),
                );
            }
        });
        let Some(p) = &self.preview else {
            theme::note(
                ui,
                "A GRPO run learns from completions it samples. Sample a few prompts' groups \
                 to see every reward function's score before the run: a reward that never \
                 changes teaches nothing.",
            );
            return;
        };
        theme::note(
            ui,
            &format!(
                "GRPO samples {} completions per prompt with the model as the run starts \
                 (temperature {}, top_p {}, top_k {}, at most {} tokens) and scores each with \
                 every reward function; a completion learns from its advantage over its group.",
                settings.num_generations,
                settings.temperature,
                settings.top_p,
                settings.top_k,
                settings.max_completion_length
            ),
        );
        ui.horizontal_wrapped(|ui| {
            theme::legend_item(ui, theme::TRAINED, "completion (trained)");
            theme::legend_item(ui, theme::WARNING, "hit max_completion_length");
            ui.separator();
            ui.label(
                RichText::new(format!("rewards: {}", p.reward_names.join(", ")))
                    .small()
                    .weak(),
            );
        });
        for (group, rows) in p.groups.iter().zip(&self.rows) {
            group_card(ui, group, rows, &p.reward_names);
        }
        theme::section(ui, "Reward metrics (TRL's names)");
        theme::stats_grid(ui, "rollout-metrics", |row| {
            for (name, value) in &p.metrics {
                row(name, format!("{value:.4}"));
            }
        });
        theme::section(ui, &format!("Rollout lints ({})", p.lints.len()));
        lint_list(ui, &p.lints, actions);
    }
}

/// A completion as a preview row: every token trained.
fn completion_row(g: &PreviewGroup, c: &PreviewCompletion) -> RowPreview {
    RowPreview {
        index: g.row,
        location: format!("prompt row {}", g.row),
        split: SplitName::Train,
        text: Some(c.text.clone()),
        tokens: c.tokens.clone(),
        num_tokens: c.tokens.len(),
        num_trained: c.tokens.len(),
        full_len: c.tokens.len(),
        truncated: c.truncated,
        completion_truncated: c.truncated,
        dropped: None,
    }
}

fn group_card(ui: &mut Ui, g: &PreviewGroup, rows: &[RowPreview], names: &[String]) {
    ui.push_id(("rollout-group", g.row), |ui| {
        egui::Frame::new()
            .stroke(egui::Stroke::new(
                1.0,
                ui.visuals().widgets.noninteractive.bg_stroke.color,
            ))
            .inner_margin(10.0)
            .corner_radius(6.0)
            .show(ui, |ui| {
                ui.set_min_width(ui.available_width());
                ui.horizontal_wrapped(|ui| {
                    ui.label(RichText::new(format!("Prompt {}", g.row)).strong());
                    ui.label(
                        RichText::new(format!(
                            "{} tokens · {} completions",
                            g.prompt_tokens,
                            g.completions.len()
                        ))
                        .weak(),
                    );
                });
                let shown: String = g.prompt.chars().take(PROMPT_CHARS_SHOWN).collect();
                let cut = if g.prompt.chars().count() > PROMPT_CHARS_SHOWN {
                    " …"
                } else {
                    ""
                };
                ui.add(
                    egui::Label::new(
                        RichText::new(format!("{shown}{cut}"))
                            .monospace()
                            .color(theme::MASKED),
                    )
                    .wrap(),
                );
                ui.add_space(4.0);
                for (i, (c, row)) in g.completions.iter().zip(rows).enumerate() {
                    ui.push_id(i, |ui| completion(ui, i, c, row, names));
                }
            });
    });
    ui.add_space(6.0);
}

/// One completion: its rewards, advantage and length, then its tokens.
fn completion(ui: &mut Ui, i: usize, c: &PreviewCompletion, row: &RowPreview, names: &[String]) {
    ui.separator();
    ui.horizontal_wrapped(|ui| {
        ui.label(RichText::new(format!("completion {i}")).strong());
        let per_function: Vec<String> = names
            .iter()
            .zip(&c.rewards)
            .map(|(n, r)| format!("{n} {r:.3}"))
            .collect();
        ui.label(format!(
            "reward {:.3} ({})",
            c.reward,
            per_function.join(", ")
        ));
        let color = if c.advantage > 0.0 {
            theme::OK
        } else if c.advantage < 0.0 {
            theme::ERROR
        } else {
            theme::MASKED
        };
        ui.label(RichText::new(format!("advantage {:+.3}", c.advantage)).color(color));
        ui.label(RichText::new(format!("{} tokens", c.tokens.len())).weak());
        if c.truncated {
            ui.label(RichText::new("truncated (no EOS)").color(theme::WARNING))
                .on_hover_text("It reached max_completion_length before the end-of-sequence token");
        }
    });
    text::token_row(ui, row, MAX_CHIPS_PER_ROW);
}
