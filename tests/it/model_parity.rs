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
    let mut worst_after = 0f32;
    for (key, want) in &r {
        if let Some(name) = key.strip_prefix("after5.") {
            let p = model.param(name).unwrap();
            let d = max_diff(p.var.as_tensor(), want);
            worst_after = worst_after.max(d);
            assert!(
                d <= 1e-4,
                "{case}: {name} after 5 AdamW steps differs by {d}"
            );
            after += 1;
        }
    }
    assert!(after >= 10);
    println!("{case} ({mode:?}): parameters after 5 AdamW steps within {worst_after:.2e}");
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

/// Five AdamW steps of tiny-llama on the fixture batch with `weight_decay`, and whether
/// norms and biases decay; the parameters after them.
fn after_five_steps(weight_decay: f64, decay_norms_and_biases: bool) -> HashMap<String, Vec<f32>> {
    let r = reference("tiny-llama");
    let model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let cfg = AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay,
        decay_norms_and_biases,
    };
    let mut opt = AdamW::new(model.params(), cfg, false).unwrap();
    for _ in 0..5 {
        let loss = model
            .loss(&r["input_ids"], Some(&r["attention_mask"]), &r["labels"])
            .unwrap();
        let grads = model.backward(&loss.sum).unwrap();
        opt.step(&grads, 1e-3, 1.0 / loss.num_tokens as f64)
            .unwrap();
    }
    model
        .params()
        .iter()
        .map(|p| {
            let v = p
                .var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            (p.name.clone(), v)
        })
        .collect()
}

/// The transformers parity tolerance (1e-4) cannot see weight decay of 0.01 over 5 steps
/// (it moves a weight by at most ~6.6e-5), so decay is checked on its own: with decay 0.1,
/// decoupled as in torch's AdamW, each step scales a weight by (1 − lr·wd), so after 5 steps
/// a decayed weight sits ≈ 5·lr·wd = 5e-4 of itself below the same run without decay (the
/// gradients barely change over 5 steps). Norm weights (1-D) decay only when
/// `decay_norms_and_biases` is on.
#[test]
fn weight_decay_shrinks_matrices_and_norms_only_when_asked() {
    let plain = after_five_steps(0.0, false);
    let decayed = after_five_steps(0.1, false);
    let everything = after_five_steps(0.1, true);
    // Median over a tensor's larger elements of (plain − decayed) / plain.
    let shrink = |other: &HashMap<String, Vec<f32>>, name: &str| {
        let (a, b) = (&plain[name], &other[name]);
        let mut ratios: Vec<f64> = a
            .iter()
            .zip(b)
            .filter(|(x, _)| x.abs() > 1e-2)
            .map(|(x, y)| ((x - y) / x) as f64)
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios[ratios.len() / 2]
    };
    let matrix = "model.layers.0.self_attn.q_proj.weight";
    let norm = "model.layers.0.input_layernorm.weight";
    let m = shrink(&decayed, matrix);
    assert!(
        (4e-4..6e-4).contains(&m),
        "a matrix shrinks by {m:e}, expected ≈ 5e-4"
    );
    let n = shrink(&decayed, norm);
    assert!(
        n.abs() < 5e-5,
        "a norm weight must not decay by default: {n:e}"
    );
    let n_on = shrink(&everything, norm);
    assert!(
        (4e-4..6e-4).contains(&n_on),
        "with decay_norms_and_biases a norm shrinks by {n_on:e}"
    );
    println!("shrink after 5 steps, wd 0.1: matrix {m:.2e}, norm {n:.2e} (off) / {n_on:.2e} (on)");
}
