//! UI tests: egui_kittest drives the real app (the same `StudioApp` eframe
//! runs) against the real library — the bundled demo model, tokenizer and
//! data, the real planner and the real trainer.

use std::path::Path;
use std::time::{Duration, Instant};

use eframe::egui;
use egui_kittest::kittest::{NodeT, Queryable};
use egui_kittest::Harness;

use super::app::{StartOptions, StudioApp};
use super::state::{Panel, RunPhase};
use tunestudio::train::FinishReason;

/// The app on the demo project, output going to `out`.
fn harness(panel: Panel, out: &Path) -> Harness<'static, StudioApp> {
    let opts = StartOptions {
        fresh: true,
        panel: Some(panel),
        output_dir: Some(out.to_path_buf()),
        ..StartOptions::default()
    };
    Harness::builder()
        .with_size(egui::vec2(1360.0, 860.0))
        // Dataset text is arbitrary (the demo has emoji): the app draws tofu for glyphs no
        // installed font has, as it does outside tests.
        .allow_missing_glyphs()
        .build_eframe(move |cc| StudioApp::new(cc, opts))
}

/// Steps frames (sleeping between them so background threads progress) until
/// `cond` holds; panics with `what` after `timeout`.
fn wait_for(
    h: &mut Harness<'static, StudioApp>,
    what: &str,
    timeout: Duration,
    cond: impl Fn(&StudioApp) -> bool,
) {
    let start = Instant::now();
    loop {
        h.step();
        if cond(h.state()) {
            break;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(15));
    }
    // A couple more frames so the UI shows what the state now holds.
    h.step();
    h.step();
}

/// Steps until no job is in flight and the preview and plan are ready.
fn wait_ready(h: &mut Harness<'static, StudioApp>) {
    wait_for(h, "the demo to load", Duration::from_secs(90), |a| {
        a.jobs.in_flight() == 0
            && a.state.preview.preview.is_some()
            && a.state.plan.plan.is_some()
            && a.state.devices.inventory.is_some()
    });
}

/// Waits for background jobs (their spinners repaint continuously), then lets the UI settle.
fn settle(h: &mut Harness<'static, StudioApp>) {
    wait_for(h, "background jobs", Duration::from_secs(60), |a| {
        a.jobs.in_flight() == 0 && a.state.model.loading.is_none()
    });
    h.run();
}

fn click_nav(h: &mut Harness<'static, StudioApp>, panel: Panel) {
    let i = Panel::ALL.iter().position(|p| *p == panel).unwrap_or(0);
    h.get_by_label(&format!("{}  {}", i + 1, panel.title()))
        .click();
    h.step();
    h.step();
    assert_eq!(h.state().state.panel, panel);
}

/// Input roles: what a user types into, toggles, picks from or drags.
fn is_input(role: egui::accesskit::Role) -> bool {
    use egui::accesskit::Role;
    matches!(
        role,
        Role::TextInput
            | Role::MultilineTextInput
            | Role::SearchInput
            | Role::SpinButton
            | Role::Slider
            | Role::ComboBox
            | Role::EditableComboBox
            | Role::CheckBox
            | Role::RadioButton
            | Role::Switch
            | Role::Button
            | Role::NumberInput
    )
}

/// Walks the accesskit tree; returns every input widget without an accessible name.
fn unlabelled_inputs<S>(h: &Harness<'_, S>) -> Vec<String> {
    h.root()
        .children_recursive()
        .map(|n| n.accesskit_node())
        .filter(|n| is_input(n.role()) && !n.is_hidden())
        .filter(|n| n.label().is_none_or(|l| l.trim().is_empty()))
        .map(|n| {
            format!(
                "{:?} at {:?} (value {:?})",
                n.role(),
                n.raw_bounds(),
                n.value()
            )
        })
        .collect()
}

#[test]
fn demo_preview_shows_trained_and_masked_tokens() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Preview, out.path());
    wait_ready(&mut h);
    let p = h.state().state.preview.preview.clone().expect("preview");
    assert!(!p.rows.is_empty());
    // The chips on screen carry their class in their accessible name.
    let trained = h.query_all_by_label_contains("(trained, id").count();
    let masked = h.query_all_by_label_contains("(masked, id").count();
    assert!(trained > 0, "no trained token chip on screen");
    assert!(
        masked > 0,
        "no masked token chip on screen (the demo masks prompts)"
    );
    // The legend states the counts.
    assert!(h.query_by_label_contains("trained: ").is_some());
    h.run();

    // Next batch: the navigator re-tokenises in the background.
    let before = p.rows[0].index;
    h.get_by_label("Next ▶").click();
    wait_for(&mut h, "the next rows", Duration::from_secs(60), |a| {
        a.state
            .preview
            .preview
            .as_ref()
            .is_some_and(|p| p.rows[0].index != before)
    });
}

#[test]
fn precision_change_changes_the_planned_memory() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Training, out.path());
    wait_ready(&mut h);
    let peak = |a: &StudioApp| {
        a.state
            .plan
            .plan
            .as_ref()
            .map(|p| p.per_device[0].peak_bytes)
    };
    let before = peak(h.state()).expect("plan");
    assert_eq!(h.state().state.config.training.precision.name(), "fp32");

    h.get_by_label("Precision").click();
    h.run();
    h.get_by_label("bf16-mixed").click();
    h.step();
    settle(&mut h);
    assert_eq!(
        h.state().state.config.training.precision.name(),
        "bf16-mixed"
    );
    wait_for(&mut h, "a new plan", Duration::from_secs(30), |a| {
        a.jobs.in_flight() == 0 && peak(a).is_some_and(|p| p != before)
    });
    let after = peak(h.state()).expect("plan");
    println!("planned peak: fp32 {before} B → bf16-mixed {after} B");

    // The GPUs & memory panel shows the bar for it.
    click_nav(&mut h, Panel::Devices);
    settle(&mut h);
    assert!(h.query_by_label_contains("memory of CPU").is_some());
}

#[test]
fn training_runs_pauses_and_stops_with_frame_times() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Run, out.path());
    wait_ready(&mut h);
    h.get_by_label("Start").click();
    h.step();
    let frames_before = h.state().state.frames.frames;
    wait_for(&mut h, "loss points", Duration::from_secs(180), |a| {
        a.state.run.loss.len() >= 3
    });
    let stats = h.state().state.frames.clone();
    println!(
        "frame time while training ({} frames): {}",
        stats.frames - frames_before,
        stats.summary()
    );
    // The UI thread only drains channels and draws: a frame stays far below a 60 Hz budget
    // even in this unoptimised test build on a shared CPU.
    assert!(
        stats.mean_ms() < 100.0,
        "frames too slow while training: {}",
        stats.summary()
    );

    h.get_by_label("Pause").click();
    wait_for(&mut h, "the pause", Duration::from_secs(60), |a| {
        a.state.run.phase == RunPhase::Paused
    });
    let paused_at = h.state().state.run.step;
    h.get_by_label("Stop").click();
    wait_for(&mut h, "the stop", Duration::from_secs(60), |a| {
        matches!(a.state.run.phase, RunPhase::Finished(_))
    });
    let r = &h.state().state.run;
    assert_eq!(r.phase, RunPhase::Finished(FinishReason::Stopped));
    assert_eq!(r.step, paused_at, "no step ran after the pause");
    assert!(r.loss.iter().all(|p| p[1].is_finite()));
    assert!(
        out.path().join("metrics.jsonl").is_file(),
        "metrics.jsonl written to the output folder"
    );
    // The log reports it, and Start is enabled again.
    assert!(h.query_all_by_label_contains("stopped at step").count() > 0);
}

#[test]
fn malformed_dataset_shows_its_error_without_crashing() {
    let out = tempfile::tempdir().expect("tempdir");
    let bad = out.path().join("broken.json");
    std::fs::write(&bad, "[{\"instruction\": \"hi\", \"output\": ").expect("write");
    let mut h = harness(Panel::Dataset, out.path());
    wait_ready(&mut h);

    let field = h.get_by_label("File, folder or hub id");
    field.focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label("File, folder or hub id")
        .type_text(&bad.display().to_string());
    h.step();
    h.get_by_label("Open").click();
    wait_for(&mut h, "the dataset error", Duration::from_secs(30), |a| {
        a.state.dataset.error.is_some() && a.jobs.in_flight() == 0
    });
    let err = h.state().state.dataset.error.clone().unwrap_or_default();
    assert!(
        err.contains("broken.json"),
        "the error names the file: {err}"
    );
    assert!(h.query_by_label_contains("could not be read").is_some());
    // The preview reports it too, and the app keeps running.
    click_nav(&mut h, Panel::Preview);
    wait_for(&mut h, "the preview error", Duration::from_secs(30), |a| {
        a.state.preview.error.is_some()
    });
    h.run();
}

#[test]
fn every_input_widget_has_an_accessible_label() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Model, out.path());
    wait_ready(&mut h);
    let mut problems = Vec::new();
    for p in Panel::ALL {
        click_nav(&mut h, p);
        settle(&mut h);
        for w in unlabelled_inputs(&h) {
            problems.push(format!("{}: {w}", p.title()));
        }
        // The walker is not vacuous: every panel has labelled inputs.
        let inputs = h
            .root()
            .children_recursive()
            .filter(|n| is_input(n.accesskit_node().role()))
            .count();
        assert!(
            inputs > 3,
            "{}: only {inputs} input widgets found",
            p.title()
        );
    }
    // LoRA settings only appear when LoRA is on.
    click_nav(&mut h, Panel::Training);
    h.get_by_label("LoRA").click();
    h.step();
    settle(&mut h);
    assert!(h.state().state.config.lora.enabled);
    problems.extend(
        unlabelled_inputs(&h)
            .into_iter()
            .map(|w| format!("Training (LoRA): {w}")),
    );
    assert!(
        problems.is_empty(),
        "input widgets without a label:\n{}",
        problems.join("\n")
    );
}

#[test]
fn auto_fit_applies_settings_that_fit_a_small_device() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Devices, out.path());
    wait_ready(&mut h);
    // A device too small for the demo as configured: 96 MiB.
    h.state_mut().state.config.devices.devices = vec!["cpu:96MiB".into()];
    wait_for(
        &mut h,
        "an out-of-memory plan",
        Duration::from_secs(30),
        |a| a.jobs.in_flight() == 0 && a.state.plan.plan.as_ref().is_some_and(|p| !p.fits()),
    );
    assert!(h.query_by_label_contains("Does not fit").is_some());
    h.get_by_label("Auto-fit").click();
    wait_for(&mut h, "auto-fit", Duration::from_secs(60), |a| {
        !a.state.plan.autofit_applied.is_empty() && a.jobs.in_flight() == 0 && !a.state.plan.loading
    });
    wait_for(&mut h, "the fitted plan", Duration::from_secs(30), |a| {
        a.jobs.in_flight() == 0 && a.state.plan.plan.as_ref().is_some_and(|p| p.fits())
    });
    assert!(h.query_by_label_contains("Auto-fit applied").is_some());
}

#[test]
fn the_label_walker_finds_an_unlabelled_input() {
    let mut v = 1.0f32;
    let mut text = String::from("x");
    let mut h = Harness::builder()
        .with_accessibility_check(false)
        .build_ui(move |ui| {
            ui.add(egui::DragValue::new(&mut v));
            ui.text_edit_singleline(&mut text);
        });
    h.run();
    assert_eq!(
        unlabelled_inputs(&h).len(),
        2,
        "{:?}",
        unlabelled_inputs(&h)
    );
}

#[test]
#[cfg_attr(
    tunestudio_missing_hebrew_font,
    ignore = "no system font for Hebrew (apt-get install fonts-dejavu-core)"
)]
fn hebrew_text_renders_with_a_system_font() {
    let fonts = super::fonts::SystemFonts::scan();
    assert!(
        fonts.alphabetic.is_some(),
        "no system font for Hebrew found (apt-get install fonts-dejavu-core)"
    );
    // The harness panics on a missing glyph, so laying the text out is the check.
    let mut installed = false;
    let mut h = Harness::builder().build_ui(move |ui| {
        if !installed {
            super::fonts::install(ui.ctx());
            installed = true;
        }
        ui.label("שלום עולם — hello");
    });
    h.run();
}

/// Replaces the text of the field labelled `label` with `text`.
fn type_into(h: &mut Harness<'static, StudioApp>, label: &str, text: &str) {
    h.get_by_label(label).focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label(label).type_text(text);
    h.step();
}

#[test]
fn playground_streams_both_sides_cancels_and_reports_errors() {
    use super::panels::playground::SideSource;
    use tunestudio::infer::StopReason;

    let out = tempfile::tempdir().expect("tempdir");
    let fixtures = tunestudio::paths::shared_dir().join("fixtures");
    let base = fixtures.join("tiny-llama").display().to_string();
    let adapter = fixtures.join("tiny-llama-lora").display().to_string();
    let mut h = harness(Panel::Model, out.path());
    h.step();
    click_nav(&mut h, Panel::Playground);

    // Left: the base model; right: the base with the LoRA adapter.
    for i in 0..2 {
        h.state_mut().state.playground.sides[i].source = SideSource::Folder;
    }
    h.step();
    type_into(&mut h, "Left model", &base);
    type_into(&mut h, "Right model", &base);
    type_into(&mut h, "Right adapter", &adapter);
    h.get_by_label("Load Left").click();
    h.step();
    h.get_by_label("Load Right").click();
    wait_for(&mut h, "both sides to load", Duration::from_secs(60), |a| {
        a.state
            .playground
            .sides
            .iter()
            .all(|s| s.loading.is_none() && (s.generator.is_some() || s.load_error.is_some()))
    });
    for s in &h.state().state.playground.sides {
        assert!(s.load_error.is_none(), "load failed: {:?}", s.load_error);
    }
    assert_eq!(h.query_all_by_label_contains("loaded: ").count(), 2);
    assert!(h.state().state.playground.sides[1]
        .loaded_name
        .contains("tiny-llama-lora"));

    // An empty prompt is refused with a message, not a crash.
    h.get_by_label("Generate").click();
    h.step();
    h.step();
    let err = h.state().state.playground.error.clone().unwrap_or_default();
    assert!(err.contains("empty"), "error: {err}");
    assert!(h.query_by_label_contains("the prompt is empty").is_some());

    // Max new tokens 0 is refused too.
    type_into(&mut h, "Prompt", "Once upon a time");
    h.state_mut().state.playground.params.max_new_tokens = 0;
    h.get_by_label("Generate").click();
    h.step();
    h.step();
    let err = h.state().state.playground.error.clone().unwrap_or_default();
    assert!(err.contains("max_new_tokens"), "error: {err}");

    // Greedy, a few tokens: both sides stream and finish.
    {
        let p = &mut h.state_mut().state.playground.params;
        p.max_new_tokens = 8;
        p.temperature = 0.0;
        p.stop_on_eos = false;
    }
    h.get_by_label("Generate").click();
    wait_for(&mut h, "both answers", Duration::from_secs(60), |a| {
        let pg = &a.state.playground;
        !pg.generating() && pg.sides.iter().all(|s| s.output.stop_reason.is_some())
    });
    let pg = &h.state().state.playground;
    assert!(pg.error.is_none(), "{:?}", pg.error);
    for s in &pg.sides {
        assert_eq!(s.output.tokens, 8, "{:?}", s.output);
        assert_eq!(s.output.stop_reason, Some(StopReason::MaxTokens));
        assert!(s.output.tokens_per_sec.is_some_and(|r| r > 0.0));
    }
    println!(
        "left: {:?}\nright: {:?}",
        pg.sides[0].output.text, pg.sides[1].output.text
    );
    assert!(h.query_all_by_label_contains("tok/s").count() >= 2);

    // Export the comparison.
    let export = out.path().join("cmp.jsonl");
    h.state_mut().state.playground.export_path = export.display().to_string();
    h.get_by_label("Export comparison").click();
    h.step();
    h.step();
    let text = std::fs::read_to_string(&export).expect("export written");
    let row: serde_json::Value =
        serde_json::from_str(text.lines().next().expect("one line")).expect("json");
    assert_eq!(row["prompt"], "Once upon a time");
    assert_eq!(row["settings"]["max_new_tokens"], 8);
    assert_eq!(
        row["left"].as_str(),
        Some(h.state().state.playground.sides[0].output.text.as_str())
    );

    // A long generation: Cancel stops both sides.
    h.state_mut().state.playground.params.max_new_tokens = 100_000;
    h.get_by_label("Generate").click();
    wait_for(
        &mut h,
        "the stream to start",
        Duration::from_secs(30),
        |a| a.state.playground.generating(),
    );
    h.get_by_label("Cancel").click();
    wait_for(&mut h, "the cancel", Duration::from_secs(30), |a| {
        !a.state.playground.generating()
    });
    for s in &h.state().state.playground.sides {
        assert_eq!(
            s.output.stop_reason,
            Some(StopReason::Cancelled),
            "{:?}",
            s.output
        );
    }

    // An adapter trained for another base model is refused with a message.
    let mistral = fixtures.join("tiny-mistral").display().to_string();
    type_into(&mut h, "Left model", &mistral);
    type_into(&mut h, "Left adapter", &adapter);
    h.get_by_label("Load Left").click();
    wait_for(&mut h, "the adapter error", Duration::from_secs(60), |a| {
        let s = &a.state.playground.sides[0];
        s.loading.is_none() && s.load_error.is_some()
    });
    let err = h.state().state.playground.sides[0]
        .load_error
        .clone()
        .unwrap_or_default();
    assert!(err.contains("tiny-llama"), "error: {err}");
    assert!(h
        .query_by_label_contains("Left could not be loaded")
        .is_some());
}

#[test]
fn playground_loads_the_demo_run_model() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Playground, out.path());
    h.get_by_label("Load Left").click();
    wait_for(&mut h, "the demo model", Duration::from_secs(60), |a| {
        let s = &a.state.playground.sides[0];
        s.loading.is_none() && (s.generator.is_some() || s.load_error.is_some())
    });
    let s = &h.state().state.playground.sides[0];
    assert!(s.load_error.is_none(), "{:?}", s.load_error);
    // The right side defaults to the run's latest checkpoint; there is none yet.
    h.get_by_label("Load Right").click();
    wait_for(
        &mut h,
        "the checkpoint error",
        Duration::from_secs(10),
        |a| a.state.playground.sides[1].load_error.is_some(),
    );
    assert!(h.query_by_label_contains("no checkpoint").is_some());
    h.state_mut().state.playground.params.max_new_tokens = 4;
    type_into(&mut h, "Prompt", "Hello");
    h.get_by_label("Generate").click();
    wait_for(&mut h, "the answer", Duration::from_secs(60), |a| {
        let s = &a.state.playground.sides[0];
        s.handle.is_none() && (s.output.stop_reason.is_some() || s.output.error.is_some())
    });
    let s = &h.state().state.playground.sides[0];
    assert!(s.output.error.is_none(), "{:?}", s.output.error);
    assert!(s.output.tokens > 0);

    // A prompt list runs in batch and fills the comparison table.
    h.state_mut().state.playground.batch_prompts = vec!["One".into(), "Two".into()];
    h.step();
    h.get_by_label("Run batch").click();
    wait_for(&mut h, "the batch", Duration::from_secs(60), |a| {
        a.state.playground.batch_next.is_none() && a.state.playground.batch_rows.len() == 2
    });
    let rows = &h.state().state.playground.batch_rows;
    assert_eq!(rows[1].prompt, "Two");
    assert!(!rows[0].left.is_empty() && !rows[0].left.starts_with("error"));
    assert!(h.query_by_label_contains("Batch prompt").is_some());
}
