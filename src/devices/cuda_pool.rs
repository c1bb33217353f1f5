//! Exact CUDA memory of candle's tensors: cudarc allocates with
//! `cuMemAllocAsync` from the device's default memory pool (on every GPU that
//! supports it — all since Pascal with a recent driver), and the pool keeps a
//! high-water mark of the bytes in use. That peak is what the planner predicts
//! (minus the CUDA context and cuBLAS workspace, which are not pool memory).
//!
//! Without the `cuda` feature every function returns
//! [`DevicesError::DeviceUnavailable`].

use super::DevicesError;

#[cfg(feature = "cuda")]
mod imp {
    use super::DevicesError;
    use candle_core::cuda_backend::cudarc::driver::{result, sys};

    fn err(ordinal: usize, what: &str, e: impl std::fmt::Debug) -> DevicesError {
        DevicesError::DeviceUnavailable {
            device: format!("cuda:{ordinal}"),
            reason: format!("{what}: {e:?}"),
        }
    }

    fn pool(ordinal: usize) -> Result<sys::CUmemoryPool, DevicesError> {
        result::init().map_err(|e| err(ordinal, "cuInit", e))?;
        let dev =
            result::device::get(ordinal as i32).map_err(|e| err(ordinal, "cuDeviceGet", e))?;
        // SAFETY: `dev` comes from cuDeviceGet.
        unsafe { result::device::get_default_mem_pool(dev) }
            .map_err(|e| err(ordinal, "cuDeviceGetDefaultMemPool", e))
    }

    fn get(ordinal: usize, attr: sys::CUmemPool_attribute) -> Result<u64, DevicesError> {
        let pool = pool(ordinal)?;
        let mut value: u64 = 0;
        // SAFETY: the used/reserved attributes are cuuint64_t values.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(|e| err(ordinal, "cuMemPoolGetAttribute", e))?;
        Ok(value)
    }

    pub fn used_bytes(ordinal: usize) -> Result<u64, DevicesError> {
        get(
            ordinal,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        )
    }

    pub fn peak_used_bytes(ordinal: usize) -> Result<u64, DevicesError> {
        get(
            ordinal,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        )
    }

    pub fn reset_peak(ordinal: usize) -> Result<(), DevicesError> {
        let pool = pool(ordinal)?;
        // Setting the high-water mark to 0 resets it to the current usage.
        let mut zero: u64 = 0;
        // SAFETY: USED_MEM_HIGH takes a cuuint64_t that must be 0.
        unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| err(ordinal, "cuMemPoolSetAttribute", e))
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::DevicesError;

    fn unavailable(ordinal: usize) -> DevicesError {
        DevicesError::DeviceUnavailable {
            device: format!("cuda:{ordinal}"),
            reason: "this build has no CUDA support; build with `--features cuda` (scripts/build-cuda.sh)".into(),
        }
    }

    pub fn used_bytes(ordinal: usize) -> Result<u64, DevicesError> {
        Err(unavailable(ordinal))
    }

    pub fn peak_used_bytes(ordinal: usize) -> Result<u64, DevicesError> {
        Err(unavailable(ordinal))
    }

    pub fn reset_peak(ordinal: usize) -> Result<(), DevicesError> {
        Err(unavailable(ordinal))
    }
}

/// Bytes of pool memory in use on GPU `ordinal` (all of this process's candle tensors there).
pub fn used_bytes(ordinal: usize) -> Result<u64, DevicesError> {
    imp::used_bytes(ordinal)
}

/// Highest [`used_bytes`] since the last [`reset_peak`].
pub fn peak_used_bytes(ordinal: usize) -> Result<u64, DevicesError> {
    imp::peak_used_bytes(ordinal)
}

/// Restarts peak tracking from the current usage.
pub fn reset_peak(ordinal: usize) -> Result<(), DevicesError> {
    imp::reset_peak(ordinal)
}
