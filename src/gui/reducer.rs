//! The router of job reports: [`apply_job`] folds one [`JobOutput`] into the panel whose
//! request it answers (and the session, where a report edits the run config) and returns the
//! [`Action`]s that follow from it (a picked model folder is loaded, a fitted plan applied, a
//! message shown). No threads, no I/O: the app runs the actions, so each report's effect is
//! testable on bare panels, like [`crate::gui::run_state::RunState::apply`].

use std::path::PathBuf;

use tunestudio::train::RunConfig;

use super::action::Action;
use super::error::JobError;
use super::jobs::{JobOutput, OpenedConfig, PickTarget, Previewed};
use super::panels::Panels;
use super::playground;
use super::session::{push_recent, Session};
use super::shared::ExportKind;

/// Stores a request's answer: the value and no error, or the error and no value.
fn store<T>(result: Result<T, JobError>, value: &mut Option<T>, error: &mut Option<JobError>) {
    match result {
        Ok(v) => {
            *error = None;
            *value = Some(v);
        }
        Err(e) => {
            *error = Some(e);
            *value = None;
        }
    }
}

/// Folds `out` into the panels `p` and the session `s`; returns the actions it asks for.
/// Answers to requests that are no longer the latest of their kind (an older `seq`) change
/// nothing.
pub fn apply_job(s: &mut Session, p: &mut Panels, out: JobOutput) -> Vec<Action> {
    match out {
        JobOutput::Model { seq, result } if seq == p.model.seq => {
            p.model.loading = None;
            p.model.download_bytes = None;
            if let Ok(info) = &result {
                push_recent(&mut s.settings.recent_models, info.source.clone());
            }
            store(result, &mut p.model.info, &mut p.model.error);
        }
        JobOutput::ModelProgress { seq, bytes } => {
            if seq == p.model.seq && p.model.loading.is_some() {
                p.model.download_bytes = Some(bytes);
            }
        }
        JobOutput::HubCache(list) => p.model.cached = list,
        JobOutput::Dataset { seq, result } if seq == p.dataset.seq => {
            p.dataset.loading = false;
            store(result, &mut p.dataset.summary, &mut p.dataset.error);
        }
        JobOutput::Preview { seq, result } if seq == p.preview.seq => {
            return previewed(s, p, result);
        }
        JobOutput::Plan { seq, result } if seq == p.devices.plan.seq => {
            p.devices.plan.loading = false;
            let result = result.map(|(req, plan)| {
                p.devices.plan.request = Some(req);
                plan
            });
            store(result, &mut p.devices.plan.plan, &mut p.devices.plan.error);
        }
        // Stale answers.
        JobOutput::Model { .. }
        | JobOutput::Dataset { .. }
        | JobOutput::Preview { .. }
        | JobOutput::Plan { .. } => {}
        JobOutput::AutoFit(r) => {
            p.devices.plan.autofit_running = false;
            match r {
                // Auto-fit applies its answer at once and says what it changed.
                Ok(fit) => {
                    p.devices.plan.autofit = Some(fit);
                    return vec![Action::ApplyAutoFit];
                }
                Err(e) => p.devices.plan.error = Some(e),
            }
        }
        JobOutput::DryRun(result) => {
            p.devices.plan.dry_run_running = false;
            match result {
                Ok(report) => p.devices.plan.dry_run = Some(report),
                Err(e) => p.devices.plan.error = Some(e),
            }
        }
        JobOutput::Devices(inv) => {
            p.devices.loading = false;
            p.devices.inventory = Some(inv);
        }
        JobOutput::Export(r) => {
            p.export.running = false;
            p.export.result = Some(r);
        }
        JobOutput::Picked(target, path) => return picked(s, p, target, path),
        JobOutput::History(runs, errors) => {
            p.run.history.loading = false;
            p.run.history.runs = runs;
            p.run
                .history
                .overlay
                .retain(|&i| i < p.run.history.runs.len());
            p.run.history.error = (!errors.is_empty()).then(|| errors.join("\n"));
        }
        JobOutput::ConfigOpened { path, demo, result } => {
            return config_opened(s, p, path, demo, result);
        }
        JobOutput::ConfigSaved { path, sent, result } => config_saved(s, p, path, &sent, result),
        // The in-app picker is the app's window, not a panel: `StudioApp::handle_job` gives
        // it its listings before they reach here.
        JobOutput::Folder(_) => {}
        JobOutput::Playground(msg) => {
            return playground::on_message(&mut p.playground, msg)
                .into_iter()
                .map(Action::Playground)
                .collect();
        }
    }
    Vec::new()
}

/// Replaces the run config (opened from a file or the demo): the panels' fields that copy
/// it follow, and what was fitted to the old one is dropped.
pub fn use_config(s: &mut Session, p: &mut Panels, config: RunConfig, path: Option<PathBuf>) {
    s.set_config(config, path);
    let plan = &mut p.devices.plan;
    plan.autofit = None;
    plan.autofit_applied.clear();
    plan.dry_run = None;
    sync_inputs_from_config(s, p);
}

/// Copies the config's paths into the panels' text fields (after loading a config).
pub fn sync_inputs_from_config(s: &Session, p: &mut Panels) {
    p.model.source_input = s.config.model.source.clone();
    p.dataset.path_input = s.config.data.path.clone();
    // Never offer to overwrite the bundled demo: its copy goes to <output>/run.toml.
    p.export.config_path = match &s.config_path {
        Some(path) if !s.is_demo() => path.display().to_string(),
        _ => s.default_config_path().display().to_string(),
    };
    p.export.kind = if s.config.lora.enabled {
        ExportKind::Adapter
    } else {
        ExportKind::Full
    };
    p.export.checkpoint.clear();
    p.export.destination.clear();
    p.preview.start_row = 0;
    p.preview.highlight = None;
}

/// An opened run config (a file, or the demo project) replaces the current one, and its
/// model is loaded; an error stays where the user asked (the Export panel, or the config's
/// problems for the demo).
fn config_opened(
    s: &mut Session,
    p: &mut Panels,
    path: PathBuf,
    demo: bool,
    result: OpenedConfig,
) -> Vec<Action> {
    p.export.config_busy = None;
    match result {
        Ok((config, problems)) => {
            use_config(s, p, config, Some(path.clone()));
            s.config_problems = problems;
            if demo {
                s.settings.last_config = None;
            } else {
                push_recent(&mut s.settings.recent_configs, path.clone());
                s.settings.last_config = Some(path.clone());
                p.export.config_message = Some(Ok(format!("loaded {}", path.display())));
            }
        }
        Err(e) if demo => s.config_problems = vec![e.to_string()],
        Err(e) => {
            p.export.config_message = Some(Err(e));
            return Vec::new();
        }
    }
    vec![Action::LoadModel]
}

/// The run config was written to `path`: it is the config's file from now on, and, unless
/// the config was edited since Save was pressed (`sent`), the config as read back replaces it
/// (its paths absolute, later relative edits resolving against the new place).
fn config_saved(
    s: &mut Session,
    p: &mut Panels,
    path: PathBuf,
    sent: &RunConfig,
    result: Result<Option<Box<RunConfig>>, JobError>,
) {
    p.export.config_busy = None;
    match result {
        Ok(saved) => {
            p.export.config_message = Some(Ok(format!("saved {}", path.display())));
            push_recent(&mut s.settings.recent_configs, path.clone());
            s.settings.last_config = Some(path.clone());
            if let Some(saved) = saved.filter(|_| s.config == *sent) {
                s.config = *saved;
            }
            s.config_path = Some(path);
        }
        Err(e) => p.export.config_message = Some(Err(e)),
    }
}

/// A preview's answer: SFT rows or preference pairs, and for a new dataset the proposed
/// `max_length` (said in a toast).
fn previewed(s: &mut Session, p: &mut Panels, result: Result<Previewed, JobError>) -> Vec<Action> {
    p.preview.loading = false;
    // `max_length` cuts SFT rows only; pairs are cut at `[preference]`'s lengths.
    let propose = std::mem::take(&mut p.dataset.propose_max_length);
    let rows = match result {
        Ok(Previewed::Rollouts(rollouts)) => {
            p.preview.rollouts.set(rollouts);
            p.preview.pairs.clear();
            p.preview.preview = None;
            p.preview.error = None;
            return Vec::new();
        }
        Ok(Previewed::Pairs(pairs)) => {
            p.preview.rollouts.clear();
            p.preview.pairs.set(pairs);
            p.preview.preview = None;
            p.preview.error = None;
            return Vec::new();
        }
        Ok(Previewed::Rows(rows)) => Ok(rows),
        Err(e) => Err(e),
    };
    p.preview.pairs.clear();
    p.preview.rollouts.clear();
    let note = match (&rows, propose) {
        (Ok(rows), true) => propose_max_length(&mut s.config, p.model.info.as_ref(), rows),
        _ => None,
    };
    store(rows, &mut p.preview.preview, &mut p.preview.error);
    note.map(Action::Toast).into_iter().collect()
}

/// A file dialog's answer for a studio field.
fn picked(
    s: &mut Session,
    p: &mut Panels,
    target: PickTarget,
    path: std::path::PathBuf,
) -> Vec<Action> {
    let text = path.display().to_string();
    match target {
        PickTarget::ModelFolder => {
            p.model.source_input = text;
            return vec![Action::LoadModel];
        }
        PickTarget::DatasetFile | PickTarget::DatasetFolder => {
            p.dataset.path_input = text;
            return vec![Action::ScanDataset];
        }
        PickTarget::ValidationFile => s.config.data.validation_path = Some(text),
        PickTarget::OutputDir => s.config.output_dir = path,
        PickTarget::ConfigOpen => return vec![Action::LoadConfig(path)],
        PickTarget::ConfigSave => {
            p.export.config_path = text;
            return vec![Action::SaveConfig(path)];
        }
        PickTarget::Checkpoint => p.export.checkpoint = text,
        PickTarget::ExportDest => p.export.destination = text,
        PickTarget::RunDir => return vec![Action::AddRunDir(path)],
    }
    Vec::new()
}

/// Sets `max_length` from a new dataset's lengths (99th percentile, rounded up to 64, at most
/// the model's context) instead of keeping the previous project's cut; returns what it says.
fn propose_max_length(
    config: &mut tunestudio::train::RunConfig,
    model: Option<&crate::gui::shared::ModelInfo>,
    p: &tunestudio::data::DataPreview,
) -> Option<String> {
    let mut len = p.stats.histogram.suggested_max_length()?;
    if let Some(ctx) = model.map(|m| m.config.max_position_embeddings) {
        len = len.min(ctx.max(64));
    }
    if len == config.data.max_length {
        return None;
    }
    config.data.max_length = len;
    Some(format!(
        "max_length {len}: the 99th-percentile row length of this dataset, rounded up to 64"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gui::error::ErrorKind;
    use crate::gui::session::Settings;
    use tunestudio::train::RunConfig;

    fn state() -> (Session, Panels) {
        let s = Session::new(RunConfig::default(), None, Settings::default());
        (s, Panels::default())
    }

    #[test]
    fn only_the_latest_request_is_kept() {
        let (mut s, mut p) = state();
        p.dataset.seq = 2;
        p.dataset.loading = true;
        let stale = JobOutput::Dataset {
            seq: 1,
            result: Err(JobError::of(ErrorKind::Data, "old")),
        };
        assert!(apply_job(&mut s, &mut p, stale).is_empty());
        assert!(p.dataset.loading && p.dataset.error.is_none());
        let fresh = JobOutput::Dataset {
            seq: 2,
            result: Err(JobError::of(ErrorKind::Io, "gone")),
        };
        assert!(apply_job(&mut s, &mut p, fresh).is_empty());
        assert!(!p.dataset.loading);
        assert_eq!(
            p.dataset.error.as_ref().map(|e| e.kind),
            Some(ErrorKind::Io)
        );
        assert!(p.dataset.summary.is_none());
    }

    #[test]
    fn a_picked_model_folder_is_loaded() {
        let (mut s, mut p) = state();
        let actions = apply_job(
            &mut s,
            &mut p,
            JobOutput::Picked(PickTarget::ModelFolder, "/models/tiny".into()),
        );
        assert!(matches!(actions.as_slice(), [Action::LoadModel]));
        assert_eq!(p.model.source_input, "/models/tiny");
        let actions = apply_job(
            &mut s,
            &mut p,
            JobOutput::Picked(PickTarget::ExportDest, "/out".into()),
        );
        assert!(actions.is_empty());
        assert_eq!(p.export.destination, "/out");
    }

    #[test]
    fn a_picked_prompt_list_is_read_by_a_job() {
        let (mut s, mut p) = state();
        let msg = playground::picked(playground::PgPick::Prompts, Some("p.txt".into()));
        let actions = apply_job(
            &mut s,
            &mut p,
            JobOutput::Playground(msg.expect("a report")),
        );
        assert!(matches!(
            actions.as_slice(),
            [Action::Playground(playground::PgAction::ReadPrompts(_))]
        ));
        assert!(p.playground.prompts_loading);
    }
}
