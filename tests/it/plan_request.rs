//! The stale-plan rule, as a property (issue #21): the one adapter
//! (`tunestudio::train::plan_request`) is what the studio's "plan is stale" key is derived
//! from, so for every run-config key the planner reads, changing that key changes the request
//! (the plan is redone), and changing a key it does not read leaves the request equal (no
//! needless replan). Random run configs (proptest) × every key of the run config.
//!
//! The table below lists EVERY key of `RunConfig` (checked against serde's own list of
//! fields): a new setting fails `every_run_config_key_is_classified` until it is listed here,
//! read or not read, with a change to apply.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::collections::BTreeSet;
use tunestudio::data::{ColumnMapping, DataConfig, Format, TxtSplit};
use tunestudio::model::OptimizerOffload;
use tunestudio::settings::{Precision, Quantization, Strategy as DeviceStrategy};
use tunestudio::train::{
    self, CheckpointSection, DevicesSection, EvalSection, InitMode, LoraSection, ModelDtype,
    ModelSection, RunConfig, ScheduleKind, TrainingSection,
};
use tunestudio::train::{
    DpoLoss, GrpoLossType, GrpoSection, PreferenceSection, ReferenceMode, ScaleRewards,
    TrainingMethod,
};

/// Whether the planner reads a key.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Reads {
    /// Always: a change must change the request.
    Yes,
    /// Only with `[lora] enabled = true` (LoRA's shape); without it, a change changes nothing.
    WhenLoraIsOn,
    /// For the process's terms (`train::process_inputs`: file sizes, whether the run
    /// evaluates): a change changes the request exactly when it changes what is derived.
    ForProcess,
    /// Only with `[training] method = "dpo" | "orpo"` (the pairs' lengths); under SFT a
    /// change changes nothing.
    WhenPreference,
    /// Only with `[training] method = "dpo"` (the reference; ORPO has none).
    WhenDpo,
    /// Only with `[training] method = "grpo"` (the group size, lengths and reference).
    WhenGrpo,
    /// Only with `[devices] strategy = "sharded"` (what the ranks divide).
    WhenSharded,
    /// Never: a change must leave the request equal.
    No,
}

/// One run-config key, whether the planner reads it, and a change of its value (to a
/// different value, whatever it was).
struct Key {
    name: &'static str,
    reads: Reads,
    change: fn(&mut RunConfig),
}

const MODELS: [&str; 4] = [
    "smollm2-135m.json",
    "llama-3.1-8b.json",
    "qwen2.5-7b.json",
    "dictalm2-7b.json",
];

fn model_source(i: usize) -> String {
    tunestudio::paths::shared_dir()
        .join("model-configs")
        .join(MODELS[i % MODELS.len()])
        .display()
        .to_string()
}

fn next_model(c: &mut RunConfig) {
    let i = (0..MODELS.len())
        .find(|&i| model_source(i) == c.model.source)
        .unwrap_or(0);
    c.model.source = model_source(i + 1);
}

fn next<T: Copy + PartialEq>(all: &[T], v: T) -> T {
    let i = all.iter().position(|x| *x == v).unwrap_or(0);
    all[(i + 1) % all.len()]
}

fn toggle(o: &mut Option<String>) {
    *o = match o {
        Some(_) => None,
        None => Some("column".into()),
    };
}

fn flip(b: &mut bool) {
    *b = !*b;
}

/// Every key of the run config.
fn keys() -> Vec<Key> {
    use Reads::*;
    vec![
        Key {
            name: "output_dir",
            reads: No,
            change: |c| c.output_dir.push("elsewhere"),
        },
        Key {
            name: "model.source",
            reads: Yes,
            change: next_model,
        },
        // The compute dtype follows the precision; validation rejects a dtype that disagrees,
        // so the precision alone decides the memory.
        Key {
            name: "model.dtype",
            reads: No,
            change: |c| {
                let all = [
                    ModelDtype::Auto,
                    ModelDtype::F32,
                    ModelDtype::Bf16,
                    ModelDtype::F16,
                ];
                c.model.dtype = next(&all, c.model.dtype);
            },
        },
        Key {
            name: "model.init",
            reads: ForProcess,
            change: |c| {
                let all = [InitMode::Auto, InitMode::Pretrained, InitMode::Random];
                c.model.init = next(&all, c.model.init);
            },
        },
        // QLoRA: the base's bytes (a quantized base exists only under LoRA).
        Key {
            name: "model.quantize",
            reads: WhenLoraIsOn,
            change: |c| c.model.quantize = next(&Quantization::ALL, c.model.quantize),
        },
        Key {
            name: "data.path",
            reads: ForProcess,
            change: |c| c.data.path.push_str(".2"),
        },
        Key {
            name: "data.validation_path",
            reads: ForProcess,
            change: |c| toggle(&mut c.data.validation_path),
        },
        Key {
            name: "data.validation_ratio",
            reads: ForProcess,
            change: |c| {
                c.data.validation_ratio = if c.data.validation_ratio > 0.5 {
                    0.0
                } else {
                    0.75
                }
            },
        },
        Key {
            name: "data.format",
            reads: No,
            change: |c| {
                c.data.format = next(&[Format::Auto, Format::Text, Format::Chat], c.data.format)
            },
        },
        Key {
            name: "data.columns.text",
            reads: No,
            change: |c| toggle(&mut c.data.columns.text),
        },
        Key {
            name: "data.columns.prompt",
            reads: No,
            change: |c| toggle(&mut c.data.columns.prompt),
        },
        Key {
            name: "data.columns.input",
            reads: No,
            change: |c| toggle(&mut c.data.columns.input),
        },
        Key {
            name: "data.columns.completion",
            reads: No,
            change: |c| toggle(&mut c.data.columns.completion),
        },
        Key {
            name: "data.columns.messages",
            reads: No,
            change: |c| toggle(&mut c.data.columns.messages),
        },
        Key {
            name: "data.columns.system",
            reads: No,
            change: |c| toggle(&mut c.data.columns.system),
        },
        Key {
            name: "data.columns.history",
            reads: No,
            change: |c| toggle(&mut c.data.columns.history),
        },
        Key {
            name: "data.max_length",
            reads: Yes,
            change: |c| c.data.max_length += 8,
        },
        // Packing fills rows up to max_length; the plan is for max_length rows either way.
        Key {
            name: "data.packing",
            reads: No,
            change: |c| flip(&mut c.data.packing),
        },
        Key {
            name: "data.train_on_completions_only",
            reads: No,
            change: |c| {
                c.data.train_on_completions_only = match c.data.train_on_completions_only {
                    None => Some(true),
                    Some(true) => Some(false),
                    Some(false) => None,
                }
            },
        },
        Key {
            name: "data.group_by_length",
            reads: No,
            change: |c| flip(&mut c.data.group_by_length),
        },
        Key {
            name: "data.seed",
            reads: No,
            change: |c| c.data.seed += 1,
        },
        Key {
            name: "data.txt_split",
            reads: No,
            change: |c| {
                let all = [TxtSplit::Auto, TxtSplit::PerFile, TxtSplit::BlankLine];
                c.data.txt_split = next(&all, c.data.txt_split);
            },
        },
        Key {
            name: "data.allow",
            reads: No,
            change: |c| {
                if c.data.allow.pop().is_none() {
                    c.data.allow.push("labels-mismatch".into());
                }
            },
        },
        Key {
            name: "training.precision",
            reads: Yes,
            change: |c| c.training.precision = next(&Precision::ALL, c.training.precision),
        },
        Key {
            name: "training.micro_batch",
            reads: Yes,
            change: |c| c.training.micro_batch += 1,
        },
        Key {
            name: "training.gradient_accumulation",
            reads: Yes,
            change: |c| c.training.gradient_accumulation += 1,
        },
        Key {
            name: "training.epochs",
            reads: No,
            change: |c| c.training.epochs += 1,
        },
        Key {
            name: "training.max_steps",
            reads: No,
            change: |c| c.training.max_steps = c.training.max_steps.map_or(Some(10), |_| None),
        },
        Key {
            name: "training.learning_rate",
            reads: No,
            change: |c| c.training.learning_rate *= 2.0,
        },
        Key {
            name: "training.schedule",
            reads: No,
            change: |c| {
                let all = [
                    ScheduleKind::Constant,
                    ScheduleKind::Linear,
                    ScheduleKind::Cosine,
                ];
                c.training.schedule = next(&all, c.training.schedule);
            },
        },
        Key {
            name: "training.warmup_steps",
            reads: No,
            change: |c| c.training.warmup_steps += 1,
        },
        Key {
            name: "training.warmup_ratio",
            reads: No,
            change: |c| c.training.warmup_ratio += 0.01,
        },
        Key {
            name: "training.weight_decay",
            reads: No,
            change: |c| c.training.weight_decay += 0.01,
        },
        Key {
            name: "training.max_grad_norm",
            reads: No,
            change: |c| c.training.max_grad_norm += 0.5,
        },
        Key {
            name: "training.activation_checkpointing",
            reads: Yes,
            change: |c| flip(&mut c.training.activation_checkpointing),
        },
        Key {
            name: "training.optimizer_offload",
            reads: Yes,
            change: |c| {
                c.training.optimizer_offload = match c.training.optimizer_offload {
                    OptimizerOffload::None => OptimizerOffload::Host,
                    OptimizerOffload::Host => OptimizerOffload::None,
                }
            },
        },
        Key {
            name: "training.seed",
            reads: No,
            change: |c| c.training.seed += 1,
        },
        Key {
            name: "training.adam_beta1",
            reads: No,
            change: |c| c.training.adam_beta1 /= 2.0,
        },
        Key {
            name: "training.adam_beta2",
            reads: No,
            change: |c| c.training.adam_beta2 /= 2.0,
        },
        Key {
            name: "training.adam_epsilon",
            reads: No,
            change: |c| c.training.adam_epsilon *= 10.0,
        },
        Key {
            name: "training.decay_norms_and_biases",
            reads: No,
            change: |c| flip(&mut c.training.decay_norms_and_biases),
        },
        Key {
            name: "training.initial_loss_scale",
            reads: No,
            change: |c| c.training.initial_loss_scale *= 2.0,
        },
        Key {
            name: "training.loss_scale_growth_interval",
            reads: No,
            change: |c| c.training.loss_scale_growth_interval += 1,
        },
        Key {
            name: "training.on_divergence",
            reads: No,
            change: |c| {
                c.training.on_divergence = tunestudio::train::divergence::OnDivergence::Stop;
            },
        },
        Key {
            name: "lora.enabled",
            reads: Yes,
            change: |c| flip(&mut c.lora.enabled),
        },
        Key {
            name: "lora.r",
            reads: WhenLoraIsOn,
            change: |c| c.lora.r += 1,
        },
        // A scale: it allocates nothing.
        Key {
            name: "lora.alpha",
            reads: No,
            change: |c| c.lora.alpha += 1.0,
        },
        // Not modelled by the planner (a mask and a copy of each adapted input per layer).
        Key {
            name: "lora.dropout",
            reads: No,
            change: |c| c.lora.dropout = if c.lora.dropout > 0.0 { 0.0 } else { 0.1 },
        },
        Key {
            name: "lora.target_modules",
            reads: WhenLoraIsOn,
            change: |c| {
                c.lora.target_modules = if c.lora.target_modules == ["q_proj"] {
                    vec!["v_proj".into()]
                } else {
                    vec!["q_proj".into()]
                }
            },
        },
        Key {
            name: "eval.eval_every",
            reads: No,
            change: |c| c.eval.eval_every += 1,
        },
        Key {
            name: "eval.max_batches",
            reads: No,
            change: |c| c.eval.max_batches += 1,
        },
        Key {
            name: "checkpoint.save_every",
            reads: No,
            change: |c| c.checkpoint.save_every += 1,
        },
        Key {
            name: "checkpoint.keep_last",
            reads: No,
            change: |c| c.checkpoint.keep_last += 1,
        },
        Key {
            name: "checkpoint.save_final",
            reads: No,
            change: |c| flip(&mut c.checkpoint.save_final),
        },
        Key {
            name: "devices.devices",
            reads: Yes,
            change: |c| {
                if c.devices.devices.len() > 1 {
                    c.devices.devices.pop();
                } else {
                    c.devices.devices.push("cuda:7=48GiB".into());
                }
            },
        },
        Key {
            name: "devices.strategy",
            reads: Yes,
            change: |c| c.devices.strategy = next(&DeviceStrategy::ALL, c.devices.strategy),
        },
        Key {
            name: "devices.shard",
            reads: WhenSharded,
            change: |c| {
                c.devices.shard = next(&tunestudio::settings::ShardMode::ALL, c.devices.shard)
            },
        },
        // A preference step runs each pair's two rows in one batch, cut at the pair's lengths.
        Key {
            name: "training.method",
            reads: Yes,
            change: |c| {
                c.training.method = match c.training.method {
                    TrainingMethod::Sft => TrainingMethod::Dpo,
                    _ => TrainingMethod::Sft,
                }
            },
        },
        Key {
            name: "preference.max_prompt_length",
            reads: WhenPreference,
            change: |c| c.preference.max_prompt_length += 1,
        },
        Key {
            name: "preference.max_completion_length",
            reads: WhenPreference,
            change: |c| c.preference.max_completion_length += 1,
        },
        Key {
            name: "preference.loss",
            reads: No,
            change: |c| {
                c.preference.loss = match c.preference.loss {
                    DpoLoss::Sigmoid => DpoLoss::Ipo,
                    DpoLoss::Ipo => DpoLoss::Sigmoid,
                }
            },
        },
        Key {
            name: "preference.beta",
            reads: No,
            change: |c| c.preference.beta *= 2.0,
        },
        Key {
            name: "preference.label_smoothing",
            reads: No,
            change: |c| c.preference.label_smoothing += 0.1,
        },
        Key {
            name: "preference.reference",
            // Each change moves between the memory cases: stored (auto, precomputed), the
            // adapters disabled, a frozen copy.
            reads: WhenDpo,
            change: |c| {
                c.preference.reference = match c.preference.reference {
                    ReferenceMode::Auto | ReferenceMode::Precomputed => ReferenceMode::Copy,
                    ReferenceMode::Copy => ReferenceMode::AdapterDisabled,
                    ReferenceMode::AdapterDisabled => ReferenceMode::Precomputed,
                }
            },
        },
        // GRPO: G rows per prompt at the prompt + completion lengths, and a reference when
        // β > 0; the sampling knobs, clipping, aggregation and rewards cost no memory.
        Key {
            name: "grpo.num_generations",
            reads: WhenGrpo,
            change: |c| c.grpo.num_generations += 1,
        },
        Key {
            name: "grpo.max_prompt_length",
            reads: WhenGrpo,
            change: |c| c.grpo.max_prompt_length += 1,
        },
        Key {
            name: "grpo.max_completion_length",
            reads: WhenGrpo,
            change: |c| c.grpo.max_completion_length += 1,
        },
        Key {
            name: "grpo.beta",
            reads: WhenGrpo,
            change: |c| c.grpo.beta = if c.grpo.beta == 0.0 { 0.04 } else { 0.0 },
        },
        Key {
            name: "grpo.temperature",
            reads: No,
            change: |c| c.grpo.temperature *= 0.5,
        },
        Key {
            name: "grpo.top_p",
            reads: No,
            change: |c| c.grpo.top_p *= 0.5,
        },
        Key {
            name: "grpo.top_k",
            reads: No,
            change: |c| c.grpo.top_k += 1,
        },
        Key {
            name: "grpo.epsilon",
            reads: No,
            change: |c| c.grpo.epsilon *= 0.5,
        },
        Key {
            name: "grpo.epsilon_high",
            reads: No,
            change: |c| c.grpo.epsilon_high = Some(c.grpo.epsilon_high.unwrap_or(0.2) + 0.08),
        },
        Key {
            name: "grpo.loss_type",
            reads: No,
            change: |c| {
                c.grpo.loss_type = match c.grpo.loss_type {
                    GrpoLossType::Dapo => GrpoLossType::Grpo,
                    _ => GrpoLossType::Dapo,
                }
            },
        },
        Key {
            name: "grpo.scale_rewards",
            reads: No,
            change: |c| {
                c.grpo.scale_rewards = match c.grpo.scale_rewards {
                    ScaleRewards::Group => ScaleRewards::Batch,
                    _ => ScaleRewards::Group,
                }
            },
        },
        Key {
            name: "grpo.num_iterations",
            reads: No,
            change: |c| c.grpo.num_iterations += 1,
        },
        Key {
            name: "grpo.mask_truncated_completions",
            reads: No,
            change: |c| flip(&mut c.grpo.mask_truncated_completions),
        },
        Key {
            name: "grpo.generations_per_micro_step",
            reads: WhenGrpo,
            change: |c| {
                c.grpo.generations_per_micro_step = match c.grpo.generations_per_micro_step {
                    None => Some(1),
                    Some(_) => None,
                }
            },
        },
        Key {
            name: "grpo.reward",
            reads: No,
            change: |c| {
                c.grpo.reward.push(
                    toml::from_str("kind = \"format\"\npattern = \"x\"").expect("a reward entry"),
                )
            },
        },
    ]
}

/// The fields serde knows for `T` (all of them, optional ones included), from the message
/// of an unknown field: "unknown field `…`, expected one of `a`, `b`, …" (or "expected `a`
/// or `b`").
fn fields_of<T: serde::de::DeserializeOwned + std::fmt::Debug>() -> Vec<String> {
    let err = toml::from_str::<T>("__no_such_key__ = 0")
        .unwrap_err()
        .to_string();
    let line = err
        .lines()
        .find(|l| l.contains("unknown field `__no_such_key__`"))
        .unwrap_or_else(|| panic!("no field list in: {err}"));
    let expected = line.split_once(", expected ").map_or("", |(_, e)| e);
    let fields: Vec<String> = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect();
    assert!(!fields.is_empty(), "no field list in: {err}");
    fields
}

/// Every key of the run config, as dotted names.
fn run_config_keys() -> BTreeSet<String> {
    let sections: Vec<(&str, Vec<String>)> = vec![
        ("model", fields_of::<ModelSection>()),
        ("data", fields_of::<DataConfig>()),
        ("data.columns", fields_of::<ColumnMapping>()),
        ("training", fields_of::<TrainingSection>()),
        ("lora", fields_of::<LoraSection>()),
        ("eval", fields_of::<EvalSection>()),
        ("checkpoint", fields_of::<CheckpointSection>()),
        ("devices", fields_of::<DevicesSection>()),
        ("preference", fields_of::<PreferenceSection>()),
        ("grpo", fields_of::<GrpoSection>()),
    ];
    let is_section = |name: &str| sections.iter().any(|(s, _)| *s == name);
    let mut out = BTreeSet::new();
    let mut pending: Vec<String> = fields_of::<RunConfig>();
    while let Some(key) = pending.pop() {
        match sections.iter().find(|(s, _)| *s == key) {
            Some((s, fields)) => pending.extend(fields.iter().map(|f| format!("{s}.{f}"))),
            None => {
                assert!(!is_section(&key));
                out.insert(key);
            }
        }
    }
    out
}

#[test]
fn every_run_config_key_is_classified() {
    let all = run_config_keys();
    assert!(all.len() > 40, "the key list looks wrong: {all:?}");
    let listed: BTreeSet<String> = keys().iter().map(|k| k.name.to_string()).collect();
    let missing: Vec<&String> = all.difference(&listed).collect();
    let unknown: Vec<&String> = listed.difference(&all).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "tests/it/plan_request.rs must classify every run-config key as read by the planner \
         or not (see train::plan_adapter, 'How a new setting is added'): missing {missing:?}, \
         no such key {unknown:?}"
    );
}

/// A random run config the planner can plan (models from the shared model configs, sized
/// devices so no driver is asked).
fn arb_config() -> impl Strategy<Value = RunConfig> {
    let devices = prop_oneof![
        Just(vec!["cpu:64GiB".to_string()]),
        Just(vec!["cuda:0=24GiB".to_string()]),
        Just(vec!["cuda:0=80GiB".to_string(), "cuda:1=80GiB".to_string()]),
        Just(vec!["cpu:1=8GiB".to_string(), "cpu:2=8GiB".to_string()]),
    ];
    let targets = proptest::sample::subsequence(tunestudio::model::LINEAR_MODULES.to_vec(), 1..=7);
    (
        (
            0..MODELS.len(),
            0..Precision::ALL.len(),
            1..8usize,
            1..8usize,
            16..4096usize,
        ),
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            1..64usize,
            targets,
        ),
        (
            devices,
            0..DeviceStrategy::ALL.len(),
            1e-6..1e-2f64,
            any::<u64>(),
        ),
    )
        .prop_map(
            |(
                (model, precision, micro_batch, accumulation, max_length),
                (checkpointing, offload, lora, r, targets),
                (devices, strategy, lr, seed),
            )| {
                let mut c = RunConfig::default();
                c.model.source = model_source(model);
                c.training.precision = Precision::ALL[precision];
                c.training.micro_batch = micro_batch;
                c.training.gradient_accumulation = accumulation;
                c.data.max_length = max_length;
                c.training.activation_checkpointing = checkpointing;
                c.training.optimizer_offload = if offload {
                    OptimizerOffload::Host
                } else {
                    OptimizerOffload::None
                };
                c.lora.enabled = lora;
                c.lora.r = r;
                c.lora.target_modules = targets.into_iter().map(String::from).collect();
                c.devices.devices = devices;
                c.devices.strategy = DeviceStrategy::ALL[strategy];
                c.training.learning_rate = lr;
                c.training.seed = seed;
                c
            },
        )
}

/// The stale-plan rule over random configs and every key: changing a key the planner reads
/// changes the request, and changing one it does not read leaves it equal.
#[test]
fn changing_a_key_the_planner_reads_changes_the_request_and_no_other_does() {
    let keys = keys();
    let mut runner = TestRunner::new(Config {
        cases: 48,
        ..Config::default()
    });
    runner
        .run(&arb_config(), |config| {
            let before = train::local_plan_request(&config).expect("the base config plans");
            for key in &keys {
                let mut changed = config.clone();
                (key.change)(&mut changed);
                prop_assert_ne!(
                    &changed,
                    &config,
                    "{}: the change changed nothing",
                    key.name
                );
                let after = train::local_plan_request(&changed)
                    .unwrap_or_else(|e| panic!("{} changed: {e}", key.name));
                let must_differ = match key.reads {
                    Reads::Yes => true,
                    Reads::WhenLoraIsOn => config.lora.enabled,
                    Reads::WhenPreference => config.training.method.is_preference(),
                    Reads::WhenDpo => config.training.method == TrainingMethod::Dpo,
                    Reads::WhenGrpo => config.training.method.is_grpo(),
                    Reads::WhenSharded => config.devices.strategy == DeviceStrategy::Sharded,
                    Reads::ForProcess => {
                        train::process_inputs(&changed) != train::process_inputs(&config)
                    }
                    Reads::No => false,
                };
                if must_differ {
                    prop_assert_ne!(
                        &after,
                        &before,
                        "{} is read by the planner: changing it must make the plan stale",
                        key.name
                    );
                } else {
                    prop_assert_eq!(
                        &after,
                        &before,
                        "{} is not read by the planner: changing it must not replan",
                        key.name
                    );
                }
            }
            Ok(())
        })
        .unwrap();
}

/// The front ends agree: what `tunestudio plan --config` (the real binary) reads from a saved
/// run config is the request the trainer's pre-flight makes for the same config, setting by
/// setting, and it plans the same peaks.
#[test]
fn the_cli_reading_and_the_trainer_make_the_same_request() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = RunConfig::default();
    config.model.source = model_source(2);
    config.training.precision = Precision::Bf16Mixed;
    config.training.micro_batch = 3;
    config.data.max_length = 700;
    config.lora.enabled = true;
    config.lora.r = 4;
    config.devices.devices = vec!["cuda:0=40GiB".into(), "cuda:1=40GiB".into()];
    config.devices.strategy = DeviceStrategy::LayerSplit;
    config.base_dir = dir.path().to_path_buf();
    let text = config.to_toml_string().unwrap();
    let (read, ignored) = train::read_run_config_leniently(&text, "run.toml", dir.path()).unwrap();
    assert!(ignored.is_empty(), "{ignored:?}");
    assert_eq!(read, config);

    let path = dir.path().join("run.toml");
    std::fs::write(&path, &text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["plan", "--json", "--config"])
        .arg(&path)
        .env_remove("TUNESTUDIO_OPS")
        .output()
        .unwrap();
    assert!(
        out.status.code().is_some_and(|c| c == 0 || c == 2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cli: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let trainer = train::local_plan_request(&config).unwrap();
    let r = &cli["request"];
    for (key, expected) in [
        ("precision", json(&trainer.precision)),
        ("micro_batch", json(&trainer.micro_batch)),
        (
            "gradient_accumulation",
            json(&trainer.gradient_accumulation),
        ),
        ("seq_len", json(&trainer.seq_len)),
        (
            "activation_checkpointing",
            json(&trainer.activation_checkpointing),
        ),
        ("optimizer_offload", json(&trainer.optimizer_offload)),
        ("lora", json(&trainer.lora)),
        ("strategy", json(&trainer.strategy)),
        ("devices", json(&trainer.devices)),
    ] {
        assert_eq!(r[key], expected, "{key}: the CLI read {} ", r[key]);
    }
    let peaks = |p: &serde_json::Value| -> Vec<u64> {
        p["per_device"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["peak_bytes"].as_u64().unwrap())
            .collect()
    };
    let planned = serde_json::to_value(tunestudio::plan::plan(&trainer).unwrap()).unwrap();
    assert_eq!(peaks(&cli["plan"]), peaks(&planned));
}

/// A setting without a flag of its own (a new one, say) is planned through `--set`: the plan
/// of a run config with `--set grpo.num_generations=4` is the plan of the same file with that
/// key written in it, and a key the run config does not have stops the command by name.
#[test]
fn a_setting_without_a_flag_plans_through_set_as_written_in_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = RunConfig::default();
    config.model.source = model_source(0);
    config.training.method = TrainingMethod::Grpo;
    config.devices.devices = vec!["cuda:0=24GiB".into()];
    config.base_dir = dir.path().to_path_buf();
    let base = dir.path().join("base.toml");
    std::fs::write(&base, config.to_toml_string().unwrap()).unwrap();
    config.grpo.num_generations = 4;
    let written = dir.path().join("written.toml");
    std::fs::write(&written, config.to_toml_string().unwrap()).unwrap();

    let plan_json = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["plan", "--json"])
            .args(args)
            .env_remove("TUNESTUDIO_OPS")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let value = serde_json::from_slice::<serde_json::Value>(&out.stdout).ok();
        (out.status.code(), value.map(|v| v["plan"].clone()), stderr)
    };
    let path = |p: &std::path::Path| p.display().to_string();
    let (_, from_file, e) = plan_json(&["--config", &path(&written)]);
    let from_file = from_file.unwrap_or_else(|| panic!("{e}"));
    let (_, from_set, e) =
        plan_json(&["--config", &path(&base), "--set", "grpo.num_generations=4"]);
    let from_set = from_set.unwrap_or_else(|| panic!("{e}"));
    assert!(
        from_set == from_file,
        "--set planned {} where the file plans {}",
        from_set["settings"],
        from_file["settings"]
    );
    let (_, unset, _) = plan_json(&["--config", &path(&base)]);
    assert!(
        unset.unwrap() != from_file,
        "G 4 must plan otherwise than the default G 8"
    );

    let (code, _, stderr) =
        plan_json(&["--config", &path(&base), "--set", "grpo.num_generation=8"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("--set grpo.num_generation=8") && stderr.contains("num_generations"),
        "the error names the --set and the keys there are: {stderr}"
    );
}

/// A request field as JSON, as the CLI writes it.
fn json<T: serde::Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap()
}

/// Every kind of fix, with the values the planner proposes (and the others a front end may
/// write), for the config `req` was made from. The match in `kind` makes a new kind of fix
/// fail to compile here until it is listed.
fn every_change(
    config: &RunConfig,
    req: &tunestudio::plan::PlanRequest,
) -> Vec<tunestudio::plan::Change> {
    use tunestudio::plan::{Change, LoraSpec, ReferencePlan};
    let rows = req.head_loss.rows_per_sample();
    let mut out: Vec<Change> = DeviceStrategy::ALL
        .iter()
        .map(|s| Change::Strategy(*s))
        .collect();
    out.extend(tunestudio::settings::ShardMode::ALL.map(Change::Shard));
    out.extend(Precision::ALL.iter().map(|p| Change::Precision(*p)));
    out.push(Change::ActivationCheckpointing);
    out.push(Change::MicroBatch {
        micro_batch: rows,
        gradient_accumulation: req.gradient_accumulation * (req.micro_batch / rows),
    });
    out.push(Change::Lora(LoraSpec::all_linear(16)));
    out.push(Change::SeqLen((req.seq_len / 2).max(2)));
    out.push(Change::OptimizerOffload);
    out.extend([Quantization::Q4K, Quantization::Q8_0].map(Change::Quantize));
    // A reference is a DPO run's only (SFT and ORPO have none to switch).
    if config.training.method == TrainingMethod::Dpo {
        out.push(Change::Reference(ReferencePlan::Stored));
        out.push(Change::Reference(if req.lora.is_some() {
            ReferencePlan::AdapterDisabled
        } else {
            ReferencePlan::Copy
        }));
    }
    // Generations per pass are a GRPO run's only: one a pass, and half the group.
    if config.training.method.is_grpo() {
        out.push(Change::GenerationsPerMicroStep(1));
        if config.grpo.num_generations.is_multiple_of(2) {
            out.push(Change::GenerationsPerMicroStep(
                config.grpo.num_generations / 2,
            ));
        }
    }
    let kinds: BTreeSet<usize> = out.iter().map(kind).collect();
    let expected =
        if config.training.method == TrainingMethod::Dpo || config.training.method.is_grpo() {
            10
        } else {
            9
        };
    assert_eq!(kinds.len(), expected, "every kind of fix is listed");
    out
}

fn kind(c: &tunestudio::plan::Change) -> usize {
    use tunestudio::plan::Change;
    match c {
        Change::Strategy(_) => 0,
        Change::Precision(_) => 1,
        Change::ActivationCheckpointing => 2,
        Change::MicroBatch { .. } => 3,
        Change::Lora(_) => 4,
        Change::SeqLen(_) => 5,
        Change::OptimizerOffload => 6,
        Change::Quantize(_) => 7,
        Change::Reference(_) => 8,
        Change::Shard(_) => 9,
        Change::GenerationsPerMicroStep(_) => 10,
    }
}

/// The one edit back (issue #39 item 3): for random configs (SFT, DPO with each reference,
/// ORPO) and every kind of fix, the fix written into the run config
/// (`train::apply_fix`) plans as the fix itself, and adds no problem of the settings it writes
/// (LoRA with a `copy` reference, a quantized base without LoRA, a dtype against the
/// precision).
#[test]
fn every_fix_written_into_the_run_config_plans_as_the_fix() {
    let methods = (0..5usize, any::<bool>(), any::<bool>());
    let mut runner = TestRunner::new(Config {
        cases: 32,
        ..Config::default()
    });
    runner
        .run(
            &(arb_config(), methods),
            |(mut config, (method, q8, f32_dtype))| {
                // GRPO's shorter-completion fix writes `[grpo] max_completion_length`.
                config.training.method = [
                    TrainingMethod::Sft,
                    TrainingMethod::Dpo,
                    TrainingMethod::Orpo,
                    TrainingMethod::Sft,
                    TrainingMethod::Grpo,
                ][method];
                config.preference.reference = match (method, config.lora.enabled) {
                    (3, _) => ReferenceMode::Auto,
                    (_, true) => ReferenceMode::AdapterDisabled,
                    (_, false) => ReferenceMode::Copy,
                };
                if q8 && config.lora.enabled {
                    config.model.quantize = Quantization::Q8_0;
                }
                if f32_dtype {
                    config.training.precision = Precision::Fp32;
                    config.model.dtype = ModelDtype::F32;
                }
                let req = train::local_plan_request(&config).expect("the config plans");
                let guarded = ["preference.reference", "model.quantize", "model.dtype"];
                let problems = |c: &RunConfig| -> BTreeSet<String> {
                    c.validate()
                        .into_iter()
                        .map(|p| p.field)
                        .filter(|f| guarded.contains(&f.as_str()))
                        .collect()
                };
                let before = problems(&config);
                for change in every_change(&config, &req) {
                    let expected = change.apply(&req);
                    let mut edited = config.clone();
                    train::apply_fix(&mut edited, &req, &change);
                    let planned =
                        train::local_plan_request(&edited).expect("the edited config plans");
                    prop_assert_eq!(
                        &planned,
                        &expected,
                        "{:?} written into the run config",
                        change
                    );
                    let added: Vec<String> =
                        problems(&edited).difference(&before).cloned().collect();
                    prop_assert!(added.is_empty(), "{:?} added {:?}", change, added);
                }
                Ok(())
            },
        )
        .unwrap();
}

/// Issue #40's ranked fix: a DPO full fine-tune with a frozen `copy` as its reference that
/// does not fit, on a device where the same run with a precomputed reference does. The plan
/// ranks the switch as a fix that fits alone, `tunestudio plan --config` shows it, auto-fit
/// makes it (and nothing that changes what is learned), and the run config it edits plans to
/// fit.
#[test]
fn auto_fit_switches_a_dpo_copy_reference_to_precomputed() {
    use tunestudio::plan::{Change, ReferencePlan};
    let mut config = RunConfig::default();
    config.model.source = model_source(0);
    config.training.method = TrainingMethod::Dpo;
    config.training.activation_checkpointing = true;
    config.preference.reference = ReferenceMode::Copy;
    config.preference.max_prompt_length = 128;
    config.preference.max_completion_length = 128;
    let peak = |c: &RunConfig| {
        let p = tunestudio::plan::plan(&train::local_plan_request(c).unwrap()).unwrap();
        p.per_device[0].peak_bytes
    };
    config.devices.devices = vec!["cuda:0=80GiB".into()];
    let mut precomputed = config.clone();
    precomputed.preference.reference = ReferenceMode::Precomputed;
    let (copy_peak, stored_peak) = (peak(&config), peak(&precomputed));
    assert!(stored_peak < copy_peak, "{stored_peak} vs {copy_peak}");
    // Room for the precomputed run with 7 % headroom, short of the copy.
    let capacity_mib = (stored_peak as f64 / 0.93 / (1 << 20) as f64).ceil() as u64;
    assert!(capacity_mib << 20 < copy_peak, "the copy must not fit");
    config.devices.devices = vec![format!("cuda:0={capacity_mib}MiB")];

    let req = train::local_plan_request(&config).unwrap();
    let plan = tunestudio::plan::plan(&req).unwrap();
    assert!(!plan.fits());
    let fix = plan
        .fixes
        .iter()
        .find(|f| f.change == Change::Reference(ReferencePlan::Stored))
        .unwrap_or_else(|| panic!("no reference fix in {:#?}", plan.fixes));
    assert!(fix.fits_alone, "{}", fix.description);
    assert!(
        fix.description.contains("precomputed"),
        "{}",
        fix.description
    );

    let fit = tunestudio::plan::auto_fit(&req).unwrap();
    assert!(fit.found, "{:?}", fit.changes);
    assert!(
        fit.steps
            .contains(&Change::Reference(ReferencePlan::Stored)),
        "{:?}",
        fit.changes
    );
    assert_eq!(fit.request.lora, None, "{:?}", fit.changes);
    assert_eq!(fit.request.precision, req.precision, "{:?}", fit.changes);
    let mut edited = config.clone();
    train::apply_plan_request(&mut edited, &fit.request);
    assert_eq!(edited.preference.reference, ReferenceMode::Precomputed);
    let replanned = train::local_plan_request(&edited).unwrap();
    assert_eq!(replanned, fit.request);
    assert!(tunestudio::plan::plan(&replanned).unwrap().fits());

    // `tunestudio plan --config` lists the fix with the key it sets.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(&path, config.to_toml_string().unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["plan", "--config"])
        .arg(&path)
        .env_remove("TUNESTUDIO_OPS")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(
        stdout.contains("preference.reference = \"precomputed\""),
        "{stdout}"
    );
}
