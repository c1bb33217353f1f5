//! The studio's state: the run config being edited (the single source of
//! truth, saved as the TOML the CLI reads) and what the background jobs and
//! the trainer reported about it. Panels read and edit this; nothing here
//! draws or blocks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use tunestudio::data::{DataPreview, Format};
use tunestudio::devices::DeviceInventory;
use tunestudio::model::ModelConfig;
use tunestudio::plan::{AutoFit, DeviceSpec, DryRunReport, Plan, PlanRequest};
use tunestudio::train::{Event, FinishReason, RunConfig, RunCurves, TrainerHandle};

use crate::gui::error::{ErrorKind, JobError};

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
    pub pairs: crate::gui::panels::pairs::PairPreviewPanel,
}

/// Everything a memory plan depends on: the planner's request, as the one adapter
/// (`tunestudio::train::plan_request`) derives it from the run config, the loaded model and
/// the devices, plus what shapes the request from outside the run config. The plan is stale
/// exactly when the current key differs (`!=`) from the one it was made for: a new setting
/// the planner reads reaches the key through the adapter, with no edit here.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanKey {
    /// The request, or why there is none (no device selected, a device string that does
    /// not parse).
    pub request: Result<PlanRequest, String>,
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

/// Where the current run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunPhase {
    /// No run yet.
    Idle,
    /// Loading the model and data.
    Loading,
    /// Training.
    Running,
    /// Paused between steps.
    Paused,
    /// Over.
    Finished(FinishReason),
}

/// One line of the run log.
#[derive(Debug, Clone)]
pub struct LogLine {
    /// Seconds since the run started.
    pub secs: f64,
    /// info / warning / error.
    pub level: LogLevel,
    /// The text.
    pub text: String,
}

/// Severity of a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// Progress.
    Info,
    /// Worth knowing.
    Warning,
    /// Stopped the run.
    Error,
}

/// Memory of one device over the run.
#[derive(Debug, Clone, Default)]
pub struct MemorySeries {
    /// (step, GiB in use).
    pub used: Vec<[f64; 2]>,
    /// Peak bytes so far.
    pub peak_bytes: u64,
    /// Capacity, when known.
    pub total_bytes: Option<u64>,
    /// The plan's predicted peak for this device.
    pub predicted_peak_bytes: Option<u64>,
    /// Whose memory the line shows (a GPU without per-process figures shows the device's).
    pub scope: tunestudio::train::MemoryScope,
}

/// The error that ended a run, with what to do about it.
#[derive(Debug, Clone)]
pub struct RunError {
    /// What happened.
    pub message: String,
    /// The trainer's hint.
    pub hint: String,
    /// What kind of error (out of memory: fixes from the planner apply).
    pub kind: ErrorKind,
    /// The step, when known.
    pub step: Option<u64>,
}

impl RunError {
    /// Whether a device ran out of memory (the trainer said so with its `out_of_memory`
    /// event).
    pub fn is_out_of_memory(&self) -> bool {
        self.kind == ErrorKind::OutOfMemory
    }
}

/// The live run.
pub struct RunState {
    /// The trainer thread.
    pub handle: Option<TrainerHandle>,
    /// Error-level lints this run trains despite (the config's `[data] allow`).
    pub allowed_lints: Vec<tunestudio::train::LintFinding>,
    /// Start found another run in the output folder: what is there (the Run panel asks).
    pub existing_run: Option<String>,
    /// After running out of memory with a checkpoint: the fitted settings a resume would use.
    pub oom_refit: Option<Vec<String>>,
    /// Where it is.
    pub phase: RunPhase,
    /// Latest status text.
    pub status: String,
    /// Steps of the whole run.
    pub total_steps: u64,
    /// Steps done.
    pub step: u64,
    /// Steps done before this session (resumed runs).
    pub start_step: u64,
    /// Epoch reached.
    pub epoch: f64,
    /// (step, loss).
    pub loss: Vec<[f64; 2]>,
    /// (step, eval loss).
    pub eval_loss: Vec<[f64; 2]>,
    /// `[step, loss]` of every divergence the watch reported (markers on the loss chart).
    pub divergences: Vec<[f64; 2]>,
    /// A tenth of the learning rate at the last divergence (the "resume with lr ÷ 10" offer).
    pub suggested_learning_rate: Option<f64>,
    /// (step, learning rate).
    pub lr: Vec<[f64; 2]>,
    /// Trained tokens per second of the last step.
    pub tokens_per_sec: f64,
    /// Training seconds so far.
    pub elapsed_secs: f64,
    /// Label tokens trained.
    pub trained_tokens: u64,
    /// Memory per device name (`cpu`, `cuda:0`).
    pub memory: BTreeMap<String, MemorySeries>,
    /// The log.
    pub log: Vec<LogLine>,
    /// The error that ended it.
    pub error: Option<RunError>,
    /// When Start was pressed.
    pub started_at: Option<Instant>,
    /// The output folder.
    pub output_dir: Option<PathBuf>,
    /// The last checkpoint written.
    pub last_checkpoint: Option<PathBuf>,
    /// Parameters / trainable parameters.
    pub parameters: Option<(u64, u64)>,
    /// Every event received (for tests and the history).
    pub events_received: usize,
    /// The trainer reported running out of memory (the error that follows is of that kind).
    pub out_of_memory_reported: bool,
}

impl Default for RunState {
    fn default() -> Self {
        RunState {
            handle: None,
            allowed_lints: Vec::new(),
            existing_run: None,
            oom_refit: None,
            phase: RunPhase::Idle,
            status: String::new(),
            total_steps: 0,
            step: 0,
            start_step: 0,
            epoch: 0.0,
            loss: Vec::new(),
            eval_loss: Vec::new(),
            divergences: Vec::new(),
            suggested_learning_rate: None,
            lr: Vec::new(),
            tokens_per_sec: 0.0,
            elapsed_secs: 0.0,
            trained_tokens: 0,
            memory: BTreeMap::new(),
            log: Vec::new(),
            error: None,
            started_at: None,
            output_dir: None,
            last_checkpoint: None,
            parameters: None,
            events_received: 0,
            out_of_memory_reported: false,
        }
    }
}

impl RunState {
    /// Whether a trainer thread is alive (loading, running or paused).
    pub fn is_active(&self) -> bool {
        matches!(
            self.phase,
            RunPhase::Loading | RunPhase::Running | RunPhase::Paused
        )
    }

    /// Seconds left at the current pace, when it can be told.
    pub fn eta_secs(&self) -> Option<f64> {
        let done = self.step.saturating_sub(self.start_step);
        if done == 0 || self.total_steps <= self.step || self.elapsed_secs <= 0.0 {
            return None;
        }
        let per_step = self.elapsed_secs / done as f64;
        Some(per_step * (self.total_steps - self.step) as f64)
    }

    /// Fraction of the steps done.
    pub fn progress(&self) -> f32 {
        if self.total_steps == 0 {
            0.0
        } else {
            (self.step as f32 / self.total_steps as f32).clamp(0.0, 1.0)
        }
    }

    fn log(&mut self, level: LogLevel, text: String) {
        let secs = self.started_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.log.push(LogLine { secs, level, text });
    }

    /// Folds one trainer event into the state.
    pub fn apply(&mut self, event: Event) {
        self.events_received += 1;
        match event {
            Event::Status { message } => {
                self.status = message.clone();
                self.log(LogLevel::Info, message);
            }
            Event::Step {
                step,
                loss,
                lr,
                tokens_per_sec,
                trained_tokens,
                elapsed_secs,
                epoch,
                skipped,
                ..
            } => {
                self.step = step;
                if loss.is_finite() {
                    self.loss.push([step as f64, loss]);
                }
                self.lr.push([step as f64, lr]);
                if tokens_per_sec.is_finite() {
                    self.tokens_per_sec = tokens_per_sec;
                }
                self.trained_tokens = trained_tokens;
                self.elapsed_secs = elapsed_secs;
                self.epoch = epoch;
                if skipped {
                    self.log(
                        LogLevel::Warning,
                        format!("step {step}: gradients overflowed in fp16; update skipped, loss scale lowered"),
                    );
                }
            }
            Event::Eval {
                step,
                loss,
                perplexity,
                ..
            } => {
                if loss.is_finite() {
                    self.eval_loss.push([step as f64, loss]);
                }
                self.log(
                    LogLevel::Info,
                    format!("eval at step {step}: loss {loss:.4}, perplexity {perplexity:.2}"),
                );
            }
            ev @ Event::Memory { .. } => self.apply_memory(ev),
            Event::CheckpointSaved { step, path } => {
                self.log(
                    LogLevel::Info,
                    format!("checkpoint at step {step}: {}", path.display()),
                );
                self.last_checkpoint = Some(path);
            }
            Event::Paused { step } => {
                self.phase = RunPhase::Paused;
                self.status = format!("paused after step {step}");
                self.log(LogLevel::Info, format!("paused after step {step}"));
            }
            Event::Resumed { step } => {
                self.phase = RunPhase::Running;
                self.status = "training".into();
                self.log(LogLevel::Info, format!("resumed at step {step}"));
            }
            Event::Warning { message } => self.log(LogLevel::Warning, message),
            ev @ Event::Divergence { .. } => self.apply_divergence(ev),
            Event::LintsBlocked { lints } => {
                for l in lints {
                    self.log(
                        LogLevel::Error,
                        format!(
                            "blocked by lint `{}` ({} rows): {}",
                            l.lint, l.count, l.message
                        ),
                    );
                }
            }
            Event::LintAllowed { lint } => {
                self.log(
                    LogLevel::Warning,
                    format!(
                        "training despite lint `{}` ({} rows), allowed by [data] allow: {}",
                        lint.lint, lint.count, lint.message
                    ),
                );
                self.allowed_lints.push(lint);
            }
            ev @ (Event::Started { .. } | Event::Finished { .. }) => self.apply_start_or_end(ev),
            ev @ (Event::OutOfMemory { .. } | Event::Error { .. }) => self.apply_failure(ev),
        }
    }

    /// A memory sample of one device.
    fn apply_memory(&mut self, event: Event) {
        let Event::Memory {
            device,
            used_bytes,
            peak_bytes,
            total_bytes,
            step,
            scope,
        } = event
        else {
            return;
        };
        let series = self.memory.entry(device).or_default();
        series.scope = scope;
        series
            .used
            .push([step as f64, crate::gui::theme::gib(used_bytes)]);
        series.peak_bytes = series.peak_bytes.max(peak_bytes);
        if total_bytes.is_some() {
            series.total_bytes = total_bytes;
        }
    }

    /// The run started or ended.
    fn apply_start_or_end(&mut self, event: Event) {
        match event {
            Event::Started {
                total_steps,
                start_step,
                resumed_from,
                num_parameters,
                trainable_parameters,
                train_rows,
                eval_rows,
                output_dir,
                ..
            } => {
                self.phase = RunPhase::Running;
                self.total_steps = total_steps;
                self.start_step = start_step;
                self.step = start_step;
                self.parameters = Some((num_parameters, trainable_parameters));
                self.status = "training".into();
                let resumed = resumed_from
                    .map(|p| format!(", resumed from {}", p.display()))
                    .unwrap_or_default();
                self.log(
                    LogLevel::Info,
                    format!(
                        "started: {total_steps} steps, {train_rows} training rows, {eval_rows} validation rows, \
                         {} of {} parameters trained{resumed}; writing to {}",
                        crate::gui::theme::count(trainable_parameters),
                        crate::gui::theme::count(num_parameters),
                        output_dir.display()
                    ),
                );
                self.output_dir = Some(output_dir);
            }
            Event::Finished {
                reason,
                step,
                final_loss,
                final_eval_loss,
                elapsed_secs,
                last_checkpoint,
            } => {
                self.phase = RunPhase::Finished(reason);
                self.step = self.step.max(step);
                if elapsed_secs > 0.0 {
                    self.elapsed_secs = elapsed_secs;
                }
                if last_checkpoint.is_some() {
                    self.last_checkpoint = last_checkpoint;
                }
                let what = match reason {
                    FinishReason::Completed => "completed",
                    FinishReason::Stopped => "stopped",
                    FinishReason::Failed => "failed",
                    FinishReason::Diverged => "stopped: the loss diverged",
                };
                let fl = final_loss
                    .map(|l| format!(", loss {l:.4}"))
                    .unwrap_or_default();
                let fe = final_eval_loss
                    .map(|l| format!(", eval loss {l:.4}"))
                    .unwrap_or_default();
                self.status = format!("{what} at step {step}");
                self.log(
                    if reason == FinishReason::Failed {
                        LogLevel::Error
                    } else {
                        LogLevel::Info
                    },
                    format!("{what} at step {step}{fl}{fe}"),
                );
            }
            _ => {}
        }
    }

    /// The divergence watch saw a spike: a marker on the loss chart, the rate to resume with.
    fn apply_divergence(&mut self, event: Event) {
        let Event::Divergence {
            step,
            loss,
            median_loss,
            suggested_learning_rate,
            stopped,
        } = event
        else {
            return;
        };
        self.divergences.push([step as f64, loss]);
        self.suggested_learning_rate = Some(suggested_learning_rate);
        self.log(
            LogLevel::Warning,
            format!(
                "the loss diverged at step {step}: {loss:.4} against a recent median of {median_loss:.4}{}; resume with learning rate {suggested_learning_rate:e}",
                if stopped { ", so the run stopped" } else { "" }
            ),
        );
    }

    /// The run failed (out of memory first, when it was that).
    fn apply_failure(&mut self, event: Event) {
        match event {
            Event::OutOfMemory {
                step,
                phase,
                device,
                planned_bytes,
                observed_bytes,
                checkpoint,
                refit,
                refit_error,
                ..
            } => {
                let saved = checkpoint
                    .as_ref()
                    .map_or("no checkpoint yet".to_string(), |p| {
                        format!("checkpoint {}", p.display())
                    });
                self.log(
                    LogLevel::Error,
                    format!(
                        "{device} ran out of memory at step {step} ({phase}{}); {saved}",
                        tunestudio::train::oom::planned_and_observed(planned_bytes, observed_bytes)
                    ),
                );
                self.out_of_memory_reported = true;
                self.oom_refit = if checkpoint.is_some() && refit_error.is_none() {
                    Some(refit)
                } else {
                    None
                };
                if let Some(e) = refit_error {
                    self.log(LogLevel::Warning, e);
                }
            }
            Event::Error {
                message,
                hint,
                step,
                ..
            } => {
                // The kind comes from the trainer's own `out_of_memory` event, not the words;
                // the hint is said once even when the message already ends with it.
                let kind = if self.out_of_memory_reported {
                    ErrorKind::OutOfMemory
                } else {
                    ErrorKind::Other
                };
                let e = JobError::new(kind, message, Some(hint));
                let hint = e.hint.unwrap_or_default();
                self.log(LogLevel::Error, format!("{} — {hint}", e.message));
                self.error = Some(RunError {
                    message: e.message,
                    hint,
                    kind,
                    step,
                });
            }
            _ => {}
        }
    }
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

/// The run history.
#[derive(Debug, Default)]
pub struct HistoryState {
    /// Runs found.
    pub runs: Vec<HistoryRun>,
    /// Runs overlaid on the loss chart (indices into `runs`).
    pub overlay: Vec<usize>,
    /// Scan in flight.
    pub loading: bool,
    /// Problems reading runs.
    pub error: Option<String>,
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

/// Export dtype choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

impl ExportDtype {
    /// The candle dtype.
    pub fn to_dtype(self) -> candle_core::DType {
        match self {
            ExportDtype::F32 => candle_core::DType::F32,
            ExportDtype::Bf16 => candle_core::DType::BF16,
            ExportDtype::F16 => candle_core::DType::F16,
        }
    }
}

/// The Export panel.
#[derive(Debug)]
pub struct ExportState {
    /// What to export.
    pub kind: ExportKind,
    /// Weights dtype of merged/full exports.
    pub dtype: ExportDtype,
    /// The GGUF file type.
    pub gguf_quant: tunestudio::gguf::GgufQuant,
    /// Overwrite an existing GGUF file.
    pub replace: bool,
    /// Progress of the GGUF export in flight.
    pub progress: std::sync::Arc<ExportProgressCell>,
    /// The checkpoint to export (defaults to the run's last).
    pub checkpoint: String,
    /// Destination folder.
    pub destination: String,
    /// Export in flight.
    pub running: bool,
    /// The last export's result.
    pub result: Option<Result<PathBuf, JobError>>,
    /// Where the run config is saved.
    pub config_path: String,
    /// The last save/load message.
    pub config_message: Option<Result<String, String>>,
}

impl Default for ExportState {
    fn default() -> Self {
        ExportState {
            kind: ExportKind::Adapter,
            dtype: ExportDtype::Bf16,
            gguf_quant: tunestudio::gguf::GgufQuant::Q4KM,
            replace: false,
            progress: Default::default(),
            checkpoint: String::new(),
            destination: String::new(),
            running: false,
            result: None,
            config_path: String::new(),
            config_message: None,
        }
    }
}

/// A rolling window of frame times (the UI code's own time per frame).
#[derive(Debug, Clone)]
pub struct FrameStats {
    samples_ms: Vec<f32>,
    next: usize,
    /// Frames measured since start.
    pub frames: u64,
}

impl Default for FrameStats {
    fn default() -> Self {
        FrameStats {
            samples_ms: Vec::with_capacity(240),
            next: 0,
            frames: 0,
        }
    }
}

impl FrameStats {
    const WINDOW: usize = 240;

    /// Records one frame.
    pub fn record(&mut self, ms: f32) {
        if self.samples_ms.len() < Self::WINDOW {
            self.samples_ms.push(ms);
        } else {
            self.samples_ms[self.next] = ms;
        }
        self.next = (self.next + 1) % Self::WINDOW;
        self.frames += 1;
    }

    /// Mean frame time in the window.
    pub fn mean_ms(&self) -> f32 {
        if self.samples_ms.is_empty() {
            0.0
        } else {
            self.samples_ms.iter().sum::<f32>() / self.samples_ms.len() as f32
        }
    }

    /// The 95th percentile in the window.
    pub fn p95_ms(&self) -> f32 {
        self.percentile(0.95)
    }

    /// The longest frame in the window.
    pub fn max_ms(&self) -> f32 {
        self.samples_ms.iter().copied().fold(0.0, f32::max)
    }

    fn percentile(&self, q: f32) -> f32 {
        if self.samples_ms.is_empty() {
            return 0.0;
        }
        let mut v = self.samples_ms.clone();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let i = ((v.len() - 1) as f32 * q).round() as usize;
        v[i.min(v.len() - 1)]
    }

    /// "frame 1.2 ms avg · 2.5 ms p95 · 4.0 ms max (240 frames)".
    pub fn summary(&self) -> String {
        format!(
            "frame {:.2} ms avg · {:.2} ms p95 · {:.2} ms max ({} frames)",
            self.mean_ms(),
            self.p95_ms(),
            self.max_ms(),
            self.frames
        )
    }
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

    /// The model source resolved against the config's folder.
    pub fn model_source(&self) -> String {
        // A config.json file is a valid (plan-only) source here, which the library's
        // folder-or-hub-id resolution does not cover.
        let src = self.config.model.source.trim();
        let candidate = self.config.resolve_path(Path::new(src));
        if !src.is_empty() && candidate.is_file() {
            return candidate.display().to_string();
        }
        self.config.model_source()
    }

    /// Key of everything the preview depends on.
    pub fn preview_key(&self) -> String {
        format!(
            "{}|{:?}|{}|{}|{:?}",
            self.model_source(),
            self.config.resolved_data(),
            self.config.training.micro_batch,
            self.preview.start_row,
            self.config.preference.limits(),
        )
    }

    /// Key of everything the dataset summary depends on.
    pub fn dataset_key(&self) -> String {
        let d = self.config.resolved_data();
        format!(
            "{}|{:?}|{:?}|{}|{}",
            d.path, d.validation_path, d.columns, d.validation_ratio, d.seed
        )
    }

    /// Key of everything the plan depends on (`None` until a model is loaded).
    pub fn plan_key(&self) -> Option<PlanKey> {
        let model = &self.model.info.as_ref()?.config;
        let request = self.device_specs().and_then(|devices| {
            super::jobs::plan_request(model, &self.config, devices, self.trained_tokens())
        });
        Some(PlanKey {
            request,
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
            match tunestudio::plan::parse_devices(label) {
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
mod tests {
    use super::*;

    #[test]
    fn frame_stats_roll_over_the_window() {
        let mut f = FrameStats::default();
        for i in 0..500 {
            f.record(if i % 100 == 0 { 20.0 } else { 1.0 });
        }
        assert_eq!(f.frames, 500);
        assert!(f.mean_ms() > 1.0 && f.mean_ms() < 2.0, "{}", f.mean_ms());
        assert_eq!(f.max_ms(), 20.0);
        assert_eq!(f.p95_ms(), 1.0);
    }

    #[test]
    fn run_state_folds_events() {
        let mut r = RunState::default();
        r.apply(Event::Step {
            step: 1,
            loss: 2.5,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens_per_sec: 100.0,
            trained_tokens: 10,
            elapsed_secs: 1.0,
            epoch: 0.1,
            skipped: false,
            loss_scale: None,
            metrics: Default::default(),
        });
        // Words alone do not make an out-of-memory error: the trainer's event does.
        r.apply(Event::Error {
            message: "the note says out of memory\nhint: lower the micro-batch".into(),
            hint: "lower the micro-batch".into(),
            phase: None,
            step: Some(2),
        });
        let e = r.error.clone().expect("error");
        assert!(!e.is_out_of_memory());
        // The hint is said once.
        assert_eq!(e.message, "the note says out of memory");
        assert_eq!(
            r.log.last().map(|l| l.text.matches("lower the").count()),
            Some(1)
        );
        r.apply(Event::OutOfMemory {
            step: 2,
            phase: tunestudio::train::Phase::Forward,
            device: "cuda:0".into(),
            planned_bytes: None,
            observed_bytes: None,
            failure: None,
            checkpoint: None,
            refit: Vec::new(),
            refit_error: None,
        });
        r.apply(Event::Error {
            message: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            hint: "lower the micro-batch".into(),
            phase: None,
            step: Some(2),
        });
        assert_eq!(r.loss, vec![[1.0, 2.5]]);
        assert!(r.error.as_ref().is_some_and(|e| e.is_out_of_memory()));
        r.total_steps = 10;
        assert!(r.eta_secs().is_some());
    }

    #[test]
    fn recent_lists_stay_unique_and_short() {
        let mut v = Vec::new();
        for i in 0..15 {
            push_recent(&mut v, i % 12);
        }
        push_recent(&mut v, 3);
        assert_eq!(v[0], 3);
        assert_eq!(v.len(), 10);
        assert_eq!(v.iter().filter(|&&x| x == 3).count(), 1);
    }
}
