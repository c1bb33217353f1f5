//! The device-generic ops path (what a GPU runs) against the CPU native path, on the CPU:
//! the same loss and gradients, gradients only where wanted.
use crate::support::fixture;

use crate::train_common::max_abs_diff;
use candle_core::{DType, Device, Tensor};
use tunestudio::model::{CausalLm, Gradients, LoraConfig, OpsMode};

fn batch(case: &str) -> (Tensor, Tensor, Tensor) {
    let r =
        candle_core::safetensors::load(fixture(case).join("reference.safetensors"), &Device::Cpu)
            .unwrap();
    (
        r["input_ids"].clone(),
        r["attention_mask"].clone(),
        r["labels"].clone(),
    )
}

/// Mean loss and gradients of one batch in `mode`, with `prepare` applied to the model.
fn loss_and_grads(
    case: &str,
    mode: OpsMode,
    checkpointing: bool,
    prepare: impl Fn(&mut CausalLm),
) -> (f64, Gradients) {
    let mut model = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
    model.set_ops_mode(mode);
    model.set_activation_checkpointing(checkpointing);
    prepare(&mut model);
    let (ids, mask, labels) = batch(case);
    let loss = model.loss(&ids, Some(&mask), &labels).unwrap();
    let mean = loss.mean().unwrap();
    let scaled = loss.sum.affine(1.0 / loss.num_tokens as f64, 0.0).unwrap();
    (mean, model.backward(&scaled).unwrap())
}

fn assert_same(case: &str, a: &(f64, Gradients), b: &(f64, Gradients), tol: f32) {
    assert!(
        (a.0 - b.0).abs() <= tol as f64,
        "{case}: loss {} vs {}",
        a.0,
        b.0
    );
    assert_eq!(a.1.len(), b.1.len(), "{case}: gradient count");
    for name in a.1.names() {
        let (x, y) = (a.1.get(name).unwrap(), b.1.get(name).unwrap());
        let d = max_abs_diff(x, y) as f32;
        assert!(d <= tol, "{case}: gradient of {name} differs by {d}");
    }
}

#[test]
fn generic_matches_native_on_loss_and_every_gradient() {
    for case in ["tiny-llama", "tiny-mistral", "tiny-qwen2"] {
        let native = loss_and_grads(case, OpsMode::Native, false, |_| {});
        let generic = loss_and_grads(case, OpsMode::Generic, false, |_| {});
        assert_same(case, &native, &generic, 1e-5);
    }
}

#[test]
fn generic_lora_matches_native_and_leaves_frozen_weights_without_gradients() {
    // tiny-llama: PEFT's fixture adapter (B ≠ 0); tiny-qwen2: fresh factors on every linear.
    let attach = |m: &mut CausalLm| {
        if m.config().qkv_bias() {
            let cfg = LoraConfig {
                r: 8,
                alpha: 16.0,
                dropout: 0.0,
                target_modules: vec!["all-linear".into()],
            };
            m.apply_lora(&cfg, 7).unwrap();
        } else {
            m.load_adapter(&fixture("tiny-llama-lora")).unwrap();
        }
    };
    for case in ["tiny-llama", "tiny-qwen2"] {
        let native = loss_and_grads(case, OpsMode::Native, false, attach);
        let generic = loss_and_grads(case, OpsMode::Generic, false, attach);
        assert_same(case, &native, &generic, 1e-5);
        assert!(generic.1.names().all(|n| n.contains(".lora_")));
    }
    // candle's own store of the generic backward: no frozen base weight in it.
    let mut model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    model.set_ops_mode(OpsMode::Generic);
    attach(&mut model);
    let (ids, mask, labels) = batch("tiny-llama");
    let store = model
        .loss(&ids, Some(&mask), &labels)
        .unwrap()
        .sum
        .backward()
        .unwrap();
    let mut frozen = 0;
    for p in model.params().iter().filter(|p| !p.trainable) {
        assert!(
            store.get(p.var.as_tensor()).is_none(),
            "frozen {} got a gradient on the generic path",
            p.name
        );
        frozen += 1;
    }
    assert!(frozen > 10, "only {frozen} frozen parameters");
}

#[test]
fn generic_checkpointing_keeps_every_gradient() {
    for case in ["tiny-llama", "tiny-mistral"] {
        let plain = loss_and_grads(case, OpsMode::Generic, false, |_| {});
        let ckpt = loss_and_grads(case, OpsMode::Generic, true, |_| {});
        assert_same(case, &plain, &ckpt, 1e-6);
    }
}

/// AdamW's state moved between placements mid-run (device tensors → host RAM → device
/// tensors, as generic mode, offload and resume do) updates exactly as the host in-place path.
#[test]
fn adamw_state_placements_give_the_same_updates() {
    use tunestudio::model::{AdamW, AdamWConfig, StatePlacement};
    let (ids, mask, labels) = batch("tiny-llama");
    let run_in = |dtype: DType, placements: &[StatePlacement]| -> CausalLm {
        let model = CausalLm::load(&fixture("tiny-llama"), dtype, &Device::Cpu).unwrap();
        let master = dtype != DType::F32;
        let mut opt = AdamW::new(model.params(), AdamWConfig::default(), master).unwrap();
        for &p in placements {
            opt.set_state_placement(p).unwrap();
            let loss = model.loss(&ids, Some(&mask), &labels).unwrap();
            let grads = model.backward(&loss.sum).unwrap();
            opt.step(&grads, 1e-3, 1.0 / loss.num_tokens as f64)
                .unwrap();
        }
        model
    };
    let run = |placements: &[StatePlacement]| run_in(DType::F32, placements);
    // bf16 parameters with f32 master weights (bf16-mixed): the host updates the master copy
    // and the parameter in place; the device path with tensor ops. Their f32 arithmetic
    // differs in order only, so the rounded parameters agree to a bf16 step.
    let host = run_in(DType::BF16, &[StatePlacement::Auto; 3]);
    let device = run_in(DType::BF16, &[StatePlacement::Device; 3]);
    for (a, b) in host.params().iter().zip(device.params()) {
        let d = max_abs_diff(a.var.as_tensor(), b.var.as_tensor());
        assert!(d <= 1e-3, "bf16-mixed {} differs by {d}", a.name);
    }
    let host = run(&[StatePlacement::Auto; 3]);
    let moved = run(&[
        StatePlacement::Device,
        StatePlacement::Host,
        StatePlacement::Device,
    ]);
    for (a, b) in host.params().iter().zip(moved.params()) {
        let d = max_abs_diff(a.var.as_tensor(), b.var.as_tensor());
        assert!(d <= 1e-6, "{} differs by {d}", a.name);
    }
}
