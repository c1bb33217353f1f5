//! Command-line front end: `tunestudio [gui] | train | plan | preview | devices | bench | generate | export | launch`.
//!
//! Each subcommand lives in its own file and renders what the library returns;
//! the library itself never prints.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

pub mod bench;
pub mod devices;
pub mod export;
pub mod generate;
pub mod hub_progress;
pub mod launch;
pub mod plan;
pub mod preview;
pub mod preview_pairs;
pub mod preview_rollouts;
pub mod train;

/// A fine-tuning studio for causal language models.
#[derive(Debug, Parser)]
#[command(name = "tunestudio", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Open the desktop studio (the default when no command is given).
    Gui,
    /// Train headless from a run config (the TOML the studio saves).
    Train(train::TrainArgs),
    /// Predict per-device memory for a run, and fit it to the devices.
    Plan(plan::PlanArgs),
    /// Show tokens, label mask, stats and lints of a run's dataset.
    Preview(preview::PreviewArgs),
    /// List the devices tunestudio can train on.
    Devices(devices::DevicesArgs),
    /// Time training steps of a model shape (tokens/s, GFLOP/s, peak RSS).
    Bench(bench::BenchArgs),
    /// Generate text from a model (optionally with a LoRA adapter).
    Generate(generate::GenerateArgs),
    /// Write a run checkpoint as a PEFT adapter, a merged model or a full model folder.
    Export(export::ExportArgs),
    /// Check a torchrun or Slurm launch: join the rendezvous and print each rank's place.
    Launch(launch::LaunchArgs),
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if cli
        .command
        .as_ref()
        .is_some_and(|c| !matches!(c, Command::Gui))
    {
        hub_progress::install();
    }
    match cli.command {
        None | Some(Command::Gui) => run_gui(),
        Some(Command::Train(args)) => train::run(args),
        Some(Command::Plan(args)) => plan::run(args),
        Some(Command::Preview(args)) => preview::run(args),
        Some(Command::Devices(args)) => devices::run(args),
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::Generate(args)) => generate::run(args),
        Some(Command::Export(args)) => export::run(args),
        Some(Command::Launch(args)) => launch::run(args),
    }
}

#[cfg(feature = "gui")]
fn run_gui() -> anyhow::Result<ExitCode> {
    if let Some(missing) = missing_display() {
        eprintln!("{missing}");
        return Ok(ExitCode::from(2));
    }
    crate::gui::run_native()?;
    Ok(ExitCode::SUCCESS)
}

/// On Linux and the BSDs the studio needs an X11 or Wayland display; without one winit
/// panics deep inside its event loop. Says so in one line, with the headless way out.
#[cfg(feature = "gui")]
fn missing_display() -> Option<String> {
    if cfg!(any(target_os = "windows", target_os = "macos")) {
        return None;
    }
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    if set("DISPLAY") || set("WAYLAND_DISPLAY") {
        return None;
    }
    Some(
        "no display: the studio needs X11 or Wayland (DISPLAY / WAYLAND_DISPLAY are unset); \
         on a server use the headless commands: tunestudio train | plan | preview | devices | \
         generate | bench (see --help)"
            .to_string(),
    )
}

#[cfg(not(feature = "gui"))]
fn run_gui() -> anyhow::Result<ExitCode> {
    anyhow::bail!(
        "this build has no GUI (built without the `gui` feature); use a subcommand, see --help"
    )
}
