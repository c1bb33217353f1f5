//! Devices as the planner sees them (a name, a kind, a capacity), parsed from
//! the short strings of the CLI and the run config, and byte sizes in and out.

use super::PlanError;
use std::fmt;

/// What kind of device (and memory) it is: the crate's one definition, shared by the planner
/// and device discovery (`devices::DeviceKind` re-exports it). Written `"cpu"` / `"cuda"` in
/// JSON; the capitalised names of older plan files are still read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The host CPU and its RAM (no runtime overhead).
    #[serde(alias = "Cpu")]
    Cpu,
    /// An NVIDIA (CUDA) GPU (≈ 612 MiB of context and workspace before any tensor).
    #[serde(alias = "Cuda")]
    Cuda,
}

/// One device: its name, kind and usable memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceSpec {
    /// What to call it in reports ("GPU 0", "CPU").
    pub name: String,
    /// CPU or CUDA.
    pub kind: DeviceKind,
    /// CUDA ordinal, when known.
    pub ordinal: Option<usize>,
    /// Total memory the run may use.
    pub capacity_bytes: u64,
    /// On a CPU, what sizes gemm's per-thread workspace ([`GemmGeometry`]): this machine's
    /// unless a test or a plan for another machine says otherwise. `None` on a GPU, and in plan
    /// files written before it existed (then the planning machine's is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm: Option<GemmGeometry>,
}

/// The inputs of a CPU's gemm workspace: the L2 slab gemm-common reads from sysfs (per core:
/// the L2 divided by the cores sharing it; 2 MiB on a Sapphire Rapids Xeon, 1 MiB on Zen 4)
/// and the threads that pack products. The kernels read the same two values
/// (`model::ops::matmul`), so a plan for this machine follows its cache and its thread count,
/// and a plan for another geometry is one struct away.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GemmGeometry {
    /// One thread's packing slab.
    pub l2_slab_bytes: u64,
    /// Threads that may hold a slab during a step.
    pub threads: u64,
}

/// The most of its L2 slab (and packing buffer) one thread's products make resident:
/// `examples/gemm_slab_rss.rs` reads `VmRSS` around one single-threaded f32 product per fresh
/// process on a 2 MiB slab (Sapphire Rapids): 1,128–1,216 KiB for every shape with `k` ≥ 512
/// (SmolLM2's 576/1536/49152 products both ways, 4096³, 8192 × 4096 × 14336), 236–284 KiB for
/// the demo's (`k` 64/192, or 49152 with 64 columns). gemm-common caps a block at `kc` ≤ 512
/// and `mc` ≤ 8 micro-panels whatever the cache, so a larger L2 adds no resident pages.
pub const GEMM_SLAB_TOUCHED_BYTES: u64 = 1_216 * 1024;

impl GemmGeometry {
    /// This process's: gemm's slab and rayon's workers plus the thread that calls them.
    pub fn host() -> Self {
        GemmGeometry {
            l2_slab_bytes: crate::model::ops::matmul::gemm_l2_slab_bytes(),
            threads: crate::model::ops::matmul::gemm_workspace_threads(),
        }
    }

    /// Every thread's slab: they live as long as the threads, so under every phase of a step.
    pub fn workspace_bytes(&self) -> u64 {
        super::step_model::gemm_workspace_bytes(self.l2_slab_bytes, self.threads)
    }

    /// The part of [`Self::workspace_bytes`] that is resident: a product touches its slab only
    /// as far as it packs, so a slab larger than [`GEMM_SLAB_TOUCHED_BYTES`] is never filled.
    /// The heap (the counting allocator) sees every slab whole; `VmRSS` sees this.
    pub fn resident_workspace_bytes(&self) -> u64 {
        super::step_model::gemm_workspace_bytes(
            self.l2_slab_bytes.min(GEMM_SLAB_TOUCHED_BYTES),
            self.threads,
        )
    }
}

impl DeviceSpec {
    /// A CUDA device `GPU <ordinal>` with the given capacity.
    pub fn cuda(ordinal: usize, capacity_bytes: u64) -> Self {
        DeviceSpec {
            name: format!("GPU {ordinal}"),
            kind: DeviceKind::Cuda,
            ordinal: Some(ordinal),
            capacity_bytes,
            gemm: None,
        }
    }

    /// The host CPU with the given capacity.
    pub fn cpu(capacity_bytes: u64) -> Self {
        DeviceSpec {
            name: "CPU".into(),
            kind: DeviceKind::Cpu,
            ordinal: None,
            capacity_bytes,
            gemm: Some(GemmGeometry::host()),
        }
    }

    /// The same CPU planned with another gemm geometry (a machine with another cache, or
    /// another thread count).
    pub fn with_gemm(mut self, gemm: GemmGeometry) -> Self {
        self.gemm = Some(gemm);
        self
    }

    /// Memory the runtime takes before any tensor: the CUDA context (cuBLAS
    /// workspace, kernels) is ≈ 612 MiB per device; CPU has none beyond the heap.
    pub fn overhead_bytes(&self) -> u64 {
        match self.kind {
            DeviceKind::Cpu => 0,
            DeviceKind::Cuda => CUDA_CONTEXT_BYTES,
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, format_bytes(self.capacity_bytes))
    }
}

/// What a CUDA process holds before and after its tensors: the context, cuBLAS's workspace,
/// candle's kernels. Measured on one H200 (driver 580, CUDA 13.0, this build): 612 MiB in
/// `nvidia-smi` once every tensor of a training run was freed, in all nine shapes probed
/// (614 in fp32); it was estimated at 500 MiB before a GPU ran.
pub(crate) const CUDA_CONTEXT_BYTES: u64 = 612 * MIB;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;

/// Parses a size such as `80GiB`, `80 GB`, `24g`, `512MiB`, `1.5TiB` (decimal
/// units are powers of 1000, binary ones powers of 1024; a bare `G`/`M` is binary).
pub fn parse_bytes(text: &str) -> Result<u64, PlanError> {
    let err = |reason: &str| PlanError::InvalidSize {
        text: text.to_string(),
        reason: reason.to_string(),
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(err("it does not start with a number"));
    }
    let value: f64 = num.parse().map_err(|_| err("the number is malformed"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let scale = match unit.as_str() {
        "" => return Err(err("it has no unit (GiB, GB, MiB, ...)")),
        "b" => 1.0,
        "kib" | "k" | "ki" => KIB as f64,
        "kb" => 1e3,
        "mib" | "m" | "mi" => MIB as f64,
        "mb" => 1e6,
        "gib" | "g" | "gi" => GIB as f64,
        "gb" => 1e9,
        "tib" | "t" | "ti" => TIB as f64,
        "tb" => 1e12,
        _ => return Err(err("unknown unit")),
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes <= 0.0 || bytes > u64::MAX as f64 {
        return Err(err("the size must be positive"));
    }
    Ok(bytes.round() as u64)
}

/// Formats bytes for people (the crate's one formatter, re-exported as `plan::format_bytes`).
pub use crate::units::format_bytes;

/// Parses a comma-separated device list:
///
/// * `2x80GiB` — two CUDA GPUs of 80 GiB; `80GB,80GB` — two of 80 GB;
/// * `cpu:24GiB` (or `cpu=24GiB`) — the host with 24 GiB; bare `cpu` — the host's total memory;
/// * `cuda:1=40GiB` (or `cuda:1:40GiB`) — GPU 1 with 40 GiB;
/// * `2xh100`, `a100-40gb` — GPUs of the catalogue ([`super::GPU_CATALOG`]), as large as
///   their driver reports.
///
/// * `cpu:1` (or `cpu:1=8GiB`) — logical CPU device 1 (several share the host; without a
///   size each gets an equal share of its memory), as the trainer's `[devices]` lists them.
///
/// A bare `cpu` and a bare `cuda:0` have no capacity the planner could know without asking
/// the machine: [`parse_devices_with`] takes what the caller measured
/// (`devices::parse_local_devices` reads `/proc/meminfo` and asks NVML); here both are unknown.
pub fn parse_devices(text: &str) -> Result<Vec<DeviceSpec>, PlanError> {
    parse_devices_with(text, &MachineMemory::UNKNOWN)
}

/// What the planner cannot know without asking the machine, measured by the layer that
/// gathers its inputs (the planner itself reads nothing).
#[derive(Clone, Copy)]
pub struct MachineMemory<'a> {
    /// The host's total memory: what a bare `cpu` (or `cpu:N`) is planned against.
    pub host_bytes: Option<u64>,
    /// A GPU's memory by CUDA ordinal: what a bare `cuda:N` is planned against.
    pub gpu_bytes: &'a dyn Fn(usize) -> Option<u64>,
}

impl MachineMemory<'static> {
    /// Nothing measured: only devices written with a size can be planned.
    pub const UNKNOWN: MachineMemory<'static> = MachineMemory {
        host_bytes: None,
        gpu_bytes: &|_| None,
    };
}

/// [`parse_devices`] with the machine's measured memory: `machine.gpu_bytes(ordinal)` supplies
/// the memory of a GPU named without a size (`cuda:0`), `machine.host_bytes` that of a bare
/// `cpu`; `None` makes that entry an error that says how to give the size.
pub fn parse_devices_with(
    text: &str,
    machine: &MachineMemory<'_>,
) -> Result<Vec<DeviceSpec>, PlanError> {
    let mut out: Vec<DeviceSpec> = Vec::new();
    let mut next_gpu = 0usize;
    let entries: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let logical_cpus = entries
        .iter()
        .filter(|e| logical_cpu_index(&e.to_ascii_lowercase()).is_some())
        .count()
        .max(1) as u64;
    for raw in entries {
        let bad = |reason: String| PlanError::InvalidDevice {
            spec: raw.to_string(),
            reason,
        };
        let lower = raw.to_ascii_lowercase();
        let unknown_host = || bad("the host's memory size is unknown here; write cpu:24GiB".into());
        if let Some((index, size)) = logical_cpu_index(&lower) {
            let capacity = match size {
                Some(size) => parse_bytes(size).map_err(|e| bad(e.to_string()))?,
                None => machine.host_bytes.ok_or_else(unknown_host)? / logical_cpus,
            };
            let mut spec = DeviceSpec::cpu(capacity);
            spec.name = format!("cpu:{index}");
            out.push(spec);
        } else if let Some(rest) = lower.strip_prefix("cpu") {
            let rest = rest.trim_start_matches([':', '=']).trim();
            let capacity = if rest.is_empty() {
                machine.host_bytes.ok_or_else(unknown_host)?
            } else {
                parse_bytes(rest).map_err(|e| bad(e.to_string()))?
            };
            out.push(DeviceSpec::cpu(capacity));
        } else if let Some(rest) = lower
            .strip_prefix("cuda")
            .or_else(|| lower.strip_prefix("gpu"))
        {
            let rest = rest.trim_start_matches(':');
            let (ord, size) = match rest.find(['=', ':']) {
                Some(i) => (&rest[..i], Some(&rest[i + 1..])),
                None => (rest, None),
            };
            let ordinal = if ord.is_empty() {
                next_gpu
            } else {
                ord.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(format!("`{ord}` is not a GPU number")))?
            };
            let capacity = match size {
                Some(size) => parse_bytes(size).map_err(|e| bad(e.to_string()))?,
                None => (machine.gpu_bytes)(ordinal).ok_or_else(|| {
                    bad(format!(
                        "no NVIDIA driver reports its memory here, so the planner needs the size: write cuda:{ordinal}=80GiB (see `tunestudio devices`)"
                    ))
                })?,
            };
            out.push(DeviceSpec::cuda(ordinal, capacity));
            next_gpu = ordinal + 1;
        } else if let Some((count, size)) = lower.split_once('x').filter(|(c, _)| {
            !c.is_empty()
                && c.chars()
                    .all(|ch| ch.is_ascii_digit() || ch.is_whitespace())
        }) {
            let count: usize = count
                .trim()
                .parse()
                .map_err(|_| bad("the count before `x` is malformed".into()))?;
            if count == 0 || count > 1024 {
                return Err(bad("the device count must be between 1 and 1024".into()));
            }
            let capacity = size_or_gpu_model(size).map_err(|e| bad(e.to_string()))?;
            for _ in 0..count {
                out.push(DeviceSpec::cuda(next_gpu, capacity));
                next_gpu += 1;
            }
        } else {
            let capacity = size_or_gpu_model(&lower).map_err(|e| bad(e.to_string()))?;
            out.push(DeviceSpec::cuda(next_gpu, capacity));
            next_gpu += 1;
        }
    }
    if out.is_empty() {
        return Err(PlanError::NoDevices);
    }
    Ok(out)
}

/// A size (`80GiB`) or, failing that, a GPU model of the catalogue (`h100`), as
/// the driver reports its memory; the size's error when it is neither.
fn size_or_gpu_model(text: &str) -> Result<u64, PlanError> {
    parse_bytes(text).or_else(|e| {
        if let Some(m) = super::find_gpu_model(text) {
            return Ok(m.capacity_bytes());
        }
        // A word, not a number: the user meant a GPU model, so list the known ones.
        if text.trim().starts_with(|c: char| c.is_ascii_alphabetic()) {
            let known: Vec<&str> = super::GPU_CATALOG.iter().map(|m| m.id).collect();
            return Err(PlanError::InvalidSize {
                text: text.to_string(),
                reason: format!(
                    "it is neither a size nor a GPU model the planner knows ({})",
                    known.join(", ")
                ),
            });
        }
        Err(e)
    })
}

/// `cpu:N` or `cpu:N=SIZE` (a logical CPU device): its index and size text.
fn logical_cpu_index(lower: &str) -> Option<(usize, Option<&str>)> {
    let rest = lower.strip_prefix("cpu:")?;
    let (index, size) = match rest.split_once('=') {
        Some((i, s)) => (i, Some(s.trim())),
        None => (rest, None),
    };
    let index = index.trim();
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((index.parse().ok()?, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slab_larger_than_gemm_packs_is_resident_only_as_far_as_it_packs() {
        let sapphire_rapids = GemmGeometry {
            l2_slab_bytes: 2 * MIB,
            threads: 3,
        };
        assert_eq!(sapphire_rapids.workspace_bytes(), 6 * MIB);
        assert_eq!(
            sapphire_rapids.resident_workspace_bytes(),
            3 * GEMM_SLAB_TOUCHED_BYTES
        );
        let epyc = GemmGeometry {
            l2_slab_bytes: MIB / 2,
            threads: 3,
        };
        assert_eq!(epyc.resident_workspace_bytes(), epyc.workspace_bytes());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("80GiB").unwrap(), 80 * GIB);
        assert_eq!(parse_bytes("80 GB").unwrap(), 80_000_000_000);
        assert_eq!(parse_bytes("1.5g").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 * MIB);
        assert!(parse_bytes("80").is_err());
        assert!(parse_bytes("GiB").is_err());
        assert!(parse_bytes("80 parsecs").is_err());
        assert!(parse_bytes("0GiB").is_err());
        assert_eq!(format_bytes(67 * GIB + GIB / 2), "67.5 GiB");
        assert_eq!(format_bytes(300 * MIB), "300 MiB");
    }

    #[test]
    fn device_lists() {
        let d = parse_devices("2x80GiB").unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].name, "GPU 1");
        assert_eq!(d[0].capacity_bytes, 80 * GIB);
        assert_eq!(d[0].kind, DeviceKind::Cuda);

        let d = parse_devices("80GB, 80GB").unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].ordinal, Some(1));
        assert_eq!(d[0].capacity_bytes, 80_000_000_000);

        let d = parse_devices("cpu:24GiB").unwrap();
        assert_eq!(d, vec![DeviceSpec::cpu(24 * GIB)]);

        let d = parse_devices("cuda:1=40GiB,cuda:3:24GiB").unwrap();
        assert_eq!(d[0].name, "GPU 1");
        assert_eq!(d[1].ordinal, Some(3));
        assert_eq!(d[1].capacity_bytes, 24 * GIB);

        let e = parse_devices("cuda:0").unwrap_err().to_string();
        assert!(e.contains("cuda:0=80GiB"), "{e}");
        let machine = MachineMemory {
            host_bytes: Some(64 * GIB),
            gpu_bytes: &|o| (o == 1).then_some(40 << 30),
        };
        let d = parse_devices_with("cuda:1", &machine).unwrap();
        assert_eq!((d[0].ordinal, d[0].capacity_bytes), (Some(1), 40 << 30));
        let d = parse_devices_with("cpu, cpu:0, cpu:1", &machine).unwrap();
        assert_eq!(d[0].capacity_bytes, 64 * GIB);
        assert_eq!(d[2].capacity_bytes, 32 * GIB);
        assert!(parse_devices("cpu").is_err());
        let d = parse_devices("cpu:0=8GiB,cpu:1=8GiB").unwrap();
        assert_eq!(d[1].name, "cpu:1");
        assert_eq!(d[1].capacity_bytes, 8 << 30);
        assert_eq!(parse_devices("cpu:24GiB").unwrap()[0].name, "CPU");
        assert!(matches!(parse_devices(" , "), Err(PlanError::NoDevices)));
        assert!(parse_devices("0x80GiB").is_err());
        assert!(parse_devices("tpu").is_err());
        let d = parse_devices("2xH100").unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].capacity_bytes, 81_559 * MIB);
        assert_eq!(
            parse_devices("a100-40gb").unwrap()[0].capacity_bytes,
            40 * GIB
        );
        let e = parse_devices("2xv100").unwrap_err().to_string();
        assert!(e.contains("h100-80gb"), "{e}");
    }
}
