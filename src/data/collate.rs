//! Collation for causal LMs: right padding to the longest row of the batch
//! rounded up to a multiple of 8 (capped at `max_length`), labels padded
//! with -100, and a seeded batch sampler with optional length grouping.
//!
//! Labels stay *unshifted* (`labels[i]` is the target for token `i`); the
//! model shifts them, as transformers' causal LMs do. There is no seq2seq
//! collation here on purpose.

use crate::data::labels::{TokenizedSample, IGNORE_INDEX};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// Padding settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollateOptions {
    /// Id written at padded positions ([`crate::data::TokenizerBundle::pad`]).
    pub pad_id: u32,
    /// Longest sequence allowed (rows are already truncated to it).
    pub max_length: usize,
    /// Round the padded length up to a multiple of this (8 suits tensor cores).
    pub pad_to_multiple_of: usize,
}

impl CollateOptions {
    /// `pad_to_multiple_of` = 8.
    pub fn new(pad_id: u32, max_length: usize) -> Self {
        CollateOptions {
            pad_id,
            max_length,
            pad_to_multiple_of: 8,
        }
    }
}

/// A padded batch, row-major `[batch_size, seq_len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Token ids, `[b*t]`.
    pub input_ids: Vec<u32>,
    /// 1 = real token, 0 = padding, `[b*t]`.
    pub attention_mask: Vec<u32>,
    /// Labels (unshifted; -100 = ignored, always at padding), `[b*t]`.
    pub labels: Vec<i64>,
    /// Per-token loss weights, `[b*t]`, when some sample has non-binary weights.
    pub weights: Option<Vec<f32>>,
    /// Rows.
    pub batch_size: usize,
    /// Padded length.
    pub seq_len: usize,
    /// Tokens the loss sees: labels at positions `1..` of each row that are
    /// not -100 (the model shifts labels left by one).
    pub num_trained_tokens: usize,
    /// Real (non-padding) tokens.
    pub num_real_tokens: usize,
    /// Source rows of each batch row (first row of a packed sequence).
    pub rows: Vec<usize>,
}

impl Batch {
    /// Padded positions.
    pub fn num_padding_tokens(&self) -> usize {
        self.batch_size * self.seq_len - self.num_real_tokens
    }

    /// `(input_ids u32 [b,t], attention_mask u32 [b,t], labels i64 [b,t])`.
    pub fn to_tensors(
        &self,
        device: &candle_core::Device,
    ) -> candle_core::Result<(
        candle_core::Tensor,
        candle_core::Tensor,
        candle_core::Tensor,
    )> {
        use candle_core::Tensor;
        let shape = (self.batch_size, self.seq_len);
        Ok((
            Tensor::from_slice(&self.input_ids, shape, device)?,
            Tensor::from_slice(&self.attention_mask, shape, device)?,
            Tensor::from_slice(&self.labels, shape, device)?,
        ))
    }

    /// The weights as an f32 `[b,t]` tensor, if any.
    pub fn weights_tensor(
        &self,
        device: &candle_core::Device,
    ) -> candle_core::Result<Option<candle_core::Tensor>> {
        self.weights
            .as_ref()
            .map(|w| candle_core::Tensor::from_slice(w, (self.batch_size, self.seq_len), device))
            .transpose()
    }
}

/// The padded length for rows whose longest is `longest`.
pub fn padded_len(longest: usize, opts: &CollateOptions) -> usize {
    let m = opts.pad_to_multiple_of.max(1);
    let rounded = longest.div_ceil(m) * m;
    rounded.min(opts.max_length.max(longest)).max(1)
}

/// Pads `samples` into one batch (rows longer than `max_length` are cut).
pub fn collate(samples: &[&TokenizedSample], opts: &CollateOptions) -> Batch {
    let b = samples.len();
    let longest = samples
        .iter()
        .map(|s| s.len().min(opts.max_length))
        .max()
        .unwrap_or(0);
    let t = padded_len(longest, opts);
    let any_weights = samples.iter().any(|s| s.weights.is_some());
    let mut input_ids = vec![opts.pad_id; b * t];
    let mut attention_mask = vec![0u32; b * t];
    let mut labels = vec![IGNORE_INDEX; b * t];
    let mut weights = any_weights.then(|| vec![0.0f32; b * t]);
    let mut trained = 0;
    let mut real = 0;
    for (r, s) in samples.iter().enumerate() {
        let n = s.len().min(t);
        let base = r * t;
        input_ids[base..base + n].copy_from_slice(&s.input_ids[..n]);
        labels[base..base + n].copy_from_slice(&s.labels[..n]);
        attention_mask[base..base + n].fill(1);
        if let Some(w) = weights.as_mut() {
            match &s.weights {
                Some(sw) => w[base..base + n].copy_from_slice(&sw[..n]),
                None => {
                    for i in 0..n {
                        w[base + i] = if s.labels[i] == IGNORE_INDEX {
                            0.0
                        } else {
                            1.0
                        };
                    }
                }
            }
        }
        trained += s.labels[..n]
            .iter()
            .skip(1)
            .filter(|&&l| l != IGNORE_INDEX)
            .count();
        real += n;
    }
    Batch {
        input_ids,
        attention_mask,
        labels,
        weights,
        batch_size: b,
        seq_len: t,
        num_trained_tokens: trained,
        num_real_tokens: real,
        rows: samples.iter().map(|s| s.row).collect(),
    }
}

/// Batches of sample indices for one epoch. Without grouping: a seeded
/// shuffle cut into batches. With `group_by_length` (as HF's
/// `LengthGroupedSampler`): shuffle, cut into mega-batches of 50 batches,
/// sort each by length (longest first), cut into batches, then shuffle the
/// batches while keeping the overall longest batch first (so an
/// out-of-memory shows up at step 1). The last batch may be smaller.
/// Deterministic for a given `(seed, epoch)`.
pub fn batch_indices(
    lengths: &[usize],
    batch_size: usize,
    group_by_length: bool,
    shuffle: bool,
    seed: u64,
    epoch: u64,
) -> Vec<Vec<usize>> {
    let bs = batch_size.max(1);
    let mut rng =
        rand::rngs::StdRng::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut idx: Vec<usize> = (0..lengths.len()).collect();
    if shuffle {
        idx.shuffle(&mut rng);
    }
    if !group_by_length {
        return idx.chunks(bs).map(<[usize]>::to_vec).collect();
    }
    let mega = bs * 50;
    let mut batches: Vec<Vec<usize>> = Vec::new();
    for chunk in idx.chunks(mega) {
        let mut c = chunk.to_vec();
        c.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
        batches.extend(c.chunks(bs).map(<[usize]>::to_vec));
    }
    if shuffle && batches.len() > 1 {
        let longest = batches
            .iter()
            .enumerate()
            .max_by_key(|(i, b)| {
                (
                    b.iter().map(|&j| lengths[j]).max().unwrap_or(0),
                    usize::MAX - i,
                )
            })
            .map(|(i, _)| i)
            .unwrap_or(0);
        let first = batches.swap_remove(longest);
        batches.shuffle(&mut rng);
        batches.insert(0, first);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(row: usize, n: usize) -> TokenizedSample {
        TokenizedSample {
            row,
            input_ids: vec![5; n],
            labels: (0..n)
                .map(|i| if i < 2 { IGNORE_INDEX } else { 5 })
                .collect(),
            weights: None,
            segments: vec![n],
            rows: vec![row],
        }
    }

    #[test]
    fn pads_to_multiple_of_8_capped() {
        let a = s(0, 3);
        let b = s(1, 10);
        let batch = collate(&[&a, &b], &CollateOptions::new(0, 64));
        assert_eq!(batch.seq_len, 16);
        assert_eq!(batch.input_ids.len(), 32);
        assert_eq!(&batch.attention_mask[..4], &[1, 1, 1, 0]);
        assert_eq!(batch.labels[3], IGNORE_INDEX);
        assert_eq!(batch.num_trained_tokens, 1 + 8);
        assert_eq!(batch.num_padding_tokens(), 32 - 13);
        let capped = collate(&[&b], &CollateOptions::new(0, 12));
        assert_eq!(capped.seq_len, 12);
        let (ids, mask, labels) = batch.to_tensors(&candle_core::Device::Cpu).unwrap();
        assert_eq!(ids.dims(), &[2, 16]);
        assert_eq!(mask.dtype(), candle_core::DType::U32);
        assert_eq!(labels.dtype(), candle_core::DType::I64);
    }

    #[test]
    fn sampler_is_deterministic_and_complete() {
        let lengths: Vec<usize> = (0..1000).map(|i| (i * 37) % 300).collect();
        let a = batch_indices(&lengths, 8, true, true, 7, 0);
        let b = batch_indices(&lengths, 8, true, true, 7, 0);
        assert_eq!(a, b);
        let mut all: Vec<usize> = a.concat();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>());
        assert_eq!(a[0].iter().map(|&i| lengths[i]).max(), Some(299));
        assert_ne!(a, batch_indices(&lengths, 8, true, true, 7, 1));
    }
}
