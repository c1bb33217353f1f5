//! `tunestudio launch check`: one rank of a torchrun or Slurm launch meets the others at the
//! rendezvous and says what it found, so a launch can be checked before it holds GPUs for a
//! run. [`join_from_env`] is the same join for `tunestudio train`.

use std::process::ExitCode;
use std::time::Duration;

use tunestudio::devices::launch::{self, Rendezvous, WorldSpec};

/// Arguments of `tunestudio launch`.
#[derive(Debug, clap::Args)]
pub struct LaunchArgs {
    #[command(subcommand)]
    pub command: LaunchCommand,
}

/// What `tunestudio launch` does.
#[derive(Debug, clap::Subcommand)]
pub enum LaunchCommand {
    /// Join the rendezvous as the launcher's environment says (torchrun's RANK, WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT, or Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST),
    /// print this rank's place, every rank's host and the id's fingerprint, and exit; exit 1
    /// with the reason when a rank is missing or the world does not fit together.
    Check,
}

/// How long the ranks of a check wait for each other to finish once they all have the id:
/// they are already connected, so this only covers a rank descheduled for a moment.
const FINISH_WAIT: Duration = Duration::from_secs(30);

/// Runs `tunestudio launch`.
pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        LaunchCommand::Check => check(),
    }
}

fn check() -> anyhow::Result<ExitCode> {
    let Some(rendezvous) = join_from_env()? else {
        anyhow::bail!(
            "no launcher started this process: start it with torchrun (`torchrun --no-python \
             ... tunestudio launch check`) or Slurm (`srun tunestudio launch check`), or set \
             RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        );
    };
    let spec = rendezvous.spec();
    let hosts: Vec<String> = rendezvous
        .hosts()
        .iter()
        .enumerate()
        .map(|(rank, host)| format!("{rank}={host}"))
        .collect();
    println!("hosts: {}", hosts.join(" "));
    println!("id: {}", launch::id_hash(rendezvous.id()));
    rendezvous.finish_together(FINISH_WAIT)?;
    println!(
        "rank {} of {}: every rank joined and finished the check",
        spec.rank, spec.world_size
    );
    Ok(ExitCode::SUCCESS)
}

/// Joins the rendezvous when a launcher started this process (`None` otherwise), printing
/// this rank's place and what the rendezvous noted on stderr.
pub fn join_from_env() -> anyhow::Result<Option<Rendezvous>> {
    let lookup = |key: &str| std::env::var(key).ok();
    let Some(spec) = launch::world_from_env(lookup)? else {
        return Ok(None);
    };
    let timeout = launch::rendezvous_timeout(lookup)?;
    eprintln!("{}", describe(&spec, timeout));
    let rendezvous = Rendezvous::join(&spec, timeout, launch::fresh_id)?;
    for note in rendezvous.notes() {
        eprintln!("note: {note}");
    }
    Ok(Some(rendezvous))
}

fn describe(spec: &WorldSpec, timeout: Duration) -> String {
    format!(
        "rank {} of {} (local rank {}) on {}, started by {}: rendezvous at {}:{} (waiting up to {} s)",
        spec.rank,
        spec.world_size,
        spec.local_rank,
        launch::hostname(),
        spec.launcher,
        spec.master_addr,
        spec.master_port,
        timeout.as_secs()
    )
}
