//! `tunestudio train --config run.toml [--resume DIR]`: trains headless with a progress bar.
//! Ctrl-C writes a checkpoint and exits cleanly (a second Ctrl-C exits at once).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use tunestudio::train::{Command, Event, FinishReason, RunConfig, Trainer, TrainerOptions};

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
    blocked_by_lints: bool,
    out_of_memory_with_checkpoint: bool,
}

/// Runs `tunestudio train`.
pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
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
    if outcome.out_of_memory_with_checkpoint && args.on_oom == OnOom::AutoFit {
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
    Ok(match outcome.reason {
        FinishReason::Completed | FinishReason::Stopped => ExitCode::SUCCESS,
        // The data's own findings stopped it, as `tunestudio preview` does: exit 2.
        FinishReason::Failed if outcome.blocked_by_lints => ExitCode::from(2),
        FinishReason::Failed | FinishReason::Diverged => ExitCode::FAILURE,
    })
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

    let interactive = std::io::stderr().is_terminal() && !args.json;
    let mut bar: Option<ProgressBar> = None;
    let log_every = args.log_every.max(1);
    let mut reason = FinishReason::Failed;
    let mut blocked = false;
    let mut oom_checkpoint = false;
    for event in handle.events.iter() {
        blocked |= matches!(event, Event::LintsBlocked { .. });
        oom_checkpoint |= matches!(
            event,
            Event::OutOfMemory {
                checkpoint: Some(_),
                ..
            }
        );
        if args.json {
            if let Ok(line) = serde_json::to_string(&event) {
                println!("{line}");
            }
        }
        match &event {
            Event::Error { message, hint, .. } => {
                if let Some(b) = &bar {
                    b.abandon();
                }
                eprintln!("error: {message}\nhint: {hint}");
            }
            Event::Finished {
                reason: r,
                step,
                final_loss,
                elapsed_secs,
                ..
            } => {
                reason = *r;
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                if !args.json {
                    let loss = final_loss.map_or("-".to_string(), |l| format!("{l:.4}"));
                    eprintln!("{r:?} at step {step} (loss {loss}) after {elapsed_secs:.1} s");
                }
                break;
            }
            _ if !args.json => render(&event, &mut bar, interactive, log_every),
            _ => {}
        }
    }
    handle.join();
    Ok(Outcome {
        reason,
        blocked_by_lints: blocked,
        out_of_memory_with_checkpoint: oom_checkpoint,
    })
}

/// Prints a line to the terminal, above the progress bar when one is showing.
fn say(bar: Option<&ProgressBar>, line: String) {
    match bar {
        Some(b) if !b.is_hidden() => b.println(line),
        _ => println!("{line}"),
    }
}

/// The human rendering of an event other than the error and the end (not in `--json` mode).
fn render(event: &Event, bar: &mut Option<ProgressBar>, interactive: bool, log_every: u64) {
    match event {
        Event::Status { message } => eprintln!("{message}…"),
        Event::Started { .. } => {
            if let Some(b) = started(event, bar.as_ref(), interactive) {
                *bar = Some(b);
            }
        }
        Event::Step {
            step,
            loss,
            lr,
            grad_norm,
            tokens_per_sec,
            skipped,
            metrics,
            ..
        } => {
            if let Some(b) = bar {
                b.set_position(*step);
                b.set_message(format!("loss {loss:.4} | {tokens_per_sec:.0} tok/s"));
            }
            if step % log_every == 0 || *step == 1 || *skipped {
                let note = if *skipped {
                    " (skipped: fp16 overflow)"
                } else {
                    ""
                };
                // Preference runs: TRL's reward figures on the same line.
                let rewards: String = [
                    ("rewards/accuracies", "acc"),
                    ("rewards/margins", "margin"),
                    ("rewards/chosen", "chosen"),
                    ("rewards/rejected", "rejected"),
                ]
                .iter()
                .filter_map(|(key, short)| metrics.get(*key).map(|v| format!("  {short} {v:.3}")))
                .collect();
                say(
                    bar.as_ref(),
                    format!(
                        "step {step:>6}  loss {loss:.4}{rewards}  lr {lr:.2e}  grad_norm {grad_norm:.3}  {tokens_per_sec:.0} tok/s{note}"
                    ),
                );
            }
        }
        Event::Eval {
            step,
            loss,
            perplexity,
            ..
        } => say(
            bar.as_ref(),
            format!("eval   {step:>6}  loss {loss:.4}  perplexity {perplexity:.2}"),
        ),
        Event::CheckpointSaved { path, .. } => {
            say(bar.as_ref(), format!("saved {}", path.display()))
        }
        Event::Warning { message } => say(bar.as_ref(), format!("warning: {message}")),
        Event::Divergence {
            step,
            loss,
            median_loss,
            suggested_learning_rate,
            stopped,
        } => say(
            bar.as_ref(),
            format!(
                "warning: the loss diverged at step {step}: {loss:.4} against a recent median of {median_loss:.4}{}; resume with training.learning_rate = {suggested_learning_rate:e} (tunestudio train --resume latest)",
                if *stopped {
                    " (on_divergence = \"stop\": stopped, the last checkpoint is before the spike)"
                } else {
                    ""
                }
            ),
        ),
        Event::OutOfMemory { .. } => out_of_memory(event),
        Event::LintAllowed { lint } => say(
            bar.as_ref(),
            format!(
                "warning: training despite lint `{}` ({} rows), allowed by name: {}",
                lint.lint, lint.count, lint.message
            ),
        ),
        _ => {}
    }
}

/// What the run is about to train, and the progress bar for it.
fn started(event: &Event, bar: Option<&ProgressBar>, interactive: bool) -> Option<ProgressBar> {
    let Event::Started {
        total_steps,
        start_step,
        resumed_from,
        num_parameters,
        trainable_parameters,
        train_rows,
        eval_rows,
        output_dir,
        effective_batch,
        ranks,
        placement,
    } = event
    else {
        return None;
    };
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
        format!("effective batch {effective_batch} rows per step ({ranks} data-parallel rank(s))"),
    );
    if placement.len() > 1 {
        for d in placement {
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
    Some(b)
}

/// Where a device ran out of memory, what was saved, and the settings a resume would use.
fn out_of_memory(event: &Event) {
    let Event::OutOfMemory {
        step,
        phase,
        device,
        planned_bytes,
        observed_bytes,
        checkpoint,
        refit,
        refit_error,
        ..
    } = event
    else {
        return;
    };
    let saved = checkpoint
        .as_ref()
        .map_or("no checkpoint yet".to_string(), |p| {
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
