use super::*;

fn t(v: &[f32]) -> Tensor {
    Tensor::new(v, &Device::Cpu).unwrap()
}

fn scalar(x: &Tensor) -> f64 {
    x.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

fn logps(sum: &[f32], tokens: &[f32]) -> SequenceLogps {
    SequenceLogps {
        sum: t(sum),
        tokens: t(tokens),
    }
}

#[test]
fn log_sigmoid_is_stable() {
    let x = t(&[-200.0, -1.0, 0.0, 1.0, 200.0]);
    let y = log_sigmoid(&x).unwrap().to_vec1::<f32>().unwrap();
    let want = [
        -200.0,
        -1.313_261_7,
        -std::f32::consts::LN_2,
        -0.313_261_7,
        0.0,
    ];
    for (a, b) in y.iter().zip(want) {
        assert!((a - b).abs() < 1e-5, "{y:?}");
    }
}

#[test]
fn log_sigmoid_has_the_gradient_sigma_minus_x_at_the_kink() {
    // At 0 (DPO's start when the policy is its own reference) the gradient is σ(0) = ½,
    // not the 1 that `minimum`'s and `abs`'s subgradients at 0 used to add up to.
    for v in [-30.0f32, -1.0, -1e-6, 0.0, 1e-6, 1.0, 30.0] {
        let x = candle_core::Var::new(&[v], &Device::Cpu).unwrap();
        let grads = log_sigmoid(x.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let got = grads.get(x.as_tensor()).unwrap().to_vec1::<f32>().unwrap()[0];
        let want = 1.0 / (1.0 + f64::from(v).exp());
        assert!(
            (f64::from(got) - want).abs() < 1e-6,
            "x = {v}: {got} vs {want}"
        );
    }
}

#[test]
fn sequence_logps_sum_completion_tokens() {
    // One row, vocab 2, uniform logits: every scored token has log-prob −ln 2.
    let logits = Tensor::zeros((1, 4, 2), DType::F32, &Device::Cpu).unwrap();
    let labels = Tensor::new(&[[-100i64, -100, 1, 0]], &Device::Cpu).unwrap();
    let s = sequence_logps(&logits, &labels).unwrap();
    assert!((scalar(&s.sum.squeeze(0).unwrap()) + 2.0 * 2f64.ln()).abs() < 1e-6);
    assert_eq!(s.tokens.to_vec1::<f32>().unwrap(), [2.0]);
    let bad = Tensor::new(&[[-100i64, 5, 1, 0]], &Device::Cpu).unwrap();
    assert!(sequence_logps(&logits, &bad).is_err());
}

#[test]
fn orpo_log_odds_of_confident_answers() {
    // Mean log-probabilities near 0, where log(1 − eˣ) matters (the fixture's, near
    // −10.7, hardly see it): checked against f64 `ln_1p(−exp)`, TRL's formula.
    let p = PairLogps {
        chosen: logps(&[-1.0, -0.9], &[2.0, 3.0]),
        rejected: logps(&[-2.0, -0.6], &[2.0, 1.0]),
    };
    let l = orpo_loss(&p, 0.1).unwrap();
    let odds = |a: f64, b: f64| (a - b) - ((-a.exp()).ln_1p() - (-b.exp()).ln_1p());
    let want = [odds(-0.5, -1.0), odds(-0.3, -0.6)];
    let got = l.log_odds.as_ref().unwrap().to_vec1::<f32>().unwrap();
    for (g, w) in got.iter().zip(want) {
        assert!((f64::from(*g) - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
    let sig = |x: f64| -(-x).exp().ln_1p();
    let nll = (1.0 + 0.9) / 5.0;
    let loss = nll - 0.1 * (sig(want[0]) + sig(want[1])) / 2.0;
    assert!((scalar(&l.loss) - loss).abs() < 1e-6);
    let m = l.metrics().unwrap();
    assert!((m.nll_loss.unwrap() - nll).abs() < 1e-6);
    assert!((m.rewards_chosen - 0.1 * (-0.5 - 0.3) / 2.0).abs() < 1e-6);
}

#[test]
fn dpo_at_the_reference_is_ln2_and_smoothing_is_symmetric() {
    let p = PairLogps {
        chosen: logps(&[-3.0, -5.0], &[2.0, 2.0]),
        rejected: logps(&[-4.0, -1.0], &[2.0, 2.0]),
    };
    let l = dpo_sigmoid_loss(&p, &p, 0.1, 0.0).unwrap();
    assert!((scalar(&l.loss) - 2f64.ln()).abs() < 1e-6);
    let m = l.metrics().unwrap();
    assert_eq!((m.rewards_margins, m.rewards_accuracies), (0.0, 0.0));
    let r = PairLogps {
        chosen: logps(&[-4.0, -4.0], &[2.0, 2.0]),
        rejected: logps(&[-4.0, -4.0], &[2.0, 2.0]),
    };
    let l = dpo_sigmoid_loss(&p, &r, 0.1, 0.0).unwrap();
    let m = l.metrics().unwrap();
    assert!((m.rewards_chosen - 0.1 * (1.0 - 1.0) / 2.0).abs() < 1e-6);
    assert!((m.rewards_accuracies - 0.5).abs() < 1e-9);
    // ε = 0.5 weighs both directions equally: the loss is even in the margin.
    let swapped = PairLogps {
        chosen: p.rejected.clone(),
        rejected: p.chosen.clone(),
    };
    let a = scalar(&dpo_sigmoid_loss(&p, &r, 0.1, 0.5).unwrap().loss);
    let b = scalar(&dpo_sigmoid_loss(&swapped, &r, 0.1, 0.5).unwrap().loss);
    assert!((a - b).abs() < 1e-6);
    assert!(orpo_loss(&p, 0.1).is_ok());
    assert!(preference_loss(PreferenceLossKind::Ipo, &p, None, 0.1).is_err());
}

#[test]
fn merged_metrics_are_weighted_by_pairs() {
    // One step of two micro-batches: 1 pair, then 3 pairs. TRL logs the mean over the step's
    // pairs, so the 3-pair batch weighs three times the other.
    let one = PreferenceMetrics {
        pairs: 1,
        loss: 0.8,
        rewards_chosen: 0.4,
        rewards_rejected: -0.2,
        rewards_accuracies: 1.0,
        rewards_margins: 0.6,
        logps_chosen: -12.0,
        logps_rejected: -20.0,
        log_odds_ratio: Some(-0.5),
        log_odds_chosen: None,
        nll_loss: Some(2.0),
    };
    let three = PreferenceMetrics {
        pairs: 3,
        loss: 0.4,
        rewards_chosen: 0.0,
        rewards_rejected: 0.2,
        rewards_accuracies: 1.0 / 3.0,
        rewards_margins: -0.2,
        logps_chosen: -16.0,
        logps_rejected: -8.0,
        log_odds_ratio: Some(-0.1),
        log_odds_chosen: Some(1.5),
        nll_loss: None,
    };
    let m = one.merge(&three);
    let close = |x: f64, want: f64| (x - want).abs() < 1e-12;
    assert_eq!(m.pairs, 4);
    assert!(close(m.loss, 0.5), "loss {}", m.loss);
    assert!(close(m.rewards_chosen, 0.1), "{}", m.rewards_chosen);
    assert!(close(m.rewards_rejected, 0.1), "{}", m.rewards_rejected);
    assert!(close(m.rewards_accuracies, 0.5), "{}", m.rewards_accuracies);
    assert!(close(m.rewards_margins, 0.0), "{}", m.rewards_margins);
    assert!(close(m.logps_chosen, -15.0), "{}", m.logps_chosen);
    assert!(close(m.logps_rejected, -11.0), "{}", m.logps_rejected);
    assert!(close(m.log_odds_ratio.unwrap_or(f64::NAN), -0.2));
    // A metric one side lacks is the other side's, not halved.
    assert_eq!(m.log_odds_chosen, Some(1.5));
    assert_eq!(m.nll_loss, Some(2.0));
    // The order of the batches does not matter.
    let r = three.merge(&one);
    assert!(close(r.loss, m.loss) && close(r.logps_chosen, m.logps_chosen));
}
