//! The Run panel's past runs: runs read back from their output folders, overlaid on the
//! loss chart.

use eframe::egui::{self, RichText, Ui};

use tunestudio::train::FinishReason;

use super::RunPanel;
use crate::gui::action::Action;
use crate::gui::jobs::PickTarget;
use crate::gui::theme;

use crate::gui::shared::HistoryRun;

/// The run history.
#[derive(Debug, Default)]
pub struct HistoryState {
    /// Runs found.
    pub runs: Vec<HistoryRun>,
    /// Runs overlaid on the loss chart (indices into `runs`).
    pub overlay: Vec<usize>,
    /// Scan in flight.
    pub loading: bool,
    /// Problems reading runs.
    pub error: Option<String>,
}

pub(super) fn history(ui: &mut Ui, rp: &mut RunPanel, actions: &mut Vec<Action>) {
    ui.horizontal(|ui| {
        if ui
            .small_button("Refresh")
            .on_hover_text("Re-read metrics.jsonl of known runs")
            .clicked()
        {
            actions.push(Action::RefreshHistory);
        }
        if ui.small_button("Add run folder…").clicked() {
            actions.push(Action::Pick(PickTarget::RunDir));
        }
        if rp.history.loading {
            ui.add(egui::Spinner::new().size(12.0));
        }
    });
    if rp.history.runs.is_empty() {
        theme::note(
            ui,
            "No finished runs found yet (runs are read from their output folders' metrics.jsonl).",
        );
        return;
    }
    ui.label(
        RichText::new("Tick runs to overlay their curves on the loss chart.")
            .small()
            .weak(),
    );
    for (i, h) in rp.history.runs.iter().enumerate() {
        let mut on = rp.history.overlay.contains(&i);
        let last = h
            .curves
            .loss
            .last()
            .map(|p| format!("loss {:.4}", p.1))
            .unwrap_or_default();
        let eval = h
            .curves
            .eval_loss
            .last()
            .map(|p| format!(" · eval {:.4}", p.1))
            .unwrap_or_default();
        let status = match h.finished {
            Some(FinishReason::Completed) => "completed",
            Some(FinishReason::Stopped) => "stopped",
            Some(FinishReason::Failed) => "failed",
            Some(FinishReason::Diverged) => "diverged",
            None => "unfinished",
        };
        let r = ui
            .checkbox(
                &mut on,
                format!(
                    "{} — {} steps, {last}{eval}, {status}",
                    h.name(),
                    h.curves.loss.len()
                ),
            )
            .on_hover_text(h.dir.display().to_string());
        if r.changed() {
            if on {
                rp.history.overlay.push(i);
            } else {
                rp.history.overlay.retain(|&x| x != i);
            }
        }
    }
    if let Some(e) = &rp.history.error {
        theme::note(ui, e);
    }
}
