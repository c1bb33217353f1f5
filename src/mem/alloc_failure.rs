//! Out of memory recognised by error kind: the error *values* the CUDA driver, cuBLAS, NCCL
//! and the OS return for a failed allocation, not the words of their messages (cuBLAS says
//! `CUBLAS_STATUS_ALLOC_FAILED`, which no word list of "out of memory" catches).
//!
//! The codes are the C enums' values: `CUDA_ERROR_OUT_OF_MEMORY` = 2 (`cuda.h`),
//! `CUBLAS_STATUS_ALLOC_FAILED` = 3 (`cublas_api.h`), NCCL's `ncclUnhandledCudaError` = 1 (its
//! `cudaMalloc` failed) and `ncclSystemError` = 2 (its host allocation failed; `nccl.h`), and
//! `ENOMEM` = 12 on Linux.

use serde::{Deserialize, Serialize};

/// The API whose error value said an allocation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailedApi {
    /// The CUDA driver (`CUresult`).
    CudaDriver,
    /// cuBLAS (`cublasStatus_t`).
    Cublas,
    /// NCCL (`ncclResult_t`).
    Nccl,
    /// The operating system (`errno`).
    Os,
    /// The trainer's test switch (`TUNESTUDIO_INJECT_OOM`).
    Injected,
}

/// An allocation failure recognised from an error value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationFailure {
    /// Who reported it.
    pub api: FailedApi,
    /// The error value.
    pub code: i64,
}

/// A device library's call that failed, with its error value kept (NCCL's error type has
/// neither `Display` nor `Error`, so its value would otherwise survive only as text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCallError {
    /// The library.
    pub api: FailedApi,
    /// The call (`ncclAllReduce`).
    pub operation: &'static str,
    /// Its error value.
    pub code: i64,
}

impl std::fmt::Display for DeviceCallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed with error value {}",
            self.operation, self.code
        )
    }
}

impl std::error::Error for DeviceCallError {}

/// `CUresult::CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: i64 = 2;
/// `cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED`.
pub const CUBLAS_STATUS_ALLOC_FAILED: i64 = 3;
/// `ncclResult_t::ncclUnhandledCudaError` (a CUDA call inside NCCL failed: its buffers).
pub const NCCL_UNHANDLED_CUDA_ERROR: i64 = 1;
/// `ncclResult_t::ncclSystemError` (a system call inside NCCL failed: its host buffers).
pub const NCCL_SYSTEM_ERROR: i64 = 2;
/// `ENOMEM`.
pub const ENOMEM: i64 = 12;

/// `api`'s error value `code` as an allocation failure, when it is one.
pub fn classify(api: FailedApi, code: i64) -> Option<AllocationFailure> {
    let failed = match api {
        FailedApi::CudaDriver => code == CUDA_ERROR_OUT_OF_MEMORY,
        FailedApi::Cublas => code == CUBLAS_STATUS_ALLOC_FAILED,
        FailedApi::Nccl => code == NCCL_UNHANDLED_CUDA_ERROR || code == NCCL_SYSTEM_ERROR,
        FailedApi::Os => code == ENOMEM,
        FailedApi::Injected => true,
    };
    failed.then_some(AllocationFailure { api, code })
}

/// The allocation failure inside a candle error (through its context and backtrace wrappers).
pub fn from_candle(err: &candle_core::Error) -> Option<AllocationFailure> {
    use candle_core::Error as E;
    match err {
        E::WithBacktrace { inner, .. } | E::Context { inner, .. } | E::WithPath { inner, .. } => {
            from_candle(inner)
        }
        E::Io(io) => from_io(io),
        E::Cuda(inner) => from_error(inner.as_ref()),
        E::WrappedContext { wrapped, .. } => from_error(wrapped.as_ref()),
        _ => None,
    }
}

fn from_io(err: &std::io::Error) -> Option<AllocationFailure> {
    classify(FailedApi::Os, i64::from(err.raw_os_error()?))
}

/// The allocation failure anywhere in an error's chain of sources.
pub fn from_error(err: &(dyn std::error::Error + 'static)) -> Option<AllocationFailure> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(found) = from_one(e) {
            return Some(found);
        }
        next = e.source();
    }
    None
}

fn from_one(e: &(dyn std::error::Error + 'static)) -> Option<AllocationFailure> {
    if let Some(c) = e.downcast_ref::<candle_core::Error>() {
        return from_candle(c);
    }
    if let Some(io) = e.downcast_ref::<std::io::Error>() {
        return from_io(io);
    }
    if let Some(call) = e.downcast_ref::<DeviceCallError>() {
        return classify(call.api, call.code);
    }
    gpu_failure(e)
}

#[cfg(feature = "cuda")]
fn gpu_failure(e: &(dyn std::error::Error + 'static)) -> Option<AllocationFailure> {
    use candle_core::cuda_backend::cudarc;
    use candle_core::cuda_backend::CudaError;
    let driver = |d: &cudarc::driver::DriverError| classify(FailedApi::CudaDriver, d.0 as i64);
    let cublas = |c: &cudarc::cublas::result::CublasError| classify(FailedApi::Cublas, c.0 as i64);
    if let Some(c) = e.downcast_ref::<CudaError>() {
        return match c {
            CudaError::Cuda(d) => driver(d),
            CudaError::Load { cuda, .. } => driver(cuda),
            CudaError::Cublas(b) => cublas(b),
            _ => None,
        };
    }
    if let Some(d) = e.downcast_ref::<cudarc::driver::DriverError>() {
        return driver(d);
    }
    if let Some(b) = e.downcast_ref::<cudarc::cublas::result::CublasError>() {
        return cublas(b);
    }
    None
}

#[cfg(not(feature = "cuda"))]
fn gpu_failure(_e: &(dyn std::error::Error + 'static)) -> Option<AllocationFailure> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_apis_allocation_failure_is_recognised_by_its_value() {
        assert!(classify(FailedApi::CudaDriver, CUDA_ERROR_OUT_OF_MEMORY).is_some());
        // CUDA_ERROR_INVALID_VALUE (1) and CUDA_ERROR_ILLEGAL_ADDRESS (700) are not.
        assert!(classify(FailedApi::CudaDriver, 1).is_none());
        assert!(classify(FailedApi::CudaDriver, 700).is_none());
        assert!(classify(FailedApi::Cublas, CUBLAS_STATUS_ALLOC_FAILED).is_some());
        // CUBLAS_STATUS_NOT_INITIALIZED (1), CUBLAS_STATUS_EXECUTION_FAILED (13).
        assert!(classify(FailedApi::Cublas, 1).is_none());
        assert!(classify(FailedApi::Cublas, 13).is_none());
        assert!(classify(FailedApi::Nccl, NCCL_UNHANDLED_CUDA_ERROR).is_some());
        assert!(classify(FailedApi::Nccl, NCCL_SYSTEM_ERROR).is_some());
        // ncclInvalidArgument (4), ncclInvalidUsage (5: two ranks on one GPU).
        assert!(classify(FailedApi::Nccl, 4).is_none());
        assert!(classify(FailedApi::Nccl, 5).is_none());
        assert!(classify(FailedApi::Os, ENOMEM).is_some());
        assert!(classify(FailedApi::Os, 2).is_none());
    }

    #[test]
    fn a_wrapped_os_allocation_failure_is_found_and_its_words_are_not_needed() {
        let enomem = candle_core::Error::Io(std::io::Error::from_raw_os_error(12));
        let wrapped = enomem.context("loading a shard");
        assert_eq!(
            from_candle(&wrapped),
            Some(AllocationFailure {
                api: FailedApi::Os,
                code: 12
            })
        );
        // A message that merely says "out of memory" is not an error value.
        let words = candle_core::Error::Msg("out of memory".into());
        assert_eq!(from_candle(&words), None);
        let not_found = candle_core::Error::Io(std::io::Error::from_raw_os_error(2));
        assert_eq!(from_candle(&not_found), None);
        // NCCL's value, as the all-reduce op keeps it.
        let nccl = |code| {
            candle_core::Error::Cuda(Box::new(DeviceCallError {
                api: FailedApi::Nccl,
                operation: "ncclAllReduce",
                code,
            }))
        };
        assert!(from_candle(&nccl(NCCL_UNHANDLED_CUDA_ERROR)).is_some());
        assert!(from_candle(&nccl(5)).is_none());
    }
}
