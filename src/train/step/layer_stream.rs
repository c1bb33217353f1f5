//! Sharded data parallel's reduce-scatter, layer by layer as the backward produces the
//! gradients (issue #57, DeepSpeed's overlapped reduce-scatter): a decoder layer whose
//! gradients leave candle's graph through the side table — every checkpointed or gathered
//! (ZeRO-3) layer, and every native CPU layer — hands each finished gradient to its rank's
//! sink, and the sinks reduce-scatter it into the ranks' running sums. No rank then holds more
//! than a layer's whole gradient for long; the embeddings', final norm's and head's gradients
//! (and a plain candle layer's, which candle's backward returns all at once) are
//! reduce-scattered after the backward as before (`fold_micro_step`).
//!
//! Two ways, as the reducer allows ([`GradientReducer::scatters_each_contribution`]):
//! - the host adds each rank's contribution into every rank's sum as it arrives: on logical
//!   CPU devices, whose ranks run in turn, that is rank order, so the sum is the post-backward
//!   scatter's bit for bit;
//! - a collective (NCCL) needs every rank's gradient of a tensor at once: each contribution
//!   waits in a mailbox until every rank has given its own, and the rank that completes it
//!   launches the reduce-scatter for all (one thread drives every communicator, as the
//!   reducer's group calls require). What is still waiting when the micro-step ends (a rank
//!   that had no rows, so no backward) is reduce-scattered then, the missing ranks as zeros.
//!
//! The sums are the step's gradient ranges (`Accumulated::grads`), lent to the sinks for one
//! micro-step.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use candle_core::{Device, Tensor};

use crate::devices::parallel::shards::{host_scatter_add, ShardLayout};
use crate::devices::{DevicesError, GradientReducer};
use crate::model::{decoder::layer_of, CausalLm, GradientSink, Gradients};

/// The running sums the ranks' sinks reduce-scatter into.
struct Sums {
    layout: ShardLayout,
    /// The decoder-layer tensors the layout divides (what the sinks take).
    layer_names: HashSet<String>,
    devices: Vec<Device>,
    sums: Vec<Mutex<Gradients>>,
    reducer: Arc<dyn GradientReducer + Send + Sync>,
    /// A collective's waiting contributions: per tensor, each rank's (summed if it gave two).
    mailbox: Mutex<HashMap<String, Vec<Option<Tensor>>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Sums {
    fn ranks(&self) -> usize {
        self.sums.len()
    }

    /// Rank `rank`'s contribution `grad` to `name`'s gradient.
    fn take(&self, rank: usize, name: &str, grad: Tensor) -> Result<(), DevicesError> {
        let Some(t) = self.layout.tensor(name) else {
            return Err(DevicesError::Input(format!(
                "the reduce-scatter has no range of `{name}` (internal error)"
            )));
        };
        if self.reducer.scatters_each_contribution() {
            return host_scatter_add(grad, rank, t, &self.devices, &self.sums);
        }
        let complete = {
            let mut mailbox = lock(&self.mailbox);
            let slots = mailbox
                .entry(name.to_string())
                .or_insert_with(|| vec![None; self.ranks()]);
            let Some(slot) = slots.get_mut(rank) else {
                return Err(DevicesError::Input(format!(
                    "rank {rank} of {} gave a gradient of `{name}` (internal error)",
                    self.ranks()
                )));
            };
            *slot = Some(match slot.take() {
                Some(prev) => (prev + grad)?,
                None => grad,
            });
            if slots.iter().all(Option::is_some) {
                mailbox.remove(name)
            } else {
                None
            }
        };
        match complete {
            Some(grads) => self.reduce_scatter(name, grads),
            None => Ok(()),
        }
    }

    /// The collective's reduce-scatter of one tensor's contributions (a missing rank's as
    /// zeros) into every rank's sum. The sums are locked in rank order, so two completions on
    /// two threads never wait on each other the wrong way round.
    fn reduce_scatter(&self, name: &str, grads: Vec<Option<Tensor>>) -> Result<(), DevicesError> {
        let Some(t) = self.layout.tensor(name) else {
            return Ok(());
        };
        let one = ShardLayout::new([(name, t.dims.as_slice())], self.ranks());
        let per_rank: Vec<Gradients> = grads
            .into_iter()
            .map(|g| {
                let mut set = Gradients::new();
                if let Some(g) = g {
                    set.insert(name, g);
                }
                set
            })
            .collect();
        let mut guards: Vec<_> = self.sums.iter().map(lock).collect();
        let mut taken: Vec<Gradients> = guards
            .iter_mut()
            .map(|g| std::mem::take(&mut **g))
            .collect();
        let result = self
            .reducer
            .reduce_scatter_into(per_rank, &one, &self.devices, &mut taken);
        for (guard, sums) in guards.iter_mut().zip(taken) {
            **guard = sums;
        }
        result
    }

    /// Reduce-scatters what is still waiting (tensors some rank gave no gradient of).
    fn flush(&self) -> Result<(), DevicesError> {
        let waiting: Vec<(String, Vec<Option<Tensor>>)> = lock(&self.mailbox).drain().collect();
        for (name, grads) in waiting {
            self.reduce_scatter(&name, grads)?;
        }
        Ok(())
    }
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

    fn take(&self, name: &str, grad: Tensor) -> candle_core::Result<()> {
        self.sums.take(self.rank, name, grad).map_err(|e| {
            candle_core::Error::Msg(format!(
                "{} reduce-scatter of rank {}'s gradient of `{name}`: {e}",
                self.sums.reducer.name(),
                self.rank
            ))
        })
    }
}

/// Runs `micro_step` with every rank's decoder-layer gradients reduce-scattered into `sums`
/// (one set per rank; empty before a step's first micro-step) by `reducer` as each layer's
/// backward ends. The sinks are removed and the sums handed back whatever `micro_step`
/// returns; a failed flush of what was still waiting becomes rank 0's error
/// (`flush_error`) unless a rank failed already.
pub(super) fn with_layer_stream<T, E>(
    layout: &ShardLayout,
    reducer: Arc<dyn GradientReducer + Send + Sync>,
    models: &[&CausalLm],
    sums: &mut Vec<Gradients>,
    micro_step: impl FnOnce() -> Vec<Result<T, E>>,
    flush_error: impl FnOnce(DevicesError) -> E,
) -> Vec<Result<T, E>> {
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
        reducer,
        mailbox: Mutex::new(HashMap::new()),
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
    let mut out = {
        let _uninstall = Uninstall(models);
        micro_step()
    };
    if let Err(e) = shared.flush() {
        if out.iter().all(Result::is_ok) {
            if let Some(first) = out.first_mut() {
                *first = Err(flush_error(e));
            }
        }
    }
    *sums = shared
        .sums
        .iter()
        .map(|s| std::mem::take(&mut *lock(s)))
        .collect();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::parallel::shards::host_reduce_scatter_into;
    use crate::devices::HostReducer;

    /// The host reducer, but as a collective: nothing is scattered until every rank has given
    /// its gradient (NCCL's constraint, checked on the CPU).
    struct AsCollective;

    impl GradientReducer for AsCollective {
        fn all_reduce_sum(
            &self,
            per_rank: Vec<Gradients>,
            outputs: &[Device],
        ) -> Result<Vec<Gradients>, DevicesError> {
            HostReducer.all_reduce_sum(per_rank, outputs)
        }

        fn scatters_each_contribution(&self) -> bool {
            false
        }

        fn name(&self) -> &'static str {
            "collective"
        }
    }

    fn grad(values: &[f32]) -> Tensor {
        Tensor::from_slice(values, values.len(), &Device::Cpu).unwrap()
    }

    fn sums_over(ranks: usize, reducer: Arc<dyn GradientReducer + Send + Sync>) -> Sums {
        let layout = ShardLayout::new(
            [
                ("model.layers.0.mlp.up_proj.weight", &[5usize][..]),
                ("lm_head.weight", &[3][..]),
            ],
            ranks,
        );
        Sums {
            layer_names: ["model.layers.0.mlp.up_proj.weight".to_string()].into(),
            layout,
            devices: vec![Device::Cpu; ranks],
            sums: (0..ranks).map(|_| Mutex::new(Gradients::new())).collect(),
            reducer,
            mailbox: Mutex::new(HashMap::new()),
        }
    }

    fn ranges(sums: &Sums, name: &str) -> Vec<Vec<f32>> {
        sums.sums
            .iter()
            .map(|s| {
                lock(s)
                    .get(name)
                    .map_or(Vec::new(), |t| t.to_vec1().unwrap())
            })
            .collect()
    }

    /// Every way of streaming gives the post-backward reduce-scatter's sums: the host's
    /// contribution by contribution, the collective's once every rank has given its gradient
    /// (a rank's two contributions summed first), and the collective's flush of a tensor one
    /// rank never gave (its share zeros).
    #[test]
    fn streamed_contributions_sum_as_the_whole_reduce_scatter() {
        let name = "model.layers.0.mlp.up_proj.weight";
        let g = [
            [1.0f32, 2.0, 3.0, 4.0, 5.0],
            [10.0, 20.0, 30.0, 40.0, 50.0],
            [100.0, 200.0, 300.0, 400.0, 500.0],
        ];
        let layout = ShardLayout::new([(name, &[5usize][..])], 3);
        let per_rank = g
            .iter()
            .map(|v| {
                let mut s = Gradients::new();
                s.insert(name, grad(v));
                s
            })
            .collect();
        let mut want = vec![Gradients::new(); 3];
        host_reduce_scatter_into(
            per_rank,
            &layout,
            &[Device::Cpu, Device::Cpu, Device::Cpu],
            &mut want,
        )
        .unwrap();
        let want: Vec<Vec<f32>> = want
            .iter()
            .map(|s| s.get(name).unwrap().to_vec1().unwrap())
            .collect();
        assert_eq!(
            want,
            vec![vec![111.0, 222.0], vec![333.0, 444.0], vec![555.0]]
        );

        let host = sums_over(3, Arc::new(HostReducer));
        for (rank, v) in g.iter().enumerate() {
            host.take(rank, name, grad(v)).unwrap();
        }
        assert_eq!(ranges(&host, name), want);

        let collective = sums_over(3, Arc::new(AsCollective));
        collective.take(2, name, grad(&g[2])).unwrap();
        // Rank 0 gives its gradient in two parts, as a tensor used twice would.
        collective
            .take(0, name, grad(&[1.0, 2.0, 0.0, 0.0, 5.0]))
            .unwrap();
        collective
            .take(0, name, grad(&[0.0, 0.0, 3.0, 4.0, 0.0]))
            .unwrap();
        assert!(
            ranges(&collective, name).iter().all(Vec::is_empty),
            "nothing is scattered before every rank gave its gradient"
        );
        collective.take(1, name, grad(&g[1])).unwrap();
        assert_eq!(ranges(&collective, name), want);
        assert!(lock(&collective.mailbox).is_empty());

        // Rank 1 had no rows: its share of the sum is zeros, given when the micro-step ends.
        collective.take(0, name, grad(&g[0])).unwrap();
        collective.take(2, name, grad(&g[2])).unwrap();
        collective.flush().unwrap();
        let twice: Vec<Vec<f32>> = vec![vec![212.0, 424.0], vec![636.0, 848.0], vec![1060.0]];
        assert_eq!(ranges(&collective, name), twice);
    }
}
