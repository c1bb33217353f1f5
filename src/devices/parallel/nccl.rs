//! NCCL all-reduce of gradients on CUDA devices (feature `nccl`): within one process or across
//! processes and machines (docs/multi-node.md).

use super::shards::{pack_slots, pad_to_slot, slot_elems, unpack_slots, ShardLayout, TensorShards};
use super::{GradientReducer, LogicalDevice};
use crate::devices::DevicesError;
use crate::model::{Gradients, Home};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{group_end, group_start, Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

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
    /// Locked for every launch: NCCL forbids concurrent calls on a communicator, and sharded
    /// data parallel's layer-by-layer reduce-scatter launches from whichever rank's thread
    /// finishes a layer last (`train::step::layer_stream`).
    comms: std::sync::Mutex<Vec<Comm>>,
    /// The global rank of the first communicator (0 in one process; a launched rank's own).
    first_rank: usize,
}

// SAFETY: a `Comm` is a handle NCCL lets any thread use, one call at a time; every use of
// these goes through the mutex, so no two threads call into one communicator at once.
unsafe impl Send for NcclReducer {}
// SAFETY: as above.
unsafe impl Sync for NcclReducer {}

fn cuda_stream(
    device: &LogicalDevice,
) -> Result<std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>, DevicesError> {
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
        Ok(NcclReducer {
            comms: std::sync::Mutex::new(comms),
            first_rank: 0,
        })
    }

    /// Rank `rank` of a `world_size`-rank job spanning processes or
    /// machines (`ncclCommInitRank`); every rank passes the same `id`.
    pub fn from_rank(
        device: &LogicalDevice,
        rank: usize,
        world_size: usize,
        id: NcclId,
    ) -> Result<Self, DevicesError> {
        let comm =
            Comm::from_rank(cuda_stream(device)?, rank, world_size, id.to_id()).map_err(|e| {
                DevicesError::Nccl {
                    operation: "ncclCommInitRank",
                    reason: format!("{e:?}"),
                }
            })?;
        Ok(NcclReducer {
            comms: std::sync::Mutex::new(vec![comm]),
            first_rank: rank,
        })
    }
}

/// The NCCL collectives the reducer runs, each as a candle op so its result is an ordinary
/// tensor on the same device and stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Collective {
    /// `ncclAllReduce(sum)`: n elements in, n out.
    AllReduce,
    /// `ncclReduceScatter(sum)`: a slot per rank in, this rank's slot (summed) out.
    ReduceScatter,
    /// `ncclAllGather`: this rank's slot in, every rank's slot out.
    AllGather,
}

impl Collective {
    fn operation(self) -> &'static str {
        match self {
            Collective::AllReduce => "ncclAllReduce",
            Collective::ReduceScatter => "ncclReduceScatter",
            Collective::AllGather => "ncclAllGather",
        }
    }

    /// Elements out for `n` in over `ranks` ranks.
    fn out_elems(self, n: usize, ranks: usize) -> usize {
        match self {
            Collective::AllReduce => n,
            Collective::ReduceScatter => n / ranks.max(1),
            Collective::AllGather => n * ranks,
        }
    }
}

struct CollectiveOp<'a> {
    comm: &'a Comm,
    collective: Collective,
}

// SAFETY: the op is applied synchronously on the thread that holds the reducer's lock;
// candle requires the bounds but never sends the op away.
unsafe impl Send for CollectiveOp<'_> {}
// SAFETY: as above; the communicator is never used from two threads at once.
unsafe impl Sync for CollectiveOp<'_> {}

/// NCCL's error with its value kept, so an allocation failure inside NCCL is recognised
/// by kind (`mem::alloc_failure`).
fn nccl_err(
    operation: &'static str,
) -> impl Fn(candle_core::cuda_backend::cudarc::nccl::result::NcclError) -> candle_core::Error {
    move |e| {
        candle_core::Error::Cuda(Box::new(crate::mem::alloc_failure::DeviceCallError {
            api: crate::mem::alloc_failure::FailedApi::Nccl,
            operation,
            code: e.0 as i64,
        }))
    }
}

impl CustomOp1 for CollectiveOp<'_> {
    fn name(&self) -> &'static str {
        self.collective.operation()
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("{} runs on CUDA tensors only", self.collective.operation())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("{} needs a contiguous tensor", self.collective.operation())
        };
        let ranks = self.comm.world_size();
        let n = end - start;
        if self.collective == Collective::ReduceScatter && n % ranks.max(1) != 0 {
            candle_core::bail!(
                "ncclReduceScatter needs a slot per rank: {n} elements over {ranks} ranks"
            )
        }
        let out = self.collective.out_elems(n, ranks);
        let dev = s.device().clone();
        let err = nccl_err(self.collective.operation());
        macro_rules! launch {
            ($t:ty) => {{
                let src = s.as_cuda_slice::<$t>()?.slice(start..end);
                // SAFETY: every element is written by the collective before use.
                let mut dst = unsafe { dev.alloc::<$t>(out)? };
                match self.collective {
                    Collective::AllReduce => self
                        .comm
                        .all_reduce(&src, &mut dst, &ReduceOp::Sum)
                        .map_err(&err)?,
                    Collective::ReduceScatter => self
                        .comm
                        .reduce_scatter(&src, &mut dst, &ReduceOp::Sum)
                        .map_err(&err)?,
                    Collective::AllGather => self.comm.all_gather(&src, &mut dst).map_err(&err)?,
                };
                CudaStorage::wrap_cuda_slice(dst, dev)
            }};
        }
        let storage = match s.dtype() {
            DType::F32 => launch!(f32),
            DType::BF16 => launch!(half::bf16),
            DType::F16 => launch!(half::f16),
            DType::F64 => launch!(f64),
            other => {
                candle_core::bail!(
                    "{} of {other:?} tensors is not supported",
                    self.collective.operation()
                )
            }
        };
        Ok((storage, Shape::from(out)))
    }
}

impl NcclReducer {
    /// Runs `collective` on `inputs` (one per local rank, in rank order, each on its rank's
    /// GPU) as one NCCL group: one thread drives every communicator, so the calls must be
    /// launched together or NCCL deadlocks. Returns each rank's flat output.
    fn grouped(
        &self,
        collective: Collective,
        inputs: &[Tensor],
    ) -> Result<Vec<Tensor>, DevicesError> {
        let comms = self
            .comms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if inputs.len() != comms.len() {
            return Err(DevicesError::Input(format!(
                "{} over {} local ranks got {} tensors",
                collective.operation(),
                comms.len(),
                inputs.len()
            )));
        }
        let group = |operation: &'static str, result: Result<_, _>| {
            result.map_err(|e| DevicesError::Nccl {
                operation,
                reason: format!("{e:?}"),
            })
        };
        group("ncclGroupStart", group_start())?;
        let out: Vec<candle_core::Result<Tensor>> = inputs
            .iter()
            .zip(comms.iter())
            .map(|(t, comm)| {
                t.contiguous()?
                    .flatten_all()?
                    .apply_op1_no_bwd(&CollectiveOp { comm, collective })
            })
            .collect();
        group("ncclGroupEnd", group_end())?;
        out.into_iter()
            .map(|t| t.map_err(DevicesError::from))
            .collect()
    }

    fn comm_count(&self) -> usize {
        self.comms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

impl GradientReducer for NcclReducer {
    fn all_reduce_sum(
        &self,
        per_rank: Vec<Gradients>,
        outputs: &[Device],
    ) -> Result<Vec<Gradients>, DevicesError> {
        let ranks = self.comm_count();
        if per_rank.len() != ranks || outputs.len() != ranks {
            return Err(DevicesError::Input(format!(
                "NCCL reducer has {ranks} local ranks but got {} gradient sets for {} outputs",
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
                    g.remove(name).ok_or_else(|| {
                        DevicesError::Input(format!("rank is missing the gradient of {name}"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let dims = inputs[0].dims().to_vec();
            let reduced = self.grouped(Collective::AllReduce, &inputs)?;
            drop(inputs);
            for (slot, t) in out.iter_mut().zip(reduced) {
                slot.insert(name, t.reshape(dims.as_slice())?);
            }
        }
        Ok(out)
    }

    /// `ncclReduceScatter` tensor by tensor: each rank's whole gradient packed into equal
    /// slots (its ranges are uneven by one element), a missing one as zeros (every rank takes
    /// part in a collective), and each rank's summed slot cut to its range and added into its
    /// running sum.
    fn reduce_scatter_into(
        &self,
        mut per_rank: Vec<Gradients>,
        layout: &ShardLayout,
        outputs: &[Device],
        sums: &mut [Gradients],
    ) -> Result<(), DevicesError> {
        let ranks = self.comm_count();
        let world = layout.ranks();
        if per_rank.len() != ranks || outputs.len() != ranks || sums.len() != ranks {
            return Err(DevicesError::Input(format!(
                "an NCCL reduce-scatter over {ranks} local ranks got gradients of {} ranks, {} \
                 devices and {} sums",
                per_rank.len(),
                outputs.len(),
                sums.len()
            )));
        }
        for t in layout.tensors() {
            let slot = slot_elems(t);
            let whole: Vec<Option<Tensor>> =
                per_rank.iter_mut().map(|g| g.remove(&t.name)).collect();
            let Some(dtype) = whole.iter().flatten().map(Tensor::dtype).next() else {
                continue;
            };
            if slot == 0 {
                continue;
            }
            let send = whole
                .iter()
                .zip(outputs)
                .map(|(g, device)| match g {
                    Some(g) => pack_slots(g, t),
                    None => Ok(Tensor::zeros(slot * world, dtype, device)?),
                })
                .collect::<Result<Vec<_>, _>>()?;
            drop(whole);
            let received = self.grouped(Collective::ReduceScatter, &send)?;
            drop(send);
            for (r, got) in received.into_iter().enumerate() {
                let len = t.ranges[self.first_rank + r].len();
                if len == 0 {
                    continue;
                }
                // A range shorter than its slot is copied out, so the slot is freed.
                let mine = if len < slot {
                    got.narrow(0, 0, len)?.force_contiguous()?
                } else {
                    got
                };
                sums[r].add(&t.name, mine)?;
            }
        }
        Ok(())
    }

    /// `ncclAllGather` of one tensor: each rank's range padded to a slot (moved to its GPU
    /// first: an offloaded master's rounded range is in host RAM), the slots joined on every
    /// rank and unpacked into the whole tensor.
    fn all_gather(
        &self,
        t: &TensorShards,
        parts: &[Option<&Tensor>],
        dtype: DType,
        homes: &[Home],
    ) -> Result<Vec<Tensor>, DevicesError> {
        let ranks = self.comm_count();
        if parts.len() != ranks || homes.len() != ranks {
            return Err(DevicesError::Input(format!(
                "an NCCL all-gather of `{}` over {ranks} ranks got {} parts for {} ranks",
                t.name,
                parts.len(),
                homes.len()
            )));
        }
        let send = parts
            .iter()
            .zip(homes)
            .map(|(part, home)| {
                let moved = part
                    .map(|p| p.to_device(&home.device)?.to_dtype(dtype))
                    .transpose()?;
                pad_to_slot(moved.as_ref(), t, dtype, &home.device)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let gathered = self.grouped(Collective::AllGather, &send)?;
        drop(send);
        gathered.iter().map(|g| unpack_slots(g, t)).collect()
    }

    /// NCCL's collectives need every rank's tensor at once.
    fn scatters_each_contribution(&self) -> bool {
        false
    }

    fn name(&self) -> &'static str {
        "nccl"
    }
}
