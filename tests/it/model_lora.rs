//! LoRA: the PEFT fixture adapter reproduces PEFT's loss, logits and gradients; adapters
//! round-trip through save/load in PEFT's layout; merging folds them into the weights.
use crate::support::{fixture, max_abs, max_diff};

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use tunestudio::model::{AdamW, AdamWConfig, CausalLm, LoraConfig, ModelError, OpsMode};

fn lora_model(fused: bool, mode: OpsMode) -> CausalLm {
    let mut model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    model.set_ops_mode(mode);
    model.set_fused_ops(fused);
    let cfg = model.load_adapter(&fixture("tiny-llama-lora")).unwrap();
    assert_eq!(cfg.r, 4);
    assert_eq!(cfg.alpha, 8.0);
    let mut targets = cfg.target_modules.clone();
    targets.sort();
    assert_eq!(targets, ["down_proj", "q_proj", "v_proj"]);
    model
}

fn check_against_peft(fused: bool, mode: OpsMode) {
    let r = candle_core::safetensors::load(
        fixture("tiny-llama-lora").join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let model = lora_model(fused, mode);
    let (ids, mask, labels) = (&r["input_ids"], &r["attention_mask"], &r["labels"]);
    let logits = model.logits(ids, Some(mask)).unwrap();
    let d = max_diff(&logits.narrow(2, 0, 256).unwrap(), &r["logits_first256"]);
    assert!(d <= 1e-4, "LoRA logits differ by {d}");
    let loss = model.loss(ids, Some(mask), labels).unwrap();
    let want = r["loss"].to_vec1::<f32>().unwrap()[0];
    let got = loss.mean().unwrap() as f32;
    assert!((got - want).abs() <= 1e-5, "LoRA loss {got} vs {want}");

    let mean = loss.sum.affine(1.0 / loss.num_tokens as f64, 0.0).unwrap();
    let grads = model.backward(&mean).unwrap();
    // Only the 12 LoRA factors are trainable and get gradients.
    assert_eq!(grads.len(), 12);
    assert!(grads.names().all(|n| n.contains(".lora_")));
    let mut checked = 0;
    for (key, want) in &r {
        let Some(peft) = key.strip_prefix("grad.base_model.model.") else {
            continue;
        };
        let name = peft.replace(".default.weight", ".weight");
        let got = grads
            .get(&name)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let d = max_diff(got, want);
        assert!(d <= 1e-3 * max_abs(want), "LoRA grad {name} differs by {d}");
        checked += 1;
    }
    assert_eq!(checked, 12);
    // Frozen base weights are not trainable.
    let frozen = model.params().iter().filter(|p| !p.trainable).count();
    assert_eq!(frozen, model.config().parameter_shapes().len());
}

#[test]
fn peft_adapter_matches_reference() {
    check_against_peft(true, OpsMode::Native);
}

#[test]
fn peft_adapter_matches_reference_with_composite_ops() {
    check_against_peft(false, OpsMode::Native);
}

#[test]
fn peft_adapter_matches_reference_with_generic_ops() {
    check_against_peft(true, OpsMode::Generic);
}

#[test]
fn adapter_save_round_trips_in_peft_layout() {
    let model = lora_model(true, OpsMode::Native);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("adapter");
    model.save_adapter(&out).unwrap();

    let saved = candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
        .unwrap();
    let original = candle_core::safetensors::load(
        fixture("tiny-llama-lora").join("adapter_model.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let mut a: Vec<_> = saved.keys().cloned().collect();
    let mut b: Vec<_> = original.keys().cloned().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "saved keys follow PEFT's names");
    for (k, t) in &original {
        assert_eq!(max_diff(&saved[k], t), 0.0, "{k} changed on save");
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["task_type"], "CAUSAL_LM");
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"], 8);
    assert_eq!(cfg["lora_dropout"], 0.0);
    assert_eq!(cfg["bias"], "none");
    assert_eq!(cfg["fan_in_fan_out"], false);
    assert_eq!(cfg["inference_mode"], true);
    assert!(cfg["base_model_name_or_path"].is_string());
    assert_eq!(cfg["target_modules"].as_array().unwrap().len(), 3);

    // Reload into a fresh base model: identical tensors.
    let mut again = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    again.load_adapter(&out).unwrap();
    for p in model.params().iter().filter(|p| p.name.contains(".lora_")) {
        let q = again.param(&p.name).unwrap();
        assert_eq!(max_diff(p.var.as_tensor(), q.var.as_tensor()), 0.0);
    }
}

#[test]
fn merge_lora_keeps_logits() {
    let r = candle_core::safetensors::load(
        fixture("tiny-llama-lora").join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let mut model = lora_model(true, OpsMode::Native);
    let before = model
        .logits(&r["input_ids"], Some(&r["attention_mask"]))
        .unwrap();
    model.merge_lora().unwrap();
    assert!(model.params().iter().all(|p| !p.name.contains("lora_")));
    let after = model
        .logits(&r["input_ids"], Some(&r["attention_mask"]))
        .unwrap();
    let d = max_diff(&before, &after);
    assert!(d <= 1e-4, "merged logits differ by {d}");
}

#[test]
fn fresh_lora_trains_only_adapters() {
    let r = candle_core::safetensors::load(
        fixture("tiny-llama").join("reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let mut model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let base_before: HashMap<String, Tensor> = model
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.var.as_tensor().copy().unwrap()))
        .collect();
    let cfg = LoraConfig {
        r: 2,
        alpha: 4.0,
        dropout: 0.1,
        target_modules: vec!["all-linear".into()],
    };
    model.apply_lora(&cfg, 7).unwrap();
    // B = 0: the adapter starts as the identity.
    let base_loss = 10.829_321_f32;
    let (ids, mask, labels) = (&r["input_ids"], &r["attention_mask"], &r["labels"]);
    let l0 = model.token_losses(ids, Some(mask), labels).unwrap();
    assert!(max_diff(&l0, &r["per_token_loss"]) <= 1e-5);
    let mut opt = AdamW::new(model.params(), AdamWConfig::default(), false).unwrap();
    for _ in 0..3 {
        let loss = model.loss(ids, Some(mask), labels).unwrap();
        let grads = model.backward(&loss.sum).unwrap();
        assert_eq!(grads.len(), 2 * 7 * 2);
        opt.step(&grads, 1e-2, 1.0 / loss.num_tokens as f64)
            .unwrap();
    }
    let after = model.loss(ids, Some(mask), labels).unwrap().mean().unwrap() as f32;
    assert!(
        after < base_loss,
        "LoRA training lowers the loss ({after} vs {base_loss})"
    );
    for (name, t) in &base_before {
        assert_eq!(
            max_diff(model.param(name).unwrap().var.as_tensor(), t),
            0.0,
            "{name} is frozen"
        );
    }
    // A second adapter on top is refused with a typed error.
    assert!(matches!(
        model.apply_lora(&cfg, 1),
        Err(ModelError::Lora(_))
    ));
}
