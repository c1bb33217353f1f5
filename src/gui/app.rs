//! The studio application: it owns the session, the panels, the jobs and the trainer
//! thread; routes job outputs and trainer events to the panel they belong to, starts
//! background work when the settings change, and carries out the [`Action`]s the panels
//! queue after the frame is drawn. Panels (in `panels/`, `playground/`) own their state and
//! view.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eframe::egui;

use tunestudio::plan::{Change, PlanRequest};
use tunestudio::train::{self, Command, RunConfig};

use super::action::Action;
use super::jobs::{FolderProposal, JobOutput, Jobs};
use super::panels::Panels;
use super::playground;
use super::reducer::{apply_job, sync_inputs_from_config};
use super::session::{push_recent, Panel, Session, Settings};

mod central;
mod chrome;
mod config_file;
mod pick;
mod schedule;
mod screenshot;
mod start_options;
mod trainer;

pub use super::jobs::load_config;
pub use super::session::demo_config_path;
pub use chrome::{Chrome, PickFor};
pub use schedule::plan_key;
use screenshot::Screenshot;
pub use start_options::StartOptions;

/// Storage key of [`Settings`].
const SETTINGS_KEY: &str = "tunestudio.settings";

/// The studio.
pub struct StudioApp {
    /// The document the panels share (the run config, the persisted settings).
    pub session: Session,
    /// Every panel's own state.
    pub panels: Panels,
    /// The window around the panels: status bar, toasts, file picker.
    pub chrome: Chrome,
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
    /// The trainer thread of the live run (its events fold into `panels.run.live`).
    trainer: Option<train::TrainerHandle>,
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
                    problems = vec![e.to_string()];
                    (RunConfig::default(), None)
                }
            },
        };
        if let Some(out) = &opts.output_dir {
            config.output_dir = std::path::absolute(out).unwrap_or_else(|_| out.clone());
        }
        let mut session = Session::new(config, path, settings);
        session.config_problems = problems;
        if let Some(p) = opts.panel {
            session.panel = p;
        }
        let chrome = Chrome {
            system_dialog: match &opts.no_system_dialog {
                Some(why) => Err(why.clone()),
                None => super::file_picker::system_dialog(),
            },
            ..Chrome::default()
        };
        let jobs = Jobs::new(ctx.clone());
        let mut app = StudioApp {
            session,
            panels: Panels::default(),
            chrome,
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
        sync_inputs_from_config(&app.session, &mut app.panels);
        app.jobs.discover_devices(app.nvml_library.clone());
        app.panels.devices.loading = true;
        app.jobs.scan_hub_cache();
        app.actions.push(Action::LoadModel);
        app.actions.push(Action::RefreshHistory);
        app
    }

    /// Routes a job's report to its panel (see [`apply_job`]) and queues what follows.
    fn handle_job(&mut self, out: JobOutput) {
        // The in-app picker is the window's, not a panel's.
        if let JobOutput::Folder(listing) = out {
            self.listed(listing);
            return;
        }
        let follow = apply_job(&mut self.session, &mut self.panels, out);
        self.actions.extend(follow);
    }

    /// Applies a planner request's settings to the run config (the one edit,
    /// `train::apply_plan_request`: LoRA's quantized base and a DPO run's reference included).
    fn apply_request(&mut self, req: &PlanRequest) {
        train::apply_plan_request(&mut self.session.config, req);
    }

    /// A new dataset gets its own settings: the format and columns are detected afresh
    /// (the previous file's `alpaca` would misread a pre-tokenized one), and `max_length`
    /// follows its lengths once the preview has them.
    fn new_dataset_settings(&mut self) {
        let d = &mut self.session.config.data;
        d.format = tunestudio::data::Format::Auto;
        d.columns = Default::default();
        d.txt_split = Default::default();
        d.allow.clear();
        self.panels.dataset.propose_max_length = true;
    }

    /// A new model or dataset is a new project: it gets a fresh output folder beside the
    /// current one (`runs/<model>-<data>`, numbered when taken) instead of writing into the
    /// previous run's. A job looks for a free name (`JobOutput::OutputProposed`); the answer
    /// is written only while the config is still of this project.
    fn propose_output_dir(&mut self) {
        let c = &self.session.config;
        let stem = |s: &str| {
            Path::new(s.trim_end_matches('/'))
                .file_stem()
                .map(|n| n.to_string_lossy().to_string())
                .unwrap_or_default()
        };
        let name = format!("{}-{}", stem(&c.model.source), stem(&c.data.path)).replace(
            |ch: char| !ch.is_alphanumeric() && ch != '-' && ch != '_',
            "-",
        );
        let parent = c
            .output_dir
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("runs"));
        let pending = &mut self.panels.run.pending;
        pending.proposal_seq += 1;
        pending.proposing = true;
        self.jobs.propose_output_dir(FolderProposal {
            seq: pending.proposal_seq,
            model: c.model.source.clone(),
            data: c.data.path.clone(),
            from: c.output_dir.clone(),
            parent,
            base: c.base_dir.clone(),
            name,
        });
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
            Action::FindLatestCheckpoint { use_it } => self
                .jobs
                .latest_checkpoint(self.session.output_dir(), use_it),
            Action::StartInNewFolder => {
                self.panels.run.live.existing_run = None;
                self.panels.run.pending.start_after_proposal = true;
                self.propose_output_dir();
            }
            Action::StartChecked { config, output_dir } => {
                self.start_checked(*config, output_dir);
            }
            Action::CancelStart => self.panels.run.live.existing_run = None,
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
                if let Some(req) = self.panels.devices.plan.request.clone() {
                    self.panels.devices.plan.autofit_running = true;
                    self.jobs.auto_fit(req);
                }
            }
            Action::ApplyAutoFit => self.apply_auto_fit(),
            Action::DryRun => self.dry_run(),
            Action::RefreshDevices => {
                self.panels.devices.loading = true;
                self.jobs.discover_devices(self.nvml_library.clone());
            }
            Action::Goto(p) => self.session.panel = p,
            Action::JumpToRow(row) => {
                self.panels.preview.start_row = row;
                self.panels.preview.highlight = Some(row);
                self.session.panel = Panel::Preview;
            }
            Action::SaveConfig(path) => self.save_config(path),
            Action::LoadConfig(path) => self.open_config(path),
            Action::LoadDemo => self.load_demo(),
            Action::Export => self.export(),
            Action::RefreshHistory => self.refresh_history(),
            Action::Pick(target) => self.pick(target),
            Action::PlaygroundPick(target) => self.pick_for_playground(target),
            Action::Playground(a) => {
                playground::apply(&mut self.panels.playground, &self.session, a, &self.jobs);
            }
            Action::Toast(text) => self.chrome.toast(text),
            Action::AddRunDir(dir) => {
                push_recent(&mut self.session.settings.run_dirs, dir);
                self.actions.push(Action::RefreshHistory);
            }
        }
    }

    fn load_model(&mut self) {
        let typed = self.panels.model.source_input.trim().to_string();
        if typed != self.session.config.model.source {
            self.session.config.model.source = typed;
            self.propose_output_dir();
        }
        self.panels.model.seq += 1;
        self.panels.model.loading = Some(Instant::now());
        self.panels.model.download_bytes = None;
        self.panels.model.error = None;
        self.jobs
            .load_model(self.panels.model.seq, self.session.config.clone());
    }

    fn scan_dataset(&mut self) {
        let path = self.panels.dataset.path_input.trim().to_string();
        let new = path != self.session.config.data.path;
        if new {
            self.new_dataset_settings();
        }
        self.session.config.data.path = path;
        if new {
            self.propose_output_dir();
        }
        self.panels.dataset.key.clear();
        self.panels.preview.key.clear();
        self.panels.preview.start_row = 0;
        let p = self.session.config.data.path.clone();
        if !p.is_empty() {
            push_recent(&mut self.session.settings.recent_datasets, p);
        }
    }

    fn apply_change(&mut self, change: &Change) {
        if let Some(req) = self.panels.devices.plan.request.clone() {
            let new = change.apply(&req);
            let text = change.describe(&req);
            self.apply_request(&new);
            self.chrome.toast(format!("applied: {text}"));
        }
    }

    fn apply_auto_fit(&mut self) {
        if let Some(fit) = self.panels.devices.plan.autofit.take() {
            self.apply_request(&fit.request);
            self.panels.devices.plan.autofit_applied = if fit.changes.is_empty() {
                vec!["the settings already fit; nothing changed".into()]
            } else {
                fit.changes.clone()
            };
        }
    }

    fn dry_run(&mut self) {
        // A dry run trains a real step: not on a planned machine.
        let real = self.planning_only().is_none();
        if let Some(request) = self.panels.devices.plan.request.clone().filter(|_| real) {
            self.panels.devices.plan.dry_run_running = true;
            self.jobs.dry_run(request, self.session.config.clone());
        }
    }

    fn export(&mut self) {
        let e = &self.panels.export;
        let ck = PathBuf::from(e.checkpoint.trim());
        let dest = PathBuf::from(e.destination.trim());
        if e.checkpoint.trim().is_empty() || e.destination.trim().is_empty() {
            self.panels.export.result = Some(Err(super::error::JobError::of(
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
            self.panels.export.running = true;
            self.panels.export.result = None;
            self.jobs.export(request);
        }
    }

    fn refresh_history(&mut self) {
        let mut dirs = self.session.settings.run_dirs.clone();
        let out = self.session.output_dir();
        dirs.push(out.clone());
        if let Some(parent) = out.parent() {
            dirs.push(parent.to_path_buf());
        }
        self.panels.run.history.loading = true;
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
        playground::tick(&mut self.panels.playground, &self.jobs);
        // Opening the Playground lists the run's checkpoints again (in a job).
        if self.shown_panel != Some(self.session.panel) {
            self.shown_panel = Some(self.session.panel);
            self.panels.playground.checkpoints_key = None;
        }
        self.show_picker(ui.ctx());
        self.run_actions();
        // A picker opened by an action lists its first folder now, not a frame later.
        self.request_listing();
        let has_weights = self
            .panels
            .model
            .info
            .as_ref()
            .map(|i| !i.weight_files.is_empty());
        if let Some(note) = super::follow::follow(
            &mut self.session.follow,
            &mut self.session.config,
            has_weights,
        ) {
            self.chrome.toast(note);
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
                let actions = self.show_panel(ui);
                self.actions.extend(actions);
            });

        // Actions queued by this frame's clicks take effect now, not on the next input.
        if !self.actions.is_empty() {
            self.ctx.request_repaint();
        }
        // A spinner or a model download wants a steady repaint; everything else is event-driven.
        if self.panels.model.loading.is_some() {
            self.ctx.request_repaint_after(Duration::from_millis(250));
        }
        // Each streamed token wakes the UI; this keeps the live tokens-per-second moving.
        if self.panels.playground.busy() {
            self.ctx.request_repaint_after(Duration::from_millis(100));
        }
        self.drive_screenshot();
        self.chrome
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
        self.session.settings.panel = self.session.panel;
        if let Some(p) = &self.session.config_path {
            if *p != demo_config_path() {
                self.session.settings.last_config = Some(p.clone());
            }
        }
        eframe::set_value(storage, SETTINGS_KEY, &self.session.settings);
    }

    fn on_exit(&mut self, _gl: Option<&eframe::glow::Context>) {
        // Ask a live run to stop after its current step; metrics are already on disk.
        if let Some(h) = &self.trainer {
            let _ = h.send(Command::Stop);
        }
    }
}
