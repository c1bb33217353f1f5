//! One file per panel of the left navigation. Each `show` draws from
//! [`crate::gui::state::AppState`], edits the run config in place, and queues
//! [`crate::gui::app::Action`]s for anything that needs the app (jobs, trainer).

pub mod dataset;
pub mod devices;
pub mod export;
pub mod model;
pub mod preview;
pub mod run;
pub mod training;
