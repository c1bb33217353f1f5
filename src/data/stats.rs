//! Dataset statistics: token lengths, truncation, trained-token fraction,
//! padding waste at a batch size, packing efficiency.

use crate::data::collate::{batch_indices, padded_len, CollateOptions};
use crate::data::labels::{pack, LabelledRow, TokenizedSample};
use serde::{Deserialize, Serialize};

/// Token-length histogram (lengths before truncation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct LengthHistogram {
    /// Width of each bin in tokens; bin `i` holds lengths in
    /// `[i*bin_width, (i+1)*bin_width)`.
    pub bin_width: usize,
    /// Rows per bin.
    pub counts: Vec<usize>,
    /// `max_length`: lengths at or above it are truncated.
    pub cutoff: usize,
}

impl LengthHistogram {
    /// The length at or below which a fraction `q` of the rows fall (the upper edge of the
    /// bin where the cumulative count reaches `q`); `None` without rows.
    pub fn percentile(&self, q: f64) -> Option<usize> {
        let total: usize = self.counts.iter().sum();
        if total == 0 {
            return None;
        }
        let target = (q * total as f64).ceil() as usize;
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= target.max(1) {
                return Some((i + 1) * self.bin_width.max(1));
            }
        }
        Some(self.counts.len() * self.bin_width.max(1))
    }

    /// The `max_length` this data suggests: its 99th-percentile row length rounded up to a
    /// multiple of 64 (what LLaMA-Factory's `cutoff_len` advice and GPU kernels like).
    pub fn suggested_max_length(&self) -> Option<usize> {
        self.percentile(0.99).map(|l| l.div_ceil(64).max(1) * 64)
    }
}

/// Statistics of one split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct DataStats {
    /// Rows read.
    pub num_rows: usize,
    /// Samples kept for training.
    pub num_samples: usize,
    /// Rows dropped (see the lints for why).
    pub num_dropped: usize,
    /// Tokens of the kept samples (after truncation).
    pub total_tokens: usize,
    /// Tokens the loss sees.
    pub trained_tokens: usize,
    /// `trained_tokens / total_tokens`.
    pub trained_fraction: f64,
    /// Rows longer than `max_length`.
    pub num_truncated: usize,
    /// `num_truncated / num_rows`.
    pub truncated_fraction: f64,
    /// Rows whose trained tokens were cut.
    pub num_completion_truncated: usize,
    /// Mean length before truncation.
    pub mean_length: f64,
    /// Median length before truncation.
    pub median_length: usize,
    /// Longest row before truncation.
    pub max_length_seen: usize,
    /// Longest kept sample, after truncation: no dynamically padded batch is longer (the
    /// memory plan sizes its activations by it).
    #[serde(default)]
    pub longest_kept_tokens: usize,
    /// Lengths before truncation.
    pub histogram: LengthHistogram,
    /// Batch size the padding figures assume.
    pub batch_size: usize,
    /// The trained tokens of the kept samples, largest first (at most
    /// [`LARGEST_TRAINED_KEPT`]): the loss computes logits for trained rows only, so the
    /// memory plan sums the largest of them for its worst micro-batch.
    #[serde(skip)]
    pub trained_tokens_largest_first: Vec<usize>,
    /// Fraction of batch positions that are padding (batches in dataset
    /// order, padded to a multiple of 8).
    pub padding_waste: f64,
    /// The same with the length-grouped sampler's batches (`group_by_length`).
    pub padding_waste_grouped: f64,
    /// Sequences after packing at `max_length`.
    pub packed_sequences: usize,
    /// Real tokens / (packed sequences × max_length).
    pub packing_efficiency: f64,
}

/// Counts [`largest_trained_counts`] keeps: more than any micro-batch.
pub const LARGEST_TRAINED_KEPT: usize = 1024;

/// The [`TokenizedSample::num_trained`] of `samples`, largest first, at most
/// [`LARGEST_TRAINED_KEPT`] of them: the sum of the first `b` is the most trained tokens any
/// batch of `b` samples can hold, whatever the sampler's order.
pub fn largest_trained_counts<'a>(
    samples: impl Iterator<Item = &'a TokenizedSample>,
) -> Vec<usize> {
    let mut counts: Vec<usize> = samples.map(TokenizedSample::num_trained).collect();
    counts.sort_unstable_by(|a, b| b.cmp(a));
    counts.truncate(LARGEST_TRAINED_KEPT);
    counts
}

/// Computes stats for labelled rows (`kept` = samples not dropped).
pub fn compute_stats(rows: &[LabelledRow], batch_size: usize, max_length: usize) -> DataStats {
    let kept: Vec<&TokenizedSample> = rows
        .iter()
        .filter(|r| r.dropped.is_none())
        .map(|r| &r.sample)
        .collect();
    let mut lens: Vec<usize> = rows.iter().map(|r| r.full_len).collect();
    lens.sort_unstable();
    let total_tokens: usize = kept.iter().map(|s| s.len()).sum();
    let trained: usize = kept.iter().map(|s| s.num_trained()).sum();
    let num_truncated = rows.iter().filter(|r| r.truncated).count();
    let max_seen = lens.last().copied().unwrap_or(0);
    let bs = batch_size.max(1);
    let opts = CollateOptions::new(0, max_length);
    let kept_lens: Vec<usize> = kept.iter().map(|s| s.len()).collect();
    let waste = |batches: &[Vec<usize>]| -> f64 {
        let mut slots = 0usize;
        let mut real = 0usize;
        for batch in batches {
            let longest = batch.iter().map(|&i| kept_lens[i]).max().unwrap_or(0);
            slots += padded_len(longest, &opts) * batch.len();
            real += batch.iter().map(|&i| kept_lens[i]).sum::<usize>();
        }
        if slots == 0 {
            0.0
        } else {
            1.0 - real as f64 / slots as f64
        }
    };
    let in_order: Vec<Vec<usize>> = (0..kept_lens.len())
        .collect::<Vec<_>>()
        .chunks(bs)
        .map(<[usize]>::to_vec)
        .collect();
    let padding_waste = waste(&in_order);
    // What the length-grouped sampler (seed 0, first epoch) would produce.
    let padding_waste_grouped = waste(&batch_indices(&kept_lens, bs, true, true, 0, 0));
    let owned: Vec<TokenizedSample> = kept.iter().map(|s| (*s).clone()).collect();
    let packed = if owned.is_empty() {
        0
    } else {
        pack(&owned, max_length).len()
    };
    let packing_efficiency = if packed == 0 {
        0.0
    } else {
        total_tokens as f64 / (packed * max_length) as f64
    };
    DataStats {
        num_rows: rows.len(),
        num_samples: kept.len(),
        num_dropped: rows.len() - kept.len(),
        total_tokens,
        trained_tokens: trained,
        trained_fraction: ratio(trained, total_tokens),
        num_truncated,
        truncated_fraction: ratio(num_truncated, rows.len()),
        num_completion_truncated: rows.iter().filter(|r| r.completion_truncated).count(),
        mean_length: if lens.is_empty() {
            0.0
        } else {
            lens.iter().sum::<usize>() as f64 / lens.len() as f64
        },
        median_length: lens.get(lens.len() / 2).copied().unwrap_or(0),
        max_length_seen: max_seen,
        longest_kept_tokens: kept_lens.iter().copied().max().unwrap_or(0),
        histogram: histogram(&lens, max_length),
        batch_size: bs,
        trained_tokens_largest_first: largest_trained_counts(kept.iter().copied()),
        padding_waste,
        padding_waste_grouped,
        packed_sequences: packed,
        packing_efficiency,
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// About 24 bins covering every length and the cutoff, with a round width.
fn histogram(lens: &[usize], cutoff: usize) -> LengthHistogram {
    let top = lens.iter().copied().max().unwrap_or(0).max(cutoff).max(1);
    let raw = top.div_ceil(24).max(1);
    // Round the width to 1, 2 or 5 × a power of ten.
    let mut width = 1;
    'outer: for mag in [1usize, 10, 100, 1000, 10_000, 100_000, 1_000_000] {
        for m in [1, 2, 5] {
            if m * mag >= raw {
                width = m * mag;
                break 'outer;
            }
        }
    }
    let bins = top / width + 1;
    let mut counts = vec![0; bins];
    for &l in lens {
        counts[(l / width).min(bins - 1)] += 1;
    }
    LengthHistogram {
        bin_width: width,
        counts,
        cutoff,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::labels::IGNORE_INDEX;

    fn sample(trained: usize, masked: usize) -> TokenizedSample {
        let n = 1 + masked + trained;
        let mut labels = vec![IGNORE_INDEX; 1 + masked];
        labels.extend((0..trained).map(|i| i as i64));
        TokenizedSample {
            row: 0,
            input_ids: vec![0; n],
            labels,
            weights: None,
            segments: vec![n],
            rows: vec![0],
        }
    }

    /// Largest first, whatever the samples' order; the first `b` sum to the fullest batch.
    #[test]
    fn trained_counts_come_largest_first() {
        let samples: Vec<TokenizedSample> = [(5, 50), (90, 1), (7, 0), (60, 30), (1, 0)]
            .iter()
            .map(|&(t, m)| sample(t, m))
            .collect();
        assert_eq!(largest_trained_counts(samples.iter()), [90, 60, 7, 5, 1]);
        assert!(largest_trained_counts(std::iter::empty()).is_empty());
    }
}
