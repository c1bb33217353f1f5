//! The jobs that touch the user's files for the app: opening and saving the run config, and
//! listing a folder for the in-app file picker. Each runs on its own thread, so the frame that
//! asked stays fast on a slow disk (`gui::tests::slow_disk`).

use super::*;
use crate::gui::disk;
use crate::gui::file_picker::{self, FolderRequest};

/// What opening a run config answers: the config and its problems (kept as text: the studio
/// shows them and lets the user fix them), or why it cannot be read at all.
pub type OpenedConfig = Result<(RunConfig, Vec<String>), JobError>;

/// Loads a run config, keeping its problems as text instead of failing when it still parses.
pub fn load_config(path: &Path) -> OpenedConfig {
    if !disk::is_file(path) {
        return Err(JobError::new(
            ErrorKind::Io,
            format!("no run config at {}", path.display()),
            Some("choose an existing .toml file, or save the current config there".into()),
        ));
    }
    match RunConfig::load(path) {
        Ok(c) => Ok((c, Vec::new())),
        Err(err) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                JobError::of(
                    ErrorKind::Io,
                    format!("cannot read {}: {e}", path.display()),
                )
            })?;
            let base = path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."));
            match RunConfig::from_toml_str(&text, &base) {
                Ok(c) => {
                    let problems = match &err {
                        train::ConfigError::Invalid { problems, .. } => {
                            problems.iter().map(|p| p.to_string()).collect()
                        }
                        other => vec![other.to_string()],
                    };
                    Ok((c, problems))
                }
                Err(_) => Err(JobError::from(err)),
            }
        }
    }
}

/// Writes `config` to `path` (its paths made absolute; under a temporary name, then renamed:
/// `RunConfig::save`) and reads it back, so later relative edits resolve against the new
/// place (`None` when it cannot be read back, which the save does not undo).
pub(super) fn save_config(config: &RunConfig, path: &Path) -> Result<Option<RunConfig>, JobError> {
    disk::will_touch(path);
    config.with_absolute_paths().save(path)?;
    Ok(load_config(path).ok().map(|(c, _)| c))
}

impl Jobs {
    /// Opens the run config at `path` (`demo`: the bundled demo project).
    pub fn open_config(&self, path: PathBuf, demo: bool) {
        self.spawn("open-config", move |_| {
            let result = load_config(&path);
            Some(JobOutput::ConfigOpened {
                path,
                demo,
                result: Box::new(result),
            })
        });
    }

    /// Saves `config` to `path`; the answer carries the config as sent, so the app can tell
    /// whether it was edited meanwhile.
    pub fn save_config(&self, config: RunConfig, path: PathBuf) {
        self.spawn("save-config", move |_| {
            let result = save_config(&config, &path);
            Some(JobOutput::ConfigSaved {
                path,
                sent: Box::new(config),
                result: result.map(|c| c.map(Box::new)),
            })
        });
    }

    /// Lists a folder for the in-app file picker.
    pub fn list_folder(&self, request: FolderRequest) {
        self.spawn("list-folder", move |_| {
            Some(JobOutput::Folder(file_picker::list_folder(&request)))
        });
    }
}
