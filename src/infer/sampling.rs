//! Choosing the next token from logits: greedy, or sampling with temperature, top-k and
//! top-p, after a repetition penalty — in the order transformers applies them
//! (repetition penalty → temperature → top-k → top-p), seeded for reproducibility.
//!
//! The penalty and the sampling are candle-transformers'
//! ([`apply_repeat_penalty`], [`LogitsProcessor`] with its seeded `StdRng`). What stays here,
//! and why:
//! - greedy decoding uses [`argmax`], not the library's `Sampling::ArgMax`: candle's argmax
//!   starts from the first value and compares with `<`, so a NaN in position 0 wins and an
//!   all-NaN row yields token 0; ours skips NaN, returns `None` for a row with nothing to
//!   pick (the generator reports it) and takes the first of equal values, as torch does —
//!   the parity tests compare greedy output with transformers token for token;
//! - top-k *and* top-p together: the library's `TopKThenTopP` compares `top_p` with the
//!   top-k tokens' share of the *whole* distribution (and skips top-p when that share is
//!   below `top_p`), while transformers renormalises over the top-k tokens first. We mask
//!   everything outside the top k to `-inf` (`keep_top_k`) so the library's softmax
//!   renormalises, then let it apply top-k (a no-op) and top-p;
//! - non-finite logits become `-inf` before sampling (a NaN would make the library's
//!   weighted draw fail), and a row with no finite logit gives `None`.

use super::error::InferError;
use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use candle_transformers::utils::apply_repeat_penalty;

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
    /// candle-transformers' sampler, seeded with `params.seed` (unused when greedy).
    processor: LogitsProcessor,
    /// Tokens picked so far (the position in `forced_tokens`).
    picked: usize,
}

impl Sampler {
    /// A sampler seeded with `params.seed`.
    pub fn new(params: &SamplingParams) -> Self {
        Self {
            processor: LogitsProcessor::from_sampling(params.seed, library_sampling(params)),
            picked: 0,
            params: params.clone(),
        }
    }

    /// The next token for `logits` (one per vocabulary entry; modified in place by the
    /// penalty, and when sampling by the top-k mask), given every token so far (`context`:
    /// prompt + output) for the repetition penalty. `None` when no logit is finite.
    pub fn next_token(&mut self, logits: &mut [f32], context: &[u32]) -> Option<u32> {
        self.picked += 1;
        if let Some(&id) = self.params.forced_tokens.get(self.picked - 1) {
            return Some(id);
        }
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let penalised =
                apply_repeat_penalty(&cpu_tensor(logits)?, p.repetition_penalty as f32, context)
                    .and_then(|t| t.to_vec1::<f32>())
                    .ok()?;
            logits.copy_from_slice(&penalised);
        }
        if !p.is_sampling() {
            return argmax(logits);
        }
        if !logits.iter().any(|l| l.is_finite()) {
            return None;
        }
        for l in logits.iter_mut().filter(|l| !l.is_finite()) {
            *l = f32::NEG_INFINITY;
        }
        if p.top_k > 0 && p.top_p < 1.0 {
            keep_top_k(logits, p.top_k);
        }
        // The library fails only on weights it cannot draw from (non-finite after the
        // temperature): reported like non-finite logits.
        self.processor.sample(&cpu_tensor(logits)?).ok()
    }
}

/// The library's sampling mode for `params` (see the module doc for top-k with top-p).
fn library_sampling(params: &SamplingParams) -> Sampling {
    if !params.is_sampling() {
        return Sampling::ArgMax;
    }
    let temperature = params.temperature;
    let p = params.top_p;
    match (params.top_k, p < 1.0) {
        (0, false) => Sampling::All { temperature },
        (0, true) => Sampling::TopP { p, temperature },
        (k, false) => Sampling::TopK { k, temperature },
        (k, true) => Sampling::TopKThenTopP { k, p, temperature },
    }
}

fn cpu_tensor(values: &[f32]) -> Option<Tensor> {
    Tensor::from_slice(values, values.len(), &Device::Cpu).ok()
}

/// Sets every logit outside the `k` largest to `-inf` (ties: lower ids kept), so that a
/// softmax renormalises over the top k, as transformers' top-k warper does before top-p.
fn keep_top_k(logits: &mut [f32], k: usize) {
    if k == 0 || k >= logits.len() {
        return;
    }
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.select_nth_unstable_by(k - 1, |&a, &b| {
        logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
    });
    let mut kept = vec![f32::NEG_INFINITY; logits.len()];
    for &i in &ids[..k] {
        kept[i] = logits[i];
    }
    logits.copy_from_slice(&kept);
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

    fn sampled(params: &SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(params);
        (0..n)
            .map(|_| s.next_token(&mut logits.to_vec(), &[]).unwrap())
            .collect()
    }

    #[test]
    fn same_seed_same_draws_other_seed_other_draws() {
        let params = |seed| SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed,
            ..SamplingParams::default()
        };
        let logits = [0.0f32; 16];
        let a = sampled(&params(7), &logits, 64);
        assert_eq!(a, sampled(&params(7), &logits, 64));
        assert_ne!(a, sampled(&params(8), &logits, 64));
        // Uniform logits: the draws really are random, not one token.
        assert!(a.iter().any(|&t| t != a[0]));
    }

    #[test]
    fn top_k_then_top_p_renormalises_over_the_top_k_as_transformers() {
        // Tokens 0 and 1 hold 60 % and 40 % of the top-2 mass but only ~11 % of the whole
        // vocabulary's. Renormalised (transformers), top_p 0.5 keeps token 0 alone; measured
        // against the whole mass, top-p would keep both.
        let mut logits = vec![0.0f32; 100];
        logits[0] = 2.0;
        logits[1] = 2.0 - 1.5f32.ln();
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 0.5,
            ..SamplingParams::default()
        };
        assert!(sampled(&params, &logits, 100).iter().all(|&t| t == 0));
        // Top-k alone samples from both.
        let params = SamplingParams {
            top_p: 1.0,
            ..params
        };
        let draws = sampled(&params, &logits, 100);
        assert!(draws.contains(&0) && draws.contains(&1));
        assert!(draws.iter().all(|&t| t < 2));
    }

    #[test]
    fn non_finite_logits_are_never_picked() {
        let sampling = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        for params in [SamplingParams::greedy(1), sampling] {
            let mut s = Sampler::new(&params);
            assert_eq!(s.next_token(&mut [f32::NAN, f32::NAN], &[]), None);
            for _ in 0..20 {
                let mut logits = [f32::NAN, 1.0, f32::NEG_INFINITY];
                assert_eq!(s.next_token(&mut logits, &[]), Some(1));
            }
        }
    }

    #[test]
    fn forced_tokens_come_first() {
        let params = SamplingParams {
            forced_tokens: vec![2, 0],
            ..SamplingParams::greedy(4)
        };
        let mut s = Sampler::new(&params);
        let picks: Vec<_> = (0..3)
            .map(|_| s.next_token(&mut [0.0, 5.0, 1.0], &[]).unwrap())
            .collect();
        assert_eq!(picks, [2, 0, 1]);
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
