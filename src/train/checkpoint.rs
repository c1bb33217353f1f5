//! Checkpoint folders: `<output>/checkpoint-<step>/` holding
//!
//! - `trainable.safetensors`: the trainable parameters (all weights, or only the LoRA ones),
//! - `adapter/`: the PEFT adapter when LoRA is on (usable outside tunestudio),
//! - `optimizer.safetensors`: AdamW moments (and f32 master weights in mixed precision),
//! - `trainer_state.json`: step, data-loader position, loss scale, RNG seed, token counts,
//! - `run.toml`: the run config.
//!
//! A checkpoint is written into `checkpoint-<step>.tmp` and renamed when complete, so a
//! crash never leaves a half-written `checkpoint-<step>`.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use super::error::TrainError;
use super::precision::{LossScaler, Precision};

/// File names inside a checkpoint folder.
pub const TRAINABLE_FILE: &str = "trainable.safetensors";
/// Optimizer state file.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Trainer state file.
pub const STATE_FILE: &str = "trainer_state.json";
/// Config copy.
pub const CONFIG_FILE: &str = "run.toml";
/// PEFT adapter sub-folder.
pub const ADAPTER_DIR: &str = "adapter";

const PREFIX: &str = "checkpoint-";

/// Everything besides tensors that an exact resume needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Layout version of the checkpoint.
    pub format_version: u32,
    /// Optimizer steps done (including skipped fp16 steps).
    pub step: u64,
    /// Steps the optimizer actually applied.
    pub optimizer_steps: u64,
    /// Data loader: current epoch (0-based).
    pub epoch: u64,
    /// Data loader: index of the next row in the epoch's seeded shuffle.
    pub index_in_epoch: usize,
    /// Label tokens trained so far.
    pub trained_tokens: u64,
    /// Seconds of training so far.
    pub elapsed_secs: f64,
    /// The run seed; every random stream (data order, dropout) derives from it and the step.
    pub seed: u64,
    /// Precision mode of the run.
    pub precision: Precision,
    /// Whether the trainable parameters are LoRA adapters.
    pub lora: bool,
    /// fp16-mixed loss scaler.
    pub loss_scaler: Option<LossScaler>,
    /// Loss of the last step.
    pub last_loss: Option<f64>,
    /// Last evaluation loss.
    pub last_eval_loss: Option<f64>,
    /// Rows per micro-batch (over every data-parallel rank) when saved, so a resume with
    /// another micro-batch (an out-of-memory refit) continues at the same row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows_per_micro_batch: Option<usize>,
}

/// The current checkpoint layout version.
pub const FORMAT_VERSION: u32 = 1;

fn io_err(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The folder name of the checkpoint of `step`.
pub fn checkpoint_dir(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("{PREFIX}{step}"))
}

/// Writes a checkpoint atomically: `write` fills a fresh `checkpoint-<step>.tmp`, which is then
/// renamed to `checkpoint-<step>` (replacing an older one of the same step).
pub fn write_atomically(
    output_dir: &Path,
    step: u64,
    write: impl FnOnce(&Path) -> Result<(), TrainError>,
) -> Result<PathBuf, TrainError> {
    let final_dir = checkpoint_dir(output_dir, step);
    let tmp_dir = output_dir.join(format!("{PREFIX}{step}.tmp"));
    if tmp_dir.exists() {
        std::fs::remove_dir_all(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;
    }
    std::fs::create_dir_all(&tmp_dir).map_err(|e| io_err(&tmp_dir, e))?;
    if let Err(e) = write(&tmp_dir) {
        let _ = std::fs::remove_dir_all(&tmp_dir);
        return Err(e);
    }
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| io_err(&final_dir, e))?;
    }
    std::fs::rename(&tmp_dir, &final_dir).map_err(|e| io_err(&final_dir, e))?;
    Ok(final_dir)
}

/// Complete checkpoints in `output_dir`, oldest first (`.tmp` leftovers are ignored).
pub fn list_checkpoints(output_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(output_dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().to_string();
                    let step = name.strip_prefix(PREFIX)?.parse::<u64>().ok()?;
                    let path = e.path();
                    path.join(STATE_FILE).is_file().then_some((step, path))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort_by_key(|(s, _)| *s);
    found
}

/// Sets aside the checkpoints of `output_dir` after step `last_good` (renamed
/// `checkpoint-<step>-diverged`, kept for inspection), so `--resume latest` continues from the
/// last good one; returns it. A loss that spikes at step k was made by the weights step k−1
/// wrote, so after a divergence at k the last good checkpoint is k−2's.
pub fn set_aside_after(output_dir: &Path, last_good: u64) -> Option<PathBuf> {
    let mut good = None;
    for (step, path) in list_checkpoints(output_dir) {
        if step <= last_good {
            good = Some(path);
            continue;
        }
        let mut aside = path.clone().into_os_string();
        aside.push("-diverged");
        // Best effort: a checkpoint that cannot be renamed stays (the report names the
        // good one either way).
        let _ = std::fs::rename(&path, aside);
    }
    good
}

/// What another run left in `output_dir` (its `metrics.jsonl`, its checkpoints), in words, or
/// `None` when a fresh run may start there. A fresh start never writes into another run's
/// folder: its metrics would interleave and `--resume latest` would pick the wrong run.
pub fn existing_run(output_dir: &Path) -> Option<String> {
    let mut found = Vec::new();
    if output_dir.join(super::metrics::METRICS_FILE).is_file() {
        found.push(super::metrics::METRICS_FILE.to_string());
    }
    let checkpoints = list_checkpoints(output_dir);
    match checkpoints.last() {
        Some((step, _)) if checkpoints.len() == 1 => found.push(format!("checkpoint-{step}")),
        Some((step, _)) => found.push(format!(
            "{} checkpoints up to checkpoint-{step}",
            checkpoints.len()
        )),
        None => {}
    }
    (!found.is_empty()).then(|| {
        format!(
            "`{}` already holds a run ({})",
            output_dir.display(),
            found.join(", ")
        )
    })
}

/// The newest complete checkpoint in `output_dir`.
pub fn latest_checkpoint(output_dir: &Path) -> Option<PathBuf> {
    list_checkpoints(output_dir).pop().map(|(_, p)| p)
}

/// Deletes all but the newest `keep_last` checkpoints (0 keeps all); returns the deleted folders.
pub fn prune_checkpoints(output_dir: &Path, keep_last: usize) -> Result<Vec<PathBuf>, TrainError> {
    if keep_last == 0 {
        return Ok(Vec::new());
    }
    let all = list_checkpoints(output_dir);
    let excess = all.len().saturating_sub(keep_last);
    let mut removed = Vec::new();
    for (_, path) in all.into_iter().take(excess) {
        std::fs::remove_dir_all(&path).map_err(|e| io_err(&path, e))?;
        removed.push(path);
    }
    Ok(removed)
}

/// Writes `trainer_state.json`.
pub fn write_state(dir: &Path, state: &TrainerState) -> Result<(), TrainError> {
    let path = dir.join(STATE_FILE);
    let text = serde_json::to_string_pretty(state).map_err(|e| io_err(&path, e))?;
    std::fs::write(&path, text).map_err(|e| io_err(&path, e))
}

/// Reads `trainer_state.json` of a checkpoint folder.
pub fn read_state(dir: &Path) -> Result<TrainerState, TrainError> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        io_err(
            dir,
            format!("cannot read {STATE_FILE} ({e}); is this a tunestudio checkpoint folder (`checkpoint-<step>`)?"),
        )
    })?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| io_err(&path, format!("{STATE_FILE} is damaged: {e}")))?;
    if state.format_version != FORMAT_VERSION {
        return Err(io_err(
            dir,
            format!(
                "checkpoint format {} is not supported by this tunestudio (format {FORMAT_VERSION})",
                state.format_version
            ),
        ));
    }
    Ok(state)
}

/// Saves named tensors as safetensors.
pub fn save_tensors(
    path: &Path,
    tensors: &std::collections::HashMap<String, candle_core::Tensor>,
) -> Result<(), TrainError> {
    candle_core::safetensors::save(tensors, path).map_err(|e| io_err(path, e))
}

/// Loads named tensors from safetensors.
pub fn load_tensors(
    path: &Path,
    device: &candle_core::Device,
) -> Result<std::collections::HashMap<String, candle_core::Tensor>, TrainError> {
    candle_core::safetensors::load(path, device).map_err(|e| io_err(path, e))
}

/// The largest safetensors header accepted (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a [`TensorFile`]: its dtype, shape and where its bytes are.
#[derive(Debug, Clone)]
struct Entry {
    dtype: candle_core::DType,
    shape: Vec<usize>,
    /// Byte offset of the data from the start of the file.
    offset: u64,
}

/// A checkpoint's safetensors file read one tensor at a time with positioned reads, so a
/// resume puts each tensor directly on its own device and the host holds one tensor at a
/// time. Not a memory map: a read-only mapping keeps every page it touched resident (and in
/// the process's RSS) until it is unmapped, which for `optimizer.safetensors` is a full host
/// copy of the optimizer state during the resume.
pub struct TensorFile {
    path: PathBuf,
    file: std::fs::File,
    entries: std::collections::HashMap<String, Entry>,
}

impl TensorFile {
    /// Opens `path` and reads its header (the tensors' names, dtypes, shapes and offsets).
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        let damaged = |what: String| {
            io_err(
                path,
                format!("{what}: the file is damaged or truncated; resume from another checkpoint"),
            )
        };
        let file = std::fs::File::open(path).map_err(|e| {
            io_err(
                path,
                format!("cannot open it ({e}); is this a complete tunestudio checkpoint folder?"),
            )
        })?;
        let file_bytes = file.metadata().map_err(|e| io_err(path, e))?.len();
        let mut len = [0u8; 8];
        read_exact_at(&file, &mut len, 0)
            .map_err(|e| damaged(format!("cannot read the header length ({e})")))?;
        let header_bytes = u64::from_le_bytes(len);
        if header_bytes > MAX_HEADER_BYTES || 8 + header_bytes > file_bytes {
            return Err(damaged(format!(
                "the header claims {header_bytes} bytes of a {file_bytes}-byte file"
            )));
        }
        let mut header = vec![0u8; header_bytes as usize];
        read_exact_at(&file, &mut header, 8)
            .map_err(|e| damaged(format!("cannot read the header ({e})")))?;
        let metadata: safetensors::tensor::Metadata = serde_json::from_slice(&header)
            .map_err(|e| damaged(format!("the header is not safetensors ({e})")))?;
        let data_start = 8 + header_bytes;
        let mut entries = std::collections::HashMap::new();
        for (name, info) in metadata.tensors() {
            let dtype = candle_dtype(info.dtype).ok_or_else(|| {
                io_err(
                    path,
                    format!(
                        "`{name}` has dtype {:?}, not f32, bf16, f16 or f64: not a tunestudio checkpoint",
                        info.dtype
                    ),
                )
            })?;
            let (start, end) = info.data_offsets;
            let elems: usize = info.shape.iter().product();
            if end.checked_sub(start) != Some(elems * dtype.size_in_bytes())
                || data_start + end as u64 > file_bytes
            {
                return Err(damaged(format!(
                    "`{name}` ({:?}, bytes {start}..{end}) does not fit the file",
                    info.shape
                )));
            }
            let entry = Entry {
                dtype,
                shape: info.shape.clone(),
                offset: data_start + start as u64,
            };
            entries.insert(name, entry);
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            entries,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shape of `key`, `None` when the file has no such tensor.
    pub fn dims(&self, key: &str) -> Option<&[usize]> {
        self.entries.get(key).map(|e| e.shape.as_slice())
    }

    fn entry(&self, key: &str) -> Result<&Entry, TrainError> {
        self.entries.get(key).ok_or_else(|| {
            io_err(
                &self.path,
                format!(
                    "has no tensor `{key}`; the checkpoint belongs to another model or LoRA setup"
                ),
            )
        })
    }

    fn read<T: candle_core::WithDType>(&self, key: &str, e: &Entry) -> Result<Vec<T>, TrainError> {
        let elems: usize = e.shape.iter().product();
        read_elems::<T>(&self.file, e.offset, elems).map_err(|err| {
            io_err(
                &self.path,
                format!("cannot read `{key}` ({err}); the file is damaged or truncated: resume from another checkpoint"),
            )
        })
    }

    /// `key` in its stored dtype on `device`: read into one host buffer that becomes the
    /// tensor on the CPU (no second copy) or is copied to a GPU and dropped.
    pub fn load(
        &self,
        key: &str,
        device: &candle_core::Device,
    ) -> Result<candle_core::Tensor, TrainError> {
        use candle_core::{DType, Tensor};
        let e = self.entry(key)?;
        let shape = e.shape.as_slice();
        let t = match e.dtype {
            DType::F32 => Tensor::from_vec(self.read::<f32>(key, e)?, shape, device),
            DType::BF16 => Tensor::from_vec(self.read::<half::bf16>(key, e)?, shape, device),
            DType::F16 => Tensor::from_vec(self.read::<half::f16>(key, e)?, shape, device),
            DType::F64 => Tensor::from_vec(self.read::<f64>(key, e)?, shape, device),
            other => {
                return Err(io_err(
                    &self.path,
                    format!("`{key}` has dtype {other:?}, not a float"),
                ))
            }
        };
        t.map_err(|err| io_err(&self.path, format!("cannot place `{key}`: {err}")))
    }

    /// `key`'s values as f32 in host RAM: an f32 tensor (the optimizer state's dtype) is
    /// read straight into the vector.
    pub fn load_f32(&self, key: &str) -> Result<Vec<f32>, TrainError> {
        let e = self.entry(key)?;
        if e.dtype == candle_core::DType::F32 {
            return self.read::<f32>(key, e);
        }
        self.load(key, &candle_core::Device::Cpu)?
            .to_dtype(candle_core::DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .map_err(|err| io_err(&self.path, format!("cannot convert `{key}` to f32: {err}")))
    }
}

impl crate::model::StateSource for TensorFile {
    fn dims(&self, key: &str) -> Option<Vec<usize>> {
        TensorFile::dims(self, key).map(<[usize]>::to_vec)
    }

    fn load_f32(&self, key: &str) -> Result<Vec<f32>, crate::model::ModelError> {
        TensorFile::load_f32(self, key)
            .map_err(|e| crate::model::ModelError::Optimizer(e.to_string()))
    }
}

fn candle_dtype(dtype: safetensors::Dtype) -> Option<candle_core::DType> {
    use candle_core::DType;
    match dtype {
        safetensors::Dtype::F32 => Some(DType::F32),
        safetensors::Dtype::BF16 => Some(DType::BF16),
        safetensors::Dtype::F16 => Some(DType::F16),
        safetensors::Dtype::F64 => Some(DType::F64),
        _ => None,
    }
}

/// `elems` values of `T` read from `offset` straight into a vector (safetensors stores them
/// little-endian, as every platform tunestudio runs on lays them out).
fn read_elems<T: candle_core::WithDType>(
    file: &std::fs::File,
    offset: u64,
    elems: usize,
) -> std::io::Result<Vec<T>> {
    let mut v = vec![T::from_f64(0.0); elems];
    // SAFETY: `T` is a plain float type (f32, f64, bf16, f16), for which every bit pattern is
    // a value; the byte slice covers exactly the vector's initialised elements.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(
            v.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(v.as_slice()),
        )
    };
    read_exact_at(file, bytes, offset)?;
    Ok(v)
}

#[cfg(unix)]
fn read_exact_at(file: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(not(unix))]
fn read_exact_at(file: &std::fs::File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> TrainerState {
        TrainerState {
            format_version: FORMAT_VERSION,
            step,
            optimizer_steps: step,
            epoch: 0,
            index_in_epoch: 3,
            trained_tokens: 10,
            elapsed_secs: 1.0,
            seed: 1,
            precision: Precision::Fp32,
            lora: false,
            loss_scaler: None,
            last_loss: Some(1.0),
            last_eval_loss: None,
            rows_per_micro_batch: Some(4),
        }
    }

    /// The streaming reader gives back what candle saved, in each tensor's dtype, and says
    /// which file and tensor a damaged file breaks.
    #[test]
    fn tensor_file_reads_one_tensor_at_a_time() {
        use candle_core::{DType, Device, Tensor};
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("t.safetensors");
        let a = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        let b = a.to_dtype(DType::BF16).unwrap();
        let tensors: std::collections::HashMap<String, Tensor> =
            [("a".to_string(), a.clone()), ("b".to_string(), b.clone())].into();
        save_tensors(&path, &tensors).unwrap();
        let file = TensorFile::open(&path).unwrap();
        assert_eq!(file.dims("a"), Some(&[3usize, 4][..]));
        assert_eq!(file.dims("c"), None);
        let got = file.load("b", &Device::Cpu).unwrap();
        assert_eq!(got.dtype(), DType::BF16);
        assert_eq!(
            got.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
            a.to_vec2::<f32>().unwrap()
        );
        let want: Vec<f32> = (0..12).map(|i| i as f32).collect();
        assert_eq!(file.load_f32("a").unwrap(), want);
        assert_eq!(file.load_f32("b").unwrap(), want);
        let missing = file.load_f32("c").unwrap_err().to_string();
        assert!(
            missing.contains("`c`") && missing.contains("t.safetensors"),
            "{missing}"
        );

        // Cut the last tensor's bytes off: the header no longer fits the file.
        let len = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 8).unwrap();
        let err = TensorFile::open(&path).err().unwrap().to_string();
        assert!(
            err.contains("t.safetensors") && err.contains("damaged or truncated"),
            "{err}"
        );
        std::fs::write(&path, b"not a checkpoint").unwrap();
        let err = TensorFile::open(&path).err().unwrap().to_string();
        assert!(err.contains("damaged or truncated"), "{err}");
    }

    #[test]
    fn atomic_write_list_and_prune() {
        let tmp = tempfile::tempdir().unwrap();
        for step in [5, 10, 15] {
            write_atomically(tmp.path(), step, |d| write_state(d, &state(step))).unwrap();
        }
        // A failed write leaves neither the folder nor the .tmp.
        let failed = write_atomically(tmp.path(), 20, |_| {
            Err(TrainError::EmptyDataset("x".into()))
        });
        assert!(failed.is_err());
        assert!(!tmp.path().join("checkpoint-20").exists());
        assert!(!tmp.path().join("checkpoint-20.tmp").exists());
        // A leftover .tmp from a crash is not a checkpoint.
        std::fs::create_dir_all(tmp.path().join("checkpoint-25.tmp")).unwrap();
        let steps: Vec<u64> = list_checkpoints(tmp.path()).iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![5, 10, 15]);
        prune_checkpoints(tmp.path(), 2).unwrap();
        let steps: Vec<u64> = list_checkpoints(tmp.path()).iter().map(|c| c.0).collect();
        assert_eq!(steps, vec![10, 15]);
        let latest = latest_checkpoint(tmp.path()).unwrap();
        assert_eq!(read_state(&latest).unwrap(), state(15));
    }
}
