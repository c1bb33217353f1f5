//! One decoder layer's weights as the forward passes read them: [`Layer`], its seven
//! [`Linear`] layers and their [`LoraFactors`], and the adapter-dropout masks they draw.
//!
//! Both the graph path (`decoder/layer.rs`) and the native layer op (`native_layer/`) read these
//! types, so they sit below both: the decoder builds them, the native op only reads them.

use super::error::ModelError;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// The seven linear layers of a decoder layer, in [`Layer::linears`]' order, by HF name.
const LINEAR_NAMES: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

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
    /// Its position in the model (`model.layers.<index>.…`).
    pub index: usize,
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

impl Layer {
    /// This layer with every tensor taken from `whole` (HF name → the whole tensor, on the
    /// layer's device): what ZeRO-3 runs after gathering a layer the ranks hold in slices
    /// (`model::layer_source`). Everything else — shapes of the heads, which tensors train,
    /// LoRA's scale and dropout, a quantized base — is this layer's; the trained tensors
    /// become variables of their own, so a backward through the result gives their
    /// gradients by name ([`Layer::trainable`]).
    pub(crate) fn with_weights(
        &self,
        whole: &HashMap<String, Tensor>,
    ) -> Result<Layer, ModelError> {
        let prefix = format!("model.layers.{}", self.index);
        let trained: HashSet<&str> = self.trainable.iter().map(|(n, _)| n.as_str()).collect();
        let mut trainable = Vec::new();
        let mut take = |name: String| -> Result<Tensor, ModelError> {
            let t = whole.get(&name).ok_or_else(|| ModelError::MissingTensor {
                name: name.clone(),
                file: "(a gathered layer)".into(),
            })?;
            if trained.contains(name.as_str()) {
                let var = Var::from_tensor(t)?.as_tensor().clone();
                trainable.push((name, var.clone()));
                Ok(var)
            } else {
                Ok(t.detach())
            }
        };
        let mut linears = Vec::with_capacity(LINEAR_NAMES.len());
        for (linear, name) in self.linears().into_iter().zip(LINEAR_NAMES) {
            let base = format!("{prefix}.{name}");
            let w = match linear.quant {
                // A quantized base is not a parameter: every rank keeps it whole.
                Some(_) => linear.w.clone(),
                None => take(format!("{base}.weight"))?,
            };
            let b = match linear.b {
                Some(_) => Some(take(format!("{base}.bias"))?),
                None => None,
            };
            let lora = match &linear.lora {
                Some(f) => Some(LoraFactors {
                    a: take(format!("{base}.lora_A.weight"))?,
                    b: take(format!("{base}.lora_B.weight"))?,
                    ..f.clone()
                }),
                None => None,
            };
            linears.push(Linear {
                w,
                b,
                lora,
                ..linear.clone()
            });
        }
        let input_norm = take(format!("{prefix}.input_layernorm.weight"))?;
        let post_norm = take(format!("{prefix}.post_attention_layernorm.weight"))?;
        let [q, k, v, o, gate, up, down]: [Linear; 7] = linears
            .try_into()
            .map_err(|_| ModelError::Input("a decoder layer has seven linear layers".into()))?;
        Ok(Layer {
            index: self.index,
            q,
            k,
            v,
            o,
            gate,
            up,
            down,
            input_norm,
            post_norm,
            eps: self.eps,
            sliding: self.sliding,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            trainable,
            device: self.device.clone(),
            owner: self.owner,
            anchor: self.anchor.clone(),
        })
    }

    /// The seven linear layers, in [`LINEAR_NAMES`]' order.
    fn linears(&self) -> [&Linear; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }
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
