//! Named parameters and the gradients a backward pass produces for them.

use super::error::ModelError;
use candle_core::{DType, Tensor, Var};
use std::collections::HashMap;

/// One parameter of the model under its Hugging Face name.
#[derive(Debug, Clone)]
pub struct NamedParam {
    /// HF name, e.g. `model.layers.0.self_attn.q_proj.weight`; LoRA factors are named
    /// `model.layers.0.self_attn.q_proj.lora_A.weight` (PEFT's key without its
    /// `base_model.model.` prefix).
    pub name: String,
    /// The storage (shared with the model: `Var::set` updates the model in place).
    pub var: Var,
    /// Whether backward computes a gradient for it (false for LoRA-frozen base weights).
    pub trainable: bool,
    /// Whether AdamW decays it by default (matrices yes, norms and biases no).
    pub weight_decay: bool,
}

/// Gradients of the trainable parameters, by HF name, in model order.
#[derive(Debug, Clone, Default)]
pub struct Gradients {
    order: Vec<String>,
    map: HashMap<String, Tensor>,
}

impl Gradients {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the gradient of `name`.
    pub fn insert(&mut self, name: &str, grad: Tensor) {
        // A name taken out by `remove` keeps its place in the order: put back, it is not
        // listed twice (a norm over the order would count it twice).
        if self.map.insert(name.to_string(), grad).is_none()
            && !self.order.iter().any(|n| n == name)
        {
            self.order.push(name.to_string());
        }
    }

    /// Takes the gradient of `name` out (its name stays in the order).
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.map.remove(name)
    }

    /// The gradient of `name`, if it has one.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.map.get(name)
    }

    /// Adds `grad` into the gradient of `name` (a running sum: a collective's incoming range);
    /// inserts it when there is none yet.
    pub fn add(&mut self, name: &str, grad: Tensor) -> candle_core::Result<()> {
        let sum = match self.remove(name) {
            Some(prev) => (prev + grad)?,
            None => grad,
        };
        self.insert(name, sum);
        Ok(())
    }

    /// Adds `other` into `self` name by name (gradient accumulation over micro-batches);
    /// names new to `self` are inserted.
    pub fn accumulate(&mut self, other: Gradients) -> Result<(), ModelError> {
        for name in other.order {
            let Some(g) = other.map.get(&name) else {
                continue;
            };
            match self.map.get_mut(&name) {
                Some(acc) => {
                    if acc.shape() != g.shape() {
                        return Err(ModelError::Input(format!(
                            "cannot accumulate the gradient of `{name}`: shapes {:?} and {:?} differ",
                            acc.dims(),
                            g.dims()
                        )));
                    }
                    let g = g.to_device(acc.device())?.to_dtype(acc.dtype())?;
                    *acc = (&*acc + g)?;
                }
                None => {
                    self.order.push(name.clone());
                    self.map.insert(name, g.clone());
                }
            }
        }
        Ok(())
    }

    /// The L2 norm over every gradient together (summed in f64).
    pub fn global_norm(&self) -> Result<f64, ModelError> {
        let mut sum = 0f64;
        for name in &self.order {
            if let Some(g) = self.map.get(name) {
                sum += sum_of_squares(g)?;
            }
        }
        Ok(sum.sqrt())
    }

    /// Names in model order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.order.iter().map(String::as_str)
    }

    /// `(name, gradient)` pairs in model order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.order
            .iter()
            .filter_map(|n| self.map.get(n).map(|g| (n.as_str(), g)))
    }

    /// The `(name, gradient)` pairs in model order, by value (so each can be moved on and
    /// freed one at a time).
    pub fn into_pairs(mut self) -> impl Iterator<Item = (String, Tensor)> {
        let order = std::mem::take(&mut self.order);
        order.into_iter().filter_map(move |n| {
            let g = self.map.remove(&n)?;
            Some((n, g))
        })
    }

    /// Number of gradients.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// True when there is none.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Multiplies every gradient by `factor` (e.g. 1/tokens, clipping).
    pub fn scale(&mut self, factor: f64) -> Result<(), ModelError> {
        for g in self.map.values_mut() {
            *g = g.affine(factor, 0.0)?;
        }
        Ok(())
    }
}

/// Elements summed in f32 before the partial sums go on in f64.
const NORM_CHUNK_ELEMS: usize = 4096;

/// The sum of `g`'s squared elements: in f32 over chunks of [`NORM_CHUNK_ELEMS`], the chunks
/// in f64. One f32 sum over a whole tensor of millions of elements drifts in the fifth digit,
/// and differently for its halves: a sharded run's norm from its ranks' ranges was 1.4e-5 off
/// one device's on the demo model (2026-12-06); chunked, the ways of cutting agree.
fn sum_of_squares(g: &candle_core::Tensor) -> Result<f64, ModelError> {
    let flat = g.to_dtype(DType::F32)?.flatten_all()?;
    let n = flat.elem_count();
    let chunked = n / NORM_CHUNK_ELEMS * NORM_CHUNK_ELEMS;
    let mut sum = 0f64;
    if chunked > 0 {
        sum += flat
            .narrow(0, 0, chunked)?
            .reshape((chunked / NORM_CHUNK_ELEMS, NORM_CHUNK_ELEMS))?
            .sqr()?
            .sum(1)?
            .to_dtype(DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    if n > chunked {
        sum += flat
            .narrow(0, chunked, n - chunked)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()? as f64;
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A gradient taken out and put back (a reduce-scatter adding into a running sum) is
    /// listed once, and counted once by the norm.
    #[test]
    fn a_gradient_put_back_is_counted_once() {
        let mut g = Gradients::new();
        g.insert("w", Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap());
        let w = g.remove("w").unwrap();
        g.insert("w", w);
        assert_eq!(g.iter().count(), 1);
        assert!((g.global_norm().unwrap() - 5.0).abs() < 1e-9);
    }
}
