//! QLoRA's step memory (issue #22): the counting allocator's peak of one LoRA step on a
//! quantized base against the planner's, on the default (CPU) path and the generic path.
//! A binary of its own: it installs the counting allocator.

#![allow(clippy::unwrap_used)]

#[path = "plan_support/harness.rs"]
mod harness;

use harness::{err_pct, phase};
use tunestudio::mem::CountingAllocator;
use tunestudio::plan::StepPhase;
use tunestudio::settings::Quantization;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

/// SmolLM2's width with 2 layers and a 4096-token vocabulary (activations, not the head, make
/// the peak), micro-batch `b` × `t` tokens, LoRA r 8 on all seven linears, the base quantized.
fn check(q: Quantization, ckpt: bool, b: usize, t: usize) -> (f64, f64) {
    use candle_core::{DType, Device};
    use tunestudio::model::{CausalLm, LoraConfig, ModelConfig};
    use tunestudio::plan::Precision::Fp32;
    let mut raw = harness::model_config().raw.clone();
    raw["num_hidden_layers"] = 2.into();
    raw["vocab_size"] = 4096.into();
    let cfg = ModelConfig::from_json_str(&raw.to_string(), "2-layer smollm").unwrap();
    harness::warm_up_process();
    let c = harness::case(Fp32, ckpt, true, b, t);
    let zero = tunestudio::mem::current_bytes();
    let mut model = CausalLm::random_init(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    model.quantize_base(q).unwrap();
    let lora = LoraConfig {
        r: c.lora_r,
        alpha: 16.0,
        dropout: 0.0,
        target_modules: vec!["all-linear".into()],
    };
    model.apply_lora(&lora, 3).unwrap();
    assert_eq!(
        model.native_layer_count(),
        2,
        "quantized layers run natively"
    );
    let m = harness::measure(&mut model, &c, zero, 5);
    let mut req = harness::request(&cfg, &c);
    if let Some(l) = req.lora.as_mut() {
        l.quantize = q;
    }
    let d = harness::step_plan(tunestudio::plan::plan(&req).unwrap().per_device.remove(0));
    harness::print_row(&c, &m, &d);
    let e = err_pct(d.peak_bytes, m.peak);
    let bwd = m.bwd_peak.max(m.acc_peak);
    let eb = err_pct(phase(&d, StepPhase::Backward), bwd);
    eprintln!("{q} ckpt={ckpt} {b}x{t}: peak {e:+.2} %, backward {eb:+.2} %, weights measured {} MiB planned {} MiB",
        m.weights >> 20, d.weights_bytes >> 20);
    (e, eb)
}

#[test]
fn qlora_step_peak_matches_the_planner() {
    harness::print_header();
    for q in [Quantization::Q4K, Quantization::Q8_0] {
        // With and without checkpointing: within 3 %, with one dequantized weight as the
        // only transient the planner adds for the base.
        for ckpt in [true, false] {
            let (e, eb) = check(q, ckpt, 4, 256);
            assert!(
                e.abs() <= 3.0 && eb.abs() <= 3.0,
                "{q} checkpointing {ckpt}: {e:+.2} % / {eb:+.2} %"
            );
        }
    }
}
