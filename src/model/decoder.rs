//! The Llama / Mistral / Qwen2 decoder: parameters, forward pass, loss and backward.
//!
//! Every op on the training path records a backward pass (no candle-nn fused op is used;
//! see [`super::reference_ops`] and [`super::ops`]). Parameters live in one list of
//! [`NamedParam`]s under their Hugging Face names; the modules used by the forward pass
//! are views of those Vars, rebuilt whenever trainability or placement changes.
//!
//! Layout: this file holds the model's types and accessors; [`load`] builds it (from files, or
//! randomly) and rebuilds its modules; [`layer`] is one decoder layer on the graph path (RoPE,
//! masks, attention, MLP, LoRA); [`forward`] the whole forward pass, the loss and backward.

use super::config::ModelConfig;
use super::error::ModelError;
use super::gradients::NamedParam;
use super::kernels;
use super::layer_weights::Layer;
use super::lora::LoraConfig;
use super::native_layer::{self, PassTables};
use super::ops_mode::OpsMode;
use super::placed::Home;
use crate::settings::Quantization;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor, Var};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

mod forward;
mod layer;
mod load;

pub use layer::rope_inv_freq;

/// The HF name of the token embeddings (also the tied lm-head).
const EMBED_NAME: &str = "model.embed_tokens.weight";

/// Labels with this value are ignored by the loss (transformers' `ignore_index`).
pub use super::ops::IGNORE_INDEX;

/// Rows of the flattened sequence whose logits are computed together in the loss.
pub const LOSS_CHUNK_TOKENS: usize = 1024;

/// The summed token loss of a batch and how many tokens it covers.
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// Scalar f32, differentiable: the sum of the cross-entropies of every non-ignored
    /// (shifted) token. `sum / num_tokens` is exactly transformers' mean loss.
    pub sum: Tensor,
    /// Number of labels that were not -100 (after the causal shift).
    pub num_tokens: usize,
}

impl LossOutput {
    /// The mean loss as a number (sum / tokens), 0 when there is no token.
    pub fn mean(&self) -> Result<f64, ModelError> {
        if self.num_tokens == 0 {
            return Ok(0.0);
        }
        Ok(self.sum.to_dtype(DType::F64)?.to_scalar::<f64>()? / self.num_tokens as f64)
    }
}

/// What every layer of one forward pass shares.
pub(crate) struct Ctx {
    /// `[t, head_dim]`, model dtype.
    pub cos: Tensor,
    pub sin: Tensor,
    /// Additive f32 mask `[b or 1, 1, 1, t, t]`: 0 where allowed, f32::MIN where not.
    pub mask: Tensor,
    /// The same with the sliding window applied, for layers that use one.
    pub sliding_mask: Option<Tensor>,
    /// `Some(seed)` when LoRA dropout is active (training); the same seed recomputes the
    /// same masks in checkpointed layers.
    pub dropout_seed: Option<u64>,
    /// Whether the LoRA adapters add their update (false: the base alone, see
    /// [`CausalLm::without_adapters`]).
    pub adapters: bool,
    /// Which implementation runs each building block.
    pub ops: kernels::OpsKind,
    /// The tables native layers read, built by the first one.
    pub native_tables: OnceLock<Arc<PassTables>>,
}

/// The views of the parameters the forward pass uses.
pub(crate) struct Modules {
    pub embed: Tensor,
    pub layers: Vec<Arc<Layer>>,
    pub norm: Tensor,
    /// The head's weight where its parameter lives (the embeddings' stage for a tied head).
    pub lm_head: Tensor,
    pub lm_head_frozen: bool,
    /// `(owner, head)`: the head runs on another logical device than its weight's owner (a
    /// tied head under a layer split), so each use moves the weight there.
    pub head_transfer: Option<(usize, Home)>,
}

/// A causal language model ready for training: parameters, forward, loss, backward.
pub struct CausalLm {
    pub(crate) config: ModelConfig,
    pub(crate) params: Vec<NamedParam>,
    pub(crate) index: HashMap<String, usize>,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) layer_devices: Vec<Device>,
    /// The logical device (stage index) of every layer: 0 unless the layers are split.
    pub(crate) layer_owners: Vec<usize>,
    pub(crate) checkpointing: bool,
    /// Which implementation runs each building block (native CPU kernels, device-generic
    /// ops, or the composite reference).
    pub(crate) ops: kernels::OpsKind,
    /// Run qualifying layers as one native op (see [`native_layer`]).
    pub(crate) native_layers: bool,
    pub(crate) lora: Option<LoraConfig>,
    /// Base linears stored quantized (QLoRA), by HF weight name; they are not in `params`.
    pub(crate) quantized: HashMap<String, Arc<QTensor>>,
    /// What `quantized` holds ([`Quantization::None`] for a dense base).
    pub(crate) quantization: Quantization,
    pub(crate) modules: Modules,
    /// Parameter gradients produced outside candle's graph: by native layers and inside
    /// checkpointed layers' backward passes.
    pub(crate) side_grads: super::side_grads::SideGrads,
    /// Parameters whose gradient came (at least partly) through `side_grads` in the last
    /// backward: an accumulated gradient is handed back there rather than to candle's store.
    side_routed: Mutex<std::collections::HashSet<String>>,
    pub(crate) forward_counter: AtomicU64,
    pub(crate) dropout_seed_base: u64,
    /// The LoRA adapters are switched off: forward passes run the base alone (PEFT's
    /// `disable_adapter()`), read by every linear layer through [`Ctx::adapters`].
    adapters_disabled: AtomicBool,
    /// What `base_model_name_or_path` says when an adapter is saved.
    pub(crate) source: String,
    /// ZeRO-3: where the decoder layers' tensors come from, gathered a layer at a time (the
    /// model holds placeholders for them, see [`super::layer_source`]).
    pub(crate) layer_source: Option<Arc<dyn super::layer_source::LayerSource>>,
}

fn is_no_decay(name: &str) -> bool {
    name.ends_with(".bias") || name.ends_with("norm.weight")
}

impl CausalLm {
    /// The parsed configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Every parameter (HF names, model order, LoRA factors last).
    pub fn params(&self) -> &[NamedParam] {
        &self.params
    }

    /// Bytes of the weights as allocated: every parameter (frozen or trainable, adapters
    /// included) and the quantized base of a QLoRA model. Frozen views share their
    /// parameter's storage, so nothing is counted twice.
    pub fn weights_bytes(&self) -> u64 {
        let params: usize = self
            .params
            .iter()
            .map(|p| p.var.elem_count() * p.var.dtype().size_in_bytes())
            .sum();
        let quantized: usize = self
            .quantized
            .values()
            .map(|q| q.storage_size_in_bytes())
            .sum();
        (params + quantized) as u64
    }

    /// The parameter named `name`.
    pub fn param(&self, name: &str) -> Option<&NamedParam> {
        self.index.get(name).map(|&i| &self.params[i])
    }

    /// The dtype parameters are held in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of the embeddings (and of everything when no layer split is set).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device of the final norm and the head: the last layer's under a layer split.
    pub fn head_device(&self) -> &Device {
        self.layer_devices.last().unwrap_or(&self.device)
    }

    /// The logical device of the final norm and the head (the last layer's).
    pub fn head_home(&self) -> Home {
        Home {
            index: self.layer_owners.last().copied().unwrap_or(0),
            device: self.head_device().clone(),
        }
    }

    /// The logical device that owns parameter `name`: its layer's, the head's for the final
    /// norm and the head, the first stage's for the embeddings.
    pub fn param_owner(&self, name: &str) -> usize {
        match layer_of(name) {
            Some(l) => self.layer_owners.get(l).copied().unwrap_or(0),
            None if name == "model.norm.weight" || name == "lm_head.weight" => {
                self.head_home().index
            }
            None => 0,
        }
    }

    /// The active LoRA configuration, if an adapter is attached.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Runs `f` with the LoRA adapters switched off: every forward pass inside it is the base
    /// model's (PEFT's `with model.disable_adapter():`), the adapters' weights untouched —
    /// the linear layers read a flag, nothing is copied. The flag is restored when `f`
    /// returns (or unwinds). Without an adapter it is a plain call.
    pub fn without_adapters<R>(&self, f: impl FnOnce(&Self) -> R) -> R {
        struct Restore<'a>(&'a AtomicBool, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::Relaxed);
            }
        }
        let _restore = Restore(
            &self.adapters_disabled,
            self.adapters_disabled.swap(true, Ordering::Relaxed),
        );
        f(self)
    }

    /// Freezes every parameter: no gradient is computed for any of them again (a frozen
    /// reference model, such as DPO's `reference = "copy"`).
    pub fn freeze(&mut self) -> Result<(), ModelError> {
        for p in &mut self.params {
            p.trainable = false;
        }
        self.rebuild()
    }

    /// Whether forward passes include the LoRA adapters (false inside
    /// [`Self::without_adapters`]).
    pub fn adapters_enabled(&self) -> bool {
        !self.adapters_disabled.load(Ordering::Relaxed)
    }

    /// Recompute each decoder layer in backward instead of keeping its activations.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }

    /// Installs (or, with `None`, removes) where the decoder layers' parameter gradients go
    /// as the backward produces them ([`super::side_grads::GradientSink`]): the gradients of
    /// checkpointed, gathered (ZeRO-3) and native layers, which leave candle's graph through
    /// the side table. Names the sink takes are left out of [`CausalLm::backward_into`]'s
    /// result; every other gradient is returned as before.
    pub fn set_gradient_sink(&self, sink: Option<Arc<dyn super::side_grads::GradientSink>>) {
        self.side_grads.set_sink(sink);
    }

    /// Whether activation checkpointing is on.
    pub fn activation_checkpointing(&self) -> bool {
        self.checkpointing
    }

    /// Use the fused kernels (default) or the composite reference ops (for parity tests).
    /// Turning them on keeps the device-generic path when that was chosen.
    pub fn set_fused_ops(&mut self, on: bool) {
        self.ops = match (on && kernels::FUSED_AVAILABLE, self.ops) {
            (false, _) => kernels::OpsKind::Reference,
            (true, kernels::OpsKind::Generic) => kernels::OpsKind::Generic,
            (true, _) => kernels::OpsKind::Fused,
        };
    }

    /// Chooses the training-ops path: [`OpsMode::Generic`] runs the device-generic ops (what a
    /// GPU runs) on every device, the CPU included; `Auto`/`Native` the CPU native kernels where
    /// tensors are on the CPU. Models start in the mode `TUNESTUDIO_OPS` names.
    pub fn set_ops_mode(&mut self, mode: OpsMode) {
        self.ops = match mode {
            OpsMode::Generic => kernels::OpsKind::Generic,
            OpsMode::Auto | OpsMode::Native => kernels::OpsKind::Fused,
        };
    }

    /// The training-ops path in use (`Auto` also while the composite reference ops are forced).
    pub fn ops_mode(&self) -> OpsMode {
        match self.ops {
            kernels::OpsKind::Generic => OpsMode::Generic,
            _ => OpsMode::Auto,
        }
    }

    /// Whether the CPU native kernels (fused ops, native layers, side-table gradients) may run.
    fn native_kernels(&self) -> bool {
        self.ops == kernels::OpsKind::Fused
    }

    /// Runs each decoder layer that qualifies (CPU, f32, fused ops on: full fine-tuning or
    /// LoRA) as one native op with a hand-written backward instead
    /// of a graph of candle ops. On by default; off gives the graph path, which is the
    /// reference the native op is tested against.
    pub fn set_native_layers(&mut self, on: bool) {
        self.native_layers = on;
    }

    /// How many decoder layers the next training forward pass runs natively.
    pub fn native_layer_count(&self) -> usize {
        // Gathered layers (ZeRO-3) run as graphs of ops.
        if !self.native_layers || !self.native_kernels() || self.layer_source.is_some() {
            return 0;
        }
        self.modules
            .layers
            .iter()
            .filter(|l| l.device.is_cpu() && native_layer::layer_qualifies(l))
            .count()
    }

    /// Sets the name saved as `base_model_name_or_path` in adapters.
    pub fn set_source_name(&mut self, name: &str) {
        self.source = name.to_string();
    }

    /// Places decoder layer i on `homes[i]` (pipeline split); embeddings stay on the
    /// model's device (stage 0), the final norm and an untied head move to the last layer's.
    /// Call before creating the optimizer: the moved parameters are new Vars.
    pub fn set_layer_devices(&mut self, homes: &[Home]) -> Result<(), ModelError> {
        let devices: Vec<Device> = homes.iter().map(|h| h.device.clone()).collect();
        if devices.len() != self.config.num_hidden_layers {
            return Err(ModelError::Input(format!(
                "set_layer_devices needs one device per layer: the model has {} layers, {} devices were given",
                self.config.num_hidden_layers,
                devices.len()
            )));
        }
        // The final norm and an untied head follow the last layer, as with
        // transformers' `device_map="auto"`; the planner counts them there too.
        let last = devices.last().unwrap_or(&self.device).clone();
        for p in self.params.iter_mut() {
            let dev = match layer_of(&p.name) {
                Some(layer) => &devices[layer],
                None if p.name == "model.norm.weight" || p.name == "lm_head.weight" => &last,
                None => continue,
            };
            if !p.var.device().same_device(dev) {
                p.var = Var::from_tensor(&p.var.as_tensor().to_device(dev)?)?;
            }
        }
        self.layer_devices = devices;
        self.layer_owners = homes.iter().map(|h| h.index).collect();
        self.place_quantized()?;
        self.rebuild()
    }
}

/// The decoder layer index of an HF parameter name.
pub(crate) fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

fn check_dtype(dtype: DType) -> Result<(), ModelError> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        other => Err(ModelError::Input(format!(
            "model dtype {other:?} is not supported; use f32, bf16 or f16"
        ))),
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<CausalLm>();
}
