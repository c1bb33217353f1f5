//! Training settings, each with a tooltip that says what it trades off.

use eframe::egui::{self, RichText, Ui};

use tunestudio::settings::Quantization;
use tunestudio::train::{DpoLoss, Precision, ScheduleKind, TrainingMethod};

use crate::gui::action::Action;
use crate::gui::jobs::PickTarget;
use crate::gui::session::Session;
use crate::gui::shared::PanelContext;
use crate::gui::theme;

const LORA_MODULES: [&str; 7] = tunestudio::model::LINEAR_MODULES;

/// The Training panel. It holds no state of its own: every control edits the run config in
/// the session, and the rules behind the controls (the effective batch, the data-parallel
/// ranks, switching the method, the offload switch) are the library's.
#[derive(Debug, Default)]
pub struct TrainingPanel;

impl TrainingPanel {
    /// Draws the Training panel.
    pub fn show(
        &mut self,
        ui: &mut Ui,
        s: &mut Session,
        cx: &PanelContext,
        actions: &mut Vec<Action>,
    ) {
        theme::heading(
            ui,
            "Training",
            "Optimisation settings. The memory plan (GPUs & memory) updates as you change them.",
        );
        settings_findings(ui, s, cx);

        ui.columns(2, |cols| {
            batch_and_precision(&mut cols[0], s);
            method(&mut cols[0], s);
            objective(&mut cols[0], s);
            optimizer_and_schedule(&mut cols[1], s);
            length_eval_and_checkpoints(&mut cols[1], s, actions);
        });
    }
}

/// What the studio moved to suit the model, and the settings lints (the same `tunestudio
/// train` stops on): an error names the setting, the fix, and its override.
fn settings_findings(ui: &mut Ui, s: &mut Session, cx: &PanelContext) {
    if let Some(note) = &s.follow.note {
        theme::note(ui, note);
    }
    for lint in &cx.settings_lints {
        let id = lint.kind.id();
        let allowed = s.config.data.allow.iter().any(|a| a == id);
        match lint.severity {
            tunestudio::data::lints::Severity::Error if !allowed => {
                theme::error_box(
                    ui,
                    &format!("Start is disabled: lint `{id}`"),
                    &lint.message,
                );
                theme::allow_lint_checkbox(ui, &mut s.config.data.allow, id);
            }
            tunestudio::data::lints::Severity::Info => theme::note(ui, &lint.message),
            _ => {
                ui.label(RichText::new(format!("⚠ {}", lint.message)).color(theme::WARNING));
            }
        }
    }
}

/// Batch, precision, sequence length and the memory savers (one grid).
fn batch_and_precision(ui: &mut Ui, s: &mut Session) {
    let ranks = s.config.data_parallel_ranks();
    theme::section(ui, "Batch and precision");
    theme::card(ui, |ui| {
        egui::Grid::new("train-batch").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
            let t = &mut s.config.training;
            theme::combo_row(
                ui,
                "precision",
                "Precision",
                "fp32: exact, most memory. bf16-mixed: bf16 compute with f32 master weights — about half the activation memory, same quality. \
                 bf16: no f32 copy, least memory, small updates can be lost. fp16-mixed: like bf16-mixed with loss scaling (older GPUs).",
                &mut t.precision,
                &[
                    (Precision::Fp32, "fp32"),
                    (Precision::Bf16Mixed, "bf16-mixed"),
                    (Precision::Bf16, "bf16"),
                    (Precision::Fp16Mixed, "fp16-mixed"),
                ],
            );
            // The micro-batch in the objective's unit: SFT rows, DPO/ORPO pairs, GRPO prompts.
            let unit = t.method.micro_batch_unit();
            theme::drag_row(
                ui,
                "Micro-batch",
                &format!(
                    "The {unit} per forward/backward pass (a pair is two rows, a GRPO prompt its generations' rows). \
                     Activation memory grows linearly with it; larger is faster per row."
                ),
                &mut t.micro_batch,
                1..=1024,
                0.1,
                &format!(" {unit}"),
            );
            theme::drag_row(
                ui,
                "Gradient accumulation",
                "Micro-batches summed before each optimizer step. Raises the effective batch without more activation memory, \
                 at the cost of more passes per step.",
                &mut t.gradient_accumulation,
                1..=1024,
                0.1,
                "",
            );
            let eff = t.effective_batch(ranks);
            ui.label(RichText::new("Effective batch").weak());
            ui.label(
                RichText::new(format!(
                    "{eff} {unit} per step ({} × {}{})",
                    t.micro_batch,
                    t.gradient_accumulation,
                    if ranks > 1 { format!(" × {ranks} devices") } else { String::new() }
                ))
                .strong(),
            )
            .on_hover_text("micro-batch × accumulation × data-parallel devices: what the optimizer sees per step");
            ui.end_row();
            theme::drag_row(
                ui,
                "Max length",
                "Tokens per row; longer rows are truncated (see the histogram in Preview). Activation and logits memory grow with it.",
                &mut s.config.data.max_length,
                2..=131072,
                4.0,
                " tokens",
            );
            memory_saver_rows(ui, s);
        });
    });
}

/// Packing, grouping, activation checkpointing and optimizer offload: the settings that
/// trade speed or order for memory (rows of the "Batch and precision" grid).
fn memory_saver_rows(ui: &mut Ui, s: &mut Session) {
    theme::check_row(
        ui,
        "Packing",
        "Concatenate short rows into full max_length sequences: no padding waste, fewer steps.",
        &mut s.config.data.packing,
        "pack rows",
    );
    theme::check_row(
        ui,
        "Group by length",
        "Batch rows of similar length together: less padding, slightly less random order.",
        &mut s.config.data.group_by_length,
        "group",
    );
    theme::check_row(
        ui,
        "Activation checkpointing",
        "Recompute each layer's activations during backward instead of keeping them: far less activation memory, \
         about 30 % more compute.",
        &mut s.config.training.activation_checkpointing,
        "recompute activations",
    );
    let mut offload = s.config.training.optimizer_offload.is_host();
    theme::check_row(
        ui,
        "Optimizer state in host RAM",
        "Keep AdamW's moments (and fp32 master weights) in host RAM instead of on the GPU: \
         8–12 bytes per parameter leave the GPU, for a host↔device copy of every gradient and \
         parameter per step. No effect on a CPU run.",
        &mut offload,
        "offload",
    );
    s.config.training.optimizer_offload = tunestudio::model::OptimizerOffload::host_if(offload);
}

/// Full fine-tune or LoRA, and the LoRA settings.
fn method(ui: &mut Ui, s: &mut Session) {
    theme::section(ui, "Method");
    theme::card(ui, |ui| {
        let l = &mut s.config.lora;
        let quantize = &mut s.config.model.quantize;
        ui.horizontal(|ui| {
            ui.radio_value(&mut l.enabled, false, "Full fine-tune")
                .on_hover_text("Train every weight: best quality, needs gradients and optimizer states for all parameters.");
            ui.radio_value(&mut l.enabled, true, "LoRA")
                .on_hover_text("Freeze the base model and train small low-rank adapters: a fraction of the memory.");
        });
        if l.enabled {
            egui::Grid::new("lora")
                .num_columns(2)
                .spacing([12.0, 8.0])
                .show(ui, |ui| {
                    theme::drag_row(
                        ui,
                        "Rank r",
                        "Adapter rank: capacity of the update (8–64 typical).",
                        &mut l.r,
                        1..=1024,
                        0.2,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Alpha",
                        "Scaling numerator: the update is multiplied by alpha / r.",
                        &mut l.alpha,
                        0.0..=4096.0,
                        0.5,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Dropout",
                        "Dropout on the adapter input (regularisation).",
                        &mut l.dropout,
                        0.0..=0.9,
                        0.01,
                        "",
                    );
                    theme::combo_row(
                        ui,
                        "quantize",
                        "Base",
                        "QLoRA: store the frozen base's linear layers quantized. q4_k (4.5 bits a weight) takes about 0.28× of the bf16 base, q8_0 about 0.53×; \
                         embeddings, norms, the lm-head and the adapters stay in the compute dtype. Each layer's weight is dequantized for its matmul (a little slower).",
                        quantize,
                        &[
                            (Quantization::None, "full precision"),
                            (Quantization::Q8_0, "QLoRA 8-bit (q8_0)"),
                            (Quantization::Q4K, "QLoRA 4-bit (q4_k)"),
                        ],
                    );
                });
            ui.label(RichText::new("Adapted layers").weak());
            ui.horizontal_wrapped(|ui| {
                for m in LORA_MODULES {
                    let mut on = l.target_modules.iter().any(|t| t == m);
                    if ui.checkbox(&mut on, m).changed() {
                        if on {
                            l.target_modules.push(m.to_string());
                        } else {
                            l.target_modules.retain(|t| t != m);
                        }
                    }
                }
            });
        }
    });
}

/// What is learned (`[training] method`): SFT on the data's tokens, or DPO / ORPO on
/// preference pairs, with `[preference]`'s loss, β and truncation lengths. Edited in place like
/// every setting here: the plan key is derived from the run config (a preference step plans
/// chosen and rejected rows cut at the pair lengths), so the plan follows.
fn objective(ui: &mut Ui, s: &mut Session) {
    theme::section(ui, "Objective");
    theme::card(ui, |ui| {
        let mut method = s.config.training.method;
        ui.horizontal(|ui| {
            ui.radio_value(&mut method, TrainingMethod::Sft, "SFT")
                .on_hover_text("Supervised fine-tuning: the next-token loss on the trained tokens of each row.");
            ui.radio_value(&mut method, TrainingMethod::Dpo, "DPO")
                .on_hover_text("Direct preference optimisation on prompt / chosen / rejected pairs, against the model as loaded \
                                (its log-probabilities precomputed once). Each step runs a pair's chosen and rejected rows: twice the rows of SFT.");
            ui.radio_value(&mut method, TrainingMethod::Orpo, "ORPO")
                .on_hover_text("Odds-ratio preference optimisation: the chosen answer's NLL plus an odds-ratio term; no reference model.");
            ui.radio_value(&mut method, TrainingMethod::Grpo, "GRPO")
                .on_hover_text("Group relative policy optimisation: the model samples a group of completions per prompt, the reward functions \
                                score them, and each completion learns from its advantage over its group. Micro-batch counts prompts.");
        });
        if method != s.config.training.method {
            // The library's switch: it also resets what the new method would refuse.
            s.config.set_method(method);
        }
        if method == TrainingMethod::Grpo {
            grpo_settings(ui, &mut s.config.grpo);
            return;
        }
        let p = &mut s.config.preference;
        if !method.is_preference() {
            theme::note(ui, "The data's rows are trained as they are; DPO and ORPO need preference pairs (prompt, chosen, rejected).");
            return;
        }
        egui::Grid::new("train-preference")
            .num_columns(2)
            .spacing([12.0, 8.0])
            .show(ui, |ui| {
                if method == TrainingMethod::Dpo {
                    theme::combo_row(
                        ui,
                        "dpo-loss",
                        "DPO loss",
                        "sigmoid: TRL's −log σ(β·margin) of the reward margin. IPO: the squared distance of the margin of mean log-probabilities from 1/(2β); less prone to overfitting the pairs.",
                        &mut p.loss,
                        &[(DpoLoss::Sigmoid, "sigmoid"), (DpoLoss::Ipo, "IPO")],
                    );
                }
                let (name, tip) = if method == TrainingMethod::Dpo {
                    ("Beta", "DPO's β: how far the model may move from the reference (TRL's default 0.1; smaller lets it move further).")
                } else {
                    ("Lambda", "ORPO's λ (stored as `[preference] beta`): the weight of the odds-ratio term against the NLL (TRL's default 0.1).")
                };
                theme::drag_row(ui, name, tip, &mut p.beta, 0.001..=10.0, 0.005, "");
                theme::drag_row(
                    ui,
                    "Max prompt length",
                    "Prompt tokens kept, from the prompt's end (TRL's max_prompt_length). With the completion length it sets the planned sequence.",
                    &mut p.max_prompt_length,
                    1..=131072,
                    4.0,
                    " tokens",
                );
                theme::drag_row(
                    ui,
                    "Max completion length",
                    "Tokens kept of each completion, from its start (TRL's max_completion_length).",
                    &mut p.max_completion_length,
                    1..=131072,
                    4.0,
                    " tokens",
                );
            });
    });
}

/// `[grpo]`'s sampling, lengths and loss; the reward functions are listed (edited in run.toml).
fn grpo_settings(ui: &mut Ui, g: &mut tunestudio::train::GrpoSection) {
    use tunestudio::train::GrpoLossType;
    egui::Grid::new("train-grpo")
        .num_columns(2)
        .spacing([12.0, 8.0])
        .show(ui, |ui| {
            theme::drag_row(ui, "Generations per prompt", "G (TRL's num_generations): completions sampled per prompt; the advantages compare them. Each micro-step trains micro-batch × G rows.", &mut g.num_generations, 2..=64, 0.1, "");
            theme::drag_row(ui, "Max prompt length", "Prompt tokens kept, from the prompt's end (TRL's max_prompt_length).", &mut g.max_prompt_length, 1..=131072, 4.0, " tokens");
            theme::drag_row(ui, "Max completion length", "Most tokens sampled per completion. The memory plan is sized by it: a completion this long will come.", &mut g.max_completion_length, 1..=131072, 4.0, " tokens");
            theme::drag_row(ui, "Temperature", "Sampling temperature; every log-probability divides the logits by it too (TRL's default 1.0).", &mut g.temperature, 0.05..=2.0, 0.01, "");
            theme::drag_row(ui, "Beta (KL)", "The KL coefficient against the reference (0: no reference model, TRL's default; with LoRA the reference is the base with the adapter off).", &mut g.beta, 0.0..=1.0, 0.001, "");
            theme::drag_row(ui, "Iterations per sample", "Optimizer steps trained on each sampled block (TRL's num_iterations, default 1: every step samples anew). Above 1 the later steps reuse the completions, with the ratio to the sampling policy clipped by epsilon, and an epoch takes that many times the steps.", &mut g.num_iterations, 1..=16, 0.05, "");
            generations_per_pass_row(ui, g);
            theme::combo_row(ui, "grpo-loss", "Loss", "How per-token losses are aggregated (TRL's loss_type): dapo divides by the step's completion tokens (TRL's default), grpo averages each completion first, dr_grpo divides by rows × max completion length, bnpo by the micro-batch's tokens.", &mut g.loss_type, &[(GrpoLossType::Dapo, "dapo"), (GrpoLossType::Grpo, "grpo"), (GrpoLossType::DrGrpo, "dr_grpo"), (GrpoLossType::Bnpo, "bnpo")]);
        });
    if g.reward.is_empty() {
        theme::note(ui, "No reward function yet: add [[grpo.reward]] entries to the run config (kind = \"accuracy\", \"format\", \"length\" or \"command\").");
    } else {
        let names: Vec<String> = g
            .reward
            .iter()
            .map(|r| format!("{} ({}, weight {})", r.name(), r.kind, r.weight))
            .collect();
        theme::note(
            ui,
            &format!(
                "Rewards: {}. Preview samples completions and scores them before the run.",
                names.join(", ")
            ),
        );
    }
}

/// `[grpo] generations_per_micro_step`: the whole group, or one of G's divisors.
fn generations_per_pass_row(ui: &mut Ui, g: &mut tunestudio::train::GrpoSection) {
    let group = g.num_generations.max(1);
    let mut names = vec![(None, format!("the whole group ({group})"))];
    names.extend(
        (1..group)
            .rev()
            .filter(|&n| group.is_multiple_of(n))
            .map(|n| (Some(n), format!("{n} ({} passes)", group / n))),
    );
    let choices: Vec<(Option<usize>, &str)> = names.iter().map(|(v, n)| (*v, n.as_str())).collect();
    theme::combo_row(
        ui,
        "grpo-generations-per-pass",
        "Generations per micro-step",
        "Completions of each group run forward and backward together (generations_per_micro_step). Fewer split each micro-step into passes of micro-batch × this many rows, gradients summed: less memory for the step, the same result (the groups are sampled and scored whole, and the loss divides by the whole step's count).",
        &mut g.generations_per_micro_step,
        &choices,
    );
}

/// Optimizer, learning rate and its schedule, decay, clipping and seed.
fn optimizer_and_schedule(ui: &mut Ui, s: &mut Session) {
    theme::section(ui, "Optimizer and schedule");
    theme::card(ui, |ui| {
        egui::Grid::new("train-opt")
            .num_columns(2)
            .spacing([12.0, 8.0])
            .show(ui, |ui| {
                let t = &mut s.config.training;
                ui.label(RichText::new("Optimizer").weak());
                ui.label("AdamW (f32 moments)")
                    .on_hover_text("Two f32 moment buffers per trained parameter: 8 bytes each.");
                ui.end_row();
                let l = ui
                    .label("Learning rate")
                    .on_hover_text("Peak learning rate after warm-up.");
                let lr_speed = t.learning_rate.max(1e-7) * 0.02;
                ui.add(
                    egui::DragValue::new(&mut t.learning_rate)
                        .range(1e-8..=1.0)
                        .speed(lr_speed)
                        .custom_formatter(|v, _| format!("{v:.2e}"))
                        .custom_parser(|s| s.trim().parse::<f64>().ok()),
                )
                .labelled_by(l.id)
                .on_hover_text("Peak learning rate after warm-up (type e.g. 2e-4).");
                ui.end_row();
                theme::combo_row(
                    ui,
                    "schedule",
                    "Schedule",
                    "How the learning rate falls after warm-up.",
                    &mut t.schedule,
                    &[
                        (ScheduleKind::Cosine, "cosine"),
                        (ScheduleKind::Linear, "linear"),
                        (ScheduleKind::Constant, "constant"),
                    ],
                );
                theme::drag_row(
                    ui,
                    "Warm-up steps",
                    "Steps of linear ramp from 0 to the peak rate: avoids early instability.",
                    &mut t.warmup_steps,
                    0..=1_000_000,
                    0.5,
                    "",
                );
                theme::drag_row(
                    ui,
                    "Weight decay",
                    "Decoupled AdamW decay of the weights (not norms and biases).",
                    &mut t.weight_decay,
                    0.0..=1.0,
                    0.001,
                    "",
                );
                theme::drag_row(
                    ui,
                    "Gradient clipping",
                    "Clip the global gradient norm to this value; 0 turns clipping off.",
                    &mut t.max_grad_norm,
                    0.0..=100.0,
                    0.01,
                    "",
                );
                theme::drag_row(
                    ui,
                    "Seed",
                    "Seed of initialisation, data order and dropout.",
                    &mut t.seed,
                    0..=u64::MAX,
                    1.0,
                    "",
                );
            });
    });
}

/// Run length, evaluation cadence, checkpoints and the output folder.
fn length_eval_and_checkpoints(ui: &mut Ui, s: &mut Session, actions: &mut Vec<Action>) {
    theme::section(ui, "Length, evaluation and checkpoints");
    theme::card(ui, |ui| {
        egui::Grid::new("train-len").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
            let t = &mut s.config.training;
            let mut by_steps = t.max_steps.is_some();
            ui.label("Train for");
            ui.horizontal(|ui| {
                if ui.radio_value(&mut by_steps, false, "epochs").changed() {
                    t.max_steps = None;
                }
                if ui.radio_value(&mut by_steps, true, "steps").changed() {
                    t.max_steps = Some(100);
                }
            });
            ui.end_row();
            match &mut t.max_steps {
                Some(steps) => {
                    theme::drag_row(ui, "Optimizer steps", "Total optimizer steps of the run.", steps, 1..=10_000_000, 1.0, "");
                }
                None => {
                    theme::drag_row(ui, "Epochs", "Passes over the training split.", &mut t.epochs, 1..=1000, 0.05, "");
                }
            }
            let e = &mut s.config.eval;
            theme::drag_row(
                ui,
                "Evaluate every",
                "Compute the validation loss every N steps (and at the end); 0 = only at the end.",
                &mut e.eval_every,
                0..=1_000_000,
                0.5,
                " steps",
            );
            theme::drag_row(
                ui,
                "Eval batches",
                "Cap on validation micro-batches per evaluation; 0 = the whole split.",
                &mut e.max_batches,
                0..=1_000_000,
                0.5,
                "",
            );
            let c = &mut s.config.checkpoint;
            theme::drag_row(
                ui,
                "Save every",
                "Write a resumable checkpoint every N steps; 0 = only at the end.",
                &mut c.save_every,
                0..=1_000_000,
                0.5,
                " steps",
            );
            theme::drag_row(
                ui,
                "Keep last",
                "Keep only the newest K checkpoints; 0 keeps all.",
                &mut c.keep_last,
                0..=1000,
                0.1,
                "",
            );
            theme::check_row(ui, "Final checkpoint", "Save when training completes.", &mut c.save_final, "save at the end");
            let mut out = s.config.output_dir.display().to_string();
            let r = theme::text_row(
                ui,
                "Output folder",
                "Checkpoints, metrics.jsonl and exports go here (relative to the run config's folder).",
                &mut out,
                "runs/my-run",
            );
            if r.changed() {
                s.config.output_dir = out.into();
            }
            ui.label("");
            if ui.button("Browse output folder…").clicked() {
                actions.push(Action::Pick(PickTarget::OutputDir));
            }
            ui.end_row();
        });
    });
}
