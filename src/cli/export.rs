//! `tunestudio export`: the studio's Export panel, headless. A run checkpoint becomes a PEFT
//! adapter, a merged model (base + adapter folded in) or a full model folder that
//! transformers, PEFT and tunestudio load.

use anyhow::Context;
use candle_core::DType;
use std::path::PathBuf;
use std::process::ExitCode;
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
}

/// Arguments of `tunestudio export`.
#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    /// A run checkpoint (`<output_dir>/checkpoint-<step>`), or a run's output folder for its newest.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// adapter, merged or full.
    #[arg(long, value_enum)]
    pub kind: ExportKind,
    /// The folder to write (created; its model files are replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// Weight dtype of merged and full exports: f32, bf16 or f16.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
}

/// Runs `tunestudio export`.
pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
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
        ExportKind::Adapter => train::export_adapter(&checkpoint, &args.out)?,
        ExportKind::Merged => train::export_merged(&checkpoint, &args.out, dtype)?,
        ExportKind::Full => train::export_full(&checkpoint, &args.out, dtype)?,
    };
    println!(
        "exported {} of {} to {}",
        format!("{:?}", args.kind).to_lowercase(),
        checkpoint.display(),
        written.display()
    );
    Ok(ExitCode::SUCCESS)
}
