//! A micro-batch of rollouts as tensors: prompts left-padded (so every completion starts at
//! the same position, as TRL pads them), completions right-padded, on one device; and a
//! micro-batch cut into the passes of `grpo.generations_per_micro_step`.

use candle_core::{Device, Tensor};

use super::rollouts::Rollout;
use super::GrpoRun;
use crate::model::grpo::MicroBatchTotals;

/// One micro-batch's rows on a device.
#[derive(Debug)]
pub struct GrpoBatch {
    /// `[rows, prompt width]` u32, left-padded with the pad token.
    pub prompt_ids: Tensor,
    /// `[rows, prompt width]` u32, 0 on the padding.
    pub prompt_mask: Tensor,
    /// `[rows, completion width]` u32, right-padded with the pad token.
    pub completion_ids: Tensor,
    /// `[rows, completion width]` f32: 1 on trained completion tokens.
    pub completion_mask: Tensor,
    /// `[rows]` f32.
    pub advantages: Tensor,
    /// `[rows, completion width]` f32: the sampling policy's log-probabilities, when every row
    /// has them (`num_iterations > 1`), 0 on the padding.
    pub old_logps: Option<Tensor>,
    /// Rows.
    pub rows: usize,
    /// Prompt width + completion width.
    pub seq_len: usize,
}

/// One rank's micro-batch as the passes that run forward and backward one after another.
#[derive(Debug)]
pub struct GrpoPasses {
    /// Each pass's rows, collated (one pass unless `generations_per_micro_step` is below G).
    pub batches: Vec<GrpoBatch>,
    /// The micro-batch's rows and completion tokens, which every pass's loss divides by
    /// (`None` with one pass: its own are the micro-batch's).
    pub totals: Option<MicroBatchTotals>,
}

impl GrpoRun {
    /// `rows` (`groups` whole groups of G rows, in order) cut into the passes of
    /// `grpo.generations_per_micro_step`: consecutive runs of `groups × per pass` rows, so
    /// every pass has the same number of rows (and, while the groups are its rank's shard,
    /// the planner's `micro_batch × generations_per_micro_step`), each collated on `device`.
    pub fn passes(
        &self,
        rows: &[&Rollout],
        groups: usize,
        pad_id: u32,
        device: &Device,
    ) -> Result<GrpoPasses, candle_core::Error> {
        let passes = self.settings.passes_per_micro_step();
        let per_pass = (groups * self.settings.generations_per_pass()).max(1);
        if passes == 1 || rows.len() <= per_pass {
            return Ok(GrpoPasses {
                batches: vec![self.batch(rows, pad_id, device)?],
                totals: None,
            });
        }
        let batches = rows
            .chunks(per_pass)
            .map(|pass| self.batch(pass, pad_id, device))
            .collect::<Result<Vec<_>, _>>()?;
        let completion_tokens: f64 = rows
            .iter()
            .map(|r| r.mask.iter().map(|&m| f64::from(m)).sum::<f64>())
            .sum();
        Ok(GrpoPasses {
            batches,
            totals: Some(MicroBatchTotals {
                rows: rows.len(),
                completion_tokens,
            }),
        })
    }

    /// `rows` as one batch on `device`.
    pub fn batch(
        &self,
        rows: &[&Rollout],
        pad_id: u32,
        device: &Device,
    ) -> Result<GrpoBatch, candle_core::Error> {
        let n = rows.len();
        let prompt_w = rows
            .iter()
            .map(|r| self.prompts[r.prompt].prompt_ids.len())
            .max()
            .unwrap_or(0);
        let completion_w = rows
            .iter()
            .map(|r| r.completion_ids.len())
            .max()
            .unwrap_or(0);
        let mut prompt_ids = vec![pad_id; n * prompt_w];
        let mut prompt_mask = vec![0u32; n * prompt_w];
        let mut completion_ids = vec![pad_id; n * completion_w];
        let mut completion_mask = vec![0f32; n * completion_w];
        for (i, r) in rows.iter().enumerate() {
            let p = &self.prompts[r.prompt].prompt_ids;
            let start = i * prompt_w + prompt_w - p.len();
            prompt_ids[start..start + p.len()].copy_from_slice(p);
            prompt_mask[start..start + p.len()].fill(1);
            let c = i * completion_w;
            completion_ids[c..c + r.completion_ids.len()].copy_from_slice(&r.completion_ids);
            completion_mask[c..c + r.mask.len()].copy_from_slice(&r.mask);
        }
        let advantages: Vec<f32> = rows.iter().map(|r| r.advantage).collect();
        let old_logps = if !rows.is_empty() && rows.iter().all(|r| !r.old_logps.is_empty()) {
            let mut old = vec![0f32; n * completion_w];
            for (i, r) in rows.iter().enumerate() {
                old[i * completion_w..i * completion_w + r.old_logps.len()]
                    .copy_from_slice(&r.old_logps);
            }
            Some(Tensor::from_vec(old, (n, completion_w), device)?)
        } else {
            None
        };
        Ok(GrpoBatch {
            prompt_ids: Tensor::from_vec(prompt_ids, (n, prompt_w), device)?,
            prompt_mask: Tensor::from_vec(prompt_mask, (n, prompt_w), device)?,
            completion_ids: Tensor::from_vec(completion_ids, (n, completion_w), device)?,
            completion_mask: Tensor::from_vec(completion_mask, (n, completion_w), device)?,
            advantages: Tensor::from_vec(advantages, n, device)?,
            old_logps,
            rows: n,
            seq_len: prompt_w + completion_w,
        })
    }
}
