//! The quantized base cached on disk as a GGUF file, so quantizing a large model is paid once.
//!
//! Where: `$TUNESTUDIO_QUANT_CACHE` when set (`off` disables the cache), otherwise
//! `$XDG_CACHE_HOME/tunestudio/quantized` or `~/.cache/tunestudio/quantized` — beside the
//! Hugging Face cache rather than inside a model folder, which may be read-only or a hub
//! snapshot. One file per model and quantization, named by a key over the model's files (each
//! weight file's and `config.json`'s path, size and modification time), the quantization and
//! this format's version: a changed checkpoint gets a new key, so a stale file is never read.
//!
//! The file is a GGUF (v2) holding the quantized tensors under their HF names, as
//! `candle_core::quantized::gguf_file` writes and reads them, plus the key in its metadata.
//! It is read through a memory map. A file that does not match (missing tensor, other shape or
//! format, other key) is ignored and rewritten; a cache that cannot be written is skipped
//! (quantizing still works). Written to a temporary name and renamed, so a crash never leaves
//! a half-written cache behind.

use super::{format_of, is_base_linear_weight, quantize};
use crate::model::config::ModelConfig;
use crate::model::error::ModelError;
use crate::model::hub::ModelFiles;
use crate::model::weights::Checkpoint;
use crate::settings::{QuantFormat, Quantization};
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{DType, Device};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Environment variable naming the cache folder (`off` disables the cache).
pub const CACHE_ENV: &str = "TUNESTUDIO_QUANT_CACHE";

/// Bumped when the cached layout changes.
const FORMAT_VERSION: &str = "tunestudio-quant-v1";

/// The metadata key holding the cache key.
const KEY_FIELD: &str = "tunestudio.cache_key";

/// The cache folder, or `None` when disabled or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    crate::paths::user_cache_path(CACHE_ENV, "quantized")
}

/// FNV-1a, 64 bits: a stable hash (std's hasher may change between Rust releases).
fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cache key of `files` quantized as `q`.
pub fn cache_key(files: &ModelFiles, q: Quantization) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    h = fnv1a(FORMAT_VERSION.as_bytes(), h);
    h = fnv1a(q.name().as_bytes(), h);
    for path in std::iter::once(&files.config).chain(files.weights.iter()) {
        let canonical = path.canonicalize().unwrap_or_else(|_| path.clone());
        h = fnv1a(canonical.display().to_string().as_bytes(), h);
        if let Ok(meta) = std::fs::metadata(path) {
            h = fnv1a(&meta.len().to_le_bytes(), h);
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            h = fnv1a(&mtime.to_le_bytes(), h);
        }
    }
    let stem = files
        .dir
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "model".into());
    let stem: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{stem}-{}-{h:016x}", q.name())
}

/// The cache file of `files` quantized as `q` in `dir`.
pub fn cache_path(dir: &Path, files: &ModelFiles, q: Quantization) -> PathBuf {
    dir.join(format!("{}.gguf", cache_key(files, q)))
}

/// The base weights `q` quantizes, with their formats and shapes, in model order.
pub fn planned_formats(
    config: &ModelConfig,
    q: Quantization,
) -> Vec<(String, QuantFormat, Vec<usize>)> {
    config
        .parameter_shapes()
        .into_iter()
        .filter(|(name, shape)| is_base_linear_weight(name) && shape.len() == 2)
        .filter_map(|(name, shape)| {
            let f = q.format_for(shape[1] as u64)?;
            Some((name, f, shape))
        })
        .collect()
}

/// The quantized base of a model: from the cache when it holds it, else quantized from the
/// checkpoint (one weight in f32 on the CPU at a time) and written to the cache.
pub(crate) fn load_quantized(
    files: &ModelFiles,
    config: &ModelConfig,
    ckpt: &Checkpoint,
    q: Quantization,
    device: &Device,
    cache_dir: Option<&Path>,
) -> Result<HashMap<String, Arc<QTensor>>, ModelError> {
    if !q.is_on() {
        return Ok(HashMap::new());
    }
    let plan = planned_formats(config, q);
    let path = cache_dir.map(|d| cache_path(d, files, q));
    let key = cache_key(files, q);
    if let Some(path) = &path {
        if let Ok(Some(map)) = read_cache(path, &key, &plan, device) {
            return Ok(map);
        }
    }
    let mut map = HashMap::new();
    for (name, format, shape) in &plan {
        let w = ckpt.load(name, Some(shape), DType::F32, &Device::Cpu)?;
        let qt = quantize(&w, *format, device)?;
        drop(w);
        map.insert(name.clone(), Arc::new(qt));
    }
    if let Some(path) = &path {
        // A cache that cannot be written only costs the next load its quantization.
        let _ = write_cache(path, &key, &plan, &map);
    }
    Ok(map)
}

/// Writes `map` (names in `plan`'s order) as a GGUF file at `path`, atomically.
pub fn write_cache(
    path: &Path,
    key: &str,
    plan: &[(String, QuantFormat, Vec<usize>)],
    map: &HashMap<String, Arc<QTensor>>,
) -> Result<(), ModelError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let tmp = path.with_extension(format!("gguf.tmp{}", std::process::id()));
    let result = (|| {
        let file = std::fs::File::create(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
        let mut w = std::io::BufWriter::new(file);
        let key_value = gguf_file::Value::String(key.to_string());
        let version = gguf_file::Value::String(FORMAT_VERSION.to_string());
        let metadata = [(KEY_FIELD, &key_value), ("tunestudio.format", &version)];
        let tensors: Vec<(&str, &QTensor)> = plan
            .iter()
            .filter_map(|(n, _, _)| map.get(n).map(|t| (n.as_str(), t.as_ref())))
            .collect();
        gguf_file::write(&mut w, &metadata, &tensors)?;
        use std::io::Write;
        w.flush().map_err(|e| ModelError::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Reads the cache at `path` if it holds exactly `plan` under `key` (`Ok(None)` otherwise).
pub fn read_cache(
    path: &Path,
    key: &str,
    plan: &[(String, QuantFormat, Vec<usize>)],
    device: &Device,
) -> Result<Option<HashMap<String, Arc<QTensor>>>, ModelError> {
    let Ok(file) = std::fs::File::open(path) else {
        return Ok(None);
    };
    // SAFETY: the cache is only ever replaced by a rename, never written in place, so the
    // mapped file does not change while it is read.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
    let mut reader = std::io::Cursor::new(&mmap[..]);
    let content = gguf_file::Content::read(&mut reader)?;
    let stored_key = content
        .metadata
        .get(KEY_FIELD)
        .and_then(|v| v.to_string().ok().cloned());
    if stored_key.as_deref() != Some(key) || content.tensor_infos.len() != plan.len() {
        return Ok(None);
    }
    let mut map = HashMap::new();
    for (name, format, shape) in plan {
        let Some(info) = content.tensor_infos.get(name) else {
            return Ok(None);
        };
        if info.shape.dims() != shape.as_slice() || format_of(info.ggml_dtype) != Some(*format) {
            return Ok(None);
        }
        let t = content.tensor(&mut reader, name, device)?;
        map.insert(name.clone(), Arc::new(t));
    }
    Ok(Some(map))
}
