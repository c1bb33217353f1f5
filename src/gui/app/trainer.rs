//! The trainer side of the app: starting a run on its own thread (the app holds the
//! handle; the run state only folds its events), commands to it, and draining its events.

use std::sync::Arc;
use std::time::Instant;

use tunestudio::train::{self, Command, Trainer};

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

    pub(super) fn start_training(&mut self, resume_latest: bool) {
        if self.panels.run.live.is_active() {
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
        // Never into another run's folder unannounced: ask (the Run panel offers resuming it
        // or a new folder), as the CLI refuses.
        if !resume_latest {
            if let Some(existing) = train::existing_run(&abs_out) {
                self.panels.run.live.existing_run = Some(existing);
                self.session.panel = Panel::Run;
                return;
            }
        }
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

    /// After an out-of-memory stop: the fitted settings, then resume from the checkpoint.
    pub(super) fn refit_and_resume(&mut self) {
        match train::oom::refit_after_oom(&self.session.config) {
            Ok(refit) => {
                self.session.config = refit.config;
                self.chrome
                    .toast(format!("resuming with: {}", refit.changes.join("; ")));
                self.start_training(true);
            }
            Err(e) => self.chrome.toast(e),
        }
    }
}
