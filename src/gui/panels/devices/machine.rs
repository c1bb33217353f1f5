//! The GPUs & memory panel's planned machine: planning for GPUs this machine does not have,
//! and the question a config made for other GPUs asks.

use eframe::egui::{self, RichText, Ui};

use tunestudio::plan::GPU_CATALOG;
use tunestudio::train::RunConfig;

use crate::gui::planned::{PlannedMachine, GPU_COUNTS};
use crate::gui::session::Session;
use crate::gui::theme;

use super::{DevicesPanel, CUSTOM};

/// The planned machine's GPU count and model (or custom size).
pub(super) fn planned_machine(ui: &mut Ui, dv: &mut DevicesPanel, s: &mut Session) {
    let draft = dv.planner.clone();
    let mut count = draft.count;
    let mut model = draft.model;
    let mut custom = draft.custom_size.clone();
    let mixed = s.planned_machine().filter(|m| m.uniform().is_none());
    egui::Grid::new("planned-machine")
        .num_columns(2)
        .spacing([12.0, 8.0])
        .show(ui, |ui| {
            let l = ui.label("GPUs");
            egui::ComboBox::from_id_salt("planned-count")
                .selected_text(gpu_count_text(count))
                .show_ui(ui, |ui| {
                    for n in GPU_COUNTS {
                        ui.selectable_value(&mut count, n, gpu_count_text(n));
                    }
                })
                .response
                .labelled_by(l.id);
            ui.end_row();

            let l = ui.label("GPU model").on_hover_text(
                "Memory as the vendor sells it and as the driver reports it; the plan uses the driver's figure.",
            );
            let shown = match (&mixed, model) {
                (Some(_), _) => "as the config lists them".to_string(),
                (None, Some(m)) => m.name.to_string(),
                (None, None) => CUSTOM.to_string(),
            };
            // Tall enough for the whole catalogue without scrolling.
            egui::ComboBox::from_id_salt("planned-model")
                .selected_text(shown)
                .width(200.0)
                .height(400.0)
                .show_ui(ui, |ui| {
                    for m in &GPU_CATALOG {
                        ui.selectable_value(&mut model, Some(m), m.name)
                            .on_hover_text(m.memory_summary());
                    }
                    ui.selectable_value(&mut model, None, CUSTOM);
                })
                .response
                .labelled_by(l.id);
            ui.end_row();

            if model.is_none() {
                theme::text_row(
                    ui,
                    "Memory per GPU",
                    "Each GPU's total memory as the driver reports it, e.g. 80GiB, 81559MiB or 24GB",
                    &mut custom,
                    "80GiB",
                );
            }
        });
    match (&mixed, model) {
        (Some(m), _) => theme::note(ui, &format!("The config plans for {}.", m.describe())),
        (None, Some(m)) => theme::note(ui, &format!("{}: {}.", m.name, m.memory_summary())),
        (None, None) => {}
    }
    let changed = count != draft.count || model != draft.model || custom != draft.custom_size;
    if changed {
        let p = &mut dv.planner;
        p.count = count;
        p.model = model;
        p.custom_size = custom;
        // A size that does not read leaves the config on the last machine that did.
        let _ = dv.plan_for_draft(&mut s.config);
    }
    if let Err(e) = dv.planner.size_text() {
        ui.label(RichText::new(format!("Memory per GPU: {e}")).color(theme::ERROR));
    }
}
fn gpu_count_text(n: usize) -> String {
    if n == 1 {
        "1 GPU".into()
    } else {
        format!("{n} GPUs")
    }
}
/// When the config plans for GPUs this machine has not, shows both and asks which to use.
pub(super) fn which_machine_question(ui: &mut Ui, dv: &mut DevicesPanel, s: &mut Session) {
    let Some(m) = s.planned_machine() else {
        return;
    };
    let Some(inv) = dv.inventory.as_ref().filter(|i| i.has_gpu()) else {
        return;
    };
    let entries = s.config.devices.devices.clone();
    if m.runs_on(Some(inv)) || dv.planner.keep_planned_for.as_ref() == Some(&entries) {
        return;
    }
    let real: Vec<String> = inv
        .gpus()
        .map(|g| format!("{} ({})", g.name, theme::bytes(g.total_bytes)))
        .collect();
    let planned = m.describe();
    let mut keep = false;
    let mut use_real = false;
    theme::card(ui, |ui| {
        ui.label(
            RichText::new("Which machine?")
                .strong()
                .color(theme::WARNING),
        );
        ui.add(
            egui::Label::new(format!(
                "The config plans for {planned}; this machine has {}. Plan for the config's machine \
                 (planning only here), or for this machine's GPUs (and train here)?",
                real.join(", ")
            ))
            .wrap(),
        );
        ui.horizontal(|ui| {
            keep = ui.button(format!("Keep planning for {planned}")).clicked();
            use_real = ui.button("Use this machine's GPUs").clicked();
        });
    });
    if keep {
        dv.planner.keep_planned_for = Some(entries);
    } else if use_real {
        let gpus = dv.real_gpu_entries(m.gpus.len());
        dv.planner.real_selection = None;
        dv.set_device_entries(&mut s.config, gpus);
    }
}

impl DevicesPanel {
    /// Switches the config to the draft's planned machine (remembering this machine's
    /// selection), or to an error when the custom size does not parse.
    pub fn plan_for_draft(&mut self, config: &mut RunConfig) -> Result<(), String> {
        let size = self.planner.size_text()?;
        let current = &config.devices.devices;
        if PlannedMachine::from_entries(current).is_none() {
            self.planner.real_selection = Some(current.clone());
        }
        let entries = PlannedMachine::entries(self.planner.count, &size);
        self.set_device_entries(config, entries);
        Ok(())
    }

    /// Switches the config back to this machine's devices: the selection from before
    /// planning, else every GPU found, else the CPU.
    pub fn plan_for_this_machine(&mut self, config: &mut RunConfig) {
        let restored = self
            .planner
            .real_selection
            .take()
            .filter(|s| !s.is_empty() && PlannedMachine::from_entries(s).is_none());
        let entries = restored.unwrap_or_else(|| self.real_gpu_entries(usize::MAX));
        self.set_device_entries(config, entries);
    }

    /// `cuda:N` for up to `max` of this machine's GPUs, else `cpu`.
    pub fn real_gpu_entries(&self, max: usize) -> Vec<String> {
        let gpus: Vec<String> = self
            .inventory
            .as_ref()
            .map(|inv| {
                inv.gpus()
                    .map(|g| format!("cuda:{}", g.cuda_ordinal.unwrap_or(g.index)))
                    .take(max)
                    .collect()
            })
            .unwrap_or_default();
        if gpus.is_empty() {
            vec!["cpu".into()]
        } else {
            gpus
        }
    }

    /// Writes the device entries; one device means the single strategy.
    pub fn set_device_entries(&mut self, config: &mut RunConfig, entries: Vec<String>) {
        if entries.len() <= 1 {
            config.devices.strategy = tunestudio::settings::Strategy::Single;
        }
        config.devices.devices = entries;
        self.planner.sync_from(&config.devices.devices);
    }
}
