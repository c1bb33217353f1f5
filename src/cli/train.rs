//! `tunestudio train --config run.toml [--resume DIR]`: trains headless with a progress bar.
//! Ctrl-C writes a checkpoint and exits cleanly (a second Ctrl-C exits at once).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use tunestudio::devices::launch;
use tunestudio::devices::parallel::process_group::ProcessGroup;
use tunestudio::train::render::{self, EventRenderer};
use tunestudio::train::{
    self, Command, FinishReason, LintFinding, RunConfig, Trainer, TrainerOptions,
};

/// Arguments of `tunestudio train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// The run config (TOML, as the studio saves it).
    #[arg(long, short)]
    pub config: PathBuf,
    /// Continue from a checkpoint folder (`<output>/checkpoint-<step>`), or `latest` for the
    /// newest one in the run's output_dir.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Override `training.max_steps`.
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Print a log line every N steps (besides the progress bar).
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Print every event as a JSON line on stdout instead of the progress bar.
    #[arg(long)]
    pub json: bool,
    /// Train even when the memory plan predicts that host memory runs out.
    #[arg(long)]
    pub ignore_memory_plan: bool,
    /// Train despite an error-level data lint, by name (repeatable; adds to `[data] allow`),
    /// e.g. `--allow-lint labels-mismatch`. The override is recorded in metrics.jsonl.
    #[arg(long = "allow-lint", value_name = "LINT")]
    pub allow_lint: Vec<String>,
    /// When a step runs out of memory: `stop` (with a checkpoint of the last good step and
    /// a report), or `auto-fit`: then also resume from that checkpoint with settings that
    /// fit what the device held, keeping the effective batch.
    #[arg(long, value_enum, default_value_t = OnOom::Stop)]
    pub on_oom: OnOom,
    /// Resume even when the run config differs from the checkpoint's in a way that breaks
    /// the exact continuation (model, data, precision, LoRA shape, device strategy).
    #[arg(long)]
    pub allow_config_change: bool,
}

/// What `tunestudio train` does when a step runs out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOom {
    /// Stop with a checkpoint of the last good step and the report.
    Stop,
    /// Stop, then resume from that checkpoint with auto-fitted settings.
    AutoFit,
}

/// How one trainer thread's run ended, as the CLI needs it.
struct Outcome {
    reason: FinishReason,
    /// The run's last error, for the other ranks of a launched run.
    error: Option<String>,
    blocked_by_lints: bool,
    out_of_memory_with_checkpoint: bool,
}

/// Runs `tunestudio train`: alone, or as one rank of a torchrun or Slurm launch, which
/// first meets the other ranks at the rendezvous (docs/multi-node.md).
pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    let Some(rendezvous) = super::launch::join_from_env()? else {
        return train_alone(args, None).map(|(code, _)| code);
    };
    // Another rank's failure, or its disappearance, ends this process: a rank blocked in a
    // collective waits for the missing rank forever otherwise.
    rendezvous.watch(|reason| {
        eprintln!("error: {reason}");
        std::process::exit(1);
    })?;
    let group = launch::collective_timeout(|key| std::env::var(key).ok())
        .and_then(|timeout| rendezvous.process_group(timeout));
    let group = match group {
        Ok(group) => Arc::new(group),
        Err(e) => {
            rendezvous.abort(&e.to_string());
            return Err(e.into());
        }
    };
    let result = train_alone(args, Some(group.clone()));
    match &result {
        Ok((code, _)) if *code == ExitCode::SUCCESS => rendezvous.finish(),
        Ok((_, Some(error))) => rendezvous.abort(error),
        Ok((_, None)) => rendezvous.abort("its training run failed (see its log)"),
        Err(e) => rendezvous.abort(&format!("{e:#}")),
    }
    // The process group's connections close only now, after the other ranks were told why.
    drop(group);
    result.map(|(code, _)| code)
}

/// Runs `tunestudio train` in this process (as one rank of a launched run when `world` is
/// given); the exit code, with the run's error when it failed.
fn train_alone(
    args: TrainArgs,
    world: Option<Arc<ProcessGroup>>,
) -> anyhow::Result<(ExitCode, Option<String>)> {
    let launched = world.is_some();
    let mut config = RunConfig::load(&args.config)?;
    if let Some(n) = args.max_steps {
        config.training.max_steps = Some(n);
    }
    for lint in &args.allow_lint {
        if !config.data.allow.contains(lint) {
            config.data.allow.push(lint.clone());
        }
    }
    let mut options = TrainerOptions {
        start_immediately: true,
        ignore_memory_plan: args.ignore_memory_plan,
        allow_config_change: args.allow_config_change,
        world,
        ..TrainerOptions::default()
    };
    match &args.resume {
        Some(p) if p.as_os_str() == "latest" => options.resume_latest = true,
        Some(p) => options.resume_from = Some(p.clone()),
        None => {}
    }
    // Ctrl-C: ask the current trainer for a checkpoint and a clean stop after the current
    // step; a second Ctrl-C gives up waiting.
    let current: Arc<Mutex<Option<Sender<Command>>>> = Arc::new(Mutex::new(None));
    let presses = Arc::new(AtomicUsize::new(0));
    {
        let current = current.clone();
        let presses = presses.clone();
        ctrlc::set_handler(move || {
            if presses.fetch_add(1, Ordering::SeqCst) == 0 {
                eprintln!(
                    "\nstopping after this step and saving a checkpoint (Ctrl-C again to quit now)"
                );
                if let Some(commands) = current.lock().ok().and_then(|c| c.clone()) {
                    let _ = commands.send(Command::SaveNow);
                    let _ = commands.send(Command::Stop);
                }
            } else {
                std::process::exit(130);
            }
        })
        .context("cannot install the Ctrl-C handler")?;
    }
    let mut outcome = drive(&args, &current, config.clone(), options)?;
    if launched && args.on_oom == OnOom::AutoFit && outcome.out_of_memory_with_checkpoint {
        // One rank alone cannot resume with other settings while the others wait in the
        // step's sum: the run stops, and a relaunch resumes it.
        eprintln!(
            "out of memory: --on-oom auto-fit does not refit a launched run; resume it with \
             `--resume latest` after lowering training.micro_batch"
        );
    } else if outcome.out_of_memory_with_checkpoint && args.on_oom == OnOom::AutoFit {
        match tunestudio::train::oom::refit_after_oom(&config) {
            Ok(refit) => {
                eprintln!(
                    "out of memory: resuming from the last checkpoint with {}",
                    refit.changes.join("; ")
                );
                let options = TrainerOptions {
                    start_immediately: true,
                    ignore_memory_plan: args.ignore_memory_plan,
                    resume_latest: true,
                    ..TrainerOptions::default()
                };
                outcome = drive(&args, &current, refit.config, options)?;
            }
            Err(e) => eprintln!("out of memory, and no resumable settings fit: {e}"),
        }
    }
    let code = match outcome.reason {
        FinishReason::Completed | FinishReason::Stopped => ExitCode::SUCCESS,
        // The data's own findings stopped it, as `tunestudio preview` does: exit 2.
        FinishReason::Failed if outcome.blocked_by_lints => ExitCode::from(2),
        FinishReason::Failed | FinishReason::Diverged => ExitCode::FAILURE,
    };
    Ok((code, outcome.error))
}

/// Spawns a trainer for `config` and renders its events until it finishes.
fn drive(
    args: &TrainArgs,
    current: &Arc<Mutex<Option<Sender<Command>>>>,
    config: RunConfig,
    options: TrainerOptions,
) -> anyhow::Result<Outcome> {
    let handle = Trainer::spawn_with(config, options, None);
    if let Ok(mut c) = current.lock() {
        *c = Some(handle.commands.clone());
    }
    let mut line = ProgressLine {
        bar: None,
        interactive: std::io::stderr().is_terminal() && !args.json,
        log_every: args.log_every.max(1),
        json: args.json,
        finished: None,
        blocked_by_lints: false,
        out_of_memory_with_checkpoint: false,
        error: None,
    };
    for event in handle.events.iter() {
        if args.json {
            if let Ok(json) = serde_json::to_string(&event) {
                println!("{json}");
            }
        }
        train::dispatch(&event, &mut line);
        if line.finished.is_some() {
            break;
        }
    }
    handle.join();
    Ok(Outcome {
        reason: line.finished.unwrap_or(FinishReason::Failed),
        error: line.error,
        blocked_by_lints: line.blocked_by_lints,
        out_of_memory_with_checkpoint: line.out_of_memory_with_checkpoint,
    })
}

/// Prints a line to the terminal, above the progress bar when one is showing.
fn say(bar: Option<&ProgressBar>, line: String) {
    match bar {
        Some(b) if !b.is_hidden() => b.println(line),
        _ => println!("{line}"),
    }
}

/// The terminal's rendering of a run: the progress bar and the log lines (with `--json`,
/// only errors: the events themselves go to stdout), and what the run's end means for the
/// exit code.
struct ProgressLine {
    bar: Option<ProgressBar>,
    interactive: bool,
    log_every: u64,
    json: bool,
    finished: Option<FinishReason>,
    blocked_by_lints: bool,
    out_of_memory_with_checkpoint: bool,
    /// The last error event's message.
    error: Option<String>,
}

impl ProgressLine {
    /// A log line above the bar (not with `--json`).
    fn say(&self, line: String) {
        if !self.json {
            say(self.bar.as_ref(), line);
        }
    }

    /// A line on stderr (not with `--json`).
    fn tell(&self, line: String) {
        if !self.json {
            eprintln!("{line}");
        }
    }
}

impl EventRenderer for ProgressLine {
    fn status(&mut self, message: &str) {
        self.tell(format!("{message}…"));
    }

    fn started(&mut self, e: render::Started<'_>) {
        if !self.json {
            self.bar = Some(started(&e, self.bar.as_ref(), self.interactive));
        }
    }

    fn step(&mut self, e: render::Step<'_>) {
        if let Some(b) = &self.bar {
            b.set_position(e.step);
            b.set_message(format!(
                "loss {:.4} | {:.0} tok/s",
                e.loss, e.tokens_per_sec
            ));
        }
        if let Some(line) = step_line(&e, self.log_every) {
            self.say(line);
        }
    }

    fn eval(&mut self, e: render::Eval) {
        self.say(format!(
            "eval   {:>6}  loss {:.4}  perplexity {:.2}",
            e.step, e.loss, e.perplexity
        ));
    }

    fn memory(&mut self, _: render::Memory<'_>) {}

    fn checkpoint_saved(&mut self, _: u64, path: &Path) {
        self.say(format!("saved {}", path.display()));
    }

    fn paused(&mut self, _: u64) {}

    fn resumed(&mut self, _: u64) {}

    fn divergence(&mut self, e: render::Divergence) {
        self.say(divergence_line(&e));
    }

    fn warning(&mut self, message: &str) {
        self.say(format!("warning: {message}"));
    }

    fn error(&mut self, e: render::ErrorReport<'_>) {
        if let Some(b) = &self.bar {
            b.abandon();
        }
        eprintln!("error: {}\nhint: {}", e.message, e.hint);
        self.error = Some(e.message.to_string());
    }

    fn lints_blocked(&mut self, _: &[LintFinding]) {
        // The error event that follows says why; the exit code says it was the data.
        self.blocked_by_lints = true;
    }

    fn out_of_memory(&mut self, e: render::OutOfMemory<'_>) {
        self.out_of_memory_with_checkpoint |= e.checkpoint.is_some();
        if !self.json {
            out_of_memory(&e);
        }
    }

    fn lint_allowed(&mut self, lint: &LintFinding) {
        self.say(format!(
            "warning: training despite lint `{}` ({} rows), allowed by name: {}",
            lint.lint, lint.count, lint.message
        ));
    }

    // The progress line shows the step's rewards; the texts are in metrics.jsonl.
    fn completions(&mut self, _: u64, _: &tunestudio::train::SampledGroup) {}

    fn finished(&mut self, e: render::Finished<'_>) {
        self.finished = Some(e.reason);
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        let loss = e.final_loss.map_or("-".to_string(), |l| format!("{l:.4}"));
        self.tell(format!(
            "{:?} at step {} (loss {loss}) after {:.1} s",
            e.reason, e.step, e.elapsed_secs
        ));
    }
}

/// The log line of a step: the first, every `log_every`-th and every skipped one.
fn step_line(e: &render::Step<'_>, log_every: u64) -> Option<String> {
    let render::Step {
        step,
        loss,
        lr,
        grad_norm,
        tokens_per_sec,
        skipped,
        metrics,
        ..
    } = e;
    if !(step % log_every == 0 || *step == 1 || *skipped) {
        return None;
    }
    let note = if *skipped {
        " (skipped: fp16 overflow)"
    } else {
        ""
    };
    // Preference and GRPO runs: TRL's reward figures on the same line.
    let rewards: String = [
        ("rewards/accuracies", "acc"),
        ("rewards/margins", "margin"),
        ("rewards/chosen", "chosen"),
        ("rewards/rejected", "rejected"),
        // GRPO: TRL's reward, its spread and how long the completions ran.
        ("reward", "reward"),
        ("reward_std", "reward_std"),
        ("kl", "kl"),
        ("completions/mean_length", "len"),
    ]
    .iter()
    .filter_map(|(key, short)| metrics.get(*key).map(|v| format!("  {short} {v:.3}")))
    .collect();
    Some(format!(
        "step {step:>6}  loss {loss:.4}{rewards}  lr {lr:.2e}  grad_norm {grad_norm:.3}  {tokens_per_sec:.0} tok/s{note}"
    ))
}

/// The warning of a loss spike, with the rate to resume with.
fn divergence_line(e: &render::Divergence) -> String {
    let render::Divergence {
        step,
        loss,
        median_loss,
        suggested_learning_rate,
        stopped,
    } = e;
    format!(
        "warning: the loss diverged at step {step}: {loss:.4} against a recent median of {median_loss:.4}{}; resume with training.learning_rate = {suggested_learning_rate:e} (tunestudio train --resume latest)",
        if *stopped {
            " (on_divergence = \"stop\": stopped, the last checkpoint is before the spike)"
        } else {
            ""
        }
    )
}

/// What the run is about to train, and the progress bar for it.
fn started(e: &render::Started<'_>, bar: Option<&ProgressBar>, interactive: bool) -> ProgressBar {
    let render::Started {
        total_steps,
        start_step,
        resumed_from,
        num_parameters,
        trainable_parameters,
        train_rows,
        eval_rows,
        output_dir,
        effective_batch,
        batch_unit,
        ranks,
        placement,
    } = e;
    if let Some(p) = resumed_from {
        say(
            bar,
            format!("resuming from {} (step {start_step})", p.display()),
        );
    }
    say(
        bar,
        format!(
            "training {trainable_parameters} of {num_parameters} parameters on {train_rows} rows ({eval_rows} for validation), {total_steps} steps → {}",
            output_dir.display()
        ),
    );
    say(
        bar,
        format!("effective batch {effective_batch} {batch_unit} per step ({ranks} data-parallel rank(s))"),
    );
    if placement.len() > 1 {
        for d in placement.iter() {
            say(
                bar,
                format!("  {}: layers {}..{}", d.device, d.start_layer, d.end_layer),
            );
        }
    }
    let b = if interactive {
        ProgressBar::new(*total_steps)
    } else {
        ProgressBar::hidden()
    };
    b.set_style(
        ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} steps | {msg} | ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_position(*start_step);
    b
}

/// Where a device ran out of memory, what was saved, and the settings a resume would use.
fn out_of_memory(e: &render::OutOfMemory<'_>) {
    let render::OutOfMemory {
        step,
        phase,
        device,
        planned_bytes,
        observed_bytes,
        checkpoint,
        refit,
        refit_error,
        ..
    } = e;
    let saved = checkpoint.map_or("no checkpoint yet".to_string(), |p| {
        format!("saved the last good step: {}", p.display())
    });
    eprintln!(
        "{device} ran out of memory at step {step} ({phase}{}); {saved}",
        tunestudio::train::oom::planned_and_observed(*planned_bytes, *observed_bytes)
    );
    match refit_error {
        Some(e) => eprintln!("no resumable settings fit: {e}"),
        None => eprintln!(
            "settings that fit what {device} held (same effective batch): {}\nresume with them: tunestudio train --config … --resume latest --on-oom auto-fit, or apply them to the config",
            refit.join("; ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn step(step: u64, metrics: &BTreeMap<String, f64>) -> render::Step<'_> {
        render::Step {
            step,
            loss: 0.625,
            lr: 5e-7,
            grad_norm: 1.25,
            tokens_per_sec: 88.4,
            trained_tokens: 4096,
            elapsed_secs: 12.0,
            epoch: 0.5,
            skipped: false,
            loss_scale: None,
            metrics,
        }
    }

    #[test]
    fn a_step_line_is_the_first_every_nth_and_every_skipped_step() {
        let none = BTreeMap::new();
        assert_eq!(
            step_line(&step(10, &none), 10).as_deref(),
            Some("step     10  loss 0.6250  lr 5.00e-7  grad_norm 1.250  88 tok/s")
        );
        assert_eq!(
            step_line(&step(1, &none), 10).as_deref(),
            Some("step      1  loss 0.6250  lr 5.00e-7  grad_norm 1.250  88 tok/s")
        );
        assert_eq!(step_line(&step(7, &none), 10), None);
        let skipped = render::Step {
            skipped: true,
            grad_norm: f64::NAN,
            ..step(7, &none)
        };
        assert_eq!(
            step_line(&skipped, 10).as_deref(),
            Some("step      7  loss 0.6250  lr 5.00e-7  grad_norm NaN  88 tok/s (skipped: fp16 overflow)")
        );
    }

    #[test]
    fn a_preference_step_line_shows_the_rewards_in_a_fixed_order() {
        let metrics: BTreeMap<String, f64> = [
            ("logps/chosen", -10.0),
            ("rewards/accuracies", 0.75),
            ("rewards/chosen", 0.5),
            ("rewards/margins", 0.1234),
            ("rewards/rejected", -0.25),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(
            step_line(&step(20, &metrics), 10).as_deref(),
            Some("step     20  loss 0.6250  acc 0.750  margin 0.123  chosen 0.500  rejected -0.250  lr 5.00e-7  grad_norm 1.250  88 tok/s")
        );
    }
}
