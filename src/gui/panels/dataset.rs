//! Dataset: files, a folder or a hub id; the detected format, the column
//! mapping, and how rows split into training and validation.

use eframe::egui::{self, RichText, Ui};

use tunestudio::data::{Format, TxtSplit};

use crate::gui::action::Action;
use crate::gui::error::JobError;
use crate::gui::jobs::PickTarget;
use crate::gui::session::Session;
use crate::gui::shared::DatasetSummary;
use crate::gui::theme;

/// The Dataset panel: its field and what the scan found.
#[derive(Debug, Default)]
pub struct DatasetPanel {
    /// The text field (file, folder or hub id).
    pub path_input: String,
    /// The last summary.
    pub summary: Option<DatasetSummary>,
    /// The last error.
    pub error: Option<JobError>,
    /// Whether a scan is in flight.
    pub loading: bool,
    /// Request sequence number.
    pub seq: u64,
    /// The settings key of the last scan.
    pub key: String,
    /// A new dataset was chosen: take `max_length` from its lengths when its preview arrives.
    pub propose_max_length: bool,
}

impl DatasetPanel {
    /// Draws the Dataset panel.
    pub fn show(&mut self, ui: &mut Ui, s: &mut Session, actions: &mut Vec<Action>) {
        let dp = self;
        theme::heading(
            ui,
            "Dataset",
            "JSON, JSONL, CSV, Parquet or text files, a folder of them, or a hub dataset id. The format is detected from the first row.",
        );

        source(ui, dp, s, actions);
        format_and_columns(ui, dp, s);
        split_and_labels(ui, s, actions);
    }
}

/// Where the rows come from: the path or hub id, recent datasets, and what was read.
fn source(ui: &mut Ui, dp: &mut DatasetPanel, s: &mut Session, actions: &mut Vec<Action>) {
    theme::card(ui, |ui| {
        egui::Grid::new("data-source")
            .num_columns(2)
            .spacing([12.0, 8.0])
            .show(ui, |ui| {
                let r = theme::text_row(
                    ui,
                    "File, folder or hub id",
                    "Relative paths resolve against the run config's folder",
                    &mut dp.path_input,
                    "data/train.jsonl or org/dataset",
                );
                if r.lost_focus() && ui.input(|i| i.key_pressed(egui::Key::Enter)) {
                    actions.push(Action::ScanDataset);
                }
                ui.label("");
                ui.horizontal(|ui| {
                    if ui
                        .button("Open")
                        .on_hover_text("Read the dataset and detect its format")
                        .clicked()
                    {
                        actions.push(Action::ScanDataset);
                    }
                    if ui.button("Browse file…").clicked() {
                        actions.push(Action::Pick(PickTarget::DatasetFile));
                    }
                    if ui.button("Browse folder…").clicked() {
                        actions.push(Action::Pick(PickTarget::DatasetFolder));
                    }
                });
                ui.end_row();
            });
        if !s.settings.recent_datasets.is_empty() {
            ui.horizontal_wrapped(|ui| {
                ui.label(RichText::new("Recent:").weak());
                for d in s.settings.recent_datasets.clone().iter().take(6) {
                    let name = std::path::Path::new(d)
                        .file_name()
                        .map(|n| n.to_string_lossy().to_string())
                        .unwrap_or_else(|| d.clone());
                    if ui.small_button(name).on_hover_text(d.as_str()).clicked() {
                        dp.path_input = d.clone();
                        actions.push(Action::ScanDataset);
                    }
                }
            });
        }
        if dp.loading {
            ui.horizontal(|ui| {
                ui.add(egui::Spinner::new());
                ui.label("reading the dataset…");
            });
        }
        if let Some(e) = &dp.error {
            theme::job_error(ui, "The dataset could not be read", e);
        }
        if let Some(sum) = &dp.summary {
            ui.add_space(4.0);
            ui.label(
                RichText::new(format!(
                    "{} rows → {} training / {} validation",
                    theme::count(sum.num_rows as u64),
                    theme::count(sum.train_rows as u64),
                    theme::count(sum.validation_rows as u64)
                ))
                .strong(),
            );
            let detected = match (sum.preference, sum.detected) {
                (Some(p), _) => format!("{} (preference pairs: DPO or ORPO)", p.name()),
                (None, Some(f)) => f.name().to_string(),
                (None, None) => "not recognised".to_string(),
            };
            ui.label(
                RichText::new(format!(
                    "detected format: {detected}   ·   files: {}",
                    sum.files.join(", ")
                ))
                .weak(),
            );
        }
    });
}

/// The format (auto names what it detected), its column names, and the first row.
fn format_and_columns(ui: &mut Ui, dp: &mut DatasetPanel, s: &mut Session) {
    theme::section(ui, "Format and columns");
    theme::card(ui, |ui| {
        egui::Grid::new("data-format").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
            // "auto" names what it detected, so the box always shows the format in use.
            let detected = dp.summary.as_ref().and_then(|d| d.detected);
            let pairs = dp.summary.as_ref().and_then(|d| d.preference);
            let auto = match (pairs, detected) {
                (Some(p), _) => format!("auto ({} pairs)", p.name()),
                (None, Some(f)) => format!("auto ({})", f.name()),
                (None, None) => "auto-detect".to_string(),
            };
            let mut choices: Vec<(Format, &str)> = vec![(Format::Auto, auto.as_str())];
            choices.extend(Format::ALL.iter().map(|f| (*f, f.name())));
            theme::combo_row(
                ui,
                "data-format-combo",
                "Format",
                "How rows become training text. alpaca/chat/sharegpt render through the chat template; text trains every token.",
                &mut s.config.data.format,
                &choices,
            );
            let format = match s.config.data.format {
                Format::Auto => dp.summary.as_ref().and_then(|d| d.detected).unwrap_or(Format::Auto),
                f => f,
            };
            let cols = &mut s.config.data.columns;
            let fields: Vec<(&str, &str, &mut Option<String>)> = match format {
                Format::Text => vec![("Text column", "text", &mut cols.text)],
                Format::Alpaca => vec![
                    ("Instruction column", "instruction", &mut cols.prompt),
                    ("Input column", "input", &mut cols.input),
                    ("Output column", "output", &mut cols.completion),
                    ("System column", "system", &mut cols.system),
                    ("History column", "history", &mut cols.history),
                ],
                Format::PromptCompletion => vec![
                    ("Prompt column", "prompt", &mut cols.prompt),
                    ("Completion column", "completion", &mut cols.completion),
                ],
                Format::Chat | Format::LlamaFactoryV1 => vec![
                    ("Messages column", "messages", &mut cols.messages),
                    ("System column", "system", &mut cols.system),
                ],
                Format::ShareGpt => vec![
                    ("Conversations column", "conversations", &mut cols.messages),
                    ("System column", "system", &mut cols.system),
                ],
                Format::Pretokenized | Format::Auto => Vec::new(),
            };
            for (label, default, value) in fields {
                option_text_row(ui, label, default, value);
            }
        });
        if let Some(sum) = &dp.summary {
            if !sum.columns.is_empty() {
                ui.horizontal_wrapped(|ui| {
                    ui.label(RichText::new("Columns in the first row:").weak());
                    for c in &sum.columns {
                        ui.label(
                            RichText::new(c)
                                .monospace()
                                .background_color(ui.visuals().faint_bg_color),
                        );
                    }
                });
            }
            if !sum.first_row.is_empty() {
                egui::CollapsingHeader::new("First row").show(ui, |ui| {
                    let font =
                        egui::FontId::monospace(egui::TextStyle::Small.resolve(ui.style()).size);
                    let color = ui.visuals().text_color();
                    crate::gui::text::bidi_label(ui, &sum.first_row, font, color);
                });
            }
        }
    });
}

/// The validation split, which tokens train, and how text files become documents.
fn split_and_labels(ui: &mut Ui, s: &mut Session, actions: &mut Vec<Action>) {
    theme::section(ui, "Split and labels");
    theme::card(ui, |ui| {
        egui::Grid::new("data-split").num_columns(2).spacing([12.0, 8.0]).show(ui, |ui| {
            let d = &mut s.config.data;
            theme::drag_row(
                ui,
                "Validation share",
                "Fraction of rows held out to measure eval loss (seeded). 0 = no validation. Ignored when a validation file is set.",
                &mut d.validation_ratio,
                0.0..=0.5,
                0.005,
                "",
            );
            let mut v = d.validation_path.clone().unwrap_or_default();
            let r = theme::text_row(
                ui,
                "Validation file",
                "A separate validation file or folder (optional)",
                &mut v,
                "none",
            );
            if r.changed() {
                d.validation_path = (!v.trim().is_empty()).then(|| v.trim().to_string());
            }
            ui.label("");
            if ui.small_button("Browse validation file…").clicked() {
                actions.push(Action::Pick(PickTarget::ValidationFile));
            }
            ui.end_row();
            theme::drag_row(
                ui,
                "Split seed",
                "Seed of the validation split and the shuffling",
                &mut d.seed,
                0..=u64::MAX,
                1.0,
                "",
            );
            let mut mask = match d.train_on_completions_only {
                None => 0u8,
                Some(true) => 1,
                Some(false) => 2,
            };
            if theme::combo_row(
                ui,
                "data-mask",
                "Train on",
                "Completions only masks the prompt (label −100) so the model learns to answer, not to repeat questions. Auto: on for instruction/chat data, off for plain text.",
                &mut mask,
                &[(0, "auto"), (1, "completions only"), (2, "every token")],
            ) {
                d.train_on_completions_only = match mask {
                    1 => Some(true),
                    2 => Some(false),
                    _ => None,
                };
            }
            theme::combo_row(
                ui,
                "data-txt",
                "Text files split",
                "How .txt files become documents",
                &mut d.txt_split,
                &[
                    (TxtSplit::Auto, "auto"),
                    (TxtSplit::PerFile, "one document per file"),
                    (TxtSplit::BlankLine, "split at blank lines"),
                ],
            );
        });
        ui.add_space(4.0);
        if ui.button("Show the token preview").clicked() {
            actions.push(Action::Goto(crate::gui::session::Panel::Preview));
        }
    });
}

/// A text field for an optional column name; empty means the format's default.
fn option_text_row(ui: &mut Ui, label: &str, default: &str, value: &mut Option<String>) {
    let mut text = value.clone().unwrap_or_default();
    let r = theme::text_row(
        ui,
        label,
        &format!("Empty: the default column `{default}`"),
        &mut text,
        default,
    );
    if r.changed() {
        *value = (!text.trim().is_empty()).then(|| text.trim().to_string());
    }
}
