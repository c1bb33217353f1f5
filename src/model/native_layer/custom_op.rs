//! The candle custom op that puts a native layer in the graph: its forward runs before the op
//! is applied (the op hands the output over), its backward runs the layer's native backward
//! and sends the parameter gradients to the side table.

use super::super::layer_weights::Layer;
use super::super::ops::lock;
use super::super::side_grads::SideGrads;
use super::dims::LayerDims;
use super::f32_data::{narrow, narrow_tensor, with_f32};
use super::layer_pass::{self, SavedActivations, TensorGrad};
use super::layer_slices::{trained_name, with_layer_weights};
use super::pass_tables::PassTables;
use super::{layer_dtype, OP_NAME};
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// The decoder layer op: forward ran before the op was applied; backward runs the native
/// backward (recomputing forward first when activations were not kept).
struct NativeLayerOp {
    layer: Arc<Layer>,
    tables: Arc<PassTables>,
    dims: LayerDims,
    /// The forward output; `cpu_fwd` hands it over once.
    out: Mutex<Option<Vec<f32>>>,
    /// Activations for backward (None under activation checkpointing: recomputed).
    saved: Mutex<Option<SavedActivations>>,
    side: SideGrads,
    /// The layer's dtype: its output and gradients are rounded to it.
    dtype: DType,
    /// Seeds the adapters' dropout masks (None: no dropout).
    dropout_seed: Option<u64>,
}

/// Runs `layer` on `h` `[b, t, hidden]` as one native op. With `keep_activations` false
/// (activation checkpointing) only the input stays alive and backward recomputes the layer.
pub(crate) fn run(
    layer: &Arc<Layer>,
    tables: &Arc<PassTables>,
    h: &Tensor,
    side: &SideGrads,
    keep_activations: bool,
    dropout_seed: Option<u64>,
) -> Result<Tensor> {
    let dims = LayerDims::of(layer, h)?;
    let h = h.contiguous()?;
    let (out, saved) = with_f32(&h, |hs| {
        with_layer_weights(layer, tables.adapters, |p| {
            layer_pass::forward(p, &dims, hs, tables, tables.mask_for(layer), dropout_seed)
        })
    })?;
    let op = NativeLayerOp {
        layer: layer.clone(),
        tables: tables.clone(),
        dims,
        out: Mutex::new(Some(out)),
        saved: Mutex::new(keep_activations.then_some(saved)),
        side: side.clone(),
        dtype: layer_dtype(layer),
        dropout_seed,
    };
    // The anchor (a zero Var) puts the node in the graph even when `h` carries no gradient.
    h.apply_op2(layer.anchor.as_tensor(), op)
}

impl NativeLayerOp {
    /// The layer's backward on its input `h` and output gradient `dout`, from the saved
    /// activations, or from a recomputed forward where none were kept.
    fn backward(
        &self,
        h: &[f32],
        dout: &[f32],
        saved: Option<&SavedActivations>,
    ) -> Result<(Vec<f32>, Vec<TensorGrad>)> {
        let (d, layer, tables) = (&self.dims, &self.layer, &self.tables);
        with_layer_weights(layer, tables.adapters, |p| {
            let recomputed;
            let s = match saved {
                Some(s) => s,
                None => {
                    let mask = tables.mask_for(layer);
                    recomputed = layer_pass::forward(p, d, h, tables, mask, self.dropout_seed)?.1;
                    &recomputed
                }
            };
            layer_pass::backward(p, d, h, s, dout, tables, self.dropout_seed)
        })
    }

    /// Adds the gradients of the layer's trained tensors to the side table, rounded to each
    /// tensor's dtype; a frozen tensor's (a norm's, computed with the input gradient) is
    /// dropped.
    fn send_to_side_table(&self, grads: Vec<TensorGrad>) -> Result<()> {
        let layer = &self.layer;
        for TensorGrad { tensor, grad } in grads {
            let Some(t) = tensor.of(layer) else {
                bail!("{OP_NAME}: gradient for a tensor the layer does not have (internal error)")
            };
            let Some(name) = trained_name(layer, t) else {
                continue;
            };
            let g = narrow_tensor(grad, t.dtype(), t.shape())?;
            self.side.add(name, g)?;
        }
        Ok(())
    }
}

impl CustomOp2 for NativeLayerOp {
    fn name(&self) -> &'static str {
        "native-decoder-layer"
    }

    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        match lock(&self.out).take() {
            Some(out) => Ok((narrow(out, self.dtype)?, l1.shape().clone())),
            None => bail!("{OP_NAME}: forward ran twice (internal error)"),
        }
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let arg = arg.contiguous()?;
        let grad = grad.contiguous()?;
        let saved = lock(&self.saved).take();
        let (dh, grads) = with_f32(&arg, |h| {
            with_f32(&grad, |g| self.backward(h, g, saved.as_ref()))
        })?;
        drop(saved);
        self.send_to_side_table(grads)?;
        let dh = narrow_tensor(dh, arg.dtype(), arg.shape())?;
        Ok((Some(dh), None))
    }
}
