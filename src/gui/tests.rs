//! UI tests: egui_kittest drives the real app (the same `StudioApp` eframe
//! runs) against the real library — the bundled demo model, tokenizer and
//! data, the real planner and the real trainer.

// Each test is one user's session read top to bottom; splitting a long one would hide it.
#![allow(clippy::too_many_lines)]

use std::path::Path;
use std::time::{Duration, Instant};

use eframe::egui;
use egui_kittest::kittest::{NodeT, Queryable};
use egui_kittest::Harness;

use super::app::{StartOptions, StudioApp};
use super::run_state::RunPhase;
use super::session::Panel;
use tunestudio::train::FinishReason;

mod fixes;
mod grpo;
mod runs;
mod sharded;
mod slow_disk;

/// The app on the demo project, output going to `out`.
fn harness(panel: Panel, out: &Path) -> Harness<'static, StudioApp> {
    let opts = StartOptions {
        fresh: true,
        panel: Some(panel),
        output_dir: Some(out.to_path_buf()),
        ..StartOptions::default()
    };
    app_harness(opts, 860.0)
}

/// The app started with `opts` in a window 1360 wide and `height` high.
fn app_harness(opts: StartOptions, height: f32) -> Harness<'static, StudioApp> {
    Harness::builder()
        .with_size(egui::vec2(1360.0, height))
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
            && a.panels.preview.preview.is_some()
            && a.panels.devices.plan.plan.is_some()
            && a.panels.devices.inventory.is_some()
    });
}

/// Waits for background jobs (their spinners repaint continuously), then lets the UI settle.
fn settle(h: &mut Harness<'static, StudioApp>) {
    wait_for(h, "background jobs", Duration::from_secs(60), |a| {
        a.jobs.in_flight() == 0 && a.panels.model.loading.is_none()
    });
    h.run();
}

fn click_nav(h: &mut Harness<'static, StudioApp>, panel: Panel) {
    let i = Panel::ALL.iter().position(|p| *p == panel).unwrap_or(0);
    h.get_by_label(&format!("{}  {}", i + 1, panel.title()))
        .click();
    h.step();
    h.step();
    assert_eq!(h.state().session.panel, panel);
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
    let p = h.state().panels.preview.preview.clone().expect("preview");
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
        a.panels
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
        a.panels
            .devices
            .plan
            .plan
            .as_ref()
            .map(|p| p.per_device[0].peak_bytes)
    };
    let before = peak(h.state()).expect("plan");
    assert_eq!(h.state().session.config.training.precision.name(), "fp32");

    h.get_by_label("Precision").click();
    h.run();
    h.get_by_label("bf16-mixed").click();
    h.step();
    settle(&mut h);
    assert_eq!(
        h.state().session.config.training.precision.name(),
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

/// Once the Preview has scanned the demo's data, the studio plans the loss for the trained rows
/// of its fullest micro-batch, as `tunestudio plan --config` does for the same run: the same
/// loss rows and the same training-tensor figure.
#[test]
fn the_studio_plans_the_trained_rows_the_cli_plans() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Devices, out.path());
    wait_ready(&mut h);
    wait_for_current_plan(&mut h, "the plan of the scanned data", |r| {
        r.trained_tokens.is_some()
    });
    let studio_req = h
        .state()
        .panels
        .devices
        .plan
        .request
        .clone()
        .expect("request");
    let studio = h.state().panels.devices.plan.plan.clone().expect("plan");

    let demo = tunestudio::paths::assets_dir().join("demo.toml");
    let cli_req = cli_request(&["plan", "--config", &demo.display().to_string()]);
    let cli = tunestudio::plan::plan(&cli_req).expect("the CLI's plan");
    assert!(
        studio_req.loss_rows() < 4 * 127,
        "the demo trains completions only"
    );
    assert_eq!(studio_req.loss_rows(), cli_req.loss_rows());
    assert_eq!(
        studio.per_device[0].training_tensors_bytes,
        cli.per_device[0].training_tensors_bytes
    );
}

#[test]
fn training_runs_pauses_and_stops_with_frame_times() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Run, out.path());
    wait_ready(&mut h);
    h.get_by_label("Start").click();
    h.step();
    let frames_before = h.state().chrome.frames.frames;
    wait_for(&mut h, "loss points", Duration::from_secs(180), |a| {
        a.panels.run.live.loss.len() >= 3
    });
    let stats = h.state().chrome.frames.clone();
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
        a.panels.run.live.phase == RunPhase::Paused
    });
    let paused_at = h.state().panels.run.live.step;
    h.get_by_label("Stop").click();
    wait_for(&mut h, "the stop", Duration::from_secs(60), |a| {
        matches!(a.panels.run.live.phase, RunPhase::Finished(_))
    });
    let r = &h.state().panels.run.live;
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
        a.panels.dataset.error.is_some() && a.jobs.in_flight() == 0
    });
    let err = h
        .state()
        .panels
        .dataset
        .error
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default();
    assert!(
        err.contains("broken.json"),
        "the error names the file: {err}"
    );
    assert!(h.query_by_label_contains("could not be read").is_some());
    // The preview reports it too, and the app keeps running.
    click_nav(&mut h, Panel::Preview);
    wait_for(&mut h, "the preview error", Duration::from_secs(30), |a| {
        a.panels.preview.error.is_some()
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
    assert!(h.state().session.config.lora.enabled);
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

/// Each planned device's peak, in the plan's order (the process peak first on a CPU).
fn planned_peaks(h: &Harness<'static, StudioApp>) -> Vec<u64> {
    let plan = h.state().panels.devices.plan.plan.as_ref().expect("a plan");
    plan.per_device.iter().map(|d| d.peak_bytes).collect()
}

#[test]
fn auto_fit_applies_settings_that_fit_a_small_device() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Devices, out.path());
    wait_ready(&mut h);
    // A device 7 % too small for the demo as configured, its plan counting the studio's own
    // footprint (the process terms and the window: ≈ 290 MiB).
    wait_for(&mut h, "the demo's plan", Duration::from_secs(30), |a| {
        a.jobs.in_flight() == 0
            && a.panels
                .devices
                .plan
                .plan
                .as_ref()
                .is_some_and(|p| p.fits())
    });
    let planned_bytes = planned_peaks(&h)[0];
    let small_mib = (planned_bytes * 93 / 100) >> 20;
    h.state_mut().session.config.devices.devices = vec![format!("cpu:{small_mib}MiB")];
    wait_for(
        &mut h,
        "an out-of-memory plan",
        Duration::from_secs(30),
        |a| {
            a.jobs.in_flight() == 0
                && a.panels
                    .devices
                    .plan
                    .plan
                    .as_ref()
                    .is_some_and(|p| !p.fits())
        },
    );
    assert!(h.query_by_label_contains("Does not fit").is_some());
    h.get_by_label("Auto-fit").click();
    wait_for(&mut h, "auto-fit", Duration::from_secs(60), |a| {
        !a.panels.devices.plan.autofit_applied.is_empty()
            && a.jobs.in_flight() == 0
            && !a.panels.devices.plan.loading
    });
    wait_for(&mut h, "the fitted plan", Duration::from_secs(30), |a| {
        a.jobs.in_flight() == 0
            && a.panels
                .devices
                .plan
                .plan
                .as_ref()
                .is_some_and(|p| p.fits())
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

/// The Playground's error message ("" when there is none).
fn playground_error(h: &Harness<'static, StudioApp>) -> String {
    h.state()
        .panels
        .playground
        .error
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default()
}

/// Steps until the run config's save (or open), a job, has answered.
fn wait_saved(h: &mut Harness<'static, StudioApp>) {
    wait_for(h, "the run config's job", Duration::from_secs(30), |a| {
        a.panels.export.config_busy.is_none() && a.panels.export.config_message.is_some()
    });
}

/// Steps until the open in-app picker's folder listing, a job, has answered.
fn wait_listed(h: &mut Harness<'static, StudioApp>) {
    wait_for(h, "the picker's listing", Duration::from_secs(30), |a| {
        a.chrome
            .picker
            .as_ref()
            .is_some_and(|(_, p)| !p.is_listing())
    });
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
    use super::playground::SideSource;
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
        h.state_mut().panels.playground.sides[i].source = SideSource::Folder;
    }
    h.step();
    type_into(&mut h, "Left model", &base);
    type_into(&mut h, "Right model", &base);
    type_into(&mut h, "Right adapter", &adapter);
    h.get_by_label("Load Left").click();
    h.step();
    h.get_by_label("Load Right").click();
    wait_for(&mut h, "both sides to load", Duration::from_secs(60), |a| {
        a.panels
            .playground
            .sides
            .iter()
            .all(|s| s.loading.is_none() && (s.generator.is_some() || s.load_error.is_some()))
    });
    for s in &h.state().panels.playground.sides {
        assert!(s.load_error.is_none(), "load failed: {:?}", s.load_error);
    }
    assert_eq!(h.query_all_by_label_contains("loaded: ").count(), 2);
    assert!(h.state().panels.playground.sides[1]
        .loaded_name
        .contains("tiny-llama-lora"));

    // An empty prompt is refused with a message, not a crash.
    h.get_by_label("Generate").click();
    h.step();
    h.step();
    let err = playground_error(&h);
    assert!(err.contains("empty"), "error: {err}");
    assert!(h.query_by_label_contains("the prompt is empty").is_some());

    // Max new tokens 0 is refused too.
    type_into(&mut h, "Prompt", "Once upon a time");
    h.state_mut().panels.playground.params.max_new_tokens = 0;
    h.get_by_label("Generate").click();
    h.step();
    h.step();
    let err = playground_error(&h);
    assert!(err.contains("max_new_tokens"), "error: {err}");

    // Greedy, a few tokens: both sides stream and finish.
    {
        let p = &mut h.state_mut().panels.playground.params;
        p.max_new_tokens = 8;
        p.temperature = 0.0;
        p.stop_on_eos = false;
    }
    h.get_by_label("Generate").click();
    wait_for(&mut h, "both answers", Duration::from_secs(60), |a| {
        let pg = &a.panels.playground;
        !pg.generating() && pg.sides.iter().all(|s| s.output.stop_reason.is_some())
    });
    let pg = &h.state().panels.playground;
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
    h.state_mut().panels.playground.export_path = export.display().to_string();
    h.get_by_label("Export comparison").click();
    // The file is written by a job, off the UI thread.
    wait_for(&mut h, "the export", Duration::from_secs(30), |a| {
        a.panels
            .playground
            .message
            .as_deref()
            .is_some_and(|m| m.starts_with("exported"))
    });
    let text = std::fs::read_to_string(&export).expect("export written");
    let row: serde_json::Value =
        serde_json::from_str(text.lines().next().expect("one line")).expect("json");
    assert_eq!(row["prompt"], "Once upon a time");
    assert_eq!(row["settings"]["max_new_tokens"], 8);
    assert_eq!(
        row["left"].as_str(),
        Some(h.state().panels.playground.sides[0].output.text.as_str())
    );

    // A long generation: Cancel stops both sides.
    h.state_mut().panels.playground.params.max_new_tokens = 100_000;
    h.get_by_label("Generate").click();
    wait_for(
        &mut h,
        "the stream to start",
        Duration::from_secs(30),
        |a| a.panels.playground.generating(),
    );
    h.get_by_label("Cancel").click();
    wait_for(&mut h, "the cancel", Duration::from_secs(30), |a| {
        !a.panels.playground.generating()
    });
    for s in &h.state().panels.playground.sides {
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
        let s = &a.panels.playground.sides[0];
        s.loading.is_none() && s.load_error.is_some()
    });
    let err = h.state().panels.playground.sides[0]
        .load_error
        .as_ref()
        .map(ToString::to_string)
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
        let s = &a.panels.playground.sides[0];
        s.loading.is_none() && (s.generator.is_some() || s.load_error.is_some())
    });
    let s = &h.state().panels.playground.sides[0];
    assert!(s.load_error.is_none(), "{:?}", s.load_error);
    // The right side defaults to the run's latest checkpoint; there is none yet.
    h.get_by_label("Load Right").click();
    wait_for(
        &mut h,
        "the checkpoint error",
        Duration::from_secs(10),
        |a| a.panels.playground.sides[1].load_error.is_some(),
    );
    assert!(h.query_by_label_contains("no checkpoint").is_some());
    h.state_mut().panels.playground.params.max_new_tokens = 4;
    type_into(&mut h, "Prompt", "Hello");
    h.get_by_label("Generate").click();
    wait_for(&mut h, "the answer", Duration::from_secs(60), |a| {
        let s = &a.panels.playground.sides[0];
        s.handle.is_none() && (s.output.stop_reason.is_some() || s.output.error.is_some())
    });
    let s = &h.state().panels.playground.sides[0];
    assert!(s.output.error.is_none(), "{:?}", s.output.error);
    assert!(s.output.tokens > 0);

    // A prompt list runs in batch and fills the comparison table.
    h.state_mut().panels.playground.batch_prompts = vec!["One".into(), "Two".into()];
    h.step();
    h.get_by_label("Run batch").click();
    wait_for(&mut h, "the batch", Duration::from_secs(60), |a| {
        a.panels.playground.batch_next.is_none() && a.panels.playground.batch_rows.len() == 2
    });
    let rows = &h.state().panels.playground.batch_rows;
    assert_eq!(rows[1].prompt, "Two");
    assert!(!rows[0].left.is_empty() && !rows[0].left.starts_with("error"));
    assert!(h.query_by_label_contains("Batch prompt").is_some());
}

/// The Playground's work (a load, a generation) runs as jobs: the status bar's
/// `Jobs::in_flight` counts it while it runs and drops to 0 when it is done.
#[test]
fn playground_work_counts_as_jobs_in_flight() {
    use super::playground::SideSource;

    let out = tempfile::tempdir().expect("tempdir");
    let base = tunestudio::paths::shared_dir()
        .join("fixtures")
        .join("tiny-llama")
        .display()
        .to_string();
    let mut h = harness(Panel::Playground, out.path());
    settle(&mut h);
    assert_eq!(h.state().jobs.in_flight(), 0);
    h.state_mut().panels.playground.sides[0].source = SideSource::Folder;
    h.step();
    type_into(&mut h, "Left model", &base);
    h.get_by_label("Load Left").click();
    // The click queues the action; the next frame starts the load as a job.
    h.step();
    h.step();
    assert!(
        h.state().panels.playground.sides[0].loading.is_some(),
        "the load started"
    );
    // (The tiny model may already be loaded by now, so its job may be done: the generation
    // below is the check that cannot race.)
    wait_for(
        &mut h,
        "the load and its job",
        Duration::from_secs(60),
        |a| a.jobs.in_flight() == 0 && a.panels.playground.sides[0].loading.is_none(),
    );
    let s = &h.state().panels.playground.sides[0];
    assert!(s.load_error.is_none(), "{:?}", s.load_error);
    assert!(s.generator.is_some());

    // A long generation counts until it is cancelled and its stream has ended.
    {
        let p = &mut h.state_mut().panels.playground.params;
        p.max_new_tokens = 100_000;
        p.stop_on_eos = false;
    }
    type_into(&mut h, "Prompt", "Once upon a time");
    h.get_by_label("Generate").click();
    h.step();
    h.step();
    assert!(h.state().panels.playground.generating());
    assert!(
        h.state().jobs.in_flight() > 0,
        "a generation counts as a job"
    );
    assert!(h.query_by_label_contains("background job(s)").is_some());
    h.get_by_label("Cancel").click();
    wait_for(
        &mut h,
        "the generation to end",
        Duration::from_secs(30),
        |a| !a.panels.playground.generating() && a.jobs.in_flight() == 0,
    );
    assert_eq!(h.state().jobs.in_flight(), 0);
}

/// The fake NVML of `tests/fake_nvml/` (two GPUs), compiled into `dir`.
fn fake_nvml(dir: &Path) -> std::path::PathBuf {
    let src = dir.join("fake_nvml.c");
    let lib = dir.join("libnvidia-ml.so.1");
    std::fs::write(&src, include_str!("../../tests/fake_nvml/fake_nvml.c")).expect("write");
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("run `cc` to build the fake NVML (install gcc)");
    assert!(status.success(), "cc failed to build the fake NVML");
    lib
}

#[test]
#[cfg_attr(
    tunestudio_missing_cc,
    ignore = "no C compiler (`cc`) to build the fake NVML (install gcc)"
)]
fn the_memory_chart_draws_one_line_per_device_with_two_gpus() {
    let out = tempfile::tempdir().expect("tempdir");
    let nvml = fake_nvml(out.path());
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Run),
        output_dir: Some(out.path().join("run")),
        nvml_library: Some(nvml),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 860.0);
    wait_ready(&mut h);
    assert_eq!(
        h.state()
            .panels
            .devices
            .inventory
            .as_ref()
            .map(|i| i.gpus().count()),
        Some(2)
    );
    h.get_by_label("Start").click();
    wait_for(
        &mut h,
        "memory of every device",
        Duration::from_secs(180),
        |a| {
            let m = &a.panels.run.live.memory;
            ["cpu", "cuda:0", "cuda:1"]
                .iter()
                .all(|d| m.get(*d).is_some_and(|s| !s.used.is_empty()))
        },
    );
    let lines: Vec<&String> = h.state().panels.run.live.memory.keys().collect();
    assert_eq!(lines, ["cpu", "cuda:0", "cuda:1"]);
    for device in ["cpu", "cuda:0", "cuda:1"] {
        assert!(
            h.query_by_label_contains(&format!("{device}: peak"))
                .is_some(),
            "no chart caption for {device}"
        );
    }
    // The CPU line has the plan's prediction as its reference; every GPU a status-bar figure.
    assert!(h.query_by_label_contains("(predicted").is_some());
    assert!(h
        .query_by_label_contains("cuda:1 0.0 / 140.4 GiB")
        .is_some());
    h.get_by_label("Stop").click();
    wait_for(&mut h, "the stop", Duration::from_secs(60), |a| {
        matches!(a.panels.run.live.phase, RunPhase::Finished(_))
    });
}

/// A layer split over logical CPU devices is one process: the Run chart's predicted line is
/// the plan's process peak (that of `cpu:0`, which counts every CPU stage), not the stages'
/// sum.
#[test]
fn a_cpu_layer_split_predicts_the_process_peak_once() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Run, out.path());
    wait_ready(&mut h);
    {
        let devices = &mut h.state_mut().session.config.devices;
        devices.devices = vec!["cpu:0".into(), "cpu:1".into()];
        devices.strategy = tunestudio::settings::Strategy::LayerSplit;
    }
    wait_for(&mut h, "the split's plan", Duration::from_secs(30), |a| {
        a.jobs.in_flight() == 0
            && !a.panels.devices.plan.loading
            && a.panels
                .devices
                .plan
                .plan
                .as_ref()
                .is_some_and(|p| p.per_device.len() == 2)
    });
    let per_device = planned_peaks(&h);
    assert!(per_device[1] > 0, "{per_device:?}");
    h.get_by_label("Start").click();
    wait_for(
        &mut h,
        "the run's memory line",
        Duration::from_secs(60),
        |a| a.panels.run.live.memory.contains_key("cpu"),
    );
    let predicted = h.state().panels.run.live.memory["cpu"].predicted_peak_bytes;
    assert_eq!(
        predicted,
        Some(per_device[0]),
        "stages planned {per_device:?}"
    );
    h.get_by_label("Stop").click();
    wait_for(&mut h, "the stop", Duration::from_secs(60), |a| {
        matches!(a.panels.run.live.phase, RunPhase::Finished(_))
    });
}

/// The app on the demo model's tokenizer (SmolLM2's byte-level BPE) and `data`, showing one
/// row per batch in the Preview panel.
fn harness_on_data(data: &Path, out: &Path) -> Harness<'static, StudioApp> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let demo = std::fs::read_to_string(root.join("assets/demo.toml")).expect("demo config");
    let quoted = |p: &Path| format!("{:?}", p.display().to_string());
    let config = demo
        .replace(
            "source = \"demo-model\"",
            &format!("source = {}", quoted(&root.join("assets/demo-model"))),
        )
        .replace(
            "path = \"demo-data.json\"",
            &format!("path = {}", quoted(data)),
        )
        .replace("max_length = 128", "max_length = 512")
        .replace("micro_batch = 4", "micro_batch = 1")
        .replace("validation_ratio = 0.05", "validation_ratio = 0.0");
    let path = out.join("run.toml");
    std::fs::write(&path, config).expect("write run.toml");
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Preview),
        output_dir: Some(out.join("run")),
        config: Some(path),
        ..StartOptions::default()
    };
    app_harness(opts, 860.0)
}

/// One token chip on screen, read from its accessible name.
struct ChipNode {
    /// The token's position in the row.
    position: usize,
    /// The characters the chip names (its whole group's, whitespace made visible).
    text: String,
    /// Which part of a split character the token is (`None`: a whole one).
    part: Option<String>,
    bounds: egui::Rect,
}

/// Every token chip on screen (`token TEXT[ part J/K] (CLASS, id N, position P)`).
fn chip_nodes<S>(h: &Harness<'_, S>) -> Vec<ChipNode> {
    h.root()
        .children_recursive()
        .filter_map(|n| {
            let a = n.accesskit_node();
            // egui names a Label through its value.
            let label = a.label().or_else(|| a.value())?.to_string();
            let body = label.strip_prefix("token ")?;
            let (head, tail) = body.rsplit_once(" (")?;
            let position = tail.rsplit_once("position ")?.1.trim_end_matches(')');
            let (text, part) = match head.rsplit_once(" part ") {
                Some((t, p)) if p.contains('/') => (t.to_string(), Some(p.to_string())),
                _ => (head.to_string(), None),
            };
            let b = a.raw_bounds()?;
            Some(ChipNode {
                position: position.parse().ok()?,
                text,
                part,
                bounds: egui::Rect::from_min_max(
                    egui::pos2(b.x0 as f32, b.y0 as f32),
                    egui::pos2(b.x1 as f32, b.y1 as f32),
                ),
            })
        })
        .collect()
}

/// Every glyph drawn in the last frame: (x, y of its row's top, character). The zero-width
/// glyphs egui adds to keep one glyph per character (it emits one when a right-to-left
/// cluster of a byte-split pair is shaped) are not drawn, so they are left out.
fn drawn_glyphs<S>(h: &Harness<'_, S>) -> Vec<(f32, f32, char)> {
    fn walk(shape: &egui::Shape, out: &mut Vec<(f32, f32, char)>) {
        match shape {
            egui::Shape::Vec(v) => v.iter().for_each(|s| walk(s, out)),
            egui::Shape::Text(t) => {
                for row in &t.galley.rows {
                    for g in row.glyphs.iter().filter(|g| g.advance_width > 0.0) {
                        out.push((t.pos.x + row.pos.x + g.pos.x, t.pos.y + row.pos.y, g.chr));
                    }
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for clipped in &h.output().shapes {
        walk(&clipped.shape, &mut out);
    }
    out
}

/// A chip text that is a bare token id such as `<12960>`.
fn is_bare_id(text: &str) -> bool {
    text.strip_prefix('<')
        .and_then(|t| t.strip_suffix('>'))
        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
}

/// Waits for the preview of the first row, then checks that every token of it has a chip
/// naming characters, never a bare id; returns the chips.
fn preview_chips(
    h: &mut Harness<'static, StudioApp>,
) -> (tunestudio::data::RowPreview, Vec<ChipNode>) {
    wait_for(h, "the preview", Duration::from_secs(90), |a| {
        a.jobs.in_flight() == 0 && a.panels.preview.preview.is_some()
    });
    let p = h.state().panels.preview.preview.clone().expect("preview");
    let row = p.rows[0].clone();
    assert!(
        row.groups(usize::MAX).iter().any(|g| g.is_split()),
        "no character is split between tokens: the test proves nothing"
    );
    let chips = chip_nodes(h);
    let mut positions: Vec<usize> = chips.iter().map(|c| c.position).collect();
    positions.sort_unstable();
    positions.dedup();
    let all: Vec<usize> = (0..row.tokens.len()).collect();
    assert_eq!(positions, all, "every token has a chip of its own");
    for c in &chips {
        assert!(
            !c.text.is_empty() && !is_bare_id(&c.text),
            "token {} is shown as {:?}",
            c.position,
            c.text
        );
    }
    (row, chips)
}

#[test]
#[cfg_attr(
    tunestudio_missing_hebrew_font,
    ignore = "no system font for Hebrew (apt-get install fonts-dejavu-core)"
)]
fn hebrew_row_reads_right_to_left_with_no_bare_ids() {
    let out = tempfile::tempdir().expect("tempdir");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alpaca_he.json");
    let mut h = harness_on_data(&data, out.path());
    let (row, chips) = preview_chips(&mut h);

    // The answer's groups, in logical order.
    let answer = "שלום! אני מודל שפה שמדבר עברית.";
    let groups = row.groups(usize::MAX);
    let text: String = groups.iter().map(|g| g.text.as_str()).collect();
    let at = text.find(answer).expect("the answer is in the row");
    let mut offset = 0;
    let mut answer_tokens = Vec::new();
    for g in &groups {
        let start = offset;
        offset += g.text.len();
        if start >= at && offset <= at + answer.len() {
            answer_tokens.push(g.tokens.start);
        }
    }
    assert!(answer_tokens.len() > 5, "{answer_tokens:?}");
    let rect_of = |pos: usize| {
        chips
            .iter()
            .find(|c| c.position == pos)
            .map(|c| c.bounds)
            .expect("chip of an answer token")
    };
    let rects: Vec<egui::Rect> = answer_tokens.iter().map(|&p| rect_of(p)).collect();
    // One line (the answer is short), laid out right to left.
    for w in rects.windows(2) {
        assert!((w[0].center().y - w[1].center().y).abs() < 1.0, "{rects:?}");
        assert!(
            w[1].center().x < w[0].center().x,
            "x does not decrease in logical order: {rects:?}"
        );
    }
    // Read left to right, the drawn line is the sentence's visual form.
    let line = rects.iter().fold(egui::Rect::NOTHING, |a, r| a.union(*r));
    let mut glyphs: Vec<(f32, f32, char)> = drawn_glyphs(&h)
        .into_iter()
        .filter(|&(_, y, _)| y + 1.0 >= line.top() && y + 1.0 <= line.bottom())
        .collect();
    glyphs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let drawn: String = glyphs.iter().map(|g| g.2).collect();
    let expected = tunestudio::text::visible(&tunestudio::text::visual_order(answer));
    println!("drawn:    {drawn}\nexpected: {expected}");
    assert!(
        drawn.contains(&expected),
        "drawn {drawn:?}, expected {expected:?} in it"
    );
}

#[test]
fn chinese_row_shows_its_characters_not_ids() {
    let out = tempfile::tempdir().expect("tempdir");
    let data = tunestudio::paths::shared_dir().join("datasets/alpaca_zh_demo.json");
    let mut h = harness_on_data(&data, out.path());
    let (row, mut chips) = preview_chips(&mut h);
    // The chips' characters in logical order (a split character once) hold the instruction.
    chips.sort_by_key(|c| c.position);
    let named: String = chips
        .iter()
        .filter(|c| c.part.as_deref().is_none_or(|p| p.starts_with("1/")))
        .map(|c| c.text.as_str())
        .collect();
    let instruction = "识别并解释给定列表中的两个科学理论：细胞理论和日心说。";
    assert!(named.contains(instruction), "{named}");
    assert!(row.text.as_deref().is_some_and(|t| t.contains(instruction)));
    // And they are drawn (as tofu where no CJK font is installed).
    let drawn: String = drawn_glyphs(&h).iter().map(|g| g.2).collect();
    assert!(drawn.contains('识') && drawn.contains('说'), "{drawn}");
}

/// A planning-only run config for DictaLM 2.0 (its real `config.json` from `../shared`, no
/// weights) with the README's settings: fp32, micro-batch 1 × 4, seq 512, checkpointing,
/// single device; on this machine's CPU until the test plans for GPUs.
fn dictalm_config(dir: &Path) -> std::path::PathBuf {
    let model = tunestudio::paths::shared_dir().join("model-configs/dictalm2-7b.json");
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/demo-data.json");
    let q = |p: &Path| format!("{:?}", p.display().to_string());
    let text = format!(
        "output_dir = {out}\n\n[model]\nsource = {model}\n\n[data]\npath = {data}\nformat = \"alpaca\"\n\
         max_length = 512\n\n[training]\nprecision = \"fp32\"\nmicro_batch = 1\ngradient_accumulation = 4\n\
         activation_checkpointing = true\n\n[devices]\ndevices = [\"cpu\"]\nstrategy = \"single\"\n",
        out = q(&dir.join("out")),
        model = q(&model),
        data = q(&data),
    );
    let path = dir.join("dictalm.toml");
    std::fs::write(&path, text).expect("write the config");
    path
}

/// The studio on `config` as a laptop without NVIDIA GPUs sees it (NVML cannot load).
fn harness_without_gpus(config: &Path, dir: &Path) -> Harness<'static, StudioApp> {
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Devices),
        config: Some(config.to_path_buf()),
        nvml_library: Some(dir.join("no-such-libnvidia-ml.so.1")),
        ..StartOptions::default()
    };
    app_harness(opts, 1400.0)
}

/// Waits for the model, the devices and a plan of `entries` (no preview: there is no tokenizer).
fn wait_for_plan_of(h: &mut Harness<'static, StudioApp>, entries: &[&str]) {
    let entries: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
    wait_for(h, "the plan", Duration::from_secs(90), move |a| {
        a.jobs.in_flight() == 0
            && a.panels.model.info.is_some()
            && a.panels.devices.inventory.is_some()
            && a.session.config.devices.devices == entries
            && !a.panels.devices.plan.loading
            && a.panels.devices.plan.key == a.plan_key()
            && a.panels.devices.plan.plan.is_some()
    });
}

/// What `tunestudio plan --model-config <DictaLM> --devices <devices>` plans with the same settings.
fn cli_plan(devices: &str) -> tunestudio::plan::Plan {
    let model = tunestudio::paths::shared_dir().join("model-configs/dictalm2-7b.json");
    let model = model.display().to_string();
    let argv = [
        "plan",
        "--model-config",
        &model,
        "--devices",
        devices,
        "--precision",
        "fp32",
        "--micro-batch",
        "1",
        "--accumulation",
        "4",
        "--seq-len",
        "512",
        "--checkpointing",
        "--strategy",
        "single",
    ];
    tunestudio::plan::plan(&cli_request(&argv)).expect("the CLI's plan")
}

/// The request `tunestudio plan` builds for `argv` (`argv[0]` is the subcommand).
fn cli_request(argv: &[&str]) -> tunestudio::plan::PlanRequest {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct PlanCommand {
        #[command(flatten)]
        args: crate::cli::plan::PlanArgs,
    }
    let cmd = PlanCommand::try_parse_from(argv).expect("the CLI's arguments");
    crate::cli::plan::build_request(&cmd.args).expect("the CLI's request")
}

/// Waits until the plan on screen is the plan of the current settings (no re-plan pending) and
/// its request satisfies `cond`.
fn wait_for_current_plan(
    h: &mut Harness<'static, StudioApp>,
    what: &str,
    cond: impl Fn(&tunestudio::plan::PlanRequest) -> bool,
) {
    wait_for(h, what, Duration::from_secs(60), move |a| {
        a.jobs.in_flight() == 0
            && a.panels.devices.plan.key == a.plan_key()
            && a.panels.devices.plan.request.as_ref().is_some_and(&cond)
    });
}

/// Opens the combo box `combo`, picks `entry`, and waits for the re-plan it starts.
fn pick(h: &mut Harness<'static, StudioApp>, combo: &str, entry: &str) {
    h.get_by_label(combo).click();
    h.run_steps(3);
    h.get_by_label(entry).click();
    h.run_steps(2);
    wait_for(h, "background jobs", Duration::from_secs(60), |a| {
        a.jobs.in_flight() == 0
    });
}

#[test]
fn a_planned_machine_plans_like_the_cli_and_survives_a_reload() {
    use super::panels::devices::bar_label;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dictalm_config(dir.path());
    let mut h = harness_without_gpus(&config, dir.path());
    wait_for_plan_of(&mut h, &["cpu"]);
    assert!(h.state().planning_only().is_none());

    // Plan for 2 × H100 80 GB (through A100 80 GB, so the model really changes).
    pick(&mut h, "Plan for", "A machine to rent or queue for");
    pick(&mut h, "GPUs", "2 GPUs");
    pick(&mut h, "GPU model", "A100 80 GB");
    assert_eq!(
        h.state().session.config.devices.devices,
        ["cuda:0=81920MiB", "cuda:1=81920MiB"]
    );
    pick(&mut h, "GPU model", "H100 80 GB");
    wait_for_plan_of(&mut h, &["cuda:0=81559MiB", "cuda:1=81559MiB"]);

    // The studio's plan is the CLI's: the same verdict, devices, bars and fixes.
    let studio = h.state().panels.devices.plan.plan.clone().expect("plan");
    let cli = cli_plan("2xh100");
    assert_eq!(
        serde_json::to_value(&studio).expect("json"),
        serde_json::to_value(&cli).expect("json"),
        "the studio's plan differs from `tunestudio plan --devices 2xh100`"
    );
    let cli_80gib = cli_plan("2x80GiB");
    assert_eq!(studio.verdict, cli_80gib.verdict);
    assert_eq!(studio.per_device.len(), cli_80gib.per_device.len());
    for (s, c) in studio.per_device.iter().zip(&cli_80gib.per_device) {
        assert_eq!(
            (s.peak_bytes, s.fits),
            (c.peak_bytes, c.fits),
            "{}",
            s.device.name
        );
        assert!(
            h.query_by_label(&bar_label(c)).is_some(),
            "no bar `{}` on screen",
            bar_label(c)
        );
    }
    assert_eq!(studio.verdict, tunestudio::plan::Verdict::OutOfMemory);
    assert!(h.query_by_label("Does not fit").is_some());
    assert!(h
        .query_by_label_contains("H100 80 GB: 80 GB HBM3 as sold; the driver reports 81559 MiB")
        .is_some());

    // Planning only: the command to run on the target is shown, and Start does nothing.
    let cmd = h.state().planning_only().expect("planning only");
    assert!(cmd.starts_with("tunestudio train --config "), "{cmd}");
    assert!(h.query_by_label(&cmd).is_some(), "the command is not shown");
    assert!(!h
        .query_all_by_label("Dry run")
        .any(|n| !n.accesskit_node().is_disabled()));

    // Apply the top fix: the settings change, the planned machine stays.
    let req = h
        .state()
        .panels
        .devices
        .plan
        .request
        .clone()
        .expect("request");
    let top = studio.fixes.first().expect("a fix").change.clone();
    let expected = top.apply(&req).settings_summary();
    h.get_all_by_label("Apply")
        .next()
        .expect("an Apply button")
        .click();
    h.step();
    wait_for_current_plan(&mut h, "the fixed plan", |r| {
        r.settings_summary() == expected
    });
    assert_eq!(
        h.state().session.config.devices.devices,
        ["cuda:0=81559MiB", "cuda:1=81559MiB"]
    );
    let fixed = h.state().panels.devices.plan.plan.clone().expect("plan");

    // Save config writes the planned GPUs as the CLI reads them.
    click_nav(&mut h, Panel::Export);
    let saved = dir.path().join("saved").join("run.toml");
    h.state_mut().panels.export.config_path = saved.display().to_string();
    h.run_steps(2);
    h.get_by_label("Save config").click();
    wait_saved(&mut h);
    let text = std::fs::read_to_string(&saved).expect("the saved config");
    assert!(
        text.contains("\"cuda:0=81559MiB\"") && text.contains("\"cuda:1=81559MiB\""),
        "{text}"
    );
    click_nav(&mut h, Panel::Run);
    assert!(h.get_by_label("Start").accesskit_node().is_disabled());
    let cmd = h.state().planning_only().expect("planning only");
    assert!(cmd.ends_with(&saved.display().to_string()), "{cmd}");
    assert!(
        h.query_by_label(&cmd).is_some(),
        "no command where Start is"
    );
    // A click on the disabled Start does nothing.
    h.get_by_label("Start").click();
    h.step();
    h.step();
    assert_eq!(h.state().panels.run.live.phase, RunPhase::Idle);
    drop(h);

    // Reopening the config restores the planned machine and its plan.
    let mut h = harness_without_gpus(&saved, dir.path());
    wait_for_plan_of(&mut h, &["cuda:0=81559MiB", "cuda:1=81559MiB"]);
    let (s, p) = (&h.state().session, &h.state().panels);
    let m = s.planned_machine().expect("a planned machine");
    assert_eq!(m.describe(), "2 × H100 80 GB");
    assert_eq!(p.devices.planner.count, 2);
    assert_eq!(p.devices.planner.model.map(|m| m.id), Some("h100-80gb"));
    assert_eq!(
        serde_json::to_value(p.devices.plan.plan.as_ref().expect("plan")).expect("json"),
        serde_json::to_value(&fixed).expect("json")
    );
    assert!(h
        .query_by_label_contains("H100 80 GB: 80 GB HBM3")
        .is_some());
    assert!(h.query_by_label("Planning only").is_some());

    // A custom size per GPU; a size that does not read keeps the last good one.
    pick(&mut h, "GPU model", "Custom size");
    type_into(&mut h, "Memory per GPU", "40 GiB");
    h.run_steps(2);
    assert_eq!(
        h.state().session.config.devices.devices,
        ["cuda:0=40GiB", "cuda:1=40GiB"]
    );
    type_into(&mut h, "Memory per GPU", "lots");
    h.run_steps(2);
    assert_eq!(
        h.state().session.config.devices.devices,
        ["cuda:0=40GiB", "cuda:1=40GiB"]
    );
    assert!(h
        .query_by_label_contains("Memory per GPU: cannot read")
        .is_some());
    let unlabelled = unlabelled_inputs(&h);
    assert!(unlabelled.is_empty(), "{unlabelled:?}");

    // Back to this machine: the CPU (it has no GPU), and training is offered again.
    pick(&mut h, "Plan for", "This machine");
    assert_eq!(h.state().session.config.devices.devices, ["cpu"]);
    assert!(h.state().planning_only().is_none());
}

#[test]
#[cfg_attr(
    tunestudio_missing_cc,
    ignore = "no C compiler (`cc`) to build the fake NVML (install gcc)"
)]
fn a_config_for_other_gpus_shows_both_machines_and_asks_which_to_use() {
    use super::planned::PlannedMachine;
    let dir = tempfile::tempdir().expect("tempdir");
    let nvml = fake_nvml(dir.path());
    let config = dictalm_config(dir.path());
    let text = std::fs::read_to_string(&config).expect("config");
    let planned = r#"devices = ["cuda:0=40960MiB", "cuda:1=40960MiB"]"#;
    std::fs::write(&config, text.replace(r#"devices = ["cpu"]"#, planned)).expect("write");
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Devices),
        config: Some(config.clone()),
        nvml_library: Some(nvml),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 1400.0);
    wait_for_plan_of(&mut h, &["cuda:0=40960MiB", "cuda:1=40960MiB"]);

    // This machine (an H100 and an H200) is not 2 × A100 40 GB: both are shown, and asked about.
    let inv = h.state().panels.devices.inventory.clone().expect("devices");
    let h100 = PlannedMachine::from_entries(&["cuda:0=81559MiB".to_string()]).expect("planned");
    assert!(h100.runs_on(Some(&inv)), "cuda:0 is the fake H100");
    let two = PlannedMachine::from_entries(&PlannedMachine::entries(2, "81559MiB"));
    assert!(
        !two.expect("planned").runs_on(Some(&inv)),
        "cuda:1 is an H200"
    );
    assert!(h.query_by_label("Which machine?").is_some());
    assert!(h
        .query_by_label_contains(
            "The config plans for 2 × A100 40 GB; this machine has NVIDIA H100"
        )
        .is_some());
    assert!(h.state().planning_only().is_some());

    // Keep planning for the config's machine: the question goes, planning only stays.
    h.get_by_label("Keep planning for 2 × A100 40 GB").click();
    h.run_steps(2);
    assert!(h.query_by_label("Which machine?").is_none());
    assert!(h.state().planning_only().is_some());

    // Another planned model asks again; this time use this machine's GPUs and train here.
    pick(&mut h, "GPU model", "H200 141 GB");
    assert!(h.query_by_label("Which machine?").is_some());
    h.get_by_label("Use this machine's GPUs").click();
    h.run_steps(2);
    wait_for_plan_of(&mut h, &["cuda:0", "cuda:1"]);
    assert!(h.state().planning_only().is_none());
    assert!(h.query_by_label("Which machine?").is_none());
}

/// The founding case in the studio: a pre-tokenized file with `labels = [1] * len` after the
/// demo. The format is detected afresh, the project gets its own folder and `max_length`,
/// Start stays disabled with the lint until it is overridden by name; Stop then leaves a
/// checkpoint the Playground loads.
#[test]
fn founding_label_bug_blocks_start_until_overridden_and_stop_saves() {
    let out = tempfile::tempdir().expect("tempdir");
    let demo_out = out.path().join("runs").join("demo");
    let data = out.path().join("tokenized.jsonl");
    let rows: Vec<String> = (0..16)
        .map(|r| {
            let ids: Vec<i64> = (0..20 + r).map(|i| 100 + i).chain([2]).collect();
            let labels = vec![1; ids.len()];
            serde_json::json!({ "input_ids": ids, "labels": labels }).to_string()
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).expect("write");
    let mut h = harness(Panel::Dataset, &demo_out);
    wait_ready(&mut h);
    assert_eq!(
        h.state().session.config.data.format,
        tunestudio::data::Format::Alpaca
    );

    h.get_by_label("File, folder or hub id").focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label("File, folder or hub id")
        .type_text(&data.display().to_string());
    h.step();
    h.get_by_label("Open").click();
    wait_for(&mut h, "the new preview", Duration::from_secs(60), |a| {
        a.jobs.in_flight() == 0
            && a.panels.dataset.summary.is_some()
            && a.panels.preview.preview.as_ref().is_some_and(|p| {
                p.format == tunestudio::data::Format::Pretokenized && !p.lints.is_empty()
            })
    });
    let c = &h.state().session.config;
    assert_eq!(c.data.format, tunestudio::data::Format::Auto, "re-detected");
    assert_ne!(c.output_dir, demo_out, "a new project writes elsewhere");
    // Its run config goes beside its output folder, not into the demo's.
    let saved_to = std::path::PathBuf::from(&h.state().panels.export.config_path);
    assert_eq!(
        saved_to,
        h.state().session.default_config_path(),
        "the Export panel saves the new project's run.toml"
    );
    assert!(!saved_to.starts_with(&demo_out), "{}", saved_to.display());
    assert_eq!(c.data.max_length, 64, "max_length from the data's lengths");
    // The Format box shows what was detected.
    let format_box = h.get_by_label("Format");
    let shown = format!(
        "{:?} {:?}",
        format_box.accesskit_node().value(),
        format_box
            .accesskit_node()
            .children()
            .map(|c| c.label())
            .collect::<Vec<_>>()
    );
    assert!(shown.contains("auto (pretokenized)"), "{shown}");

    click_nav(&mut h, Panel::Run);
    assert!(h
        .query_by_label_contains("Start is disabled: lint `labels-mismatch`")
        .is_some());
    assert!(h.get_by_label("Start").accesskit_node().is_disabled());
    h.get_by_label_contains("Train anyway despite `labels-mismatch`")
        .click();
    h.step();
    h.step();
    assert_eq!(h.state().session.config.data.allow, ["labels-mismatch"]);
    assert!(!h.get_by_label("Start").accesskit_node().is_disabled());
    h.get_by_label("Start").click();
    wait_for(
        &mut h,
        "training with the override",
        Duration::from_secs(120),
        |a| a.panels.run.live.step >= 1 && !a.panels.run.live.allowed_lints.is_empty(),
    );
    // Shown in the Run panel and in its log.
    assert!(
        h.query_all_by_label_contains("training despite lint `labels-mismatch`")
            .count()
            >= 2
    );
    h.get_by_label("Stop").click();
    wait_for(&mut h, "the stop", Duration::from_secs(60), |a| {
        matches!(a.panels.run.live.phase, RunPhase::Finished(_))
    });
    let r = &h.state().panels.run.live;
    assert_eq!(r.phase, RunPhase::Finished(FinishReason::Stopped));
    assert!(r.last_checkpoint.is_some(), "Stop saves a checkpoint");

    click_nav(&mut h, Panel::Playground);
    h.get_by_label("Load Right").click();
    wait_for(
        &mut h,
        "the stopped run's checkpoint",
        Duration::from_secs(60),
        |a| {
            let s = &a.panels.playground.sides[1];
            s.loading.is_none() && (s.generator.is_some() || s.load_error.is_some())
        },
    );
    let right = &h.state().panels.playground.sides[1];
    assert!(right.load_error.is_none(), "{:?}", right.load_error);
}

/// Without a system file dialog (no xdg-desktop-portal: forced here, as under Xvfb), "Browse
/// folder…" opens the in-app picker; choosing the bundled demo model there fills the Model
/// field and loads it, and the status bar says which dialog is in use.
#[test]
fn browse_opens_the_in_app_picker_without_a_portal() {
    let out = tempfile::tempdir().expect("tempdir");
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Model),
        output_dir: Some(out.path().join("runs").join("demo")),
        no_system_dialog: Some("no xdg-desktop-portal (forced by the test)".into()),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 860.0);
    wait_ready(&mut h);
    h.get_by_label("Browse folder…").click();
    for _ in 0..4 {
        h.step();
    }
    assert!(
        h.state().chrome.picker.is_some(),
        "the in-app picker opened"
    );
    wait_listed(&mut h);
    assert!(h.query_by_label("Choose this folder").is_some());
    assert!(h
        .query_by_label_contains("using the built-in file picker")
        .is_some());

    // Walk to the bundled model: type its parent, then pick it in the list.
    let assets = tunestudio::paths::assets_dir();
    h.get_by_label("Path").focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label("Path")
        .type_text(&assets.display().to_string());
    h.step();
    h.key_press(egui::Key::Enter);
    wait_listed(&mut h);
    h.get_by_label("demo-model/").click();
    wait_listed(&mut h);
    let shown = h
        .state()
        .chrome
        .picker
        .as_ref()
        .map(|(_, p)| p.dir().to_path_buf());
    assert_eq!(shown.as_deref(), Some(assets.join("demo-model").as_path()));
    h.get_by_label("Choose this folder").click();
    wait_for(&mut h, "the chosen model", Duration::from_secs(60), |a| {
        a.chrome.picker.is_none()
            && a.panels.model.loading.is_none()
            && a.panels.model.info.is_some()
    });
    let s = &h.state().panels;
    assert_eq!(
        std::path::Path::new(&s.model.source_input),
        assets.join("demo-model")
    );
    assert!(s.model.error.is_none(), "{:?}", s.model.error);
}

/// A newcomer's first real run: the demo loads (random init, 3e-3), then a model folder with
/// pretrained weights. The initialisation turns to the weights, the learning rate moves to full
/// fine-tuning's (the demo's warm-up stays), and one line says so; the demo's 3e-3 typed back in shows the
/// learning-rate lint and disables Start until it is allowed by name.
#[test]
fn settings_follow_a_pretrained_model_and_a_wild_rate_blocks_start() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Model, &out.path().join("runs").join("demo"));
    wait_ready(&mut h);
    let c = &h.state().session.config;
    assert_eq!(c.model.init, tunestudio::train::InitMode::Random);
    assert_eq!(c.training.learning_rate, 3e-3);

    let model = tunestudio::paths::shared_dir()
        .join("fixtures")
        .join("tiny-llama");
    h.get_by_label("Folder or hub id").focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label("Folder or hub id")
        .type_text(&model.display().to_string());
    h.step();
    h.get_by_label("Load").click();
    wait_for(
        &mut h,
        "the pretrained model",
        Duration::from_secs(60),
        |a| {
            a.panels
                .model
                .info
                .as_ref()
                .is_some_and(|i| !i.weight_files.is_empty())
                && a.session.follow.note.is_some()
        },
    );
    let c = &h.state().session.config;
    assert_eq!(c.model.init, tunestudio::train::InitMode::Auto);
    assert_eq!(c.training.learning_rate, 2e-5);
    // The demo already warms up (5 steps): that stays.
    assert_eq!(c.training.warmup_steps, 5);
    click_nav(&mut h, Panel::Training);
    // Announced in the Training panel (and in the status bar).
    assert!(
        h.query_all_by_label_contains("learning rate 3e-3 → 2e-5")
            .count()
            >= 1
    );

    h.state_mut().session.config.training.learning_rate = 3e-3;
    click_nav(&mut h, Panel::Run);
    assert!(h
        .query_by_label_contains("Start is disabled: lint `learning-rate`")
        .is_some());
    assert!(h.get_by_label("Start").accesskit_node().is_disabled());
    h.get_by_label_contains("Train anyway despite `learning-rate`")
        .click();
    h.step();
    h.step();
    assert!(h
        .state()
        .session
        .config
        .data
        .allow
        .contains(&"learning-rate".to_string()));
    assert!(!h.get_by_label("Start").accesskit_node().is_disabled());
}

#[test]
fn the_export_panel_writes_a_gguf_file_with_its_predicted_size() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Export, out.path());
    wait_ready(&mut h);
    h.get_by_label("GGUF file").click();
    h.step();
    h.step();
    assert_eq!(
        h.state().panels.export.kind,
        super::shared::ExportKind::Gguf
    );
    // The size follows the type, computed from the loaded model's config.
    let size_of =
        |h: &Harness<'static, StudioApp>| text_containing(h, "+ the tokenizer").unwrap_or_default();
    let q4 = size_of(&h);
    assert!(!q4.is_empty(), "the predicted size is shown");
    h.state_mut().panels.export.gguf_quant = tunestudio::gguf::GgufQuant::F16;
    h.step();
    h.step();
    assert_ne!(size_of(&h), q4, "f16 predicts another size than q4_k_m");

    // A model folder exports as it is (a checkpoint would merge its adapter first).
    let dest = out.path().join("tiny.gguf");
    {
        let e = &mut h.state_mut().panels.export;
        e.checkpoint = crate_fixture("tiny-llama").display().to_string();
        e.destination = dest.display().to_string();
        e.gguf_quant = tunestudio::gguf::GgufQuant::Q8_0;
    }
    // The panel's heading is "Export" too: the button is the one to press.
    h.query_all_by_label("Export")
        .find(|n| n.accesskit_node().role() == egui::accesskit::Role::Button)
        .expect("the Export button")
        .click();
    wait_for(&mut h, "the GGUF export", Duration::from_secs(60), |a| {
        !a.panels.export.running && a.panels.export.result.is_some()
    });
    let result = h.state().panels.export.result.clone().expect("result");
    assert_eq!(result.expect("exported"), dest);
    assert!(std::fs::metadata(&dest).expect("file").len() > 1_000_000);
    assert!(dest.with_extension("Modelfile").is_file());
    assert!(text_containing(&h, "ollama create").is_some());
}

/// The first text on screen (a label's or a widget's value) that contains `needle`.
fn text_containing<S>(h: &Harness<'_, S>, needle: &str) -> Option<String> {
    h.root().children_recursive().find_map(|n| {
        let a = n.accesskit_node();
        let text = a.label().or_else(|| a.value())?.to_string();
        text.contains(needle).then_some(text)
    })
}

/// A fixture model folder under the shared fixtures.
fn crate_fixture(name: &str) -> std::path::PathBuf {
    tunestudio::paths::shared_dir().join("fixtures").join(name)
}

/// What you ship is what you test: the Playground runs the exported GGUF file beside the
/// Hugging Face model it came from, and greedy answers are the same.
#[test]
fn playground_compares_a_gguf_file_with_its_model_folder() {
    use super::playground::SideSource;
    use std::ops::ControlFlow;

    let out = tempfile::tempdir().expect("tempdir");
    let base = crate_fixture("tiny-llama");
    let source = tunestudio::train::export_source(&base, None).expect("source");
    let gguf = out.path().join("tiny-f16.gguf");
    tunestudio::train::export_gguf(
        &source,
        tunestudio::gguf::GgufQuant::F16,
        &gguf,
        false,
        &mut |_| ControlFlow::Continue(()),
    )
    .expect("export");

    let mut h = harness(Panel::Playground, out.path());
    h.state_mut().panels.playground.sides[0].source = SideSource::Folder;
    h.state_mut().panels.playground.sides[1].source = SideSource::Gguf;
    h.step();
    type_into(&mut h, "Left model", &base.display().to_string());
    type_into(&mut h, "Right GGUF", &gguf.display().to_string());
    h.get_by_label("Load Left").click();
    h.step();
    h.get_by_label("Load Right").click();
    wait_for(&mut h, "both sides to load", Duration::from_secs(60), |a| {
        a.panels
            .playground
            .sides
            .iter()
            .all(|s| s.loading.is_none() && (s.generator.is_some() || s.load_error.is_some()))
    });
    for s in &h.state().panels.playground.sides {
        assert!(s.load_error.is_none(), "load failed: {:?}", s.load_error);
    }
    {
        let p = &mut h.state_mut().panels.playground.params;
        p.max_new_tokens = 12;
        p.temperature = 0.0;
        p.stop_on_eos = false;
    }
    type_into(&mut h, "Prompt", "Give three tips for staying healthy.");
    h.get_by_label("Generate").click();
    wait_for(&mut h, "both answers", Duration::from_secs(60), |a| {
        let pg = &a.panels.playground;
        !pg.generating() && pg.sides.iter().all(|s| s.output.stop_reason.is_some())
    });
    let sides = &h.state().panels.playground.sides;
    assert_eq!(sides[1].output.tokens, 12);
    assert_eq!(sides[0].output.text, sides[1].output.text);
}

/// The app on the Model panel with no system file dialog, its "Browse folder…" clicked: the
/// in-app picker is open.
fn open_in_app_picker(out: &Path) -> Harness<'static, StudioApp> {
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Model),
        output_dir: Some(out.join("runs").join("demo")),
        no_system_dialog: Some("no xdg-desktop-portal (forced by the test)".into()),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 860.0);
    h.step();
    h.get_by_label("Browse folder…").click();
    for _ in 0..4 {
        h.step();
    }
    assert!(
        h.state().chrome.picker.is_some(),
        "the in-app picker opened"
    );
    wait_listed(&mut h);
    h
}

/// The folder the open in-app picker lists.
fn picker_dir(h: &Harness<'static, StudioApp>) -> Option<std::path::PathBuf> {
    h.state()
        .chrome
        .picker
        .as_ref()
        .map(|(_, p)| p.dir().to_path_buf())
}

/// The in-app picker is modal: with it open, a click on a sidebar entry leaves the panel as
/// it was; the picker's own buttons still work, and once it is closed the sidebar does too.
#[test]
fn the_in_app_picker_is_modal() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = open_in_app_picker(out.path());
    // Every entry, wherever the picker lies over the sidebar.
    for (i, p) in Panel::ALL.iter().enumerate() {
        h.get_by_label(&format!("{}  {}", i + 1, p.title())).click();
        h.step();
        h.step();
        assert_eq!(
            h.state().session.panel,
            Panel::Model,
            "a click on {} went through",
            p.title()
        );
        assert!(h.state().chrome.picker.is_some(), "the picker stays open");
    }

    let before = picker_dir(&h).expect("open");
    h.get_by_label("⬆ Up").click();
    wait_listed(&mut h);
    assert_eq!(picker_dir(&h).as_deref(), before.parent());
    h.get_by_label("Cancel").click();
    h.step();
    h.step();
    assert!(
        h.state().chrome.picker.is_none(),
        "Cancel closed the picker"
    );
    click_nav(&mut h, Panel::Training);
}

/// A path typed into the picker lists its folders as it is typed, without Enter, and the
/// field keeps the text as typed.
#[test]
fn a_typed_path_lists_its_folders_without_enter() {
    let out = tempfile::tempdir().expect("tempdir");
    let typed = out.path().join("pick-here");
    for d in ["alpha", "beta"] {
        std::fs::create_dir_all(typed.join(d)).expect("mkdir");
    }
    let mut h = open_in_app_picker(out.path());
    // The parent first: its listing shows the folder about to be typed.
    type_into(&mut h, "Path", &out.path().display().to_string());
    wait_listed(&mut h);
    assert!(
        h.query_by_label("pick-here/").is_some(),
        "the parent is listed"
    );
    h.get_by_label("Path").type_text("/pick-here");
    wait_listed(&mut h);
    assert_eq!(picker_dir(&h).as_deref(), Some(typed.as_path()));
    assert!(h.query_by_label("alpha/").is_some(), "alpha/ is listed");
    assert!(h.query_by_label("beta/").is_some(), "beta/ is listed");
    assert_eq!(
        h.get_by_label("Path").value().as_deref(),
        Some(typed.display().to_string().as_str())
    );
}

/// A long status message stops short of the frame-time readout (cut short, the whole of it
/// on hover) instead of running under it.
#[test]
fn a_long_status_message_stops_short_of_the_frame_time_readout() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Model, out.path());
    h.step();
    let long = format!("a long message: {}", "every word of it counts ".repeat(40));
    h.state_mut().chrome.show_debug = true;
    h.state_mut().chrome.toast(long.clone());
    h.step();
    h.step();
    let message = h.get_by_label(&long).rect();
    let toggle = h.get_by_label("frame time").rect();
    let summary = h.get_by_label_contains("ms p95").rect();
    assert!(
        !message.intersects(toggle) && !message.intersects(summary),
        "the message {message:?} overlaps the readout: {summary:?}, {toggle:?}"
    );
    assert!(message.max.x <= summary.min.x, "{message:?} vs {summary:?}");
    assert!(
        toggle.max.x <= 1360.0,
        "the readout left the window: {toggle:?}"
    );
}

/// Issue #44 item 4 in the studio: the demo's rows at `max_length = 1024` are far shorter, and
/// once the Preview has scanned them the studio plans their longest batch, as
/// `tunestudio plan --config` does for the same file, and says so on the GPUs & memory panel.
#[test]
fn the_studio_plans_the_longest_batch_of_the_data_as_the_cli_does() {
    let out = tempfile::tempdir().expect("tempdir");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let quoted = |p: &Path| format!("{:?}", p.display().to_string());
    let config = std::fs::read_to_string(root.join("assets/demo.toml"))
        .expect("demo config")
        .replace(
            "source = \"demo-model\"",
            &format!("source = {}", quoted(&root.join("assets/demo-model"))),
        )
        .replace(
            "path = \"demo-data.json\"",
            &format!("path = {}", quoted(&root.join("assets/demo-data.json"))),
        )
        .replace("max_length = 128", "max_length = 1024");
    let path = out.path().join("run.toml");
    std::fs::write(&path, config).expect("write run.toml");
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Devices),
        output_dir: Some(out.path().join("run")),
        config: Some(path.clone()),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 900.0);
    wait_ready(&mut h);
    wait_for_current_plan(&mut h, "the plan of the scanned data", |r| {
        r.trained_tokens.is_some()
    });
    let studio = h
        .state()
        .panels
        .devices
        .plan
        .request
        .clone()
        .expect("request");
    let cli = cli_request(&["plan", "--config", &path.display().to_string()]);
    assert_eq!(studio.seq_len, 1024);
    assert!(
        studio.planned_seq_len() < 1024,
        "planned {}",
        studio.planned_seq_len()
    );
    assert_eq!(studio.planned_seq_len(), cli.planned_seq_len());
    h.run_steps(2);
    assert!(
        h.query_by_label_contains("planned for the longest batch of this data")
            .is_some(),
        "the panel says what the plan is sized for"
    );
}

/// LLaMA-Factory's sharegpt ranking demo (`dpo_en_demo.json`, from `$TUNESTUDIO_SHARED`).
fn dpo_demo_data() -> Option<std::path::PathBuf> {
    let shared = std::env::var_os("TUNESTUDIO_SHARED")?;
    let path = Path::new(&shared).join("datasets/dpo_en_demo.json");
    path.is_file().then_some(path)
}

/// Issue #40: preference data is previewed as pairs — the prompt masked, the chosen and the
/// rejected completion trained, each as token chips with its lengths — then the pair lints.
#[test]
fn preference_data_shows_the_pair_preview() {
    let Some(data) = dpo_demo_data() else {
        eprintln!("skipped: no $TUNESTUDIO_SHARED/datasets/dpo_en_demo.json");
        return;
    };
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Dataset, out.path());
    wait_ready(&mut h);
    // One pair per micro-batch row keeps the frame small.
    h.state_mut().session.config.training.micro_batch = 1;
    h.get_by_label("File, folder or hub id").focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label("File, folder or hub id")
        .type_text(&data.display().to_string());
    h.step();
    h.get_by_label("Open").click();
    wait_for(&mut h, "the dataset", Duration::from_secs(30), |a| {
        a.jobs.in_flight() == 0 && a.panels.dataset.summary.is_some()
    });
    assert!(
        h.query_by_label_contains("sharegpt_ranking (preference pairs")
            .is_some(),
        "the Dataset panel names the pair format"
    );
    h.get_by_label("Show the token preview").click();
    h.step();
    wait_for(&mut h, "the preview", Duration::from_secs(90), |a| {
        let p = &a.panels.preview;
        a.jobs.in_flight() == 0
            && (p.pairs.preview().is_some() || p.preview.is_some() || p.error.is_some())
    });
    let s = &h.state().panels;
    assert!(s.preview.error.is_none(), "{:?}", s.preview.error);
    assert!(s.preview.preview.is_none(), "previewed as SFT rows");
    let p = s.preview.pairs.preview().cloned().expect("pairs");
    assert_eq!(p.format.name(), "sharegpt_ranking");
    assert_eq!(p.num_rows, 300);
    assert_eq!(p.pairs.len(), 1, "one pair per micro-batch row");
    let pair = &p.pairs[0];
    h.run_steps(2);

    // The two completions, named, with their lengths.
    assert!(h.query_by_label("chosen").is_some(), "no 'chosen' heading");
    assert!(
        h.query_by_label("rejected").is_some(),
        "no 'rejected' heading"
    );
    assert!(
        h.query_all_by_label("prompt").next().is_some(),
        "no 'prompt' heading"
    );
    let lengths = format!(
        "prompt {} · chosen {} · rejected {} tokens",
        pair.prompt.num_tokens(),
        pair.chosen.num_tokens(),
        pair.rejected.num_tokens()
    );
    assert!(h.query_by_label(&lengths).is_some(), "no {lengths:?}");

    // Their tokens as chips with their label classes: the prompt masked, the answers trained.
    let chosen = &pair.chosen.tokens[0];
    let rejected = &pair.rejected.tokens[0];
    assert_eq!(chosen.text, "That", "dpo_en_demo's first chosen answer");
    assert_eq!(rejected.text, "Hello");
    for (t, class) in [(chosen, "trained"), (rejected, "trained")] {
        let name = format!("token {} ({class}, id {}, position 0)", t.text, t.id);
        assert!(h.query_by_label(&name).is_some(), "no chip {name:?}");
    }
    let prompt_first = &pair.prompt.tokens[0];
    assert!(
        h.query_by_label_contains(&format!("(masked, id {}, position 0)", prompt_first.id))
            .is_some(),
        "the prompt's first token is not a masked chip"
    );
    assert_eq!(
        chip_nodes(&h).len(),
        pair.prompt.num_tokens() + pair.chosen.num_tokens() + pair.rejected.num_tokens(),
        "one chip per token of the three parts"
    );

    // The pair lints (the demo's long prompts and answers are cut), and the run's method:
    // SFT does not learn from pairs.
    assert!(p
        .lints
        .iter()
        .any(|l| format!("{:?}", l.kind) == "PairPromptTruncated"));
    assert!(h
        .query_by_label(&format!("Pair lints ({})", p.lints.len()))
        .is_some());
    assert!(h.query_by_label("PairPromptTruncated").is_some());
    assert!(h
        .query_by_label_contains("This dataset holds preference pairs")
        .is_some());
    h.get_by_label("Open Training").click();
    h.run_steps(2);
    assert_eq!(h.state().session.panel, Panel::Training);
}

/// Issue #40: the Training panel's method switch edits `[training] method`, the plan follows
/// (a DPO step runs a pair's chosen and rejected rows, cut at the pair lengths), and the saved
/// run config says `method = "dpo"`.
#[test]
fn switching_the_method_to_dpo_changes_the_plan() {
    let out = tempfile::tempdir().expect("tempdir");
    let mut h = harness(Panel::Training, out.path());
    wait_ready(&mut h);
    wait_for_current_plan(&mut h, "the SFT plan", |_| true);
    let sft_req = h
        .state()
        .panels
        .devices
        .plan
        .request
        .clone()
        .expect("request");
    let sft_peak = planned_peaks(&h)[0];
    assert_eq!(
        h.state().session.config.training.method,
        tunestudio::train::TrainingMethod::Sft
    );
    assert!(h.query_by_label("Beta").is_none(), "β is DPO's");

    h.get_by_label("DPO").click();
    h.run_steps(2);
    assert_eq!(
        h.state().session.config.training.method,
        tunestudio::train::TrainingMethod::Dpo,
        "the switch edits the run config"
    );
    let sft_summary = sft_req.settings_summary();
    wait_for_current_plan(&mut h, "the DPO plan", |r| {
        r.settings_summary() != sft_summary
    });
    let dpo_req = h
        .state()
        .panels
        .devices
        .plan
        .request
        .clone()
        .expect("request");
    let pref = h.state().session.config.preference.clone();
    assert_eq!(dpo_req.micro_batch, 2 * sft_req.micro_batch);
    assert_eq!(
        dpo_req.seq_len,
        pref.max_prompt_length + pref.max_completion_length
    );
    let dpo_peak = planned_peaks(&h)[0];
    assert_ne!(dpo_peak, sft_peak, "the planned peak follows the method");
    println!("planned peak: sft {sft_peak} B → dpo {dpo_peak} B");

    // DPO's own settings: the loss and β.
    assert!(h.query_by_label("Beta").is_some());
    pick(&mut h, "DPO loss", "IPO");
    assert_eq!(
        h.state().session.config.preference.loss,
        tunestudio::train::DpoLoss::Ipo
    );

    // The saved run config trains DPO.
    click_nav(&mut h, Panel::Export);
    let saved = out.path().join("saved").join("run.toml");
    h.state_mut().panels.export.config_path = saved.display().to_string();
    h.run_steps(2);
    h.get_by_label("Save config").click();
    wait_saved(&mut h);
    let text = std::fs::read_to_string(&saved).expect("the saved config");
    assert!(text.contains("method = \"dpo\""), "{text}");
    assert!(text.contains("loss = \"ipo\""), "{text}");
    let (config, problems) = super::jobs::load_config(&saved).expect("reload");
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        config.training.method,
        tunestudio::train::TrainingMethod::Dpo
    );
}
