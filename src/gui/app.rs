//! The studio application: navigation, status bar, and the loop that feeds
//! job outputs and trainer events into the state and starts background work
//! when the settings change. Panels (in `panels/`) draw the state and queue
//! [`Action`]s; the app carries them out after the frame is drawn.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eframe::egui;

use tunestudio::plan::{Change, PlanRequest};
use tunestudio::train::{self, Command, RunConfig};

use super::jobs::{JobOutput, Jobs};
use super::panels;
use super::playground;
use super::reducer::apply_job;
use super::state::{push_recent, AppState, Panel, Settings};

mod action;
mod chrome;
mod config_file;
mod pick;
mod screenshot;
mod trainer;

pub use action::{Action, StartOptions};
pub use config_file::load_config;
use screenshot::Screenshot;

/// Storage key of [`Settings`].
const SETTINGS_KEY: &str = "tunestudio.settings";

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
    /// The trainer thread of the live run (its events fold into `state.run`).
    trainer: Option<train::TrainerHandle>,
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
            trainer: None,
        };
        app.jobs.discover_devices(app.nvml_library.clone());
        app.state.devices.loading = true;
        app.jobs.scan_hub_cache();
        app.actions.push(Action::LoadModel);
        app.actions.push(Action::RefreshHistory);
        app
    }

    /// Folds a job's report into the state (see [`apply_job`]) and queues what follows.
    fn handle_job(&mut self, out: JobOutput) {
        let follow = apply_job(&mut self.state, out);
        self.actions.extend(follow);
    }

    /// Starts background work the current settings need (dataset scan, preview, plan). The
    /// keys compare the settings as written and read no disk; the jobs resolve paths and
    /// measure files on their own threads.
    fn schedule_jobs(&mut self) {
        let s = &mut self.state;
        if let Some(seq) = next_request(s.dataset_key(), &mut s.dataset.key, &mut s.dataset.seq) {
            s.dataset.loading = true;
            self.jobs.scan_dataset(seq, s.config.clone());
        }
        if let Some(dir) = s.model.info.as_ref().map(|i| i.dir.display().to_string()) {
            let key = format!("{dir}|{}", s.preview_key());
            if let Some(seq) = next_request(key, &mut s.preview.key, &mut s.preview.seq) {
                s.preview.loading = true;
                let rows = (
                    s.preview.start_row,
                    s.config.training.micro_batch.clamp(1, 16),
                );
                let limits = s.config.preference.limits();
                self.jobs.preview(seq, dir, s.config.clone(), rows, limits);
            }
        }
        let Some(key) = s.plan_key() else {
            return;
        };
        let Some(seq) = next_request(Some(key.clone()), &mut s.plan.key, &mut s.plan.seq) else {
            return;
        };
        match key.devices {
            Ok(devices) => {
                s.plan.loading = true;
                self.jobs
                    .plan(seq, key.model, key.config, devices, key.trained_tokens);
            }
            Err(e) => {
                s.plan.error = Some(super::error::JobError::of(
                    super::error::ErrorKind::Config,
                    e,
                ));
                s.plan.plan = None;
            }
        }
    }

    /// Applies a planner request's settings to the run config (the one edit,
    /// `train::apply_plan_request`: LoRA's quantized base and a DPO run's reference included).
    fn apply_request(&mut self, req: &PlanRequest) {
        train::apply_plan_request(&mut self.state.config, req);
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
            .find(|n| !super::disk::exists(&base.join(n)))
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
        self.state.model.seq += 1;
        self.state.model.loading = Some(Instant::now());
        self.state.model.download_bytes = None;
        self.state.model.error = None;
        self.jobs
            .load_model(self.state.model.seq, self.state.config.clone());
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
        if let Some(h) = &self.trainer {
            let _ = h.send(Command::Stop);
        }
    }
}
