//! `<output>/metrics.jsonl`: every trainer event, one JSON object per line, so a run can be
//! reopened and compared with others after the studio is closed.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use super::error::TrainError;
use super::events::{Event, LintFinding};
use super::render::{self, EventRenderer};

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
        let mut builder = CurvesBuilder::default();
        for e in events {
            super::render::dispatch(e, &mut builder);
        }
        builder.finish()
    }
}

/// [`RunCurves`] being rebuilt: by step, so a step written twice (a resumed run) keeps its
/// later value.
#[derive(Debug, Default)]
struct CurvesBuilder {
    loss: BTreeMap<u64, f64>,
    lr: BTreeMap<u64, f64>,
    tokens_per_sec: BTreeMap<u64, f64>,
    eval_loss: BTreeMap<u64, f64>,
    trained_tokens: u64,
}

impl CurvesBuilder {
    fn finish(self) -> RunCurves {
        RunCurves {
            loss: self.loss.into_iter().collect(),
            lr: self.lr.into_iter().collect(),
            tokens_per_sec: self.tokens_per_sec.into_iter().collect(),
            eval_loss: self.eval_loss.into_iter().collect(),
            trained_tokens: self.trained_tokens,
        }
    }
}

/// The curves are the steps and evaluations; every other kind leaves them as they are.
impl EventRenderer for CurvesBuilder {
    fn status(&mut self, _: &str) {}
    fn started(&mut self, _: render::Started<'_>) {}
    fn step(&mut self, e: render::Step<'_>) {
        self.loss.insert(e.step, e.loss);
        self.lr.insert(e.step, e.lr);
        self.tokens_per_sec.insert(e.step, e.tokens_per_sec);
        self.trained_tokens = e.trained_tokens;
    }
    fn eval(&mut self, e: render::Eval) {
        self.eval_loss.insert(e.step, e.loss);
    }
    fn memory(&mut self, _: render::Memory<'_>) {}
    fn checkpoint_saved(&mut self, _: u64, _: &Path) {}
    fn paused(&mut self, _: u64) {}
    fn resumed(&mut self, _: u64) {}
    fn divergence(&mut self, _: render::Divergence) {}
    fn warning(&mut self, _: &str) {}
    fn error(&mut self, _: render::ErrorReport<'_>) {}
    fn lints_blocked(&mut self, _: &[LintFinding]) {}
    fn out_of_memory(&mut self, _: render::OutOfMemory<'_>) {}
    fn lint_allowed(&mut self, _: &LintFinding) {}
    fn completions(&mut self, _: u64, _: &super::SampledGroup) {}
    fn finished(&mut self, _: render::Finished<'_>) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: u64, loss: f64) -> Event {
        Event::Step {
            step,
            loss,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens_per_sec: 100.0 * step as f64,
            trained_tokens: 64 * step,
            elapsed_secs: step as f64,
            epoch: 0.1,
            skipped: false,
            loss_scale: None,
            metrics: BTreeMap::new(),
        }
    }

    #[test]
    fn curves_keep_the_later_value_of_a_step_written_twice() {
        let events = [
            Event::Warning {
                message: "ignored".into(),
            },
            step(1, 3.0),
            step(2, 2.5),
            Event::Eval {
                step: 2,
                loss: 2.7,
                perplexity: 2.7f64.exp(),
                tokens: 10,
            },
            // Resumed from the checkpoint of step 1: step 2 again.
            step(2, 2.4),
        ];
        let curves = RunCurves::from_events(&events);
        assert_eq!(curves.loss, [(1, 3.0), (2, 2.4)]);
        assert_eq!(curves.lr, [(1, 1e-3), (2, 1e-3)]);
        assert_eq!(curves.tokens_per_sec, [(1, 100.0), (2, 200.0)]);
        assert_eq!(curves.eval_loss, [(2, 2.7)]);
        assert_eq!(curves.trained_tokens, 128);
    }
}
