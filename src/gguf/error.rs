//! The typed errors of GGUF export and loading; each names the file, tensor or setting and
//! the fix.

use std::path::PathBuf;

use crate::model::ModelError;

/// Everything that can go wrong while writing or reading a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The destination exists and `--force` was not given.
    #[error("{path} already exists; pass --force (or tick \"replace\") to overwrite it, or choose another --out")]
    Exists {
        /// The destination file.
        path: PathBuf,
    },
    /// Reading or writing a file failed (a full disk is the usual cause when writing).
    #[error("cannot write {path}: {cause}{hint}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        cause: std::io::Error,
        /// A suggestion, already formatted (`"; the disk is full: free …"`), or empty.
        hint: String,
    },
    /// The model cannot be represented in llama.cpp's format.
    #[error("{what} cannot be exported to GGUF: {hint}")]
    Unsupported {
        /// What (the architecture, the tokenizer, a tensor).
        what: String,
        /// Why, and what to do instead.
        hint: String,
    },
    /// The tokenizer files could not be read or understood.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// `tokenizer.json` (or the GGUF file it came from).
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A GGUF file being read is not a valid one (or not one of ours to run).
    #[error("{path} is not a GGUF model tunestudio can run: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Loading or merging the weights failed.
    #[error("{context}: {cause}")]
    Model {
        /// What was being done.
        context: String,
        /// The model engine's error.
        #[source]
        cause: ModelError,
    },
    /// A tensor operation (permutation, quantization) failed.
    #[error("{context}: {cause}")]
    Tensor {
        /// What was being done (names the tensor).
        context: String,
        /// candle's error.
        #[source]
        cause: candle_core::Error,
    },
    /// The user stopped the export; nothing was left at the destination.
    #[error("the export was cancelled; nothing was written to {path}")]
    Cancelled {
        /// The destination that was not written.
        path: PathBuf,
    },
}

impl GgufError {
    /// An I/O error on `path`, with the full-disk hint when that is the cause.
    pub fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        let path = path.into();
        // ENOSPC (28) and EDQUOT (122) on Linux: the disk or the quota is full.
        let full = matches!(cause.raw_os_error(), Some(28) | Some(122))
            || cause.kind() == std::io::ErrorKind::StorageFull;
        let hint = if full {
            let dir = path
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            format!("; the disk is full: free space on `{dir}` or choose another --out (the partial file was removed)")
        } else {
            String::new()
        };
        GgufError::Io { path, cause, hint }
    }

    /// A candle error while working on `tensor`.
    pub fn tensor(tensor: &str, cause: candle_core::Error) -> Self {
        GgufError::Tensor {
            context: format!("tensor `{tensor}`"),
            cause,
        }
    }
}
