//! The live run: a reducer of the trainer's events (`RunState::apply`) with no drawing,
//! no I/O and no thread handle (the trainer's handle is the app's). The Run panel draws it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tunestudio::train::render::{self, EventRenderer};
use tunestudio::train::{self, Event, FinishReason, LintFinding};

use crate::gui::error::{ErrorKind, JobError};

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
    /// GRPO: (step, value) of the mean reward (`reward`) and of each function's mean
    /// (`rewards/<name>/mean`), by TRL's metric name.
    pub rewards: BTreeMap<String, Vec<[f64; 2]>>,
    /// GRPO: the last step's first prompt and its sampled completions, with that step.
    pub completions: Option<(u64, tunestudio::train::SampledGroup)>,
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

/// Whether a step metric is one the Run panel's reward chart draws: GRPO's mean reward and each
/// reward function's mean.
pub fn is_reward_curve(name: &str) -> bool {
    name == "reward" || (name.starts_with("rewards/") && name.ends_with("/mean"))
}

impl Default for RunState {
    fn default() -> Self {
        RunState {
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
            rewards: BTreeMap::new(),
            completions: None,
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

    /// The plan's predicted peaks and capacities per device, for the memory chart (`devices`:
    /// the config's device entries, in the plan's order). The trainer samples the CPU once
    /// (logical CPU devices share this process) and each GPU by `cuda:N`, so the plan's
    /// devices are keyed the same way.
    pub fn expect_plan(&mut self, devices: &[String], plan: &tunestudio::plan::Plan) {
        for (entry, dp) in devices.iter().zip(plan.per_device.iter()) {
            let name = entry.split('=').next().unwrap_or(entry).trim();
            let label = if name.starts_with("cpu") { "cpu" } else { name };
            let series = self.memory.entry(label.to_string()).or_default();
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

    fn log(&mut self, level: LogLevel, text: String) {
        let secs = self.started_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.log.push(LogLine { secs, level, text });
    }

    /// Folds one trainer event into the state.
    pub fn apply(&mut self, event: Event) {
        self.events_received += 1;
        train::dispatch(&event, self);
    }
}

/// The reducer: each kind of trainer event folded into the run's state and log.
impl EventRenderer for RunState {
    fn status(&mut self, message: &str) {
        self.status = message.to_string();
        self.log(LogLevel::Info, message.to_string());
    }

    fn started(&mut self, e: render::Started<'_>) {
        self.phase = RunPhase::Running;
        self.total_steps = e.total_steps;
        self.start_step = e.start_step;
        self.step = e.start_step;
        self.parameters = Some((e.num_parameters, e.trainable_parameters));
        self.status = "training".into();
        let resumed = e
            .resumed_from
            .map(|p| format!(", resumed from {}", p.display()))
            .unwrap_or_default();
        self.log(
            LogLevel::Info,
            format!(
                "started: {} steps, {} training rows, {} validation rows, \
                 {} of {} parameters trained{resumed}; writing to {}",
                e.total_steps,
                e.train_rows,
                e.eval_rows,
                crate::gui::theme::count(e.trainable_parameters),
                crate::gui::theme::count(e.num_parameters),
                e.output_dir.display()
            ),
        );
        self.output_dir = Some(e.output_dir.to_path_buf());
    }

    fn step(&mut self, e: render::Step<'_>) {
        let step = e.step;
        self.step = step;
        if e.loss.is_finite() {
            self.loss.push([step as f64, e.loss]);
        }
        self.lr.push([step as f64, e.lr]);
        for (name, &value) in e.metrics {
            if is_reward_curve(name) && value.is_finite() {
                let curve = self.rewards.entry(name.clone()).or_default();
                curve.push([step as f64, value]);
            }
        }
        if e.tokens_per_sec.is_finite() {
            self.tokens_per_sec = e.tokens_per_sec;
        }
        self.trained_tokens = e.trained_tokens;
        self.elapsed_secs = e.elapsed_secs;
        self.epoch = e.epoch;
        if e.skipped {
            self.log(
                LogLevel::Warning,
                format!(
                    "step {step}: gradients overflowed in fp16; update skipped, loss scale lowered"
                ),
            );
        }
    }

    fn eval(&mut self, e: render::Eval) {
        if e.loss.is_finite() {
            self.eval_loss.push([e.step as f64, e.loss]);
        }
        self.log(
            LogLevel::Info,
            format!(
                "eval at step {}: loss {:.4}, perplexity {:.2}",
                e.step, e.loss, e.perplexity
            ),
        );
    }

    fn memory(&mut self, e: render::Memory<'_>) {
        let series = self.memory.entry(e.device.to_string()).or_default();
        series.scope = e.scope;
        series
            .used
            .push([e.step as f64, crate::gui::theme::gib(e.used_bytes)]);
        series.peak_bytes = series.peak_bytes.max(e.peak_bytes);
        if e.total_bytes.is_some() {
            series.total_bytes = e.total_bytes;
        }
    }

    fn checkpoint_saved(&mut self, step: u64, path: &Path) {
        self.log(
            LogLevel::Info,
            format!("checkpoint at step {step}: {}", path.display()),
        );
        self.last_checkpoint = Some(path.to_path_buf());
    }

    fn paused(&mut self, step: u64) {
        self.phase = RunPhase::Paused;
        self.status = format!("paused after step {step}");
        self.log(LogLevel::Info, format!("paused after step {step}"));
    }

    fn resumed(&mut self, step: u64) {
        self.phase = RunPhase::Running;
        self.status = "training".into();
        self.log(LogLevel::Info, format!("resumed at step {step}"));
    }

    /// The divergence watch saw a spike: a marker on the loss chart, the rate to resume with.
    fn divergence(&mut self, e: render::Divergence) {
        self.divergences.push([e.step as f64, e.loss]);
        self.suggested_learning_rate = Some(e.suggested_learning_rate);
        self.log(
            LogLevel::Warning,
            format!(
                "the loss diverged at step {}: {:.4} against a recent median of {:.4}{}; resume with learning rate {:e}",
                e.step,
                e.loss,
                e.median_loss,
                if e.stopped { ", so the run stopped" } else { "" },
                e.suggested_learning_rate
            ),
        );
    }

    fn warning(&mut self, message: &str) {
        self.log(LogLevel::Warning, message.to_string());
    }

    fn error(&mut self, e: render::ErrorReport<'_>) {
        // The kind comes from the trainer's own `out_of_memory` event, not the words;
        // the hint is said once even when the message already ends with it.
        let kind = if self.out_of_memory_reported {
            ErrorKind::OutOfMemory
        } else {
            ErrorKind::Other
        };
        let err = JobError::new(kind, e.message.to_string(), Some(e.hint.to_string()));
        let hint = err.hint.unwrap_or_default();
        self.log(LogLevel::Error, format!("{} — {hint}", err.message));
        self.error = Some(RunError {
            message: err.message,
            hint,
            kind,
            step: e.step,
        });
    }

    fn lints_blocked(&mut self, lints: &[LintFinding]) {
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

    fn out_of_memory(&mut self, e: render::OutOfMemory<'_>) {
        let saved = e.checkpoint.map_or("no checkpoint yet".to_string(), |p| {
            format!("checkpoint {}", p.display())
        });
        self.log(
            LogLevel::Error,
            format!(
                "{} ran out of memory at step {} ({}{}); {saved}",
                e.device,
                e.step,
                e.phase,
                tunestudio::train::oom::planned_and_observed(e.planned_bytes, e.observed_bytes)
            ),
        );
        self.out_of_memory_reported = true;
        self.oom_refit = if e.checkpoint.is_some() && e.refit_error.is_none() {
            Some(e.refit.to_vec())
        } else {
            None
        };
        if let Some(why) = e.refit_error {
            self.log(LogLevel::Warning, why.to_string());
        }
    }

    fn lint_allowed(&mut self, lint: &LintFinding) {
        self.log(
            LogLevel::Warning,
            format!(
                "training despite lint `{}` ({} rows), allowed by [data] allow: {}",
                lint.lint, lint.count, lint.message
            ),
        );
        self.allowed_lints.push(lint.clone());
    }

    fn completions(&mut self, step: u64, group: &tunestudio::train::SampledGroup) {
        self.completions = Some((step, group.clone()));
    }

    fn finished(&mut self, e: render::Finished<'_>) {
        let (reason, step) = (e.reason, e.step);
        self.phase = RunPhase::Finished(reason);
        self.step = self.step.max(step);
        if e.elapsed_secs > 0.0 {
            self.elapsed_secs = e.elapsed_secs;
        }
        if let Some(p) = e.last_checkpoint {
            self.last_checkpoint = Some(p.to_path_buf());
        }
        let what = match reason {
            FinishReason::Completed => "completed",
            FinishReason::Stopped => "stopped",
            FinishReason::Failed => "failed",
            FinishReason::Diverged => "stopped: the loss diverged",
        };
        let fl = e
            .final_loss
            .map(|l| format!(", loss {l:.4}"))
            .unwrap_or_default();
        let fe = e
            .final_eval_loss
            .map(|l| format!(", eval loss {l:.4}"))
            .unwrap_or_default();
        self.status = format!("{what} at step {step}");
        let level = if reason == FinishReason::Failed {
            LogLevel::Error
        } else {
            LogLevel::Info
        };
        self.log(level, format!("{what} at step {step}{fl}{fe}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
