//! `tunestudio devices`: what this machine can train on, and (with `--check`)
//! the device checks a GPU machine runs through `scripts/gpu-check.sh`.

use std::path::PathBuf;
use std::process::ExitCode;
use tunestudio::devices::check::{run_checks, CheckMode, CheckStatus};
use tunestudio::devices::{discover, DeviceKind};
use tunestudio::units::format_bytes;

/// Arguments of `tunestudio devices`.
#[derive(Debug, clap::Args)]
pub struct DevicesArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Run the device checks (parity fp32/bf16, layer split, data parallel,
    /// NCCL, memory sampler) on GPU 0; exit status 1 when one fails.
    #[arg(long)]
    pub check: bool,
    /// With --check: run the checks on the CPU instead of GPU 0.
    #[arg(long, requires = "check")]
    pub cpu: bool,
    /// With --check: the fixture model folder (default: <shared>/fixtures/tiny-llama).
    #[arg(long, value_name = "DIR", requires = "check")]
    pub fixtures: Option<PathBuf>,
    /// With --check: run only these steps (comma-separated; see the step names in the output).
    #[arg(long, value_delimiter = ',', value_name = "STEP", requires = "check")]
    pub only: Vec<String>,
}

/// Runs `tunestudio devices`.
pub fn run(args: DevicesArgs) -> anyhow::Result<ExitCode> {
    if args.check {
        return run_check(&args);
    }
    let inventory = discover();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&inventory)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<8} {:<40} {:>11} {:>11} {:>11} {:>5}  details",
        "device", "name", "total", "used", "free", "util"
    );
    for d in &inventory.devices {
        let util = d
            .utilization_percent
            .map(|u| format!("{u}%"))
            .unwrap_or_else(|| "-".into());
        let details = match d.kind {
            DeviceKind::Cpu => format!("{} cores", d.cores.unwrap_or(0)),
            DeviceKind::Cuda => {
                let others: Vec<String> = d
                    .processes
                    .iter()
                    .filter(|p| !p.is_self)
                    .map(|p| match p.used_bytes {
                        Some(b) => format!("pid {} {}", p.pid, format_bytes(b)),
                        None => format!("pid {}", p.pid),
                    })
                    .collect();
                let mut s = format!(
                    "nvml #{} {} {}",
                    d.index,
                    d.pci_bus_id.as_deref().unwrap_or("?"),
                    d.uuid.as_deref().unwrap_or("?")
                );
                if !others.is_empty() {
                    s.push_str(&format!("; other processes: {}", others.join(", ")));
                }
                s
            }
        };
        println!(
            "{:<8} {:<40} {:>11} {:>11} {:>11} {:>5}  {}",
            d.label(),
            truncate(&d.name, 40),
            format_bytes(d.total_bytes),
            format_bytes(d.used_bytes),
            format_bytes(d.free_bytes),
            util,
            details
        );
    }
    if let Some(v) = &inventory.driver_version {
        println!("NVIDIA driver {v}");
    }
    println!(
        "build: cuda {}, nccl {}",
        if inventory.cuda_build { "yes" } else { "no" },
        if inventory.nccl_build { "yes" } else { "no" }
    );
    for note in &inventory.notes {
        println!("note: {note}");
    }
    Ok(ExitCode::SUCCESS)
}

fn run_check(args: &DevicesArgs) -> anyhow::Result<ExitCode> {
    // The checks' runs are planned through the run-config adapter, as `train` and `plan` plan.
    let mut options = tunestudio::train::check_options(if args.cpu {
        CheckMode::Cpu
    } else {
        CheckMode::Gpu
    });
    if let Some(dir) = &args.fixtures {
        options.fixture_dir = dir.clone();
    }
    options.only = args.only.clone();
    let report = run_checks(&options);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for step in &report.steps {
            let status = match step.status {
                CheckStatus::Passed => "PASS",
                CheckStatus::Failed => "FAIL",
                CheckStatus::Skipped => "SKIP",
                CheckStatus::Informational => "INFO",
            };
            println!(
                "[{status}] {:<15} {:>6.2}s  {}",
                step.name, step.secs, step.detail
            );
        }
        println!(
            "devices --check ({}): {}",
            if args.cpu { "cpu" } else { "gpu" },
            if report.passed() {
                "all passed"
            } else {
                "FAILED"
            }
        );
    }
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max - 1).collect();
        t.push('…');
        t
    }
}
