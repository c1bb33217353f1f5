use super::*;

fn set(peak: u64, phase: StepPhase) -> ComponentSet {
    ComponentSet {
        step: StepComponents {
            weights_bytes: 100,
            optimizer_bytes: 200,
            gradients_bytes: 100,
            activations_bytes: 50,
            logits_and_loss_bytes: 10,
            accumulating: false,
        },
        peak_bytes: peak,
        peak_phase: phase,
        baseline_bytes: None,
    }
}

#[test]
fn rows_add_up_to_the_peak_in_every_phase() {
    for phase in [
        StepPhase::Generation,
        StepPhase::Forward,
        StepPhase::Backward,
        StepPhase::OptimizerStep,
    ] {
        let s = set(500, phase);
        let sum: i64 = Component::ALL
            .iter()
            .filter(|&&c| c != Component::Baseline)
            .filter(|&&c| match phase {
                StepPhase::Generation => !matches!(
                    c,
                    Component::Gradients | Component::Activations | Component::LogitsAndLoss
                ),
                StepPhase::Forward => c != Component::Gradients,
                StepPhase::Backward => true,
                StepPhase::OptimizerStep => {
                    !matches!(c, Component::Activations | Component::LogitsAndLoss)
                }
            })
            .map(|&c| s.value(c).unwrap_or(0))
            .sum();
        assert_eq!(sum, 500, "{phase}");
    }
    // A backward peak below every gradient: the gradients not yet allocated are not a
    // negative temporary, they are not alive at the peak; the rows still add up.
    let below = set(400, StepPhase::Backward);
    assert_eq!(below.temporaries_bytes(), 0);
    assert_eq!(below.value(Component::Gradients), Some(40));
    // Below the weights, optimizer and forward's tensors too: the activations give way
    // after the gradients, and no row is negative.
    let far_below = set(330, StepPhase::Backward);
    let rows: Vec<i64> = Component::ALL
        .iter()
        .filter_map(|&c| far_below.value(c))
        .collect();
    assert!(rows.iter().all(|&b| b >= 0), "{rows:?}");
    assert_eq!(rows.iter().sum::<i64>(), 330);
}

#[test]
fn report_has_a_row_per_component_and_errors() {
    let mut m = set(520, StepPhase::Backward);
    m.step.activations_bytes = 40;
    let r = ComponentReport::new(&set(500, StepPhase::Backward), &m);
    assert_eq!(r.rows.len(), Component::ALL.len());
    let a = r.row(Component::Activations).unwrap();
    assert_eq!(a.error_pct(), Some(25.0));
    assert_eq!(r.row(Component::Baseline).unwrap().error_pct(), None);
    let text = r.render();
    for c in Component::ALL {
        assert!(text.contains(c.name()), "{text}");
    }
    assert!(text.contains("step peak"), "{text}");
    assert!(
        !text.contains("measured how"),
        "no notes when all is counted: {text}"
    );
}

#[test]
fn readings_count_the_tensors_and_derive_the_rest_of_the_process_peak() {
    // The case: a backward peak below every gradient (−402 MiB of temporaries
    // before) and AdamW's state not resident before its first update (a baseline of
    // −779 MiB before): neither shows as a negative row now.
    let predicted = set(360, StepPhase::Backward);
    let readings = StepReadings {
        method: MeasureMethod::ProcessRss,
        tensors: Some(TensorBytes {
            weights_bytes: 100,
            optimizer_bytes: 200,
            gradients_bytes: Some(100),
        }),
        in_use_before_step: Some(150),
        peak_before_step: Some(160),
        peak_after_step: Some(1480),
    };
    let r = ComponentReport::from_readings(&predicted, &readings, 1500, Some(1480));
    let measured = |c| r.row(c).unwrap().measured;
    assert_eq!(measured(Component::Weights), Some(100));
    assert_eq!(measured(Component::Optimizer), Some(200));
    assert_eq!(measured(Component::Gradients), Some(100));
    for c in [
        Component::Activations,
        Component::LogitsAndLoss,
        Component::Temporaries,
        Component::Baseline,
    ] {
        assert_eq!(measured(c), None, "{}", c.name());
        assert!(r.row(c).unwrap().how.is_some());
    }
    for row in &r.rows {
        assert!(row.predicted.unwrap_or(0) >= 0, "{row:?}");
    }
    // Counted rows plus the rest make the process peak, on both sides.
    let rest = r.rest_of_peak.unwrap();
    assert_eq!((rest.predicted, rest.measured), (Some(1100), Some(1080)));
    assert_eq!(r.predicted_peak.0, 1500);
    assert_eq!(r.measured_peak, Some((1480, None)));
    let text = r.render();
    for word in [
        "rest of peak",
        "process peak",
        "counted",
        "derived",
        "resident set",
    ] {
        assert!(text.contains(word), "{word}: {text}");
    }
    let negative = |w: &str| {
        w.strip_prefix('-')
            .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()))
    };
    assert!(
        !text.split_whitespace().any(negative),
        "no negative cell: {text}"
    );

    // No meter (a GPU): the counted tensors only, the rest not measured.
    let gpu = StepReadings {
        method: MeasureMethod::Unavailable,
        in_use_before_step: None,
        peak_before_step: None,
        peak_after_step: None,
        ..readings
    };
    let r = ComponentReport::from_readings(&predicted, &gpu, 1500, None);
    assert_eq!(r.row(Component::Weights).unwrap().measured, Some(100));
    assert_eq!(r.row(Component::Baseline).unwrap().measured, None);
    assert_eq!(r.rest_of_peak.unwrap().measured, None);
    assert_eq!((r.measured_peak, r.note), (None, None));
}
