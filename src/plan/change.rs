//! The fixes the planner ranks: one [`Change`] of settings, how it is applied to a request and
//! described, and a ranked [`Fix`].

use super::*;

/// One change of settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Change {
    /// Switch the device strategy (to `Sharded`: with the request's shard mode).
    Strategy(Strategy),
    /// Sharded data parallel dividing this much over the ranks (`[devices] strategy =
    /// "sharded"` and `shard`): what auto-fit and the fixes propose, for the modes the trainer
    /// runs ([`ShardMode::trainer_runs`]).
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
                    .unwrap_or_else(|| LoraSpec::all_linear(fit::AUTO_LORA_RANK));
                r.lora = Some(lora.quantized(*q));
                r.reference = r.reference.with_lora();
            }
            Change::Reference(reference) => r.reference = *reference,
        }
        r
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
                        fit::AUTO_LORA_RANK
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
        }
    }
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
            "weights, accumulated gradients, fp32 master weights and AdamW state"
        }
        (ShardMode::Everything, false) => "weights, accumulated gradients and AdamW state",
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
