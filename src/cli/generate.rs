//! `tunestudio generate`.

use std::process::ExitCode;

/// Arguments of `tunestudio generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {}

/// Runs `tunestudio generate`.
pub fn run(_args: GenerateArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`tunestudio generate` is not available yet")
}
