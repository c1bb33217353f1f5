//! Live per-device memory: a background thread that samples every device a
//! run uses at 2–5 Hz and hands [`MemorySample`]s to a callback (or a
//! channel). The trainer forwards them as events; the GUI plots them.
//!
//! GPUs are read through NVML (device-wide used/total, the same figure
//! `nvidia-smi` shows). The CPU is one physical device however many logical
//! devices share it, so it is sampled once: the process's resident set size
//! and, when the counting allocator of [`crate::mem`] is installed, the heap
//! bytes it counts.

use super::nvml::Nvml;
use super::DevicesError;
use crossbeam_channel::{Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Fastest and slowest sampling allowed (5 Hz and 2 Hz): faster costs NVML
/// calls for no visible gain in a chart, slower misses short peaks.
pub const MIN_INTERVAL: Duration = Duration::from_millis(200);
/// See [`MIN_INTERVAL`].
pub const MAX_INTERVAL: Duration = Duration::from_millis(500);

/// One reading of one device's memory.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MemorySample {
    /// The device's position among the run's devices (the first logical
    /// device of the physical device sampled).
    pub device_index: usize,
    /// "cpu", "cuda:0".
    pub label: String,
    /// Bytes in use: the process RSS for the CPU, device-wide used memory for a GPU.
    pub used_bytes: u64,
    /// Bytes the device has.
    pub capacity_bytes: u64,
    /// Heap bytes counted by [`crate::mem`]'s allocator (CPU, when installed).
    pub allocator_bytes: Option<u64>,
    /// GPU: the memory NVML attributes to this process, when it reports it (not inside
    /// some containers); `used_bytes` stays the device-wide figure `nvidia-smi` shows.
    #[serde(default)]
    pub process_bytes: Option<u64>,
    /// Seconds since the sampler started.
    pub t_secs: f64,
}

/// What to sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SampleTarget {
    /// This process on the host.
    Cpu {
        /// Reported as [`MemorySample::device_index`].
        device_index: usize,
        /// Reported as [`MemorySample::label`].
        label: String,
        /// The host's usable memory.
        capacity_bytes: u64,
    },
    /// An NVIDIA GPU, by NVML index.
    Gpu {
        /// Reported as [`MemorySample::device_index`].
        device_index: usize,
        /// Reported as [`MemorySample::label`].
        label: String,
        /// NVML's index of the GPU.
        nvml_index: u32,
    },
}

impl SampleTarget {
    /// One target per physical device among `devices` (logical devices
    /// sharing the CPU or a GPU are sampled once), using `inventory` to map
    /// CUDA ordinals to NVML indices.
    pub fn for_devices(
        devices: &[super::LogicalDevice],
        inventory: &super::DeviceInventory,
    ) -> Vec<SampleTarget> {
        let mut out: Vec<SampleTarget> = Vec::new();
        for d in devices {
            match d.candle.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => {
                    let Some(info) = inventory.gpu_by_cuda_ordinal(gpu_id) else {
                        continue;
                    };
                    let nvml_index = info.index as u32;
                    if !out
                        .iter()
                        .any(|t| matches!(t, SampleTarget::Gpu { nvml_index: n, .. } if *n == nvml_index))
                    {
                        out.push(SampleTarget::Gpu {
                            device_index: d.index,
                            label: format!("cuda:{gpu_id}"),
                            nvml_index,
                        });
                    }
                }
                _ => {
                    if !out.iter().any(|t| matches!(t, SampleTarget::Cpu { .. })) {
                        out.push(SampleTarget::Cpu {
                            device_index: d.index,
                            label: "cpu".to_string(),
                            capacity_bytes: inventory.cpu().map(|c| c.total_bytes).unwrap_or(0),
                        });
                    }
                }
            }
        }
        out
    }
}

/// A running sampler; dropping it stops the thread and waits for it.
#[derive(Debug)]
pub struct MemorySampler {
    stop: Option<Sender<()>>,
    handle: Option<JoinHandle<()>>,
    interval: Duration,
}

impl MemorySampler {
    /// Starts sampling `targets` every `interval` (clamped to 200–500 ms),
    /// calling `sink` with each sample from the sampler thread. The first
    /// round is taken immediately. GPU targets are skipped (with no samples)
    /// when NVML cannot be loaded.
    pub fn start<F>(
        targets: Vec<SampleTarget>,
        interval: Duration,
        sink: F,
    ) -> Result<Self, DevicesError>
    where
        F: FnMut(MemorySample) + Send + 'static,
    {
        Self::start_with_library(targets, interval, None, sink)
    }

    /// [`MemorySampler::start`] reading GPUs through the NVML library at `nvml_library`
    /// (`None`: `$TUNESTUDIO_NVML_LIB`, then the driver's).
    pub fn start_with_library<F>(
        targets: Vec<SampleTarget>,
        interval: Duration,
        nvml_library: Option<std::path::PathBuf>,
        sink: F,
    ) -> Result<Self, DevicesError>
    where
        F: FnMut(MemorySample) + Send + 'static,
    {
        let interval = interval.clamp(MIN_INTERVAL, MAX_INTERVAL);
        let (stop_tx, stop_rx) = crossbeam_channel::bounded::<()>(1);
        let needs_nvml = targets
            .iter()
            .any(|t| matches!(t, SampleTarget::Gpu { .. }));
        let handle = std::thread::Builder::new()
            .name("tunestudio-mem-sampler".into())
            .spawn(move || {
                let nvml = if needs_nvml {
                    match &nvml_library {
                        Some(path) => Nvml::open_path(path),
                        None => Nvml::open(),
                    }
                    .ok()
                    .map(Arc::new)
                } else {
                    None
                };
                run(targets, interval, nvml, stop_rx, sink)
            })
            .map_err(DevicesError::Sampler)?;
        Ok(MemorySampler {
            stop: Some(stop_tx),
            handle: Some(handle),
            interval,
        })
    }

    /// [`MemorySampler::start`] with the samples sent over a channel.
    pub fn with_channel(
        targets: Vec<SampleTarget>,
        interval: Duration,
    ) -> Result<(Self, Receiver<MemorySample>), DevicesError> {
        Self::with_channel_and_library(targets, interval, None)
    }

    /// [`MemorySampler::with_channel`] with an explicit NVML library (see
    /// [`MemorySampler::start_with_library`]).
    pub fn with_channel_and_library(
        targets: Vec<SampleTarget>,
        interval: Duration,
        nvml_library: Option<std::path::PathBuf>,
    ) -> Result<(Self, Receiver<MemorySample>), DevicesError> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let sampler = Self::start_with_library(targets, interval, nvml_library, move |s| {
            // The receiver may be gone (UI closed): keep running quietly until dropped.
            let _ = tx.send(s);
        })?;
        Ok((sampler, rx))
    }

    /// The interval actually used (after clamping).
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Stops the thread and waits for it (also done on drop).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        // Dropping the sender wakes the thread's `recv_timeout` at once.
        self.stop.take();
        if let Some(handle) = self.handle.take() {
            // A panicking sink only ends sampling; nothing to propagate.
            let _ = handle.join();
        }
    }
}

impl Drop for MemorySampler {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn run<F: FnMut(MemorySample)>(
    targets: Vec<SampleTarget>,
    interval: Duration,
    nvml: Option<Arc<Nvml>>,
    stop: Receiver<()>,
    mut sink: F,
) {
    let start = Instant::now();
    loop {
        for target in &targets {
            if let Some(sample) = sample(target, nvml.as_deref(), start) {
                sink(sample);
            }
        }
        match stop.recv_timeout(interval) {
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
            // A message or a dropped sender both mean stop.
            _ => break,
        }
    }
}

/// One reading of `target`, `None` when it cannot be read right now.
fn sample(target: &SampleTarget, nvml: Option<&Nvml>, start: Instant) -> Option<MemorySample> {
    let t_secs = start.elapsed().as_secs_f64();
    match target {
        SampleTarget::Cpu {
            device_index,
            label,
            capacity_bytes,
        } => {
            let allocator_bytes = crate::mem::is_installed().then(crate::mem::current_bytes);
            let used_bytes = crate::mem::process_rss_bytes().or(allocator_bytes)?;
            Some(MemorySample {
                device_index: *device_index,
                label: label.clone(),
                used_bytes,
                capacity_bytes: *capacity_bytes,
                allocator_bytes,
                process_bytes: None,
                t_secs,
            })
        }
        SampleTarget::Gpu {
            device_index,
            label,
            nvml_index,
        } => {
            let nvml = nvml?;
            let memory = nvml.memory(*nvml_index).ok()?;
            let own_pid = std::process::id();
            let process_bytes = nvml.processes(*nvml_index).ok().and_then(|ps| {
                ps.into_iter()
                    .find(|p| p.pid == own_pid)
                    .and_then(|p| p.used_bytes)
            });
            Some(MemorySample {
                device_index: *device_index,
                label: label.clone(),
                used_bytes: memory.used_bytes,
                capacity_bytes: memory.total_bytes,
                allocator_bytes: None,
                process_bytes,
                t_secs,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_the_cpu_and_stops_on_drop() {
        let targets = vec![SampleTarget::Cpu {
            device_index: 0,
            label: "cpu".into(),
            capacity_bytes: 1 << 30,
        }];
        let (sampler, rx) = MemorySampler::with_channel(targets, Duration::from_millis(1)).unwrap();
        assert_eq!(sampler.interval(), MIN_INTERVAL);
        let first = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("a first sample");
        let second = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("a second sample");
        let started = Instant::now();
        drop(sampler);
        // Drop wakes the thread immediately rather than after a full interval.
        assert!(started.elapsed() < Duration::from_millis(150));
        assert!(first.used_bytes > 0);
        assert_eq!(first.label, "cpu");
        assert!(second.t_secs >= first.t_secs + 0.15, "{first:?} {second:?}");
        // The thread has ended: the channel drains and disconnects.
        while rx.try_recv().is_ok() {}
        assert!(matches!(
            rx.recv_timeout(Duration::from_millis(50)),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected)
        ));
    }
}
