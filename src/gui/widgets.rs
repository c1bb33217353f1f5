//! Views more than one panel draws (a panel never imports another panel's module; what two
//! panels share lives here): the plan's ranked fixes and the "planning only" note.

use std::path::PathBuf;

use eframe::egui::{self, RichText, Ui};

use tunestudio::plan::Plan;

use crate::gui::action::Action;
use crate::gui::shared::PanelContext;
use crate::gui::theme;

/// When the config plans for a machine this one is not, draws "planning only" with the
/// `tunestudio train --config …` command to run on the target (and a button that saves
/// the config and copies it), and returns `true`: Start is then not offered.
pub fn planning_only_note(ui: &mut Ui, cx: &PanelContext, actions: &mut Vec<Action>) -> bool {
    let Some(cmd) = cx.planning_only.clone() else {
        return false;
    };
    ui.horizontal_wrapped(|ui| {
        ui.label(RichText::new("Planning only").strong().color(theme::WARNING))
            .on_hover_text("The config plans for another machine; train there.");
        ui.label(
            RichText::new(&cmd)
                .monospace()
                .background_color(ui.visuals().extreme_bg_color),
        );
        let r = ui
            .button("Save config & copy command")
            .on_hover_text("Saves the config where Export does and copies the command that trains it on the target");
        if r.clicked() {
            actions.push(Action::SaveConfig(PathBuf::from(&cx.train_config_path)));
            ui.ctx().copy_text(cmd.clone());
            actions.push(Action::Toast(
                "saved the config and copied the command for the target machine".into(),
            ));
        }
    });
    true
}

/// The plan's ranked fixes, each with an Apply button.
pub fn fixes(ui: &mut Ui, plan: &Plan, actions: &mut Vec<Action>) {
    for (i, f) in plan.fixes.iter().enumerate() {
        ui.horizontal(|ui| {
            ui.label(RichText::new(format!("{}.", i + 1)).weak());
            let r = ui
                .button("Apply")
                .on_hover_text(format!("Apply: {}", f.description));
            if r.clicked() {
                actions.push(Action::ApplyChange(f.change.clone()));
            }
            ui.add(egui::Label::new(&f.description).wrap());
            if f.fits_alone {
                ui.label(RichText::new("fits alone").color(theme::OK).small());
            }
            ui.label(
                RichText::new(format!("speed ×{:.2}", f.relative_throughput))
                    .small()
                    .weak(),
            );
        });
    }
}
