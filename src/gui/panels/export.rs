//! Export: the adapter, the merged model, the full model or a GGUF file from a checkpoint;
//! the run config as TOML; and the CLI command that reruns it headless.

use std::path::PathBuf;
use std::sync::atomic::Ordering;

use eframe::egui::{self, RichText, Ui};

use crate::gui::action::Action;
use crate::gui::error::JobError;
use crate::gui::jobs::PickTarget;
use crate::gui::session::Session;
use crate::gui::shared::PanelContext;
use crate::gui::theme;
use tunestudio::gguf::GgufQuant;

use crate::gui::shared::{ExportKind, ExportProgressCell};

/// Export dtype choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

impl ExportDtype {
    /// The candle dtype.
    pub fn to_dtype(self) -> candle_core::DType {
        match self {
            ExportDtype::F32 => candle_core::DType::F32,
            ExportDtype::Bf16 => candle_core::DType::BF16,
            ExportDtype::F16 => candle_core::DType::F16,
        }
    }
}

/// The Export panel: what to export and where, the export in flight, and where the run
/// config is saved.
#[derive(Debug)]
pub struct ExportPanel {
    /// What to export.
    pub kind: ExportKind,
    /// Weights dtype of merged/full exports.
    pub dtype: ExportDtype,
    /// The GGUF file type.
    pub gguf_quant: tunestudio::gguf::GgufQuant,
    /// Overwrite an existing GGUF file.
    pub replace: bool,
    /// Progress of the GGUF export in flight.
    pub progress: std::sync::Arc<ExportProgressCell>,
    /// The checkpoint to export (defaults to the run's last).
    pub checkpoint: String,
    /// Destination folder.
    pub destination: String,
    /// Export in flight.
    pub running: bool,
    /// The last export's result.
    pub result: Option<Result<PathBuf, JobError>>,
    /// Where the run config is saved.
    pub config_path: String,
    /// The last save/load message (an error keeps its kind and hint).
    pub config_message: Option<Result<String, JobError>>,
    /// A save or open of the run config in flight: what it is doing ("saving …").
    pub config_busy: Option<String>,
    /// The output folder a job was last asked to look in for its newest checkpoint (the
    /// empty Checkpoint field's default), so a frame asks once per folder, never the disk.
    pub latest_asked_for: Option<PathBuf>,
    /// Machines of the launch the panel prints (torchrun, Slurm).
    pub launch_nodes: usize,
    /// GPUs on each machine of that launch (one rank each).
    pub launch_gpus_per_node: usize,
}

impl Default for ExportPanel {
    fn default() -> Self {
        ExportPanel {
            kind: ExportKind::Adapter,
            dtype: ExportDtype::Bf16,
            gguf_quant: tunestudio::gguf::GgufQuant::Q4KM,
            replace: false,
            progress: Default::default(),
            checkpoint: String::new(),
            destination: String::new(),
            running: false,
            result: None,
            config_path: String::new(),
            config_message: None,
            config_busy: None,
            latest_asked_for: None,
            launch_nodes: 2,
            launch_gpus_per_node: 8,
        }
    }
}

/// The command that reproduces the run headless.
pub fn cli_command(config_path: &str) -> String {
    format!(
        "tunestudio train --config {}",
        tunestudio::devices::launch::commands::shell_quoted(config_path)
    )
}

impl ExportPanel {
    /// Draws the Export panel.
    pub fn show(
        &mut self,
        ui: &mut Ui,
        s: &mut Session,
        cx: &PanelContext,
        actions: &mut Vec<Action>,
    ) {
        let ep = self;
        theme::heading(
            ui,
            "Export",
            "Save the trained weights in Hugging Face layout, and the run config that reproduces the run.",
        );

        weights(ui, ep, s, cx, actions);
        run_config(ui, ep, s, actions);
    }
}

/// The checkpoint to export, what to write (adapter, merged or full), its dtype and folder.
fn weights(
    ui: &mut Ui,
    ep: &mut ExportPanel,
    s: &mut Session,
    cx: &PanelContext,
    actions: &mut Vec<Action>,
) {
    theme::section(ui, "Weights");
    fill_defaults(ep, s, cx, actions);
    theme::card(ui, |ui| {
        egui::Grid::new("export-weights").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
            theme::text_row(
                ui,
                "Checkpoint",
                "A checkpoint-<step> folder of a run (its run.toml names the base model)",
                &mut ep.checkpoint,
                "runs/demo/checkpoint-80",
            );
            ui.label("");
            ui.horizontal(|ui| {
                if ui.button("Browse checkpoint…").clicked() {
                    actions.push(Action::Pick(PickTarget::Checkpoint));
                }
                if ui.button("Use the latest").on_hover_text("The newest checkpoint in the output folder").clicked() {
                    actions.push(Action::FindLatestCheckpoint { use_it: true });
                }
            });
            ui.end_row();
            ui.label("What");
            ui.horizontal(|ui| {
                ui.radio_value(&mut ep.kind, ExportKind::Adapter, "LoRA adapter")
                    .on_hover_text("adapter_config.json + adapter_model.safetensors (PEFT): small, needs the base model");
                ui.radio_value(&mut ep.kind, ExportKind::Merged, "merged model")
                    .on_hover_text("The base weights with the adapter merged in: a standalone Hugging Face model");
                ui.radio_value(&mut ep.kind, ExportKind::Full, "full model")
                    .on_hover_text("Every fine-tuned weight as a Hugging Face model folder (for full fine-tunes)");
                ui.radio_value(&mut ep.kind, ExportKind::Gguf, "GGUF file")
                    .on_hover_text("One file for llama.cpp, Ollama and LM Studio (adapter merged), with an Ollama Modelfile beside it");
            });
            ui.end_row();
            if ep.kind == ExportKind::Gguf {
                gguf_rows(ui, ep, cx);
            } else {
                theme::combo_row(
                    ui,
                    "export-dtype",
                    "Weights dtype",
                    "Dtype of the saved weights (merged and full models). bf16 halves the size of f32.",
                    &mut ep.dtype,
                    &[(ExportDtype::Bf16, "bf16"), (ExportDtype::F16, "f16"), (ExportDtype::F32, "f32")],
                );
            }
            theme::text_row(
                ui,
                "Destination",
                "The folder to write (created if missing); for GGUF a .gguf file or a folder for <run>-<type>.gguf",
                &mut ep.destination,
                "runs/demo/export",
            );
            ui.label("");
            ui.horizontal(|ui| {
                if ui.button("Browse destination…").clicked() {
                    actions.push(Action::Pick(PickTarget::ExportDest));
                }
                let r = ui.add_enabled(!ep.running, egui::Button::new(RichText::new("Export").strong()));
                if r.clicked() {
                    actions.push(Action::Export);
                }
                if ep.running {
                    ui.add(egui::Spinner::new());
                    let total = ep.progress.total_bytes.load(Ordering::Relaxed);
                    let done = ep.progress.done_bytes.load(Ordering::Relaxed);
                    if total > 0 {
                        ui.add(
                            egui::ProgressBar::new(done as f32 / total as f32)
                                .desired_width(160.0)
                                .show_percentage(),
                        );
                    }
                }
            });
            ui.end_row();
        });
        export_result(ui, ep);
    });
}

/// The checkpoint (the run's last, else the newest in the output folder, which a job looks
/// for once per folder: `JobOutput::LatestCheckpoint`) and the folder to export to, while
/// still empty.
fn fill_defaults(ep: &mut ExportPanel, s: &Session, cx: &PanelContext, actions: &mut Vec<Action>) {
    if ep.checkpoint.is_empty() {
        if let Some(ck) = &cx.last_checkpoint {
            ep.checkpoint = ck.display().to_string();
        } else if ep.latest_asked_for.as_ref() != Some(&s.output_dir()) {
            ep.latest_asked_for = Some(s.output_dir());
            actions.push(Action::FindLatestCheckpoint { use_it: false });
        }
    }
    if ep.destination.is_empty() {
        ep.destination = s.output_dir().join("export").display().to_string();
    }
}

/// What the last export wrote (with the Ollama command for a GGUF file), or its error.
fn export_result(ui: &mut Ui, ep: &ExportPanel) {
    match &ep.result {
        Some(Ok(p)) => {
            ui.label(RichText::new(format!("Exported to {}", p.display())).color(theme::OK));
            if p.extension().is_some_and(|e| e == "gguf") {
                let modelfile = p.with_extension("Modelfile");
                ui.label(
                    RichText::new(format!(
                        "Ollama: ollama create my-model -f {}",
                        modelfile.display()
                    ))
                    .monospace(),
                );
            }
        }
        Some(Err(e)) => theme::job_error(ui, "Export failed", e),
        None => {}
    }
}

/// The GGUF file type, its predicted size and whether to replace an existing file.
fn gguf_rows(ui: &mut Ui, ep: &mut ExportPanel, cx: &PanelContext) {
    let options: Vec<(GgufQuant, &str)> = GgufQuant::ALL.iter().map(|q| (*q, q.name())).collect();
    theme::combo_row(
        ui,
        "export-gguf-quant",
        "GGUF type",
        "llama.cpp's types: q4_k_m is the usual choice (about 4.8 bits a weight, output and some layers at 6); q8_0 is nearly lossless; f16/bf16 keep every bit",
        &mut ep.gguf_quant,
        &options,
    );
    ui.label("Predicted size");
    match &cx.model {
        Some(info) => {
            let bytes = tunestudio::gguf::predicted_tensor_bytes(&info.config, ep.gguf_quant);
            ui.label(format!(
                "{} (+ the tokenizer, 1–5 MB)",
                tunestudio::units::format_bytes(bytes)
            ))
            .on_hover_text(
                "The tensors' bytes in the chosen type, by llama.cpp's per-tensor rules",
            );
        }
        None => {
            ui.label(RichText::new("load the model to see it").weak());
        }
    }
    ui.end_row();
    ui.label("");
    ui.checkbox(&mut ep.replace, "Replace an existing file");
    ui.end_row();
}

/// Saving and loading the run config, and the CLI command that reruns it headless.
fn run_config(ui: &mut Ui, ep: &mut ExportPanel, s: &mut Session, actions: &mut Vec<Action>) {
    theme::section(ui, "Run config");
    theme::card(ui, |ui| {
        if ep.config_path.is_empty() {
            ep.config_path = s.default_config_path().display().to_string();
        }
        egui::Grid::new("export-config")
            .num_columns(2)
            .spacing([12.0, 8.0])
            .show(ui, |ui| {
                theme::text_row(
                    ui,
                    "Config file",
                    "Where the run config TOML is saved (paths inside are written absolute)",
                    &mut ep.config_path,
                    "runs/my-run/run.toml",
                );
                ui.label("");
                ui.horizontal(|ui| {
                    if ui.button("Save config").clicked() {
                        actions.push(Action::SaveConfig(PathBuf::from(ep.config_path.trim())));
                    }
                    if ui.button("Save as…").clicked() {
                        actions.push(Action::Pick(PickTarget::ConfigSave));
                    }
                    if ui.button("Load config…").clicked() {
                        actions.push(Action::Pick(PickTarget::ConfigOpen));
                    }
                });
                ui.end_row();
            });
        // The file is read or written by a job; its answer arrives a few frames later.
        if let Some(busy) = &ep.config_busy {
            ui.horizontal(|ui| {
                ui.add(egui::Spinner::new().size(12.0));
                ui.label(RichText::new(busy).weak());
            });
        } else if let Some(m) = &ep.config_message {
            match m {
                Ok(t) => {
                    ui.label(RichText::new(t).color(theme::OK));
                }
                Err(e) => theme::job_error(ui, "The run config", e),
            }
        }
        ui.add_space(6.0);
        let cmd = cli_command(&ep.config_path);
        ui.label(RichText::new("Reproduce this run headless:").weak());
        ui.horizontal(|ui| {
            ui.label(
                RichText::new(&cmd)
                    .monospace()
                    .background_color(ui.visuals().extreme_bg_color),
            );
            let r = ui.button("Copy CLI command").on_hover_text(
                "Saves the config to the path above and copies the command that trains it headless",
            );
            if r.clicked() {
                actions.push(Action::SaveConfig(PathBuf::from(ep.config_path.trim())));
                ui.ctx().copy_text(cmd.clone());
                actions.push(Action::Toast(
                    "saved the config and copied the command".into(),
                ));
            }
        });
        launch_lines(ui, ep, &s.config);
        // The paths as written: making them absolute looks at the disk, which Save does in
        // its job.
        egui::CollapsingHeader::new("TOML").show(ui, |ui| {
            theme::note(ui, "paths as written; the saved file has them absolute");
            let text = s
                .config
                .to_toml_string()
                .unwrap_or_else(|e| format!("cannot write the config: {e}"));
            ui.add(egui::Label::new(RichText::new(text).monospace().small()).wrap());
        });
    });
}

/// The `torchrun` line and the Slurm script that start this run config over machines × GPUs
/// (`devices::launch::LaunchShape`), each with a copy button.
fn launch_lines(ui: &mut Ui, ep: &mut ExportPanel, config: &tunestudio::train::RunConfig) {
    egui::CollapsingHeader::new("Launch on several machines (torchrun, Slurm)").show(ui, |ui| {
        ui.horizontal(|ui| {
            ui.label("Machines");
            ui.add(egui::DragValue::new(&mut ep.launch_nodes).range(1..=1024));
            ui.label("GPUs on each");
            ui.add(egui::DragValue::new(&mut ep.launch_gpus_per_node).range(1..=16));
        });
        let shape = tunestudio::devices::launch::LaunchShape {
            nodes: ep.launch_nodes,
            gpus_per_node: ep.launch_gpus_per_node,
            config_path: ep.config_path.clone(),
        };
        theme::note(
            ui,
            &format!(
                "{} ranks, one process per GPU, with a CUDA + NCCL build of tunestudio on every \
                 machine (scripts/build-cuda.sh) and the run config at the same path; rank 0 \
                 writes the checkpoints and the metrics. docs/multi-node.md says more.",
                shape.world_size()
            ),
        );
        // What the launched ranks will do with this config, or why they would refuse it: the
        // check each rank makes before it trains.
        match tunestudio::train::launched_training(config, shape.world_size()) {
            Ok(how) => theme::note(ui, &format!("The ranks train {how}.")),
            Err(e) => {
                ui.colored_label(
                    ui.visuals().warn_fg_color,
                    format!("Launched like this, every rank stops before training: {e}"),
                );
            }
        }
        for (what, text) in [
            ("On each machine (torchrun)", shape.torchrun()),
            ("Or as a Slurm job (sbatch)", shape.sbatch()),
        ] {
            ui.horizontal(|ui| {
                ui.label(RichText::new(what).weak());
                if ui.small_button(format!("Copy: {what}")).clicked() {
                    ui.ctx().copy_text(text.clone());
                }
            });
            ui.label(
                RichText::new(text)
                    .monospace()
                    .background_color(ui.visuals().extreme_bg_color),
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::cli_command;

    #[test]
    fn quotes_paths_with_spaces() {
        assert_eq!(
            cli_command("/tmp/run.toml"),
            "tunestudio train --config /tmp/run.toml"
        );
        assert_eq!(
            cli_command("/tmp/my run/run.toml"),
            "tunestudio train --config '/tmp/my run/run.toml'"
        );
    }
}
