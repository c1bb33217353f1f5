//! Lints on the run's settings, beside the data lints and with the same levels: an error
//! stops the run unless allowed by name (`[data] allow = ["learning-rate"]`,
//! `--allow-lint learning-rate`).
//!
//! The usual learning rates are those the tools a user would otherwise pick start from:
//! full fine-tuning of a pretrained model 1e-5–2e-5 (TRL's SFT examples, LLaMA-Factory's full
//! recipes), LoRA and QLoRA 1e-4–2e-4 (Unsloth's and LLaMA-Factory's defaults), a model trained
//! from random weights ~1e-3. The objective moves them: DPO and ORPO 1e-6 for full fine-tuning
//! (TRL's `DPOConfig` and `ORPOConfig` default) and 5e-6 with LoRA (Unsloth's DPO notebook;
//! users report 5e-6–5e-5), GRPO 1e-6 for full fine-tuning (TRL's `GRPOConfig`) and 5e-6 with
//! LoRA (Unsloth's GRPO notebooks). The reported case: 3e-3 (the demo's rate) on SmolLM2-135M full
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
    /// Whether this machine's CPU has bf16 arithmetic (AVX512-BF16 or AMX) for a bf16 kernel.
    pub cpu_bf16_kernel: bool,
}

impl SettingsContext {
    /// The context of `config` on this machine, from what is known of the model and the
    /// training split.
    pub fn new(
        config: &RunConfig,
        has_weights: bool,
        train_rows: usize,
        longest_row_tokens: usize,
    ) -> Self {
        use crate::model::ops::kernel_path::Bf16Kernel;
        SettingsContext {
            pretrained: Self::is_pretrained(config.model.init, has_weights),
            train_rows,
            longest_row_tokens,
            ranks: config.data_parallel_ranks(),
            cpu_bf16_kernel: Bf16Kernel::ALL
                .into_iter()
                .any(|k| k != Bf16Kernel::F32 && k.available()),
        }
    }

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
    use super::config::TrainingMethod as M;
    let method = config.training.method;
    match (pretrained, config.lora.enabled, method) {
        (false, _, _) => (1e-3, "training from random weights"),
        (true, true, M::Sft) => (2e-4, "LoRA on a pretrained model"),
        (true, false, M::Sft) => (2e-5, "full fine-tuning of a pretrained model"),
        (true, true, M::Dpo | M::Orpo) => (5e-6, "preference training with LoRA"),
        (true, false, M::Dpo | M::Orpo) => (1e-6, "full preference training"),
        (true, true, M::Grpo) => (5e-6, "GRPO with LoRA"),
        (true, false, M::Grpo) => (1e-6, "full GRPO fine-tuning"),
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
    let effective = t.effective_batch(ctx.ranks.max(1));
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
    if let Some(lint) = half_precision_widened(config, ctx) {
        out.push(lint);
    }
    out
}

/// Half precision on a CPU that cannot compute in it: every product widens its operands to f32,
/// so the run pays the conversions and gains no arithmetic. Measured on a 2-core AVX2 EPYC
/// (SmolLM2-135M shape, 256 tokens, `tunestudio bench`, three interleaved rounds): bf16-mixed
/// 0.81–0.94× fp32's tokens/s with 2.49 GB peak against 2.26 GB; pure bf16 0.87–0.96× with
/// 1.95 GB. fp16 has no CPU kernel anywhere.
fn half_precision_widened(config: &RunConfig, ctx: &SettingsContext) -> Option<Lint> {
    use crate::settings::Precision;
    // `devices::parse_device`'s name for the CPU.
    let on_cpu = config.devices.devices.iter().any(|d| d == "cpu");
    let precision = config.training.precision;
    let widened = match precision {
        Precision::Fp32 => false,
        Precision::Bf16Mixed | Precision::Bf16 => !ctx.cpu_bf16_kernel,
        Precision::Fp16Mixed => true,
    };
    if !on_cpu || !widened {
        return None;
    }
    let (name, memory) = match precision {
        Precision::Bf16 => (
            "bf16",
            "it does halve the weights' memory; keep it if that is why you chose it",
        ),
        Precision::Fp16Mixed => (
            "fp16-mixed",
            "it holds a half copy of the weights beside the f32 masters, more than fp32",
        ),
        _ => (
            "bf16-mixed",
            "it holds a bf16 copy of the weights beside the f32 masters, more than fp32",
        ),
    };
    Some(Lint {
        kind: LintKind::HalfPrecisionWidened,
        severity: Severity::Warning,
        count: 1,
        examples: Vec::new(),
        message: format!(
            "training.precision = \"{name}\" on a CPU without {} arithmetic: every product widens its operands to f32, so steps run slower than fp32 (measured 0.8–0.96× on an AVX2 CPU), and {memory}. Set training.precision = \"fp32\" for speed.",
            if precision == Precision::Fp16Mixed { "fp16" } else { "bf16 (AVX512-BF16 or AMX)" }
        ),
    })
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
            cpu_bf16_kernel: false,
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

    /// SFT's LoRA rate carried into DPO is 40× DPO's usual one: an error naming DPO's rate;
    /// GRPO with LoRA at its usual 5e-6 is fine.
    #[test]
    fn the_usual_rate_follows_the_objective() {
        let mut c = RunConfig::default();
        c.training.warmup_ratio = 0.03;
        c.lora.enabled = true;
        c.training.learning_rate = 2e-4;
        c.training.method = crate::train::TrainingMethod::Dpo;
        let dpo = settings_lints(&c, &ctx(true));
        assert!(
            kinds(&dpo).contains(&(LintKind::LearningRate, Severity::Error)),
            "{dpo:?}"
        );
        assert!(
            dpo[0].message.contains("training.learning_rate = 5e-6"),
            "{dpo:?}"
        );
        c.training.method = crate::train::TrainingMethod::Grpo;
        c.training.learning_rate = 5e-6;
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

    #[test]
    fn half_precision_on_a_cpu_without_its_arithmetic_is_a_warning_with_the_fix() {
        use crate::settings::Precision;
        let mut c = RunConfig::default();
        c.training.learning_rate = 1e-3;
        let widened = |c: &RunConfig, cpu_bf16_kernel: bool| {
            let ctx = SettingsContext {
                cpu_bf16_kernel,
                ..ctx(false)
            };
            settings_lints(c, &ctx)
                .into_iter()
                .filter(|l| l.kind == LintKind::HalfPrecisionWidened)
                .collect::<Vec<_>>()
        };
        assert!(widened(&c, false).is_empty(), "fp32 is never widened");
        c.training.precision = Precision::Bf16Mixed;
        let found = widened(&c, false);
        assert_eq!(
            kinds(&found),
            [(LintKind::HalfPrecisionWidened, Severity::Warning)]
        );
        assert!(
            found[0].message.contains("training.precision = \"fp32\""),
            "{found:?}"
        );
        // A CPU with AVX512-BF16 or AMX multiplies bf16 itself.
        assert!(widened(&c, true).is_empty());
        c.training.precision = Precision::Bf16;
        assert!(widened(&c, false)[0].message.contains("halve"));
        // No CPU has fp16 products.
        c.training.precision = Precision::Fp16Mixed;
        assert_eq!(widened(&c, true).len(), 1);
        // On a GPU the products are its own.
        c.training.precision = Precision::Bf16Mixed;
        c.devices.devices = vec!["cuda:0".into(), "cuda:1".into()];
        assert!(widened(&c, false).is_empty());
    }
}
