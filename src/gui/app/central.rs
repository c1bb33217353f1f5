//! The open panel: the app lends it the session and, read-only, what it shows of the other
//! panels' results ([`PanelContext`]); the panel queues [`Action`]s.

use eframe::egui;

use super::{Action, StudioApp};
use crate::gui::panels::Panels;
use crate::gui::session::Panel;
use crate::gui::shared::PanelContext;

impl StudioApp {
    /// Draws the open panel; returns what it asked for.
    pub(super) fn show_panel(&mut self, ui: &mut egui::Ui) -> Vec<Action> {
        let mut actions = Vec::new();
        let panel = self.session.panel;
        let mut cx: PanelContext<'_> = self.owned_context(panel);
        let s = &mut self.session;
        // Each panel is lent mutably; the others' results beside it, read-only.
        let Panels {
            model,
            dataset,
            preview,
            training,
            devices,
            run,
            export,
            playground,
        } = &mut self.panels;
        egui::ScrollArea::vertical()
            .id_salt(("panel", panel as u8))
            .auto_shrink([false, false])
            .show(ui, |ui| match panel {
                Panel::Model => model.show(ui, s, &mut actions),
                Panel::Dataset => dataset.show(ui, s, &mut actions),
                Panel::Preview => {
                    cx.model = model.info.as_ref();
                    cx.dataset = dataset.summary.as_ref();
                    preview.show(ui, s, &cx, &mut actions);
                }
                Panel::Training => training.show(ui, s, &cx, &mut actions),
                Panel::Devices => {
                    cx.model = model.info.as_ref();
                    devices.show(ui, s, &cx, &mut actions);
                }
                Panel::Run => {
                    cx.plan = devices.plan.plan.as_ref();
                    run.show(ui, s, &cx, &mut actions);
                }
                Panel::Export => {
                    cx.model = model.info.as_ref();
                    export.show(ui, s, &cx, &mut actions);
                }
                Panel::Playground => playground.show(ui, s, &cx, &mut actions),
            });
        actions
    }

    /// The owned part of what `panel` reads of the others' results this frame (what is
    /// computed from several panels: the lints, the planning note); the borrowed part is
    /// lent beside the panel in [`Self::show_panel`].
    fn owned_context(&self, panel: Panel) -> PanelContext<'static> {
        let p = &self.panels;
        let mut cx = PanelContext::default();
        match panel {
            Panel::Training => {
                let config = &self.session.config;
                let (model, preview) = (p.model.info.as_ref(), p.preview.preview.as_ref());
                cx.settings_lints = crate::gui::follow::settings_lints(config, model, preview);
            }
            Panel::Devices | Panel::Run => {
                cx.run_active = p.run.live.is_active();
                cx.planning_only = self.planning_only();
                cx.train_config_path = self.train_config_path();
                if panel == Panel::Run {
                    cx.blocking_lints = self.blocking_lints();
                }
            }
            Panel::Export | Panel::Playground => {
                cx.last_checkpoint = p.run.live.last_checkpoint.clone();
            }
            Panel::Model | Panel::Dataset | Panel::Preview => {}
        }
        cx
    }

    /// The error-level lints of the data (the preview's) and of the settings that
    /// `[data] allow` does not name: they stop a run, as they stop `tunestudio train`.
    pub fn blocking_lints(&self) -> Vec<tunestudio::data::Lint> {
        let config = &self.session.config;
        let preview = self.panels.preview.preview.as_ref();
        let mut lints = preview.map(|p| p.lints.clone()).unwrap_or_default();
        let model = self.panels.model.info.as_ref();
        lints.extend(crate::gui::follow::settings_lints(config, model, preview));
        tunestudio::data::lints::blocking(&lints, &config.data.allow)
            .into_iter()
            .cloned()
            .collect()
    }
}
