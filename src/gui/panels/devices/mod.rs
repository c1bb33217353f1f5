//! GPUs & memory: the devices found, which to train on and how, and the
//! planner's per-device memory prediction for the current settings — with
//! the verdict, ranked fixes, auto-fit and a measured dry run.

use eframe::egui::{self, Color32, RichText, Sense, Ui};

use tunestudio::devices::{DeviceInventory, DeviceKind};
use tunestudio::plan::{AutoFit, DevicePlan, DryRunReport, Plan, PlanRequest, Verdict};

use crate::gui::action::Action;
use crate::gui::error::JobError;
use crate::gui::session::Session;
use crate::gui::shared::{PanelContext, PlanKey};
use crate::gui::theme;

mod machine;
mod strategy;
use machine::{planned_machine, which_machine_question};
use strategy::strategy_row;

/// The memory plan for the current settings.
#[derive(Default)]
pub struct PlanState {
    /// The request planned.
    pub request: Option<PlanRequest>,
    /// The plan.
    pub plan: Option<Plan>,
    /// Why there is no plan.
    pub error: Option<JobError>,
    /// Whether a plan is being computed.
    pub loading: bool,
    /// Request sequence number.
    pub seq: u64,
    /// What the last request was made for (`plan_key`, in `gui/app/schedule.rs`); `None` before the first.
    pub key: Option<PlanKey>,
    /// The last auto-fit, with the settings it started from.
    pub autofit: Option<AutoFit>,
    /// Auto-fit in flight.
    pub autofit_running: bool,
    /// The last auto-fit's explanation after it was applied.
    pub autofit_applied: Vec<String>,
    /// The last dry run.
    pub dry_run: Option<DryRunReport>,
    /// Dry run in flight.
    pub dry_run_running: bool,
}

/// The GPUs & memory panel: the devices found, the machine being planned, and the memory
/// plan for the current settings (the app schedules it; Run and the status bar read it).
#[derive(Default)]
pub struct DevicesPanel {
    /// What discovery found.
    pub inventory: Option<DeviceInventory>,
    /// Discovery in flight.
    pub loading: bool,
    /// The machine being planned when it is not this one (see [`crate::gui::planned`]).
    pub planner: crate::gui::planned::PlannerDraft,
    /// The memory plan, auto-fit and dry run.
    pub plan: PlanState,
}

impl DevicesPanel {
    /// Draws the GPUs & memory panel.
    pub fn show(
        &mut self,
        ui: &mut Ui,
        s: &mut Session,
        cx: &PanelContext,
        actions: &mut Vec<Action>,
    ) {
        let dv = self;
        theme::heading(
            ui,
            "GPUs & memory",
            "Choose where to train. The bars are the planner's prediction of each device's peak memory for the current settings.",
        );

        // A config loaded or edited elsewhere may name another machine: show its choices.
        let entries = s.config.devices.devices.clone();
        dv.planner.sync_from(&entries);

        devices_section(ui, dv, s, cx, actions);

        theme::section(ui, "Memory plan");
        if let Some(e) = &dv.plan.error {
            theme::job_error(ui, "No plan", e);
        }
        if cx.model.is_none() {
            theme::note(ui, "Load a model to see the memory plan.");
            return;
        }
        let Some(plan) = dv.plan.plan.clone() else {
            ui.horizontal(|ui| {
                ui.add(egui::Spinner::new());
                ui.label("planning…");
            });
            return;
        };
        plan_bars(ui, dv, &plan);
        autofit_and_dry_run(ui, dv, cx, actions);
        if !plan.fixes.is_empty() {
            theme::section(ui, "Fixes, best first");
            crate::gui::widgets::fixes(ui, &plan, actions);
        }
        memory_per_block(ui, &plan);
    }
}

/// Which machine to plan for, its devices and the strategy; the note when planning elsewhere.
fn devices_section(
    ui: &mut Ui,
    dv: &mut DevicesPanel,
    s: &mut Session,
    cx: &PanelContext,
    actions: &mut Vec<Action>,
) {
    theme::section(ui, "Devices");
    theme::card(ui, |ui| {
        plan_for(ui, dv, s, actions);
        if s.planned_machine().is_some() {
            planned_machine(ui, dv, s);
        } else {
            device_list(ui, dv, s);
            logical_cpu_devices(ui, s);
        }
        strategy_row(ui, s);
        if s.planned_machine().is_none() && ui.small_button("Refresh devices").clicked() {
            actions.push(Action::RefreshDevices);
        }
    });
    which_machine_question(ui, dv, s);
    if cx.planning_only.is_some() {
        theme::card(ui, |ui| {
            ui.add(
                egui::Label::new(
                    "This machine is not the planned one: plan, fix and auto-fit here, then save the config \
                     and train it on the target machine with:",
                )
                .wrap(),
            );
            crate::gui::widgets::planning_only_note(ui, cx, actions);
        });
    }
}

/// The verdict and one bar per device, the idle devices, the legend and the settings line.
fn plan_bars(ui: &mut Ui, dv: &DevicesPanel, plan: &Plan) {
    verdict(ui, plan);
    ui.add_space(6.0);
    for d in &plan.per_device {
        device_bar(ui, d);
        ui.add_space(6.0);
    }
    // Devices the strategy leaves unused (single uses the first), as the CLI lists them.
    if let Some(req) = &dv.plan.request {
        for idle in req.devices.iter().skip(plan.per_device.len()) {
            ui.label(RichText::new(format!("{idle}: idle with this strategy")).weak());
        }
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
}

/// The Auto-fit and Dry run buttons, and what each last did.
fn autofit_and_dry_run(
    ui: &mut Ui,
    dv: &DevicesPanel,
    cx: &PanelContext,
    actions: &mut Vec<Action>,
) {
    ui.add_space(8.0);
    ui.horizontal(|ui| {
        let r = ui
            .add_enabled(!dv.plan.autofit_running, egui::Button::new("Auto-fit"))
            .on_hover_text(
                "Search precision, checkpointing, micro-batch, strategy and (last) LoRA for the fastest settings that fit \
                 every device with 5 % headroom, keeping the effective batch — and apply them.",
            );
        if r.clicked() {
            actions.push(Action::AutoFit);
        }
        // A dry run trains one real step, so it needs the real devices.
        let real = cx.planning_only.is_none();
        let r = ui
            .add_enabled(
                real && !dv.plan.dry_run_running && !cx.run_active,
                egui::Button::new("Dry run"),
            )
            .on_hover_text("Load everything and run one real training step, measuring its memory against the prediction.")
            .on_disabled_hover_text("A dry run trains one real step: run it on the planned machine.");
        if r.clicked() {
            actions.push(Action::DryRun);
        }
        if dv.plan.autofit_running || dv.plan.dry_run_running {
            ui.add(egui::Spinner::new());
        }
    });
    if !dv.plan.autofit_applied.is_empty() {
        theme::card(ui, |ui| {
            ui.label(RichText::new("Auto-fit applied").strong().color(theme::OK));
            for c in &dv.plan.autofit_applied {
                ui.label(format!("• {c}"));
            }
        });
    }
    if let Some(r) = &dv.plan.dry_run {
        theme::card(ui, |ui| {
            let color = if r.ok() { theme::OK } else { theme::ERROR };
            ui.label(RichText::new("Dry run").strong().color(color));
            ui.add(egui::Label::new(&r.summary).wrap());
            // Which part of the prediction is off (measured where the step measured it).
            if let Some(c) = &r.components {
                egui::CollapsingHeader::new("By component").show(ui, |ui| {
                    ui.label(RichText::new(c.render()).monospace());
                });
            }
        });
    }
}

/// The plan's memory per block, by kind (collapsed by default).
fn memory_per_block(ui: &mut Ui, plan: &Plan) {
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

/// The "plan for" choice's entries.
const THIS_MACHINE: &str = "This machine";
const PLANNED_MACHINE: &str = "A machine to rent or queue for";

/// This machine's devices, or a machine to rent (N GPUs of a catalogue model or a size).
fn plan_for(ui: &mut Ui, dv: &mut DevicesPanel, s: &mut Session, actions: &mut Vec<Action>) {
    let planned = s.planned_machine().is_some();
    let mut choice = planned;
    egui::Grid::new("plan-for")
        .num_columns(2)
        .spacing([12.0, 8.0])
        .show(ui, |ui| {
            let l = ui.label("Plan for").on_hover_text(
                "Plan for the devices of this machine, or for GPUs you will rent or queue for \
                 (written to the config as cuda:N=SIZE, which `tunestudio plan` reads too).",
            );
            egui::ComboBox::from_id_salt("plan-for-combo")
                .selected_text(if planned {
                    PLANNED_MACHINE
                } else {
                    THIS_MACHINE
                })
                .show_ui(ui, |ui| {
                    ui.selectable_value(&mut choice, false, THIS_MACHINE);
                    ui.selectable_value(&mut choice, true, PLANNED_MACHINE);
                })
                .response
                .labelled_by(l.id);
            ui.end_row();
        });
    if choice != planned {
        if choice {
            // The draft's size is valid unless a custom one is mid-edit; then keep this machine.
            if let Err(e) = dv.plan_for_draft(&mut s.config) {
                actions.push(Action::Toast(format!("cannot plan for that machine: {e}")));
            }
        } else {
            dv.plan_for_this_machine(&mut s.config);
        }
    }
}

/// The model picker's entry for a size of one's own.
const CUSTOM: &str = "Custom size";

fn device_list(ui: &mut Ui, dv: &mut DevicesPanel, s: &mut Session) {
    let Some(inv) = dv.inventory.clone() else {
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
                // The CPU is in use as `cpu` or as logical devices `cpu:N`.
                let is_entry = |l: &String| {
                    *l == label || (d.kind == DeviceKind::Cpu && l.starts_with("cpu:"))
                };
                let mut on = s.config.devices.devices.iter().any(is_entry);
                let r = ui
                    .checkbox(&mut on, format!("{} ({label})", d.name))
                    .on_hover_text("Train on this device");
                if r.changed() {
                    if on {
                        s.config.devices.devices.push(label.clone());
                        // The CPU and GPUs are not mixed in one run.
                        let gpu = d.kind == DeviceKind::Cuda;
                        s.config.devices.devices.retain(|l| {
                            (l == "cpu" || l.starts_with("cpu:")) != gpu || *l == label
                        });
                    } else {
                        s.config.devices.devices.retain(|l| !is_entry(l));
                    }
                    if s.config.devices.devices.len() <= 1 {
                        s.config.devices.strategy = tunestudio::settings::Strategy::Single;
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
}

/// How many logical CPU devices a CPU run uses (`cpu`, or `cpu:0`, `cpu:1`, …): several
/// share this machine's cores and RAM, to try a layer split or data parallel without GPUs.
fn logical_cpu_devices(ui: &mut Ui, s: &mut Session) {
    let entries = &s.config.devices.devices;
    if entries.is_empty() || !entries.iter().all(|e| e == "cpu" || e.starts_with("cpu:")) {
        return;
    }
    let before = entries.len();
    let mut n = before;
    egui::Grid::new("logical-cpus").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
        theme::combo_row(
            ui,
            "logical-cpu-combo",
            "Logical CPU devices",
            "Split the CPU into logical devices (cpu:0, cpu:1, …) that share its cores and RAM, \
             to try a layer split or data parallel without GPUs",
            &mut n,
            &[(1, "1 (cpu)"), (2, "2 (cpu:0, cpu:1)"), (3, "3 (cpu:0 … cpu:2)"), (4, "4 (cpu:0 … cpu:3)")],
        );
    });
    if n != before {
        s.config.devices.devices = if n == 1 {
            vec!["cpu".to_string()]
        } else {
            (0..n).map(|i| format!("cpu:{i}")).collect()
        };
        if n == 1 {
            s.config.devices.strategy = tunestudio::settings::Strategy::Single;
        }
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
fn components(d: &DevicePlan) -> [(&'static str, Color32, u64); 9] {
    [
        ("weights", theme::MEM_WEIGHTS, d.weights_bytes),
        ("master weights", theme::MEM_MASTER, d.master_weights_bytes),
        ("gradients", theme::MEM_GRADIENTS, d.gradients_bytes),
        ("optimizer", theme::MEM_OPTIMIZER, d.optimizer_states_bytes),
        ("activations", theme::MEM_ACTIVATIONS, d.activations_bytes),
        ("logits & loss", theme::MEM_LOGITS, d.logits_and_loss_bytes),
        ("temporaries", theme::MEM_TEMPORARIES, d.temporaries_bytes),
        (
            "collective buffers",
            theme::MEM_COLLECTIVE,
            d.collective_bytes,
        ),
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
                d.peak_moment()
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
    let label = bar_label(d);
    response.widget_info(|| egui::WidgetInfo::labeled(egui::Role::Label, true, &label));
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

/// A device bar's accessible name: "memory of GPU 0: weights 27.0 GiB, ...".
pub fn bar_label(d: &DevicePlan) -> String {
    let summary = components(d)
        .iter()
        .filter(|c| c.2 > 0)
        .map(|(n, _, b)| format!("{n} {}", theme::bytes(*b)))
        .collect::<Vec<_>>()
        .join(", ");
    format!("memory of {}: {summary}", d.device.name)
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
            ("collective buffers", theme::MEM_COLLECTIVE),
            ("overhead", theme::MEM_OVERHEAD),
        ] {
            theme::legend_item(ui, c, n);
        }
        ui.label(RichText::new("| = capacity").small().weak());
    });
}
