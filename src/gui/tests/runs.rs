//! Whole runs in the studio (issue #43): the exports loaded back, "Resume that run", the
//! out-of-memory refit and resume, a QLoRA run, data parallel over logical CPU devices and a
//! dry run — each started from the panels' own controls on tiny-llama (hidden 64, 2 layers),
//! and checked against the library running the same config.

use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use eframe::egui;
use egui_kittest::kittest::{NodeT, Queryable};
use egui_kittest::Harness;

use super::{app_harness, click_nav, pick, text_containing, wait_for, wait_for_current_plan};
use crate::gui::app::{StartOptions, StudioApp};
use crate::gui::run_state::RunPhase;
use crate::gui::session::Panel;
use tunestudio::data::{DataConfig, Format};
use tunestudio::model::CausalLm;
use tunestudio::train::{FinishReason, InitMode, RunConfig, ScheduleKind, TrainingRun};

fn tiny_llama() -> PathBuf {
    tunestudio::paths::shared_dir().join("fixtures/tiny-llama")
}

/// tiny-llama with a LoRA (r 4 on q/v/down) on the bundled demo data: max_length 64,
/// micro-batch 2, a constant 5e-3 (the learning-rate lint allowed: tiny-llama's weights are
/// random-like), no evaluation, a checkpoint at the end only.
fn tiny_config(out: &Path, steps: u64) -> RunConfig {
    let data = tunestudio::paths::assets_dir().join("demo-data.json");
    let mut c = RunConfig {
        output_dir: out.to_path_buf(),
        data: DataConfig {
            format: Format::Alpaca,
            max_length: 64,
            validation_ratio: 0.0,
            seed: 0,
            allow: vec!["learning-rate".into()],
            ..DataConfig::new(data.display().to_string())
        },
        ..RunConfig::default()
    };
    c.model.source = tiny_llama().display().to_string();
    c.model.init = InitMode::Pretrained;
    let t = &mut c.training;
    t.micro_batch = 2;
    t.gradient_accumulation = 1;
    t.max_steps = Some(steps);
    t.learning_rate = 5e-3;
    t.schedule = ScheduleKind::Constant;
    t.warmup_steps = 0;
    t.seed = 0;
    t.max_grad_norm = 1.0;
    c.lora.enabled = true;
    c.lora.r = 4;
    c.lora.alpha = 8.0;
    c.lora.dropout = 0.0;
    c.lora.target_modules = vec!["q_proj".into(), "v_proj".into(), "down_proj".into()];
    c.eval.eval_every = 0;
    c.checkpoint.save_every = 0;
    c.checkpoint.save_final = true;
    c
}

/// The studio opened on `config` (saved as `dir/run.toml`, as a user opens a run config), on
/// `panel`; `inject_oom` makes its first run's step fail as out of memory (`STEP:PHASE`).
fn studio(
    config: &RunConfig,
    dir: &Path,
    panel: Panel,
    inject_oom: Option<&str>,
) -> Harness<'static, StudioApp> {
    let path = dir.join("run.toml");
    config
        .with_absolute_paths()
        .save(&path)
        .expect("save run.toml");
    let opts = StartOptions {
        fresh: true,
        panel: Some(panel),
        output_dir: Some(config.output_dir.clone()),
        config: Some(path),
        inject_oom: inject_oom.map(str::to_string),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 1100.0);
    wait_for(&mut h, "tiny-llama to load", Duration::from_secs(90), |a| {
        a.jobs.in_flight() == 0
            && a.panels.model.info.is_some()
            && a.panels.preview.preview.is_some()
            && a.panels.devices.plan.plan.is_some()
            && a.panels.devices.inventory.is_some()
    });
    h
}

/// Presses Start on the Run panel, and waits for the output folder's check.
fn start(h: &mut Harness<'static, StudioApp>) {
    click_nav(h, Panel::Run);
    h.get_by_label("Start").click();
    h.run_steps(2);
    wait_start_jobs(h);
}

/// Waits for the jobs Start waits on (the output folder's check, a new folder, the refit).
fn wait_start_jobs(h: &mut Harness<'static, StudioApp>) {
    wait_for(h, "Start's jobs", Duration::from_secs(60), |a| {
        !a.panels.run.pending.busy()
    });
}

/// Waits for the run to end; returns how.
fn wait_finished(h: &mut Harness<'static, StudioApp>) -> FinishReason {
    wait_for(h, "the run to end", Duration::from_secs(120), |a| {
        matches!(a.panels.run.live.phase, RunPhase::Finished(_))
    });
    match h.state().panels.run.live.phase {
        RunPhase::Finished(r) => r,
        _ => unreachable!(),
    }
}

/// Replaces the text of the field labelled `label` as a user does (select all, type).
fn retype(h: &mut Harness<'static, StudioApp>, label: &str, text: &str) {
    h.get_by_label(label).focus();
    h.step();
    h.key_press_modifiers(egui::Modifiers::COMMAND, egui::Key::A);
    h.step();
    h.get_by_label(label).type_text(text);
    h.run_steps(2);
}

/// The same config trained by the library for `steps` steps in `out`: the losses and the run.
fn library_run(config: &RunConfig, out: &Path, steps: usize) -> (Vec<f64>, TrainingRun) {
    let mut c = config.clone();
    c.output_dir = out.to_path_buf();
    c.checkpoint.save_final = false;
    let mut run = TrainingRun::new(c).expect("the library's run");
    let losses = (0..steps)
        .map(|_| run.step().expect("a library step").loss)
        .collect();
    (losses, run)
}

/// The studio's losses, `(step, loss)`.
fn studio_losses(h: &Harness<'static, StudioApp>) -> Vec<(u64, f64)> {
    let r = &h.state().panels.run.live;
    r.loss.iter().map(|p| (p[0] as u64, p[1])).collect()
}

/// Asserts the studio's losses are `reference`'s (steps from 1) within `tol`.
fn assert_losses(studio: &[(u64, f64)], reference: &[f64], tol: f64) {
    assert_eq!(studio.len(), reference.len(), "{studio:?} vs {reference:?}");
    for ((step, s), (i, r)) in studio.iter().zip(reference.iter().enumerate()) {
        assert_eq!(*step, i as u64 + 1);
        assert!(
            (s - r).abs() <= tol,
            "step {step}: studio {s} vs library {r}"
        );
    }
}

fn probe_logits(model: &CausalLm) -> Tensor {
    let ids = Tensor::new(&[[1u32, 100, 200, 300, 400, 500, 600, 2]], &Device::Cpu).unwrap();
    model.logits(&ids, None).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .expect("logit difference")
}

/// Exports the checkpoint in the Export panel's Checkpoint field as `kind` (its radio label)
/// to `dest`; returns what the panel reports.
fn export(h: &mut Harness<'static, StudioApp>, kind: &str, dest: &Path) -> PathBuf {
    h.get_by_label(kind).click();
    h.run_steps(2);
    retype(h, "Destination", &dest.display().to_string());
    // The panel's heading is "Export" too: the button is the one to press.
    h.query_all_by_label("Export")
        .find(|n| n.accesskit_node().role() == egui::accesskit::Role::Button)
        .expect("the Export button")
        .click();
    // The click is handled on the next frames (until then the last export's result shows).
    h.run_steps(2);
    wait_for(h, "the export", Duration::from_secs(60), |a| {
        !a.panels.export.running && a.panels.export.result.is_some()
    });
    let result = h.state().panels.export.result.clone().expect("a result");
    let written = result.unwrap_or_else(|e| panic!("{kind} export failed: {e:?}"));
    assert!(
        text_containing(h, &format!("Exported to {}", written.display())).is_some(),
        "the panel says where it exported"
    );
    written
}

/// Issue #43: after a 2-step LoRA run the Export panel writes the PEFT adapter and the merged
/// model, and after a 2-step full fine-tune (Training → "Full fine-tune", Start → "Train in a
/// new folder") the full model; each loads back with the library (the adapter onto the base)
/// and gives the trained model's logits — the library's run of the same config — within 1e-5.
#[test]
fn exports_of_each_kind_load_back_with_the_trained_logits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(&dir.path().join("runs").join("lora"), 2);
    let mut h = studio(&config, dir.path(), Panel::Run, None);
    start(&mut h);
    assert_eq!(wait_finished(&mut h), FinishReason::Completed);
    let checkpoint = h
        .state()
        .panels
        .run
        .live
        .last_checkpoint
        .clone()
        .expect("saved");
    let (losses, reference) = library_run(&config, &dir.path().join("ref-lora"), 2);
    assert_losses(&studio_losses(&h), &losses, 1e-5);
    let trained = probe_logits(reference.model());
    let base_model = CausalLm::load(&tiny_llama(), DType::F32, &Device::Cpu).unwrap();
    let base = probe_logits(&base_model);
    let moved = max_abs_diff(&trained, &base);
    assert!(moved > 1e-3, "2 steps moved the logits by only {moved:e}");

    click_nav(&mut h, Panel::Export);
    // The panel proposes the run's last checkpoint.
    assert_eq!(
        Path::new(&h.state().panels.export.checkpoint),
        checkpoint.as_path()
    );
    pick(&mut h, "Weights dtype", "f32");
    let adapter = export(&mut h, "LoRA adapter", &dir.path().join("adapter"));
    assert!(adapter.join("adapter_config.json").is_file());
    assert!(adapter.join("adapter_model.safetensors").is_file());
    let mut with_adapter = CausalLm::load(&tiny_llama(), DType::F32, &Device::Cpu).unwrap();
    with_adapter
        .load_adapter(&adapter)
        .expect("the adapter loads");
    let d_adapter = max_abs_diff(&probe_logits(&with_adapter), &trained);

    let merged = export(&mut h, "merged model", &dir.path().join("merged"));
    assert!(
        !merged.join("adapter_config.json").exists(),
        "a model folder"
    );
    let merged_model = CausalLm::load(&merged, DType::F32, &Device::Cpu).expect("merged loads");
    let d_merged = max_abs_diff(&probe_logits(&merged_model), &trained);

    // A full fine-tune of the same data, in a new folder.
    click_nav(&mut h, Panel::Training);
    h.get_by_label("Full fine-tune").click();
    h.run_steps(2);
    assert!(!h.state().session.config.lora.enabled);
    let full_config = h.state().session.config.clone();
    start(&mut h);
    h.get_by_label("Train in a new folder").click();
    h.run_steps(2);
    wait_start_jobs(&mut h);
    assert_eq!(wait_finished(&mut h), FinishReason::Completed);
    let (full_losses, full_reference) = library_run(&full_config, &dir.path().join("ref-full"), 2);
    assert_losses(&studio_losses(&h), &full_losses, 1e-5);
    let full_trained = probe_logits(full_reference.model());

    click_nav(&mut h, Panel::Export);
    let full_checkpoint = h
        .state()
        .panels
        .run
        .live
        .last_checkpoint
        .clone()
        .expect("saved");
    // A job looks for the newest checkpoint of the (new) output folder.
    h.get_by_label("Use the latest").click();
    wait_for(
        &mut h,
        "the latest checkpoint",
        Duration::from_secs(30),
        |a| Path::new(&a.panels.export.checkpoint) == full_checkpoint.as_path(),
    );
    let full = export(&mut h, "full model", &dir.path().join("full"));
    let full_model = CausalLm::load(&full, DType::F32, &Device::Cpu).expect("full loads");
    let d_full = max_abs_diff(&probe_logits(&full_model), &full_trained);
    println!(
        "logits against the trained model: adapter {d_adapter:e}, merged {d_merged:e}, full {d_full:e} (training moved them {moved:e})"
    );
    assert!(d_adapter <= 1e-5, "adapter: {d_adapter:e}");
    assert!(d_merged <= 1e-5, "merged: {d_merged:e}");
    assert!(d_full <= 1e-5, "full: {d_full:e}");
    assert!(
        max_abs_diff(&full_trained, &base) > 1e-3,
        "full run trained"
    );
}

/// Issue #43: Stop leaves a checkpoint of step k; Start then asks about the run in the folder
/// and "Resume that run" continues at step k + 1 with the loss an uninterrupted run has
/// there — not a restart's step-1 loss.
#[test]
fn resume_latest_continues_from_the_checkpoint_step() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(&dir.path().join("runs").join("resume"), 40);
    let mut h = studio(&config, dir.path(), Panel::Run, None);
    start(&mut h);
    wait_for(&mut h, "two steps", Duration::from_secs(60), |a| {
        a.panels.run.live.step >= 2
    });
    h.get_by_label("Stop").click();
    assert_eq!(wait_finished(&mut h), FinishReason::Stopped);
    let k = h.state().panels.run.live.step;
    let checkpoint = h
        .state()
        .panels
        .run
        .live
        .last_checkpoint
        .clone()
        .expect("saved");
    assert!(
        checkpoint.ends_with(format!("checkpoint-{k}")),
        "{}",
        checkpoint.display()
    );

    start(&mut h);
    assert!(
        h.state().panels.run.live.existing_run.is_some(),
        "Start asks about the run in the folder"
    );
    h.get_by_label("Resume that run").click();
    h.run_steps(2);
    wait_for(&mut h, "two resumed steps", Duration::from_secs(60), |a| {
        a.panels.run.live.loss.len() >= 2
    });
    h.get_by_label("Stop").click();
    wait_finished(&mut h);
    let resumed = studio_losses(&h);
    println!("stopped at step {k}; resumed: {resumed:?}");
    assert_eq!(
        h.state().panels.run.live.start_step,
        k,
        "started at the checkpoint"
    );
    assert_eq!(
        resumed[0].0,
        k + 1,
        "the step counter continues: {resumed:?}"
    );
    assert!(h
        .query_all_by_label_contains("resumed from")
        .next()
        .is_some());

    let (uninterrupted, _) = library_run(&config, &dir.path().join("ref"), k as usize + 2);
    for (step, loss) in &resumed[..2] {
        let u = uninterrupted[*step as usize - 1];
        assert!(
            (loss - u).abs() <= 1e-5,
            "step {step}: resumed {loss} vs uninterrupted {u}"
        );
    }
    let restart = uninterrupted[0];
    assert!(
        (resumed[0].1 - restart).abs() > 1e-4,
        "the first resumed loss {} is a restart's step-1 loss {restart}",
        resumed[0].1
    );
}

/// Issue #43: a step that runs out of memory (injected for this studio's first run at step
/// 3, backward) stops the run with a checkpoint of step 2; the Run panel shows the error and
/// the refit (the settings `train::oom` fits, same effective batch); "Apply the fix and
/// resume" applies them and continues at step 3 from that checkpoint, the loss that of an
/// uninterrupted run, and the run's saved config has the refit settings.
#[test]
fn out_of_memory_refit_applies_and_resumes_from_the_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = tiny_config(&dir.path().join("runs").join("oom"), 5);
    config.training.micro_batch = 4;
    let mut h = studio(&config, dir.path(), Panel::Run, Some("3:backward"));
    start(&mut h);
    assert_eq!(wait_finished(&mut h), FinishReason::Failed);
    let run = &h.state().panels.run.live;
    let error = run.error.clone().expect("an error");
    assert!(error.is_out_of_memory(), "{error:?}");
    assert_eq!(error.step, Some(3));
    let checkpoint = run.last_checkpoint.clone().expect("a checkpoint");
    assert!(
        checkpoint.ends_with("checkpoint-2"),
        "{}",
        checkpoint.display()
    );
    let offered = run.oom_refit.clone().expect("the refit offer");
    let expected =
        tunestudio::train::oom::refit_after_oom(&h.state().session.config).expect("a refit");
    assert_eq!(offered, expected.changes);
    assert!(!offered.is_empty());
    println!("refit offered: {}", offered.join("; "));
    assert_ne!(expected.config.training, h.state().session.config.training);
    // The Run panel shows it.
    assert!(h.query_by_label("Out of memory").is_some());
    let card = text_containing(&h, "Settings that fit what the device held").expect("card");
    assert!(card.contains(&offered.join("; ")), "{card}");

    h.get_by_label("Apply the fix and resume").click();
    h.run_steps(2);
    wait_start_jobs(&mut h);
    assert_eq!(
        h.state().session.config.training,
        expected.config.training,
        "the refit settings are applied"
    );
    assert_eq!(wait_finished(&mut h), FinishReason::Completed);
    let r = &h.state().panels.run.live;
    assert!(r.error.is_none(), "{:?}", r.error);
    assert_eq!(r.start_step, 2, "resumed from checkpoint-2");
    let resumed = studio_losses(&h);
    assert_eq!(resumed.iter().map(|p| p.0).collect::<Vec<_>>(), [3, 4, 5]);
    let last = r.last_checkpoint.clone().expect("final checkpoint");
    let saved = RunConfig::load(&last.join("run.toml")).expect("the run's config");
    assert_eq!(
        saved.training.micro_batch,
        expected.config.training.micro_batch
    );
    assert_eq!(
        saved.training.gradient_accumulation,
        expected.config.training.gradient_accumulation
    );

    // Same effective batch: the uninterrupted run's losses (micro-batches summed in another
    // grouping, so to 1e-4), and not a restart's.
    let (uninterrupted, _) = library_run(&config, &dir.path().join("ref"), 5);
    for (step, loss) in &resumed {
        let u = uninterrupted[*step as usize - 1];
        assert!(
            (loss - u).abs() <= 1e-4,
            "step {step}: resumed {loss} vs uninterrupted {u}"
        );
    }
    assert!((resumed[0].1 - uninterrupted[0]).abs() > 1e-4, "a restart");
}

/// Issue #43: Training → Base "QLoRA 8-bit (q8_0)" trains with a quantized base: the losses
/// are finite and those of the library's q8_0 run of the config (not those of the full
/// precision base), and the run's saved config says q8_0.
#[test]
fn a_qlora_run_trains_on_a_quantized_base() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(&dir.path().join("runs").join("qlora"), 3);
    let mut h = studio(&config, dir.path(), Panel::Training, None);
    pick(&mut h, "Base", "QLoRA 8-bit (q8_0)");
    assert_eq!(
        h.state().session.config.model.quantize,
        tunestudio::settings::Quantization::Q8_0
    );
    let qlora_config = h.state().session.config.clone();
    start(&mut h);
    assert_eq!(wait_finished(&mut h), FinishReason::Completed);
    let losses = studio_losses(&h);
    assert!(losses.iter().all(|(_, l)| l.is_finite()), "{losses:?}");
    let (quantized, _) = library_run(&qlora_config, &dir.path().join("ref-q8"), 3);
    assert_losses(&losses, &quantized, 1e-5);
    let (full_precision, _) = library_run(&config, &dir.path().join("ref-f32"), 1);
    let gap = (losses[0].1 - full_precision[0]).abs();
    println!(
        "step 1: q8_0 {} vs f32 base {} ({gap:e})",
        losses[0].1, full_precision[0]
    );
    assert!(gap > 1e-6, "the base was not quantized: {gap:e}");
    let last = h
        .state()
        .panels
        .run
        .live
        .last_checkpoint
        .clone()
        .expect("saved");
    let saved = RunConfig::load(&last.join("run.toml")).expect("the run's config");
    assert_eq!(
        saved.model.quantize,
        tunestudio::settings::Quantization::Q8_0
    );
}

/// Issue #43: GPUs & memory → "Logical CPU devices" 2 and Strategy "data parallel" train on
/// `cpu:0`, `cpu:1` (micro-batch 2 each), with the losses of one device taking both
/// micro-batches (micro-batch 4) within 1e-5.
#[test]
fn data_parallel_on_logical_cpu_devices_trains_like_one_device() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(&dir.path().join("runs").join("dp"), 3);
    let mut h = studio(&config, dir.path(), Panel::Devices, None);
    pick(&mut h, "Logical CPU devices", "2 (cpu:0, cpu:1)");
    pick(&mut h, "Strategy", "data parallel");
    let c = &h.state().session.config;
    assert_eq!(c.devices.devices, ["cpu:0", "cpu:1"]);
    assert_eq!(
        c.devices.strategy,
        tunestudio::settings::Strategy::DataParallel
    );
    wait_for_current_plan(&mut h, "the two-device plan", |r| r.devices.len() == 2);
    start(&mut h);
    assert_eq!(wait_finished(&mut h), FinishReason::Completed);
    assert!(h
        .query_all_by_label_contains("started: 3 steps")
        .next()
        .is_some());
    let mut one = config.clone();
    one.training.micro_batch = 4;
    let (reference, _) = library_run(&one, &dir.path().join("ref"), 3);
    assert_losses(&studio_losses(&h), &reference, 1e-5);
}

/// Issue #43: GPUs & memory → "Dry run" runs one real step and shows its result: completed,
/// the measured peak beside the planned one.
#[test]
fn a_dry_run_from_the_devices_panel_runs_and_shows_measured_against_planned() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = tiny_config(&dir.path().join("runs").join("dry"), 3);
    let mut h = studio(&config, dir.path(), Panel::Devices, None);
    h.get_by_label("Dry run").click();
    h.run_steps(2);
    assert!(h.state().panels.devices.plan.dry_run_running);
    wait_for(&mut h, "the dry run", Duration::from_secs(90), |a| {
        !a.panels.devices.plan.dry_run_running
    });
    let s = &h.state().panels.devices;
    assert!(s.plan.error.is_none(), "{:?}", s.plan.error);
    let report = s.plan.dry_run.clone().expect("a dry run report");
    assert!(report.ok(), "{}", report.summary);
    assert!(report.predicted_peak_bytes > 0);
    assert!(
        report.measured_peak_bytes.is_some_and(|b| b > 0),
        "{report:?}"
    );
    assert!(report.step_secs > 0.0);
    assert!(report.components.is_some(), "the step measured its parts");
    // Nothing of a run is written.
    assert!(!config.output_dir.join("metrics.jsonl").exists());
    assert_eq!(
        h.query_all_by_label("Dry run").count(),
        2,
        "the button and the result's heading"
    );
    assert!(
        text_containing(&h, &report.summary).is_some(),
        "the summary is shown: {}",
        report.summary
    );
    println!("dry run: {}", report.summary);
}
