//! Logical devices and how a run is assigned to them.
//!
//! A [`LogicalDevice`] is what a strategy places work on. Several logical
//! devices may share one physical device: on the CPU they are all
//! `Device::Cpu` (tracked separately by index), on a GPU each is its own candle
//! `CudaDevice` (own stream) on the same ordinal. That is what lets a layer
//! split or data parallelism run — and be tested — on one CPU or one GPU.

use super::placement::{balance_layers, LayerSplit, StageCosts};
use super::DevicesError;
use crate::model::NamedParam;
use crate::units::format_bytes;
use candle_core::{DType, Device};

/// How a run is spread over its devices (the planner's type, so the run
/// config, the planner and the trainer share one spelling).
pub use crate::plan::Strategy;

/// A device a strategy can place work on.
#[derive(Debug, Clone)]
pub struct LogicalDevice {
    /// Position among the run's devices (rank under data parallel, stage under a layer split).
    pub index: usize,
    /// The candle device tensors are created on.
    pub candle: Device,
    /// "cpu:0", "cuda:0", "cuda:0#1" (second logical device on GPU 0).
    pub label: String,
    /// Bytes this logical device may use (its share of the physical device).
    pub capacity_bytes: u64,
}

impl LogicalDevice {
    /// Logical CPU device `index` (all share the host; each gets `capacity_bytes`).
    pub fn cpu(index: usize, capacity_bytes: u64) -> Self {
        LogicalDevice {
            index,
            candle: Device::Cpu,
            label: format!("cpu:{index}"),
            capacity_bytes,
        }
    }

    /// `n` logical CPU devices sharing the host's RAM equally.
    pub fn cpus(n: usize) -> Vec<Self> {
        let total = super::discovery::cpu_info().total_bytes;
        let share = total / (n.max(1) as u64);
        (0..n).map(|i| Self::cpu(i, share)).collect()
    }

    /// A logical device on CUDA GPU `ordinal`. Each call opens a separate
    /// candle device (own stream), so two calls with the same ordinal give two
    /// logical devices on one GPU.
    pub fn cuda(index: usize, ordinal: usize, capacity_bytes: u64) -> Result<Self, DevicesError> {
        let candle = Device::new_cuda_with_stream(ordinal).map_err(|err| DevicesError::DeviceUnavailable {
            device: format!("cuda:{ordinal}"),
            reason: if cfg!(feature = "cuda") {
                format!("{err} (is the GPU visible? check CUDA_VISIBLE_DEVICES and `tunestudio devices`)")
            } else {
                "this build has no CUDA support; build with `--features cuda` (scripts/build-cuda.sh)".to_string()
            },
        })?;
        Ok(LogicalDevice {
            index,
            candle,
            label: format!("cuda:{ordinal}"),
            capacity_bytes,
        })
    }

    /// Logical devices for the planner's device list: CUDA specs open their
    /// ordinal, CPU specs become logical CPU devices. Repeated ordinals get
    /// "#k" suffixes in their labels.
    pub fn from_specs(specs: &[crate::plan::DeviceSpec]) -> Result<Vec<Self>, DevicesError> {
        let mut out: Vec<LogicalDevice> = Vec::with_capacity(specs.len());
        for (index, spec) in specs.iter().enumerate() {
            let mut device = match (spec.kind, spec.ordinal) {
                (crate::plan::DeviceKind::Cpu, _) => Self::cpu(index, spec.capacity_bytes),
                (crate::plan::DeviceKind::Cuda, Some(ordinal)) => {
                    Self::cuda(index, ordinal, spec.capacity_bytes)?
                }
                (crate::plan::DeviceKind::Cuda, None) => {
                    Self::cuda(index, index, spec.capacity_bytes)?
                }
            };
            let same = out
                .iter()
                .filter(|d| d.label.split('#').next() == Some(device.label.as_str()))
                .count();
            if same > 0 {
                device.label = format!("{}#{same}", device.label);
            }
            out.push(device);
        }
        Ok(out)
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        self.candle.is_cuda()
    }
}

/// Which part of the model a parameter belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamBlock {
    /// `model.embed_tokens.*` (first device).
    Embeddings,
    /// `model.layers.N.*` (including LoRA factors inside the layer).
    Layer(usize),
    /// `model.norm.*` and `lm_head.*` (last device).
    Head,
}

impl ParamBlock {
    /// The block of an HF parameter name. Unknown names count as the head
    /// (they are model-level extras that live with the output).
    pub fn of(name: &str) -> ParamBlock {
        let name = name.strip_prefix("base_model.model.").unwrap_or(name);
        if let Some(rest) = name.strip_prefix("model.layers.") {
            if let Some(index) = rest.split('.').next().and_then(|n| n.parse().ok()) {
                return ParamBlock::Layer(index);
            }
        }
        if name.starts_with("model.embed_tokens") {
            ParamBlock::Embeddings
        } else {
            ParamBlock::Head
        }
    }
}

/// Bytes a device holds for its parameters, by kind (what is placed on it
/// before any activation exists).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlacedBytes {
    /// Parameters in their own dtype (trainable and frozen).
    pub weights_bytes: u64,
    /// f32 master copies of half-precision trainable parameters.
    pub master_weights_bytes: u64,
    /// One gradient per trainable parameter (in the parameter's dtype).
    pub gradients_bytes: u64,
    /// AdamW's two f32 moments per trainable parameter.
    pub optimizer_states_bytes: u64,
}

impl PlacedBytes {
    /// Everything together.
    pub fn total_bytes(&self) -> u64 {
        self.weights_bytes
            + self.master_weights_bytes
            + self.gradients_bytes
            + self.optimizer_states_bytes
    }
}

/// Bytes placed on each of `num_devices` devices for the model's actual
/// parameters: `device_of` says where each block lives. Master weights are
/// counted for half-precision trainable parameters when `master_weights`.
pub fn placed_bytes(
    params: &[NamedParam],
    num_devices: usize,
    master_weights: bool,
    device_of: impl Fn(ParamBlock) -> usize,
) -> Result<Vec<PlacedBytes>, DevicesError> {
    let mut out = vec![PlacedBytes::default(); num_devices];
    for p in params {
        let block = ParamBlock::of(&p.name);
        let d = device_of(block);
        let slot = out.get_mut(d).ok_or_else(|| {
            DevicesError::Input(format!(
                "parameter {} was placed on device {d}, but there are only {num_devices} devices",
                p.name
            ))
        })?;
        let elems = p.var.elem_count() as u64;
        let dtype_bytes = p.var.dtype().size_in_bytes() as u64;
        slot.weights_bytes += elems * dtype_bytes;
        if p.trainable {
            slot.gradients_bytes += elems * dtype_bytes;
            slot.optimizer_states_bytes += elems * 2 * DType::F32.size_in_bytes() as u64;
            if master_weights && dtype_bytes < 4 {
                slot.master_weights_bytes += elems * DType::F32.size_in_bytes() as u64;
            }
        }
    }
    Ok(out)
}

/// A run's devices with its strategy applied.
#[derive(Debug, Clone)]
pub enum Assignment {
    /// Everything on one device.
    Single {
        /// The device.
        device: LogicalDevice,
    },
    /// Consecutive layers on each device; activations move between them.
    LayerSplit {
        /// The devices, in pipeline order.
        devices: Vec<LogicalDevice>,
        /// Which layers each holds.
        split: LayerSplit,
    },
    /// A replica per device, each on its share of the batch.
    DataParallel {
        /// The devices, one per rank.
        devices: Vec<LogicalDevice>,
        /// The training state divided over the ranks ([`Strategy::Sharded`]).
        sharded: bool,
    },
}

impl Assignment {
    /// Applies `strategy` to `devices`. A layer split is balanced by `costs`
    /// (the planner's per-block bytes, see [`stage_costs`]) against each
    /// device's `capacity_bytes`.
    pub fn new(
        strategy: Strategy,
        devices: Vec<LogicalDevice>,
        costs: &StageCosts,
    ) -> Result<Self, DevicesError> {
        let Some(first) = devices.first().cloned() else {
            return Err(super::PlacementError::NoDevices.into());
        };
        Ok(match strategy {
            Strategy::Single => Assignment::Single { device: first },
            Strategy::DataParallel => Assignment::DataParallel {
                devices,
                sharded: false,
            },
            Strategy::Sharded => Assignment::DataParallel {
                devices,
                sharded: true,
            },
            Strategy::LayerSplit => {
                let capacities: Vec<u64> = devices.iter().map(|d| d.capacity_bytes).collect();
                let split = balance_layers(costs, &capacities)?;
                Assignment::LayerSplit { devices, split }
            }
        })
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        match self {
            Assignment::Single { .. } => Strategy::Single,
            Assignment::LayerSplit { .. } => Strategy::LayerSplit,
            Assignment::DataParallel { sharded: false, .. } => Strategy::DataParallel,
            Assignment::DataParallel { sharded: true, .. } => Strategy::Sharded,
        }
    }

    /// The devices used.
    pub fn devices(&self) -> Vec<&LogicalDevice> {
        match self {
            Assignment::Single { device } => vec![device],
            Assignment::LayerSplit { devices, .. } | Assignment::DataParallel { devices, .. } => {
                devices.iter().collect()
            }
        }
    }

    /// The device (position in [`Assignment::devices`]) holding a parameter
    /// block. Under data parallel every rank holds everything: rank 0 is returned.
    pub fn device_of(&self, block: ParamBlock) -> usize {
        match self {
            Assignment::Single { .. } | Assignment::DataParallel { .. } => 0,
            Assignment::LayerSplit { split, .. } => match block {
                ParamBlock::Embeddings => 0,
                ParamBlock::Head => split.num_devices().saturating_sub(1),
                ParamBlock::Layer(l) => split
                    .device_of_layer(l)
                    .unwrap_or(split.num_devices().saturating_sub(1)),
            },
        }
    }

    /// The logical device of every decoder layer, for `CausalLm::set_layer_devices`.
    pub fn layer_devices(&self, num_layers: usize) -> Vec<crate::model::Home> {
        use crate::model::Home;
        match self {
            Assignment::Single { device } => vec![Home::single(&device.candle); num_layers],
            Assignment::DataParallel { devices, .. } => {
                let d = devices
                    .first()
                    .map(|d| d.candle.clone())
                    .unwrap_or(Device::Cpu);
                vec![Home::single(&d); num_layers]
            }
            Assignment::LayerSplit { devices, split } => (0..num_layers)
                .map(|l| {
                    let d = split
                        .device_of_layer(l)
                        .unwrap_or(devices.len().saturating_sub(1))
                        .min(devices.len() - 1);
                    Home {
                        index: d,
                        device: devices[d].candle.clone(),
                    }
                })
                .collect(),
        }
    }

    /// Moves a model's layers to their devices (layer split), or the whole
    /// model to the single device.
    pub fn apply(&self, model: &mut crate::model::CausalLm) -> Result<(), DevicesError> {
        let layers = model.config().num_hidden_layers;
        model.set_layer_devices(&self.layer_devices(layers))?;
        Ok(())
    }

    /// Bytes of the model's parameters (+ gradients, optimizer states) on each device.
    pub fn placed_bytes(
        &self,
        params: &[NamedParam],
        master_weights: bool,
    ) -> Result<Vec<PlacedBytes>, DevicesError> {
        match self {
            Assignment::DataParallel { devices, .. } => {
                // Every rank holds a full replica.
                let one = placed_bytes(params, 1, master_weights, |_| 0)?;
                Ok(vec![one[0]; devices.len()])
            }
            _ => placed_bytes(params, self.devices().len(), master_weights, |b| {
                self.device_of(b)
            }),
        }
    }

    /// One line per device saying what it holds.
    pub fn describe(&self) -> Vec<String> {
        match self {
            Assignment::Single { device } => {
                vec![format!(
                    "{}: the whole model ({} available)",
                    device.label,
                    format_bytes(device.capacity_bytes)
                )]
            }
            Assignment::DataParallel { devices, .. } => devices
                .iter()
                .enumerate()
                .map(|(rank, d)| format!("{}: replica, rank {rank} of {}", d.label, devices.len()))
                .collect(),
            Assignment::LayerSplit { devices, split } => {
                let labels: Vec<String> = devices.iter().map(|d| d.label.clone()).collect();
                split.describe(&labels)
            }
        }
    }
}

/// The planner's per-block costs as [`StageCosts`]: its first block is the
/// embeddings, its last the norm + head, the rest the decoder layers.
pub fn stage_costs(costs: &crate::plan::LayerCosts) -> StageCosts {
    let blocks = costs.per_block();
    let n = blocks.len();
    let total = |i: usize| blocks.get(i).map(|b| b.total_bytes()).unwrap_or(0);
    StageCosts {
        embeddings_bytes: total(0),
        layer_bytes: costs.decoder_layer_bytes(),
        head_bytes: if n >= 2 { total(n - 1) } else { 0 },
    }
}

/// Stage costs from a model's actual parameters (weights, gradients, AdamW
/// states; no activations) — for when no plan is at hand.
pub fn stage_costs_from_params(
    params: &[NamedParam],
    master_weights: bool,
) -> Result<StageCosts, DevicesError> {
    let layers = params
        .iter()
        .filter_map(|p| match ParamBlock::of(&p.name) {
            ParamBlock::Layer(l) => Some(l + 1),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    // Slot 0: embeddings, 1..=layers: decoder layers, layers + 1: head.
    let bytes = placed_bytes(params, layers + 2, master_weights, |b| match b {
        ParamBlock::Embeddings => 0,
        ParamBlock::Layer(l) => l + 1,
        ParamBlock::Head => layers + 1,
    })?;
    Ok(StageCosts {
        embeddings_bytes: bytes[0].total_bytes(),
        layer_bytes: bytes[1..=layers].iter().map(|b| b.total_bytes()).collect(),
        head_bytes: bytes[layers + 1].total_bytes(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_names_map_to_blocks() {
        assert_eq!(
            ParamBlock::of("model.embed_tokens.weight"),
            ParamBlock::Embeddings
        );
        assert_eq!(
            ParamBlock::of("model.layers.12.mlp.up_proj.weight"),
            ParamBlock::Layer(12)
        );
        assert_eq!(
            ParamBlock::of("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"),
            ParamBlock::Layer(3)
        );
        assert_eq!(ParamBlock::of("model.norm.weight"), ParamBlock::Head);
        assert_eq!(ParamBlock::of("lm_head.weight"), ParamBlock::Head);
    }

    #[test]
    fn layer_split_assignment_places_blocks() {
        let costs = StageCosts {
            embeddings_bytes: 10,
            layer_bytes: vec![10; 4],
            head_bytes: 10,
        };
        let a = Assignment::new(Strategy::LayerSplit, LogicalDevice::cpus(2), &costs).unwrap();
        assert_eq!(a.device_of(ParamBlock::Embeddings), 0);
        assert_eq!(a.device_of(ParamBlock::Head), 1);
        assert_eq!(a.device_of(ParamBlock::Layer(0)), 0);
        assert_eq!(a.device_of(ParamBlock::Layer(3)), 1);
        assert_eq!(a.layer_devices(4).len(), 4);
        let lines = a.describe();
        assert_eq!(lines.len(), 2);
        assert!(
            lines[0].starts_with("cpu:0: embeddings + layers 0–1"),
            "{lines:?}"
        );
    }
}
