//! What the panels share read-only: the results of one panel's jobs that another panel
//! shows (the model, the dataset summary, the plan), the types the background jobs take and
//! answer with (an export's kind and progress, a past run), and the [`PanelContext`] through
//! which the app lends them for one frame. A panel never imports another panel's module, and
//! the jobs import none (`tests/it/layering.rs`).

use std::path::PathBuf;

use tunestudio::data::{Format, Lint};
use tunestudio::model::ModelConfig;
use tunestudio::plan::{DeviceSpec, Plan};
use tunestudio::train::{FinishReason, RunConfig, RunCurves};

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

/// What a panel reads of the other panels' results, lent by the app for one frame (filled as
/// the panel shown needs it; the rest is left empty).
#[derive(Default)]
pub struct PanelContext<'a> {
    /// The model loaded (Model panel).
    pub model: Option<&'a ModelInfo>,
    /// The dataset opened (Dataset panel).
    pub dataset: Option<&'a DatasetSummary>,
    /// The memory plan (GPUs & memory panel).
    pub plan: Option<&'a Plan>,
    /// Whether a run is loading, training or paused (Run panel).
    pub run_active: bool,
    /// `Some(command)` when the config plans for another machine (see
    /// [`crate::gui::planned::planning_only`]).
    pub planning_only: Option<String>,
    /// Where Export saves the config, which that command trains.
    pub train_config_path: String,
    /// The settings' findings for this model and data ([`crate::gui::follow::settings_lints`]).
    pub settings_lints: Vec<Lint>,
    /// The lints that stop a run (the data's and the settings', less `[data] allow`).
    pub blocking_lints: Vec<Lint>,
    /// The newest checkpoint of the live run (Playground).
    pub last_checkpoint: Option<PathBuf>,
}

/// What to export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportKind {
    /// The LoRA adapter (PEFT layout).
    Adapter,
    /// Base + adapter merged into a full HF model.
    Merged,
    /// The full fine-tuned model.
    Full,
    /// One GGUF file (adapter merged) for llama.cpp / Ollama, with a Modelfile.
    Gguf,
}

/// How far a GGUF export is: bytes written and the file's size, written by the export's
/// thread and read by the panel each frame (no message per tensor).
#[derive(Debug, Default)]
pub struct ExportProgressCell {
    /// Bytes written so far.
    pub done_bytes: std::sync::atomic::AtomicU64,
    /// The file's size (0 until the plan is known).
    pub total_bytes: std::sync::atomic::AtomicU64,
}

/// A past run read back from its output folder.
#[derive(Debug, Clone)]
pub struct HistoryRun {
    /// The output folder.
    pub dir: PathBuf,
    /// Its curves from `metrics.jsonl`.
    pub curves: RunCurves,
    /// How it ended, if it did.
    pub finished: Option<FinishReason>,
}

impl HistoryRun {
    /// The folder's name.
    pub fn name(&self) -> String {
        self.dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| self.dir.display().to_string())
    }
}
