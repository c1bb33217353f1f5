//! The router of job reports: [`apply_job`] folds one [`JobOutput`] into the panel whose
//! request it answers (and the session, where a report edits the run config) and returns the
//! [`Action`]s that follow from it (a picked model folder is loaded, a fitted plan applied, a
//! message shown). No threads, no I/O: the app runs the actions, so each report's effect is
//! testable on bare panels, like [`crate::gui::run_state::RunState::apply`].

use std::path::{Path, PathBuf};

use tunestudio::train::RunConfig;

use super::action::Action;
use super::error::JobError;
use super::jobs::{FolderProposal, JobOutput, OpenedConfig, PickTarget, Previewed};
use super::panels::Panels;
use super::playground;
use super::session::{push_recent, Panel, Session};
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
            return config_opened(s, p, path, demo, *result);
        }
        JobOutput::ConfigSaved { path, sent, result } => config_saved(s, p, path, &sent, result),
        // The in-app picker is the app's window, not a panel: `StudioApp::handle_job` gives
        // it its listings before they reach here.
        JobOutput::Folder(_) => {}
        JobOutput::OutputChecked {
            seq,
            config,
            output_dir,
            existing,
        } => return output_checked(s, p, seq, (config, output_dir), existing),
        JobOutput::OutputProposed { request, proposed } => {
            return output_proposed(s, p, &request, proposed);
        }
        JobOutput::Refitted { seq, result } => return refitted(s, p, seq, result),
        JobOutput::LatestCheckpoint {
            output_dir,
            latest,
            use_it,
        } => return latest_checkpoint(s, p, &output_dir, latest, use_it),
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

/// Start's check of the output folder: another run there is asked about (the Run panel offers
/// resuming it or a new folder, as the CLI refuses); with none, the run starts with the config
/// as it was when Start was pressed.
fn output_checked(
    s: &mut Session,
    p: &mut Panels,
    seq: u64,
    (config, output_dir): (Box<RunConfig>, PathBuf),
    existing: Option<String>,
) -> Vec<Action> {
    let pending = &mut p.run.pending;
    if seq != pending.check_seq || !pending.checking {
        return Vec::new();
    }
    pending.checking = false;
    s.panel = Panel::Run;
    match existing {
        Some(existing) => {
            p.run.live.existing_run = Some(existing);
            Vec::new()
        }
        None => vec![Action::StartChecked { config, output_dir }],
    }
}

/// A new project's fresh output folder: written into the config only while the config is
/// still of the project it was found for (the same model, dataset and output folder), with
/// the run config's path when the user did not choose one (the old folder's default, or the
/// demo's); then Start, when "Train in a new folder" asked for it.
fn output_proposed(
    s: &mut Session,
    p: &mut Panels,
    request: &FolderProposal,
    proposed: PathBuf,
) -> Vec<Action> {
    let pending = &mut p.run.pending;
    if request.seq != pending.proposal_seq || !pending.proposing {
        return Vec::new();
    }
    pending.proposing = false;
    let start = std::mem::take(&mut pending.start_after_proposal);
    let c = &s.config;
    let same_project = c.model.source == request.model
        && c.data.path == request.data
        && c.output_dir == request.from;
    let mut follow = Vec::new();
    if same_project && proposed != c.output_dir {
        let old_default = s.default_config_path().display().to_string();
        s.config.output_dir = proposed.clone();
        let demo = s.is_demo();
        if demo || p.export.config_path == old_default {
            p.export.config_path = s.default_config_path().display().to_string();
        }
        if demo {
            s.config_path = None;
        }
        follow.push(Action::Toast(format!(
            "new project: output folder {}",
            proposed.display()
        )));
    }
    if start {
        follow.push(Action::Start);
    }
    follow
}

/// The out-of-memory refit: its settings replace the config's and the run resumes from its
/// checkpoint; or the status bar says why none resumes it.
fn refitted(
    s: &mut Session,
    p: &mut Panels,
    seq: u64,
    result: Result<(Box<RunConfig>, Vec<String>), JobError>,
) -> Vec<Action> {
    let pending = &mut p.run.pending;
    if seq != pending.refit_seq || !pending.refitting {
        return Vec::new();
    }
    pending.refitting = false;
    match result {
        Ok((config, changes)) => {
            s.config = *config;
            vec![
                Action::Toast(format!("resuming with: {}", changes.join("; "))),
                Action::StartResumingLatest,
            ]
        }
        Err(e) => vec![Action::Toast(e.to_string())],
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

/// The newest checkpoint of an output folder, into the Export panel's Checkpoint field: when
/// the user asked, whatever the field held (or a toast when there is none); as the empty
/// field's default, only while it is empty and the folder is still the run's.
fn latest_checkpoint(
    s: &Session,
    p: &mut Panels,
    output_dir: &Path,
    latest: Option<PathBuf>,
    use_it: bool,
) -> Vec<Action> {
    let ep = &mut p.export;
    match latest {
        Some(ck) if use_it => ep.checkpoint = ck.display().to_string(),
        None if use_it => {
            return vec![Action::Toast(
                "no checkpoint in the output folder yet".into(),
            )]
        }
        Some(ck) if ep.checkpoint.is_empty() && s.output_dir() == output_dir => {
            ep.checkpoint = ck.display().to_string();
        }
        _ => {}
    }
    Vec::new()
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

    fn proposal(seq: u64, s: &Session) -> FolderProposal {
        FolderProposal {
            seq,
            model: s.config.model.source.clone(),
            data: s.config.data.path.clone(),
            from: s.config.output_dir.clone(),
            parent: "runs".into(),
            base: "/project".into(),
            name: "m-d".into(),
        }
    }

    #[test]
    fn a_proposed_folder_is_written_only_for_the_project_it_was_found_for() {
        let (mut s, mut p) = state();
        s.config.data.path = "old.json".into();
        p.run.pending.proposal_seq = 1;
        p.run.pending.proposing = true;
        let asked = proposal(1, &s);
        // The dataset changed while the folder was looked for: the answer is dropped.
        s.config.data.path = "other.json".into();
        let before = s.config.output_dir.clone();
        let out = JobOutput::OutputProposed {
            request: asked,
            proposed: "runs/m-d".into(),
        };
        assert!(apply_job(&mut s, &mut p, out).is_empty());
        assert_eq!(s.config.output_dir, before);
        assert!(!p.run.pending.proposing);
        // An older request's answer is dropped too; the latest one is written, then Start.
        p.run.pending.proposal_seq = 3;
        p.run.pending.proposing = true;
        p.run.pending.start_after_proposal = true;
        let stale = JobOutput::OutputProposed {
            request: proposal(2, &s),
            proposed: "runs/m-d-2".into(),
        };
        assert!(apply_job(&mut s, &mut p, stale).is_empty());
        assert!(p.run.pending.proposing);
        let fresh = JobOutput::OutputProposed {
            request: proposal(3, &s),
            proposed: "runs/m-d-3".into(),
        };
        let follow = apply_job(&mut s, &mut p, fresh);
        assert_eq!(s.config.output_dir, PathBuf::from("runs/m-d-3"));
        assert!(
            matches!(follow.as_slice(), [Action::Toast(_), Action::Start]),
            "{follow:?}"
        );
        assert!(!p.run.pending.busy());
    }

    #[test]
    fn a_checked_output_folder_starts_the_run_or_asks() {
        let (mut s, mut p) = state();
        p.run.pending.check_seq = 1;
        p.run.pending.checking = true;
        let config = Box::new(s.config.clone());
        let asked = JobOutput::OutputChecked {
            seq: 1,
            config: config.clone(),
            output_dir: "/out".into(),
            existing: Some("`/out` already holds a run".into()),
        };
        assert!(apply_job(&mut s, &mut p, asked).is_empty());
        assert!(p.run.live.existing_run.is_some());
        assert_eq!(s.panel, Panel::Run);
        p.run.pending.check_seq = 2;
        p.run.pending.checking = true;
        let free = JobOutput::OutputChecked {
            seq: 2,
            config,
            output_dir: "/out".into(),
            existing: None,
        };
        let follow = apply_job(&mut s, &mut p, free);
        assert!(
            matches!(follow.as_slice(), [Action::StartChecked { .. }]),
            "{follow:?}"
        );
        assert!(!p.run.pending.busy());
    }
}
