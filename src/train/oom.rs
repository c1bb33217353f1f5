//! Out of memory as a report and a way out: which device ran out in which phase, the
//! planner's fixes, and settings fitted to what the device proved it can hold — applied to
//! the run config so the run resumes from its last good step with the same effective batch.
//!
//! [`INJECT_OOM_ENV`] makes one step fail as an allocation failure would (`3:backward`), so
//! all of this is tested on the CPU, where a real allocation failure aborts the process;
//! [`TrainerOptions::inject_oom`](super::TrainerOptions::inject_oom) does the same for one
//! trainer thread only (the studio's tests, where other runs share the process).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};

use super::config::RunConfig;
use super::error::{Phase, TrainError};

/// Test switch: `STEP:PHASE` (`forward`, `backward` or `optimizer`) makes that step fail
/// once per process with an out-of-memory error, before anything of the step is applied.
pub const INJECT_OOM_ENV: &str = "TUNESTUDIO_INJECT_OOM";

/// Share of the failed peak the refit aims under: the device held less than the plan's
/// peak, and the planner's ±3 % plus the allocator's slack must fit below what it held.
const REFIT_CAPACITY_FRACTION: f64 = 0.85;

static INJECTED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// This trainer thread's own injection (`TrainerOptions::inject_oom`), taken when it fires.
    static THREAD_INJECTION: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Sets the injection of the calling (trainer) thread: `STEP:PHASE` as [`INJECT_OOM_ENV`].
pub(crate) fn inject_on_this_thread(spec: Option<String>) {
    THREAD_INJECTION.with(|t| *t.borrow_mut() = spec);
}

/// Whether `spec` (`STEP:PHASE`) names `step` in `phase`.
fn spec_matches(spec: &str, step: u64, phase: Phase) -> bool {
    spec.split_once(':').is_some_and(|(at, when)| {
        at.trim().parse::<u64>().ok() == Some(step)
            && when.trim().eq_ignore_ascii_case(&phase.to_string())
    })
}

/// The injected failure for `step` in `phase`, when this thread's injection or
/// [`INJECT_OOM_ENV`] asks for it (once per thread, once per process respectively).
pub(crate) fn injected_failure(step: u64, phase: Phase) -> Option<super::error::InjectedOom> {
    let own = THREAD_INJECTION.with(|t| {
        let mut t = t.borrow_mut();
        let fires = t.as_deref().is_some_and(|s| spec_matches(s, step, phase));
        fires.then(|| t.take()).flatten()
    });
    if let Some(spec) = own {
        return Some(super::error::InjectedOom(format!(
            "out of memory: allocation failed (injected by the trainer option inject_oom={spec})"
        )));
    }
    let spec = std::env::var(INJECT_OOM_ENV).ok()?;
    (spec_matches(&spec, step, phase) && !INJECTED.swap(true, Ordering::SeqCst)).then(|| {
        super::error::InjectedOom(format!(
            "out of memory: allocation failed (injected by {INJECT_OOM_ENV}={spec})"
        ))
    })
}

/// Whether a training error is a device running out of memory.
pub fn is_out_of_memory(err: &TrainError) -> bool {
    match err {
        TrainError::Step {
            allocation_failure, ..
        } => allocation_failure.is_some(),
        _ => false,
    }
}

/// ", planned 3.1 GiB, seen 3.4 GiB" for an out-of-memory line (what is known of the two).
pub fn planned_and_observed(planned: Option<u64>, observed: Option<u64>) -> String {
    let mut out = String::new();
    if let Some(p) = planned {
        out.push_str(&format!(", planned {}", crate::units::format_bytes(p)));
    }
    if let Some(o) = observed {
        out.push_str(&format!(", seen {}", crate::units::format_bytes(o)));
    }
    out
}

/// Settings for the same run that fit what the device held, and what changed.
#[derive(Debug, Clone)]
pub struct OomRefit {
    /// The run config with the fitted settings (same effective batch, precision and LoRA,
    /// so the last checkpoint resumes into it).
    pub config: RunConfig,
    /// Each change in words.
    pub changes: Vec<String>,
}

/// Why no settings resume the run after an out-of-memory stop.
#[derive(Debug, thiserror::Error)]
pub enum RefitError {
    /// The run could not be planned (its model's config, a setting, the devices).
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    /// No settings with the same effective batch fit what the device held.
    #[error("no settings with the same effective batch fit what the device held; lower data.max_length or train LoRA")]
    NoFit,
    /// Only changes a checkpoint cannot resume into would fit.
    #[error("only a change a checkpoint cannot resume into would fit ({refused}); start a new run with those settings ({changes})")]
    NotResumable {
        /// The refused changes, in words.
        refused: String,
        /// Every change the fit makes, in words.
        changes: String,
    },
}

/// Fits `config` to a device that ran out at the plan's predicted peak: every device is
/// planned with at most [`REFIT_CAPACITY_FRACTION`] of that peak, and auto-fit searches
/// settings that keep the effective batch, written into the config by the one edit
/// ([`super::apply_plan_request`]). Changes a checkpoint could not resume into (precision,
/// LoRA, QLoRA) are refused with the reason.
pub fn refit_after_oom(config: &RunConfig) -> Result<OomRefit, RefitError> {
    let req = super::plan_adapter::local_plan_request(config)?;
    let plan = crate::plan::plan(&req)?;
    let mut squeezed = req.clone();
    for (spec, d) in squeezed.devices.iter_mut().zip(&plan.per_device) {
        let held = (d.peak_bytes as f64 * REFIT_CAPACITY_FRACTION) as u64;
        spec.capacity_bytes = spec.capacity_bytes.min(held.max(1));
    }
    let fit = crate::plan::auto_fit(&squeezed)?;
    if !fit.found {
        return Err(RefitError::NoFit);
    }
    let refused: Vec<String> = fit
        .steps
        .iter()
        .filter(|c| !c.keeps_checkpoints())
        .map(|c| c.describe(&req))
        .collect();
    if !refused.is_empty() {
        return Err(RefitError::NotResumable {
            refused: refused.join("; "),
            changes: fit.changes.join("; "),
        });
    }
    let mut fitted = config.clone();
    super::apply_plan::apply_plan_request(&mut fitted, &fit.request);
    Ok(OomRefit {
        config: fitted,
        changes: fit.changes,
    })
}
