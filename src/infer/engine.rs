//! The inference forward pass: the decoder of [`crate::model`] re-run on plain (detached)
//! tensors with a key/value cache, so each generated token costs one position's work.
//!
//! The weights are views of a [`CausalLm`]'s parameters (same storage, no copy) with autograd
//! tracking cut off, so no backward graph is recorded. The math follows
//! [`crate::model::decoder`] op for op (same fused kernels, same RoPE tables, same
//! grouped-query layout), which is what keeps the first step's logits equal to
//! [`CausalLm::logits`].

use super::error::InferError;
use crate::model::{ops, rope_inv_freq, CausalLm, ModelConfig, ModelError};
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// The LoRA factors of one linear layer (kept unmerged).
#[derive(Clone)]
struct Lora {
    /// `[r, in]`.
    a: Tensor,
    /// `[out, r]`.
    b: Tensor,
    /// `alpha / r`.
    scale: f64,
}

/// `y = x Wᵀ (+ b) (+ scale · x Aᵀ Bᵀ)` on detached tensors.
#[derive(Clone)]
struct Linear {
    /// `[out, in]`.
    w: Tensor,
    b: Option<Tensor>,
    lora: Option<Lora>,
    /// The quantized base weight (QLoRA); `w` is then an empty placeholder on its device.
    quant: Option<Arc<QTensor>>,
}

impl Linear {
    /// `x`: `[n, in]` → `[n, out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor, InferError> {
        // The frozen-linear kernel multiplies straight out of the weight's storage and starts
        // from the bias: one pass, no transpose copy, no graph.
        let mut y = match &self.quant {
            // Dequantized for the call only (the training op's numerics: the first step's
            // logits stay equal to `CausalLm::logits`).
            Some(q) => {
                let w = q.dequantize(x.device())?.to_dtype(x.dtype())?;
                ops::frozen_linear(x, &w, self.b.as_ref())?
            }
            None => ops::frozen_linear(x, &self.w, self.b.as_ref())?,
        };
        if let Some(l) = &self.lora {
            let delta = ops::frozen_linear(&ops::frozen_linear(x, &l.a, None)?, &l.b, None)?;
            y = (y + (delta * l.scale)?)?;
        }
        Ok(y)
    }
}

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
    /// `Some(window)` for layers with sliding-window attention.
    window: Option<usize>,
    device: Device,
}

/// A decoder ready for generation: detached weights plus the per-architecture constants.
///
/// Cheap to share across threads (`Send + Sync`); each generation owns its [`KvCache`].
pub struct InferModel {
    config: ModelConfig,
    dtype: DType,
    device: Device,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Vec<f32>,
}

/// The keys and values of every layer for the positions seen so far, for `rows` sequences
/// that advance together (one for a generation; a GRPO group's completions after their shared
/// prompt, [`KvCache::repeat_rows`]).
///
/// Buffers are `[rows, kv_heads, capacity, head_dim]` and grow by doubling; keys are stored
/// after RoPE, so a cached position never needs recomputing.
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
    capacity: usize,
    rows: usize,
}

impl KvCache {
    /// Number of positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position (keeps the buffers).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keeps only the first `len` positions (to reuse a shared prompt prefix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Sequences the cache holds.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// A cache of `rows` sequences that each start with this one-sequence cache's positions
    /// (a prompt prefilled once, then decoded `rows` ways), with room for `capacity_tokens`
    /// positions.
    pub fn repeat_rows(&self, rows: usize, capacity_tokens: usize) -> Result<KvCache, InferError> {
        if self.rows != 1 {
            return Err(InferError::Model(ModelError::Input(format!(
                "only a one-sequence cache can be repeated (this one holds {})",
                self.rows
            ))));
        }
        let cap = capacity_tokens.max(self.len).max(1);
        let mut layers = Vec::with_capacity(self.layers.len());
        for slot in &self.layers {
            layers.push(match slot {
                None => None,
                Some((k, v)) => {
                    let repeat = |b: &Tensor| -> Result<Tensor, InferError> {
                        let (_, nkv, _, hd) = b.dims4()?;
                        let out = Tensor::zeros((rows, nkv, cap, hd), b.dtype(), b.device())?;
                        if self.len > 0 {
                            let prefix = b.narrow(2, 0, self.len)?;
                            let prefix = prefix.broadcast_as((rows, nkv, self.len, hd))?;
                            out.slice_set(&prefix.contiguous()?, 2, 0)?;
                        }
                        Ok(out)
                    };
                    Some((repeat(k)?, repeat(v)?))
                }
            });
        }
        Ok(KvCache {
            layers,
            len: self.len,
            capacity: cap,
            rows,
        })
    }

    /// Writes `k`, `v` (`[rows, kv_heads, t, head_dim]`) after the cached positions of `layer`
    /// and returns views of all `len + t` positions. [`KvCache::len`] advances only in
    /// [`KvCache::commit`], once every layer has appended.
    fn append(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor), InferError> {
        let (rows, nkv, t, hd) = k.dims4()?;
        let needed = self.len + t;
        let slot = &mut self.layers[layer];
        let grow = match slot {
            Some((kb, _)) => kb.dim(2)? < needed,
            None => true,
        };
        if grow {
            let old_cap = match slot {
                Some((kb, _)) => kb.dim(2)?,
                None => 0,
            };
            // Doubling keeps the copies of a long generation linear in its length.
            let cap = needed.max(self.capacity).max(2 * old_cap);
            let kb = Tensor::zeros((rows, nkv, cap, hd), k.dtype(), k.device())?;
            let vb = Tensor::zeros((rows, nkv, cap, hd), v.dtype(), v.device())?;
            if let (Some((ok, ov)), true) = (slot.as_ref(), self.len > 0) {
                kb.slice_set(&ok.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                vb.slice_set(&ov.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
            }
            *slot = Some((kb, vb));
        }
        let Some((kb, vb)) = slot.as_ref() else {
            return Err(InferError::Candle(candle_core::Error::Msg(
                "kv cache buffer missing after allocation (internal error)".into(),
            )));
        };
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        Ok((kb.narrow(2, 0, needed)?, vb.narrow(2, 0, needed)?))
    }

    fn commit(&mut self, t: usize) {
        self.len += t;
    }
}

/// The detached view of a parameter, or a clear error when the model lacks it.
fn param(model: &CausalLm, name: &str) -> Result<Tensor, InferError> {
    model
        .param(name)
        .map(|p| p.var.as_detached_tensor())
        .ok_or_else(|| {
            InferError::Model(ModelError::MissingTensor {
                name: name.to_string(),
                file: "(model parameters)".into(),
            })
        })
}

fn opt_param(model: &CausalLm, name: &str) -> Option<Tensor> {
    model.param(name).map(|p| p.var.as_detached_tensor())
}

fn linear(model: &CausalLm, prefix: &str) -> Result<Linear, InferError> {
    let wname = format!("{prefix}.weight");
    let quant = model.quantized_weight(&wname).cloned();
    let w = match &quant {
        Some(q) => Tensor::zeros(0, model.dtype(), &q.device())?,
        None => param(model, &wname)?,
    };
    let b = opt_param(model, &format!("{prefix}.bias"));
    let lora = match (
        model.lora_config(),
        opt_param(model, &format!("{prefix}.lora_A.weight")),
        opt_param(model, &format!("{prefix}.lora_B.weight")),
    ) {
        (Some(cfg), Some(a), Some(b)) => Some(Lora {
            a,
            b,
            scale: cfg.scale(),
        }),
        _ => None,
    };
    Ok(Linear { w, b, lora, quant })
}

/// The additive mask `[tq, tk]` (f32) for queries at positions `offset..offset+tq` over keys
/// `0..offset+tq`: causal, and within `window` when given (as transformers: `i - j < w`).
fn causal_mask(
    tq: usize,
    offset: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor, InferError> {
    let tk = offset + tq;
    let mut m = vec![0f32; tq * tk];
    for i in 0..tq {
        let pos = offset + i;
        for j in 0..tk {
            let mut ok = j <= pos;
            if let Some(w) = window {
                ok &= pos - j.min(pos) < w;
            }
            if !ok {
                m[i * tk + j] = f32::MIN;
            }
        }
    }
    Ok(Tensor::from_vec(m, (tq, tk), device)?)
}

impl InferModel {
    /// Views `model`'s parameters (no copy) for generation; an attached LoRA adapter stays
    /// unmerged. Later changes to the model's weights (training steps) are seen too, since
    /// the storage is shared.
    pub fn from_causal_lm(model: &CausalLm) -> Result<Self, InferError> {
        if model.layer_weights_released() {
            return Err(ModelError::Input(
                "the model's decoder layers are divided over ZeRO-3 ranks: gather them first (`TrainingRun::gather_weights`)".into(),
            )
            .into());
        }
        let config = model.config().clone();
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let q = linear(model, &format!("{p}.self_attn.q_proj"))?;
            let device = q.w.device().clone();
            layers.push(Layer {
                q,
                k: linear(model, &format!("{p}.self_attn.k_proj"))?,
                v: linear(model, &format!("{p}.self_attn.v_proj"))?,
                o: linear(model, &format!("{p}.self_attn.o_proj"))?,
                gate: linear(model, &format!("{p}.mlp.gate_proj"))?,
                up: linear(model, &format!("{p}.mlp.up_proj"))?,
                down: linear(model, &format!("{p}.mlp.down_proj"))?,
                input_norm: param(model, &format!("{p}.input_layernorm.weight"))?,
                post_norm: param(model, &format!("{p}.post_attention_layernorm.weight"))?,
                window: config.layer_sliding_window(l),
                device,
            });
        }
        let embed = param(model, "model.embed_tokens.weight")?;
        let lm_head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            param(model, "lm_head.weight")?
        };
        Ok(Self {
            inv_freq: rope_inv_freq(&config),
            dtype: model.dtype(),
            device: model.device().clone(),
            norm: param(model, "model.norm.weight")?,
            embed,
            layers,
            lm_head,
            config,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The dtype the weights are held in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// An empty cache sized for `capacity_tokens` positions (it grows if needed).
    pub fn new_cache(&self, capacity_tokens: usize) -> KvCache {
        KvCache {
            layers: (0..self.layers.len()).map(|_| None).collect(),
            len: 0,
            capacity: capacity_tokens.max(1),
            rows: 1,
        }
    }

    /// `cos`, `sin` `[t, head_dim]` for positions `offset..offset+t`, computed exactly as the
    /// training model's tables (f32 products of position and inverse frequency).
    fn rope_tables(
        &self,
        offset: usize,
        t: usize,
        device: &Device,
    ) -> Result<(Tensor, Tensor), InferError> {
        let half = self.inv_freq.len();
        let d = 2 * half;
        let mut cos = vec![0f32; t * d];
        let mut sin = vec![0f32; t * d];
        for i in 0..t {
            let p = (offset + i) as f32;
            for (j, f) in self.inv_freq.iter().enumerate() {
                let (s, c) = (p * f).sin_cos();
                cos[i * d + j] = c;
                cos[i * d + half + j] = c;
                sin[i * d + j] = s;
                sin[i * d + half + j] = s;
            }
        }
        let cos = Tensor::from_vec(cos, (t, d), device)?.to_dtype(self.dtype)?;
        let sin = Tensor::from_vec(sin, (t, d), device)?.to_dtype(self.dtype)?;
        Ok((cos, sin))
    }

    /// Runs `ids` (the positions after those in `cache`, row after row: `cache.rows()` rows of
    /// `ids.len() / rows` positions) through the decoder, appending them to the cache; returns
    /// the final hidden states `[rows · t, hidden]`.
    fn hidden(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor, InferError> {
        let rows = cache.rows.max(1);
        if ids.is_empty() {
            return Err(InferError::EmptyPrompt);
        }
        if !ids.len().is_multiple_of(rows) {
            return Err(InferError::Model(ModelError::Input(format!(
                "{} token ids do not split into the cache's {rows} rows",
                ids.len()
            ))));
        }
        let t = ids.len() / rows;
        let vocab = self.config.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(InferError::Model(ModelError::Input(format!(
                "token id {bad} is out of range for this model's vocab_size {vocab} (tokenizer and model do not match?)"
            ))));
        }
        if cache.layers.len() != self.layers.len() {
            return Err(InferError::Model(ModelError::Input(format!(
                "the kv cache has {} layers but the model has {}: make the cache with this model's new_cache",
                cache.layers.len(),
                self.layers.len()
            ))));
        }
        let offset = cache.len;
        let ids_t = Tensor::new(ids, &self.device)?;
        let mut h = self.embed.index_select(&ids_t, 0)?; // [rows · t, hidden]

        // Per-device tables and masks (layers may sit on several devices).
        struct DevCtx {
            device: Device,
            cos: Tensor,
            sin: Tensor,
            full_mask: Option<Tensor>,
            window_mask: Option<Tensor>,
        }
        let mut ctxs: Vec<DevCtx> = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            if !h.device().same_device(&layer.device) {
                h = h.to_device(&layer.device)?;
            }
            let ci = match ctxs
                .iter()
                .position(|c| c.device.same_device(&layer.device))
            {
                Some(i) => i,
                None => {
                    let (cos, sin) = self.rope_tables(offset, t, &layer.device)?;
                    ctxs.push(DevCtx {
                        device: layer.device.clone(),
                        cos,
                        sin,
                        full_mask: None,
                        window_mask: None,
                    });
                    ctxs.len() - 1
                }
            };
            // A single query sees every cached key (or the last `window` of them), so it
            // needs no mask; a block of queries needs the causal (and window) mask.
            let mask = if t == 1 {
                None
            } else {
                let c = &mut ctxs[ci];
                let slot = if layer.window.is_some() {
                    &mut c.window_mask
                } else {
                    &mut c.full_mask
                };
                if slot.is_none() {
                    *slot = Some(causal_mask(t, offset, layer.window, &layer.device)?);
                }
                slot.clone()
            };
            let c = &ctxs[ci];
            h = self.layer_forward(li, layer, &h, &c.cos, &c.sin, mask.as_ref(), cache)?;
        }
        cache.commit(t);
        if !h.device().same_device(&self.device) {
            h = h.to_device(&self.device)?;
        }
        Ok(ops::rms_norm(&h, &self.norm, self.config.rms_norm_eps)?)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        li: usize,
        layer: &Layer,
        h: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: &mut KvCache,
    ) -> Result<Tensor, InferError> {
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rows = cache.rows.max(1);
        let t = h.dim(0)? / rows;
        let x = ops::rms_norm(h, &layer.input_norm, c.rms_norm_eps)?;
        let heads = |y: Tensor, n: usize| -> Result<Tensor, InferError> {
            Ok(y.reshape((rows, t, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        let q = heads(layer.q.forward(&x)?, nh)?;
        let k = heads(layer.k.forward(&x)?, nkv)?;
        let v = heads(layer.v.forward(&x)?, nkv)?;
        let q = ops::rope(&q, cos, sin)?;
        let k = ops::rope(&k, cos, sin)?;
        let (mut k_all, mut v_all) = cache.append(li, &k, &v)?;
        let tk_full = k_all.dim(2)?;
        // A single query of a sliding layer only sees the last `window` keys.
        let mask = match (layer.window, mask) {
            (Some(w), None) if tk_full > w => {
                k_all = k_all.narrow(2, tk_full - w, w)?;
                v_all = v_all.narrow(2, tk_full - w, w)?;
                None
            }
            (_, m) => m,
        };
        let tk = k_all.dim(2)?;
        // Grouped-query attention as in the training decoder: the `rep` query heads of one
        // kv head are stacked along time ([rows, nkv, rep*t, hd]), q's memory order already.
        let rep = nh / nkv;
        let q = q.reshape((rows, nkv, rep * t, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut scores = (q.matmul(&k_all.t()?)? * scale)?.to_dtype(DType::F32)?;
        if let Some(m) = mask {
            scores = scores
                .reshape((rows, nkv, rep, t, tk))?
                .broadcast_add(m)?
                .reshape((rows, nkv, rep * t, tk))?;
        }
        let probs = ops::softmax_last_dim(&scores)?.to_dtype(self.dtype)?;
        let o = probs.matmul(&v_all)?; // [rows, nkv, rep*t, hd] == [rows, nh, t, hd]
        let o = o
            .reshape((rows, nh, t, hd))?
            .transpose(1, 2)?
            .reshape((rows * t, nh * hd))?;
        let h = (h + layer.o.forward(&o)?)?;
        let x = ops::rms_norm(&h, &layer.post_norm, c.rms_norm_eps)?;
        let a = ops::silu_mul(&layer.gate.forward(&x)?, &layer.up.forward(&x)?)?;
        Ok((&h + layer.down.forward(&a)?)?)
    }

    /// Feeds `ids` after the cached positions and returns the logits of the LAST position
    /// (`vocab_size` f32 values). The head runs on that one row only. `cache` holds one
    /// sequence ([`InferModel::new_cache`]).
    pub fn forward(&self, ids: &[u32], cache: &mut KvCache) -> Result<Vec<f32>, InferError> {
        one_row(cache)?;
        let h = self.hidden(ids, cache)?;
        let t = h.dim(0)?;
        let last = h.narrow(0, t - 1, 1)?;
        let logits = ops::frozen_linear(&last, &self.lm_head, None)?.to_dtype(DType::F32)?;
        Ok(logits.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Like [`InferModel::forward`] but returns the logits of every fed position,
    /// `[t, vocab]` f32 (for tests and scoring).
    pub fn forward_all(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor, InferError> {
        one_row(cache)?;
        let h = self.hidden(ids, cache)?;
        Ok(ops::frozen_linear(&h, &self.lm_head, None)?.to_dtype(DType::F32)?)
    }

    /// One decode step of every sequence of a many-row cache ([`KvCache::repeat_rows`]): `ids`
    /// holds each row's next token; returns each row's logits, `[rows, vocab]` f32. The rows'
    /// products run as one matrix product instead of `rows` matrix-vector products.
    pub fn forward_rows(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor, InferError> {
        if ids.len() != cache.rows {
            return Err(InferError::Model(ModelError::Input(format!(
                "{} token ids for a cache of {} rows: one id per row",
                ids.len(),
                cache.rows
            ))));
        }
        let h = self.hidden(ids, cache)?;
        Ok(ops::frozen_linear(&h, &self.lm_head, None)?.to_dtype(DType::F32)?)
    }
}

/// A one-sequence cache, or the error that says which call takes a many-row one.
fn one_row(cache: &KvCache) -> Result<(), InferError> {
    if cache.rows == 1 {
        return Ok(());
    }
    Err(InferError::Model(ModelError::Input(format!(
        "this cache holds {} sequences: decode them with forward_rows",
        cache.rows
    ))))
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<InferModel>();
    f::<KvCache>();
}
