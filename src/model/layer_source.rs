//! Decoder layers whose weights the model does not hold (ZeRO-3, FSDP's full shard): a
//! [`LayerSource`] gathers a layer's tensors whole just before the layer runs, and the model
//! drops them as soon as it has run. The forward pass and the recompute of the backward each
//! gather the layer again (`model::checkpoint`), so a rank holds one layer whole at a time.
//!
//! The model keeps a placeholder (no elements) for every tensor of its decoder layers while a
//! source is installed ([`CausalLm::release_layer_weights`]); the embeddings, the final norm
//! and the head stay whole, as FSDP's root unit keeps them gathered through the step.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Tensor, Var};

use super::decoder::layer_of;
use super::error::ModelError;
use super::CausalLm;

/// Where a model whose layers were released gets a layer's tensors.
pub trait LayerSource: Send + Sync {
    /// Every tensor of decoder layer `layer` (HF names, e.g. `model.layers.3.mlp.up_proj.weight`),
    /// whole, in the model's dtype, on the device of the model that asks.
    fn gather(&self, layer: usize) -> Result<HashMap<String, Tensor>, ModelError>;
}

impl CausalLm {
    /// Drops every tensor of the decoder layers (each parameter keeps its name, trainability
    /// and place in the list, with no elements), and runs each layer from what `source`
    /// gathers for it from then on. A quantized base is not a parameter and stays.
    pub fn release_layer_weights(
        &mut self,
        source: Arc<dyn LayerSource>,
    ) -> Result<(), ModelError> {
        for p in self
            .params
            .iter_mut()
            .filter(|p| layer_of(&p.name).is_some())
        {
            let empty = Tensor::zeros(0, p.var.dtype(), p.var.device())?;
            p.var = Var::from_tensor(&empty)?;
        }
        self.layer_source = Some(source);
        self.rebuild()
    }

    /// Puts the decoder layers' tensors back whole (`whole`, by HF name, every tensor of every
    /// layer) and forgets the source: the model is an ordinary one again (to save or export
    /// it).
    pub fn restore_layer_weights(
        &mut self,
        whole: HashMap<String, Tensor>,
    ) -> Result<(), ModelError> {
        let mut whole = whole;
        for p in self
            .params
            .iter_mut()
            .filter(|p| layer_of(&p.name).is_some())
        {
            let t = whole
                .remove(&p.name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: p.name.clone(),
                    file: "(the gathered layers)".into(),
                })?;
            p.var = Var::from_tensor(&t.to_device(p.var.device())?)?;
        }
        self.layer_source = None;
        self.rebuild()
    }

    /// Whether the decoder layers' weights live elsewhere ([`Self::release_layer_weights`]).
    pub fn layer_weights_released(&self) -> bool {
        self.layer_source.is_some()
    }

    /// Every decoder layer's tensors, whole, from the source (`None` when the model holds
    /// its layers itself).
    pub fn gather_layer_weights(&self) -> Result<Option<HashMap<String, Tensor>>, ModelError> {
        let Some(source) = &self.layer_source else {
            return Ok(None);
        };
        let mut whole = HashMap::new();
        for layer in 0..self.config.num_hidden_layers {
            whole.extend(source.gather(layer)?);
        }
        Ok(Some(whole))
    }
}
