//! Sharded data parallel's reduce-scatter, layer by layer as the backward produces the
//! gradients (issue #57, DeepSpeed's overlapped reduce-scatter): a decoder layer whose
//! gradients leave candle's graph through the side table — every checkpointed or gathered
//! (ZeRO-3) layer, and every native CPU layer — hands each finished gradient to its rank's
//! sink, which adds each rank's range of it into that rank's running sum and drops it. No
//! rank then holds more than one layer's whole gradient; the embeddings', final norm's and
//! head's gradients (and a plain candle layer's, which candle's backward returns all at once)
//! are reduce-scattered after the backward as before (`fold_micro_step`).
//!
//! The sums are the step's gradient ranges (`Accumulated::grads`), lent to the sinks for one
//! micro-step. A contribution is added when it arrives: on logical CPU devices, whose ranks
//! run in turn, that is rank order, so the sum is the post-backward scatter's bit for bit.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::Device;

use crate::devices::parallel::shards::{host_scatter_add, ShardLayout};
use crate::model::{decoder::layer_of, CausalLm, GradientSink, Gradients};

/// The running sums the ranks' sinks add into.
struct Sums {
    layout: ShardLayout,
    /// The decoder-layer tensors the layout divides (what the sinks take).
    layer_names: HashSet<String>,
    devices: Vec<Device>,
    sums: Vec<Mutex<Gradients>>,
}

/// One rank's sink.
struct RankSink {
    rank: usize,
    sums: Arc<Sums>,
}

impl GradientSink for RankSink {
    fn takes(&self, name: &str) -> bool {
        self.sums.layer_names.contains(name)
    }

    fn take(&self, name: &str, grad: candle_core::Tensor) -> candle_core::Result<()> {
        let Some(t) = self.sums.layout.tensor(name) else {
            candle_core::bail!("the reduce-scatter has no range of `{name}` (internal error)")
        };
        host_scatter_add(grad, self.rank, t, &self.sums.devices, &self.sums.sums).map_err(|e| {
            candle_core::Error::Msg(format!(
                "reduce-scatter of rank {}'s gradient of `{name}`: {e}",
                self.rank
            ))
        })
    }
}

/// Runs `micro_step` with every rank's decoder-layer gradients reduce-scattered into `sums`
/// (one set per rank; empty before a step's first micro-step) as each layer's backward ends.
/// The sinks are removed and the sums handed back whatever `micro_step` returns.
pub(super) fn with_layer_stream<T>(
    layout: &ShardLayout,
    models: &[&CausalLm],
    sums: &mut Vec<Gradients>,
    micro_step: impl FnOnce() -> T,
) -> T {
    let ranks = layout.ranks();
    if models.len() != ranks || ranks < 2 {
        return micro_step();
    }
    if sums.len() != ranks {
        *sums = vec![Gradients::new(); ranks];
    }
    let shared = Arc::new(Sums {
        layer_names: layout
            .tensors()
            .iter()
            .filter(|t| layer_of(&t.name).is_some())
            .map(|t| t.name.clone())
            .collect(),
        layout: layout.clone(),
        devices: models.iter().map(|m| m.device().clone()).collect(),
        sums: std::mem::take(sums).into_iter().map(Mutex::new).collect(),
    });
    for (rank, model) in models.iter().enumerate() {
        model.set_gradient_sink(Some(Arc::new(RankSink {
            rank,
            sums: shared.clone(),
        })));
    }
    // Removed on every way out, a panic included (the trainer may go on to write a checkpoint).
    struct Uninstall<'a>(&'a [&'a CausalLm]);
    impl Drop for Uninstall<'_> {
        fn drop(&mut self) {
            for model in self.0 {
                model.set_gradient_sink(None);
            }
        }
    }
    let out = {
        let _uninstall = Uninstall(models);
        micro_step()
    };
    *sums = shared
        .sums
        .iter()
        .map(|s| std::mem::take(&mut *s.lock().unwrap_or_else(PoisonError::into_inner)))
        .collect();
    out
}
