//! Memory samples for the memory chart and `metrics.jsonl`: every device the run uses is read
//! by one background sampler (the CPU's process and every GPU, every 250 ms), and the readings
//! between two steps are folded into that step's events.
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

/// How often devices are read between steps: a step's peak lasts milliseconds to seconds, and
/// NVML calls and `/proc/self/status` reads are cheap at this rate (see
/// [`crate::devices::sampler`]).
const SAMPLE_INTERVAL: Duration = Duration::from_millis(250);

/// The CPU's label among the sampler's targets.
const CPU_LABEL: &str = "cpu";

/// What the background readings of one device said since the last step's event.
#[derive(Debug, Clone, Copy, Default)]
struct Readings {
    /// The highest reading since the last event (a spike inside a step).
    highest_since_event: u64,
    /// The last reading.
    last: u64,
    capacity_bytes: u64,
    scope: Option<MemoryScope>,
}

/// Samples memory for every device of the run through one background sampler: the CPU (this
/// process) when the run uses it, and every GPU NVML lists. Each step's event carries the
/// highest reading since the previous one as `used_bytes`, so a spike inside a step shows on
/// the chart, not only what is left at its end.
#[derive(Debug)]
pub struct MemoryMonitor {
    on_cpu: bool,
    total_bytes: Option<u64>,
    sampler: Option<(MemorySampler, Receiver<MemorySample>)>,
    readings: BTreeMap<String, Readings>,
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
        let on_cpu = config
            .devices
            .devices
            .iter()
            .any(|d| d == "cpu" || d.starts_with("cpu:"));
        let total_bytes = system_memory_bytes();
        let mut targets: Vec<SampleTarget> = Vec::new();
        if on_cpu {
            targets.push(SampleTarget::Cpu {
                device_index: 0,
                label: CPU_LABEL.into(),
                capacity_bytes: total_bytes.unwrap_or(0),
            });
        }
        targets.extend(inventory.gpus().map(|g| SampleTarget::Gpu {
            device_index: g.index,
            label: format!("cuda:{}", g.cuda_ordinal.unwrap_or(g.index)),
            nvml_index: g.index as u32,
        }));
        let sampler = (!targets.is_empty())
            .then(|| {
                MemorySampler::with_channel_and_library(targets, SAMPLE_INTERVAL, nvml_library).ok()
            })
            .flatten();
        MemoryMonitor {
            on_cpu,
            total_bytes,
            sampler,
            readings: BTreeMap::new(),
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
        self.drain_readings();
        let mut out = Vec::new();
        if self.on_cpu {
            out.extend(self.cpu_event(step));
        }
        out.extend(self.gpu_events(step));
        for r in self.readings.values_mut() {
            r.highest_since_event = 0;
        }
        out
    }

    /// Folds the sampler's readings since the last call into [`Readings`].
    fn drain_readings(&mut self) {
        let Some((_, rx)) = &self.sampler else {
            return;
        };
        for s in rx.try_iter() {
            let (used, scope) = if s.label == CPU_LABEL {
                // The same figure the step-end reading takes (heap when counted, else RSS).
                (
                    s.allocator_bytes.unwrap_or(s.used_bytes),
                    MemoryScope::Process,
                )
            } else {
                match s.process_bytes {
                    Some(b) => (b, MemoryScope::Process),
                    None => (s.used_bytes, MemoryScope::Device),
                }
            };
            let r = self.readings.entry(s.label.clone()).or_default();
            r.highest_since_event = r.highest_since_event.max(used);
            r.last = used;
            r.capacity_bytes = s.capacity_bytes;
            r.scope = Some(scope);
            if s.label != CPU_LABEL {
                let peak = self.gpu_peaks.entry(s.label).or_default();
                *peak = (*peak).max(used);
            }
        }
    }

    fn cpu_event(&self, step: u64) -> Option<Event> {
        let (now, peak) = if crate::mem::is_installed() {
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
        let sampled = self
            .readings
            .get(CPU_LABEL)
            .map_or(0, |r| r.highest_since_event);
        let used = now.max(sampled);
        Some(Event::Memory {
            device: "cpu".into(),
            used_bytes: used,
            peak_bytes: peak.max(used),
            total_bytes: self.total_bytes,
            step,
            scope: MemoryScope::Process,
        })
    }

    /// One event per GPU read since the last step: this process's memory where NVML
    /// attributes it, the device's otherwise.
    fn gpu_events(&self, step: u64) -> Vec<Event> {
        self.readings
            .iter()
            .filter(|(label, r)| label.as_str() != CPU_LABEL && r.scope.is_some())
            .filter(|(_, r)| r.highest_since_event > 0)
            .map(|(device, r)| Event::Memory {
                peak_bytes: self.gpu_peaks.get(device).copied().unwrap_or(r.last),
                device: device.clone(),
                used_bytes: r.highest_since_event,
                total_bytes: Some(r.capacity_bytes),
                step,
                scope: r.scope.unwrap_or(MemoryScope::Device),
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
/// request, the data tokenized only when the first plan does not fit with headroom); a
/// launched process plans its place in the `world`.
pub fn check_plan(config: &RunConfig, world: crate::plan::WorldPlace) -> PlanCheck {
    match super::plan_adapter::local_plan_request(config) {
        Ok(mut req) => {
            req.world = world;
            check_request(req, || {
                // The trainer reports the data's error itself when it loads it.
                super::samples::trained_tokens(config).ok().flatten()
            })
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A spike inside a step (memory taken and given back before the step ends) shows in the
    /// step's CPU event: the background sampler saw it, although the step-end reading does not.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_spike_inside_a_step_shows_in_its_cpu_event() {
        let mut config = RunConfig::default();
        config.devices.devices = vec!["cpu".into()];
        let mut monitor = MemoryMonitor::new(&config, Some("/nonexistent/libnvidia-ml.so".into()));
        let before = crate::mem::process_rss_bytes().expect("VmRSS on Linux");
        let spike_bytes = 512usize << 20;
        {
            // Touched page by page so it is resident; held for three sampling intervals.
            let mut spike = vec![0u8; spike_bytes];
            for i in (0..spike.len()).step_by(4096) {
                spike[i] = 1;
            }
            std::thread::sleep(SAMPLE_INTERVAL * 3);
            std::hint::black_box(&spike);
        }
        let after = crate::mem::process_rss_bytes().expect("VmRSS on Linux");
        assert!(
            after < before + spike_bytes as u64 / 2,
            "the spike was given back ({before} → {after} B)"
        );
        let events = monitor.sample(1);
        let used = events
            .iter()
            .find_map(|e| match e {
                Event::Memory {
                    device, used_bytes, ..
                } if device == "cpu" => Some(*used_bytes),
                _ => None,
            })
            .expect("a CPU event");
        assert!(
            used >= after + spike_bytes as u64 / 2,
            "the step's CPU reading {used} B misses the {spike_bytes} B spike (RSS {before} B before, {after} B after)"
        );
        // The next step starts from its own readings.
        std::thread::sleep(SAMPLE_INTERVAL * 2);
        let next = monitor.sample(2);
        let Some(Event::Memory { used_bytes, .. }) = next.first() else {
            panic!("a CPU event for step 2: {next:?}");
        };
        assert!(
            *used_bytes < before + spike_bytes as u64 / 2,
            "{used_bytes}"
        );
    }
}
