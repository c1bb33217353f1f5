//! Run: start/pause/resume/stop, progress, live charts of the loss, learning
//! rate and per-device memory (against the plan's predicted peak and the
//! capacity), the log, the error report with fixes, and past runs to overlay.

use eframe::egui::{self, RichText, Ui};
use egui_plot::{HLine, Legend, Line, LineStyle, Plot, PlotPoints, Points};

use tunestudio::train::FinishReason;

use crate::gui::app::Action;
use crate::gui::run_state::{LogLevel, RunPhase, RunState};
use crate::gui::session::Session;
use crate::gui::shared::PanelContext;
use crate::gui::theme;

mod history;
use history::history;
pub use history::{HistoryRun, HistoryState};

/// The Run panel: the live run (its trainer's events folded in; the app holds the thread)
/// and the past runs.
#[derive(Default)]
pub struct RunPanel {
    /// The live run.
    pub live: RunState,
    /// Past runs.
    pub history: HistoryState,
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
        let can_start = !rp.live.is_active() && blocking.is_empty() && !planning_only;
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
            if ui.button("Apply the fix and resume").clicked() {
                actions.push(Action::ApplyOomRefitAndResume);
            }
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

/// Exponential moving average (as TensorBoard's smoothing slider).
pub fn smooth(points: &[[f64; 2]], weight: f64) -> Vec<[f64; 2]> {
    let mut out = Vec::with_capacity(points.len());
    let mut last: Option<f64> = None;
    for p in points {
        let v = match last {
            None => p[1],
            Some(prev) => prev * weight + p[1] * (1.0 - weight),
        };
        last = Some(v);
        out.push([p[0], v]);
    }
    out
}

fn loss_chart(ui: &mut Ui, rp: &mut RunPanel, s: &mut Session) {
    ui.horizontal(|ui| {
        ui.label(RichText::new("Loss").size(15.0).strong());
        ui.add_space(20.0);
        let l = ui.label("Smoothing");
        ui.add(
            egui::DragValue::new(&mut s.settings.smoothing)
                .range(0.0..=0.99)
                .speed(0.01),
        )
        .labelled_by(l.id)
        .on_hover_text("Exponential moving average of the training loss (0 = raw)");
    });
    let w = s.settings.smoothing as f64;
    let run = &rp.live;
    // (name, train loss, eval loss) of each overlaid run.
    type Curves = (String, Vec<[f64; 2]>, Vec<[f64; 2]>);
    let overlays: Vec<Curves> = rp
        .history
        .overlay
        .iter()
        .filter_map(|&i| rp.history.runs.get(i))
        .map(|h| {
            let pts = |v: &[(u64, f64)]| {
                v.iter()
                    .filter(|p| p.1.is_finite())
                    .map(|&(x, y)| [x as f64, y])
                    .collect()
            };
            (h.name(), pts(&h.curves.loss), pts(&h.curves.eval_loss))
        })
        .collect();
    Plot::new("loss-chart")
        .height(240.0)
        .legend(Legend::default())
        .x_axis_label("step")
        .y_axis_label("loss")
        .allow_scroll(false)
        .show(ui, |plot| {
            if !run.loss.is_empty() {
                plot.line(
                    Line::new("train (raw)", PlotPoints::from(run.loss.clone()))
                        .color(theme::ACCENT.gamma_multiply(0.35))
                        .width(1.0),
                );
                plot.line(
                    Line::new("train", PlotPoints::from(smooth(&run.loss, w)))
                        .color(theme::ACCENT)
                        .width(2.0),
                );
            }
            if !run.eval_loss.is_empty() {
                plot.line(
                    Line::new("eval", PlotPoints::from(run.eval_loss.clone()))
                        .color(theme::MEM_ACTIVATIONS)
                        .width(2.0),
                );
                plot.points(
                    Points::new("eval", PlotPoints::from(run.eval_loss.clone()))
                        .color(theme::MEM_ACTIVATIONS)
                        .radius(3.5),
                );
            }
            // The divergence watch's spikes (`train::divergence`).
            if !run.divergences.is_empty() {
                plot.points(
                    Points::new("diverged", PlotPoints::from(run.divergences.clone()))
                        .color(theme::ERROR)
                        .radius(6.0),
                );
            }
            for (i, (name, loss, eval)) in overlays.into_iter().enumerate() {
                let c = theme::SERIES[(i + 2) % theme::SERIES.len()];
                if !loss.is_empty() {
                    plot.line(
                        Line::new(format!("{name} train"), PlotPoints::from(smooth(&loss, w)))
                            .color(c)
                            .style(LineStyle::dashed_loose()),
                    );
                }
                if !eval.is_empty() {
                    plot.line(
                        Line::new(format!("{name} eval"), PlotPoints::from(eval))
                            .color(c)
                            .style(LineStyle::dotted_dense()),
                    );
                }
            }
        });
}

fn lr_chart(ui: &mut Ui, rp: &RunPanel) {
    Plot::new("lr-chart")
        .height(170.0)
        .x_axis_label("step")
        .allow_scroll(false)
        .y_axis_formatter(|m, _| format!("{:.0e}", m.value))
        .show(ui, |plot| {
            if !rp.live.lr.is_empty() {
                plot.line(
                    Line::new("learning rate", PlotPoints::from(rp.live.lr.clone()))
                        .color(theme::MEM_GRADIENTS)
                        .width(2.0),
                );
            }
        });
}

fn memory_chart(ui: &mut Ui, rp: &RunPanel) {
    let mem = &rp.live.memory;
    Plot::new("memory-chart")
        .height(170.0)
        .legend(Legend::default())
        .x_axis_label("step")
        .y_axis_label("GiB")
        .allow_scroll(false)
        .include_y(0.0)
        .show(ui, |plot| {
            for (i, (device, series)) in mem.iter().enumerate() {
                let c = theme::SERIES[i % theme::SERIES.len()];
                if !series.used.is_empty() {
                    let whose = match series.scope {
                        tunestudio::train::MemoryScope::Process => "used",
                        tunestudio::train::MemoryScope::Device => "used (whole device)",
                    };
                    plot.line(
                        Line::new(
                            format!("{device} {whose}"),
                            PlotPoints::from(series.used.clone()),
                        )
                        .color(c)
                        .width(2.0),
                    );
                }
                if let Some(p) = series.predicted_peak_bytes {
                    plot.hline(
                        HLine::new(format!("{device} predicted peak"), theme::gib(p))
                            .color(c)
                            .style(LineStyle::dashed_loose()),
                    );
                }
                // A capacity far above the use would flatten the curves to the axis.
                let top = series
                    .peak_bytes
                    .max(series.predicted_peak_bytes.unwrap_or(0));
                if let Some(t) = series.total_bytes.filter(|&t| t <= top.saturating_mul(4)) {
                    plot.hline(
                        HLine::new(format!("{device} capacity"), theme::gib(t))
                            .color(theme::ERROR)
                            .width(1.5),
                    );
                }
            }
        });
    // One caption per line of the chart, so each device's figures read on their own.
    let peaks: Vec<String> = mem
        .iter()
        .filter(|(_, v)| v.peak_bytes > 0)
        .map(|(d, v)| {
            format!(
                "{d}: peak {}{}{}",
                theme::bytes(v.peak_bytes),
                v.predicted_peak_bytes
                    .map(|p| format!(
                        " (predicted {}, {:+.1} %)",
                        theme::bytes(p),
                        100.0 * (p as f64 - v.peak_bytes as f64) / v.peak_bytes as f64
                    ))
                    .unwrap_or_default(),
                v.total_bytes
                    .map(|t| format!(" of {}", theme::bytes(t)))
                    .unwrap_or_default()
            )
        })
        .collect();
    ui.horizontal_wrapped(|ui| {
        for p in peaks {
            ui.label(RichText::new(p).small().weak());
        }
    });
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

#[cfg(test)]
mod tests {
    use super::smooth;

    #[test]
    fn smoothing_is_an_ema() {
        let pts = [[1.0, 4.0], [2.0, 2.0], [3.0, 2.0]];
        assert_eq!(smooth(&pts, 0.0), pts.to_vec());
        let s = smooth(&pts, 0.5);
        assert_eq!(s[0], [1.0, 4.0]);
        assert_eq!(s[1], [2.0, 3.0]);
        assert_eq!(s[2], [3.0, 2.5]);
    }
}
