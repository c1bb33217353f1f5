//! NCCL all-reduce of gradients on CUDA devices (feature `nccl`): within one process or across
//! processes and machines (docs/multi-node.md).

use super::{GradientReducer, LogicalDevice};
use crate::devices::DevicesError;
use crate::model::Gradients;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::nccl::safe::{group_end, group_start, Comm, Id, ReduceOp};
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
        let comm =
            Comm::from_rank(cuda_stream(device)?, rank, world_size, id.to_id()).map_err(|e| {
                DevicesError::Nccl {
                    operation: "ncclCommInitRank",
                    reason: format!("{e:?}"),
                }
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
fn nccl_err(e: candle_core::cuda_backend::cudarc::nccl::result::NcclError) -> candle_core::Error {
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

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
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
                            DevicesError::Input(format!("rank is missing the gradient of {name}"))
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
