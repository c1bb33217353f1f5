//! What a plan is asked for: the [`PlanRequest`] (one adapter makes it from a run config,
//! `train::plan_request`), its LoRA settings, head loss and trained tokens.

use super::*;

/// LoRA settings that matter for memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoraSpec {
    /// Adapter rank.
    pub r: usize,
    /// Short names of the adapted linear layers (`q_proj`, `v_proj`, ...).
    pub target_modules: Vec<String>,
    /// How the frozen base linears are stored (QLoRA: `q8_0`, `q4_k`; see
    /// [`crate::settings::Quantization`]).
    #[serde(default)]
    pub quantize: Quantization,
}

impl LoraSpec {
    /// Rank `r` on every linear layer of the decoder (what auto-fit proposes).
    pub fn all_linear(r: usize) -> Self {
        LoraSpec {
            r,
            target_modules: crate::model::LINEAR_MODULES
                .iter()
                .map(|s| s.to_string())
                .collect(),
            quantize: Quantization::None,
        }
    }

    /// The same adapters on a base quantized as `q`.
    pub fn quantized(mut self, q: Quantization) -> Self {
        self.quantize = q;
        self
    }
}

/// What to plan: a model shape, the training settings, and the devices. Two requests are
/// equal exactly when they plan the same (the studio's "plan is stale" test).
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    /// The model's architecture (from its `config.json`).
    pub model: ModelConfig,
    /// Numeric precision.
    pub precision: Precision,
    /// Rows per forward/backward pass (per device under data parallel).
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation: usize,
    /// Tokens per row (the longest batch the run will see).
    pub seq_len: usize,
    /// Recompute each layer in the backward pass instead of keeping its activations.
    pub activation_checkpointing: bool,
    /// Keep AdamW's state (and fp32 master weights) in host RAM when training on GPUs.
    pub optimizer_offload: bool,
    /// Train LoRA adapters on a frozen base instead of every weight.
    pub lora: Option<LoraSpec>,
    /// How the model is spread over `devices`.
    pub strategy: Strategy,
    /// What a [`Strategy::Sharded`] run divides over its ranks (`[devices] shard`); the
    /// default, and not read, under the other strategies.
    pub shard: ShardMode,
    /// The devices, in order (layer split puts the embeddings on the first).
    pub devices: Vec<DeviceSpec>,
    /// The training-ops path the trainer will run (`TUNESTUDIO_OPS`): under `Generic` a CPU
    /// runs the GPU's code, so the plan models graphs of ops instead of the native layers.
    pub ops: OpsMode,
    /// What the process loads besides the model (tokenizer, dataset, mapped weights, the
    /// GUI): with it the first CPU device's peak is the process's resident set
    /// ([`ProcessFootprint`]); `None` plans the training tensors only.
    pub process: Option<ProcessInputs>,
    /// The trained tokens of the data's samples, when the data has been tokenized: the loss
    /// computes logits for those rows only, on the CPU's fused op and the generic one (a dataset
    /// that trains completions has far fewer than every position). `None` plans every position of every row, the upper
    /// bound.
    pub trained_tokens: Option<TrainedTokens>,
    /// What the loss holds of the head's output: the causal-LM loss's chunks of the trained
    /// rows (SFT, the default), or the full logits of every row (preference training).
    pub head_loss: HeadLoss,
    /// A DPO run's reference: stored (nothing during the step), the base with the adapters
    /// switched off, or a frozen copy of the weights (`plan/reference.rs`).
    pub reference: ReferencePlan,
    /// GRPO: completions of each group per forward and backward pass (`[grpo]
    /// generations_per_micro_step`, a divisor of G); `None`, and under any other head, the
    /// whole micro-batch in one pass. See [`Self::rows_per_pass`].
    pub generations_per_micro_step: Option<usize>,
    /// A launched run's place (torchrun, Slurm): this process's rank and the world's processes,
    /// each planning its own `devices`. Sharded data parallel divides its state over every
    /// process's devices; the default is a run in one process.
    pub world: WorldPlace,
}

/// Where a launched process stands in its world (`PlanRequest::world`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorldPlace {
    /// This process's rank.
    pub rank: usize,
    /// Processes in the world.
    pub size: usize,
}

impl Default for WorldPlace {
    /// A run in one process.
    fn default() -> Self {
        WorldPlace { rank: 0, size: 1 }
    }
}

/// What the step's loss holds of the head's output, for the `Head` block of the plan
/// ([`step_model`]). Set by the run-config adapter from `[training] method`.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum HeadLoss {
    /// The causal-LM loss (SFT): the fused CPU op or the generic one computes the logits of
    /// the trained rows only, at most 1024 rows at a time.
    #[default]
    Chunked,
    /// Sequence log-probabilities from the full logits (preference training: DPO, IPO,
    /// ORPO; `model::preference::model_sequence_logps`): the f32 logits of every position of
    /// every row exist at once, with their log-softmax temporaries and gradients.
    /// [`PlanRequest::trained_tokens`] (counts of SFT samples) does not apply.
    FullLogits,
    /// GRPO: every prompt runs as `generations` rows (its sampled completions), whose
    /// log-probabilities come from the head on the completion positions only, a chunk of
    /// rows at a time (`model::grpo::model_completion_logps`).
    Completions {
        /// Completions per prompt (`[grpo] num_generations`).
        generations: usize,
        /// The completion positions whose logits exist (`[grpo] max_completion_length`): the
        /// head runs on these only (`model::grpo::model_completion_logps`).
        completion_tokens: usize,
    },
}

impl HeadLoss {
    /// Whether the f32 logits of every position exist at once (preference pairs; GRPO's head
    /// runs chunk by chunk, as SFT's loss does).
    pub fn is_full_logits(self) -> bool {
        matches!(self, HeadLoss::FullLogits)
    }

    /// Positions of a `seq_len`-token row whose f32 logits the loss holds (full-logits heads):
    /// every one for preference pairs, the completion's for GRPO.
    pub fn logit_positions(self, seq_len: usize) -> usize {
        match self {
            HeadLoss::Completions {
                completion_tokens, ..
            } => completion_tokens.min(seq_len),
            _ => seq_len,
        }
    }

    /// What one sample (the unit of `training.micro_batch`) is, in the plural: `rows`, `pairs`
    /// or `prompts` (agrees with `train::TrainingMethod::micro_batch_unit`, tested there).
    pub fn sample_unit(self) -> &'static str {
        match self {
            HeadLoss::Chunked => "rows",
            HeadLoss::FullLogits => "pairs",
            HeadLoss::Completions { .. } => "prompts",
        }
    }

    /// The micro-batch of `rows` rows in samples, said as a user set it: `""` for SFT (a row is
    /// a sample), `" (2 pairs)"`, `" (2 prompts × 8 completions)"`.
    pub fn rows_in_samples(self, rows: usize) -> String {
        let per = self.rows_per_sample();
        match self {
            HeadLoss::Chunked => String::new(),
            HeadLoss::FullLogits => format!(" ({} pairs)", rows / per),
            HeadLoss::Completions { generations, .. } => {
                format!(" ({} prompts × {generations} completions)", rows / per)
            }
        }
    }

    /// Rows one sample (the unit of `training.micro_batch`) puts in a micro-batch: a
    /// preference pair's chosen and rejected rows (2), a GRPO prompt's completions, an SFT
    /// row (1). The one place this rule is written.
    pub fn rows_per_sample(self) -> usize {
        match self {
            HeadLoss::Chunked => 1,
            HeadLoss::FullLogits => 2,
            HeadLoss::Completions { generations, .. } => generations.max(1),
        }
    }
}

/// The trained tokens (rows the loss sees) of a tokenized dataset's samples, for the loss's
/// share of the plan ([`PlanRequest::loss_rows`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TrainedTokens {
    /// The length the samples were truncated at (`[data] max_length`).
    pub max_length: usize,
    /// Trained tokens per sample, largest first: the largest [`TrainedTokens::KEPT`].
    pub largest_first: Vec<usize>,
    /// Tokens of the longest sample (after truncation at `max_length`); 0 when unknown.
    /// The collator pads each micro-batch to its own longest row (dynamic padding), so no
    /// micro-batch of the data is longer than this, rounded up to the collator's multiple.
    #[serde(default)]
    pub longest_row_tokens: usize,
}

impl TrainedTokens {
    /// Counts kept: enough for any micro-batch the planner or the auto-fit considers (the
    /// studio's counts come capped at the same number, `data::stats::LARGEST_TRAINED_KEPT`).
    pub const KEPT: usize = 1024;

    /// The multiple the collator rounds a padded row up to (`data::CollateOptions::new`).
    pub const PAD_TO_MULTIPLE_OF: usize = 8;

    /// From every sample's trained tokens, truncated at `max_length`, and the tokens of the
    /// longest sample (0: unknown, plan `max_length`).
    pub fn from_counts(
        max_length: usize,
        longest_row_tokens: usize,
        counts: impl IntoIterator<Item = usize>,
    ) -> Self {
        let mut largest_first: Vec<usize> = counts.into_iter().collect();
        largest_first.sort_unstable_by(|a, b| b.cmp(a));
        largest_first.truncate(Self::KEPT);
        TrainedTokens {
            max_length,
            largest_first,
            longest_row_tokens,
        }
    }

    /// The padded length of the data's longest micro-batch at rows cut at `seq_len`: its
    /// longest row rounded up as the collator pads it, never above `seq_len`. `None` when the
    /// longest row is unknown or `seq_len` is longer than the samples were cut at (a longer
    /// cut keeps more of them).
    pub fn longest_batch_len(&self, seq_len: usize) -> Option<usize> {
        if self.longest_row_tokens == 0 || seq_len > self.max_length {
            return None;
        }
        let longest = self.longest_row_tokens.min(seq_len);
        Some(
            longest
                .next_multiple_of(Self::PAD_TO_MULTIPLE_OF)
                .min(seq_len),
        )
    }

    /// The most trained tokens any `micro_batch` samples hold at rows of `seq_len`, whatever
    /// the sampler's order; `None` when `seq_len` is longer than the samples were cut at (they
    /// may train more there) or a micro-batch is larger than the counts kept.
    pub fn max_per_micro_batch(&self, micro_batch: usize, seq_len: usize) -> Option<usize> {
        let truncated = self.largest_first.len() >= Self::KEPT;
        if seq_len > self.max_length || (truncated && micro_batch > self.largest_first.len()) {
            return None;
        }
        // A shorter cut trains no more tokens than it keeps.
        let cap = seq_len.saturating_sub(1);
        Some(
            self.largest_first
                .iter()
                .take(micro_batch)
                .map(|&c| c.min(cap))
                .sum(),
        )
    }
}

impl PlanRequest {
    /// Rows of one forward and backward pass, which the step's activations and head scale
    /// with: the micro-batch, or for GRPO with [`Self::generations_per_micro_step`] its share
    /// of every group (micro-batch prompts × generations per pass; the trainer sums the
    /// passes' gradients in place). The generation before the step still samples whole groups
    /// (`plan/generation.rs`). A value that does not divide G plans the whole group, as
    /// validation refuses it.
    pub fn rows_per_pass(&self) -> usize {
        match (self.head_loss, self.generations_per_micro_step) {
            (HeadLoss::Completions { generations, .. }, Some(per_pass))
                if per_pass >= 1 && generations.is_multiple_of(per_pass) =>
            {
                (self.micro_batch / generations.max(1) * per_pass).max(1)
            }
            _ => self.micro_batch,
        }
    }

    /// Rows the loss computes logits for per micro-batch: the most trained tokens a
    /// micro-batch of the data holds ([`Self::trained_tokens`]), else every position after the
    /// first of each row; with [`HeadLoss::FullLogits`], every position of every row.
    pub fn loss_rows(&self) -> usize {
        if self.head_loss.is_full_logits() {
            // Every position of every row, the last one included.
            return self.micro_batch * self.planned_seq_len();
        }
        if let HeadLoss::Completions { .. } = self.head_loss {
            // GRPO: every completion position of every row of a pass (full-length
            // completions: the upper bound a sampled step can reach).
            return self.rows_per_pass() * self.head_loss.logit_positions(self.planned_seq_len());
        }
        let rows = self.micro_batch * self.planned_seq_len().saturating_sub(1);
        self.trained_tokens
            .as_ref()
            .and_then(|t| t.max_per_micro_batch(self.micro_batch, self.seq_len))
            .map_or(rows, |t| t.min(rows))
    }

    /// The padded length of the longest micro-batch the plan sizes activations, logits and
    /// temporaries for: the data's longest batch when the data is known
    /// ([`TrainedTokens::longest_batch_len`]: dynamic padding never pads beyond it), else
    /// `seq_len` (`[data] max_length`, the bound).
    pub fn planned_seq_len(&self) -> usize {
        // A preference run's counts carry its longest pair (prompt + the longer completion,
        // `train::samples::trained_tokens`), which its collator pads to as the SFT one does.
        self.trained_tokens
            .as_ref()
            .and_then(|t| t.longest_batch_len(self.seq_len))
            .unwrap_or(self.seq_len)
    }

    /// Whether the plan is sized by the data's longest batch, shorter than `seq_len`.
    pub fn planned_for_the_data(&self) -> bool {
        self.planned_seq_len() < self.seq_len
    }

    /// Rows per optimizer step: micro-batch × accumulation × data-parallel ranks.
    pub fn effective_batch(&self) -> usize {
        self.micro_batch * self.gradient_accumulation * self.data_parallel_ranks()
    }

    /// Replicas that each process a micro-batch (1 unless data parallel).
    pub fn data_parallel_ranks(&self) -> usize {
        self.strategy.ranks(self.devices.len())
    }

    /// The devices this strategy actually uses (single uses the first only).
    pub fn used_devices(&self) -> &[DeviceSpec] {
        match self.strategy {
            Strategy::Single => &self.devices[..self.devices.len().min(1)],
            _ => &self.devices,
        }
    }

    /// The request of the planner's dry run of this run: one training step, no evaluation.
    /// The dry run does not evaluate, so the evaluation's heap is left out of its prediction,
    /// and one step leaves no allocator retention from other batch shapes.
    pub fn for_dry_run(&self) -> PlanRequest {
        let mut req = self.clone();
        if let Some(p) = req.process.as_mut() {
            p.evaluation = false;
            p.single_step = true;
        }
        req
    }

    /// Whether every decoder layer is recomputed in the backward: activation checkpointing,
    /// or ZeRO-3, whose trainer gathers a layer's weights for its forward and again for its
    /// recompute rather than keep them (the graph of a layer holds its weights).
    pub fn recomputes_layers(&self) -> bool {
        self.activation_checkpointing
            || (self.strategy == Strategy::Sharded && self.shard == ShardMode::Everything)
    }

    /// Whether the trainer runs this request's shard mode for its kind of run: ZeRO-3 gathers
    /// no whole model for GRPO's rollouts and slices no quantized base (QLoRA).
    pub fn trainer_runs_shard(&self, mode: ShardMode) -> bool {
        match mode {
            ShardMode::GradientsAndOptimizer => true,
            ShardMode::Everything => {
                !matches!(self.head_loss, HeadLoss::Completions { .. })
                    && !self.lora.as_ref().is_some_and(|l| l.quantize.is_on())
            }
        }
    }

    /// A one-line description of the settings ("fp32, micro-batch 1 × 4, seq 512, ...").
    pub fn settings_summary(&self) -> String {
        let mut s = format!(
            "{}, micro-batch {} rows{} × accumulation {}, seq {}, {}",
            self.precision,
            self.micro_batch,
            self.head_loss.rows_in_samples(self.micro_batch),
            self.gradient_accumulation,
            self.seq_len,
            self.strategy
        );
        if self.strategy == Strategy::Sharded {
            s.push_str(&format!(" {} ({})", self.shard, self.shard.zero_stage()));
            if !self.trainer_runs_shard(self.shard) {
                s.push_str(", planned only: the trainer does not run it for this run");
            }
            if self.shard == ShardMode::Everything && !self.activation_checkpointing {
                s.push_str(", every layer recomputed (gathered again for its backward)");
            }
        }
        if self.planned_for_the_data() {
            s.push_str(&format!(
                ", planned for the longest batch of this data: {} × {} tokens",
                self.micro_batch,
                self.planned_seq_len()
            ));
        }
        match self.head_loss {
            HeadLoss::Chunked => {}
            HeadLoss::FullLogits => s.push_str(", loss on full logits (preference pairs)"),
            HeadLoss::Completions {
                completion_tokens, ..
            } => s.push_str(&format!(
                ", loss on {completion_tokens} completion positions, chunked (GRPO)"
            )),
        }
        match self.reference {
            ReferencePlan::Stored => {}
            ReferencePlan::AdapterDisabled => {
                s.push_str(", reference forward with the adapters disabled")
            }
            ReferencePlan::Copy => s.push_str(", frozen reference copy of the weights"),
        }
        if let (HeadLoss::Completions { generations, .. }, Some(n)) =
            (self.head_loss, self.generations_per_micro_step)
        {
            if n < generations {
                s.push_str(&format!(
                    ", {n} of {generations} completions per pass ({} rows)",
                    self.rows_per_pass()
                ));
            }
        }
        if self.activation_checkpointing {
            s.push_str(", checkpointing");
        }
        if self.optimizer_offload {
            s.push_str(", optimizer state in host RAM");
        }
        if let Some(l) = &self.lora {
            s.push_str(&format!(
                ", LoRA r={} on {}",
                l.r,
                l.target_modules.join("/")
            ));
            if l.quantize.is_on() {
                s.push_str(&format!(", base quantized {}", l.quantize));
            }
        }
        s
    }
}
