//! The reducer of job reports: [`apply_job`] folds one [`JobOutput`] into the
//! [`AppState`] and returns the [`Action`]s that follow from it (a picked model folder is
//! loaded, a fitted plan applied). No threads, no I/O: the app runs the actions, so each
//! report's effect is testable on a bare state, like [`crate::gui::state::RunState::apply`].

use super::app::Action;
use super::error::JobError;
use super::jobs::{JobOutput, PickTarget, Previewed};
use super::playground;
use super::state::{push_recent, AppState};

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

/// Folds `out` into `s`; returns the actions it asks for. Answers to requests that are no
/// longer the latest of their kind (an older `seq`) change nothing.
pub fn apply_job(s: &mut AppState, out: JobOutput) -> Vec<Action> {
    match out {
        JobOutput::Model { seq, result } if seq == s.model.seq => {
            s.model.loading = None;
            s.model.download_bytes = None;
            if let Ok(info) = &result {
                push_recent(&mut s.settings.recent_models, info.source.clone());
            }
            store(result, &mut s.model.info, &mut s.model.error);
        }
        JobOutput::ModelProgress { seq, bytes } => {
            if seq == s.model.seq && s.model.loading.is_some() {
                s.model.download_bytes = Some(bytes);
            }
        }
        JobOutput::HubCache(list) => s.model.cached = list,
        JobOutput::Dataset { seq, result } if seq == s.dataset.seq => {
            s.dataset.loading = false;
            store(result, &mut s.dataset.summary, &mut s.dataset.error);
        }
        JobOutput::Preview { seq, result } if seq == s.preview.seq => {
            s.preview.loading = false;
            // `max_length` cuts SFT rows only; pairs are cut at `[preference]`'s lengths.
            let propose = std::mem::take(&mut s.dataset.propose_max_length);
            let rows = match result {
                Ok(Previewed::Pairs(p)) => {
                    s.preview.pairs.set(p);
                    s.preview.preview = None;
                    s.preview.error = None;
                    return Vec::new();
                }
                Ok(Previewed::Rows(p)) => Ok(p),
                Err(e) => Err(e),
            };
            s.preview.pairs.clear();
            if let (Ok(p), true) = (&rows, propose) {
                propose_max_length(s, p);
            }
            store(rows, &mut s.preview.preview, &mut s.preview.error);
        }
        JobOutput::Plan { seq, result } if seq == s.plan.seq => {
            s.plan.loading = false;
            let result = result.map(|(req, plan)| {
                s.plan.request = Some(req);
                plan
            });
            store(result, &mut s.plan.plan, &mut s.plan.error);
        }
        // Stale answers.
        JobOutput::Model { .. }
        | JobOutput::Dataset { .. }
        | JobOutput::Preview { .. }
        | JobOutput::Plan { .. } => {}
        JobOutput::AutoFit(r) => {
            s.plan.autofit_running = false;
            match r {
                // Auto-fit applies its answer at once and says what it changed.
                Ok(fit) => {
                    s.plan.autofit = Some(fit);
                    return vec![Action::ApplyAutoFit];
                }
                Err(e) => s.plan.error = Some(e),
            }
        }
        JobOutput::DryRun(result) => {
            s.plan.dry_run_running = false;
            match result {
                Ok(report) => s.plan.dry_run = Some(report),
                Err(e) => s.plan.error = Some(e),
            }
        }
        JobOutput::Devices(inv) => {
            s.devices.loading = false;
            s.devices.inventory = Some(inv);
        }
        JobOutput::Export(r) => {
            s.export.running = false;
            s.export.result = Some(r);
        }
        JobOutput::Picked(target, path) => return picked(s, target, path),
        JobOutput::History(runs, errors) => {
            s.history.loading = false;
            s.history.runs = runs;
            s.history.overlay.retain(|&i| i < s.history.runs.len());
            s.history.error = (!errors.is_empty()).then(|| errors.join("\n"));
        }
        JobOutput::Playground(msg) => {
            return playground::on_message(&mut s.playground, msg)
                .into_iter()
                .map(Action::Playground)
                .collect();
        }
    }
    Vec::new()
}

/// A file dialog's answer for a studio field.
fn picked(s: &mut AppState, target: PickTarget, path: std::path::PathBuf) -> Vec<Action> {
    let text = path.display().to_string();
    match target {
        PickTarget::ModelFolder => {
            s.model.source_input = text;
            return vec![Action::LoadModel];
        }
        PickTarget::DatasetFile | PickTarget::DatasetFolder => {
            s.dataset.path_input = text;
            return vec![Action::ScanDataset];
        }
        PickTarget::ValidationFile => s.config.data.validation_path = Some(text),
        PickTarget::OutputDir => s.config.output_dir = path,
        PickTarget::ConfigOpen => return vec![Action::LoadConfig(path)],
        PickTarget::ConfigSave => {
            s.export.config_path = text;
            return vec![Action::SaveConfig(path)];
        }
        PickTarget::Checkpoint => s.export.checkpoint = text,
        PickTarget::ExportDest => s.export.destination = text,
        PickTarget::RunDir => return vec![Action::AddRunDir(path)],
    }
    Vec::new()
}

/// Sets `max_length` from a new dataset's lengths (99th percentile, rounded up to 64, at most
/// the model's context) instead of keeping the previous project's cut.
fn propose_max_length(s: &mut AppState, p: &tunestudio::data::DataPreview) {
    let Some(mut len) = p.stats.histogram.suggested_max_length() else {
        return;
    };
    if let Some(ctx) = s
        .model
        .info
        .as_ref()
        .map(|m| m.config.max_position_embeddings)
    {
        len = len.min(ctx.max(64));
    }
    if len != s.config.data.max_length {
        s.config.data.max_length = len;
        s.toast(format!(
            "max_length {len}: the 99th-percentile row length of this dataset, rounded up to 64"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gui::error::ErrorKind;
    use crate::gui::state::Settings;
    use tunestudio::train::RunConfig;

    fn state() -> AppState {
        AppState::new(RunConfig::default(), None, Settings::default())
    }

    #[test]
    fn only_the_latest_request_is_kept() {
        let mut s = state();
        s.dataset.seq = 2;
        s.dataset.loading = true;
        let stale = JobOutput::Dataset {
            seq: 1,
            result: Err(JobError::of(ErrorKind::Data, "old")),
        };
        assert!(apply_job(&mut s, stale).is_empty());
        assert!(s.dataset.loading && s.dataset.error.is_none());
        let fresh = JobOutput::Dataset {
            seq: 2,
            result: Err(JobError::of(ErrorKind::Io, "gone")),
        };
        assert!(apply_job(&mut s, fresh).is_empty());
        assert!(!s.dataset.loading);
        assert_eq!(
            s.dataset.error.as_ref().map(|e| e.kind),
            Some(ErrorKind::Io)
        );
        assert!(s.dataset.summary.is_none());
    }

    #[test]
    fn a_picked_model_folder_is_loaded() {
        let mut s = state();
        let actions = apply_job(
            &mut s,
            JobOutput::Picked(PickTarget::ModelFolder, "/models/tiny".into()),
        );
        assert!(matches!(actions.as_slice(), [Action::LoadModel]));
        assert_eq!(s.model.source_input, "/models/tiny");
        let actions = apply_job(
            &mut s,
            JobOutput::Picked(PickTarget::ExportDest, "/out".into()),
        );
        assert!(actions.is_empty());
        assert_eq!(s.export.destination, "/out");
    }

    #[test]
    fn a_picked_prompt_list_is_read_by_a_job() {
        let mut s = state();
        let msg = playground::picked(playground::PgPick::Prompts, Some("p.txt".into()));
        let actions = apply_job(&mut s, JobOutput::Playground(msg.expect("a report")));
        assert!(matches!(
            actions.as_slice(),
            [Action::Playground(playground::PgAction::ReadPrompts(_))]
        ));
        assert!(s.playground.prompts_loading);
    }
}
