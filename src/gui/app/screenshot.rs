//! Screenshot mode (`TUNESTUDIO_SCREENSHOT=out.png`): drives the real window to the panel
//! asked for (optionally training a few steps or opening a file dialog first), saves a PNG
//! and closes.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eframe::egui;

use tunestudio::train::Command;

use super::{Action, StudioApp};
use crate::gui::jobs::PickTarget;
use crate::gui::run_state::RunPhase;

impl StudioApp {
    pub(super) fn drive_screenshot(&mut self) {
        let Some(shot) = &mut self.screenshot else {
            return;
        };
        if shot.saved {
            return;
        }
        let image = shot.image.lock().ok().and_then(|mut g| g.take());
        if let Some(img) = image {
            let r = save_png(&shot.path, &img);
            match r {
                Ok(()) => eprintln!("screenshot saved to {}", shot.path.display()),
                Err(e) => eprintln!("error: cannot save the screenshot: {e}"),
            }
            // The Run chart's figures as the caption under it shows them, in bytes, for a
            // script (or test) that compares the studio's measured peak with its plan.
            for (device, series) in &self.panels.run.live.memory {
                eprintln!(
                    "run chart: {device} peak_bytes={} predicted_peak_bytes={}",
                    series.peak_bytes,
                    series
                        .predicted_peak_bytes
                        .map_or_else(|| "none".to_string(), |p| p.to_string())
                );
            }
            shot.saved = true;
            if let Some(h) = &self.trainer {
                let _ = h.send(Command::Stop);
            }
            self.ctx.send_viewport_cmd(egui::ViewportCommand::Close);
            return;
        }
        if shot.requested {
            self.ctx.request_repaint_after(Duration::from_millis(50));
            return;
        }
        let elapsed = shot.started.elapsed();
        // Start the demo once the background jobs are done and the plan is of the current
        // settings, so the memory chart has the predicted peak a user sees (with the Preview
        // scan's trained tokens, not the every-position bound planned before the scan ends).
        let scanned = plan_has_the_scan(&self.session, &self.panels, elapsed);
        if shot.train_steps.is_some()
            && self.panels.run.live.phase == RunPhase::Idle
            && scanned
            && self.jobs.in_flight() == 0
            && !self.panels.devices.plan.loading
            && self.panels.devices.plan.plan.is_some()
            && self.panels.devices.plan.key == super::plan_key(&self.session, &self.panels)
        {
            self.actions.push(Action::Start);
            self.ctx.request_repaint();
            return;
        }
        let jobs_done = self.jobs.in_flight() == 0;
        if jobs_done && self.frame_count > 8 {
            if let Some(target) = shot.pick.take() {
                shot.picked_at_frame = Some(self.frame_count);
                self.actions.push(Action::Pick(target));
                self.ctx.request_repaint();
                return;
            }
        }
        // Once its first listing (a job) has come back.
        let listed = self.chrome.picker.as_ref().filter(|(_, p)| !p.is_listing());
        if let Some((_, p)) = listed {
            if !self.chrome.picker_noted_on_stderr {
                self.chrome.picker_noted_on_stderr = true;
                let why = self.chrome.system_dialog.clone().err().unwrap_or_default();
                eprintln!(
                    "file dialog: the built-in picker ({why}), showing {}",
                    p.dir().display()
                );
            }
        }
        let steps_done = match shot.train_steps {
            None => true,
            Some(n) => {
                self.panels.run.live.step >= n
                    || matches!(self.panels.run.live.phase, RunPhase::Finished(_))
            }
        };
        // Let a few frames settle layout (egui sizes some widgets on the first pass).
        let picker_drawn = shot
            .picked_at_frame
            .is_none_or(|f| self.frame_count > f + 4);
        let ready = jobs_done
            && steps_done
            && picker_drawn
            && self.frame_count > 8
            && elapsed > Duration::from_millis(800);
        if ready || elapsed > Duration::from_secs(180) {
            if shot.train_steps.is_some() {
                if let Some(h) = &self.trainer {
                    let _ = h.send(Command::Pause);
                }
            }
            shot.requested = true;
            let slot = Arc::clone(&shot.image);
            let ctx = self.ctx.clone();
            self.ctx.request_screenshot(move |img| {
                if let Ok(mut g) = slot.lock() {
                    *g = Some(img);
                }
                ctx.request_repaint();
            });
        } else {
            self.ctx.request_repaint_after(Duration::from_millis(100));
        }
    }
}

/// The screenshot mode's progress.
pub(super) struct Screenshot {
    pub(super) path: PathBuf,
    pub(super) train_steps: Option<u64>,
    /// Press this "Browse…" first (`TUNESTUDIO_SCREENSHOT_PICK`), to show the file dialog.
    pub(super) pick: Option<PickTarget>,
    /// The frame the picker was asked for: a new egui window is invisible on its first
    /// (sizing) pass, so the screenshot waits a few frames after it.
    pub(super) picked_at_frame: Option<u64>,
    pub(super) started: Instant,
    pub(super) requested: bool,
    pub(super) image: Arc<Mutex<Option<Arc<egui::ColorImage>>>>,
    pub(super) saved: bool,
}

/// Writes an egui image as PNG.
pub fn save_png(path: &Path, img: &egui::ColorImage) -> Result<(), String> {
    let [w, h] = img.size;
    let mut raw = Vec::with_capacity(w * h * 4);
    for p in &img.pixels {
        raw.extend_from_slice(&p.to_srgba_unmultiplied());
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    image::save_buffer(path, &raw, w as u32, h as u32, image::ColorType::Rgba8)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether the plan is the one a user sees once the Preview has scanned the data: a
/// loaded config's scan starts a frame after the config arrives, so "no job in flight"
/// alone can fall between the two (seen under load: the demo run started on the
/// every-position plan, +24 % over its peak). An SFT or preference plan waits for the
/// scan's trained tokens, 20 s at most (packing never has them).
fn plan_has_the_scan(
    session: &crate::gui::session::Session,
    panels: &crate::gui::panels::Panels,
    elapsed: Duration,
) -> bool {
    super::plan_key(session, panels)
        .is_some_and(|k| k.trained_tokens.is_some() || k.config.training.method.is_grpo())
        || elapsed > Duration::from_secs(20)
}
