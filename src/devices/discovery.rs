//! What devices this machine has: the CPU (always) and NVIDIA GPUs (through
//! NVML, when a driver is installed), with their live memory.
//!
//! Discovery never fails: a missing driver, a broken NVML or a CUDA build that
//! cannot see a GPU become human-readable [`DeviceInventory::notes`], and the
//! CPU is always listed, so the studio can always train somewhere.

use super::nvml::{Nvml, NvmlGpu};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The kind of a device (the planner's type: one definition for both).
pub use crate::plan::DeviceKind;

/// A process that holds memory on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// Operating-system process id.
    pub pid: u32,
    /// Device memory it uses, `None` when the driver cannot tell.
    pub used_bytes: Option<u64>,
    /// Whether it is this process.
    pub is_self: bool,
}

/// One device as the CLI and the GUI show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// CPU or GPU.
    pub kind: DeviceKind,
    /// 0 for the CPU; NVML's index for a GPU (PCI order).
    pub index: usize,
    /// The CUDA ordinal candle uses for this GPU (`cuda:N`), when this build
    /// has CUDA and the GPU is visible to it (see `CUDA_VISIBLE_DEVICES`).
    pub cuda_ordinal: Option<usize>,
    /// Product or CPU model name.
    pub name: String,
    /// GPU UUID ("GPU-…"), `None` for the CPU.
    pub uuid: Option<String>,
    /// PCI bus id ("00000000:19:00.0"), `None` for the CPU.
    pub pci_bus_id: Option<String>,
    /// Memory installed (for the CPU: RAM, or the cgroup limit when lower).
    pub total_bytes: u64,
    /// Memory in use (all processes).
    pub used_bytes: u64,
    /// Memory available to a new allocation.
    pub free_bytes: u64,
    /// Percent of time a kernel ran over the last sample period (GPU only).
    pub utilization_percent: Option<u32>,
    /// Percent of time memory was read/written over the last period (GPU only).
    pub memory_utilization_percent: Option<u32>,
    /// Logical cores (CPU only).
    pub cores: Option<usize>,
    /// Processes holding GPU memory (GPU only).
    pub processes: Vec<GpuProcess>,
}

impl DeviceInfo {
    /// A short label: "cpu" or "cuda:N" (NVML index when no CUDA ordinal is known: "gpu#N").
    pub fn label(&self) -> String {
        match (self.kind, self.cuda_ordinal) {
            (DeviceKind::Cpu, _) => "cpu".to_string(),
            (DeviceKind::Cuda, Some(ordinal)) => format!("cuda:{ordinal}"),
            (DeviceKind::Cuda, None) => format!("gpu#{}", self.index),
        }
    }

    /// Bytes held by processes other than this one (GPU only; 0 for the CPU).
    pub fn other_processes_bytes(&self) -> u64 {
        self.processes
            .iter()
            .filter(|p| !p.is_self)
            .filter_map(|p| p.used_bytes)
            .sum()
    }
}

/// Everything discovery found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInventory {
    /// The CPU first, then GPUs in NVML order.
    pub devices: Vec<DeviceInfo>,
    /// NVIDIA driver version, when a driver was found.
    pub driver_version: Option<String>,
    /// Whether this binary was built with CUDA support (`--features cuda`).
    pub cuda_build: bool,
    /// Whether this binary was built with NCCL support (`--features nccl`).
    pub nccl_build: bool,
    /// Human-readable notes: "no GPU found", why NVML failed, GPUs CUDA cannot see.
    pub notes: Vec<String>,
}

impl DeviceInventory {
    /// The CPU entry (always present).
    pub fn cpu(&self) -> Option<&DeviceInfo> {
        self.devices.iter().find(|d| d.kind == DeviceKind::Cpu)
    }

    /// The GPU entries, in NVML order.
    pub fn gpus(&self) -> impl Iterator<Item = &DeviceInfo> {
        self.devices.iter().filter(|d| d.kind == DeviceKind::Cuda)
    }

    /// Whether any GPU was found.
    pub fn has_gpu(&self) -> bool {
        self.gpus().next().is_some()
    }

    /// The GPU candle calls `cuda:ordinal`.
    pub fn gpu_by_cuda_ordinal(&self, ordinal: usize) -> Option<&DeviceInfo> {
        self.gpus().find(|d| d.cuda_ordinal == Some(ordinal))
    }

    /// The memory of the GPU a run config calls `cuda:ordinal`, as the driver reports it.
    /// Without CUDA ordinals (a build without CUDA, or CUDA failed) NVML's order stands in:
    /// it is the PCI bus order, which is CUDA's with `CUDA_DEVICE_ORDER=PCI_BUS_ID` and on
    /// servers of identical GPUs.
    pub fn gpu_capacity_bytes(&self, ordinal: usize) -> Option<u64> {
        let by_ordinal = self.gpu_by_cuda_ordinal(ordinal);
        let any_ordinal = self.gpus().any(|d| d.cuda_ordinal.is_some());
        by_ordinal
            .or_else(|| {
                (!any_ordinal)
                    .then(|| self.gpus().find(|d| d.index == ordinal))
                    .flatten()
            })
            .map(|d| d.total_bytes)
    }
}

/// Where discovery looks.
#[derive(Debug, Clone, Default)]
pub struct DiscoveryOptions {
    /// An NVML library to load instead of the driver's (tests use a fake one).
    /// `None`: `$TUNESTUDIO_NVML_LIB`, then `libnvidia-ml.so.1`.
    pub nvml_library: Option<PathBuf>,
    /// Skip NVML entirely (list the CPU only).
    pub skip_gpus: bool,
}

/// Lists the CPU and every NVIDIA GPU; never fails (problems become notes).
pub fn discover() -> DeviceInventory {
    discover_with(&DiscoveryOptions::default())
}

/// The planner's lookup for GPUs named without a size (`cuda:0`): their memory as
/// NVML reports it, discovered once on first use (nothing is loaded for runs without one).
pub fn driver_gpu_capacity() -> impl Fn(usize) -> Option<u64> {
    let inventory = std::cell::OnceCell::new();
    move |ordinal| inventory.get_or_init(discover).gpu_capacity_bytes(ordinal)
}

/// The host's total memory (`MemTotal` of `/proc/meminfo`): what the planner plans a bare
/// `cpu` against. `None` off Linux.
pub fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text).map(|m| m.total_bytes)
}

/// A device list (`cpu`, `2x80GiB`, `cuda:0`) parsed against this machine
/// ([`crate::plan::parse_devices_with`]): a bare `cpu` is the host's memory
/// ([`host_memory_bytes`]), a bare `cuda:N` what the driver reports ([`driver_gpu_capacity`]).
pub fn parse_local_devices(
    text: &str,
) -> Result<Vec<crate::plan::DeviceSpec>, crate::plan::PlanError> {
    let gpu_bytes = driver_gpu_capacity();
    let machine = crate::plan::MachineMemory {
        host_bytes: host_memory_bytes(),
        gpu_bytes: &gpu_bytes,
    };
    crate::plan::parse_devices_with(text, &machine)
}

/// [`discover`] with explicit options.
pub fn discover_with(options: &DiscoveryOptions) -> DeviceInventory {
    let mut inventory = DeviceInventory {
        devices: vec![cpu_info()],
        driver_version: None,
        cuda_build: cfg!(feature = "cuda"),
        nccl_build: cfg!(feature = "nccl"),
        notes: Vec::new(),
    };
    if options.skip_gpus {
        return inventory;
    }
    let nvml = match &options.nvml_library {
        Some(path) => Nvml::open_path(path),
        None => Nvml::open(),
    };
    let nvml = match nvml {
        Ok(nvml) => nvml,
        Err(err) => {
            inventory.notes.push(format!("no GPU found: {err}"));
            return inventory;
        }
    };
    inventory.driver_version = nvml.driver_version().ok();
    let count = match nvml.device_count() {
        Ok(n) => n,
        Err(err) => {
            inventory.notes.push(format!(
                "no GPU found: the NVIDIA driver is loaded but {err}"
            ));
            return inventory;
        }
    };
    if count == 0 {
        inventory
            .notes
            .push("no GPU found: the NVIDIA driver reports 0 GPUs".to_string());
        return inventory;
    }
    let gpus: Vec<NvmlGpu> = (0..count)
        .filter_map(|i| match nvml.gpu(i) {
            Ok(gpu) => Some(gpu),
            Err(err) => {
                inventory.notes.push(format!("GPU {i} skipped: {err}"));
                None
            }
        })
        .collect();
    let nvml_uuids: Vec<String> = gpus.iter().map(|g| g.uuid.clone()).collect();
    let ordinals = match cuda_device_uuids() {
        CudaUuids::NotBuilt => {
            inventory.notes.push(
                "this build has no CUDA support: GPUs are listed but training runs on the CPU; \
                 build with `--features cuda` (scripts/build-cuda.sh) to train on them"
                    .to_string(),
            );
            vec![None; gpus.len()]
        }
        CudaUuids::Failed(reason) => {
            inventory.notes.push(format!(
                "CUDA could not list its devices ({reason}); GPUs are shown but not usable"
            ));
            vec![None; gpus.len()]
        }
        CudaUuids::Found(cuda) => {
            let ordinals = match_cuda_ordinals(&nvml_uuids, &cuda);
            let hidden = ordinals.iter().filter(|o| o.is_none()).count();
            if hidden > 0 {
                inventory.notes.push(format!(
                    "{hidden} GPU(s) are not visible to CUDA in this process (CUDA_VISIBLE_DEVICES?)"
                ));
            }
            ordinals
        }
    };
    let own_pid = std::process::id();
    for (gpu, ordinal) in gpus.into_iter().zip(ordinals) {
        inventory.devices.push(DeviceInfo {
            kind: DeviceKind::Cuda,
            index: gpu.index as usize,
            cuda_ordinal: ordinal,
            name: gpu.name,
            uuid: Some(gpu.uuid),
            pci_bus_id: Some(gpu.pci_bus_id),
            total_bytes: gpu.memory.total_bytes,
            used_bytes: gpu.memory.used_bytes,
            free_bytes: gpu.memory.free_bytes,
            utilization_percent: gpu.utilization.map(|u| u.gpu_percent),
            memory_utilization_percent: gpu.utilization.map(|u| u.memory_percent),
            cores: None,
            processes: gpu
                .processes
                .into_iter()
                .map(|p| GpuProcess {
                    pid: p.pid,
                    used_bytes: p.used_bytes,
                    is_self: p.pid == own_pid,
                })
                .collect(),
        });
    }
    inventory
}

/// What CUDA (through candle's cudarc) reports about its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaUuids {
    /// This binary was built without the `cuda` feature.
    NotBuilt,
    /// The CUDA driver API failed (no driver, no device visible, …).
    Failed(String),
    /// UUIDs of CUDA ordinals 0..n, as NVML formats them ("GPU-xxxxxxxx-…").
    Found(Vec<String>),
}

/// The UUID of every CUDA ordinal, via the driver API (`cuDeviceGetUuid`).
///
/// This deliberately does not create a CUDA context (which would take
/// hundreds of MB on every GPU just to list them).
#[cfg(feature = "cuda")]
pub fn cuda_device_uuids() -> CudaUuids {
    use candle_core::cuda_backend::cudarc::driver::result;
    if let Err(err) = result::init() {
        return CudaUuids::Failed(format!("cuInit: {err:?}"));
    }
    let count = match result::device::get_count() {
        Ok(n) => n,
        Err(err) => return CudaUuids::Failed(format!("cuDeviceGetCount: {err:?}")),
    };
    let mut uuids = Vec::new();
    for ordinal in 0..count {
        let uuid = result::device::get(ordinal).and_then(result::device::get_uuid);
        match uuid {
            Ok(uuid) => {
                let mut bytes = [0u8; 16];
                for (b, c) in bytes.iter_mut().zip(uuid.bytes.iter()) {
                    *b = *c as u8;
                }
                uuids.push(format_cuda_uuid(&bytes));
            }
            Err(err) => return CudaUuids::Failed(format!("cuDeviceGetUuid({ordinal}): {err:?}")),
        }
    }
    CudaUuids::Found(uuids)
}

/// Without the `cuda` feature there are no CUDA ordinals.
#[cfg(not(feature = "cuda"))]
pub fn cuda_device_uuids() -> CudaUuids {
    CudaUuids::NotBuilt
}

/// Formats CUDA's 16 raw UUID bytes the way NVML prints them:
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (lower-case hex).
pub fn format_cuda_uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The comparable core of a UUID: lower-case hex digits only, without the
/// "GPU-"/"MIG-" prefix and dashes.
fn normalize_uuid(uuid: &str) -> String {
    let trimmed = uuid.trim();
    let body = trimmed
        .strip_prefix("GPU-")
        .or_else(|| trimmed.strip_prefix("gpu-"))
        .or_else(|| trimmed.strip_prefix("MIG-"))
        .unwrap_or(trimmed);
    body.chars()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// For each NVML device (by position in `nvml_uuids`), the CUDA ordinal whose
/// UUID matches, or `None` when CUDA does not see it.
///
/// NVML enumerates in PCI bus order while CUDA's default order is "fastest
/// first" and `CUDA_VISIBLE_DEVICES` can hide and reorder GPUs, so positions
/// must never be assumed to agree; UUIDs are the stable key.
pub fn match_cuda_ordinals(nvml_uuids: &[String], cuda_uuids: &[String]) -> Vec<Option<usize>> {
    let cuda: Vec<String> = cuda_uuids.iter().map(|u| normalize_uuid(u)).collect();
    nvml_uuids
        .iter()
        .map(|u| {
            let key = normalize_uuid(u);
            if key.is_empty() {
                return None;
            }
            cuda.iter().position(|c| *c == key)
        })
        .collect()
}

/// The CPU entry: model name, logical cores, RAM (total / available).
pub fn cpu_info() -> DeviceInfo {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or_else(|_| num_cpus::get());
    let name = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| parse_cpu_model(&text))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let (mut total_bytes, mut free_bytes) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| parse_meminfo(&text))
        .map(|m| (m.total_bytes, m.available_bytes))
        .unwrap_or((0, 0));
    // In a container the cgroup limit, not the host's RAM, is what an
    // allocation can reach.
    if let Some((limit, usage)) = cgroup_memory() {
        if limit < total_bytes || total_bytes == 0 {
            total_bytes = limit;
            free_bytes = free_bytes.min(limit.saturating_sub(usage));
        }
    }
    DeviceInfo {
        kind: DeviceKind::Cpu,
        index: 0,
        cuda_ordinal: None,
        name,
        uuid: None,
        pci_bus_id: None,
        total_bytes,
        used_bytes: total_bytes.saturating_sub(free_bytes),
        free_bytes,
        utilization_percent: None,
        memory_utilization_percent: None,
        cores: Some(cores),
        processes: Vec::new(),
    }
}

/// RAM figures from `/proc/meminfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// `MemTotal`.
    pub total_bytes: u64,
    /// `MemAvailable` (or `MemFree` on kernels older than 3.14).
    pub available_bytes: u64,
}

/// Parses `/proc/meminfo` text.
pub fn parse_meminfo(text: &str) -> Option<MemInfo> {
    let field = |key: &str| -> Option<u64> {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(key)?.strip_prefix(':')?;
            let mut parts = rest.split_whitespace();
            let value: u64 = parts.next()?.parse().ok()?;
            match parts.next() {
                Some("kB") => Some(value * 1024),
                None => Some(value),
                _ => None,
            }
        })
    };
    let total_bytes = field("MemTotal")?;
    let available_bytes = field("MemAvailable").or_else(|| field("MemFree"))?;
    Some(MemInfo {
        total_bytes,
        available_bytes,
    })
}

/// The first `model name` (x86) or `Model`/`Hardware` (ARM) line of `/proc/cpuinfo`.
pub fn parse_cpu_model(text: &str) -> Option<String> {
    for key in ["model name", "Model", "Hardware", "cpu model"] {
        let found = text.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key && !v.trim().is_empty()).then(|| v.trim().to_string())
        });
        if found.is_some() {
            return found;
        }
    }
    None
}

/// cgroup v2 memory limit and usage of this process, when limited.
fn cgroup_memory() -> Option<(u64, u64)> {
    let limit = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok()?;
    let limit: u64 = limit.trim().parse().ok()?; // "max" (unlimited) fails to parse
    let usage = std::fs::read_to_string("/sys/fs/cgroup/memory.current")
        .ok()
        .and_then(|u| u.trim().parse().ok())
        .unwrap_or(0);
    Some((limit, usage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_uuid_format_matches_nvml() {
        let bytes = [
            0x0c, 0x3c, 0x1a, 0x2b, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
            0xee, 0xff,
        ];
        assert_eq!(
            format_cuda_uuid(&bytes),
            "GPU-0c3c1a2b-4455-6677-8899-aabbccddeeff"
        );
    }

    #[test]
    fn ordinals_follow_uuids_not_positions() {
        let nvml = vec![
            "GPU-aaaaaaaa-0000-0000-0000-000000000000".to_string(),
            "GPU-bbbbbbbb-0000-0000-0000-000000000000".to_string(),
            "GPU-cccccccc-0000-0000-0000-000000000000".to_string(),
        ];
        // CUDA_VISIBLE_DEVICES=2,0: CUDA sees NVML#2 as ordinal 0, NVML#0 as 1; NVML#1 hidden.
        let cuda = vec![
            "GPU-CCCCCCCC-0000-0000-0000-000000000000".to_string(),
            "gpu-aaaaaaaa-0000-0000-0000-000000000000".to_string(),
        ];
        assert_eq!(
            match_cuda_ordinals(&nvml, &cuda),
            vec![Some(1), None, Some(0)]
        );
        assert_eq!(match_cuda_ordinals(&nvml, &[]), vec![None, None, None]);
        assert_eq!(
            match_cuda_ordinals(&[String::new()], &[String::new()]),
            vec![None]
        );
    }

    #[test]
    fn meminfo_and_cpuinfo_parse() {
        let meminfo =
            "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(
            parse_meminfo(meminfo),
            Some(MemInfo {
                total_bytes: 24_576_000 * 1024,
                available_bytes: 20_000_000 * 1024
            })
        );
        assert_eq!(
            parse_meminfo("MemTotal: 10 kB\nMemFree: 4 kB\n").map(|m| m.available_bytes),
            Some(4096)
        );
        assert_eq!(parse_meminfo("nothing"), None);
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n";
        assert_eq!(parse_cpu_model(cpuinfo).as_deref(), Some("AMD EPYC 7B13"));
        assert_eq!(parse_cpu_model("processor : 0\n"), None);
    }

    #[test]
    fn without_a_driver_only_the_cpu_is_listed() {
        let inv = discover_with(&DiscoveryOptions {
            nvml_library: Some(PathBuf::from("/nonexistent/libnvidia-ml.so.1")),
            skip_gpus: false,
        });
        assert_eq!(inv.devices.len(), 1);
        let cpu = inv.cpu().expect("cpu listed");
        assert!(cpu.total_bytes > 0 && cpu.cores.unwrap_or(0) > 0);
        assert!(!inv.has_gpu());
        assert!(
            inv.notes.iter().any(|n| n.starts_with("no GPU found")),
            "{:?}",
            inv.notes
        );
    }
}
