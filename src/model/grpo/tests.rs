//! The advantage rules and the completion mask on hand-made numbers; the losses against TRL's
//! own numbers are in `tests/it/grpo_loss.rs`.

use super::*;
use candle_core::{Device, Tensor};

#[test]
fn group_advantages_center_and_scale_each_group() {
    let a = advantages(&[1.0, 0.0, 0.5, 0.5], 2, ScaleRewards::Group).unwrap();
    // Group 1: mean 0.5, std (n−1) = 0.7071; group 2: equal rewards.
    let want = 0.5 / (0.5f64.sqrt() + ADVANTAGE_STD_EPS);
    assert!(
        (f64::from(a.values[0]) - want).abs() < 1e-6,
        "{:?}",
        a.values
    );
    assert!((f64::from(a.values[1]) + want).abs() < 1e-6);
    assert_eq!(&a.values[2..], &[0.0, 0.0]);
    assert_eq!(a.zero_std, vec![false, false, true, true]);
    assert!((a.frac_zero_std() - 0.5).abs() < 1e-12);
}

#[test]
fn batch_and_unscaled_advantages() {
    let r = [1.0f32, 0.0, 2.0, 2.0];
    let none = advantages(&r, 2, ScaleRewards::None).unwrap();
    assert_eq!(none.values, vec![0.5, -0.5, 0.0, 0.0]);
    let batch = advantages(&r, 2, ScaleRewards::Batch).unwrap();
    let std = (r
        .iter()
        .map(|&x| (f64::from(x) - 1.25).powi(2))
        .sum::<f64>()
        / 3.0)
        .sqrt();
    assert!((f64::from(batch.values[0]) - 0.5 / (std + ADVANTAGE_STD_EPS)).abs() < 1e-6);
    // Under batch scaling the zero-std flag is the batch's.
    assert_eq!(batch.zero_std, vec![false; 4]);
}

#[test]
fn rewards_that_do_not_fill_groups_are_refused() {
    let e = advantages(&[1.0, 2.0, 3.0], 2, ScaleRewards::Group).unwrap_err();
    assert!(e.to_string().contains("num_generations = 2"), "{e}");
}

#[test]
fn the_mask_keeps_the_first_eos_even_when_it_is_the_pad_token() {
    assert_eq!(
        completion_mask(&[5, 6, 2, 2, 2], &[2]),
        vec![1., 1., 1., 0., 0.]
    );
    // Never stopped: every token trains.
    assert_eq!(completion_mask(&[5, 6, 7], &[2]), vec![1., 1., 1.]);
    assert_eq!(completion_mask(&[9, 3, 1], &[2, 3]), vec![1., 1., 0.]);
}

fn t(rows: &[&[f32]]) -> Tensor {
    let c = rows[0].len();
    let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_vec(flat, (rows.len(), c), &Device::Cpu).unwrap()
}

fn settings(loss_type: GrpoLossType) -> GrpoLossSettings {
    GrpoLossSettings {
        loss_type,
        beta: 0.0,
        epsilon_low: 0.2,
        epsilon_high: 0.2,
        max_completion_length: 4,
        step_completion_tokens: 5.0,
        accumulation_steps: 1,
        bias_correction_kl: true,
        micro_batch: None,
    }
}

#[test]
fn each_aggregation_divides_by_its_own_count() {
    // Ratio 1: per-token loss is −A on the mask.
    let logps = t(&[&[-1.0, -2.0, 0.0], &[-1.0, -1.0, -1.0]]);
    let mask = t(&[&[1.0, 1.0, 0.0], &[1.0, 1.0, 1.0]]);
    let adv = Tensor::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
    let value = |k| {
        grpo_loss(&logps, None, None, &adv, &mask, &settings(k))
            .unwrap()
            .loss
            .to_scalar::<f32>()
            .unwrap()
    };
    // Sum = −(1·2) + (2·3) = 4.
    assert!((value(GrpoLossType::Dapo) - 4.0 / 5.0).abs() < 1e-6);
    assert!((value(GrpoLossType::Bnpo) - 4.0 / 5.0).abs() < 1e-6);
    assert!((value(GrpoLossType::DrGrpo) - 4.0 / 8.0).abs() < 1e-6);
    assert!((value(GrpoLossType::Grpo) - (-1.0 + 2.0) / 2.0).abs() < 1e-6);
}

#[test]
fn clipped_tokens_count_and_carry_no_gradient() {
    let old = t(&[&[0.0, 0.0], &[0.0, 0.0]]);
    // r = e^{0.5} > 1.2 with A > 0 (clipped high); r = e^{-0.5} < 0.8 with A < 0 (clipped low).
    let logps = candle_core::Var::from_tensor(&t(&[&[0.5, 0.0], &[-0.5, 0.0]])).unwrap();
    let mask = t(&[&[1.0, 1.0], &[1.0, 1.0]]);
    let adv = Tensor::new(&[1.0f32, -1.0], &Device::Cpu).unwrap();
    let l = grpo_loss(
        logps.as_tensor(),
        Some(&old),
        None,
        &adv,
        &mask,
        &settings(GrpoLossType::Bnpo),
    )
    .unwrap();
    let g = l.loss.backward().unwrap();
    let grad = g.get(logps.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(grad[0][0], 0.0);
    assert_eq!(grad[1][0], 0.0);
    assert!((grad[0][1] + 0.25).abs() < 1e-6, "{grad:?}");
    let m = l.metrics(&mask.zeros_like().unwrap()).unwrap();
    assert!((m.clip_low_mean - 0.25).abs() < 1e-9);
    assert!((m.clip_high_mean - 0.25).abs() < 1e-9);
    assert!((m.clip_region_mean - 0.5).abs() < 1e-9);
    assert!((m.clip_high_max - 0.5).abs() < 1e-9);
    assert_eq!(m.clip_low_min, 0.0);
}

/// `grpo.generations_per_micro_step`: a micro-batch run as two passes (rows 0–1, then 2–3),
/// each told the whole micro-batch's rows and tokens, gives the whole micro-batch's loss and
/// gradient under every aggregation, with clipping and the KL term in play.
#[test]
fn passes_of_a_micro_batch_sum_to_its_loss_and_gradient() {
    let logps = t(&[
        &[-1.0, -2.0, -0.5],
        &[-0.7, -1.1, -3.0],
        &[-2.0, -0.2, -0.9],
        &[-0.4, -1.5, -1.2],
    ]);
    let old = t(&[
        &[-1.2, -1.6, -0.5],
        &[-0.7, -1.4, -2.5],
        &[-2.1, -0.2, -1.0],
        &[-0.9, -1.5, -1.2],
    ]);
    let reference = old.affine(1.0, -0.1).unwrap();
    let mask = t(&[
        &[1.0, 1.0, 0.0],
        &[1.0, 1.0, 1.0],
        &[1.0, 0.0, 0.0],
        &[1.0, 1.0, 1.0],
    ]);
    let adv = Tensor::new(&[1.0f32, -2.0, 0.5, -0.3], &Device::Cpu).unwrap();
    // Loss and d loss / d logps of `rows`, with `whole` the micro-batch's totals.
    let run = |rows: std::ops::Range<usize>, s: &GrpoLossSettings| {
        let n = rows.len();
        let pick = |x: &Tensor| x.narrow(0, rows.start, n).unwrap();
        let var = candle_core::Var::from_tensor(&pick(&logps)).unwrap();
        let l = grpo_loss(
            var.as_tensor(),
            Some(&pick(&old)),
            Some(&pick(&reference)),
            &pick(&adv),
            &pick(&mask),
            s,
        )
        .unwrap();
        let grad = l.loss.backward().unwrap();
        let grad = grad.get(var.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        (l.loss.to_scalar::<f32>().unwrap(), grad)
    };
    for k in [
        GrpoLossType::Dapo,
        GrpoLossType::Grpo,
        GrpoLossType::DrGrpo,
        GrpoLossType::Bnpo,
    ] {
        let whole = GrpoLossSettings {
            beta: 0.04,
            step_completion_tokens: 9.0,
            accumulation_steps: 2,
            ..settings(k)
        };
        let pass = GrpoLossSettings {
            micro_batch: Some(MicroBatchTotals {
                rows: 4,
                completion_tokens: 9.0,
            }),
            ..whole.clone()
        };
        let (loss, grad) = run(0..4, &whole);
        let (first, first_grad) = run(0..2, &pass);
        let (second, second_grad) = run(2..4, &pass);
        assert!(
            (first + second - loss).abs() <= 1e-6 * loss.abs(),
            "{}: {first} + {second} vs {loss}",
            k.name()
        );
        let passes: Vec<Vec<f32>> = first_grad.into_iter().chain(second_grad).collect();
        for (a, b) in passes.iter().flatten().zip(grad.iter().flatten()) {
            assert!(
                (a - b).abs() <= 1e-6,
                "{}: {passes:?} vs {grad:?}",
                k.name()
            );
        }
    }
}
