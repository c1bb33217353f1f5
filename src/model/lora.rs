//! LoRA adapters in PEFT's layout: `y = x Wᵀ (+ b) + dropout(x) Aᵀ Bᵀ · alpha/r`, with the
//! base weights frozen (no gradient buffer, no gradient compute).

use super::decoder::CausalLm;
use super::error::ModelError;
use super::save::replace_dir_atomically;
use super::weights::{write_safetensors, Checkpoint};
use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::Path;

/// Every linear layer of a Llama / Mistral / Qwen2 decoder layer, by the short name
/// LoRA `target_modules` use.
pub const LINEAR_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// A LoRA configuration (PEFT's `r`, `lora_alpha`, `lora_dropout`, `target_modules`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank of the update.
    pub r: usize,
    /// Scale numerator: the update is multiplied by `alpha / r`.
    pub alpha: f64,
    /// Dropout probability on the adapter input during training.
    pub dropout: f64,
    /// Module names to adapt (`q_proj`, `v_proj`, ... or `all-linear`).
    pub target_modules: Vec<String>,
}

impl LoraConfig {
    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.r as f64
    }

    /// Whether the linear module with full name `module` (e.g.
    /// `model.layers.0.self_attn.q_proj`) is targeted; PEFT matches name suffixes.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| t == "all-linear" || module == t || module.ends_with(&format!(".{t}")))
    }
}

/// The linear modules of every decoder layer, `(full name, in, out)`.
fn linear_modules(model: &CausalLm) -> Vec<(String, usize, usize)> {
    let c = &model.config;
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let q = c.num_attention_heads * c.head_dim;
    let kv = c.num_key_value_heads * c.head_dim;
    let mut out = Vec::new();
    for l in 0..c.num_hidden_layers {
        for (name, fin, fout) in [
            ("self_attn.q_proj", h, q),
            ("self_attn.k_proj", h, kv),
            ("self_attn.v_proj", h, kv),
            ("self_attn.o_proj", q, h),
            ("mlp.gate_proj", h, i),
            ("mlp.up_proj", h, i),
            ("mlp.down_proj", i, h),
        ] {
            out.push((format!("model.layers.{l}.{name}"), fin, fout));
        }
    }
    out
}

const PEFT_PREFIX: &str = "base_model.model.";

impl CausalLm {
    /// Attaches fresh LoRA factors to every targeted linear layer (A: PEFT's
    /// kaiming-uniform, i.e. U(-1/√in, 1/√in); B: zeros) and freezes every base weight.
    pub fn apply_lora(&mut self, cfg: &LoraConfig, seed: u64) -> Result<(), ModelError> {
        if self.lora.is_some() {
            return Err(ModelError::Lora(
                "an adapter is already attached; merge it (merge_lora) or reload the model first"
                    .into(),
            ));
        }
        if cfg.r == 0 {
            return Err(ModelError::Lora("r must be at least 1".into()));
        }
        if !(0.0..1.0).contains(&cfg.dropout) {
            return Err(ModelError::Lora(format!(
                "lora_dropout must be in [0, 1), got {}",
                cfg.dropout
            )));
        }
        let modules: Vec<_> = linear_modules(self)
            .into_iter()
            .filter(|(name, _, _)| cfg.targets(name))
            .collect();
        if modules.is_empty() {
            return Err(ModelError::Lora(format!(
                "target_modules {:?} match no linear layer of this model (use q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj or all-linear)",
                cfg.target_modules
            )));
        }
        for p in self.params.iter_mut() {
            p.trainable = false;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (name, fin, fout) in modules {
            let device = super::decoder::layer_of(&name)
                .and_then(|l| self.layer_devices.get(l).cloned())
                .unwrap_or_else(|| self.device.clone());
            let bound = 1.0 / (fin as f64).sqrt();
            let a: Vec<f32> = (0..cfg.r * fin)
                .map(|_| rng.gen_range(-bound..bound) as f32)
                .collect();
            let a = Tensor::from_vec(a, (cfg.r, fin), &device)?.to_dtype(self.dtype)?;
            let b = Tensor::zeros((fout, cfg.r), self.dtype, &device)?;
            self.push_param(format!("{name}.lora_A.weight"), a, true)?;
            self.push_param(format!("{name}.lora_B.weight"), b, true)?;
        }
        self.lora = Some(cfg.clone());
        self.rebuild()
    }

    /// Loads a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`),
    /// attaching it to this model; returns its configuration.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<LoraConfig, ModelError> {
        let cfg_path = dir.join("adapter_config.json");
        if !cfg_path.is_file() {
            return Err(ModelError::MissingFile {
                path: cfg_path,
                hint: "a PEFT adapter folder needs adapter_config.json".into(),
            });
        }
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
        let cfg = parse_adapter_config(&text, &cfg_path.display().to_string())?;
        let weights = dir.join("adapter_model.safetensors");
        if !weights.is_file() {
            return Err(ModelError::MissingFile {
                path: weights,
                hint: "a PEFT adapter folder needs adapter_model.safetensors (.bin adapters are not supported)".into(),
            });
        }
        let ckpt = Checkpoint::open(std::slice::from_ref(&weights))?;
        self.apply_lora(&cfg, 0)?;
        let lora_names: Vec<(String, Vec<usize>)> = self
            .params
            .iter()
            .filter(|p| p.name.contains(".lora_"))
            .map(|p| (p.name.clone(), p.var.dims().to_vec()))
            .collect();
        for (name, shape) in lora_names {
            let key = format!("{PEFT_PREFIX}{name}");
            // PEFT saves without the adapter name; in-memory state dicts carry `.default`.
            let alt = key.replace(".weight", ".default.weight");
            let key = if ckpt.contains(&key) || !ckpt.contains(&alt) {
                key
            } else {
                alt
            };
            let Some(&i) = self.index.get(&name) else {
                continue;
            };
            let dev = self.params[i].var.device().clone();
            let t = ckpt.load(&key, Some(&shape), self.dtype, &dev)?;
            self.params[i].var.set(&t)?;
        }
        Ok(cfg)
    }

    /// Saves the attached adapter in PEFT's layout (loadable by `PeftModel.from_pretrained`).
    pub fn save_adapter(&self, dir: &Path) -> Result<(), ModelError> {
        let cfg = self.lora.as_ref().ok_or_else(|| {
            ModelError::Lora("no adapter is attached (apply_lora or load_adapter first)".into())
        })?;
        let tensors: Vec<(String, Tensor)> = self
            .params
            .iter()
            .filter(|p| p.name.contains(".lora_"))
            .map(|p| {
                (
                    format!("{PEFT_PREFIX}{}", p.name),
                    p.var.as_tensor().clone(),
                )
            })
            .collect();
        let mut targets: Vec<String> = cfg.target_modules.clone();
        targets.sort();
        let config = json!({
            "alpha_pattern": {},
            "auto_mapping": null,
            "base_model_name_or_path": self.source,
            "bias": "none",
            "exclude_modules": null,
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "layer_replication": null,
            "layers_pattern": null,
            "layers_to_transform": null,
            "loftq_config": {},
            "lora_alpha": alpha_json(cfg.alpha),
            "lora_bias": false,
            "lora_dropout": cfg.dropout,
            "megatron_config": null,
            "megatron_core": "megatron.core",
            "modules_to_save": null,
            "peft_type": "LORA",
            "r": cfg.r,
            "rank_pattern": {},
            "revision": null,
            "target_modules": targets,
            "task_type": "CAUSAL_LM",
            "use_dora": false,
            "use_rslora": false
        });
        let dtype = self.dtype;
        replace_dir_atomically(dir, |tmp| {
            write_safetensors(&tmp.join("adapter_model.safetensors"), &tensors, dtype)?;
            let path = tmp.join("adapter_config.json");
            let text = serde_json::to_string_pretty(&config)
                .map_err(|e| ModelError::Lora(e.to_string()))?;
            std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
            Ok(())
        })?;
        Ok(())
    }

    /// Folds every adapter into its base weight (`W += alpha/r · B A`) and removes the
    /// LoRA factors; the base weights stay frozen.
    pub fn merge_lora(&mut self) -> Result<(), ModelError> {
        let cfg = self
            .lora
            .clone()
            .ok_or_else(|| ModelError::Lora("no adapter is attached to merge".into()))?;
        let scale = cfg.scale();
        // A quantized base is merged into its dequantized weights (as PEFT does for QLoRA):
        // the merged model is dense.
        self.dequantize_base()?;
        let names: Vec<String> = self
            .params
            .iter()
            .filter_map(|p| p.name.strip_suffix(".lora_A.weight").map(str::to_string))
            .collect();
        for module in names {
            let get = |n: &str| {
                self.param(n).map(|p| p.var.clone()).ok_or_else(|| {
                    ModelError::Lora(format!("parameter `{n}` is missing while merging"))
                })
            };
            let a = get(&format!("{module}.lora_A.weight"))?;
            let b = get(&format!("{module}.lora_B.weight"))?;
            let w = get(&format!("{module}.weight"))?;
            let delta = b
                .as_tensor()
                .to_dtype(DType::F32)?
                .matmul(&a.as_tensor().to_dtype(DType::F32)?)?;
            let merged =
                (w.as_tensor().to_dtype(DType::F32)? + (delta * scale)?)?.to_dtype(w.dtype())?;
            w.set(&merged)?;
        }
        self.remove_params(|n| n.contains(".lora_"));
        self.lora = None;
        self.rebuild()
    }
}

/// `lora_alpha` as PEFT writes it (an integer when it is one).
fn alpha_json(alpha: f64) -> Value {
    if alpha.fract() == 0.0 && alpha.abs() < 1e15 {
        json!(alpha as i64)
    } else {
        json!(alpha)
    }
}

/// Parses PEFT's `adapter_config.json`, rejecting variants this engine does not run.
pub fn parse_adapter_config(text: &str, origin: &str) -> Result<LoraConfig, ModelError> {
    let err = |m: String| ModelError::Config {
        origin: origin.to_string(),
        message: m,
    };
    let v: Value = serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
    if let Some(t) = v.get("peft_type").and_then(Value::as_str) {
        if t != "LORA" {
            return Err(err(format!("peft_type `{t}` is not supported (only LORA)")));
        }
    }
    for flag in ["use_dora", "use_rslora", "fan_in_fan_out"] {
        if v.get(flag).and_then(Value::as_bool).unwrap_or(false) {
            return Err(err(format!("`{flag}: true` is not supported")));
        }
    }
    if let Some(bias) = v.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(err(format!(
                "bias `{bias}` is not supported (only \"none\")"
            )));
        }
    }
    let r = v
        .get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| err("`r` (a positive integer) is missing".into()))? as usize;
    let alpha = v.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let dropout = v.get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0);
    let target_modules = match v.get("target_modules") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| err("`target_modules` must be a list of names".into()))
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::String(s)) if s == "all-linear" => vec![s.clone()],
        Some(Value::String(s)) => {
            return Err(err(format!(
                "`target_modules` is the regular expression `{s}`; list module names instead"
            )))
        }
        _ => return Err(err("`target_modules` is missing".into())),
    };
    Ok(LoraConfig {
        r,
        alpha,
        dropout,
        target_modules,
    })
}
