//! The whole layer's forward and backward on slices: input norm, q/k/v, rope, attention,
//! `o_proj` and the residual, post norm, the gated MLP and its residual; what the forward
//! saves for the backward; and the gradients the backward hands to the side table.

use super::super::layer_weights::Layer;
use super::super::ops::{rms_norm, silu_mul};
use super::attention::{self, SavedAttention};
use super::dims::LayerDims;
use super::f32_data::add_into;
use super::layer_slices::LayerWeights;
use super::linear::{LinearGrads, LoraDown};
use super::pass_tables::PassTables;
use super::{linears, OP_NAME};
use candle_core::{Result, Tensor};

/// What the layer's forward keeps for its backward (the planner counts it:
/// `plan/step_model/native_layer.rs`).
pub(super) struct SavedActivations {
    /// Input-norm output `[n, hidden]` (`x1`).
    normed_input: Vec<f32>,
    /// The rotated queries, keys and values, and the attention probabilities.
    attention: SavedAttention,
    /// Attention output before `o_proj` `[n, heads·head_dim]`.
    attention_out: Vec<f32>,
    /// Residual stream after attention (`h2`), and its post-norm output (`x2`) `[n, hidden]`.
    residual: Vec<f32>,
    normed_residual: Vec<f32>,
    /// Gate and up projections `[n, intermediate]`.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Per linear layer (q, k, v, o, gate, up, down): the adapter's scaled down-projection
    /// `[n, r]` (LoRA only). The dropout masks are drawn again from their seed instead of
    /// kept: `n × in` floats each would be the largest thing LoRA keeps.
    lora_down: [LoraDown; 7],
}

/// The layer's forward pass on `h` `[n, hidden]`: returns the output and what backward needs.
/// `seed` seeds the adapters' dropout masks (None: no dropout).
pub(super) fn forward(
    p: &LayerWeights<'_>,
    d: &LayerDims,
    h: &[f32],
    tables: &PassTables,
    mask: &[f32],
    seed: Option<u64>,
) -> Result<(Vec<f32>, SavedActivations)> {
    let [lq, lk, lv, lo, lg, lu, ld] = &p.linears;
    let n = d.n;
    let x1 = rms_norm::forward::<f32>(h, p.input_norm, d.eps);
    let (mut q, sq) = lq.forward(&x1, n, seed)?;
    let (mut k, sk) = lk.forward(&x1, n, seed)?;
    let (v, sv) = lv.forward(&x1, n, seed)?;
    attention::rope_rows(
        &mut q,
        d.heads,
        d.head_dim,
        d.t,
        &tables.cos,
        &tables.sin,
        false,
    );
    attention::rope_rows(
        &mut k,
        d.kv_heads,
        d.head_dim,
        d.t,
        &tables.cos,
        &tables.sin,
        false,
    );
    let (o, attention) = attention::forward(q, k, v, d, mask, tables.mask_rows)?;
    let (mut h2, so) = lo.forward(&o, n, seed)?;
    add_into(&mut h2, h);
    let x2 = rms_norm::forward::<f32>(&h2, p.post_norm, d.eps);
    let (g, sg) = lg.forward(&x2, n, seed)?;
    let (u, su) = lu.forward(&x2, n, seed)?;
    let a = silu_mul::forward::<f32>(&g, &u);
    let (mut out, sd) = ld.forward(&a, n, seed)?;
    drop(a);
    add_into(&mut out, &h2);
    Ok((
        out,
        SavedActivations {
            normed_input: x1,
            attention,
            attention_out: o,
            residual: h2,
            normed_residual: x2,
            gate: g,
            up: u,
            lora_down: [sq, sk, sv, so, sg, su, sd],
        },
    ))
}

/// Which tensor of the layer a gradient belongs to.
#[derive(Clone, Copy)]
pub(super) enum LayerTensor {
    InputNorm,
    PostNorm,
    /// Weight, bias, adapter A and adapter B of linear layer `i` (q, k, v, o, gate, up, down).
    Weight(usize),
    Bias(usize),
    LoraA(usize),
    LoraB(usize),
}

/// A parameter gradient on its way to the side table.
pub(super) struct TensorGrad {
    pub tensor: LayerTensor,
    pub grad: Vec<f32>,
}

/// Collects the gradients of the layer's trained tensors as backward produces them.
#[derive(Default)]
struct LayerGrads(Vec<TensorGrad>);

impl LayerGrads {
    fn push(&mut self, tensor: LayerTensor, grad: Option<Vec<f32>>) {
        if let Some(grad) = grad {
            self.0.push(TensorGrad { tensor, grad });
        }
    }

    fn push_linear(&mut self, i: usize, g: LinearGrads) {
        self.push(LayerTensor::Weight(i), g.weight);
        self.push(LayerTensor::Bias(i), g.bias);
        self.push(LayerTensor::LoraA(i), g.lora_a);
        self.push(LayerTensor::LoraB(i), g.lora_b);
    }
}

/// The layer's backward pass: returns the input gradient and the gradient of every trained
/// tensor (frozen weights get none).
pub(super) fn backward(
    p: &LayerWeights<'_>,
    d: &LayerDims,
    h: &[f32],
    s: &SavedActivations,
    dout: &[f32],
    tables: &PassTables,
    seed: Option<u64>,
) -> Result<(Vec<f32>, Vec<TensorGrad>)> {
    let [lq, lk, lv, lo, lg, lu, ld] = &p.linears;
    let n = d.n;
    let sv = |i: usize| s.lora_down[i].as_deref();
    let mut grads = LayerGrads::default();
    // MLP: out = h2 + down(silu(gate(x2)) * up(x2)).
    let a = silu_mul::forward::<f32>(&s.gate, &s.up);
    let mut da = None;
    grads.push_linear(6, ld.backward(dout, &a, sv(6), n, seed, &mut da)?);
    drop(a);
    let (dg, du) = silu_mul::backward::<f32>(&s.gate, &s.up, &input_grad(da)?);
    let mut dx2 = None;
    grads.push_linear(
        4,
        lg.backward(&dg, &s.normed_residual, sv(4), n, seed, &mut dx2)?,
    );
    grads.push_linear(
        5,
        lu.backward(&du, &s.normed_residual, sv(5), n, seed, &mut dx2)?,
    );
    drop((dg, du));
    let (mut dh2, dw_post) =
        rms_norm::backward::<f32>(&s.residual, &input_grad(dx2)?, p.post_norm, d.eps);
    grads.push(LayerTensor::PostNorm, Some(dw_post));
    add_into(&mut dh2, dout);
    // Attention: h2 = h + o_proj(attention(rope(q(x1)), rope(k(x1)), v(x1))).
    let mut d_o = None;
    grads.push_linear(
        3,
        lo.backward(&dh2, &s.attention_out, sv(3), n, seed, &mut d_o)?,
    );
    let (mut dq, mut dk, dv) = attention::backward(&s.attention, &input_grad(d_o)?, d)?;
    attention::rope_rows(
        &mut dq,
        d.heads,
        d.head_dim,
        d.t,
        &tables.cos,
        &tables.sin,
        true,
    );
    attention::rope_rows(
        &mut dk,
        d.kv_heads,
        d.head_dim,
        d.t,
        &tables.cos,
        &tables.sin,
        true,
    );
    let mut dx1 = None;
    grads.push_linear(
        0,
        lq.backward(&dq, &s.normed_input, sv(0), n, seed, &mut dx1)?,
    );
    grads.push_linear(
        1,
        lk.backward(&dk, &s.normed_input, sv(1), n, seed, &mut dx1)?,
    );
    grads.push_linear(
        2,
        lv.backward(&dv, &s.normed_input, sv(2), n, seed, &mut dx1)?,
    );
    drop((dq, dk, dv));
    let (mut dh, dw_in) = rms_norm::backward::<f32>(h, &input_grad(dx1)?, p.input_norm, d.eps);
    grads.push(LayerTensor::InputNorm, Some(dw_in));
    add_into(&mut dh, &dh2);
    Ok((dh, grads.0))
}

impl LayerTensor {
    /// The tensor of `layer` this stands for.
    pub(super) fn of(self, layer: &Layer) -> Option<&Tensor> {
        let lins = linears(layer);
        match self {
            LayerTensor::InputNorm => Some(&layer.input_norm),
            LayerTensor::PostNorm => Some(&layer.post_norm),
            LayerTensor::Weight(i) => Some(&lins.get(i)?.w),
            LayerTensor::Bias(i) => lins.get(i)?.b.as_ref(),
            LayerTensor::LoraA(i) => lins.get(i)?.lora.as_ref().map(|f| &f.a),
            LayerTensor::LoraB(i) => lins.get(i)?.lora.as_ref().map(|f| &f.b),
        }
    }
}

/// The input gradient a chain of [`LinearWeights::backward`] calls produced.
fn input_grad(dx: Option<Vec<f32>>) -> Result<Vec<f32>> {
    dx.ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{OP_NAME}: input gradient missing (internal error)"
        ))
    })
}
