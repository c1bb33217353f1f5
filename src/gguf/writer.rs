//! A streaming GGUF v3 writer: the header (metadata and every tensor's name, shape, type and
//! offset) is known before any weight is read, so tensors are written one at a time and a
//! 7B model never has to be in memory. The file is written under a temporary name beside the
//! destination and renamed into place by [`GgufWriter::finish`]; dropping an unfinished
//! writer removes it, so an error, a cancel or a full disk never leaves a half-written model
//! under the final name.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;

use super::error::GgufError;
use super::quant::{ggml_type_id, tensor_bytes};

/// GGUF's alignment of the data section and of each tensor (`general.alignment` default).
pub const ALIGNMENT: u64 = 32;

/// A metadata value (the subset of GGUF's value types llama.cpp's keys use).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// `UINT32`.
    U32(u32),
    /// `INT32`.
    I32(i32),
    /// `FLOAT32`.
    F32(f32),
    /// `BOOL`.
    Bool(bool),
    /// `STRING`.
    Str(String),
    /// `ARRAY` of `STRING`.
    StrArray(Vec<String>),
    /// `ARRAY` of `INT32`.
    I32Array(Vec<i32>),
    /// `ARRAY` of `FLOAT32`.
    F32Array(Vec<f32>),
}

const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

impl MetaValue {
    fn type_id(&self) -> u32 {
        match self {
            MetaValue::U32(_) => T_U32,
            MetaValue::I32(_) => T_I32,
            MetaValue::F32(_) => T_F32,
            MetaValue::Bool(_) => T_BOOL,
            MetaValue::Str(_) => T_STRING,
            _ => T_ARRAY,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(u8::from(*v)),
            MetaValue::Str(s) => put_str(out, s),
            MetaValue::StrArray(items) => {
                out.extend_from_slice(&T_STRING.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for s in items {
                    put_str(out, s);
                }
            }
            MetaValue::I32Array(items) => {
                out.extend_from_slice(&T_I32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for v in items {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            MetaValue::F32Array(items) => {
                out.extend_from_slice(&T_F32.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for v in items {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

/// One tensor of the file: its name, shape (row-major, as candle and transformers write it)
/// and ggml type.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// llama.cpp's name.
    pub name: String,
    /// Row-major shape; GGUF stores it reversed (`ne[0]` is the row length).
    pub shape: Vec<usize>,
    /// The stored type.
    pub ty: GgmlDType,
}

impl TensorInfo {
    /// Bytes of its data (without alignment padding).
    pub fn bytes(&self) -> u64 {
        tensor_bytes(self.ty, self.shape.iter().product())
    }
}

fn padded(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

/// The header bytes: magic, version, counts, metadata and tensor infos, padded to the data
/// section's alignment.
fn encode_header(metadata: &[(String, MetaValue)], tensors: &[TensorInfo]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        put_str(&mut out, key);
        out.extend_from_slice(&value.type_id().to_le_bytes());
        value.encode(&mut out);
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for &d in t.shape.iter().rev() {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        out.extend_from_slice(&ggml_type_id(t.ty).to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset += padded(t.bytes());
    }
    out.resize(padded(out.len() as u64) as usize, 0);
    out
}

/// The size of the file these metadata and tensors make, before writing it.
pub fn file_bytes(metadata: &[(String, MetaValue)], tensors: &[TensorInfo]) -> u64 {
    encode_header(metadata, tensors).len() as u64
        + tensors.iter().map(|t| padded(t.bytes())).sum::<u64>()
}

/// Writes one GGUF file tensor by tensor, in the order of the infos it was created with.
pub struct GgufWriter {
    out: Option<BufWriter<File>>,
    tmp: PathBuf,
    dest: PathBuf,
    tensors: Vec<TensorInfo>,
    next: usize,
}

impl GgufWriter {
    /// Opens `<dest dir>/.<name>.tmp-<pid>` and writes the header. Refuses an existing
    /// `dest` unless `replace`.
    pub fn create(
        dest: &Path,
        replace: bool,
        metadata: &[(String, MetaValue)],
        tensors: Vec<TensorInfo>,
    ) -> Result<Self, GgufError> {
        if dest.exists() && !replace {
            return Err(GgufError::Exists {
                path: dest.to_path_buf(),
            });
        }
        let dir = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).map_err(|e| GgufError::io(&dir, e))?;
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "model.gguf".into());
        let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        let file = File::create(&tmp).map_err(|e| GgufError::io(&tmp, e))?;
        let mut writer = Self {
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            tmp,
            dest: dest.to_path_buf(),
            tensors,
            next: 0,
        };
        let header = encode_header(metadata, &writer.tensors);
        writer.write_all(&header)?;
        Ok(writer)
    }

    /// The temporary file being written (removed unless [`GgufWriter::finish`] succeeds).
    pub fn temporary_path(&self) -> &Path {
        &self.tmp
    }

    fn write_all(&mut self, bytes: &[u8]) -> Result<(), GgufError> {
        let tmp = self.tmp.clone();
        match self.out.as_mut() {
            Some(out) => out.write_all(bytes).map_err(|e| GgufError::io(&tmp, e)),
            None => Ok(()),
        }
    }

    /// Writes the next tensor's data; it must be the tensor the header announced next, with
    /// exactly its size.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), GgufError> {
        let Some(info) = self.tensors.get(self.next) else {
            return Err(GgufError::Unsupported {
                what: format!("tensor `{name}`"),
                hint: "the header announced fewer tensors (an exporter bug; please report it)"
                    .into(),
            });
        };
        if info.name != name || info.bytes() != data.len() as u64 {
            return Err(GgufError::Unsupported {
                what: format!("tensor `{name}` ({} bytes)", data.len()),
                hint: format!(
                    "the header announced `{}` of {} bytes here (an exporter bug; please report it)",
                    info.name,
                    info.bytes()
                ),
            });
        }
        let pad = (padded(data.len() as u64) - data.len() as u64) as usize;
        self.write_all(data)?;
        self.write_all(&vec![0u8; pad])?;
        self.next += 1;
        Ok(())
    }

    /// Flushes, syncs and renames the file to its destination.
    pub fn finish(mut self) -> Result<PathBuf, GgufError> {
        if self.next != self.tensors.len() {
            return Err(GgufError::Unsupported {
                what: format!("`{}`", self.dest.display()),
                hint: format!(
                    "only {} of {} tensors were written (an exporter bug; please report it)",
                    self.next,
                    self.tensors.len()
                ),
            });
        }
        let tmp = self.tmp.clone();
        if let Some(out) = self.out.take() {
            let file = out
                .into_inner()
                .map_err(|e| GgufError::io(&tmp, e.into_error()))?;
            file.sync_all().map_err(|e| GgufError::io(&tmp, e))?;
        }
        std::fs::rename(&tmp, &self.dest).map_err(|e| GgufError::io(&self.dest, e))?;
        Ok(self.dest.clone())
    }
}

impl Drop for GgufWriter {
    fn drop(&mut self) {
        if self.out.take().is_some() || self.tmp.exists() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;

    #[test]
    fn a_written_file_reads_back_with_candles_reader_and_has_the_predicted_size() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("t.gguf");
        let metadata = vec![
            (
                "general.architecture".to_string(),
                MetaValue::Str("llama".into()),
            ),
            ("llama.block_count".to_string(), MetaValue::U32(2)),
            (
                "tokenizer.ggml.tokens".to_string(),
                MetaValue::StrArray(vec!["a".into(), "b".into()]),
            ),
            (
                "tokenizer.ggml.scores".to_string(),
                MetaValue::F32Array(vec![0.0, -1.0]),
            ),
        ];
        let tensors = vec![
            TensorInfo {
                name: "x".into(),
                shape: vec![3],
                ty: GgmlDType::F32,
            },
            TensorInfo {
                name: "y".into(),
                shape: vec![2, 2],
                ty: GgmlDType::F32,
            },
        ];
        let predicted = file_bytes(&metadata, &tensors);
        let mut w = GgufWriter::create(&dest, false, &metadata, tensors).unwrap();
        let x: Vec<u8> = [1f32, 2., 3.]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let y: Vec<u8> = [4f32, 5., 6., 7.]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        w.write_tensor("x", &x).unwrap();
        w.write_tensor("y", &y).unwrap();
        w.finish().unwrap();
        assert_eq!(std::fs::metadata(&dest).unwrap().len(), predicted);
        let mut f = File::open(&dest).unwrap();
        let content = gguf_file::Content::read(&mut f).unwrap();
        assert_eq!(content.metadata["llama.block_count"].to_u32().unwrap(), 2);
        let y = content
            .tensor(&mut f, "y", &candle_core::Device::Cpu)
            .unwrap();
        assert_eq!(y.shape().dims(), &[2, 2]);
        let y = y.dequantize(&candle_core::Device::Cpu).unwrap();
        assert_eq!(
            y.to_vec2::<f32>().unwrap(),
            vec![vec![4., 5.], vec![6., 7.]]
        );
        // An existing file is refused without `replace`.
        let again = GgufWriter::create(&dest, false, &metadata, vec![]);
        assert!(matches!(again, Err(GgufError::Exists { .. })));
    }

    #[test]
    fn an_unfinished_writer_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("t.gguf");
        let tensors = vec![TensorInfo {
            name: "x".into(),
            shape: vec![1],
            ty: GgmlDType::F32,
        }];
        let w = GgufWriter::create(&dest, false, &[], tensors).unwrap();
        let tmp = w.temporary_path().to_path_buf();
        assert!(tmp.exists());
        drop(w);
        assert!(!tmp.exists() && !dest.exists());
    }
}
