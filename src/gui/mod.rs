//! The desktop studio (eframe), a thin layer over the library.
//!
//! ```text
//! panels (own state + view, queue Actions) ──▶ app (runs actions) ──▶ jobs / trainer threads
//!        ▲                                                                 │
//!        └──── app routes to the panel ◀── JobOutput / trainer Event ◀─────┘ (+ request_repaint)
//! ```
//!
//! The run config ([`tunestudio::train::RunConfig`], in the [`session::Session`]) is the
//! single source of truth: every panel edits it, background jobs re-plan and re-preview
//! when the parts they depend on change (the keys in `app/schedule.rs`), and Export saves it
//! as the TOML that `tunestudio train --config` runs headless.

pub mod action;
pub mod app;
pub mod disk;
pub mod error;
pub mod file_picker;
pub mod follow;
pub mod fonts;
pub mod frame_stats;
pub mod jobs;
pub mod panels;
pub mod planned;
pub mod playground;
pub mod reducer;
pub mod run_state;
pub mod session;
pub mod shared;
pub mod text;
pub mod theme;
pub mod widgets;

#[cfg(test)]
mod tests;

use app::{StartOptions, StudioApp};
use eframe::egui;

/// Opens the studio window and runs until it is closed.
///
/// `TUNESTUDIO_SCREENSHOT=out.png` (with `TUNESTUDIO_SCREENSHOT_PANEL=preview`,
/// optionally `TUNESTUDIO_SCREENSHOT_TRAIN_STEPS=30`) renders the real window,
/// saves a screenshot and exits.
pub fn run_native() -> anyhow::Result<()> {
    let opts = StartOptions::from_env();
    let screenshot = opts.screenshot.is_some();
    let mut viewport = egui::ViewportBuilder::default()
        .with_title("tunestudio")
        .with_inner_size([1360.0, 860.0])
        .with_min_inner_size([900.0, 600.0]);
    if screenshot {
        // A fixed size so screenshots are comparable.
        viewport = viewport
            .with_inner_size([1360.0, 860.0])
            .with_resizable(false);
    }
    let native = eframe::NativeOptions {
        viewport,
        persist_window: !screenshot,
        ..Default::default()
    };
    eframe::run_native(
        "tunestudio",
        native,
        Box::new(move |cc| Ok(Box::new(StudioApp::new(cc, opts)))),
    )
    .map_err(|e| anyhow::anyhow!("the studio window could not be opened: {e}"))
}
