//! The events of a finished step: its numbers (`Event::Step`, with the preference or GRPO
//! metrics under TRL's names) and, for GRPO, one prompt's sampled group (`Event::Completions`).

use super::super::events::Event;
use super::super::step::{StepOutcome, TrainingRun};

/// The last GRPO step's first prompt and its group, as the front ends show it
/// ([`Event::Completions`]; `None` for other methods).
pub(super) fn last_group(run: &TrainingRun) -> Option<super::super::events::SampledGroup> {
    let rollouts = super::super::step::last_rollouts(run)?;
    let prompts = super::super::step::last_prompts(run)?;
    let first = rollouts.rows.first()?;
    let prompt = prompts.get(first.prompt)?;
    let keep = super::super::events::SampledGroup::TEXT_CHARS;
    let chars = prompt.prompt_text.chars().count();
    Some(super::super::events::SampledGroup {
        row: prompt.index,
        prompt: prompt
            .prompt_text
            .chars()
            .skip(chars.saturating_sub(keep))
            .collect(),
        reward_names: rollouts.reward_names.clone(),
        completions: rollouts
            .rows
            .iter()
            .take_while(|r| r.prompt == first.prompt)
            .map(|r| super::super::events::SampledText {
                text: r.text.chars().take(keep).collect(),
                rewards: r.rewards.clone(),
                reward: r.reward,
                advantage: r.advantage,
                truncated: r.truncated,
            })
            .collect(),
    })
}

/// The event of a finished step.
pub(super) fn step_event(o: &StepOutcome) -> Event {
    Event::Step {
        step: o.step,
        loss: o.loss,
        lr: o.lr,
        grad_norm: o.grad_norm,
        tokens_per_sec: o.tokens_per_sec,
        trained_tokens: o.trained_tokens,
        elapsed_secs: o.elapsed_secs,
        epoch: o.epoch,
        skipped: o.skipped,
        loss_scale: o.loss_scale,
        metrics: o
            .preference
            .map(|m| {
                m.named()
                    .into_iter()
                    // The loss is the event's own field.
                    .filter(|(name, _)| *name != "loss")
                    .map(|(name, v)| (name.to_string(), v))
                    .collect()
            })
            .or_else(|| o.grpo.as_ref().map(|g| g.named().into_iter().collect()))
            .unwrap_or_default(),
    }
}
