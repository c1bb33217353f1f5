//! Tests that kill the survivors of a mutation pass over the core rooms (issue #43, item 7):
//! each pins one formula or rule exactly, so a flipped operator in it fails here.

use candle_core::{DType, Device, Tensor, Var};
use tunestudio::data::{
    label_example, Example, LabelContext, LabelledRow, TokenizerBundle, IGNORE_INDEX,
};
use tunestudio::model::preference::{dpo_sigmoid_loss, orpo_loss, PairLogps, SequenceLogps};
use tunestudio::model::{AdamW, AdamWConfig, CausalLm, Gradients, NamedParam};
use tunestudio::train::TrainingRun;

use crate::train_common::tiny_config;

/// torch's AdamW in f64 on one parameter vector: decoupled decay, moments, bias correction.
struct ReferenceAdamW {
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
}

impl ReferenceAdamW {
    fn step(&mut self, cfg: &AdamWConfig, lr: f64, g: &[f64], mult: f64) {
        self.t += 1;
        let bc1 = 1.0 - cfg.beta1.powi(self.t);
        let bc2 = 1.0 - cfg.beta2.powi(self.t);
        let state = self.p.iter_mut().zip(&mut self.m).zip(&mut self.v);
        for (((p, m), v), &g) in state.zip(g) {
            let gi = g * mult;
            *p *= 1.0 - lr * cfg.weight_decay;
            *m = cfg.beta1 * *m + (1.0 - cfg.beta1) * gi;
            *v = cfg.beta2 * *v + (1.0 - cfg.beta2) * gi * gi;
            let m_hat = *m / bc1;
            let v_hat = *v / bc2;
            *p -= lr * m_hat / (v_hat.sqrt() + cfg.eps);
        }
    }
}

/// Three AdamW steps on one parameter stored as `dtype` (bf16 with an f32 master copy) match
/// the f64 formula. The hyper-parameters are far from torch's defaults on purpose: a large
/// eps and weight decay, betas whose bias corrections differ a lot between steps, and a
/// gradient multiplier ≠ 1, so every term of the update moves the result.
fn adamw_follows_the_formula(dtype: DType, master: bool, tol: f64) {
    let dev = Device::Cpu;
    let p0 = [0.5f64, -1.0, 2.0, 0.25, -3.0];
    let init = Tensor::new(&p0.map(|x| x as f32), &dev)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let var = Var::from_tensor(&init).unwrap();
    let params = [NamedParam {
        name: "w".into(),
        var: var.clone(),
        trainable: true,
        weight_decay: true,
    }];
    let cfg = AdamWConfig {
        lr: 0.1,
        beta1: 0.7,
        beta2: 0.8,
        eps: 0.25,
        weight_decay: 0.5,
        decay_norms_and_biases: false,
    };
    let mut opt = AdamW::new(&params, cfg.clone(), master).unwrap();
    let mut want = ReferenceAdamW {
        p: p0.to_vec(),
        m: vec![0.0; p0.len()],
        v: vec![0.0; p0.len()],
        t: 0,
    };
    let steps = [
        ([1.0, -2.0, 0.5, 3.0, -0.25], 0.1, 0.5),
        ([-0.5, 1.0, 2.0, -4.0, 1.5], 0.2, 2.0),
        ([2.0, 2.0, -1.0, 1.0, 0.75], 0.05, 1.0),
    ];
    for (k, (g, lr, mult)) in steps.iter().enumerate() {
        let mut grads = Gradients::new();
        let gt = Tensor::new(&g.map(|x| x as f32), &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        grads.insert("w", gt);
        opt.step(&grads, *lr, *mult).unwrap();
        want.step(&cfg, *lr, g, *mult);
        let got: Vec<f32> = var
            .as_tensor()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (i, (&a, &b)) in got.iter().zip(&want.p).enumerate() {
            assert!(
                (f64::from(a) - b).abs() <= tol * b.abs().max(1.0),
                "{dtype:?} step {}: element {i} is {a}, the formula gives {b}",
                k + 1
            );
        }
    }
    assert_eq!(opt.steps_taken(), 3);
}

#[test]
fn adamw_f32_update_is_torchs_formula() {
    adamw_follows_the_formula(DType::F32, false, 1e-6);
}

#[test]
fn adamw_bf16_master_update_is_torchs_formula() {
    // The parameter is rounded to bf16 after each step (8 bits of mantissa); the master copy
    // carries the f32 value between steps.
    adamw_follows_the_formula(DType::BF16, true, 1e-2);
}

/// Every trainable parameter's values, as f32, by name.
fn param_values(run: &TrainingRun) -> Vec<(String, Vec<f32>)> {
    run.model()
        .params()
        .iter()
        .filter(|p| p.trainable)
        .map(|p| {
            let v = p.var.as_tensor().to_dtype(DType::F32).unwrap();
            (p.name.clone(), v.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// The first optimizer step of a run applies AdamW to the step's token-normalised gradient
/// (what `preview_gradients` shows), clipped to `max_grad_norm`: with no weight decay, AdamW's
/// first update is exactly `−lr · g / (|g| + eps)` per element. eps is set near the typical
/// |g| so the update depends on the gradient's scale (a gradient left unnormalised by the
/// token count, or clipped by the wrong factor, moves the weights differently), and
/// `max_grad_norm` is half the gradient's norm so clipping acts. The step reports that
/// unclipped norm and the mean token loss (≈ ln(vocab) for the untrained fixture).
#[test]
fn first_step_applies_adamw_to_the_clipped_mean_gradient() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = tiny_config(&tmp.path().join("probe"), 1);
    c.training.micro_batch = 2;
    c.training.gradient_accumulation = 2;
    c.training.weight_decay = 0.0;
    let preview = TrainingRun::new(c.clone())
        .unwrap()
        .preview_gradients()
        .unwrap();
    let norm = preview
        .grads
        .values()
        .flat_map(flat)
        .map(|x| f64::from(x).powi(2))
        .sum::<f64>()
        .sqrt();
    let max_norm = norm / 2.0;
    let clip = max_norm / (norm + 1e-6);
    let mut mags: Vec<f64> = preview
        .grads
        .values()
        .flat_map(flat)
        .map(|x| f64::from(x).abs() * clip)
        .filter(|&x| x > 0.0)
        .collect();
    mags.sort_by(f64::total_cmp);
    let eps = mags[mags.len() / 2];

    c.output_dir = tmp.path().join("run");
    c.training.max_grad_norm = max_norm;
    c.training.adam_epsilon = eps;
    let mut run = TrainingRun::new(c).unwrap();
    let again = run.preview_gradients().unwrap();
    assert_eq!(again.tokens, preview.tokens);
    let before = param_values(&run);
    let out = run.step().unwrap();
    assert_eq!(out.tokens, preview.tokens);
    assert!(
        (out.loss - preview.loss).abs() < 1e-9 && (10.0..11.5).contains(&out.loss),
        "step loss {} vs previewed {} (ln 49152 = 10.80)",
        out.loss,
        preview.loss
    );
    assert!(
        (out.grad_norm - norm).abs() <= 1e-4 * norm,
        "reported norm {} vs {norm}",
        out.grad_norm
    );
    let lr = out.lr;
    let after = param_values(&run);
    let mut checked = 0;
    for ((name, p0), (_, p1)) in before.iter().zip(&after) {
        let g = flat(&preview.grads[name]);
        for ((&a, &b), &gi) in p0.iter().zip(p1).zip(&g) {
            let g = f64::from(gi) * clip;
            let want = f64::from(a) - lr * g / (g.abs() + eps);
            assert!(
                (f64::from(b) - want).abs() <= 1e-3 * lr + 1e-6 * f64::from(a).abs(),
                "{name}: {a} → {b}, AdamW's first step gives {want}"
            );
            checked += 1;
        }
    }
    assert!(checked > 1000, "{checked} elements checked");
}

fn label(ex: &Example, tok: &TokenizerBundle, max_length: usize) -> LabelledRow {
    let ctx = LabelContext {
        tok,
        template: None,
        completions_only: true,
        max_length,
        keep_text: false,
    };
    label_example(0, ex, &ctx, &|| "row 0".into()).unwrap()
}

/// A row of exactly `max_length` tokens fits: it is not flagged truncated (the lint and the
/// preview would otherwise say tokens were cut); one token more is truncated.
#[test]
fn a_row_of_exactly_max_length_is_not_truncated() {
    let tok = crate::data_support::tiny_llama();
    let ex = Example::Text {
        text: "The quick brown fox jumps over the lazy dog.".into(),
    };
    let full = label(&ex, &tok, 1024);
    let n = full.sample.len();
    assert!(n > 4 && !full.truncated);
    let exact = label(&ex, &tok, n);
    assert!(!exact.truncated, "{n} tokens fit max_length {n}");
    assert_eq!(exact.sample, full.sample);
    let short = label(&ex, &tok, n - 1);
    assert!(short.truncated && short.completion_truncated);
    assert_eq!(short.sample.len(), n - 1);
}

/// Prompt/completion with completions only: every prompt token's label is -100, every
/// completion token (and the appended EOS) is trained on itself.
#[test]
fn prompt_labels_are_ignored_and_completion_labels_are_the_tokens() {
    let tok = crate::data_support::tiny_llama();
    let prompt = "Question: what is two plus two?\nAnswer:";
    let ex = Example::PromptCompletion {
        prompt: prompt.into(),
        completion: " four".into(),
    };
    let row = label(&ex, &tok, 1024);
    let n_prompt = tok.encode(prompt, true).unwrap().len();
    let s = &row.sample;
    assert!(row.eos_appended);
    assert_eq!(s.input_ids.last().copied(), tok.eos_token_id);
    assert!(s.labels[..n_prompt].iter().all(|&l| l == IGNORE_INDEX));
    for (i, (&id, &l)) in s.input_ids.iter().zip(&s.labels).enumerate().skip(n_prompt) {
        assert_eq!(l, i64::from(id), "completion position {i}");
    }
    assert_eq!(s.num_trained(), s.len() - n_prompt);
}

/// The per-token losses the preview shows are 0 exactly where the (shifted) label is -100 and
/// sum to the training loss over the trained tokens.
#[test]
fn token_losses_are_zero_where_ignored_and_sum_to_the_loss() {
    let dev = Device::Cpu;
    let model = CausalLm::load(&crate::train_common::tiny_llama(), DType::F32, &dev).unwrap();
    let ids = Tensor::new(&[[5u32, 17, 300, 42, 9, 1000]], &dev).unwrap();
    let labels = Tensor::new(&[[-100i64, -100, 300, 42, -100, 1000]], &dev).unwrap();
    let per_token: Vec<f32> = model
        .token_losses(&ids, None, &labels)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    // Position i scores labels[i + 1]: -100, 300, 42, -100, 1000.
    assert_eq!(per_token.len(), 5);
    assert_eq!(per_token[0], 0.0);
    assert_eq!(per_token[3], 0.0);
    for i in [1, 2, 4] {
        assert!(per_token[i] > 1.0, "position {i}: {}", per_token[i]);
    }
    let loss = model.loss(&ids, None, &labels).unwrap();
    assert_eq!(loss.num_tokens, 3);
    let sum = loss
        .sum
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let total: f32 = per_token.iter().sum();
    assert!((sum - total).abs() <= 1e-3 * total, "{sum} vs {total}");
}

fn seq(sum: &[f32], tokens: &[f32]) -> SequenceLogps {
    SequenceLogps {
        sum: Tensor::new(sum, &Device::Cpu).unwrap(),
        tokens: Tensor::new(tokens, &Device::Cpu).unwrap(),
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    let v: Vec<f32> = t.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
    v.into_iter().map(f64::from).collect()
}

fn log_sigmoid(x: f64) -> f64 {
    -(1.0 + (-x).exp()).ln()
}

/// DPO with label smoothing ε away from the reference: each pair's loss is
/// `−(1−ε)·log σ(β·m) − ε·log σ(−β·m)` (TRL's conservative DPO), not only its first term.
#[test]
fn dpo_label_smoothing_adds_the_reversed_term() {
    let policy = PairLogps {
        chosen: seq(&[-4.0, -9.0], &[4.0, 6.0]),
        rejected: seq(&[-7.0, -5.0], &[5.0, 3.0]),
    };
    let reference = PairLogps {
        chosen: seq(&[-5.0, -8.0], &[4.0, 6.0]),
        rejected: seq(&[-6.0, -6.0], &[5.0, 3.0]),
    };
    let (beta, eps) = (0.5, 0.2);
    let out = dpo_sigmoid_loss(&policy, &reference, beta, eps).unwrap();
    // Margins: (−4+7) − (−5+6) = 2 and (−9+5) − (−8+6) = −2.
    for (got, m) in values(&out.losses).into_iter().zip([2.0, -2.0]) {
        let z: f64 = beta * m;
        let want = -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z);
        assert!((got - want).abs() < 1e-5, "margin {m}: {got} vs {want}");
    }
}

/// ORPO's log-odds ratio of mean per-token log-probabilities `a`, `b` is
/// `(a − b) − (log(1 − eᵃ) − log(1 − eᵇ))`, and its loss adds `−λ·log σ(log-odds)` to the
/// chosen answers' NLL.
#[test]
fn orpo_log_odds_follow_the_formula() {
    let policy = PairLogps {
        chosen: seq(&[-2.0, -6.0], &[4.0, 3.0]),
        rejected: seq(&[-6.0, -3.0], &[4.0, 6.0]),
    };
    let lambda = 0.25;
    let out = orpo_loss(&policy, lambda).unwrap();
    let pairs = [(-0.5f64, -1.5f64), (-2.0, -0.5)];
    let log1m_exp = |x: f64| (1.0 - x.exp()).ln();
    let odds: Vec<f64> = pairs
        .iter()
        .map(|&(a, b)| (a - b) - (log1m_exp(a) - log1m_exp(b)))
        .collect();
    for (got, want) in values(out.log_odds.as_ref().unwrap())
        .into_iter()
        .zip(&odds)
    {
        assert!((got - want).abs() < 1e-5, "log-odds {got} vs {want}");
    }
    let nll = 8.0 / 7.0;
    let ratio = odds.iter().map(|&o| -lambda * log_sigmoid(o)).sum::<f64>() / 2.0;
    let loss = values(&out.loss.reshape(1).unwrap())[0];
    assert!(
        (loss - (nll + ratio)).abs() < 1e-5,
        "{loss} vs {}",
        nll + ratio
    );
}

/// Full fine-tuning of DictaLM 2.0 (a real 7 B shape): every block's gradient, master-copy and
/// AdamW-state bytes are its parameter count times the bytes per parameter of the precision
/// (fp32: 4-byte gradients, no master copy; both: 8 bytes of moments), and every parameter
/// is trainable.
#[test]
fn planner_state_terms_are_bytes_per_trainable_parameter() {
    let path = tunestudio::paths::shared_dir()
        .join("model-configs")
        .join("dictalm2-7b.json");
    let model = tunestudio::model::ModelConfig::from_file(&path).unwrap();
    let req = tunestudio::plan::PlanRequest {
        model,
        precision: tunestudio::plan::Precision::Fp32,
        micro_batch: 1,
        gradient_accumulation: 4,
        seq_len: 512,
        activation_checkpointing: true,
        optimizer_offload: false,
        lora: None,
        strategy: tunestudio::plan::Strategy::Single,
        shard: Default::default(),
        devices: tunestudio::plan::parse_devices("1x80GiB").unwrap(),
        ops: tunestudio::model::OpsMode::Auto,
        process: None,
        trained_tokens: None,
        head_loss: Default::default(),
        reference: Default::default(),
        generations_per_micro_step: None,
        world: Default::default(),
    };
    let costs = tunestudio::plan::layer_costs(&req);
    assert_eq!(costs.trainable_parameters, costs.parameters);
    let blocks = costs.per_block();
    assert_eq!(blocks.len(), 32 + 2);
    for b in blocks {
        assert!(b.parameters > 1_000_000, "{}", b.name);
        assert_eq!(b.weights_bytes, 4 * b.parameters, "{} weights", b.name);
        assert_eq!(b.gradients_bytes, 4 * b.parameters, "{} gradients", b.name);
        assert_eq!(b.master_weights_bytes, 0, "{} master copy", b.name);
        assert_eq!(
            b.optimizer_states_bytes,
            8 * b.parameters,
            "{} moments",
            b.name
        );
    }
}

/// A tie in the layer split is broken the documented way: three equal layers on two equal
/// devices can go 1 + 2 or 2 + 1 (both fullest at two layers), and the first cut scanned from
/// the left that reaches the optimum is kept, so the split is the same on every run and the
/// planner and the trainer agree on it.
#[test]
fn an_even_tie_in_the_layer_split_keeps_the_first_cut_from_the_left() {
    use tunestudio::plan::placement::{balance_layers, StageCosts};
    let costs = StageCosts {
        embeddings_bytes: 0,
        layer_bytes: vec![100; 3],
        head_bytes: 0,
    };
    let split = balance_layers(&costs, &[1_000, 1_000]).unwrap();
    assert_eq!(split.ranges, vec![0..1, 1..3]);
    assert_eq!(split.device_bytes, vec![100, 200]);
}
