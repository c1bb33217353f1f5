//! Planning for a machine this one is not: N GPUs of a catalogue model (or of a
//! custom size), kept in the run config as `cuda:N=SIZE` entries — the form the
//! CLI plans and the trainer runs (it ignores the size) — so a config prepared
//! on a laptop carries its target. Training is offered only on real devices.
//!
//! The config stays the single source of truth: a planned machine is read back
//! from its `[devices] devices` every frame; [`PlannerDraft`] only holds what the
//! user is typing and what to restore when switching back to this machine.

use tunestudio::devices::DeviceInventory;
use tunestudio::plan::{self, GpuModel};

use tunestudio::train::RunConfig;

/// What a planned machine's GPUs are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlannedGpu {
    /// A model of the catalogue.
    Catalog(&'static GpuModel),
    /// A size the user gave.
    Custom,
}

/// One `cuda:N=SIZE` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedEntry {
    /// `N`.
    pub ordinal: usize,
    /// `SIZE` as written.
    pub size_text: String,
    /// Its bytes.
    pub bytes: u64,
}

impl PlannedEntry {
    /// The catalogue model the size was written from, if any.
    pub fn model(&self) -> Option<&'static GpuModel> {
        plan::gpu_model_by_size_text(&self.size_text)
    }
}

/// A machine to plan for, read from the config's device entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedMachine {
    /// Its GPUs, in config order.
    pub gpus: Vec<PlannedEntry>,
}

impl PlannedMachine {
    /// The planned machine the entries describe: `Some` when there is at least one
    /// entry and every one is a GPU with a size (`cuda:0=80GiB`). A bare `cuda:0`
    /// or `cpu` is this machine's device.
    pub fn from_entries(entries: &[String]) -> Option<PlannedMachine> {
        let gpus = entries
            .iter()
            .map(|e| planned_entry(e))
            .collect::<Option<Vec<_>>>()?;
        (!gpus.is_empty()).then_some(PlannedMachine { gpus })
    }

    /// The entries of `count` GPUs of `size_text` each: `cuda:0=SIZE`, `cuda:1=SIZE`, ...
    pub fn entries(count: usize, size_text: &str) -> Vec<String> {
        (0..count.max(1))
            .map(|i| format!("cuda:{i}={size_text}"))
            .collect()
    }

    /// The GPUs' kind when they are all alike (same size text): the catalogue model or custom.
    pub fn uniform(&self) -> Option<PlannedGpu> {
        let first = self.gpus.first()?;
        if self.gpus.iter().any(|g| g.size_text != first.size_text) {
            return None;
        }
        Some(match first.model() {
            Some(m) => PlannedGpu::Catalog(m),
            None => PlannedGpu::Custom,
        })
    }

    /// "2 × H100 80 GB", "1 × 80.0 GiB", or "GPU 0 80.0 GiB + GPU 1 40.0 GiB".
    pub fn describe(&self) -> String {
        match (self.uniform(), self.gpus.first()) {
            (Some(PlannedGpu::Catalog(m)), _) => format!("{} × {}", self.gpus.len(), m.name),
            (Some(PlannedGpu::Custom), Some(g)) => {
                format!("{} × {} GPU", self.gpus.len(), plan::format_bytes(g.bytes))
            }
            _ => self
                .gpus
                .iter()
                .map(|g| format!("GPU {} {}", g.ordinal, plan::format_bytes(g.bytes)))
                .collect::<Vec<_>>()
                .join(" + "),
        }
    }

    /// Whether this machine's GPUs are the planned ones: each planned `cuda:N` exists
    /// and its total memory is within 2 % of the planned size (a custom `80GiB` is an
    /// H100's 81559 MiB; an H200 is not an H100). Then the config can train here.
    pub fn runs_on(&self, inventory: Option<&DeviceInventory>) -> bool {
        let Some(inv) = inventory else {
            return false;
        };
        self.gpus.iter().all(|g| {
            inv.gpu_capacity_bytes(g.ordinal).is_some_and(|real| {
                let (real, planned) = (real as f64, g.bytes as f64);
                (real - planned).abs() <= planned * 0.02
            })
        })
    }
}

/// `cuda:N=SIZE` (or `gpu:N=SIZE`, `cuda:N:SIZE`): the entry, when the size parses.
fn planned_entry(entry: &str) -> Option<PlannedEntry> {
    let lower = entry.trim().to_ascii_lowercase();
    let rest = lower
        .strip_prefix("cuda:")
        .or_else(|| lower.strip_prefix("gpu:"))?;
    let (ordinal, size) = rest.split_once(['=', ':'])?;
    let ordinal = ordinal.trim().parse().ok()?;
    // The size as the user wrote it (the config's case), for a faithful round trip.
    let size_text = entry.trim()[entry.trim().len() - size.len()..]
        .trim()
        .to_string();
    let bytes = plan::parse_bytes(&size_text).ok()?;
    Some(PlannedEntry {
        ordinal,
        size_text,
        bytes,
    })
}

/// What the GPUs & memory panel keeps while the user plans a machine.
#[derive(Debug, Clone)]
pub struct PlannerDraft {
    /// GPUs of the machine being planned (the last choice, restored when switching back).
    pub count: usize,
    /// The catalogue model chosen (`None`: a custom size).
    pub model: Option<&'static GpuModel>,
    /// The custom size as typed (`80GiB`).
    pub custom_size: String,
    /// This machine's devices before switching to a planned machine, restored after.
    pub real_selection: Option<Vec<String>>,
    /// The config's device entries the fields above were last synced with.
    pub synced_entries: Vec<String>,
    /// The user chose to keep planning for the config's machine although this one's
    /// GPUs differ (the question is not asked again for these entries).
    pub keep_planned_for: Option<Vec<String>>,
}

impl Default for PlannerDraft {
    fn default() -> Self {
        PlannerDraft {
            count: 1,
            model: plan::find_gpu_model("h100-80gb"),
            custom_size: "80GiB".into(),
            real_selection: None,
            synced_entries: Vec::new(),
            keep_planned_for: None,
        }
    }
}

impl PlannerDraft {
    /// The size text the draft plans each GPU with, or why it cannot.
    pub fn size_text(&self) -> Result<String, String> {
        match self.model {
            Some(m) => Ok(m.size_text()),
            None => {
                let text: String = self.custom_size.split_whitespace().collect();
                plan::parse_bytes(&text)
                    .map(|_| text)
                    .map_err(|e| e.to_string())
            }
        }
    }

    /// Takes the count, model and size from a planned machine read from the config
    /// (after loading a config or an edit elsewhere), once per change of the entries.
    pub fn sync_from(&mut self, entries: &[String]) {
        if self.synced_entries == entries {
            return;
        }
        self.synced_entries = entries.to_vec();
        let Some(m) = PlannedMachine::from_entries(entries) else {
            return;
        };
        self.count = m.gpus.len();
        match m.uniform() {
            Some(PlannedGpu::Catalog(model)) => self.model = Some(model),
            Some(PlannedGpu::Custom) => {
                self.model = None;
                self.custom_size = m.gpus[0].size_text.clone();
            }
            None => {}
        }
    }
}

/// The GPU counts offered.
pub const GPU_COUNTS: [usize; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

/// `Some(command)` when `config` plans for a machine this one (`inventory`) is not: training
/// is not offered here (Start is disabled) and `command` is what to run on the target, which
/// trains the config saved at `train_config_path`.
pub fn planning_only(
    config: &RunConfig,
    inventory: Option<&DeviceInventory>,
    train_config_path: &str,
) -> Option<String> {
    let m = PlannedMachine::from_entries(&config.devices.devices)?;
    if m.runs_on(inventory) {
        return None;
    }
    Some(super::panels::export::cli_command(train_config_path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn reads_planned_machines_from_entries() {
        let m = PlannedMachine::from_entries(&strings(&["cuda:0=81559MiB", "cuda:1=81559MiB"]))
            .expect("planned");
        assert_eq!(m.describe(), "2 × H100 80 GB");
        assert_eq!(m.gpus[1].ordinal, 1);
        assert_eq!(m.gpus[1].bytes, 81_559 << 20);

        let m = PlannedMachine::from_entries(&strings(&["cuda:0=80GiB"])).expect("planned");
        assert_eq!(m.uniform(), Some(PlannedGpu::Custom));
        assert_eq!(m.describe(), "1 × 80.0 GiB GPU");

        let m = PlannedMachine::from_entries(&strings(&["cuda:0=80GiB", "cuda:1=40GiB"]))
            .expect("planned");
        assert_eq!(m.uniform(), None);
        assert_eq!(m.describe(), "GPU 0 80.0 GiB + GPU 1 40.0 GiB");

        for real in [&["cpu"][..], &["cuda:0"], &["cuda:0=80GiB", "cuda:1"], &[]] {
            assert!(
                PlannedMachine::from_entries(&strings(real)).is_none(),
                "{real:?}"
            );
        }
        assert!(PlannedMachine::from_entries(&strings(&["cuda:0=lots"])).is_none());
    }

    #[test]
    fn entries_round_trip_through_the_draft() {
        let entries = PlannedMachine::entries(2, "81559MiB");
        assert_eq!(entries, strings(&["cuda:0=81559MiB", "cuda:1=81559MiB"]));
        let mut d = PlannerDraft::default();
        d.sync_from(&strings(&["cuda:0=40GiB", "cuda:1=40GiB", "cuda:2=40GiB"]));
        assert_eq!(
            (d.count, d.model, d.custom_size.as_str()),
            (3, None, "40GiB")
        );
        d.custom_size = "4O GiB".into();
        assert!(d.size_text().is_err());
        d.custom_size = "48 GiB".into();
        assert_eq!(d.size_text().as_deref(), Ok("48GiB"));
        d.sync_from(&PlannedMachine::entries(1, "143771MiB"));
        assert_eq!(d.model.map(|m| m.id), Some("h200"));
    }
}
