//! The window around the panels: the left navigation with its badges, and the status bar
//! (the run, the jobs, toasts, the frame-time readout).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use eframe::egui::{self, Color32, RichText};

use super::{Action, StudioApp};
use crate::gui::file_picker::{FilePicker, PickKind};
use crate::gui::frame_stats::FrameStats;
use crate::gui::run_state::{RunPhase, RunState};
use crate::gui::session::{Panel, Session};
use crate::gui::theme;

/// The window's own state around the panels: the status bar's message and frame times, and
/// the file picker.
pub struct Chrome {
    /// Frame-time statistics.
    pub frames: FrameStats,
    /// Show the frame-time debug line in the status bar.
    pub show_debug: bool,
    /// A transient message for the status bar.
    pub toast: Option<(String, Instant)>,
    /// Whether the system file dialog can open (and why not): decided once at start.
    pub system_dialog: Result<(), String>,
    /// The in-app file picker, when open, and who asked for it.
    pub picker: Option<(PickFor, FilePicker)>,
    /// The status bar said which file dialog is in use.
    pub picker_noted: bool,
    /// Screenshot mode printed it too.
    pub picker_noted_on_stderr: bool,
}

impl Default for Chrome {
    fn default() -> Self {
        Chrome {
            frames: FrameStats::default(),
            show_debug: true,
            toast: None,
            system_dialog: Ok(()),
            picker: None,
            picker_noted: false,
            picker_noted_on_stderr: false,
        }
    }
}

/// Who opened the in-app file picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickFor {
    /// A studio field.
    Studio(crate::gui::jobs::PickTarget),
    /// The Playground.
    Playground(crate::gui::action::PgPick),
}

impl Chrome {
    /// Shows a transient message in the status bar.
    pub fn toast(&mut self, text: impl Into<String>) {
        self.toast = Some((text.into(), Instant::now()));
    }

    /// Opens the in-app picker for `who` (the system dialog is unavailable), saying once in
    /// the status bar why. It starts in the first of `starts` a job can list; its places
    /// start at the session's run folder and project.
    pub fn open_picker(
        &mut self,
        session: &Session,
        who: PickFor,
        title: &str,
        kind: PickKind,
        starts: Vec<PathBuf>,
    ) {
        if !self.picker_noted {
            self.picker_noted = true;
            let why = self.system_dialog.clone().err().unwrap_or_default();
            self.toast(format!("{why}: using the built-in file picker"));
        }
        let mut places = vec![("Run folder".to_string(), session.output_dir())];
        if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
            places.push(("Home".into(), home));
        }
        places.push((
            "HF cache".into(),
            tunestudio::model::HubOptions::from_env().cache_dir,
        ));
        places.push(("Project".into(), session.config.base_dir.clone()));
        self.picker = Some((who, FilePicker::new(title, kind, starts, places)));
    }
}

impl StudioApp {
    /// The status bar. The frame-time readout on the right is laid out first and the rest
    /// gets the width left of it, so a long message is cut short ("…", the whole of it on
    /// hover) instead of running under the readout.
    pub(super) fn status_bar(&mut self, ui: &mut egui::Ui) {
        ui.with_layout(egui::Layout::right_to_left(egui::Align::Center), |ui| {
            self.frame_time_readout(ui);
            ui.with_layout(egui::Layout::left_to_right(egui::Align::Center), |ui| {
                // Whatever still does not fit is clipped at the readout, never drawn over it.
                ui.set_clip_rect(ui.max_rect().intersect(ui.clip_rect()));
                self.status_messages(ui);
            });
        });
    }

    /// The "frame time" toggle and, when on, the frame-time summary (right to left).
    pub(super) fn frame_time_readout(&mut self, ui: &mut egui::Ui) {
        let r = ui
            .selectable_label(self.chrome.show_debug, RichText::new("frame time").small())
            .on_hover_text("Show the frame-time debug line");
        if r.clicked() {
            self.chrome.show_debug = !self.chrome.show_debug;
        }
        if self.chrome.show_debug {
            ui.label(
                RichText::new(self.chrome.frames.summary())
                    .small()
                    .weak()
                    .monospace(),
            );
        }
    }

    /// The status bar left of the readout: devices, the run, GPU memory, background jobs and
    /// the latest message.
    pub(super) fn status_messages(&self, ui: &mut egui::Ui) {
        // Devices.
        match &self.panels.devices.inventory {
            Some(inv) => {
                let gpus: Vec<String> = inv
                    .gpus()
                    .map(|g| format!("{} {} free", g.label(), theme::bytes(g.free_bytes)))
                    .collect();
                let cpu = inv
                    .cpu()
                    .map(|c| format!("CPU {} free", theme::bytes(c.free_bytes)))
                    .unwrap_or_default();
                let text = if gpus.is_empty() {
                    format!("{cpu} · no GPU")
                } else {
                    format!("{cpu} · {}", gpus.join(" · "))
                };
                let max = ui.available_width() * 0.5;
                status_text(ui, RichText::new(text).small(), max);
            }
            None => {
                ui.label(RichText::new("looking for devices…").small().weak());
            }
        }
        ui.separator();
        let font_msg = crate::gui::fonts::missing_font_message(ui.ctx());
        let toast = self
            .chrome
            .toast
            .as_ref()
            .filter(|(_, at)| at.elapsed() < Duration::from_secs(6))
            .map(|(msg, _)| msg);
        // The run: a long status leaves room for a message after it.
        let r = &self.panels.run.live;
        let color = match r.phase {
            RunPhase::Running => theme::OK,
            RunPhase::Paused => theme::WARNING,
            RunPhase::Finished(tunestudio::train::FinishReason::Failed) => theme::ERROR,
            _ => ui.visuals().text_color(),
        };
        let share = if font_msg.is_some() || toast.is_some() {
            0.5
        } else {
            1.0
        };
        let max = ui.available_width() * share;
        status_text(ui, RichText::new(run_status(r)).small().color(color), max);
        // Each GPU's memory as the run last measured it.
        for (device, series) in r.memory.iter().filter(|(d, _)| d.starts_with("cuda")) {
            let Some(used) = series.used.last().map(|p| p[1]) else {
                continue;
            };
            let total = series
                .total_bytes
                .map(|t| format!(" / {:.1}", theme::gib(t)))
                .unwrap_or_default();
            ui.separator();
            ui.label(RichText::new(format!("{device} {used:.1}{total} GiB")).small());
        }
        let busy = self.jobs.in_flight();
        if busy > 0 {
            ui.separator();
            ui.add(egui::Spinner::new().size(12.0));
            ui.label(
                RichText::new(format!("{busy} background job(s)"))
                    .small()
                    .weak(),
            );
        }
        // Said once, in one place: the first character drawn without a font names it.
        if let Some(msg) = font_msg {
            ui.separator();
            let max = ui.available_width() * if toast.is_some() { 0.5 } else { 1.0 };
            status_text(ui, RichText::new(msg).small().color(theme::WARNING), max);
        }
        if let Some(msg) = toast {
            ui.separator();
            let max = ui.available_width();
            status_text(ui, RichText::new(msg).small().color(theme::ACCENT), max);
        }
    }

    pub(super) fn navigation(&mut self, ui: &mut egui::Ui) {
        ui.add_space(8.0);
        ui.label(
            RichText::new("tunestudio")
                .size(20.0)
                .strong()
                .color(theme::ACCENT),
        );
        ui.label(RichText::new("fine-tuning studio").small().weak());
        ui.add_space(12.0);
        for (i, p) in Panel::ALL.iter().enumerate() {
            let badge = self.nav_badge(*p);
            let selected = self.session.panel == *p;
            let text = RichText::new(format!("{}  {}", i + 1, p.title())).size(15.0);
            ui.horizontal(|ui| {
                let r = ui.add(
                    // The grow atom pushes the title to the left edge.
                    egui::Button::selectable(selected, (text, egui::Atom::grow()))
                        .min_size(egui::vec2(150.0, 28.0)),
                );
                if r.clicked() {
                    self.session.panel = *p;
                }
                if let Some((color, tip)) = badge {
                    let (rect, resp) =
                        ui.allocate_exact_size(egui::vec2(10.0, 10.0), egui::Sense::hover());
                    ui.painter().circle_filled(rect.center(), 4.0, color);
                    resp.on_hover_text(tip);
                }
            });
        }
        ui.add_space(16.0);
        ui.separator();
        if let Some(p) = &self.session.config_path {
            ui.label(RichText::new("Run config").small().weak());
            ui.add(egui::Label::new(RichText::new(p.display().to_string()).small()).wrap());
        }
        if !self.session.config_problems.is_empty() {
            ui.label(
                RichText::new(format!(
                    "{} config problem(s)",
                    self.session.config_problems.len()
                ))
                .small()
                .color(theme::WARNING),
            )
            .on_hover_text(self.session.config_problems.join("\n"));
        }
        ui.add_space(6.0);
        if ui
            .button("Load demo project")
            .on_hover_text(
                "The bundled tiny model, tokenizer and dataset: trains offline in about a minute",
            )
            .clicked()
        {
            self.actions.push(Action::LoadDemo);
        }
    }

    /// A status dot for a navigation entry.
    pub(super) fn nav_badge(&self, p: Panel) -> Option<(Color32, String)> {
        let s = &self.panels;
        match p {
            Panel::Model => {
                if s.model.error.is_some() {
                    Some((theme::ERROR, "the model could not be loaded".into()))
                } else if s.model.info.is_some() {
                    Some((theme::OK, "model ready".into()))
                } else {
                    None
                }
            }
            Panel::Dataset => {
                if s.dataset.error.is_some() {
                    Some((theme::ERROR, "the dataset could not be read".into()))
                } else {
                    s.dataset
                        .summary
                        .as_ref()
                        .map(|d| (theme::OK, format!("{} rows", d.num_rows)))
                }
            }
            Panel::Preview => s
                .preview
                .preview
                .as_ref()
                .map(|p| p.lints.as_slice())
                .or_else(|| s.preview.pairs.preview().map(|p| p.lints.as_slice()))
                .map(|lints| {
                    if tunestudio::data::has_errors(lints) {
                        (theme::ERROR, "the dataset has error-level lints".into())
                    } else if !lints.is_empty() {
                        (theme::WARNING, format!("{} lint(s)", lints.len()))
                    } else {
                        (theme::OK, "no lints".into())
                    }
                }),
            Panel::Devices => s.devices.plan.plan.as_ref().map(|p| match p.verdict {
                tunestudio::plan::Verdict::Fits => (theme::OK, "fits".into()),
                tunestudio::plan::Verdict::Tight => (theme::WARNING, "fits, tight".into()),
                tunestudio::plan::Verdict::OutOfMemory => (theme::ERROR, p.summary.clone()),
            }),
            Panel::Run => match s.run.live.phase {
                RunPhase::Running | RunPhase::Loading => Some((theme::OK, "training".into())),
                RunPhase::Paused => Some((theme::WARNING, "paused".into())),
                RunPhase::Finished(tunestudio::train::FinishReason::Failed) => {
                    Some((theme::ERROR, "the run failed".into()))
                }
                _ => None,
            },
            _ => None,
        }
    }
}

/// A status-bar text in at most `max_width`, cut short with "…" (the whole text on hover);
/// nothing when there is no room at all.
fn status_text(ui: &mut egui::Ui, text: RichText, max_width: f32) {
    if max_width < 16.0 {
        return;
    }
    ui.scope(|ui| {
        ui.set_max_width(max_width);
        ui.add(egui::Label::new(text).truncate());
    });
}

/// The status bar's line about the run.
fn run_status(r: &RunState) -> String {
    match r.phase {
        RunPhase::Idle => "no run".to_string(),
        RunPhase::Loading => format!("run: {}", r.status),
        RunPhase::Running | RunPhase::Paused => {
            let loss = r
                .loss
                .last()
                .map(|p| format!(" · loss {:.4}", p[1]))
                .unwrap_or_default();
            format!(
                "run: step {}/{}{loss} · {:.0} tok/s{}",
                r.step,
                r.total_steps,
                r.tokens_per_sec,
                if r.phase == RunPhase::Paused {
                    " · paused"
                } else {
                    ""
                }
            )
        }
        RunPhase::Finished(_) => format!("run: {}", r.status),
    }
}
