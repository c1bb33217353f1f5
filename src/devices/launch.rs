//! Past one machine: a process started by `torchrun` or Slurm's `srun` as one rank of a
//! data-parallel run finds its place in the world and meets the other ranks.
//!
//! * [`env`] — the launcher's environment read into a [`WorldSpec`] (pure, over a lookup).
//! * [`nodelist`] — the first host of a Slurm node list (`gpu[01-04,07],cpu3` → `gpu01`).
//! * [`rendezvous`] — the TCP rendezvous at `MASTER_ADDR:MASTER_PORT` that hands every rank
//!   the same NCCL id, then stays open so a rank that fails stops the others.
//! * [`wire`] — its messages on the wire.
//! * [`commands`] — the `torchrun` line and the Slurm script that start a run.
//!
//! docs/multi-node.md says how to start a run and what is tested where.

pub mod commands;
pub mod env;
pub mod nodelist;
pub mod rendezvous;
pub mod wire;

pub use commands::LaunchShape;
pub use env::{
    collective_timeout, rendezvous_timeout, world_from_env, Launcher, WorldSpec,
    COLLECTIVE_TIMEOUT_ENV, DEFAULT_MASTER_PORT, DEFAULT_RENDEZVOUS_TIMEOUT, LAUNCHER_ENV,
    RENDEZVOUS_TIMEOUT_ENV,
};
pub use nodelist::first_host;
pub use rendezvous::Rendezvous;
pub use wire::ID_BYTES;

/// Errors of reading the launcher's environment and of the rendezvous. Each message names
/// the variable, the rank or the address, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The launcher's environment is missing a variable or holds a wrong value.
    #[error("{0}")]
    Env(String),
    /// The rendezvous failed (a rank did not join, rank 0 was unreachable, the world did
    /// not fit together).
    #[error("{0}")]
    Rendezvous(String),
    /// Another rank (or rank 0) stopped the run; the text names it and why.
    #[error("stopped by another rank: {0}")]
    Aborted(String),
}

/// The run's id, made by rank 0: NCCL's unique id (`ncclGetUniqueId`, which holds rank 0's
/// bootstrap address) in a build with NCCL; otherwise 128 random bytes, which only need to be
/// the same on every rank for the rendezvous to be checked.
pub fn fresh_id() -> Result<[u8; ID_BYTES], LaunchError> {
    #[cfg(feature = "nccl")]
    {
        crate::devices::parallel::nccl::NcclId::new()
            .map(|id| id.0)
            .map_err(|e| LaunchError::Rendezvous(e.to_string()))
    }
    #[cfg(not(feature = "nccl"))]
    {
        use rand::RngCore;
        let mut id = [0u8; ID_BYTES];
        rand::thread_rng().fill_bytes(&mut id);
        Ok(id)
    }
}

/// A short, stable fingerprint of an id (FNV-1a, 12 hex digits), for a person to compare
/// ranks' logs; not a secret and not a checksum against tampering.
pub fn id_hash(id: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:012x}", h >> 16)
}

/// This machine's host name as other ranks' messages should show it (Linux's
/// `/proc/sys/kernel/hostname`, else `HOSTNAME`, else `unknown-host`): std has no call for it,
/// and a name is only for messages.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "unknown-host".to_string())
}
