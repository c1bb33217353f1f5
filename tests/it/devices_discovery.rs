//! Device discovery: without an NVIDIA driver only the CPU is listed (no
//! error), and the NVML bindings read what a driver reports — checked against
//! a fake `libnvidia-ml.so` compiled from C with nvml.h's struct layouts.

use std::path::{Path, PathBuf};
use std::process::Command;
use tunestudio::devices::{discover, discover_with, DeviceKind, DiscoveryOptions};

#[test]
fn without_an_nvidia_driver_only_the_cpu_is_listed() {
    let inv = discover_with(&DiscoveryOptions {
        nvml_library: Some(PathBuf::from("/nonexistent/libnvidia-ml.so.1")),
        skip_gpus: false,
    });
    assert_eq!(inv.devices.len(), 1, "{inv:?}");
    let cpu = &inv.devices[0];
    assert_eq!(cpu.kind, DeviceKind::Cpu);
    assert!(cpu.total_bytes > 0 && cpu.free_bytes <= cpu.total_bytes);
    assert!(cpu.cores.unwrap_or(0) >= 1);
    assert!(!cpu.name.is_empty());
    assert!(inv.driver_version.is_none());
    assert!(
        inv.notes.iter().any(|n| n.contains("no GPU found")),
        "{:?}",
        inv.notes
    );

    // Whatever this machine has, the CPU is always listed first.
    let inv = discover();
    assert_eq!(inv.devices.first().map(|d| d.kind), Some(DeviceKind::Cpu));
}

/// The fake driver library's C source.
const FAKE_NVML: &str = include_str!("../fake_nvml/fake_nvml.c");

/// Compiles the fake NVML into `dir` with the system C compiler.
pub(crate) fn build_fake_nvml(dir: &Path) -> PathBuf {
    let src = dir.join("fake_nvml.c");
    let lib = dir.join("libnvidia-ml.so.1");
    std::fs::write(&src, FAKE_NVML).unwrap();
    let status = Command::new("cc")
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
fn nvml_bindings_read_a_drivers_answers() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build_fake_nvml(dir.path());
    let inv = discover_with(&DiscoveryOptions {
        nvml_library: Some(lib.clone()),
        skip_gpus: false,
    });
    assert_eq!(inv.driver_version.as_deref(), Some("580.65.06"));
    let gpus: Vec<_> = inv.gpus().collect();
    assert_eq!(gpus.len(), 2, "{inv:?}");

    let h100 = gpus[0];
    assert_eq!(h100.index, 0);
    assert_eq!(h100.name, "NVIDIA H100 80GB HBM3");
    assert_eq!(
        h100.uuid.as_deref(),
        Some("GPU-aaaaaaaa-1111-2222-3333-444444444444")
    );
    assert_eq!(h100.pci_bus_id.as_deref(), Some("00000000:19:00.0"));
    assert_eq!(h100.total_bytes, 85_520_809_984);
    assert_eq!(h100.used_bytes, 2_000_000_000);
    assert_eq!(h100.free_bytes, 85_520_809_984 - 2_000_000_000);
    assert_eq!(h100.utilization_percent, Some(37));
    assert_eq!(h100.memory_utilization_percent, Some(12));
    assert_eq!(h100.processes.len(), 2);
    assert!(h100.processes[0].is_self && h100.processes[0].used_bytes == Some(1 << 20));
    // NVML_VALUE_NOT_AVAILABLE means "unknown", not 16 EiB.
    assert_eq!(h100.processes[1].used_bytes, None);
    assert_eq!(h100.other_processes_bytes(), 0);

    let h200 = gpus[1];
    assert_eq!(h200.name, "NVIDIA H200");
    assert_eq!(h200.pci_bus_id.as_deref(), Some("00000000:3B:00.0"));
    assert_eq!(
        h200.utilization_percent, None,
        "NOT_SUPPORTED is not an error"
    );
    // 10 processes do not fit the first buffer of 8: the retry gets them all.
    assert_eq!(h200.processes.len(), 10);
    assert_eq!(h200.processes[9].pid, 1009);
    assert_eq!(
        h200.other_processes_bytes(),
        (3..=10).map(|i| i * (1u64 << 20)).sum::<u64>()
    );

    // The fake GPUs' UUIDs match no CUDA device, so no ordinal is known in any build, and a
    // note says why: no CUDA support (a CPU build), or CUDA could not list or see them.
    assert!(gpus.iter().all(|g| g.cuda_ordinal.is_none()));
    let why = if inv.cuda_build {
        ["CUDA could not list its devices", "not visible to CUDA"].as_slice()
    } else {
        ["no CUDA support"].as_slice()
    };
    assert!(
        inv.notes.iter().any(|n| why.iter().any(|w| n.contains(w))),
        "expected a note containing one of {why:?}: {:?}",
        inv.notes
    );

    // The CLI renders the same inventory (NVML chosen through the environment).
    let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["devices", "--json"])
        .env("TUNESTUDIO_NVML_LIB", &lib)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 3);
    assert_eq!(devices[0]["kind"], "cpu");
    assert_eq!(devices[2]["name"], "NVIDIA H200");
    let table = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .arg("devices")
        .env("TUNESTUDIO_NVML_LIB", &lib)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("NVIDIA H100 80GB HBM3") && text.contains("79.6 GiB"),
        "{text}"
    );
    assert!(text.contains("NVIDIA driver 580.65.06"), "{text}");
}

#[test]
fn cli_without_a_driver_prints_the_cpu_and_a_note() {
    let out = Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["devices", "--json"])
        .env("TUNESTUDIO_NVML_LIB", "/nonexistent/libnvidia-ml.so.1")
        .output()
        .unwrap();
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["devices"].as_array().map(|d| d.len()), Some(1));
    assert!(json["notes"][0]
        .as_str()
        .unwrap_or("")
        .starts_with("no GPU found"));
}
