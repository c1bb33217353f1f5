//! The tables one forward pass shares with its native layers: the rope tables and the
//! attention masks as `f32`, read once by the first native layer and kept until the loss is
//! dropped.

use super::super::layer_weights::Layer;
use super::super::ops::tensor_to_f32_vec;
use super::OP_NAME;
use candle_core::{Result, Tensor};

/// What every native layer of one forward pass reads: rope tables and masks as `f32`.
pub(crate) struct PassTables {
    /// `[t, head_dim]`.
    pub(super) cos: Vec<f32>,
    pub(super) sin: Vec<f32>,
    /// `[mask_rows, t, t]` additive masks (`mask_rows` is 1 or the batch size).
    pub(super) mask: Vec<f32>,
    pub(super) sliding_mask: Option<Vec<f32>>,
    pub(super) mask_rows: usize,
    /// Whether the adapters add their update (false inside `CausalLm::without_adapters`).
    pub(super) adapters: bool,
}

impl PassTables {
    /// The tables of one forward pass: `cos` and `sin` `[t, head_dim]`, the additive masks
    /// `[b or 1, 1, 1, t, t]` (the sliding-window one where a layer uses it), and whether the
    /// adapters add their update.
    pub(crate) fn new(
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        sliding_mask: Option<&Tensor>,
        adapters: bool,
    ) -> Result<Self> {
        let mask_rows = mask.dims().first().copied().unwrap_or(1);
        Ok(Self {
            cos: tensor_to_f32_vec(cos, OP_NAME)?,
            sin: tensor_to_f32_vec(sin, OP_NAME)?,
            mask: tensor_to_f32_vec(mask, OP_NAME)?,
            sliding_mask: match sliding_mask {
                Some(m) => Some(tensor_to_f32_vec(m, OP_NAME)?),
                None => None,
            },
            mask_rows,
            adapters,
        })
    }

    /// The mask `layer` reads: the sliding-window one where it uses one.
    pub(super) fn mask_for(&self, layer: &Layer) -> &[f32] {
        match (&self.sliding_mask, layer.sliding) {
            (Some(m), true) => m,
            _ => &self.mask,
        }
    }
}
