//! How the app is started ([`StartOptions`]: the command line's and the tests' options).

use std::path::PathBuf;

use crate::gui::jobs::PickTarget;
use crate::gui::session::Panel;

/// Options for the app that the command line or tests set.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// Take a screenshot to this PNG and exit.
    pub screenshot: Option<PathBuf>,
    /// Panel to open at start.
    pub panel: Option<Panel>,
    /// In screenshot mode: start training and wait for this many steps first.
    pub train_steps: Option<u64>,
    /// Ignore persisted settings (tests, screenshots).
    pub fresh: bool,
    /// Override the run's output folder.
    pub output_dir: Option<PathBuf>,
    /// Open this run config instead of the last one / the demo.
    pub config: Option<PathBuf>,
    /// The NVML library to read GPUs through (`None`: `$TUNESTUDIO_NVML_LIB`, then the
    /// driver's); tests pass a fake one.
    pub nvml_library: Option<PathBuf>,
    /// Force the system file dialog unavailable, with this reason (tests; `None`: ask the
    /// session bus).
    pub no_system_dialog: Option<String>,
    /// In screenshot mode: press this field's "Browse…" before the screenshot.
    pub screenshot_pick: Option<PickTarget>,
    /// Tests: the first run started makes this step fail once as out of memory (`STEP:PHASE`,
    /// see [`train::TrainerOptions::inject_oom`]); later runs (the refit's resume) do not.
    pub inject_oom: Option<String>,
}

impl StartOptions {
    /// Reads `TUNESTUDIO_SCREENSHOT`, `TUNESTUDIO_SCREENSHOT_PANEL`,
    /// `TUNESTUDIO_SCREENSHOT_TRAIN_STEPS`, `TUNESTUDIO_OUTPUT_DIR` and `TUNESTUDIO_CONFIG`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let screenshot = var("TUNESTUDIO_SCREENSHOT").map(PathBuf::from);
        StartOptions {
            fresh: screenshot.is_some(),
            panel: var("TUNESTUDIO_SCREENSHOT_PANEL").and_then(|p| Panel::from_name(&p)),
            train_steps: var("TUNESTUDIO_SCREENSHOT_TRAIN_STEPS").and_then(|s| s.parse().ok()),
            output_dir: var("TUNESTUDIO_OUTPUT_DIR").map(PathBuf::from),
            config: var("TUNESTUDIO_CONFIG").map(PathBuf::from),
            screenshot,
            // `$TUNESTUDIO_NVML_LIB` is read where NVML is opened.
            nvml_library: None,
            no_system_dialog: None,
            screenshot_pick: var("TUNESTUDIO_SCREENSHOT_PICK").and_then(|p| match p.as_str() {
                "model-folder" => Some(PickTarget::ModelFolder),
                "dataset-file" => Some(PickTarget::DatasetFile),
                "dataset-folder" => Some(PickTarget::DatasetFolder),
                _ => None,
            }),
            inject_oom: None,
        }
    }
}
