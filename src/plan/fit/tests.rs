//! Ranked fixes on requests that do not fit.

use super::*;

/// DictaLM 2.0, GRPO with LoRA r 16, one prompt × G 16 of 512 + 2,048 tokens, on 24 GiB.
fn long_completions() -> PlanRequest {
    let path = crate::paths::shared_dir()
        .join("model-configs")
        .join("dictalm2-7b.json");
    PlanRequest {
        model: crate::model::ModelConfig::from_file(&path).expect("model config"),
        precision: Precision::Bf16,
        micro_batch: 16,
        gradient_accumulation: 1,
        seq_len: 512 + 2048,
        activation_checkpointing: true,
        optimizer_offload: false,
        lora: Some(LoraSpec::all_linear(16)),
        strategy: Strategy::Single,
        shard: Default::default(),
        devices: crate::plan::parse_devices("24GiB").expect("devices"),
        ops: crate::model::OpsMode::Auto,
        process: None,
        trained_tokens: None,
        head_loss: HeadLoss::Completions {
            generations: 16,
            completion_tokens: 2048,
        },
        reference: Default::default(),
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
