//! QLoRA (issue #22): a quantized frozen base computes exactly what the dense model computes
//! on `dequantize(quantize(W))` — logits, loss and every LoRA gradient, on the native CPU path
//! and on the device-generic path — and gives no gradient to a quantized weight.

use crate::support::fixture;
use crate::train_common::max_abs_diff;
use candle_core::{DType, Device, Tensor};
use tunestudio::model::quant::{self, cache};
use tunestudio::model::{CausalLm, Gradients, LoraConfig, ModelConfig, ModelFiles, OpsMode};
use tunestudio::settings::{QuantFormat, Quantization};

const TOL: f64 = 1e-4;

fn lora_cfg() -> LoraConfig {
    LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: vec!["all-linear".into()],
    }
}

/// A llama whose every input width is a multiple of 256 (so `q4_k` needs no fallback).
fn wide_config() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"model_type":"llama","hidden_size":256,"intermediate_size":512,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,
            "num_hidden_layers":2,"vocab_size":384,"rms_norm_eps":1e-5,
            "max_position_embeddings":128,"tie_word_embeddings":false}"#,
        "wide-llama",
    )
    .unwrap()
}

/// Deterministic non-zero values for every `lora_B` factor (fresh adapters have B = 0, which
/// would make every A gradient zero and the comparison vacuous).
fn randomize_b(model: &CausalLm) {
    for p in model.params() {
        if !p.name.contains("lora_B") {
            continue;
        }
        let n = p.var.elem_count();
        let mut state = p.name.bytes().fold(0x9E37_79B9_7F4A_7C15u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let v: Vec<f32> = (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
            })
            .collect();
        let t = Tensor::from_vec(v, p.var.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(p.var.dtype())
            .unwrap();
        p.var.set(&t).unwrap();
    }
}

/// The dense reference: every base weight replaced by `dequantize(quantize(W))` in the format
/// the quantized model uses for it.
fn round_trip_base(model: &CausalLm, q: Quantization) {
    for p in model.params() {
        if !quant::is_base_linear_weight(&p.name) {
            continue;
        }
        let in_dim = p.var.dims()[1] as u64;
        if let Some(f) = q.format_for(in_dim) {
            p.var
                .set(&quant::round_trip(p.var.as_tensor(), f).unwrap())
                .unwrap();
        }
    }
}

struct Outcome {
    logits: Tensor,
    loss: f64,
    grads: Gradients,
}

fn run(
    model: &mut CausalLm,
    (mode, native): (OpsMode, bool),
    batch: &(Tensor, Option<Tensor>, Tensor),
) -> Outcome {
    model.set_ops_mode(mode);
    model.set_native_layers(native);
    let (ids, mask, labels) = batch;
    let logits = model.logits(ids, mask.as_ref()).unwrap();
    let loss = model.loss(ids, mask.as_ref(), labels).unwrap();
    let mean = loss.mean().unwrap();
    let scaled = loss.sum.affine(1.0 / loss.num_tokens as f64, 0.0).unwrap();
    Outcome {
        logits,
        loss: mean,
        grads: model.backward(&scaled).unwrap(),
    }
}

/// Builds the reference and the quantized model from `make`, and compares them on both paths.
fn check(
    case: &str,
    make: &dyn Fn() -> CausalLm,
    q: Quantization,
    batch: &(Tensor, Option<Tensor>, Tensor),
) -> quant::QuantSummary {
    let mut dense = make();
    round_trip_base(&dense, q);
    dense.apply_lora(&lora_cfg(), 7).unwrap();
    randomize_b(&dense);

    let mut qm = make();
    let summary = qm.quantize_base(q).unwrap();
    assert_eq!(qm.quantization(), q);
    qm.apply_lora(&lora_cfg(), 7).unwrap();
    randomize_b(&qm);
    assert!(!summary.formats.is_empty(), "{case}: nothing was quantized");
    // The dense copies are gone: no parameter is a quantized weight.
    for name in qm.quantized_names() {
        assert!(
            qm.param(&name).is_none(),
            "{case}: {name} is still a parameter"
        );
    }
    assert_eq!(
        qm.native_layer_count(),
        qm.config().num_hidden_layers,
        "{case}: the quantized layers run as native ops on the CPU"
    );

    // The native layer op (dequantizing one weight per product), the graph of ops with the
    // quantized frozen-linear op on the CPU kernels, and the device-generic path.
    for mode in [
        (OpsMode::Auto, true),
        (OpsMode::Auto, false),
        (OpsMode::Generic, true),
    ] {
        let a = run(&mut dense, mode, batch);
        let b = run(&mut qm, mode, batch);
        let what = format!("{case} {q} {mode:?}");
        let dl = max_abs_diff(&a.logits, &b.logits);
        assert!(dl <= TOL, "{what}: logits differ by {dl}");
        assert!(
            (a.loss - b.loss).abs() <= TOL,
            "{what}: loss {} vs {}",
            a.loss,
            b.loss
        );
        let names: Vec<&str> = b.grads.names().collect();
        assert_eq!(
            names,
            a.grads.names().collect::<Vec<_>>(),
            "{what}: gradient names"
        );
        assert!(
            names.iter().all(|n| n.contains(".lora_")),
            "{what}: a gradient for a non-adapter weight: {names:?}"
        );
        for name in names {
            let d = max_abs_diff(a.grads.get(name).unwrap(), b.grads.get(name).unwrap());
            assert!(d <= TOL, "{what}: gradient of {name} differs by {d}");
            assert!(
                max_abs_diff(
                    b.grads.get(name).unwrap(),
                    &b.grads.get(name).unwrap().zeros_like().unwrap()
                ) > 0.0
                    || name.contains("lora_B"),
                "{what}: gradient of {name} is all zero"
            );
        }
    }
    summary
}

fn fixture_batch(case: &str) -> (Tensor, Option<Tensor>, Tensor) {
    let r =
        candle_core::safetensors::load(fixture(case).join("reference.safetensors"), &Device::Cpu)
            .unwrap();
    (
        r["input_ids"].clone(),
        Some(r["attention_mask"].clone()),
        r["labels"].clone(),
    )
}

#[test]
fn quantized_base_matches_round_tripped_dense_on_fixtures() {
    for case in ["tiny-llama", "tiny-qwen2"] {
        let make = || CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
        let batch = fixture_batch(case);
        let s8 = check(case, &make, Quantization::Q8_0, &batch);
        assert!(s8.formats.iter().all(|(_, f)| *f == QuantFormat::Q8_0));
        assert_eq!(s8.formats.len(), 14, "{case}: 7 linears × 2 layers");
        // The fixtures' input widths (64, 160) are not multiples of 256: q4_k falls back to
        // q5_0 on every weight (llama.cpp's rule).
        let s4 = check(case, &make, Quantization::Q4K, &batch);
        assert!(s4.formats.iter().all(|(_, f)| *f == QuantFormat::Q5_0));
        assert!(s4.quantized_bytes < s8.quantized_bytes);
    }
}

#[test]
fn quantized_base_matches_round_tripped_dense_with_q4_k_blocks() {
    let cfg = wide_config();
    let make = || CausalLm::random_init(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 384).collect();
    let ids = Tensor::from_vec(ids, (2, 12), &Device::Cpu).unwrap();
    let batch = (ids.clone(), None, ids);
    let s = check("wide-llama", &make, Quantization::Q4K, &batch);
    assert!(s.formats.iter().all(|(_, f)| *f == QuantFormat::Q4K));
    // 144 bytes per 256 weights against 4 bytes a weight.
    let ratio = s.quantized_bytes as f64 / s.dense_bytes as f64;
    assert!((ratio - 144.0 / 1024.0).abs() < 1e-9, "ratio {ratio}");
    check("wide-llama", &make, Quantization::Q8_0, &batch);
}

#[test]
fn quantized_base_with_checkpointing_matches_without() {
    let case = "tiny-llama";
    let batch = fixture_batch(case);
    let outcome = |ckpt: bool| {
        let mut m = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
        m.quantize_base(Quantization::Q8_0).unwrap();
        m.apply_lora(&lora_cfg(), 1).unwrap();
        randomize_b(&m);
        m.set_activation_checkpointing(ckpt);
        run(&mut m, (OpsMode::Auto, true), &batch)
    };
    let (a, b) = (outcome(false), outcome(true));
    assert!((a.loss - b.loss).abs() <= 1e-6);
    for name in a.grads.names() {
        let d = max_abs_diff(a.grads.get(name).unwrap(), b.grads.get(name).unwrap());
        assert!(d <= 1e-5, "{name}: {d}");
    }
}

#[test]
fn quantized_cache_round_trips_bit_exactly_and_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let files = ModelFiles::from_dir(&fixture("tiny-qwen2")).unwrap();
    for q in [Quantization::Q8_0, Quantization::Q4K] {
        let fresh = CausalLm::load_files_quantized_in(
            &files,
            DType::F32,
            &Device::Cpu,
            q,
            Some(dir.path()),
        )
        .unwrap();
        let path = cache::cache_path(dir.path(), &files, q);
        assert!(
            path.is_file(),
            "{q}: no cache written at {}",
            path.display()
        );
        let cached = CausalLm::load_files_quantized_in(
            &files,
            DType::F32,
            &Device::Cpu,
            q,
            Some(dir.path()),
        )
        .unwrap();
        let uncached =
            CausalLm::load_files_quantized_in(&files, DType::F32, &Device::Cpu, q, None).unwrap();
        let names = fresh.quantized_names();
        assert_eq!(names, cached.quantized_names());
        assert_eq!(names.len(), 14);
        for name in &names {
            let a = fresh.quantized_weight(name).unwrap();
            let b = cached.quantized_weight(name).unwrap();
            let c = uncached.quantized_weight(name).unwrap();
            assert_eq!(a.dtype(), b.dtype());
            assert_eq!(a.shape(), b.shape());
            assert_eq!(
                a.data().unwrap(),
                b.data().unwrap(),
                "{q} {name}: cache differs"
            );
            assert_eq!(
                a.data().unwrap(),
                c.data().unwrap(),
                "{q} {name}: not deterministic"
            );
        }
        // A stale or foreign file is not read: another key finds nothing.
        let cfg = ModelConfig::from_file(&files.config).unwrap();
        let plan = cache::planned_formats(&cfg, q);
        assert!(cache::read_cache(&path, "other-key", &plan, &Device::Cpu)
            .unwrap()
            .is_none());
    }
}

#[test]
fn adapter_trained_on_quantized_base_saves_and_reloads_identically() {
    let case = "tiny-llama";
    let batch = fixture_batch(case);
    let files = ModelFiles::from_dir(&fixture(case)).unwrap();
    let load = || {
        CausalLm::load_files_quantized_in(&files, DType::F32, &Device::Cpu, Quantization::Q4K, None)
            .unwrap()
    };
    let mut m = load();
    m.apply_lora(&lora_cfg(), 5).unwrap();
    randomize_b(&m);
    let before = m.logits(&batch.0, batch.1.as_ref()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    m.save_adapter(dir.path()).unwrap();
    let mut again = load();
    again.load_adapter(dir.path()).unwrap();
    let after = again.logits(&batch.0, batch.1.as_ref()).unwrap();
    assert_eq!(max_abs_diff(&before, &after), 0.0);
    // The full model cannot be saved quantized; merged, it is dense again.
    assert!(m.save_pretrained(dir.path(), DType::F32, 0).is_err());
    m.merge_lora().unwrap();
    assert_eq!(m.quantization(), Quantization::None);
    let merged = m.logits(&batch.0, batch.1.as_ref()).unwrap();
    assert!(max_abs_diff(&before, &merged) < 1e-4);
}

/// `tunestudio plan --json` for the DictaLM 7B config on one 24 GiB GPU with LoRA r=16.
fn plan_dictalm(quantize: &str) -> serde_json::Value {
    let config = tunestudio::paths::shared_dir()
        .join("model-configs")
        .join("dictalm2-7b.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["plan", "--model-config"])
        .arg(&config)
        .args([
            "--devices",
            "1x24GiB",
            "--lora-r",
            "16",
            "--quantize",
            quantize,
            "--seq-len",
            "512",
            "--micro-batch",
            "1",
            "--checkpointing",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "plan --json: {e}\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn cli_plans_qlora_4bit_for_dictalm_7b_on_24_gib() {
    let q = plan_dictalm("q4_k");
    let plan = &q["plan"];
    assert_eq!(plan["verdict"], "Fits", "{}", plan["summary"]);
    // The base (every decoder layer: quantized linears, bf16-sized norms and the adapters)
    // against the same layers in bf16.
    let layers: Vec<&serde_json::Value> = plan["per_layer"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["name"].as_str().unwrap().starts_with("layer "))
        .collect();
    assert_eq!(layers.len(), 32);
    let bytes: u64 = layers
        .iter()
        .map(|l| l["weights_bytes"].as_u64().unwrap())
        .sum();
    let params: u64 = layers
        .iter()
        .map(|l| l["parameters"].as_u64().unwrap())
        .sum();
    let ratio = bytes as f64 / (2 * params) as f64;
    assert!(ratio <= 0.3, "base at {ratio:.3} of its bf16 bytes");
    assert!(
        ratio > 0.25,
        "base at {ratio:.3}: Q4_K is 4.5 bits a weight"
    );
    // Without quantization the same run does not fit, and QLoRA 4-bit is a ranked fix.
    let dense = plan_dictalm("none");
    assert_eq!(dense["plan"]["verdict"], "OutOfMemory");
    let fixes = dense["plan"]["fixes"].as_array().unwrap();
    let qlora = fixes
        .iter()
        .find(|f| {
            f["description"]
                .as_str()
                .unwrap()
                .starts_with("QLoRA 4-bit")
        })
        .unwrap_or_else(|| panic!("no QLoRA fix among {fixes:?}"));
    assert_eq!(qlora["fits_alone"], true);
    assert!(qlora["saving_bytes"].as_u64().unwrap() > 15 << 30);
    let speed = qlora["relative_throughput"].as_f64().unwrap();
    assert!(speed < 1.0 && speed > 0.5, "QLoRA speed estimate {speed}");
}

#[test]
fn trainer_runs_lora_on_a_quantized_base_and_validation_needs_lora() {
    use crate::train_common::tiny_config;
    use tunestudio::train::TrainingRun;
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(&tmp.path().join("run"), 3);
    c.model.quantize = Quantization::Q8_0;
    let problems = c.validate();
    assert!(
        problems.iter().any(|p| p.field == "model.quantize"),
        "quantize without LoRA must be refused: {problems:?}"
    );
    c.lora.enabled = true;
    c.lora.r = 4;
    c.lora.target_modules = vec!["all-linear".into()];
    assert!(c.validate().iter().all(|p| p.field != "model.quantize"));
    let mut run = TrainingRun::new(c).unwrap();
    assert_eq!(run.model().quantization(), Quantization::Q8_0);
    assert_eq!(run.model().quantized_names().len(), 14);
    let (_, trainable) = run.parameter_counts();
    // r = 4 on q, k, v, o, gate, up, down of 2 layers (hidden 64, kv 32, intermediate 160).
    assert_eq!(trainable, 2 * 4 * (128 + 96 + 96 + 128 + 224 + 224 + 224));
    let mut losses = Vec::new();
    while !run.is_done() {
        losses.push(run.step().unwrap().loss);
    }
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    run.model()
        .save_adapter(&tmp.path().join("adapter"))
        .unwrap();
    assert!(tmp
        .path()
        .join("adapter/adapter_model.safetensors")
        .is_file());
}

/// The planner's quantized weight bytes are the bytes the model really holds (block scales
/// included), for every format and fallback.
#[test]
fn planner_counts_the_quantized_bytes_the_model_holds() {
    use tunestudio::plan::{self, DeviceSpec};
    for case in ["tiny-llama", "tiny-qwen2"] {
        for q in [Quantization::Q8_0, Quantization::Q4K] {
            let mut m = CausalLm::load(&fixture(case), DType::F32, &Device::Cpu).unwrap();
            let summary = m.quantize_base(q).unwrap();
            m.apply_lora(&lora_cfg(), 1).unwrap();
            // Everything a decoder layer holds besides the quantized weights: norms, biases,
            // adapters (f32).
            let dense_layer_bytes: u64 = m
                .params()
                .iter()
                .filter(|p| p.name.starts_with("model.layers."))
                .map(|p| p.var.elem_count() as u64 * 4)
                .sum();
            // Through the run-config adapter, as the CLI and the studio plan.
            let mut c = tunestudio::train::RunConfig::default();
            c.lora.enabled = true;
            c.lora.r = 4;
            c.lora.target_modules = lora_cfg().target_modules;
            c.model.quantize = q;
            c.data.max_length = 16;
            c.training.micro_batch = 1;
            let req = tunestudio::train::plan_request(
                &c,
                m.config().clone(),
                vec![DeviceSpec::cpu(1 << 34)],
            );
            let planned: u64 = plan::layer_costs(&req)
                .per_block()
                .iter()
                .filter(|b| b.name.starts_with("layer "))
                .map(|b| b.weights_bytes)
                .sum();
            assert_eq!(
                planned,
                summary.quantized_bytes + dense_layer_bytes,
                "{case} {q}"
            );
        }
    }
}

/// The setting through the real CLI, as a user runs it: `[model] quantize = "q8_0"` with
/// `[lora]` trains (finite losses, a PEFT adapter in the checkpoint), `tunestudio plan` reads
/// the same config as a quantized base, and without `[lora]` the run is refused with an error
/// naming the setting.
#[test]
fn cli_trains_and_plans_a_quantized_base() {
    let bin = env!("CARGO_BIN_EXE_tunestudio");
    let dir = tempfile::tempdir().unwrap();
    let shared = tunestudio::paths::shared_dir();
    let config = |lora: bool, out: &str| {
        let text = format!(
            r#"output_dir = {out:?}
[model]
source = {model:?}
quantize = "q8_0"
[data]
path = {data:?}
format = "alpaca"
max_length = 48
[training]
micro_batch = 2
max_steps = 3
learning_rate = 0.001
[checkpoint]
save_every = 3
[lora]
enabled = {lora}
r = 4
target_modules = ["all-linear"]
"#,
            out = dir.path().join(out).display().to_string(),
            model = shared.join("fixtures/tiny-llama").display().to_string(),
            data = shared
                .join("datasets/alpaca_en_demo.json")
                .display()
                .to_string(),
        );
        let path = dir.path().join(format!("{out}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    };
    let run = |args: &[&str], path: &std::path::Path| {
        std::process::Command::new(bin)
            .args(args)
            .arg(path)
            .env("TUNESTUDIO_QUANT_CACHE", dir.path().join("cache"))
            .output()
            .unwrap()
    };
    let good = config(true, "run");
    let out = run(&["train", "--config"], &good);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics = std::fs::read_to_string(dir.path().join("run/metrics.jsonl")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "step")
        .filter_map(|e| e["loss"].as_f64())
        .collect();
    assert_eq!(losses.len(), 3, "{metrics}");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    let adapter = dir
        .path()
        .join("run/checkpoint-3/adapter/adapter_config.json");
    assert!(adapter.is_file(), "no adapter at {}", adapter.display());

    let plan = run(&["plan", "--json", "--config"], &good);
    assert!(
        plan.status.success(),
        "{}",
        String::from_utf8_lossy(&plan.stderr)
    );
    let text = String::from_utf8_lossy(&plan.stdout);
    assert!(
        text.contains("q8_0"),
        "the plan does not show the quantized base: {text}"
    );

    let bad = config(false, "refused");
    let out = run(&["train", "--config"], &bad);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("quantize"),
        "the error names the setting: {err}"
    );
}
