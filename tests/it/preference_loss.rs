//! Preference losses against what TRL's formulas computed with transformers + PEFT for
//! `fixtures/tiny-llama-dpo`: the policy (tiny-llama + the `tiny-llama-lora` adapter) and
//! reference (the same base without the adapter) log-probabilities of the three pairs,
//! the DPO-sigmoid, IPO and ORPO losses and rewards, and every LoRA gradient of each loss.

use crate::data_support::tiny_llama;
use crate::preference_data::fixture_pairs;
use crate::support::{fixture, max_abs, max_diff};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use tunestudio::data::preference::collate_pairs;
use tunestudio::data::CollateOptions;
use tunestudio::model::preference::{
    dpo_sigmoid_loss, ipo_loss, orpo_loss, sequence_logps, PairLogps, PreferenceLoss,
};
use tunestudio::model::{CausalLm, OpsMode};

const BETA: f64 = 0.1;

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        fixture("tiny-llama-dpo").join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap()
}

fn policy_model(mode: OpsMode) -> CausalLm {
    let mut m = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    m.set_ops_mode(mode);
    m.load_adapter(&fixture("tiny-llama-lora")).unwrap();
    m
}

/// The reference: the base model, i.e. the policy with its adapter disabled.
fn reference_model() -> CausalLm {
    CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap()
}

/// The fixture's batch, chosen rows then rejected rows: `(ids, mask, labels)`.
fn batch(r: &HashMap<String, Tensor>) -> (Tensor, Tensor, Tensor) {
    let cat = |k: &str| {
        Tensor::cat(
            &[&r[&format!("chosen.{k}")], &r[&format!("rejected.{k}")]],
            0,
        )
        .unwrap()
    };
    (cat("input_ids"), cat("attention_mask"), cat("labels"))
}

fn logps(model: &CausalLm, b: &(Tensor, Tensor, Tensor)) -> PairLogps {
    let logits = model.logits(&b.0, Some(&b.1)).unwrap();
    PairLogps::from_concatenated(&sequence_logps(&logits, &b.2).unwrap()).unwrap()
}

fn vec(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// `got` within `rel` of `want`, elementwise, relative to `want`'s magnitude.
fn assert_close(what: &str, got: &Tensor, want: &Tensor, rel: f32) {
    assert_within(what, got, want, |w| rel * w.abs().max(1e-6));
}

/// `got` within `tol` of `want`, elementwise.
fn assert_within(what: &str, got: &Tensor, want: &Tensor, tol: impl Fn(f32) -> f32) {
    let (g, w) = (vec(got), vec(want));
    assert_eq!(g.len(), w.len(), "{what}: lengths");
    for (a, b) in g.iter().zip(&w) {
        assert!((a - b).abs() <= tol(*b), "{what}: {g:?} vs {w:?}");
    }
}

#[test]
fn fixture_batch_is_what_the_data_layer_builds() {
    // The loss tests below read the fixture's tensors; they are the data layer's pairs.
    let tok = tiny_llama();
    let pairs = fixture_pairs(&tok);
    let refs: Vec<_> = pairs.iter().collect();
    let opts = CollateOptions {
        pad_id: tok.pad().id,
        max_length: usize::MAX,
        pad_to_multiple_of: 1,
    };
    let ours = collate_pairs(&refs, &opts);
    let (_, _, labels) = batch(&reference());
    let (b, t) = (ours.batch_size, ours.seq_len);
    let ours_labels = Tensor::from_vec(ours.labels.clone(), (b, t), &Device::Cpu).unwrap();
    assert_eq!(max_diff(&ours_labels, &labels), 0.0);
}

#[test]
fn policy_and_reference_logps_match_peft() {
    let r = reference();
    let b = batch(&r);
    let policy = logps(&policy_model(OpsMode::Native), &b);
    let reference = logps(&reference_model(), &b);
    assert_close(
        "policy chosen",
        &policy.chosen.sum,
        &r["lora.policy_chosen_logps"],
        1e-5,
    );
    assert_close(
        "policy rejected",
        &policy.rejected.sum,
        &r["lora.policy_rejected_logps"],
        1e-5,
    );
    assert_close(
        "reference chosen",
        &reference.chosen.sum,
        &r["lora.reference_chosen_logps"],
        1e-5,
    );
    assert_close(
        "reference rejected",
        &reference.rejected.sum,
        &r["lora.reference_rejected_logps"],
        1e-5,
    );
    assert_eq!(vec(&policy.chosen.tokens), vec(&r["lora.chosen_tokens"]));
    assert_eq!(
        vec(&policy.rejected.tokens),
        vec(&r["lora.rejected_tokens"])
    );
}

fn scalar(t: &Tensor) -> Tensor {
    t.reshape(1).unwrap()
}

/// The three losses from the policy's (graph-carrying) and the reference's log-probabilities.
fn losses(policy: &PairLogps, reference: &PairLogps) -> [(&'static str, PreferenceLoss); 3] {
    [
        (
            "dpo_sigmoid",
            dpo_sigmoid_loss(policy, reference, BETA, 0.0).unwrap(),
        ),
        ("ipo", ipo_loss(policy, reference, BETA).unwrap()),
        ("orpo", orpo_loss(policy, BETA).unwrap()),
    ]
}

#[test]
fn losses_and_rewards_match_trl() {
    let r = reference();
    let b = batch(&r);
    let policy = logps(&policy_model(OpsMode::Native), &b);
    let reference = logps(&reference_model(), &b);
    let [(_, dpo), (_, ipo), (_, orpo)] = losses(&policy, &reference);
    assert_close(
        "dpo loss",
        &scalar(&dpo.loss),
        &r["lora.dpo_sigmoid_loss"],
        1e-5,
    );
    // A reward is β times the difference of two sums near −173, where f32's spacing is
    // 1.5e-5: it is compared to 1e-5 absolute, not relative to its own size (~0.01).
    for (what, got, key) in [
        (
            "dpo rewards chosen",
            &dpo.rewards_chosen,
            "lora.rewards_chosen",
        ),
        (
            "dpo rewards rejected",
            &dpo.rewards_rejected,
            "lora.rewards_rejected",
        ),
    ] {
        assert_within(what, got, &r[key], |_| 1e-5);
    }
    assert_close("ipo loss", &scalar(&ipo.loss), &r["lora.ipo_loss"], 1e-5);
    assert_close("orpo loss", &scalar(&orpo.loss), &r["lora.orpo_loss"], 1e-5);
    assert_close(
        "orpo nll",
        &scalar(orpo.nll_loss.as_ref().unwrap()),
        &r["lora.orpo_nll"],
        1e-5,
    );
    // Log-odds are differences of mean log-probabilities near −10.7: absolute, as rewards.
    assert_within(
        "orpo log-odds",
        orpo.log_odds.as_ref().unwrap(),
        &r["lora.orpo_log_odds"],
        |_| 1e-5,
    );

    // TRL's metrics are means of those per-pair numbers (to the same absolute 1e-5).
    let m = dpo.metrics().unwrap();
    let mean = |k: &str| vec(&r[k]).iter().map(|&x| f64::from(x)).sum::<f64>() / 3.0;
    assert!((m.rewards_chosen - mean("lora.rewards_chosen")).abs() < 1e-5);
    // A margin is the difference of two rewards: twice their tolerance.
    assert!(
        (m.rewards_margins - (mean("lora.rewards_chosen") - mean("lora.rewards_rejected"))).abs()
            < 2e-5
    );
    let rc = vec(&r["lora.rewards_chosen"]);
    let rr = vec(&r["lora.rewards_rejected"]);
    let acc = rc.iter().zip(&rr).filter(|(c, r)| c > r).count() as f64 / 3.0;
    assert!((m.rewards_accuracies - acc).abs() < 1e-9);
    assert!((m.logps_chosen - mean("lora.policy_chosen_logps")).abs() < 1e-3);
    let names: Vec<&str> = orpo
        .metrics()
        .unwrap()
        .named()
        .iter()
        .map(|(n, _)| *n)
        .collect();
    for n in [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
        "log_odds_ratio",
    ] {
        assert!(names.contains(&n), "{names:?}");
    }
}

fn check_lora_gradients(mode: OpsMode) {
    let r = reference();
    let b = batch(&r);
    let model = policy_model(mode);
    let reference = logps(&reference_model(), &b).detach();
    for name in ["dpo_sigmoid", "ipo", "orpo"] {
        // A fresh forward per loss: backward consumes the graph's saved activations.
        let policy = logps(&model, &b);
        let all = losses(&policy, &reference);
        let loss = &all.iter().find(|(n, _)| *n == name).unwrap().1;
        let grads = model.backward(&loss.loss).unwrap();
        assert_eq!(
            grads.len(),
            12,
            "{name}: only the LoRA factors get gradients"
        );
        let mut checked = 0;
        for (key, want) in &r {
            let Some(peft) = key.strip_prefix(&format!("lora.{name}.grad.base_model.model."))
            else {
                continue;
            };
            let param = peft.replace(".default.weight", ".weight");
            let got = grads
                .get(&param)
                .unwrap_or_else(|| panic!("no gradient for {param}"));
            let d = max_diff(got, want);
            let scale = max_abs(want);
            assert!(
                d <= 1e-5 * scale,
                "{name} {mode:?}: {param} differs by {d} (max |g| {scale})"
            );
            checked += 1;
        }
        assert_eq!(checked, 12, "{name}");
    }
}

#[test]
fn lora_gradients_match_peft() {
    check_lora_gradients(OpsMode::Native);
}

#[test]
fn lora_gradients_match_peft_with_generic_ops() {
    check_lora_gradients(OpsMode::Generic);
}
