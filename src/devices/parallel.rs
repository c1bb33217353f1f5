//! Data parallelism: one rank per device, each on a contiguous share of the
//! batch rows; the gradients of the per-rank loss *sums* are all-reduced
//! (summed) and then normalised by the total number of trained tokens.
//!
//! Summing loss sums (not averaging per-rank means) makes the step exactly the
//! one-device step on the whole batch, whatever the ranks' token counts:
//! d(Σ_r sum_r)/dθ / Σ_r tokens_r = d(sum)/dθ / tokens.
//!
//! The reduction is pluggable ([`GradientReducer`]): [`HostReducer`] sums
//! through the first rank's device (any devices, CPU logical devices
//! included); `nccl::NcclReducer` (feature `nccl`) runs NCCL all-reduce on
//! the GPUs, within one process or across processes and machines
//! (docs/multi-node.md); `process_group::ProcessGroup` sums across processes over TCP (a
//! launched run's ranks on the CPU, as PyTorch's Gloo backend does).

use super::strategy::LogicalDevice;
use super::DevicesError;
use crate::model::{CausalLm, Gradients, Home, Placed};
use candle_core::{Device, Tensor};

/// One batch of training rows as tensors, all on one device (the host-side padded batch
/// is [`crate::data::Batch`]).
#[derive(Debug, Clone)]
pub struct DeviceBatch {
    /// `[rows, seq]` u32 token ids.
    pub input_ids: Tensor,
    /// `[rows, seq]` u32 1/0 attention mask, when padded.
    pub attention_mask: Option<Tensor>,
    /// `[rows, seq]` i64 labels, -100 ignored.
    pub labels: Tensor,
}

impl DeviceBatch {
    /// Number of rows.
    pub fn rows(&self) -> Result<usize, DevicesError> {
        Ok(self.input_ids.dim(0)?)
    }

    /// Rows `start..start + len`.
    pub fn narrow(&self, start: usize, len: usize) -> Result<DeviceBatch, DevicesError> {
        Ok(DeviceBatch {
            input_ids: self.input_ids.narrow(0, start, len)?,
            attention_mask: match &self.attention_mask {
                Some(m) => Some(m.narrow(0, start, len)?),
                None => None,
            },
            labels: self.labels.narrow(0, start, len)?,
        })
    }

    /// The same batch on `device`.
    pub fn to_device(&self, device: &Device) -> Result<DeviceBatch, DevicesError> {
        Ok(DeviceBatch {
            input_ids: self.input_ids.to_device(device)?,
            attention_mask: match &self.attention_mask {
                Some(m) => Some(m.to_device(device)?),
                None => None,
            },
            labels: self.labels.to_device(device)?,
        })
    }
}

/// Splits a batch's rows into `ranks` contiguous shards, as even as possible
/// (earlier ranks get the extra rows).
pub fn split_batch(batch: &DeviceBatch, ranks: usize) -> Result<Vec<DeviceBatch>, DevicesError> {
    let rows = batch.rows()?;
    if ranks == 0 {
        return Err(DevicesError::Input(
            "data parallel needs at least one device; choose devices in the run's `devices` setting".into(),
        ));
    }
    if rows < ranks {
        return Err(DevicesError::Input(format!(
            "a batch of {rows} rows cannot be split over {ranks} data-parallel ranks; \
             raise training.micro_batch to at least {ranks} (rows per step = micro-batch × ranks) or use fewer devices"
        )));
    }
    let mut shards = Vec::with_capacity(ranks);
    let mut start = 0;
    for r in 0..ranks {
        let len = rows / ranks + usize::from(r < rows % ranks);
        shards.push(batch.narrow(start, len)?);
        start += len;
    }
    Ok(shards)
}

/// What one rank computed on its shard.
#[derive(Debug, Clone)]
pub struct ShardResult {
    /// Sum of the shard's token losses.
    pub loss_sum: f64,
    /// Tokens the loss covered (labels != -100 after the shift).
    pub num_tokens: usize,
    /// Gradients of `loss_sum` (not of a mean).
    pub grads: Gradients,
}

/// A model one rank can run on a shard (implemented for [`CausalLm`]; tests
/// can implement it for toy models).
pub trait ShardModel {
    /// Loss sum, token count and gradients of the loss sum on `shard`.
    fn loss_and_grads(&self, shard: &DeviceBatch) -> Result<ShardResult, DevicesError>;
}

impl ShardModel for CausalLm {
    fn loss_and_grads(&self, shard: &DeviceBatch) -> Result<ShardResult, DevicesError> {
        let out = self.loss(
            &shard.input_ids,
            shard.attention_mask.as_ref(),
            &shard.labels,
        )?;
        let loss_sum = out
            .sum
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?;
        let grads = self.backward(&out.sum)?;
        Ok(ShardResult {
            loss_sum,
            num_tokens: out.num_tokens,
            grads,
        })
    }
}

/// Sums gradients across ranks.
pub trait GradientReducer {
    /// Returns, for each device in `outputs`, the sum of every rank's
    /// gradients on that device (each replica's optimizer then applies the
    /// same update).
    fn all_reduce_sum(
        &self,
        per_rank: Vec<Gradients>,
        outputs: &[Device],
    ) -> Result<Vec<Gradients>, DevicesError>;

    /// Sharded data parallel's reduce-scatter: `per_rank[k]` holds rank k's gradients (whole,
    /// on its device); rank r's running sums `sums[r]` (its ranges, flat, on `outputs[r]`) gain
    /// the sum over the ranks of each tensor's range r. The host's: tensor by tensor, through
    /// each receiving rank's device ([`shards::host_reduce_scatter_into`]). A reducer that
    /// drives only some of the layout's ranks (a launched process: its own; NCCL: its
    /// communicators') takes and fills theirs, in rank order.
    fn reduce_scatter_into(
        &self,
        per_rank: Vec<Gradients>,
        layout: &shards::ShardLayout,
        outputs: &[Device],
        sums: &mut [Gradients],
    ) -> Result<(), DevicesError> {
        shards::host_reduce_scatter_into(per_rank, layout, outputs, sums)
    }

    /// Sharded data parallel's all-gather of one tensor: `parts[i]` is the i-th local rank's
    /// range of `t` (flat, on its device; `None` when empty); returns the whole tensor, in
    /// `dtype`, on each local rank's home (`homes[i]`).
    fn all_gather(
        &self,
        t: &shards::TensorShards,
        parts: &[Option<&Tensor>],
        dtype: candle_core::DType,
        homes: &[Home],
    ) -> Result<Vec<Tensor>, DevicesError> {
        let _ = dtype;
        homes
            .iter()
            .map(|home| {
                // What a rank receives is its own, for the per-rank memory accounting.
                let _rank = crate::mem::ranks::RankGuard::enter(home.index);
                shards::host_all_gather(parts, &t.dims, home)
            })
            .collect()
    }

    /// Whether one rank's gradient can be reduce-scattered alone, as the backward produces it
    /// (the host's adds can; a collective such as NCCL's needs every rank's at once).
    fn scatters_each_contribution(&self) -> bool {
        true
    }

    /// A short name for reports ("host", "nccl").
    fn name(&self) -> &'static str;
}

/// Sums on the first rank's device, then copies the sum to each output device.
/// Works for any devices; on CPU logical devices the copies are free.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostReducer;

impl GradientReducer for HostReducer {
    fn all_reduce_sum(
        &self,
        per_rank: Vec<Gradients>,
        outputs: &[Device],
    ) -> Result<Vec<Gradients>, DevicesError> {
        let homes: Vec<Home> = outputs
            .iter()
            .enumerate()
            .map(|(index, device)| Home {
                index,
                device: device.clone(),
            })
            .collect();
        let Some(rank0) = homes.first() else {
            return Ok(per_rank);
        };
        // Rank r's gradients are rank r's: each moves to rank 0 explicitly before the sum
        // (the placement rule refuses the add otherwise, on logical CPU devices too).
        let mut sums: Vec<(String, Placed)> = Vec::new();
        let mut position: std::collections::HashMap<String, usize> =
            std::collections::HashMap::new();
        // The sums are rank 0's (they become its output), each copy its receiver's.
        crate::mem::ranks::on_rank(0, || -> Result<(), DevicesError> {
            for (rank, grads) in per_rank.into_iter().enumerate() {
                for (name, g) in grads.into_pairs() {
                    let g = Placed::new(g, rank).to(rank0)?;
                    match position.get(&name) {
                        Some(&i) => {
                            let sum: &mut Placed = &mut sums[i].1;
                            *sum = sum.add(&g, "the data-parallel gradient sum")?;
                        }
                        None => {
                            position.insert(name.clone(), sums.len());
                            sums.push((name, g));
                        }
                    }
                }
            }
            Ok(())
        })?;
        let mut out = Vec::with_capacity(homes.len());
        for home in &homes {
            let copy = crate::mem::ranks::on_rank(home.index, || -> Result<_, DevicesError> {
                let mut copy = Gradients::new();
                for (name, g) in &sums {
                    copy.insert(name, g.to(home)?.into_tensor());
                }
                Ok(copy)
            })?;
            out.push(copy);
        }
        Ok(out)
    }

    fn name(&self) -> &'static str {
        "host"
    }
}

/// How a data-parallel run sums its gradients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReducerChoice {
    /// NCCL all-reduce: every rank a distinct GPU, in a build with the `nccl` feature.
    Nccl,
    /// Through rank 0's device ([`HostReducer`]), and why NCCL is not used.
    Host {
        /// Why (for the run's log).
        reason: String,
    },
}

/// Chooses the reducer for ranks on `labels` (`[devices]` entries, `=SIZE` suffixes
/// allowed). NCCL refuses two ranks on one GPU (`ncclCommInitAll` with a repeated device
/// fails with `ncclInvalidUsage`), so ranks that share a GPU (two streams of `cuda:0`, the
/// device check's miniature of two GPUs) are summed by the host reducer, whose staging
/// through rank 0 is a copy inside that GPU.
pub fn choose_reducer(labels: &[String], nccl_built: bool) -> ReducerChoice {
    let host = |reason: String| ReducerChoice::Host { reason };
    let mut ordinals = Vec::with_capacity(labels.len());
    for label in labels {
        let name = label.split('=').next().unwrap_or(label).trim();
        match name.split_once(':') {
            // "cuda:0#1" is the second logical device (stream) of GPU 0.
            Some(("cuda", n)) => ordinals.push(n.split('#').next().unwrap_or(n).to_string()),
            _ if name == "cuda" => ordinals.push("0".to_string()),
            _ => return host(format!("{name} is not a GPU")),
        }
    }
    if let Some(shared) = ordinals
        .iter()
        .enumerate()
        .find_map(|(i, o)| ordinals[..i].contains(o).then_some(o))
    {
        return host(format!(
            "two ranks share cuda:{shared}, and NCCL needs one GPU per rank"
        ));
    }
    if !nccl_built {
        return host("this build has no NCCL (build with `--features nccl`)".to_string());
    }
    ReducerChoice::Nccl
}

/// Per-rank figures of a data-parallel step.
#[derive(Debug, Clone, PartialEq)]
pub struct RankStats {
    /// The rank.
    pub rank: usize,
    /// Its device label.
    pub device: String,
    /// Batch rows it processed.
    pub rows: usize,
    /// Tokens its loss covered.
    pub num_tokens: usize,
    /// Its loss sum.
    pub loss_sum: f64,
}

/// The result of a data-parallel step.
#[derive(Debug, Clone)]
pub struct DataParallelOutput {
    /// Sum of every rank's loss sum.
    pub loss_sum: f64,
    /// Tokens over all ranks.
    pub num_tokens: usize,
    /// Per replica (one entry when a single model served every rank): the
    /// all-reduced gradients of the summed loss, already normalised by
    /// `num_tokens` (the gradient of the mean token loss over the whole batch).
    pub grads: Vec<Gradients>,
    /// What each rank did.
    pub per_rank: Vec<RankStats>,
}

impl DataParallelOutput {
    /// The mean token loss over the whole batch.
    pub fn mean_loss(&self) -> f64 {
        if self.num_tokens == 0 {
            0.0
        } else {
            self.loss_sum / self.num_tokens as f64
        }
    }
}

/// Runs one data-parallel forward + backward: the batch is split over
/// `devices` (one rank each), rank r runs on `replicas[r]` — or every rank on
/// `replicas[0]` when a single model is given (CPU logical devices share one
/// model and run one after another) — and the gradients are all-reduced by
/// `reducer` and divided by the total token count.
///
/// Ranks on distinct GPUs run concurrently (one thread each); CPU ranks run
/// in turn since they share the same cores.
pub fn data_parallel_step<M: ShardModel + Sync>(
    replicas: &[&M],
    devices: &[LogicalDevice],
    batch: &DeviceBatch,
    reducer: &dyn GradientReducer,
) -> Result<DataParallelOutput, DevicesError> {
    if replicas.is_empty() {
        return Err(DevicesError::Input("data parallel needs a model".into()));
    }
    if replicas.len() != 1 && replicas.len() != devices.len() {
        return Err(DevicesError::Input(format!(
            "data parallel got {} model replicas for {} devices: give one replica per device, or one shared model",
            replicas.len(),
            devices.len()
        )));
    }
    let shards = split_batch(batch, devices.len())?;
    let shared = replicas.len() == 1;
    // Each shard goes to the device of the replica that runs it.
    let rank_device = |r: usize| -> &Device {
        if shared {
            &devices[0].candle
        } else {
            &devices[r].candle
        }
    };
    let parallel = !shared && devices.iter().all(|d| d.is_cuda());
    let mut results: Vec<Result<ShardResult, DevicesError>> = if parallel {
        std::thread::scope(|scope| {
            let handles: Vec<_> = shards
                .iter()
                .enumerate()
                .map(|(r, shard)| {
                    let model = replicas[r];
                    let device = rank_device(r).clone();
                    scope.spawn(move || model.loss_and_grads(&shard.to_device(&device)?))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(DevicesError::Input("a data-parallel rank panicked".into()))
                    })
                })
                .collect()
        })
    } else {
        shards
            .iter()
            .enumerate()
            .map(|(r, shard)| {
                let model = replicas[if shared { 0 } else { r }];
                model.loss_and_grads(&shard.to_device(rank_device(r))?)
            })
            .collect()
    };
    let mut per_rank = Vec::with_capacity(devices.len());
    let mut grads = Vec::with_capacity(devices.len());
    let mut loss_sum = 0.0;
    let mut num_tokens = 0;
    for (r, result) in results.drain(..).enumerate() {
        let result = result?;
        per_rank.push(RankStats {
            rank: r,
            device: devices[r].label.clone(),
            rows: shards[r].rows()?,
            num_tokens: result.num_tokens,
            loss_sum: result.loss_sum,
        });
        loss_sum += result.loss_sum;
        num_tokens += result.num_tokens;
        grads.push(result.grads);
    }
    let outputs: Vec<Device> = if shared {
        vec![devices[0].candle.clone()]
    } else {
        devices.iter().map(|d| d.candle.clone()).collect()
    };
    let mut reduced = reducer.all_reduce_sum(grads, &outputs)?;
    if num_tokens > 0 {
        let scale = 1.0 / num_tokens as f64;
        for g in &mut reduced {
            g.scale(scale)?;
        }
    }
    Ok(DataParallelOutput {
        loss_sum,
        num_tokens,
        grads: reduced,
        per_rank,
    })
}

#[cfg(feature = "nccl")]
pub mod nccl;
pub mod process_group;
pub mod shards;

#[cfg(test)]
mod tests;
