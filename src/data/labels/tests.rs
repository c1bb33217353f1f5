//! Label masking and packing, checked on hand-made rows.

use super::*;

fn sample(row: usize, n: usize, masked: usize) -> TokenizedSample {
    TokenizedSample {
        row,
        input_ids: (0..n as u32).collect(),
        labels: (0..n as i64)
            .map(|i| {
                if (i as usize) < masked {
                    IGNORE_INDEX
                } else {
                    i
                }
            })
            .collect(),
        weights: None,
        segments: vec![n],
        rows: vec![row],
    }
}

/// Lengths 5, 7, 3, 9; the first and third with a masked prompt of 2 and 1 tokens.
fn four_samples() -> Vec<TokenizedSample> {
    vec![
        sample(0, 5, 2),
        sample(1, 7, 0),
        sample(2, 3, 1),
        sample(3, 9, 0),
    ]
}

#[test]
fn packing_keeps_trained_tokens() {
    let s = four_samples();
    let packed = pack(&s, 12);
    let before: usize = s.iter().map(TokenizedSample::num_trained).sum();
    let after: usize = packed.iter().map(TokenizedSample::num_trained).sum();
    assert_eq!(before, after);
    assert!(packed.iter().all(|p| p.len() <= 12));
    assert_eq!(packed.iter().map(|p| p.segments.len()).sum::<usize>(), 4);
    for p in &packed {
        assert_eq!(p.segments.iter().sum::<usize>(), p.len());
    }
}

/// First-fit decreasing into 12-token sequences: lengths 5, 7, 3, 9 go {5, 7} and
/// {3, 9}, each sequence in source order, listed by its first source row; a sample after
/// the first has its first label ignored (it is not trained to follow the previous one);
/// a sample longer than the limit is cut to it.
#[test]
fn packing_fills_first_fit_decreasing_and_masks_each_boundary() {
    let s = four_samples();
    let packed = pack(&s, 12);
    let ig = IGNORE_INDEX;
    assert_eq!(packed.len(), 2);
    assert_eq!(packed[0].rows, vec![0, 1]);
    assert_eq!(packed[0].segments, vec![5, 7]);
    assert_eq!(
        packed[0].input_ids,
        vec![0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]
    );
    assert_eq!(
        packed[0].labels,
        vec![ig, ig, 2, 3, 4, ig, 1, 2, 3, 4, 5, 6]
    );
    assert_eq!(packed[1].rows, vec![2, 3]);
    assert_eq!(packed[1].labels, vec![ig, 1, 2, ig, 1, 2, 3, 4, 5, 6, 7, 8]);
    let cut = pack(&[sample(7, 20, 0)], 12);
    assert_eq!(
        (cut.len(), cut[0].len(), cut[0].rows.clone()),
        (1, 12, vec![7])
    );
}
