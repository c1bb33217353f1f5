//! Well-known locations: the shared fixtures folder used by tests and benches, and the
//! user's cache folders.

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

/// A cache location of tunestudio's: the path in the environment variable `env` when it is set
/// (`off` or `0`: no cache), else `$XDG_CACHE_HOME/tunestudio/<name>` (`~/.cache/…` when unset).
/// `None` when disabled or no home is known.
pub fn user_cache_path(env: &str, name: &str) -> Option<PathBuf> {
    if let Ok(v) = std::env::var(env) {
        let v = v.trim();
        if v.eq_ignore_ascii_case("off") || v == "0" {
            return None;
        }
        if !v.is_empty() {
            return Some(PathBuf::from(v));
        }
    }
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(x) if !x.is_empty() => PathBuf::from(x),
        _ => PathBuf::from(std::env::var_os("HOME")?).join(".cache"),
    };
    Some(base.join("tunestudio").join(name))
}
