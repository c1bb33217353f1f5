//! File choosing: the system dialog when the session has one, else the in-app picker.

use eframe::egui;

use super::PickFor;
use super::StudioApp;
use crate::gui::file_picker::{FolderListing, PickKind, PickerOutcome};
use crate::gui::jobs::{JobOutput, PickTarget};
use crate::gui::playground::{self, PgPick};
use crate::gui::session::dialog_dirs;

impl StudioApp {
    pub(super) fn pick(&mut self, target: PickTarget) {
        let base = self.session.config.base_dir.clone();
        // Where to start, best first; the dialog's job or the picker's listing takes the
        // first that is a folder (no look here, on the UI thread).
        let starts = match target {
            PickTarget::ModelFolder => dialog_dirs(&self.panels.model.source_input, &base),
            PickTarget::DatasetFile | PickTarget::DatasetFolder => {
                dialog_dirs(&self.panels.dataset.path_input, &base)
            }
            PickTarget::Checkpoint | PickTarget::RunDir | PickTarget::OutputDir => {
                vec![self.session.output_dir()]
            }
            _ => Vec::new(),
        };
        if self.chrome.system_dialog.is_ok() {
            self.jobs.pick(target, starts);
        } else {
            let (title, kind) = pick_kind(target);
            let who = PickFor::Studio(target);
            self.chrome
                .open_picker(&self.session, who, title, kind, starts);
        }
    }

    /// A file dialog for the Playground: as [`StudioApp::pick`], starting in the run folder.
    pub(super) fn pick_for_playground(&mut self, target: PgPick) {
        let starts = vec![self.session.output_dir()];
        if self.chrome.system_dialog.is_ok() {
            playground::open_system_dialog(&self.jobs, target, starts);
        } else {
            let (title, kind) = playground::pick_kind(target);
            let who = PickFor::Playground(target);
            self.chrome
                .open_picker(&self.session, who, title, kind, starts);
        }
    }

    /// Hands the open picker's folder listing, if it wants one, to a job.
    pub(super) fn request_listing(&mut self) {
        if let Some(request) = self
            .chrome
            .picker
            .as_mut()
            .and_then(|(_, p)| p.take_request())
        {
            self.jobs.list_folder(request);
        }
    }

    /// A listing for the open picker (none: the picker was closed meanwhile).
    pub(super) fn listed(&mut self, listing: FolderListing) {
        if let Some((_, picker)) = self.chrome.picker.as_mut() {
            picker.listed(listing);
        }
    }

    /// Draws the in-app file picker when open; a choice goes where a system dialog's would.
    pub(super) fn show_picker(&mut self, ctx: &egui::Context) {
        let Some((who, picker)) = self.chrome.picker.as_mut() else {
            return;
        };
        let who = *who;
        let outcome = picker.show(ctx);
        self.request_listing();
        match outcome {
            PickerOutcome::Open => {}
            PickerOutcome::Cancelled => {
                self.chrome.picker = None;
                if let PickFor::Playground(p) = who {
                    if let Some(msg) = playground::picked(p, None) {
                        self.handle_job(JobOutput::Playground(msg));
                    }
                }
            }
            PickerOutcome::Chosen(path) => {
                self.chrome.picker = None;
                match who {
                    PickFor::Studio(target) => self.handle_job(JobOutput::Picked(target, path)),
                    PickFor::Playground(p) => {
                        if let Some(msg) = playground::picked(p, Some(path)) {
                            self.handle_job(JobOutput::Playground(msg));
                        }
                    }
                }
            }
        }
    }
}

/// The in-app picker's title and what it chooses, per studio field (as the system dialog's
/// filters in `Jobs::pick`).
fn pick_kind(target: PickTarget) -> (&'static str, PickKind) {
    match target {
        PickTarget::ModelFolder => ("Choose a model folder", PickKind::Folder),
        PickTarget::DatasetFolder => ("Choose a folder of data files", PickKind::Folder),
        PickTarget::OutputDir => ("Choose the output folder", PickKind::Folder),
        PickTarget::Checkpoint => ("Choose a checkpoint folder", PickKind::Folder),
        PickTarget::ExportDest => ("Choose where to export", PickKind::Folder),
        PickTarget::RunDir => ("Choose a run folder", PickKind::Folder),
        PickTarget::DatasetFile | PickTarget::ValidationFile => (
            "Choose a data file",
            PickKind::File(crate::gui::jobs::DATA_EXTENSIONS.to_vec()),
        ),
        PickTarget::ConfigOpen => ("Open a run config", PickKind::File(vec!["toml"])),
        PickTarget::ConfigSave => ("Save the run config", PickKind::Save(vec!["toml"])),
    }
}
