//! The planner's fixes applied in the studio (issue #39 item 3): every kind of fix the
//! planner ranks for a run that does not fit, applied with its own "Apply" button, leaves a
//! saved run config that trains what the plan showed.

use std::collections::BTreeSet;
use std::time::Duration;

use egui_kittest::kittest::Queryable;
use egui_kittest::Harness;

use super::{app_harness, wait_for, wait_for_current_plan};
use crate::gui::app::{StartOptions, StudioApp};
use crate::gui::session::Panel;
use tunestudio::data::{DataConfig, Format};
use tunestudio::plan::{Change, Plan, PlanRequest, ReferencePlan};
use tunestudio::train::{self, InitMode, ReferenceMode, RunConfig, TrainingMethod};

/// A DPO full fine-tune of tiny-llama on the shared pairs, with a frozen copy as its reference,
/// in fp32 with micro-batch 2 and no checkpointing, data parallel on `devices`.
fn dpo_config(dir: &std::path::Path, devices: &[String]) -> RunConfig {
    let shared = tunestudio::paths::shared_dir();
    let data = shared.join("datasets/dpo_en_demo.json");
    let mut c = RunConfig {
        output_dir: dir.join("runs/dpo"),
        data: DataConfig {
            format: Format::Auto,
            validation_ratio: 0.0,
            ..DataConfig::new(data.display().to_string())
        },
        ..RunConfig::default()
    };
    c.model.source = shared.join("fixtures/tiny-llama").display().to_string();
    c.model.init = InitMode::Pretrained;
    c.training.method = TrainingMethod::Dpo;
    c.training.micro_batch = 2;
    c.training.gradient_accumulation = 1;
    c.preference.reference = ReferenceMode::Copy;
    c.preference.max_prompt_length = 64;
    c.preference.max_completion_length = 64;
    c.devices.devices = devices.to_vec();
    c.devices.strategy = tunestudio::settings::Strategy::DataParallel;
    c
}

fn studio(config: &RunConfig, dir: &std::path::Path) -> Harness<'static, StudioApp> {
    let path = dir.join("run.toml");
    config.save(&path).expect("save run.toml");
    let opts = StartOptions {
        fresh: true,
        panel: Some(Panel::Devices),
        output_dir: Some(config.output_dir.clone()),
        config: Some(path),
        ..StartOptions::default()
    };
    let mut h = app_harness(opts, 2000.0);
    wait_for(&mut h, "tiny-llama to load", Duration::from_secs(90), |a| {
        a.jobs.in_flight() == 0
            && a.panels.model.info.is_some()
            && a.panels.devices.plan.plan.is_some()
    });
    h
}

/// The kind of a fix, by name (the match makes a new kind fail to compile here).
fn kind(c: &Change) -> &'static str {
    match c {
        Change::Strategy(_) | Change::Shard(_) => "strategy",
        Change::Precision(_) => "precision",
        Change::ActivationCheckpointing => "checkpointing",
        Change::MicroBatch { .. } => "micro-batch",
        Change::Lora(_) => "lora",
        Change::SeqLen(_) => "sequence length",
        Change::OptimizerOffload => "optimizer offload",
        Change::Quantize(_) => "qlora",
        Change::Reference(_) => "reference",
        Change::GenerationsPerMicroStep(_) => "generations per micro-step",
    }
}

/// The settings of a request that a run config decides (what the studio's process and the
/// preview's counts add is the studio's own).
fn settings(req: &PlanRequest) -> PlanRequest {
    let mut r = req.clone();
    r.process = None;
    r.trained_tokens = None;
    r
}

/// Waits for the plan of the studio's current config, and returns it with its request.
fn current_plan(h: &mut Harness<'static, StudioApp>) -> (Plan, PlanRequest) {
    wait_for_current_plan(h, "the plan", |_| true);
    let plan = h.state().panels.devices.plan.plan.clone().expect("a plan");
    let req = h
        .state()
        .panels
        .devices
        .plan
        .request
        .clone()
        .expect("its request");
    (plan, req)
}

/// Every kind of fix the planner ranks here — strategy, checkpointing,
/// micro-batch, LoRA, QLoRA, optimizer offload and the DPO reference (a sequence length is
/// never proposed; a precision change saves nothing on tiny-llama's fp32 step, but is applied
/// when ranked) — applied with its "Apply" button: the run config saved after it, planned
/// again through the one adapter, plans the fix's settings; QLoRA sets `[model] quantize`
/// and the reference switch `[preference] reference`; and the saved config validates.
#[test]
fn every_ranked_fix_applied_in_the_studio_saves_the_planned_settings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let big = ["cuda:0=80GiB".to_string(), "cuda:1=80GiB".to_string()];
    let mut h = studio(&dpo_config(dir.path(), &big), dir.path());
    let (plan, _) = current_plan(&mut h);
    let peak_mib = plan.per_device[0].peak_bytes >> 20;
    // 3 % short of the run as configured on each GPU.
    let small: Vec<String> = (0..2)
        .map(|i| format!("cuda:{i}={}MiB", peak_mib * 97 / 100))
        .collect();
    h.state_mut().session.config.devices.devices = small;
    let (plan, req) = current_plan(&mut h);
    assert!(!plan.fits(), "{}", plan.summary);
    let base = h.state().session.config.clone();
    let model = h
        .state()
        .panels
        .model
        .info
        .as_ref()
        .expect("model")
        .config
        .clone();
    let fixes = plan.fixes.clone();
    let kinds: BTreeSet<&str> = fixes.iter().map(|f| kind(&f.change)).collect();
    let expected = [
        "strategy",
        "checkpointing",
        "micro-batch",
        "lora",
        "qlora",
        "optimizer offload",
        "reference",
    ];
    for k in expected {
        assert!(kinds.contains(k), "no {k} fix among {kinds:?}");
    }
    for (i, fix) in fixes.iter().enumerate() {
        h.state_mut().session.config = base.clone();
        let (shown, shown_req) = current_plan(&mut h);
        assert_eq!(shown.fixes[i].change, fix.change);
        h.get_all_by_label("Apply")
            .nth(i)
            .unwrap_or_else(|| panic!("no Apply button for fix {i}: {}", fix.description))
            .click();
        h.run_steps(2);
        let path = dir.path().join(format!("fixed-{i}.toml"));
        h.state().session.config.save(&path).expect("save");
        let saved = RunConfig::load(&path).expect("the saved config loads and validates");
        let replanned = train::plan_request(&saved, model.clone(), shown_req.devices.clone());
        assert_eq!(
            settings(&replanned),
            settings(&fix.change.apply(&req)),
            "{}",
            fix.description
        );
        match &fix.change {
            Change::Quantize(q) => assert_eq!(saved.model.quantize, *q),
            Change::Reference(ReferencePlan::Stored) => {
                assert_eq!(saved.preference.reference, ReferenceMode::Precomputed)
            }
            _ => {}
        }
    }
}
