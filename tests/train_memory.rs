//! Activation checkpointing: the same gradients, less peak memory. Measured with the counting
//! allocator (this test binary installs it; it holds a single test so nothing else allocates
//! concurrently).

mod train_common;

use tunestudio::data::{DataConfig, Format};
use tunestudio::train::{InitMode, TrainingRun};

#[global_allocator]
static ALLOC: tunestudio::mem::CountingAllocator = tunestudio::mem::CountingAllocator::new();

#[test]
fn checkpointing_keeps_gradients_and_lowers_peak_memory() {
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
        let mut d = DataConfig::new(
            tunestudio::paths::shared_dir()
                .join("datasets/c4_demo.jsonl")
                .display()
                .to_string(),
        );
        d.format = Format::Text;
        d.max_length = 256;
        c.data = d;
        c.training.micro_batch = 4;
        c.training.activation_checkpointing = ckpt;
        TrainingRun::new(c).unwrap()
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
        "peak step memory above the loaded model: checkpointing off {:.1} MB, on {:.1} MB ({} tokens)",
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
