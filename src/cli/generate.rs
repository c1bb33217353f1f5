//! `tunestudio generate`: streams a model's answer to stdout, the speed to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tunestudio::infer::{
    spawn_generation, GenEvent, GenerationRequest, Generator, ModelSpec, Prompt, SamplingParams,
};

/// Arguments of `tunestudio generate`.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Model folder (base or fully fine-tuned HF folder) or Hugging Face id.
    #[arg(long)]
    pub model: String,
    /// PEFT LoRA adapter folder to attach to the model (unmerged).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// The prompt (the user message in chat mode).
    #[arg(long)]
    pub prompt: String,
    /// Format the prompt with the model's chat template (instruct / fine-tuned models).
    #[arg(long)]
    pub chat: bool,
    /// System prompt (implies --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f64,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f64,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 50)]
    pub top_k: usize,
    /// Penalty on repeated tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f64,
    /// Random seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when the output contains this text (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Parameter dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Run the base quantized: none, q8_0 or q4_k (the base an adapter was trained on with
    /// `[model] quantize`).
    #[arg(long, default_value = "none")]
    pub quantize: String,
    /// Read the tokenizer from this folder or hub id instead of the model's.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Attach the adapter even if its adapter_config.json names another base model.
    #[arg(long)]
    pub ignore_adapter_base: bool,
    /// Output these token ids (comma-separated) instead of sampling, then sample on: a
    /// script for tests of the streamed text.
    #[arg(long, value_delimiter = ',', hide = true)]
    pub force_tokens: Vec<u32>,
}

/// Runs `tunestudio generate`.
pub fn run(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    let dtype = match args.dtype.to_ascii_lowercase().as_str() {
        "f32" | "float32" => candle_core::DType::F32,
        "bf16" | "bfloat16" => candle_core::DType::BF16,
        "f16" | "float16" => candle_core::DType::F16,
        other => anyhow::bail!("--dtype {other} is not supported; use f32, bf16 or f16"),
    };
    let mut spec = ModelSpec::new(args.model.clone());
    spec.adapter = args.adapter.clone();
    spec.tokenizer = args.tokenizer.clone();
    spec.dtype = dtype;
    spec.check_adapter_base = !args.ignore_adapter_base;
    spec.quantize = args.quantize.parse()?;
    let params = SamplingParams {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        stop_strings: args.stop.clone(),
        stop_on_eos: true,
        forced_tokens: args.force_tokens.clone(),
    };
    // Fail on bad settings before the (slow) model load.
    params.validate()?;
    eprintln!(
        "loading {}{} ...",
        args.model,
        args.adapter
            .as_ref()
            .map(|a| format!(" + adapter {}", a.display()))
            .unwrap_or_default()
    );
    let generator = Arc::new(Generator::load(&spec)?);
    let prompt = if args.chat || args.system.is_some() {
        Prompt::chat(args.system.as_deref(), &args.prompt)
    } else {
        Prompt::Completion(args.prompt.clone())
    };
    let handle = spawn_generation(GenerationRequest {
        generator,
        prompt,
        params,
    });
    let flag = handle.cancel_flag();
    // Ctrl-C stops generation (and still prints the statistics); a handler may already be
    // installed by another command in this process, which is fine.
    let _ = ctrlc::set_handler(move || flag.store(true, Ordering::Relaxed));
    let mut stdout = std::io::stdout().lock();
    for event in handle.events.iter() {
        match event {
            GenEvent::Started { prompt_tokens } => {
                eprintln!("prompt: {prompt_tokens} tokens");
            }
            // The generator releases whole characters only (a byte-split character is held
            // back until its last token), so no chunk ends in U+FFFD.
            GenEvent::Token { text, .. } => {
                if !text.is_empty() {
                    stdout.write_all(text.as_bytes())?;
                    stdout.flush()?;
                }
            }
            GenEvent::Done(out) => {
                writeln!(stdout)?;
                if out.cut_character {
                    eprintln!("(the output ended inside a character; its bytes are not shown)");
                }
                eprintln!(
                    "{} tokens in {:.2} s: {:.1} tokens/s ({:.1} tokens/s after the first; prompt pass {:.2} s); stopped: {}",
                    out.tokens,
                    out.total_secs,
                    out.tokens_per_sec,
                    out.decode_tokens_per_sec,
                    out.prefill_secs,
                    out.stop_reason
                );
                return Ok(ExitCode::SUCCESS);
            }
            GenEvent::Error { message } => anyhow::bail!(message),
        }
    }
    anyhow::bail!("generation ended without a result (the generation thread stopped unexpectedly)")
}
