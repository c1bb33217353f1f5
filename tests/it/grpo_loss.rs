//! GRPO against TRL 1.16's own `GRPOTrainer` on `fixtures/tiny-llama-grpo` (two prompts × four
//! fixed completions, two reward functions; `../shared/README.md` says how it was made): the
//! advantages under each `scale_rewards`, the completion mask, the per-token log-probabilities
//! and entropies at temperature 1 and 0.7, every case's loss and LoRA gradients (native and
//! generic ops), the full fine-tuning step-0 gradients and a 3-step AdamW trajectory.

use crate::support::{fixture, max_abs, max_diff};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use tunestudio::model::grpo::{
    advantages, completion_mask, grpo_loss, model_completion_logps, CompletionLogps,
    GrpoLossSettings, GrpoLossType, ScaleRewards,
};
use tunestudio::model::{AdamW, AdamWConfig, CausalLm, OpsMode};

const G: usize = 4;
const EOS: u32 = 2;
const MAX_COMPLETION_LENGTH: usize = 16;

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        fixture("tiny-llama-grpo").join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

fn vec1(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// The largest `|got − want|` relative to `want`'s largest magnitude.
fn rel_diff(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    max_diff(got, want) / max_abs(want).max(1e-12)
}

/// The rewards of the fixture's functions weighted and summed, as TRL does.
fn weighted_rewards(r: &HashMap<String, Tensor>, per_func: &str) -> Vec<f32> {
    let per = r[per_func].to_vec2::<f32>().unwrap();
    let w = vec1(&r["reward_weights"]);
    per.iter()
        .map(|row| row.iter().zip(&w).map(|(x, w)| x * w).sum())
        .collect()
}

#[test]
fn advantages_match_trl_for_every_scaling_and_the_zero_std_group() {
    let r = reference();
    let rewards = weighted_rewards(&r, "rewards_per_func");
    assert_eq!(rewards, vec1(&r["rewards"]));
    for (scale, key) in [
        (ScaleRewards::Group, "advantages"),
        (ScaleRewards::Batch, "advantages.batch"),
        (ScaleRewards::None, "advantages.none"),
    ] {
        let a = advantages(&rewards, G, scale).unwrap();
        let want = vec1(&r[key]);
        for (g, w) in a.values.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6, "{key}: {:?} vs {want:?}", a.values);
        }
    }
    let edge = weighted_rewards(&r, "edge.rewards_per_func");
    let a = advantages(&edge, G, ScaleRewards::Group).unwrap();
    assert_eq!(
        &a.values[G..],
        &[0.0; G],
        "a group of equal rewards learns nothing"
    );
    for (g, w) in a.values.iter().zip(vec1(&r["edge.advantages"])) {
        assert!((g - w).abs() <= 1e-6);
    }
    assert_eq!(a.frac_zero_std(), 0.5, "TRL's frac_reward_zero_std");
}

#[test]
fn the_completion_mask_includes_the_eos_that_is_also_the_pad() {
    let r = reference();
    for (ids, mask) in [
        ("completion_ids", "completion_mask"),
        ("edge.completion_ids", "edge.completion_mask"),
    ] {
        let ids = r[ids]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec2::<u32>()
            .unwrap();
        let want = r[mask]
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for (row, w) in ids.iter().zip(&want) {
            assert_eq!(&completion_mask(row, &[EOS]), w, "{row:?}");
        }
    }
}

fn base() -> CausalLm {
    CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap()
}

fn lora_policy(mode: OpsMode) -> CausalLm {
    let mut m = base();
    m.set_ops_mode(mode);
    m.load_adapter(&fixture("tiny-llama-lora")).unwrap();
    m
}

fn logps(model: &CausalLm, r: &HashMap<String, Tensor>, temperature: f64) -> CompletionLogps {
    model_completion_logps(
        model,
        &r["prompt_ids"],
        &r["prompt_mask"],
        &r["completion_ids"],
        &r["completion_mask"],
        temperature,
        true,
    )
    .unwrap()
}

#[test]
fn log_probabilities_and_entropies_match_trl_at_two_temperatures() {
    let r = reference();
    // The entropies come from the head op's own pass: the fused kernel's and the generic op's.
    for mode in [OpsMode::Native, OpsMode::Generic] {
        let policy = lora_policy(mode);
        for (t, prefix) in [(1.0, "lora"), (0.7, "lora.t07")] {
            let got = logps(&policy, &r, t);
            let d = rel_diff(&got.logps, &r[&format!("{prefix}.per_token_logps")]);
            assert!(
                d <= 2e-6,
                "{mode:?} T {t}: log-probabilities differ by {d} (relative)"
            );
            let d = rel_diff(&got.entropies, &r[&format!("{prefix}.entropies")]);
            assert!(
                d <= 2e-6,
                "{mode:?} T {t}: entropies differ by {d} (relative)"
            );
        }
        // The reference is the base: the policy with its adapter disabled.
        let reference = policy.without_adapters(|m| logps(m, &r, 1.0));
        let d = rel_diff(&reference.logps, &r["lora.ref_per_token_logps"]);
        assert!(
            d <= 2e-6,
            "{mode:?}: reference log-probabilities differ by {d}"
        );
    }
}

/// One fixture case: its settings, temperature and old log-probabilities.
struct Case {
    name: &'static str,
    loss_type: GrpoLossType,
    beta: f64,
    temperature: f64,
    bias_correction_kl: bool,
    zero_advantages: bool,
    old: Option<&'static str>,
    epsilon_high: f64,
}

const fn case(name: &'static str, loss_type: GrpoLossType) -> Case {
    Case {
        name,
        loss_type,
        beta: 0.0,
        temperature: 1.0,
        bias_correction_kl: true,
        zero_advantages: false,
        old: None,
        epsilon_high: 0.2,
    }
}

fn cases() -> Vec<Case> {
    let kl = |name, bias_correction_kl, zero_advantages| Case {
        beta: 0.04,
        bias_correction_kl,
        zero_advantages,
        ..case(name, GrpoLossType::Grpo)
    };
    vec![
        case("dapo", GrpoLossType::Dapo),
        case("bnpo", GrpoLossType::Bnpo),
        case("grpo", GrpoLossType::Grpo),
        case("dr_grpo", GrpoLossType::DrGrpo),
        kl("grpo_kl", true, false),
        kl("kl_only", true, true),
        kl("kl_only_nocorr", false, true),
        Case {
            temperature: 0.7,
            old: Some("lora.clip.old_per_token_logps"),
            epsilon_high: 0.28,
            ..case("clip", GrpoLossType::Dapo)
        },
    ]
}

fn settings(c: &Case, mask: &Tensor) -> GrpoLossSettings {
    GrpoLossSettings {
        loss_type: c.loss_type,
        beta: c.beta,
        epsilon_low: 0.2,
        epsilon_high: c.epsilon_high,
        max_completion_length: MAX_COMPLETION_LENGTH,
        step_completion_tokens: f64::from(
            mask.to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap(),
        ),
        accumulation_steps: 1,
        bias_correction_kl: c.bias_correction_kl,
        micro_batch: None,
    }
}

fn check_lora_case(c: &Case, mode: OpsMode, r: &HashMap<String, Tensor>, reference: &Tensor) {
    let policy = lora_policy(mode);
    let lp = logps(&policy, r, c.temperature);
    let adv = if c.zero_advantages {
        r["advantages"].zeros_like().unwrap()
    } else {
        r["advantages"].clone()
    };
    let mask = &r["completion_mask"];
    let old = c.old.map(|k| r[k].clone());
    let loss = grpo_loss(
        &lp.logps,
        old.as_ref(),
        Some(reference),
        &adv,
        mask,
        &settings(c, mask),
    )
    .unwrap();
    let name = c.name;
    // The KL-only losses are built from differences of nearly equal log-probabilities: the
    // fixture's README puts two correct implementations 3e-5 apart; measured here 3.6e-5
    // (native) and 3.2e-5 (generic). 1e-4 still tells the bias-corrected KL from the plain one
    // (their gradients differ by 2 %).
    let tol = if name.starts_with("kl_only") {
        1e-4
    } else {
        2e-6
    };
    let got = loss.loss.to_scalar::<f32>().unwrap();
    let want = vec1(&r[&format!("lora.{name}.loss")])[0];
    assert!(
        (got - want).abs() <= tol * want.abs().max(1e-3),
        "{name} {mode:?}: loss {got} vs TRL's {want}"
    );
    let grads = policy.backward(&loss.loss).unwrap();
    let mut checked = 0;
    for (key, want) in r {
        let Some(peft) = key.strip_prefix(&format!("lora.{name}.grad.base_model.model.")) else {
            continue;
        };
        let param = peft.replace(".default.weight", ".weight");
        let d = rel_diff(
            grads
                .get(&param)
                .unwrap_or_else(|| panic!("no gradient for {param}")),
            want,
        );
        assert!(
            d <= tol.max(1e-5),
            "{name} {mode:?}: {param} differs by {d} (relative to its largest)"
        );
        checked += 1;
    }
    let want = if name == "bnpo" { 0 } else { 12 };
    assert_eq!(checked, want, "{name}: LoRA gradients compared");
}

fn check_lora_cases(mode: OpsMode) {
    let r = reference();
    let reference = base();
    for c in cases() {
        let rl = logps(&reference, &r, c.temperature).logps.detach();
        check_lora_case(&c, mode, &r, &rl);
    }
}

#[test]
fn every_loss_case_and_its_lora_gradients_match_trl() {
    check_lora_cases(OpsMode::Native);
}

#[test]
fn every_loss_case_and_its_lora_gradients_match_trl_with_generic_ops() {
    check_lora_cases(OpsMode::Generic);
}

#[test]
fn the_metrics_match_trls_logged_ones() {
    let r = reference();
    let policy = lora_policy(OpsMode::Native);
    let reference = logps(&base(), &r, 0.7).logps.detach();
    let c = &cases()[7];
    assert_eq!(c.name, "clip");
    let lp = logps(&policy, &r, c.temperature);
    let mask = &r["completion_mask"];
    let old = r["lora.clip.old_per_token_logps"].clone();
    let loss = grpo_loss(
        &lp.logps,
        Some(&old),
        Some(&reference),
        &r["advantages"],
        mask,
        &settings(c, mask),
    )
    .unwrap();
    let m = loss.metrics(&lp.entropies).unwrap();
    // TRL's `clip` case: 9 of 54 tokens clipped low, 6 high; per completion at most 2/3 high.
    for (got, want) in [
        (m.clip_low_mean, 0.166_666_67),
        (m.clip_high_mean, 0.111_111_11),
        (m.clip_region_mean, 0.277_777_8),
        (m.clip_low_min, 0.0),
        (m.clip_high_max, 0.666_666_7),
        (m.entropy, 10.776_234),
    ] {
        assert!((got - want).abs() < 1e-5, "{m:?}");
    }
    assert_eq!(m.tokens, 54.0);
}

/// The full fine-tuning case (`dapo`, β 0, T 1, no adapter): step-0 gradients of every
/// parameter and the tied embedding's, then three AdamW steps.
fn full_fine_tuning(mode: OpsMode) {
    let r = reference();
    let mut model = base();
    model.set_ops_mode(mode);
    let mask = &r["completion_mask"];
    let c = case("full", GrpoLossType::Dapo);
    let cfg = AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decay_norms_and_biases: false,
    };
    let mut opt = AdamW::new(model.params(), cfg, false).unwrap();
    let seen = r["full.adamw_per_token_logps"].clone();
    for step in 0..3 {
        let lp = logps(&model, &r, 1.0);
        let d = rel_diff(&lp.logps, &seen.get(step).unwrap());
        assert!(
            d <= 1e-5,
            "{mode:?} step {step}: log-probabilities differ by {d}"
        );
        let loss = grpo_loss(
            &lp.logps,
            None,
            None,
            &r["advantages"],
            mask,
            &settings(&c, mask),
        )
        .unwrap();
        let got = loss.loss.to_scalar::<f32>().unwrap();
        let want = vec1(&r["full.adamw_losses"])[step];
        assert!(
            (got - want).abs() <= 1e-6,
            "step {step}: loss {got} vs {want}"
        );
        let grads = model.backward(&loss.loss).unwrap();
        if step == 0 {
            check_step0_gradients(&r, &grads, mode);
        }
        opt.step(&grads, 1e-3, 1.0).unwrap();
    }
    let mut checked = 0;
    for (key, want) in &r {
        let Some(name) = key.strip_prefix("full.after3.") else {
            continue;
        };
        let got = model.param(name).unwrap().var.as_tensor();
        let d = max_diff(got, want);
        // Adam turns rounding into a full step where a gradient is ~0 (the README's 5e-6 between
        // two implementations); measured 7.5e-6 native, 8.3e-6 generic: 1e-5 is 1 % of one
        // step of lr 1e-3.
        assert!(d <= 1e-5, "{mode:?}: {name} after 3 steps differs by {d}");
        checked += 1;
    }
    assert_eq!(checked, 19, "parameters compared after 3 steps");
}

fn check_step0_gradients(
    r: &HashMap<String, Tensor>,
    grads: &tunestudio::model::Gradients,
    mode: OpsMode,
) {
    let mut checked = 0;
    for (key, want) in r {
        let Some(name) = key.strip_prefix("full.step0.grad.") else {
            continue;
        };
        let d = rel_diff(
            grads
                .get(name)
                .unwrap_or_else(|| panic!("no gradient for {name}")),
            want,
        );
        assert!(
            d <= 1e-5,
            "{mode:?}: step-0 gradient of {name} differs by {d}"
        );
        checked += 1;
    }
    assert_eq!(checked, 19, "step-0 gradients compared");
    let embed = "model.embed_tokens.weight";
    let g = grads.get(embed).unwrap();
    let norm = g
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .sqrt()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let want = vec1(&r[&format!("full.step0.gradnorm.{embed}")])[0];
    assert!(
        (norm - want).abs() <= 1e-5 * want,
        "{mode:?}: embedding gradient norm {norm} vs {want}"
    );
    let ids = r[&format!("full.step0.gradrows_ids.{embed}")]
        .to_dtype(DType::U32)
        .unwrap();
    let rows = g.index_select(&ids, 0).unwrap();
    let d = rel_diff(&rows, &r[&format!("full.step0.gradrows.{embed}")]);
    assert!(d <= 1e-5, "{mode:?}: embedding gradient rows differ by {d}");
}

#[test]
fn full_fine_tuning_gradients_and_three_adamw_steps_match_trl() {
    full_fine_tuning(OpsMode::Native);
}

#[test]
fn full_fine_tuning_matches_trl_with_generic_ops() {
    full_fine_tuning(OpsMode::Generic);
}
