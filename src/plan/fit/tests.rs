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
