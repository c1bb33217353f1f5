//! `scripts/gpu-check.sh --cpu` runs every step of the GPU check that can run without a GPU
//! with the binary under test (tiny shapes, `cpu:0,cpu:1` logical devices, an injected
//! out-of-memory), so the script a GPU machine runs in one call is exercised here, and its one
//! JSON report names every step of the list with a status, a reason and its seconds.

use std::process::Command;

/// The steps of the GPU check, in order (docs/gpu-check.md).
const STEPS: [&str; 13] = [
    "parity-fp32",
    "parity-bf16",
    "memory-plan",
    "layer-split",
    "data-parallel",
    "sharded",
    "nccl-one-rank",
    "launcher",
    "resume",
    "optimizer-offload",
    "out-of-memory",
    "qlora",
    "throughput-vs-pytorch",
];

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
    assert_eq!(report["mode"], "cpu");
    assert_eq!(report["passed"], true, "{stdout}");
    let steps = report["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(
        names, STEPS,
        "the report's steps are the check's list, in order"
    );
    let step = |name: &str| steps.iter().find(|s| s["name"] == name).unwrap();
    for s in steps {
        assert!(s["secs"].as_f64().is_some_and(|t| t >= 0.0), "{s}");
        assert!(s["budget_secs"].as_f64().is_some_and(|t| t > 0.0), "{s}");
        assert!(!s["reason"].as_str().unwrap_or("").is_empty(), "{s}");
    }
    for name in [
        "parity-fp32",
        "parity-bf16",
        "memory-plan",
        "layer-split",
        "data-parallel",
        "sharded",
        "launcher",
        "resume",
        "optimizer-offload",
        "out-of-memory",
        "qlora",
    ] {
        assert_eq!(step(name)["status"], "passed", "{name}:\n{stdout}");
    }
    // What needs a GPU, or PyTorch, is skipped with the reason, never failed.
    assert_eq!(step("nccl-one-rank")["status"], "skipped");
    assert!(step("nccl-one-rank")["reason"]
        .as_str()
        .unwrap()
        .contains("GPU"));
    let throughput = step("throughput-vs-pytorch");
    assert_eq!(throughput["status"], "skipped");
    assert!(throughput["reason"]
        .as_str()
        .unwrap()
        .contains("--no-torch"));
    assert!(
        throughput["figures"]["tunestudio_tokens_per_sec"]
            .as_f64()
            .unwrap_or(0.0)
            > 0.0
    );

    // The figures behind the verdicts.
    // Six shapes, each predicted and measured (the CPU's bound is looser than the GPU's ±5 %:
    // process RSS of a debug binary; tests/plan_accuracy.rs compares the CPU exactly).
    let memory = &step("memory-plan")["figures"];
    assert_eq!(memory["tolerance_pct"], 10.0);
    assert_eq!(memory["shapes"].as_array().unwrap().len(), 6);
    for shape in memory["shapes"].as_array().unwrap() {
        assert!(
            shape["error_pct"].as_f64().unwrap().abs() <= 10.0,
            "{shape}"
        );
        assert!(shape["measured_bytes"].as_u64().unwrap() > 0, "{shape}");
    }
    let split = &step("layer-split")["figures"]["layer-split"];
    assert_eq!(split["placement"].as_array().unwrap().len(), 2, "{split}");
    assert!(split["worst_abs_loss_diff"].as_f64().unwrap() <= 1e-5);
    for strategy in ["data-parallel", "sharded"] {
        assert_eq!(
            step(strategy)["figures"][strategy]["ranks"],
            2,
            "{strategy}"
        );
    }
    let resume = &step("resume")["figures"]["resume"];
    assert_eq!(resume["start_step"], 2, "{resume}");
    assert_eq!(resume["steps"], serde_json::json!([3, 4]));
    assert!(resume["worst_abs_loss_diff"].as_f64().unwrap() <= 1e-6);
    let oom = &step("out-of-memory")["figures"];
    assert_eq!(oom["step"], 3, "{oom}");
    assert_eq!(oom["failure"]["api"], "injected", "{oom}");
    assert!(oom["checkpoint"]
        .as_str()
        .unwrap()
        .ends_with("checkpoint-2"));
    assert!(!oom["refit"].as_array().unwrap().is_empty(), "{oom}");

    let devices: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("devices.json")).unwrap())
            .unwrap();
    assert_eq!(devices["devices"][0]["kind"], "cpu");
    assert_eq!(report["environment"]["mode"], "cpu");
}
