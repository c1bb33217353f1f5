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
