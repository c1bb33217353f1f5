//! GRPO's rollouts: a group of completions sampled for one prompt, every one from the same
//! prefill (the prompt runs through the model once, and its cached keys and values are copied
//! to every completion's row), decoded together as one batch (each step's products are one
//! matrix product over the group's rows, not a matrix-vector product per completion), each
//! sampled with its own seed so a run is reproducible and a resumed run samples what the
//! uninterrupted one would have.
//!
//! A completion that stopped (EOS) keeps its row until the whole group has stopped: its later
//! tokens are computed and dropped, which costs less than re-packing the cache every time one
//! finishes.

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
    let mut prefill = model.new_cache(prompt_len);
    let first_logits = model.forward(prompt_ids, &mut prefill)?;
    let rows = generations.max(1);
    let mut cache = prefill.repeat_rows(rows, prompt_len + params.max_new_tokens)?;
    drop(prefill);
    let mut samplers: Vec<Sampler> = (0..rows)
        .map(|g| {
            Sampler::new(&SamplingParams {
                seed: params.seed.wrapping_add(g as u64),
                ..params.clone()
            })
        })
        .collect();
    let mut logits: Vec<Vec<f32>> = vec![first_logits; rows];
    let mut contexts: Vec<Vec<u32>> = vec![prompt_ids.to_vec(); rows];
    let mut completions: Vec<SampledCompletion> = (0..rows)
        .map(|_| SampledCompletion {
            ids: Vec::new(),
            truncated: false,
        })
        .collect();
    let mut open = vec![true; rows];
    let mut step = 0;
    loop {
        let mut next = Vec::with_capacity(rows);
        for g in 0..rows {
            let c = &mut completions[g];
            if !open[g] {
                // A stopped row feeds its last token again; what it computes is dropped.
                next.push(c.ids.last().copied().unwrap_or(0));
                continue;
            }
            let id = samplers[g]
                .next_token(&mut logits[g], &contexts[g])
                .ok_or(InferError::NonFiniteLogits { step })?;
            c.ids.push(id);
            contexts[g].push(id);
            if eos_ids.contains(&id) {
                open[g] = false;
            } else if c.ids.len() >= params.max_new_tokens {
                c.truncated = true;
                open[g] = false;
            }
            next.push(id);
        }
        step += 1;
        if !open.iter().any(|&o| o) {
            break;
        }
        let batch = model.forward_rows(&next, &mut cache)?;
        logits = batch.to_vec2::<f32>()?;
    }
    completions.truncate(generations);
    Ok(GroupSample { completions })
}
