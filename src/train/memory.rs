//! Memory samples for the GUI's memory chart, taken between steps on the trainer thread.
//!
//! CPU training reports the process: the counting allocator's bytes when a binary installed
//! [`crate::mem::CountingAllocator`], otherwise the resident set (VmRSS / VmHWM).

use super::config::RunConfig;
use super::events::Event;

/// Samples memory once per step for every device of the run.
#[derive(Debug)]
pub struct MemoryMonitor {
    devices: Vec<String>,
    total_bytes: Option<u64>,
}

impl MemoryMonitor {
    /// A monitor for the run's `[devices]`.
    pub fn new(config: &RunConfig) -> Self {
        MemoryMonitor {
            devices: config.devices.devices.clone(),
            total_bytes: system_memory_bytes(),
        }
    }

    /// Memory events for the step just done (devices that cannot be measured are left out).
    pub fn sample(&mut self, step: u64) -> Vec<Event> {
        let mut out = Vec::new();
        for d in &self.devices {
            if d == "cpu" {
                let (used, peak) = if crate::mem::is_installed() {
                    (crate::mem::current_bytes(), crate::mem::peak_bytes())
                } else {
                    match (
                        crate::mem::process_rss_bytes(),
                        crate::mem::peak_rss_bytes(),
                    ) {
                        (Some(u), Some(p)) => (u, p),
                        (Some(u), None) => (u, u),
                        _ => continue,
                    }
                };
                out.push(Event::Memory {
                    device: d.clone(),
                    used_bytes: used,
                    peak_bytes: peak,
                    total_bytes: self.total_bytes,
                    step,
                });
            }
        }
        out
    }
}

/// Physical memory of the machine (`MemTotal`), when readable.
fn system_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What the memory planner predicts for a run, checked before anything is loaded.
#[derive(Debug, Clone, PartialEq)]
pub enum PlanCheck {
    /// Fits with headroom.
    Fits,
    /// Fits with under 5 % headroom.
    Tight {
        /// The planner's summary.
        summary: String,
    },
    /// Predicted to run out of memory.
    OutOfMemory {
        /// The planner's summary (device, phase, shortfall).
        summary: String,
        /// Ranked fixes in words.
        fixes: Vec<String>,
        /// Whether the short device is host memory (where an allocation failure aborts the
        /// process instead of returning an error).
        on_cpu: bool,
    },
    /// No prediction (e.g. the model config could not be read); training still runs.
    Unavailable {
        /// Why.
        reason: String,
    },
}

/// Asks [`crate::plan`] whether the run fits its devices.
pub fn check_plan(config: &RunConfig) -> PlanCheck {
    use crate::plan::{DeviceKind, Verdict};
    let text = match config.to_toml_string() {
        Ok(t) => t,
        Err(e) => {
            return PlanCheck::Unavailable {
                reason: e.to_string(),
            }
        }
    };
    let plan = crate::plan::RunConfigSettings::from_toml_str(&text, "run config")
        .and_then(|s| crate::plan::request_from_run_config(&s, &config.base_dir, None))
        .and_then(|req| crate::plan::plan(&req));
    let plan = match plan {
        Ok(p) => p,
        Err(e) => {
            return PlanCheck::Unavailable {
                reason: e.to_string(),
            }
        }
    };
    match plan.verdict {
        Verdict::Fits => PlanCheck::Fits,
        Verdict::Tight => PlanCheck::Tight {
            summary: plan.summary.clone(),
        },
        Verdict::OutOfMemory => PlanCheck::OutOfMemory {
            on_cpu: plan
                .per_device
                .iter()
                .any(|d| !d.fits && d.device.kind == DeviceKind::Cpu),
            summary: plan.summary.clone(),
            fixes: plan.fixes.iter().map(|f| f.description.clone()).collect(),
        },
    }
}
