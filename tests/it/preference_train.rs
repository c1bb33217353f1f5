//! Preference training through the trainer (`[training] method = "dpo" | "orpo"`): the
//! step's gradient and loss trajectory against `fixtures/tiny-llama-dpo` (transformers + TRL's
//! formulas, full fine-tuning, reference frozen = the model as loaded), within 1e-5, and a run
//! of the real CLI whose rewards accuracy and margin rise.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use tunestudio::train::{RunConfig, TrainingMethod, TrainingRun};

use super::data_support::{dataset, tiny_llama_dir};

fn fixture() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        tunestudio::paths::shared_dir().join("fixtures/tiny-llama-dpo/reference.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap()
}

/// The fixture's three pairs (the first three single-turn rows of `dpo_en_demo.json` whose
/// prompt is at most 40 tokens) as a dataset file of their own, in the file's own format.
fn fixture_pairs_file(dir: &Path) -> std::path::PathBuf {
    let tok = super::data_support::tiny_llama();
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dataset("dpo_en_demo.json")).unwrap())
            .unwrap();
    let picked: Vec<serde_json::Value> = super::preference_data::fixture_pairs(&tok)
        .iter()
        .map(|p| rows[p.row].clone())
        .collect();
    assert_eq!(picked.len(), 3);
    let path = dir.join("pairs.json");
    std::fs::write(&path, serde_json::to_string(&picked).unwrap()).unwrap();
    path
}

/// Full fine-tuning of tiny-llama with DPO on the fixture's pairs, as the fixture made it:
/// one batch of the three pairs a step, completions cut at 16 tokens, AdamW(lr 1e-3, betas
/// 0.9/0.999, eps 1e-8, no decay), no clipping, β = 0.1.
fn fixture_config(dir: &Path) -> RunConfig {
    let mut c = super::train_common::tiny_config(&dir.join("out"), 3);
    c.model.source = tiny_llama_dir().display().to_string();
    c.data = tunestudio::data::DataConfig::new(fixture_pairs_file(dir).display().to_string());
    c.data.validation_ratio = 0.0;
    c.data.allow = vec!["learning-rate".into()];
    c.training.method = TrainingMethod::Dpo;
    c.training.micro_batch = 3;
    c.training.max_grad_norm = 0.0;
    c.training.weight_decay = 0.0;
    c.preference.max_prompt_length = 512;
    c.preference.max_completion_length = 16;
    c.preference.beta = 0.1;
    c
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&a.sub(b).unwrap())
}

/// The same DPO steps computed directly on the model (no trainer): the fixture's batch, the
/// mean sigmoid loss against the frozen start's log-probabilities, `CausalLm::backward` and
/// tunestudio's AdamW. Returns the step-0 gradients and the three losses.
fn model_level_dpo() -> (HashMap<String, Tensor>, Vec<f64>) {
    use tunestudio::model::preference::{
        preference_loss, sequence_logps, PairLogps, PreferenceLossKind,
    };
    use tunestudio::model::{AdamW, AdamWConfig, CausalLm};
    let r = fixture();
    let cat = |k: &str| {
        Tensor::cat(
            &[&r[&format!("chosen.{k}")], &r[&format!("rejected.{k}")]],
            0,
        )
        .unwrap()
    };
    let (ids, mask, labels) = (cat("input_ids"), cat("attention_mask"), cat("labels"));
    let model = CausalLm::load(
        &tiny_llama_dir(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let logps = |m: &CausalLm| {
        let logits = m.logits(&ids, Some(&mask)).unwrap();
        PairLogps::from_concatenated(&sequence_logps(&logits, &labels).unwrap()).unwrap()
    };
    let reference = logps(&model).detach();
    let cfg = AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decay_norms_and_biases: false,
    };
    let mut opt = AdamW::new(model.params(), cfg, false).unwrap();
    let (mut first, mut losses) = (HashMap::new(), Vec::new());
    for step in 0..3 {
        let kind = PreferenceLossKind::DpoSigmoid {
            label_smoothing: 0.0,
        };
        let loss = preference_loss(kind, &logps(&model), Some(&reference), 0.1).unwrap();
        losses.push(f64::from(loss.loss.to_scalar::<f32>().unwrap()));
        let grads = model.backward(&loss.loss).unwrap();
        if step == 0 {
            first = grads
                .iter()
                .map(|(n, g)| (n.to_string(), g.clone()))
                .collect();
        }
        opt.step(&grads, 1e-3, 1.0).unwrap();
    }
    (first, losses)
}

/// The largest difference of two loss trajectories.
fn worst(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Step 0 through the trainer (the pairs read from a file, tokenized, collated with the
/// trainer's padding, the reference precomputed, the loss summed over pairs and divided by
/// them): the policy is its own reference, so the loss is ln 2, and the gradient of every
/// parameter is the model-level gradient and transformers' (`full.step0.grad`, every
/// parameter under 1M elements), each within 1e-5 of its largest magnitude.
///
/// At step 0 every margin is exactly 0, where `log σ` has its kink in the overflow-safe form
/// `min(x, 0) − log(1 + e^{−|x|})`. Candle's subgradients there (`minimum` splits a tie, ½;
/// `abs` takes +1, so the second term gave another ½) made the derivative 1 instead of
/// σ(0) = ½: every gradient came out exactly 2.000× the fixture's, while the LoRA case, whose
/// margins are not 0, matched. `log_sigmoid` now writes `min(x, 0)` as `(x − |x|)/2`, whose
/// derivative at 0 is ½ whatever `abs`'s subgradient.
#[test]
fn the_dpo_step_gradient_is_the_model_level_gradient() {
    let tmp = tempfile::tempdir().unwrap();
    let mut run = TrainingRun::new(fixture_config(tmp.path())).unwrap();
    let g = run.preview_gradients().unwrap();
    assert_eq!(g.tokens, 3, "the step counts its pairs");
    assert!(
        (g.loss - std::f64::consts::LN_2).abs() < 1e-6,
        "step-0 loss {} (ln 2 expected)",
        g.loss
    );
    let (direct, _) = model_level_dpo();
    assert_eq!(g.grads.len(), direct.len());
    for (name, want) in &direct {
        let got = &g.grads[name];
        let (d, scale) = (max_diff(got, want), max_abs(want));
        assert!(
            d <= 1e-5 * scale.max(1e-12),
            "{name}: differs by {d} (max |g| {scale})"
        );
    }
    let r = fixture();
    let mut checked = 0;
    let mut worst_rel = 0f32;
    for (key, want) in &r {
        let Some(param) = key.strip_prefix("full.step0.grad.") else {
            continue;
        };
        let got = &g.grads[param];
        let (d, scale) = (max_diff(got, want), max_abs(want));
        assert!(
            d <= 1e-5 * scale.max(1e-12),
            "{param}: differs from transformers' by {d} (max |g| {scale}, ratio of the \
             largest {})",
            max_abs(got) / scale
        );
        worst_rel = worst_rel.max(d / scale.max(1e-12));
        checked += 1;
    }
    assert!(checked >= 19, "{checked} gradients checked");
    println!("{checked} gradients within {worst_rel:.2e} of transformers' (relative)");
}

/// Three optimizer steps through the trainer give the model-level losses and transformers'
/// (`full.dpo_sigmoid_losses`: 0.693147, 0.512387, 0.404019), each within 1e-5.
///
/// Two things made them differ (0.69315, 0.51326, 0.41914 before). The doubled step-0 gradient
/// (see the test above) weighed step 0 twice in AdamW's moments, which moved the third loss
/// (alone it left 0.51327, 0.40456). The second loss needed transformers' `padding_idx`:
/// Llama builds `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`, whose lookups of the
/// pad token give its row no gradient. tiny-llama's pad is `<|im_end|>` (id 2, = eos), a real
/// token of every ChatML prompt, so transformers' tied embedding row 2 gets only the head's
/// gradient; with the lookups' part as well, AdamW's first (sign-like) step on that row made
/// the second loss 0.51327. Dropping it (`CausalLm` now does, on both embedding paths) gives
/// 0.5123864, 0.4040194 against 0.5123868, 0.4040194.
#[test]
fn the_dpo_loss_trajectory_is_the_model_level_one() {
    let tmp = tempfile::tempdir().unwrap();
    let mut run = TrainingRun::new(fixture_config(tmp.path())).unwrap();
    let (_, direct) = model_level_dpo();
    let fixture_losses = fixture()["full.dpo_sigmoid_losses"]
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..3 {
        let o = run.step().unwrap();
        let m = o.preference.expect("TRL's metrics");
        assert_eq!(m.pairs, 3);
        got.push(o.loss);
    }
    println!("trainer {got:?}, model level {direct:?}, transformers {fixture_losses:?}");
    assert!(worst(&got, &direct) <= 1e-5, "{got:?} vs {direct:?}");
    assert!(
        worst(&got, &fixture_losses) <= 1e-5,
        "{got:?} vs the fixture's {fixture_losses:?}"
    );
    assert!(
        worst(&direct, &fixture_losses) <= 1e-5,
        "model level {direct:?} vs the fixture's {fixture_losses:?}"
    );
}

/// `tunestudio train` with DPO and LoRA on 12 pairs of `dpo_en_demo.json` (tiny-llama, short
/// cuts so it runs in seconds): the reward accuracy and margin rise as the adapter learns the
/// pairs, TRL's metrics are in `metrics.jsonl` and on the progress lines.
#[test]
fn dpo_with_lora_through_the_cli_raises_the_reward_margin() {
    let tmp = tempfile::tempdir().unwrap();
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dataset("dpo_en_demo.json")).unwrap())
            .unwrap();
    let data = tmp.path().join("pairs.json");
    std::fs::write(&data, serde_json::to_string(&rows[..12]).unwrap()).unwrap();
    let out = tmp.path().join("out");
    let config = format!(
        r#"output_dir = {out:?}
[model]
source = {model:?}
[data]
path = {data:?}
validation_ratio = 0.0
allow = ["learning-rate", "pair-completion-truncated", "pair-prompt-truncated"]
[training]
method = "dpo"
micro_batch = 4
max_steps = 24
learning_rate = 0.01
schedule = "constant"
seed = 0
[preference]
max_prompt_length = 48
max_completion_length = 24
[lora]
enabled = true
r = 8
alpha = 16
[checkpoint]
save_every = 0
save_final = false
[devices]
devices = ["cpu"]
"#,
        out = out.display().to_string(),
        model = tiny_llama_dir().display().to_string(),
        data = data.display().to_string(),
    );
    let path = tmp.path().join("run.toml");
    std::fs::write(&path, config).unwrap();
    let result = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "{stderr}");
    let printed = format!("{}{stderr}", String::from_utf8_lossy(&result.stdout));
    assert!(
        printed.contains("  acc ") && printed.contains("  margin "),
        "the progress lines show the rewards: {printed}"
    );
    let events = tunestudio::train::read_metrics(&out).unwrap();
    let steps: Vec<HashMap<String, f64>> = events
        .iter()
        .filter_map(|e| match e {
            tunestudio::train::Event::Step { metrics, .. } => {
                Some(metrics.iter().map(|(k, v)| (k.clone(), *v)).collect())
            }
            _ => None,
        })
        .collect();
    assert_eq!(steps.len(), 24);
    let mean = |range: std::ops::Range<usize>, key: &str| {
        steps[range.clone()].iter().map(|m| m[key]).sum::<f64>() / range.len() as f64
    };
    let (early_margin, late_margin) = (
        mean(0..6, "rewards/margins"),
        mean(18..24, "rewards/margins"),
    );
    let (early_acc, late_acc) = (
        mean(0..6, "rewards/accuracies"),
        mean(18..24, "rewards/accuracies"),
    );
    println!(
        "margin {early_margin:.4} → {late_margin:.4}, accuracy {early_acc:.2} → {late_acc:.2}"
    );
    assert!(
        late_margin > early_margin + 0.05,
        "margin {early_margin} → {late_margin}"
    );
    assert!(
        late_acc > early_acc && late_acc >= 0.75,
        "accuracy {early_acc} → {late_acc}"
    );
    for key in [
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
    ] {
        assert!(steps[0].contains_key(key), "{key} in {:?}", steps[0]);
    }
}

/// A pair lint at error level stops a DPO run before the weights load, as the SFT lints do
/// (exit 2), and `--allow-lint` lets it through.
#[test]
fn an_identical_pair_stops_a_dpo_run_unless_allowed() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = serde_json::json!([
        {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "Hi!"},
        {"prompt": "Say bye.", "chosen": "Bye!", "rejected": "No."},
    ]);
    let data = tmp.path().join("identical.json");
    std::fs::write(&data, rows.to_string()).unwrap();
    let mut c = fixture_config(tmp.path());
    c.data = tunestudio::data::DataConfig::new(data.display().to_string());
    c.data.validation_ratio = 0.0;
    c.data.allow = vec!["learning-rate".into()];
    c.training.micro_batch = 2;
    c.training.max_steps = Some(1);
    let path = tmp.path().join("run.toml");
    c.save(&path).unwrap();
    let run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
            .args(["train", "--config"])
            .arg(&path)
            .args(extra)
            .output()
            .unwrap()
    };
    let stopped = run(&[]);
    let stderr = String::from_utf8_lossy(&stopped.stderr);
    assert_eq!(stopped.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("pair-identical"),
        "the lint is named: {stderr}"
    );
    let allowed = run(&["--allow-lint", "pair-identical"]);
    assert!(
        allowed.status.success(),
        "{}",
        String::from_utf8_lossy(&allowed.stderr)
    );
}

/// Three steps of `fixture_config` with `[preference] reference = mode` (after `tweak`): the
/// losses and the first step's TRL metrics.
fn three_steps(
    dir: &Path,
    mode: tunestudio::train::ReferenceMode,
    tweak: impl Fn(&mut RunConfig),
) -> (Vec<f64>, tunestudio::model::preference::PreferenceMetrics) {
    std::fs::create_dir_all(dir).unwrap();
    let mut c = fixture_config(dir);
    c.preference.reference = mode;
    tweak(&mut c);
    let mut run = TrainingRun::new(c).unwrap();
    let mut losses = Vec::new();
    let mut first = None;
    for _ in 0..3 {
        let o = run.step().unwrap();
        first.get_or_insert(o.preference.expect("TRL's metrics"));
        losses.push(o.loss);
    }
    (losses, first.unwrap())
}

/// LoRA on the fixture's pairs (r 8, no dropout), a rate at which the adapter moves.
fn with_lora(c: &mut RunConfig) {
    c.lora.enabled = true;
    c.lora.r = 8;
    c.lora.alpha = 16.0;
    c.lora.dropout = 0.0;
    c.lora.target_modules = vec!["all-linear".into()];
    c.training.learning_rate = 0.05;
}

/// The policy with its adapters switched off is the base, exactly, whatever the adapters
/// hold; the switch is a flag (restored afterwards), on the native and the generic layers.
#[test]
fn disabling_the_adapters_gives_the_base_exactly() {
    use tunestudio::model::preference::model_sequence_logps;
    use tunestudio::model::{CausalLm, LoraConfig};
    let r = fixture();
    let cat = |k: &str| {
        Tensor::cat(
            &[&r[&format!("chosen.{k}")], &r[&format!("rejected.{k}")]],
            0,
        )
        .unwrap()
    };
    let (ids, mask, labels) = (cat("input_ids"), cat("attention_mask"), cat("labels"));
    let load = || {
        CausalLm::load(
            &tiny_llama_dir(),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap()
    };
    let logps = |m: &CausalLm| {
        model_sequence_logps(m, &ids, Some(&mask), &labels, false)
            .unwrap()
            .sum
    };
    let base = logps(&load());
    let mut model = load();
    model
        .apply_lora(
            &LoraConfig {
                r: 8,
                alpha: 16.0,
                dropout: 0.0,
                target_modules: vec!["all-linear".into()],
            },
            0,
        )
        .unwrap();
    // A trained adapter: every B factor non-zero.
    for p in model.params().iter().filter(|p| p.name.contains("lora_B")) {
        let t = (p.var.as_tensor().ones_like().unwrap() * 0.05).unwrap();
        p.var.set(&t).unwrap();
    }
    let adapted = logps(&model);
    assert!(
        max_diff(&adapted, &base) > 1e-2,
        "the adapter changes the model"
    );
    let off = model.without_adapters(|m| {
        assert!(!m.adapters_enabled());
        logps(m)
    });
    assert!(model.adapters_enabled(), "the switch is restored");
    assert_eq!(max_diff(&off, &base), 0.0, "{off} vs {base}");
    assert_eq!(max_diff(&logps(&model), &adapted), 0.0);
}

/// `reference = "adapter-disabled"` with LoRA: at step 0 (a fresh adapter adds nothing) its
/// reference is the precomputed one exactly, so the first step's loss and rewards are the
/// same numbers; after the adapter has trained the reference is still the base's, so three
/// steps give the precomputed run's losses within 1e-5 (had the reference followed the
/// adapter, every margin would stay 0 and the loss ln 2).
#[test]
fn the_adapter_disabled_reference_is_the_base_as_the_adapter_trains() {
    use tunestudio::train::ReferenceMode;
    let tmp = tempfile::tempdir().unwrap();
    let (pre, pre0) = three_steps(
        &tmp.path().join("pre"),
        ReferenceMode::Precomputed,
        with_lora,
    );
    let (off, off0) = three_steps(
        &tmp.path().join("off"),
        ReferenceMode::AdapterDisabled,
        with_lora,
    );
    println!(
        "precomputed {pre:?}, adapter-disabled {off:?}: worst {:.3e}",
        worst(&pre, &off)
    );
    assert_eq!(pre[0], off[0], "step 0: the same reference");
    assert_eq!(pre0.rewards_chosen, off0.rewards_chosen);
    assert!(
        (pre[2] - std::f64::consts::LN_2).abs() > 1e-3,
        "the adapter trains: {pre:?}"
    );
    assert!(worst(&pre, &off) <= 1e-5, "{pre:?} vs {off:?}");
}

/// `reference = "copy"` on the fixture's full fine-tuning case: a frozen copy of the starting
/// weights gives the precomputed run's losses and transformers' (`full.dpo_sigmoid_losses`)
/// within 1e-5 over three AdamW steps (had the copy followed the policy, the loss would stay
/// ln 2). `adapter-disabled` without LoRA and `copy` with LoRA are refused with the fix.
#[test]
fn the_copy_reference_is_the_frozen_start_under_full_fine_tuning() {
    use tunestudio::train::ReferenceMode;
    let tmp = tempfile::tempdir().unwrap();
    let (pre, _) = three_steps(&tmp.path().join("pre"), ReferenceMode::Precomputed, |_| {});
    let (copy, _) = three_steps(&tmp.path().join("copy"), ReferenceMode::Copy, |_| {});
    let fixture_losses = fixture()["full.dpo_sigmoid_losses"]
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    println!(
        "precomputed {pre:?}, copy {copy:?}: worst {:.3e}, vs transformers {:.3e}",
        worst(&pre, &copy),
        worst(&copy, &fixture_losses)
    );
    assert!(worst(&pre, &copy) <= 1e-5, "{pre:?} vs {copy:?}");
    assert!(worst(&copy, &fixture_losses) <= 1e-5, "{copy:?}");

    let mut c = fixture_config(tmp.path());
    c.preference.reference = ReferenceMode::AdapterDisabled;
    let message: String = c.validate().iter().map(|p| p.to_string()).collect();
    assert!(
        message.contains("lora] enabled = true") && message.contains("\"copy\""),
        "{message}"
    );
    with_lora(&mut c);
    c.preference.reference = ReferenceMode::Copy;
    let message: String = c.validate().iter().map(|p| p.to_string()).collect();
    assert!(message.contains("\"adapter-disabled\""), "{message}");
}

/// DPO on 12 pairs of `dpo_en_demo.json` (tiny-llama, short cuts), accumulation 2, 4 steps, on
/// `devices` under `strategy`: LoRA with the adapters-disabled reference, or full fine-tuning
/// with the frozen copy.
pub(super) fn multi_device_config(
    dir: &Path,
    lora: bool,
    micro_batch: usize,
    devices: &[&str],
    strategy: tunestudio::settings::Strategy,
) -> RunConfig {
    use tunestudio::train::ReferenceMode;
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dataset("dpo_en_demo.json")).unwrap())
            .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let data = dir.join("pairs.json");
    std::fs::write(&data, serde_json::to_string(&rows[..12]).unwrap()).unwrap();
    let mut c = super::train_common::tiny_config(&dir.join("out"), 4);
    c.model.source = tiny_llama_dir().display().to_string();
    c.data = tunestudio::data::DataConfig::new(data.display().to_string());
    c.data.validation_ratio = 0.0;
    c.data.allow = vec![
        "learning-rate".into(),
        "pair-completion-truncated".into(),
        "pair-prompt-truncated".into(),
    ];
    c.training.method = TrainingMethod::Dpo;
    c.training.micro_batch = micro_batch;
    c.training.gradient_accumulation = 2;
    c.preference.max_prompt_length = 48;
    c.preference.max_completion_length = 24;
    if lora {
        with_lora(&mut c);
        c.training.learning_rate = 0.01;
        c.preference.reference = ReferenceMode::AdapterDisabled;
    } else {
        c.preference.reference = ReferenceMode::Copy;
    }
    c.devices.devices = devices.iter().map(|d| d.to_string()).collect();
    c.devices.strategy = strategy;
    c
}

/// `tunestudio train` on `config` with `TUNESTUDIO_OPS=ops`: each step's loss, the ranks and
/// the devices the layers were placed on.
fn cli_losses(config: &RunConfig, ops: &str) -> (Vec<f64>, usize, usize) {
    let path = config.output_dir.with_extension("toml");
    config.clone().with_absolute_paths().save(&path).unwrap();
    let result = std::process::Command::new(env!("CARGO_BIN_EXE_tunestudio"))
        .args(["train", "--config"])
        .arg(&path)
        .env(tunestudio::model::OPS_ENV, ops)
        .output()
        .unwrap();
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let (mut losses, mut ranks, mut stages) = (Vec::new(), 0, 0);
    for e in tunestudio::train::read_metrics(&config.output_dir).unwrap() {
        match e {
            tunestudio::train::Event::Step { loss, .. } => losses.push(loss),
            tunestudio::train::Event::Started {
                ranks: r,
                placement,
                ..
            } => (ranks, stages) = (r, placement.len()),
            _ => {}
        }
    }
    (losses, ranks, stages)
}

/// DPO through `tunestudio train` over `cpu:0,cpu:1`, accumulation 2, on both ops paths: data
/// parallel (each rank takes 2 whole pairs a micro-batch, its own reference) and a layer
/// split (the pairs' batch through both stages) give one device's losses within 1e-5 — with
/// LoRA and the adapters-disabled reference, and with full fine-tuning and a frozen copy per
/// rank.
#[test]
fn dpo_on_two_devices_trains_like_one_device() {
    use tunestudio::settings::Strategy;
    let tmp = tempfile::tempdir().unwrap();
    for ops in ["native", "generic"] {
        for lora in [true, false] {
            let case = format!("{ops}-{}", if lora { "lora" } else { "full" });
            let (one, _, _) = cli_losses(
                &multi_device_config(
                    &tmp.path().join(format!("one-{case}")),
                    lora,
                    4,
                    &["cpu"],
                    Strategy::Single,
                ),
                ops,
            );
            assert_eq!(one.len(), 4, "{one:?}");
            for (strategy, micro_batch) in [(Strategy::DataParallel, 2), (Strategy::LayerSplit, 4)]
            {
                let dir = tmp.path().join(format!("{strategy:?}-{case}"));
                let c = multi_device_config(&dir, lora, micro_batch, &["cpu:0", "cpu:1"], strategy);
                let (got, ranks, stages) = cli_losses(&c, ops);
                assert_eq!(stages, 2, "{strategy:?}: both devices hold layers");
                assert_eq!(
                    ranks,
                    if strategy == Strategy::DataParallel {
                        2
                    } else {
                        1
                    }
                );
                println!(
                    "{case} {strategy:?}: {got:?} vs one device {one:?}: worst {:.3e}",
                    worst(&one, &got)
                );
                assert!(
                    worst(&one, &got) <= 1e-5,
                    "{case} {strategy:?}: {got:?} vs {one:?}"
                );
            }
        }
    }
}

/// DPO under sharded data parallel (ZeRO-2 and ZeRO-3) over `cpu:0,cpu:1`, accumulation 4:
/// full fine-tuning with a frozen reference copy per rank and LoRA with the adapters switched
/// off, on both ops paths, each step's loss one device's within 1e-6 (measured: 3.9e-7 at
/// worst under ZeRO-2).
#[test]
fn dpo_sharded_over_two_devices_trains_like_one_device() {
    use tunestudio::settings::{ShardMode, Strategy};
    let tmp = tempfile::tempdir().unwrap();
    for (ops, lora) in [("native", false), ("generic", true)] {
        let case = format!("{ops}-{}", if lora { "lora" } else { "full" });
        let config = |name: &str, micro_batch, devices: &[&str], strategy| {
            let mut c = multi_device_config(
                &tmp.path().join(format!("{name}-{case}")),
                lora,
                micro_batch,
                devices,
                strategy,
            );
            c.training.gradient_accumulation = 4;
            c.training.max_steps = Some(3);
            c
        };
        let (one, _, _) = cli_losses(&config("one", 2, &["cpu"], Strategy::Single), ops);
        assert_eq!(one.len(), 3, "{one:?}");
        for shard in ShardMode::ALL {
            let mut sharded = config(
                &format!("sharded-{shard}"),
                1,
                &["cpu:0", "cpu:1"],
                Strategy::Sharded,
            );
            sharded.devices.shard = shard;
            let (got, ranks, _) = cli_losses(&sharded, ops);
            assert_eq!(ranks, 2);
            println!(
                "{case} {}: {got:?} vs one device {one:?}: worst {:.3e}",
                shard.zero_stage(),
                worst(&one, &got)
            );
            assert!(
                worst(&one, &got) <= 1e-6,
                "{case} {shard}: {got:?} vs {one:?}"
            );
        }
    }
}

/// The plan counts the reference: `copy` a second set of weights on every rank's device (a
/// full fine-tuning run's weights exactly double, on one device and on each of two
/// data-parallel ranks), `adapter-disabled` no weights but a forward without a graph before
/// the policy's (the forward phase never shrinks); `auto` plans as `precomputed`.
#[test]
fn the_plan_counts_the_reference_copy_and_its_forward() {
    use tunestudio::train::{local_plan_request, ReferenceMode};
    let tmp = tempfile::tempdir().unwrap();
    let planned = |c: &RunConfig| tunestudio::plan::plan(&local_plan_request(c).unwrap()).unwrap();
    let weights = |p: &tunestudio::plan::Plan| -> Vec<u64> {
        p.per_device.iter().map(|d| d.weights_bytes).collect()
    };
    let forward = |p: &tunestudio::plan::Plan| p.per_device[0].phases[0].bytes;
    let mut c = fixture_config(tmp.path());
    for devices in [&["cpu"][..], &["cpu:0", "cpu:1"][..]] {
        c.devices.devices = devices.iter().map(|d| d.to_string()).collect();
        c.devices.strategy = if devices.len() > 1 {
            tunestudio::settings::Strategy::DataParallel
        } else {
            tunestudio::settings::Strategy::Single
        };
        c.preference.reference = ReferenceMode::Precomputed;
        let stored = planned(&c);
        c.preference.reference = ReferenceMode::Auto;
        assert_eq!(weights(&planned(&c)), weights(&stored));
        c.preference.reference = ReferenceMode::Copy;
        let copy = planned(&c);
        let doubled: Vec<u64> = weights(&stored).iter().map(|w| 2 * w).collect();
        assert_eq!(weights(&copy), doubled, "{devices:?}");
        assert!(copy.per_device[0].peak_bytes > stored.per_device[0].peak_bytes);
    }
    let mut c = fixture_config(tmp.path());
    with_lora(&mut c);
    c.preference.reference = ReferenceMode::Precomputed;
    let stored = planned(&c);
    c.preference.reference = ReferenceMode::AdapterDisabled;
    let off = planned(&c);
    assert_eq!(weights(&off), weights(&stored));
    assert!(forward(&off) >= forward(&stored));
    assert!(
        off.settings.contains("adapters disabled"),
        "{}",
        off.settings
    );
}
