//! One module per panel of the left navigation (the Playground is `gui/playground/`). Each
//! owns its state (a `…Panel` struct: its fields, its job answers; Training's has none) and its
//! view (`show`); each edits the shared run config
//! ([`crate::gui::session::Session`]) in place, reads the other panels' results only through
//! the [`crate::gui::shared::PanelContext`] the app lends it, and queues
//! [`crate::gui::action::Action`]s for anything that needs the app (jobs, trainer). No panel
//! imports another (`tests/it/layering.rs`).

pub mod dataset;
pub mod devices;
pub mod export;
pub mod model;
pub mod preview;
pub mod run;
pub mod training;

/// Every panel's state, side by side (the app routes job answers to the one they belong to).
#[derive(Default)]
pub struct Panels {
    /// Model panel.
    pub model: model::ModelPanel,
    /// Dataset panel.
    pub dataset: dataset::DatasetPanel,
    /// Preview panel.
    pub preview: preview::PreviewPanel,
    /// Training panel (no state: it edits the run config).
    pub training: training::TrainingPanel,
    /// GPUs & memory panel, with the memory plan.
    pub devices: devices::DevicesPanel,
    /// Run panel: the live run and the history.
    pub run: run::RunPanel,
    /// Export panel.
    pub export: export::ExportPanel,
    /// Playground panel.
    pub playground: crate::gui::playground::PlaygroundState,
}
