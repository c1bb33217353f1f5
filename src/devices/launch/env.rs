//! Which rank of which world this process is, read from the launcher's environment:
//! torchrun's (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) or Slurm's
//! (`SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`, the first host of `SLURM_JOB_NODELIST`).
//!
//! A pure function over a lookup, so tests hand it a table instead of changing the process's
//! environment (which every thread of the test binary shares).

use std::time::Duration;

use super::nodelist::first_host;
use super::LaunchError;

/// The rendezvous port when Slurm starts the ranks and `MASTER_PORT` is unset (torchrun's
/// own default, so a cluster's firewall rules for torchrun jobs fit).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// How long ranks wait for each other at the rendezvous when
/// [`RENDEZVOUS_TIMEOUT_ENV`] is unset: long enough for a slow node to load the binary and
/// its CUDA libraries from a shared filesystem, short enough that a rank that never starts
/// does not hold a cluster's GPUs idle for long.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Seconds to wait at the rendezvous (a positive whole number).
pub const RENDEZVOUS_TIMEOUT_ENV: &str = "TUNESTUDIO_RENDEZVOUS_TIMEOUT_SECS";
/// Seconds a rank of a launched run waits in a sum across processes for the other ranks
/// (default `parallel::process_group::DEFAULT_COLLECTIVE_TIMEOUT`).
pub const COLLECTIVE_TIMEOUT_ENV: &str = "TUNESTUDIO_COLLECTIVE_TIMEOUT_SECS";

/// `none` ignores the launcher's variables (one process, as without a launcher), for a
/// command run directly inside an allocation whose Slurm variables describe other tasks.
pub const LAUNCHER_ENV: &str = "TUNESTUDIO_LAUNCHER";

/// What started the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `torchrun` (or anything that sets its variables).
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
        })
    }
}

/// This process's place in a multi-process run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorldSpec {
    /// The global rank, `0..world_size`.
    pub rank: usize,
    /// The rank on this machine: the GPU it trains on (`cuda:local_rank`).
    pub local_rank: usize,
    /// Ranks over every machine.
    pub world_size: usize,
    /// Rank 0's host: where the rendezvous listens.
    pub master_addr: String,
    /// The rendezvous port.
    pub master_port: u16,
    /// What started the ranks.
    pub launcher: Launcher,
}

/// The world this process belongs to, or `None` when no launcher started it (neither
/// torchrun's `RANK`/`WORLD_SIZE` nor Slurm's `SLURM_PROCID` is set, or
/// `TUNESTUDIO_LAUNCHER=none`). torchrun's variables win over Slurm's: torchrun started
/// inside a Slurm job sets its own, and they describe the processes it started.
pub fn world_from_env(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Option<WorldSpec>, LaunchError> {
    let get = |key: &str| lookup(key).filter(|v| !v.trim().is_empty());
    match get(LAUNCHER_ENV).as_deref().map(str::trim) {
        None | Some("auto") => {}
        Some("none") => return Ok(None),
        Some(other) => {
            return Err(LaunchError::Env(format!(
                "{LAUNCHER_ENV}={other:?} is not `auto` or `none`; unset it to read the \
                 launcher's variables"
            )))
        }
    }
    if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
        return torchrun(&get).map(Some);
    }
    if get("SLURM_PROCID").is_some() {
        return slurm(&get).map(Some);
    }
    Ok(None)
}

/// The rendezvous timeout: [`RENDEZVOUS_TIMEOUT_ENV`], else [`DEFAULT_RENDEZVOUS_TIMEOUT`].
pub fn rendezvous_timeout(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Duration, LaunchError> {
    seconds(&lookup, RENDEZVOUS_TIMEOUT_ENV, DEFAULT_RENDEZVOUS_TIMEOUT)
}

/// How long a sum across processes waits for a rank: [`COLLECTIVE_TIMEOUT_ENV`], else
/// `parallel::process_group::DEFAULT_COLLECTIVE_TIMEOUT`.
pub fn collective_timeout(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Duration, LaunchError> {
    use crate::devices::parallel::process_group::DEFAULT_COLLECTIVE_TIMEOUT;
    seconds(&lookup, COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT)
}

/// Whole positive seconds from `var`, else `default`; a bad value named.
fn seconds(
    lookup: &dyn Fn(&str) -> Option<String>,
    var: &str,
    default: Duration,
) -> Result<Duration, LaunchError> {
    let Some(text) = lookup(var) else {
        return Ok(default);
    };
    match text.trim().parse::<u64>() {
        Ok(secs) if secs > 0 => Ok(Duration::from_secs(secs)),
        _ => Err(LaunchError::Env(format!(
            "{var}={text:?} is not a positive number of seconds; set it to e.g. {}, or unset \
             it for the default of {} s",
            default.as_secs(),
            default.as_secs()
        ))),
    }
}

fn torchrun(get: &dyn Fn(&str) -> Option<String>) -> Result<WorldSpec, LaunchError> {
    let how = "torchrun sets it for each process; when starting ranks by hand, set RANK, \
               LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT";
    let world_size = count(get, "WORLD_SIZE", how)?;
    let rank = number(get, "RANK", how)?;
    let local_rank = number(get, "LOCAL_RANK", how)?;
    let master_addr = required(get, "MASTER_ADDR", how)?;
    let master_port = port(get, "MASTER_PORT", how)?.ok_or_else(|| missing("MASTER_PORT", how))?;
    check_ranks(
        WorldSpec {
            rank,
            local_rank,
            world_size,
            master_addr,
            master_port,
            launcher: Launcher::Torchrun,
        },
        ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    )
}

fn slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<WorldSpec, LaunchError> {
    let how = "srun sets it for each task: start the command with `srun`, not directly in \
               the batch script";
    let (ntasks_key, world_size) = match get("SLURM_NTASKS") {
        Some(_) => ("SLURM_NTASKS", count(get, "SLURM_NTASKS", how)?),
        // Older Slurm releases name it SLURM_NPROCS.
        None if get("SLURM_NPROCS").is_some() => ("SLURM_NPROCS", count(get, "SLURM_NPROCS", how)?),
        None => return Err(missing("SLURM_NTASKS", how)),
    };
    let rank = number(get, "SLURM_PROCID", how)?;
    let local_rank = number(get, "SLURM_LOCALID", how)?;
    // MASTER_ADDR, when the job script sets it, names the interface rank 0 listens on;
    // otherwise rank 0 is on the allocation's first node.
    let master_addr = match get("MASTER_ADDR") {
        Some(addr) => addr.trim().to_string(),
        None => {
            let list = get("SLURM_JOB_NODELIST")
                .or_else(|| get("SLURM_NODELIST"))
                .ok_or_else(|| {
                    missing(
                        "SLURM_JOB_NODELIST",
                        "Slurm sets it in a job; outside one, set MASTER_ADDR to rank 0's host",
                    )
                })?;
            first_host(&list)?
        }
    };
    let master_port = port(get, "MASTER_PORT", how)?.unwrap_or(DEFAULT_MASTER_PORT);
    check_ranks(
        WorldSpec {
            rank,
            local_rank,
            world_size,
            master_addr,
            master_port,
            launcher: Launcher::Slurm,
        },
        ("SLURM_PROCID", "SLURM_LOCALID", ntasks_key),
    )
}

/// A rank must be inside its world.
fn check_ranks(
    spec: WorldSpec,
    (rank_key, local_key, world_key): (&str, &str, &str),
) -> Result<WorldSpec, LaunchError> {
    if spec.rank >= spec.world_size {
        return Err(LaunchError::Env(format!(
            "{rank_key}={} is outside a world of {world_key}={} ranks (ranks are 0..{}); \
             give every process a different rank below the world size",
            spec.rank,
            spec.world_size,
            spec.world_size - 1
        )));
    }
    if spec.local_rank >= spec.world_size {
        return Err(LaunchError::Env(format!(
            "{local_key}={} is not below {world_key}={}; it is this process's GPU on its \
             machine, so it counts from 0 on each machine",
            spec.local_rank, spec.world_size
        )));
    }
    Ok(spec)
}

fn missing(key: &str, how: &str) -> LaunchError {
    LaunchError::Env(format!("{key} is not set: {how}"))
}

fn required(
    get: &dyn Fn(&str) -> Option<String>,
    key: &str,
    how: &str,
) -> Result<String, LaunchError> {
    get(key)
        .map(|v| v.trim().to_string())
        .ok_or_else(|| missing(key, how))
}

fn number(
    get: &dyn Fn(&str) -> Option<String>,
    key: &str,
    how: &str,
) -> Result<usize, LaunchError> {
    let text = required(get, key, how)?;
    text.parse::<usize>()
        .map_err(|_| LaunchError::Env(format!("{key}={text:?} is not a whole number; {how}")))
}

/// A world size: a whole number of at least 1.
fn count(get: &dyn Fn(&str) -> Option<String>, key: &str, how: &str) -> Result<usize, LaunchError> {
    match number(get, key, how)? {
        0 => Err(LaunchError::Env(format!(
            "{key}=0: a world needs at least one rank; {how}"
        ))),
        n => Ok(n),
    }
}

fn port(
    get: &dyn Fn(&str) -> Option<String>,
    key: &str,
    how: &str,
) -> Result<Option<u16>, LaunchError> {
    let Some(text) = get(key) else {
        return Ok(None);
    };
    match text.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(Some(p)),
        _ => Err(LaunchError::Env(format!(
            "{key}={text:?} is not a TCP port (1 to 65535); {how}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    const TORCHRUN: [(&str, &str); 5] = [
        ("RANK", "9"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "16"),
        ("MASTER_ADDR", "node-a"),
        ("MASTER_PORT", "29400"),
    ];

    /// torchrun's five variables: rank 9 of 16, GPU 1 on its machine.
    #[test]
    fn torchrun_variables_give_the_rank_and_the_rendezvous() {
        let spec = world_from_env(env(&TORCHRUN)).unwrap().unwrap();
        assert_eq!(
            spec,
            WorldSpec {
                rank: 9,
                local_rank: 1,
                world_size: 16,
                master_addr: "node-a".into(),
                master_port: 29400,
                launcher: Launcher::Torchrun,
            }
        );
    }

    /// No launcher: one process, as before; `TUNESTUDIO_LAUNCHER=none` ignores a launcher's
    /// variables.
    #[test]
    fn without_a_launcher_there_is_no_world() {
        assert_eq!(world_from_env(env(&[])).unwrap(), None);
        let mut pairs = TORCHRUN.to_vec();
        pairs.push((LAUNCHER_ENV, "none"));
        assert_eq!(world_from_env(env(&pairs)).unwrap(), None);
        pairs.pop();
        pairs.push((LAUNCHER_ENV, "mpi"));
        let err = world_from_env(env(&pairs)).unwrap_err().to_string();
        assert!(err.contains(LAUNCHER_ENV), "{err}");
    }

    /// srun's task variables: rank 0 is on the node list's first host, the port defaults to
    /// 29500; MASTER_ADDR / MASTER_PORT override them; SLURM_NPROCS stands in for NTASKS.
    #[test]
    fn slurm_variables_give_the_rank_and_the_first_host() {
        let srun = [
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_JOB_NODELIST", "gpu[01-04,07],cpu3"),
        ];
        let spec = world_from_env(env(&srun)).unwrap().unwrap();
        assert_eq!(
            spec,
            WorldSpec {
                rank: 5,
                local_rank: 1,
                world_size: 8,
                master_addr: "gpu01".into(),
                master_port: DEFAULT_MASTER_PORT,
                launcher: Launcher::Slurm,
            }
        );
        let mut pairs = srun.to_vec();
        pairs.extend([("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "31000")]);
        let spec = world_from_env(env(&pairs)).unwrap().unwrap();
        assert_eq!(
            (spec.master_addr.as_str(), spec.master_port),
            ("10.0.0.1", 31000)
        );
        let old = [
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NPROCS", "2"),
            ("SLURM_NODELIST", "n[3-4]"),
        ];
        let spec = world_from_env(env(&old)).unwrap().unwrap();
        assert_eq!((spec.world_size, spec.master_addr.as_str()), (2, "n3"));
    }

    /// torchrun inside a Slurm job: torchrun's variables describe the processes it started.
    #[test]
    fn torchrun_wins_over_slurm() {
        let mut pairs = TORCHRUN.to_vec();
        pairs.extend([
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS", "2"),
        ]);
        let spec = world_from_env(env(&pairs)).unwrap().unwrap();
        assert_eq!((spec.launcher, spec.rank), (Launcher::Torchrun, 9));
    }

    /// Each missing or wrong variable is named, with the value it had and what to do.
    #[test]
    fn a_missing_or_invalid_variable_is_named() {
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (without(&TORCHRUN, "MASTER_ADDR"), "MASTER_ADDR is not set"),
            (without(&TORCHRUN, "MASTER_PORT"), "MASTER_PORT is not set"),
            (without(&TORCHRUN, "LOCAL_RANK"), "LOCAL_RANK is not set"),
            (without(&TORCHRUN, "WORLD_SIZE"), "WORLD_SIZE is not set"),
            (
                with(&TORCHRUN, "RANK", "two"),
                "RANK=\"two\" is not a whole number",
            ),
            (
                with(&TORCHRUN, "RANK", "16"),
                "RANK=16 is outside a world of WORLD_SIZE=16",
            ),
            (with(&TORCHRUN, "WORLD_SIZE", "0"), "WORLD_SIZE=0"),
            (
                with(&TORCHRUN, "MASTER_PORT", "70000"),
                "MASTER_PORT=\"70000\" is not a TCP port",
            ),
            (
                with(&TORCHRUN, "LOCAL_RANK", "16"),
                "LOCAL_RANK=16 is not below WORLD_SIZE=16",
            ),
            (
                vec![
                    ("SLURM_PROCID", "0"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_JOB_NODELIST", "a"),
                ],
                "SLURM_NTASKS is not set: srun sets it",
            ),
            (
                vec![
                    ("SLURM_PROCID", "0"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NTASKS", "2"),
                ],
                "SLURM_JOB_NODELIST is not set",
            ),
            (
                vec![
                    ("SLURM_PROCID", "3"),
                    ("SLURM_LOCALID", "0"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_JOB_NODELIST", "a"),
                ],
                "SLURM_PROCID=3 is outside a world of SLURM_NTASKS=2",
            ),
        ];
        for (pairs, expected) in cases {
            let err = world_from_env(env(&pairs)).unwrap_err().to_string();
            assert!(err.contains(expected), "expected {expected:?} in: {err}");
        }
    }

    /// The timeout: 300 s by default, whole seconds from the variable, a bad value named.
    #[test]
    fn the_rendezvous_timeout_reads_its_variable() {
        assert_eq!(
            rendezvous_timeout(env(&[])).unwrap(),
            DEFAULT_RENDEZVOUS_TIMEOUT
        );
        let three = env(&[(RENDEZVOUS_TIMEOUT_ENV, "3")]);
        assert_eq!(rendezvous_timeout(three).unwrap(), Duration::from_secs(3));
        for bad in ["0", "-1", "soon"] {
            let err = rendezvous_timeout(env(&[(RENDEZVOUS_TIMEOUT_ENV, bad)]))
                .unwrap_err()
                .to_string();
            assert!(err.contains(RENDEZVOUS_TIMEOUT_ENV), "{err}");
        }
    }

    fn without<'a>(pairs: &[(&'a str, &'a str)], key: &str) -> Vec<(&'a str, &'a str)> {
        pairs.iter().copied().filter(|(k, _)| *k != key).collect()
    }

    fn with<'a>(
        pairs: &[(&'a str, &'a str)],
        key: &'a str,
        value: &'a str,
    ) -> Vec<(&'a str, &'a str)> {
        let mut out = without(pairs, key);
        out.push((key, value));
        out
    }
}
