//! One way to turn trainer [`Event`]s into something: the [`EventRenderer`] trait, a method per
//! event kind, and [`dispatch`], the only exhaustive match over [`Event`] a front end needs
//! (burn-train's renderer shape). The studio's run state, the CLI's progress line and the
//! curves read back from `metrics.jsonl` ([`super::RunCurves`]) are renderers.
//!
//! The methods receive borrowed views of their event's fields ([`Step`], [`Started`], ...);
//! events of one or two fields pass them as arguments.

use std::collections::BTreeMap;
use std::path::Path;

use super::error::Phase;
use super::events::{Event, FinishReason, LintFinding, MemoryScope, SampledGroup};
use super::placement::DeviceLayers;
use crate::mem::alloc_failure::AllocationFailure;

/// Something that renders trainer events: one method per [`Event`] kind, named as
/// [`Event::kind`] names it, called by [`dispatch`] in the order the events arrive.
///
/// No method has a default body, so every renderer says what it does with every kind (an
/// empty body is a decision, not an oversight).
///
/// # Adding an event kind
/// 1. Add the variant to [`Event`] (`train/events.rs`) and its name to [`Event::kind`].
/// 2. Add its method here (for more than two fields, a view struct in this file, built by a
///    function like [`step`]'s that binds every field).
/// 3. Add its arm to [`dispatch`].
/// 4. The compiler then lists every renderer that lacks the method: the studio's run state,
///    the CLI's progress line, [`super::RunCurves`] and the tests' recorder. `metrics.jsonl`
///    records every event through `Event`'s serde derive, so it needs nothing.
///
/// Adding a field to a variant fails to compile in this file until its view carries it.
pub trait EventRenderer {
    /// [`Event::Status`]: setup progress.
    fn status(&mut self, message: &str);
    /// [`Event::Started`]: training begins or continues.
    fn started(&mut self, e: Started<'_>);
    /// [`Event::Step`]: an optimizer step finished.
    fn step(&mut self, e: Step<'_>);
    /// [`Event::Eval`]: an evaluation on the validation split.
    fn eval(&mut self, e: Eval);
    /// [`Event::Memory`]: a memory sample of one device.
    fn memory(&mut self, e: Memory<'_>);
    /// [`Event::CheckpointSaved`]: the checkpoint of `step` is in `path`.
    fn checkpoint_saved(&mut self, step: u64, path: &Path);
    /// [`Event::Paused`] after `step` steps.
    fn paused(&mut self, step: u64);
    /// [`Event::Resumed`] at `step` steps.
    fn resumed(&mut self, step: u64);
    /// [`Event::Divergence`]: the loss spiked.
    fn divergence(&mut self, e: Divergence);
    /// [`Event::Warning`].
    fn warning(&mut self, message: &str);
    /// [`Event::Error`]: something stopped training.
    fn error(&mut self, e: ErrorReport<'_>);
    /// [`Event::LintsBlocked`]: error-level lints refused the run.
    fn lints_blocked(&mut self, lints: &[LintFinding]);
    /// [`Event::OutOfMemory`]: a step ran out of memory.
    fn out_of_memory(&mut self, e: OutOfMemory<'_>);
    /// [`Event::LintAllowed`]: an error-level lint the run trains despite.
    fn lint_allowed(&mut self, lint: &LintFinding);
    /// [`Event::Completions`]: GRPO's sampled group of `step`.
    fn completions(&mut self, step: u64, group: &SampledGroup);
    /// [`Event::Finished`]: the run is over.
    fn finished(&mut self, e: Finished<'_>);
}

/// Calls `renderer`'s method for `event`'s kind: the one exhaustive match over [`Event`].
pub fn dispatch(event: &Event, renderer: &mut impl EventRenderer) {
    let r = renderer;
    match event {
        Event::Status { message } => r.status(message),
        Event::Started { .. } => r.started(started(event)),
        Event::Step { .. } => r.step(step(event)),
        Event::Eval {
            step,
            loss,
            perplexity,
            tokens,
        } => r.eval(Eval {
            step: *step,
            loss: *loss,
            perplexity: *perplexity,
            tokens: *tokens,
        }),
        Event::Memory { .. } => r.memory(memory(event)),
        Event::CheckpointSaved { step, path } => r.checkpoint_saved(*step, path),
        Event::Paused { step } => r.paused(*step),
        Event::Resumed { step } => r.resumed(*step),
        Event::Divergence { .. } => r.divergence(divergence(event)),
        Event::Warning { message } => r.warning(message),
        Event::Error {
            message,
            hint,
            phase,
            step,
        } => r.error(ErrorReport {
            message,
            hint,
            phase: *phase,
            step: *step,
        }),
        Event::LintsBlocked { lints } => r.lints_blocked(lints),
        Event::OutOfMemory { .. } => r.out_of_memory(out_of_memory(event)),
        Event::LintAllowed { lint } => r.lint_allowed(lint),
        Event::Completions { step, group } => r.completions(*step, group),
        Event::Finished { .. } => r.finished(finished(event)),
    }
}

/// [`Event::Started`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Started<'a> {
    /// Optimizer steps of the whole run.
    pub total_steps: u64,
    /// Steps already done (non-zero when resumed).
    pub start_step: u64,
    /// Checkpoint resumed from, if any.
    pub resumed_from: Option<&'a Path>,
    /// Parameters of the model.
    pub num_parameters: u64,
    /// Parameters being trained.
    pub trainable_parameters: u64,
    /// Rows in the training split.
    pub train_rows: usize,
    /// Rows in the validation split.
    pub eval_rows: usize,
    /// The output folder.
    pub output_dir: &'a Path,
    /// Samples per optimizer step, in `batch_unit`.
    pub effective_batch: usize,
    /// What the batch counts: `rows`, `pairs` or `prompts`.
    pub batch_unit: &'a str,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// The decoder layers each device holds.
    pub placement: &'a [DeviceLayers],
}

/// [`Event::Step`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step<'a> {
    /// The step.
    pub step: u64,
    /// The loss (NaN when not finite).
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping; NaN when skipped.
    pub grad_norm: f64,
    /// Trained tokens per second in this step.
    pub tokens_per_sec: f64,
    /// Label tokens trained so far.
    pub trained_tokens: u64,
    /// Seconds of training so far.
    pub elapsed_secs: f64,
    /// Fractional epoch reached.
    pub epoch: f64,
    /// fp16: the update was skipped.
    pub skipped: bool,
    /// fp16: the loss scale after this step.
    pub loss_scale: Option<f64>,
    /// Preference training: TRL's metrics by name.
    pub metrics: &'a BTreeMap<String, f64>,
}

/// [`Event::Eval`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Eval {
    /// The step.
    pub step: u64,
    /// The loss (NaN when not finite).
    pub loss: f64,
    /// exp(loss).
    pub perplexity: f64,
    /// Tokens evaluated.
    pub tokens: u64,
}

/// [`Event::Memory`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Memory<'a> {
    /// The device (`cpu`, `cuda:0`).
    pub device: &'a str,
    /// Bytes in use now.
    pub used_bytes: u64,
    /// Peak bytes so far.
    pub peak_bytes: u64,
    /// Capacity of the device, when known.
    pub total_bytes: Option<u64>,
    /// The step.
    pub step: u64,
    /// Whose memory the figures are.
    pub scope: MemoryScope,
}

/// [`Event::Divergence`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Divergence {
    /// The step.
    pub step: u64,
    /// The loss (NaN when not finite).
    pub loss: f64,
    /// The median of the recent losses.
    pub median_loss: f64,
    /// A tenth of the step's learning rate: what to resume with.
    pub suggested_learning_rate: f64,
    /// Whether the run stops here.
    pub stopped: bool,
}

/// [`Event::Error`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrorReport<'a> {
    /// What happened.
    pub message: &'a str,
    /// What to do about it.
    pub hint: &'a str,
    /// The phase of the step.
    pub phase: Option<Phase>,
    /// The step.
    pub step: Option<u64>,
}

/// [`Event::OutOfMemory`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutOfMemory<'a> {
    /// The step.
    pub step: u64,
    /// The phase of the step.
    pub phase: Phase,
    /// The device (`cpu`, `cuda:0`).
    pub device: &'a str,
    /// What the memory plan gave the device.
    pub planned_bytes: Option<u64>,
    /// The most it was seen to hold.
    pub observed_bytes: Option<u64>,
    /// The allocation failure's error value.
    pub failure: Option<AllocationFailure>,
    /// The checkpoint of the last good step.
    pub checkpoint: Option<&'a Path>,
    /// Settings that fit, in words.
    pub refit: &'a [String],
    /// Why no resumable refit exists.
    pub refit_error: Option<&'a str>,
}

/// [`Event::Finished`]'s fields (see there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finished<'a> {
    /// Why the run ended.
    pub reason: FinishReason,
    /// The step.
    pub step: u64,
    /// Loss of the last step.
    pub final_loss: Option<f64>,
    /// Last evaluation loss.
    pub final_eval_loss: Option<f64>,
    /// Seconds of training so far.
    pub elapsed_secs: f64,
    /// The last checkpoint written, if any.
    pub last_checkpoint: Option<&'a Path>,
}

const NOT_THIS_KIND: &str = "dispatch passes each view builder only its own kind";

/// The view of an [`Event::Started`] (every field bound, so a new one does not compile
/// until the view carries it).
fn started(event: &Event) -> Started<'_> {
    let Event::Started {
        total_steps,
        start_step,
        resumed_from,
        num_parameters,
        trainable_parameters,
        train_rows,
        eval_rows,
        output_dir,
        effective_batch,
        batch_unit,
        ranks,
        placement,
    } = event
    else {
        unreachable!("{NOT_THIS_KIND}")
    };
    Started {
        total_steps: *total_steps,
        start_step: *start_step,
        resumed_from: resumed_from.as_deref(),
        num_parameters: *num_parameters,
        trainable_parameters: *trainable_parameters,
        train_rows: *train_rows,
        eval_rows: *eval_rows,
        output_dir,
        effective_batch: *effective_batch,
        batch_unit,
        ranks: *ranks,
        placement,
    }
}

/// The view of an [`Event::Step`].
fn step(event: &Event) -> Step<'_> {
    let Event::Step {
        step,
        loss,
        lr,
        grad_norm,
        tokens_per_sec,
        trained_tokens,
        elapsed_secs,
        epoch,
        skipped,
        loss_scale,
        metrics,
    } = event
    else {
        unreachable!("{NOT_THIS_KIND}")
    };
    Step {
        step: *step,
        loss: *loss,
        lr: *lr,
        grad_norm: *grad_norm,
        tokens_per_sec: *tokens_per_sec,
        trained_tokens: *trained_tokens,
        elapsed_secs: *elapsed_secs,
        epoch: *epoch,
        skipped: *skipped,
        loss_scale: *loss_scale,
        metrics,
    }
}

/// The view of an [`Event::Memory`].
fn memory(event: &Event) -> Memory<'_> {
    let Event::Memory {
        device,
        used_bytes,
        peak_bytes,
        total_bytes,
        step,
        scope,
    } = event
    else {
        unreachable!("{NOT_THIS_KIND}")
    };
    Memory {
        device,
        used_bytes: *used_bytes,
        peak_bytes: *peak_bytes,
        total_bytes: *total_bytes,
        step: *step,
        scope: *scope,
    }
}

/// The view of an [`Event::Divergence`].
fn divergence(event: &Event) -> Divergence {
    let Event::Divergence {
        step,
        loss,
        median_loss,
        suggested_learning_rate,
        stopped,
    } = event
    else {
        unreachable!("{NOT_THIS_KIND}")
    };
    Divergence {
        step: *step,
        loss: *loss,
        median_loss: *median_loss,
        suggested_learning_rate: *suggested_learning_rate,
        stopped: *stopped,
    }
}

/// The view of an [`Event::OutOfMemory`].
fn out_of_memory(event: &Event) -> OutOfMemory<'_> {
    let Event::OutOfMemory {
        step,
        phase,
        device,
        planned_bytes,
        observed_bytes,
        failure,
        checkpoint,
        refit,
        refit_error,
    } = event
    else {
        unreachable!("{NOT_THIS_KIND}")
    };
    OutOfMemory {
        step: *step,
        phase: *phase,
        device,
        planned_bytes: *planned_bytes,
        observed_bytes: *observed_bytes,
        failure: *failure,
        checkpoint: checkpoint.as_deref(),
        refit,
        refit_error: refit_error.as_deref(),
    }
}

/// The view of an [`Event::Finished`].
fn finished(event: &Event) -> Finished<'_> {
    let Event::Finished {
        reason,
        step,
        final_loss,
        final_eval_loss,
        elapsed_secs,
        last_checkpoint,
    } = event
    else {
        unreachable!("{NOT_THIS_KIND}")
    };
    Finished {
        reason: *reason,
        step: *step,
        final_loss: *final_loss,
        final_eval_loss: *final_eval_loss,
        elapsed_secs: *elapsed_secs,
        last_checkpoint: last_checkpoint.as_deref(),
    }
}
