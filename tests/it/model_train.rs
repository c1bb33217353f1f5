//! Training machinery: activation checkpointing, missing-gradient detection, AdamW groups,
//! master weights and state round trips, bf16, layer placement.
use crate::support::{fixture, max_diff};

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use tunestudio::model::{
    AdamW, AdamWConfig, CausalLm, Gradients, LoraConfig, ModelConfig, ModelError,
};

fn reference(case: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(case).join("reference.safetensors"), &Device::Cpu)
        .unwrap()
}

fn grads_of(model: &CausalLm, r: &HashMap<String, Tensor>) -> Gradients {
    let loss = model
        .loss(&r["input_ids"], Some(&r["attention_mask"]), &r["labels"])
        .unwrap();
    model.backward(&loss.sum).unwrap()
}

fn assert_same_grads(a: &Gradients, b: &Gradients, what: &str) {
    assert_eq!(a.len(), b.len());
    for (name, g) in a.iter() {
        let h = b
            .get(name)
            .unwrap_or_else(|| panic!("{what}: {name} missing"));
        let d = max_diff(g, h);
        assert!(d <= 1e-5, "{what}: gradient of {name} differs by {d}");
    }
}

#[test]
fn checkpointing_gives_the_same_gradients() {
    for case in ["tiny-mistral", "tiny-qwen2"] {
        let r = reference(case);
        let mut model = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
        let plain = grads_of(&model, &r);
        model.set_activation_checkpointing(true);
        assert!(model.activation_checkpointing());
        let ckpt = grads_of(&model, &r);
        assert_same_grads(&plain, &ckpt, case);
        // Running twice gives the same result (the side store is cleared per backward).
        let again = grads_of(&model, &r);
        assert_same_grads(&ckpt, &again, case);
    }
}

#[test]
fn checkpointing_with_lora_dropout_recomputes_the_same_masks() {
    let r = reference("tiny-llama");
    let cfg = LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.2,
        target_modules: vec!["q_proj".into(), "down_proj".into()],
    };
    let mut grads = Vec::new();
    for ckpt in [false, true] {
        let mut model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
        model.apply_lora(&cfg, 3).unwrap();
        // Make B non-zero so A gets a gradient too.
        for p in model.params() {
            if p.name.ends_with("lora_B.weight") {
                p.var
                    .set(&Tensor::full(0.01f32, p.var.dims(), &Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        model.set_activation_checkpointing(ckpt);
        grads.push(grads_of(&model, &r));
    }
    assert_eq!(grads[0].len(), 8);
    assert_same_grads(&grads[0], &grads[1], "LoRA + dropout");
}

#[test]
fn a_parameter_without_gradient_is_an_error() {
    let model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    // A "loss" that only depends on the final norm leaves every other parameter without a gradient.
    let norm = model
        .param("model.norm.weight")
        .unwrap()
        .var
        .as_tensor()
        .sum_all()
        .unwrap();
    match model.backward(&norm) {
        Err(ModelError::MissingGradient { name }) => assert_eq!(name, "model.embed_tokens.weight"),
        other => panic!("expected MissingGradient, got {:?}", other.map(|g| g.len())),
    }
}

fn zero_grads(model: &CausalLm) -> Gradients {
    let mut g = Gradients::new();
    for p in model.params().iter().filter(|p| p.trainable) {
        g.insert(&p.name, p.var.as_tensor().zeros_like().unwrap());
    }
    g
}

#[test]
fn adamw_parameter_groups_skip_norms_and_biases() {
    let model = CausalLm::load(&fixture("tiny-qwen2"), DType::F32, &Device::Cpu).unwrap();
    let before: HashMap<String, Tensor> = model
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.var.as_tensor().copy().unwrap()))
        .collect();
    let cfg = AdamWConfig {
        weight_decay: 0.1,
        decay_norms_and_biases: false,
        ..AdamWConfig::default()
    };
    let mut opt = AdamW::new(model.params(), cfg, false).unwrap();
    opt.step(&zero_grads(&model), 0.5, 1.0).unwrap();
    for p in model.params() {
        let b = &before[&p.name];
        let now = p.var.as_tensor();
        if p.name.ends_with(".bias") || p.name.ends_with("norm.weight") {
            assert_eq!(max_diff(now, b), 0.0, "{} must not decay", p.name);
        } else {
            // Zero gradient: only the decoupled decay p *= 1 - lr*wd acts.
            let want = b.affine(1.0 - 0.5 * 0.1, 0.0).unwrap();
            assert!(max_diff(now, &want) <= 1e-7, "{} decays", p.name);
        }
    }
    // A missing gradient is a typed error and leaves the state untouched.
    let mut partial = Gradients::new();
    partial.insert(
        "model.norm.weight",
        model
            .param("model.norm.weight")
            .unwrap()
            .var
            .as_tensor()
            .zeros_like()
            .unwrap(),
    );
    assert!(matches!(
        opt.step(&partial, 0.1, 1.0),
        Err(ModelError::Optimizer(_))
    ));
    assert_eq!(opt.steps_taken(), 1);
}

#[test]
fn adamw_state_round_trips() {
    let r = reference("tiny-llama");
    let a = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let b = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let mut oa = AdamW::new(a.params(), AdamWConfig::default(), false).unwrap();
    let g = grads_of(&a, &r);
    oa.step(&g, 1e-3, 0.01).unwrap();
    // b gets a's parameters and optimizer state; the next step must then agree.
    for p in b.params() {
        p.var
            .set(a.param(&p.name).unwrap().var.as_tensor())
            .unwrap();
    }
    let mut ob = AdamW::new(b.params(), AdamWConfig::default(), false).unwrap();
    ob.load_state_tensors(&oa.state_tensors().unwrap(), oa.steps_taken())
        .unwrap();
    let ga = grads_of(&a, &r);
    let gb = grads_of(&b, &r);
    oa.step(&ga, 1e-3, 0.01).unwrap();
    ob.step(&gb, 1e-3, 0.01).unwrap();
    for p in a.params() {
        assert_eq!(
            max_diff(p.var.as_tensor(), b.param(&p.name).unwrap().var.as_tensor()),
            0.0,
            "{}",
            p.name
        );
    }
    // A state of the wrong shape is rejected.
    let mut bad = oa.state_tensors().unwrap();
    bad.insert(
        "exp_avg.model.norm.weight".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
    );
    assert!(matches!(
        ob.load_state_tensors(&bad, 2),
        Err(ModelError::Optimizer(_))
    ));
}

/// A checkpoint's optimizer file, written tensor by tensor from the state's own memory, holds
/// exactly the state, under the names `load_state_tensors` reads: host vectors (the CPU's
/// path), device tensors (the GPU's path, forced on the CPU) and fp32 master copies alike.
#[test]
fn adamw_state_file_is_the_state() {
    use tunestudio::model::StatePlacement;
    let r = reference("tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    for (dtype, master, placement) in [
        (DType::F32, false, StatePlacement::Auto),
        (DType::F32, false, StatePlacement::Device),
        (DType::BF16, true, StatePlacement::Auto),
    ] {
        let model = CausalLm::load(&fixture("tiny-llama"), dtype, &Device::Cpu).unwrap();
        let mut opt = AdamW::new(model.params(), AdamWConfig::default(), master).unwrap();
        opt.set_state_placement(placement).unwrap();
        opt.step(&grads_of(&model, &r), 1e-3, 0.01).unwrap();
        let path = dir.path().join("optimizer.safetensors");
        opt.save_state(&path).unwrap();
        let saved = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
        let state = opt.state_tensors().unwrap();
        assert_eq!(saved.len(), state.len(), "{dtype:?} {placement:?}");
        for (name, t) in &state {
            assert_eq!(
                max_diff(t, &saved[name]),
                0.0,
                "{name} ({dtype:?} {placement:?})"
            );
        }
    }
}

#[test]
fn bf16_model_trains_with_master_weights() {
    let r = reference("tiny-llama");
    let model = CausalLm::load(&fixture("tiny-llama"), DType::BF16, &Device::Cpu).unwrap();
    assert!(model.params().iter().all(|p| p.var.dtype() == DType::BF16));
    let loss = model
        .loss(&r["input_ids"], Some(&r["attention_mask"]), &r["labels"])
        .unwrap();
    let mean = loss.mean().unwrap() as f32;
    let want = r["loss"].to_vec1::<f32>().unwrap()[0];
    assert!(
        (mean - want).abs() < 0.05,
        "bf16 loss {mean} vs f32 reference {want}"
    );
    let grads = model.backward(&loss.sum).unwrap();
    let mut opt = AdamW::new(model.params(), AdamWConfig::default(), true).unwrap();
    opt.step(&grads, 1e-3, 1.0 / loss.num_tokens as f64)
        .unwrap();
    let state = opt.state_tensors().unwrap();
    for p in model.params() {
        let master = &state[&format!("master.{}", p.name)];
        assert_eq!(master.dtype(), DType::F32);
        // The half-precision parameter is the rounded master weight.
        let rounded = master.to_dtype(DType::BF16).unwrap();
        assert_eq!(max_diff(p.var.as_tensor(), &rounded), 0.0, "{}", p.name);
    }
}

#[test]
fn random_init_is_deterministic_and_sane() {
    let cfg = ModelConfig::from_file(&fixture("tiny-qwen2").join("config.json")).unwrap();
    let a = CausalLm::random_init(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
    let b = CausalLm::random_init(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
    let c = CausalLm::random_init(&cfg, 2, DType::F32, &Device::Cpu).unwrap();
    let total: usize = a.params().iter().map(|p| p.var.elem_count()).sum();
    assert_eq!(total as u64, cfg.num_parameters());
    let w = "model.layers.0.mlp.up_proj.weight";
    assert_eq!(
        max_diff(
            a.param(w).unwrap().var.as_tensor(),
            b.param(w).unwrap().var.as_tensor()
        ),
        0.0
    );
    assert!(
        max_diff(
            a.param(w).unwrap().var.as_tensor(),
            c.param(w).unwrap().var.as_tensor()
        ) > 0.0
    );
    let std = a
        .param(w)
        .unwrap()
        .var
        .as_tensor()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    assert!((std - 0.02).abs() < 0.002, "init std {std}");
    let ids = Tensor::new(&[[5u32, 17, 900, 3, 44, 12]], &Device::Cpu).unwrap();
    let loss = a
        .loss(&ids, None, &ids.to_dtype(DType::I64).unwrap())
        .unwrap();
    let ln_v = (cfg.vocab_size as f64).ln();
    assert!(
        (loss.mean().unwrap() - ln_v).abs() < 0.5,
        "random-init loss ≈ ln(vocab)"
    );
    assert_eq!(loss.num_tokens, 5);
}

#[test]
fn layer_placement_on_one_device_keeps_results() {
    let r = reference("tiny-llama");
    let mut model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let before = model
        .logits(&r["input_ids"], Some(&r["attention_mask"]))
        .unwrap();
    model.set_layer_devices(&[home(0), home(1)]).unwrap();
    let after = model
        .logits(&r["input_ids"], Some(&r["attention_mask"]))
        .unwrap();
    assert_eq!(max_diff(&before, &after), 0.0);
    assert!(matches!(
        model.set_layer_devices(&[home(0)]),
        Err(ModelError::Input(_))
    ));
}

#[test]
fn bad_inputs_are_typed_errors() {
    let model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let too_big = Tensor::new(&[[1u32, 60000]], &Device::Cpu).unwrap();
    assert!(matches!(
        model.logits(&too_big, None),
        Err(ModelError::Input(_))
    ));
    let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).unwrap();
    let wrong_labels = Tensor::new(&[[1i64, 2]], &Device::Cpu).unwrap();
    assert!(matches!(
        model.loss(&ids, None, &wrong_labels),
        Err(ModelError::Input(_))
    ));
    let bad_label = Tensor::new(&[[1i64, 2, 99999]], &Device::Cpu).unwrap();
    assert!(matches!(
        model.loss(&ids, None, &bad_label),
        Err(ModelError::Input(_))
    ));
    let flat = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
    assert!(matches!(
        model.logits(&flat, None),
        Err(ModelError::Input(_))
    ));
    // All labels ignored: zero tokens, and backward still works.
    let ignored = Tensor::new(&[[-100i64, -100, -100]], &Device::Cpu).unwrap();
    let loss = model.loss(&ids, None, &ignored).unwrap();
    assert_eq!(loss.num_tokens, 0);
    assert_eq!(loss.mean().unwrap(), 0.0);
    // ... and on an untied model the head is reached too: zero gradients, no error.
    let untied = CausalLm::load(&fixture("tiny-mistral"), DType::F32, &Device::Cpu).unwrap();
    let loss = untied.loss(&ids, None, &ignored).unwrap();
    let grads = untied.backward(&loss.sum).unwrap();
    assert_eq!(grads.len(), untied.params().len());
    assert_eq!(grads.global_norm().unwrap(), 0.0);
}

#[test]
fn gradients_accumulate_and_norm() {
    let r = reference("tiny-llama");
    let model = CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
    let g1 = grads_of(&model, &r);
    let mut acc = g1.clone();
    acc.accumulate(g1.clone()).unwrap();
    let n1 = g1.global_norm().unwrap();
    let n2 = acc.global_norm().unwrap();
    assert!(n1 > 0.0);
    assert!((n2 - 2.0 * n1).abs() <= 1e-5 * n2, "{n2} vs 2 × {n1}");
    assert_eq!(acc.names().count(), g1.len());
}

/// Gradient accumulation into one buffer (`backward_into`, the trainer's path) gives the
/// gradients of summing each micro-batch's complete gradient set (`backward` + `accumulate`)
/// within 1e-6, on the native and the generic path, with and without checkpointing and LoRA.
#[test]
fn accumulating_into_one_buffer_matches_summing_gradient_sets() {
    use tunestudio::model::OpsMode;
    for case in ["tiny-llama", "tiny-mistral", "tiny-qwen2"] {
        let r = reference(case);
        let rows = r["input_ids"].dim(0).unwrap();
        let micro: Vec<(Tensor, Tensor, Tensor)> = (0..4)
            .map(|i| {
                let row = |t: &Tensor| t.narrow(0, i % rows, 1).unwrap();
                (
                    row(&r["input_ids"]),
                    row(&r["attention_mask"]),
                    row(&r["labels"]),
                )
            })
            .collect();
        for (ops, checkpointing, lora) in [
            (OpsMode::Native, false, false),
            (OpsMode::Native, true, true),
            (OpsMode::Generic, false, false),
            (OpsMode::Generic, true, true),
        ] {
            let mut model = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
            model.set_ops_mode(ops);
            model.set_activation_checkpointing(checkpointing);
            if lora {
                let cfg = LoraConfig {
                    r: 4,
                    alpha: 8.0,
                    dropout: 0.0,
                    target_modules: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
                };
                model.apply_lora(&cfg, 5).unwrap();
            }
            let mut summed: Option<Gradients> = None;
            let mut buffer = Gradients::new();
            for (ids, mask, labels) in &micro {
                let loss = model.loss(ids, Some(mask), labels).unwrap();
                let g = model.backward(&loss.sum).unwrap();
                match summed.as_mut() {
                    None => summed = Some(g),
                    Some(s) => s.accumulate(g).unwrap(),
                }
                let loss = model.loss(ids, Some(mask), labels).unwrap();
                model.backward_into(&loss.sum, &mut buffer).unwrap();
            }
            let summed = summed.unwrap();
            let what = format!("{case} {ops:?} ckpt {checkpointing} lora {lora}");
            assert_eq!(summed.len(), buffer.len(), "{what}");
            for (name, g) in summed.iter() {
                // Relative to the gradient's size: the sums run in another order (f32).
                let d =
                    max_diff(g, buffer.get(name).unwrap()) / crate::support::max_abs(g).max(1.0);
                assert!(d <= 1e-6, "{what}: {name} differs by {d:e} (relative)");
            }
        }
    }
}

/// Logical CPU device `index` (all share `Device::Cpu`; the index is their identity).
fn home(index: usize) -> tunestudio::model::Home {
    tunestudio::model::Home {
        index,
        device: Device::Cpu,
    }
}

/// The founding case's settings in miniature: layers split over two logical devices, and a
/// second micro-batch (accumulation), whose gradient taps hang off the loss. Every tap of a
/// stage is summed on that stage and moved to the head's explicitly; summing them all into
/// one scalar (as before) is a cross-device add that candle refuses on two GPUs, and the
/// placement rule refuses it here on logical CPU devices.
#[test]
fn accumulating_over_a_layer_split_keeps_each_stages_taps_on_its_stage() {
    use tunestudio::model::OpsMode;
    let r = reference("tiny-llama");
    let micro: Vec<(Tensor, Tensor, Tensor)> = (0..3)
        .map(|i| {
            let row = |t: &Tensor| t.narrow(0, i % 2, 1).unwrap();
            (
                row(&r["input_ids"]),
                row(&r["attention_mask"]),
                row(&r["labels"]),
            )
        })
        .collect();
    for ops in [OpsMode::Native, OpsMode::Generic] {
        let accumulate = |split: bool| {
            let mut model =
                CausalLm::load(&fixture("tiny-llama"), DType::F32, &Device::Cpu).unwrap();
            model.set_ops_mode(ops);
            if split {
                model.set_layer_devices(&[home(0), home(1)]).unwrap();
            }
            let mut buffer = Gradients::new();
            for (ids, mask, labels) in &micro {
                let loss = model.loss(ids, Some(mask), labels).unwrap();
                model
                    .backward_into(&loss.sum, &mut buffer)
                    .unwrap_or_else(|e| panic!("{ops:?}, split {split}: {e}"));
            }
            buffer
        };
        let one = accumulate(false);
        let split = accumulate(true);
        assert_eq!(one.len(), split.len());
        for (name, g) in one.iter() {
            assert_eq!(
                max_diff(g, split.get(name).unwrap()),
                0.0,
                "{ops:?}: {name}"
            );
        }
    }
}
