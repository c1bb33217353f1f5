//! `tunestudio export`: the studio's Export panel, headless. A run checkpoint becomes a PEFT
//! adapter, a merged model (base + adapter folded in), a full model folder that
//! transformers, PEFT and tunestudio load, or a GGUF file (with an Ollama `Modelfile`) that
//! llama.cpp, Ollama and LM Studio run.

use anyhow::Context;
use candle_core::DType;
use indicatif::{ProgressBar, ProgressStyle};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;
use tunestudio::gguf::GgufQuant;
use tunestudio::train;

/// What to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportKind {
    /// The LoRA adapter alone (`adapter_config.json` + `adapter_model.safetensors`).
    Adapter,
    /// The base model with the adapter merged into its weights.
    Merged,
    /// Every weight of a full fine-tune (or the merged model of a LoRA run).
    Full,
    /// One GGUF file for llama.cpp / Ollama / LM Studio (adapter merged), plus a Modelfile.
    Gguf,
}

/// Arguments of `tunestudio export`.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// A run checkpoint (`<output_dir>/checkpoint-<step>`), or a run's output folder for its
    /// newest. For `--kind gguf` also a Hugging Face model folder or a PEFT adapter folder.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// adapter, merged, full or gguf.
    #[arg(long, value_enum)]
    pub kind: ExportKind,
    /// The folder to write (created; its model files are replaced); for gguf the file
    /// (default: `<name>-<quant>.gguf` in the run folder).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Weight dtype of merged and full exports: f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// GGUF type: f16, bf16, q8_0, q6_k, q5_k_m or q4_k_m (llama.cpp's mixes).
    #[arg(long, default_value = "q4_k_m")]
    pub quant: String,
    /// Replace an existing GGUF file.
    #[arg(long)]
    pub force: bool,
    /// The base model of a PEFT adapter folder (default: the one its adapter_config.json names).
    #[arg(long)]
    pub base: Option<PathBuf>,
}

/// Runs `tunestudio export`.
pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    if args.kind == ExportKind::Gguf {
        return run_gguf(&args);
    }
    let out = args
        .out
        .clone()
        .context("--out <folder> is required for adapter, merged and full exports")?;
    let checkpoint = if args
        .checkpoint
        .join(train::checkpoint::STATE_FILE)
        .is_file()
    {
        args.checkpoint.clone()
    } else {
        train::latest_checkpoint(&args.checkpoint).with_context(|| {
            format!(
                "`{}` is neither a checkpoint folder nor a run folder with checkpoints",
                args.checkpoint.display()
            )
        })?
    };
    let dtype = match args.dtype.as_str() {
        "f32" | "fp32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" | "fp16" => DType::F16,
        other => anyhow::bail!("--dtype `{other}`: use f32, bf16 or f16"),
    };
    let written = match args.kind {
        ExportKind::Adapter => train::export_adapter(&checkpoint, &out)?,
        ExportKind::Merged => train::export_merged(&checkpoint, &out, dtype)?,
        ExportKind::Full | ExportKind::Gguf => train::export_full(&checkpoint, &out, dtype)?,
    };
    println!(
        "exported {} of {} to {}",
        format!("{:?}", args.kind).to_lowercase(),
        checkpoint.display(),
        written.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn run_gguf(args: &ExportArgs) -> anyhow::Result<ExitCode> {
    let quant = GgufQuant::parse(&args.quant).with_context(|| {
        let names: Vec<&str> = GgufQuant::ALL.iter().map(|q| q.name()).collect();
        format!("--quant `{}`: use one of {}", args.quant, names.join(", "))
    })?;
    let source = train::export_source(&args.checkpoint, args.base.as_deref())?;
    let dest = args
        .out
        .clone()
        .unwrap_or_else(|| train::default_gguf_path(&args.checkpoint, &source, quant));
    let started = std::time::Instant::now();
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg:24} [{bar:30}] {bytes}/{total_bytes} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(format!("writing {}", quant.name()));
    let written = train::export_gguf(&source, quant, &dest, args.force, &mut |p| {
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
        ControlFlow::Continue(())
    })?;
    bar.finish_and_clear();
    println!(
        "exported {} ({}, {:.1} MB) in {:.1} s; Ollama: ollama create {} -f {}",
        written.path.display(),
        quant.name(),
        written.plan.file_bytes as f64 / 1e6,
        started.elapsed().as_secs_f64(),
        source.name,
        written.modelfile.display()
    );
    Ok(ExitCode::SUCCESS)
}
