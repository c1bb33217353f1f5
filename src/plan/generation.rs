//! GRPO's generation phase as the memory plan sees it: before a step's forward, every prompt's
//! group of `num_generations` completions is sampled (`infer::rollout::sample_group`) with the
//! policy's own weights (viewed, not copied) and no graph, one group at a time:
//!
//! - the prompt's prefill (one row of the prompt's tokens), whose keys and values are then
//!   copied to a cache of G rows sized for prompt + completion (both exist for a moment);
//! - a decode step: each layer's attention over the cache and its MLP for G rows, and the
//!   head's logits for G rows (the product in the compute dtype, its f32 cast, the host copy
//!   the samplers read and the previous step's, which lives until it is replaced).
//!
//! The cache is sized for `max_completion_length` from the start, so its bytes do not grow
//! with the completion: the plan takes the whole cache. A device holds the cache of the layers
//! it holds (a layer split spreads it), and the head's logits where the head is.

use super::step_model::StepDims;
use super::{HeadLoss, PlanRequest};

/// The generation phase's bytes on a device holding `layers` decoder layers (and the head when
/// `head`), besides the weights and optimizer state that stay resident: the G-row cache, the
/// prefill's one-row copy of the prompt's part of it, and the larger of the prefill's and a
/// decode step's transients. 0 for a run that samples nothing (any method but GRPO).
pub(crate) fn generation_bytes(req: &PlanRequest, d: &StepDims, layers: u64, head: bool) -> u64 {
    let HeadLoss::Completions {
        generations,
        completion_tokens,
    } = req.head_loss
    else {
        return 0;
    };
    let g = generations.max(1) as u64;
    let positions = d.seq_len;
    let prompt = positions.saturating_sub(completion_tokens as u64).max(1);
    let a = d.act_bytes;
    let kv_row = 2 * d.kv_dim * a;
    let cache = layers * g * positions * kv_row;
    let prefill_copy = layers * prompt * kv_row;
    // A layer's transient: its input and output, q (and k, v) of the new tokens, the f32
    // scores and their softmax over the cache, and the MLP's gate, up and product.
    let layer = |rows: u64, keys: u64| {
        rows * (4 * d.hidden + d.q_dim + 2 * d.kv_dim + 3 * d.intermediate) * a
            + 2 * rows * d.heads * keys * 4
    };
    let logits = |rows: u64| {
        if head {
            rows * d.vocab * (a + 4) + 2 * rows * d.vocab * 4
        } else {
            0
        }
    };
    let any_layer = if layers > 0 { 1 } else { 0 };
    let prefill = any_layer * layer(prompt, prompt) + logits(1);
    let decode = any_layer * layer(g, positions) + logits(g);
    cache + prefill_copy + prefill.max(decode)
}

/// DictaLM 2.0 (Mistral, 32 layers, 8 KV heads of 128) trained by GRPO in pure bf16 with
/// checkpointing: one prompt of 512 tokens × `generations` completions of `completion_tokens`
/// per micro-step on `devices` (the planner's tests of GRPO).
#[cfg(test)]
pub(crate) fn dictalm_grpo_request(
    generations: usize,
    completion_tokens: usize,
    devices: &str,
) -> PlanRequest {
    let path = crate::paths::shared_dir()
        .join("model-configs")
        .join("dictalm2-7b.json");
    PlanRequest {
        model: crate::model::ModelConfig::from_file(&path).expect("model config"),
        precision: crate::plan::Precision::Bf16,
        micro_batch: generations,
        gradient_accumulation: 1,
        seq_len: 512 + completion_tokens,
        activation_checkpointing: true,
        optimizer_offload: false,
        lora: None,
        strategy: crate::plan::Strategy::Single,
        shard: Default::default(),
        devices: crate::plan::parse_devices(devices).expect("devices"),
        ops: crate::model::OpsMode::Auto,
        process: None,
        trained_tokens: None,
        head_loss: HeadLoss::Completions {
            generations,
            completion_tokens,
        },
        reference: Default::default(),
        generations_per_micro_step: None,
        world: Default::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpo(generations: usize, completion_tokens: usize) -> PlanRequest {
        dictalm_grpo_request(generations, completion_tokens, "80GiB")
    }

    #[test]
    fn the_cache_holds_every_completion_at_its_full_length_on_the_layers_held() {
        let req = grpo(8, 256);
        let d = StepDims::new(&req);
        let one = generation_bytes(&req, &d, 1, false);
        let all = generation_bytes(&req, &d, 32, true);
        // Per layer: K and V of 8 rows × 768 positions, and the prefill's one-row prompt part.
        let per_layer = 2 * 1024 * 2 * (8 * 768 + 512);
        assert_eq!(generation_bytes(&req, &d, 2, false) - one, per_layer);
        // The whole cache is the 0.8 GB docs/grpo.md names (805,306,368 bytes), below the head's
        // G rows of logits on top.
        assert!(all > 32 * 2 * 1024 * 2 * 8 * 768 + 8 * 32_000 * 6, "{all}");
        // Twice the generations, twice the G-row cache.
        let req16 = grpo(16, 256);
        let d16 = StepDims::new(&req16);
        assert!(generation_bytes(&req16, &d16, 32, true) - all >= 32 * 2 * 1024 * 2 * 8 * 768);
    }

    #[test]
    fn only_grpo_generates() {
        let mut req = grpo(8, 256);
        req.head_loss = HeadLoss::Chunked;
        let d = StepDims::new(&req);
        assert_eq!(generation_bytes(&req, &d, 32, true), 0);
    }
}
