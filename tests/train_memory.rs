//! What a training step keeps alive, measured with the counting allocator (this test binary
//! installs it; its tests take a lock so nothing else allocates while one measures):
//! activation checkpointing on the native and the device-generic paths, and the generic loss.

// Test code: helpers outside `#[test]` functions unwrap too (clippy's `allow-unwrap-in-tests`
// covers only the tests themselves); a panic here is a failed test, not a user's crash.
#![allow(clippy::unwrap_used)]

mod train_common;

use tunestudio::model::{CausalLm, ModelConfig, OpsMode};
use tunestudio::train::{InitMode, TrainingRun};

#[global_allocator]
static ALLOC: tunestudio::mem::CountingAllocator = tunestudio::mem::CountingAllocator::new();

/// The counting allocator is process-wide: tests that measure must not overlap.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    MEASURING.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn checkpointing_keeps_gradients_and_lowers_peak_memory() {
    checkpointing_case(OpsMode::Native);
}

/// The same on the device-generic path (what a GPU runs): checkpointing is no CPU-only feature.
#[test]
fn generic_checkpointing_keeps_gradients_and_lowers_peak_memory() {
    checkpointing_case(OpsMode::Generic);
}

fn checkpointing_case(mode: OpsMode) {
    let _guard = exclusive();
    assert!(
        tunestudio::mem::is_installed(),
        "the counting allocator must be this binary's global allocator"
    );
    let tmp = tempfile::tempdir().unwrap();
    // 6 random-init layers (hidden 64) on 256-token plain-text rows: activations, which
    // checkpointing drops, are a visible part of the peak next to the loss's logits chunk.
    let model = train_common::random_model_dir(tmp.path(), 6, 64);
    let make = |ckpt: bool| {
        let mut c = train_common::tiny_config(&tmp.path().join(format!("out-{ckpt}")), 1);
        c.model.source = model.display().to_string();
        c.model.init = InitMode::Random;
        c.data = train_common::c4_text(256);
        c.training.micro_batch = 4;
        c.training.activation_checkpointing = ckpt;
        let mut run = TrainingRun::new(c).unwrap();
        run.model_mut().set_ops_mode(mode);
        run
    };
    let measure = |ckpt: bool| {
        let mut run = make(ckpt);
        let base = tunestudio::mem::current_bytes();
        tunestudio::mem::reset_peak();
        let g = run.preview_gradients().unwrap();
        let peak = tunestudio::mem::peak_bytes().saturating_sub(base);
        (g, peak)
    };
    let (g_off, peak_off) = measure(false);
    let (g_on, peak_on) = measure(true);
    println!(
        "{mode}: peak step memory above the loaded model: checkpointing off {:.1} MB, on {:.1} MB ({} tokens)",
        peak_off as f64 / 1e6,
        peak_on as f64 / 1e6,
        g_off.tokens
    );
    assert_eq!(g_off.tokens, g_on.tokens);
    let worst = train_common::compare_grads(&g_off.grads, &g_on.grads, 1e-5);
    println!("max |Δgrad| checkpointing on vs off = {worst:e}");
    assert!(
        peak_on < peak_off,
        "checkpointing did not lower the peak: {peak_on} vs {peak_off}"
    );
}

const VOCAB: u64 = 131_072;

/// Bytes held between the loss's forward and backward (the graph's saved tensors), for a
/// model whose `[tokens × vocab]` logits would dwarf everything else.
fn bytes_kept_by_the_loss(configure: impl Fn(&mut CausalLm)) -> (u64, u64) {
    use candle_core::{DType, Device, Tensor};
    let raw = std::fs::read_to_string(train_common::tiny_llama().join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&raw).unwrap();
    // A short sequence and a huge vocabulary: the attention activations (which the graph
    // keeps on every path) are a few MB, the logits 64 MiB.
    json["vocab_size"] = VOCAB.into();
    let cfg = ModelConfig::from_json_str(&json.to_string(), "wide-vocab").unwrap();
    let mut model = CausalLm::random_init(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    configure(&mut model);
    let t = 128usize;
    let ids: Vec<u32> = (0..t as u32).map(|i| (i * 7919) % VOCAB as u32).collect();
    let ids = Tensor::from_vec(ids, (1, t), &Device::Cpu).unwrap();
    let labels = ids.to_dtype(DType::I64).unwrap();
    let before = tunestudio::mem::current_bytes();
    let loss = model.loss(&ids, None, &labels).unwrap();
    let kept = tunestudio::mem::current_bytes().saturating_sub(before);
    drop(model.backward(&loss.sum).unwrap());
    let logits_bytes = (t - 1) as u64 * VOCAB * 4;
    (kept, logits_bytes)
}

/// The generic loss (the GPU's) keeps one log-sum-exp per row, not the `[tokens × vocab]`
/// logits; the composite reference, which does keep them, shows the measurement can see them.
#[test]
fn generic_loss_keeps_no_vocab_sized_tensor_between_forward_and_backward() {
    let _guard = exclusive();
    let (generic, logits) = bytes_kept_by_the_loss(|m| m.set_ops_mode(OpsMode::Generic));
    let (reference, _) = bytes_kept_by_the_loss(|m| m.set_fused_ops(false));
    println!(
        "kept between forward and backward: generic {:.1} MB, reference {:.1} MB; logits {:.1} MB",
        generic as f64 / 1e6,
        reference as f64 / 1e6,
        logits as f64 / 1e6
    );
    assert!(
        reference >= logits,
        "the reference keeps its logits: {reference} < {logits}"
    );
    assert!(
        generic < logits / 4,
        "the generic loss kept {generic} B between forward and backward (logits are {logits} B)"
    );
}
