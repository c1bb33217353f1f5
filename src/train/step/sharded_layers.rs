//! ZeRO-3 (`[devices] shard = "everything"`): the decoder layers' weights divided over the
//! ranks too. Every rank keeps its range of every layer tensor — for a trained tensor the
//! range its optimizer updates (the fp32 master under mixed precision, see
//! [`super::sharded`]), for a frozen one (a LoRA base) a copy of its range in the weights'
//! dtype — and each rank's model gathers a layer whole just before it runs, forward and
//! recompute, and drops it after ([`crate::model::LayerSource`]). The embeddings, the final
//! norm and the head stay whole on every rank, as FSDP's root unit stays gathered through the
//! step; their gradients and AdamW state are divided as under ZeRO-2.
//!
//! The gather is the host all-gather of [`crate::devices::parallel::shards`] (each range moved
//! to the asking rank's device, then joined), so on logical CPU devices with distinct storage
//! it copies what an NCCL all-gather would move. A master range is rounded to the weights'
//! dtype where it lives, as ZeRO-2's all-gather after the update rounds it, so the gathered
//! weights are those one device's AdamW would have written.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::devices::parallel::shards::{host_all_gather, ShardLayout};
use crate::model::{CausalLm, Home, LayerSource, ModelError};

/// Every rank's ranges of every decoder-layer tensor.
pub(super) struct LayerShards {
    layout: ShardLayout,
    /// Per tensor of `layout` (same order): each rank's range, flat (`None` for an empty one).
    parts: Vec<Vec<Option<Tensor>>>,
    /// Indices into `layout` of each decoder layer's tensors.
    by_layer: Vec<Vec<usize>>,
    /// The dtype the forward pass reads (a master range is rounded to it).
    dtype: DType,
}

impl LayerShards {
    /// The ranges of every decoder-layer tensor of `models` (one per rank, rank 0 first, still
    /// whole): for a trained tensor `trained(rank, name)` (the sharded optimizer's range),
    /// for a frozen one a copy of the rank's range of its own model's tensor.
    pub(super) fn new(
        models: &[&CausalLm],
        trained: impl Fn(usize, &str) -> Option<Tensor>,
    ) -> Result<Self, ModelError> {
        let first = models
            .first()
            .ok_or_else(|| ModelError::Input("ZeRO-3 needs at least one rank".into()))?;
        let layers = first.config().num_hidden_layers;
        let tensors: Vec<(&str, &[usize], usize)> = first
            .params()
            .iter()
            .filter_map(|p| {
                crate::model::decoder::layer_of(&p.name).map(|l| (p.name.as_str(), p.var.dims(), l))
            })
            .collect();
        let layout = ShardLayout::new(tensors.iter().map(|&(n, d, _)| (n, d)), models.len());
        let mut by_layer = vec![Vec::new(); layers];
        for (i, &(_, _, l)) in tensors.iter().enumerate() {
            if let Some(list) = by_layer.get_mut(l) {
                list.push(i);
            }
        }
        let mut parts = Vec::with_capacity(layout.tensors().len());
        for t in layout.tensors() {
            let mut ranks = Vec::with_capacity(models.len());
            for (rank, model) in models.iter().enumerate() {
                let range = &t.ranges[rank];
                if range.is_empty() {
                    ranks.push(None);
                    continue;
                }
                let _rank = crate::mem::ranks::RankGuard::enter(rank);
                let part = match trained(rank, &t.name) {
                    Some(range) => range,
                    None => {
                        let param = model.param(&t.name).ok_or_else(|| {
                            ModelError::Input(format!("rank {rank}'s model has no `{}`", t.name))
                        })?;
                        // Detached: a copy of a variable's view would keep the whole
                        // variable alive through its graph.
                        param
                            .var
                            .as_detached_tensor()
                            .flatten_all()?
                            .narrow(0, range.start, range.len())?
                            .force_contiguous()?
                    }
                };
                ranks.push(Some(part));
            }
            parts.push(ranks);
        }
        Ok(LayerShards {
            layout,
            parts,
            by_layer,
            dtype: first.dtype(),
        })
    }

    /// Names of every tensor the ranks hold in ranges only.
    pub(super) fn names(&self) -> impl Iterator<Item = &str> {
        self.layout.tensors().iter().map(|t| t.name.as_str())
    }

    /// Layer `layer`'s tensors whole on `home`.
    fn gather(&self, layer: usize, home: &Home) -> Result<HashMap<String, Tensor>, ModelError> {
        let indices = self.by_layer.get(layer).ok_or_else(|| {
            ModelError::Input(format!("ZeRO-3: the model has no decoder layer {layer}"))
        })?;
        let mut whole = HashMap::with_capacity(indices.len());
        for &i in indices {
            let t = &self.layout.tensors()[i];
            // A master range (fp32) rounded to the weights' dtype where it lives.
            let rounded: Vec<Option<Tensor>> = self.parts[i]
                .iter()
                .map(|p| match p {
                    Some(p) if p.dtype() != self.dtype => p.to_dtype(self.dtype).map(Some),
                    Some(p) => Ok(Some(p.clone())),
                    None => Ok(None),
                })
                .collect::<Result<_, _>>()?;
            let refs: Vec<Option<&Tensor>> = rounded.iter().map(Option::as_ref).collect();
            let joined = host_all_gather(&refs, &t.dims, home).map_err(|e| {
                ModelError::Optimizer(format!("ZeRO-3 gather of `{}`: {e}", t.name))
            })?;
            whole.insert(t.name.clone(), joined);
        }
        Ok(whole)
    }
}

/// What one rank's model gathers its layers from.
pub(super) struct RankLayers {
    pub shards: Arc<LayerShards>,
    pub home: Home,
}

impl RankLayers {
    /// Rank `rank`'s view of `shards`, gathering onto `device`.
    pub(super) fn new(shards: Arc<LayerShards>, rank: usize, device: &Device) -> Self {
        RankLayers {
            shards,
            home: Home {
                index: rank,
                device: device.clone(),
            },
        }
    }
}

impl LayerSource for RankLayers {
    fn gather(&self, layer: usize) -> Result<HashMap<String, Tensor>, ModelError> {
        self.shards.gather(layer, &self.home)
    }
}

impl super::TrainingRun {
    /// ZeRO-3: divides the decoder layers' weights over the ranks, once their whole weights
    /// have served what needs them (loading, a resume, a checkpoint), before a step or an
    /// evaluation runs. Models already running from the ranges are left as they are; rank 0,
    /// made whole for a checkpoint, runs from them again. Nothing for any other strategy.
    pub(super) fn shard_layers(&mut self) -> Result<(), super::super::error::TrainError> {
        use crate::settings::{ShardMode, Strategy};
        let d = &self.config.devices;
        if d.strategy != Strategy::Sharded || d.shard != ShardMode::Everything {
            return Ok(());
        }
        let Some(sharded) = &mut self.sharded else {
            return Ok(());
        };
        let err = |cause| super::super::error::TrainError::Model {
            context: "ZeRO-3: cannot divide the decoder layers over the ranks".into(),
            cause,
        };
        let shards = match &self.layer_shards {
            Some(shards) => shards.clone(),
            None => {
                let models: Vec<&CausalLm> = std::iter::once(&self.model)
                    .chain(self.replicas.iter().map(|r| &r.model))
                    .collect();
                let shards = LayerShards::new(&models, |rank, name| sharded.range(rank, name))
                    .map_err(err)?;
                sharded.keep_sliced(shards.names());
                let shards = Arc::new(shards);
                self.layer_shards = Some(shards.clone());
                shards
            }
        };
        let models =
            std::iter::once(&mut self.model).chain(self.replicas.iter_mut().map(|r| &mut r.model));
        for (rank, model) in models.enumerate() {
            if model.layer_weights_released() {
                continue;
            }
            // Each rank gathers onto its own model's device.
            let device = model.device().clone();
            let source = Arc::new(RankLayers::new(shards.clone(), rank, &device));
            model.release_layer_weights(source).map_err(err)?;
        }
        Ok(())
    }

    /// ZeRO-3: makes rank 0's model whole again (its layers gathered onto its device), for a
    /// checkpoint to write and for callers of [`super::TrainingRun::model`]; the next step
    /// divides them again. Costs rank 0 the whole weights while they are whole, as DeepSpeed's
    /// `stage3_gather_16bit_weights_on_model_save` does. Nothing when rank 0 holds its layers.
    pub fn gather_weights(&mut self) -> Result<(), super::super::error::TrainError> {
        let whole = self
            .model
            .gather_layer_weights()
            .and_then(|whole| match whole {
                Some(whole) => self.model.restore_layer_weights(whole),
                None => Ok(()),
            });
        whole.map_err(|cause| super::super::error::TrainError::Model {
            context: "ZeRO-3: cannot gather the decoder layers into rank 0's model".into(),
            cause,
        })
    }
}
