//! GPUs & memory: the devices found, which to train on and how, and the
//! planner's per-device memory prediction for the current settings — with
//! the verdict, ranked fixes, auto-fit and a measured dry run.

use eframe::egui::{self, Color32, RichText, Sense, Ui};

use tunestudio::devices::DeviceKind;
use tunestudio::plan::{DevicePlan, Plan, Verdict};

use crate::gui::app::Action;
use crate::gui::state::AppState;
use crate::gui::theme;

/// Draws the GPUs & memory panel.
pub fn show(ui: &mut Ui, s: &mut AppState, actions: &mut Vec<Action>) {
    theme::heading(
        ui,
        "GPUs & memory",
        "Choose where to train. The bars are the planner's prediction of each device's peak memory for the current settings.",
    );

    theme::section(ui, "Devices");
    theme::card(ui, |ui| device_list(ui, s, actions));

    theme::section(ui, "Memory plan");
    if let Some(e) = &s.plan.error {
        theme::error_box(ui, "No plan", e);
    }
    if s.model.info.is_none() {
        theme::note(ui, "Load a model to see the memory plan.");
        return;
    }
    let Some(plan) = s.plan.plan.clone() else {
        ui.horizontal(|ui| {
            ui.add(egui::Spinner::new());
            ui.label("planning…");
        });
        return;
    };
    verdict(ui, &plan);
    ui.add_space(6.0);
    for d in &plan.per_device {
        device_bar(ui, d);
        ui.add_space(6.0);
    }
    legend(ui);
    ui.label(
        RichText::new(format!(
            "{} · {} parameters, {} trained · effective batch {}",
            plan.settings,
            theme::params(plan.parameters),
            theme::params(plan.trainable_parameters),
            plan.effective_batch
        ))
        .small()
        .weak(),
    );

    ui.add_space(8.0);
    ui.horizontal(|ui| {
        let r = ui
            .add_enabled(!s.plan.autofit_running, egui::Button::new("Auto-fit"))
            .on_hover_text(
                "Search precision, checkpointing, micro-batch, strategy and (last) LoRA for the fastest settings that fit \
                 every device with 5 % headroom, keeping the effective batch — and apply them.",
            );
        if r.clicked() {
            actions.push(Action::AutoFit);
        }
        let r = ui
            .add_enabled(!s.plan.dry_run_running && !s.run.is_active(), egui::Button::new("Dry run"))
            .on_hover_text("Load everything and run one real training step, measuring its memory against the prediction.");
        if r.clicked() {
            actions.push(Action::DryRun);
        }
        if s.plan.autofit_running || s.plan.dry_run_running {
            ui.add(egui::Spinner::new());
        }
    });
    if !s.plan.autofit_applied.is_empty() {
        theme::card(ui, |ui| {
            ui.label(RichText::new("Auto-fit applied").strong().color(theme::OK));
            for c in &s.plan.autofit_applied {
                ui.label(format!("• {c}"));
            }
        });
    }
    if let Some(r) = &s.plan.dry_run {
        theme::card(ui, |ui| {
            let color = if r.ok() { theme::OK } else { theme::ERROR };
            ui.label(RichText::new("Dry run").strong().color(color));
            ui.add(egui::Label::new(&r.summary).wrap());
        });
    }

    if !plan.fixes.is_empty() {
        theme::section(ui, "Fixes, best first");
        fixes(ui, &plan, actions);
    }

    egui::CollapsingHeader::new("Memory per block").show(ui, |ui| {
        egui::Grid::new("per-layer")
            .num_columns(6)
            .striped(true)
            .show(ui, |ui| {
                for h in [
                    "block",
                    "weights",
                    "gradients",
                    "optimizer",
                    "activations",
                    "total",
                ] {
                    ui.label(RichText::new(h).weak());
                }
                ui.end_row();
                for l in &plan.per_layer {
                    ui.label(&l.name);
                    ui.label(theme::bytes(l.weights_bytes + l.master_weights_bytes));
                    ui.label(theme::bytes(l.gradients_bytes));
                    ui.label(theme::bytes(l.optimizer_states_bytes));
                    ui.label(theme::bytes(l.activations_bytes));
                    ui.label(theme::bytes(l.total_bytes()));
                    ui.end_row();
                }
            });
    });
}

fn device_list(ui: &mut Ui, s: &mut AppState, actions: &mut Vec<Action>) {
    let Some(inv) = s.devices.inventory.clone() else {
        ui.horizontal(|ui| {
            ui.add(egui::Spinner::new());
            ui.label("looking for devices…");
        });
        return;
    };
    egui::Grid::new("devices")
        .num_columns(6)
        .spacing([16.0, 6.0])
        .striped(true)
        .show(ui, |ui| {
            for h in ["use", "device", "total", "free", "other processes", "load"] {
                ui.label(RichText::new(h).weak());
            }
            ui.end_row();
            for d in &inv.devices {
                let label = match d.kind {
                    DeviceKind::Cpu => "cpu".to_string(),
                    DeviceKind::Cuda => format!("cuda:{}", d.cuda_ordinal.unwrap_or(d.index)),
                };
                let mut on = s.config.devices.devices.contains(&label);
                let r = ui
                    .checkbox(&mut on, format!("{} ({label})", d.name))
                    .on_hover_text("Train on this device");
                if r.changed() {
                    if on {
                        s.config.devices.devices.push(label.clone());
                        // The CPU and GPUs are not mixed in one run.
                        let gpu = d.kind == DeviceKind::Cuda;
                        s.config
                            .devices
                            .devices
                            .retain(|l| (l == "cpu") != gpu || *l == label);
                    } else {
                        s.config.devices.devices.retain(|l| *l != label);
                    }
                    if s.config.devices.devices.len() <= 1 {
                        s.config.devices.strategy = "single".into();
                    }
                }
                ui.label(match d.kind {
                    DeviceKind::Cpu => format!("{} cores", d.cores.unwrap_or(0)),
                    DeviceKind::Cuda => d.uuid.clone().unwrap_or_default(),
                });
                ui.label(theme::bytes(d.total_bytes));
                ui.label(theme::bytes(d.free_bytes));
                let others: Vec<String> = d
                    .processes
                    .iter()
                    .filter(|p| !p.is_self)
                    .map(|p| {
                        format!(
                            "pid {} ({})",
                            p.pid,
                            p.used_bytes.map_or("?".into(), theme::bytes)
                        )
                    })
                    .collect();
                ui.label(if others.is_empty() {
                    "none".to_string()
                } else {
                    others.join(", ")
                });
                ui.label(
                    d.utilization_percent
                        .map_or("–".to_string(), |u| format!("{u} %")),
                );
                ui.end_row();
            }
        });
    for n in &inv.notes {
        theme::note(ui, n);
    }
    ui.add_space(4.0);
    egui::Grid::new("strategy").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
        let mut strat = s.config.devices.strategy.clone();
        let choices: [(&str, &str); 3] = [
            ("single", "single device"),
            ("layer-split", "layer split (pipeline)"),
            ("data-parallel", "data parallel"),
        ];
        let l = ui.label("Strategy").on_hover_text(
            "single: everything on the first device. layer split: consecutive layers on each device (fits bigger models, \
             one device busy at a time). data parallel: a full copy per device, each on its own micro-batch (faster, \
             needs the model to fit on each).",
        );
        egui::ComboBox::from_id_salt("strategy-combo")
            .selected_text(choices.iter().find(|c| c.0 == strat).map_or(strat.as_str(), |c| c.1).to_string())
            .show_ui(ui, |ui| {
                for (v, name) in choices {
                    ui.selectable_value(&mut strat, v.to_string(), name);
                }
            })
            .response
            .labelled_by(l.id);
        ui.end_row();
        if strat != s.config.devices.strategy {
            s.config.devices.strategy = strat;
        }
    });
    if ui.small_button("Refresh devices").clicked() {
        actions.push(Action::RefreshDevices);
    }
}

fn verdict(ui: &mut Ui, plan: &Plan) {
    let (color, word) = match plan.verdict {
        Verdict::Fits => (theme::OK, "Fits"),
        Verdict::Tight => (theme::WARNING, "Fits, but tight"),
        Verdict::OutOfMemory => (theme::ERROR, "Does not fit"),
    };
    egui::Frame::new()
        .fill(color.gamma_multiply(0.12))
        .stroke(egui::Stroke::new(1.0, color))
        .inner_margin(10.0)
        .corner_radius(6.0)
        .show(ui, |ui| {
            ui.set_min_width(ui.available_width());
            ui.label(RichText::new(word).size(18.0).strong().color(color));
            ui.add(egui::Label::new(&plan.summary).wrap());
        });
}

/// Memory components in stacking order: (name, colour, bytes).
fn components(d: &DevicePlan) -> [(&'static str, Color32, u64); 8] {
    [
        ("weights", theme::MEM_WEIGHTS, d.weights_bytes),
        ("master weights", theme::MEM_MASTER, d.master_weights_bytes),
        ("gradients", theme::MEM_GRADIENTS, d.gradients_bytes),
        ("optimizer", theme::MEM_OPTIMIZER, d.optimizer_states_bytes),
        ("activations", theme::MEM_ACTIVATIONS, d.activations_bytes),
        ("logits & loss", theme::MEM_LOGITS, d.logits_and_loss_bytes),
        ("temporaries", theme::MEM_TEMPORARIES, d.temporaries_bytes),
        ("overhead", theme::MEM_OVERHEAD, d.overhead_bytes),
    ]
}

fn device_bar(ui: &mut Ui, d: &DevicePlan) {
    let cap = d.device.capacity_bytes.max(1);
    ui.horizontal(|ui| {
        ui.label(RichText::new(&d.device.name).strong());
        let color = if d.fits { theme::OK } else { theme::ERROR };
        ui.label(
            RichText::new(format!(
                "peak {} of {} ({}) at the {}",
                theme::bytes(d.peak_bytes),
                theme::bytes(cap),
                if d.fits {
                    format!("{} free", theme::bytes(d.headroom_bytes))
                } else {
                    format!("{} short", theme::bytes(d.shortfall_bytes))
                },
                d.peak_phase
            ))
            .color(color),
        );
        if d.layers.end > d.layers.start {
            ui.label(
                RichText::new(format!("layers {}–{}", d.layers.start, d.layers.end - 1)).weak(),
            );
        }
    });
    // The scale covers the capacity or the peak, whichever is larger, so an overflow shows.
    let scale = cap.max(d.peak_bytes) as f32;
    let width = ui.available_width().max(200.0);
    let (rect, response) = ui.allocate_exact_size(egui::vec2(width, 26.0), Sense::hover());
    let painter = ui.painter_at(rect);
    painter.rect_filled(rect, 4.0, ui.visuals().extreme_bg_color);
    let mut x = rect.left();
    let mut hovered = None;
    for (name, color, b) in components(d) {
        if b == 0 {
            continue;
        }
        let w = rect.width() * b as f32 / scale;
        let seg =
            egui::Rect::from_min_size(egui::pos2(x, rect.top()), egui::vec2(w, rect.height()));
        painter.rect_filled(seg, 0.0, color);
        if response.hover_pos().is_some_and(|p| seg.contains(p)) {
            hovered = Some((name, b));
        }
        x += w;
    }
    let cap_x = rect.left() + rect.width() * cap as f32 / scale;
    painter.line_segment(
        [
            egui::pos2(cap_x, rect.top() - 2.0),
            egui::pos2(cap_x, rect.bottom() + 2.0),
        ],
        egui::Stroke::new(2.0, if d.fits { Color32::WHITE } else { theme::ERROR }),
    );
    let summary = components(d)
        .iter()
        .filter(|c| c.2 > 0)
        .map(|(n, _, b)| format!("{n} {}", theme::bytes(*b)))
        .collect::<Vec<_>>()
        .join(", ");
    let name = d.device.name.clone();
    response.widget_info(|| {
        egui::WidgetInfo::labeled(
            egui::Role::Label,
            true,
            format!("memory of {name}: {summary}"),
        )
    });
    response.on_hover_ui(|ui| {
        if let Some((n, b)) = hovered {
            ui.label(RichText::new(format!("{n}: {}", theme::bytes(b))).strong());
        }
        for (n, c, b) in components(d) {
            if b > 0 {
                theme::legend_item(ui, c, &format!("{n}: {}", theme::bytes(b)));
            }
        }
        ui.label(format!("capacity: {}", theme::bytes(cap)));
    });
}

fn legend(ui: &mut Ui) {
    ui.horizontal_wrapped(|ui| {
        for (n, c) in [
            ("weights", theme::MEM_WEIGHTS),
            ("master weights", theme::MEM_MASTER),
            ("gradients", theme::MEM_GRADIENTS),
            ("optimizer", theme::MEM_OPTIMIZER),
            ("activations", theme::MEM_ACTIVATIONS),
            ("logits & loss", theme::MEM_LOGITS),
            ("temporaries", theme::MEM_TEMPORARIES),
            ("overhead", theme::MEM_OVERHEAD),
        ] {
            theme::legend_item(ui, c, n);
        }
        ui.label(RichText::new("| = capacity").small().weak());
    });
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
