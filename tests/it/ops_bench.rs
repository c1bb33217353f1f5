//! Timing of the fused ops against their composite (plain candle) versions at SmolLM2-135M shapes
//! (seq 256, batch 1). Those timings are ignored by default; run them with
//! `cargo test --release --test ops_bench -- --ignored --nocapture`. The `tunestudio bench`
//! command itself is checked on a tiny model in every run.

use candle_core::{DType, Device, Result, Tensor, Var};
use std::time::Instant;
use tunestudio::model::ops::{self, composite, IGNORE_INDEX};

fn median_ms(mut f: impl FnMut() -> Result<()>, reps: usize) -> Result<f64> {
    f()?; // warm-up
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[reps / 2])
}

fn report(name: &str, fused: f64, reference: f64) {
    println!(
        "{name:<32} fused {fused:>9.2} ms   composite {reference:>9.2} ms   speed-up {:>5.1}x",
        reference / fused
    );
}

#[test]
#[ignore = "benchmark; run with --release -- --ignored --nocapture"]
fn bench_fused_ops_forward_backward() -> Result<()> {
    let dev = Device::Cpu;
    let (t, hidden, heads, d, inter, vocab) =
        (256usize, 576usize, 9usize, 64usize, 1536usize, 49152usize);
    let reps = 5;

    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, t, hidden), &dev)?)?;
    let w = Var::from_tensor(&Tensor::ones(hidden, DType::F32, &dev)?)?;
    let run = |fused: bool| -> Result<()> {
        let y = if fused {
            ops::rms_norm(x.as_tensor(), w.as_tensor(), 1e-5)?
        } else {
            composite::rms_norm(x.as_tensor(), w.as_tensor(), 1e-5)?
        };
        y.sum_all()?.backward()?;
        Ok(())
    };
    report(
        "rms_norm fwd+bwd",
        median_ms(|| run(true), reps)?,
        median_ms(|| run(false), reps)?,
    );

    let q = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, heads, t, d), &dev)?)?;
    let cos = Tensor::randn(0f32, 1.0, (t, d), &dev)?;
    let sin = Tensor::randn(0f32, 1.0, (t, d), &dev)?;
    let run = |fused: bool| -> Result<()> {
        let y = if fused {
            ops::rope(q.as_tensor(), &cos, &sin)?
        } else {
            composite::rope(q.as_tensor(), &cos, &sin)?
        };
        y.sum_all()?.backward()?;
        Ok(())
    };
    report(
        "rope fwd+bwd",
        median_ms(|| run(true), reps)?,
        median_ms(|| run(false), reps)?,
    );

    let s = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, heads, t, t), &dev)?)?;
    let run = |fused: bool| -> Result<()> {
        let y = if fused {
            ops::softmax_last_dim(s.as_tensor())?
        } else {
            composite::softmax_last_dim(s.as_tensor())?
        };
        (y * 1.5)?.sum_all()?.backward()?;
        Ok(())
    };
    report(
        "softmax fwd+bwd",
        median_ms(|| run(true), reps)?,
        median_ms(|| run(false), reps)?,
    );

    let g = Var::from_tensor(&Tensor::randn(0f32, 1.0, (t, inter), &dev)?)?;
    let u = Var::from_tensor(&Tensor::randn(0f32, 1.0, (t, inter), &dev)?)?;
    let run = |fused: bool| -> Result<()> {
        let y = if fused {
            ops::silu_mul(g.as_tensor(), u.as_tensor())?
        } else {
            composite::silu_mul(g.as_tensor(), u.as_tensor())?
        };
        y.sum_all()?.backward()?;
        Ok(())
    };
    report(
        "silu_mul fwd+bwd",
        median_ms(|| run(true), reps)?,
        median_ms(|| run(false), reps)?,
    );

    let h = Var::from_tensor(&Tensor::randn(0f32, 1.0, (t, hidden), &dev)?)?;
    let emb = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (vocab, hidden), &dev)? * 0.05)?)?;
    let labels: Vec<i64> = (0..t)
        .map(|i| {
            if i < 40 {
                IGNORE_INDEX
            } else {
                (i * 7919 % vocab) as i64
            }
        })
        .collect();
    for chunk in [64usize, 256] {
        let run = |fused: bool| -> Result<()> {
            let (loss, _) = if fused {
                ops::linear_cross_entropy(h.as_tensor(), emb.as_tensor(), &labels, chunk)?
            } else {
                composite::linear_cross_entropy(h.as_tensor(), emb.as_tensor(), &labels, chunk)?
            };
            loss.backward()?;
            Ok(())
        };
        report(
            &format!("linear_cross_entropy c={chunk}"),
            median_ms(|| run(true), 3)?,
            median_ms(|| run(false), 3)?,
        );
    }
    // The matmuls alone (forward logits + both backward products) for scale.
    let hm = h.as_tensor().clone();
    let em = emb.as_tensor().clone();
    let mm = median_ms(
        || {
            let logits = hm.matmul(&em.t()?)?;
            let _gh = logits.matmul(&em)?;
            let _gw = logits.t()?.matmul(&hm)?;
            Ok(())
        },
        3,
    )?;
    println!(
        "{:<32} {mm:>9.2} ms (3 gemms of the lm head, candle)",
        "lm-head matmuls only"
    );
    Ok(())
}

#[test]
#[ignore = "profiling helper"]
fn bench_softmax_only() -> Result<()> {
    let dev = Device::Cpu;
    let s = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 9, 256, 256), &dev)?)?;
    let g = Tensor::randn(0f32, 1.0, (1, 9, 256, 256), &dev)?;
    let fwd = median_ms(|| ops::softmax_last_dim(s.as_tensor()).map(|_| ()), 20)?;
    let all = median_ms(
        || {
            let y = ops::softmax_last_dim(s.as_tensor())?;
            (y * &g)?.sum_all()?.backward()?;
            Ok(())
        },
        20,
    )?;
    let glue = median_ms(
        || {
            let y = s.as_tensor().affine(1.0, 0.0)?;
            (y * &g)?.sum_all()?.backward()?;
            Ok(())
        },
        20,
    )?;
    println!("softmax fwd {fwd:.2} ms, fwd+bwd+glue {all:.2} ms, glue only {glue:.2} ms");
    Ok(())
}

/// `tunestudio bench` on a tiny model: the user's way of timing a shape on their machine. It
/// must finish and print every figure it promises, with a loss near ln(vocab) for random weights.
#[test]
fn bench_command_reports_its_figures_on_a_tiny_model() {
    let native = bench_figures("native", &[]);
    let generic = bench_figures("generic", &[]);
    // The same seeded steps through the GPU's code path: the same losses.
    assert!(
        (native - generic).abs() < 1e-4,
        "last loss native {native} vs generic {generic}"
    );
}

/// `tunestudio bench --lora-r R` and `--precision bf16-mixed`: the LoRA and half-precision
/// steps the bench compares with PyTorch + PEFT. LoRA trains only the adapters (r × (in + out)
/// per linear layer) and gives the same losses on the native and the generic path.
#[test]
fn bench_command_times_lora_and_half_precision() {
    let lora = ["--lora-r", "4"];
    let native = bench_figures("native", &lora);
    let generic = bench_figures("generic", &lora);
    assert!(
        (native - generic).abs() < 1e-4,
        "LoRA last loss native {native} vs generic {generic}"
    );
    bench_figures("native", &["--precision", "bf16-mixed"]);
    bench_figures("native", &["--precision", "bf16", "--lora-r", "4"]);
}

/// Runs `tunestudio bench --ops OPS EXTRA…` on tiny-llama, checks every figure, returns the last
/// loss.
fn bench_figures(ops: &str, extra: &[&str]) -> f64 {
    let config = tunestudio::paths::shared_dir().join("fixtures/tiny-llama/config.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["bench", "--seq-len", "16", "--steps", "2", "--threads", "1"])
        .args(["--ops", ops])
        .args(extra)
        .arg("--model-config")
        .arg(&config)
        .output()
        .expect("tunestudio runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |name: &str| -> String {
        stdout
            .lines()
            .find_map(|l| l.split_once("  ").filter(|(label, _)| *label == name))
            .map(|(_, value)| value)
            .unwrap_or_else(|| panic!("no `{name}` line in:\n{stdout}"))
            .trim()
            .to_string()
    };
    for name in ["step (median)", "forward/backward/optimizer", "peak RSS"] {
        field(name);
    }
    assert!(["AVX-512", "AVX2 + FMA", "SSE2", "NEON", "scalar"]
        .contains(&field("matmul SIMD").as_str()));
    assert_eq!(field("ops"), ops);
    assert_eq!(field("tokens/step"), "16");
    let cfg = tunestudio::model::ModelConfig::from_file(&config).unwrap();
    let trainable: u64 = field("trainable").parse().unwrap();
    let want = match extra.iter().position(|a| *a == "--lora-r") {
        Some(i) => {
            let r: u64 = extra[i + 1].parse().unwrap();
            let (h, inter) = (cfg.hidden_size as u64, cfg.intermediate_size as u64);
            let (q, kv) = (
                (cfg.num_attention_heads * cfg.head_dim) as u64,
                (cfg.num_key_value_heads * cfg.head_dim) as u64,
            );
            let per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h);
            r * per_layer * cfg.num_hidden_layers as u64
        }
        None => cfg.num_parameters(),
    };
    assert_eq!(trainable, want, "trainable parameters with {extra:?}");
    let tokens_per_sec: f64 = field("tokens/s").parse().unwrap();
    assert!(tokens_per_sec > 0.0);
    let vocab = tunestudio::model::ModelConfig::from_file(&config)
        .unwrap()
        .vocab_size as f64;
    let loss: f64 = field("last loss").parse().unwrap();
    assert!(
        (loss - vocab.ln()).abs() < 1.0,
        "loss {loss} vs ln(vocab) {}",
        vocab.ln()
    );
    loss
}
