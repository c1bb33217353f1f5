//! The studio's looks at the disk (is this a file, a folder, does it exist; a folder's
//! listing; a file the library is about to read or write) go through here, so that a test can
//! make a folder slow and count which thread looked (`gui::tests::slow_disk`).
//!
//! The UI thread never calls these while drawing a panel or carrying out an action: what a
//! frame needs from the disk (the model's resolved source, the dataset's resolved paths, the
//! sizes the plan counts, a folder's listing for the in-app picker, the run config opened or
//! saved, another run in the output folder, a new project's free folder name, the model's
//! config for the out-of-memory refit, the output folder's newest checkpoint) comes from a
//! job's result. What the UI thread still reads (start-up) is listed in `ARCHITECTURE.md`
//! ("How the studio talks to the trainer").

use std::path::Path;

/// Whether `path` is a file.
pub fn is_file(path: &Path) -> bool {
    hook::visit(path);
    path.is_file()
}

/// Whether `path` is a folder.
pub fn is_dir(path: &Path) -> bool {
    hook::visit(path);
    path.is_dir()
}

/// Whether `path` exists.
pub fn exists(path: &Path) -> bool {
    hook::visit(path);
    path.exists()
}

/// The entries of folder `path`.
pub fn read_dir(path: &Path) -> std::io::Result<std::fs::ReadDir> {
    hook::visit(path);
    std::fs::read_dir(path)
}

/// `path` is about to be read or written by the library (`RunConfig::load`,
/// `RunConfig::save`): counted, and slowed in tests, as a look.
pub fn will_touch(path: &Path) {
    hook::visit(path);
}

#[cfg(not(test))]
mod hook {
    use std::path::Path;

    #[inline]
    pub fn visit(_path: &Path) {}
}

/// Test hook: folders made slow (each look under them sleeps), and a per-thread count of
/// looks, so a test can tell the UI thread from the jobs.
#[cfg(test)]
pub mod hook {
    use std::cell::Cell;
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;
    use std::time::Duration;

    static SLOW: Mutex<Vec<(PathBuf, Duration)>> = Mutex::new(Vec::new());

    thread_local! {
        static LOOKS: Cell<u64> = const { Cell::new(0) };
    }

    /// Every look at a path under `dir` sleeps `delay` (a slow disk), until
    /// [`clear_slow`].
    pub fn make_slow(dir: &Path, delay: Duration) {
        if let Ok(mut v) = SLOW.lock() {
            v.push((dir.to_path_buf(), delay));
        }
    }

    /// `dir` is fast again.
    pub fn clear_slow(dir: &Path) {
        if let Ok(mut v) = SLOW.lock() {
            v.retain(|(d, _)| d != dir);
        }
    }

    /// Looks at the disk this thread made so far.
    pub fn looks_on_this_thread() -> u64 {
        LOOKS.with(Cell::get)
    }

    pub(super) fn visit(path: &Path) {
        LOOKS.with(|c| c.set(c.get() + 1));
        let delay = SLOW.lock().ok().and_then(|v| {
            v.iter()
                .filter(|(d, _)| path.starts_with(d))
                .map(|(_, t)| *t)
                .max()
        });
        if let Some(t) = delay {
            std::thread::sleep(t);
        }
    }
}
