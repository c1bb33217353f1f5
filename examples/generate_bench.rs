//! Generation speed (prints, asserts nothing): the SmolLM2-135M shape with random weights,
//! f32 on the CPU, greedy, a fixed number of new tokens (EOS ignored).
//!
//! `cargo run --release --example generate_bench [-- PROMPT_TOKENS NEW_TOKENS]`
//!
//! Reports the KV-cached generator (prompt pass, tokens/s after the first token, end to end)
//! and, for comparison, decoding without a cache (the whole sequence re-run per token).

use candle_core::{DType, Device, IndexOp, Tensor};
use std::sync::atomic::AtomicBool;
use std::time::Instant;
use tunestudio::data::TokenizerBundle;
use tunestudio::infer::{argmax, Generator, SamplingParams};
use tunestudio::model::{CausalLm, ModelConfig};
use tunestudio::paths::shared_dir;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let prompt_tokens: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(32);
    let new_tokens: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(64);
    let config = ModelConfig::from_file(&shared_dir().join("model-configs/smollm2-135m.json"))?;
    let t0 = Instant::now();
    let lm = CausalLm::random_init(&config, 0, DType::F32, &Device::Cpu)?;
    // SmolLM2's own tokenizer (the fixtures use it), for decoding the output.
    let tok = TokenizerBundle::load(&shared_dir().join("fixtures/tiny-llama"))?;
    let g = Generator::from_model(&lm, tok, "smollm2-135m (random init)")?;
    println!(
        "model: SmolLM2-135M shape, {} parameters, f32, random init ({:.1} s); {} threads",
        config.num_parameters(),
        t0.elapsed().as_secs_f64(),
        rayon::current_num_threads()
    );
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|i| 100 + i * 37).collect();
    let params = SamplingParams {
        stop_on_eos: false,
        ..SamplingParams::greedy(new_tokens)
    };
    let cancel = AtomicBool::new(false);
    // Warm-up (allocator, thread pool), then the timed run.
    g.generate_ids(
        &prompt,
        &SamplingParams {
            max_new_tokens: 4,
            ..params.clone()
        },
        &cancel,
        &mut |_| true,
    )?;
    let out = g.generate_ids(&prompt, &params, &cancel, &mut |_| true)?;
    println!(
        "kv cache: prompt {} tokens in {:.3} s ({:.0} tokens/s); {} new tokens: {:.1} tokens/s after the first ({:.1} ms/token), {:.1} tokens/s end to end",
        out.prompt_tokens,
        out.prefill_secs,
        out.prompt_tokens as f64 / out.prefill_secs,
        out.tokens,
        out.decode_tokens_per_sec,
        1000.0 / out.decode_tokens_per_sec.max(1e-9),
        out.tokens_per_sec
    );

    // Without a cache: the training model re-runs the whole sequence for every token.
    let n_uncached = new_tokens.min(8);
    let mut ids = prompt.clone();
    let t = Instant::now();
    for _ in 0..n_uncached {
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
        let logits = lm.logits(&input, None)?;
        let last = logits.i((0, ids.len() - 1))?.to_vec1::<f32>()?;
        ids.push(argmax(&last).unwrap_or(0));
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "no cache (training forward per token): {n_uncached} tokens: {:.1} tokens/s",
        n_uncached as f64 / secs
    );
    let same = ids[prompt.len()..] == out.token_ids[..n_uncached];
    println!("cached and uncached greedy agree on the first {n_uncached} tokens: {same}");
    Ok(())
}
