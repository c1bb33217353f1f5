//! Model: a local folder or a hub id, resolved (and downloaded) in the
//! background; what the model is.

use std::time::Instant;

use eframe::egui::{self, RichText, Ui};

use tunestudio::train::InitMode;

use crate::gui::action::Action;
use crate::gui::error::JobError;
use crate::gui::jobs::PickTarget;
use crate::gui::session::Session;
use crate::gui::shared::ModelInfo;
use crate::gui::theme;

/// The Model panel: its field and the model it resolved.
#[derive(Debug, Default)]
pub struct ModelPanel {
    /// The text field (folder or hub id).
    pub source_input: String,
    /// The model last resolved.
    pub info: Option<ModelInfo>,
    /// A resolve in flight: when it started.
    pub loading: Option<Instant>,
    /// Bytes in the hub cache folder of the model being downloaded.
    pub download_bytes: Option<u64>,
    /// The last error.
    pub error: Option<JobError>,
    /// Hub models found in the local cache (usable offline).
    pub cached: Vec<String>,
    /// Request sequence number (latest wins).
    pub seq: u64,
}

impl ModelPanel {
    /// Draws the Model panel.
    pub fn show(&mut self, ui: &mut Ui, s: &mut Session, actions: &mut Vec<Action>) {
        let mp = self;
        theme::heading(
            ui,
            "Model",
            "The base model to fine-tune: a local Hugging Face folder or a hub id (downloaded once, then used offline from the cache).",
        );

        source(ui, mp, s, actions);
        recent_and_cached(ui, mp, s, actions);

        let Some(info) = &mp.info else {
            if mp.loading.is_none() && mp.error.is_none() {
                theme::note(ui, "No model loaded yet.");
            }
            return;
        };
        about(ui, info);
    }
}

/// The folder or hub id, the initialisation, and the load in progress or its error.
fn source(ui: &mut Ui, mp: &mut ModelPanel, s: &mut Session, actions: &mut Vec<Action>) {
    theme::card(ui, |ui| {
        egui::Grid::new("model-source").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
            let r = theme::text_row(
                ui,
                "Folder or hub id",
                "A folder with config.json (+ model.safetensors, tokenizer.json), or an id like HuggingFaceTB/SmolLM2-135M",
                &mut mp.source_input,
                "HuggingFaceTB/SmolLM2-135M or /path/to/model",
            );
            if r.lost_focus() && ui.input(|i| i.key_pressed(egui::Key::Enter)) {
                actions.push(Action::LoadModel);
            }
            ui.label("");
            ui.horizontal(|ui| {
                if ui.button("Load").on_hover_text("Resolve the folder or hub id (downloads if not cached)").clicked() {
                    actions.push(Action::LoadModel);
                }
                if ui.button("Browse folder…").clicked() {
                    actions.push(Action::Pick(PickTarget::ModelFolder));
                }
            });
            ui.end_row();
            theme::combo_row(
                ui,
                "model-init",
                "Initialisation",
                "auto: load the weights when the folder has any, random otherwise. random: train from scratch (the demo model).",
                &mut s.config.model.init,
                &[
                    (InitMode::Auto, "auto"),
                    (InitMode::Pretrained, "pretrained weights"),
                    (InitMode::Random, "random (from the seed)"),
                ],
            );
        });

        if let Some(started) = mp.loading {
            ui.horizontal(|ui| {
                ui.add(egui::Spinner::new());
                let secs = started.elapsed().as_secs_f32();
                match mp.download_bytes {
                    Some(b) if b > 0 => ui.label(format!(
                        "downloading… {} so far ({secs:.0} s)",
                        theme::bytes(b)
                    )),
                    _ => ui.label(format!("resolving the model… ({secs:.0} s)")),
                };
            });
        }
        if let Some(e) = &mp.error {
            theme::job_error(ui, "The model could not be loaded", e);
        }
    });
}

/// One-click buttons for recent models and those in the local hub cache.
fn recent_and_cached(ui: &mut Ui, mp: &mut ModelPanel, s: &mut Session, actions: &mut Vec<Action>) {
    if !s.settings.recent_models.is_empty() || !mp.cached.is_empty() {
        theme::section(ui, "Recent and cached models");
        ui.horizontal_wrapped(|ui| {
            let recent = s.settings.recent_models.clone();
            for m in recent.iter().take(8) {
                if ui
                    .button(short(m))
                    .on_hover_text(format!("recent: {m}"))
                    .clicked()
                {
                    mp.source_input = m.clone();
                    actions.push(Action::LoadModel);
                }
            }
            for m in mp.cached.clone() {
                if recent.contains(&m) {
                    continue;
                }
                if ui
                    .button(format!("cached: {m}"))
                    .on_hover_text("in the local Hugging Face cache: loads offline")
                    .clicked()
                {
                    mp.source_input = m.clone();
                    actions.push(Action::LoadModel);
                }
            }
        });
    }
}

/// What the loaded model is: architecture, size, shape, weights, tokenizer, template.
fn about(ui: &mut Ui, info: &ModelInfo) {
    theme::section(ui, "About this model");
    theme::card(ui, |ui| {
        let c = &info.config;
        egui::Grid::new("model-info")
            .num_columns(2)
            .spacing([24.0, 6.0])
            .striped(true)
            .show(ui, |ui| {
                row(ui, "Folder", &info.dir.display().to_string());
                row(
                    ui,
                    "Architecture",
                    &format!("{:?} ({})", c.architecture, c.architecture.model_type()),
                );
                row(
                    ui,
                    "Parameters",
                    &format!(
                        "{} ({})",
                        theme::params(info.parameters),
                        theme::count(info.parameters)
                    ),
                );
                row(
                    ui,
                    "Checkpoint dtype",
                    info.dtype.as_deref().unwrap_or("not stated"),
                );
                row(ui, "Vocabulary", &theme::count(c.vocab_size as u64));
                row(
                    ui,
                    "Context length",
                    &format!("{} tokens", theme::count(c.max_position_embeddings as u64)),
                );
                row(
                    ui,
                    "Shape",
                    &format!(
                        "{} layers · hidden {} · MLP {} · {} heads ({} key/value) × {}",
                        c.num_hidden_layers,
                        c.hidden_size,
                        c.intermediate_size,
                        c.num_attention_heads,
                        c.num_key_value_heads,
                        c.head_dim
                    ),
                );
                row(
                    ui,
                    "Weights",
                    &if info.weight_files.is_empty() {
                        "none in the folder — random initialisation only".to_string()
                    } else {
                        format!(
                            "{} file(s), {}",
                            info.weight_files.len(),
                            theme::bytes(info.weight_bytes)
                        )
                    },
                );
                row(
                    ui,
                    "Tokenizer",
                    if info.has_tokenizer {
                        "tokenizer.json"
                    } else {
                        "missing"
                    },
                );
                row(
                    ui,
                    "Chat template",
                    &match &info.chat_template {
                        Some(origin) => format!("yes ({origin})"),
                        None => "no — chat data uses the built-in ChatML fallback".into(),
                    },
                );
            });
    });
}

fn row(ui: &mut Ui, key: &str, value: &str) {
    ui.label(RichText::new(key).weak());
    ui.add(egui::Label::new(value).wrap());
    ui.end_row();
}

/// The last two path components of a long source.
fn short(s: &str) -> String {
    let parts: Vec<&str> = s.trim_end_matches('/').rsplit('/').take(2).collect();
    if parts.len() == 2 && s.starts_with('/') {
        format!("…/{}/{}", parts[1], parts[0])
    } else {
        s.to_string()
    }
}
