//! The background trainer thread the GUI drives.
//!
//! ```text
//! GUI ──Command──▶ trainer thread ──Event──▶ GUI (waker() after each event → repaint)
//!                        │
//!                        └──▶ <output>/metrics.jsonl (every event, one JSON line)
//! ```
//!
//! The thread waits for [`Command::Start`] (unless [`TrainerOptions::start_immediately`]),
//! loads everything, and runs steps, checking for commands between steps. Errors (and even
//! panics) inside a step end the run with an [`Event::Error`] and [`Event::Finished`]; they
//! never take the process down.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use super::config::RunConfig;
use super::error::{Phase, TrainError};
use super::events::{Command, Event, FinishReason};
use super::metrics::{MetricsWriter, METRICS_FILE};
use super::step::{panic_message, TrainingRun};

mod out_of_memory;
mod step_events;
use step_events::{last_group, step_event};

use out_of_memory::report_out_of_memory;

/// Called after every event (e.g. `ctx.request_repaint()` in the GUI).
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// How the thread starts.
#[derive(Debug, Clone, Default)]
pub struct TrainerOptions {
    /// Continue from this checkpoint folder.
    pub resume_from: Option<PathBuf>,
    /// Continue from the newest checkpoint in the output folder, if there is one.
    pub resume_latest: bool,
    /// Resume even when the run config differs from the checkpoint's in a way that breaks
    /// the exact continuation (`--allow-config-change`).
    pub allow_config_change: bool,
    /// Start without waiting for [`Command::Start`].
    pub start_immediately: bool,
    /// Train even when the memory planner predicts that host memory runs out
    /// (on the CPU an allocation failure aborts the whole process, so by default such a run
    /// is refused with an error event naming the fixes).
    pub ignore_memory_plan: bool,
    /// The NVML library the memory samples read GPUs through (`None`: `$TUNESTUDIO_NVML_LIB`,
    /// then the driver's); the studio passes the one its device discovery used.
    pub nvml_library: Option<PathBuf>,
    /// Test switch: `STEP:PHASE` makes that step of this run fail once with an out-of-memory
    /// error, as [`super::oom::INJECT_OOM_ENV`] does for every run of the process (the
    /// studio's tests, whose runs share one process). `None` in normal use.
    pub inject_oom: Option<String>,
    /// One rank of a launched run (torchrun, Slurm): the process group of its ranks, from the
    /// rendezvous. Only rank 0 writes metrics.jsonl and checkpoints. `None`: a run in one
    /// process.
    pub world: Option<Arc<crate::devices::parallel::process_group::ProcessGroup>>,
}

/// The front end's side of a trainer thread.
pub struct TrainerHandle {
    /// Send commands here.
    pub commands: Sender<Command>,
    /// Receive events here (in order; the last one is `Finished`).
    pub events: Receiver<Event>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TrainerHandle {
    /// Sends a command; false when the thread has ended.
    pub fn send(&self, command: Command) -> bool {
        self.commands.send(command).is_ok()
    }

    /// Every event available now, without blocking.
    pub fn drain(&self) -> Vec<Event> {
        self.events.try_iter().collect()
    }

    /// True when the thread has ended.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits for the thread to end (send `Stop` first to end it early).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Spawns trainer threads.
pub struct Trainer;

impl Trainer {
    /// Spawns a trainer thread for `config` that waits for [`Command::Start`].
    /// Dropping the handle (closing the command channel) stops the run after the current step.
    pub fn spawn(config: RunConfig, waker: Option<Waker>) -> TrainerHandle {
        Self::spawn_with(config, TrainerOptions::default(), waker)
    }

    /// Spawns a trainer thread with options (resume, start immediately).
    pub fn spawn_with(
        config: RunConfig,
        options: TrainerOptions,
        waker: Option<Waker>,
    ) -> TrainerHandle {
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded();
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("tunestudio-trainer".into())
            .spawn(move || {
                let mut emitter = Emitter {
                    tx: ev_tx,
                    waker,
                    metrics: None,
                };
                super::oom::inject_on_this_thread(options.inject_oom.clone());
                // The last resort: nothing a run does may take the thread down silently.
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    thread_main(config, options, cmd_rx, &mut emitter)
                }));
                // The run's tensors are dropped: hand the pooled large blocks back to the OS so
                // the studio's resident set falls to what it holds between runs.
                crate::mem::release_free_blocks();
                if let Err(payload) = result {
                    emitter.emit(Event::Error {
                        message: format!("internal error: {}", panic_message(&payload)),
                        hint: "please report it; resume from the last checkpoint".into(),
                        phase: None,
                        step: None,
                    });
                    emitter.emit(Event::Finished {
                        reason: FinishReason::Failed,
                        step: 0,
                        final_loss: None,
                        final_eval_loss: None,
                        elapsed_secs: 0.0,
                        last_checkpoint: None,
                    });
                }
            });
        let thread = match thread {
            Ok(t) => Some(t),
            Err(e) => {
                // No thread: report through a channel the front end still reads.
                let (tx, rx) = crossbeam_channel::unbounded();
                let _ = tx.send(Event::Error {
                    message: format!("cannot start the trainer thread: {e}"),
                    hint: "the system is out of threads or memory; close other programs".into(),
                    phase: Some(Phase::Setup),
                    step: None,
                });
                return TrainerHandle {
                    commands: cmd_tx,
                    events: rx,
                    thread: None,
                };
            }
        };
        TrainerHandle {
            commands: cmd_tx,
            events: ev_rx,
            thread,
        }
    }
}

/// Sends events, appends them to metrics.jsonl and wakes the front end.
struct Emitter {
    tx: Sender<Event>,
    waker: Option<Waker>,
    metrics: Option<MetricsWriter>,
}

impl Emitter {
    fn emit(&mut self, event: Event) {
        let mut warning = None;
        if let Some(m) = &mut self.metrics {
            if !matches!(event, Event::Status { .. }) {
                if let Err(e) = m.append(&event) {
                    warning = Some(format!("metrics are no longer recorded: {e}"));
                    self.metrics = None;
                }
            }
        }
        // A closed receiver only means nobody listens any more; training goes on.
        let _ = self.tx.send(event);
        if let Some(w) = warning {
            let _ = self.tx.send(Event::Warning { message: w });
        }
        if let Some(w) = &self.waker {
            w();
        }
    }

    fn error(&mut self, err: &TrainError, step: Option<u64>) {
        if let TrainError::Lints { lints } = err {
            self.emit(Event::LintsBlocked {
                lints: lints.iter().map(Into::into).collect(),
            });
        }
        let phase = match err {
            TrainError::Step { phase, .. } => Some(*phase),
            TrainError::Checkpoint { .. } => Some(Phase::Checkpoint),
            _ => None,
        };
        self.emit(Event::Error {
            message: err.to_string(),
            hint: err.hint(),
            phase,
            step,
        });
    }
}

/// What the command loop decided.
enum Control {
    Continue,
    Stop,
}

/// The trainer thread: waits for Start (unless told to start at once), checks the memory plan,
/// builds or resumes the run, then trains until done, stopped or failed.
fn thread_main(
    config: RunConfig,
    options: TrainerOptions,
    commands: Receiver<Command>,
    em: &mut Emitter,
) {
    let finish = |em: &mut Emitter, reason, run: Option<&TrainingRun>| {
        em.emit(Event::Finished {
            reason,
            step: run.map_or(0, |r| r.step_index()),
            final_loss: run.and_then(|r| r.last_loss()),
            final_eval_loss: run.and_then(|r| r.last_eval_loss()),
            elapsed_secs: run.map_or(0.0, |r| r.elapsed_secs()),
            last_checkpoint: run.and_then(|r| r.last_checkpoint().map(|p| p.to_path_buf())),
        })
    };

    if !options.start_immediately && !wait_for_start(&commands) {
        return finish(em, FinishReason::Stopped, None);
    }
    if !check_memory_plan(&config, &options, em) {
        return finish(em, FinishReason::Failed, None);
    }
    let Some(mut run) = build_run(&config, &options, em) else {
        return finish(em, FinishReason::Failed, None);
    };
    announce(&run, em);
    let reason = train_loop(&mut run, &commands, &options, em);
    finish(em, reason, Some(&run));
}

/// Waits for [`Command::Start`]; false when told to stop (or the front end went away) first.
fn wait_for_start(commands: &Receiver<Command>) -> bool {
    loop {
        match commands.recv() {
            Ok(Command::Start) => return true,
            Ok(Command::Stop) | Err(_) => return false,
            Ok(_) => {}
        }
    }
}

/// The planner's verdict before the model loads: a warning when it predicts out of memory or
/// a tight fit; false (after an error event) when a CPU run is predicted not to fit, since
/// running out of host memory would end the program.
fn check_memory_plan(config: &RunConfig, options: &TrainerOptions, em: &mut Emitter) -> bool {
    em.emit(Event::Status {
        message: "checking the memory plan".into(),
    });
    let world = options
        .world
        .as_ref()
        .map_or_else(Default::default, |w| crate::plan::WorldPlace {
            rank: w.rank(),
            size: w.world_size(),
        });
    match super::memory::check_plan(config, world) {
        super::memory::PlanCheck::OutOfMemory {
            summary,
            fixes,
            on_cpu,
        } => {
            let hint = if fixes.is_empty() {
                "lower training.micro_batch or data.max_length, or use [lora]".to_string()
            } else {
                format!("try: {}", fixes.join("; "))
            };
            if on_cpu && !options.ignore_memory_plan {
                em.emit(Event::Error {
                    message: format!(
                        "the memory plan predicts that this run does not fit: {summary}. \
                         Training was not started, because running out of host memory would end the program"
                    ),
                    hint,
                    phase: Some(Phase::Setup),
                    step: None,
                });
                return false;
            }
            em.emit(Event::Warning {
                message: format!("the memory plan predicts: {summary}; {hint}"),
            });
        }
        super::memory::PlanCheck::Tight { summary } => em.emit(Event::Warning {
            message: format!("memory will be tight: {summary}"),
        }),
        super::memory::PlanCheck::Fits | super::memory::PlanCheck::Unavailable { .. } => {}
    }
    true
}

/// Loads the model, tokenizer and data: a new run, or a resumed one when asked. `None` (after
/// an error event) when that fails, panics, or a new run would write into another run's folder.
fn build_run(
    config: &RunConfig,
    options: &TrainerOptions,
    em: &mut Emitter,
) -> Option<TrainingRun> {
    em.emit(Event::Status {
        message: "loading the model, tokenizer and data".into(),
    });
    let resume_dir = options.resume_from.clone().or_else(|| {
        options
            .resume_latest
            .then(|| super::checkpoint::latest_checkpoint(&config.output_path()))
            .flatten()
    });
    // `--resume latest` with nothing to resume starts fresh there, as asked. The other ranks
    // of a launched run write nothing, and rank 0 may already have begun writing there.
    let writes_outputs = options.world.as_ref().is_none_or(|w| w.rank() == 0);
    if resume_dir.is_none() && !options.resume_latest && writes_outputs {
        if let Some(existing) = super::checkpoint::existing_run(&config.output_path()) {
            em.emit(Event::Error {
                message: format!("{existing}; a new run does not write into another run's folder"),
                hint: "resume it (`tunestudio train --resume latest`, or Resume in the studio), or choose another output_dir".into(),
                phase: Some(Phase::Setup),
                step: None,
            });
            return None;
        }
    }
    let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &resume_dir {
        Some(dir) => TrainingRun::resume_in(
            config.clone(),
            dir,
            options.allow_config_change,
            options.world.clone(),
        ),
        None => TrainingRun::new_in(config.clone(), options.world.clone()),
    }));
    match built {
        Ok(Ok(run)) => Some(run),
        Ok(Err(e)) => {
            em.error(&e, None);
            None
        }
        Err(payload) => {
            em.error(
                &TrainError::Panic {
                    step: 0,
                    message: panic_message(&payload),
                },
                None,
            );
            None
        }
    }
}

/// Opens metrics.jsonl and tells the front end what was built: the `Started` event, the data
/// warnings and the lints the run trains despite.
fn announce(run: &TrainingRun, em: &mut Emitter) {
    let out = run.config().output_path();
    if run.writes_outputs() {
        match MetricsWriter::open(&out.join(METRICS_FILE)) {
            Ok(m) => em.metrics = Some(m),
            Err(e) => em.emit(Event::Warning {
                message: format!("{e}; training continues without metrics.jsonl"),
            }),
        }
    }
    let (num_parameters, trainable_parameters) = run.parameter_counts();
    let (train_rows, eval_rows) = run.split_sizes();
    em.emit(Event::Started {
        total_steps: run.total_steps(),
        start_step: run.step_index(),
        resumed_from: run.resumed_from().map(|p| p.to_path_buf()),
        num_parameters,
        trainable_parameters,
        train_rows,
        eval_rows,
        output_dir: out,
        effective_batch: run.effective_batch(),
        batch_unit: run.config().training.method.micro_batch_unit().into(),
        ranks: run.total_ranks(),
        placement: run
            .placement()
            .describe(run.model().config().num_hidden_layers),
    });
    for w in run.data_warnings().to_vec() {
        em.emit(Event::Warning { message: w });
    }
    let allowed: Vec<super::events::LintFinding> =
        run.allowed_lints().into_iter().map(Into::into).collect();
    for lint in allowed {
        em.emit(Event::LintAllowed { lint });
    }
}

/// Steps until the run is done, stopped or failed: the queued commands between steps (and,
/// while paused, waiting for more), then a step with its events, memory samples, evaluation
/// and checkpoint when due.
fn train_loop(
    run: &mut TrainingRun,
    commands: &Receiver<Command>,
    options: &TrainerOptions,
    em: &mut Emitter,
) -> FinishReason {
    let mut memory = super::memory::MemoryMonitor::new(run.config(), options.nvml_library.clone());
    let mut watch = super::divergence::DivergenceWatch::new(run.warmup_steps());
    let mut paused = false;
    'training: loop {
        // Commands between steps: everything queued now, and while paused, wait for more.
        loop {
            let cmd = if paused {
                match commands.recv_timeout(Duration::from_millis(500)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break 'training FinishReason::Stopped,
                }
            } else {
                match commands.try_recv() {
                    Ok(c) => Some(c),
                    Err(TryRecvError::Empty) => None,
                    Err(TryRecvError::Disconnected) => break 'training FinishReason::Stopped,
                }
            };
            let Some(cmd) = cmd else { break };
            match handle_command(cmd, run, &mut paused, em) {
                Control::Continue => {}
                Control::Stop => break 'training FinishReason::Stopped,
            }
        }
        if run.is_done() {
            break FinishReason::Completed;
        }
        let outcome = match run.step() {
            Ok(o) => o,
            Err(e) => {
                if super::oom::is_out_of_memory(&e) {
                    report_out_of_memory(run, &e, &memory, em);
                }
                // A reward function failed before any weight moved: the last good step is
                // saved, so fixing the function and resuming loses nothing.
                if matches!(e, TrainError::Reward { .. }) && run.step_index() > 0 {
                    save(run, em);
                }
                em.error(&e, Some(run.step_index() + 1));
                break FinishReason::Failed;
            }
        };
        em.emit(step_event(&outcome));
        if let Some(group) = last_group(run) {
            em.emit(Event::Completions {
                step: outcome.step,
                group,
            });
        }
        let spike = (!outcome.skipped)
            .then(|| watch.observe(outcome.step, outcome.loss, outcome.lr))
            .flatten();
        if let Some(d) = spike {
            let stop = run.config().training.on_divergence == super::divergence::OnDivergence::Stop;
            em.emit(Event::Divergence {
                step: d.step,
                loss: d.loss,
                median_loss: d.median_loss,
                suggested_learning_rate: d.suggested_learning_rate,
                stopped: stop,
            });
            if stop {
                if run.writes_outputs() {
                    run.fall_back_before(d.step);
                }
                break FinishReason::Diverged;
            }
        }
        for ev in memory.sample(outcome.step) {
            em.emit(ev);
        }
        // Evaluation is rank 0's: every rank holds the same weights.
        if run.eval_due() && run.writes_outputs() {
            match run.evaluate() {
                Ok(r) => em.emit(Event::Eval {
                    step: r.step,
                    loss: r.loss,
                    perplexity: r.perplexity,
                    tokens: r.tokens,
                }),
                Err(e) => em.emit(Event::Warning {
                    message: format!("evaluation failed: {e}"),
                }),
            }
        }
        if run.save_due() {
            save(run, em);
        }
    }
}

fn handle_command(
    cmd: Command,
    run: &mut TrainingRun,
    paused: &mut bool,
    em: &mut Emitter,
) -> Control {
    match cmd {
        Command::Start => {}
        Command::Pause => {
            if !*paused {
                *paused = true;
                em.emit(Event::Paused {
                    step: run.step_index(),
                });
            }
        }
        Command::Resume => {
            if *paused {
                *paused = false;
                em.emit(Event::Resumed {
                    step: run.step_index(),
                });
            }
        }
        Command::SaveNow => save(run, em),
        Command::Stop => return Control::Stop,
    }
    Control::Continue
}

fn save(run: &mut TrainingRun, em: &mut Emitter) {
    // Rank 0 writes a launched run's checkpoints: the replicas are identical. A sharded run's
    // other ranks hand it their share of the optimizer state.
    if !run.writes_outputs() {
        if run.checkpoint_needs_every_rank()
            && run.shared_checkpoint_step() != Some(run.step_index())
        {
            if let Err(e) = run.share_checkpoint_state() {
                em.emit(Event::Warning {
                    message: format!(
                        "could not hand this rank's optimizer state to rank 0's checkpoint: \
                         {e}; training continues"
                    ),
                });
            }
        }
        return;
    }
    // Saving twice at one step (periodic save, then Ctrl-C) just reports the one checkpoint.
    if let Some(p) = run.last_checkpoint() {
        if super::checkpoint::read_state(p).is_ok_and(|s| s.step == run.step_index()) {
            em.emit(Event::CheckpointSaved {
                step: run.step_index(),
                path: p.to_path_buf(),
            });
            return;
        }
    }
    match run.save_checkpoint() {
        Ok(path) => em.emit(Event::CheckpointSaved {
            step: run.step_index(),
            path,
        }),
        Err(e) => em.emit(Event::Warning {
            message: format!("could not save a checkpoint: {e}; training continues"),
        }),
    }
}
