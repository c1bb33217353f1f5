//! The run config on disk: saving, opening and the bundled demo, each a job
//! (`gui/jobs/files.rs`); the answers are folded in by `gui/reducer.rs` a few frames later,
//! and the Export panel shows the save or open in flight meanwhile.

use std::path::PathBuf;

use super::{demo_config_path, StudioApp};

impl StudioApp {
    pub(super) fn save_config(&mut self, path: PathBuf) {
        self.panels.export.config_busy = Some(format!("saving {}…", path.display()));
        self.jobs.save_config(self.session.config.clone(), path);
    }

    pub(super) fn open_config(&mut self, path: PathBuf) {
        self.panels.export.config_busy = Some(format!("opening {}…", path.display()));
        self.jobs.open_config(path, false);
    }

    pub(super) fn load_demo(&mut self) {
        self.jobs.open_config(demo_config_path(), true);
    }
}
