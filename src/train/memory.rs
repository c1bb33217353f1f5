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
                    match (crate::mem::process_rss_bytes(), crate::mem::peak_rss_bytes()) {
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
