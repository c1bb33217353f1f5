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
//! (docs/multi-node.md).

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
        let mut out = Vec::with_capacity(homes.len());
        for home in &homes {
            let mut copy = Gradients::new();
            for (name, g) in &sums {
                copy.insert(name, g.to(home)?.into_tensor());
            }
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

/// NCCL all-reduce of gradients on CUDA devices.
#[cfg(feature = "nccl")]
pub mod nccl {
    use super::{GradientReducer, LogicalDevice};
    use crate::devices::DevicesError;
    use crate::model::Gradients;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::nccl::safe::{
        group_end, group_start, Comm, Id, ReduceOp,
    };
    use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape};

    /// Environment variable carrying the NCCL unique id (hex) to every rank of
    /// a multi-process job (see docs/multi-node.md).
    pub const NCCL_ID_ENV: &str = "TUNESTUDIO_NCCL_ID";

    /// NCCL's 128-byte bootstrap id: made once by rank 0 (`ncclGetUniqueId`),
    /// handed to every other rank by the launcher.
    #[derive(Clone, Copy)]
    pub struct NcclId(pub [u8; 128]);

    impl NcclId {
        /// A fresh id (`ncclGetUniqueId`; rank 0 only).
        pub fn new() -> Result<Self, DevicesError> {
            let id = Id::new().map_err(|e| DevicesError::Nccl {
                operation: "ncclGetUniqueId",
                reason: format!("{e:?}"),
            })?;
            let mut bytes = [0u8; 128];
            for (b, c) in bytes.iter_mut().zip(id.internal().iter()) {
                *b = *c as u8;
            }
            Ok(NcclId(bytes))
        }

        /// As 256 hex digits (for an environment variable or a file).
        pub fn to_hex(&self) -> String {
            self.0.iter().map(|b| format!("{b:02x}")).collect()
        }

        /// Parses [`NcclId::to_hex`]'s output.
        pub fn from_hex(text: &str) -> Result<Self, DevicesError> {
            let text = text.trim();
            if text.len() != 256 {
                return Err(DevicesError::Input(format!(
                    "an NCCL id is 256 hex digits, got {} characters; pass rank 0's `{NCCL_ID_ENV}` unchanged",
                    text.len()
                )));
            }
            let mut bytes = [0u8; 128];
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
                    .map_err(|_| DevicesError::Input(format!("`{NCCL_ID_ENV}` is not hex")))?;
            }
            Ok(NcclId(bytes))
        }

        fn to_id(self) -> Id {
            let mut internal = [0 as std::ffi::c_char; 128];
            for (c, b) in internal.iter_mut().zip(self.0.iter()) {
                *c = *b as std::ffi::c_char;
            }
            Id::uninit(internal)
        }
    }

    /// NCCL communicators for the ranks this process drives, in rank order.
    pub struct NcclReducer {
        comms: Vec<Comm>,
    }

    fn cuda_stream(
        device: &LogicalDevice,
    ) -> Result<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>, DevicesError>
    {
        match &device.candle {
            Device::Cuda(cuda) => Ok(cuda.cuda_stream()),
            _ => Err(DevicesError::Input(format!(
                "NCCL needs CUDA devices, {} is not one; use the host reducer on CPU",
                device.label
            ))),
        }
    }

    impl NcclReducer {
        /// One process driving every GPU in `devices` (`ncclCommInitAll`).
        /// The GPUs must be distinct: NCCL refuses two ranks on one GPU.
        pub fn single_process(devices: &[LogicalDevice]) -> Result<Self, DevicesError> {
            let streams = devices
                .iter()
                .map(cuda_stream)
                .collect::<Result<Vec<_>, _>>()?;
            let comms = Comm::from_devices(streams).map_err(|e| DevicesError::Nccl {
                operation: "ncclCommInitAll",
                reason: format!("{e:?}"),
            })?;
            Ok(NcclReducer { comms })
        }

        /// Rank `rank` of a `world_size`-rank job spanning processes or
        /// machines (`ncclCommInitRank`); every rank passes the same `id`.
        pub fn from_rank(
            device: &LogicalDevice,
            rank: usize,
            world_size: usize,
            id: NcclId,
        ) -> Result<Self, DevicesError> {
            let comm = Comm::from_rank(cuda_stream(device)?, rank, world_size, id.to_id())
                .map_err(|e| DevicesError::Nccl {
                    operation: "ncclCommInitRank",
                    reason: format!("{e:?}"),
                })?;
            Ok(NcclReducer { comms: vec![comm] })
        }
    }

    /// `ncclAllReduce(sum)` as a candle op, so the result is an ordinary tensor
    /// on the same device and stream.
    struct AllReduceOp<'a> {
        comm: &'a Comm,
    }

    // SAFETY: the op is applied synchronously on the thread that owns the
    // communicator; candle requires the bounds but never sends the op away.
    unsafe impl Send for AllReduceOp<'_> {}
    // SAFETY: as above; the communicator is never used from two threads at once.
    unsafe impl Sync for AllReduceOp<'_> {}

    /// NCCL's error with its value kept, so an allocation failure inside NCCL is recognised
    /// by kind (`mem::alloc_failure`).
    fn nccl_err(
        e: candle_core::cuda_backend::cudarc::nccl::result::NcclError,
    ) -> candle_core::Error {
        candle_core::Error::Cuda(Box::new(crate::mem::alloc_failure::DeviceCallError {
            api: crate::mem::alloc_failure::FailedApi::Nccl,
            operation: "ncclAllReduce",
            code: e.0 as i64,
        }))
    }

    impl CustomOp1 for AllReduceOp<'_> {
        fn name(&self) -> &'static str {
            "nccl-all-reduce"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("NCCL all-reduce runs on CUDA tensors only")
        }

        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let Some((start, end)) = l.contiguous_offsets() else {
                candle_core::bail!("NCCL all-reduce needs a contiguous tensor")
            };
            let n = end - start;
            let dev = s.device().clone();
            macro_rules! reduce {
                ($t:ty) => {{
                    let src = s.as_cuda_slice::<$t>()?.slice(start..end);
                    // SAFETY: every element is written by the all-reduce before use.
                    let mut dst = unsafe { dev.alloc::<$t>(n)? };
                    self.comm
                        .all_reduce(&src, &mut dst, &ReduceOp::Sum)
                        .map_err(nccl_err)?;
                    CudaStorage::wrap_cuda_slice(dst, dev)
                }};
            }
            let out = match s.dtype() {
                DType::F32 => reduce!(f32),
                DType::BF16 => reduce!(half::bf16),
                DType::F16 => reduce!(half::f16),
                DType::F64 => reduce!(f64),
                other => {
                    candle_core::bail!("NCCL all-reduce of {other:?} gradients is not supported")
                }
            };
            Ok((out, l.shape().clone()))
        }
    }

    impl GradientReducer for NcclReducer {
        fn all_reduce_sum(
            &self,
            per_rank: Vec<Gradients>,
            outputs: &[Device],
        ) -> Result<Vec<Gradients>, DevicesError> {
            if per_rank.len() != self.comms.len() || outputs.len() != self.comms.len() {
                return Err(DevicesError::Input(format!(
                    "NCCL reducer has {} local ranks but got {} gradient sets for {} outputs",
                    self.comms.len(),
                    per_rank.len(),
                    outputs.len()
                )));
            }
            let names: Vec<String> = per_rank
                .first()
                .map(|g| g.names().map(str::to_string).collect())
                .unwrap_or_default();
            let mut out = vec![Gradients::new(); per_rank.len()];
            let mut per_rank = per_rank;
            for name in &names {
                // Each input is taken out of its set and dropped once its sum exists: one
                // tensor per rank is staged at a time, never the input and output sets whole.
                let inputs = per_rank
                    .iter_mut()
                    .map(|g| {
                        g.remove(name)
                            .ok_or_else(|| {
                                DevicesError::Input(format!(
                                    "rank is missing the gradient of {name}"
                                ))
                            })
                            .and_then(|t| Ok(t.contiguous()?))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                // One thread drives several communicators: group the calls so
                // NCCL launches them together instead of deadlocking.
                group_start().map_err(|e| DevicesError::Nccl {
                    operation: "ncclGroupStart",
                    reason: format!("{e:?}"),
                })?;
                let reduced: Vec<candle_core::Result<candle_core::Tensor>> = inputs
                    .iter()
                    .zip(&self.comms)
                    .map(|(t, comm)| t.apply_op1_no_bwd(&AllReduceOp { comm }))
                    .collect();
                group_end().map_err(|e| DevicesError::Nccl {
                    operation: "ncclGroupEnd",
                    reason: format!("{e:?}"),
                })?;
                drop(inputs);
                for (slot, t) in out.iter_mut().zip(reduced) {
                    slot.insert(name, t?);
                }
            }
            Ok(out)
        }

        fn name(&self) -> &'static str {
            "nccl"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn batch(rows: usize) -> DeviceBatch {
        let ids: Vec<u32> = (0..rows as u32 * 3).collect();
        DeviceBatch {
            input_ids: Tensor::from_vec(ids, (rows, 3), &Device::Cpu).unwrap(),
            attention_mask: None,
            labels: Tensor::zeros((rows, 3), DType::I64, &Device::Cpu).unwrap(),
        }
    }

    #[test]
    fn nccl_only_when_every_rank_is_its_own_gpu() {
        let labels = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            choose_reducer(&labels(&["cuda:0", "cuda:1=40GiB"]), true),
            ReducerChoice::Nccl
        );
        assert_ne!(
            choose_reducer(&labels(&["cuda:0", "cuda:0#1"]), true),
            ReducerChoice::Nccl
        );
        // The GPU check's two streams of one GPU: NCCL would refuse them.
        let ReducerChoice::Host { reason } = choose_reducer(&labels(&["cuda:0", "cuda:0"]), true)
        else {
            panic!("NCCL chosen for two ranks on one GPU");
        };
        assert!(reason.contains("share cuda:0"), "{reason}");
        assert!(matches!(
            choose_reducer(&labels(&["cpu:0", "cpu:1"]), true),
            ReducerChoice::Host { .. }
        ));
        assert!(matches!(
            choose_reducer(&labels(&["cuda:0", "cuda:1"]), false),
            ReducerChoice::Host { .. }
        ));
    }

    #[test]
    fn the_host_reducer_refuses_nothing_and_moves_each_rank_explicitly() {
        let mut a = Gradients::new();
        a.insert("w", Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap());
        let mut b = Gradients::new();
        b.insert("w", Tensor::new(&[10f32, 20.0], &Device::Cpu).unwrap());
        let out = HostReducer
            .all_reduce_sum(vec![a, b], &[Device::Cpu, Device::Cpu])
            .unwrap();
        for g in &out {
            assert_eq!(
                g.get("w").unwrap().to_vec1::<f32>().unwrap(),
                vec![11.0, 22.0]
            );
        }
    }

    #[test]
    fn shards_are_contiguous_and_cover_the_batch() {
        let b = batch(5);
        let shards = split_batch(&b, 2).unwrap();
        assert_eq!(shards[0].rows().unwrap(), 3);
        assert_eq!(shards[1].rows().unwrap(), 2);
        let first: Vec<u32> = shards[1]
            .input_ids
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(first[0], 9);
        assert!(split_batch(&b, 6).is_err());
        assert!(split_batch(&b, 0).is_err());
    }

    /// y = w · Σ ids over non-ignored tokens: the gradient of the loss sum is
    /// the token-id sum, so data parallel is checkable by hand.
    struct Toy {
        w: candle_core::Var,
    }

    impl ShardModel for Toy {
        fn loss_and_grads(&self, shard: &DeviceBatch) -> Result<ShardResult, DevicesError> {
            let x = shard.input_ids.to_dtype(DType::F32)?;
            let n = shard.input_ids.elem_count();
            let sum = x.sum_all()?.broadcast_mul(self.w.as_tensor())?.sum_all()?;
            let g = sum.backward()?;
            let mut grads = Gradients::new();
            if let Some(gw) = g.get(self.w.as_tensor()) {
                grads.insert("w", gw.clone());
            }
            Ok(ShardResult {
                loss_sum: sum.to_scalar::<f32>()? as f64,
                num_tokens: n,
                grads,
            })
        }
    }

    #[test]
    fn host_all_reduce_sums_then_normalises() {
        let toy = Toy {
            w: candle_core::Var::from_tensor(&Tensor::new(&[2f32], &Device::Cpu).unwrap()).unwrap(),
        };
        let b = batch(4);
        let devices = LogicalDevice::cpus(2);
        let out = data_parallel_step(&[&toy], &devices, &b, &HostReducer).unwrap();
        // ids 0..12 sum to 66, 12 tokens.
        assert_eq!(out.num_tokens, 12);
        assert!((out.loss_sum - 132.0).abs() < 1e-9);
        let g: Vec<f32> = out.grads[0].get("w").unwrap().to_vec1().unwrap();
        assert!((g[0] - 66.0 / 12.0).abs() < 1e-6, "{g:?}");
        assert_eq!(out.per_rank.len(), 2);
        assert_eq!(out.per_rank[1].rows, 2);
        // Two replicas (one per logical device) give the same sum on each.
        let out2 = data_parallel_step(&[&toy, &toy], &devices, &b, &HostReducer).unwrap();
        assert_eq!(out2.grads.len(), 2);
        let g2: Vec<f32> = out2.grads[1].get("w").unwrap().to_vec1().unwrap();
        assert_eq!(g, g2);
    }
}
