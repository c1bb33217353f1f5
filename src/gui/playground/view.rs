//! Drawing the Playground: the two sides' pickers, the prompt and sampling settings, the
//! answers, the prompt list and the export row. Nothing here blocks or touches files: the
//! checkpoint list comes from a job ([`PgAction::RefreshCheckpoints`]).

use eframe::egui::{self, RichText, Ui};

use super::{PgAction, PgPick, PlaygroundSide, PlaygroundState, SideSource, SIDE_NAMES};
use crate::gui::action::Action;
use crate::gui::session::Session;
use crate::gui::shared::PanelContext;
use crate::gui::theme;

fn push(actions: &mut Vec<Action>, a: PgAction) {
    actions.push(Action::Playground(a));
}

impl PlaygroundState {
    /// Draws the Playground panel.
    pub fn show(&mut self, ui: &mut Ui, s: &Session, cx: &PanelContext, actions: &mut Vec<Action>) {
        theme::heading(
            ui,
            "Playground",
            "Ask two models the same prompt and compare the answers side by side.",
        );
        let pg = self;
        refresh_checkpoints(pg, s, cx, actions);
        let run_source = s.config.model.source.clone();

        ui.columns(2, |cols| {
            for (i, ui) in cols.iter_mut().enumerate() {
                side_picker(ui, i, pg, &run_source, actions);
            }
        });
        ask(ui, pg);
        sampling(ui, pg);
        generate_row(ui, pg, actions);

        ui.add_space(6.0);
        ui.columns(2, |cols| {
            for (i, ui) in cols.iter_mut().enumerate() {
                answer(ui, i, &pg.sides[i]);
            }
        });

        prompt_list(ui, pg, actions);
        export_row(ui, pg, actions);
    }
}

/// Asks a job to list the run's checkpoints when the output folder or the run's last
/// checkpoint changed (or the panel was opened again).
fn refresh_checkpoints(
    pg: &mut PlaygroundState,
    s: &Session,
    cx: &PanelContext,
    actions: &mut Vec<Action>,
) {
    let out = s.output_dir();
    let key = format!("{}|{:?}", out.display(), cx.last_checkpoint);
    if pg.checkpoints_key.as_deref() != Some(key.as_str()) {
        pg.checkpoints_key = Some(key);
        push(actions, PgAction::RefreshCheckpoints(out));
    }
}

/// The chat switch, the system prompt and the prompt.
fn ask(ui: &mut Ui, pg: &mut PlaygroundState) {
    theme::section(ui, "Ask both sides");
    let chat_ok = pg.chat_available();
    ui.horizontal(|ui| {
        let r = ui
            .add_enabled(chat_ok, egui::Checkbox::new(&mut pg.chat, "Chat"))
            .on_hover_text("Format the prompt with the models' chat template")
            .on_disabled_hover_text("Only when every loaded model has a chat template");
        let _ = r;
        if !chat_ok {
            ui.label(
                RichText::new("completion (no chat template)")
                    .small()
                    .weak(),
            );
        }
    });
    if pg.chat {
        egui::Grid::new("pg-system").num_columns(2).show(ui, |ui| {
            theme::text_row(
                ui,
                "System prompt",
                "Put first in the conversation (empty: the template's default)",
                &mut pg.system,
                "You are a helpful assistant.",
            );
        });
    }
    let l = ui.label("Prompt");
    ui.add(
        egui::TextEdit::multiline(&mut pg.prompt)
            .desired_rows(3)
            .desired_width(f32::INFINITY)
            .hint_text("Write a haiku about gradient descent."),
    )
    .labelled_by(l.id);
}

/// The sampling settings.
fn sampling(ui: &mut Ui, pg: &mut PlaygroundState) {
    egui::CollapsingHeader::new("Sampling")
        .default_open(true)
        .show(ui, |ui| {
            egui::Grid::new("pg-sampling")
                .num_columns(4)
                .show(ui, |ui| {
                    let p = &mut pg.params;
                    theme::drag_row(
                        ui,
                        "Max new tokens",
                        "Most tokens each side generates",
                        &mut p.max_new_tokens,
                        0..=100_000,
                        1.0,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Temperature",
                        "0 = greedy (always the most likely token)",
                        &mut p.temperature,
                        0.0..=5.0,
                        0.01,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Top-p",
                        "Nucleus sampling (1 = off)",
                        &mut p.top_p,
                        0.01..=1.0,
                        0.01,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Top-k",
                        "Keep the k most likely tokens (0 = off)",
                        &mut p.top_k,
                        0..=100_000,
                        1.0,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Repetition penalty",
                        "1 = off, 1.1 is typical",
                        &mut p.repetition_penalty,
                        0.01..=10.0,
                        0.01,
                        "",
                    );
                    theme::drag_row(
                        ui,
                        "Seed",
                        "Same seed, same settings: same answer",
                        &mut p.seed,
                        0..=u64::MAX,
                        1.0,
                        "",
                    );
                    theme::check_row(
                        ui,
                        "Stop at end of sequence",
                        "Turn off to always generate the maximum number of tokens",
                        &mut p.stop_on_eos,
                        "stop at EOS",
                    );
                });
        });
}

/// Generate and Cancel, and what went wrong.
fn generate_row(ui: &mut Ui, pg: &PlaygroundState, actions: &mut Vec<Action>) {
    ui.horizontal(|ui| {
        let generating = pg.generating();
        let can = !generating && pg.sides.iter().any(|sd| sd.generator.is_some());
        if ui
            .add_enabled(
                can,
                egui::Button::new(RichText::new("Generate").strong())
                    .min_size(egui::vec2(100.0, 30.0)),
            )
            .on_hover_text("Answer the prompt on both sides")
            .on_disabled_hover_text("Load a model on at least one side first")
            .clicked()
        {
            push(actions, PgAction::Generate);
        }
        if ui
            .add_enabled(
                generating,
                egui::Button::new("Cancel").min_size(egui::vec2(90.0, 30.0)),
            )
            .on_hover_text("Stop both sides (and the batch)")
            .clicked()
        {
            push(actions, PgAction::Cancel);
        }
        if generating {
            ui.add(egui::Spinner::new());
        }
    });
    if let Some(e) = &pg.error {
        theme::job_error(ui, "Cannot generate", e);
    }
    if let Some(m) = &pg.message {
        ui.label(RichText::new(m).color(theme::ACCENT));
    }
}

/// The prompt list: load, take from validation, run, and the batch table.
fn prompt_list(ui: &mut Ui, pg: &mut PlaygroundState, actions: &mut Vec<Action>) {
    theme::section(ui, "Prompt list");
    ui.horizontal(|ui| {
        if ui
            .button("Load prompts…")
            .on_hover_text(".txt: one prompt per line; .jsonl: `prompt` / `instruction` per line")
            .clicked()
        {
            // Until the chosen list is read (a cancelled dialog says so).
            pg.prompts_loading = true;
            actions.push(Action::PlaygroundPick(PgPick::Prompts));
        }
        let l = ui.label("Validation prompts");
        ui.add(egui::DragValue::new(&mut pg.validation_count).range(1..=1000))
            .labelled_by(l.id);
        if ui
            .button("Take from validation")
            .on_hover_text("The first prompts of the run's validation split")
            .clicked()
        {
            push(actions, PgAction::ValidationPrompts);
        }
        let can_batch = !pg.batch_prompts.is_empty() && !pg.generating();
        if ui
            .add_enabled(can_batch, egui::Button::new("Run batch"))
            .on_hover_text("Answer every prompt of the list on both sides")
            .clicked()
        {
            push(actions, PgAction::RunBatch);
        }
        if pg.prompts_loading {
            ui.add(egui::Spinner::new());
        }
        ui.label(format!("{} prompt(s)", pg.batch_prompts.len()));
        if let Some(i) = pg.batch_next {
            ui.label(format!("answering {}/{}", i + 1, pg.batch_prompts.len()));
        }
    });
    if !pg.batch_rows.is_empty() {
        batch_table(ui, pg);
    }
}

/// Where the comparison goes.
fn export_row(ui: &mut Ui, pg: &mut PlaygroundState, actions: &mut Vec<Action>) {
    ui.horizontal(|ui| {
        let l = ui.label("Export file");
        ui.add(
            egui::TextEdit::singleline(&mut pg.export_path)
                .hint_text("comparison.jsonl")
                .desired_width(320.0),
        )
        .labelled_by(l.id);
        if ui
            .button("Choose…")
            .on_hover_text("Choose the export file")
            .clicked()
        {
            actions.push(Action::PlaygroundPick(PgPick::Export));
        }
        if ui
            .button("Export comparison")
            .on_hover_text("Write prompt, left, right and the settings as JSON lines")
            .clicked()
        {
            push(actions, PgAction::Export);
        }
    });
}

fn side_picker(
    ui: &mut Ui,
    i: usize,
    pg: &mut PlaygroundState,
    run_source: &str,
    actions: &mut Vec<Action>,
) {
    let name = SIDE_NAMES[i];
    theme::card(ui, |ui| {
        ui.label(RichText::new(name).strong());
        let checkpoints = &pg.checkpoints;
        let sd = &mut pg.sides[i];
        egui::Grid::new(("pg-side", i))
            .num_columns(2)
            .show(ui, |ui| {
                theme::combo_row(
                    ui,
                    &format!("pg-source-{i}"),
                    &format!("{name} source"),
                    "Where this side's model comes from",
                    &mut sd.source,
                    &[
                        (SideSource::RunModel, "Run model"),
                        (SideSource::Checkpoint, "Run checkpoint"),
                        (SideSource::Folder, "Model folder"),
                        (SideSource::Gguf, "GGUF file"),
                    ],
                );
                match sd.source {
                    SideSource::RunModel => {
                        ui.label("Model");
                        ui.label(RichText::new(run_source).monospace());
                        ui.end_row();
                    }
                    SideSource::Checkpoint => checkpoint_row(ui, i, sd, checkpoints, actions),
                    SideSource::Folder => path_row(
                        ui,
                        &format!("{name} model"),
                        &mut sd.folder,
                        ("model folder or org/name", "model"),
                        PgPick::Folder(i),
                        actions,
                    ),
                    SideSource::Gguf => path_row(
                        ui,
                        &format!("{name} GGUF"),
                        &mut sd.folder,
                        ("a .gguf file (tunestudio's or llama.cpp's)", "GGUF file"),
                        PgPick::Gguf(i),
                        actions,
                    ),
                }
                if matches!(sd.source, SideSource::RunModel | SideSource::Folder) {
                    path_row(
                        ui,
                        &format!("{name} adapter"),
                        &mut sd.adapter,
                        ("optional PEFT adapter folder", "adapter"),
                        PgPick::Adapter(i),
                        actions,
                    );
                }
            });
        load_row(ui, i, sd, actions);
    });
}

/// A labelled path field with its "Choose…" button; `(hint, what)` are the field's hint
/// and the noun of the button's tooltip.
fn path_row(
    ui: &mut Ui,
    label: &str,
    text: &mut String,
    (hint, what): (&str, &str),
    target: PgPick,
    actions: &mut Vec<Action>,
) {
    let l = ui.label(label);
    let side = label.split(' ').next().unwrap_or_default();
    ui.horizontal(|ui| {
        ui.add(
            egui::TextEdit::singleline(text)
                .hint_text(hint)
                .desired_width(240.0),
        )
        .labelled_by(l.id);
        if ui
            .button("Choose…")
            .on_hover_text(format!("Choose the {side} {what} folder"))
            .clicked()
        {
            actions.push(Action::PlaygroundPick(target));
        }
    });
    ui.end_row();
}

/// The checkpoint field, the run's checkpoints to choose from, and "Choose…".
fn checkpoint_row(
    ui: &mut Ui,
    i: usize,
    sd: &mut PlaygroundSide,
    checkpoints: &[(u64, std::path::PathBuf)],
    actions: &mut Vec<Action>,
) {
    let name = SIDE_NAMES[i];
    let l = ui.label(format!("{name} checkpoint"));
    ui.horizontal(|ui| {
        ui.add(
            egui::TextEdit::singleline(&mut sd.checkpoint)
                .hint_text("latest checkpoint of the run")
                .desired_width(200.0),
        )
        .labelled_by(l.id);
        let current = if sd.checkpoint.is_empty() {
            "latest".to_string()
        } else {
            "…".to_string()
        };
        egui::ComboBox::from_id_salt(("pg-ck", i))
            .selected_text(current)
            .width(80.0)
            .show_ui(ui, |ui| {
                for (step, dir) in checkpoints {
                    if ui.selectable_label(false, format!("step {step}")).clicked() {
                        sd.checkpoint = dir.display().to_string();
                    }
                }
            })
            .response
            .labelled_by(l.id);
        if ui
            .button("Choose…")
            .on_hover_text(format!("Choose the {name} checkpoint folder"))
            .clicked()
        {
            actions.push(Action::PlaygroundPick(PgPick::Checkpoint(i)));
        }
    });
    ui.end_row();
}

/// "Load", what is loaded, and why it could not be.
fn load_row(ui: &mut Ui, i: usize, sd: &PlaygroundSide, actions: &mut Vec<Action>) {
    let name = SIDE_NAMES[i];
    ui.horizontal(|ui| {
        let loading = sd.loading.is_some();
        if ui
            .add_enabled(
                !loading && !sd.generating(),
                egui::Button::new(format!("Load {name}")),
            )
            .on_hover_text("Load this side's model in the background")
            .clicked()
        {
            push(actions, PgAction::Load(i));
        }
        if loading {
            ui.add(egui::Spinner::new());
            ui.label("loading…");
        } else if sd.generator.is_some() {
            ui.label(RichText::new(format!("loaded: {}", sd.loaded_name)).color(theme::OK));
        } else if sd.load_error.is_none() {
            ui.label(RichText::new("not loaded").weak());
        }
    });
    if let Some(e) = &sd.load_error {
        theme::job_error(ui, &format!("{name} could not be loaded"), e);
    }
}

fn answer(ui: &mut Ui, i: usize, sd: &PlaygroundSide) {
    let name = SIDE_NAMES[i];
    theme::card(ui, |ui| {
        ui.horizontal(|ui| {
            ui.label(RichText::new(format!("{name} answer")).strong());
            let o = &sd.output;
            let mut info = format!("{} tokens", o.tokens);
            if let Some(r) = o.rate() {
                info.push_str(&format!(" · {r:.1} tok/s"));
            }
            if let Some(r) = &o.stop_reason {
                info.push_str(&format!(" · {r}"));
            } else if sd.generating() {
                info.push_str(" · generating");
            }
            ui.label(RichText::new(info).small().weak());
        });
        if let Some(e) = &sd.output.error {
            theme::error_box(ui, &format!("{name} failed"), e);
        }
        let font = egui::TextStyle::Monospace.resolve(ui.style());
        let color = ui.visuals().text_color();
        crate::gui::text::bidi_label(ui, &sd.output.text, font, color);
    });
}

fn batch_table(ui: &mut Ui, pg: &PlaygroundState) {
    egui::Grid::new("pg-batch")
        .num_columns(3)
        .striped(true)
        .max_col_width(360.0)
        .show(ui, |ui| {
            ui.label(RichText::new("Batch prompt").strong());
            ui.label(RichText::new(format!("Left: {}", pg.sides[0].loaded_name)).strong());
            ui.label(RichText::new(format!("Right: {}", pg.sides[1].loaded_name)).strong());
            ui.end_row();
            for r in &pg.batch_rows {
                let body = egui::TextStyle::Body.resolve(ui.style());
                let mono = egui::TextStyle::Monospace.resolve(ui.style());
                let color = ui.visuals().text_color();
                // Each cell in its own column-wide scope, so a right-to-left answer is
                // right-aligned within its column.
                for (text, font) in [(&r.prompt, body), (&r.left, mono.clone()), (&r.right, mono)] {
                    ui.vertical(|ui| {
                        ui.set_max_width(360.0);
                        crate::gui::text::bidi_label(ui, text, font, color);
                    });
                }
                ui.end_row();
            }
        });
}
