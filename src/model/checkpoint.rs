//! Activation checkpointing of decoder layers.
//!
//! A checkpointed layer runs forward on a detached input, so none of its intermediate
//! activations stay alive; only its input (held by the graph node) and output remain.
//! The node is a candle custom op whose backward recomputes the layer with a fresh
//! graph, back-propagates the incoming gradient through it, stores the layer's parameter
//! gradients in a side table that [`super::CausalLm::backward`] merges, and returns the
//! input gradient to candle's backward pass.

use super::decoder::Ctx;
use super::error::ModelError;
use super::kernels::cpu_storage_of;
use super::layer_source::LayerSource;
use super::layer_weights::Layer;
use super::ops::lock;
use super::side_grads::SideGrads;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, Var};
use std::sync::{Arc, Mutex};

/// The layer a checkpointed node runs: one the model holds, or one gathered from a
/// [`LayerSource`] each time it runs (ZeRO-3: for the forward, and again for the recompute).
enum LayerRef {
    Held(Arc<Layer>),
    Gathered {
        /// The model's layer with placeholder tensors: everything but the weights.
        template: Arc<Layer>,
        source: Arc<dyn LayerSource>,
    },
}

impl LayerRef {
    /// The layer with its weights (gathered now, for a gathered one).
    fn get(&self) -> Result<Arc<Layer>, ModelError> {
        match self {
            LayerRef::Held(layer) => Ok(layer.clone()),
            LayerRef::Gathered { template, source } => Ok(Arc::new(
                template.with_weights(&source.gather(template.index)?)?,
            )),
        }
    }

    /// The model's own layer (its anchor, device and metadata).
    fn template(&self) -> &Arc<Layer> {
        match self {
            LayerRef::Held(layer)
            | LayerRef::Gathered {
                template: layer, ..
            } => layer,
        }
    }
}

struct CheckpointOp {
    layer: LayerRef,
    ctx: Arc<Ctx>,
    /// The output computed before the op was applied; `cpu_fwd` hands it over once.
    out: Mutex<Option<Tensor>>,
    side: SideGrads,
}

/// Runs `layer` on `h` without keeping its graph; the backward pass recomputes it.
pub(crate) fn checkpointed_layer(
    layer: &Arc<Layer>,
    ctx: &Arc<Ctx>,
    h: &Tensor,
    side: &SideGrads,
) -> Result<Tensor, ModelError> {
    run(LayerRef::Held(layer.clone()), ctx, h, side)
}

/// Runs the layer `template` stands for with its weights gathered from `source`, then drops
/// them; the backward pass gathers them again to recompute it (ZeRO-3).
pub(crate) fn gathered_layer(
    template: &Arc<Layer>,
    source: &Arc<dyn LayerSource>,
    ctx: &Arc<Ctx>,
    h: &Tensor,
    side: &SideGrads,
) -> Result<Tensor, ModelError> {
    let layer = LayerRef::Gathered {
        template: template.clone(),
        source: source.clone(),
    };
    run(layer, ctx, h, side)
}

fn run(
    layer: LayerRef,
    ctx: &Arc<Ctx>,
    h: &Tensor,
    side: &SideGrads,
) -> Result<Tensor, ModelError> {
    // The gathered weights are dropped with `weighted` (the output's graph, which holds
    // them, is dropped when `cpu_fwd` hands the output over).
    let weighted = layer.get()?;
    let out = weighted.forward(&h.detach(), ctx)?;
    drop(weighted);
    let anchor = layer.template().anchor.clone();
    let op = CheckpointOp {
        layer,
        ctx: ctx.clone(),
        out: Mutex::new(Some(out)),
        side: side.clone(),
    };
    // The anchor (a zero Var) puts the node in the graph even when `h` carries no
    // gradient, so the layer's own parameters (e.g. LoRA factors) still get theirs.
    Ok(h.contiguous()?.apply_op2(anchor.as_tensor(), op)?)
}

impl CustomOp2 for CheckpointOp {
    fn name(&self) -> &'static str {
        "layer-checkpoint"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = lock(&self.out).take();
        match out {
            Some(t) => cpu_storage_of(&t),
            None => candle_core::bail!("layer-checkpoint: forward ran twice (internal error)"),
        }
    }

    // The same hand-over on a GPU: the layer ran with tensor ops on the device already.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s1: &candle_core::CudaStorage,
        _l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = lock(&self.out).take();
        match out {
            Some(t) => super::ops::generic::hand_over_cuda(&t),
            None => candle_core::bail!("layer-checkpoint: forward ran twice (internal error)"),
        }
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let x = Var::from_tensor(&arg.detach())?;
        let layer = self.layer.get().map_err(|e| {
            candle_core::Error::Msg(format!("gathering a layer to recompute it: {e}"))
        })?;
        let out = layer.forward(x.as_tensor(), &self.ctx).map_err(|e| {
            candle_core::Error::Msg(format!("recomputing a checkpointed layer: {e}"))
        })?;
        // d/dθ sum(out · g) = gᵀ ∂out/∂θ: the vector-Jacobian product the outer pass needs.
        let seed = (out * grad.detach())?.sum_all()?;
        let grads = seed.backward()?;
        for (name, t) in &layer.trainable {
            if let Some(g) = grads.get(t) {
                self.side.add(name, g.clone())?;
            }
        }
        Ok((grads.get(x.as_tensor()).cloned(), None))
    }
}
