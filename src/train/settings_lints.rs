//! Lints on the run's settings, beside the data lints and with the same levels: an error
//! stops the run unless allowed by name (`[data] allow = ["learning-rate"]`,
//! `--allow-lint learning-rate`).
//!
//! The usual learning rates are those the tools a user would otherwise pick start from:
//! full fine-tuning of a pretrained model 1e-5–2e-5 (TRL's SFT examples, LLaMA-Factory's full
//! recipes), LoRA and QLoRA 1e-4–2e-4 (Unsloth's and LLaMA-Factory's defaults), a model trained
//! from random weights ~1e-3. The reported case: 3e-3 (the demo's rate) on SmolLM2-135M full
//! fine-tuning took the loss from 2.05 to 10.7 in 9 steps — 150× the usual rate.

use crate::data::lints::{Lint, LintKind, Severity};

use super::config::{InitMode, RunConfig};

/// A rate this many times the usual one (or more) is an error.
const ERROR_RATIO: f64 = 30.0;
/// A rate this many times the usual one (or more) is a warning.
const WARNING_RATIO: f64 = 5.0;
/// A rate this many times smaller than the usual one barely moves the weights.
const TOO_LOW_RATIO: f64 = 100.0;
/// Epochs at or above this over a small dataset repeat every row too often.
const MANY_EPOCHS: u32 = 10;
/// Rows below which a dataset counts as small for [`MANY_EPOCHS`].
const SMALL_DATASET_ROWS: usize = 1_000;
/// `max_length` at or above this multiple of the longest row is far above the data.
const OVERSIZED_LENGTH_RATIO: usize = 4;

/// What the lints need to know beyond the run config.
#[derive(Debug, Clone, Copy)]
pub struct SettingsContext {
    /// Whether the model starts from pretrained weights (`init = "auto"` with weights, or
    /// `"pretrained"`), as opposed to a random initialisation.
    pub pretrained: bool,
    /// Rows in the training split.
    pub train_rows: usize,
    /// Tokens of the training split's longest row.
    pub longest_row_tokens: usize,
    /// Data-parallel ranks (each takes `micro_batch` rows).
    pub ranks: usize,
}

impl SettingsContext {
    /// Whether `init` on a folder with (`has_weights`) or without weights loads pretrained weights.
    pub fn is_pretrained(init: InitMode, has_weights: bool) -> bool {
        match init {
            InitMode::Auto => has_weights,
            InitMode::Pretrained => true,
            InitMode::Random => false,
        }
    }
}

/// The usual learning rate for this method and initialisation, and what it is called.
pub fn usual_learning_rate(config: &RunConfig, pretrained: bool) -> (f64, &'static str) {
    match (pretrained, config.lora.enabled) {
        (false, _) => (1e-3, "training from random weights"),
        (true, true) => (2e-4, "LoRA on a pretrained model"),
        (true, false) => (2e-5, "full fine-tuning of a pretrained model"),
    }
}

/// Every settings lint of `config` in `ctx`.
pub fn settings_lints(config: &RunConfig, ctx: &SettingsContext) -> Vec<Lint> {
    let mut out = Vec::new();
    let t = &config.training;
    let lr = t.learning_rate;
    let (usual, method) = usual_learning_rate(config, ctx.pretrained);
    let ratio = lr / usual;
    let lint = |kind, severity, message: String| Lint {
        kind,
        severity,
        count: 1,
        examples: Vec::new(),
        message,
    };
    if ratio >= WARNING_RATIO {
        let severity = if ratio >= ERROR_RATIO {
            Severity::Error
        } else {
            Severity::Warning
        };
        out.push(lint(
            LintKind::LearningRate,
            severity,
            format!(
                "training.learning_rate = {lr:e} is {ratio:.0}× the usual {usual:e} for {method}; a rate this high can wreck the model in a few steps. Set training.learning_rate = {usual:e}."
            ),
        ));
    } else if ratio <= 1.0 / TOO_LOW_RATIO {
        out.push(lint(
            LintKind::LearningRate,
            Severity::Warning,
            format!(
                "training.learning_rate = {lr:e} is {:.0}× below the usual {usual:e} for {method}; the weights will barely move. Set training.learning_rate = {usual:e}.",
                1.0 / ratio
            ),
        ));
    }
    let high = ratio > 1.0 + 1e-9;
    if ctx.pretrained && high && t.warmup_steps == 0 && t.warmup_ratio == 0.0 {
        out.push(lint(
            LintKind::NoWarmup,
            Severity::Warning,
            format!(
                "no warm-up at training.learning_rate = {lr:e} (above the usual {usual:e}): the first steps hit the pretrained weights at full rate. Set training.warmup_ratio = 0.03."
            ),
        ));
    }
    let effective = t.micro_batch * t.gradient_accumulation * ctx.ranks.max(1);
    if effective == 1 && high {
        out.push(lint(
            LintKind::TinyEffectiveBatch,
            Severity::Warning,
            format!(
                "an effective batch of 1 row at training.learning_rate = {lr:e}: every step follows one row's gradient. Raise training.gradient_accumulation (e.g. 8) or lower the rate."
            ),
        ));
    }
    if ctx.pretrained
        && t.max_steps.is_none()
        && t.epochs >= MANY_EPOCHS
        && ctx.train_rows < SMALL_DATASET_ROWS
    {
        out.push(lint(
            LintKind::ManyEpochs,
            Severity::Warning,
            format!(
                "training.epochs = {} over {} rows shows the model every row {} times; it will memorise them. Use 1–3 epochs (training.epochs = 3) or more data.",
                t.epochs, ctx.train_rows, t.epochs
            ),
        ));
    }
    let max_length = config.data.max_length;
    if !config.data.packing
        && ctx.longest_row_tokens > 0
        && max_length >= OVERSIZED_LENGTH_RATIO * ctx.longest_row_tokens
    {
        let suggested = ctx.longest_row_tokens.next_power_of_two();
        out.push(lint(
            LintKind::MaxLengthOversized,
            Severity::Info,
            format!(
                "data.max_length = {max_length} is far above the longest row ({} tokens); batches are padded to their own longest row, but a longer bound hides rows that grew by mistake. data.max_length = {suggested} fits every row.",
                ctx.longest_row_tokens
            ),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(pretrained: bool) -> SettingsContext {
        SettingsContext {
            pretrained,
            train_rows: 500,
            longest_row_tokens: 120,
            ranks: 1,
        }
    }

    fn kinds(lints: &[Lint]) -> Vec<(LintKind, Severity)> {
        lints.iter().map(|l| (l.kind, l.severity)).collect()
    }

    #[test]
    fn the_demos_rate_on_a_pretrained_model_is_an_error_and_fine_on_a_random_one() {
        let mut c = RunConfig::default();
        c.training.learning_rate = 3e-3;
        c.training.warmup_ratio = 0.03;
        c.training.micro_batch = 4;
        let pretrained = settings_lints(&c, &ctx(true));
        assert!(
            kinds(&pretrained).contains(&(LintKind::LearningRate, Severity::Error)),
            "{pretrained:?}"
        );
        assert!(pretrained[0]
            .message
            .contains("training.learning_rate = 2e-5"));
        let random = settings_lints(&c, &ctx(false));
        assert!(
            !random.iter().any(|l| l.kind == LintKind::LearningRate),
            "{random:?}"
        );
        // LoRA's usual rate is ten times higher: 3e-3 is a warning there.
        c.lora.enabled = true;
        assert!(kinds(&settings_lints(&c, &ctx(true)))
            .contains(&(LintKind::LearningRate, Severity::Warning)));
        c.training.learning_rate = 2e-4;
        assert!(settings_lints(&c, &ctx(true))
            .iter()
            .all(|l| l.kind != LintKind::LearningRate));
    }

    #[test]
    fn warm_up_batch_epochs_and_length_are_named_with_their_fix() {
        let mut c = RunConfig::default();
        c.training.learning_rate = 5e-5;
        c.training.micro_batch = 1;
        c.training.gradient_accumulation = 1;
        c.training.warmup_steps = 0;
        c.training.warmup_ratio = 0.0;
        c.training.epochs = 20;
        c.training.max_steps = None;
        c.data.max_length = 2048;
        c.data.packing = false;
        let found = kinds(&settings_lints(&c, &ctx(true)));
        for kind in [
            LintKind::NoWarmup,
            LintKind::TinyEffectiveBatch,
            LintKind::ManyEpochs,
            LintKind::MaxLengthOversized,
        ] {
            assert!(found.iter().any(|(k, _)| *k == kind), "{kind:?}: {found:?}");
        }
        c.training.warmup_ratio = 0.03;
        c.training.gradient_accumulation = 8;
        c.training.epochs = 3;
        c.data.max_length = 256;
        assert!(settings_lints(&c, &ctx(true)).is_empty());
    }
}
