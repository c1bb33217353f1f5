//! The studio's state: the run config being edited (the single source of
//! truth, saved as the TOML the CLI reads) and what the background jobs and
//! the trainer reported about it. Panels read and edit this; nothing here
//! draws or blocks.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use tunestudio::data::{DataPreview, Format};
use tunestudio::devices::DeviceInventory;
use tunestudio::model::ModelConfig;
use tunestudio::plan::{AutoFit, DeviceSpec, DryRunReport, Plan, PlanRequest};
use tunestudio::train::RunConfig;

use crate::gui::error::JobError;
pub use crate::gui::frame_stats::FrameStats;
pub use crate::gui::panels::export::{ExportKind, ExportProgressCell, ExportState};
pub use crate::gui::panels::run::{HistoryRun, HistoryState};
pub use crate::gui::run_state::{RunPhase, RunState};

/// The panels of the left navigation, in workflow order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Panel {
    /// Pick the base model.
    Model,
    /// Pick the data and its format.
    Dataset,
    /// See tokens, labels, stats and lints.
    Preview,
    /// Optimisation settings.
    Training,
    /// Devices and the memory plan.
    Devices,
    /// Train and watch.
    Run,
    /// Save adapters, models and the config.
    Export,
    /// Compare two models' answers side by side.
    Playground,
}

impl Panel {
    /// Every panel in navigation order.
    pub const ALL: [Panel; 8] = [
        Panel::Model,
        Panel::Dataset,
        Panel::Preview,
        Panel::Training,
        Panel::Devices,
        Panel::Run,
        Panel::Export,
        Panel::Playground,
    ];

    /// The navigation label.
    pub fn title(self) -> &'static str {
        match self {
            Panel::Model => "Model",
            Panel::Dataset => "Dataset",
            Panel::Preview => "Preview",
            Panel::Training => "Training",
            Panel::Devices => "GPUs & memory",
            Panel::Run => "Run",
            Panel::Export => "Export",
            Panel::Playground => "Playground",
        }
    }

    /// Parses the `TUNESTUDIO_SCREENSHOT_PANEL` / `--panel` spelling.
    pub fn from_name(name: &str) -> Option<Panel> {
        let n = name.trim().to_ascii_lowercase();
        Some(match n.as_str() {
            "model" => Panel::Model,
            "dataset" | "data" => Panel::Dataset,
            "preview" => Panel::Preview,
            "training" | "settings" => Panel::Training,
            "devices" | "gpus" | "memory" | "plan" => Panel::Devices,
            "run" => Panel::Run,
            "export" => Panel::Export,
            "playground" | "chat" | "generate" => Panel::Playground,
            _ => return None,
        })
    }
}

/// What survives a restart (eframe storage).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Model sources opened, newest first.
    pub recent_models: Vec<String>,
    /// Dataset paths opened, newest first.
    pub recent_datasets: Vec<String>,
    /// Run configs saved or opened, newest first.
    pub recent_configs: Vec<PathBuf>,
    /// The config open at exit, reopened at start.
    pub last_config: Option<PathBuf>,
    /// Output folders of runs, for the run history.
    pub run_dirs: Vec<PathBuf>,
    /// Exponential smoothing of the loss chart (0 = none).
    pub smoothing: f32,
    /// The panel open at exit.
    pub panel: Panel,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            recent_models: Vec::new(),
            recent_datasets: Vec::new(),
            recent_configs: Vec::new(),
            last_config: None,
            run_dirs: Vec::new(),
            smoothing: 0.6,
            panel: Panel::Preview,
        }
    }
}

/// The bundled demo config.
pub fn demo_config_path() -> PathBuf {
    tunestudio::paths::assets_dir().join("demo.toml")
}

/// Keeps a most-recent-first list of at most 10 unique entries.
pub fn push_recent<T: PartialEq + Clone>(list: &mut Vec<T>, item: T) {
    list.retain(|x| *x != item);
    list.insert(0, item);
    list.truncate(10);
}

/// What the Model panel shows about the resolved model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The source as typed (folder or hub id).
    pub source: String,
    /// The folder holding the files.
    pub dir: PathBuf,
    /// The parsed `config.json`.
    pub config: ModelConfig,
    /// `torch_dtype` / `dtype` of the checkpoint, when given.
    pub dtype: Option<String>,
    /// Parameters as transformers builds them.
    pub parameters: u64,
    /// Safetensors files (empty: no weights, random initialisation only).
    pub weight_files: Vec<PathBuf>,
    /// Their total size.
    pub weight_bytes: u64,
    /// Whether `tokenizer.json` is present.
    pub has_tokenizer: bool,
    /// Where the chat template comes from, if there is one.
    pub chat_template: Option<String>,
}

/// The Model panel.
#[derive(Debug, Default)]
pub struct ModelState {
    /// The text field (folder or hub id).
    pub source_input: String,
    /// The model last resolved.
    pub info: Option<ModelInfo>,
    /// A resolve in flight: when it started.
    pub loading: Option<Instant>,
    /// Bytes in the hub cache folder of the model being downloaded.
    pub download_bytes: Option<u64>,
    /// The last error.
    pub error: Option<JobError>,
    /// Hub models found in the local cache (usable offline).
    pub cached: Vec<String>,
    /// Request sequence number (latest wins).
    pub seq: u64,
}

/// What opening the dataset found.
#[derive(Debug, Clone)]
pub struct DatasetSummary {
    /// The data files read.
    pub files: Vec<String>,
    /// Rows in `data.path`.
    pub num_rows: usize,
    /// Training rows after the split.
    pub train_rows: usize,
    /// Validation rows (held out or separate).
    pub validation_rows: usize,
    /// The format detected from the first row.
    pub detected: Option<Format>,
    /// The preference-pair format of the first row, when it is a pair (then the preview shows
    /// pairs, as DPO and ORPO train them).
    pub preference: Option<tunestudio::data::preference::PreferenceFormat>,
    /// The first row's columns.
    pub columns: Vec<String>,
    /// The first row, pretty-printed and shortened.
    pub first_row: String,
}

/// The Dataset panel.
#[derive(Debug, Default)]
pub struct DatasetState {
    /// The text field (file, folder or hub id).
    pub path_input: String,
    /// The last summary.
    pub summary: Option<DatasetSummary>,
    /// The last error.
    pub error: Option<JobError>,
    /// Whether a scan is in flight.
    pub loading: bool,
    /// Request sequence number.
    pub seq: u64,
    /// The settings key of the last scan.
    pub key: String,
    /// A new dataset was chosen: take `max_length` from its lengths when its preview arrives.
    pub propose_max_length: bool,
}

/// The Preview panel.
#[derive(Debug, Default)]
pub struct PreviewState {
    /// First row shown (a batch of `micro_batch` rows starts here).
    pub start_row: usize,
    /// The last preview.
    pub preview: Option<DataPreview>,
    /// The last error.
    pub error: Option<JobError>,
    /// Whether a preview is being built.
    pub loading: bool,
    /// Request sequence number.
    pub seq: u64,
    /// The settings key of the last request.
    pub key: String,
    /// Row to highlight (jumped to from a lint).
    pub highlight: Option<usize>,
    /// The preview of preference pairs, when the data holds them (then `preview` is `None`).
    pub pairs: crate::gui::panels::preview::pairs::PairPreviewPanel,
}

/// Everything a memory plan depends on: the inputs of the one adapter
/// (`tunestudio::train::plan_request`): the run config, the loaded model and the devices,
/// plus what shapes the request from outside the run config. The plan is stale exactly when
/// the current key differs (`!=`) from the one it was made for. The key holds no disk facts:
/// the plan job derives the request from it on its own thread (see [`crate::gui::disk`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanKey {
    /// The run config as edited.
    pub config: RunConfig,
    /// The loaded model's shape.
    pub model: ModelConfig,
    /// The devices, or why there are none (no device selected, a device string that does
    /// not parse).
    pub devices: Result<Vec<DeviceSpec>, String>,
    /// The data's trained tokens, when the Preview's scan has them.
    pub trained_tokens: Option<tunestudio::plan::TrainedTokens>,
    /// How many devices discovery found (`None` before it answers): the selected devices are
    /// sized from it.
    pub inventory_devices: Option<usize>,
}

/// The memory plan for the current settings.
#[derive(Default)]
pub struct PlanState {
    /// The request planned.
    pub request: Option<PlanRequest>,
    /// The plan.
    pub plan: Option<Plan>,
    /// Why there is no plan.
    pub error: Option<JobError>,
    /// Whether a plan is being computed.
    pub loading: bool,
    /// Request sequence number.
    pub seq: u64,
    /// What the last request was made for ([`AppState::plan_key`]); `None` before the first.
    pub key: Option<PlanKey>,
    /// The last auto-fit, with the settings it started from.
    pub autofit: Option<AutoFit>,
    /// Auto-fit in flight.
    pub autofit_running: bool,
    /// The last auto-fit's explanation after it was applied.
    pub autofit_applied: Vec<String>,
    /// The last dry run.
    pub dry_run: Option<DryRunReport>,
    /// Dry run in flight.
    pub dry_run_running: bool,
}

/// The Devices panel.
#[derive(Debug, Default)]
pub struct DevicesState {
    /// What discovery found.
    pub inventory: Option<DeviceInventory>,
    /// Discovery in flight.
    pub loading: bool,
    /// The machine being planned when it is not this one (see [`crate::gui::planned`]).
    pub planner: crate::gui::planned::PlannerDraft,
}

/// Everything the panels share.
pub struct AppState {
    /// The run config being edited.
    pub config: RunConfig,
    /// Where it was loaded from / saved to.
    pub config_path: Option<PathBuf>,
    /// Problems of the config as loaded.
    pub config_problems: Vec<String>,
    /// The open panel.
    pub panel: Panel,
    /// Persisted settings.
    pub settings: Settings,
    /// Panels.
    pub model: ModelState,
    /// Dataset panel.
    pub dataset: DatasetState,
    /// Preview panel.
    pub preview: PreviewState,
    /// Memory plan.
    pub plan: PlanState,
    /// Devices.
    pub devices: DevicesState,
    /// The live run.
    pub run: RunState,
    /// Past runs.
    pub history: HistoryState,
    /// Export panel.
    pub export: ExportState,
    /// Playground panel.
    pub playground: crate::gui::playground::PlaygroundState,
    /// Frame-time statistics.
    pub frames: FrameStats,
    /// Show the frame-time debug line in the status bar.
    pub show_debug: bool,
    /// A transient message for the status bar.
    pub toast: Option<(String, Instant)>,
    /// The settings the studio fitted to the model and method ([`crate::gui::follow`]).
    pub follow: crate::gui::follow::FollowState,
    /// Whether the system file dialog can open (and why not): decided once at start.
    pub system_dialog: Result<(), String>,
    /// The in-app file picker, when open, and who asked for it.
    pub picker: Option<(PickFor, crate::gui::file_picker::FilePicker)>,
    /// The status bar said which file dialog is in use.
    pub picker_noted: bool,
    /// Screenshot mode printed it too.
    pub picker_noted_on_stderr: bool,
}

/// Who opened the in-app file picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickFor {
    /// A studio field.
    Studio(crate::gui::jobs::PickTarget),
    /// The Playground.
    Playground(crate::gui::playground::PgPick),
}

impl AppState {
    /// Opens the in-app picker for `who` (the system dialog is unavailable), saying once in
    /// the status bar why.
    pub fn open_picker(
        &mut self,
        who: PickFor,
        title: &str,
        kind: crate::gui::file_picker::PickKind,
        start: Option<PathBuf>,
    ) {
        if !self.picker_noted {
            self.picker_noted = true;
            let why = self.system_dialog.clone().err().unwrap_or_default();
            self.toast(format!("{why}: using the built-in file picker"));
        }
        let mut places = vec![("Run folder".to_string(), self.output_dir())];
        if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
            places.push(("Home".into(), home));
        }
        places.push((
            "HF cache".into(),
            tunestudio::model::HubOptions::from_env().cache_dir,
        ));
        places.push(("Project".into(), self.config.base_dir.clone()));
        let picker = crate::gui::file_picker::FilePicker::new(title, kind, start, places);
        self.picker = Some((who, picker));
    }

    /// A fresh state editing `config`.
    pub fn new(config: RunConfig, config_path: Option<PathBuf>, settings: Settings) -> Self {
        let mut s = AppState {
            panel: settings.panel,
            config,
            config_path,
            config_problems: Vec::new(),
            settings,
            model: ModelState::default(),
            dataset: DatasetState::default(),
            preview: PreviewState::default(),
            plan: PlanState::default(),
            devices: DevicesState::default(),
            run: RunState::default(),
            history: HistoryState::default(),
            export: ExportState::default(),
            playground: Default::default(),
            frames: FrameStats::default(),
            system_dialog: Ok(()),
            picker: None,
            picker_noted: false,
            picker_noted_on_stderr: false,
            show_debug: true,
            toast: None,
            follow: Default::default(),
        };
        s.follow = crate::gui::follow::FollowState::loaded(&s.config, s.demo_fitting());
        s.sync_inputs_from_config();
        s
    }

    /// Copies the config's paths into the text fields (after loading a config).
    pub fn sync_inputs_from_config(&mut self) {
        self.model.source_input = self.config.model.source.clone();
        self.dataset.path_input = self.config.data.path.clone();
        // Never offer to overwrite the bundled demo: its copy goes to <output>/run.toml.
        self.export.config_path = match &self.config_path {
            Some(p) if *p != demo_config_path() => p.display().to_string(),
            _ => self.default_config_path().display().to_string(),
        };
        self.export.kind = if self.config.lora.enabled {
            ExportKind::Adapter
        } else {
            ExportKind::Full
        };
        self.export.checkpoint.clear();
        self.export.destination.clear();
        self.preview.start_row = 0;
        self.preview.highlight = None;
    }

    /// Replaces the config (loaded from a file or the demo).
    pub fn set_config(&mut self, config: RunConfig, path: Option<PathBuf>) {
        self.config = config;
        self.config_path = path;
        self.follow = crate::gui::follow::FollowState::loaded(&self.config, self.demo_fitting());
        self.config_problems.clear();
        self.plan.autofit = None;
        self.plan.autofit_applied.clear();
        self.plan.dry_run = None;
        self.sync_inputs_from_config();
    }

    /// What the loaded config's settings suit: the bundled demo's a random model's full
    /// fine-tuning; a user's own config is adopted as it is (`None`).
    fn demo_fitting(&self) -> Option<(bool, bool)> {
        (self.config_path.as_deref() == Some(demo_config_path().as_path()))
            .then_some((false, false))
    }

    /// Shows a transient message in the status bar.
    pub fn toast(&mut self, text: impl Into<String>) {
        self.toast = Some((text.into(), Instant::now()));
    }

    /// Key of everything the preview depends on: the settings as written, with the folder
    /// they are relative to. No disk is read here (the job resolves the paths).
    pub fn preview_key(&self) -> String {
        format!(
            "{}|{}|{:?}|{}|{}|{:?}",
            self.config.base_dir.display(),
            self.config.model.source.trim(),
            self.config.data,
            self.config.training.micro_batch,
            self.preview.start_row,
            self.config.preference.limits(),
        )
    }

    /// Key of everything the dataset summary depends on (as written; the job resolves it).
    pub fn dataset_key(&self) -> String {
        let d = &self.config.data;
        format!(
            "{}|{}|{:?}|{:?}|{}|{}",
            self.config.base_dir.display(),
            d.path,
            d.validation_path,
            d.columns,
            d.validation_ratio,
            d.seed
        )
    }

    /// Key of everything the plan depends on (`None` until a model is loaded): the adapter's
    /// inputs, compared with `==`. It reads no disk: the plan job derives the request
    /// (`tunestudio::train::plan_request`, which measures the model's and data's files) on
    /// its own thread.
    pub fn plan_key(&self) -> Option<PlanKey> {
        let model = self.model.info.as_ref()?.config.clone();
        Some(PlanKey {
            config: self.config.clone(),
            model,
            devices: self.device_specs(),
            trained_tokens: self.trained_tokens(),
            inventory_devices: self.devices.inventory.as_ref().map(|i| i.devices.len()),
        })
    }

    /// The trained tokens of the dataset, from the Preview's full scan of the training split:
    /// the plan's loss rows. `None` while a scan is missing, partial or running, and with
    /// packing (the scan's samples are not packed).
    pub fn trained_tokens(&self) -> Option<tunestudio::plan::TrainedTokens> {
        // A preference step's rows are a pair's prompt and completions, not the SFT samples
        // the scan counted: the pair preview's scan gives the longest pair.
        if self.config.training.method.is_preference() {
            return self.preview.pairs.trained_tokens(&self.config);
        }
        let p = self.preview.preview.as_ref()?;
        let data = &self.config.data;
        if !p.full_scan || self.preview.loading || data.packing || p.max_length != data.max_length {
            return None;
        }
        Some(tunestudio::plan::TrainedTokens::from_counts(
            p.max_length,
            p.stats.longest_kept_tokens,
            p.stats.trained_tokens_largest_first.iter().copied(),
        ))
    }

    /// The devices the plan runs on: the selected ones, sized from discovery.
    pub fn device_specs(&self) -> Result<Vec<DeviceSpec>, String> {
        let labels = &self.config.devices.devices;
        if labels.is_empty() {
            return Err("no device selected: tick at least one device in GPUs & memory".into());
        }
        let mut out = Vec::new();
        for label in labels {
            let label = label.trim();
            if let Some(inv) = &self.devices.inventory {
                if label == "cpu" {
                    if let Some(cpu) = inv.cpu() {
                        out.push(DeviceSpec::cpu(cpu.total_bytes));
                        continue;
                    }
                }
                if let Some(n) = label
                    .strip_prefix("cuda:")
                    .and_then(|n| n.parse::<usize>().ok())
                {
                    let gpu = inv
                        .gpu_by_cuda_ordinal(n)
                        .or_else(|| inv.gpus().find(|g| g.index == n));
                    if let Some(g) = gpu {
                        let cap = g.total_bytes.saturating_sub(g.other_processes_bytes());
                        let mut spec = DeviceSpec::cuda(n, cap);
                        spec.name = format!("GPU {n}");
                        out.push(spec);
                        continue;
                    }
                }
            }
            match tunestudio::devices::parse_local_devices(label) {
                Ok(mut d) => out.append(&mut d),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(out)
    }

    /// The output folder, resolved.
    pub fn output_dir(&self) -> PathBuf {
        self.config.output_path()
    }

    /// A path for the config when none was chosen: `<output>/run.toml`.
    pub fn default_config_path(&self) -> PathBuf {
        self.output_dir().join("run.toml")
    }
}

/// The folder a path-like string points into, for file dialogs.
pub fn dialog_dir(text: &str, base: &Path) -> Option<PathBuf> {
    let p = Path::new(text);
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    };
    if p.is_dir() {
        Some(p)
    } else {
        p.parent().filter(|d| d.is_dir()).map(Path::to_path_buf)
    }
}

#[cfg(test)]
mod tests;
