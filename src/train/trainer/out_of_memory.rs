//! What the trainer thread reports when a step runs out of memory: a checkpoint of the last
//! good step, the device that failed with its planned and observed peaks, and the settings a
//! resume would use.

use super::super::error::{Phase, TrainError};
use super::super::events::Event;
use super::super::step::TrainingRun;
use super::{save, Emitter};

/// Out of memory: a checkpoint of the last good step, then the report with the fitted
/// settings a resume would use. Only a forward or backward failure leaves the weights as
/// they were; in the optimizer step some tensors may already be updated, so then the last
/// periodic checkpoint is the one to resume from.
pub(super) fn report_out_of_memory(
    run: &mut TrainingRun,
    err: &TrainError,
    memory: &super::super::memory::MemoryMonitor,
    em: &mut Emitter,
) {
    let TrainError::Step {
        step,
        phase,
        allocation_failure,
        device: failed_rank,
        ..
    } = err
    else {
        return;
    };
    let untouched = matches!(phase, Phase::Forward | Phase::Backward);
    if untouched && run.step_index() > 0 {
        save(run, em);
    }
    let checkpoint = run.last_checkpoint().map(|p| p.to_path_buf());
    let (refit, refit_error) = match super::super::oom::refit_after_oom(run.config()) {
        Ok(r) => (r.changes, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    let planned: Vec<Option<u64>> = super::super::plan_adapter::local_plan_request(run.config())
        .ok()
        .and_then(|req| crate::plan::plan(&req).ok())
        .map(|p| p.per_device.iter().map(|d| Some(d.peak_bytes)).collect())
        .unwrap_or_default();
    let labels: Vec<String> = run
        .placement()
        .devices
        .iter()
        .map(|d| d.label.clone())
        .collect();
    let observed: Vec<Option<u64>> = labels.iter().map(|l| memory.observed_peak(l)).collect();
    let index = failed_rank.unwrap_or_else(|| fullest_device(&planned, &observed));
    em.emit(Event::OutOfMemory {
        step: *step,
        phase: *phase,
        device: labels.get(index).cloned().unwrap_or_else(|| "cpu".into()),
        planned_bytes: planned.get(index).copied().flatten(),
        observed_bytes: observed.get(index).copied().flatten(),
        failure: *allocation_failure,
        checkpoint,
        refit,
        refit_error,
    });
}

/// The device that most likely failed when the error does not say: the one seen holding the
/// largest share of its planned peak (the first when nothing was observed).
fn fullest_device(planned: &[Option<u64>], observed: &[Option<u64>]) -> usize {
    let share = |i: usize| match (planned.get(i).copied().flatten(), observed[i]) {
        (Some(p), Some(o)) if p > 0 => o as f64 / p as f64,
        _ => 0.0,
    };
    // On a tie the earlier device wins (`max_by` alone would return the last).
    (0..observed.len())
        .max_by(|&a, &b| share(a).total_cmp(&share(b)).then(b.cmp(&a)))
        .unwrap_or(0)
}
