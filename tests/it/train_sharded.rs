//! Sharded data parallel (`[devices] strategy = "sharded"`, ZeRO-2) through `tunestudio train`
//! on logical CPU devices that copy as GPUs do: it trains as one device does (full fine-tuning
//! and LoRA, native and generic ops, accumulation 4), each rank holds half of data parallel's
//! optimizer state, and a two-rank checkpoint resumes on one and on three devices.

use crate::train_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use train_common::*;
use tunestudio::settings::{ShardMode, Strategy};
use tunestudio::train::{read_metrics, Event, RunConfig, TrainingRun};

/// 8 steps over the first 48 Alpaca rows (lengths vary, so ranks pad differently),
/// accumulation 4, on `devices`.
fn config(out: &Path, rows_per_micro_step: usize, devices: &[&str], lora: bool) -> RunConfig {
    // One data file per folder, the same for every run in it (a resume checks the data path).
    let data = out.parent().unwrap().join("rows.json");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str::<Vec<serde_json::Value>>(&std::fs::read_to_string(alpaca()).unwrap())
            .unwrap()
            .into_iter()
            .take(48)
            .collect();
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&data, serde_json::to_string(&rows).unwrap()).unwrap();
    let mut c = tiny_config(out, 8);
    c.data.path = data.display().to_string();
    c.data.validation_ratio = 0.0;
    c.training.micro_batch = rows_per_micro_step / devices.len();
    c.training.gradient_accumulation = 4;
    c.devices.devices = devices.iter().map(|d| d.to_string()).collect();
    c.devices.strategy = if devices.len() > 1 {
        Strategy::Sharded
    } else {
        Strategy::Single
    };
    if lora {
        c.lora.enabled = true;
        c.lora.r = 8;
        c.lora.alpha = 16.0;
        c.lora.dropout = 0.0;
        c.lora.target_modules = vec!["all-linear".into()];
        c.training.learning_rate = 0.01;
    }
    c
}

/// `tunestudio train` on `config` with `TUNESTUDIO_OPS=ops` and `extra` arguments; the
/// process's stderr on failure.
fn train(config: &RunConfig, ops: &str, extra: &[&str]) -> Result<(), String> {
    let path = config.output_dir.with_extension("toml");
    config.clone().with_absolute_paths().save(&path).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(&path)
        .args(extra)
        .env(tunestudio::model::OPS_ENV, ops)
        .env(tunestudio::model::DISTINCT_CPU_DEVICES_ENV, "1")
        .output()
        .unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Every step's last recorded loss.
fn losses(out: &Path) -> BTreeMap<u64, f64> {
    read_metrics(out)
        .unwrap()
        .into_iter()
        .filter_map(|e| match e {
            Event::Step { step, loss, .. } => Some((step, loss)),
            _ => None,
        })
        .collect()
}

/// The largest `|a − b| / |a|` over the steps.
fn worst_relative(reference: &BTreeMap<u64, f64>, other: &BTreeMap<u64, f64>) -> f64 {
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        other.keys().collect::<Vec<_>>()
    );
    reference
        .iter()
        .map(|(step, r)| (r - other[step]).abs() / r.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// Two ranks, each micro-step's 4 rows split 2 + 2, accumulation 4: the loss of every step
/// is one device's with the whole batch, within 1e-6 of its size, for full fine-tuning and
/// LoRA on both ops paths. (Relative: at a loss of 10.8 one f32 step is 9.5e-7, and the ranks
/// pad their rows to other lengths, so step 1's loss, before any update, already differs by
/// 5e-8.)
#[test]
fn sharded_over_two_devices_trains_like_one_device() {
    let tmp = tempfile::tempdir().unwrap();
    for ops in ["native", "generic"] {
        for lora in [false, true] {
            let case = format!("{ops}-{}", if lora { "lora" } else { "full" });
            let one = config(&tmp.path().join(format!("one-{case}")), 4, &["cpu"], lora);
            train(&one, ops, &[]).unwrap();
            let reference = losses(&one.output_dir);
            assert_eq!(reference.len(), 8, "{reference:?}");

            let sharded = config(
                &tmp.path().join(format!("sharded-{case}")),
                4,
                &["cpu:0", "cpu:1"],
                lora,
            );
            train(&sharded, ops, &[]).unwrap();
            let got = losses(&sharded.output_dir);
            let diff = worst_relative(&reference, &got);
            println!("{case}: worst relative step-loss difference from one device {diff:.3e}");
            assert!(diff <= 1e-6, "{case}: {got:?} vs one device {reference:?}");
        }
    }
}

/// A checkpoint two sharded ranks wrote (the optimizer state whole, under one device's names)
/// resumes on one device and on three sharded ranks (the same rows per micro-step: 6 as
/// 6 × 1, 3 × 2 and 2 × 3) and continues the uninterrupted two-rank run.
#[test]
fn a_sharded_checkpoint_resumes_on_one_and_on_three_devices() {
    let tmp = tempfile::tempdir().unwrap();
    let mut two = config(&tmp.path().join("two"), 6, &["cpu:0", "cpu:1"], false);
    two.checkpoint.save_every = 4;
    two.checkpoint.keep_last = 0;
    train(&two, "native", &[]).unwrap();
    let uninterrupted = losses(&two.output_dir);
    let ckpt = tunestudio::train::list_checkpoints(&two.output_dir)
        .into_iter()
        .find(|(s, _)| *s == 4)
        .expect("a checkpoint at step 4")
        .1;
    let names = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
    assert!(
        names.iter().any(|n| n == "optimizer.safetensors"),
        "{names:?}"
    );

    for devices in [&["cpu"][..], &["cpu:0", "cpu:1", "cpu:2"][..]] {
        let out = tmp.path().join(format!("resumed-{}", devices.len()));
        let mut c = config(&out, 6, devices, false);
        c.checkpoint.save_every = 0;
        train(&c, "native", &["--resume", &ckpt.display().to_string()]).unwrap();
        let resumed = losses(&out);
        assert_eq!(
            resumed.keys().copied().collect::<Vec<_>>(),
            vec![5, 6, 7, 8],
            "the resumed run starts after step 4"
        );
        for (step, loss) in &resumed {
            let u = uninterrupted[step];
            assert!(
                (u - loss).abs() <= 1e-6 * u.abs(),
                "{} devices, step {step}: resumed {loss} vs {u}",
                devices.len()
            );
        }
    }
}

/// Each of two sharded ranks holds half of data parallel's AdamW state (moments of its
/// range, plus the range it updates), counted from the tensors themselves.
#[test]
fn each_sharded_rank_holds_half_of_data_parallels_optimizer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let state = |strategy: Strategy| -> Vec<u64> {
        let mut c = config(
            &tmp.path().join(format!("{strategy}")),
            4,
            &["cpu:0", "cpu:1"],
            false,
        );
        c.devices.strategy = strategy;
        let run = TrainingRun::new(c).unwrap();
        std::iter::once(run.tensor_bytes())
            .chain(run.replica_tensor_bytes())
            .map(|b| b.optimizer_bytes)
            .collect()
    };
    let dp = state(Strategy::DataParallel);
    let sharded = state(Strategy::Sharded);
    assert_eq!(dp.len(), 2);
    assert_eq!(sharded.len(), 2);
    // fp32 full fine-tuning: data parallel keeps m and v (8 bytes a parameter) on each rank;
    // a sharded rank keeps m, v and the range it updates (12 bytes) of half the parameters.
    for (rank, (d, s)) in dp.iter().zip(&sharded).enumerate() {
        let ratio = *s as f64 / *d as f64;
        println!("rank {rank}: sharded {s} B vs data parallel {d} B ({ratio:.4})");
        assert!((ratio - 0.75).abs() < 1e-3, "rank {rank}: {s} vs {d}");
    }
    assert_eq!(
        sharded.iter().sum::<u64>(),
        dp[0] * 3 / 2,
        "the ranks' ranges cover every parameter once"
    );
}

/// The plan's weights, master weights and AdamW state of each sharded rank are what the
/// trainer's tensors hold on that rank (counted from the tensors themselves), within 3 %: the
/// whole weights, the range each rank updates and its moments.
#[test]
fn each_sharded_ranks_state_is_the_planned_state() {
    let tmp = tempfile::tempdir().unwrap();
    for devices in [&["cpu:0", "cpu:1"][..], &["cpu:0", "cpu:1", "cpu:2"][..]] {
        let c = config(
            &tmp.path().join(format!("ranks-{}", devices.len())),
            6,
            devices,
            false,
        );
        let plan =
            tunestudio::plan::plan(&tunestudio::train::local_plan_request(&c).unwrap()).unwrap();
        let run = TrainingRun::new(c).unwrap();
        let held: Vec<u64> = std::iter::once(run.tensor_bytes())
            .chain(run.replica_tensor_bytes())
            .map(|b| b.weights_bytes + b.optimizer_bytes)
            .collect();
        assert_eq!(held.len(), devices.len());
        for (rank, (held, planned)) in held.iter().zip(&plan.per_device).enumerate() {
            let planned = planned.weights_bytes
                + planned.master_weights_bytes
                + planned.optimizer_states_bytes;
            let err = (planned as f64 - *held as f64) / *held as f64;
            println!(
                "{} ranks, rank {rank}: {held} B held, {planned} B planned ({:+.2} %)",
                devices.len(),
                100.0 * err
            );
            assert!(
                err.abs() <= 0.03,
                "rank {rank}: {held} vs planned {planned}"
            );
        }
    }
}

/// `shard = "everything"` (ZeRO-3) is planned but not trained yet: `tunestudio train` refuses
/// it by its setting, with the setting that works, before loading anything.
#[test]
fn zero3_is_refused_by_its_setting() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = config(&tmp.path().join("zero3"), 4, &["cpu:0", "cpu:1"], false);
    c.devices.shard = ShardMode::Everything;
    let err = train(&c, "native", &[]).unwrap_err();
    assert!(
        err.contains("devices.shard") && err.contains("gradients-and-optimizer"),
        "{err}"
    );
    assert!(!PathBuf::from(&c.output_dir).join("metrics.jsonl").exists());
}
