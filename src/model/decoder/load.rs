//! Building a [`CausalLm`]: from safetensors files (quantized for QLoRA) or a random
//! initialisation, and rebuilding the forward pass's modules from the parameter list
//! whenever trainability or placement changes.

use super::super::config::ModelConfig;
use super::super::error::ModelError;
use super::super::gradients::NamedParam;
use super::super::hub::ModelFiles;
use super::super::kernels;
use super::super::layer_weights::{Linear, LoraFactors};
use super::super::ops_mode::OpsMode;
use super::super::weights::Checkpoint;
use super::*;
use crate::settings::Quantization;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

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
                head_transfer: None,
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
            side_grads: super::super::side_grads::SideTable::new(),
            side_routed: Mutex::new(Default::default()),
            forward_counter: AtomicU64::new(0),
            dropout_seed_base: 0x5EED,
            adapters_disabled: AtomicBool::new(false),
            source,
            layer_source: None,
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
    /// cached on disk ([`super::super::quant::cache`]) and read from there on later loads.
    pub fn load_files_quantized(
        files: &ModelFiles,
        dtype: DType,
        device: &Device,
        quantize: Quantization,
    ) -> Result<Self, ModelError> {
        let cache = super::super::quant::cache::cache_dir();
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
        let quantized = super::super::quant::cache::load_quantized(
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
    pub(super) fn head_param_name(&self) -> &'static str {
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
        // A tied head under a layer split reads the embeddings of the first stage. It is moved
        // at every use ([`CausalLm::head_weight`]), never here: a copy made once would miss
        // every optimizer step after it (a GPU's copy is its own memory; the layer split on one
        // H200 drifted 3.8e-2 in loss by step 4 that way).
        let owner = self.param_owner(self.head_param_name());
        let home = self.head_home();
        let head_transfer = (owner != home.index || !lm_head.device().same_device(&home.device))
            .then_some((owner, home));
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
                index: l,
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
            head_transfer,
        };
        Ok(())
    }
}
