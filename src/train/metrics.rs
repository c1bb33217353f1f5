//! `<output>/metrics.jsonl`: every trainer event, one JSON object per line, so a run can be
//! reopened and compared with others after the studio is closed.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use super::error::TrainError;
use super::events::Event;

/// The metrics file's name inside the output folder.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Appends events to a metrics file.
#[derive(Debug)]
pub struct MetricsWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl MetricsWriter {
    /// Opens (creating, appending) `path`.
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|cause| TrainError::Io {
                path: parent.to_path_buf(),
                cause,
            })?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|cause| TrainError::Io {
                path: path.to_path_buf(),
                cause,
            })?;
        Ok(MetricsWriter {
            path: path.to_path_buf(),
            file,
        })
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event as a line (written through at once, so a crash loses nothing).
    pub fn append(&mut self, event: &Event) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(event).map_err(|e| TrainError::Io {
            path: self.path.clone(),
            cause: std::io::Error::other(e),
        })?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .map_err(|cause| TrainError::Io {
                path: self.path.clone(),
                cause,
            })
    }
}

/// Reads every event of a metrics file (a folder is taken to mean its `metrics.jsonl`).
/// Lines that do not parse (a line cut by a crash) are skipped.
pub fn read_metrics(path: &Path) -> Result<Vec<Event>, TrainError> {
    let path = if path.is_dir() {
        path.join(METRICS_FILE)
    } else {
        path.to_path_buf()
    };
    let file = std::fs::File::open(&path).map_err(|cause| TrainError::Io {
        path: path.clone(),
        cause,
    })?;
    let mut events = Vec::new();
    for line in std::io::BufReader::new(file).lines() {
        let line = line.map_err(|cause| TrainError::Io {
            path: path.clone(),
            cause,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        if let Ok(e) = serde_json::from_str::<Event>(&line) {
            events.push(e);
        }
    }
    Ok(events)
}

/// A run's curves rebuilt from its events. When a run was resumed, steps after the
/// checkpoint appear twice in the file; the later value wins.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunCurves {
    /// (step, loss) by step.
    pub loss: Vec<(u64, f64)>,
    /// (step, learning rate).
    pub lr: Vec<(u64, f64)>,
    /// (step, tokens/s).
    pub tokens_per_sec: Vec<(u64, f64)>,
    /// (step, eval loss).
    pub eval_loss: Vec<(u64, f64)>,
    /// Label tokens trained at the last step.
    pub trained_tokens: u64,
}

impl RunCurves {
    /// Builds the curves from events in file order.
    pub fn from_events(events: &[Event]) -> Self {
        let mut loss = BTreeMap::new();
        let mut lr = BTreeMap::new();
        let mut tps = BTreeMap::new();
        let mut eval = BTreeMap::new();
        let mut trained_tokens = 0;
        for e in events {
            match e {
                Event::Step {
                    step,
                    loss: l,
                    lr: r,
                    tokens_per_sec,
                    trained_tokens: t,
                    ..
                } => {
                    loss.insert(*step, *l);
                    lr.insert(*step, *r);
                    tps.insert(*step, *tokens_per_sec);
                    trained_tokens = *t;
                }
                Event::Eval { step, loss: l, .. } => {
                    eval.insert(*step, *l);
                }
                _ => {}
            }
        }
        RunCurves {
            loss: loss.into_iter().collect(),
            lr: lr.into_iter().collect(),
            tokens_per_sec: tps.into_iter().collect(),
            eval_loss: eval.into_iter().collect(),
            trained_tokens,
        }
    }
}
