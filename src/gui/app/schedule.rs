//! What the background jobs depend on, and starting them when it changes: the keys of the
//! dataset scan, the preview and the memory plan are functions of the session and of the
//! panels' results (no disk is read here; the jobs resolve paths and measure files on their
//! own threads).

use tunestudio::devices::DeviceInventory;
use tunestudio::plan::{DeviceSpec, TrainedTokens};
use tunestudio::train::RunConfig;

use super::StudioApp;
use crate::gui::error::{ErrorKind, JobError};
use crate::gui::panels::preview::PreviewPanel;
use crate::gui::panels::Panels;
use crate::gui::session::Session;
use crate::gui::shared::PlanKey;

/// Whether the settings `key` changed since the last request: if so, records it and
/// returns the new request's sequence number (answers to older numbers are dropped).
fn next_request<K: PartialEq>(key: K, last: &mut K, seq: &mut u64) -> Option<u64> {
    if key == *last {
        return None;
    }
    *last = key;
    *seq += 1;
    Some(*seq)
}

/// Key of everything the preview depends on: the settings as written, with the folder they
/// are relative to, and the first row shown. No disk is read here (the job resolves the
/// paths).
pub fn preview_key(config: &RunConfig, start_row: usize) -> String {
    format!(
        "{}|{}|{:?}|{}|{}|{:?}",
        config.base_dir.display(),
        config.model.source.trim(),
        config.data,
        config.training.micro_batch,
        start_row,
        config.preference.limits(),
    )
}

/// The preview's request key: the settings' key ([`preview_key`]), except for a GRPO run,
/// whose preview loads the model and samples with it: that runs when the user asks (the
/// Preview's "Sample rollouts"), not on every edit of a setting (`None` until then).
fn preview_request_key(dir: &str, config: &RunConfig, preview: &PreviewPanel) -> Option<String> {
    if config.training.method.is_grpo() {
        let asked = preview.rollouts.requests;
        return (asked > 0).then(|| format!("rollouts|{asked}"));
    }
    Some(format!("{dir}|{}", preview_key(config, preview.start_row)))
}

/// Key of everything the dataset summary depends on (as written; the job resolves it).
pub fn dataset_key(config: &RunConfig) -> String {
    let d = &config.data;
    format!(
        "{}|{}|{:?}|{:?}|{}|{}",
        config.base_dir.display(),
        d.path,
        d.validation_path,
        d.columns,
        d.validation_ratio,
        d.seed
    )
}

/// Key of everything the plan depends on (`None` until a model is loaded): the adapter's
/// inputs, compared with `==`. It reads no disk: the plan job derives the request
/// (`tunestudio::train::plan_request`, which measures the model's and data's files) on its
/// own thread.
pub fn plan_key(session: &Session, panels: &Panels) -> Option<PlanKey> {
    let model = panels.model.info.as_ref()?.config.clone();
    let inventory = panels.devices.inventory.as_ref();
    Some(PlanKey {
        config: session.config.clone(),
        model,
        devices: device_specs(&session.config, inventory),
        trained_tokens: trained_tokens(&session.config, &panels.preview),
        inventory_devices: inventory.map(|i| i.devices.len()),
    })
}

/// The trained tokens of the dataset, from the Preview's full scan of the training split:
/// the plan's loss rows. `None` while a scan is missing, partial or running, and with
/// packing (the scan's samples are not packed).
pub fn trained_tokens(config: &RunConfig, preview: &PreviewPanel) -> Option<TrainedTokens> {
    // A preference step's rows are a pair's prompt and completions, not the SFT samples
    // the scan counted: the pair preview's scan gives the longest pair.
    if config.training.method.is_preference() {
        return preview.pairs.trained_tokens(config);
    }
    // A GRPO step's rows are sampled: the plan is sized by the lengths' limits.
    if config.training.method.is_grpo() {
        return None;
    }
    let p = preview.preview.as_ref()?;
    let data = &config.data;
    if !p.full_scan || preview.loading || data.packing || p.max_length != data.max_length {
        return None;
    }
    Some(TrainedTokens::from_counts(
        p.max_length,
        p.stats.longest_kept_tokens,
        p.stats.trained_tokens_largest_first.iter().copied(),
    ))
}

/// The devices the plan runs on: the selected ones, sized from discovery.
pub fn device_specs(
    config: &RunConfig,
    inventory: Option<&DeviceInventory>,
) -> Result<Vec<DeviceSpec>, String> {
    let labels = &config.devices.devices;
    if labels.is_empty() {
        return Err("no device selected: tick at least one device in GPUs & memory".into());
    }
    let mut out = Vec::new();
    for label in labels {
        let label = label.trim();
        if let Some(inv) = inventory {
            if label == "cpu" {
                if let Some(cpu) = inv.cpu() {
                    out.push(DeviceSpec::cpu(cpu.total_bytes));
                    continue;
                }
            }
            if let Some(n) = label
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
            {
                let gpu = inv
                    .gpu_by_cuda_ordinal(n)
                    .or_else(|| inv.gpus().find(|g| g.index == n));
                if let Some(g) = gpu {
                    let cap = g.total_bytes.saturating_sub(g.other_processes_bytes());
                    let mut spec = DeviceSpec::cuda(n, cap);
                    spec.name = format!("GPU {n}");
                    out.push(spec);
                    continue;
                }
            }
        }
        match tunestudio::devices::parse_local_devices(label) {
            Ok(mut d) => out.append(&mut d),
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(out)
}

impl StudioApp {
    /// Starts background work the current settings need (dataset scan, preview, plan).
    pub(super) fn schedule_jobs(&mut self) {
        let s = &self.session;
        let p = &mut self.panels;
        let dataset = &mut p.dataset;
        if let Some(seq) = next_request(dataset_key(&s.config), &mut dataset.key, &mut dataset.seq)
        {
            dataset.loading = true;
            self.jobs.scan_dataset(seq, s.config.clone());
        }
        if let Some(dir) = p.model.info.as_ref().map(|i| i.dir.display().to_string()) {
            let preview = &mut p.preview;
            let key = preview_request_key(&dir, &s.config, preview);
            let request = key.and_then(|k| next_request(k, &mut preview.key, &mut preview.seq));
            if let Some(seq) = request {
                if s.config.training.method.is_grpo() {
                    preview.rollouts.sampling(&s.config, preview.start_row);
                }
                preview.loading = true;
                let rows = (
                    preview.start_row,
                    s.config.training.micro_batch.clamp(1, 16),
                );
                let limits = s.config.preference.limits();
                self.jobs.preview(seq, dir, s.config.clone(), rows, limits);
            }
        }
        let Some(key) = plan_key(s, p) else {
            return;
        };
        let plan = &mut p.devices.plan;
        let Some(seq) = next_request(Some(key.clone()), &mut plan.key, &mut plan.seq) else {
            return;
        };
        match key.devices {
            Ok(devices) => {
                plan.loading = true;
                self.jobs
                    .plan(seq, key.model, key.config, devices, key.trained_tokens);
            }
            Err(e) => {
                plan.error = Some(JobError::of(ErrorKind::Config, e));
                plan.plan = None;
            }
        }
    }

    /// What the plan depends on now ([`plan_key`]); the studio tests wait on it.
    #[cfg(test)]
    pub fn plan_key(&self) -> Option<PlanKey> {
        plan_key(&self.session, &self.panels)
    }

    /// Where Export saves the config, which the CLI command trains.
    pub fn train_config_path(&self) -> String {
        let p = self.panels.export.config_path.trim();
        if p.is_empty() {
            self.session.default_config_path().display().to_string()
        } else {
            p.to_string()
        }
    }

    /// `Some(command)` when the config plans for a machine this one is not (see
    /// [`crate::gui::planned::planning_only`]).
    pub fn planning_only(&self) -> Option<String> {
        crate::gui::planned::planning_only(
            &self.session.config,
            self.panels.devices.inventory.as_ref(),
            &self.train_config_path(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gui::session::Settings;

    #[test]
    fn no_device_selected_is_the_plans_reason_not_an_empty_plan() {
        let mut config = RunConfig::default();
        config.devices.devices.clear();
        let why = device_specs(&config, None).expect_err("no devices");
        assert!(why.contains("no device selected"), "{why}");
    }

    #[test]
    fn the_plan_waits_for_a_model_and_the_preview_follows_the_row_shown() {
        let session = Session::new(RunConfig::default(), None, Settings::default());
        assert!(plan_key(&session, &Panels::default()).is_none());
        let config = &session.config;
        assert_ne!(preview_key(config, 0), preview_key(config, 8));
        let mut other = config.clone();
        other.data.path = "other.jsonl".into();
        assert_ne!(dataset_key(config), dataset_key(&other));
    }
}
