//! A short catalogue of GPUs people rent or queue for, so a run can be planned
//! for a machine this one is not ("will DictaLM-7B fit on two H100s?").
//!
//! Every model has two figures: the memory as the vendor sells it ("80 GB") and
//! the total the driver reports (`nvidia-smi`, NVML's `memory.total`). The
//! planner uses the driver's figure: it is what a bare `cuda:N` is planned
//! against on the target machine, so a plan made here equals the plan made
//! there. Vendor figures are in decimal GB as the datasheets print them; the
//! driver's are MiB as `nvidia-smi` prints them.
//!
//! Sources of the driver figures (public `nvidia-smi` output; none was measured
//! by this project):
//! * H100 80GB HBM3, A100 80GB, A100 40GB, L40S, L4, T4: the totals Modal
//!   reports for its fleet, <https://github.com/modal-labs/modal-client/pull/2797>.
//!   H100 also in <https://github.com/NVIDIA/nccl/issues/1264> and
//!   <https://github.com/wilicc/gpu-burn/issues/114>.
//! * H200: `nvidia-smi -q` on an H200 SXM (driver 550.90.12), "FB Memory Usage:
//!   Total 143771 MiB", as quoted in public logs (many `nvidia-smi` tables of
//!   H200 machines show the same `143771MiB`).
//! * RTX 4090: 24564 MiB, e.g. <https://github.com/RLinf/RLinf/issues/255>.
//! * RTX A6000: 49140 MiB with ECC off (the workstation default), as in public
//!   `nvidia-smi` tables; with ECC on the driver reports less (how much was not
//!   verified, so it is not listed).
//!
//! ECC reserves memory: the L40S's 46068 MiB is with ECC on, its data-centre
//! default (public tables of its sibling L20 show 49140 MiB with ECC off and
//! 46068 MiB with it on). Each figure is for the card's default setting.

use super::device::format_bytes;

/// One GPU model of the catalogue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuModel {
    /// A short id for command lines: `h100-80gb`.
    pub id: &'static str,
    /// What people call it: `H100 80 GB`.
    pub name: &'static str,
    /// The memory as the vendor's datasheet states it, in (decimal) GB.
    pub vendor_gb: u32,
    /// The memory type as the datasheet names it (`HBM3`, `GDDR6`).
    pub memory_type: &'static str,
    /// The vendor's datasheet.
    pub datasheet: &'static str,
    /// Total memory as the driver reports it, in MiB (`nvidia-smi`'s figure).
    pub driver_mib: u64,
}

impl GpuModel {
    /// The memory the planner uses: the driver's total, in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.driver_mib << 20
    }

    /// The size as a run config writes it (`cuda:0=81559MiB`): the driver's
    /// figure exactly, so reading the config back finds this model again.
    pub fn size_text(&self) -> String {
        format!("{}MiB", self.driver_mib)
    }

    /// "80 GB HBM3 as sold; the driver reports 81559 MiB (79.6 GiB)".
    pub fn memory_summary(&self) -> String {
        format!(
            "{} GB {} as sold; the driver reports {} MiB ({})",
            self.vendor_gb,
            self.memory_type,
            self.driver_mib,
            format_bytes(self.capacity_bytes())
        )
    }
}

/// The catalogue, largest memory first.
pub const GPU_CATALOG: [GpuModel; 9] = [
    GpuModel {
        id: "h200",
        name: "H200 141 GB",
        vendor_gb: 141,
        memory_type: "HBM3e",
        // NVIDIA H200 product page: 141 GB HBM3e.
        datasheet: "https://www.nvidia.com/en-us/data-center/h200/",
        driver_mib: 143_771,
    },
    GpuModel {
        id: "h100-80gb",
        name: "H100 80 GB",
        vendor_gb: 80,
        memory_type: "HBM3",
        // NVIDIA H100 product page: 80 GB (SXM, HBM3). The driver figure is the SXM card's
        // ("NVIDIA H100 80GB HBM3"); the PCIe and NVL cards were not checked.
        datasheet: "https://www.nvidia.com/en-us/data-center/h100/",
        driver_mib: 81_559,
    },
    GpuModel {
        id: "a100-80gb",
        name: "A100 80 GB",
        vendor_gb: 80,
        memory_type: "HBM2e",
        // NVIDIA A100 datasheet: 80 GB HBM2e.
        datasheet: "https://www.nvidia.com/en-us/data-center/a100/",
        driver_mib: 81_920,
    },
    GpuModel {
        id: "a100-40gb",
        name: "A100 40 GB",
        vendor_gb: 40,
        memory_type: "HBM2",
        // NVIDIA A100 datasheet: 40 GB HBM2.
        datasheet: "https://www.nvidia.com/en-us/data-center/a100/",
        driver_mib: 40_960,
    },
    GpuModel {
        id: "a6000",
        name: "RTX A6000 48 GB",
        vendor_gb: 48,
        memory_type: "GDDR6",
        // NVIDIA RTX A6000 datasheet: 48 GB GDDR6 with ECC.
        datasheet: "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/",
        driver_mib: 49_140,
    },
    GpuModel {
        id: "l40s",
        name: "L40S 48 GB",
        vendor_gb: 48,
        memory_type: "GDDR6",
        // NVIDIA L40S datasheet: 48 GB GDDR6 with ECC.
        datasheet: "https://www.nvidia.com/en-us/data-center/l40s/",
        driver_mib: 46_068,
    },
    GpuModel {
        id: "rtx4090",
        name: "RTX 4090 24 GB",
        vendor_gb: 24,
        memory_type: "GDDR6X",
        // NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X.
        datasheet: "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/",
        driver_mib: 24_564,
    },
    GpuModel {
        id: "l4",
        name: "L4 24 GB",
        vendor_gb: 24,
        memory_type: "GDDR6",
        // NVIDIA L4 datasheet: 24 GB GDDR6.
        datasheet: "https://www.nvidia.com/en-us/data-center/l4/",
        driver_mib: 23_034,
    },
    GpuModel {
        id: "t4",
        name: "T4 16 GB",
        vendor_gb: 16,
        memory_type: "GDDR6",
        // NVIDIA T4 datasheet: 16 GB GDDR6.
        datasheet: "https://www.nvidia.com/en-us/data-center/tesla-t4/",
        driver_mib: 15_360,
    },
];

/// The catalogue model called `name`: its id (`h100-80gb`), or its name with or
/// without spaces (`H100 80 GB`, `h100`), case-insensitive. A bare family name
/// of at least 4 characters (`h100`, `a100`) matches the first — largest — model
/// of that family; shorter prefixes (`a`, `h1`) are too ambiguous to guess from.
pub fn find_gpu_model(name: &str) -> Option<&'static GpuModel> {
    let key = squash(name);
    if key.is_empty() {
        return None;
    }
    GPU_CATALOG
        .iter()
        .find(|m| squash(m.id) == key || squash(m.name) == key)
        .or_else(|| {
            if key.len() < 4 {
                return None;
            }
            GPU_CATALOG
                .iter()
                .find(|m| squash(m.id).starts_with(&key) || squash(m.name).starts_with(&key))
        })
}

/// The catalogue model whose config size text (`81559MiB`) is `size`, so a
/// config written from the catalogue reads back as the same model (a custom
/// `80GiB` stays custom even though the A100's 81920 MiB is the same size).
pub fn gpu_model_by_size_text(size: &str) -> Option<&'static GpuModel> {
    let size = size.trim();
    GPU_CATALOG
        .iter()
        .find(|m| m.size_text().eq_ignore_ascii_case(size))
}

/// Lower case without spaces, dashes or underscores.
fn squash(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_is_found_by_id_name_and_size() {
        for m in &GPU_CATALOG {
            assert_eq!(find_gpu_model(m.id), Some(m), "{}", m.id);
            assert_eq!(find_gpu_model(m.name), Some(m), "{}", m.name);
            assert_eq!(gpu_model_by_size_text(&m.size_text()), Some(m));
            // The driver's figure is within 10 % of the datasheet's (decimal) GB: a typo guard.
            let vendor = m.vendor_gb as f64 * 1e9;
            let driver = m.capacity_bytes() as f64;
            assert!(
                driver < vendor * 1.10 && driver > vendor * 0.90,
                "{}: {driver} vs {vendor}",
                m.name
            );
        }
    }

    #[test]
    fn lookups() {
        assert_eq!(find_gpu_model("H100").map(|m| m.id), Some("h100-80gb"));
        assert_eq!(find_gpu_model("a100").map(|m| m.id), Some("a100-80gb"));
        assert_eq!(find_gpu_model("A100 40GB").map(|m| m.id), Some("a100-40gb"));
        assert_eq!(find_gpu_model("rtx 4090").map(|m| m.id), Some("rtx4090"));
        assert!(find_gpu_model("").is_none());
        assert!(find_gpu_model("v100").is_none());
        assert!(find_gpu_model("a").is_none() && find_gpu_model("h1").is_none());
        assert_eq!(find_gpu_model("T4").map(|m| m.id), Some("t4"));
        let h100 = find_gpu_model("h100-80gb").unwrap();
        assert_eq!(h100.capacity_bytes(), 85_520_809_984);
        assert_eq!(h100.size_text(), "81559MiB");
        assert!(gpu_model_by_size_text("80GiB").is_none());
        assert!(h100.memory_summary().contains("81559 MiB (79.6 GiB)"));
    }
}
