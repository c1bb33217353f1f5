//! `scripts/gpu-check.sh --cpu` runs every device check on the CPU with the
//! binary under test, so the script a GPU machine runs is exercised here.

use std::process::Command;

#[test]
fn gpu_check_script_passes_in_cpu_mode() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = tempfile::tempdir().unwrap();
    let output = Command::new("bash")
        .arg(format!("{root}/scripts/gpu-check.sh"))
        .args([
            "--cpu",
            "--no-torch",
            "--bin",
            env!("CARGO_BIN_EXE_tunestudio"),
            "--out",
        ])
        .arg(out.path())
        .env("TUNESTUDIO_SHARED", tunestudio::paths::shared_dir())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "gpu-check.sh --cpu failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("check.json")).unwrap())
            .unwrap();
    let steps = report["steps"].as_array().unwrap();
    let status = |name: &str| {
        steps
            .iter()
            .find(|s| s["name"] == name)
            .map(|s| s["status"].as_str().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    for name in [
        "discovery",
        "parity-fp32",
        "parity-bf16",
        "parity-generic",
        "layer-split",
        "data-parallel",
        "memory-sampler",
        "throughput",
    ] {
        assert_eq!(status(name), "passed", "{name}:\n{stdout}");
    }
    // The binary measures the CPU by process RSS (no counting allocator): figures only.
    // The exact comparison is `tests/plan_accuracy.rs::memory_grid_check_is_exact_within_5_percent`.
    assert_eq!(status("memory-grid"), "informational", "\n{stdout}");
    // NCCL needs a GPU: skipped on the CPU, never failed.
    assert_eq!(status("nccl"), "skipped");
    let devices: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("devices.json")).unwrap())
            .unwrap();
    assert_eq!(devices["devices"][0]["kind"], "cpu");
    let tps = steps.iter().find(|s| s["name"] == "throughput").unwrap()["metrics"]
        ["tokens_per_sec"]
        .as_f64();
    assert!(tps.unwrap_or(0.0) > 0.0);
}
