//! `tunestudio bench`: times training steps of a model shape on random tokens.

use std::path::PathBuf;
use std::process::ExitCode;
use tunestudio::model::{matmul_simd, run_training_bench, BenchConfig, LoraConfig, OpsMode};
use tunestudio::settings::Precision;

/// Arguments of `tunestudio bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// A model `config.json` (weights are random). Default: the SmolLM2-135M shape from
    /// the shared model configs.
    #[arg(long)]
    pub model_config: Option<PathBuf>,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Micro-batches accumulated per optimizer step (tokens/s counts all of them)
    #[arg(long, default_value_t = 1)]
    pub accumulation: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Parameter dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// The trainer's precision setting (`fp32`, `bf16-mixed`, `bf16`, `fp16-mixed`); overrides
    /// `--dtype` (mixed precision keeps f32 master weights in AdamW, as `train` does).
    #[arg(long)]
    pub precision: Option<String>,
    /// LoRA rank: adapters on a frozen base instead of full fine-tuning.
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// LoRA alpha (default 2 × r).
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// LoRA target modules, comma-separated (default all-linear).
    #[arg(long, default_value = "all-linear", value_delimiter = ',')]
    pub lora_targets: Vec<String>,
    /// LoRA dropout on the adapter input.
    #[arg(long, default_value_t = 0.0)]
    pub lora_dropout: f64,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Recompute decoder layers in backward (activation checkpointing).
    #[arg(long)]
    pub checkpointing: bool,
    /// Training ops: `native` (CPU kernels), `generic` (the device-generic ops a GPU runs) or
    /// `auto`. Default: `TUNESTUDIO_OPS`, else auto.
    #[arg(long)]
    pub ops: Option<String>,
}

/// Runs `tunestudio bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let (dtype, master_weights) = match &args.precision {
        Some(p) => {
            let p: Precision = p.parse()?;
            (p.compute_dtype(), p.master_weights())
        }
        None => match args.dtype.to_ascii_lowercase().as_str() {
            "f32" | "float32" => (candle_core::DType::F32, false),
            "bf16" | "bfloat16" => (candle_core::DType::BF16, false),
            "f16" | "float16" => (candle_core::DType::F16, false),
            other => anyhow::bail!("--dtype {other} is not supported; use f32, bf16 or f16"),
        },
    };
    let lora = args.lora_r.map(|r| LoraConfig {
        r,
        alpha: args.lora_alpha.unwrap_or(2.0 * r as f64),
        dropout: args.lora_dropout,
        target_modules: args.lora_targets.clone(),
    });
    let ops = match &args.ops {
        Some(o) => o.parse::<OpsMode>()?,
        None => OpsMode::from_env()?,
    };
    let mut cfg = BenchConfig {
        seq_len: args.seq_len,
        batch: args.batch,
        accumulation: args.accumulation,
        steps: args.steps,
        dtype,
        threads: args.threads,
        activation_checkpointing: args.checkpointing,
        ops,
        master_weights,
        lora,
        ..BenchConfig::default()
    };
    if let Some(p) = args.model_config {
        cfg.model_config = p;
    }
    eprintln!(
        "bench: {} — seq {} × batch {}, {} steps after 1 warm-up, {:?}{}{}",
        cfg.model_config.display(),
        cfg.seq_len,
        cfg.batch,
        cfg.steps,
        cfg.dtype,
        if cfg.master_weights {
            " + f32 master weights"
        } else {
            ""
        },
        match &cfg.lora {
            Some(l) => format!(", LoRA r {} on {}", l.r, l.target_modules.join(",")),
            None => String::new(),
        }
    );
    let r = run_training_bench(&cfg)?;
    println!("parameters        {}", r.num_parameters);
    println!("trainable         {}", r.trainable_parameters);
    println!("threads           {}", r.threads);
    println!("matmul SIMD       {}", matmul_simd());
    if let Some(k) = &r.bf16_kernel {
        println!("bf16 products     {} ({})", k.kernel.name(), k.why());
    }
    println!("ops               {}", cfg.ops);
    println!("tokens/step       {}", r.tokens_per_step);
    println!(
        "step (median)     {:.3} s   [{}]",
        r.median_step_secs,
        r.step_secs
            .iter()
            .map(|s| format!("{s:.3}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "forward/backward/optimizer  {:.3} / {:.3} / {:.3} s",
        r.median_forward_secs, r.median_backward_secs, r.median_optimizer_secs
    );
    println!("tokens/s          {:.1}", r.tokens_per_sec);
    println!("GFLOP/s (6·N·T)   {:.1}", r.gflops_per_sec);
    match r.peak_rss_bytes {
        Some(b) => println!("peak RSS          {:.2} GB", b as f64 / 1e9),
        None => println!("peak RSS          (not available on this OS)"),
    }
    println!("last loss         {:.4}", r.last_loss);
    Ok(ExitCode::SUCCESS)
}
