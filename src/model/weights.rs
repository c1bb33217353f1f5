//! Memory-mapped safetensors checkpoints (single file or sharded), read tensor by tensor
//! with shape checks and dtype conversion.

use super::error::ModelError;
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype as StDtype, Metadata};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

struct MappedFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    /// Byte offset of the data section (8-byte length + JSON header).
    data_start: usize,
    metadata: Metadata,
}

/// One or more memory-mapped safetensors files seen as one name → tensor table.
pub struct Checkpoint {
    files: Vec<MappedFile>,
    routing: HashMap<String, usize>,
}

/// The candle dtype of a safetensors dtype, when candle can hold it.
fn candle_dtype(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::F16 => DType::F16,
        StDtype::BF16 => DType::BF16,
        StDtype::F64 => DType::F64,
        StDtype::U8 => DType::U8,
        StDtype::U32 => DType::U32,
        StDtype::I64 => DType::I64,
        _ => return None,
    })
}

impl Checkpoint {
    /// Maps every file and reads their headers (no tensor data is read yet).
    pub fn open(paths: &[PathBuf]) -> Result<Self, ModelError> {
        let mut files = Vec::new();
        let mut routing = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
            // SAFETY: the mapping is read-only; a checkpoint modified on disk while it is
            // mapped is outside what any safetensors reader can guard against.
            let mmap = unsafe { memmap2::MmapOptions::new().map(&file) }
                .map_err(|e| ModelError::io(path, e))?;
            let (n, metadata) = safetensors::SafeTensors::read_metadata(&mmap).map_err(|e| {
                ModelError::Safetensors {
                    path: path.clone(),
                    message: e.to_string(),
                }
            })?;
            for name in metadata.tensors().keys() {
                routing.insert(name.clone(), i);
            }
            files.push(MappedFile {
                path: path.clone(),
                mmap,
                data_start: 8 + n,
                metadata,
            });
        }
        Ok(Self { files, routing })
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.routing.contains_key(name)
    }

    /// Every tensor name.
    pub fn names(&self) -> Vec<String> {
        self.routing.keys().cloned().collect()
    }

    fn describe(&self) -> String {
        match self.files.as_slice() {
            [one] => one.path.display().to_string(),
            many => format!(
                "{} (and {} more shard(s))",
                many.first()
                    .map(|f| f.path.display().to_string())
                    .unwrap_or_default(),
                many.len().saturating_sub(1)
            ),
        }
    }

    /// The stored shape of `name`.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let f = &self.files[*self.routing.get(name)?];
        f.metadata.info(name).map(|i| i.shape.clone())
    }

    /// Loads `name`, checks it has `expected` shape (when given) and converts it to `dtype`.
    pub fn load(
        &self,
        name: &str,
        expected: Option<&[usize]>,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, ModelError> {
        let Some(&idx) = self.routing.get(name) else {
            return Err(ModelError::MissingTensor {
                name: name.to_string(),
                file: self.describe(),
            });
        };
        let f = &self.files[idx];
        let file = f.path.display().to_string();
        let info = f
            .metadata
            .info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                file: file.clone(),
            })?;
        if let Some(exp) = expected {
            if info.shape.as_slice() != exp {
                return Err(ModelError::ShapeMismatch {
                    name: name.to_string(),
                    file,
                    expected: exp.to_vec(),
                    found: info.shape.clone(),
                });
            }
        }
        let src_dtype = candle_dtype(info.dtype)
            .filter(|d| d.is_float())
            .ok_or_else(|| ModelError::UnsupportedDtype {
                name: name.to_string(),
                file: file.clone(),
                dtype: format!("{:?}", info.dtype),
            })?;
        let (start, end) = info.data_offsets;
        let bytes = f
            .mmap
            .get(f.data_start + start..f.data_start + end)
            .ok_or_else(|| ModelError::Safetensors {
                path: f.path.clone(),
                message: format!("tensor `{name}` points past the end of the file"),
            })?;
        let t = Tensor::from_raw_buffer(bytes, src_dtype, &info.shape, &Device::Cpu)?;
        let t = if src_dtype == dtype {
            t
        } else {
            t.to_dtype(dtype)?
        };
        Ok(t.to_device(device)?)
    }
}

impl Checkpoint {
    /// Drops the pages of `name` from this process's memory once its data was copied out.
    /// A read-only file mapping keeps every page it touched resident and counted in the
    /// process's RSS; a streaming reader (the GGUF export) releases each tensor after use,
    /// so its peak stays one tensor, not the whole checkpoint (measured: a q4_k_m export of
    /// a 135M model, 514 MB of f32 weights, peaked at 731 MB RSS without this, 251 MB with
    /// it). Best effort: the pages
    /// are clean, and a later read maps them in again from the file.
    pub fn release(&self, name: &str) {
        let Some(&idx) = self.routing.get(name) else {
            return;
        };
        let f = &self.files[idx];
        let Some(info) = f.metadata.info(name) else {
            return;
        };
        let (start, end) = info.data_offsets;
        #[cfg(unix)]
        // SAFETY: MADV_DONTNEED on a private read-only file mapping discards clean pages;
        // a later access reads them from the file again. No reference into this range is
        // held: `load` copied the bytes into a tensor of its own.
        unsafe {
            let _ = f.mmap.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                f.data_start + start,
                end - start,
            );
        }
        #[cfg(not(unix))]
        let _ = (start, end);
    }
}

/// The file name of a checkpoint's first weight file (for messages).
pub fn display_files(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Writes `tensors` (name, tensor) to one safetensors file with `{"format": "pt"}`
/// metadata (transformers checks it), converting each to `dtype` on the way.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    dtype: DType,
) -> Result<(), ModelError> {
    let mut buffers: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors {
        let shape = t.dims().to_vec();
        let t = t
            .to_device(&Device::Cpu)?
            .to_dtype(dtype)?
            .contiguous()?
            .flatten_all()?;
        let (st, bytes) = match dtype {
            DType::F32 => (StDtype::F32, bytes_of(&t.to_vec1::<f32>()?)),
            DType::BF16 => (StDtype::BF16, bytes_of(&t.to_vec1::<half::bf16>()?)),
            DType::F16 => (StDtype::F16, bytes_of(&t.to_vec1::<half::f16>()?)),
            other => {
                return Err(ModelError::Input(format!(
                    "cannot save tensors as {other:?}; choose f32, bf16 or f16"
                )))
            }
        };
        buffers.push((name.clone(), st, shape, bytes));
    }
    let mut views = Vec::new();
    for (name, st, shape, bytes) in &buffers {
        let view =
            safetensors::tensor::TensorView::new(*st, shape.clone(), bytes).map_err(|e| {
                ModelError::Safetensors {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                }
            })?;
        views.push((name.clone(), view));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(metadata), path).map_err(|e| {
        ModelError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    })
}

/// Little-endian bytes of a slice of plain numbers.
fn bytes_of<T: Copy + ToLeBytes>(v: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(std::mem::size_of_val(v));
    for x in v {
        x.extend_le(&mut out);
    }
    out
}

trait ToLeBytes {
    fn extend_le(&self, out: &mut Vec<u8>);
}
impl ToLeBytes for f32 {
    fn extend_le(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}
impl ToLeBytes for half::bf16 {
    fn extend_le(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}
impl ToLeBytes for half::f16 {
    fn extend_le(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}
