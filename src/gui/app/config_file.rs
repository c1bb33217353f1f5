//! The run config on disk: loading one (its problems kept as text), saving, opening and the
//! bundled demo.

use std::path::{Path, PathBuf};

use tunestudio::train::{self, RunConfig};

use super::{demo_config_path, Action, StudioApp};
use crate::gui::session::push_recent;

/// Loads a run config, keeping its problems as text instead of failing when it
/// still parses (the studio shows them and lets the user fix them).
pub fn load_config(path: &Path) -> Result<(RunConfig, Vec<String>), String> {
    match RunConfig::load(path) {
        Ok(c) => Ok((c, Vec::new())),
        Err(err) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
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
                Err(_) => Err(err.to_string()),
            }
        }
    }
}

impl StudioApp {
    pub(super) fn save_config(&mut self, path: PathBuf) {
        let r = self.session.config.with_absolute_paths().save(&path);
        match r {
            Ok(()) => {
                self.panels.export.config_message = Some(Ok(format!("saved {}", path.display())));
                push_recent(&mut self.session.settings.recent_configs, path.clone());
                self.session.settings.last_config = Some(path.clone());
                // Later relative edits resolve against the new location.
                if let Ok((c, _)) = load_config(&path) {
                    self.session.config = c;
                }
                self.session.config_path = Some(path);
            }
            Err(e) => self.panels.export.config_message = Some(Err(e.to_string())),
        }
    }

    pub(super) fn open_config(&mut self, path: PathBuf) {
        match load_config(&path) {
            Ok((c, problems)) => {
                self.set_config(c, Some(path.clone()));
                self.session.config_problems = problems;
                push_recent(&mut self.session.settings.recent_configs, path.clone());
                self.session.settings.last_config = Some(path.clone());
                self.panels.export.config_message = Some(Ok(format!("loaded {}", path.display())));
                self.actions.push(Action::LoadModel);
            }
            Err(e) => self.panels.export.config_message = Some(Err(e)),
        }
    }

    pub(super) fn load_demo(&mut self) {
        match load_config(&demo_config_path()) {
            Ok((c, problems)) => {
                self.set_config(c, Some(demo_config_path()));
                self.session.config_problems = problems;
                self.session.settings.last_config = None;
            }
            Err(e) => self.session.config_problems = vec![e],
        }
        self.actions.push(Action::LoadModel);
    }
}
