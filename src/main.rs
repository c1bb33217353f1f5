//! The `tunestudio` binary: the desktop studio (default) and the headless CLI.

mod cli;
#[cfg(feature = "gui")]
mod gui;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
