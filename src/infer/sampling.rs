//! Choosing the next token from logits: greedy, or sampling with temperature, top-k and
//! top-p, after a repetition penalty — in the order transformers applies them
//! (repetition penalty → temperature → top-k → top-p), seeded for reproducibility.

use super::error::InferError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;

/// How to generate: length limits, sampling knobs, stop conditions.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Most tokens to generate (at least 1).
    pub max_new_tokens: usize,
    /// Softmax temperature; `0` means greedy (always the most likely token).
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens whose probabilities sum to `top_p`
    /// (`1.0` = off). In `(0, 1]`.
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (`0` = off).
    pub top_k: usize,
    /// CTRL-style penalty on tokens already in the prompt or the output (`1.0` = off):
    /// positive logits are divided by it, negative ones multiplied.
    pub repetition_penalty: f64,
    /// Seed of the sampler's random generator (same seed, same settings, same output).
    pub seed: u64,
    /// Stop when the output contains one of these strings (the string itself is not output).
    pub stop_strings: Vec<String>,
    /// Stop at the model's end-of-sequence tokens (turn off to generate exactly
    /// `max_new_tokens`, e.g. for benchmarks).
    pub stop_on_eos: bool,
    /// Tokens output in this order instead of sampled ones, then sampling takes over
    /// (empty: off). A script for tests and demonstrations: it forces an answer through
    /// chosen tokens, e.g. single-byte tokens that split every CJK character.
    pub forced_tokens: Vec<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 0.7,
            top_p: 0.95,
            top_k: 50,
            repetition_penalty: 1.0,
            seed: 0,
            stop_strings: Vec::new(),
            stop_on_eos: true,
            forced_tokens: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of at most `max_new_tokens` tokens, no penalty, no stop strings.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            ..Self::default()
        }
    }

    /// Whether this samples (temperature > 0) rather than decoding greedily.
    pub fn is_sampling(&self) -> bool {
        self.temperature > 0.0
    }

    /// Checks every setting's range.
    pub fn validate(&self) -> Result<(), InferError> {
        let bad = |setting, message: String| Err(InferError::InvalidSetting { setting, message });
        if self.max_new_tokens == 0 {
            return bad(
                "max_new_tokens",
                "must be at least 1 (0 would generate nothing)".into(),
            );
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(
                "temperature",
                format!(
                    "{} is not allowed; use 0 for greedy decoding or a positive value such as 0.7",
                    self.temperature
                ),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(
                "top_p",
                format!("{} is outside (0, 1]; use 1.0 to turn it off", self.top_p),
            );
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(
                "repetition_penalty",
                format!(
                    "{} is not allowed; it must be positive (1.0 = off, 1.1 is typical)",
                    self.repetition_penalty
                ),
            );
        }
        if self.stop_strings.iter().any(String::is_empty) {
            return bad(
                "stop_strings",
                "an empty stop string would stop at once; remove it".into(),
            );
        }
        Ok(())
    }
}

/// Picks tokens from logits according to [`SamplingParams`]; owns the seeded generator.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Tokens picked so far (the position in `forced_tokens`).
    picked: usize,
    /// Scratch: (token, value) candidates.
    cand: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler seeded with `params.seed`.
    pub fn new(params: &SamplingParams) -> Self {
        Self {
            rng: StdRng::seed_from_u64(params.seed),
            picked: 0,
            params: params.clone(),
            cand: Vec::new(),
        }
    }

    /// The next token for `logits` (one per vocabulary entry; modified in place by the
    /// penalty), given every token so far (`context`: prompt + output) for the repetition
    /// penalty. `None` when no logit is finite.
    pub fn next_token(&mut self, logits: &mut [f32], context: &[u32]) -> Option<u32> {
        self.picked += 1;
        if let Some(&id) = self.params.forced_tokens.get(self.picked - 1) {
            return Some(id);
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let pen = p.repetition_penalty as f32;
            let seen: HashSet<u32> = context.iter().copied().collect();
            for id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / pen } else { *l * pen };
                }
            }
        }
        if !p.is_sampling() {
            return argmax(logits);
        }
        let inv_t = (1.0 / p.temperature) as f32;
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        if self.cand.is_empty() {
            return None;
        }
        let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            // Partial selection: only the k best need sorting.
            self.cand.select_nth_unstable_by(p.top_k - 1, desc);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_unstable_by(desc);
        let max = self.cand[0].1;
        let mut probs: Vec<f32> = self.cand.iter().map(|c| (c.1 - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        if p.top_p < 1.0 {
            // Keep the smallest prefix whose mass reaches top_p (the token crossing it too).
            let target = p.top_p as f32 * total;
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (i, q) in probs.iter().enumerate() {
                if cum >= target {
                    keep = i.max(1);
                    break;
                }
                cum += q;
            }
            probs.truncate(keep);
        }
        let mass: f32 = probs.iter().sum();
        let mut u = self.rng.gen::<f32>() * mass;
        for (i, q) in probs.iter().enumerate() {
            if u < *q {
                return Some(self.cand[i].0);
            }
            u -= q;
        }
        // Rounding left `u` just past the end: the last kept token.
        Some(self.cand[probs.len() - 1].0)
    }
}

/// Index of the largest finite value (the first one on ties, as torch's argmax).
pub fn argmax(values: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if !v.is_finite() && v != f32::INFINITY {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_skips_nan_and_takes_first_tie() {
        assert_eq!(argmax(&[1.0, f32::NAN, 3.0, 3.0]), Some(2));
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), None);
    }

    #[test]
    fn top_k_one_is_greedy_and_penalty_changes_choice() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(&params);
        let mut logits = vec![0.0, 2.0, 1.0];
        assert_eq!(s.next_token(&mut logits, &[]), Some(1));
        let params = SamplingParams {
            repetition_penalty: 4.0,
            ..SamplingParams::greedy(1)
        };
        let mut s = Sampler::new(&params);
        let mut logits = vec![0.0, 2.0, 1.0];
        // 2.0 / 4 = 0.5 < 1.0: the repeated token loses.
        assert_eq!(s.next_token(&mut logits, &[1]), Some(2));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(&params);
        // Token 0 holds ~84% of the mass: with top_p 0.5 it is the only candidate.
        for _ in 0..50 {
            let mut logits = vec![3.0, 1.0, 0.5, 0.0];
            assert_eq!(s.next_token(&mut logits, &[]), Some(0));
        }
    }

    #[test]
    fn validate_rejects_bad_settings() {
        assert!(SamplingParams::greedy(0).validate().is_err());
        let p = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert!(p.validate().is_err());
        let p = SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        };
        assert!(p.validate().is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }
}
