//! Fixes for plans that do not fit, and the auto-fit search.
//!
//! Auto-fit keeps the effective batch (micro-batch × accumulation × data-parallel
//! ranks) and searches strategy (sharded data parallel in the shard modes the trainer runs,
//! [`PlanRequest::trainer_runs_shard`]) × precision × checkpointing × micro-batch × LoRA
//! for the settings that fit every device with ≥ 5 % headroom and have the
//! highest estimated throughput. Changes that alter what is learned rank behind
//! those that do not: pure bf16 (no f32 master weights) only when mixed precision
//! cannot fit, LoRA only when nothing full-parameter can.

use super::change::{SearchAxis, SEARCH_AXES};
use super::estimate::{plan_without_fixes, TIGHT_HEADROOM};
use super::{format_bytes, Change, Fix, Plan, PlanError, PlanRequest, ReferencePlan};

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

/// Ranks single-change fixes for a plan that does not fit (or is tight): those that
/// make it fit alone first (least quality impact, then fastest), then the rest by saving.
pub(crate) fn rank_fixes(req: &PlanRequest, plan: &Plan) -> Vec<Fix> {
    let (worst_name, worst_peak) = worst(plan);
    let base_speed = relative_throughput(req);
    let mut fixes: Vec<(u8, Fix)> = Vec::new();
    for change in Change::candidates(req) {
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
            change.quality_tier(req),
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

/// Finds settings that fit every device with ≥ 5 % headroom, keeping the effective
/// batch, with the highest estimated throughput (see the module docs for the order
/// of preference), and explains each change.
pub fn auto_fit(req: &PlanRequest) -> Result<AutoFit, PlanError> {
    // Validates the request (errors such as zero devices surface here).
    let original_plan = super::plan(req)?;
    let mut search = Search::default();
    search.extend(req, req, Path::default(), &SEARCH_AXES);
    Ok(search.finish(req, &original_plan))
}

/// A request the search reached and the changes that led there from the original, in order.
#[derive(Clone, Default)]
struct Path {
    /// The changes, applied one after the other ([`Change::apply`]).
    changes: Vec<Change>,
    /// How much they alter what is learned: the highest of their tiers.
    tier: u8,
}

impl Path {
    /// This path with `change`, made to `before`, at its end.
    fn then(&self, change: Change, before: &PlanRequest) -> Path {
        let mut next = self.clone();
        next.tier = next.tier.max(change.quality_tier(before));
        next.changes.push(change);
        next
    }
}

/// A fitting candidate: its quality tier, throughput and number of changes, the request, its
/// plan and the changes that made it.
struct Candidate {
    tier: u8,
    speed: f64,
    n_changes: usize,
    request: PlanRequest,
    plan: Plan,
    changes: Vec<Change>,
}

/// The search's state: the best fitting candidate, and the one that fills the worst device
/// least (the answer when nothing fits).
#[derive(Default)]
struct Search {
    best: Option<Candidate>,
    least_bad: Option<(f64, PlanRequest, Plan, Vec<Change>)>,
}

impl Search {
    /// Walks `axes` from `so_far` ([`SEARCH_AXES`]: each axis's options, nested in order) and
    /// considers every request at the end of a path.
    fn extend(
        &mut self,
        original: &PlanRequest,
        so_far: &PlanRequest,
        path: Path,
        axes: &[SearchAxis],
    ) {
        let Some((axis, rest)) = axes.split_first() else {
            self.consider(so_far.clone(), path);
            return;
        };
        for option in axis(original, so_far) {
            match option {
                None => self.extend(original, so_far, path.clone(), rest),
                Some(change) => {
                    let next = change.apply(so_far);
                    let path = path.then(change, so_far);
                    self.extend(original, &next, path, rest);
                }
            }
        }
    }

    fn consider(&mut self, r: PlanRequest, path: Path) {
        let Ok(p) = plan_without_fixes(&r) else {
            return;
        };
        let fill = p
            .per_device
            .iter()
            .map(|d| d.peak_bytes as f64 / d.device.capacity_bytes.max(1) as f64)
            .fold(0.0, f64::max);
        if self.least_bad.as_ref().is_none_or(|(f, ..)| fill < *f) {
            self.least_bad = Some((fill, r.clone(), p.clone(), path.changes.clone()));
        }
        if !fits_with_headroom(&p) {
            return;
        }
        let c = Candidate {
            tier: path.tier,
            speed: relative_throughput(&r),
            n_changes: path.changes.len(),
            request: r,
            plan: p,
            changes: path.changes,
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
            let (steps, changes) = explain_changes(req, original_plan, c.changes);
            return AutoFit {
                found: true,
                relative_throughput: c.speed / base_speed,
                request: c.request,
                plan: c.plan,
                changes,
                steps,
            };
        }
        let (_, r, p, path) =
            self.least_bad
                .unwrap_or((0.0, req.clone(), original_plan.clone(), Vec::new()));
        let (steps, mut changes) = explain_changes(req, original_plan, path);
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

/// Applies the search's changes one at a time and says what each saved on the device that
/// was fullest before it: the changes, and each in words.
fn explain_changes(
    from: &PlanRequest,
    from_plan: &Plan,
    steps: Vec<Change>,
) -> (Vec<Change>, Vec<String>) {
    let mut cur = from.clone();
    let mut cur_plan = from_plan.clone();
    let mut out = Vec::new();
    for change in &steps {
        let next = change.apply(&cur);
        out.push(describe_step(change, &cur, &cur_plan, &next));
        if let Ok(p) = plan_without_fixes(&next) {
            cur_plan = p;
        }
        cur = next;
    }
    if out.is_empty() {
        out.push("the requested settings already fit with headroom; nothing changed".into());
    }
    debug_assert_eq!(cur.effective_batch(), from.effective_batch());
    (steps, out)
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
