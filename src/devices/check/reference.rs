//! The fixture's reference batch, loss and gradients (transformers'), and how far a run's
//! are from them.

use super::*;

/// The fixture batch (`input_ids`, `attention_mask`, `labels`) and references.
pub(super) fn load_reference(
    dir: &Path,
) -> Result<(DeviceBatch, HashMap<String, Tensor>), DevicesError> {
    let path = dir.join("reference.safetensors");
    if !path.exists() {
        return Err(DevicesError::Input(format!(
            "{} not found: point --fixtures at a fixture model folder (e.g. ../shared/fixtures/tiny-llama) \
             or set TUNESTUDIO_SHARED",
            path.display()
        )));
    }
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let get = |k: &str| {
        tensors
            .get(k)
            .cloned()
            .ok_or_else(|| DevicesError::Input(format!("{} has no tensor `{k}`", path.display())))
    };
    let batch = DeviceBatch {
        input_ids: get("input_ids")?.to_dtype(DType::U32)?,
        attention_mask: Some(get("attention_mask")?.to_dtype(DType::U32)?),
        labels: get("labels")?.to_dtype(DType::I64)?,
    };
    Ok((batch, tensors))
}

/// Mean loss and gradients of the mean (grads of the sum scaled by 1/tokens).
pub(super) fn loss_and_mean_grads(
    model: &CausalLm,
    batch: &DeviceBatch,
) -> Result<(f64, Gradients), DevicesError> {
    let out = model.loss(
        &batch.input_ids,
        batch.attention_mask.as_ref(),
        &batch.labels,
    )?;
    let mean = out.mean()?;
    let mut grads = model.backward(&out.sum)?;
    if out.num_tokens > 0 {
        grads.scale(1.0 / out.num_tokens as f64)?;
    }
    Ok((mean, grads))
}

/// max |a − b| and max |b| over two tensors (compared in f32 on the CPU).
pub(super) fn diff(a: &Tensor, b: &Tensor) -> Result<(f64, f64), DevicesError> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    let d = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    let m = b.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    Ok((d, m))
}

/// Cosine similarity of two tensors.
pub(super) fn cosine(a: &Tensor, b: &Tensor) -> Result<f64, DevicesError> {
    let a = a
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let b = b
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F64)?
        .flatten_all()?;
    let dot = (&a * &b)?.sum_all()?.to_scalar::<f64>()?;
    let na = a.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let nb = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if na == 0.0 || nb == 0.0 {
        1.0
    } else {
        dot / (na * nb)
    })
}

/// Largest relative gradient difference over every name both sets have:
/// max |a − b| / max |b| per tensor.
pub(super) fn max_grad_rel_diff(
    a: &Gradients,
    b: &Gradients,
) -> Result<(f64, String, usize), DevicesError> {
    let mut worst = (0.0, String::new(), 0usize);
    for (name, gb) in b.iter() {
        let Some(ga) = a.get(name) else {
            return Err(DevicesError::Input(format!("gradient of {name} missing")));
        };
        let (d, m) = diff(ga, gb)?;
        let rel = d / m.max(1e-12);
        worst.2 += 1;
        if rel > worst.0 {
            worst.0 = rel;
            worst.1 = name.to_string();
        }
    }
    Ok(worst)
}

/// How a run's gradients stand against the reference's `grad.*` tensors.
#[derive(Debug, Clone, Default)]
pub(super) struct GradientComparison {
    /// Gradients present on both sides.
    pub compared: usize,
    /// Parameters transformers trained that have no gradient here: a failure, not a skip.
    pub missing: Vec<String>,
    /// The largest max |g − reference| / max |reference| over the tensors, and its name.
    pub worst_rel: f64,
    pub worst_name: String,
    /// The smallest cosine between a gradient and its reference.
    pub worst_cosine: f64,
}

impl GradientComparison {
    /// One line for the step's detail, with the gradient tolerance it is held to.
    pub fn describe(&self, tolerance: &ParityTolerance) -> String {
        format!(
            "{} gradients: worst rel diff {:.2e} (tol {:.0e}, {}), min cosine {:.5}{}",
            self.compared,
            self.worst_rel,
            tolerance.grad_rel,
            self.worst_name,
            self.worst_cosine,
            if self.missing.is_empty() {
                String::new()
            } else {
                format!("; no gradient for {}", self.missing.join(", "))
            }
        )
    }
}

/// Compares every `grad.<name>` of the reference with the run's gradient of `<name>`.
pub(super) fn compare_with_reference(
    grads: &Gradients,
    reference: &HashMap<String, Tensor>,
) -> Result<GradientComparison, DevicesError> {
    let mut out = GradientComparison {
        worst_cosine: 1.0,
        ..GradientComparison::default()
    };
    let mut names: Vec<&String> = reference.keys().collect();
    names.sort();
    for key in names {
        let Some(name) = key.strip_prefix("grad.") else {
            continue;
        };
        let Some(g) = grads.get(name) else {
            out.missing.push(name.to_string());
            continue;
        };
        let ref_grad = &reference[key];
        let (d, m) = diff(g, ref_grad)?;
        let rel = d / m.max(1e-12);
        if rel > out.worst_rel {
            out.worst_rel = rel;
            out.worst_name = name.to_string();
        }
        out.worst_cosine = out.worst_cosine.min(cosine(g, ref_grad)?);
        out.compared += 1;
    }
    Ok(out)
}
