//! One decoder layer on the graph path: its linear layers (with LoRA and adapter dropout),
//! attention with RoPE and the causal (sliding-window) mask, and the MLP.

use super::super::config::ModelConfig;
use super::super::error::ModelError;
use super::super::kernels;
use super::super::layer_weights::{dropout_mask, lora_dropout_seed, Linear};
use super::*;
use candle_core::{DType, Device, Tensor};

/// RoPE inverse frequencies as transformers computes them (in f32), with the llama3
/// adjustment when configured.
pub fn rope_inv_freq(config: &ModelConfig) -> Vec<f32> {
    let dim = config.head_dim;
    let base = config.rope_theta as f32;
    let mut inv: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / dim as f32))
        .collect();
    if let Some(s) = &config.rope_scaling {
        let old = s.original_max_position_embeddings as f32;
        let (factor, lo, hi) = (
            s.factor as f32,
            s.low_freq_factor as f32,
            s.high_freq_factor as f32,
        );
        let low_wavelen = old / lo;
        let high_wavelen = old / hi;
        for f in inv.iter_mut() {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            let scaled = if wavelen > low_wavelen {
                *f / factor
            } else {
                *f
            };
            let smooth = (old / wavelen - lo) / (hi - lo);
            let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
            let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
            *f = if medium { smoothed } else { scaled };
        }
    }
    inv
}

/// `cos`, `sin` tables `[t, head_dim]` for positions `0..t` (HF `emb = cat(freqs, freqs)`).
pub(super) fn rope_tables(
    config: &ModelConfig,
    t: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor), ModelError> {
    let inv = rope_inv_freq(config);
    let half = inv.len();
    let d = 2 * half;
    let mut cos = vec![0f32; t * d];
    let mut sin = vec![0f32; t * d];
    for p in 0..t {
        for (i, f) in inv.iter().enumerate() {
            let a = p as f32 * f;
            let (s, c) = a.sin_cos();
            cos[p * d + i] = c;
            cos[p * d + half + i] = c;
            sin[p * d + i] = s;
            sin[p * d + half + i] = s;
        }
    }
    let cos = Tensor::from_vec(cos, (t, d), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (t, d), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// The additive attention mask `[b or 1, 1, 1, t, t]` (f32): query i sees key j when
/// j <= i, i - j < window (if any) and key j is not padding. A padded query still sees
/// the real tokens before it, as in transformers, so its logits stay finite.
pub(super) fn build_attention_mask(
    padding: Option<&[Vec<u32>]>,
    b: usize,
    t: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor, ModelError> {
    let rows = if padding.is_some() { b } else { 1 };
    let mut m = vec![0f32; rows * t * t];
    for r in 0..rows {
        for i in 0..t {
            for j in 0..t {
                let mut ok = j <= i;
                if let Some(w) = window {
                    ok &= i - j.min(i) < w;
                }
                if let Some(p) = padding {
                    ok &= p[r][j] != 0;
                }
                if !ok {
                    m[(r * t + i) * t + j] = f32::MIN;
                }
            }
        }
    }
    Ok(Tensor::from_vec(m, (rows, 1, 1, t, t), device)?)
}

/// Dropout with a mask drawn from `seed` (so recomputation reproduces it).
pub(super) fn dropout(x: &Tensor, p: f64, seed: u64) -> Result<Tensor, ModelError> {
    let mask = dropout_mask(x.elem_count(), p, seed);
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok((x * mask)?)
}

impl Linear {
    /// `x`: `[n, in]` → `[n, out]`.
    pub(crate) fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor, ModelError> {
        let mut y = if let Some(q) = &self.quant {
            super::super::quant::quant_linear(x, q, ctx.ops)?
        } else if self.frozen {
            kernels::frozen_linear(x, &self.w, ctx.ops)?
        } else {
            x.matmul(&self.w.t()?)?
        };
        if let Some(b) = &self.b {
            y = y.broadcast_add(b)?;
        }
        if let Some(l) = self.lora.as_ref().filter(|_| ctx.adapters) {
            let xin = match ctx.dropout_seed {
                Some(seed) if l.dropout > 0.0 => {
                    dropout(x, l.dropout, lora_dropout_seed(seed, self.key))?
                }
                _ => x.clone(),
            };
            let delta = xin.matmul(&l.a.t()?)?.matmul(&l.b.t()?)?;
            y = (y + (delta * l.scale)?)?;
        }
        Ok(y)
    }
}

impl Layer {
    fn attention(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor, ModelError> {
        let (b, t, hidden) = x.dims3()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let x2 = x.reshape((b * t, hidden))?;
        let q = self
            .q
            .forward(&x2, ctx)?
            .reshape((b, t, nh, hd))?
            .transpose(1, 2)?;
        let k = self
            .k
            .forward(&x2, ctx)?
            .reshape((b, t, nkv, hd))?
            .transpose(1, 2)?;
        let v = self
            .v
            .forward(&x2, ctx)?
            .reshape((b, t, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = kernels::rope(&q.contiguous()?, &ctx.cos, &ctx.sin, ctx.ops)?;
        let k = kernels::rope(&k.contiguous()?, &ctx.cos, &ctx.sin, ctx.ops)?;
        // Grouped-query attention without repeating k/v: the `rep` query heads sharing a kv
        // head are stacked along the time axis ([b, nkv, rep*t, hd]), which is q's memory
        // order already, so one batched matmul per kv head does the work.
        let rep = nh / nkv;
        let q = q.contiguous()?.reshape((b, nkv, rep * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let scores = scores
            .to_dtype(DType::F32)?
            .reshape((b, nkv, rep, t, t))?
            .broadcast_add(match (&ctx.sliding_mask, self.sliding) {
                (Some(m), true) => m,
                _ => &ctx.mask,
            })?;
        let probs = kernels::softmax_last_dim(&scores, ctx.ops)?
            .to_dtype(x.dtype())?
            .reshape((b, nkv, rep * t, t))?;
        let o = probs.matmul(&v)?; // [b, nkv, rep*t, hd] == [b, nh, t, hd]
        let o = o
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?
            .reshape((b * t, nh * hd))?;
        Ok(self.o.forward(&o, ctx)?.reshape((b, t, hidden))?)
    }

    fn mlp(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor, ModelError> {
        let (b, t, hidden) = x.dims3()?;
        let x2 = x.reshape((b * t, hidden))?;
        let g = self.gate.forward(&x2, ctx)?;
        let u = self.up.forward(&x2, ctx)?;
        let a = kernels::silu_mul(&g, &u, ctx.ops)?;
        Ok(self.down.forward(&a, ctx)?.reshape((b, t, hidden))?)
    }

    /// One decoder layer: pre-norm attention and MLP blocks with residuals.
    pub(crate) fn forward(&self, h: &Tensor, ctx: &Ctx) -> Result<Tensor, ModelError> {
        let x = kernels::rms_norm(h, &self.input_norm, self.eps, ctx.ops)?;
        let h = (h + self.attention(&x, ctx)?)?;
        let x = kernels::rms_norm(&h, &self.post_norm, self.eps, ctx.ops)?;
        Ok((&h + self.mlp(&x, ctx)?)?)
    }
}

/// Ids `[b, t]` as u32 on `device`, whatever integer dtype they came in.
pub(super) fn as_u32(t: &Tensor, what: &str) -> Result<Tensor, ModelError> {
    if t.rank() != 2 {
        return Err(ModelError::Input(format!(
            "{what} must be [batch, seq], got shape {:?}",
            t.dims()
        )));
    }
    match t.dtype() {
        DType::U32 => Ok(t.clone()),
        DType::U8 | DType::I64 | DType::I32 | DType::I16 => Ok(t.to_dtype(DType::U32)?),
        other => Err(ModelError::Input(format!(
            "{what} must hold integer ids, got dtype {other:?}"
        ))),
    }
}
