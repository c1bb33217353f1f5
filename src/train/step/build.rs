//! Building a run: its data, its model on every device it trains on, the optimizer, and
//! the data order and schedule that follow from them.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::Device;

use crate::devices::parallel::process_group::ProcessGroup;
use crate::mem::ranks::RankGuard;
use crate::model::{
    AdamW, AdamWConfig, CausalLm, ModelError, ModelLocation, NamedParam, OpsMode, OptimizerOffload,
    StatePlacement,
};
use crate::settings::Strategy;

use super::super::config::{InitMode, RunConfig};
use super::super::error::{ConfigError, TrainError};
use super::super::grpo::{self, GrpoReference, GrpoRun};
use super::super::loader::{derive_seed, DataLoader};
use super::super::placement::RunPlacement;
use super::super::precision::LossScaler;
use super::super::preference::{self, PairRun, ReferenceSource};
use super::super::samples::{self, Splits};
use super::super::schedule::LrSchedule;
use super::{Replica, TrainingRun, LORA_STREAM};

/// The run's data: SFT samples, preference pairs or GRPO prompts (the last two's lints and
/// warnings in `Splits`).
fn load_data(
    config: &RunConfig,
    tokenizer: &crate::data::TokenizerBundle,
    located: &ModelLocation,
) -> Result<(Splits, Option<PairRun>, Option<GrpoRun>), TrainError> {
    let has_weights = located.has_weights;
    if config.training.method.is_preference() {
        let (splits, pairs) = preference::load_checked_pairs(config, tokenizer, has_weights)?;
        Ok((splits, Some(pairs), None))
    } else if config.training.method.is_grpo() {
        let (splits, grpo) = grpo::load_checked_prompts(config, tokenizer, located)?;
        Ok((splits, None, Some(grpo)))
    } else {
        Ok((
            samples::load_checked_splits(config, tokenizer, has_weights)?,
            None,
            None,
        ))
    }
}

/// A preference run's reference pass (the model as loaded is the reference, see
/// `train::preference`) and the lengths its loader groups by; `None` for SFT.
fn prepare_pairs(
    pairs: Option<&mut PairRun>,
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
    placement: &RunPlacement,
) -> Result<Vec<Replica>, TrainError> {
    let mut replicas = Vec::new();
    for (rank, d) in placement
        .devices
        .iter()
        .enumerate()
        .take(placement.ranks())
        .skip(1)
    {
        let _rank = RankGuard::enter(rank);
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
    placement: &RunPlacement,
    pairs: Option<&PairRun>,
    grpo: Option<&GrpoRun>,
) -> Result<Vec<CausalLm>, TrainError> {
    let pair_copy = pairs.is_some_and(|p| p.source == ReferenceSource::Copy);
    let grpo_copy = grpo.is_some_and(|g| g.reference == GrpoReference::Copy);
    if !pair_copy && !grpo_copy {
        return Ok(Vec::new());
    }
    let context = |what: &str| format!("cannot build the frozen reference copy ({what})");
    let mut copies = Vec::new();
    for (rank, d) in placement.devices.iter().take(placement.ranks()).enumerate() {
        let _rank = RankGuard::enter(rank);
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

/// Builds the model a run config describes: pretrained or random weights in the precision's
/// dtype, activation checkpointing and LoRA applied. Returns it with its folder.
pub fn build_model(config: &RunConfig, device: &Device) -> Result<(CausalLm, PathBuf), TrainError> {
    let located = samples::locate_model(config)?;
    let mut model = initial_weights(config, &located, device)?;
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
    Ok((model, located.dir))
}

/// A model error with what was being done.
fn model_err(context: String) -> impl FnOnce(ModelError) -> TrainError {
    move |cause| TrainError::Model { context, cause }
}

/// The model's starting weights in the run's dtype: random (`[model] init = "random"`, or
/// `auto` with no weights in the folder) or read from the folder (quantized as they are read
/// under QLoRA, or from the cache).
fn initial_weights(
    config: &RunConfig,
    located: &ModelLocation,
    device: &Device,
) -> Result<CausalLm, TrainError> {
    let dtype = config.compute_dtype();
    let random = match config.model.init {
        InitMode::Random => true,
        InitMode::Pretrained => false,
        InitMode::Auto => !located.has_weights,
    };
    if !random && !located.has_weights {
        return Err(TrainError::Model {
            context: format!(
                "`{}` has no weights (model.init = \"pretrained\")",
                config.model_source()
            ),
            cause: ModelError::MissingFile {
                path: located.dir.join("model.safetensors"),
                hint: "add the safetensors weights, or set `[model] init = \"random\"`".into(),
            },
        });
    }
    let config_path = &located.config;
    if random {
        let mc = crate::model::ModelConfig::from_file(config_path).map_err(model_err(format!(
            "cannot read `{}`",
            config_path.display()
        )))?;
        return CausalLm::random_init(&mc, config.training.seed, dtype, device).map_err(model_err(
            format!("cannot initialise the model of `{}`", config_path.display()),
        ));
    }
    crate::model::ModelFiles::from_dir(&located.dir)
        .and_then(|files| {
            CausalLm::load_files_quantized(&files, dtype, device, config.model.quantize)
        })
        .map_err(model_err(format!(
            "cannot load the model `{}`",
            located.dir.display()
        )))
}

/// AdamW for a model's trainable parameters, its state placed as the run asks:
/// offloading keeps it in host RAM; the generic path (the GPU's code) keeps it as
/// device tensors updated with tensor ops; otherwise where the parameter lives.
fn build_optimizer(config: &RunConfig, model: &CausalLm) -> Result<AdamW, TrainError> {
    // Sharded data parallel: the ranks' optimizers hold ranges of the parameters instead
    // (`step::sharded`), so a rank's own optimizer holds nothing.
    let params = if config.devices.strategy == Strategy::Sharded {
        &[][..]
    } else {
        model.params()
    };
    optimizer_over(config, params, model.ops_mode())
}

/// AdamW over `params` with the run's settings, its state where the run keeps it.
fn optimizer_over(
    config: &RunConfig,
    params: &[NamedParam],
    ops_mode: OpsMode,
) -> Result<AdamW, TrainError> {
    let t = &config.training;
    let adam_cfg = AdamWConfig {
        lr: t.learning_rate,
        beta1: t.adam_beta1,
        beta2: t.adam_beta2,
        eps: t.adam_epsilon,
        weight_decay: t.weight_decay,
        decay_norms_and_biases: t.decay_norms_and_biases,
    };
    let mut optimizer = AdamW::new(params, adam_cfg, t.precision.master_weights())
        .map_err(model_err("cannot create the optimizer".into()))?;
    let placement = match (t.optimizer_offload, ops_mode) {
        (OptimizerOffload::Host, _) => Some(StatePlacement::Host),
        (OptimizerOffload::None, OpsMode::Generic) => Some(StatePlacement::Device),
        _ => None,
    };
    if let Some(placement) = placement {
        optimizer
            .set_state_placement(placement)
            .map_err(model_err("cannot place the optimizer state".into()))?;
    }
    Ok(optimizer)
}

/// Sharded data parallel's optimizer over every rank's model (`None` for any other
/// strategy).
fn build_sharded(
    config: &RunConfig,
    models: &[&CausalLm],
    world: Option<(usize, usize)>,
) -> Result<Option<super::sharded::ShardedOptimizer>, TrainError> {
    if config.devices.strategy != Strategy::Sharded {
        return Ok(None);
    }
    use super::sharded::{MasterRanges, ShardedOptimizer};
    let ops_mode = models.first().map_or(OpsMode::Generic, |m| m.ops_mode());
    // Each rank's master ranges live where AdamW would keep its masters.
    let masters = match (
        config.training.precision.master_weights(),
        config.training.optimizer_offload,
    ) {
        (false, _) => MasterRanges::None,
        (true, OptimizerOffload::None) => MasterRanges::OnRank,
        (true, OptimizerOffload::Host) => MasterRanges::InHostRam,
    };
    ShardedOptimizer::new(models, masters, world, |params| {
        optimizer_over(config, params, ops_mode)
    })
    .map(Some)
}

/// Parameters and trained parameters of `model`.
fn parameter_counts(model: &CausalLm) -> (u64, u64) {
    let mut all = 0u64;
    let mut trainable = 0u64;
    for p in model.params() {
        let n = p.var.elem_count() as u64;
        all += n;
        if p.trainable {
            trainable += n;
        }
    }
    (all, trainable)
}

/// Refuses a run config with problems (every one of them, by field).
fn check_config(config: &RunConfig) -> Result<(), TrainError> {
    let problems = config.validate();
    if problems.is_empty() {
        return Ok(());
    }
    Err(ConfigError::Invalid {
        origin: "run config".into(),
        problems,
    }
    .into())
}

/// The run's data as the model's tokenizer reads it, before any weight is loaded.
struct RunData {
    splits: Splits,
    pairs: Option<PairRun>,
    grpo: Option<GrpoRun>,
    pad_id: u32,
}

impl RunData {
    /// Locates the model, loads its tokenizer, checks it against the model's vocabulary and
    /// reads the data (SFT samples or preference pairs) with their lints.
    fn read(config: &RunConfig) -> Result<Self, TrainError> {
        let located = samples::locate_model(config)?;
        let tokenizer = samples::load_tokenizer(&located.dir)?;
        let model_config =
            crate::model::ModelConfig::from_file(&located.config).map_err(|cause| {
                TrainError::Model {
                    context: format!("cannot read `{}`", located.config.display()),
                    cause,
                }
            })?;
        samples::check_vocab(&tokenizer, &located.dir, model_config.vocab_size)?;
        let pad_id = tokenizer.pad().id;
        let (splits, pairs, grpo) = load_data(config, &tokenizer, &located)?;
        Ok(RunData {
            splits,
            pairs,
            grpo,
            pad_id,
        })
    }
}

/// Every model a run holds, on its devices: rank 0's (spread over the stages under a layer
/// split), the data-parallel replicas, and the frozen reference copies.
struct RunModels {
    device: Device,
    model: CausalLm,
    model_dir: PathBuf,
    replicas: Vec<Replica>,
    reference_copies: Vec<CausalLm>,
}

impl RunModels {
    fn build(
        config: &RunConfig,
        placement: &RunPlacement,
        pairs: Option<&PairRun>,
        grpo: Option<&GrpoRun>,
    ) -> Result<Self, TrainError> {
        let device = placement.primary().clone();
        // Rank 0's model (every stage's layers, under a layer split) is charged to rank 0.
        let rank0 = RankGuard::enter(0);
        let (mut model, model_dir) = build_model(config, &device)?;
        if let Some(per_layer) = placement.layer_devices(model.config().num_hidden_layers) {
            model
                .set_layer_devices(&per_layer)
                .map_err(|cause| TrainError::Model {
                    context: "cannot spread the layers over `[devices] devices`".into(),
                    cause,
                })?;
        }
        drop(rank0);
        let replicas = build_replicas(config, placement)?;
        let reference_copies = build_reference_copies(config, placement, pairs, grpo)?;
        Ok(RunModels {
            device,
            model,
            model_dir,
            replicas,
            reference_copies,
        })
    }
}

/// The run's data order: rows grouped by `lengths` when asked; under data parallel a
/// micro-step draws `micro_batch` rows per rank (`ranks` over every process of a launched run).
fn data_loader(config: &RunConfig, lengths: Vec<usize>, ranks: usize) -> DataLoader {
    DataLoader::new(
        lengths,
        config.training.micro_batch * ranks,
        config.data.group_by_length,
        config.data.seed,
    )
}

/// Optimizer steps per sampled batch: GRPO's `num_iterations`, 1 for every other objective.
fn objective_iterations(config: &RunConfig) -> u64 {
    if config.training.method.is_grpo() {
        config.grpo.num_iterations.max(1) as u64
    } else {
        1
    }
}

/// The learning-rate schedule over the run's `total_steps`.
fn lr_schedule(config: &RunConfig, total_steps: u64) -> LrSchedule {
    let t = &config.training;
    LrSchedule::new(
        t.schedule,
        t.learning_rate,
        t.warmup_steps,
        t.warmup_ratio,
        total_steps,
    )
}

impl TrainingRun {
    /// Prepares a fresh run: validates the config, loads the model and tokenizer,
    /// tokenises the data and builds the optimizer. Nothing is written yet.
    pub fn new(config: RunConfig) -> Result<Self, TrainError> {
        Self::new_in(config, None)
    }

    /// [`Self::new`] as one rank of a launched run when `world` is given: this process trains
    /// on one device (a GPU entry becomes `cuda:LOCAL_RANK`) and takes its global rank's share
    /// of every micro-step, whose rows are `micro_batch` × the world's ranks.
    pub fn new_in(config: RunConfig, world: Option<Arc<ProcessGroup>>) -> Result<Self, TrainError> {
        let config = match &world {
            Some(w) => super::world::rank_config(config, w)?,
            None => config,
        };
        check_config(&config)?;
        // The data first: a run its lints stop never loads the weights.
        let mut data = RunData::read(&config)?;
        let placement = RunPlacement::open(
            &config,
            samples::split_trained_tokens(&config, &data.splits.train),
        )?;
        let models =
            RunModels::build(&config, &placement, data.pairs.as_ref(), data.grpo.as_ref())?;
        let t = &config.training;
        let lengths = prepare_pairs(
            data.pairs.as_mut(),
            &models.model,
            data.pad_id,
            t.micro_batch,
        )?
        .or_else(|| data.grpo.as_ref().map(GrpoRun::lengths))
        .unwrap_or_else(|| data.splits.train.iter().map(|s| s.len()).collect());
        let world_size = world.as_ref().map_or(1, |w| w.world_size());
        let loader = data_loader(&config, lengths, placement.ranks() * world_size);
        let total_steps = match t.max_steps {
            Some(n) => n,
            // GRPO trains each sampled block `num_iterations` times (TRL repeats the prompts
            // as many times), so an epoch takes that many more optimizer steps.
            None => {
                loader.steps_per_epoch(t.gradient_accumulation)
                    * u64::from(t.epochs)
                    * objective_iterations(&config)
            }
        };
        let schedule = lr_schedule(&config, total_steps);
        let optimizer = crate::mem::ranks::on_rank(0, || build_optimizer(&config, &models.model))?;
        let scaler = t
            .precision
            .uses_loss_scaling()
            .then(|| LossScaler::new(t.initial_loss_scale, t.loss_scale_growth_interval));
        let counts = parameter_counts(&models.model);
        let mut run = TrainingRun {
            config,
            device: models.device,
            placement,
            model: models.model,
            optimizer,
            sharded: None,
            layer_shards: None,
            parameter_counts: counts,
            replicas: models.replicas,
            splits: data.splits,
            objective: match (data.pairs, data.grpo) {
                (Some(pairs), _) => Box::new(pairs),
                (None, Some(grpo)) => Box::new(grpo),
                (None, None) => Box::new(super::objective::SftRows),
            },
            reference_copies: models.reference_copies,
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
            pad_id: data.pad_id,
            model_dir: models.model_dir,
            last_gradient_bytes: None,
            state_bytes_by_rank: Vec::new(),
            #[cfg(feature = "nccl")]
            nccl: None,
            shared_checkpoint_step: None,
            world,
        };
        #[cfg(feature = "nccl")]
        {
            run.nccl = match run.world.clone() {
                Some(world) => run.open_world_nccl(&world)?,
                None => run.open_nccl()?,
            }
            .map(std::sync::Arc::new);
        }
        run.sync_replicas()?;
        let world = run.world.as_ref().map(|w| (w.rank(), w.world_size()));
        run.sharded = build_sharded(&run.config, &run.rank_models(), world)?;
        Ok(run)
    }

    /// Copies rank 0's trainable weights into every replica. Replicas are built from the
    /// same files and seeds, so this only guards against a nondeterministic initialiser,
    /// and after a resume it is what puts the checkpoint on every rank.
    pub(super) fn sync_replicas(&mut self) -> Result<(), TrainError> {
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
}
