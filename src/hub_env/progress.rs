//! Download progress: the events a hub download reports and the one observer this process sends
//! them to (the CLI draws a bar).

use super::*;

/// A download's progress, as [`set_download_observer`]'s callback sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DownloadEvent<'a> {
    /// A file's download begins.
    Started {
        /// The hub id.
        repo: &'a str,
        /// The file in the repository.
        file: &'a str,
        /// Its size in bytes.
        total: u64,
    },
    /// The download continues from `offset` bytes already on disk (a partial file of an
    /// earlier run, or a retry after a broken connection).
    Resumed {
        /// The hub id.
        repo: &'a str,
        /// The file in the repository.
        file: &'a str,
        /// The bytes kept.
        offset: u64,
        /// Its size in bytes.
        total: u64,
    },
    /// `done` of `total` bytes are on disk.
    Progress {
        /// The hub id.
        repo: &'a str,
        /// The file in the repository.
        file: &'a str,
        /// The bytes on disk.
        done: u64,
        /// Its size in bytes.
        total: u64,
    },
    /// The file is complete and in the cache.
    Finished {
        /// The hub id.
        repo: &'a str,
        /// The file in the repository.
        file: &'a str,
        /// Its size in bytes.
        total: u64,
    },
    /// The download failed (the caller gets the error).
    Failed {
        /// The hub id.
        repo: &'a str,
        /// The file in the repository.
        file: &'a str,
    },
}

pub(super) type Observer = Arc<dyn Fn(&DownloadEvent<'_>) + Send + Sync>;

pub(super) static OBSERVER: RwLock<Option<Observer>> = RwLock::new(None);

/// Sets the callback every hub download of this process reports to (the CLI draws a bar).
pub fn set_download_observer(observer: impl Fn(&DownloadEvent<'_>) + Send + Sync + 'static) {
    if let Ok(mut slot) = OBSERVER.write() {
        *slot = Some(Arc::new(observer));
    }
}

pub(super) fn emit(event: &DownloadEvent<'_>) {
    let observer = OBSERVER.read().ok().and_then(|slot| slot.clone());
    if let Some(observer) = observer {
        observer(event);
    }
}

/// Progress reports no more often than every this many bytes.
pub(super) const PROGRESS_STEP: u64 = 1 << 20;

/// hf-hub's progress callbacks as [`DownloadEvent`]s. hf-hub 0.4 calls `init` once before the
/// first request and again before each request (the first try and every retry), each followed
/// by `update(offset)` with the bytes already on disk.
pub(super) struct Reporter {
    repo: String,
    file: String,
    total: Rc<Cell<u64>>,
    done: u64,
    reported: u64,
    inits: u32,
    offset_next: bool,
}

impl Reporter {
    pub(super) fn new(repo: &str, file: &str, total: Rc<Cell<u64>>) -> Self {
        Self {
            repo: repo.to_string(),
            file: file.to_string(),
            total,
            done: 0,
            reported: 0,
            inits: 0,
            offset_next: false,
        }
    }
}

impl Progress for Reporter {
    fn init(&mut self, size: usize, _filename: &str) {
        self.total.set(size as u64);
        self.done = 0;
        self.reported = 0;
        if self.inits == 0 {
            emit(&DownloadEvent::Started {
                repo: &self.repo,
                file: &self.file,
                total: size as u64,
            });
        } else {
            self.offset_next = true;
        }
        self.inits += 1;
    }

    fn update(&mut self, size: usize) {
        let total = self.total.get();
        if std::mem::take(&mut self.offset_next) && size > 0 {
            emit(&DownloadEvent::Resumed {
                repo: &self.repo,
                file: &self.file,
                offset: size as u64,
                total,
            });
        }
        self.done += size as u64;
        if self.done != self.reported
            && (self.done - self.reported >= PROGRESS_STEP || self.done == total)
        {
            self.reported = self.done;
            emit(&DownloadEvent::Progress {
                repo: &self.repo,
                file: &self.file,
                done: self.done,
                total,
            });
        }
    }

    fn finish(&mut self) {}
}
