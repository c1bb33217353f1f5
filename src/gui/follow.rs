//! Settings that follow the model and the method. The demo trains a random tiny model at
//! 3e-3; carried over to a real pretrained model that rate wrecked it (2.05 → 10.7 in nine
//! steps). When the model turns out to have weights, the method changes between full
//! fine-tuning and LoRA, or the objective changes (SFT, DPO/ORPO, GRPO: switching to DPO with
//! LoRA proposed SFT's 2e-4, 40× the usual 5e-6), the settings the user has not touched move to
//! defaults suited to it, and one line says what changed and why; settings the user set stay.
//!
//! "Not touched" is tracked by value: the studio remembers what it (or the loaded config)
//! set, and a setting still holding that value is the studio's to move.

use tunestudio::train::settings_lints::usual_learning_rate;
use tunestudio::train::{InitMode, RunConfig, TrainingMethod};

/// What the settings are fitted to: a pretrained model or not, LoRA or not, the objective.
pub type Fitting = (bool, bool, TrainingMethod);

/// The warm-up the studio suggests for a pretrained model: 3 % of the steps (transformers'
/// and LLaMA-Factory's common recipe).
const PRETRAINED_WARMUP_RATIO: f64 = 0.03;

/// What the studio last fitted the training settings to, and the values it set.
#[derive(Debug, Clone, Default)]
pub struct FollowState {
    /// What the settings are fitted to; `None`: adopt the first one seen without moving
    /// anything (a config the user saved is theirs).
    fitted_for: Option<Fitting>,
    init: Option<InitMode>,
    learning_rate: Option<f64>,
    warmup_ratio: Option<f64>,
    /// The last announcement, shown in the Training panel.
    pub note: Option<String>,
}

impl FollowState {
    /// After a config was loaded: its values count as not touched. `fitted_for` is what they
    /// suit (the demo: a random model, full fine-tuning), or `None` for a user's own config.
    pub fn loaded(config: &RunConfig, fitted_for: Option<Fitting>) -> Self {
        FollowState {
            fitted_for,
            init: Some(config.model.init),
            learning_rate: Some(config.training.learning_rate),
            warmup_ratio: Some(config.training.warmup_ratio),
            note: None,
        }
    }
}

/// Moves the untouched settings of `config` when the model (`has_weights`, once known) or
/// the method changed since they were fitted; returns the announcement.
pub fn follow(
    state: &mut FollowState,
    config: &mut RunConfig,
    has_weights: Option<bool>,
) -> Option<String> {
    let has_weights = has_weights?;
    let mut changes = Vec::new();
    if has_weights && config.model.init == InitMode::Random && state.init == Some(InitMode::Random)
    {
        config.model.init = InitMode::Auto;
        state.init = Some(InitMode::Auto);
        changes.push("initialisation random → pretrained weights".to_string());
    }
    let pretrained = has_weights && config.model.init != InitMode::Random;
    let context = (pretrained, config.lora.enabled, config.training.method);
    let Some(fitted) = state.fitted_for else {
        state.fitted_for = Some(context);
        return announce(state, changes, context, config);
    };
    if fitted != context {
        state.fitted_for = Some(context);
        let (usual, _) = usual_learning_rate(config, pretrained);
        let t = &mut config.training;
        if state.learning_rate == Some(t.learning_rate) && t.learning_rate != usual {
            changes.push(format!("learning rate {:e} → {usual:e}", t.learning_rate));
            t.learning_rate = usual;
            state.learning_rate = Some(usual);
        }
        let warmup = if pretrained {
            PRETRAINED_WARMUP_RATIO
        } else {
            0.0
        };
        if t.warmup_steps == 0
            && state.warmup_ratio == Some(t.warmup_ratio)
            && t.warmup_ratio != warmup
        {
            changes.push(format!(
                "warm-up {:.0} % → {:.0} % of the steps",
                100.0 * t.warmup_ratio,
                100.0 * warmup
            ));
            t.warmup_ratio = warmup;
            state.warmup_ratio = Some(warmup);
        }
    }
    announce(state, changes, context, config)
}

fn announce(
    state: &mut FollowState,
    changes: Vec<String>,
    (pretrained, _, _): Fitting,
    config: &RunConfig,
) -> Option<String> {
    if changes.is_empty() {
        return None;
    }
    let (_, method) = usual_learning_rate(config, pretrained);
    let note = format!(
        "Settings follow the model: {} (suited to {method}; settings you changed stay).",
        changes.join(", ")
    );
    state.note = Some(note.clone());
    Some(note)
}

/// The settings lints of the studio's current config (`train::settings_lints`), once the
/// model is known: the same findings `tunestudio train` stops on.
pub fn settings_lints(
    config: &RunConfig,
    model: Option<&crate::gui::shared::ModelInfo>,
    preview: Option<&tunestudio::data::DataPreview>,
) -> Vec<tunestudio::data::Lint> {
    use tunestudio::train::settings_lints::{settings_lints, SettingsContext};
    let Some(info) = model else {
        return Vec::new();
    };
    let stats = preview.map(|p| (p.num_train_rows, p.stats.max_length_seen));
    let (train_rows, longest_row_tokens) = stats.unwrap_or((usize::MAX, 0));
    let ctx = SettingsContext::new(
        config,
        !info.weight_files.is_empty(),
        train_rows,
        longest_row_tokens,
    );
    settings_lints(config, &ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demo() -> RunConfig {
        let mut c = RunConfig::default();
        c.model.init = InitMode::Random;
        c.training.learning_rate = 3e-3;
        c
    }

    #[test]
    fn a_model_with_weights_after_the_demo_moves_init_rate_and_warm_up() {
        let mut c = demo();
        let mut s = FollowState::loaded(&c, Some((false, false, TrainingMethod::Sft)));
        // The demo model itself (no weights): nothing moves.
        assert_eq!(follow(&mut s, &mut c, Some(false)), None);
        let note = follow(&mut s, &mut c, Some(true)).expect("an announcement");
        assert_eq!(c.model.init, InitMode::Auto);
        assert_eq!(c.training.learning_rate, 2e-5);
        assert_eq!(c.training.warmup_ratio, 0.03);
        assert!(note.contains("3e-3 → 2e-5"), "{note}");
        // Switching to LoRA moves the rate again; a rate the user set stays.
        c.lora.enabled = true;
        follow(&mut s, &mut c, Some(true)).expect("LoRA's rate");
        assert_eq!(c.training.learning_rate, 2e-4);
        c.training.learning_rate = 5e-5;
        c.lora.enabled = false;
        assert_eq!(follow(&mut s, &mut c, Some(true)), None);
        assert_eq!(c.training.learning_rate, 5e-5);
    }

    /// The objective moves the rate too: DPO with LoRA is usually 5e-6, GRPO with full
    /// fine-tuning 1e-6 (TRL's default), and back to SFT's.
    #[test]
    fn switching_the_objective_moves_an_untouched_rate() {
        let mut c = demo();
        let mut s = FollowState::loaded(&c, Some((false, false, TrainingMethod::Sft)));
        follow(&mut s, &mut c, Some(true)).expect("pretrained");
        c.lora.enabled = true;
        follow(&mut s, &mut c, Some(true)).expect("LoRA's rate");
        assert_eq!(c.training.learning_rate, 2e-4);
        c.training.method = TrainingMethod::Dpo;
        let note = follow(&mut s, &mut c, Some(true)).expect("DPO's rate");
        assert_eq!(c.training.learning_rate, 5e-6);
        assert!(note.contains("preference training with LoRA"), "{note}");
        c.training.method = TrainingMethod::Grpo;
        c.lora.enabled = false;
        follow(&mut s, &mut c, Some(true)).expect("GRPO's rate");
        assert_eq!(c.training.learning_rate, 1e-6);
        c.training.method = TrainingMethod::Sft;
        follow(&mut s, &mut c, Some(true)).expect("SFT's rate");
        assert_eq!(c.training.learning_rate, 2e-5);
    }

    #[test]
    fn a_users_own_config_is_adopted_as_it_is() {
        let mut c = RunConfig::default();
        c.training.learning_rate = 1e-4;
        let mut s = FollowState::loaded(&c, None);
        assert_eq!(follow(&mut s, &mut c, Some(true)), None);
        assert_eq!(c.training.learning_rate, 1e-4);
    }
}
