//! One decoder layer's weights as the forward passes read them: [`Layer`], its seven
//! [`Linear`] layers and their [`LoraFactors`], and the adapter-dropout masks they draw.
//!
//! Both the graph path (`decoder/layer.rs`) and the native layer op (`native_layer/`) read these
//! types, so they sit below both: the decoder builds them, the native op only reads them.

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// The LoRA factors attached to one linear layer.
#[derive(Clone)]
pub(crate) struct LoraFactors {
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    /// `alpha / r`.
    pub scale: f64,
    /// Dropout probability on the adapter's input.
    pub dropout: f64,
}

/// A linear layer `y = x W^T (+ b) (+ LoRA)` as the forward pass sees it.
#[derive(Clone)]
pub(crate) struct Linear {
    /// `[out, in]`: the Var's tensor when trainable, a detached view when frozen.
    pub w: Tensor,
    pub b: Option<Tensor>,
    /// Frozen weights go through a matmul whose backward computes only the input gradient.
    pub frozen: bool,
    /// The quantized base weight (QLoRA, see [`super::quant`]); `w` is then an empty
    /// placeholder and the layer never runs as a native layer op.
    pub quant: Option<Arc<QTensor>>,
    pub lora: Option<LoraFactors>,
    /// Distinguishes dropout masks of different layers.
    pub key: u64,
}

/// One decoder layer's weights.
pub(crate) struct Layer {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub input_norm: Tensor,
    pub post_norm: Tensor,
    pub eps: f64,
    /// Whether this layer uses the sliding-window mask.
    pub sliding: bool,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `(name, var tensor)` of the layer's trainable parameters (for checkpointed backward).
    pub trainable: Vec<(String, Tensor)>,
    pub device: Device,
    /// The logical device (stage) that owns it ([`super::placed::Placed`]).
    pub owner: usize,
    /// A zero Var that makes checkpointed layers part of the graph even when their input
    /// carries no gradient (frozen embeddings under LoRA).
    pub anchor: Var,
}

/// The dropout mask of `n` elements drawn from `seed`: `1 / (1 - p)` where an element is kept,
/// 0 where it is dropped. The graph path and the native layer op both draw it here, so the
/// same seed drops the same elements on either path (and again when a layer is recomputed).
pub(crate) fn dropout_mask(n: usize, p: f64, seed: u64) -> Vec<f32> {
    let keep = 1.0 - p;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            if rng.gen::<f64>() < keep {
                (1.0 / keep) as f32
            } else {
                0.0
            }
        })
        .collect()
}

/// The seed of one linear layer's adapter-dropout mask in the forward pass seeded `pass_seed`
/// (`key` tells the linear layers apart).
pub(crate) fn lora_dropout_seed(pass_seed: u64, key: u64) -> u64 {
    pass_seed ^ key.wrapping_mul(0xA24B_AED4_963E_E407)
}
