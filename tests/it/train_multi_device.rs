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

/// Both training-ops paths: the native CPU kernels and the device-generic ops a GPU runs.
const OPS_MODES: [&str; 2] = ["native", "generic"];

/// `tunestudio train` with `TUNESTUDIO_OPS=ops`.
fn train_with_ops(config: &Path, extra: &[&str], ops: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(config)
        .args(extra)
        .env(tunestudio::model::OPS_ENV, ops)
        // Logical CPU devices as distinct memories: a copy kept across steps goes stale here
        // as it does between GPUs.
        .env(tunestudio::model::DISTINCT_CPU_DEVICES_ENV, "1")
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

/// The checkpoint of `step` in `out`.
fn checkpoint_at(out: &Path, step: u64) -> PathBuf {
    tunestudio::train::list_checkpoints(out)
        .into_iter()
        .find(|(s, _)| *s == step)
        .unwrap_or_else(|| panic!("no checkpoint at step {step} in {}", out.display()))
        .1
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

/// Data parallel over `cpu:0,cpu:1` (micro-batch 2 per rank) and `cpu:0,cpu:1,cpu:2`
/// (micro-batch 1), accumulation 2, in both ops modes: the losses of one device with the
/// whole batch, within 1e-5; the two-rank run resumes from step 5 within 1e-6.
#[test]
fn data_parallel_over_cpu_logical_devices_trains_like_one_device() {
    let tmp = tempfile::tempdir().unwrap();
    for ops in OPS_MODES {
        for (ranks, micro_batch) in [(2usize, 2usize), (3, 1)] {
            let one = tmp.path().join(format!("one-{ranks}-{ops}"));
            let path = save(
                &config(&one, None, micro_batch * ranks, &["cpu"]),
                &tmp.path().join(format!("one-{ranks}-{ops}.toml")),
            );
            train_with_ops(&path, &[], ops);
            let (reference, _) = recorded(&one);

            let names: Vec<String> = (0..ranks).map(|r| format!("cpu:{r}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let dp = tmp.path().join(format!("dp-{ranks}-{ops}"));
            let mut cfg = config(&dp, None, micro_batch, &names);
            cfg.devices.strategy = tunestudio::settings::Strategy::DataParallel;
            cfg.checkpoint.save_every = 5;
            cfg.checkpoint.keep_last = 0;
            let dp_path = save(&cfg, &tmp.path().join(format!("dp-{ranks}-{ops}.toml")));
            train_with_ops(&dp_path, &[], ops);
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
            if ranks == 2 {
                let ckpt5 = checkpoint_at(&dp, 5);
                train_with_ops(&dp_path, &["--resume", &ckpt5.display().to_string()], ops);
                let (resumed, _) = recorded(&dp);
                assert_resumed_after(&dp, 5, 10);
                for (step, l) in &resumed {
                    let u = losses[step];
                    assert!(
                        (u - l).abs() <= 1e-6,
                        "{ops} step {step}: resumed {l} vs {u}"
                    );
                }
            }
        }
    }
}

/// The plan's layer ranges for a run config, from `tunestudio plan --config … --json`.
/// (Planned with the run's ops path: the generic ops keep other activations, so they split
/// elsewhere.)
fn planned_ranges(config: &Path, ops: &str) -> Vec<(usize, usize)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["plan", "--json", "--config"])
        .arg(config)
        .env(tunestudio::model::OPS_ENV, ops)
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
    for ops in OPS_MODES {
        layer_split_case(tmp.path(), &model, ops);
    }
}

/// The founding case's settings in miniature (accumulation 4: from the second micro-batch on,
/// every stage's gradient taps meet the loss), on two and three logical devices.
fn layer_split_case(tmp: &Path, model: &Path, ops: &str) {
    let accumulation = 4;
    let one = tmp.join(format!("one-{ops}"));
    let mut one_cfg = config(&one, Some(model), 4, &["cpu"]);
    one_cfg.training.gradient_accumulation = accumulation;
    train_with_ops(
        &save(&one_cfg, &tmp.join(format!("one-{ops}.toml"))),
        &[],
        ops,
    );
    let (reference, _) = recorded(&one);
    for devices in [&["cpu:0", "cpu:1"][..], &["cpu:0", "cpu:1", "cpu:2"][..]] {
        let n = devices.len();
        let out = tmp.join(format!("split-{n}-{ops}"));
        let mut cfg = config(&out, Some(model), 4, devices);
        cfg.training.gradient_accumulation = accumulation;
        cfg.devices.strategy = tunestudio::settings::Strategy::LayerSplit;
        cfg.checkpoint.save_every = 5;
        cfg.checkpoint.keep_last = 0;
        let path = save(&cfg, &tmp.join(format!("split-{n}-{ops}.toml")));
        let planned = planned_ranges(&path, ops);
        assert_eq!(planned.len(), n);

        // Kill the run once step 5's checkpoint exists.
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["train", "--config"])
            .arg(&path)
            .env(tunestudio::model::OPS_ENV, ops)
            .env(tunestudio::model::DISTINCT_CPU_DEVICES_ENV, "1")
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

        let full = tmp.join(format!("split-{n}-{ops}-full"));
        let mut full_cfg = cfg.clone();
        full_cfg.output_dir = full.clone();
        train_with_ops(
            &save(&full_cfg, &tmp.join(format!("full-{n}-{ops}.toml"))),
            &[],
            ops,
        );
        let (uninterrupted, _) = recorded(&full);
        assert_close(&reference, &uninterrupted, 1e-5);
        // Resume the killed run from step 5 (explicitly: the kill may have come late).
        let ckpt5 = checkpoint_at(&out, 5);
        train_with_ops(&path, &["--resume", &ckpt5.display().to_string()], ops);
        let (resumed, _) = recorded(&out);
        assert_eq!(resumed.len(), 10);
        assert_resumed_after(&out, 5, 10);
        for (step, l) in &resumed {
            let u = uninterrupted[step];
            assert!(
                (u - l).abs() <= 1e-6,
                "{ops}, {n} devices, step {step}: resumed {l} vs {u}"
            );
        }
    }
}
