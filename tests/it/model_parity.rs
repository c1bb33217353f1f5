//! Parity with Hugging Face transformers on the tiny fixtures: logits, per-token loss,
//! gradients of every parameter and five AdamW steps.
use crate::support::{fixture, max_abs, max_diff};

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use tunestudio::model::{AdamW, AdamWConfig, CausalLm, OpsMode, StatePlacement};

fn reference(case: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(case).join("reference.safetensors"), &Device::Cpu)
        .expect("reference.safetensors of the fixture")
}

fn scalar(t: &Tensor) -> f32 {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0]
}

/// `fused` false: the composite reference ops; `mode` Generic: the device-generic ops (what a
/// GPU runs), forced on the CPU.
fn check_case(case: &str, fused: bool, mode: OpsMode) {
    let r = reference(case);
    let mut model = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
    model.set_ops_mode(mode);
    model.set_fused_ops(fused);
    let ids = &r["input_ids"];
    let mask = &r["attention_mask"];
    let labels = &r["labels"];

    // Logits and log-sum-exp.
    let logits = model.logits(ids, Some(mask)).unwrap();
    let first = logits.narrow(2, 0, 256).unwrap();
    let d = max_diff(&first, &r["logits_first256"]);
    assert!(d <= 1e-4, "{case}: logits_first256 differ by {d}");
    let m = logits.max_keepdim(2).unwrap();
    let lse = (logits
        .broadcast_sub(&m)
        .unwrap()
        .exp()
        .unwrap()
        .sum_keepdim(2)
        .unwrap()
        .log()
        .unwrap()
        + m)
        .unwrap()
        .squeeze(2)
        .unwrap();
    let d = max_diff(&lse, &r["logsumexp"]);
    assert!(d <= 1e-4, "{case}: logsumexp differs by {d}");

    // Per-token loss and mean loss.
    let per_tok = model.token_losses(ids, Some(mask), labels).unwrap();
    let d = max_diff(&per_tok, &r["per_token_loss"]);
    assert!(d <= 1e-5, "{case}: per_token_loss differs by {d}");
    let loss = model.loss(ids, Some(mask), labels).unwrap();
    let mean = loss.mean().unwrap() as f32;
    let d = (mean - scalar(&r["loss"])).abs();
    assert!(d <= 1e-5, "{case}: loss {mean} vs {} ", scalar(&r["loss"]));

    // Gradients of the mean loss.
    let mean_t = loss.sum.affine(1.0 / loss.num_tokens as f64, 0.0).unwrap();
    let grads = model.backward(&mean_t).unwrap();
    assert_eq!(
        grads.len(),
        model.params().len(),
        "{case}: every parameter gets a gradient"
    );
    let mut checked = 0;
    for (key, want) in &r {
        if let Some(name) = key.strip_prefix("grad.") {
            let got = grads
                .get(name)
                .unwrap_or_else(|| panic!("{case}: no gradient for {name}"));
            let d = max_diff(got, want);
            let tol = 1e-3 * max_abs(want);
            assert!(
                d <= tol,
                "{case}: grad of {name} differs by {d} (tol {tol})"
            );
            checked += 1;
        } else if let Some(name) = key.strip_prefix("gradrows.") {
            let rows = r[&format!("gradrows_ids.{name}")]
                .to_dtype(DType::U32)
                .unwrap();
            let got = grads.get(name).unwrap().index_select(&rows, 0).unwrap();
            let d = max_diff(&got, want);
            let tol = 1e-3 * max_abs(want);
            assert!(
                d <= tol,
                "{case}: grad rows of {name} differ by {d} (tol {tol})"
            );
            let norm = grads
                .get(name)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                .sqrt();
            let want_norm = scalar(&r[&format!("gradnorm.{name}")]);
            let rel = (norm - want_norm).abs() / want_norm;
            assert!(
                rel <= 1e-4,
                "{case}: grad norm of {name}: {norm} vs {want_norm}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 19, "{case}: only {checked} gradients compared");

    // Five AdamW steps with weight decay on every parameter.
    let cfg = AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decay_norms_and_biases: true,
    };
    let mut opt = AdamW::new(model.params(), cfg, false).unwrap();
    if mode == OpsMode::Generic {
        // The GPU's optimizer: moments as device tensors, updated with tensor ops.
        opt.set_state_placement(StatePlacement::Device).unwrap();
    }
    let want_losses = r["adamw_losses"].to_vec1::<f32>().unwrap();
    for (step, want) in want_losses.iter().enumerate() {
        let loss = model.loss(ids, Some(mask), labels).unwrap();
        let got = loss.mean().unwrap() as f32;
        assert!(
            (got - want).abs() <= 1e-4,
            "{case}: AdamW step {step} loss {got} vs {want}"
        );
        let grads = model.backward(&loss.sum).unwrap();
        opt.step(&grads, 1e-3, 1.0 / loss.num_tokens as f64)
            .unwrap();
    }
    assert_eq!(opt.steps_taken(), 5);
    let mut after = 0;
    for (key, want) in &r {
        if let Some(name) = key.strip_prefix("after5.") {
            let p = model.param(name).unwrap();
            let d = max_diff(p.var.as_tensor(), want);
            assert!(
                d <= 1e-4,
                "{case}: {name} after 5 AdamW steps differs by {d}"
            );
            after += 1;
        }
    }
    assert!(after >= 10);
}

#[test]
fn tiny_llama_matches_transformers() {
    check_case("tiny-llama", true, OpsMode::Native);
}

#[test]
fn tiny_mistral_matches_transformers() {
    check_case("tiny-mistral", true, OpsMode::Native);
}

#[test]
fn tiny_qwen2_matches_transformers() {
    check_case("tiny-qwen2", true, OpsMode::Native);
}

#[test]
fn composite_reference_ops_match_transformers() {
    check_case("tiny-llama", false, OpsMode::Native);
    check_case("tiny-mistral", false, OpsMode::Native);
    check_case("tiny-qwen2", false, OpsMode::Native);
}

/// The device-generic ops (what a GPU runs) against transformers, to the same tolerances,
/// AdamW's five steps included.
#[test]
fn generic_ops_match_transformers() {
    check_case("tiny-llama", true, OpsMode::Generic);
    check_case("tiny-mistral", true, OpsMode::Generic);
    check_case("tiny-qwen2", true, OpsMode::Generic);
}
