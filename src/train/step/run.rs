//! One optimizer step (the accumulated gradients clipped and applied, fp16 overflow skipped),
//! the gradient preview, and evaluation; a panic inside any of them is caught.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use candle_core::DType;

use crate::model::{CausalLm, Gradients};

use super::super::error::{step_error, Phase, TrainError};
use super::super::precision::Precision;
use super::super::preference::PairRun;
use super::super::samples::{self, Sample};
use super::{
    Accumulated, EvalResult, StepGradients, StepOutcome, TrainingRun, MAX_CONSECUTIVE_SKIPS,
};

/// How a step's update went.
struct Update {
    /// Global norm of the token-normalised gradient before clipping (NaN when skipped).
    grad_norm: f64,
    /// fp16: the update was skipped (gradient overflow).
    skipped: bool,
}

impl TrainingRun {
    /// Runs one optimizer step. Errors leave the thread (and process) alive; a panic inside the
    /// step is caught and returned as [`TrainError::Panic`].
    pub fn step(&mut self) -> Result<StepOutcome, TrainError> {
        self.guarded(Self::step_inner)
    }

    /// Runs one optimizer step on the longest rows of the training split (the planner's worst
    /// case, see [`DataLoader::longest_step`]) without moving the data position: the step of
    /// the planner's dry run (`train::dry_run`). Otherwise as [`TrainingRun::step`]: the
    /// weights are updated and the step is counted.
    pub fn step_longest(&mut self) -> Result<StepOutcome, TrainError> {
        self.guarded(|run| {
            let accumulation = run.config.training.gradient_accumulation;
            let micro_batches = run.loader.longest_step(accumulation);
            run.step_on(&micro_batches)
        })
    }

    /// Runs `step`, a panic inside it caught and returned as [`TrainError::Panic`].
    fn guarded(
        &mut self,
        step: impl FnOnce(&mut Self) -> Result<StepOutcome, TrainError>,
    ) -> Result<StepOutcome, TrainError> {
        let index = self.step + 1;
        match std::panic::catch_unwind(AssertUnwindSafe(|| step(self))) {
            Ok(r) => r,
            Err(payload) => Err(TrainError::Panic {
                step: index,
                message: panic_message(&payload),
            }),
        }
    }

    fn step_inner(&mut self) -> Result<StepOutcome, TrainError> {
        // A failed step leaves the run as after the last good one (data position too), so a
        // checkpoint written now resumes exactly there.
        let (epoch, index) = self.loader.position();
        let result = self.try_step();
        if result.is_err() {
            self.loader.set_position(epoch, index);
        }
        result
    }

    fn try_step(&mut self) -> Result<StepOutcome, TrainError> {
        // GRPO's later steps of a block of rollouts train on the block's prompts again; the
        // data order moves on only when a step samples.
        let micro_batches = match self.objective.reused_micro_batches(self.step + 1) {
            Some(reused) => reused,
            None => self
                .loader
                .next_step(self.config.training.gradient_accumulation),
        };
        self.step_on(&micro_batches)
    }

    /// One optimizer step on `micro_batches` (rows of the training split).
    fn step_on(&mut self, micro_batches: &[Vec<usize>]) -> Result<StepOutcome, TrainError> {
        let started = Instant::now();
        let step = self.step + 1;
        self.shard_layers()?;
        let lr =
            self.schedule.lr_at(self.step) * super::super::divergence::injected_lr_factor(step);
        if micro_batches.is_empty() {
            return Err(TrainError::EmptyDataset("no rows left".into()));
        }
        let loss_scale = self.scaler.as_ref().map_or(1.0, |s| s.scale);
        let acc = self.accumulate(micro_batches, loss_scale)?;
        self.last_gradient_bytes = acc.grads.first().map(gradient_bytes);
        let loss = if acc.tokens > 0 {
            acc.loss_sum / acc.tokens as f64
        } else {
            0.0
        };
        if !loss.is_finite() && self.scaler.is_none() {
            let value = if loss.is_nan() { "NaN" } else { "infinite" };
            return Err(self.non_finite(step, value.into()));
        }
        let update = self.update(step, lr, &acc, loss)?;
        self.step = step;
        self.trained_tokens += acc.label_tokens;
        let secs = started.elapsed().as_secs_f64();
        self.elapsed_secs += secs;
        if loss.is_finite() {
            self.last_loss = Some(loss);
        }
        Ok(StepOutcome {
            step,
            loss,
            lr,
            grad_norm: update.grad_norm,
            tokens: acc.label_tokens,
            tokens_per_sec: acc.label_tokens as f64 / secs.max(1e-9),
            trained_tokens: self.trained_tokens,
            elapsed_secs: self.elapsed_secs,
            epoch: self.loader.epoch_progress(),
            skipped: update.skipped,
            loss_scale: self.scaler.as_ref().map(|s| s.scale),
            batch_shapes: acc.shapes,
            preference: acc.preference,
            grpo: acc.grpo,
        })
    }

    /// Clips and applies the accumulated gradient of the mean loss, unless fp16's loss scaler
    /// finds it overflowed (then the step is skipped and the scale halved). Nothing to do
    /// when the step had no trained token.
    fn update(
        &mut self,
        step: u64,
        lr: f64,
        acc: &Accumulated,
        loss: f64,
    ) -> Result<Update, TrainError> {
        let Some(grads) = acc.grads.first().filter(|_| acc.tokens > 0) else {
            return Ok(Update {
                grad_norm: 0.0,
                skipped: false,
            });
        };
        let shape = acc.last_shape();
        let settings = self.settings_summary();
        // Sharded: each rank holds its ranges of the gradient; the norm is over all of them.
        let mut raw_norm = match &self.sharded {
            Some(_) => super::sharded::ShardedOptimizer::global_norm(&acc.grads),
            None => grads.global_norm(),
        }
        .map_err(|e| step_error(Phase::Optimizer, step, shape, e, &settings))?;
        // A launched sharded run: the other processes hold the other ranges.
        if let (Some(world), Some(_)) = (&self.world, &self.sharded) {
            let squares = world
                .all_reduce_f64("gradient norm", &[raw_norm * raw_norm])
                .map_err(|e| step_error(Phase::Optimizer, step, shape, e, &settings))?;
            raw_norm = squares.first().copied().unwrap_or(0.0).sqrt();
        }
        // grads = backward_factor × ∇(summed loss); the mean-loss gradient is ∇sum / tokens.
        let denominator = acc.tokens as f64 * acc.backward_factor;
        let grad_norm = raw_norm / denominator;
        let finite = loss.is_finite() && grad_norm.is_finite();
        let apply = match &mut self.scaler {
            Some(s) => s.update(finite),
            None if finite => true,
            None => {
                return Err(self.non_finite(step, "finite, but the gradient norm is not".into()))
            }
        };
        if !apply {
            return self.skip_update(step);
        }
        self.consecutive_skips = 0;
        let max_norm = self.config.training.max_grad_norm;
        let clip = if max_norm > 0.0 && grad_norm > max_norm {
            max_norm / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.apply_update(step, lr, &acc.grads, clip / denominator, shape, &settings)?;
        Ok(Update {
            grad_norm,
            skipped: false,
        })
    }

    /// fp16: a step whose gradient overflowed is skipped; this many in a row means scaling
    /// cannot fix it.
    fn skip_update(&mut self, step: u64) -> Result<Update, TrainError> {
        self.consecutive_skips += 1;
        if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS {
            return Err(self.non_finite(
                step,
                format!(
                    "non-finite in {} steps in a row despite loss scaling",
                    self.consecutive_skips
                ),
            ));
        }
        Ok(Update {
            grad_norm: f64::NAN,
            skipped: true,
        })
    }

    /// A non-finite loss or gradient at `step`, with what to do about it.
    fn non_finite(&self, step: u64, value: String) -> TrainError {
        TrainError::NonFiniteLoss {
            step,
            value,
            hint: self.non_finite_hint(),
        }
    }

    /// One optimizer step on every rank with `grads` (rank 0's first) scaled by `multiplier`
    /// (the clip over the mean-loss denominator).
    fn apply_update(
        &mut self,
        step: u64,
        lr: f64,
        grads: &[Gradients],
        multiplier: f64,
        shape: (usize, usize),
        settings: &str,
    ) -> Result<(), TrainError> {
        if let Some(message) = super::super::oom::injected_failure(step, Phase::Optimizer) {
            return Err(step_error(Phase::Optimizer, step, shape, message, settings));
        }
        if crate::mem::ranks::tracking_ranks() {
            self.state_bytes_by_rank = (0..self.placement.ranks())
                .map(crate::mem::ranks::rank_live_bytes)
                .collect();
        }
        // Sharded: each rank steps its ranges, then the ranges are all-gathered into every
        // rank's weights.
        let reducer = self.shard_reducer();
        if let Some(sharded) = &mut self.sharded {
            let models: Vec<&CausalLm> = std::iter::once(&self.model)
                .chain(self.replicas.iter().map(|r| &r.model))
                .collect();
            return sharded
                .step(grads, lr, multiplier, &models, reducer.as_ref())
                .map_err(|e| step_error(Phase::Optimizer, step, shape, e, settings));
        }
        // Every rank steps its own optimizer on the same all-reduced gradients (as DDP does):
        // no weights travel after the step, and each rank's AdamW state stays with its
        // replica, where the planner counts it.
        crate::mem::ranks::on_rank(0, || self.optimizer.step(&grads[0], lr, multiplier))
            .map_err(|e| step_error(Phase::Optimizer, step, shape, e, settings))?;
        for (rank, (replica, grads)) in self.replicas.iter_mut().zip(&grads[1..]).enumerate() {
            let _rank = crate::mem::ranks::RankGuard::enter(rank + 1);
            replica
                .optimizer
                .step(grads, lr, multiplier)
                .map_err(|e| step_error(Phase::Optimizer, step, shape, e, settings))?;
        }
        Ok(())
    }

    fn non_finite_hint(&self) -> String {
        let t = &self.config.training;
        let mut advice = vec![format!(
            "lower training.learning_rate (now {})",
            t.learning_rate
        )];
        if t.max_grad_norm == 0.0 {
            advice.push("turn gradient clipping on (training.max_grad_norm = 1.0)".into());
        }
        match t.precision {
            Precision::Fp16Mixed | Precision::Bf16 => {
                advice.push("use training.precision = \"bf16-mixed\" or \"fp32\"".into())
            }
            _ => {}
        }
        advice.push("check the data for broken rows (`tunestudio preview`)".into());
        advice.push("then resume from the last checkpoint".into());
        advice.join("; ")
    }

    /// The token-normalised gradient of the next step, without applying it or moving the data
    /// position (for tests and diagnostics).
    pub fn preview_gradients(&mut self) -> Result<StepGradients, TrainError> {
        self.shard_layers()?;
        let (epoch, index) = self.loader.position();
        let micro_batches = self
            .loader
            .next_step(self.config.training.gradient_accumulation);
        self.loader.set_position(epoch, index);
        let acc = self.accumulate(&micro_batches, 1.0)?;
        let n = acc.tokens.max(1) as f64 * acc.backward_factor;
        let mut grads = HashMap::new();
        let whole = match &self.sharded {
            Some(sharded) => {
                Some(
                    sharded
                        .gather_gradients(&acc.grads)
                        .map_err(|e| TrainError::Data {
                            context: "preview gradients".into(),
                            message: e.to_string(),
                        })?,
                )
            }
            None => acc.grads.into_iter().next(),
        };
        if let Some(g) = whole {
            for (name, t) in g.iter() {
                let t = t
                    .to_dtype(DType::F32)
                    .and_then(|t| t.affine(1.0 / n, 0.0))
                    .map_err(|e| TrainError::Data {
                        context: "preview gradients".into(),
                        message: e.to_string(),
                    })?;
                grads.insert(name.to_string(), t);
            }
        }
        Ok(StepGradients {
            grads,
            tokens: acc.tokens,
            loss: acc.loss_sum / n,
        })
    }

    /// Mean token loss on the validation split (at most `eval.max_batches` micro-batches).
    pub fn evaluate(&mut self) -> Result<EvalResult, TrainError> {
        let step = self.step;
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.evaluate_inner())) {
            Ok(r) => r,
            Err(payload) => Err(TrainError::Panic {
                step,
                message: panic_message(&payload),
            }),
        }
    }

    fn evaluate_inner(&mut self) -> Result<EvalResult, TrainError> {
        self.shard_layers()?;
        let started = Instant::now();
        let (loss, perplexity, tokens) = self.objective.evaluate(self)?;
        self.last_eval_loss = Some(loss).filter(|l| l.is_finite());
        self.elapsed_secs += started.elapsed().as_secs_f64();
        Ok(EvalResult {
            step: self.step,
            loss,
            perplexity,
            tokens,
        })
    }

    /// The preference loss over the validation pairs, with no perplexity (it is not defined)
    /// and the pairs counted: `(loss, perplexity, pairs)`.
    pub(super) fn evaluate_pairs(&self, p: &PairRun) -> Result<(f64, f64, u64), TrainError> {
        let mb = self.config.training.micro_batch.max(1);
        let metrics = p
            .evaluate(
                &self.model,
                self.reference_copies.first(),
                self.pad_id,
                mb,
                self.config.eval.max_batches,
            )
            .map_err(|e| {
                step_error(Phase::Eval, self.step, (mb, 0), e, &self.settings_summary())
            })?;
        let loss = metrics.map_or(f64::NAN, |m| m.loss);
        Ok((loss, f64::NAN, metrics.map_or(0, |m| m.pairs as u64)))
    }

    /// The mean token loss over the validation samples (at most `eval.max_batches`
    /// micro-batches): `(loss, perplexity, tokens)`.
    pub(super) fn evaluate_rows(&self) -> Result<(f64, f64, u64), TrainError> {
        let settings = self.settings_summary();
        let mb = self.config.training.micro_batch.max(1);
        let max_batches = match self.config.eval.max_batches {
            0 => usize::MAX,
            n => n,
        };
        let mut loss_sum = 0.0;
        let mut tokens = 0u64;
        for chunk in self.splits.eval.chunks(mb).take(max_batches) {
            let picked: Vec<&Sample> = chunk.iter().collect();
            let batch = samples::collate(
                &picked,
                self.pad_id,
                self.config.data.max_length,
                &self.device,
            )
            .map_err(|e| step_error(Phase::Eval, self.step, (chunk.len(), 0), e, &settings))?;
            let shape = (batch.rows, batch.seq_len);
            // Without dropout, without a backward graph, one logits chunk at a time.
            let (v, _) = self
                .model
                .eval_loss(&batch.input_ids, Some(&batch.attention_mask), &batch.labels)
                .map_err(|e| step_error(Phase::Eval, self.step, shape, e, &settings))?;
            loss_sum += v;
            tokens += batch.trained_tokens as u64;
        }
        let loss = if tokens > 0 {
            loss_sum / tokens as f64
        } else {
            f64::NAN
        };
        Ok((loss, loss.exp(), tokens))
    }
}

/// Σ bytes of the tensors of a gradient store.
fn gradient_bytes(grads: &Gradients) -> u64 {
    grads
        .iter()
        .map(|(_, g)| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
        .sum()
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}
