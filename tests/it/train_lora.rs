//! LoRA training (with dropout) resumes exactly, trains only the adapters, and exports as a
//! PEFT adapter and as a merged model; a full fine-tune exports as a model folder.

use crate::train_common;

use candle_core::{DType, Device, Tensor};
use train_common::*;
use tunestudio::model::CausalLm;
use tunestudio::train::{export_adapter, export_full, export_merged, RunConfig, TrainingRun};

fn lora_config(out: &std::path::Path, steps: u64) -> RunConfig {
    let mut c = tiny_config(out, steps);
    c.training.micro_batch = 2;
    c.training.learning_rate = 1e-2;
    c.lora.enabled = true;
    c.lora.r = 4;
    c.lora.alpha = 8.0;
    c.lora.dropout = 0.1;
    c.lora.target_modules = vec!["q_proj".into(), "v_proj".into(), "down_proj".into()];
    c
}

fn probe_logits(model: &CausalLm) -> Tensor {
    let ids = Tensor::new(&[[1u32, 100, 200, 300, 400, 500, 600, 2]], &Device::Cpu).unwrap();
    model.logits(&ids, None).unwrap()
}

#[test]
fn lora_with_dropout_resumes_exactly_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let mut reference = TrainingRun::new(lora_config(&tmp.path().join("ref"), 6)).unwrap();
    let (all, trainable) = reference.parameter_counts();
    assert!(
        trainable * 50 < all,
        "LoRA should train a small fraction: {trainable} of {all}"
    );
    let base_before = reference
        .model()
        .param("model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .var
        .as_tensor()
        .copy()
        .unwrap();
    let mut ref_losses = Vec::new();
    while !reference.is_done() {
        ref_losses.push(reference.step().unwrap().loss);
    }
    let base_after = reference
        .model()
        .param("model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .var
        .as_tensor()
        .copy()
        .unwrap();
    assert_eq!(
        max_abs_diff(&base_before, &base_after),
        0.0,
        "a frozen base weight changed"
    );

    let cfg = lora_config(&tmp.path().join("cut"), 6);
    let mut first = TrainingRun::new(cfg.clone()).unwrap();
    for _ in 0..3 {
        first.step().unwrap();
    }
    let ckpt = first.save_checkpoint().unwrap();
    assert!(ckpt.join("adapter/adapter_config.json").is_file());
    drop(first);
    let mut resumed = TrainingRun::resume(cfg, &ckpt).unwrap();
    let mut resumed_losses = Vec::new();
    while !resumed.is_done() {
        resumed_losses.push(resumed.step().unwrap().loss);
    }
    for (i, (a, b)) in ref_losses[3..].iter().zip(&resumed_losses).enumerate() {
        assert!((a - b).abs() <= 1e-6, "step {}: {a} vs {b}", i + 4);
    }

    // Exports from the final checkpoint of the reference run.
    let final_ckpt = reference.save_checkpoint().unwrap();
    let trained = probe_logits(reference.model());
    let adapter = export_adapter(&final_ckpt, &tmp.path().join("adapter")).unwrap();
    assert!(adapter.join("adapter_model.safetensors").is_file());
    let mut with_adapter = CausalLm::load(&tiny_llama(), DType::F32, &Device::Cpu).unwrap();
    with_adapter.load_adapter(&adapter).unwrap();
    let d_adapter = max_abs_diff(&probe_logits(&with_adapter), &trained);
    let merged = export_merged(&final_ckpt, &tmp.path().join("merged"), DType::F32).unwrap();
    assert!(merged.join("tokenizer.json").is_file());
    let merged_model = CausalLm::load(&merged, DType::F32, &Device::Cpu).unwrap();
    let d_merged = max_abs_diff(&probe_logits(&merged_model), &trained);
    println!("logit differences: adapter {d_adapter:e}, merged {d_merged:e}");
    assert!(d_adapter < 1e-4 && d_merged < 1e-4);
}

#[test]
fn full_finetune_exports_a_model_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let mut run = TrainingRun::new(tiny_config(tmp.path(), 2)).unwrap();
    run.step().unwrap();
    run.step().unwrap();
    let ckpt = run.save_checkpoint().unwrap();
    assert!(
        export_adapter(&ckpt, &tmp.path().join("x")).is_err(),
        "no adapter in a full fine-tune"
    );
    let out = export_full(&ckpt, &tmp.path().join("full"), DType::F32).unwrap();
    let loaded = CausalLm::load(&out, DType::F32, &Device::Cpu).unwrap();
    let d = max_abs_diff(&probe_logits(&loaded), &probe_logits(run.model()));
    assert!(d < 1e-5, "exported model differs: {d}");
}

/// `tunestudio export` (the studio's Export panel, headless) on a LoRA run and a full run
/// trained by `tunestudio train`: the merged model reproduces the adapter model's logits
/// within 1e-5, and every export loads back.
#[test]
fn cli_exports_adapter_merged_and_full() {
    let tmp = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_tunestudio");
    let run = |cfg: RunConfig, name: &str| {
        let path = tmp.path().join(format!("{name}.toml"));
        let mut cfg = cfg.with_absolute_paths();
        cfg.checkpoint.save_final = true;
        cfg.save(&path).unwrap();
        let out = std::process::Command::new(bin)
            .args(["train", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        cfg.output_path()
    };
    let export = |run_dir: &std::path::Path, kind: &str| {
        let dest = tmp.path().join(format!("export-{kind}"));
        let out = std::process::Command::new(bin)
            .args(["export", "--checkpoint"])
            .arg(run_dir)
            .args(["--kind", kind, "--dtype", "f32", "--out"])
            .arg(&dest)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        dest
    };
    let lora_run = run(lora_config(&tmp.path().join("lora"), 3), "lora");
    let adapter = export(&lora_run, "adapter");
    let merged = export(&lora_run, "merged");
    let mut with_adapter = CausalLm::load(&tiny_llama(), DType::F32, &Device::Cpu).unwrap();
    with_adapter.load_adapter(&adapter).unwrap();
    let merged_model = CausalLm::load(&merged, DType::F32, &Device::Cpu).unwrap();
    let d = max_abs_diff(&probe_logits(&merged_model), &probe_logits(&with_adapter));
    assert!(d < 1e-5, "merged vs adapter logits differ by {d:e}");

    let full_run = run(tiny_config(&tmp.path().join("full"), 2), "full");
    let full = export(&full_run, "full");
    let exported = CausalLm::load(&full, DType::F32, &Device::Cpu).unwrap();
    let base = CausalLm::load(&tiny_llama(), DType::F32, &Device::Cpu).unwrap();
    assert!(
        max_abs_diff(&probe_logits(&exported), &probe_logits(&base)) > 0.0,
        "not trained"
    );
    // A full run has no adapter: a clear error, not a crash.
    let out = std::process::Command::new(bin)
        .args(["export", "--kind", "adapter", "--checkpoint"])
        .arg(&full_run)
        .arg("--out")
        .arg(tmp.path().join("nope"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no LoRA"));
}
