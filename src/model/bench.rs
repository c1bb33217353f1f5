//! The training benchmark: random-initialised model, random tokens, full AdamW steps,
//! timed phase by phase.

use super::adamw::{AdamW, AdamWConfig, StatePlacement};
use super::config::ModelConfig;
use super::decoder::CausalLm;
use super::error::ModelError;
use super::lora::LoraConfig;
use super::ops_mode::OpsMode;
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

/// What to benchmark.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// A `config.json` giving the model shape (weights are random).
    pub model_config: PathBuf,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step (their gradients summed in one buffer).
    pub accumulation: usize,
    /// Timed steps (one untimed warm-up step runs first).
    pub steps: usize,
    /// Parameter dtype.
    pub dtype: DType,
    /// Rayon threads (None: rayon's default).
    pub threads: Option<usize>,
    /// Recompute layers in backward.
    pub activation_checkpointing: bool,
    /// Seed of weights and tokens.
    pub seed: u64,
    /// The training-ops path: native CPU kernels or the device-generic ops a GPU runs.
    pub ops: OpsMode,
    /// AdamW keeps f32 master weights (mixed precision: `bf16-mixed`, `fp16-mixed`).
    pub master_weights: bool,
    /// LoRA adapters on a frozen base (None: full fine-tuning).
    pub lora: Option<LoraConfig>,
}

impl Default for BenchConfig {
    /// SmolLM2-135M shape, seq 256, batch 1, 5 steps, f32.
    fn default() -> Self {
        Self {
            model_config: crate::paths::shared_dir()
                .join("model-configs")
                .join("smollm2-135m.json"),
            seq_len: 256,
            batch: 1,
            accumulation: 1,
            steps: 5,
            dtype: DType::F32,
            threads: None,
            activation_checkpointing: false,
            seed: 0,
            ops: OpsMode::Auto,
            master_weights: false,
            lora: None,
        }
    }
}

/// Timings of one benchmark run.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Parameters of the model (transformers' count).
    pub num_parameters: u64,
    /// Parameters the optimizer updates (all of them, or the LoRA adapters).
    pub trainable_parameters: u64,
    /// Tokens per step (batch × seq_len).
    pub tokens_per_step: usize,
    /// Rayon threads used.
    pub threads: usize,
    /// Seconds of every timed step.
    pub step_secs: Vec<f64>,
    /// Median step time.
    pub median_step_secs: f64,
    /// Median forward (loss) time.
    pub median_forward_secs: f64,
    /// Median backward time.
    pub median_backward_secs: f64,
    /// Median optimizer time.
    pub median_optimizer_secs: f64,
    /// Tokens per second at the median step.
    pub tokens_per_sec: f64,
    /// 6 · parameters · tokens / median step time, in GFLOP/s.
    pub gflops_per_sec: f64,
    /// Peak resident set size of the process (VmHWM), when the OS reports it.
    pub peak_rss_bytes: Option<u64>,
    /// Loss of the last step (a sanity figure: about ln(vocab) for random weights).
    pub last_loss: f64,
    /// The path bf16 products ran on, and why (`model::ops::kernel_path`; None for f32 and f16
    /// models, and off the native CPU ops, where no bf16 kernel runs).
    pub bf16_kernel: Option<crate::model::ops::kernel_path::KernelChoice>,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    if s.is_empty() {
        return 0.0;
    }
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The process's peak resident set size from `/proc/self/status` (Linux only).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The widest SIMD instruction set gemm's f32 kernels use on this CPU (chosen at run time), so
/// that figures from different machines can be told apart.
pub fn matmul_simd() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "AVX-512";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "AVX2 + FMA";
        }
        "SSE2"
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "scalar"
    }
}

/// Runs the benchmark described by `cfg`.
pub fn run_training_bench(cfg: &BenchConfig) -> Result<BenchReport, ModelError> {
    if cfg.seq_len < 2 || cfg.batch == 0 || cfg.steps == 0 {
        return Err(ModelError::Input(
            "bench needs seq_len >= 2, batch >= 1 and steps >= 1".into(),
        ));
    }
    let pool = {
        let mut b = rayon::ThreadPoolBuilder::new();
        if let Some(n) = cfg.threads {
            b = b.num_threads(n);
        }
        b.build().map_err(|e| {
            ModelError::Input(format!("cannot start {:?} threads: {e}", cfg.threads))
        })?
    };
    pool.install(|| run_inner(cfg, pool.current_num_threads()))
}

fn run_inner(cfg: &BenchConfig, threads: usize) -> Result<BenchReport, ModelError> {
    let config = ModelConfig::from_file(&cfg.model_config)?;
    let device = Device::Cpu;
    let mut model = CausalLm::random_init(&config, cfg.seed, cfg.dtype, &device)?;
    model.set_activation_checkpointing(cfg.activation_checkpointing);
    model.set_ops_mode(cfg.ops);
    if let Some(lora) = &cfg.lora {
        model.apply_lora(lora, cfg.seed)?;
    }
    let mut opt = AdamW::new(model.params(), AdamWConfig::default(), cfg.master_weights)?;
    let trainable_parameters = model
        .params()
        .iter()
        .filter(|p| p.trainable)
        .map(|p| p.var.elem_count() as u64)
        .sum();
    if cfg.ops == OpsMode::Generic {
        opt.set_state_placement(StatePlacement::Device)?;
    }
    // Chosen (measured, or read from the cache) on this pool before the timed steps.
    let bf16_kernel = (cfg.dtype == DType::BF16 && cfg.ops != OpsMode::Generic)
        .then(|| crate::model::ops::kernel_path::choice().clone());
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed ^ 0xB0BA);
    let accumulation = cfg.accumulation.max(1);
    let n_tok = cfg.batch * cfg.seq_len * accumulation;
    let mut step_secs = Vec::new();
    let (mut fw, mut bw, mut op) = (Vec::new(), Vec::new(), Vec::new());
    let mut last_loss = 0.0;
    for step in 0..=cfg.steps {
        let (mut forward_secs, mut backward_secs) = (0.0, 0.0);
        let mut grads = crate::model::Gradients::new();
        let mut tokens = 0;
        let t0 = Instant::now();
        for _ in 0..accumulation {
            let ids: Vec<u32> = (0..cfg.batch * cfg.seq_len)
                .map(|_| rng.gen_range(0..config.vocab_size as u32))
                .collect();
            let ids = Tensor::from_vec(ids, (cfg.batch, cfg.seq_len), &device)?;
            let labels = ids.to_dtype(DType::I64)?;
            let f0 = Instant::now();
            let loss = model.loss(&ids, None, &labels)?;
            let f1 = Instant::now();
            model.backward_into(&loss.sum, &mut grads)?;
            backward_secs += f1.elapsed().as_secs_f64();
            forward_secs += (f1 - f0).as_secs_f64();
            tokens += loss.num_tokens;
            last_loss = loss.mean()?;
        }
        let t2 = Instant::now();
        opt.step(&grads, 1e-4, 1.0 / tokens.max(1) as f64)?;
        drop(grads);
        let t3 = Instant::now();
        if step > 0 {
            fw.push(forward_secs);
            bw.push(backward_secs);
            op.push((t3 - t2).as_secs_f64());
            step_secs.push((t3 - t0).as_secs_f64());
        }
    }
    let med = median(&step_secs);
    let num_parameters = config.num_parameters();
    Ok(BenchReport {
        num_parameters,
        trainable_parameters,
        tokens_per_step: n_tok,
        threads,
        median_step_secs: med,
        median_forward_secs: median(&fw),
        median_backward_secs: median(&bw),
        median_optimizer_secs: median(&op),
        tokens_per_sec: if med > 0.0 { n_tok as f64 / med } else { 0.0 },
        gflops_per_sec: if med > 0.0 {
            6.0 * num_parameters as f64 * n_tok as f64 / med / 1e9
        } else {
            0.0
        },
        step_secs,
        peak_rss_bytes: peak_rss_bytes(),
        last_loss,
        bf16_kernel,
    })
}
