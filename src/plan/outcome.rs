//! The planner's answer: the [`Plan`], each device's [`DevicePlan`] with its phases and
//! bytes by kind, and the [`Verdict`].

use super::*;

/// A moment of the training step, in time order, whose memory the planner predicts. (Where a
/// run *failed* — setup, evaluation and checkpoints included — is the trainer's `Phase`, in
/// `train/error.rs`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum StepPhase {
    /// GRPO's rollouts, before the forward: the policy's weights, a group's KV cache and a
    /// decode step's logits, no graph (`plan/generation.rs`).
    Generation,
    /// The forward pass and the loss (the autograd graph grows).
    Forward,
    /// The backward pass (graph alive, gradients being produced).
    Backward,
    /// The AdamW update (activations freed, gradients + moments alive).
    OptimizerStep,
}

impl fmt::Display for StepPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StepPhase::Generation => "generation",
            StepPhase::Forward => "forward",
            StepPhase::Backward => "backward",
            StepPhase::OptimizerStep => "optimizer step",
        })
    }
}

/// The moment of a run at which a device's memory peaks: a phase of the training step or,
/// when the peak is the process's resident set ([`ProcessFootprint`]), the evaluation or the
/// loading of the weights when that moment is the process's largest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum PeakMoment {
    /// A phase of the training step.
    Step(StepPhase),
    /// The evaluation on the validation split (`CausalLm::eval_loss`).
    Evaluation,
    /// The loading of the weights (mapped files and the loaded tensors at once).
    Loading,
    /// The resume from a checkpoint ([`DevicePlan::resume_peak_bytes`]).
    Resume,
}

impl fmt::Display for PeakMoment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeakMoment::Step(phase) => phase.fmt(f),
            PeakMoment::Evaluation => f.write_str("evaluation"),
            PeakMoment::Loading => f.write_str("loading of the weights"),
            PeakMoment::Resume => f.write_str("resume from a checkpoint"),
        }
    }
}

/// Bytes in use on one device at one phase's high-water mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PhaseBytes {
    /// The phase.
    pub phase: StepPhase,
    /// Its peak bytes.
    pub bytes: u64,
}

/// One device's share of the run. The component fields are what is alive at the
/// device's peak, so they add up to `peak_bytes`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DevicePlan {
    /// The device.
    pub device: DeviceSpec,
    /// Decoder layers on this device (empty when it holds none).
    pub layers: Range<usize>,
    /// Whether the token embeddings live here (first device).
    pub holds_embeddings: bool,
    /// Whether the final norm, `lm_head` and the loss live here (last device).
    pub holds_head: bool,
    /// Compute copy of the weights (trainable and frozen). Sharded: ZeRO-2 adds the
    /// optimizer's copy of this rank's slice of the trainable ones; under ZeRO-3 it is the
    /// rank's slice of every weight and the two layers gathered whole.
    pub weights_bytes: u64,
    /// f32 master copy of the trainable weights (mixed precision only; sharded, of this
    /// rank's slice).
    pub master_weights_bytes: u64,
    /// Gradients alive at the peak (incl. the accumulation buffer; sharded, this rank's slice
    /// accumulator and, in the backward, the micro-step's whole gradient).
    pub gradients_bytes: u64,
    /// AdamW first and second moments (f32; sharded, of this rank's slice).
    pub optimizer_states_bytes: u64,
    /// What the device holds as the optimizer step begins, whatever phase peaks: weights
    /// (no ZeRO-3 layer gathered), master weights, the accumulated gradients (a sharded
    /// rank's slice accumulator) and AdamW state. `TrainingRun::measured_state_bytes_by_rank`
    /// measures the same moment.
    pub update_state_bytes: u64,
    /// Forward tensors kept by the autograd graph for backward.
    pub activations_bytes: u64,
    /// The f32 logits chunk, its softmax pieces and the per-row logsumexp.
    pub logits_and_loss_bytes: u64,
    /// Short-lived buffers at the peak (backward's zero-then-add, copies, optimizer scratch).
    pub temporaries_bytes: u64,
    /// The collectives' buffers at the peak, one tensor at a time: data parallel's all-reduce
    /// staging; a sharded run's reduce-scatter staging (another rank's slice) and all-gather
    /// of the updated weights.
    pub collective_bytes: u64,
    /// Runtime overhead (≈ 612 MiB CUDA context and workspace per CUDA device; 0 on CPU).
    pub overhead_bytes: u64,
    /// The predicted high-water mark (on the first CPU device of a request with
    /// [`PlanRequest::process`], the process's peak resident set).
    pub peak_bytes: u64,
    /// The training step's tensors at their peak (the components above plus the overhead):
    /// `peak_bytes` without the process terms.
    pub training_tensors_bytes: u64,
    /// The high-water mark while a resume (or an out-of-memory refit) loads a checkpoint
    /// onto this device: the overhead, the weights and the optimizer's state (allocated before
    /// the load) plus [`DevicePlan::resume_transient_bytes`]. `peak_bytes` covers it.
    pub resume_peak_bytes: u64,
    /// The resume's transient: the largest trainable tensor held here, in its dtype, on its
    /// way from the file into its parameter (the loader reads one tensor at a time, and each
    /// parameter's optimizer state is freed before its saved one is read).
    pub resume_transient_bytes: u64,
    /// The process's resident set, term by term (first CPU device, with
    /// [`PlanRequest::process`]).
    pub process: Option<ProcessFootprint>,
    /// The phase in which the peak occurs.
    pub peak_phase: StepPhase,
    /// The step's full-size components (weights, optimizer state, gradients, activations,
    /// logits/loss) for the per-component report ([`DevicePlan::predicted_components`]).
    pub components: StepComponents,
    /// Each phase's high-water mark, in time order.
    pub phases: Vec<PhaseBytes>,
    /// The first phase (in time order) whose need exceeds the capacity, if any.
    pub first_oom_phase: Option<StepPhase>,
    /// Peak ≤ capacity.
    pub fits: bool,
    /// Capacity − peak (0 when it does not fit).
    pub headroom_bytes: u64,
    /// Peak − capacity (0 when it fits).
    pub shortfall_bytes: u64,
}

impl DevicePlan {
    /// Headroom as a fraction of the capacity (negative when short).
    pub fn headroom_fraction(&self) -> f64 {
        let cap = self.device.capacity_bytes.max(1) as f64;
        (self.device.capacity_bytes as f64 - self.peak_bytes as f64) / cap
    }

    /// The moment `peak_bytes` belongs to: the resume when its figure is the largest, the
    /// process's largest moment when the peak is the process's resident set (the evaluation
    /// or the loading can be larger than the step), else the step's phase
    /// ([`DevicePlan::peak_phase`]).
    pub fn peak_moment(&self) -> PeakMoment {
        let others = self
            .process
            .as_ref()
            .map_or(self.training_tensors_bytes, |p| p.peak_bytes);
        if self.resume_peak_bytes > others {
            return PeakMoment::Resume;
        }
        match self.process.as_ref().map(|p| p.largest_moment) {
            Some(process::EVALUATION) => PeakMoment::Evaluation,
            Some(process::LOADING) => PeakMoment::Loading,
            _ => PeakMoment::Step(self.peak_phase),
        }
    }
}

/// Memory of one block of the model (embeddings, a decoder layer, or norm + head),
/// independent of the device it lands on. Used to balance a layer split.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LayerMemory {
    /// "embeddings", "layer 7", "norm + lm_head".
    pub name: String,
    /// Parameters in the block.
    pub parameters: u64,
    /// Compute copy of the weights.
    pub weights_bytes: u64,
    /// f32 master weights.
    pub master_weights_bytes: u64,
    /// Gradients (×2 with gradient accumulation: accumulated + current).
    pub gradients_bytes: u64,
    /// AdamW moments.
    pub optimizer_states_bytes: u64,
    /// Forward tensors kept for backward.
    pub activations_bytes: u64,
}

impl LayerMemory {
    /// Everything the block holds at the end of backward.
    pub fn total_bytes(&self) -> u64 {
        self.weights_bytes
            + self.master_weights_bytes
            + self.gradients_bytes
            + self.optimizer_states_bytes
            + self.activations_bytes
    }
}

/// The overall answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Verdict {
    /// Every device fits with at least 5 % headroom.
    Fits,
    /// Every device fits, but one has less than 5 % headroom (fragmentation may tip it over).
    Tight,
    /// At least one device runs out of memory.
    OutOfMemory,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Fits => "fits",
            Verdict::Tight => "fits (tight)",
            Verdict::OutOfMemory => "out of memory",
        })
    }
}

/// The planner's answer for one request.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    /// One entry per device the strategy uses, in order.
    pub per_device: Vec<DevicePlan>,
    /// Overall verdict.
    pub verdict: Verdict,
    /// The verdict in words, naming the device, the phase and the shortfall.
    pub summary: String,
    /// Ranked fixes (empty when it fits): those that fit alone first, fastest first.
    pub fixes: Vec<Fix>,
    /// Memory per block of the model (embeddings, each layer, head).
    pub per_layer: Vec<LayerMemory>,
    /// Total parameters and trainable parameters.
    pub parameters: u64,
    /// Parameters the optimizer updates.
    pub trainable_parameters: u64,
    /// Rows per optimizer step.
    pub effective_batch: usize,
    /// The settings planned, in words.
    pub settings: String,
    /// Optimizer state and master weights kept in host RAM (optimizer offload on GPUs).
    pub host_offload_bytes: u64,
}

impl Plan {
    /// Whether every device fits.
    pub fn fits(&self) -> bool {
        self.per_device.iter().all(|d| d.fits)
    }

    /// The resume peak of the plan's CPU devices together: logical CPU devices
    /// (`cpu:0,cpu:1`) share the host's memory and load the checkpoint one tensor at a time,
    /// so their resume figures add up but for one transient (the largest). 0 without CPU
    /// devices. The training tensors only, as [`DevicePlan::resume_peak_bytes`].
    pub fn cpu_resume_peak_bytes(&self) -> u64 {
        let cpus = self
            .per_device
            .iter()
            .filter(|d| d.device.kind == DeviceKind::Cpu);
        let steady: u64 = cpus
            .clone()
            .map(|d| d.resume_peak_bytes - d.resume_transient_bytes)
            .sum();
        let transient = cpus.map(|d| d.resume_transient_bytes).max().unwrap_or(0);
        steady + transient
    }

    /// The device with the least headroom (largest shortfall).
    pub fn worst_device(&self) -> Option<&DevicePlan> {
        self.per_device.iter().min_by(|a, b| {
            a.headroom_fraction()
                .partial_cmp(&b.headroom_fraction())
                .unwrap_or(std::cmp::Ordering::Equal)
        })
    }
}
