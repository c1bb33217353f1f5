//! Checkpoint I/O: resuming a run exactly (trainable weights, optimizer state, data position,
//! counters) and writing `checkpoint-<step>` folders.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Tensor;

use super::super::checkpoint::{self, TrainerState};
use super::super::config::RunConfig;
use super::super::error::TrainError;
use super::TrainingRun;
use crate::model::CausalLm;

impl TrainingRun {
    /// Prepares a run that continues from `checkpoint` (a `checkpoint-<step>` folder): the
    /// trainable weights, optimizer state, data position, loss scale and counters are restored,
    /// so the following steps are those the uninterrupted run would have made.
    pub fn resume(config: RunConfig, checkpoint_dir: &Path) -> Result<Self, TrainError> {
        Self::resume_allowing(config, checkpoint_dir, false)
    }

    /// As [`TrainingRun::resume`]; every setting that differs from the checkpoint's
    /// `run.toml` is reported as a warning with what it does, and one that breaks the exact
    /// continuation (model, data, precision, LoRA shape, device strategy) is refused unless
    /// `allow_config_change`.
    pub fn resume_allowing(
        config: RunConfig,
        checkpoint_dir: &Path,
        allow_config_change: bool,
    ) -> Result<Self, TrainError> {
        Self::resume_in(config, checkpoint_dir, allow_config_change, None)
    }

    /// [`Self::resume_allowing`] as one rank of a launched run when `world` is given (see
    /// [`TrainingRun::new_in`]): every rank reads the same checkpoint.
    pub fn resume_in(
        config: RunConfig,
        checkpoint_dir: &Path,
        allow_config_change: bool,
        world: Option<std::sync::Arc<crate::devices::parallel::process_group::ProcessGroup>>,
    ) -> Result<Self, TrainError> {
        let state = checkpoint::read_state(checkpoint_dir)?;
        let changes = match RunConfig::load(&checkpoint_dir.join(checkpoint::CONFIG_FILE)) {
            Ok(saved) => super::super::resume_changes::config_changes(&saved, &config),
            // A checkpoint of an older version may lack it: nothing to compare.
            Err(_) => Vec::new(),
        };
        let breaking: Vec<String> = changes
            .iter()
            .filter(|c| c.breaks_resume)
            .map(ToString::to_string)
            .collect();
        if !breaking.is_empty() && !allow_config_change {
            return Err(TrainError::Checkpoint {
                path: checkpoint_dir.to_path_buf(),
                message: format!(
                    "the run config differs from the checkpoint's in a way that breaks an exact resume: {}. Resume with the checkpoint's own run.toml, or pass --allow-config-change to continue anyway",
                    breaking.join("; ")
                ),
            });
        }
        let mut run = TrainingRun::new_in(config, world)?;
        run.load_checkpoint(checkpoint_dir, &state)?;
        run.splits.warnings.extend(
            changes
                .iter()
                .map(|c| format!("resumed with a changed setting: {c}")),
        );
        Ok(run)
    }

    /// Resumes from the newest checkpoint in the output folder, or starts fresh when there is none.
    pub fn resume_latest_or_new(config: RunConfig) -> Result<Self, TrainError> {
        match checkpoint::latest_checkpoint(&config.output_path()) {
            Some(dir) => TrainingRun::resume(config, &dir),
            None => TrainingRun::new(config),
        }
    }

    /// Reads the trainable weights of checkpoint `dir` one tensor at a time, each straight
    /// onto its parameter's own device (its stage under a layer split): the host holds one
    /// tensor at a time (on the CPU that buffer is the tensor), a GPU one tensor besides its
    /// weights. Data-parallel replicas take them from rank 0 afterwards (`sync_replicas`).
    fn load_trainable(&self, dir: &Path) -> Result<(), TrainError> {
        let file = checkpoint::TensorFile::open(&dir.join(checkpoint::TRAINABLE_FILE))?;
        let ck_err = |message: String| TrainError::Checkpoint {
            path: file.path().to_path_buf(),
            message,
        };
        for p in self.model.params().iter().filter(|p| p.trainable) {
            match file.dims(&p.name) {
                None => {
                    return Err(ck_err(format!(
                        "has no tensor `{}`; the checkpoint belongs to another model or LoRA setup",
                        p.name
                    )))
                }
                Some(dims) if dims != p.var.dims() => {
                    return Err(ck_err(format!(
                        "`{}` has shape {dims:?} in the checkpoint but {:?} in the model; the checkpoint belongs to another model",
                        p.name,
                        p.var.dims()
                    )))
                }
                Some(_) => {}
            }
            let t = file
                .load(&p.name, p.var.device())?
                .to_dtype(p.var.dtype())
                .map_err(|e| ck_err(format!("`{}`: {e}", p.name)))?;
            p.var
                .set(&t)
                .map_err(|e| ck_err(format!("`{}`: {e}", p.name)))?;
        }
        Ok(())
    }

    /// Restores checkpoint `dir` into a run just built from the same config: the trainable
    /// weights, every rank's optimizer state, the data position and the counters.
    fn load_checkpoint(&mut self, dir: &Path, state: &TrainerState) -> Result<(), TrainError> {
        self.check_resumable(dir, state)?;
        self.load_trainable(dir)?;
        // Every rank has the checkpoint's weights before its optimizer state is read (a master
        // copy the file lacks, and a sharded rank's ranges, come from them).
        self.sync_replicas()?;
        self.load_optimizer_states(dir, state)?;
        self.step = state.step;
        let index = self.resume_index(dir, state)?;
        self.loader.set_position(state.epoch, index);
        self.objective.read_checkpoint_state(dir)?;
        self.trained_tokens = state.trained_tokens;
        self.elapsed_secs = state.elapsed_secs;
        if self.scaler.is_some() {
            if let Some(s) = &state.loss_scaler {
                self.scaler = Some(s.clone());
            }
        }
        self.last_loss = state.last_loss;
        self.last_eval_loss = state.last_eval_loss;
        self.resumed_from = Some(dir.to_path_buf());
        self.last_checkpoint = Some(dir.to_path_buf());
        Ok(())
    }

    /// Refuses a checkpoint whose trainable set (LoRA or not) or precision differs from the
    /// config's: its tensors would not fit the model.
    fn check_resumable(&self, dir: &Path, state: &TrainerState) -> Result<(), TrainError> {
        let ck_err = |message: String| checkpoint_error(dir, message);
        if state.lora != self.config.lora.enabled {
            return Err(ck_err(format!(
                "the checkpoint was made with lora.enabled = {} but the config says {}; use the run's own config (its run.toml)",
                state.lora, self.config.lora.enabled
            )));
        }
        if state.precision != self.config.training.precision {
            return Err(ck_err(format!(
                "the checkpoint was made with training.precision = \"{}\" but the config says \"{}\"",
                state.precision, self.config.training.precision
            )));
        }
        Ok(())
    }

    /// Reads the optimizer state one tensor at a time from the file, straight into each rank's
    /// optimizer on its own device: every data-parallel rank reads the same file.
    fn load_optimizer_states(
        &mut self,
        dir: &Path,
        state: &TrainerState,
    ) -> Result<(), TrainError> {
        let opt = checkpoint::TensorFile::open(&dir.join(checkpoint::OPTIMIZER_FILE))?;
        // Sharded: the file holds the state whole (whatever device count wrote it); every rank
        // reads its ranges of it, after taking its weight ranges from the loaded weights.
        if let Some(sharded) = &mut self.sharded {
            let models: Vec<&CausalLm> = std::iter::once(&self.model)
                .chain(self.replicas.iter().map(|r| &r.model))
                .collect();
            sharded.refresh_from(&models)?;
            return sharded
                .load_state_from(&opt, state.optimizer_steps)
                .map_err(|e| checkpoint_error(dir, format!("optimizer state: {e}")));
        }
        let optimizers = std::iter::once(&mut self.optimizer)
            .chain(self.replicas.iter_mut().map(|r| &mut r.optimizer));
        for optimizer in optimizers {
            optimizer
                .load_state_from(&opt, state.optimizer_steps)
                .map_err(|e| checkpoint_error(dir, format!("optimizer state: {e}")))?;
        }
        Ok(())
    }

    /// The micro-step of the epoch the run continues at. With another micro-batch size (an
    /// out-of-memory refit) it is the same row, when the shuffled row order is the same
    /// (`group_by_length` off) and the row falls on a micro-batch boundary.
    fn resume_index(&self, dir: &Path, state: &TrainerState) -> Result<usize, TrainError> {
        let now = self.rows_per_micro_batch();
        let Some(rows) = state.rows_per_micro_batch.filter(|&rows| rows != now) else {
            return Ok(state.index_in_epoch);
        };
        let consumed = state.index_in_epoch * rows;
        if self.config.data.group_by_length || !consumed.is_multiple_of(now) {
            return Err(checkpoint_error(dir, format!(
                "the checkpoint was made with {rows} rows per micro-batch and the config has {now}; with data.group_by_length on (or row {consumed} not on a micro-batch boundary) the data order cannot continue: keep training.micro_batch as it was"
            )));
        }
        Ok(consumed / now)
    }

    /// The state an exact resume needs.
    pub fn trainer_state(&self) -> TrainerState {
        let (epoch, index_in_epoch) = self.loader.position();
        TrainerState {
            format_version: checkpoint::FORMAT_VERSION,
            step: self.step,
            optimizer_steps: match &self.sharded {
                Some(s) => s.steps_taken(),
                None => self.optimizer.steps_taken(),
            },
            epoch,
            index_in_epoch,
            trained_tokens: self.trained_tokens,
            elapsed_secs: self.elapsed_secs,
            seed: self.config.training.seed,
            precision: self.config.training.precision,
            lora: self.config.lora.enabled,
            loss_scaler: self.scaler.clone(),
            last_loss: self.last_loss,
            last_eval_loss: self.last_eval_loss,
            rows_per_micro_batch: Some(self.rows_per_micro_batch()),
        }
    }

    /// Writes `<output>/checkpoint-<step>` atomically and prunes old ones to `keep_last`.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf, TrainError> {
        let started = Instant::now();
        // ZeRO-3: the checkpoint holds the layers whole, whatever device count wrote them.
        self.gather_weights()?;
        let out = self.config.output_path();
        std::fs::create_dir_all(&out).map_err(|cause| TrainError::Io {
            path: out.clone(),
            cause,
        })?;
        let state = self.trainer_state();
        let config_text = self.config.with_absolute_paths().to_toml_string()?;
        let path = checkpoint::write_atomically(&out, self.step, |dir| {
            self.write_checkpoint_files(dir, &state, &config_text)
        })?;
        checkpoint::prune_checkpoints(&out, self.config.checkpoint.keep_last)?;
        self.last_checkpoint = Some(path.clone());
        self.elapsed_secs += started.elapsed().as_secs_f64();
        Ok(path)
    }

    /// Whether every rank of a launched run takes part in a checkpoint: a sharded run's
    /// optimizer state is spread over the processes, and rank 0 writes it whole.
    pub fn checkpoint_needs_every_rank(&self) -> bool {
        self.sharded.is_some() && self.world_size() > 1
    }

    /// A launched sharded run's rank that writes no checkpoint: its share of the optimizer
    /// state, joined into rank 0's file by the same collective rank 0's
    /// [`Self::save_checkpoint`] runs. Every rank calls one of them at the same step.
    pub fn share_checkpoint_state(&mut self) -> Result<(), TrainError> {
        if let Some(sharded) = &self.sharded {
            sharded.save_state(None, self.shard_reducer().as_ref())?;
        }
        self.shared_checkpoint_step = Some(self.step);
        Ok(())
    }

    /// The step of the last [`Self::share_checkpoint_state`].
    pub fn shared_checkpoint_step(&self) -> Option<u64> {
        self.shared_checkpoint_step
    }

    /// The files of checkpoint folder `dir`: the trainable tensors, the optimizer state, the
    /// adapter (LoRA), the run config, and last the state file, whose presence marks the
    /// checkpoint complete.
    fn write_checkpoint_files(
        &self,
        dir: &Path,
        state: &TrainerState,
        config_text: &str,
    ) -> Result<(), TrainError> {
        let ck_err = |message: String| checkpoint_error(dir, message);
        let trainable: HashMap<String, Tensor> = self
            .model
            .params()
            .iter()
            .filter(|p| p.trainable)
            .map(|p| (p.name.clone(), p.var.as_tensor().clone()))
            .collect();
        checkpoint::save_tensors(&dir.join(checkpoint::TRAINABLE_FILE), &trainable)?;
        match &self.sharded {
            Some(sharded) => sharded.save_state(
                Some(&dir.join(checkpoint::OPTIMIZER_FILE)),
                self.shard_reducer().as_ref(),
            )?,
            None => self
                .optimizer
                .save_state(&dir.join(checkpoint::OPTIMIZER_FILE))
                .map_err(|e| ck_err(format!("optimizer state: {e}")))?,
        }
        if self.config.lora.enabled {
            self.model
                .save_adapter(&dir.join(checkpoint::ADAPTER_DIR))
                .map_err(|e| ck_err(format!("adapter: {e}")))?;
        }
        std::fs::write(dir.join(checkpoint::CONFIG_FILE), config_text)
            .map_err(|e| ck_err(e.to_string()))?;
        self.objective.write_checkpoint_state(dir, self.step)?;
        checkpoint::write_state(dir, state)
    }
}

/// A problem with checkpoint `dir`.
fn checkpoint_error(dir: &Path, message: String) -> TrainError {
    TrainError::Checkpoint {
        path: dir.to_path_buf(),
        message,
    }
}
