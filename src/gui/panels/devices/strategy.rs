//! The strategy choice of the GPUs & memory panel, and under sharded data parallel what the
//! ranks divide (`[devices] strategy` and `shard`).

use eframe::egui::{self, Ui};

use tunestudio::settings::{ShardMode, Strategy};

use crate::gui::session::Session;

/// The strategies in the order the menu lists them, with their names there.
const STRATEGIES: [(Strategy, &str); 4] = [
    (Strategy::Single, "single device"),
    (Strategy::LayerSplit, "layer split (pipeline)"),
    (Strategy::DataParallel, "data parallel"),
    (Strategy::Sharded, "sharded data parallel (ZeRO)"),
];

/// The shard modes with their names in the menu.
fn shard_choices() -> [(ShardMode, &'static str); 2] {
    ShardMode::ALL.map(|m| {
        let name = match m {
            ShardMode::GradientsAndOptimizer => "gradients and optimizer state (ZeRO-2)",
            ShardMode::Everything => "everything (ZeRO-3)",
        };
        (m, name)
    })
}

/// The strategy choice, for this machine's devices and a planned machine alike; under sharded
/// data parallel, the shard mode below it.
pub(super) fn strategy_row(ui: &mut Ui, s: &mut Session) {
    ui.add_space(4.0);
    egui::Grid::new("strategy")
        .num_columns(2)
        .spacing([12.0, 8.0])
        .show(ui, |ui| {
            let mut strat = s.config.devices.strategy;
            let l = ui.label("Strategy").on_hover_text(
                "single: everything on the first device. layer split: consecutive layers on each device (fits bigger \
                 models, one device busy at a time). data parallel: a full copy per device, each on its own micro-batch \
                 (faster, needs the model to fit on each). sharded data parallel: data parallel with the training state \
                 divided over the devices (DeepSpeed ZeRO, FSDP): nearly as fast, fits bigger models.",
            );
            let selected = STRATEGIES
                .iter()
                .find(|c| c.0 == strat)
                .map_or(strat.as_str(), |c| c.1);
            egui::ComboBox::from_id_salt("strategy-combo")
                .selected_text(selected)
                .show_ui(ui, |ui| {
                    for (v, name) in STRATEGIES {
                        ui.selectable_value(&mut strat, v, name);
                    }
                })
                .response
                .labelled_by(l.id);
            ui.end_row();
            if strat != s.config.devices.strategy {
                s.config.devices.strategy = strat;
            }
            if strat == Strategy::Sharded {
                let mut shard = s.config.devices.shard;
                crate::gui::theme::combo_row(
                    ui,
                    "shard-combo",
                    "Shard",
                    "What each device keeps only its share of. gradients and optimizer state (ZeRO-2): the \
                     accumulated gradients, fp32 master weights and AdamW state; the weights stay whole. everything \
                     (ZeRO-3): the weights too, gathered a layer at a time.",
                    &mut shard,
                    &shard_choices(),
                );
                if shard != s.config.devices.shard {
                    s.config.devices.shard = shard;
                }
            }
        });
}
