//! Ranked fixes on requests that do not fit.

use super::*;
use crate::plan::{HeadLoss, LoraSpec};

/// DictaLM 2.0, GRPO with LoRA r 16, one prompt × G 16 of 512 + 2,048 tokens, on 24 GiB.
fn long_completions() -> PlanRequest {
    PlanRequest {
        lora: Some(LoraSpec::all_linear(16)),
        ..crate::plan::generation::dictalm_grpo_request(16, 2048, "24GiB")
    }
}

#[test]
fn a_grpo_run_that_does_not_fit_is_offered_shorter_completions_last() {
    let req = long_completions();
    let plan = super::super::plan(&req).expect("plan");
    assert!(!plan.fits(), "the case must not fit as it is");
    let fixes = rank_fixes(&req, &plan);
    let shorter = fixes
        .iter()
        .find(|f| matches!(f.change, Change::SeqLen(_)))
        .expect("a shorter completion among the fixes");
    assert_eq!(shorter.change, Change::SeqLen(512 + 1024));
    assert!(
        shorter
            .description
            .contains("completions of at most 1024 tokens"),
        "{}",
        shorter.description
    );
    assert!(shorter.saving_bytes > 0);
    // It keeps the prompt and halves the completion the plan is sized by.
    let after = shorter.change.apply(&req);
    assert_eq!(
        after.head_loss,
        HeadLoss::Completions {
            generations: 16,
            completion_tokens: 1024
        }
    );
    // Changing what is learned ranks it after every fix that fits alone and does not.
    if shorter.fits_alone {
        let last_fitting = fixes.iter().rposition(|f| f.fits_alone).unwrap();
        let position = fixes
            .iter()
            .position(|f| f.change == shorter.change)
            .unwrap();
        assert_eq!(position, last_fitting, "{fixes:#?}");
    }
}

/// The worst device's planned peak of `req`.
fn peak_bytes(req: &PlanRequest) -> u64 {
    max_peak(&super::super::plan(req).expect("plan"))
}

/// `[grpo] generations_per_micro_step`: the step's activations and head are a pass's, so half
/// the group per pass plans a lower peak, and a quarter lower still; the generation before the
/// step keeps the whole group's cache.
#[test]
fn fewer_generations_per_pass_plan_a_smaller_peak() {
    let whole = long_completions();
    let per_pass = |n| PlanRequest {
        generations_per_micro_step: Some(n),
        world: Default::default(),
        ..whole.clone()
    };
    let (g16, g8, g4) = (
        peak_bytes(&whole),
        peak_bytes(&per_pass(8)),
        peak_bytes(&per_pass(4)),
    );
    println!("peak: G 16 per pass {g16}, 8 {g8}, 4 {g4}");
    assert!(g8 < g16 && g4 < g8, "{g16} {g8} {g4}");
    assert_eq!(per_pass(16).rows_per_pass(), 16);
    assert_eq!(per_pass(4).rows_per_pass(), 4);
    // A value that does not divide G plans the whole group (validation refuses it).
    assert_eq!(peak_bytes(&per_pass(3)), g16);
}

/// A GRPO run that does not fit (the DictaLM case above on 120 GiB: 166 GiB planned with the
/// whole group per pass, 90 GiB with half) is offered half the group per pass, ranked as a
/// change that learns the same (ahead of shorter completions), and auto-fit takes it rather
/// than anything that changes what is learned.
#[test]
fn a_grpo_run_that_does_not_fit_is_offered_fewer_generations_per_pass() {
    let req = PlanRequest {
        lora: Some(LoraSpec::all_linear(16)),
        ..crate::plan::generation::dictalm_grpo_request(16, 2048, "120GiB")
    };
    let plan = super::super::plan(&req).expect("plan");
    assert!(!plan.fits(), "the case must not fit as it is");
    let fixes = rank_fixes(&req, &plan);
    let position = |c: &dyn Fn(&Change) -> bool| fixes.iter().position(|f| c(&f.change));
    let split = position(&|c| *c == Change::GenerationsPerMicroStep(8))
        .unwrap_or_else(|| panic!("half the group per pass among {fixes:#?}"));
    let shorter = position(&|c| matches!(c, Change::SeqLen(_))).expect("shorter completions");
    let fix = &fixes[split];
    println!("{}", fix.description);
    assert!(fix.fits_alone, "{}", fix.description);
    assert!(
        fix.description
            .contains("grpo.generations_per_micro_step = 8, was 16"),
        "{}",
        fix.description
    );
    assert!(split < shorter, "{fixes:#?}");
    let fit = auto_fit(&req).expect("auto-fit");
    println!("{:#?}", fit.changes);
    assert!(fit.found, "{:#?}", fit.changes);
    assert_eq!(
        fit.steps,
        vec![Change::GenerationsPerMicroStep(8)],
        "{:#?}",
        fit.changes
    );
}
