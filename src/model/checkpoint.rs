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
use super::layer_weights::Layer;
use super::ops::lock;
use super::side_grads::add_side_grad;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor, Var};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

struct CheckpointOp {
    layer: Arc<Layer>,
    ctx: Arc<Ctx>,
    /// The output computed before the op was applied; `cpu_fwd` hands it over once.
    out: Mutex<Option<Tensor>>,
    side: Arc<Mutex<HashMap<String, Tensor>>>,
}

/// Runs `layer` on `h` without keeping its graph; the backward pass recomputes it.
pub(crate) fn checkpointed_layer(
    layer: &Arc<Layer>,
    ctx: &Arc<Ctx>,
    h: &Tensor,
    side: &Arc<Mutex<HashMap<String, Tensor>>>,
) -> Result<Tensor, ModelError> {
    let out = layer.forward(&h.detach(), ctx)?;
    let op = CheckpointOp {
        layer: layer.clone(),
        ctx: ctx.clone(),
        out: Mutex::new(Some(out)),
        side: side.clone(),
    };
    // The anchor (a zero Var) puts the node in the graph even when `h` carries no
    // gradient, so the layer's own parameters (e.g. LoRA factors) still get theirs.
    Ok(h.contiguous()?.apply_op2(layer.anchor.as_tensor(), op)?)
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
        let out = self.layer.forward(x.as_tensor(), &self.ctx).map_err(|e| {
            candle_core::Error::Msg(format!("recomputing a checkpointed layer: {e}"))
        })?;
        // d/dθ sum(out · g) = gᵀ ∂out/∂θ: the vector-Jacobian product the outer pass needs.
        let seed = (out * grad.detach())?.sum_all()?;
        let grads = seed.backward()?;
        let mut side = lock(&self.side);
        for (name, t) in &self.layer.trainable {
            if let Some(g) = grads.get(t) {
                add_side_grad(&mut side, name, g.clone())?;
            }
        }
        Ok((grads.get(x.as_tensor()).cloned(), None))
    }
}
