//! Background work: every slow call into the library (resolving and
//! downloading models, reading datasets, tokenising the preview, planning,
//! dry runs, exports, reading run history) runs on its own thread and reports
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
use tunestudio::train::{self, RunConfig};

use super::error::{ErrorKind, JobError};
use super::state::{DatasetSummary, ExportKind, HistoryRun, ModelInfo};

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
    pub fn load_model(&self, seq: u64, source: String) {
        self.spawn("model", move |tx| {
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
    pub fn scan_dataset(&self, seq: u64, cfg: DataConfig) {
        self.spawn("dataset", move |_| {
            Some(JobOutput::Dataset {
                seq,
                result: dataset_summary(&cfg),
            })
        });
    }

    /// Builds the token preview of `batch` rows starting at `start`; preference pairs are
    /// cut at `limits` (`[preference]`), as the trainer cuts them.
    pub fn preview(
        &self,
        seq: u64,
        model_dir: String,
        cfg: DataConfig,
        (start, batch): (usize, usize),
        limits: PairLimits,
    ) {
        let cache = Arc::clone(&self.tokenizer);
        self.spawn("preview", move |_| {
            let result = (|| {
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
    pub fn pick(&self, target: PickTarget, start_dir: Option<PathBuf>) {
        self.spawn("dialog", move |_| {
            let mut d = rfd::FileDialog::new();
            if let Some(dir) = start_dir {
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

/// Total size of the files under `dir` (a download in progress).
fn folder_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.is_file() {
                total += meta.len();
            }
        }
    }
    total
}

/// Resolves a model and reads what the Model panel shows.
pub fn model_info(source: &str) -> Result<ModelInfo, JobError> {
    let source = source.trim();
    if source.is_empty() {
        return Err(JobError::of(
            ErrorKind::Config,
            "no model chosen: type a folder or a hub id like HuggingFaceTB/SmolLM2-135M",
        ));
    }
    let local = Path::new(source);
    // A local folder without weights is still a usable model (random initialisation),
    // so read it directly instead of requiring safetensors.
    // A bare config.json (e.g. a real architecture without its weights) is enough to plan memory.
    let (dir, weight_files, config_path) = if local.is_file() {
        let dir = local.parent().map(Path::to_path_buf).unwrap_or_default();
        (dir, Vec::new(), local.to_path_buf())
    } else if local.is_dir() {
        let weights = model::ModelFiles::from_dir(local)
            .map(|f| f.weights)
            .unwrap_or_default();
        (local.to_path_buf(), weights, local.join("config.json"))
    } else {
        let files = model::resolve_model(source)?;
        (files.dir.clone(), files.weights, files.config.clone())
    };
    let config = ModelConfig::from_file(&config_path)?;
    let dtype = ["torch_dtype", "dtype"].iter().find_map(|k| {
        config
            .raw
            .get(*k)
            .and_then(|v| v.as_str())
            .map(str::to_string)
    });
    let weight_bytes = weight_files
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let has_tokenizer = dir.join("tokenizer.json").is_file();
    let chat_template = if !has_tokenizer {
        None
    } else if dir.join("chat_template.jinja").is_file() {
        Some("chat_template.jinja".to_string())
    } else {
        std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .filter(|v| v.get("chat_template").is_some_and(|c| !c.is_null()))
            .map(|_| "tokenizer_config.json".to_string())
    };
    Ok(ModelInfo {
        source: source.to_string(),
        dir,
        parameters: config.num_parameters(),
        config,
        dtype,
        weight_files,
        weight_bytes,
        has_tokenizer,
        chat_template,
    })
}

/// The tokenizer of `model_dir`, from the cache when it is the same folder.
fn tokenizer_for(
    cache: &Mutex<Option<(PathBuf, Arc<TokenizerBundle>)>>,
    model_dir: &str,
) -> Result<Arc<TokenizerBundle>, JobError> {
    let key = PathBuf::from(model_dir);
    if let Ok(guard) = cache.lock() {
        if let Some((dir, tok)) = guard.as_ref() {
            if *dir == key {
                return Ok(Arc::clone(tok));
            }
        }
    }
    let tok = Arc::new(TokenizerBundle::from_source(model_dir)?);
    if let Ok(mut guard) = cache.lock() {
        *guard = Some((key, Arc::clone(&tok)));
    }
    Ok(tok)
}

/// Opens a dataset and summarises it.
pub fn dataset_summary(cfg: &DataConfig) -> Result<DatasetSummary, JobError> {
    cfg.validate()?;
    let opened = data::open_data(cfg)?;
    let n = opened.main.len();
    let (detected, preference, columns, first_row) = if n > 0 {
        let row = opened.main.row(0)?;
        let columns = row
            .as_object()
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default();
        let mut text = serde_json::to_string_pretty(&row).unwrap_or_default();
        if text.chars().count() > 600 {
            text = text.chars().take(600).collect::<String>() + " …";
        }
        // As the preview decides (`is_preference_data`): pairs only under `format = auto`.
        let preference = (cfg.format == data::Format::Auto)
            .then(|| pref::detect_preference_format(&row, &cfg.columns))
            .flatten();
        (
            data::detect_format(&row, &cfg.columns),
            preference,
            columns,
            text,
        )
    } else {
        (None, None, Vec::new(), String::new())
    };
    Ok(DatasetSummary {
        files: opened
            .main
            .files()
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        num_rows: n,
        train_rows: opened.train_indices.len(),
        validation_rows: opened.heldout_indices.len()
            + opened.separate_validation.as_ref().map_or(0, |v| v.len()),
        detected,
        preference,
        columns,
        first_row,
    })
}

/// The planner's request for the studio's settings: the run config through the one adapter
/// ([`train::plan_request`]), with the model the studio has loaded, its devices and the trained
/// tokens of the dataset's preview scan (`None` before one, or with packing: the scan's samples
/// are not packed). Its output is also the studio's "plan is stale" key
/// ([`super::state::PlanKey`]).
pub fn plan_request(
    model: &ModelConfig,
    config: &RunConfig,
    devices: Vec<DeviceSpec>,
    trained_tokens: Option<plan::TrainedTokens>,
) -> Result<PlanRequest, String> {
    let mut req = train::plan_request(config, model.clone(), devices);
    req.trained_tokens = trained_tokens;
    // The studio trains in its own process: its window is part of the resident set.
    if let Some(p) = req.process.as_mut() {
        p.gui = true;
    }
    Ok(req)
}

/// Reads runs: each folder with a `metrics.jsonl`, or its sub-folders that have one.
pub fn read_history(dirs: &[PathBuf]) -> (Vec<HistoryRun>, Vec<String>) {
    let mut candidates = Vec::new();
    for d in dirs {
        if d.join(train::METRICS_FILE).is_file() {
            candidates.push(d.clone());
        } else if let Ok(entries) = std::fs::read_dir(d) {
            for e in entries.flatten() {
                if e.path().join(train::METRICS_FILE).is_file() {
                    candidates.push(e.path());
                }
            }
        }
    }
    candidates.sort();
    candidates.dedup();
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    for dir in candidates {
        match train::read_metrics(&dir) {
            Ok(events) => {
                let finished = events.iter().rev().find_map(|e| match e {
                    train::Event::Finished { reason, .. } => Some(*reason),
                    _ => None,
                });
                runs.push(HistoryRun {
                    curves: train::RunCurves::from_events(&events),
                    dir,
                    finished,
                });
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    (runs, errors)
}

/// An export the Export panel asked for.
pub struct ExportRequest {
    /// What to write.
    pub kind: ExportKind,
    /// The checkpoint (or model / adapter folder, for GGUF).
    pub checkpoint: PathBuf,
    /// The folder (HF exports) or file / folder (GGUF) to write.
    pub dest: PathBuf,
    /// Weights dtype of merged and full exports.
    pub dtype: candle_core::DType,
    /// GGUF file type.
    pub gguf_quant: tunestudio::gguf::GgufQuant,
    /// Overwrite an existing GGUF file.
    pub replace: bool,
    /// Where the GGUF export reports its bytes.
    pub progress: Arc<super::state::ExportProgressCell>,
}

/// A GGUF export: `dest` is the file, or a folder for `<name>-<quant>.gguf`.
fn export_gguf(
    checkpoint: &std::path::Path,
    dest: &std::path::Path,
    quant: tunestudio::gguf::GgufQuant,
    replace: bool,
    progress: &super::state::ExportProgressCell,
) -> Result<PathBuf, JobError> {
    let source = train::export_source(checkpoint, None).map_err(JobError::from)?;
    let file = if dest
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        dest.to_path_buf()
    } else {
        let default = train::default_gguf_path(checkpoint, &source, quant);
        dest.join(default.file_name().unwrap_or_default())
    };
    let written = train::export_gguf(&source, quant, &file, replace, &mut |p| {
        progress.total_bytes.store(p.bytes_total, Ordering::Relaxed);
        progress.done_bytes.store(p.bytes_done, Ordering::Relaxed);
        std::ops::ControlFlow::Continue(())
    })
    .map_err(JobError::from)?;
    Ok(written.path)
}
