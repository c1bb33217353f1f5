//! Run: start/pause/resume/stop, progress, live charts of the loss, learning
//! rate and per-device memory (against the plan's predicted peak and the
//! capacity), the log, the error report with fixes, and past runs to overlay.

use eframe::egui::{self, RichText, Ui};

use tunestudio::train::FinishReason;

use crate::gui::action::Action;
use crate::gui::run_state::{LogLevel, RunPhase, RunState};
use crate::gui::session::Session;
use crate::gui::shared::PanelContext;
use crate::gui::theme;

mod charts;
mod history;
use charts::{loss_chart, lr_chart, memory_chart, reward_chart};
use history::history;
pub use history::HistoryState;

/// The Run panel: the live run (its trainer's events folded in; the app holds the thread)
/// and the past runs.
#[derive(Default)]
pub struct RunPanel {
    /// The live run.
    pub live: RunState,
    /// Past runs.
    pub history: HistoryState,
    /// Start's disk work under way on jobs.
    pub pending: PendingStart,
}

/// What Start (or "Train in a new folder", or "Apply the fix and resume") waits on: each is a
/// job (`gui/jobs/start.rs`), the latest request's number kept so a stale answer is dropped.
/// Start shows busy while any is out, so a second click cannot start a second run.
#[derive(Default, Debug, Clone)]
pub struct PendingStart {
    /// Number of the latest check of the output folder for another run.
    pub check_seq: u64,
    /// That check is out.
    pub checking: bool,
    /// Number of the latest proposal of a fresh output folder for a new project.
    pub proposal_seq: u64,
    /// That proposal is out.
    pub proposing: bool,
    /// Start once the proposal is in ("Train in a new folder").
    pub start_after_proposal: bool,
    /// Number of the latest out-of-memory refit.
    pub refit_seq: u64,
    /// That refit is out.
    pub refitting: bool,
}

impl PendingStart {
    /// Whether Start waits on a job.
    pub fn busy(&self) -> bool {
        self.checking || self.proposing || self.refitting
    }
}

impl RunPanel {
    /// Draws the Run panel.
    pub fn show(
        &mut self,
        ui: &mut Ui,
        s: &mut Session,
        cx: &PanelContext,
        actions: &mut Vec<Action>,
    ) {
        let rp = self;
        theme::heading(
            ui,
            "Run",
            "Train with the current settings and watch it live.",
        );
        controls(ui, rp, s, cx, actions);
        ui.add_space(6.0);
        progress(ui, rp);
        diverged_offer(ui, rp, s, actions);

        if let Some(err) = rp.live.error.clone() {
            ui.add_space(6.0);
            theme::error_box(
                ui,
                if err.is_out_of_memory() {
                    "Out of memory"
                } else {
                    "The run stopped with an error"
                },
                &format!(
                    "{}{}\n\nWhat to do: {}",
                    err.step
                        .map(|st| format!("At step {st}: "))
                        .unwrap_or_default(),
                    err.message,
                    err.hint
                ),
            );
            if err.is_out_of_memory() {
                match cx.plan.cloned() {
                    Some(plan) if !plan.fixes.is_empty() => {
                        ui.label(RichText::new("Fixes from the memory plan, best first:").strong());
                        crate::gui::widgets::fixes(ui, &plan, actions);
                    }
                    _ => {
                        ui.horizontal(|ui| {
                        ui.label("The plan predicted this would fit; let auto-fit find settings with more headroom:");
                        if ui.button("Auto-fit").clicked() {
                            actions.push(Action::AutoFit);
                            actions.push(Action::Goto(crate::gui::session::Panel::Devices));
                        }
                    });
                    }
                }
            }
        }

        ui.add_space(8.0);
        loss_chart(ui, rp, s);
        if !rp.live.rewards.is_empty() {
            theme::section(ui, "Rewards");
            reward_chart(ui, rp);
        }
        if let Some((step, group)) = &rp.live.completions {
            theme::section(ui, &format!("Latest completions (step {step})"));
            latest_completions(ui, group);
        }
        ui.columns(2, |cols| {
            theme::section(&mut cols[0], "Learning rate");
            lr_chart(&mut cols[0], rp);
            theme::section(&mut cols[1], "Memory per device");
            memory_chart(&mut cols[1], rp);
        });

        theme::section(ui, "Log");
        log(ui, rp);

        theme::section(ui, "Run history");
        history(ui, rp, actions);
    }
}

/// GRPO: the last step's first prompt and each sampled completion with its rewards and
/// advantage, so a reward that scores the wrong thing shows while the run is young.
fn latest_completions(ui: &mut Ui, g: &tunestudio::train::SampledGroup) {
    theme::card(ui, |ui| {
        ui.label(RichText::new(format!("prompt row {}", g.row)).strong());
        ui.add(egui::Label::new(RichText::new(&g.prompt).monospace().weak()).wrap());
        for (i, c) in g.completions.iter().enumerate() {
            ui.separator();
            let per_function: Vec<String> = g
                .reward_names
                .iter()
                .zip(&c.rewards)
                .map(|(n, r)| format!("{n} {r:.3}"))
                .collect();
            ui.label(format!(
                "[{i}] reward {:.3} ({}) · advantage {:+.3}{}",
                c.reward,
                per_function.join(", "),
                c.advantage,
                if c.truncated { " · truncated" } else { "" }
            ));
            ui.add(egui::Label::new(RichText::new(&c.text).monospace()).wrap());
        }
    });
}

/// After the divergence watch stopped the run: resume from the last good checkpoint with a
/// tenth of the learning rate.
fn diverged_offer(ui: &mut Ui, rp: &mut RunPanel, s: &mut Session, actions: &mut Vec<Action>) {
    let (RunPhase::Finished(FinishReason::Diverged), Some(lr)) =
        (rp.live.phase, rp.live.suggested_learning_rate)
    else {
        return;
    };
    ui.horizontal(|ui| {
        ui.label(
            RichText::new("The loss diverged; the last checkpoint before the spike is kept.")
                .color(theme::WARNING),
        );
        if ui
            .button(format!("Resume with lr ÷ 10 ({lr:.1e})"))
            .on_hover_text("Sets training.learning_rate and resumes from the last good checkpoint")
            .clicked()
        {
            s.config.training.learning_rate = lr;
            actions.push(Action::StartResumingLatest);
        }
    });
}

/// Why Start is disabled by the data, the rows, the fix, and a named override per lint.
fn lint_gate(ui: &mut Ui, s: &mut Session, blocking: &[tunestudio::data::Lint]) {
    for l in blocking {
        let id = l.kind.id();
        let rows: Vec<String> = l.examples.iter().map(usize::to_string).collect();
        theme::error_box(
            ui,
            &format!("Start is disabled: lint `{id}`"),
            &if rows.is_empty() {
                l.message.clone()
            } else {
                format!(
                    "{} (rows {}). The Preview panel shows them.",
                    l.message,
                    rows.join(", ")
                )
            },
        );
        theme::allow_lint_checkbox(ui, &mut s.config.data.allow, id);
    }
}

/// Start found another run in the output folder: resume it, or train in a new folder.
fn existing_run_question(ui: &mut Ui, rp: &RunPanel, actions: &mut Vec<Action>) {
    let Some(existing) = &rp.live.existing_run else {
        return;
    };
    theme::card(ui, |ui| {
        ui.label(RichText::new(format!("{existing}.")).color(theme::WARNING));
        ui.horizontal(|ui| {
            if ui.button("Resume that run").clicked() {
                actions.push(Action::StartResumingLatest);
            }
            if ui.button("Train in a new folder").clicked() {
                actions.push(Action::StartInNewFolder);
            }
            if ui.button("Cancel").clicked() {
                actions.push(Action::CancelStart);
            }
        });
    });
}

fn controls(
    ui: &mut Ui,
    rp: &mut RunPanel,
    s: &mut Session,
    cx: &PanelContext,
    actions: &mut Vec<Action>,
) {
    let phase = rp.live.phase;
    let blocking = &cx.blocking_lints;
    ui.horizontal(|ui| {
        // A planned machine (not this one) shows its `tunestudio train` command instead.
        let planning_only = crate::gui::widgets::planning_only_note(ui, cx, actions);
        let can_start = !rp.live.is_active()
            && !rp.pending.busy()
            && blocking.is_empty()
            && !planning_only;
        let start = ui
            .add_enabled(
                can_start,
                egui::Button::new(RichText::new("Start").strong()).min_size(egui::vec2(90.0, 30.0)),
            )
            .on_hover_text("Train with the current settings (writes to the output folder)");
        if start.clicked() {
            actions.push(Action::Start);
        }
        match phase {
            RunPhase::Paused => {
                if ui
                    .add(egui::Button::new("Resume").min_size(egui::vec2(90.0, 30.0)))
                    .clicked()
                {
                    actions.push(Action::Resume);
                }
            }
            _ => {
                let r = ui
                    .add_enabled(
                        phase == RunPhase::Running,
                        egui::Button::new("Pause").min_size(egui::vec2(90.0, 30.0)),
                    )
                    .on_hover_text("Pause after the current step");
                if r.clicked() {
                    actions.push(Action::Pause);
                }
            }
        }
        let r = ui
            .add_enabled(
                rp.live.is_active(),
                egui::Button::new("Stop").min_size(egui::vec2(90.0, 30.0)),
            )
            .on_hover_text(
                "End the run after the current step, saving a checkpoint of it (as Ctrl-C does in `tunestudio train`)",
            );
        if r.clicked() {
            actions.push(Action::Stop);
        }
        let r = ui
            .add_enabled(
                matches!(phase, RunPhase::Running | RunPhase::Paused),
                egui::Button::new("Save checkpoint").min_size(egui::vec2(90.0, 30.0)),
            )
            .on_hover_text("Write a resumable checkpoint after the current step");
        if r.clicked() {
            actions.push(Action::SaveNow);
        }
        phase_label(ui, rp);
    });
    if !rp.live.is_active() {
        lint_gate(ui, s, blocking);
    }
    existing_run_question(ui, rp, actions);
    run_notes(ui, rp, cx, actions);
}

/// Below the controls: the out-of-memory refit offer, the lints a run was allowed to train
/// despite, and the plan's "will not fit".
fn run_notes(ui: &mut Ui, rp: &RunPanel, cx: &PanelContext, actions: &mut Vec<Action>) {
    if let Some(refit) = rp.live.oom_refit.clone().filter(|_| !rp.live.is_active()) {
        theme::card(ui, |ui| {
            ui.label(format!(
                "Out of memory. The run stopped with a checkpoint of its last good step. Settings that fit what the device held (same effective batch): {}",
                refit.join("; ")
            ));
            let refitting = rp.pending.refitting;
            ui.horizontal(|ui| {
                if ui
                    .add_enabled(!refitting, egui::Button::new("Apply the fix and resume"))
                    .clicked()
                {
                    actions.push(Action::ApplyOomRefitAndResume);
                }
                if refitting {
                    ui.add(egui::Spinner::new().size(12.0));
                    ui.label("fitting the settings…");
                }
            });
        });
    }
    for l in &rp.live.allowed_lints {
        ui.label(
            RichText::new(format!(
                "training despite lint `{}` ({} rows), allowed by [data] allow",
                l.lint, l.count
            ))
            .color(theme::WARNING)
            .small(),
        );
    }
    if let Some(plan) = cx.plan {
        if !plan.fits() && !rp.live.is_active() {
            ui.label(
                RichText::new(format!(
                    "The memory plan says this will not fit: {}",
                    plan.summary
                ))
                .color(theme::WARNING)
                .small(),
            );
        }
    }
}

/// Where the run is, in a word (with a spinner while it loads).
fn phase_label(ui: &mut Ui, rp: &RunPanel) {
    // Start waits on a job: the output folder's check for another run, or a new folder.
    if rp.pending.checking || rp.pending.proposing {
        ui.add(egui::Spinner::new());
        ui.label(
            RichText::new("checking the output folder…")
                .color(theme::ACCENT)
                .strong(),
        );
        return;
    }
    let phase = rp.live.phase;
    let (color, text) = match phase {
        RunPhase::Idle => (ui.visuals().weak_text_color(), "ready".to_string()),
        RunPhase::Loading => (theme::ACCENT, rp.live.status.clone()),
        RunPhase::Running => (theme::OK, "training".to_string()),
        RunPhase::Paused => (theme::WARNING, "paused".to_string()),
        RunPhase::Finished(FinishReason::Completed) => (theme::OK, "completed".to_string()),
        RunPhase::Finished(FinishReason::Stopped) => (theme::WARNING, "stopped".to_string()),
        RunPhase::Finished(FinishReason::Failed) => (theme::ERROR, "failed".to_string()),
        RunPhase::Finished(FinishReason::Diverged) => (theme::ERROR, "diverged".to_string()),
    };
    if phase == RunPhase::Loading {
        ui.add(egui::Spinner::new());
    }
    ui.label(RichText::new(text).color(color).strong());
}

fn progress(ui: &mut Ui, rp: &RunPanel) {
    let r = &rp.live;
    if r.phase == RunPhase::Idle {
        theme::note(
            ui,
            "Press Start to train. The demo trains a tiny model in about a minute on a laptop CPU.",
        );
        return;
    }
    let text = if r.total_steps > 0 {
        format!("step {} / {}", r.step, r.total_steps)
    } else {
        r.status.clone()
    };
    ui.add(
        egui::ProgressBar::new(r.progress())
            .text(text)
            .desired_height(20.0),
    );
    ui.horizontal_wrapped(|ui| {
        let mut stat = |k: &str, v: String| {
            ui.label(RichText::new(k).weak());
            ui.label(RichText::new(v).strong());
            ui.add_space(12.0);
        };
        stat(
            "loss",
            r.loss.last().map_or("–".into(), |p| format!("{:.4}", p[1])),
        );
        stat(
            "eval loss",
            r.eval_loss
                .last()
                .map_or("–".into(), |p| format!("{:.4}", p[1])),
        );
        stat("tokens/s", format!("{:.0}", r.tokens_per_sec));
        stat("elapsed", theme::duration(r.elapsed_secs));
        stat("ETA", r.eta_secs().map_or("–".into(), theme::duration));
        stat("epoch", format!("{:.2}", r.epoch));
        stat("trained tokens", theme::count(r.trained_tokens));
    });
    if let Some(dir) = &r.output_dir {
        ui.label(
            RichText::new(format!("output: {}", dir.display()))
                .small()
                .weak(),
        );
    }
}

fn log(ui: &mut Ui, rp: &RunPanel) {
    egui::Frame::new()
        .fill(ui.visuals().extreme_bg_color)
        .inner_margin(8.0)
        .corner_radius(4.0)
        .show(ui, |ui| {
            ui.set_min_width(ui.available_width());
            egui::ScrollArea::vertical()
                .id_salt("run-log")
                .max_height(160.0)
                .stick_to_bottom(true)
                .auto_shrink([false, true])
                .show(ui, |ui| {
                    if rp.live.log.is_empty() {
                        ui.label(RichText::new("(empty)").weak().monospace());
                    }
                    for l in &rp.live.log {
                        let color = match l.level {
                            LogLevel::Info => ui.visuals().text_color(),
                            LogLevel::Warning => theme::WARNING,
                            LogLevel::Error => theme::ERROR,
                        };
                        ui.add(
                            egui::Label::new(
                                RichText::new(format!("[{:>6.1}s] {}", l.secs, l.text))
                                    .monospace()
                                    .small()
                                    .color(color),
                            )
                            .wrap(),
                        );
                    }
                });
        });
}
