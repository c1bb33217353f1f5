//! Well-known locations: the shared fixtures folder used by tests and benches.

use std::path::PathBuf;

/// The folder holding the parity fixtures, datasets and model configs.
///
/// `TUNESTUDIO_SHARED` overrides it; otherwise it is `../shared` next to the
/// crate root (where CI lays it out).
pub fn shared_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TUNESTUDIO_SHARED") {
        // Made absolute against the current folder now, so paths built from it stay valid for
        // child processes and code that changes folder later.
        let dir = PathBuf::from(dir);
        return std::path::absolute(&dir).unwrap_or(dir);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("shared")
}

/// The crate's bundled assets (demo model config, tokenizer, dataset).
pub fn assets_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets")
}
