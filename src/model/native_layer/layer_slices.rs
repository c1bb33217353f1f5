//! The layer's tensors as slices for one call: the storages read-locked while the op runs, the
//! norms, biases and adapter factors as `f32`, the weights in their stored dtype.

use super::super::layer_weights::Layer;
use super::dims::weight_dims;
use super::f32_data::as_f32;
use super::linear::{weight_ref, LinearWeights, LoraWeights, WeightRef};
use super::{linears, OP_NAME};
use candle_core::{bail, Result, Storage, Tensor};
use std::borrow::Cow;

/// The HF name of a trainable tensor of `layer` (None when it is frozen).
pub(super) fn trained_name<'a>(layer: &'a Layer, t: &Tensor) -> Option<&'a str> {
    layer
        .trainable
        .iter()
        .find(|(_, v)| v.id() == t.id())
        .map(|(n, _)| n.as_str())
}

/// The layer's parameters as slices (storages read-locked while they are in use).
pub(super) struct LayerWeights<'a> {
    /// The two norms' weights.
    pub input_norm: &'a [f32],
    pub post_norm: &'a [f32],
    /// q, k, v, o, gate, up, down.
    pub linears: [LinearWeights<'a>; 7],
}

/// Every tensor of `layer` in the order [`with_layer_weights`] reads them: the two norms, the
/// seven weights, then per linear layer its bias and its adapter factors, where present.
fn layer_tensors(layer: &Layer) -> Vec<&Tensor> {
    let lins = linears(layer);
    let mut tensors = vec![&layer.input_norm, &layer.post_norm];
    tensors.extend(lins.iter().map(|l| &l.w));
    for l in lins {
        tensors.extend(l.b.as_ref());
        if let Some(f) = &l.lora {
            tensors.extend([&f.a, &f.b]);
        }
    }
    tensors
}

/// Runs `f` on the tensors of `layer` as slices: norms, biases and adapter factors as `f32`,
/// the weights in their stored dtype. `adapters` false (the adapters switched off) leaves
/// every adapter out of the products.
pub(super) fn with_layer_weights<R>(
    layer: &Layer,
    adapters: bool,
    f: impl FnOnce(&LayerWeights<'_>) -> Result<R>,
) -> Result<R> {
    let lins = linears(layer);
    let tensors = layer_tensors(layer);
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut cows = Vec::with_capacity(guards.len());
    let mut weights = Vec::with_capacity(7);
    for (k, (storage, layout)) in guards.iter().enumerate() {
        let Storage::Cpu(cpu) = &**storage else {
            bail!("{OP_NAME}: runs on the CPU only (internal error: use the graph path)")
        };
        if (2..9).contains(&k) {
            // The seven weights stay in their dtype: each product widens its own (or reads a
            // bf16 one as it is).
            weights.push(weight_ref(cpu, layout)?);
            cows.push(Cow::Borrowed(&[][..]));
        } else {
            cows.push(as_f32(cpu, layout)?);
        }
    }
    let slices: Vec<&[f32]> = cows.iter().map(|c| c.as_ref()).collect();
    let mut rest = slices[9..].iter().copied();
    let mut next = || {
        rest.next().ok_or_else(|| {
            candle_core::Error::Msg(format!("{OP_NAME}: a tensor of the layer is missing"))
        })
    };
    let mut linears_read = Vec::with_capacity(7);
    for (i, l) in lins.iter().enumerate() {
        let (out, inp) = weight_dims(l)?;
        let b = match l.b {
            Some(_) => Some(next()?),
            None => None,
        };
        let lora = match &l.lora {
            Some(_) if !adapters => {
                // Read past the factors: the slices are in order.
                next()?;
                next()?;
                None
            }
            Some(f) => Some(LoraWeights {
                a: next()?,
                b: next()?,
                rank: f.a.dim(0)?,
                scale: f.scale as f32,
                dropout: f.dropout,
                dropout_key: l.key,
            }),
            None => None,
        };
        linears_read.push(LinearWeights {
            weight: match (&l.quant, weights.get(i)) {
                (Some(q), _) => WeightRef::Quantized(q),
                (None, Some(w)) => *w,
                (None, None) => bail!("{OP_NAME}: a weight of the layer is missing"),
            },
            bias: b,
            out_dim: out,
            in_dim: inp,
            trains_weight: trained_name(layer, &l.w).is_some(),
            trains_bias: l
                .b
                .as_ref()
                .is_some_and(|b| trained_name(layer, b).is_some()),
            lora,
        });
    }
    let Ok(linears) = <[LinearWeights<'_>; 7]>::try_from(linears_read) else {
        bail!("{OP_NAME}: expected seven linear layers")
    };
    f(&LayerWeights {
        input_norm: slices[0],
        post_norm: slices[1],
        linears,
    })
}
