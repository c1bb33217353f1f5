//! Exact resume (CPU, fp32): a run stopped at step k — by dropping it, or by killing the
//! `tunestudio train` process — and resumed from its checkpoint continues with the
//! uninterrupted run's losses within 1e-6.

use crate::train_common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use train_common::*;
use tunestudio::train::{read_metrics, Event, RunConfig, TrainingRun};

fn losses(run: &mut TrainingRun) -> BTreeMap<u64, f64> {
    let mut out = BTreeMap::new();
    while !run.is_done() {
        let o = run.step().unwrap();
        out.insert(o.step, o.loss);
    }
    out
}

fn assert_same(reference: &BTreeMap<u64, f64>, resumed: &BTreeMap<u64, f64>) {
    assert!(!resumed.is_empty());
    for (step, l) in resumed {
        let r = reference[step];
        assert!(
            (r - l).abs() <= 1e-6,
            "step {step}: resumed loss {l} vs uninterrupted {r}"
        );
    }
}

/// Two epochs' boundary, accumulation and clipping are crossed: 40 rows, micro-batch 2,
/// accumulation 2 → 10 steps per epoch; stop at 7, resume to 14.
fn small_config(out: &std::path::Path) -> RunConfig {
    let tmp_data = out.with_extension("data.json");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str::<Vec<serde_json::Value>>(&std::fs::read_to_string(alpaca()).unwrap())
            .unwrap()
            .into_iter()
            .take(40)
            .collect();
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&tmp_data, serde_json::to_string(&rows).unwrap()).unwrap();
    let mut c = tiny_config(out, 14);
    c.data.path = tmp_data.display().to_string();
    c.training.micro_batch = 2;
    c.training.gradient_accumulation = 2;
    c.training.weight_decay = 0.01;
    c.training.schedule = tunestudio::train::ScheduleKind::Cosine;
    c.training.warmup_steps = 2;
    c
}

#[test]
fn resume_in_process_matches_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = losses(&mut TrainingRun::new(small_config(&tmp.path().join("ref"))).unwrap());
    assert_eq!(reference.len(), 14);

    let cfg = small_config(&tmp.path().join("cut"));
    let mut first = TrainingRun::new(cfg.clone()).unwrap();
    for _ in 0..7 {
        first.step().unwrap();
    }
    let ckpt = first.save_checkpoint().unwrap();
    // Two more steps that are never saved: dropped as if the process died.
    first.step().unwrap();
    first.step().unwrap();
    drop(first);

    let latest = tunestudio::train::latest_checkpoint(&cfg.output_path()).unwrap();
    assert_eq!(latest, ckpt);
    let mut resumed = TrainingRun::resume(cfg, &latest).unwrap();
    assert_eq!(resumed.step_index(), 7);
    let after = losses(&mut resumed);
    assert_eq!(
        after.keys().copied().collect::<Vec<_>>(),
        (8..=14).collect::<Vec<_>>()
    );
    assert_same(&reference, &after);
}

/// Kill `tunestudio train` right after its first checkpoint appears, resume with
/// `--resume latest`, and compare the recorded losses with an uninterrupted run's.
#[test]
fn resume_after_killing_the_process() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = losses(&mut TrainingRun::new(small_config(&tmp.path().join("ref"))).unwrap());

    let out = tmp.path().join("killed");
    let mut cfg = small_config(&out);
    cfg.checkpoint.save_every = 3;
    cfg.checkpoint.keep_last = 0;
    let cfg = cfg.with_absolute_paths();
    let cfg_path = tmp.path().join("run.toml");
    cfg.save(&cfg_path).unwrap();

    let bin = env!("CARGO_BIN_EXE_tunestudio");
    let mut child = std::process::Command::new(bin)
        .args(["train", "--config"])
        .arg(&cfg_path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while tunestudio::train::latest_checkpoint(&out).is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint appeared"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("tunestudio train exited early: {status}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let killed_at = tunestudio::train::list_checkpoints(&out);
    assert!(!killed_at.is_empty());
    assert!(
        killed_at.last().unwrap().0 < 14,
        "the run finished before it was killed; nothing to resume"
    );

    let resumed_from = killed_at.last().unwrap().0;
    let status = std::process::Command::new(bin)
        .args(["train", "--config"])
        .arg(&cfg_path)
        .args(["--resume", "latest"])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());

    // The last value per step in metrics.jsonl: steps redone after the kill are overwritten.
    let events = read_metrics(&out).unwrap();
    let mut recorded = BTreeMap::new();
    for e in &events {
        if let Event::Step { step, loss, .. } = e {
            recorded.insert(*step, *loss);
        }
    }
    assert_eq!(recorded.len(), 14, "steps recorded: {:?}", recorded.keys());
    assert_same(&reference, &recorded);
    assert_resumed_after(&out, resumed_from, 14);
}

/// The last recorded loss of every step in `out`'s `metrics.jsonl`.
fn recorded_losses(out: &std::path::Path) -> BTreeMap<u64, f64> {
    let mut recorded = BTreeMap::new();
    for e in read_metrics(out).unwrap() {
        if let Event::Step { step, loss, .. } = e {
            recorded.insert(step, loss);
        }
    }
    recorded
}

/// The GPU's code path on the CPU (`TUNESTUDIO_OPS=generic`: generic ops, AdamW moments as
/// device tensors), through the real CLI: resuming from step 7's checkpoint reproduces the
/// uninterrupted run's steps 8–14 within 1e-6.
#[test]
fn generic_ops_resume_exactly_through_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("generic");
    let mut cfg = small_config(&out);
    cfg.checkpoint.save_every = 7;
    cfg.checkpoint.keep_last = 0;
    let cfg = cfg.with_absolute_paths();
    let cfg_path = tmp.path().join("run.toml");
    cfg.save(&cfg_path).unwrap();
    let train = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["train", "--config"])
            .arg(&cfg_path)
            .args(extra)
            .env(tunestudio::model::OPS_ENV, "generic")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    train(&[]);
    let uninterrupted = recorded_losses(&out);
    assert_eq!(uninterrupted.len(), 14);
    let ckpt7 = tunestudio::train::list_checkpoints(&out)
        .into_iter()
        .find(|(step, _)| *step == 7)
        .expect("a checkpoint at step 7")
        .1;
    train(&["--resume", &ckpt7.display().to_string()]);
    let resumed = recorded_losses(&out);
    assert_eq!(resumed.len(), 14);
    assert_same(&uninterrupted, &resumed);
    assert_resumed_after(&out, 7, 14);
}

/// `training.optimizer_offload = "host"` through `tunestudio train`: the state lives in host RAM
/// (on a CPU run that is where the parameters are too), and the run is the default run.
#[test]
fn optimizer_offload_trains_like_the_default_through_the_cli() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, offload: tunestudio::model::OptimizerOffload| {
        let out = tmp.path().join(name);
        let mut cfg = small_config(&out);
        cfg.training.optimizer_offload = offload;
        let cfg = cfg.with_absolute_paths();
        let path = tmp.path().join(format!("{name}.toml"));
        cfg.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["train", "--config"])
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        (recorded_losses(&out), text)
    };
    let (default, _) = run("default", tunestudio::model::OptimizerOffload::None);
    let (offloaded, toml) = run("host", tunestudio::model::OptimizerOffload::Host);
    assert!(toml.contains("optimizer_offload = \"host\""), "{toml}");
    assert_eq!(offloaded.len(), 14);
    assert_same(&default, &offloaded);
}
