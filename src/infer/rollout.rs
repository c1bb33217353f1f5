//! GRPO's rollouts: a group of completions sampled for one prompt, every one from the same
//! prefill (the prompt runs through the model once; each completion restarts from its cached
//! keys and values), each seeded on its own so a run is reproducible and a resumed run samples
//! what the uninterrupted one would have.
//!
//! The completions of a group are decoded one after another on a batch-of-one cache: the
//! prompt's prefill, the expensive part for short answers, is shared, but the decode steps are
//! matrix-vector products. Decoding the group as one batch is the next speed step.

use super::engine::InferModel;
use super::error::InferError;
use super::sampling::{Sampler, SamplingParams};

/// One sampled completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampledCompletion {
    /// The sampled tokens, ending with the EOS token when one was sampled.
    pub ids: Vec<u32>,
    /// It reached the length limit without an EOS (TRL's "clipped" completion).
    pub truncated: bool,
}

/// The completions of one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSample {
    /// In generation order (generation `g` used seed `seed + g`).
    pub completions: Vec<SampledCompletion>,
}

/// Samples `generations` completions of `prompt_ids` with `params` (its `max_new_tokens` is the
/// completion limit, its `seed` the group's: generation `g` draws from `seed + g`), stopping
/// each at the first of `eos_ids`.
pub fn sample_group(
    model: &InferModel,
    prompt_ids: &[u32],
    params: &SamplingParams,
    generations: usize,
    eos_ids: &[u32],
) -> Result<GroupSample, InferError> {
    params.validate()?;
    if prompt_ids.is_empty() {
        return Err(InferError::EmptyPrompt);
    }
    let prompt_len = prompt_ids.len();
    let mut cache = model.new_cache(prompt_len + params.max_new_tokens);
    let first_logits = model.forward(prompt_ids, &mut cache)?;
    let mut completions = Vec::with_capacity(generations);
    for g in 0..generations {
        cache.truncate(prompt_len);
        let seeded = SamplingParams {
            seed: params.seed.wrapping_add(g as u64),
            ..params.clone()
        };
        let mut sampler = Sampler::new(&seeded);
        let mut logits = first_logits.clone();
        let mut context = prompt_ids.to_vec();
        let mut ids = Vec::new();
        let truncated = loop {
            let id = sampler
                .next_token(&mut logits, &context)
                .ok_or(InferError::NonFiniteLogits { step: ids.len() })?;
            ids.push(id);
            context.push(id);
            if eos_ids.contains(&id) {
                break false;
            }
            if ids.len() >= params.max_new_tokens {
                break true;
            }
            logits = model.forward(&[id], &mut cache)?;
        };
        completions.push(SampledCompletion { ids, truncated });
    }
    Ok(GroupSample { completions })
}
