//! Fixes for plans that do not fit, and the auto-fit search.
//!
//! Auto-fit keeps the effective batch (micro-batch × accumulation × data-parallel
//! ranks) and searches strategy (sharded data parallel in the shard modes the trainer runs,
//! [`ShardMode::trainer_runs`]) × precision × checkpointing × micro-batch × LoRA
//! for the settings that fit every device with ≥ 5 % headroom and have the
//! highest estimated throughput. Changes that alter what is learned rank behind
//! those that do not: pure bf16 (no f32 master weights) only when mixed precision
//! cannot fit, LoRA only when nothing full-parameter can.

use super::estimate::{plan_without_fixes, TIGHT_HEADROOM};
use super::{
    format_bytes, Change, DeviceKind, Fix, HeadLoss, LoraSpec, Plan, PlanError, PlanRequest,
    Precision, Quantization, ReferencePlan, ShardMode, Strategy,
};

/// LoRA rank auto-fit proposes when nothing else fits.
pub(crate) const AUTO_LORA_RANK: usize = 16;

mod throughput;
pub use throughput::relative_throughput;

/// The result of [`auto_fit`].
#[derive(Debug, Clone)]
pub struct AutoFit {
    /// Whether settings were found that fit every device with ≥ 5 % headroom.
    pub found: bool,
    /// The fitted settings (the request itself when it already fits best).
    pub request: PlanRequest,
    /// Their plan.
    pub plan: Plan,
    /// Each change in words with its effect ("bf16 mixed precision: −4.0 GiB on GPU 0").
    pub changes: Vec<String>,
    /// The changes themselves, in the order `changes` explains them: applied one after the
    /// other ([`Change::apply`]) they turn the request given into `request`.
    pub steps: Vec<Change>,
    /// Estimated throughput relative to the request as given (1.0 = same).
    pub relative_throughput: f64,
}

impl ReferencePlan {
    /// The reference once LoRA is on: a frozen copy is full fine-tuning's reference, and with
    /// adapters the base with them switched off is the same model (validation rejects `copy`
    /// with LoRA).
    pub(crate) fn with_lora(self) -> Self {
        match self {
            ReferencePlan::Copy => ReferencePlan::AdapterDisabled,
            other => other,
        }
    }

    /// The switch to this reference in words, with the run-config key it sets.
    pub(crate) fn describe_change(self) -> String {
        match self {
            ReferencePlan::Stored => "reference log-probabilities precomputed before the first step, no reference weights (preference.reference = \"precomputed\")".into(),
            ReferencePlan::AdapterDisabled => "reference = the base with the LoRA adapters switched off (preference.reference = \"adapter-disabled\")".into(),
            ReferencePlan::Copy => "a frozen copy of the weights as the reference (preference.reference = \"copy\")".into(),
        }
    }
}

/// Rows a sample puts in a micro-batch ([`crate::plan::HeadLoss::rows_per_sample`]). A micro-batch the
/// search proposes is a whole number of samples.
fn rows_per_sample(req: &PlanRequest) -> usize {
    req.head_loss.rows_per_sample()
}

/// A change in words, and the reference it switches along with it (LoRA on a run with a
/// frozen copy as its reference).
fn describe(change: &Change, req: &PlanRequest, after: &PlanRequest) -> String {
    let words = change.describe(req);
    match change {
        Change::Reference(_) => words,
        _ if after.reference != req.reference => {
            format!("{words}; {}", after.reference.describe_change())
        }
        _ => words,
    }
}

/// How much a change alters what training learns (lower is preferred).
fn quality_tier(original: &PlanRequest, r: &PlanRequest) -> u8 {
    let quantized = |q: &PlanRequest| q.lora.as_ref().is_some_and(|l| l.quantize.is_on());
    if r.seq_len < original.seq_len {
        // Shorter rows or completions: what is trained changes, not only how.
        4
    } else if quantized(r) && !quantized(original) {
        3
    } else if r.lora.is_some() && original.lora.is_none() {
        2
    } else if r.precision == Precision::Bf16 && original.precision != Precision::Bf16 {
        1
    } else {
        0
    }
}

fn max_peak(p: &Plan) -> u64 {
    p.per_device.iter().map(|d| d.peak_bytes).max().unwrap_or(0)
}

fn fits_with_headroom(p: &Plan) -> bool {
    p.per_device
        .iter()
        .all(|d| d.fits && d.headroom_fraction() >= TIGHT_HEADROOM)
}

/// The worst device's name and peak.
fn worst(p: &Plan) -> (String, u64) {
    p.per_device
        .iter()
        .max_by_key(|d| d.peak_bytes)
        .map(|d| (d.device.name.clone(), d.peak_bytes))
        .unwrap_or_default()
}

/// Single changes worth trying on a request.
fn candidate_changes(req: &PlanRequest) -> Vec<Change> {
    let mut out = Vec::new();
    if req.devices.len() > 1 {
        for s in [Strategy::LayerSplit, Strategy::DataParallel] {
            if s != req.strategy {
                out.push(Change::Strategy(s));
            }
        }
        for mode in proposed_shard_modes() {
            if req.strategy != Strategy::Sharded || req.shard != mode {
                out.push(Change::Shard(mode));
            }
        }
    }
    for p in [Precision::Bf16Mixed, Precision::Bf16] {
        let fp16_already_mixed = p == Precision::Bf16Mixed && req.precision == Precision::Fp16Mixed;
        if p != req.precision && !fp16_already_mixed {
            out.push(Change::Precision(p));
        }
    }
    if !req.activation_checkpointing {
        out.push(Change::ActivationCheckpointing);
    }
    out.extend(micro_batch_changes(req));
    if req.lora.is_none() {
        out.push(Change::Lora(LoraSpec::all_linear(AUTO_LORA_RANK)));
    }
    if req
        .lora
        .as_ref()
        .is_none_or(|l| l.quantize != Quantization::Q4K)
    {
        out.push(Change::Quantize(Quantization::Q4K));
    }
    let on_gpu = req.used_devices().iter().any(|d| d.kind != DeviceKind::Cpu);
    if on_gpu && !req.optimizer_offload {
        out.push(Change::OptimizerOffload);
    }
    if req.reference != ReferencePlan::Stored {
        out.push(Change::Reference(ReferencePlan::Stored));
    }
    if req.reference == ReferencePlan::Copy && req.lora.is_some() {
        out.push(Change::Reference(ReferencePlan::AdapterDisabled));
    }
    // GRPO is planned at full-length completions (a long one will come): half as long is a
    // fix that changes what is learned, ranked after every other (`quality_tier`).
    if let HeadLoss::Completions {
        completion_tokens, ..
    } = req.head_loss
    {
        if completion_tokens >= 2 {
            out.push(Change::SeqLen(req.seq_len - completion_tokens / 2));
        }
    }
    out
}

/// Smaller micro-batches with more accumulation (one sample, and half as many), in whole
/// samples (a preference pair is two rows).
fn micro_batch_changes(req: &PlanRequest) -> Vec<Change> {
    let rows = rows_per_sample(req);
    let samples = req.micro_batch / rows;
    if samples <= 1 || !req.micro_batch.is_multiple_of(rows) {
        return Vec::new();
    }
    let mut per_batch = vec![1];
    if samples.is_multiple_of(2) && samples > 2 {
        per_batch.push(samples / 2);
    }
    per_batch
        .into_iter()
        .map(|n| Change::MicroBatch {
            micro_batch: n * rows,
            gradient_accumulation: req.gradient_accumulation * (samples / n),
        })
        .collect()
}

/// Ranks single-change fixes for a plan that does not fit (or is tight): those that
/// make it fit alone first (least quality impact, then fastest), then the rest by saving.
pub(crate) fn rank_fixes(req: &PlanRequest, plan: &Plan) -> Vec<Fix> {
    let (worst_name, worst_peak) = worst(plan);
    let base_speed = relative_throughput(req);
    let mut fixes: Vec<(u8, Fix)> = Vec::new();
    for change in candidate_changes(req) {
        let r = change.apply(req);
        let Ok(p) = plan_without_fixes(&r) else {
            continue;
        };
        let after = max_peak(&p);
        let saving = worst_peak.saturating_sub(after);
        if saving == 0 {
            continue;
        }
        let fits_alone = p.fits();
        let speed = relative_throughput(&r) / base_speed.max(f64::MIN_POSITIVE);
        let description = format!(
            "{}: −{} on {}{}",
            describe(&change, req, &r),
            format_bytes(saving),
            worst_name,
            if fits_alone {
                format!(" → fits ({:.0} % of the speed)", 100.0 * speed)
            } else {
                " (not enough alone)".to_string()
            }
        );
        fixes.push((
            quality_tier(req, &r),
            Fix {
                description,
                saving_bytes: saving,
                fits_alone,
                relative_throughput: speed,
                change,
            },
        ));
    }
    fixes.sort_by(|(ta, a), (tb, b)| {
        b.fits_alone
            .cmp(&a.fits_alone)
            .then(if a.fits_alone {
                ta.cmp(tb).then(
                    b.relative_throughput
                        .partial_cmp(&a.relative_throughput)
                        .unwrap_or(std::cmp::Ordering::Equal),
                )
            } else {
                std::cmp::Ordering::Equal
            })
            .then(b.saving_bytes.cmp(&a.saving_bytes))
    });
    fixes.into_iter().map(|(_, f)| f).collect()
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Finds settings that fit every device with ≥ 5 % headroom, keeping the effective
/// batch, with the highest estimated throughput (see the module docs for the order
/// of preference), and explains each change.
pub fn auto_fit(req: &PlanRequest) -> Result<AutoFit, PlanError> {
    // Validates the request (errors such as zero devices surface here).
    let original_plan = super::plan(req)?;
    let mut search = Search::default();
    for r in search_space(req) {
        search.consider(req, r);
    }
    Ok(search.finish(req, &original_plan))
}

/// Every request the search plans, in its order of preference: strategy × precision ×
/// checkpointing × LoRA × reference × micro-batch, each keeping the effective batch.
fn search_space(req: &PlanRequest) -> Vec<PlanRequest> {
    let effective = req.effective_batch();
    let rows = rows_per_sample(req);
    let mut out = Vec::new();
    for (strategy, shard) in strategy_options(req) {
        let ranks = strategy.ranks(req.devices.len());
        if !effective.is_multiple_of(ranks * rows) {
            continue;
        }
        let per_rank = effective / ranks;
        for precision in precision_options(req) {
            for ckpt in checkpointing_options(req) {
                for lora in lora_options(req) {
                    for reference in reference_options(req, lora.as_ref()) {
                        for samples in divisors(per_rank / rows) {
                            let mut r = req.clone();
                            r.strategy = strategy;
                            r.shard = shard;
                            r.precision = precision;
                            r.activation_checkpointing = ckpt;
                            r.lora = lora.clone();
                            r.reference = reference;
                            r.micro_batch = samples * rows;
                            r.gradient_accumulation = per_rank / r.micro_batch;
                            out.push(r);
                        }
                    }
                }
            }
        }
    }
    out
}

/// The shard modes auto-fit and the fixes may propose: those the trainer runs. A mode it does
/// not run yet (ZeRO-3) is planned when asked for, never proposed.
fn proposed_shard_modes() -> impl Iterator<Item = ShardMode> {
    ShardMode::ALL.into_iter().filter(|m| m.trainer_runs())
}

/// The strategies (with their shard mode) the search tries: the request's, then on several
/// devices the layer split, data parallel and sharded data parallel. A requested shard mode
/// the trainer does not run is replaced by those it runs.
fn strategy_options(req: &PlanRequest) -> Vec<(Strategy, ShardMode)> {
    let mut options: Vec<(Strategy, ShardMode)> = Vec::new();
    let mut add = |o: (Strategy, ShardMode)| {
        if !options.contains(&o) {
            options.push(o);
        }
    };
    if req.strategy == Strategy::Sharded && !req.shard.trainer_runs() {
        proposed_shard_modes().for_each(|m| add((Strategy::Sharded, m)));
    } else {
        add((req.strategy, req.shard));
    }
    if req.devices.len() > 1 {
        for s in [Strategy::LayerSplit, Strategy::DataParallel] {
            add((s, req.shard));
        }
        proposed_shard_modes().for_each(|m| add((Strategy::Sharded, m)));
    }
    options
}

fn precision_options(req: &PlanRequest) -> Vec<Precision> {
    let mut precisions = vec![req.precision];
    for p in [Precision::Bf16Mixed, Precision::Bf16] {
        let fp16_already_mixed = p == Precision::Bf16Mixed && req.precision == Precision::Fp16Mixed;
        if !precisions.contains(&p) && !fp16_already_mixed {
            precisions.push(p);
        }
    }
    precisions
}

fn checkpointing_options(req: &PlanRequest) -> Vec<bool> {
    if req.activation_checkpointing {
        vec![true]
    } else {
        vec![false, true]
    }
}

/// The request's LoRA, then LoRA r=16 on every linear, then QLoRA 4-bit last: it changes
/// what is learned the most (tier 3).
fn lora_options(req: &PlanRequest) -> Vec<Option<LoraSpec>> {
    match &req.lora {
        Some(l) if l.quantize.is_on() => vec![Some(l.clone())],
        Some(l) => vec![
            Some(l.clone()),
            Some(l.clone().quantized(Quantization::Q4K)),
        ],
        None => vec![
            None,
            Some(LoraSpec::all_linear(AUTO_LORA_RANK)),
            Some(LoraSpec::all_linear(AUTO_LORA_RANK).quantized(Quantization::Q4K)),
        ],
    }
}

/// A DPO run's reference as given (the base with the adapters off once LoRA is on, for a
/// frozen copy), then precomputed: it learns the same (`train/preference.rs`) and holds
/// nothing during the step.
fn reference_options(req: &PlanRequest, lora: Option<&LoraSpec>) -> Vec<ReferencePlan> {
    let given = if lora.is_some() {
        req.reference.with_lora()
    } else {
        req.reference
    };
    if given == ReferencePlan::Stored {
        vec![given]
    } else {
        vec![given, ReferencePlan::Stored]
    }
}

/// A fitting candidate: its quality tier, throughput and number of changes, the request and
/// its plan.
struct Candidate {
    tier: u8,
    speed: f64,
    n_changes: usize,
    request: PlanRequest,
    plan: Plan,
}

/// The search's state: the best fitting candidate, and the one that fills the worst device
/// least (the answer when nothing fits).
#[derive(Default)]
struct Search {
    best: Option<Candidate>,
    least_bad: Option<(f64, PlanRequest, Plan)>,
}

impl Search {
    fn consider(&mut self, req: &PlanRequest, r: PlanRequest) {
        let Ok(p) = plan_without_fixes(&r) else {
            return;
        };
        let fill = p
            .per_device
            .iter()
            .map(|d| d.peak_bytes as f64 / d.device.capacity_bytes.max(1) as f64)
            .fold(0.0, f64::max);
        if self.least_bad.as_ref().is_none_or(|(f, _, _)| fill < *f) {
            self.least_bad = Some((fill, r.clone(), p.clone()));
        }
        if !fits_with_headroom(&p) {
            return;
        }
        let c = Candidate {
            tier: quality_tier(req, &r),
            speed: relative_throughput(&r),
            n_changes: count_changes(req, &r),
            request: r,
            plan: p,
        };
        let better = self.best.as_ref().is_none_or(|b| {
            c.tier < b.tier
                || (c.tier == b.tier
                    && (c.speed > b.speed * 1.02
                        || (c.speed > b.speed * 0.98 && c.n_changes < b.n_changes)))
        });
        if better {
            self.best = Some(c);
        }
    }

    fn finish(self, req: &PlanRequest, original_plan: &Plan) -> AutoFit {
        let base_speed = relative_throughput(req).max(f64::MIN_POSITIVE);
        if let Some(c) = self.best {
            let (steps, changes) = explain_changes(req, original_plan, &c.request);
            return AutoFit {
                found: true,
                relative_throughput: c.speed / base_speed,
                request: c.request,
                plan: c.plan,
                changes,
                steps,
            };
        }
        let (_, r, p) = self
            .least_bad
            .unwrap_or((0.0, req.clone(), original_plan.clone()));
        let (steps, mut changes) = explain_changes(req, original_plan, &r);
        changes.push(format!(
            "nothing fits these devices with {:.0} % headroom, even with QLoRA 4-bit r={}: use larger or more devices, or shorter sequences",
            100.0 * TIGHT_HEADROOM,
            AUTO_LORA_RANK
        ));
        AutoFit {
            found: false,
            relative_throughput: relative_throughput(&r) / base_speed,
            request: r,
            plan: p,
            changes,
            steps,
        }
    }
}

/// Whether `to` shards differently from `from` (the shard mode counts under sharded only).
fn shard_changed(from: &PlanRequest, to: &PlanRequest) -> bool {
    to.strategy == Strategy::Sharded
        && (from.strategy != Strategy::Sharded || from.shard != to.shard)
}

fn count_changes(a: &PlanRequest, b: &PlanRequest) -> usize {
    usize::from(a.strategy != b.strategy || shard_changed(a, b))
        + usize::from(a.precision != b.precision)
        + usize::from(a.activation_checkpointing != b.activation_checkpointing)
        + usize::from(a.micro_batch != b.micro_batch)
        + usize::from(a.lora != b.lora)
        + usize::from(a.optimizer_offload != b.optimizer_offload)
        + usize::from(a.reference != b.reference)
}

/// The changes from `from` to `to`, in the order of preference (the micro-batch split last).
fn steps_between(from: &PlanRequest, to: &PlanRequest) -> Vec<Change> {
    let mut steps: Vec<Change> = Vec::new();
    if shard_changed(from, to) {
        steps.push(Change::Shard(to.shard));
    } else if from.strategy != to.strategy {
        steps.push(Change::Strategy(to.strategy));
    }
    if from.precision != to.precision {
        steps.push(Change::Precision(to.precision));
    }
    if to.activation_checkpointing && !from.activation_checkpointing {
        steps.push(Change::ActivationCheckpointing);
    }
    let quantize = |r: &PlanRequest| r.lora.as_ref().map_or(Quantization::None, |l| l.quantize);
    if let (Some(l), None) = (&to.lora, &from.lora) {
        steps.push(Change::Lora(l.clone().quantized(Quantization::None)));
    }
    if quantize(to) != quantize(from) {
        steps.push(Change::Quantize(quantize(to)));
    }
    if to.optimizer_offload && !from.optimizer_offload {
        steps.push(Change::OptimizerOffload);
    }
    // Last of the settings: turning LoRA on may already have switched it.
    if to.reference != from.reference {
        steps.push(Change::Reference(to.reference));
    }
    steps
}

/// Applies the differences from `from` to `to` one at a time, in the order of
/// preference, and says what each saved on the device that was fullest before it: the
/// changes applied, and each in words.
fn explain_changes(
    from: &PlanRequest,
    from_plan: &Plan,
    to: &PlanRequest,
) -> (Vec<Change>, Vec<String>) {
    let mut cur = from.clone();
    let mut cur_plan = from_plan.clone();
    let mut applied = Vec::new();
    let mut out = Vec::new();
    for change in steps_between(from, to) {
        if matches!(change, Change::Reference(r) if r == cur.reference) {
            continue;
        }
        let next = change.apply(&cur);
        out.push(describe_step(&change, &cur, &cur_plan, &next));
        if let Ok(p) = plan_without_fixes(&next) {
            cur_plan = p;
        }
        cur = next;
        applied.push(change);
    }
    if cur.micro_batch != to.micro_batch || cur.gradient_accumulation != to.gradient_accumulation {
        let change = Change::MicroBatch {
            micro_batch: to.micro_batch,
            gradient_accumulation: to.gradient_accumulation,
        };
        let next = change.apply(&cur);
        out.push(describe_step(&change, &cur, &cur_plan, &next));
        cur = next;
        applied.push(change);
    }
    if out.is_empty() {
        out.push("the requested settings already fit with headroom; nothing changed".into());
    }
    debug_assert_eq!(cur.effective_batch(), to.effective_batch());
    (applied, out)
}

fn describe_step(
    change: &Change,
    cur: &PlanRequest,
    cur_plan: &Plan,
    next: &PlanRequest,
) -> String {
    let (name, before) = worst(cur_plan);
    let words = describe(change, cur, next);
    match plan_without_fixes(next) {
        Ok(p) => {
            let after = p
                .per_device
                .iter()
                .find(|d| d.device.name == name)
                .map(|d| d.peak_bytes)
                .unwrap_or_else(|| max_peak(&p));
            let speed = relative_throughput(next) / relative_throughput(cur).max(f64::MIN_POSITIVE);
            let delta = if after <= before {
                format!("−{}", format_bytes(before - after))
            } else {
                format!("+{}", format_bytes(after - before))
            };
            format!("{words}: {delta} on {name} (speed ×{speed:.2})")
        }
        Err(e) => format!("{words}: {e}"),
    }
}

#[cfg(test)]
mod tests;
