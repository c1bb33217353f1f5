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
fn hebrew_text_renders_with_a_system_font() {
    let fonts = super::fonts::SystemFonts::scan();
    if fonts.alphabetic.is_none() {
        println!("skipped: no system font for Hebrew found");
        return;
    }
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
