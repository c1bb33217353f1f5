//! Command-line front end: `tunestudio [gui] | train | plan | preview | devices | bench | generate`.
//!
//! Each subcommand lives in its own file and renders what the library returns;
//! the library itself never prints.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

pub mod bench;
pub mod devices;
pub mod generate;
pub mod plan;
pub mod preview;
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
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        None | Some(Command::Gui) => run_gui(),
        Some(Command::Train(args)) => train::run(args),
        Some(Command::Plan(args)) => plan::run(args),
        Some(Command::Preview(args)) => preview::run(args),
        Some(Command::Devices(args)) => devices::run(args),
        Some(Command::Bench(args)) => bench::run(args),
        Some(Command::Generate(args)) => generate::run(args),
    }
}

#[cfg(feature = "gui")]
fn run_gui() -> anyhow::Result<ExitCode> {
    crate::gui::run_native()?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "gui"))]
fn run_gui() -> anyhow::Result<ExitCode> {
    anyhow::bail!(
        "this build has no GUI (built without the `gui` feature); use a subcommand, see --help"
    )
}
