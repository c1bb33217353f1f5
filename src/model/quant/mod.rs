//! QLoRA: LoRA on a quantized frozen base.
//!
//! With `[model] quantize = "q8_0" | "q4_k"` ([`Quantization`]) the seven base linears of every
//! decoder layer (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`)
//! are stored as GGML blocks (`candle_core::quantized::QTensor`) instead of parameters: they are
//! quantized as they are read from the checkpoint (one weight in f32 at a time, on the CPU,
//! then placed on the device) and the dense copy is never kept. Which format each weight gets
//! (and the `q4_k` → `q5_0` fallback for input widths that are not a multiple of 256) is
//! [`Quantization::format_for`], shared with the planner.
//!
//! # What stays in the compute dtype, and why
//! - **The token embeddings**: a lookup reads a handful of rows, so quantizing saves memory
//!   only, and with a tied head (most small models) the same matrix is the lm-head.
//! - **The lm-head**: its logits feed the loss directly; QLoRA (bitsandbytes / PEFT) keeps it
//!   in 16 bits too, because quantization noise on the vocabulary projection shows up
//!   straight in the loss. It is also one matrix, not one per layer.
//! - **The norms and biases**: vectors, a rounding error of the total.
//! - **The LoRA factors**: trained, so in the compute dtype with their optimizer state, in
//!   PEFT's layout as without quantization.
//!
//! # The op
//! [`quant_linear`] is a graph node (the device-generic [`super::ops::generic`] pattern) whose
//! forward dequantizes the weight into the compute dtype, multiplies, and drops it; its
//! backward gives only the input gradient `dX = dY · W`, dequantizing the weight again. Between
//! forward and backward nothing weight-sized is kept, so the transient is one layer's weight
//! (in f32, plus its compute-dtype cast in half precision). On the CPU with the native kernels
//! the products run in the frozen-linear kernel ([`super::ops::frozen_linear`]); elsewhere in
//! candle's matmul (any device). Layers with quantized weights never run as native layer ops.
//!
//! Why dequantize rather than GGML's quantized matmul (`QMatMul`): GGML's kernels quantize the
//! *activations* to 8 bits (Q8_K / Q8_0 blocks) before the dot products, an extra error of
//! ≈ 1e-3 relative in every product that the gradient through the base does not see, and they
//! have no backward. Training with dequantize-then-matmul is what bitsandbytes does for QLoRA
//! as well (its 4-bit kernels are for batch-1 inference); the result equals the unquantized
//! computation on `dequantize(quantize(W))` to rounding (`tests/it/model_qlora.rs`). The cost is
//! one dequantization per weight and pass, O(out × in) against the matmul's O(tokens × out × in).

pub mod cache;

use super::decoder::CausalLm;
use super::error::ModelError;
use super::kernels::OpsKind;
use super::ops::generic::{apply1, TensorOp};
use crate::settings::{QuantFormat, Quantization};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// The GGML dtype of a format.
pub fn ggml_dtype(format: QuantFormat) -> GgmlDType {
    match format {
        QuantFormat::Q8_0 => GgmlDType::Q8_0,
        QuantFormat::Q4K => GgmlDType::Q4K,
        QuantFormat::Q5_0 => GgmlDType::Q5_0,
    }
}

/// The format of a GGML dtype this module writes.
pub fn format_of(dtype: GgmlDType) -> Option<QuantFormat> {
    match dtype {
        GgmlDType::Q8_0 => Some(QuantFormat::Q8_0),
        GgmlDType::Q4K => Some(QuantFormat::Q4K),
        GgmlDType::Q5_0 => Some(QuantFormat::Q5_0),
        _ => None,
    }
}

/// The short names of the base linears that are quantized.
pub const QUANTIZED_MODULES: [&str; 7] = super::lora::LINEAR_MODULES;

/// Whether `name` is the weight of a decoder layer's base linear (`model.layers.N.*.q_proj.weight`).
pub fn is_base_linear_weight(name: &str) -> bool {
    name.starts_with("model.layers.")
        && QUANTIZED_MODULES
            .iter()
            .any(|m| name.ends_with(&format!(".{m}.weight")))
}

/// Quantizes `w` (`[out, in]`, any dtype and device) into `format` on `device`. The f32 copy
/// made for it is transient.
pub fn quantize(w: &Tensor, format: QuantFormat, device: &Device) -> Result<QTensor, ModelError> {
    let dtype = ggml_dtype(format);
    let q = if w.device().is_cpu() {
        QTensor::quantize_onto(&w.to_dtype(DType::F32)?, dtype, device)?
    } else {
        let q = QTensor::quantize(&w.to_dtype(DType::F32)?, dtype)?;
        move_to(&q, device)?
    };
    Ok(q)
}

/// `dequantize(quantize(w))` in `w`'s dtype and device: the weights the quantized model
/// computes with (the reference of the exactness tests).
pub fn round_trip(w: &Tensor, format: QuantFormat) -> Result<Tensor, ModelError> {
    let q = QTensor::quantize(&w.to_dtype(DType::F32)?, ggml_dtype(format))?;
    Ok(q.dequantize(w.device())?.to_dtype(w.dtype())?)
}

/// `q` on `device`, bit for bit (its blocks are copied, not re-quantized).
pub fn move_to(q: &QTensor, device: &Device) -> Result<QTensor, ModelError> {
    let data = q.data()?;
    let storage = QStorage::from_data(data, device, q.dtype())?;
    Ok(QTensor::new(storage, q.shape().clone())?)
}

/// `x @ Wᵀ` for a quantized frozen `W` (`[out, in]`): see the module doc.
struct QuantLinear {
    w: Arc<QTensor>,
    /// The CPU frozen-linear kernel runs the products (native kernels on, CPU tensors).
    native: bool,
}

impl QuantLinear {
    /// The dense weight in `like`'s dtype on its device (transient).
    fn dense(&self, like: &Tensor) -> candle_core::Result<Tensor> {
        let w = self.w.dequantize(like.device())?;
        if w.dtype() == like.dtype() {
            Ok(w)
        } else {
            w.to_dtype(like.dtype())
        }
    }
}

impl TensorOp for QuantLinear {
    fn name(&self) -> &'static str {
        "quantized-frozen-linear"
    }

    fn forward(&self, xs: &[Tensor]) -> candle_core::Result<Tensor> {
        let x = &xs[0];
        let w = self.dense(x)?;
        if self.native {
            super::ops::frozen_linear(x, &w, None)
        } else {
            x.matmul(&w.t()?)
        }
    }

    fn backward(
        &self,
        _xs: &[Tensor],
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let w = self.dense(grad)?;
        // dX = dY · W (no gradient for W).
        let dx = if self.native {
            super::ops::frozen_linear(grad, &w.t()?, None)?
        } else {
            grad.matmul(&w)?
        };
        Ok(vec![Some(dx)])
    }
}

/// `x @ Wᵀ` (`x`: `[n, in]`) for a quantized frozen weight; the backward gives `x`'s gradient
/// only, dequantizing `W` once more.
pub(crate) fn quant_linear(
    x: &Tensor,
    w: &Arc<QTensor>,
    ops: OpsKind,
) -> Result<Tensor, ModelError> {
    let native = ops == OpsKind::Fused && x.device().is_cpu();
    let op = QuantLinear {
        w: w.clone(),
        native,
    };
    Ok(apply1(op, &x.contiguous()?)?)
}

/// How the base of a model was quantized.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantSummary {
    /// What `[model] quantize` asked for.
    pub requested: Quantization,
    /// `(weight name, format)` of every quantized weight, in model order.
    pub formats: Vec<(String, QuantFormat)>,
    /// Base linear weights left in the compute dtype (input width not a multiple of 32).
    pub kept_dense: Vec<String>,
    /// Bytes of the quantized blocks (scales included).
    pub quantized_bytes: u64,
    /// What the same weights take in the compute dtype.
    pub dense_bytes: u64,
}

impl QuantSummary {
    /// One line for logs: "q4_k: 154 weights (q4_k 112, q5_0 42), 3.6 GiB instead of 13.0 GiB".
    pub fn describe(&self) -> String {
        let mut counts: Vec<(QuantFormat, usize)> = Vec::new();
        for (_, f) in &self.formats {
            match counts.iter_mut().find(|(g, _)| g == f) {
                Some((_, n)) => *n += 1,
                None => counts.push((*f, 1)),
            }
        }
        let parts: Vec<String> = counts
            .iter()
            .map(|(f, n)| format!("{} {n}", f.name()))
            .collect();
        let mut s = format!(
            "{}: {} base weights ({}), {} instead of {}",
            self.requested,
            self.formats.len(),
            parts.join(", "),
            crate::units::format_bytes(self.quantized_bytes),
            crate::units::format_bytes(self.dense_bytes)
        );
        if !self.kept_dense.is_empty() {
            s.push_str(&format!(
                "; {} kept in the compute dtype (input width not a multiple of 32)",
                self.kept_dense.len()
            ));
        }
        s
    }
}

impl CausalLm {
    /// Quantizes every base linear of the decoder layers (see the module doc) and drops their
    /// dense parameters. The weights are frozen from then on; attach LoRA to train. Calling it
    /// again with the same setting does nothing; with another, it fails.
    pub fn quantize_base(&mut self, q: Quantization) -> Result<QuantSummary, ModelError> {
        if !q.is_on() {
            return Ok(self.quant_summary());
        }
        if self.quantization.is_on() {
            if self.quantization == q {
                return Ok(self.quant_summary());
            }
            return Err(ModelError::Input(format!(
                "the base is already quantized as {}; reload the model to use {q}",
                self.quantization
            )));
        }
        let names: Vec<String> = self
            .params
            .iter()
            .filter(|p| is_base_linear_weight(&p.name))
            .map(|p| p.name.clone())
            .collect();
        for name in names {
            let Some(p) = self.param(&name) else { continue };
            let w = p.var.as_tensor();
            let in_dim = w.dims2()?.1;
            let Some(format) = q.format_for(in_dim as u64) else {
                continue;
            };
            let device = w.device().clone();
            let qt = quantize(w, format, &device)?;
            self.quantized.insert(name.clone(), Arc::new(qt));
            self.remove_params(|n| n == name);
        }
        self.quantization = q;
        self.rebuild()?;
        Ok(self.quant_summary())
    }

    /// The quantization of the base (`None` when it is dense).
    pub fn quantization(&self) -> Quantization {
        self.quantization
    }

    /// The quantized weight `name` (an HF weight name), if the base stores it quantized.
    pub fn quantized_weight(&self, name: &str) -> Option<&Arc<QTensor>> {
        self.quantized.get(name)
    }

    /// The names of the quantized weights, in model order.
    pub fn quantized_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.quantized.keys().cloned().collect();
        names.sort_by_key(|n| (super::decoder::layer_of(n), linear_rank(n), n.clone()));
        names
    }

    /// What was quantized, in which format, and the bytes saved.
    pub fn quant_summary(&self) -> QuantSummary {
        let elem = self.dtype.size_in_bytes() as u64;
        let mut s = QuantSummary {
            requested: self.quantization,
            ..QuantSummary::default()
        };
        for name in self.quantized_names() {
            let Some(q) = self.quantized.get(&name) else {
                continue;
            };
            let Some(f) = format_of(q.dtype()) else {
                continue;
            };
            s.quantized_bytes += q.storage_size_in_bytes() as u64;
            s.dense_bytes += q.shape().elem_count() as u64 * elem;
            s.formats.push((name, f));
        }
        if self.quantization.is_on() {
            s.kept_dense = self
                .params
                .iter()
                .filter(|p| is_base_linear_weight(&p.name))
                .map(|p| p.name.clone())
                .collect();
        }
        s
    }

    /// Replaces the quantized weights by dense frozen parameters (`dequantize(W)` in the model
    /// dtype): used before merging an adapter or saving a full model.
    pub fn dequantize_base(&mut self) -> Result<(), ModelError> {
        let names = self.quantized_names();
        for name in names {
            let Some(q) = self.quantized.remove(&name) else {
                continue;
            };
            let w = q.dequantize(&q.device())?.to_dtype(self.dtype)?;
            drop(q);
            self.push_param(name, w, false)?;
        }
        self.quantization = Quantization::None;
        self.rebuild()
    }

    /// Moves quantized weights to the devices of their layers (after a layer split).
    pub(crate) fn place_quantized(&mut self) -> Result<(), ModelError> {
        let names = self.quantized_names();
        for name in names {
            let Some(layer) = super::decoder::layer_of(&name) else {
                continue;
            };
            let Some(dev) = self.layer_devices.get(layer).cloned() else {
                continue;
            };
            let Some(q) = self.quantized.get(&name) else {
                continue;
            };
            if !q.device().same_device(&dev) {
                let moved = move_to(q, &dev)?;
                self.quantized.insert(name, Arc::new(moved));
            }
        }
        Ok(())
    }
}

/// The position of a linear in a layer (q, k, v, o, gate, up, down), for ordering.
fn linear_rank(name: &str) -> usize {
    QUANTIZED_MODULES
        .iter()
        .position(|m| name.ends_with(&format!(".{m}.weight")))
        .unwrap_or(usize::MAX)
}
