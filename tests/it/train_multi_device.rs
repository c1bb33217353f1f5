//! Several devices through `tunestudio train` on CPU logical devices (`cpu:0`, `cpu:1`, …):
//! data parallel and a layer split train exactly as one device does, the layer ranges are
//! the plan's, the effective batch counts every rank, and a killed layer-split run resumes
//! exactly.

use crate::train_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use train_common::*;
use tunestudio::train::{read_metrics, DeviceLayers, Event, RunConfig};

/// 10 steps over the first 60 Alpaca rows (lengths vary, so shards pad differently),
/// accumulation 2.
fn config(out: &Path, model: Option<&Path>, micro_batch: usize, devices: &[&str]) -> RunConfig {
    let data = out.with_extension("data.json");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str::<Vec<serde_json::Value>>(&std::fs::read_to_string(alpaca()).unwrap())
            .unwrap()
            .into_iter()
            .take(60)
            .collect();
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    std::fs::write(&data, serde_json::to_string(&rows).unwrap()).unwrap();
    let mut c = tiny_config(out, 10);
    if let Some(m) = model {
        c.model.source = m.display().to_string();
        c.model.init = tunestudio::train::InitMode::Auto;
    }
    c.data.path = data.display().to_string();
    c.training.micro_batch = micro_batch;
    c.training.gradient_accumulation = 2;
    c.devices.devices = devices.iter().map(|d| d.to_string()).collect();
    c
}

fn save(cfg: &RunConfig, path: &Path) -> PathBuf {
    let cfg = cfg.clone().with_absolute_paths();
    cfg.save(path).unwrap();
    path.to_path_buf()
}

fn train(config: &Path, extra: &[&str]) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(config)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tunestudio train failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The last recorded loss of every step, and the last `started` event.
fn recorded(out: &Path) -> (BTreeMap<u64, f64>, Event) {
    let mut losses = BTreeMap::new();
    let mut started = None;
    for e in read_metrics(out).unwrap() {
        match e {
            Event::Step { step, loss, .. } => {
                losses.insert(step, loss);
            }
            e @ Event::Started { .. } => started = Some(e),
            _ => {}
        }
    }
    (losses, started.expect("a started event"))
}

fn assert_close(reference: &BTreeMap<u64, f64>, other: &BTreeMap<u64, f64>, tol: f64) {
    assert_eq!(reference.len(), 10, "{reference:?}");
    assert_eq!(
        reference.keys().collect::<Vec<_>>(),
        other.keys().collect::<Vec<_>>()
    );
    for (step, r) in reference {
        let o = other[step];
        assert!((r - o).abs() <= tol, "step {step}: {o} vs one device's {r}");
    }
}

#[test]
fn data_parallel_over_cpu_logical_devices_trains_like_one_device() {
    let tmp = tempfile::tempdir().unwrap();
    for (ranks, micro_batch) in [(2usize, 2usize), (3, 1)] {
        let one = tmp.path().join(format!("one-{ranks}"));
        let path = save(
            &config(&one, None, micro_batch * ranks, &["cpu"]),
            &tmp.path().join(format!("one-{ranks}.toml")),
        );
        train(&path, &[]);
        let (reference, _) = recorded(&one);

        let names: Vec<String> = (0..ranks).map(|r| format!("cpu:{r}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let dp = tmp.path().join(format!("dp-{ranks}"));
        let mut cfg = config(&dp, None, micro_batch, &names);
        cfg.devices.strategy = tunestudio::settings::Strategy::DataParallel;
        train(
            &save(&cfg, &tmp.path().join(format!("dp-{ranks}.toml"))),
            &[],
        );
        let (losses, started) = recorded(&dp);
        assert_close(&reference, &losses, 1e-5);
        let Event::Started {
            effective_batch,
            ranks: logged_ranks,
            placement,
            ..
        } = started
        else {
            unreachable!()
        };
        assert_eq!(logged_ranks, ranks);
        assert_eq!(effective_batch, micro_batch * 2 * ranks);
        assert_eq!(placement.len(), ranks, "{placement:?}");
    }
}

/// The plan's layer ranges for a run config, from `tunestudio plan --config … --json`.
fn planned_ranges(config: &Path) -> Vec<(usize, usize)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["plan", "--json", "--config"])
        .arg(config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["plan"]["per_device"]
        .as_array()
        .expect("per_device")
        .iter()
        .map(|d| {
            let r = &d["layers"];
            (
                r["start"].as_u64().unwrap() as usize,
                r["end"].as_u64().unwrap() as usize,
            )
        })
        .collect()
}

#[test]
fn layer_split_uses_the_plans_ranges_trains_like_one_device_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    // Five layers of unequal share once the embeddings and the head are counted.
    let model = random_model_dir(tmp.path(), 5, 64);
    let one = tmp.path().join("one");
    train(
        &save(
            &config(&one, Some(&model), 4, &["cpu"]),
            &tmp.path().join("one.toml"),
        ),
        &[],
    );
    let (reference, _) = recorded(&one);
    for devices in [&["cpu:0", "cpu:1"][..], &["cpu:0", "cpu:1", "cpu:2"][..]] {
        let n = devices.len();
        let out = tmp.path().join(format!("split-{n}"));
        let mut cfg = config(&out, Some(&model), 4, devices);
        cfg.devices.strategy = tunestudio::settings::Strategy::LayerSplit;
        cfg.checkpoint.save_every = 5;
        cfg.checkpoint.keep_last = 0;
        let path = save(&cfg, &tmp.path().join(format!("split-{n}.toml")));
        let planned = planned_ranges(&path);
        assert_eq!(planned.len(), n);

        // Kill the run once step 5's checkpoint exists.
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["train", "--config"])
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while tunestudio::train::latest_checkpoint(&out).is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "no checkpoint"
            );
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        child.wait().unwrap();
        let (_, started) = recorded(&out);
        let Event::Started { placement, .. } = started else {
            unreachable!()
        };
        let trained: Vec<(usize, usize)> = placement
            .iter()
            .map(|d: &DeviceLayers| (d.start_layer, d.end_layer))
            .collect();
        assert_eq!(trained, planned, "the trainer's split is not the plan's");
        assert_eq!(placement[0].device, "cpu:0");

        let full = tmp.path().join(format!("split-{n}-full"));
        let mut full_cfg = cfg.clone();
        full_cfg.output_dir = full.clone();
        train(
            &save(&full_cfg, &tmp.path().join(format!("full-{n}.toml"))),
            &[],
        );
        let (uninterrupted, _) = recorded(&full);
        assert_close(&reference, &uninterrupted, 1e-5);
        // Resume the killed run from step 5 (explicitly: the kill may have come late).
        let ckpt5 = tunestudio::train::list_checkpoints(&out)
            .into_iter()
            .find(|(step, _)| *step == 5)
            .expect("a checkpoint at step 5")
            .1;
        train(&path, &["--resume", &ckpt5.display().to_string()]);
        let (resumed, _) = recorded(&out);
        assert_eq!(resumed.len(), 10);
        for (step, l) in &resumed {
            let u = uninterrupted[step];
            assert!((u - l).abs() <= 1e-6, "step {step}: resumed {l} vs {u}");
        }
    }
}
