//! The Llama / Mistral / Qwen2 decoder: parameters, forward pass, loss and backward.
//!
//! Every op on the training path records a backward pass (no candle-nn fused op is used;
//! see [`super::reference_ops`] and [`super::ops`]). Parameters live in one list of
//! [`NamedParam`]s under their Hugging Face names; the modules used by the forward pass
//! are views of those Vars, rebuilt whenever trainability or placement changes.

use super::config::ModelConfig;
use super::error::ModelError;
use super::gradients::{Gradients, NamedParam};
use super::hub::ModelFiles;
use super::lora::LoraConfig;
use super::native_embedding;
use super::native_layer::{self, NativeCtx};
use super::ops;
use super::ops_mode::OpsMode;
use super::placed::{Home, Placed};
use super::weights::Checkpoint;
use super::{checkpoint, kernels};
use crate::settings::Quantization;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The HF name of the token embeddings (also the tied lm-head).
const EMBED_NAME: &str = "model.embed_tokens.weight";

/// Labels with this value are ignored by the loss (transformers' `ignore_index`).
pub use super::ops::IGNORE_INDEX;

/// Rows of the flattened sequence whose logits are computed together in the loss.
pub const LOSS_CHUNK_TOKENS: usize = 1024;

/// The summed token loss of a batch and how many tokens it covers.
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// Scalar f32, differentiable: the sum of the cross-entropies of every non-ignored
    /// (shifted) token. `sum / num_tokens` is exactly transformers' mean loss.
    pub sum: Tensor,
    /// Number of labels that were not -100 (after the causal shift).
    pub num_tokens: usize,
}

impl LossOutput {
    /// The mean loss as a number (sum / tokens), 0 when there is no token.
    pub fn mean(&self) -> Result<f64, ModelError> {
        if self.num_tokens == 0 {
            return Ok(0.0);
        }
        Ok(self.sum.to_dtype(DType::F64)?.to_scalar::<f64>()? / self.num_tokens as f64)
    }
}

/// The LoRA factors attached to one linear layer.
#[derive(Clone)]
pub(crate) struct LoraFactors {
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    /// `alpha / r`.
    pub scale: f64,
    /// Dropout probability on the adapter's input.
    pub dropout: f64,
}

/// A linear layer `y = x W^T (+ b) (+ LoRA)` as the forward pass sees it.
#[derive(Clone)]
pub(crate) struct Linear {
    /// `[out, in]`: the Var's tensor when trainable, a detached view when frozen.
    pub w: Tensor,
    pub b: Option<Tensor>,
    /// Frozen weights go through a matmul whose backward computes only the input gradient.
    pub frozen: bool,
    /// The quantized base weight (QLoRA, see [`super::quant`]); `w` is then an empty
    /// placeholder and the layer never runs as a native layer op.
    pub quant: Option<Arc<QTensor>>,
    pub lora: Option<LoraFactors>,
    /// Distinguishes dropout masks of different layers.
    pub key: u64,
}

/// What every layer of one forward pass shares.
pub(crate) struct Ctx {
    /// `[t, head_dim]`, model dtype.
    pub cos: Tensor,
    pub sin: Tensor,
    /// Additive f32 mask `[b or 1, 1, 1, t, t]`: 0 where allowed, f32::MIN where not.
    pub mask: Tensor,
    /// The same with the sliding window applied, for layers that use one.
    pub sliding_mask: Option<Tensor>,
    /// `Some(seed)` when LoRA dropout is active (training); the same seed recomputes the
    /// same masks in checkpointed layers.
    pub dropout_seed: Option<u64>,
    /// Whether the LoRA adapters add their update (false: the base alone, see
    /// [`CausalLm::without_adapters`]).
    pub adapters: bool,
    /// Which implementation runs each building block.
    pub ops: kernels::OpsKind,
    /// The tables native layers read, built by the first one.
    pub native: OnceLock<Arc<NativeCtx>>,
}

/// One decoder layer's weights.
pub(crate) struct Layer {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub input_norm: Tensor,
    pub post_norm: Tensor,
    pub eps: f64,
    /// Whether this layer uses the sliding-window mask.
    pub sliding: bool,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `(name, var tensor)` of the layer's trainable parameters (for checkpointed backward).
    pub trainable: Vec<(String, Tensor)>,
    pub device: Device,
    /// The logical device (stage) that owns it ([`Placed`]).
    pub owner: usize,
    /// A zero Var that makes checkpointed layers part of the graph even when their input
    /// carries no gradient (frozen embeddings under LoRA).
    pub anchor: Var,
}

/// The views of the parameters the forward pass uses.
pub(crate) struct Modules {
    pub embed: Tensor,
    pub layers: Vec<Arc<Layer>>,
    pub norm: Tensor,
    pub lm_head: Tensor,
    pub lm_head_frozen: bool,
}

/// A causal language model ready for training: parameters, forward, loss, backward.
pub struct CausalLm {
    pub(crate) config: ModelConfig,
    pub(crate) params: Vec<NamedParam>,
    pub(crate) index: HashMap<String, usize>,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) layer_devices: Vec<Device>,
    /// The logical device (stage index) of every layer: 0 unless the layers are split.
    pub(crate) layer_owners: Vec<usize>,
    pub(crate) checkpointing: bool,
    /// Which implementation runs each building block (native CPU kernels, device-generic
    /// ops, or the composite reference).
    pub(crate) ops: kernels::OpsKind,
    /// Run qualifying layers as one native op (see [`native_layer`]).
    pub(crate) native_layers: bool,
    pub(crate) lora: Option<LoraConfig>,
    /// Base linears stored quantized (QLoRA), by HF weight name; they are not in `params`.
    pub(crate) quantized: HashMap<String, Arc<QTensor>>,
    /// What `quantized` holds ([`Quantization::None`] for a dense base).
    pub(crate) quantization: Quantization,
    pub(crate) modules: Modules,
    /// Parameter gradients produced outside candle's graph: by native layers and inside
    /// checkpointed layers' backward passes.
    pub(crate) side_grads: Arc<Mutex<HashMap<String, Tensor>>>,
    /// Parameters whose gradient came (at least partly) through `side_grads` in the last
    /// backward: an accumulated gradient is handed back there rather than to candle's store.
    side_routed: Mutex<std::collections::HashSet<String>>,
    pub(crate) forward_counter: AtomicU64,
    pub(crate) dropout_seed_base: u64,
    /// The LoRA adapters are switched off: forward passes run the base alone (PEFT's
    /// `disable_adapter()`), read by every linear layer through [`Ctx::adapters`].
    adapters_disabled: AtomicBool,
    /// What `base_model_name_or_path` says when an adapter is saved.
    pub(crate) source: String,
}

fn is_no_decay(name: &str) -> bool {
    name.ends_with(".bias") || name.ends_with("norm.weight")
}

/// Normal(0, std) samples, generated in parallel chunks each seeded from (seed, chunk)
/// so the result does not depend on the thread count.
pub(crate) fn normal_vec(n: usize, std: f64, seed: u64) -> Vec<f32> {
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(
                seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (ci as u64).wrapping_add(1),
            );
            let mut i = 0;
            while i < chunk.len() {
                // Box-Muller: two independent normals from two uniforms.
                let u1: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
                let u2: f64 = rng.gen();
                let r = (-2.0 * u1.ln()).sqrt() * std;
                let th = std::f64::consts::TAU * u2;
                chunk[i] = (r * th.cos()) as f32;
                if i + 1 < chunk.len() {
                    chunk[i + 1] = (r * th.sin()) as f32;
                }
                i += 2;
            }
        });
    out
}

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
fn rope_tables(
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
fn build_attention_mask(
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

/// The dropout mask of `n` elements drawn from `seed`: `1 / (1 - p)` where an element is kept,
/// 0 where it is dropped. The graph path and the native layer op both draw it here, so the
/// same seed drops the same elements on either path (and again when a layer is recomputed).
pub(crate) fn dropout_mask(n: usize, p: f64, seed: u64) -> Vec<f32> {
    let keep = 1.0 - p;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            if rng.gen::<f64>() < keep {
                (1.0 / keep) as f32
            } else {
                0.0
            }
        })
        .collect()
}

/// The seed of one linear layer's adapter-dropout mask in the forward pass seeded `pass_seed`
/// (`key` tells the linear layers apart).
pub(crate) fn lora_dropout_seed(pass_seed: u64, key: u64) -> u64 {
    pass_seed ^ key.wrapping_mul(0xA24B_AED4_963E_E407)
}

/// Dropout with a mask drawn from `seed` (so recomputation reproduces it).
fn dropout(x: &Tensor, p: f64, seed: u64) -> Result<Tensor, ModelError> {
    let mask = dropout_mask(x.elem_count(), p, seed);
    let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
    Ok((x * mask)?)
}

impl Linear {
    /// `x`: `[n, in]` → `[n, out]`.
    pub(crate) fn forward(&self, x: &Tensor, ctx: &Ctx) -> Result<Tensor, ModelError> {
        let mut y = if let Some(q) = &self.quant {
            super::quant::quant_linear(x, q, ctx.ops)?
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
fn as_u32(t: &Tensor, what: &str) -> Result<Tensor, ModelError> {
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

impl CausalLm {
    fn from_params(
        config: ModelConfig,
        tensors: Vec<(String, Tensor)>,
        dtype: DType,
        device: &Device,
        source: String,
        quantized: (Quantization, HashMap<String, Arc<QTensor>>),
    ) -> Result<Self, ModelError> {
        let mut params = Vec::with_capacity(tensors.len());
        let mut index = HashMap::new();
        for (name, t) in tensors {
            index.insert(name.clone(), params.len());
            params.push(NamedParam {
                weight_decay: !is_no_decay(&name),
                var: Var::from_tensor(&t)?,
                trainable: true,
                name,
            });
        }
        let layer_devices = vec![device.clone(); config.num_hidden_layers];
        let layer_owners = vec![0; config.num_hidden_layers];
        let mut model = Self {
            modules: Modules {
                embed: Tensor::zeros(1, dtype, device)?,
                layers: vec![],
                norm: Tensor::zeros(1, dtype, device)?,
                lm_head: Tensor::zeros(1, dtype, device)?,
                lm_head_frozen: false,
            },
            config,
            params,
            index,
            dtype,
            device: device.clone(),
            layer_devices,
            layer_owners,
            checkpointing: false,
            ops: kernels::OpsKind::Fused,
            native_layers: true,
            lora: None,
            quantized: quantized.1,
            quantization: quantized.0,
            side_grads: Arc::new(Mutex::new(HashMap::new())),
            side_routed: Mutex::new(Default::default()),
            forward_counter: AtomicU64::new(0),
            dropout_seed_base: 0x5EED,
            adapters_disabled: AtomicBool::new(false),
            source,
        };
        model.set_ops_mode(OpsMode::from_env()?);
        model.rebuild()?;
        Ok(model)
    }

    /// Loads an HF model folder (`config.json` + safetensors), converting weights to `dtype`.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self, ModelError> {
        let files = ModelFiles::from_dir(dir)?;
        Self::load_files(&files, dtype, device)
    }

    /// Loads the files [`super::resolve_model`] found.
    pub fn load_files(
        files: &ModelFiles,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::load_files_quantized(files, dtype, device, Quantization::None)
    }

    /// Loads a model whose base linears are quantized as they are read (QLoRA, see
    /// [`super::quant`]): no dense copy of them is ever made on `device`. The quantized base is
    /// cached on disk ([`super::quant::cache`]) and read from there on later loads.
    pub fn load_files_quantized(
        files: &ModelFiles,
        dtype: DType,
        device: &Device,
        quantize: Quantization,
    ) -> Result<Self, ModelError> {
        let cache = super::quant::cache::cache_dir();
        Self::load_files_quantized_in(files, dtype, device, quantize, cache.as_deref())
    }

    /// [`CausalLm::load_files_quantized`] with the cache in `cache_dir` (`None`: no cache).
    pub fn load_files_quantized_in(
        files: &ModelFiles,
        dtype: DType,
        device: &Device,
        quantize: Quantization,
        cache_dir: Option<&Path>,
    ) -> Result<Self, ModelError> {
        check_dtype(dtype)?;
        let config = ModelConfig::from_file(&files.config)?;
        let ckpt = Checkpoint::open(&files.weights)?;
        let quantized = super::quant::cache::load_quantized(
            files, &config, &ckpt, quantize, device, cache_dir,
        )?;
        let mut tensors = Vec::new();
        for (name, shape) in config.parameter_shapes() {
            if quantized.contains_key(&name) {
                continue;
            }
            let t = ckpt.load(&name, Some(&shape), dtype, device)?;
            tensors.push((name, t));
        }
        Self::from_params(
            config,
            tensors,
            dtype,
            device,
            files.dir.display().to_string(),
            (quantize, quantized),
        )
    }

    /// A freshly initialised model like transformers' `_init_weights`: matrices from
    /// N(0, initializer_range), biases 0, norms 1. Deterministic for a seed.
    pub fn random_init(
        config: &ModelConfig,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        check_dtype(dtype)?;
        let std = config
            .raw
            .get("initializer_range")
            .and_then(|v| v.as_f64())
            .unwrap_or(0.02);
        let mut tensors = Vec::new();
        for (i, (name, shape)) in config.parameter_shapes().into_iter().enumerate() {
            let n: usize = shape.iter().product();
            let data = if name.ends_with("norm.weight") {
                vec![1f32; n]
            } else if name.ends_with(".bias") {
                vec![0f32; n]
            } else {
                normal_vec(n, std, seed.wrapping_add((i as u64) << 32))
            };
            let t = Tensor::from_vec(data, shape, device)?.to_dtype(dtype)?;
            tensors.push((name, t));
        }
        Self::from_params(
            config.clone(),
            tensors,
            dtype,
            device,
            "random-init".into(),
            (Quantization::None, HashMap::new()),
        )
    }

    /// The parsed configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Every parameter (HF names, model order, LoRA factors last).
    pub fn params(&self) -> &[NamedParam] {
        &self.params
    }

    /// Bytes of the weights as allocated: every parameter (frozen or trainable, adapters
    /// included) and the quantized base of a QLoRA model. Frozen views share their
    /// parameter's storage, so nothing is counted twice.
    pub fn weights_bytes(&self) -> u64 {
        let params: usize = self
            .params
            .iter()
            .map(|p| p.var.elem_count() * p.var.dtype().size_in_bytes())
            .sum();
        let quantized: usize = self
            .quantized
            .values()
            .map(|q| q.storage_size_in_bytes())
            .sum();
        (params + quantized) as u64
    }

    /// The parameter named `name`.
    pub fn param(&self, name: &str) -> Option<&NamedParam> {
        self.index.get(name).map(|&i| &self.params[i])
    }

    /// The dtype parameters are held in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device of the embeddings (and of everything when no layer split is set).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The device of the final norm and the head: the last layer's under a layer split.
    pub fn head_device(&self) -> &Device {
        self.layer_devices.last().unwrap_or(&self.device)
    }

    /// The logical device of the final norm and the head (the last layer's).
    pub fn head_home(&self) -> Home {
        Home {
            index: self.layer_owners.last().copied().unwrap_or(0),
            device: self.head_device().clone(),
        }
    }

    /// The logical device that owns parameter `name`: its layer's, the head's for the final
    /// norm and the head, the first stage's for the embeddings.
    pub fn param_owner(&self, name: &str) -> usize {
        match layer_of(name) {
            Some(l) => self.layer_owners.get(l).copied().unwrap_or(0),
            None if name == "model.norm.weight" || name == "lm_head.weight" => {
                self.head_home().index
            }
            None => 0,
        }
    }

    /// The active LoRA configuration, if an adapter is attached.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Runs `f` with the LoRA adapters switched off: every forward pass inside it is the base
    /// model's (PEFT's `with model.disable_adapter():`), the adapters' weights untouched —
    /// the linear layers read a flag, nothing is copied. The flag is restored when `f`
    /// returns (or unwinds). Without an adapter it is a plain call.
    pub fn without_adapters<R>(&self, f: impl FnOnce(&Self) -> R) -> R {
        struct Restore<'a>(&'a AtomicBool, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::Relaxed);
            }
        }
        let _restore = Restore(
            &self.adapters_disabled,
            self.adapters_disabled.swap(true, Ordering::Relaxed),
        );
        f(self)
    }

    /// Freezes every parameter: no gradient is computed for any of them again (a frozen
    /// reference model, such as DPO's `reference = "copy"`).
    pub fn freeze(&mut self) -> Result<(), ModelError> {
        for p in &mut self.params {
            p.trainable = false;
        }
        self.rebuild()
    }

    /// Whether forward passes include the LoRA adapters (false inside
    /// [`Self::without_adapters`]).
    pub fn adapters_enabled(&self) -> bool {
        !self.adapters_disabled.load(Ordering::Relaxed)
    }

    /// Recompute each decoder layer in backward instead of keeping its activations.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }

    /// Whether activation checkpointing is on.
    pub fn activation_checkpointing(&self) -> bool {
        self.checkpointing
    }

    /// Use the fused kernels (default) or the composite reference ops (for parity tests).
    /// Turning them on keeps the device-generic path when that was chosen.
    pub fn set_fused_ops(&mut self, on: bool) {
        self.ops = match (on && kernels::FUSED_AVAILABLE, self.ops) {
            (false, _) => kernels::OpsKind::Reference,
            (true, kernels::OpsKind::Generic) => kernels::OpsKind::Generic,
            (true, _) => kernels::OpsKind::Fused,
        };
    }

    /// Chooses the training-ops path: [`OpsMode::Generic`] runs the device-generic ops (what a
    /// GPU runs) on every device, the CPU included; `Auto`/`Native` the CPU native kernels where
    /// tensors are on the CPU. Models start in the mode `TUNESTUDIO_OPS` names.
    pub fn set_ops_mode(&mut self, mode: OpsMode) {
        self.ops = match mode {
            OpsMode::Generic => kernels::OpsKind::Generic,
            OpsMode::Auto | OpsMode::Native => kernels::OpsKind::Fused,
        };
    }

    /// The training-ops path in use (`Auto` also while the composite reference ops are forced).
    pub fn ops_mode(&self) -> OpsMode {
        match self.ops {
            kernels::OpsKind::Generic => OpsMode::Generic,
            _ => OpsMode::Auto,
        }
    }

    /// Whether the CPU native kernels (fused ops, native layers, side-table gradients) may run.
    fn native_kernels(&self) -> bool {
        self.ops == kernels::OpsKind::Fused
    }

    /// Runs each decoder layer that qualifies (CPU, f32, fused ops on: full fine-tuning or
    /// LoRA) as one native op with a hand-written backward instead
    /// of a graph of candle ops. On by default; off gives the graph path, which is the
    /// reference the native op is tested against.
    pub fn set_native_layers(&mut self, on: bool) {
        self.native_layers = on;
    }

    /// How many decoder layers the next training forward pass runs natively.
    pub fn native_layer_count(&self) -> usize {
        if !self.native_layers || !self.native_kernels() {
            return 0;
        }
        self.modules
            .layers
            .iter()
            .filter(|l| l.device.is_cpu() && native_layer::layer_qualifies(l))
            .count()
    }

    /// Sets the name saved as `base_model_name_or_path` in adapters.
    pub fn set_source_name(&mut self, name: &str) {
        self.source = name.to_string();
    }

    /// Places decoder layer i on `homes[i]` (pipeline split); embeddings stay on the
    /// model's device (stage 0), the final norm and an untied head move to the last layer's.
    /// Call before creating the optimizer: the moved parameters are new Vars.
    pub fn set_layer_devices(&mut self, homes: &[Home]) -> Result<(), ModelError> {
        let devices: Vec<Device> = homes.iter().map(|h| h.device.clone()).collect();
        if devices.len() != self.config.num_hidden_layers {
            return Err(ModelError::Input(format!(
                "set_layer_devices needs one device per layer: the model has {} layers, {} devices were given",
                self.config.num_hidden_layers,
                devices.len()
            )));
        }
        // The final norm and an untied head follow the last layer, as with
        // transformers' `device_map="auto"`; the planner counts them there too.
        let last = devices.last().unwrap_or(&self.device).clone();
        for p in self.params.iter_mut() {
            let dev = match layer_of(&p.name) {
                Some(layer) => &devices[layer],
                None if p.name == "model.norm.weight" || p.name == "lm_head.weight" => &last,
                None => continue,
            };
            if !p.var.device().same_device(dev) {
                p.var = Var::from_tensor(&p.var.as_tensor().to_device(dev)?)?;
            }
        }
        self.layer_devices = devices;
        self.layer_owners = homes.iter().map(|h| h.index).collect();
        self.place_quantized()?;
        self.rebuild()
    }

    /// The tensor the forward pass should use for a parameter: the Var itself when
    /// trainable, a detached view (same storage) when frozen.
    fn view(&self, name: &str) -> Result<(Tensor, bool), ModelError> {
        let p = self.param(name).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
            file: "(model parameters)".into(),
        })?;
        Ok(if p.trainable {
            (p.var.as_tensor().clone(), true)
        } else {
            (p.var.as_detached_tensor(), false)
        })
    }

    fn linear(
        &self,
        prefix: &str,
        key: u64,
        trainable: &mut Vec<(String, Tensor)>,
    ) -> Result<Linear, ModelError> {
        let wname = format!("{prefix}.weight");
        let quant = self.quantized.get(&wname).cloned();
        let (w, w_tr) = match &quant {
            Some(q) => (Tensor::zeros(0, self.dtype, &q.device())?, false),
            None => self.view(&wname)?,
        };
        if w_tr {
            trainable.push((wname, w.clone()));
        }
        let bname = format!("{prefix}.bias");
        let b = if self.index.contains_key(&bname) {
            let (b, tr) = self.view(&bname)?;
            if tr {
                trainable.push((bname, b.clone()));
            }
            Some(b)
        } else {
            None
        };
        let aname = format!("{prefix}.lora_A.weight");
        let lora = match (&self.lora, self.index.contains_key(&aname)) {
            (Some(cfg), true) => {
                let bname = format!("{prefix}.lora_B.weight");
                let (a, a_tr) = self.view(&aname)?;
                let (bm, b_tr) = self.view(&bname)?;
                if a_tr {
                    trainable.push((aname, a.clone()));
                }
                if b_tr {
                    trainable.push((bname, bm.clone()));
                }
                Some(LoraFactors {
                    a,
                    b: bm,
                    scale: cfg.scale(),
                    dropout: cfg.dropout,
                })
            }
            _ => None,
        };
        Ok(Linear {
            w,
            b,
            frozen: !w_tr,
            quant,
            lora,
            key,
        })
    }

    /// The parameter the lm-head reads: the embeddings when they are tied.
    fn head_param_name(&self) -> &'static str {
        if self.config.tie_word_embeddings {
            EMBED_NAME
        } else {
            "lm_head.weight"
        }
    }

    /// Rebuilds the forward-pass views after parameters, trainability or devices changed.
    pub(crate) fn rebuild(&mut self) -> Result<(), ModelError> {
        let (embed, _) = self.view(EMBED_NAME)?;
        let (norm, _) = self.view("model.norm.weight")?;
        let (lm_head, head_tr) = self.view(self.head_param_name())?;
        // A tied head reads the embeddings from the first device; the copy is
        // differentiable, so its gradient flows back to the embedding weight.
        let head_device = self.head_device().clone();
        let lm_head = if lm_head.device().same_device(&head_device) {
            lm_head
        } else {
            lm_head.to_device(&head_device)?
        };
        let mut layers = Vec::new();
        for l in 0..self.config.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut trainable = Vec::new();
            let key = |i: u64| (l as u64) * 16 + i;
            let q = self.linear(&format!("{p}.self_attn.q_proj"), key(0), &mut trainable)?;
            let k = self.linear(&format!("{p}.self_attn.k_proj"), key(1), &mut trainable)?;
            let v = self.linear(&format!("{p}.self_attn.v_proj"), key(2), &mut trainable)?;
            let o = self.linear(&format!("{p}.self_attn.o_proj"), key(3), &mut trainable)?;
            let gate = self.linear(&format!("{p}.mlp.gate_proj"), key(4), &mut trainable)?;
            let up = self.linear(&format!("{p}.mlp.up_proj"), key(5), &mut trainable)?;
            let down = self.linear(&format!("{p}.mlp.down_proj"), key(6), &mut trainable)?;
            let n1 = format!("{p}.input_layernorm.weight");
            let n2 = format!("{p}.post_attention_layernorm.weight");
            let (input_norm, tr1) = self.view(&n1)?;
            let (post_norm, tr2) = self.view(&n2)?;
            if tr1 {
                trainable.push((n1, input_norm.clone()));
            }
            if tr2 {
                trainable.push((n2, post_norm.clone()));
            }
            let device = self.layer_devices[l].clone();
            let owner = self.layer_owners[l];
            layers.push(Arc::new(Layer {
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
                input_norm,
                post_norm,
                eps: self.config.rms_norm_eps,
                sliding: self.config.layer_sliding_window(l).is_some(),
                num_heads: self.config.num_attention_heads,
                num_kv_heads: self.config.num_key_value_heads,
                head_dim: self.config.head_dim,
                trainable,
                anchor: Var::zeros(1, self.dtype, &device)?,
                device,
                owner,
            }));
        }
        self.modules = Modules {
            embed,
            layers,
            norm,
            lm_head,
            lm_head_frozen: !head_tr,
        };
        Ok(())
    }

    /// The token whose embedding lookups give the embedding matrix no gradient, as
    /// transformers' decoders build `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`
    /// (Llama, Mistral, Qwen2): `config.pad_token_id` when the embeddings are trained and it
    /// is in the vocabulary. Only the lookup's part of that row is dropped: a tied lm-head
    /// still trains it. With pad = eos, as in SmolLM2's and many chat models' configs, this
    /// is a real token (`<|im_end|>` ends every ChatML turn), and full fine-tuning through
    /// transformers never trains its input embedding — measured on
    /// `fixtures/tiny-llama-dpo`, whose AdamW losses need it (`tests/it/preference_train.rs`).
    fn padding_idx(&self) -> Option<u32> {
        let pad = self.config.pad_token_id?;
        let trained = self.param(EMBED_NAME).is_some_and(|p| p.trainable);
        (trained && (pad as usize) < self.config.vocab_size).then_some(pad)
    }

    fn check_ids(&self, ids: &Tensor) -> Result<(), ModelError> {
        let max = ids.max_all()?.to_dtype(DType::U32)?.to_scalar::<u32>()?;
        if max as usize >= self.config.vocab_size {
            return Err(ModelError::Input(format!(
                "token id {max} is out of range for this model's vocab_size {} (tokenizer and model do not match?)",
                self.config.vocab_size
            )));
        }
        Ok(())
    }

    /// Runs embeddings, every layer and the final norm: `[b, t, hidden]` in the model dtype.
    #[allow(clippy::too_many_lines)] // the forward pass in order (embeddings, layers, norm); to split
    pub(crate) fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor, ModelError> {
        let ids = as_u32(input_ids, "input_ids")?.to_device(&self.device)?;
        let (b, t) = ids.dims2()?;
        if t == 0 || b == 0 {
            return Err(ModelError::Input("input_ids is empty".into()));
        }
        self.check_ids(&ids)?;
        let padding = match attention_mask {
            Some(m) => {
                let m = as_u32(m, "attention_mask")?;
                if m.dims() != ids.dims() {
                    return Err(ModelError::Input(format!(
                        "attention_mask has shape {:?} but input_ids has {:?}",
                        m.dims(),
                        ids.dims()
                    )));
                }
                Some(m.to_device(&Device::Cpu)?.to_vec2::<u32>()?)
            }
            None => None,
        };
        let dropout_seed = if train && self.lora.as_ref().is_some_and(|l| l.dropout > 0.0) {
            let n = self.forward_counter.fetch_add(1, Ordering::Relaxed);
            Some(self.dropout_seed_base ^ n.wrapping_mul(0x2545_F491_4F6C_DD1D))
        } else {
            None
        };
        let make_ctx = |device: &Device| -> Result<Arc<Ctx>, ModelError> {
            let (cos, sin) = rope_tables(&self.config, t, self.dtype, device)?;
            let mask = build_attention_mask(padding.as_deref(), b, t, None, device)?;
            let sliding_mask = match self.config.sliding_window {
                Some(w) if w < t => Some(build_attention_mask(
                    padding.as_deref(),
                    b,
                    t,
                    Some(w),
                    device,
                )?),
                _ => None,
            };
            Ok(Arc::new(Ctx {
                cos,
                sin,
                mask,
                sliding_mask,
                dropout_seed,
                adapters: !self.adapters_disabled.load(Ordering::Relaxed),
                ops: self.ops,
                native: OnceLock::new(),
            }))
        };
        let mut ctxs: Vec<(Device, Arc<Ctx>)> =
            vec![(self.device.clone(), make_ctx(&self.device)?)];
        let hidden = self.config.hidden_size;
        let flat_ids = ids.flatten_all()?;
        let padding_idx = self.padding_idx();
        let h = if train && self.native_embedding() {
            native_embedding::embedding(
                &self.modules.embed,
                flat_ids.to_vec1::<u32>()?,
                padding_idx,
                EMBED_NAME,
                &self.side_grads,
            )?
        } else {
            let rows = self.modules.embed.index_select(&flat_ids, 0)?;
            match padding_idx {
                // The pad token's rows come from a detached copy, so its lookups add
                // nothing to the embedding's gradient (`nn.Embedding(padding_idx=…)`).
                Some(pad) => flat_ids
                    .eq(pad)?
                    .unsqueeze(1)?
                    .broadcast_as(rows.shape())?
                    .where_cond(&rows.detach(), &rows)?,
                None => rows,
            }
        }
        .reshape((b, t, hidden))?;
        // The embeddings are stage 0's; every stage boundary is an explicit transfer.
        let mut h = Placed::new(h, 0);
        for layer in &self.modules.layers {
            let ctx = match ctxs.iter().find(|(d, _)| d.same_device(&layer.device)) {
                Some((_, c)) => c.clone(),
                None => {
                    let c = make_ctx(&layer.device)?;
                    ctxs.push((layer.device.clone(), c.clone()));
                    c
                }
            };
            let home = Home {
                index: layer.owner,
                device: layer.device.clone(),
            };
            let x = h.to(&home)?.into_tensor();
            let h_out = if self.native_layers
                && self.native_kernels()
                && native_layer::applies(layer, &ctx, &x)
            {
                let nc = match ctx.native.get() {
                    Some(nc) => nc.clone(),
                    None => {
                        let nc = native_layer::native_ctx(&ctx)?;
                        let _ = ctx.native.set(nc.clone());
                        nc
                    }
                };
                native_layer::native_layer(
                    layer,
                    &nc,
                    &x,
                    &self.side_grads,
                    train && !self.checkpointing,
                    ctx.dropout_seed,
                )?
            } else if self.checkpointing {
                checkpoint::checkpointed_layer(layer, &ctx, &x, &self.side_grads)?
            } else {
                layer.forward(&x, &ctx)?
            };
            h = Placed::new(h_out, layer.owner);
        }
        let h = h.to(&self.head_home())?.into_tensor();
        kernels::rms_norm(&h, &self.modules.norm, self.config.rms_norm_eps, self.ops)
    }

    /// Full logits `[b, t, vocab]` in f32 (for tests and generation; training uses
    /// [`CausalLm::loss`], which never materialises them all).
    pub fn logits(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let h = self.hidden_states(input_ids, attention_mask, false)?;
        let (b, t, hidden) = h.dims3()?;
        let h2 = h.reshape((b * t, hidden))?;
        let logits = self.head_matmul(&h2)?.to_dtype(DType::F32)?;
        Ok(logits.reshape((b, t, self.config.vocab_size))?)
    }

    /// Whether training looks tokens up with the native embedding op (its gradient goes to
    /// the side table): native layers on, fused kernels, trainable dense f32 CPU embeddings.
    fn native_embedding(&self) -> bool {
        self.native_layers
            && self.native_kernels()
            && self.param(EMBED_NAME).is_some_and(|p| p.trainable)
            && native_embedding::applies(&self.modules.embed)
    }

    /// Where the fused loss sends the lm-head gradient instead of candle's store, under the same
    /// conditions as the native embedding (a tied head shares its side-table entry, so the
    /// embedding's backward adds into it in place).
    pub(crate) fn head_grad_sink(&self) -> Option<ops::WeightGradSink> {
        let name = self.head_param_name();
        let param = self.param(name)?;
        let head = &self.modules.lm_head;
        let usable = self.native_layers
            && self.native_kernels()
            && param.trainable
            && head.id() == param.var.as_tensor().id()
            && native_embedding::applies(head);
        if !usable {
            return None;
        }
        let side = self.side_grads.clone();
        let name = name.to_string();
        Some(Box::new(move |g: Tensor| {
            native_layer::add_side_grad(&mut lock(&side), &name, g)
        }))
    }

    /// `[n, hidden] @ lm_head^T` → `[n, vocab]` in the model dtype.
    pub(crate) fn head_matmul(&self, h2: &Tensor) -> Result<Tensor, ModelError> {
        if self.modules.lm_head_frozen {
            kernels::frozen_linear(h2, &self.modules.lm_head, self.ops)
        } else {
            Ok(h2.matmul(&self.modules.lm_head.t()?)?)
        }
    }

    /// The summed causal-LM loss: labels are shifted inside (`labels[:, 1:]` scores
    /// `logits[:, :-1]`), -100 is ignored, and `sum / num_tokens` equals transformers'
    /// mean loss. See [`super::loss`] for how the logits are chunked.
    pub fn loss(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<LossOutput, ModelError> {
        let h = self.hidden_states(input_ids, attention_mask, true)?;
        super::loss::causal_lm_loss(self, &h, labels)
    }

    /// The summed loss for evaluation: no dropout, no graph kept, and the same chunked loss
    /// op training uses, which holds one chunk of logits at a time (the diagnostic
    /// [`CausalLm::token_losses`] holds three: logits, `logits − max` and their `exp`, which
    /// made evaluation the demo's largest moment, 323 MiB against 150 MiB for the step).
    pub fn eval_loss(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<(f64, usize), ModelError> {
        let h = self
            .hidden_states(input_ids, attention_mask, false)?
            .detach();
        let loss = super::loss::causal_lm_loss(self, &h, labels)?;
        let sum = loss.sum.detach().to_dtype(DType::F64)?.to_scalar::<f64>()?;
        Ok((sum, loss.num_tokens))
    }

    /// Per-token cross-entropy `[b, t-1]` of the shifted labels (0 where ignored), f32.
    pub fn token_losses(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let h = self.hidden_states(input_ids, attention_mask, false)?;
        super::loss::token_losses(self, &h, labels)
    }

    /// Gradients of every trainable parameter from `loss` (the `sum` of a [`LossOutput`],
    /// or anything derived from it). Fails with [`ModelError::MissingGradient`] when a
    /// trainable parameter received none.
    pub fn backward(&self, loss: &Tensor) -> Result<Gradients, ModelError> {
        let mut grads = Gradients::new();
        self.backward_into(loss, &mut grads)?;
        Ok(grads)
    }

    /// Adds the gradients of `loss` into `acc` (gradient accumulation over micro-batches)
    /// without ever holding two gradients of a parameter: each accumulated gradient is handed
    /// to the backward pass itself — to the side table for parameters whose gradient the
    /// native and checkpointed ops write there, through a [`ops::generic::gradient_tap`] to
    /// candle's store for the rest — so every new contribution is summed into it as it is
    /// produced, on any device. The peak is one gradient buffer per trainable parameter plus
    /// one parameter's transient (measured in `tests/train_memory.rs`).
    pub fn backward_into(&self, loss: &Tensor, acc: &mut Gradients) -> Result<(), ModelError> {
        let routed = std::mem::take(&mut *lock(&self.side_routed));
        // One sum of taps per stage: a tap lives on its parameter's device, and adding taps
        // of two stages would be a cross-device op (candle refuses it on two GPUs).
        let mut taps: std::collections::BTreeMap<usize, Placed> = Default::default();
        {
            let mut side = lock(&self.side_grads);
            side.clear();
            for (name, g) in std::mem::take(acc).into_pairs() {
                let param = self.param(&name).filter(|p| p.trainable);
                match param {
                    Some(p) if !routed.contains(&name) => {
                        let owner = self.param_owner(&name);
                        let tap =
                            Placed::new(ops::generic::gradient_tap(p.var.as_tensor(), g)?, owner);
                        let sum = match taps.remove(&owner) {
                            None => tap,
                            Some(sum) => sum.add(&tap, "gradient taps")?,
                        };
                        taps.insert(owner, sum);
                    }
                    _ => {
                        side.insert(name, g);
                    }
                }
            }
        }
        // The taps hang off the root, so candle processes them before the loss's graph. The
        // loss is the head's stage's; each stage's sum moves there explicitly.
        let head = self.head_home();
        let mut root = Placed::new(loss.clone(), head.index);
        if !taps.is_empty() {
            root = Placed::new(loss.to_dtype(DType::F32)?, head.index);
            for (_, sum) in taps {
                root = root.add(&sum.to(&head)?, "the loss and the gradient taps")?;
            }
        }
        let root = root.into_tensor();
        let mut store = root.backward()?;
        drop(root);
        let mut side = std::mem::take(&mut *lock(&self.side_grads));
        let mut now_routed = std::collections::HashSet::new();
        for p in self.params.iter().filter(|p| p.trainable) {
            let from_side = side.remove(&p.name);
            if from_side.is_some() {
                now_routed.insert(p.name.clone());
            }
            // Taken out of the store so a summed gradient never sits beside its parts.
            let g = match (store.remove(p.var.as_tensor()), from_side) {
                (Some(a), Some(b)) => (a + b)?,
                (Some(a), None) => a,
                (None, Some(b)) => b,
                (None, None) => {
                    return Err(ModelError::MissingGradient {
                        name: p.name.clone(),
                    })
                }
            };
            acc.insert(&p.name, g);
        }
        *lock(&self.side_routed) = now_routed;
        Ok(())
    }

    /// Adds a parameter (LoRA factors) to the list.
    pub(crate) fn push_param(
        &mut self,
        name: String,
        t: Tensor,
        trainable: bool,
    ) -> Result<(), ModelError> {
        if let Some(&i) = self.index.get(&name) {
            self.params[i].var = Var::from_tensor(&t)?;
            self.params[i].trainable = trainable;
            return Ok(());
        }
        self.index.insert(name.clone(), self.params.len());
        self.params.push(NamedParam {
            weight_decay: !is_no_decay(&name),
            var: Var::from_tensor(&t)?,
            trainable,
            name,
        });
        Ok(())
    }

    /// Removes every parameter whose name matches `pred` (used when merging LoRA).
    pub(crate) fn remove_params(&mut self, pred: impl Fn(&str) -> bool) {
        self.params.retain(|p| !pred(&p.name));
        self.index = self
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
    }

    /// The device of decoder layer `layer`.
    pub fn layer_device(&self, layer: usize) -> Option<&Device> {
        self.layer_devices.get(layer)
    }
}

/// Locks a mutex, recovering the data if another thread panicked while holding it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The decoder layer index of an HF parameter name.
pub(crate) fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("model.layers.")?;
    rest.split('.').next()?.parse().ok()
}

fn check_dtype(dtype: DType) -> Result<(), ModelError> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        other => Err(ModelError::Input(format!(
            "model dtype {other:?} is not supported; use f32, bf16 or f16"
        ))),
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<CausalLm>();
}
