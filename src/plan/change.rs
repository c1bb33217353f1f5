//! The fixes the planner ranks: one [`Change`] of settings, how it is applied to a request and
//! described, when it is proposed, how much it alters what is learned, and a ranked [`Fix`].
//!
//! Everything the planner's fixes know of a setting lives here, so that a new fixable setting
//! is one variant and its arms in this file: [`Change::candidates`] (the ranked fixes),
//! [`SEARCH_AXES`] (auto-fit's search) and [`Change::quality_tier`]; `plan/fit.rs` ranks and
//! searches without naming a setting.

use super::fit::AUTO_LORA_RANK;
use super::*;

/// One change of settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Change {
    /// Switch the device strategy (to `Sharded`: with the request's shard mode).
    Strategy(Strategy),
    /// Sharded data parallel dividing this much over the ranks (`[devices] strategy =
    /// "sharded"` and `shard`): what auto-fit and the fixes propose, for the modes the trainer
    /// runs for the request ([`PlanRequest::trainer_runs_shard`]).
    Shard(ShardMode),
    /// Switch the precision.
    Precision(Precision),
    /// Turn activation checkpointing on.
    ActivationCheckpointing,
    /// Smaller micro-batch with more accumulation (same effective batch).
    MicroBatch {
        /// New micro-batch.
        micro_batch: usize,
        /// New accumulation.
        gradient_accumulation: usize,
    },
    /// Train LoRA adapters instead of every weight.
    Lora(LoraSpec),
    /// Shorter sequences (changes what is trained: never chosen by auto-fit). For GRPO the
    /// completion is what gets shorter (`[grpo] max_completion_length`), a ranked fix.
    SeqLen(usize),
    /// Keep the optimizer's state in host RAM (GPU runs).
    OptimizerOffload,
    /// Quantize the frozen base (QLoRA); turns LoRA on (rank 16 on every linear) when it is off.
    Quantize(Quantization),
    /// Where a DPO run's reference comes from (`[preference] reference`): `Stored` is
    /// `precomputed`, `AdapterDisabled` needs LoRA.
    Reference(ReferencePlan),
    /// GRPO: this many completions of each group per forward and backward pass (`[grpo]
    /// generations_per_micro_step`). The same step in more passes: what is learned does not
    /// change (the trainer divides every pass by the whole step's count).
    GenerationsPerMicroStep(usize),
}

impl Change {
    /// Applies the change to a request. Strategy changes that alter the number of
    /// data-parallel ranks re-split accumulation so the effective batch stays the same
    /// when it divides.
    pub fn apply(&self, req: &PlanRequest) -> PlanRequest {
        let mut r = req.clone();
        match self {
            Change::Strategy(s) => set_strategy(&mut r, req, *s),
            Change::Shard(mode) => {
                set_strategy(&mut r, req, Strategy::Sharded);
                r.shard = *mode;
            }
            Change::Precision(p) => r.precision = *p,
            Change::ActivationCheckpointing => r.activation_checkpointing = true,
            Change::MicroBatch {
                micro_batch,
                gradient_accumulation,
            } => {
                r.micro_batch = *micro_batch;
                r.gradient_accumulation = *gradient_accumulation;
            }
            Change::Lora(l) => {
                r.lora = Some(l.clone());
                r.reference = r.reference.with_lora();
            }
            Change::SeqLen(t) => {
                if let HeadLoss::Completions {
                    generations,
                    completion_tokens,
                } = req.head_loss
                {
                    // A GRPO row is prompt + completion: the completion takes what the prompt
                    // leaves, as the run config's write-back does (`train::set_seq_len`).
                    let mut prompt = req.seq_len.saturating_sub(completion_tokens);
                    if *t <= prompt {
                        prompt = t / 2;
                    }
                    r.head_loss = HeadLoss::Completions {
                        generations,
                        completion_tokens: t - prompt,
                    };
                }
                r.seq_len = *t;
            }
            Change::OptimizerOffload => r.optimizer_offload = true,
            Change::Quantize(q) => {
                let lora = r
                    .lora
                    .take()
                    .unwrap_or_else(|| LoraSpec::all_linear(AUTO_LORA_RANK));
                r.lora = Some(lora.quantized(*q));
                r.reference = r.reference.with_lora();
            }
            Change::Reference(reference) => r.reference = *reference,
            Change::GenerationsPerMicroStep(n) => r.generations_per_micro_step = Some(*n),
        }
        r
    }

    /// How much the change, made to `req`, alters what training learns (0: only how it
    /// trains; a fix of a higher tier ranks behind every fix of a lower one that fits).
    pub(crate) fn quality_tier(&self, req: &PlanRequest) -> u8 {
        let quantized = req.lora.as_ref().is_some_and(|l| l.quantize.is_on());
        match self {
            // Shorter rows or completions: what is trained changes, not only how.
            Change::SeqLen(t) if *t < req.seq_len => 4,
            Change::Quantize(q) if q.is_on() && !quantized => 3,
            Change::Lora(_) if req.lora.is_none() => 2,
            Change::Precision(Precision::Bf16) if req.precision != Precision::Bf16 => 1,
            _ => 0,
        }
    }

    /// Whether a checkpoint resumes into the run after the change (the out-of-memory refit,
    /// `train::oom`, resumes only then): what is trained (precision, LoRA and its quantized
    /// base, the rows' length) must stay; how a step is laid out may change, and so may a DPO
    /// run's reference (a precomputed one is recomputed from the starting weights before the
    /// checkpoint is loaded: the same numbers). Sharded counts as any other layout: its
    /// checkpoints hold the whole state, as one device writes it.
    pub fn keeps_checkpoints(&self) -> bool {
        match self {
            Change::Strategy(_)
            | Change::Shard(_)
            | Change::ActivationCheckpointing
            | Change::MicroBatch { .. }
            | Change::OptimizerOffload
            | Change::Reference(_)
            | Change::GenerationsPerMicroStep(_) => true,
            Change::Precision(_) | Change::Lora(_) | Change::Quantize(_) | Change::SeqLen(_) => {
                false
            }
        }
    }

    /// The single changes worth trying on `req`, each a fix the planner ranks.
    pub(crate) fn candidates(req: &PlanRequest) -> Vec<Change> {
        let mut out = Vec::new();
        if req.devices.len() > 1 {
            for s in [Strategy::LayerSplit, Strategy::DataParallel] {
                if s != req.strategy {
                    out.push(Change::Strategy(s));
                }
            }
            for mode in proposed_shard_modes(req) {
                if req.strategy != Strategy::Sharded || req.shard != mode {
                    out.push(Change::Shard(mode));
                }
            }
        }
        out.extend(precision_axis(req, req).into_iter().flatten());
        // ZeRO-3 recomputes every layer already.
        if !req.recomputes_layers() {
            out.push(Change::ActivationCheckpointing);
        }
        out.extend(micro_batch_changes(req));
        if req.lora.is_none() {
            out.push(Change::Lora(LoraSpec::all_linear(AUTO_LORA_RANK)));
        }
        if req
            .lora
            .as_ref()
            .is_none_or(|l| l.quantize != Quantization::Q4K)
        {
            out.push(Change::Quantize(Quantization::Q4K));
        }
        let on_gpu = req.used_devices().iter().any(|d| d.kind != DeviceKind::Cpu);
        if on_gpu && !req.optimizer_offload {
            out.push(Change::OptimizerOffload);
        }
        if req.reference != ReferencePlan::Stored {
            out.push(Change::Reference(ReferencePlan::Stored));
        }
        if req.reference == ReferencePlan::Copy && req.lora.is_some() {
            out.push(Change::Reference(ReferencePlan::AdapterDisabled));
        }
        out.extend(halved_generations(req).map(Change::GenerationsPerMicroStep));
        // GRPO is planned at full-length completions (a long one will come): half as long is
        // a fix that changes what is learned, ranked after every other (tier 4).
        if let HeadLoss::Completions {
            completion_tokens, ..
        } = req.head_loss
        {
            if completion_tokens >= 2 {
                out.push(Change::SeqLen(req.seq_len - completion_tokens / 2));
            }
        }
        out
    }

    /// The change in words ("bf16 mixed precision", "layer split over 2 GPUs"), with the
    /// reason a strategy is as fast as auto-fit's throughput model says.
    pub fn describe(&self, req: &PlanRequest) -> String {
        match self {
            Change::Strategy(Strategy::LayerSplit) => {
                format!(
                    "split the layers over the {} devices (one computes at a time)",
                    req.devices.len()
                )
            }
            Change::Shard(mode) => {
                let r = self.apply(req);
                format!(
                    "sharded data parallel, {} ({}): {} compute, each on its own micro-batch, and each keeps {} of the {} (accumulation {} → {}); the reduce-scatter and all-gather cost a little of data parallel's speed",
                    mode.zero_stage(),
                    mode,
                    all_devices(req),
                    share_of(req.devices.len()),
                    sharded_state(*mode, req),
                    req.gradient_accumulation,
                    r.gradient_accumulation
                )
            }
            Change::Strategy(Strategy::DataParallel) => {
                let r = self.apply(req);
                format!(
                    "data parallel on {} devices: {} compute, each on its own micro-batch with a whole copy of the training state (accumulation {} → {})",
                    req.devices.len(),
                    all_devices(req),
                    req.gradient_accumulation,
                    r.gradient_accumulation
                )
            }
            Change::Strategy(Strategy::Sharded) => Change::Shard(req.shard).describe(req),
            Change::Strategy(Strategy::Single) => "train on a single device".into(),
            Change::Precision(p) => match p {
                Precision::Bf16Mixed => "bf16 mixed precision".into(),
                Precision::Fp16Mixed => "fp16 mixed precision".into(),
                Precision::Bf16 => "pure bf16 (no f32 master weights)".into(),
                Precision::Fp32 => "fp32".into(),
            },
            Change::ActivationCheckpointing => "activation checkpointing".into(),
            Change::MicroBatch {
                micro_batch,
                gradient_accumulation,
            } => format!(
                "micro-batch {} × accumulation {} (was {} × {})",
                micro_batch, gradient_accumulation, req.micro_batch, req.gradient_accumulation
            ),
            Change::Lora(l) if l.quantize.is_on() => format!(
                "QLoRA r={} on {} (base frozen, quantized {})",
                l.r,
                l.target_modules.join(", "),
                l.quantize
            ),
            Change::Lora(l) => format!(
                "LoRA r={} on {} (base frozen)",
                l.r,
                l.target_modules.join(", ")
            ),
            Change::Quantize(q) => {
                let bits = match q {
                    Quantization::Q4K => "QLoRA 4-bit",
                    Quantization::Q8_0 => "QLoRA 8-bit",
                    Quantization::None => "dense base",
                };
                match &req.lora {
                    Some(l) => format!("{bits} (base linears as {q}, LoRA r={} kept)", l.r),
                    None => format!(
                        "{bits} (base linears as {q}, LoRA r={} on every linear)",
                        AUTO_LORA_RANK
                    ),
                }
            }
            Change::SeqLen(t) => match (req.head_loss, self.apply(req).head_loss) {
                (
                    HeadLoss::Completions {
                        completion_tokens: was,
                        ..
                    },
                    HeadLoss::Completions {
                        completion_tokens, ..
                    },
                ) => format!(
                    "completions of at most {completion_tokens} tokens (`[grpo] max_completion_length`, was {was}): a longer answer is cut, which changes what the run learns"
                ),
                _ => format!("sequence length {} (was {})", t, req.seq_len),
            },
            Change::OptimizerOffload => {
                "optimizer state in host RAM (training.optimizer_offload = \"host\")".into()
            }
            Change::Reference(reference) => reference.describe_change(),
            Change::GenerationsPerMicroStep(n) => {
                let (generations, was) = generations_per_pass(req).unwrap_or((*n, *n));
                format!(
                    "{n} of each prompt's {generations} completions per forward and backward pass (grpo.generations_per_micro_step = {n}, was {was}): the same step in {} passes, gradients summed",
                    generations / (*n).max(1)
                )
            }
        }
    }
}

/// A GRPO request's group size G and the completions of a group it runs per pass (`None`
/// for any other method).
fn generations_per_pass(req: &PlanRequest) -> Option<(usize, usize)> {
    let HeadLoss::Completions { generations, .. } = req.head_loss else {
        return None;
    };
    let per_pass = req
        .generations_per_micro_step
        .filter(|&n| n >= 1 && generations.is_multiple_of(n))
        .unwrap_or(generations);
    Some((generations, per_pass))
}

/// Half as many completions per pass as a GRPO request runs (`None` when that is not a whole
/// divisor of G, or for another method).
fn halved_generations(req: &PlanRequest) -> Option<usize> {
    let (generations, per_pass) = generations_per_pass(req)?;
    let half = per_pass / 2;
    (half >= 1 && per_pass.is_multiple_of(2) && generations.is_multiple_of(half)).then_some(half)
}

/// `r` switched from `req` to strategy `s`, with the accumulation re-split so the effective
/// batch stays the same when it divides.
fn set_strategy(r: &mut PlanRequest, req: &PlanRequest, s: Strategy) {
    let effective = req.effective_batch();
    r.strategy = s;
    let ranks = r.data_parallel_ranks();
    if effective.is_multiple_of(ranks * r.micro_batch) {
        r.gradient_accumulation = effective / (ranks * r.micro_batch);
    }
}

/// One axis of auto-fit's search: the changes it may make to the request built so far
/// (`None`: keep it as it is), in order of preference; none at all prunes that branch.
/// `original` is the request auto-fit was given (its effective batch is kept).
pub(crate) type SearchAxis =
    fn(original: &PlanRequest, so_far: &PlanRequest) -> Vec<Option<Change>>;

/// Auto-fit's search, outermost first: strategy × precision × checkpointing × LoRA ×
/// reference × GRPO's generations per pass × micro-batch. The micro-batch comes last: it
/// re-splits the effective batch over the ranks the strategy chose. A new setting that
/// auto-fit may change adds its axis here.
pub(crate) const SEARCH_AXES: [SearchAxis; 7] = [
    strategy_axis,
    precision_axis,
    checkpointing_axis,
    lora_axis,
    reference_axis,
    generations_axis,
    micro_batch_axis,
];

/// The shard modes auto-fit and the fixes may propose: those the trainer runs for this kind of
/// run ([`PlanRequest::trainer_runs_shard`]: no ZeRO-3 for GRPO or QLoRA). Another is planned
/// when asked for, never proposed.
fn proposed_shard_modes(req: &PlanRequest) -> impl Iterator<Item = ShardMode> + '_ {
    ShardMode::ALL
        .into_iter()
        .filter(|&m| req.trainer_runs_shard(m))
}

/// The request's strategy, then on several devices the layer split, data parallel and sharded
/// data parallel. A requested shard mode the trainer does not run is replaced by those it runs.
fn strategy_axis(_: &PlanRequest, req: &PlanRequest) -> Vec<Option<Change>> {
    let mut options: Vec<Option<Change>> = Vec::new();
    let mut add = |o: Option<Change>| {
        if !options.contains(&o) {
            options.push(o);
        }
    };
    let sharded = |mode| {
        let same = req.strategy == Strategy::Sharded && req.shard == mode;
        (!same).then_some(Change::Shard(mode))
    };
    if req.strategy == Strategy::Sharded && !req.trainer_runs_shard(req.shard) {
        proposed_shard_modes(req).for_each(|m| add(sharded(m)));
    } else {
        add(None);
    }
    if req.devices.len() > 1 {
        for s in [Strategy::LayerSplit, Strategy::DataParallel] {
            add((s != req.strategy).then_some(Change::Strategy(s)));
        }
        proposed_shard_modes(req).for_each(|m| add(sharded(m)));
    }
    options
}

/// The request's precision, then bf16 mixed (unless fp16 mixed already keeps masters), then
/// pure bf16 (tier 1: no f32 master weights).
fn precision_axis(_: &PlanRequest, req: &PlanRequest) -> Vec<Option<Change>> {
    let mut options = vec![None];
    for p in [Precision::Bf16Mixed, Precision::Bf16] {
        let fp16_already_mixed = p == Precision::Bf16Mixed && req.precision == Precision::Fp16Mixed;
        if p != req.precision && !fp16_already_mixed {
            options.push(Some(Change::Precision(p)));
        }
    }
    options
}

fn checkpointing_axis(_: &PlanRequest, req: &PlanRequest) -> Vec<Option<Change>> {
    if req.recomputes_layers() {
        vec![None]
    } else {
        vec![None, Some(Change::ActivationCheckpointing)]
    }
}

/// The request's LoRA, then LoRA r=16 on every linear, then QLoRA 4-bit last: it changes
/// what is learned the most (tier 3).
fn lora_axis(_: &PlanRequest, req: &PlanRequest) -> Vec<Option<Change>> {
    let qlora = Some(Change::Quantize(Quantization::Q4K));
    match &req.lora {
        Some(l) if l.quantize.is_on() => vec![None],
        Some(_) => vec![None, qlora],
        None => vec![
            None,
            Some(Change::Lora(LoraSpec::all_linear(AUTO_LORA_RANK))),
            qlora,
        ],
    }
}

/// A DPO run's reference as it is (the base with the adapters off once LoRA is on, for a
/// frozen copy), then precomputed: it learns the same (`train/preference.rs`) and holds
/// nothing during the step.
fn reference_axis(_: &PlanRequest, req: &PlanRequest) -> Vec<Option<Change>> {
    if req.reference == ReferencePlan::Stored {
        vec![None]
    } else {
        vec![None, Some(Change::Reference(ReferencePlan::Stored))]
    }
}

/// A GRPO request's generations per pass as they are, then halved, and halved again, down to
/// one completion per pass (each a divisor of G): the same step in more, smaller passes.
fn generations_axis(_: &PlanRequest, req: &PlanRequest) -> Vec<Option<Change>> {
    let mut options = vec![None];
    let mut so_far = req.clone();
    while let Some(half) = halved_generations(&so_far) {
        let change = Change::GenerationsPerMicroStep(half);
        so_far = change.apply(&so_far);
        options.push(Some(change));
    }
    options
}

/// Every whole number of samples per micro-batch that divides a rank's share of the original
/// effective batch, smallest first, with the accumulation that keeps the effective batch; no
/// option at all when the ranks do not divide it.
fn micro_batch_axis(original: &PlanRequest, req: &PlanRequest) -> Vec<Option<Change>> {
    let effective = original.effective_batch();
    let rows = req.head_loss.rows_per_sample();
    let ranks = req.data_parallel_ranks();
    if !effective.is_multiple_of(ranks * rows) {
        return Vec::new();
    }
    let per_rank = effective / ranks;
    let samples = per_rank / rows;
    (1..=samples)
        .filter(|n| samples.is_multiple_of(*n))
        .map(|n| {
            let change = Change::MicroBatch {
                micro_batch: n * rows,
                gradient_accumulation: per_rank / (n * rows),
            };
            (change.apply(req) != *req).then_some(change)
        })
        .collect()
}

/// Smaller micro-batches with more accumulation (one sample, and half as many), in whole
/// samples (a preference pair is two rows).
fn micro_batch_changes(req: &PlanRequest) -> Vec<Change> {
    let rows = req.head_loss.rows_per_sample();
    let samples = req.micro_batch / rows;
    if samples <= 1 || !req.micro_batch.is_multiple_of(rows) {
        return Vec::new();
    }
    let mut per_batch = vec![1];
    if samples.is_multiple_of(2) && samples > 2 {
        per_batch.push(samples / 2);
    }
    per_batch
        .into_iter()
        .map(|n| Change::MicroBatch {
            micro_batch: n * rows,
            gradient_accumulation: req.gradient_accumulation * (samples / n),
        })
        .collect()
}

/// The request's devices as the subject of "compute": "both GPUs", "all 4 GPUs", "both
/// devices".
fn all_devices(req: &PlanRequest) -> String {
    let gpus = req.devices.iter().all(|d| d.kind == DeviceKind::Cuda);
    let noun = if gpus { "GPUs" } else { "devices" };
    match req.devices.len() {
        2 => format!("both {noun}"),
        n => format!("all {n} {noun}"),
    }
}

/// "half", "a third", "1/5".
fn share_of(ranks: usize) -> String {
    match ranks {
        2 => "half".into(),
        3 => "a third".into(),
        4 => "a quarter".into(),
        n => format!("1/{n}"),
    }
}

/// What a shard mode divides, in words, for this request (master weights in mixed precision).
fn sharded_state(mode: ShardMode, req: &PlanRequest) -> &'static str {
    match (mode, req.precision.master_weights()) {
        (ShardMode::GradientsAndOptimizer, true) => {
            "accumulated gradients, fp32 master weights and AdamW state"
        }
        (ShardMode::GradientsAndOptimizer, false) => "accumulated gradients and AdamW state",
        (ShardMode::Everything, true) => {
            "decoder layers' weights (each gathered as it runs, and recomputed in the backward), accumulated gradients, fp32 master weights and AdamW state"
        }
        (ShardMode::Everything, false) => {
            "decoder layers' weights (each gathered as it runs, and recomputed in the backward), accumulated gradients and AdamW state"
        }
    }
}

/// A ranked suggestion for a plan that does not fit.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Fix {
    /// The fix in words, with its saving ("bf16 mixed precision: −4.1 GiB on GPU 0").
    pub description: String,
    /// Bytes saved on the device that is shortest of memory.
    pub saving_bytes: u64,
    /// Whether this change alone makes every device fit.
    pub fits_alone: bool,
    /// Relative throughput of the run after the change (1.0 = as requested).
    pub relative_throughput: f64,
    /// The change itself (apply it with [`Change::apply`]).
    pub change: Change,
}
