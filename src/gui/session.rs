//! The studio's shared document: the run config being edited (the single source of truth,
//! saved as the TOML the CLI reads), where it lives, its problems, the persisted settings
//! and the open panel. Every panel may edit the run config in place; everything else a
//! panel owns lives in its own module (`panels/*`, `playground/`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use tunestudio::train::RunConfig;

use crate::gui::follow::FollowState;

/// The panels of the left navigation, in workflow order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Panel {
    /// Pick the base model.
    Model,
    /// Pick the data and its format.
    Dataset,
    /// See tokens, labels, stats and lints.
    Preview,
    /// Optimisation settings.
    Training,
    /// Devices and the memory plan.
    Devices,
    /// Train and watch.
    Run,
    /// Save adapters, models and the config.
    Export,
    /// Compare two models' answers side by side.
    Playground,
}

impl Panel {
    /// Every panel in navigation order.
    pub const ALL: [Panel; 8] = [
        Panel::Model,
        Panel::Dataset,
        Panel::Preview,
        Panel::Training,
        Panel::Devices,
        Panel::Run,
        Panel::Export,
        Panel::Playground,
    ];

    /// The navigation label.
    pub fn title(self) -> &'static str {
        match self {
            Panel::Model => "Model",
            Panel::Dataset => "Dataset",
            Panel::Preview => "Preview",
            Panel::Training => "Training",
            Panel::Devices => "GPUs & memory",
            Panel::Run => "Run",
            Panel::Export => "Export",
            Panel::Playground => "Playground",
        }
    }

    /// Parses the `TUNESTUDIO_SCREENSHOT_PANEL` / `--panel` spelling.
    pub fn from_name(name: &str) -> Option<Panel> {
        let n = name.trim().to_ascii_lowercase();
        Some(match n.as_str() {
            "model" => Panel::Model,
            "dataset" | "data" => Panel::Dataset,
            "preview" => Panel::Preview,
            "training" | "settings" => Panel::Training,
            "devices" | "gpus" | "memory" | "plan" => Panel::Devices,
            "run" => Panel::Run,
            "export" => Panel::Export,
            "playground" | "chat" | "generate" => Panel::Playground,
            _ => return None,
        })
    }
}

/// What survives a restart (eframe storage).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Model sources opened, newest first.
    pub recent_models: Vec<String>,
    /// Dataset paths opened, newest first.
    pub recent_datasets: Vec<String>,
    /// Run configs saved or opened, newest first.
    pub recent_configs: Vec<PathBuf>,
    /// The config open at exit, reopened at start.
    pub last_config: Option<PathBuf>,
    /// Output folders of runs, for the run history.
    pub run_dirs: Vec<PathBuf>,
    /// Exponential smoothing of the loss chart (0 = none).
    pub smoothing: f32,
    /// The panel open at exit.
    pub panel: Panel,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            recent_models: Vec::new(),
            recent_datasets: Vec::new(),
            recent_configs: Vec::new(),
            last_config: None,
            run_dirs: Vec::new(),
            smoothing: 0.6,
            panel: Panel::Preview,
        }
    }
}

/// The bundled demo config.
pub fn demo_config_path() -> PathBuf {
    tunestudio::paths::assets_dir().join("demo.toml")
}

/// Keeps a most-recent-first list of at most 10 unique entries.
pub fn push_recent<T: PartialEq + Clone>(list: &mut Vec<T>, item: T) {
    list.retain(|x| *x != item);
    list.insert(0, item);
    list.truncate(10);
}

/// Where a file dialog for the field holding `text` may start, best first: the path itself,
/// then its folder (relative paths against `base`). No look at the disk: the dialog's job or
/// the in-app picker's listing takes the first that is a folder.
pub fn dialog_dirs(text: &str, base: &Path) -> Vec<PathBuf> {
    let p = Path::new(text.trim());
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    };
    let parent = p.parent().map(Path::to_path_buf);
    std::iter::once(p).chain(parent).collect()
}

/// The document the panels share.
pub struct Session {
    /// The run config being edited.
    pub config: RunConfig,
    /// Where it was loaded from / saved to.
    pub config_path: Option<PathBuf>,
    /// Problems of the config as loaded.
    pub config_problems: Vec<String>,
    /// The open panel.
    pub panel: Panel,
    /// Persisted settings.
    pub settings: Settings,
    /// The settings the studio fitted to the model and method ([`crate::gui::follow`]).
    pub follow: FollowState,
}

impl Session {
    /// A session editing `config`.
    pub fn new(config: RunConfig, config_path: Option<PathBuf>, settings: Settings) -> Self {
        let mut s = Session {
            panel: settings.panel,
            config,
            config_path,
            config_problems: Vec::new(),
            settings,
            follow: FollowState::default(),
        };
        s.follow = FollowState::loaded(&s.config, s.demo_fitting());
        s
    }

    /// Replaces the config (loaded from a file or the demo). The panels that copy parts of
    /// it into their fields are reset with it by `gui::reducer::use_config`.
    pub fn set_config(&mut self, config: RunConfig, path: Option<PathBuf>) {
        self.config = config;
        self.config_path = path;
        self.follow = FollowState::loaded(&self.config, self.demo_fitting());
        self.config_problems.clear();
    }

    /// What the loaded config's settings suit: the bundled demo's a random model's full
    /// fine-tuning; a user's own config is adopted as it is (`None`).
    fn demo_fitting(&self) -> Option<crate::gui::follow::Fitting> {
        self.is_demo()
            .then_some((false, false, tunestudio::train::TrainingMethod::Sft))
    }

    /// Whether the config open is the bundled demo's.
    pub fn is_demo(&self) -> bool {
        self.config_path.as_deref() == Some(demo_config_path().as_path())
    }

    /// The machine the config plans for when it is not this one's devices.
    pub fn planned_machine(&self) -> Option<crate::gui::planned::PlannedMachine> {
        crate::gui::planned::PlannedMachine::from_entries(&self.config.devices.devices)
    }

    /// The output folder, resolved.
    pub fn output_dir(&self) -> PathBuf {
        self.config.output_path()
    }

    /// A path for the config when none was chosen: `<output>/run.toml`.
    pub fn default_config_path(&self) -> PathBuf {
        self.output_dir().join("run.toml")
    }
}

#[cfg(test)]
mod tests;
