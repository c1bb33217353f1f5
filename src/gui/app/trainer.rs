//! The trainer side of the app: starting a run on its own thread (the app holds the
//! handle; the run state only folds its events) once a job has checked its output folder,
//! commands to it, draining its events, and asking a job for the out-of-memory refit.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tunestudio::train::{self, Command, RunConfig, Trainer};

use super::{Action, StudioApp};
use crate::gui::run_state::{RunPhase, RunState};
use crate::gui::session::{push_recent, Panel};

impl StudioApp {
    pub(super) fn poll_trainer(&mut self) {
        let events = match &self.trainer {
            Some(h) => h.drain(),
            None => return,
        };
        for e in events {
            self.panels.run.live.apply(e);
        }
        if matches!(self.panels.run.live.phase, RunPhase::Finished(_)) {
            if let Some(h) = self.trainer.take() {
                // The thread has sent Finished; joining returns at once.
                h.join();
                self.actions.push(Action::RefreshHistory);
            }
        }
    }

    /// Start: a resumed run starts at once; a new one after a job has looked for another
    /// run in its output folder (`JobOutput::OutputChecked`: the Run panel asks about one,
    /// else [`Action::StartChecked`] starts it). Start shows busy meanwhile.
    pub(super) fn start_training(&mut self, resume_latest: bool) {
        if self.panels.run.live.is_active() || self.panels.run.pending.busy() {
            return;
        }
        // A planned machine's GPUs are not here: the trainer would fail to open them.
        if let Some(cmd) = self.planning_only() {
            self.chrome.toast(format!(
                "planning only: train on the planned machine with `{cmd}`"
            ));
            return;
        }
        let mut config = self.session.config.clone();
        if let Some(s) = &self.screenshot {
            if s.train_steps.is_some() {
                config.output_dir = std::env::temp_dir()
                    .join(format!("tunestudio-screenshot-{}", std::process::id()));
            }
        }
        let out = config.output_path();
        let abs_out = std::path::absolute(&out).unwrap_or(out);
        if resume_latest {
            self.spawn_trainer(config, abs_out, true);
            return;
        }
        // Never into another run's folder unannounced (the CLI refuses): a job looks.
        let pending = &mut self.panels.run.pending;
        pending.check_seq += 1;
        pending.checking = true;
        self.panels.run.live.existing_run = None;
        self.jobs
            .check_output_dir(pending.check_seq, config, abs_out);
    }

    /// Starts the run whose output folder was checked, unless one started meanwhile.
    pub(super) fn start_checked(&mut self, config: RunConfig, output_dir: PathBuf) {
        if !self.panels.run.live.is_active() {
            self.spawn_trainer(config, output_dir, false);
        }
    }

    /// Starts the trainer thread on `config`, writing to `abs_out`.
    fn spawn_trainer(&mut self, config: RunConfig, abs_out: PathBuf, resume_latest: bool) {
        push_recent(&mut self.session.settings.run_dirs, abs_out.clone());
        let mut run = RunState {
            phase: RunPhase::Loading,
            status: "starting".into(),
            started_at: Some(Instant::now()),
            output_dir: Some(abs_out),
            ..RunState::default()
        };
        if let Some(plan) = &self.panels.devices.plan.plan {
            run.expect_plan(&config.devices.devices, plan);
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
        self.trainer = Some(handle);
        self.panels.run.live = run;
        self.session.panel = Panel::Run;
    }

    pub(super) fn send(&mut self, cmd: Command) {
        if let Some(h) = &self.trainer {
            if !h.send(cmd) {
                self.chrome.toast("the trainer has already ended");
            }
        }
    }

    /// After an out-of-memory stop: a job fits the settings (`JobOutput::Refitted`: they are
    /// applied and the run resumes from its checkpoint, or the error is shown).
    pub(super) fn refit_and_resume(&mut self) {
        let pending = &mut self.panels.run.pending;
        if pending.refitting {
            return;
        }
        pending.refit_seq += 1;
        pending.refitting = true;
        self.jobs
            .refit_after_oom(pending.refit_seq, self.session.config.clone());
    }
}
