//! What a panel asks the app to do: [`Action`] (and the Playground's own [`PgAction`]), the
//! vocabulary the panels speak. It sits below the panels and the app: a panel queues
//! actions and never names the app (`tests/it/layering.rs`), the app carries them out after
//! the frame.

use std::path::PathBuf;

use tunestudio::plan::Change;
use tunestudio::train::RunConfig;

use crate::gui::jobs::PickTarget;
use crate::gui::session::Panel;

/// Something a panel asks the app to do.
#[derive(Debug, Clone)]
pub enum Action {
    /// Resolve the model in the Model panel's text field.
    LoadModel,
    /// Re-open the dataset.
    ScanDataset,
    /// Start training.
    Start,
    /// Start by resuming the run already in the output folder (its newest checkpoint).
    StartResumingLatest,
    /// Start in a fresh output folder (the current one holds another run).
    StartInNewFolder,
    /// Start the run whose output folder was checked (no other run there): the config as it
    /// was when Start was pressed. Follows the check's job, never a panel.
    StartChecked {
        /// The config to train.
        config: Box<RunConfig>,
        /// Its output folder, absolute.
        output_dir: PathBuf,
    },
    /// After an out-of-memory stop: apply the fitted settings and resume from the checkpoint.
    ApplyOomRefitAndResume,
    /// Look for the newest checkpoint in the output folder (a job): `use_it` puts it in the
    /// Export panel's Checkpoint field (or says there is none); otherwise it fills the field
    /// only while it is still empty.
    FindLatestCheckpoint {
        /// The user asked ("Use the latest").
        use_it: bool,
    },
    /// Dismiss the "this folder holds a run" question.
    CancelStart,
    /// Pause the trainer.
    Pause,
    /// Resume it.
    Resume,
    /// Stop it.
    Stop,
    /// Save a checkpoint now.
    SaveNow,
    /// Apply a planner change to the settings.
    ApplyChange(Change),
    /// Search settings that fit.
    AutoFit,
    /// Apply the last auto-fit.
    ApplyAutoFit,
    /// Run one measured step.
    DryRun,
    /// Re-discover devices.
    RefreshDevices,
    /// Open the panel.
    Goto(Panel),
    /// Show preview rows starting here (and highlight it).
    JumpToRow(usize),
    /// Save the run config to this path.
    SaveConfig(PathBuf),
    /// Load a run config.
    LoadConfig(PathBuf),
    /// Load the bundled demo project.
    LoadDemo,
    /// Export a checkpoint.
    Export,
    /// Re-read the run history.
    RefreshHistory,
    /// Add a folder to the run history.
    AddRunDir(PathBuf),
    /// Open a file dialog for a studio field.
    Pick(PickTarget),
    /// Open a file dialog for the Playground (the app chooses the system dialog or the
    /// in-app picker, as for a studio field).
    PlaygroundPick(PgPick),
    /// Something for the Playground panel.
    Playground(PgAction),
    /// Show a transient message in the status bar.
    Toast(String),
}

/// What a file dialog of the playground chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PgPick {
    /// A side's checkpoint folder.
    Checkpoint(usize),
    /// A side's model folder.
    Folder(usize),
    /// A side's adapter folder.
    Adapter(usize),
    /// A side's GGUF file.
    Gguf(usize),
    /// A prompt list (.txt / .jsonl).
    Prompts,
    /// Where to export the comparison.
    Export,
}

/// What the playground asks the app to do.
#[derive(Debug, Clone)]
pub enum PgAction {
    /// Load side 0 (left) or 1 (right).
    Load(usize),
    /// Answer the prompt on both sides.
    Generate,
    /// Stop both sides (and the batch).
    Cancel,
    /// Take prompts from the run's validation split.
    ValidationPrompts,
    /// Read a prompt list file.
    ReadPrompts(PathBuf),
    /// Answer every prompt of the list on both sides.
    RunBatch,
    /// Write the comparison as JSONL.
    Export,
    /// List the checkpoints of this output folder again.
    RefreshCheckpoints(PathBuf),
}
