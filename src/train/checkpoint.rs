//! Checkpoint folders: `<output>/checkpoint-<step>/` holding
//!
//! - `trainable.safetensors`: the trainable parameters (all weights, or only the LoRA ones),
//! - `adapter/`: the PEFT adapter when LoRA is on (usable outside tunestudio),
//! - `optimizer.safetensors`: AdamW moments (and f32 master weights in mixed precision),
//! - `trainer_state.json`: step, data-loader position, loss scale, RNG seed, token counts,
//! - `run.toml`: the run config.
//!
//! A checkpoint is written into `checkpoint-<step>.tmp` and renamed when complete, so a
//! crash never leaves a half-written `checkpoint-<step>`.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use super::error::TrainError;
use super::precision::{LossScaler, Precision};

/// File names inside a checkpoint folder.
pub const TRAINABLE_FILE: &str = "trainable.safetensors";
/// Optimizer state file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Trainer state file.
pub const STATE_FILE: &str = "trainer_state.json";
/// Config copy.
pub const CONFIG_FILE: &str = "run.toml";
/// PEFT adapter sub-folder.
pub const ADAPTER_DIR: &str = "adapter";

const PREFIX: &str = "checkpoint-";

/// Everything besides tensors that an exact resume needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Layout version of the checkpoint.
    pub format_version: u32,
    /// Optimizer steps done (including skipped fp16 steps).
    pub step: u64,
    /// Steps the optimizer actually applied.
    pub optimizer_steps: u64,
    /// Data loader: current epoch (0-based).
    pub epoch: u64,
    /// Data loader: index of the next row in the epoch's seeded shuffle.
    pub index_in_epoch: usize,
    /// Label tokens trained so far.
    pub trained_tokens: u64,
    /// Seconds of training so far.
    pub elapsed_secs: f64,
    /// The run seed; every random stream (data order, dropout) derives from it and the step.
    pub seed: u64,
    /// Precision mode of the run.
    pub precision: Precision,
    /// Whether the trainable parameters are LoRA adapters.
    pub lora: bool,
    /// fp16-mixed loss scaler.
    pub loss_scaler: Option<LossScaler>,
    /// Loss of the last step.
    pub last_loss: Option<f64>,
    /// Last evaluation loss.
    pub last_eval_loss: Option<f64>,
    /// Rows per micro-batch (over every data-parallel rank) when saved, so a resume with
    /// another micro-batch (an out-of-memory refit) continues at the same row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_per_micro_batch: Option<usize>,
}

/// The current checkpoint layout version.
pub const FORMAT_VERSION: u32 = 1;

fn io_err(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The folder name of the checkpoint of `step`.
pub fn checkpoint_dir(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("{PREFIX}{step}"))
}

/// Writes a checkpoint atomically: `write` fills a fresh `checkpoint-<step>.tmp`, which is then
/// renamed to `checkpoint-<step>` (replacing an older one of the same step).
pub fn write_atomically(
    output_dir: &Path,
    step: u64,
    write: impl FnOnce(&Path) -> Result<(), TrainError>,
) -> Result<PathBuf, TrainError> {
    let final_dir = checkpoint_dir(output_dir, step);
    let tmp_dir = output_dir.join(format!("{PREFIX}{step}.tmp"));
    if tmp_dir.exists() {
        std::fs::remove_dir_all(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;
    }
    std::fs::create_dir_all(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;
    if let Err(e) = write(&tmp_dir) {
        let _ = std::fs::remove_dir_all(&tmp_dir);
        return Err(e);
    }
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| io_err(&final_dir, e))?;
    }
    std::fs::rename(&tmp_dir, &final_dir).map_err(|e| io_err(&final_dir, e))?;
    Ok(final_dir)
}

/// Complete checkpoints in `output_dir`, oldest first (`.tmp` leftovers are ignored).
pub fn list_checkpoints(output_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(output_dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().to_string();
                    let step = name.strip_prefix(PREFIX)?.parse::<u64>().ok()?;
                    let path = e.path();
                    path.join(STATE_FILE).is_file().then_some((step, path))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort_by_key(|(s, _)| *s);
    found
}

/// Sets aside the checkpoints of `output_dir` after step `last_good` (renamed
/// `checkpoint-<step>-diverged`, kept for inspection), so `--resume latest` continues from the
/// last good one; returns it. A loss that spikes at step k was made by the weights step k−1
/// wrote, so after a divergence at k the last good checkpoint is k−2's.
pub fn set_aside_after(output_dir: &Path, last_good: u64) -> Option<PathBuf> {
    let mut good = None;
    for (step, path) in list_checkpoints(output_dir) {
        if step <= last_good {
            good = Some(path);
            continue;
        }
        let mut aside = path.clone().into_os_string();
        aside.push("-diverged");
        // Best effort: a checkpoint that cannot be renamed stays (the report names the
        // good one either way).
        let _ = std::fs::rename(&path, aside);
    }
    good
}

/// What another run left in `output_dir` (its `metrics.jsonl`, its checkpoints), in words, or
/// `None` when a fresh run may start there. A fresh start never writes into another run's
/// folder: its metrics would interleave and `--resume latest` would pick the wrong run.
pub fn existing_run(output_dir: &Path) -> Option<String> {
    let mut found = Vec::new();
    if output_dir.join(super::metrics::METRICS_FILE).is_file() {
        found.push(super::metrics::METRICS_FILE.to_string());
    }
    let checkpoints = list_checkpoints(output_dir);
    match checkpoints.last() {
        Some((step, _)) if checkpoints.len() == 1 => found.push(format!("checkpoint-{step}")),
        Some((step, _)) => found.push(format!(
            "{} checkpoints up to checkpoint-{step}",
            checkpoints.len()
        )),
        None => {}
    }
    (!found.is_empty()).then(|| {
        format!(
            "`{}` already holds a run ({})",
            output_dir.display(),
            found.join(", ")
        )
    })
}

/// The newest complete checkpoint in `output_dir`.
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    list_checkpoints(output_dir).pop().map(|(_, p)| p)
}

/// Deletes all but the newest `keep_last` checkpoints (0 keeps all); returns the deleted folders.
pub fn prune_checkpoints(output_dir: &Path, keep_last: usize) -> Result<Vec<PathBuf>, TrainError> {
    if keep_last == 0 {
        return Ok(Vec::new());
    }
    let all = list_checkpoints(output_dir);
    let excess = all.len().saturating_sub(keep_last);
    let mut removed = Vec::new();
    for (_, path) in all.into_iter().take(excess) {
        std::fs::remove_dir_all(&path).map_err(|e| io_err(&path, e))?;
        removed.push(path);
    }
    Ok(removed)
}

/// Writes `trainer_state.json`.
pub fn write_state(dir: &Path, state: &TrainerState) -> Result<(), TrainError> {
    let path = dir.join(STATE_FILE);
    let text = serde_json::to_string_pretty(state).map_err(|e| io_err(&path, e))?;
    std::fs::write(&path, text).map_err(|e| io_err(&path, e))
}

/// Reads `trainer_state.json` of a checkpoint folder.
pub fn read_state(dir: &Path) -> Result<TrainerState, TrainError> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        io_err(
            dir,
            format!("cannot read {STATE_FILE} ({e}); is this a tunestudio checkpoint folder (`checkpoint-<step>`)?"),
        )
    })?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| io_err(&path, format!("{STATE_FILE} is damaged: {e}")))?;
    if state.format_version != FORMAT_VERSION {
        return Err(io_err(
            dir,
            format!(
                "checkpoint format {} is not supported by this tunestudio (format {FORMAT_VERSION})",
                state.format_version
            ),
        ));
    }
    Ok(state)
}

/// Saves named tensors as safetensors.
pub fn save_tensors(
    path: &Path,
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<(), TrainError> {
    candle_core::safetensors::save(tensors, path).map_err(|e| io_err(path, e))
}

/// Loads named tensors from safetensors.
pub fn load_tensors(
    path: &Path,
    device: &candle_core::Device,
) -> Result<std::collections::HashMap<String, candle_core::Tensor>, TrainError> {
    candle_core::safetensors::load(path, device).map_err(|e| io_err(path, e))
}

/// A checkpoint file memory-mapped, so a resume reads one tensor at a time and puts each
/// directly on its own device (no copy of the whole file on one device or in the heap).
pub fn open_tensors(
    path: &Path,
) -> Result<candle_core::safetensors::MmapedSafetensors, TrainError> {
    // SAFETY: the checkpoint folder is the run's own; it is not modified while training
    // resumes from it (a new checkpoint is written under a temporary name, then renamed).
    unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }.map_err(|e| io_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> TrainerState {
        TrainerState {
            format_version: FORMAT_VERSION,
            step,
            optimizer_steps: step,
            epoch: 0,
            index_in_epoch: 3,
            trained_tokens: 10,
            elapsed_secs: 1.0,
            seed: 1,
            precision: Precision::Fp32,
            lora: false,
            loss_scaler: None,
            last_loss: Some(1.0),
            last_eval_loss: None,
            rows_per_micro_batch: Some(4),
        }
    }

    #[test]
    fn atomic_write_list_and_prune() {
        let tmp = tempfile::tempdir().unwrap();
        for step in [5, 10, 15] {
            write_atomically(tmp.path(), step, |d| write_state(d, &state(step))).unwrap();
        }
        // A failed write leaves neither the folder nor the .tmp.
        let failed = write_atomically(tmp.path(), 20, |_| {
            Err(TrainError::EmptyDataset("x".into()))
        });
        assert!(failed.is_err());
        assert!(!tmp.path().join("checkpoint-20").exists());
        assert!(!tmp.path().join("checkpoint-20.tmp").exists());
        // A leftover .tmp from a crash is not a checkpoint.
        std::fs::create_dir_all(tmp.path().join("checkpoint-25.tmp")).unwrap();
        let steps: Vec<u64> = list_checkpoints(tmp.path()).iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![5, 10, 15]);
        prune_checkpoints(tmp.path(), 2).unwrap();
        let steps: Vec<u64> = list_checkpoints(tmp.path()).iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![10, 15]);
        let latest = latest_checkpoint(tmp.path()).unwrap();
        assert_eq!(read_state(&latest).unwrap(), state(15));
    }
}
