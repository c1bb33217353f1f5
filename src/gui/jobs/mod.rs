//! Background work: every slow call into the library (resolving and
//! downloading models, reading datasets, tokenising the preview, planning,
//! dry runs, exports, reading run history, opening and saving the run config, the in-app
//! file picker's folder listings, Start's look for another run in the output folder, a new
//! project's output folder, the out-of-memory refit) runs on its own thread and reports
//! one [`JobOutput`] over a channel; the thread wakes the UI with
//! `request_repaint`. The UI thread never waits on any of it.
//!
//! Requests carry a sequence number; the app keeps only the answer to the
//! latest request of each kind, so a slow answer to stale settings is dropped.
//!
//! The Playground's work (loads, dialogs, prompt lists, generations) runs here too, so
//! [`Jobs::in_flight`] counts everything the studio has running. Errors cross this edge as
//! [`JobError`]s: a kind, the message and the hint.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::{Receiver, Sender};
use eframe::egui;

use tunestudio::data::preference::{self as pref, PairLimits, PreferencePreview};
use tunestudio::data::{
    self, DataConfig, DataPreview, PreviewOptions, RowSelection, TokenizerBundle,
};
use tunestudio::devices::DeviceInventory;
use tunestudio::model::{self, ModelConfig};
use tunestudio::plan::{self, AutoFit, DeviceSpec, DryRunReport, Plan, PlanRequest};
use tunestudio::train::rollout_preview::{rollout_preview, RolloutPreview};
use tunestudio::train::{self, RunConfig};

use super::error::{ErrorKind, JobError};
use super::shared::{DatasetSummary, ExportKind, HistoryRun, ModelInfo};

/// What a finished job reports.
pub enum JobOutput {
    /// A model was resolved (or not).
    Model {
        /// Request number.
        seq: u64,
        /// The model or the error.
        result: Result<ModelInfo, JobError>,
    },
    /// Download progress of a hub model: bytes in its cache folder so far.
    ModelProgress {
        /// Request number.
        seq: u64,
        /// Bytes so far.
        bytes: u64,
    },
    /// Hub models in the local cache.
    HubCache(Vec<String>),
    /// A dataset was opened.
    Dataset {
        /// Request number.
        seq: u64,
        /// The summary or the error.
        result: Result<DatasetSummary, JobError>,
    },
    /// A preview was built.
    Preview {
        /// Request number.
        seq: u64,
        /// The preview (of rows, or of preference pairs) or the error.
        result: Result<Previewed, JobError>,
    },
    /// A plan was made.
    Plan {
        /// Request number.
        seq: u64,
        /// The request and its plan, or the error.
        result: Result<(PlanRequest, Plan), JobError>,
    },
    /// Auto-fit finished.
    AutoFit(Result<AutoFit, JobError>),
    /// The dry run finished.
    DryRun(Result<DryRunReport, JobError>),
    /// Device discovery finished.
    Devices(DeviceInventory),
    /// An export finished.
    Export(Result<PathBuf, JobError>),
    /// Run history was read.
    History(Vec<HistoryRun>, Vec<String>),
    /// A file dialog returned a path.
    Picked(PickTarget, PathBuf),
    /// A report of the Playground's work.
    Playground(super::playground::PgMsg),
    /// A run config was read (for Open, or the demo project).
    ConfigOpened {
        /// The file.
        path: PathBuf,
        /// It is the bundled demo project.
        demo: bool,
        /// The config and its problems, or why it cannot be read. Boxed: a `RunConfig` (over
        /// 800 bytes) would make every job's answer that large (clippy's `large_enum_variant`).
        result: Box<OpenedConfig>,
    },
    /// The run config was saved.
    ConfigSaved {
        /// The file.
        path: PathBuf,
        /// The config as it was when Save was pressed.
        sent: Box<RunConfig>,
        /// The config read back from the file (`None`: written, but not readable back), or
        /// why it could not be written.
        result: Result<Option<Box<RunConfig>>, JobError>,
    },
    /// A folder was listed for the in-app file picker.
    Folder(crate::gui::file_picker::FolderListing),
    /// Start's check of the output folder for another run.
    OutputChecked {
        /// Request number.
        seq: u64,
        /// The config as it was when Start was pressed (the run trains it).
        config: Box<RunConfig>,
        /// The output folder, absolute.
        output_dir: PathBuf,
        /// What another run left there (`train::existing_run`), if any.
        existing: Option<String>,
    },
    /// A fresh output folder for a new project.
    OutputProposed {
        /// What was asked, for which project.
        request: FolderProposal,
        /// The folder, as the config writes it.
        proposed: PathBuf,
    },
    /// The newest checkpoint in an output folder.
    LatestCheckpoint {
        /// The folder looked in.
        output_dir: PathBuf,
        /// Its newest `checkpoint-<step>`, if any.
        latest: Option<PathBuf>,
        /// The user asked for it ("Use the latest"); otherwise it is the empty field's default.
        use_it: bool,
    },
    /// The out-of-memory refit.
    Refitted {
        /// Request number.
        seq: u64,
        /// The fitted config and its changes in words, or why none resumes the run.
        result: Result<(Box<RunConfig>, Vec<String>), JobError>,
    },
}

/// What the preview job built: the rows as SFT trains them, or, when the data holds
/// preference pairs (the format is `auto` and the first row is a TRL or LLaMA-Factory pair),
/// the pairs as DPO and ORPO train them.
#[derive(Debug, Clone)]
pub enum Previewed {
    /// Rows of an SFT dataset.
    Rows(DataPreview),
    /// Preference pairs.
    Pairs(PreferencePreview),
    /// A GRPO run's rollouts: completions sampled for the shown prompts and scored.
    Rollouts(RolloutPreview),
}

/// How a running job reports: each output wakes the UI.
#[derive(Clone)]
pub struct JobSender {
    tx: Sender<JobOutput>,
    ctx: egui::Context,
}

impl JobSender {
    /// Delivers `out` to [`Jobs::drain`] and wakes the UI.
    pub fn send(&self, out: JobOutput) {
        let _ = self.tx.send(out);
        self.ctx.request_repaint();
    }
}

/// What a file dialog is choosing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickTarget {
    /// A local model folder.
    ModelFolder,
    /// A data file.
    DatasetFile,
    /// A folder of data files.
    DatasetFolder,
    /// A separate validation file.
    ValidationFile,
    /// The run's output folder.
    OutputDir,
    /// A run config to open.
    ConfigOpen,
    /// Where to save the run config.
    ConfigSave,
    /// A checkpoint folder to export.
    Checkpoint,
    /// The export destination.
    ExportDest,
    /// A run folder for the history.
    RunDir,
}

/// The tokenizer of the last model folder, shared with preview jobs.
type TokenizerCache = Arc<Mutex<Option<(PathBuf, Arc<TokenizerBundle>)>>>;

/// Spawns jobs and collects their outputs.
pub struct Jobs {
    tx: Sender<JobOutput>,
    rx: Receiver<JobOutput>,
    ctx: egui::Context,
    running: Arc<AtomicUsize>,
    /// The tokenizer of the last model folder, reused across previews.
    tokenizer: TokenizerCache,
}

impl Jobs {
    /// A job runner that wakes `ctx` when a job finishes.
    pub fn new(ctx: egui::Context) -> Self {
        let (tx, rx) = crossbeam_channel::unbounded();
        Jobs {
            tx,
            rx,
            ctx,
            running: Arc::new(AtomicUsize::new(0)),
            tokenizer: Arc::new(Mutex::new(None)),
        }
    }

    /// Jobs still running.
    pub fn in_flight(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Every output available now.
    pub fn drain(&self) -> Vec<JobOutput> {
        self.rx.try_iter().collect()
    }

    /// Runs `work` on a new thread; what it sends on the way and its output are delivered by
    /// [`Jobs::drain`]. It counts in [`Jobs::in_flight`] until it returns.
    pub fn spawn(
        &self,
        name: &str,
        work: impl FnOnce(&JobSender) -> Option<JobOutput> + Send + 'static,
    ) {
        let tx = JobSender {
            tx: self.tx.clone(),
            ctx: self.ctx.clone(),
        };
        let ctx = self.ctx.clone();
        let running = Arc::clone(&self.running);
        running.fetch_add(1, Ordering::SeqCst);
        let guard_running = Arc::clone(&running);
        let spawned = std::thread::Builder::new()
            .name(format!("studio-{name}"))
            .spawn(move || {
                // A panic inside the library must not leave the UI waiting forever.
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&tx)));
                if let Ok(Some(out)) = out {
                    tx.send(out);
                }
                guard_running.fetch_sub(1, Ordering::SeqCst);
                ctx.request_repaint();
            });
        if spawned.is_err() {
            running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Resolves a model source (folder or hub id, downloading if needed).
    pub fn load_model(&self, seq: u64, config: RunConfig) {
        self.spawn("model", move |tx| {
            let source = model_source(&config);
            // While a hub download runs, report the cache folder's growth.
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            if looks_like_hub_id(&source) && !Path::new(&source).exists() {
                let opts = model::HubOptions::from_env();
                let dir = opts
                    .cache_dir
                    .join(format!("models--{}", source.replace('/', "--")));
                let done2 = Arc::clone(&done);
                let tx2 = tx.clone();
                let _ = std::thread::Builder::new()
                    .name("studio-download".into())
                    .spawn(move || {
                        while !done2.load(Ordering::SeqCst) {
                            tx2.send(JobOutput::ModelProgress {
                                seq,
                                bytes: folder_bytes(&dir),
                            });
                            std::thread::sleep(std::time::Duration::from_millis(400));
                        }
                    });
            }
            let result = model_info(&source);
            done.store(true, Ordering::SeqCst);
            Some(JobOutput::Model { seq, result })
        });
    }

    /// Lists hub models in the local HF cache.
    pub fn scan_hub_cache(&self) {
        self.spawn("hub-cache", |_| {
            let dir = model::HubOptions::from_env().cache_dir;
            let mut found = Vec::new();
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    if let Some(rest) = name.strip_prefix("models--") {
                        let id = rest.replacen("--", "/", 1);
                        if model::hub::cached_snapshot(&dir, &id).is_some() {
                            found.push(id);
                        }
                    }
                }
            }
            found.sort();
            Some(JobOutput::HubCache(found))
        });
    }

    /// Opens the dataset of `cfg` and summarises it.
    pub fn scan_dataset(&self, seq: u64, config: RunConfig) {
        self.spawn("dataset", move |_| {
            Some(JobOutput::Dataset {
                seq,
                result: dataset_summary(&config.resolved_data()),
            })
        });
    }

    /// Builds the token preview of `batch` rows starting at `start`; preference pairs are
    /// cut at `limits` (`[preference]`), as the trainer cuts them. A GRPO run previews its
    /// rollouts instead: `batch` prompts from `start`, each with its sampled group.
    pub fn preview(
        &self,
        seq: u64,
        model_dir: String,
        config: RunConfig,
        (start, batch): (usize, usize),
        limits: PairLimits,
    ) {
        let cache = Arc::clone(&self.tokenizer);
        self.spawn("preview", move |_| {
            let cfg = config.resolved_data();
            let result = (|| {
                if config.training.method.is_grpo() {
                    let p = rollout_preview(&config, start, batch.max(1))?;
                    return Ok(Previewed::Rollouts(p));
                }
                let tok = tokenizer_for(&cache, &model_dir)?;
                let opened = data::open_data(&cfg)?;
                let n = opened.main.len();
                if n == 0 {
                    return Err(JobError::of(
                        ErrorKind::Data,
                        format!("{} has no rows", cfg.path),
                    ));
                }
                let start = start.min(n - 1);
                let rows: Vec<usize> = (start..(start + batch.max(1)).min(n)).collect();
                let opts = PreviewOptions {
                    rows: RowSelection::Indices(rows),
                    batch_size: batch.max(1),
                    full_scan: true,
                };
                if pref::is_preference_data(&cfg, &opened)? {
                    let p = pref::preview_pairs_opened(&cfg, &tok, &opened, &opts, limits)?;
                    return Ok(Previewed::Pairs(p));
                }
                Ok(Previewed::Rows(data::preview_opened(
                    &cfg, &tok, &opened, &opts,
                )?))
            })();
            Some(JobOutput::Preview { seq, result })
        });
    }

    /// Plans memory for `config` on `devices`.
    pub fn plan(
        &self,
        seq: u64,
        model: ModelConfig,
        config: RunConfig,
        devices: Vec<DeviceSpec>,
        trained_tokens: Option<plan::TrainedTokens>,
    ) {
        self.spawn("plan", move |_| {
            let result = plan_request(&model, &config, devices, trained_tokens)
                .map_err(|e| JobError::of(ErrorKind::Config, e))
                .and_then(|req| Ok(plan::plan(&req).map(|p| (req, p))?));
            Some(JobOutput::Plan { seq, result })
        });
    }

    /// Searches settings that fit.
    pub fn auto_fit(&self, request: PlanRequest) {
        self.spawn("auto-fit", move |_| {
            Some(JobOutput::AutoFit(
                plan::auto_fit(&request).map_err(JobError::from),
            ))
        });
    }

    /// One real training step measured against the plan.
    pub fn dry_run(&self, request: PlanRequest, config: RunConfig) {
        self.spawn("dry-run", move |_| {
            // One step as the trainer takes it, its components measured as far as the
            // process can (the same dry run as `tunestudio plan --dry-run`).
            Some(JobOutput::DryRun(
                train::dry_run(config, &request)
                    .map(|(report, _)| report)
                    .map_err(JobError::from),
            ))
        });
    }

    /// Discovers devices, reading GPUs through `nvml_library` (`None`: the driver's).
    pub fn discover_devices(&self, nvml_library: Option<std::path::PathBuf>) {
        self.spawn("devices", move |_| {
            let options = tunestudio::devices::DiscoveryOptions {
                nvml_library,
                skip_gpus: false,
            };
            Some(JobOutput::Devices(tunestudio::devices::discover_with(
                &options,
            )))
        });
    }

    /// Exports a checkpoint.
    pub fn export(&self, request: ExportRequest) {
        self.spawn("export", move |_| {
            let ExportRequest {
                kind,
                checkpoint,
                dest,
                dtype,
                gguf_quant,
                replace,
                progress,
            } = request;
            let r = match kind {
                ExportKind::Adapter => train::export_adapter(&checkpoint, &dest),
                ExportKind::Merged => train::export_merged(&checkpoint, &dest, dtype),
                ExportKind::Full => train::export_full(&checkpoint, &dest, dtype),
                ExportKind::Gguf => {
                    return Some(JobOutput::Export(export_gguf(
                        &checkpoint,
                        &dest,
                        gguf_quant,
                        replace,
                        &progress,
                    )))
                }
            };
            Some(JobOutput::Export(r.map_err(JobError::from)))
        });
    }

    /// Opens a native file dialog on its own thread (the xdg portal does not need the
    /// main thread), so the studio keeps drawing while it is open.
    /// It starts in the first of `starts` that is a folder.
    pub fn pick(&self, target: PickTarget, starts: Vec<PathBuf>) {
        self.spawn("dialog", move |_| {
            let mut d = rfd::FileDialog::new();
            if let Some(dir) = starts.into_iter().find(|d| crate::gui::disk::is_dir(d)) {
                d = d.set_directory(dir);
            }
            let picked = match target {
                PickTarget::ModelFolder
                | PickTarget::DatasetFolder
                | PickTarget::OutputDir
                | PickTarget::Checkpoint
                | PickTarget::ExportDest
                | PickTarget::RunDir => d.pick_folder(),
                PickTarget::DatasetFile | PickTarget::ValidationFile => {
                    d.add_filter("data", DATA_EXTENSIONS).pick_file()
                }
                PickTarget::ConfigOpen => d.add_filter("run config", &["toml"]).pick_file(),
                PickTarget::ConfigSave => d
                    .add_filter("run config", &["toml"])
                    .set_file_name("run.toml")
                    .save_file(),
            };
            picked.map(|p| JobOutput::Picked(target, p))
        });
    }

    /// Reads the metrics of every run folder (and the run folders inside them).
    pub fn load_history(&self, dirs: Vec<PathBuf>) {
        self.spawn("history", move |_| {
            let (runs, errors) = read_history(&dirs);
            Some(JobOutput::History(runs, errors))
        });
    }
}

/// The data files a file dialog offers.
pub const DATA_EXTENSIONS: &[&str] = &["json", "jsonl", "ndjson", "csv", "tsv", "parquet", "txt"];

/// Whether `s` looks like a hub id (`org/name`) rather than a path.
pub fn looks_like_hub_id(s: &str) -> bool {
    data::hub::looks_like_hub_id(s)
}

mod files;
mod start;
mod work;
pub use files::{load_config, OpenedConfig};
pub use start::FolderProposal;
pub use work::{
    dataset_summary, model_info, model_source, plan_request, read_history, ExportRequest,
};
use work::{export_gguf, folder_bytes, tokenizer_for};
