//! The jobs Start waits on: the output folder checked for another run, a fresh output folder
//! proposed for a new project (another model or dataset), and the out-of-memory refit; and the
//! output folder's newest checkpoint, which the Export panel exports by default. Each
//! runs on its own thread, so the frame that clicked stays fast on a slow disk
//! (`gui::tests::slow_disk`); the reducer folds the answer in and starts the run.

use super::*;
use crate::gui::disk;

/// Where a new project's output folder is looked for, and the project it is for: the
/// answer is written into the config only while the config still holds this model, dataset
/// and output folder (and the request is the latest, `seq`).
#[derive(Debug, Clone)]
pub struct FolderProposal {
    /// Request number.
    pub seq: u64,
    /// The model source the folder is named after.
    pub model: String,
    /// The dataset path the folder is named after.
    pub data: String,
    /// The output folder when it was asked (a folder the user chose meanwhile stays).
    pub from: PathBuf,
    /// The new folder's parent, as the config writes it (relative to `base`, or absolute).
    pub parent: PathBuf,
    /// The folder the config's relative paths resolve against.
    pub base: PathBuf,
    /// The folder's name, `<model>-<data>`; numbered (`-2`, `-3`, …) when taken.
    pub name: String,
}

/// The first of `name`, `name-2`, `name-3`, … that does not exist under `base/parent`,
/// as `parent/<that>`.
fn fresh_folder(p: &FolderProposal) -> PathBuf {
    let dir = p.base.join(&p.parent);
    let fresh = (1..)
        .map(|n| {
            if n == 1 {
                p.name.clone()
            } else {
                format!("{}-{n}", p.name)
            }
        })
        .find(|n| !disk::exists(&dir.join(n)))
        .unwrap_or_else(|| p.name.clone());
    p.parent.join(fresh)
}

impl Jobs {
    /// Looks for another run in `output_dir` before Start trains there; the answer carries
    /// the config as it was when Start was pressed, which the run then trains.
    pub fn check_output_dir(&self, seq: u64, config: RunConfig, output_dir: PathBuf) {
        self.spawn("check-output", move |_| {
            disk::will_touch(&output_dir);
            let existing = train::existing_run(&output_dir);
            Some(JobOutput::OutputChecked {
                seq,
                config: Box::new(config),
                output_dir,
                existing,
            })
        });
    }

    /// Looks for the newest checkpoint in `output_dir` (the Export panel's default, or its
    /// "Use the latest" when `use_it`).
    pub fn latest_checkpoint(&self, output_dir: PathBuf, use_it: bool) {
        self.spawn("latest-checkpoint", move |_| {
            disk::will_touch(&output_dir);
            let latest = train::latest_checkpoint(&output_dir);
            Some(JobOutput::LatestCheckpoint {
                output_dir,
                latest,
                use_it,
            })
        });
    }

    /// Finds a fresh output folder for a new project.
    pub fn propose_output_dir(&self, request: FolderProposal) {
        self.spawn("propose-output", move |_| {
            let proposed = fresh_folder(&request);
            Some(JobOutput::OutputProposed { request, proposed })
        });
    }

    /// Fits `config` to what the device held after an out-of-memory stop (reads the model's
    /// config, asks the driver, plans: `train::oom::refit_after_oom`).
    pub fn refit_after_oom(&self, seq: u64, config: RunConfig) {
        self.spawn("oom-refit", move |_| {
            disk::will_touch(&config.resolve_path(Path::new(config.model.source.trim())));
            let result = train::oom::refit_after_oom(&config)
                .map(|r| (Box::new(r.config), r.changes))
                .map_err(JobError::from);
            Some(JobOutput::Refitted { seq, result })
        });
    }
}
