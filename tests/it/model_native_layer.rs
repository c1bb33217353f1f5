//! The native decoder-layer op (one CPU op per layer with a hand-written backward) against
//! the graph of candle ops it replaces: same loss and same gradient for every parameter, on
//! every fixture architecture (GQA, Mistral's sliding window, Qwen2's q/k/v biases), with
//! padding, a batch of two rows, and activation checkpointing.
use crate::support::{fixture, max_abs};

use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use tunestudio::model::{AdamW, AdamWConfig, CausalLm, Gradients, LoraConfig};

fn inputs(case: &str) -> (Tensor, Tensor, Tensor) {
    let r: HashMap<String, Tensor> =
        candle_core::safetensors::load(fixture(case).join("reference.safetensors"), &Device::Cpu)
            .expect("reference.safetensors of the fixture");
    (
        r["input_ids"].clone(),
        r["attention_mask"].clone(),
        r["labels"].clone(),
    )
}

fn run(case: &str, native: bool, checkpointing: bool) -> (f64, Gradients, usize) {
    let mut model = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
    model.set_native_layers(native);
    model.set_activation_checkpointing(checkpointing);
    let (ids, mask, labels) = inputs(case);
    let loss = model.loss(&ids, Some(&mask), &labels).unwrap();
    let grads = model.backward(&loss.sum).unwrap();
    (loss.mean().unwrap(), grads, model.native_layer_count())
}

/// Loss, gradients and native layer count of one step of `case` on the given batch.
fn run_on(
    case: &str,
    native: bool,
    ids: &Tensor,
    mask: Option<&Tensor>,
    labels: &Tensor,
) -> (f64, Gradients, usize) {
    let mut model = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
    model.set_native_layers(native);
    let loss = model.loss(ids, mask, labels).unwrap();
    let grads = model.backward(&loss.sum).unwrap();
    (loss.mean().unwrap(), grads, model.native_layer_count())
}

fn assert_same(case: &str, what: &str, a: &(f64, Gradients, usize), b: &(f64, Gradients, usize)) {
    assert!(
        (a.0 - b.0).abs() <= 1e-5 * a.0.abs().max(1.0),
        "{case} {what}: loss {} vs {}",
        a.0,
        b.0
    );
    assert_eq!(
        a.1.names().collect::<Vec<_>>(),
        b.1.names().collect::<Vec<_>>(),
        "{case} {what}: gradient names"
    );
    for (name, ga) in a.1.iter() {
        let gb = b.1.get(name).unwrap();
        assert_eq!(ga.dims(), gb.dims(), "{case} {what}: {name} shape");
        let scale = max_abs(ga).max(1e-6);
        let d = max_abs(&(ga - gb).unwrap());
        assert!(
            d <= 1e-4 * scale,
            "{case} {what}: {name} differs by {d} (max |g| {scale})"
        );
    }
}

#[test]
fn native_layers_match_the_graph_path_on_every_architecture() {
    for case in ["tiny-llama", "tiny-mistral", "tiny-qwen2"] {
        let graph = run(case, false, false);
        let native = run(case, true, false);
        assert_eq!(graph.2, 0, "{case}: native layers were off");
        assert_eq!(native.2, 2, "{case}: both layers should run natively");
        assert_same(case, "native vs graph", &graph, &native);
        let native_ckpt = run(case, true, true);
        assert_same(case, "native checkpointed vs graph", &graph, &native_ckpt);
    }
}

/// Rows longer than the causal block (64 query rows), left padding in the second row, on the
/// model with q/k/v biases and on the one with a sliding window.
#[test]
fn native_layers_handle_a_padded_batch_of_long_rows() {
    let t = 150usize;
    let pad = std::env::var("PAD")
        .map(|v| v.parse().unwrap())
        .unwrap_or(20usize);
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    let mut labels = Vec::new();
    for row in 0..2usize {
        for i in 0..t {
            let padded = row == 1 && i < pad;
            let id = ((i * 7919 + row * 104_729) % 5000) as u32 + 3;
            ids.push(if padded { 0 } else { id });
            mask.push(u32::from(!padded));
            labels.push(if padded { -100i64 } else { id as i64 });
        }
    }
    let dev = Device::Cpu;
    let ids = Tensor::from_vec(ids, (2, t), &dev).unwrap();
    let mask = Tensor::from_vec(mask, (2, t), &dev).unwrap();
    let labels = Tensor::from_vec(labels, (2, t), &dev).unwrap();
    for case in ["tiny-qwen2", "tiny-mistral"] {
        let graph = run_on(case, false, &ids, Some(&mask), &labels);
        let native = run_on(case, true, &ids, Some(&mask), &labels);
        assert_eq!(native.2, 2);
        assert_same(case, "padded batch of long rows", &graph, &native);
    }
}

/// bf16 and f16 layers run natively (f32 arithmetic on the half values; a bf16 weight's
/// products on bf16 dot products where the CPU has them) and agree with the graph path, which
/// rounds after every op, within half precision: the loss to 0.5 %, every
/// gradient to 3 % of its largest element. Both are then held to the f32 reference.
#[test]
fn half_precision_layers_run_natively_and_match_the_graph_path() {
    for dtype in [DType::BF16, DType::F16] {
        for case in ["tiny-llama", "tiny-qwen2"] {
            let (ids, mask, labels) = inputs(case);
            let run = |native: bool| {
                let mut model = CausalLm::load(&fixture(case), dtype, &Device::Cpu).unwrap();
                model.set_native_layers(native);
                let loss = model.loss(&ids, Some(&mask), &labels).unwrap();
                let grads = model.backward(&loss.sum).unwrap();
                (loss.mean().unwrap(), grads, model.native_layer_count())
            };
            let (graph, native) = (run(false), run(true));
            let what = format!("{case} {dtype:?}");
            assert_eq!(native.2, 2, "{what}: both layers run natively");
            let f32_loss = run_f32_loss(case);
            for (path, l) in [("graph", graph.0), ("native", native.0)] {
                assert!(
                    (l - f32_loss).abs() <= 0.05,
                    "{what} {path}: loss {l} vs f32 {f32_loss}"
                );
            }
            assert!(
                (graph.0 - native.0).abs() <= 5e-3 * graph.0.abs(),
                "{what}: loss {} vs {}",
                graph.0,
                native.0
            );
            for (name, ga) in graph.1.iter() {
                let gb = native.1.get(name).unwrap();
                assert_eq!(
                    gb.dtype(),
                    dtype,
                    "{what}: {name} keeps the parameter dtype"
                );
                let ga = ga.to_dtype(DType::F32).unwrap();
                let gb = gb.to_dtype(DType::F32).unwrap();
                let scale = max_abs(&ga).max(1e-6);
                let d = max_abs(&(&ga - &gb).unwrap());
                assert!(
                    d <= 3e-2 * scale,
                    "{what}: {name} differs by {d} (max |g| {scale})"
                );
            }
        }
    }
}

fn run_f32_loss(case: &str) -> f64 {
    run(case, true, false).0
}

/// How a LoRA model of the parity test is made.
#[derive(Clone, Copy, Debug)]
enum Adapter {
    /// Fresh factors on every linear layer (B starts at zero, so the first step's `dA` is zero
    /// and only later steps test it), with this dropout.
    Fresh { dropout: f64 },
    /// The PEFT fixture's trained adapter (q, v, down; r 4), with this dropout.
    Peft { dropout: f64 },
}

/// The PEFT fixture's adapter folder with `lora_dropout` set to `dropout` (a copy in a temp
/// folder when it differs from the fixture's 0).
fn peft_adapter(dropout: f64) -> (std::path::PathBuf, Option<tempfile::TempDir>) {
    let src = fixture("tiny-llama-lora");
    if dropout == 0.0 {
        return (src, None);
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = std::fs::read_to_string(src.join("adapter_config.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    cfg["lora_dropout"] = serde_json::json!(dropout);
    std::fs::write(dir.path().join("adapter_config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dir.path().join("adapter_model.safetensors"),
    )
    .unwrap();
    (dir.path().to_path_buf(), Some(dir))
}

/// Per step of 3 AdamW steps: the loss, the logits before the step and every gradient; and
/// how many layers ran natively.
fn lora_steps(
    case: &str,
    adapter: Adapter,
    native: bool,
) -> (Vec<(f64, Tensor, Gradients)>, usize) {
    let mut model = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
    let _keep = match adapter {
        Adapter::Fresh { dropout } => {
            let cfg = LoraConfig {
                r: 4,
                alpha: 8.0,
                dropout,
                target_modules: vec!["all-linear".into()],
            };
            model.apply_lora(&cfg, 11).unwrap();
            None
        }
        Adapter::Peft { dropout } => {
            let (dir, keep) = peft_adapter(dropout);
            model.load_adapter(&dir).unwrap();
            keep
        }
    };
    model.set_native_layers(native);
    let (ids, mask, labels) = inputs(case);
    let mut opt = AdamW::new(model.params(), AdamWConfig::default(), false).unwrap();
    let mut steps = Vec::new();
    for _ in 0..3 {
        let logits = model.logits(&ids, Some(&mask)).unwrap();
        let loss = model.loss(&ids, Some(&mask), &labels).unwrap();
        let grads = model.backward(&loss.sum).unwrap();
        opt.step(&grads, 1e-2, 1.0 / loss.num_tokens as f64)
            .unwrap();
        steps.push((loss.mean().unwrap(), logits, grads));
    }
    (steps, model.native_layer_count())
}

/// LoRA through the native layer op against the graph path (and so against PEFT, which the
/// graph path is held to): loss, logits and every adapter gradient over three AdamW steps,
/// with and without adapter dropout, on every fixture architecture and the PEFT adapter; no
/// base weight gets a gradient.
#[test]
fn lora_native_layers_match_the_graph_path() {
    let mut cases = Vec::new();
    for case in ["tiny-llama", "tiny-mistral", "tiny-qwen2"] {
        for dropout in [0.0, 0.1] {
            cases.push((case, Adapter::Fresh { dropout }));
        }
    }
    for dropout in [0.0, 0.1] {
        cases.push(("tiny-llama", Adapter::Peft { dropout }));
    }
    for (case, adapter) in cases {
        let what = format!("{case} {adapter:?}");
        let (graph, graph_native) = lora_steps(case, adapter, false);
        let (native, native_count) = lora_steps(case, adapter, true);
        assert_eq!(graph_native, 0, "{what}: native layers were off");
        assert_eq!(
            native_count, 2,
            "{what}: both LoRA layers should run natively"
        );
        for (step, (g, n)) in graph.iter().zip(&native).enumerate() {
            assert!(
                (g.0 - n.0).abs() <= 1e-5 * g.0.abs().max(1.0),
                "{what} step {step}: loss {} vs {}",
                g.0,
                n.0
            );
            let d = max_abs(&(&g.1 - &n.1).unwrap());
            assert!(
                d <= 1e-5 * max_abs(&g.1).max(1.0),
                "{what} step {step}: logits differ by {d}"
            );
            let names: Vec<_> = n.2.names().collect();
            assert_eq!(
                g.2.names().collect::<Vec<_>>(),
                names,
                "{what}: gradient names"
            );
            assert!(
                names
                    .iter()
                    .all(|n| n.contains(".lora_A.") || n.contains(".lora_B.")),
                "{what}: a base weight has a gradient: {names:?}"
            );
            for (name, ga) in g.2.iter() {
                let gb = n.2.get(name).unwrap();
                let scale = max_abs(ga).max(1e-6);
                let d = max_abs(&(ga - gb).unwrap());
                assert!(
                    d <= 1e-5 * scale.max(1e-3),
                    "{what} step {step}: {name} differs by {d} (max |g| {scale})"
                );
            }
        }
    }
}

/// Tokens that repeat within and across rows: the native embedding's backward adds each
/// occurrence's gradient (into the tied lm-head's gradient on tiny-llama, into a fresh one on
/// untied tiny-mistral) exactly as `index_select`'s backward does.
#[test]
fn repeated_tokens_accumulate_embedding_gradients() {
    let (b, t) = (2usize, 40usize);
    let ids: Vec<u32> = (0..b * t).map(|i| (i % 7) as u32 + 3).collect();
    let labels: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let dev = Device::Cpu;
    let ids = Tensor::from_vec(ids, (b, t), &dev).unwrap();
    let labels = Tensor::from_vec(labels, (b, t), &dev).unwrap();
    for case in ["tiny-llama", "tiny-mistral"] {
        let graph = run_on(case, false, &ids, None, &labels);
        let native = run_on(case, true, &ids, None, &labels);
        assert_eq!(native.2, 2);
        assert_same(case, "repeated tokens", &graph, &native);
        let embed = native.1.get("model.embed_tokens.weight").unwrap();
        assert!(max_abs(embed) > 0.0, "{case}: embedding gradient is zero");
    }
}
