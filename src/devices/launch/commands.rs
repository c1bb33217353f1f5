//! The commands that start a run over several machines: the `torchrun` line to run on each
//! machine and the Slurm batch script, for a number of machines × GPUs on each (what the
//! studio's Export panel prints, and what docs/multi-node.md shows).

use super::env::DEFAULT_MASTER_PORT;

/// A run over `nodes` machines with `gpus_per_node` GPUs each: one rank (process) per GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchShape {
    /// Machines.
    pub nodes: usize,
    /// GPUs on each machine, one rank each.
    pub gpus_per_node: usize,
    /// The run config every rank trains (`tunestudio train --config`).
    pub config_path: String,
}

impl LaunchShape {
    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        self.nodes.max(1) * self.gpus_per_node.max(1)
    }

    /// The `torchrun` line to run on every machine, `$NODE_RANK` being 0 on the first machine
    /// (whose address is `$MASTER_ADDR`, reachable from the others), 1 on the next, and so on.
    /// One machine needs no address: it rendezvouses on 127.0.0.1.
    pub fn torchrun(&self) -> String {
        let nodes = self.nodes.max(1);
        let (node_rank, master) = if nodes == 1 {
            ("0", "127.0.0.1")
        } else {
            ("$NODE_RANK", "$MASTER_ADDR")
        };
        format!(
            "torchrun --nnodes {nodes} --nproc-per-node {} --node-rank {node_rank} \\\n  \
             --master-addr {master} --master-port {DEFAULT_MASTER_PORT} \\\n  \
             --no-python $(which tunestudio) train --config {}",
            self.gpus_per_node.max(1),
            shell_quoted(&self.config_path)
        )
    }

    /// A Slurm batch script: one task per GPU, started by `srun` (run directly in the script,
    /// the command would be task 0 of a world whose other tasks never start). The rendezvous
    /// is on the first node of the allocation, at the default port.
    pub fn sbatch(&self) -> String {
        format!(
            "#!/bin/bash\n\
             #SBATCH --nodes={}\n\
             #SBATCH --ntasks-per-node={gpus}\n\
             #SBATCH --gpus-per-node={gpus}\n\
             export MASTER_PORT={DEFAULT_MASTER_PORT}\n\
             srun tunestudio train --config {}\n",
            self.nodes.max(1),
            shell_quoted(&self.config_path),
            gpus = self.gpus_per_node.max(1),
        )
    }
}

/// `path` as one shell word: as it is when it has no character the shell would split or
/// expand, else in single quotes (a quote inside written `'\''`).
pub fn shell_quoted(path: &str) -> String {
    let p = path.trim();
    let plain = !p.is_empty()
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+:=@,%".contains(c));
    if plain {
        p.to_string()
    } else {
        format!("'{}'", p.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(nodes: usize, gpus_per_node: usize, path: &str) -> LaunchShape {
        LaunchShape {
            nodes,
            gpus_per_node,
            config_path: path.into(),
        }
    }

    #[test]
    fn two_machines_of_eight_gpus_are_sixteen_ranks_started_on_each_machine() {
        let s = shape(2, 8, "/runs/dicta/run.toml");
        assert_eq!(s.world_size(), 16);
        assert_eq!(
            s.torchrun(),
            "torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \\\n  \
             --master-addr $MASTER_ADDR --master-port 29500 \\\n  \
             --no-python $(which tunestudio) train --config /runs/dicta/run.toml"
        );
        let script = s.sbatch();
        assert!(script.starts_with("#!/bin/bash\n"), "{script}");
        for line in [
            "#SBATCH --nodes=2",
            "#SBATCH --ntasks-per-node=8",
            "#SBATCH --gpus-per-node=8",
            "srun tunestudio train --config /runs/dicta/run.toml",
        ] {
            assert!(script.lines().any(|l| l == line), "{line} in {script}");
        }
    }

    #[test]
    fn one_machine_rendezvouses_on_itself() {
        let line = shape(1, 2, "run.toml").torchrun();
        assert!(
            line.contains("--nnodes 1 --nproc-per-node 2 --node-rank 0"),
            "{line}"
        );
        assert!(line.contains("--master-addr 127.0.0.1"), "{line}");
    }

    #[test]
    fn a_path_the_shell_would_split_is_quoted() {
        assert_eq!(shell_quoted("/tmp/run.toml"), "/tmp/run.toml");
        assert_eq!(
            shell_quoted("/tmp/my run/run.toml"),
            "'/tmp/my run/run.toml'"
        );
        assert_eq!(
            shell_quoted("/tmp/it's/run.toml"),
            "'/tmp/it'\\''s/run.toml'"
        );
        assert_eq!(shell_quoted("/tmp/$HOME/r.toml"), "'/tmp/$HOME/r.toml'");
        assert!(shape(2, 4, "/a b/run.toml")
            .sbatch()
            .contains("--config '/a b/run.toml'"));
    }
}
