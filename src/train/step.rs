//! The synchronous training loop: [`TrainingRun`] owns the model, optimizer, data order and
//! counters; [`TrainingRun::step`] runs one optimizer step (all accumulated micro-batches).
//!
//! Loss normalisation: each micro-batch's *summed* token loss is back-propagated as is, the
//! gradients are summed over the micro-batches, and the optimizer multiplies them by
//! `1 / total_label_tokens` (times the clipping coefficient and the inverse loss scale).
//! That is the gradient of the mean token loss over the whole accumulated batch, so
//! `micro_batch = 1, gradient_accumulation = 4` trains exactly like `micro_batch = 4`.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::model::{
    AdamW, AdamWConfig, CausalLm, Gradients, OpsMode, OptimizerOffload, StatePlacement,
};

use super::checkpoint::{self, TrainerState};
use super::config::{InitMode, RunConfig};
use super::error::{step_error, Phase, TrainError};
use super::loader::{derive_seed, DataLoader};
use super::precision::{LossScaler, Precision};
use super::samples::{self, Sample, Splits};
use super::schedule::LrSchedule;

/// Stream id of LoRA initialisation.
const LORA_STREAM: u64 = 2;
/// Stream id of dropout masks.
pub(crate) const DROPOUT_STREAM: u64 = 3;
/// fp16: this many skipped steps in a row means scaling cannot fix it.
const MAX_CONSECUTIVE_SKIPS: u64 = 64;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// 1-based index of the step just done.
    pub step: u64,
    /// Mean token loss over the step's micro-batches.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global norm of the token-normalised gradient, before clipping (NaN when skipped).
    pub grad_norm: f64,
    /// Label tokens in this step.
    pub tokens: u64,
    /// Label tokens per second of this step.
    pub tokens_per_sec: f64,
    /// Label tokens trained so far.
    pub trained_tokens: u64,
    /// Seconds spent training so far.
    pub elapsed_secs: f64,
    /// Fractional epoch reached.
    pub epoch: f64,
    /// fp16: the update was skipped (gradient overflow); the scale was halved.
    pub skipped: bool,
    /// fp16: the loss scale after this step.
    pub loss_scale: Option<f64>,
    /// `(rows, padded length)` of each micro-batch.
    pub batch_shapes: Vec<(usize, usize)>,
    /// A preference step's metrics under TRL's names (`rewards/chosen`, ...); `None` for SFT.
    pub preference: Option<crate::model::preference::PreferenceMetrics>,
}

/// An evaluation's result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// The step it followed.
    pub step: u64,
    /// Mean token loss.
    pub loss: f64,
    /// exp(loss).
    pub perplexity: f64,
    /// Label tokens evaluated.
    pub tokens: u64,
}

/// The gradient of the next step (for tests and diagnostics): token-normalised, unscaled, f32.
#[derive(Debug, Clone)]
pub struct StepGradients {
    /// Gradient of the mean token loss, by parameter name.
    pub grads: HashMap<String, Tensor>,
    /// Label tokens of the step.
    pub tokens: u64,
    /// Mean token loss.
    pub loss: f64,
}

/// Gradients summed over the micro-batches of a step (and, under data parallel, over the
/// ranks), before normalisation.
struct Accumulated {
    /// One set per rank (on that rank's devices), equal after the all-reduce; empty when
    /// no micro-batch had a trained token.
    grads: Vec<Gradients>,
    loss_sum: f64,
    /// What the loss sum is divided by: trained tokens (SFT) or pairs (preference).
    tokens: u64,
    /// Trained (label) tokens, for the throughput figures.
    label_tokens: u64,
    /// A preference step's metrics (TRL's names), merged over its micro-batches.
    preference: Option<crate::model::preference::PreferenceMetrics>,
    shapes: Vec<(usize, usize)>,
    /// What the summed loss was multiplied by before backward.
    backward_factor: f64,
}

impl Accumulated {
    /// Nothing accumulated yet; the summed loss is multiplied by `backward_factor`.
    fn new(backward_factor: f64) -> Self {
        Accumulated {
            grads: Vec::new(),
            loss_sum: 0.0,
            tokens: 0,
            label_tokens: 0,
            preference: None,
            shapes: Vec::new(),
            backward_factor,
        }
    }
}

/// A data-parallel rank other than rank 0: its own model replica and optimizer, on its device.
struct Replica {
    model: CausalLm,
    optimizer: AdamW,
}

/// The run's data: SFT samples, or preference pairs (their lints and warnings in `Splits`).
fn load_data(
    config: &RunConfig,
    tokenizer: &crate::data::TokenizerBundle,
    has_weights: bool,
) -> Result<(Splits, Option<super::preference::PairRun>), TrainError> {
    if config.training.method.is_preference() {
        let (splits, pairs) =
            super::preference::load_checked_pairs(config, tokenizer, has_weights)?;
        Ok((splits, Some(pairs)))
    } else {
        Ok((
            samples::load_checked_splits(config, tokenizer, has_weights)?,
            None,
        ))
    }
}

/// A preference run's reference pass (the model as loaded is the reference, see
/// `train::preference`) and the lengths its loader groups by; `None` for SFT.
fn prepare_pairs(
    pairs: Option<&mut super::preference::PairRun>,
    model: &CausalLm,
    pad_id: u32,
    micro_batch: usize,
) -> Result<Option<Vec<usize>>, TrainError> {
    let Some(p) = pairs else {
        return Ok(None);
    };
    p.compute_reference(model, pad_id, micro_batch)
        .map_err(|cause| TrainError::Model {
            context: "cannot compute the reference log-probabilities of the pairs".into(),
            cause,
        })?;
    Ok(Some(p.train_lengths()))
}

/// The model and optimizer of every data-parallel rank after the first (none otherwise).
fn build_replicas(
    config: &RunConfig,
    placement: &super::placement::RunPlacement,
) -> Result<Vec<Replica>, TrainError> {
    let mut replicas = Vec::new();
    for d in placement.devices.iter().take(placement.ranks()).skip(1) {
        let (model, _) = build_model(config, &d.candle)?;
        let optimizer = build_optimizer(config, &model)?;
        replicas.push(Replica { model, optimizer });
    }
    Ok(replicas)
}

/// `[preference] reference = "copy"`: a frozen copy of the starting weights for every rank, on
/// that rank's devices (rank 0's spread over the stages like the policy under a layer split);
/// none for any other run.
fn build_reference_copies(
    config: &RunConfig,
    placement: &super::placement::RunPlacement,
    pairs: Option<&super::preference::PairRun>,
) -> Result<Vec<CausalLm>, TrainError> {
    if pairs.is_none_or(|p| p.source != super::preference::ReferenceSource::Copy) {
        return Ok(Vec::new());
    }
    let context = |what: &str| format!("cannot build the frozen reference copy ({what})");
    let mut copies = Vec::new();
    for (rank, d) in placement.devices.iter().take(placement.ranks()).enumerate() {
        let (mut copy, _) = build_model(config, &d.candle)?;
        if rank == 0 {
            if let Some(per_layer) = placement.layer_devices(copy.config().num_hidden_layers) {
                copy.set_layer_devices(&per_layer)
                    .map_err(|cause| TrainError::Model {
                        context: context("its layers over `[devices] devices`"),
                        cause,
                    })?;
            }
        }
        copy.freeze().map_err(|cause| TrainError::Model {
            context: context("freezing it"),
            cause,
        })?;
        copies.push(copy);
    }
    Ok(copies)
}

/// A training run, driven synchronously.
pub struct TrainingRun {
    config: RunConfig,
    device: Device,
    placement: super::placement::RunPlacement,
    /// Rank 0 (the only rank unless the strategy is data parallel).
    model: CausalLm,
    optimizer: AdamW,
    /// Ranks 1.. under data parallel.
    replicas: Vec<Replica>,
    splits: Splits,
    /// `[training] method = "dpo" | "orpo"`: the pairs, loss and reference (`splits` is then
    /// empty but for its lints and warnings).
    pairs: Option<super::preference::PairRun>,
    /// `reference = "copy"`: each rank's frozen reference, rank 0 first (empty otherwise).
    reference_copies: Vec<CausalLm>,
    loader: DataLoader,
    schedule: LrSchedule,
    total_steps: u64,
    step: u64,
    trained_tokens: u64,
    elapsed_secs: f64,
    scaler: Option<LossScaler>,
    consecutive_skips: u64,
    last_loss: Option<f64>,
    last_eval_loss: Option<f64>,
    last_checkpoint: Option<PathBuf>,
    resumed_from: Option<PathBuf>,
    pad_id: u32,
    model_dir: PathBuf,
    /// Σ bytes of rank 0's gradient store when the last step's backward returned.
    last_gradient_bytes: Option<u64>,
    /// The NCCL communicators of a data-parallel run over distinct GPUs: created once per
    /// run (NCCL's setup costs far more than a step) and reused by every step.
    #[cfg(feature = "nccl")]
    nccl: Option<crate::devices::parallel::nccl::NcclReducer>,
}

/// Parses a `[devices]` entry into a candle device.
pub fn parse_device(name: &str) -> Result<Device, TrainError> {
    let err = |message: String| TrainError::Device {
        device: name.to_string(),
        message,
    };
    match name {
        "cpu" => Ok(Device::Cpu),
        _ => {
            let (kind, idx) = name.split_once(':').unwrap_or((name, "0"));
            let idx: usize = idx
                .parse()
                .map_err(|_| err(format!("`{idx}` is not a device number")))?;
            match kind {
                "cuda" => Device::new_cuda(idx).map_err(|e| err(e.to_string())),
                "metal" => Device::new_metal(idx).map_err(|e| err(e.to_string())),
                _ => Err(err("unknown device kind".into())),
            }
        }
    }
}

/// Builds the model a run config describes: pretrained or random weights in the precision's
/// dtype, activation checkpointing and LoRA applied. Returns it with its folder.
pub fn build_model(config: &RunConfig, device: &Device) -> Result<(CausalLm, PathBuf), TrainError> {
    let source = config.model_source();
    let model_err = |context: String| {
        move |cause: crate::model::ModelError| TrainError::Model { context, cause }
    };
    let (dir, config_path, has_any_weights) = locate_model(config)?;
    let dtype = config.compute_dtype();
    let random = match config.model.init {
        InitMode::Random => true,
        InitMode::Pretrained => false,
        InitMode::Auto => !has_any_weights,
    };
    if !random && !has_any_weights {
        return Err(TrainError::Model {
            context: format!("`{source}` has no weights (model.init = \"pretrained\")"),
            cause: crate::model::ModelError::MissingFile {
                path: dir.join("model.safetensors"),
                hint: "add the safetensors weights, or set `[model] init = \"random\"`".into(),
            },
        });
    }
    let mut model = if random {
        let mc = crate::model::ModelConfig::from_file(&config_path).map_err(model_err(format!(
            "cannot read `{}`",
            config_path.display()
        )))?;
        CausalLm::random_init(&mc, config.training.seed, dtype, device).map_err(model_err(
            format!("cannot initialise the model of `{}`", config_path.display()),
        ))?
    } else {
        // QLoRA: the base linears are quantized as they are read (or come from the cache).
        crate::model::ModelFiles::from_dir(&dir)
            .and_then(|files| {
                CausalLm::load_files_quantized(&files, dtype, device, config.model.quantize)
            })
            .map_err(model_err(format!(
                "cannot load the model `{}`",
                dir.display()
            )))?
    };
    if config.model.quantize.is_on() {
        model
            .quantize_base(config.model.quantize)
            .map_err(model_err(
                "cannot quantize the base (model.quantize)".into(),
            ))?;
    }
    model.set_activation_checkpointing(config.training.activation_checkpointing);
    if config.lora.enabled {
        model
            .apply_lora(
                &config.lora.to_model_config(),
                derive_seed(config.training.seed, LORA_STREAM, 0),
            )
            .map_err(model_err(
                "cannot add LoRA adapters (check `[lora] target_modules`)".into(),
            ))?;
    }
    Ok((model, dir))
}

/// AdamW for a model's trainable parameters, its state placed as the run asks:
/// offloading keeps it in host RAM; the generic path (the GPU's code) keeps it as
/// device tensors updated with tensor ops; otherwise where the parameter lives.
fn build_optimizer(config: &RunConfig, model: &CausalLm) -> Result<AdamW, TrainError> {
    let t = &config.training;
    let adam_cfg = AdamWConfig {
        lr: t.learning_rate,
        beta1: t.adam_beta1,
        beta2: t.adam_beta2,
        eps: t.adam_epsilon,
        weight_decay: t.weight_decay,
        decay_norms_and_biases: t.decay_norms_and_biases,
    };
    let model_err = |context: &str| {
        let context = context.to_string();
        move |cause| TrainError::Model { context, cause }
    };
    let mut optimizer = AdamW::new(model.params(), adam_cfg, t.precision.master_weights())
        .map_err(model_err("cannot create the optimizer"))?;
    let placement = match (t.optimizer_offload, model.ops_mode()) {
        (OptimizerOffload::Host, _) => Some(StatePlacement::Host),
        (OptimizerOffload::None, OpsMode::Generic) => Some(StatePlacement::Device),
        _ => None,
    };
    if let Some(placement) = placement {
        optimizer
            .set_state_placement(placement)
            .map_err(model_err("cannot place the optimizer state"))?;
    }
    Ok(optimizer)
}

/// The model's folder, its `config.json` and whether it has weights, without reading them.
pub(crate) fn locate_model(config: &RunConfig) -> Result<(PathBuf, PathBuf, bool), TrainError> {
    let source = config.model_source();
    let local = Path::new(&source);
    // A local folder without weights needs only its config.json (random initialisation);
    // resolve_model insists on weights, so it is only asked when there are some or for hub ids.
    if local.is_dir() && !has_weights(local) {
        return Ok((local.to_path_buf(), local.join("config.json"), false));
    }
    let files = crate::model::resolve_model(&source).map_err(|cause| TrainError::Model {
        context: format!("cannot find the model `{source}` (model.source)"),
        cause,
    })?;
    let any = !files.weights.is_empty();
    Ok((files.dir, files.config, any))
}

/// Whether a folder holds safetensors weights.
fn has_weights(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        })
        .unwrap_or(false)
}

impl TrainingRun {
    /// Prepares a fresh run: validates the config, loads the model and tokenizer,
    /// tokenises the data and builds the optimizer. Nothing is written yet.
    pub fn new(config: RunConfig) -> Result<Self, TrainError> {
        let problems = config.validate();
        if !problems.is_empty() {
            return Err(super::error::ConfigError::Invalid {
                origin: "run config".into(),
                problems,
            }
            .into());
        }
        // The data first: a run its lints stop never loads the weights.
        let (model_dir, config_path, has_weights) = locate_model(&config)?;
        let tokenizer = samples::load_tokenizer(&model_dir)?;
        let model_config = crate::model::ModelConfig::from_file(&config_path).map_err(|cause| {
            TrainError::Model {
                context: format!("cannot read `{}`", config_path.display()),
                cause,
            }
        })?;
        samples::check_vocab(&tokenizer, &model_dir, model_config.vocab_size)?;
        let pad_id = tokenizer.pad().id;
        let (splits, mut pairs) = load_data(&config, &tokenizer, has_weights)?;
        let placement = super::placement::RunPlacement::open(
            &config,
            samples::split_trained_tokens(&config, &splits.train),
        )?;
        let device = placement.primary().clone();
        let (mut model, model_dir) = build_model(&config, &device)?;
        if let Some(per_layer) = placement.layer_devices(model.config().num_hidden_layers) {
            model
                .set_layer_devices(&per_layer)
                .map_err(|cause| TrainError::Model {
                    context: "cannot spread the layers over `[devices] devices`".into(),
                    cause,
                })?;
        }
        let replicas = build_replicas(&config, &placement)?;
        let reference_copies = build_reference_copies(&config, &placement, pairs.as_ref())?;
        let t = &config.training;
        let lengths = prepare_pairs(pairs.as_mut(), &model, pad_id, t.micro_batch)?
            .unwrap_or_else(|| splits.train.iter().map(|s| s.len()).collect());
        // Under data parallel a micro-step draws `micro_batch` rows per rank.
        let loader = DataLoader::new(
            lengths,
            t.micro_batch * placement.ranks(),
            config.data.group_by_length,
            config.data.seed,
        );
        let total_steps = match t.max_steps {
            Some(n) => n,
            None => loader.steps_per_epoch(t.gradient_accumulation) * u64::from(t.epochs),
        };
        let schedule = LrSchedule::new(
            t.schedule,
            t.learning_rate,
            t.warmup_steps,
            t.warmup_ratio,
            total_steps,
        );
        let optimizer = build_optimizer(&config, &model)?;
        let scaler = t
            .precision
            .uses_loss_scaling()
            .then(|| LossScaler::new(t.initial_loss_scale, t.loss_scale_growth_interval));
        let mut run = TrainingRun {
            config,
            device,
            placement,
            model,
            optimizer,
            replicas,
            splits,
            pairs,
            reference_copies,
            loader,
            schedule,
            total_steps,
            step: 0,
            trained_tokens: 0,
            elapsed_secs: 0.0,
            scaler,
            consecutive_skips: 0,
            last_loss: None,
            last_eval_loss: None,
            last_checkpoint: None,
            resumed_from: None,
            pad_id,
            model_dir,
            last_gradient_bytes: None,
            #[cfg(feature = "nccl")]
            nccl: None,
        };
        #[cfg(feature = "nccl")]
        {
            run.nccl = run.open_nccl()?;
        }
        run.sync_replicas()?;
        Ok(run)
    }

    /// Copies rank 0's trainable weights into every replica. Replicas are built from the
    /// same files and seeds, so this only guards against a nondeterministic initialiser,
    /// and after a resume it is what puts the checkpoint on every rank.
    fn sync_replicas(&mut self) -> Result<(), TrainError> {
        for replica in &self.replicas {
            for (mine, theirs) in self.model.params().iter().zip(replica.model.params()) {
                if !mine.trainable {
                    continue;
                }
                mine.var
                    .as_tensor()
                    .to_device(theirs.var.device())
                    .and_then(|t| theirs.var.set(&t))
                    .map_err(|cause| TrainError::Model {
                        context: format!("cannot copy `{}` to a data-parallel replica", mine.name),
                        cause: cause.into(),
                    })?;
            }
        }
        Ok(())
    }

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
        let state = checkpoint::read_state(checkpoint_dir)?;
        let changes = match RunConfig::load(&checkpoint_dir.join(checkpoint::CONFIG_FILE)) {
            Ok(saved) => super::resume_changes::config_changes(&saved, &config),
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
        let mut run = TrainingRun::new(config)?;
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

    fn load_checkpoint(&mut self, dir: &Path, state: &TrainerState) -> Result<(), TrainError> {
        let ck_err = |message: String| TrainError::Checkpoint {
            path: dir.to_path_buf(),
            message,
        };
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
        self.load_trainable(dir)?;
        // One tensor at a time from the file, straight into each rank's optimizer on its own
        // device: every data-parallel rank reads the same file.
        let opt = checkpoint::TensorFile::open(&dir.join(checkpoint::OPTIMIZER_FILE))?;
        self.optimizer
            .load_state_from(&opt, state.optimizer_steps)
            .map_err(|e| ck_err(format!("optimizer state: {e}")))?;
        for replica in &mut self.replicas {
            replica
                .optimizer
                .load_state_from(&opt, state.optimizer_steps)
                .map_err(|e| ck_err(format!("optimizer state: {e}")))?;
        }
        drop(opt);
        self.sync_replicas()?;
        self.step = state.step;
        let index = match state.rows_per_micro_batch {
            // Another micro-batch size (an out-of-memory refit): the same row, when the
            // shuffled row order is the same (`group_by_length` off) and the row divides.
            Some(rows) if rows != self.rows_per_micro_batch() => {
                let consumed = state.index_in_epoch * rows;
                let now = self.rows_per_micro_batch();
                if self.config.data.group_by_length || !consumed.is_multiple_of(now) {
                    return Err(ck_err(format!(
                        "the checkpoint was made with {rows} rows per micro-batch and the config has {now}; with data.group_by_length on (or row {consumed} not on a micro-batch boundary) the data order cannot continue: keep training.micro_batch as it was"
                    )));
                }
                consumed / now
            }
            _ => state.index_in_epoch,
        };
        self.loader.set_position(state.epoch, index);
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

    /// The run config.
    pub fn config(&self) -> &RunConfig {
        &self.config
    }

    /// The model being trained.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// Mutable access to the model (e.g. to export it).
    pub fn model_mut(&mut self) -> &mut CausalLm {
        &mut self.model
    }

    /// The device trained on (rank 0's, the first stage's under a layer split).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The run's devices, strategy and layer split.
    pub fn placement(&self) -> &super::placement::RunPlacement {
        &self.placement
    }

    /// Rows of one micro-step over every rank.
    fn rows_per_micro_batch(&self) -> usize {
        self.config.training.micro_batch * self.placement.ranks()
    }

    /// Rows per optimizer step: micro-batch × accumulation × data-parallel ranks.
    pub fn effective_batch(&self) -> usize {
        let t = &self.config.training;
        t.micro_batch * t.gradient_accumulation * self.placement.ranks()
    }

    /// The model's folder (config, tokenizer).
    pub fn model_dir(&self) -> &Path {
        &self.model_dir
    }

    /// Optimizer steps done.
    pub fn step_index(&self) -> u64 {
        self.step
    }

    /// Optimizer steps of the whole run.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }

    /// After a divergence at `spike_step`: the checkpoints written from step `spike_step − 1`
    /// on hold the weights that spiked; they are set aside and the last good one becomes the
    /// run's last checkpoint (what `--resume latest` and the report name).
    pub fn fall_back_before(&mut self, spike_step: u64) -> Option<&Path> {
        let good =
            checkpoint::set_aside_after(&self.config.output_path(), spike_step.saturating_sub(2));
        self.last_checkpoint = good;
        self.last_checkpoint.as_deref()
    }

    /// Warm-up steps of the learning-rate schedule.
    pub fn warmup_steps(&self) -> u64 {
        self.schedule.warmup_steps
    }

    /// Whether every step of the run is done.
    pub fn is_done(&self) -> bool {
        self.step >= self.total_steps
    }

    /// Rows in the training and validation splits.
    pub fn split_sizes(&self) -> (usize, usize) {
        match &self.pairs {
            Some(p) => (p.splits.train.len(), p.splits.eval.len()),
            None => (self.splits.train.len(), self.splits.eval.len()),
        }
    }

    /// The training split's trained tokens and longest row, for the memory plan
    /// ([`crate::plan::PlanRequest::trained_tokens`]; `None` with packing).
    pub fn data_trained_tokens(&self) -> Option<crate::plan::TrainedTokens> {
        if self.pairs.is_some() {
            // The plan counts every position of the pairs' rows.
            return None;
        }
        samples::split_trained_tokens(&self.config, &self.splits.train)
    }

    /// Label tokens trained so far.
    pub fn trained_tokens(&self) -> u64 {
        self.trained_tokens
    }

    /// Seconds spent in steps, evaluations and checkpoints.
    pub fn elapsed_secs(&self) -> f64 {
        self.elapsed_secs
    }

    /// Warnings about the data (lints, ignored loss weights), for the front end to show.
    pub fn data_warnings(&self) -> &[String] {
        &self.splits.warnings
    }

    /// The error-level lints this run trains despite, because `[data] allow` names them.
    pub fn allowed_lints(&self) -> Vec<&crate::data::lints::Lint> {
        let errors = self
            .splits
            .lints
            .iter()
            .filter(|l| l.severity == crate::data::lints::Severity::Error);
        let blocking = crate::data::lints::blocking(&self.splits.lints, &self.config.data.allow);
        errors
            .filter(|l| !blocking.iter().any(|b| std::ptr::eq(*b, *l)))
            .collect()
    }

    /// Loss of the last step.
    pub fn last_loss(&self) -> Option<f64> {
        self.last_loss
    }

    /// Loss of the last evaluation.
    pub fn last_eval_loss(&self) -> Option<f64> {
        self.last_eval_loss
    }

    /// The newest checkpoint written or resumed from.
    pub fn last_checkpoint(&self) -> Option<&Path> {
        self.last_checkpoint.as_deref()
    }

    /// The checkpoint this run resumed from.
    pub fn resumed_from(&self) -> Option<&Path> {
        self.resumed_from.as_deref()
    }

    /// The fp16 loss scaler.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Number of parameters and of trainable parameters.
    pub fn parameter_counts(&self) -> (u64, u64) {
        let mut all = 0u64;
        let mut trainable = 0u64;
        for p in self.model.params() {
            let n = p.var.elem_count() as u64;
            all += n;
            if p.trainable {
                trainable += n;
            }
        }
        (all, trainable)
    }

    /// Whether an evaluation is due after the step just done.
    pub fn eval_due(&self) -> bool {
        let every = self.config.eval.eval_every;
        self.split_sizes().1 > 0
            && self.step > 0
            && ((every > 0 && self.step.is_multiple_of(every)) || self.is_done())
    }

    /// Whether a periodic checkpoint is due after the step just done.
    pub fn save_due(&self) -> bool {
        let every = self.config.checkpoint.save_every;
        (every > 0 && self.step > 0 && self.step.is_multiple_of(every))
            || (self.is_done() && self.config.checkpoint.save_final)
    }

    /// The settings that decide memory, for error hints.
    fn settings_summary(&self) -> String {
        let t = &self.config.training;
        format!(
            "micro_batch {}, gradient_accumulation {}, max_length {}, precision {}, activation_checkpointing {}, lora {}",
            t.micro_batch,
            t.gradient_accumulation,
            self.config.data.max_length,
            t.precision,
            t.activation_checkpointing,
            self.config.lora.enabled
        )
    }

    /// The bytes of the tensors rank 0 holds, counted from the tensors themselves (any
    /// device, no allocator needed): its weights, its AdamW state, and its gradient store as
    /// the last step's backward left it (the per-component report's definitions,
    /// `plan::components`). Under a layer split they span every device of rank 0.
    pub fn tensor_bytes(&self) -> crate::plan::TensorBytes {
        crate::plan::TensorBytes {
            weights_bytes: self.model.weights_bytes(),
            optimizer_bytes: self.optimizer.state_bytes(),
            gradients_bytes: self.last_gradient_bytes,
        }
    }

    /// The weights and AdamW state of every data-parallel rank after the first, each counted
    /// from its own tensors (empty unless data parallel).
    pub fn replica_tensor_bytes(&self) -> Vec<crate::plan::TensorBytes> {
        self.replicas
            .iter()
            .map(|r| crate::plan::TensorBytes {
                weights_bytes: r.model.weights_bytes(),
                optimizer_bytes: r.optimizer.state_bytes(),
                gradients_bytes: None,
            })
            .collect()
    }

    /// Every rank's model, rank 0 first.
    fn rank_models(&self) -> Vec<&CausalLm> {
        std::iter::once(&self.model)
            .chain(self.replicas.iter().map(|r| &r.model))
            .collect()
    }

    /// Forward + backward over the micro-batches, summing gradients and token counts, then
    /// (data parallel) summing the gradients over the ranks.
    ///
    /// Without loss scaling each micro-batch's summed loss is back-propagated as is (the
    /// optimizer divides by the step's token count). With fp16 loss scaling the summed loss is
    /// multiplied by `loss_scale / step_tokens` instead, so the scale applies to the *mean*
    /// token loss as in torch's GradScaler (a scaled sum would overflow f16 far sooner).
    ///
    /// Data parallel: each micro-batch's rows are cut into one contiguous shard per rank,
    /// each collated on its rank's device (padded to its own longest row, as a per-rank
    /// collator would); the per-rank gradients of the loss *sums* are all-reduced once per
    /// step, so dividing by the global token count gives the one-device gradient exactly.
    fn accumulate(
        &mut self,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        if self.pairs.is_some() {
            return self.accumulate_pairs(micro_batches, loss_scale);
        }
        let step = self.step + 1;
        let settings = self.settings_summary();
        let max_length = self.config.data.max_length;
        let ranks = self.placement.ranks();
        let mut batches: Vec<Vec<Option<samples::TensorBatch>>> =
            Vec::with_capacity(micro_batches.len());
        for rows in micro_batches {
            let mut shards = Vec::with_capacity(ranks);
            for (rank, shard) in shard_rows(rows, ranks).into_iter().enumerate() {
                if shard.is_empty() {
                    shards.push(None);
                    continue;
                }
                let picked: Vec<&Sample> = shard.iter().map(|&r| &self.splits.train[r]).collect();
                let device = &self.placement.devices[rank].candle;
                let batch = samples::collate(&picked, self.pad_id, max_length, device)
                    .map_err(|e| step_error(Phase::Forward, step, (rows.len(), 0), e, &settings))?;
                shards.push(Some(batch));
            }
            batches.push(shards);
        }
        let step_tokens: usize = batches
            .iter()
            .flatten()
            .flatten()
            .map(|b| b.trained_tokens)
            .sum();
        let backward_factor = if loss_scale != 1.0 {
            loss_scale / step_tokens.max(1) as f64
        } else {
            1.0
        };
        // Each rank's gradients, summed in place over the micro-batches (one buffer each).
        let mut per_rank: Vec<Gradients> = vec![Gradients::new(); ranks];
        let mut acc = Accumulated::new(backward_factor);
        let seed_base = derive_seed(self.config.training.seed, DROPOUT_STREAM, 0);
        self.model.dropout_seed_base = seed_base;
        for r in &mut self.replicas {
            r.model.dropout_seed_base = seed_base;
        }
        let models = self.rank_models();
        for (i, shards) in batches.iter().enumerate() {
            let live = shards.iter().flatten();
            let shape = (
                live.clone().map(|b| b.rows).sum(),
                live.map(|b| b.seq_len).max().unwrap_or(0),
            );
            acc.shapes.push(shape);
            // LoRA dropout masks derive from (seed, step, micro-batch), never from how many
            // forward passes this process made, so a resumed run draws the same masks.
            let counter = (step << 16) + i as u64;
            if let Some(message) = super::oom::injected_failure(step, Phase::Forward) {
                return Err(step_error(Phase::Forward, step, shape, message, &settings));
            }
            let accs = std::mem::take(&mut per_rank);
            let results = run_ranks(&models, shards, accs, |model, batch, acc| {
                micro_step(model, batch, seed_base, counter, backward_factor, acc)
            });
            for (rank, result) in results.into_iter().enumerate() {
                let (loss, tokens, grads) = result.map_err(|(phase, e)| {
                    let mut err = step_error(phase, step, shape, e, &settings);
                    if let TrainError::Step { device, .. } = &mut err {
                        *device = (ranks > 1).then_some(rank);
                    }
                    err
                })?;
                acc.loss_sum += loss;
                acc.tokens += tokens as u64;
                acc.label_tokens += tokens as u64;
                per_rank.push(grads);
            }
            if let Some(message) = super::oom::injected_failure(step, Phase::Backward) {
                return Err(step_error(Phase::Backward, step, shape, message, &settings));
            }
        }
        if per_rank.iter().any(|g| !g.is_empty()) {
            let shape = acc.shapes.last().copied().unwrap_or((0, 0));
            acc.grads = self
                .all_reduce(per_rank)
                .map_err(|e| step_error(Phase::Backward, step, shape, e, &settings))?;
        }
        Ok(acc)
    }

    /// [`Self::accumulate`] for preference pairs: each micro-batch's pairs as one batch of
    /// chosen then rejected rows, the gradient of the sum of their losses added in place; the
    /// count is the step's pairs (see `train::preference`).
    ///
    /// Data parallel: each rank takes a contiguous shard of whole pairs (a pair's chosen and
    /// rejected rows stay together on one rank), collated on its device, with its own
    /// reference (its adapters switched off, or its frozen copy); the per-rank gradients of the
    /// loss sums are all-reduced once per step, as for SFT, so dividing by the step's pairs
    /// gives the one-device gradient. A layer split runs through the model's stages as SFT.
    fn accumulate_pairs(
        &mut self,
        micro_batches: &[Vec<usize>],
        loss_scale: f64,
    ) -> Result<Accumulated, TrainError> {
        let step = self.step + 1;
        let settings = self.settings_summary();
        let ranks = self.placement.ranks();
        let step_pairs: usize = micro_batches.iter().map(Vec::len).sum();
        let backward_factor = if loss_scale != 1.0 {
            loss_scale / step_pairs.max(1) as f64
        } else {
            1.0
        };
        let seed_base = derive_seed(self.config.training.seed, DROPOUT_STREAM, 0);
        self.model.dropout_seed_base = seed_base;
        for r in &mut self.replicas {
            r.model.dropout_seed_base = seed_base;
        }
        let Some(pairs) = self.pairs.as_ref() else {
            return Err(TrainError::EmptyDataset("no preference pairs".into()));
        };
        let models = self.rank_models();
        let concurrent = ranks > 1 && models.iter().all(|m| m.device().is_cuda());
        let mut per_rank: Vec<Gradients> = vec![Gradients::new(); ranks];
        let mut acc = Accumulated::new(backward_factor);
        for (i, rows) in micro_batches.iter().enumerate() {
            let shards = self
                .pair_shards(pairs, rows)
                .map_err(|e| step_error(Phase::Forward, step, (2 * rows.len(), 0), e, &settings))?;
            let live = shards.iter().flatten();
            let shape = (
                live.clone().map(|(_, b)| b.rows).sum(),
                live.map(|(_, b)| b.seq_len).max().unwrap_or(0),
            );
            acc.shapes.push(shape);
            if let Some(message) = super::oom::injected_failure(step, Phase::Forward) {
                return Err(step_error(Phase::Forward, step, shape, message, &settings));
            }
            // LoRA dropout masks derive from (seed, step, micro-batch), as for SFT.
            let counter = (step << 16) + i as u64;
            let jobs: Vec<_> = models
                .iter()
                .zip(shards)
                .zip(std::mem::take(&mut per_rank))
                .enumerate()
                .map(|(rank, ((model, shard), grads))| {
                    (*model, self.reference_copies.get(rank), shard, grads)
                })
                .collect();
            let results = run_rank_jobs(concurrent, jobs, |(model, copy, shard, mut grads)| {
                let Some((indices, batch)) = shard else {
                    return Ok((None, grads));
                };
                model
                    .forward_counter
                    .store(counter, std::sync::atomic::Ordering::Relaxed);
                pairs
                    .micro_step(model, copy, indices, &batch, backward_factor, &mut grads)
                    .map(|out| (Some(out), grads))
            });
            for (rank, result) in results.into_iter().enumerate() {
                let (out, grads) = result.map_err(|(phase, e)| {
                    let mut err = step_error(phase, step, shape, e, &settings);
                    if let TrainError::Step { device, .. } = &mut err {
                        *device = (ranks > 1).then_some(rank);
                    }
                    err
                })?;
                per_rank.push(grads);
                let Some(out) = out else { continue };
                acc.loss_sum += out.loss_sum;
                acc.tokens += out.pairs as u64;
                acc.label_tokens += out.label_tokens as u64;
                acc.preference = Some(match acc.preference {
                    Some(m) => m.merge(&out.metrics),
                    None => out.metrics,
                });
            }
        }
        if per_rank.iter().any(|g| !g.is_empty()) {
            let shape = acc.shapes.last().copied().unwrap_or((0, 0));
            acc.grads = self
                .all_reduce(per_rank)
                .map_err(|e| step_error(Phase::Backward, step, shape, e, &settings))?;
        }
        Ok(acc)
    }

    /// A micro-step's pairs cut into one contiguous shard of whole pairs per rank, each
    /// collated on its rank's device (`None` for a rank a short batch leaves empty).
    fn pair_shards<'r>(
        &self,
        pairs: &super::preference::PairRun,
        rows: &'r [usize],
    ) -> Result<Vec<Option<PairShard<'r>>>, crate::model::ModelError> {
        shard_rows(rows, self.placement.ranks())
            .into_iter()
            .enumerate()
            .map(|(rank, shard)| {
                if shard.is_empty() {
                    return Ok(None);
                }
                let device = &self.placement.devices[rank].candle;
                Ok(Some((
                    shard,
                    pairs.batch(shard, false, self.pad_id, device)?,
                )))
            })
            .collect()
    }

    /// Sums every rank's gradients and hands each rank the sum on its own device:
    /// NCCL all-reduce when built with it and every rank is a GPU, otherwise through
    /// rank 0's device (CPU logical devices share memory, so that costs nothing there).
    fn all_reduce(
        &self,
        per_rank: Vec<Gradients>,
    ) -> Result<Vec<Gradients>, crate::devices::DevicesError> {
        use crate::devices::GradientReducer;
        if per_rank.len() == 1 {
            return Ok(per_rank);
        }
        let devices = &self.placement.devices[..per_rank.len()];
        let outputs: Vec<Device> = devices.iter().map(|d| d.candle.clone()).collect();
        #[cfg(feature = "nccl")]
        if let Some(reducer) = &self.nccl {
            return reducer.all_reduce_sum(per_rank, &outputs);
        }
        crate::devices::HostReducer.all_reduce_sum(per_rank, &outputs)
    }

    /// The run's NCCL communicators, when its ranks are distinct GPUs
    /// ([`crate::devices::parallel::choose_reducer`]); `None` runs the host reducer.
    #[cfg(feature = "nccl")]
    fn open_nccl(&self) -> Result<Option<crate::devices::parallel::nccl::NcclReducer>, TrainError> {
        use crate::devices::parallel::{choose_reducer, nccl::NcclReducer, ReducerChoice};
        let ranks = self.placement.ranks();
        if ranks < 2 {
            return Ok(None);
        }
        let devices = &self.placement.devices[..ranks];
        let labels: Vec<String> = devices.iter().map(|d| d.label.clone()).collect();
        match choose_reducer(&labels, true) {
            ReducerChoice::Nccl => Ok(Some(NcclReducer::single_process(devices).map_err(|e| {
                TrainError::Device {
                    device: labels.join(","),
                    message: e.to_string(),
                }
            })?)),
            ReducerChoice::Host { .. } => Ok(None),
        }
    }

    /// Runs one optimizer step. Errors leave the thread (and process) alive; a panic inside the
    /// step is caught and returned as [`TrainError::Panic`].
    pub fn step(&mut self) -> Result<StepOutcome, TrainError> {
        self.guarded(Self::step_inner)
    }

    /// Runs one optimizer step on the longest rows of the training split (the planner's worst
    /// case, see [`DataLoader::longest_step`]) without moving the data position: the step of
    /// the planner's dry run (`train::dry_run`). Otherwise as [`TrainingRun::step`]: the
    /// weights are updated and the step is counted.
    pub fn step_longest(&mut self) -> Result<StepOutcome, TrainError> {
        self.guarded(|run| {
            let accumulation = run.config.training.gradient_accumulation;
            let micro_batches = run.loader.longest_step(accumulation);
            run.step_on(&micro_batches)
        })
    }

    /// Runs `step`, a panic inside it caught and returned as [`TrainError::Panic`].
    fn guarded(
        &mut self,
        step: impl FnOnce(&mut Self) -> Result<StepOutcome, TrainError>,
    ) -> Result<StepOutcome, TrainError> {
        let index = self.step + 1;
        match std::panic::catch_unwind(AssertUnwindSafe(|| step(self))) {
            Ok(r) => r,
            Err(payload) => Err(TrainError::Panic {
                step: index,
                message: panic_message(&payload),
            }),
        }
    }

    fn step_inner(&mut self) -> Result<StepOutcome, TrainError> {
        // A failed step leaves the run as after the last good one (data position too), so a
        // checkpoint written now resumes exactly there.
        let (epoch, index) = self.loader.position();
        let result = self.try_step();
        if result.is_err() {
            self.loader.set_position(epoch, index);
        }
        result
    }

    fn try_step(&mut self) -> Result<StepOutcome, TrainError> {
        let micro_batches = self
            .loader
            .next_step(self.config.training.gradient_accumulation);
        self.step_on(&micro_batches)
    }

    /// One optimizer step on `micro_batches` (rows of the training split).
    fn step_on(&mut self, micro_batches: &[Vec<usize>]) -> Result<StepOutcome, TrainError> {
        let started = Instant::now();
        let step = self.step + 1;
        let lr = self.schedule.lr_at(self.step) * super::divergence::injected_lr_factor(step);
        if micro_batches.is_empty() {
            return Err(TrainError::EmptyDataset("no rows left".into()));
        }
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let acc = self.accumulate(micro_batches, loss_scale)?;
        self.last_gradient_bytes = acc.grads.first().map(gradient_bytes);
        let shape = acc.shapes.last().copied().unwrap_or((0, 0));
        let settings = self.settings_summary();
        let tokens = acc.tokens;
        let loss = if tokens > 0 {
            acc.loss_sum / tokens as f64
        } else {
            0.0
        };
        let mut skipped = false;
        let mut grad_norm = 0.0;
        if !loss.is_finite() && self.scaler.is_none() {
            return Err(TrainError::NonFiniteLoss {
                step,
                value: if loss.is_nan() {
                    "NaN".into()
                } else {
                    "infinite".into()
                },
                hint: self.non_finite_hint(),
            });
        }
        if let Some(grads) = acc.grads.first().filter(|_| tokens > 0) {
            let raw_norm = grads
                .global_norm()
                .map_err(|e| step_error(Phase::Optimizer, step, shape, e, &settings))?;
            // grads = backward_factor × ∇(summed loss); the mean-loss gradient is ∇sum / tokens.
            let denominator = tokens as f64 * acc.backward_factor;
            grad_norm = raw_norm / denominator;
            let finite = loss.is_finite() && grad_norm.is_finite();
            let apply = match &mut self.scaler {
                Some(s) => s.update(finite),
                None if finite => true,
                None => {
                    return Err(TrainError::NonFiniteLoss {
                        step,
                        value: "finite, but the gradient norm is not".into(),
                        hint: self.non_finite_hint(),
                    })
                }
            };
            if apply {
                self.consecutive_skips = 0;
                let max_norm = self.config.training.max_grad_norm;
                let clip = if max_norm > 0.0 && grad_norm > max_norm {
                    max_norm / (grad_norm + 1e-6)
                } else {
                    1.0
                };
                let multiplier = clip / denominator;
                self.apply_update(step, lr, &acc.grads, multiplier, shape, &settings)?;
            } else {
                skipped = true;
                grad_norm = f64::NAN;
                self.consecutive_skips += 1;
                if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS {
                    return Err(TrainError::NonFiniteLoss {
                        step,
                        value: format!(
                            "non-finite in {} steps in a row despite loss scaling",
                            self.consecutive_skips
                        ),
                        hint: self.non_finite_hint(),
                    });
                }
            }
        }
        let shapes = acc.shapes;
        let label_tokens = acc.label_tokens;
        self.step = step;
        self.trained_tokens += label_tokens;
        let secs = started.elapsed().as_secs_f64();
        self.elapsed_secs += secs;
        if loss.is_finite() {
            self.last_loss = Some(loss);
        }
        Ok(StepOutcome {
            step,
            loss,
            lr,
            grad_norm,
            tokens: label_tokens,
            tokens_per_sec: label_tokens as f64 / secs.max(1e-9),
            trained_tokens: self.trained_tokens,
            elapsed_secs: self.elapsed_secs,
            epoch: self.loader.epoch_progress(),
            skipped,
            loss_scale: self.scaler.as_ref().map(|s| s.scale),
            batch_shapes: shapes,
            preference: acc.preference,
        })
    }

    /// One optimizer step on every rank with `grads` (rank 0's first) scaled by `multiplier`
    /// (the clip over the mean-loss denominator).
    fn apply_update(
        &mut self,
        step: u64,
        lr: f64,
        grads: &[Gradients],
        multiplier: f64,
        shape: (usize, usize),
        settings: &str,
    ) -> Result<(), TrainError> {
        if let Some(message) = super::oom::injected_failure(step, Phase::Optimizer) {
            return Err(step_error(Phase::Optimizer, step, shape, message, settings));
        }
        // Every rank steps its own optimizer on the same all-reduced gradients (as DDP does):
        // no weights travel after the step, and each rank's AdamW state stays with its
        // replica, where the planner counts it.
        self.optimizer
            .step(&grads[0], lr, multiplier)
            .map_err(|e| step_error(Phase::Optimizer, step, shape, e, settings))?;
        for (replica, grads) in self.replicas.iter_mut().zip(&grads[1..]) {
            replica
                .optimizer
                .step(grads, lr, multiplier)
                .map_err(|e| step_error(Phase::Optimizer, step, shape, e, settings))?;
        }
        Ok(())
    }

    fn non_finite_hint(&self) -> String {
        let t = &self.config.training;
        let mut advice = vec![format!(
            "lower training.learning_rate (now {})",
            t.learning_rate
        )];
        if t.max_grad_norm == 0.0 {
            advice.push("turn gradient clipping on (training.max_grad_norm = 1.0)".into());
        }
        match t.precision {
            Precision::Fp16Mixed | Precision::Bf16 => {
                advice.push("use training.precision = \"bf16-mixed\" or \"fp32\"".into())
            }
            _ => {}
        }
        advice.push("check the data for broken rows (`tunestudio preview`)".into());
        advice.push("then resume from the last checkpoint".into());
        advice.join("; ")
    }

    /// The token-normalised gradient of the next step, without applying it or moving the data
    /// position (for tests and diagnostics).
    pub fn preview_gradients(&mut self) -> Result<StepGradients, TrainError> {
        let (epoch, index) = self.loader.position();
        let micro_batches = self
            .loader
            .next_step(self.config.training.gradient_accumulation);
        self.loader.set_position(epoch, index);
        let acc = self.accumulate(&micro_batches, 1.0)?;
        let n = acc.tokens.max(1) as f64 * acc.backward_factor;
        let mut grads = HashMap::new();
        if let Some(g) = acc.grads.into_iter().next() {
            for (name, t) in g.iter() {
                let t = t
                    .to_dtype(DType::F32)
                    .and_then(|t| t.affine(1.0 / n, 0.0))
                    .map_err(|e| TrainError::Data {
                        context: "preview gradients".into(),
                        message: e.to_string(),
                    })?;
                grads.insert(name.to_string(), t);
            }
        }
        Ok(StepGradients {
            grads,
            tokens: acc.tokens,
            loss: acc.loss_sum / n,
        })
    }

    /// Mean token loss on the validation split (at most `eval.max_batches` micro-batches).
    pub fn evaluate(&mut self) -> Result<EvalResult, TrainError> {
        let step = self.step;
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.evaluate_inner())) {
            Ok(r) => r,
            Err(payload) => Err(TrainError::Panic {
                step,
                message: panic_message(&payload),
            }),
        }
    }

    fn evaluate_inner(&mut self) -> Result<EvalResult, TrainError> {
        let started = Instant::now();
        let settings = self.settings_summary();
        let mb = self.config.training.micro_batch.max(1);
        if let Some(p) = &self.pairs {
            // The preference loss over the validation pairs (perplexity is not defined).
            let metrics = p
                .evaluate(
                    &self.model,
                    self.reference_copies.first(),
                    self.pad_id,
                    mb,
                    self.config.eval.max_batches,
                )
                .map_err(|e| step_error(Phase::Eval, self.step, (mb, 0), e, &settings))?;
            let loss = metrics.map_or(f64::NAN, |m| m.loss);
            self.last_eval_loss = Some(loss).filter(|l| l.is_finite());
            self.elapsed_secs += started.elapsed().as_secs_f64();
            return Ok(EvalResult {
                step: self.step,
                loss,
                perplexity: f64::NAN,
                tokens: metrics.map_or(0, |m| m.pairs as u64),
            });
        }
        let max_batches = match self.config.eval.max_batches {
            0 => usize::MAX,
            n => n,
        };
        let max_length = self.config.data.max_length;
        let mut loss_sum = 0.0;
        let mut tokens = 0u64;
        for chunk in self.splits.eval.chunks(mb).take(max_batches) {
            let picked: Vec<&Sample> = chunk.iter().collect();
            let batch = samples::collate(&picked, self.pad_id, max_length, &self.device)
                .map_err(|e| step_error(Phase::Eval, self.step, (chunk.len(), 0), e, &settings))?;
            let shape = (batch.rows, batch.seq_len);
            // Without dropout, without a backward graph, one logits chunk at a time.
            let (v, _) = self
                .model
                .eval_loss(&batch.input_ids, Some(&batch.attention_mask), &batch.labels)
                .map_err(|e| step_error(Phase::Eval, self.step, shape, e, &settings))?;
            loss_sum += v;
            tokens += batch.trained_tokens as u64;
        }
        let loss = if tokens > 0 {
            loss_sum / tokens as f64
        } else {
            f64::NAN
        };
        self.last_eval_loss = Some(loss).filter(|l| l.is_finite());
        self.elapsed_secs += started.elapsed().as_secs_f64();
        Ok(EvalResult {
            step: self.step,
            loss,
            perplexity: loss.exp(),
            tokens,
        })
    }

    /// The state an exact resume needs.
    pub fn trainer_state(&self) -> TrainerState {
        let (epoch, index_in_epoch) = self.loader.position();
        TrainerState {
            format_version: checkpoint::FORMAT_VERSION,
            step: self.step,
            optimizer_steps: self.optimizer.steps_taken(),
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
        let out = self.config.output_path();
        std::fs::create_dir_all(&out).map_err(|cause| TrainError::Io {
            path: out.clone(),
            cause,
        })?;
        let state = self.trainer_state();
        let config_text = self.config.with_absolute_paths().to_toml_string()?;
        let model = &self.model;
        let optimizer = &self.optimizer;
        let lora = self.config.lora.enabled;
        let path = checkpoint::write_atomically(&out, self.step, |dir| {
            let ck_err = |message: String| TrainError::Checkpoint {
                path: dir.to_path_buf(),
                message,
            };
            let trainable: HashMap<String, Tensor> = model
                .params()
                .iter()
                .filter(|p| p.trainable)
                .map(|p| (p.name.clone(), p.var.as_tensor().clone()))
                .collect();
            checkpoint::save_tensors(&dir.join(checkpoint::TRAINABLE_FILE), &trainable)?;
            optimizer
                .save_state(&dir.join(checkpoint::OPTIMIZER_FILE))
                .map_err(|e| ck_err(format!("optimizer state: {e}")))?;
            if lora {
                model
                    .save_adapter(&dir.join(checkpoint::ADAPTER_DIR))
                    .map_err(|e| ck_err(format!("adapter: {e}")))?;
            }
            std::fs::write(dir.join(checkpoint::CONFIG_FILE), &config_text)
                .map_err(|e| ck_err(e.to_string()))?;
            // The state file goes last: its presence marks the checkpoint complete.
            checkpoint::write_state(dir, &state)
        })?;
        checkpoint::prune_checkpoints(&out, self.config.checkpoint.keep_last)?;
        self.last_checkpoint = Some(path.clone());
        self.elapsed_secs += started.elapsed().as_secs_f64();
        Ok(path)
    }
}

/// Σ bytes of the tensors of a gradient store.
fn gradient_bytes(grads: &Gradients) -> u64 {
    grads
        .iter()
        .map(|(_, g)| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
        .sum()
}

/// What one rank's micro-step gives: loss sum, trained tokens, and its accumulated gradients.
type MicroStep = (f64, usize, Gradients);

/// Forward and backward of one rank's shard of a micro-batch (none: nothing to do), adding
/// the gradients into the rank's accumulation `acc`.
fn micro_step(
    model: &CausalLm,
    batch: Option<&samples::TensorBatch>,
    seed_base: u64,
    counter: u64,
    backward_factor: f64,
    mut acc: Gradients,
) -> Result<MicroStep, (Phase, crate::model::ModelError)> {
    let Some(batch) = batch else {
        return Ok((0.0, 0, acc));
    };
    let forward = |e| (Phase::Forward, e);
    let backward = |e| (Phase::Backward, e);
    debug_assert_eq!(model.dropout_seed_base, seed_base);
    model
        .forward_counter
        .store(counter, std::sync::atomic::Ordering::Relaxed);
    let out = model
        .loss(&batch.input_ids, Some(&batch.attention_mask), &batch.labels)
        .map_err(forward)?;
    let loss = out
        .sum
        .to_dtype(DType::F64)
        .and_then(|t| t.to_scalar::<f64>())
        .map_err(|e| forward(e.into()))?;
    if out.num_tokens == 0 {
        // Nothing to learn from (every label masked); its gradient is zero anyway.
        return Ok((loss, 0, acc));
    }
    let scaled = if backward_factor != 1.0 {
        out.sum
            .affine(backward_factor, 0.0)
            .map_err(|e| backward(e.into()))?
    } else {
        out.sum
    };
    model.backward_into(&scaled, &mut acc).map_err(backward)?;
    Ok((loss, out.num_tokens, acc))
}

/// Runs `work` for every rank (with its shard, if any, and its accumulated gradients):
/// concurrently (a thread per rank) when every rank is a GPU, in turn on the CPU, whose
/// logical devices share the same cores. Results come back in rank order.
fn run_ranks<T: Send>(
    models: &[&CausalLm],
    shards: &[Option<samples::TensorBatch>],
    accs: Vec<Gradients>,
    work: impl Fn(&CausalLm, Option<&samples::TensorBatch>, Gradients) -> T + Sync,
) -> Vec<T> {
    let concurrent = models.len() > 1 && models.iter().all(|m| m.device().is_cuda());
    let jobs = models.iter().zip(shards).zip(accs);
    if !concurrent {
        return jobs.map(|((m, b), acc)| work(m, b.as_ref(), acc)).collect();
    }
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = jobs
            .map(|((m, b), acc)| scope.spawn(move || work(m, b.as_ref(), acc)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// One rank's pairs of a micro-step (their indices) and their batch on its device.
type PairShard<'r> = (&'r [usize], samples::TensorBatch);

/// [`run_ranks`]'s schedule for any per-rank job: a thread per rank when `concurrent` (every
/// rank a GPU), in turn otherwise. Results come back in rank order.
fn run_rank_jobs<J: Send, T: Send>(
    concurrent: bool,
    jobs: Vec<J>,
    work: impl Fn(J) -> T + Sync,
) -> Vec<T> {
    if !concurrent {
        return jobs.into_iter().map(&work).collect();
    }
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|job| scope.spawn(move || work(job)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Cuts a micro-step's rows into `ranks` contiguous shards, earlier ranks taking the
/// extra rows (a short last batch may leave later ranks empty).
fn shard_rows(rows: &[usize], ranks: usize) -> Vec<&[usize]> {
    let ranks = ranks.max(1);
    let mut out = Vec::with_capacity(ranks);
    let mut start = 0;
    for r in 0..ranks {
        let len = rows.len() / ranks + usize::from(r < rows.len() % ranks);
        out.push(&rows[start..start + len]);
        start += len;
    }
    out
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}
