//! Memory samples for the GUI's memory chart, taken between steps on the trainer thread.
//!
//! CPU training reports the process: the counting allocator's bytes when a binary installed
//! [`crate::mem::CountingAllocator`], otherwise the resident set (VmRSS / VmHWM).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use crossbeam_channel::Receiver;

use super::config::RunConfig;
use super::events::{Event, MemoryScope};
use crate::devices::{MemorySample, MemorySampler, SampleTarget};

/// How often GPUs are read between steps: a step's peak lasts milliseconds to seconds, and
/// NVML calls are cheap at this rate (see [`crate::devices::sampler`]).
const GPU_SAMPLE_INTERVAL: Duration = Duration::from_millis(250);

/// Samples memory for every device of the run: the CPU (this process) once per step, and
/// every GPU NVML lists through a background sampler, whose readings between two steps are
/// folded into that step's event (last reading, and the highest as the peak).
#[derive(Debug)]
pub struct MemoryMonitor {
    devices: Vec<String>,
    total_bytes: Option<u64>,
    gpus: Option<(MemorySampler, Receiver<MemorySample>)>,
    gpu_peaks: BTreeMap<String, u64>,
}

impl MemoryMonitor {
    /// A monitor for the run's `[devices]`, reading GPUs through `nvml_library` (`None`:
    /// `$TUNESTUDIO_NVML_LIB`, then the driver's). Every GPU of the machine is sampled, not
    /// only the run's: what else occupies a GPU is what decides whether a run fits there.
    pub fn new(config: &RunConfig, nvml_library: Option<PathBuf>) -> Self {
        let inventory = crate::devices::discover_with(&crate::devices::DiscoveryOptions {
            nvml_library: nvml_library.clone(),
            skip_gpus: false,
        });
        let targets: Vec<SampleTarget> = inventory
            .gpus()
            .map(|g| SampleTarget::Gpu {
                device_index: g.index,
                label: format!("cuda:{}", g.cuda_ordinal.unwrap_or(g.index)),
                nvml_index: g.index as u32,
            })
            .collect();
        let gpus = (!targets.is_empty())
            .then(|| {
                MemorySampler::with_channel_and_library(targets, GPU_SAMPLE_INTERVAL, nvml_library)
                    .ok()
            })
            .flatten();
        MemoryMonitor {
            devices: config.devices.devices.clone(),
            total_bytes: system_memory_bytes(),
            gpus,
            gpu_peaks: BTreeMap::new(),
        }
    }

    /// The most `device` (a `[devices]` entry) was seen to hold: the process's peak for the
    /// CPU, the sampler's peak for a GPU.
    pub fn observed_peak(&self, device: &str) -> Option<u64> {
        let name = device.split('=').next().unwrap_or(device).trim();
        if name == "cpu" || name.starts_with("cpu:") {
            return if crate::mem::is_installed() {
                Some(crate::mem::peak_bytes())
            } else {
                crate::mem::peak_rss_bytes()
            };
        }
        let gpu = name.split('#').next().unwrap_or(name);
        self.gpu_peaks.get(gpu).copied()
    }

    /// Memory events for the step just done (devices that cannot be measured are left out).
    pub fn sample(&mut self, step: u64) -> Vec<Event> {
        let mut out = Vec::new();
        let on_cpu = self
            .devices
            .iter()
            .any(|d| d == "cpu" || d.starts_with("cpu:"));
        if on_cpu {
            out.extend(self.cpu_event(step));
        }
        out.extend(self.gpu_events(step));
        out
    }

    fn cpu_event(&self, step: u64) -> Option<Event> {
        let (used, peak) = if crate::mem::is_installed() {
            (crate::mem::current_bytes(), crate::mem::peak_bytes())
        } else {
            match (
                crate::mem::process_rss_bytes(),
                crate::mem::peak_rss_bytes(),
            ) {
                (Some(u), Some(p)) => (u, p),
                (Some(u), None) => (u, u),
                _ => return None,
            }
        };
        Some(Event::Memory {
            device: "cpu".into(),
            used_bytes: used,
            peak_bytes: peak,
            total_bytes: self.total_bytes,
            step,
            scope: MemoryScope::Process,
        })
    }

    /// One event per GPU read since the last step: this process's memory where NVML
    /// attributes it, the device's otherwise.
    fn gpu_events(&mut self, step: u64) -> Vec<Event> {
        let Some((_, rx)) = &self.gpus else {
            return Vec::new();
        };
        let mut last: BTreeMap<String, (u64, u64, MemoryScope)> = BTreeMap::new();
        for s in rx.try_iter() {
            let (used, scope) = match s.process_bytes {
                Some(b) => (b, MemoryScope::Process),
                None => (s.used_bytes, MemoryScope::Device),
            };
            let peak = self.gpu_peaks.entry(s.label.clone()).or_default();
            *peak = (*peak).max(used);
            last.insert(s.label, (used, s.capacity_bytes, scope));
        }
        last.into_iter()
            .map(|(device, (used, total, scope))| Event::Memory {
                peak_bytes: self.gpu_peaks.get(&device).copied().unwrap_or(used),
                device,
                used_bytes: used,
                total_bytes: Some(total),
                step,
                scope,
            })
            .collect()
    }
}

/// Physical memory of the machine (`MemTotal`), when readable.
fn system_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What the memory planner predicts for a run, checked before the model is loaded.
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

/// Asks [`crate::plan`] whether the run fits its devices ([`check_request`] on this machine's
/// request, the data tokenized only when the first plan does not fit with headroom).
pub fn check_plan(config: &RunConfig) -> PlanCheck {
    match super::plan_adapter::local_plan_request(config) {
        Ok(req) => check_request(req, || {
            // The trainer reports the data's error itself when it loads it.
            super::samples::trained_tokens(config).ok().flatten()
        }),
        Err(e) => PlanCheck::Unavailable {
            reason: e.to_string(),
        },
    }
}

/// The verdict on `req`. Its first plan counts every loss row (the upper bound: nothing but
/// file sizes has been read); when that one does not fit with headroom, `trained_tokens` (the
/// data, tokenized) is asked for and the run planned with it, as `tunestudio plan --config` and
/// the studio plan it, so a run they show fitting is not refused.
pub fn check_request(
    mut req: crate::plan::PlanRequest,
    trained_tokens: impl FnOnce() -> Option<crate::plan::TrainedTokens>,
) -> PlanCheck {
    use crate::plan::{DeviceKind, Verdict};
    let plan = crate::plan::plan(&req).and_then(|upper| {
        if upper.verdict == Verdict::Fits {
            return Ok(upper);
        }
        match trained_tokens() {
            Some(t) => {
                req.trained_tokens = Some(t);
                crate::plan::plan(&req)
            }
            None => Ok(upper),
        }
    });
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
