//! The meter a dry run measures a step with: the counting allocator's heap, the process's
//! resident set (its peak reset through `/proc/self/clear_refs`), or nothing (a GPU).

use std::fmt;

/// How a step's memory was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum MeasureMethod {
    /// Peak heap bytes from [`super::CountingAllocator`] (exact for CPU tensors).
    CountingAllocator,
    /// Peak resident set size (`VmHWM`, reset before the step); includes mapped files.
    ProcessRss,
    /// Nothing to measure with (e.g. CUDA memory, or RSS unavailable off Linux).
    Unavailable,
}

impl fmt::Display for MeasureMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MeasureMethod::CountingAllocator => "counting allocator",
            MeasureMethod::ProcessRss => "peak RSS",
            MeasureMethod::Unavailable => "not measured",
        })
    }
}

/// The meter a dry run measures with, as its step sees it: the counting allocator's heap, the
/// process's resident set, or nothing (a GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meter {
    method: MeasureMethod,
}

impl Meter {
    /// How this process can measure a step's peak: on the CPU the counting allocator when a
    /// binary installed it, else the peak RSS where it can be reset (it is reset here);
    /// nothing for a GPU.
    pub fn for_step(on_cpu: bool) -> Self {
        let method = if !on_cpu {
            MeasureMethod::Unavailable
        } else if super::is_installed() {
            MeasureMethod::CountingAllocator
        } else if reset_peak_rss() && super::process_rss_bytes().is_some() {
            MeasureMethod::ProcessRss
        } else {
            MeasureMethod::Unavailable
        };
        Meter { method }
    }

    /// What it reads.
    pub fn method(&self) -> MeasureMethod {
        self.method
    }

    /// Starts a measurement (the allocator's peak is reset): the bytes in use before the step.
    pub fn start(&self) -> Option<u64> {
        match self.method {
            MeasureMethod::CountingAllocator => {
                super::reset_peak();
                Some(super::current_bytes())
            }
            MeasureMethod::ProcessRss => super::process_rss_bytes(),
            MeasureMethod::Unavailable => None,
        }
    }

    /// Bytes in use now: the heap, or the resident set (`VmRSS`).
    pub fn in_use_bytes(&self) -> Option<u64> {
        match self.method {
            MeasureMethod::CountingAllocator => Some(super::current_bytes()),
            MeasureMethod::ProcessRss => super::process_rss_bytes(),
            MeasureMethod::Unavailable => None,
        }
    }

    /// The peak since [`Meter::start`] (the dry run starts it before the step closure runs).
    pub fn peak_bytes(&self) -> Option<u64> {
        match self.method {
            MeasureMethod::CountingAllocator => Some(super::peak_bytes()),
            MeasureMethod::ProcessRss => super::peak_rss_bytes(),
            MeasureMethod::Unavailable => None,
        }
    }
}

/// Resets the kernel's peak-RSS counter (`VmHWM`) by writing 5 to
/// `/proc/self/clear_refs`; false where that is not possible.
fn reset_peak_rss() -> bool {
    #[cfg(target_os = "linux")]
    {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}
