//! The sizes of one native layer call, checked against the layer's weights.

use super::super::layer_weights::{Layer, Linear};
use super::{linears, OP_NAME};
use candle_core::{bail, Result, Tensor};

/// Sizes of one layer call.
#[derive(Clone, Copy)]
pub(super) struct LayerDims {
    /// Batch rows.
    pub b: usize,
    /// Tokens per row.
    pub t: usize,
    /// Tokens (`b × t`).
    pub n: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
}

impl LayerDims {
    /// The sizes of `layer` on `h` `[b, t, hidden]`, checked against its weights.
    pub(super) fn of(layer: &Layer, h: &Tensor) -> Result<Self> {
        let (b, t, hidden) = h.dims3()?;
        let dims = Self {
            b,
            t,
            n: b * t,
            hidden,
            heads: layer.num_heads,
            kv_heads: layer.num_kv_heads,
            head_dim: layer.head_dim,
            eps: layer.eps as f32,
        };
        check_dims(layer, &dims)?;
        Ok(dims)
    }

    /// Width of the queries (and of the attention output): `heads × head_dim`.
    pub(super) fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Width of the keys and values: `kv_heads × head_dim`.
    pub(super) fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// Fails unless every weight of `layer` has the shape its config says and the heads group.
fn check_dims(layer: &Layer, d: &LayerDims) -> Result<()> {
    let want = [
        (d.q_dim(), d.hidden),
        (d.kv_dim(), d.hidden),
        (d.kv_dim(), d.hidden),
        (d.hidden, d.q_dim()),
    ];
    let inter = weight_dims(&layer.gate)?.0;
    let want = [
        want[0],
        want[1],
        want[2],
        want[3],
        (inter, d.hidden),
        (inter, d.hidden),
        (d.hidden, inter),
    ];
    for (l, (out, inp)) in linears(layer).iter().zip(want) {
        let got = weight_dims(l)?;
        if got != (out, inp) {
            bail!(
                "{OP_NAME}: weight of shape {got:?} where [{out}, {inp}] was expected (config and weights disagree)"
            );
        }
    }
    if d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) || !d.head_dim.is_multiple_of(2) {
        bail!(
            "{OP_NAME}: {} heads over {} kv heads of width {} cannot be grouped",
            d.heads,
            d.kv_heads,
            d.head_dim
        );
    }
    Ok(())
}

/// `(out, in)` of a linear layer's weight, dense or quantized.
pub(super) fn weight_dims(l: &Linear) -> Result<(usize, usize)> {
    match &l.quant {
        Some(q) => q.shape().dims2(),
        None => l.w.dims2(),
    }
}
