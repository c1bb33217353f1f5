//! Helpers shared by the trainer's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use tunestudio::data::{DataConfig, Format};
use tunestudio::train::{InitMode, RunConfig, ScheduleKind};

/// The tiny-llama fixture folder (hidden 64, 2 layers, vocab 49,152).
pub fn tiny_llama() -> PathBuf {
    tunestudio::paths::shared_dir().join("fixtures/tiny-llama")
}

/// The 999-row Alpaca demo dataset.
pub fn alpaca() -> PathBuf {
    tunestudio::paths::shared_dir().join("datasets/alpaca_en_demo.json")
}

/// The c4 demo rows as plain text (every token trained), cut at `max_length` tokens.
pub fn c4_text(max_length: usize) -> DataConfig {
    let mut d = DataConfig::new(
        tunestudio::paths::shared_dir()
            .join("datasets/c4_demo.jsonl")
            .display()
            .to_string(),
    );
    d.format = Format::Text;
    d.max_length = max_length;
    d
}

/// tiny-llama on alpaca_en_demo, fp32, seed 0, max_length 64, micro-batch 4, constant lr 1e-3,
/// no evaluation or checkpoints unless a test turns them on.
pub fn tiny_config(out: &Path, steps: u64) -> RunConfig {
    let mut c = RunConfig {
        output_dir: out.to_path_buf(),
        data: DataConfig {
            format: Format::Alpaca,
            max_length: 64,
            seed: 0,
            ..DataConfig::new(alpaca().display().to_string())
        },
        ..RunConfig::default()
    };
    c.model.source = tiny_llama().display().to_string();
    c.model.init = InitMode::Pretrained;
    c.training.micro_batch = 4;
    c.training.gradient_accumulation = 1;
    c.training.max_steps = Some(steps);
    c.training.learning_rate = 1e-3;
    // tiny-llama loads as pretrained, but its weights are random-like (loss 10.6 at step 0):
    // a from-scratch rate suits it, so the learning-rate lint is allowed by name.
    c.data.allow = vec!["learning-rate".into()];
    c.training.schedule = ScheduleKind::Constant;
    c.training.seed = 0;
    c.training.max_grad_norm = 1.0;
    c.eval.eval_every = 0;
    c.checkpoint.save_every = 0;
    c.checkpoint.save_final = false;
    c
}

/// A random-init model folder with `layers` layers and the fixture's tokenizer.
pub fn random_model_dir(dir: &Path, layers: usize, hidden: usize) -> PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(tiny_llama().join(f), m.join(f)).unwrap();
    }
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden / 4,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "vocab_size": 49152,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "initializer_range": 0.02
    });
    std::fs::write(
        m.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    m
}

/// Largest absolute difference between two tensors.
pub fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    let a = a.to_dtype(candle_core::DType::F64).unwrap();
    let b = b.to_dtype(candle_core::DType::F64).unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Compares two gradient maps: same names, every element within `tol`; returns the largest difference.
pub fn compare_grads(
    a: &std::collections::HashMap<String, candle_core::Tensor>,
    b: &std::collections::HashMap<String, candle_core::Tensor>,
    tol: f64,
) -> f64 {
    assert_eq!(a.len(), b.len(), "different parameter sets");
    let mut worst = 0f64;
    for (name, ga) in a {
        let gb = b
            .get(name)
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let d = max_abs_diff(ga, gb);
        assert!(d <= tol, "{name}: gradients differ by {d:e} (> {tol:e})");
        worst = worst.max(d);
    }
    worst
}

/// What the last process that trained in `out` did, from `metrics.jsonl`: its `Started`
/// event's `start_step`, whether it resumed, and the steps it logged. A resume that retrained
/// from step 1 (ignoring the checkpoint) logs the same losses, since training is deterministic;
/// these say which steps really ran.
pub fn last_process_steps(out: &Path) -> (u64, bool, Vec<u64>) {
    use tunestudio::train::Event;
    let events = tunestudio::train::read_metrics(out).unwrap();
    let start = events
        .iter()
        .rposition(|e| matches!(e, Event::Started { .. }))
        .expect("a started event");
    let Event::Started {
        start_step,
        resumed_from,
        ..
    } = &events[start]
    else {
        unreachable!()
    };
    let steps = events[start..]
        .iter()
        .filter_map(|e| match e {
            Event::Step { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    (*start_step, resumed_from.is_some(), steps)
}

/// Asserts that the last process in `out` resumed after step `from` and ran exactly the
/// steps `from + 1 ..= last`.
pub fn assert_resumed_after(out: &Path, from: u64, last: u64) {
    let (start_step, resumed, steps) = last_process_steps(out);
    assert!(resumed, "the last run did not resume");
    assert_eq!(start_step, from, "the resumed run started at another step");
    assert_eq!(
        steps,
        (from + 1..=last).collect::<Vec<_>>(),
        "the resumed process ran other steps than those after its checkpoint"
    );
}
