//! Two GPUs as a driver would report them (the fake NVML of `tests/fake_nvml/`, loaded through
//! `TUNESTUDIO_NVML_LIB` by child processes): `tunestudio devices` lists them, a plan for a bare
//! `cuda:0` uses the memory the driver reports, and a training run records memory for each.

use crate::devices_discovery::build_fake_nvml;
use crate::train_common::tiny_config;

use std::path::Path;
use std::process::{Command, Output};

use tunestudio::devices::nvml::LIBRARY_ENV;
use tunestudio::train::{read_metrics, Event, MemoryScope, RunConfig};

/// The H100's memory in the fake driver.
const FAKE_GPU0_BYTES: u64 = 85_520_809_984;

fn tunestudio(args: &[&str], nvml: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(args)
        .env(LIBRARY_ENV, nvml)
        .output()
        .unwrap()
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn save(cfg: &RunConfig, path: &Path) -> String {
    cfg.clone().with_absolute_paths().save(path).unwrap();
    path.display().to_string()
}

#[test]
#[cfg_attr(
    tunestudio_missing_cc,
    ignore = "no C compiler (`cc`) to build the fake NVML (install gcc)"
)]
fn two_fake_gpus_are_listed_planned_and_sampled() {
    let tmp = tempfile::tempdir().unwrap();
    let nvml = build_fake_nvml(tmp.path());

    let listed: serde_json::Value =
        serde_json::from_str(&ok(tunestudio(&["devices", "--json"], &nvml))).unwrap();
    let names: Vec<&str> = listed["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["kind"] == "cuda")
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]);

    // A bare `cuda:0` is planned against the driver's figure; without a driver it says how
    // to give the size; `cuda:0=80GiB` needs no driver.
    let mut cfg = tiny_config(&tmp.path().join("gpu-run"), 2);
    cfg.devices.devices = vec!["cuda:0".into()];
    let path = save(&cfg, &tmp.path().join("gpu.toml"));
    let plan: serde_json::Value = serde_json::from_str(&ok(tunestudio(
        &["plan", "--json", "--config", &path],
        &nvml,
    )))
    .unwrap();
    assert_eq!(
        plan["plan"]["per_device"][0]["device"]["capacity_bytes"].as_u64(),
        Some(FAKE_GPU0_BYTES)
    );
    let no_driver = tunestudio(&["plan", "--config", &path], &tmp.path().join("missing.so"));
    assert!(!no_driver.status.success());
    assert!(String::from_utf8_lossy(&no_driver.stderr).contains("cuda:0=80GiB"));
    cfg.devices.devices = vec!["cuda:0=80GiB".into()];
    assert!(cfg.validate().is_empty(), "{:?}", cfg.validate());
    let sized = save(&cfg, &tmp.path().join("sized.toml"));
    let plan: serde_json::Value = serde_json::from_str(&ok(tunestudio(
        &["plan", "--json", "--config", &sized],
        &tmp.path().join("missing.so"),
    )))
    .unwrap();
    assert_eq!(
        plan["plan"]["per_device"][0]["device"]["capacity_bytes"].as_u64(),
        Some(80 << 30)
    );

    // A CPU run on this machine records memory for the CPU and both GPUs.
    let out = tmp.path().join("cpu-run");
    let cpu = save(&tiny_config(&out, 3), &tmp.path().join("cpu.toml"));
    ok(tunestudio(&["train", "--config", &cpu], &nvml));
    let mut seen = std::collections::BTreeMap::new();
    for e in read_metrics(&out).unwrap() {
        if let Event::Memory {
            device,
            total_bytes,
            scope,
            used_bytes,
            ..
        } = e
        {
            seen.insert(device, (total_bytes, scope, used_bytes));
        }
    }
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        ["cpu", "cuda:0", "cuda:1"],
        "{seen:?}"
    );
    // The fake driver attributes 1 MiB on each GPU to this process.
    assert_eq!(
        seen["cuda:0"],
        (Some(FAKE_GPU0_BYTES), MemoryScope::Process, 1 << 20)
    );
    assert_eq!(seen["cuda:1"].0, Some(150_754_820_096));
}
