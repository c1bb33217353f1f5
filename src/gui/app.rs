//! The studio application: navigation, status bar, and the loop that feeds
//! job outputs and trainer events into the state and starts background work
//! when the settings change. Panels (in `panels/`) draw the state and queue
//! [`Action`]s; the app carries them out after the frame is drawn.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eframe::egui::{self, Color32, RichText};

use tunestudio::plan::{Change, DeviceSpec, PlanRequest};
use tunestudio::train::{self, Command, RunConfig, Trainer};

use super::file_picker::{PickKind, PickerOutcome};
use super::jobs::{JobOutput, Jobs, PickTarget};
use super::panels;
use super::playground;
use super::reducer::apply_job;
use super::state::{push_recent, AppState, Panel, PickFor, RunPhase, RunState, Settings};
use super::theme;

/// Storage key of [`Settings`].
const SETTINGS_KEY: &str = "tunestudio.settings";

/// Something a panel asks the app to do.
#[derive(Debug, Clone)]
pub enum Action {
    /// Resolve the model in the Model panel's text field.
    LoadModel,
    /// Re-open the dataset.
    ScanDataset,
    /// Start training.
    Start,
    /// Start by resuming the run already in the output folder (its newest checkpoint).
    StartResumingLatest,
    /// Start in a fresh output folder (the current one holds another run).
    StartInNewFolder,
    /// After an out-of-memory stop: apply the fitted settings and resume from the checkpoint.
    ApplyOomRefitAndResume,
    /// Dismiss the "this folder holds a run" question.
    CancelStart,
    /// Pause the trainer.
    Pause,
    /// Resume it.
    Resume,
    /// Stop it.
    Stop,
    /// Save a checkpoint now.
    SaveNow,
    /// Apply a planner change to the settings.
    ApplyChange(Change),
    /// Search settings that fit.
    AutoFit,
    /// Apply the last auto-fit.
    ApplyAutoFit,
    /// Run one measured step.
    DryRun,
    /// Re-discover devices.
    RefreshDevices,
    /// Open the panel.
    Goto(Panel),
    /// Show preview rows starting here (and highlight it).
    JumpToRow(usize),
    /// Save the run config to this path.
    SaveConfig(PathBuf),
    /// Load a run config.
    LoadConfig(PathBuf),
    /// Load the bundled demo project.
    LoadDemo,
    /// Export a checkpoint.
    Export,
    /// Re-read the run history.
    RefreshHistory,
    /// Add a folder to the run history.
    AddRunDir(PathBuf),
    /// Open a file dialog.
    Pick(PickTarget),
    /// Something for the Playground panel.
    Playground(playground::PgAction),
}

/// Options for the app that the command line or tests set.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// Take a screenshot to this PNG and exit.
    pub screenshot: Option<PathBuf>,
    /// Panel to open at start.
    pub panel: Option<Panel>,
    /// In screenshot mode: start training and wait for this many steps first.
    pub train_steps: Option<u64>,
    /// Ignore persisted settings (tests, screenshots).
    pub fresh: bool,
    /// Override the run's output folder.
    pub output_dir: Option<PathBuf>,
    /// Open this run config instead of the last one / the demo.
    pub config: Option<PathBuf>,
    /// The NVML library to read GPUs through (`None`: `$TUNESTUDIO_NVML_LIB`, then the
    /// driver's); tests pass a fake one.
    pub nvml_library: Option<PathBuf>,
    /// Force the system file dialog unavailable, with this reason (tests; `None`: ask the
    /// session bus).
    pub no_system_dialog: Option<String>,
    /// In screenshot mode: press this field's "Browse…" before the screenshot.
    pub screenshot_pick: Option<PickTarget>,
    /// Tests: the first run started makes this step fail once as out of memory (`STEP:PHASE`,
    /// see [`train::TrainerOptions::inject_oom`]); later runs (the refit's resume) do not.
    pub inject_oom: Option<String>,
}

impl StartOptions {
    /// Reads `TUNESTUDIO_SCREENSHOT`, `TUNESTUDIO_SCREENSHOT_PANEL`,
    /// `TUNESTUDIO_SCREENSHOT_TRAIN_STEPS`, `TUNESTUDIO_OUTPUT_DIR` and `TUNESTUDIO_CONFIG`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let screenshot = var("TUNESTUDIO_SCREENSHOT").map(PathBuf::from);
        StartOptions {
            fresh: screenshot.is_some(),
            panel: var("TUNESTUDIO_SCREENSHOT_PANEL").and_then(|p| Panel::from_name(&p)),
            train_steps: var("TUNESTUDIO_SCREENSHOT_TRAIN_STEPS").and_then(|s| s.parse().ok()),
            output_dir: var("TUNESTUDIO_OUTPUT_DIR").map(PathBuf::from),
            config: var("TUNESTUDIO_CONFIG").map(PathBuf::from),
            screenshot,
            // `$TUNESTUDIO_NVML_LIB` is read where NVML is opened.
            nvml_library: None,
            no_system_dialog: None,
            screenshot_pick: var("TUNESTUDIO_SCREENSHOT_PICK").and_then(|p| match p.as_str() {
                "model-folder" => Some(PickTarget::ModelFolder),
                "dataset-file" => Some(PickTarget::DatasetFile),
                "dataset-folder" => Some(PickTarget::DatasetFolder),
                _ => None,
            }),
            inject_oom: None,
        }
    }
}

/// The screenshot mode's progress.
struct Screenshot {
    path: PathBuf,
    train_steps: Option<u64>,
    /// Press this "Browse…" first (`TUNESTUDIO_SCREENSHOT_PICK`), to show the file dialog.
    pick: Option<PickTarget>,
    /// The frame the picker was asked for: a new egui window is invisible on its first
    /// (sizing) pass, so the screenshot waits a few frames after it.
    picked_at_frame: Option<u64>,
    started: Instant,
    requested: bool,
    image: Arc<Mutex<Option<Arc<egui::ColorImage>>>>,
    saved: bool,
}

/// The studio.
pub struct StudioApp {
    /// Everything the panels show.
    pub state: AppState,
    /// Background work.
    pub jobs: Jobs,
    ctx: egui::Context,
    actions: Vec<Action>,
    screenshot: Option<Screenshot>,
    /// Frames drawn.
    pub frame_count: u64,
    /// See [`StartOptions::nvml_library`].
    nvml_library: Option<PathBuf>,
    /// The panel the last frame showed (opening the Playground lists checkpoints again).
    shown_panel: Option<Panel>,
    /// See [`StartOptions::inject_oom`] (taken by the first run).
    inject_oom: Option<String>,
}

/// The in-app picker's title and what it chooses, per studio field (as the system dialog's
/// filters in `Jobs::pick`).
fn pick_kind(target: PickTarget) -> (&'static str, PickKind) {
    match target {
        PickTarget::ModelFolder => ("Choose a model folder", PickKind::Folder),
        PickTarget::DatasetFolder => ("Choose a folder of data files", PickKind::Folder),
        PickTarget::OutputDir => ("Choose the output folder", PickKind::Folder),
        PickTarget::Checkpoint => ("Choose a checkpoint folder", PickKind::Folder),
        PickTarget::ExportDest => ("Choose where to export", PickKind::Folder),
        PickTarget::RunDir => ("Choose a run folder", PickKind::Folder),
        PickTarget::DatasetFile | PickTarget::ValidationFile => (
            "Choose a data file",
            PickKind::File(super::jobs::DATA_EXTENSIONS.to_vec()),
        ),
        PickTarget::ConfigOpen => ("Open a run config", PickKind::File(vec!["toml"])),
        PickTarget::ConfigSave => ("Save the run config", PickKind::Save(vec!["toml"])),
    }
}

/// Whether the settings `key` changed since the last request: if so, records it and
/// returns the new request's sequence number (answers to older numbers are dropped).
fn next_request<K: PartialEq>(key: K, last: &mut K, seq: &mut u64) -> Option<u64> {
    if key == *last {
        return None;
    }
    *last = key;
    *seq += 1;
    Some(*seq)
}

pub use super::state::demo_config_path;

/// Loads a run config, keeping its problems as text instead of failing when it
/// still parses (the studio shows them and lets the user fix them).
pub fn load_config(path: &Path) -> Result<(RunConfig, Vec<String>), String> {
    match RunConfig::load(path) {
        Ok(c) => Ok((c, Vec::new())),
        Err(err) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let base = path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."));
            match RunConfig::from_toml_str(&text, &base) {
                Ok(c) => {
                    let problems = match &err {
                        train::ConfigError::Invalid { problems, .. } => {
                            problems.iter().map(|p| p.to_string()).collect()
                        }
                        other => vec![other.to_string()],
                    };
                    Ok((c, problems))
                }
                Err(_) => Err(err.to_string()),
            }
        }
    }
}

impl StudioApp {
    /// Builds the app (eframe's creation hook).
    pub fn new(cc: &eframe::CreationContext<'_>, opts: StartOptions) -> Self {
        let ctx = cc.egui_ctx.clone();
        super::fonts::install(&ctx);
        ctx.set_theme(egui::ThemePreference::Dark);
        ctx.all_styles_mut(|style| {
            style.spacing.item_spacing = egui::vec2(8.0, 6.0);
            style.spacing.button_padding = egui::vec2(10.0, 4.0);
        });

        let settings: Settings = if opts.fresh {
            Settings::default()
        } else {
            cc.storage
                .and_then(|s| eframe::get_value(s, SETTINGS_KEY))
                .unwrap_or_default()
        };

        // The last config, else the bundled demo (tiny model, tokenizer and data: trains offline).
        let mut problems = Vec::new();
        let mut loaded = None;
        if let Some(p) = opts
            .config
            .clone()
            .or_else(|| settings.last_config.clone())
            .filter(|p| p.is_file())
        {
            if let Ok((c, pr)) = load_config(&p) {
                problems = pr;
                loaded = Some((c, Some(p)));
            }
        }
        let (mut config, path) = match loaded {
            Some(x) => x,
            None => match load_config(&demo_config_path()) {
                Ok((c, pr)) => {
                    problems = pr;
                    (c, Some(demo_config_path()))
                }
                Err(e) => {
                    problems = vec![e];
                    (RunConfig::default(), None)
                }
            },
        };
        if let Some(out) = &opts.output_dir {
            config.output_dir = std::path::absolute(out).unwrap_or_else(|_| out.clone());
        }
        let mut state = AppState::new(config, path, settings);
        state.system_dialog = match &opts.no_system_dialog {
            Some(why) => Err(why.clone()),
            None => super::file_picker::system_dialog(),
        };
        state.config_problems = problems;
        if let Some(p) = opts.panel {
            state.panel = p;
        }
        let jobs = Jobs::new(ctx.clone());
        let mut app = StudioApp {
            state,
            jobs,
            ctx: ctx.clone(),
            actions: Vec::new(),
            screenshot: opts.screenshot.map(|path| Screenshot {
                path,
                train_steps: opts.train_steps,
                pick: opts.screenshot_pick,
                picked_at_frame: None,
                started: Instant::now(),
                requested: false,
                image: Arc::new(Mutex::new(None)),
                saved: false,
            }),
            frame_count: 0,
            nvml_library: opts.nvml_library,
            shown_panel: None,
            inject_oom: opts.inject_oom,
        };
        app.jobs.discover_devices(app.nvml_library.clone());
        app.state.devices.loading = true;
        app.jobs.scan_hub_cache();
        app.actions.push(Action::LoadModel);
        app.actions.push(Action::RefreshHistory);
        app
    }

    /// The devices the plan runs on: the selected ones, sized from discovery.
    pub fn device_specs(&self) -> Result<Vec<DeviceSpec>, String> {
        self.state.device_specs()
    }

    /// Folds a job's report into the state (see [`apply_job`]) and queues what follows.
    fn handle_job(&mut self, out: JobOutput) {
        let follow = apply_job(&mut self.state, out);
        self.actions.extend(follow);
    }

    /// Starts background work the current settings need (dataset scan, preview, plan).
    fn schedule_jobs(&mut self) {
        let model_dir = self
            .state
            .model
            .info
            .as_ref()
            .map(|i| i.dir.display().to_string());

        let s = &mut self.state;
        if let Some(seq) = next_request(s.dataset_key(), &mut s.dataset.key, &mut s.dataset.seq) {
            s.dataset.loading = true;
            self.jobs.scan_dataset(seq, s.config.resolved_data());
        }

        if let Some(dir) = &model_dir {
            let key = format!("{dir}|{}", s.preview_key());
            if let Some(seq) = next_request(key, &mut s.preview.key, &mut s.preview.seq) {
                s.preview.loading = true;
                self.jobs.preview(
                    seq,
                    dir.clone(),
                    s.config.resolved_data(),
                    (
                        s.preview.start_row,
                        s.config.training.micro_batch.clamp(1, 16),
                    ),
                    s.config.preference.limits(),
                );
            }
        }

        let Some(model) = s.model.info.as_ref().map(|i| i.config.clone()) else {
            return;
        };
        if let Some(seq) = next_request(s.plan_key(), &mut s.plan.key, &mut s.plan.seq) {
            match self.device_specs() {
                Ok(devices) => {
                    self.state.plan.loading = true;
                    let trained = self.state.trained_tokens();
                    self.jobs
                        .plan(seq, model, self.state.config.clone(), devices, trained);
                }
                Err(e) => {
                    self.state.plan.error = Some(super::error::JobError::of(
                        super::error::ErrorKind::Config,
                        e,
                    ));
                    self.state.plan.plan = None;
                }
            }
        }
    }

    fn poll_trainer(&mut self) {
        let events = match &self.state.run.handle {
            Some(h) => h.drain(),
            None => return,
        };
        for e in events {
            self.state.run.apply(e);
        }
        if matches!(self.state.run.phase, RunPhase::Finished(_)) {
            if let Some(h) = self.state.run.handle.take() {
                // The thread has sent Finished; joining returns at once.
                h.join();
                self.actions.push(Action::RefreshHistory);
            }
        }
    }

    /// Applies a planner request's settings to the run config.
    fn apply_request(&mut self, req: &PlanRequest) {
        let c = &mut self.state.config;
        c.training.precision = req.precision;
        c.training.micro_batch = req.micro_batch;
        c.training.gradient_accumulation = req.gradient_accumulation;
        c.data.max_length = req.seq_len;
        c.training.activation_checkpointing = req.activation_checkpointing;
        c.training.optimizer_offload = if req.optimizer_offload {
            tunestudio::model::OptimizerOffload::Host
        } else {
            tunestudio::model::OptimizerOffload::None
        };
        match &req.lora {
            Some(l) => {
                c.lora.enabled = true;
                c.lora.r = l.r;
                c.lora.target_modules = l.target_modules.clone();
            }
            None => c.lora.enabled = false,
        }
        c.devices.strategy = req.strategy;
    }

    /// A new dataset gets its own settings: the format and columns are detected afresh
    /// (the previous file's `alpaca` would misread a pre-tokenized one), and `max_length`
    /// follows its lengths once the preview has them.
    fn new_dataset_settings(&mut self) {
        let d = &mut self.state.config.data;
        d.format = tunestudio::data::Format::Auto;
        d.columns = Default::default();
        d.txt_split = Default::default();
        d.allow.clear();
        self.state.dataset.propose_max_length = true;
    }

    /// A new model or dataset is a new project: it gets a fresh output folder beside the
    /// current one (`runs/<model>-<data>`, numbered when taken) instead of writing into the
    /// previous run's.
    fn propose_output_dir(&mut self) {
        let c = &self.state.config;
        let stem = |s: &str| {
            Path::new(s.trim_end_matches('/'))
                .file_stem()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default()
        };
        let name = format!(
            "{}-{}",
            stem(&c.model.source),
            stem(&self.state.dataset.path_input)
        )
        .replace(
            |ch: char| !ch.is_alphanumeric() && ch != '-' && ch != '_',
            "-",
        );
        let parent = c
            .output_dir
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("runs"));
        let base = c.base_dir.join(&parent);
        let fresh = (1..)
            .map(|n| {
                if n == 1 {
                    name.clone()
                } else {
                    format!("{name}-{n}")
                }
            })
            .find(|n| !base.join(n).exists())
            .unwrap_or(name);
        let proposed = parent.join(fresh);
        if proposed != self.state.config.output_dir {
            let old_default = self.state.default_config_path().display().to_string();
            self.state.config.output_dir = proposed.clone();
            // The project owns its run config too: a path the user did not choose (the old
            // folder's default, or the demo's) moves beside the new output folder.
            let demo = self.state.config_path.as_deref() == Some(demo_config_path().as_path());
            if demo || self.state.export.config_path == old_default {
                self.state.export.config_path =
                    self.state.default_config_path().display().to_string();
            }
            if demo {
                self.state.config_path = None;
            }
            self.state
                .toast(format!("new project: output folder {}", proposed.display()));
        }
    }

    fn start_training(&mut self, resume_latest: bool) {
        if self.state.run.is_active() {
            return;
        }
        // A planned machine's GPUs are not here: the trainer would fail to open them.
        if let Some(cmd) = self.state.planning_only() {
            self.state.toast(format!(
                "planning only: train on the planned machine with `{cmd}`"
            ));
            return;
        }
        let mut config = self.state.config.clone();
        if let Some(s) = &self.screenshot {
            if s.train_steps.is_some() {
                config.output_dir = std::env::temp_dir()
                    .join(format!("tunestudio-screenshot-{}", std::process::id()));
            }
        }
        let out = config.output_path();
        let abs_out = std::path::absolute(&out).unwrap_or(out);
        // Never into another run's folder unannounced: ask (the Run panel offers resuming it
        // or a new folder), as the CLI refuses.
        if !resume_latest {
            if let Some(existing) = train::existing_run(&abs_out) {
                self.state.run.existing_run = Some(existing);
                self.state.panel = Panel::Run;
                return;
            }
        }
        push_recent(&mut self.state.settings.run_dirs, abs_out.clone());
        let mut run = RunState {
            phase: RunPhase::Loading,
            status: "starting".into(),
            started_at: Some(Instant::now()),
            output_dir: Some(abs_out),
            ..RunState::default()
        };
        // Predicted peaks and capacities per device, for the memory chart: the trainer
        // samples the CPU once (logical CPU devices share this process) and each GPU by
        // `cuda:N`, so the plan's devices are keyed the same way.
        if let Some(plan) = &self.state.plan.plan {
            for (entry, dp) in config.devices.devices.iter().zip(plan.per_device.iter()) {
                let name = entry.split('=').next().unwrap_or(entry).trim();
                let label = if name.starts_with("cpu") { "cpu" } else { name };
                let series = run.memory.entry(label.to_string()).or_default();
                let predicted = series.predicted_peak_bytes.get_or_insert(0);
                // Logical CPU devices are stages of this one process, and the first one's
                // planned peak is the process's (it counts every CPU stage's tensors): the
                // line is the largest, not the sum, which counted the process twice.
                *predicted = if label == "cpu" {
                    (*predicted).max(dp.peak_bytes)
                } else {
                    *predicted + dp.peak_bytes
                };
                if label != "cpu" || series.total_bytes.is_none() {
                    series.total_bytes = Some(dp.device.capacity_bytes);
                }
            }
        }
        let ctx = self.ctx.clone();
        let waker: train::Waker = Arc::new(move || ctx.request_repaint());
        let options = train::TrainerOptions {
            nvml_library: self.nvml_library.clone(),
            resume_latest,
            inject_oom: self.inject_oom.take(),
            ..train::TrainerOptions::default()
        };
        let handle = Trainer::spawn_with(config, options, Some(waker));
        if !handle.send(Command::Start) {
            run.status = "the trainer thread ended before it started".into();
        }
        run.handle = Some(handle);
        self.state.run = run;
        self.state.panel = Panel::Run;
    }

    fn send(&mut self, cmd: Command) {
        if let Some(h) = &self.state.run.handle {
            if !h.send(cmd) {
                self.state.toast("the trainer has already ended");
            }
        }
    }

    fn run_actions(&mut self) {
        let actions = std::mem::take(&mut self.actions);
        for a in actions {
            self.run_action(a);
        }
    }

    fn run_action(&mut self, a: Action) {
        match a {
            Action::LoadModel => self.load_model(),
            Action::ScanDataset => self.scan_dataset(),
            Action::Start => self.start_training(false),
            Action::StartResumingLatest => self.start_training(true),
            Action::StartInNewFolder => {
                self.state.run.existing_run = None;
                self.propose_output_dir();
                self.start_training(false);
            }
            Action::CancelStart => self.state.run.existing_run = None,
            Action::ApplyOomRefitAndResume => self.refit_and_resume(),
            Action::Pause => self.send(Command::Pause),
            Action::Resume => self.send(Command::Resume),
            // Stop means what Ctrl-C means in `tunestudio train`: a checkpoint of the
            // current step, then the end (the Playground can load a stopped run).
            Action::Stop => {
                self.send(Command::SaveNow);
                self.send(Command::Stop);
            }
            Action::SaveNow => self.send(Command::SaveNow),
            Action::ApplyChange(change) => self.apply_change(&change),
            Action::AutoFit => {
                if let Some(req) = self.state.plan.request.clone() {
                    self.state.plan.autofit_running = true;
                    self.jobs.auto_fit(req);
                }
            }
            Action::ApplyAutoFit => self.apply_auto_fit(),
            Action::DryRun => self.dry_run(),
            Action::RefreshDevices => {
                self.state.devices.loading = true;
                self.jobs.discover_devices(self.nvml_library.clone());
            }
            Action::Goto(p) => self.state.panel = p,
            Action::JumpToRow(row) => {
                self.state.preview.start_row = row;
                self.state.preview.highlight = Some(row);
                self.state.panel = Panel::Preview;
            }
            Action::SaveConfig(path) => self.save_config(path),
            Action::LoadConfig(path) => self.open_config(path),
            Action::LoadDemo => self.load_demo(),
            Action::Export => self.export(),
            Action::RefreshHistory => self.refresh_history(),
            Action::Pick(target) => self.pick(target),
            Action::Playground(a) => playground::apply(&mut self.state, a, &self.jobs),
            Action::AddRunDir(dir) => {
                push_recent(&mut self.state.settings.run_dirs, dir);
                self.actions.push(Action::RefreshHistory);
            }
        }
    }

    fn load_model(&mut self) {
        let typed = self.state.model.source_input.trim().to_string();
        if typed != self.state.config.model.source {
            self.state.config.model.source = typed;
            self.propose_output_dir();
        }
        let source = self.state.model_source();
        self.state.model.seq += 1;
        self.state.model.loading = Some(Instant::now());
        self.state.model.download_bytes = None;
        self.state.model.error = None;
        self.jobs.load_model(self.state.model.seq, source);
    }

    fn scan_dataset(&mut self) {
        let path = self.state.dataset.path_input.trim().to_string();
        if path != self.state.config.data.path {
            self.new_dataset_settings();
            self.propose_output_dir();
        }
        self.state.config.data.path = path;
        self.state.dataset.key.clear();
        self.state.preview.key.clear();
        self.state.preview.start_row = 0;
        let p = self.state.config.data.path.clone();
        if !p.is_empty() {
            push_recent(&mut self.state.settings.recent_datasets, p);
        }
    }

    /// After an out-of-memory stop: the fitted settings, then resume from the checkpoint.
    fn refit_and_resume(&mut self) {
        match train::oom::refit_after_oom(&self.state.config) {
            Ok(refit) => {
                self.state.config = refit.config;
                self.state
                    .toast(format!("resuming with: {}", refit.changes.join("; ")));
                self.start_training(true);
            }
            Err(e) => self.state.toast(e),
        }
    }

    fn apply_change(&mut self, change: &Change) {
        if let Some(req) = self.state.plan.request.clone() {
            let new = change.apply(&req);
            let text = change.describe(&req);
            self.apply_request(&new);
            self.state.toast(format!("applied: {text}"));
        }
    }

    fn apply_auto_fit(&mut self) {
        if let Some(fit) = self.state.plan.autofit.take() {
            self.apply_request(&fit.request);
            self.state.plan.autofit_applied = if fit.changes.is_empty() {
                vec!["the settings already fit; nothing changed".into()]
            } else {
                fit.changes.clone()
            };
        }
    }

    fn dry_run(&mut self) {
        // A dry run trains a real step: not on a planned machine.
        let real = self.state.planning_only().is_none();
        if let Some(request) = self.state.plan.request.clone().filter(|_| real) {
            self.state.plan.dry_run_running = true;
            self.jobs.dry_run(request, self.state.config.clone());
        }
    }

    fn save_config(&mut self, path: PathBuf) {
        let r = self.state.config.with_absolute_paths().save(&path);
        match r {
            Ok(()) => {
                self.state.export.config_message = Some(Ok(format!("saved {}", path.display())));
                push_recent(&mut self.state.settings.recent_configs, path.clone());
                self.state.settings.last_config = Some(path.clone());
                // Later relative edits resolve against the new location.
                if let Ok((c, _)) = load_config(&path) {
                    self.state.config = c;
                }
                self.state.config_path = Some(path);
            }
            Err(e) => self.state.export.config_message = Some(Err(e.to_string())),
        }
    }

    fn open_config(&mut self, path: PathBuf) {
        match load_config(&path) {
            Ok((c, problems)) => {
                self.state.set_config(c, Some(path.clone()));
                self.state.config_problems = problems;
                push_recent(&mut self.state.settings.recent_configs, path.clone());
                self.state.settings.last_config = Some(path.clone());
                self.state.export.config_message = Some(Ok(format!("loaded {}", path.display())));
                self.actions.push(Action::LoadModel);
            }
            Err(e) => self.state.export.config_message = Some(Err(e)),
        }
    }

    fn load_demo(&mut self) {
        match load_config(&demo_config_path()) {
            Ok((c, problems)) => {
                self.state.set_config(c, Some(demo_config_path()));
                self.state.config_problems = problems;
                self.state.settings.last_config = None;
            }
            Err(e) => self.state.config_problems = vec![e],
        }
        self.actions.push(Action::LoadModel);
    }

    fn export(&mut self) {
        let e = &self.state.export;
        let ck = PathBuf::from(e.checkpoint.trim());
        let dest = PathBuf::from(e.destination.trim());
        if e.checkpoint.trim().is_empty() || e.destination.trim().is_empty() {
            self.state.export.result = Some(Err(super::error::JobError::of(
                super::error::ErrorKind::Config,
                "choose a checkpoint folder and a destination folder first",
            )));
        } else {
            let request = super::jobs::ExportRequest {
                kind: e.kind,
                checkpoint: ck,
                dest,
                dtype: e.dtype.to_dtype(),
                gguf_quant: e.gguf_quant,
                replace: e.replace,
                progress: std::sync::Arc::clone(&e.progress),
            };
            e.progress
                .done_bytes
                .store(0, std::sync::atomic::Ordering::Relaxed);
            e.progress
                .total_bytes
                .store(0, std::sync::atomic::Ordering::Relaxed);
            self.state.export.running = true;
            self.state.export.result = None;
            self.jobs.export(request);
        }
    }

    fn refresh_history(&mut self) {
        let mut dirs = self.state.settings.run_dirs.clone();
        let out = self.state.output_dir();
        dirs.push(out.clone());
        if let Some(parent) = out.parent() {
            dirs.push(parent.to_path_buf());
        }
        self.state.history.loading = true;
        self.jobs.load_history(dirs);
    }

    fn pick(&mut self, target: PickTarget) {
        let base = self.state.config.base_dir.clone();
        let start = match target {
            PickTarget::ModelFolder => {
                super::state::dialog_dir(&self.state.model.source_input, &base)
            }
            PickTarget::DatasetFile | PickTarget::DatasetFolder => {
                super::state::dialog_dir(&self.state.dataset.path_input, &base)
            }
            PickTarget::Checkpoint | PickTarget::RunDir | PickTarget::OutputDir => {
                Some(self.state.output_dir()).filter(|p| p.is_dir())
            }
            _ => None,
        };
        if self.state.system_dialog.is_ok() {
            self.jobs.pick(target, start);
        } else {
            let (title, kind) = pick_kind(target);
            self.state
                .open_picker(PickFor::Studio(target), title, kind, start);
        }
    }

    /// Draws the in-app file picker when open; a choice goes where a system dialog's would.
    fn show_picker(&mut self, ctx: &egui::Context) {
        let Some((who, picker)) = self.state.picker.as_mut() else {
            return;
        };
        let who = *who;
        match picker.show(ctx) {
            PickerOutcome::Open => {}
            PickerOutcome::Cancelled => {
                self.state.picker = None;
                if let PickFor::Playground(p) = who {
                    if let Some(msg) = playground::picked(p, None) {
                        self.handle_job(JobOutput::Playground(msg));
                    }
                }
            }
            PickerOutcome::Chosen(path) => {
                self.state.picker = None;
                match who {
                    PickFor::Studio(target) => self.handle_job(JobOutput::Picked(target, path)),
                    PickFor::Playground(p) => {
                        if let Some(msg) = playground::picked(p, Some(path)) {
                            self.handle_job(JobOutput::Playground(msg));
                        }
                    }
                }
            }
        }
    }

    /// The status bar. The frame-time readout on the right is laid out first and the rest
    /// gets the width left of it, so a long message is cut short ("…", the whole of it on
    /// hover) instead of running under the readout.
    fn status_bar(&mut self, ui: &mut egui::Ui) {
        ui.with_layout(egui::Layout::right_to_left(egui::Align::Center), |ui| {
            self.frame_time_readout(ui);
            ui.with_layout(egui::Layout::left_to_right(egui::Align::Center), |ui| {
                // Whatever still does not fit is clipped at the readout, never drawn over it.
                ui.set_clip_rect(ui.max_rect().intersect(ui.clip_rect()));
                self.status_messages(ui);
            });
        });
    }

    /// The "frame time" toggle and, when on, the frame-time summary (right to left).
    fn frame_time_readout(&mut self, ui: &mut egui::Ui) {
        let r = ui
            .selectable_label(self.state.show_debug, RichText::new("frame time").small())
            .on_hover_text("Show the frame-time debug line");
        if r.clicked() {
            self.state.show_debug = !self.state.show_debug;
        }
        if self.state.show_debug {
            ui.label(
                RichText::new(self.state.frames.summary())
                    .small()
                    .weak()
                    .monospace(),
            );
        }
    }

    /// The status bar left of the readout: devices, the run, GPU memory, background jobs and
    /// the latest message.
    fn status_messages(&self, ui: &mut egui::Ui) {
        // Devices.
        match &self.state.devices.inventory {
            Some(inv) => {
                let gpus: Vec<String> = inv
                    .gpus()
                    .map(|g| format!("{} {} free", g.label(), theme::bytes(g.free_bytes)))
                    .collect();
                let cpu = inv
                    .cpu()
                    .map(|c| format!("CPU {} free", theme::bytes(c.free_bytes)))
                    .unwrap_or_default();
                let text = if gpus.is_empty() {
                    format!("{cpu} · no GPU")
                } else {
                    format!("{cpu} · {}", gpus.join(" · "))
                };
                let max = ui.available_width() * 0.5;
                status_text(ui, RichText::new(text).small(), max);
            }
            None => {
                ui.label(RichText::new("looking for devices…").small().weak());
            }
        }
        ui.separator();
        let font_msg = super::fonts::missing_font_message(ui.ctx());
        let toast = self
            .state
            .toast
            .as_ref()
            .filter(|(_, at)| at.elapsed() < Duration::from_secs(6))
            .map(|(msg, _)| msg);
        // The run: a long status leaves room for a message after it.
        let r = &self.state.run;
        let color = match r.phase {
            RunPhase::Running => theme::OK,
            RunPhase::Paused => theme::WARNING,
            RunPhase::Finished(train::FinishReason::Failed) => theme::ERROR,
            _ => ui.visuals().text_color(),
        };
        let share = if font_msg.is_some() || toast.is_some() {
            0.5
        } else {
            1.0
        };
        let max = ui.available_width() * share;
        status_text(ui, RichText::new(run_status(r)).small().color(color), max);
        // Each GPU's memory as the run last measured it.
        for (device, series) in r.memory.iter().filter(|(d, _)| d.starts_with("cuda")) {
            let Some(used) = series.used.last().map(|p| p[1]) else {
                continue;
            };
            let total = series
                .total_bytes
                .map(|t| format!(" / {:.1}", theme::gib(t)))
                .unwrap_or_default();
            ui.separator();
            ui.label(RichText::new(format!("{device} {used:.1}{total} GiB")).small());
        }
        let busy = self.jobs.in_flight();
        if busy > 0 {
            ui.separator();
            ui.add(egui::Spinner::new().size(12.0));
            ui.label(
                RichText::new(format!("{busy} background job(s)"))
                    .small()
                    .weak(),
            );
        }
        // Said once, in one place: the first character drawn without a font names it.
        if let Some(msg) = font_msg {
            ui.separator();
            let max = ui.available_width() * if toast.is_some() { 0.5 } else { 1.0 };
            status_text(ui, RichText::new(msg).small().color(theme::WARNING), max);
        }
        if let Some(msg) = toast {
            ui.separator();
            let max = ui.available_width();
            status_text(ui, RichText::new(msg).small().color(theme::ACCENT), max);
        }
    }

    fn navigation(&mut self, ui: &mut egui::Ui) {
        ui.add_space(8.0);
        ui.label(
            RichText::new("tunestudio")
                .size(20.0)
                .strong()
                .color(theme::ACCENT),
        );
        ui.label(RichText::new("fine-tuning studio").small().weak());
        ui.add_space(12.0);
        for (i, p) in Panel::ALL.iter().enumerate() {
            let badge = self.nav_badge(*p);
            let selected = self.state.panel == *p;
            let text = RichText::new(format!("{}  {}", i + 1, p.title())).size(15.0);
            ui.horizontal(|ui| {
                let r = ui.add(
                    // The grow atom pushes the title to the left edge.
                    egui::Button::selectable(selected, (text, egui::Atom::grow()))
                        .min_size(egui::vec2(150.0, 28.0)),
                );
                if r.clicked() {
                    self.state.panel = *p;
                }
                if let Some((color, tip)) = badge {
                    let (rect, resp) =
                        ui.allocate_exact_size(egui::vec2(10.0, 10.0), egui::Sense::hover());
                    ui.painter().circle_filled(rect.center(), 4.0, color);
                    resp.on_hover_text(tip);
                }
            });
        }
        ui.add_space(16.0);
        ui.separator();
        if let Some(p) = &self.state.config_path {
            ui.label(RichText::new("Run config").small().weak());
            ui.add(egui::Label::new(RichText::new(p.display().to_string()).small()).wrap());
        }
        if !self.state.config_problems.is_empty() {
            ui.label(
                RichText::new(format!(
                    "{} config problem(s)",
                    self.state.config_problems.len()
                ))
                .small()
                .color(theme::WARNING),
            )
            .on_hover_text(self.state.config_problems.join("\n"));
        }
        ui.add_space(6.0);
        if ui
            .button("Load demo project")
            .on_hover_text(
                "The bundled tiny model, tokenizer and dataset: trains offline in about a minute",
            )
            .clicked()
        {
            self.actions.push(Action::LoadDemo);
        }
    }

    /// A status dot for a navigation entry.
    fn nav_badge(&self, p: Panel) -> Option<(Color32, String)> {
        let s = &self.state;
        match p {
            Panel::Model => {
                if s.model.error.is_some() {
                    Some((theme::ERROR, "the model could not be loaded".into()))
                } else if s.model.info.is_some() {
                    Some((theme::OK, "model ready".into()))
                } else {
                    None
                }
            }
            Panel::Dataset => {
                if s.dataset.error.is_some() {
                    Some((theme::ERROR, "the dataset could not be read".into()))
                } else {
                    s.dataset
                        .summary
                        .as_ref()
                        .map(|d| (theme::OK, format!("{} rows", d.num_rows)))
                }
            }
            Panel::Preview => s
                .preview
                .preview
                .as_ref()
                .map(|p| p.lints.as_slice())
                .or_else(|| s.preview.pairs.preview().map(|p| p.lints.as_slice()))
                .map(|lints| {
                    if tunestudio::data::has_errors(lints) {
                        (theme::ERROR, "the dataset has error-level lints".into())
                    } else if !lints.is_empty() {
                        (theme::WARNING, format!("{} lint(s)", lints.len()))
                    } else {
                        (theme::OK, "no lints".into())
                    }
                }),
            Panel::Devices => s.plan.plan.as_ref().map(|p| match p.verdict {
                tunestudio::plan::Verdict::Fits => (theme::OK, "fits".into()),
                tunestudio::plan::Verdict::Tight => (theme::WARNING, "fits, tight".into()),
                tunestudio::plan::Verdict::OutOfMemory => (theme::ERROR, p.summary.clone()),
            }),
            Panel::Run => match s.run.phase {
                RunPhase::Running | RunPhase::Loading => Some((theme::OK, "training".into())),
                RunPhase::Paused => Some((theme::WARNING, "paused".into())),
                RunPhase::Finished(train::FinishReason::Failed) => {
                    Some((theme::ERROR, "the run failed".into()))
                }
                _ => None,
            },
            _ => None,
        }
    }

    fn drive_screenshot(&mut self) {
        let Some(shot) = &mut self.screenshot else {
            return;
        };
        if shot.saved {
            return;
        }
        let image = shot.image.lock().ok().and_then(|mut g| g.take());
        if let Some(img) = image {
            let r = save_png(&shot.path, &img);
            match r {
                Ok(()) => eprintln!("screenshot saved to {}", shot.path.display()),
                Err(e) => eprintln!("error: cannot save the screenshot: {e}"),
            }
            // The Run chart's figures as the caption under it shows them, in bytes, for a
            // script (or test) that compares the studio's measured peak with its plan.
            for (device, series) in &self.state.run.memory {
                eprintln!(
                    "run chart: {device} peak_bytes={} predicted_peak_bytes={}",
                    series.peak_bytes,
                    series
                        .predicted_peak_bytes
                        .map_or_else(|| "none".to_string(), |p| p.to_string())
                );
            }
            shot.saved = true;
            if let Some(h) = &self.state.run.handle {
                let _ = h.send(Command::Stop);
            }
            self.ctx.send_viewport_cmd(egui::ViewportCommand::Close);
            return;
        }
        if shot.requested {
            self.ctx.request_repaint_after(Duration::from_millis(50));
            return;
        }
        let elapsed = shot.started.elapsed();
        // Start the demo once the background jobs are done and the plan is of the current
        // settings, so the memory chart has the predicted peak a user sees (with the Preview
        // scan's trained tokens, not the every-position bound planned before the scan ends).
        if shot.train_steps.is_some()
            && self.state.run.phase == RunPhase::Idle
            && self.jobs.in_flight() == 0
            && !self.state.plan.loading
            && self.state.plan.plan.is_some()
            && self.state.plan.key == self.state.plan_key()
        {
            self.actions.push(Action::Start);
            self.ctx.request_repaint();
            return;
        }
        let jobs_done = self.jobs.in_flight() == 0;
        if jobs_done && self.frame_count > 8 {
            if let Some(target) = shot.pick.take() {
                shot.picked_at_frame = Some(self.frame_count);
                self.actions.push(Action::Pick(target));
                self.ctx.request_repaint();
                return;
            }
        }
        if let Some((_, p)) = &self.state.picker {
            if !self.state.picker_noted_on_stderr {
                self.state.picker_noted_on_stderr = true;
                let why = self.state.system_dialog.clone().err().unwrap_or_default();
                eprintln!(
                    "file dialog: the built-in picker ({why}), showing {}",
                    p.dir().display()
                );
            }
        }
        let steps_done = match shot.train_steps {
            None => true,
            Some(n) => {
                self.state.run.step >= n || matches!(self.state.run.phase, RunPhase::Finished(_))
            }
        };
        // Let a few frames settle layout (egui sizes some widgets on the first pass).
        let picker_drawn = shot
            .picked_at_frame
            .is_none_or(|f| self.frame_count > f + 4);
        let ready = jobs_done
            && steps_done
            && picker_drawn
            && self.frame_count > 8
            && elapsed > Duration::from_millis(800);
        if ready || elapsed > Duration::from_secs(180) {
            if shot.train_steps.is_some() {
                if let Some(h) = &self.state.run.handle {
                    let _ = h.send(Command::Pause);
                }
            }
            shot.requested = true;
            let slot = Arc::clone(&shot.image);
            let ctx = self.ctx.clone();
            self.ctx.request_screenshot(move |img| {
                if let Ok(mut g) = slot.lock() {
                    *g = Some(img);
                }
                ctx.request_repaint();
            });
        } else {
            self.ctx.request_repaint_after(Duration::from_millis(100));
        }
    }
}

/// A status-bar text in at most `max_width`, cut short with "…" (the whole text on hover);
/// nothing when there is no room at all.
fn status_text(ui: &mut egui::Ui, text: RichText, max_width: f32) {
    if max_width < 16.0 {
        return;
    }
    ui.scope(|ui| {
        ui.set_max_width(max_width);
        ui.add(egui::Label::new(text).truncate());
    });
}

/// The status bar's line about the run.
fn run_status(r: &RunState) -> String {
    match r.phase {
        RunPhase::Idle => "no run".to_string(),
        RunPhase::Loading => format!("run: {}", r.status),
        RunPhase::Running | RunPhase::Paused => {
            let loss = r
                .loss
                .last()
                .map(|p| format!(" · loss {:.4}", p[1]))
                .unwrap_or_default();
            format!(
                "run: step {}/{}{loss} · {:.0} tok/s{}",
                r.step,
                r.total_steps,
                r.tokens_per_sec,
                if r.phase == RunPhase::Paused {
                    " · paused"
                } else {
                    ""
                }
            )
        }
        RunPhase::Finished(_) => format!("run: {}", r.status),
    }
}

/// Writes an egui image as PNG.
pub fn save_png(path: &Path, img: &egui::ColorImage) -> Result<(), String> {
    let [w, h] = img.size;
    let mut raw = Vec::with_capacity(w * h * 4);
    for p in &img.pixels {
        raw.extend_from_slice(&p.to_srgba_unmultiplied());
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    image::save_buffer(path, &raw, w as u32, h as u32, image::ColorType::Rgba8)
        .map_err(|e| format!("{}: {e}", path.display()))
}

impl eframe::App for StudioApp {
    fn ui(&mut self, ui: &mut egui::Ui, _frame: &mut eframe::Frame) {
        let t0 = Instant::now();
        self.frame_count += 1;

        for out in self.jobs.drain() {
            self.handle_job(out);
        }
        self.poll_trainer();
        playground::tick(&mut self.state.playground, &self.jobs);
        // Opening the Playground lists the run's checkpoints again (in a job).
        if self.shown_panel != Some(self.state.panel) {
            self.shown_panel = Some(self.state.panel);
            self.state.playground.checkpoints_key = None;
        }
        self.show_picker(ui.ctx());
        self.run_actions();
        let has_weights = self
            .state
            .model
            .info
            .as_ref()
            .map(|i| !i.weight_files.is_empty());
        if let Some(note) =
            super::follow::follow(&mut self.state.follow, &mut self.state.config, has_weights)
        {
            self.state.toast(note);
        }
        self.schedule_jobs();

        egui::Panel::bottom("status")
            .frame(
                egui::Frame::side_top_panel(ui.style())
                    .inner_margin(egui::Margin::symmetric(10, 4)),
            )
            .show(ui, |ui| self.status_bar(ui));
        egui::Panel::left("nav")
            .resizable(false)
            .exact_size(190.0)
            .frame(
                egui::Frame::side_top_panel(ui.style())
                    .inner_margin(egui::Margin::symmetric(10, 6)),
            )
            .show(ui, |ui| self.navigation(ui));
        egui::CentralPanel::default()
            .frame(
                egui::Frame::central_panel(ui.style())
                    .inner_margin(egui::Margin::symmetric(18, 10)),
            )
            .show(ui, |ui| {
                let mut actions = Vec::new();
                let panel = self.state.panel;
                egui::ScrollArea::vertical()
                    .id_salt(("panel", panel as u8))
                    .auto_shrink([false, false])
                    .show(ui, |ui| match panel {
                        Panel::Model => panels::model::show(ui, &mut self.state, &mut actions),
                        Panel::Dataset => panels::dataset::show(ui, &mut self.state, &mut actions),
                        Panel::Preview => panels::preview::show(ui, &mut self.state, &mut actions),
                        Panel::Training => {
                            panels::training::show(ui, &mut self.state, &mut actions)
                        }
                        Panel::Devices => panels::devices::show(ui, &mut self.state, &mut actions),
                        Panel::Run => panels::run::show(ui, &mut self.state, &mut actions),
                        Panel::Export => panels::export::show(ui, &mut self.state, &mut actions),
                        Panel::Playground => playground::show(ui, &mut self.state, &mut actions),
                    });
                self.actions.extend(actions);
            });

        // Actions queued by this frame's clicks take effect now, not on the next input.
        if !self.actions.is_empty() {
            self.ctx.request_repaint();
        }
        // A spinner or a model download wants a steady repaint; everything else is event-driven.
        if self.state.model.loading.is_some() {
            self.ctx.request_repaint_after(Duration::from_millis(250));
        }
        // Each streamed token wakes the UI; this keeps the live tokens-per-second moving.
        if self.state.playground.busy() {
            self.ctx.request_repaint_after(Duration::from_millis(100));
        }
        self.drive_screenshot();
        self.state
            .frames
            .record(t0.elapsed().as_secs_f32() * 1000.0);
    }

    fn raw_input_hook(&mut self, _ctx: &egui::Context, raw_input: &mut egui::RawInput) {
        // Screenshots show the panels, not whatever the X server's pointer happens to hover.
        if self.screenshot.is_some() {
            raw_input.events.retain(|e| {
                !matches!(
                    e,
                    egui::Event::PointerMoved(_) | egui::Event::PointerButton { .. }
                )
            });
            raw_input.events.push(egui::Event::PointerGone);
        }
    }

    fn save(&mut self, storage: &mut dyn eframe::Storage) {
        if self.screenshot.is_some() {
            return;
        }
        self.state.settings.panel = self.state.panel;
        if let Some(p) = &self.state.config_path {
            if *p != demo_config_path() {
                self.state.settings.last_config = Some(p.clone());
            }
        }
        eframe::set_value(storage, SETTINGS_KEY, &self.state.settings);
    }

    fn on_exit(&mut self, _gl: Option<&eframe::glow::Context>) {
        // Ask a live run to stop after its current step; metrics are already on disk.
        if let Some(h) = &self.state.run.handle {
            let _ = h.send(Command::Stop);
        }
    }
}
