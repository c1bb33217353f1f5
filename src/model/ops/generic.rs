//! Device-generic training ops: the code a GPU runs, and that `TUNESTUDIO_OPS=generic` runs on
//! the CPU so the test suite measures it.
//!
//! Each op is a graph node whose forward was evaluated with candle tensor ops (on detached
//! inputs, so no intermediate stays in the graph) and whose backward is written in candle tensor
//! ops, recomputing what it needs. Between forward and backward a node keeps only its inputs and
//! its output, as the CPU native kernels do, so the memory the planner predicts for those holds
//! here too. Only the hand-over of the precomputed output into candle's custom-op call is per
//! backend (one copy of the output: `cpu_fwd`, `cuda_fwd`); everything else is the same code on
//! every device.
//!
//! Why custom ops rather than plain tensor ops: candle's autograd keeps every intermediate of a
//! composite op alive until backward, computes a weight gradient for a frozen weight anyway (its
//! matmul backward always computes both operands'), and keeps a chunked loss's `[tokens × vocab]`
//! logits. A node with its own backward does none of that.

use super::super::reference_ops as r;
use super::lock;
use candle_core::Var;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

/// An op evaluated with tensor ops, with a backward in tensor ops.
pub(crate) trait TensorOp: Send + Sync + 'static {
    /// The node's name in candle's graph.
    fn name(&self) -> &'static str;
    /// The output, from detached inputs.
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor>;
    /// The gradient of each input (detached) from the output's gradient `grad`.
    fn backward(&self, xs: &[Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>>;
}

/// A graph node holding `op` and, until candle asks for it once, its precomputed output.
struct Node<O> {
    op: O,
    out: Mutex<Option<Tensor>>,
}

impl<O: TensorOp> Node<O> {
    fn take_output(&self) -> Result<Tensor> {
        match lock(&self.out).take() {
            Some(t) => Ok(t),
            None => bail!("{}: forward ran twice (internal error)", self.op.name()),
        }
    }

    fn cpu_output(&self) -> Result<(CpuStorage, Shape)> {
        hand_over_cpu(&self.take_output()?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_output(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        hand_over_cuda(&self.take_output()?)
    }

    fn grads(&self, xs: &[&Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let xs: Vec<Tensor> = xs.iter().map(|x| x.detach()).collect();
        let mut g = self.op.backward(&xs, &out.detach(), &grad.detach())?;
        g.resize(xs.len(), None);
        Ok(g)
    }
}

/// A copy of a CPU tensor's data as a fresh storage (what `cpu_fwd` must return).
pub(crate) fn hand_over_cpu(t: &Tensor) -> Result<(CpuStorage, Shape)> {
    super::super::kernels::cpu_storage_of(t)
}

/// A copy of a CUDA tensor's data as a fresh storage (what `cuda_fwd` must return).
#[cfg(feature = "cuda")]
pub(crate) fn hand_over_cuda(t: &Tensor) -> Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::backend::BackendStorage;
    use candle_core::Storage;
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(c) => Ok((c.try_clone(layout)?, layout.shape().clone())),
        _ => bail!("expected a CUDA tensor (internal error)"),
    }
}

impl<O: TensorOp> CustomOp1 for Node<O> {
    fn name(&self) -> &'static str {
        self.op.name()
    }
    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu_output()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_output()
    }
    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(self.grads(&[arg], res, grad)?.swap_remove(0))
    }
}

impl<O: TensorOp> CustomOp2 for Node<O> {
    fn name(&self) -> &'static str {
        self.op.name()
    }
    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu_output()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s1: &candle_core::CudaStorage,
        _l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_output()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], res, grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

/// `op` applied to `a`. Without a graph to join (inference) the output is returned as is.
pub(crate) fn apply1<O: TensorOp>(op: O, a: &Tensor) -> Result<Tensor> {
    let out = op.forward(&[a.detach()])?;
    if !a.track_op() {
        return Ok(out);
    }
    let node = Node {
        op,
        out: Mutex::new(Some(out)),
    };
    a.apply_op1(node)
}

/// `op` applied to `a` and `b`.
pub(crate) fn apply2<O: TensorOp>(op: O, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = op.forward(&[a.detach(), b.detach()])?;
    if !a.track_op() && !b.track_op() {
        return Ok(out);
    }
    let node = Node {
        op,
        out: Mutex::new(Some(out)),
    };
    a.apply_op2(b, node)
}

/// An op whose forward is `f` and whose backward recomputes `f` from its inputs and takes the
/// vector-Jacobian product with candle's autograd: exact reference gradients, and between forward
/// and backward only the inputs and the output are kept (the recomputation's intermediates live
/// only inside this op's backward).
struct Recompute<F> {
    name: &'static str,
    f: F,
}

impl<F> TensorOp for Recompute<F>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    fn name(&self) -> &'static str {
        self.name
    }
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        (self.f)(xs)
    }
    fn backward(&self, xs: &[Tensor], _out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let vars: Vec<Var> = xs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
        let inputs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = (self.f)(&inputs)?;
        // d/dx sum(out · g) = gᵀ ∂out/∂x.
        let seed = (out.to_dtype(DType::F32)? * grad.to_dtype(DType::F32)?)?.sum_all()?;
        let store = seed.backward()?;
        // Detached: a gradient from the store is tracked and would keep the recomputation's
        // graph (every intermediate of its backward) alive until the consuming node runs.
        Ok(inputs
            .iter()
            .map(|x| store.get(x).map(|t| t.detach()))
            .collect())
    }
}

/// Hands a parameter's accumulated gradient to candle's backward: its forward is a constant
/// zero (added to the loss, it changes nothing), its backward gives the accumulated gradient
/// once, by value. Processed right after the loss (it hangs off the root), it moves the
/// accumulation into candle's gradient store before any new gradient exists, so the store
/// sums into it: one gradient buffer per parameter across micro-batches instead of the
/// previous sum beside a complete new set (+1 gradient copy at the end of every backward).
struct GradTap {
    acc: Mutex<Option<Tensor>>,
}

impl TensorOp for GradTap {
    fn name(&self) -> &'static str {
        "gradient-accumulation-tap"
    }
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        Tensor::zeros((), DType::F32, xs[0].device())
    }
    fn backward(
        &self,
        _xs: &[Tensor],
        _out: &Tensor,
        _grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![lock(&self.acc).take()])
    }
}

/// A scalar zero whose gradient with respect to `param` (a trainable variable) is `acc`.
pub(crate) fn gradient_tap(param: &Tensor, acc: Tensor) -> Result<Tensor> {
    let op = GradTap {
        acc: Mutex::new(Some(acc)),
    };
    apply1(op, param)
}

/// RMSNorm (`x`: `[.., hidden]`, `w`: `[hidden]`), normalised in f32 as transformers does.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let op = Recompute {
        name: "generic-rms-norm",
        f: move |xs: &[Tensor]| r::rms_norm(&xs[0], &xs[1], eps),
    };
    apply2(op, &x.contiguous()?, w)
}

/// Rotary embedding with HF's `rotate_half` convention; `cos`/`sin` are constants.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (cos.detach(), sin.detach());
    let op = Recompute {
        name: "generic-rope",
        f: move |xs: &[Tensor]| r::rope(&xs[0], &cos, &sin),
    };
    apply1(op, &x.contiguous()?)
}

/// Softmax over the last dimension; its backward uses the output alone,
/// `dx = y ⊙ (g − Σ g ⊙ y)`. (Recomputing it instead would hold about six score-sized
/// tensors at once: measured +2.3 GB at seq 2048 on a 2-layer SmolLM2-width model.)
struct Softmax;

impl TensorOp for Softmax {
    fn name(&self) -> &'static str {
        "generic-softmax"
    }
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        r::softmax_last_dim(&xs[0])
    }
    fn backward(&self, _xs: &[Tensor], out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let dot = (grad * out)?.sum_keepdim(candle_core::D::Minus1)?;
        let dx = (grad.broadcast_sub(&dot)? * out)?;
        Ok(vec![Some(dx)])
    }
}

/// Softmax over the last dimension.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    apply1(Softmax, &x.contiguous()?)
}

/// `a = silu(g) · u` with an analytic backward in f32, s = sigmoid(g):
/// `dg = grad · u · s · (1 + g · (1 − s))`, `du = grad · g · s`.
///
/// One op at a time, each temporary dropped as soon as it is read, so at most three
/// `[n, i]` f32 buffers beyond the inputs and the incoming gradient are alive at once
/// (plus their f32 casts in half precision); the gradients are plain, untracked tensors.
struct SiluMul;

impl TensorOp for SiluMul {
    fn name(&self) -> &'static str {
        "generic-silu-mul"
    }
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        r::silu_mul(&xs[0], &xs[1])
    }
    fn backward(&self, xs: &[Tensor], _out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (gate, up) = (&xs[0], &xs[1]);
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let g = f32(gate)?;
        let s = candle_nn::ops::sigmoid(&g)?;
        // SiLU's derivative s · (1 + g − g·s).
        let d = {
            let w = {
                let gs = (&g * &s)?;
                (&g - &gs)?
            };
            let w = (w + 1.0)?;
            (w * &s)?
        };
        let dg = {
            let p = (d * f32(up)?)?;
            (p * f32(grad)?)?.to_dtype(gate.dtype())?
        };
        let du = {
            let gs = (&g * s)?;
            drop(g);
            (gs * f32(grad)?)?.to_dtype(up.dtype())?
        };
        Ok(vec![Some(dg.detach()), Some(du.detach())])
    }
}

/// `silu(gate) * up`.
pub(crate) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    apply2(SiluMul, &gate.contiguous()?, &up.contiguous()?)
}

/// `x @ wᵀ` for a frozen `w`: the backward computes `x`'s gradient only — no weight-gradient
/// product and no weight-sized buffer.
struct FrozenLinear {
    w: Tensor,
}

impl TensorOp for FrozenLinear {
    fn name(&self) -> &'static str {
        "generic-frozen-linear"
    }
    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        xs[0].matmul(&self.w.t()?)
    }
    fn backward(
        &self,
        _xs: &[Tensor],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad.matmul(&self.w)?)])
    }
}

/// `x @ wᵀ` (`x`: `[n, in]`, `w`: `[out, in]`) with no gradient for `w`.
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    apply1(FrozenLinear { w: w.detach() }, &x.contiguous()?)
}

/// The summed cross-entropy of `rows @ wᵀ` against `labels`, `chunk` rows at a time. Between
/// forward and backward it keeps one log-sum-exp per row; the backward recomputes each chunk's
/// logits, so no `[rows × vocab]` tensor outlives one chunk.
struct LinearCrossEntropy {
    labels: Tensor,
    chunk: usize,
    /// Each row's loss `[n]` instead of their sum (GRPO weighs every token by its own
    /// gradient, which the backward then takes row by row).
    per_row: bool,
    /// Whether `w` gets a gradient (false for a LoRA-frozen head).
    w_grad: bool,
    /// Per-row log-sum-exp, written by the forward.
    lse: Mutex<Option<Tensor>>,
    /// Where the forward writes each row's entropy `[n]`, when asked (GRPO's metric).
    entropies: Option<std::sync::Arc<Mutex<Option<Tensor>>>>,
}

impl LinearCrossEntropy {
    /// Rows `start..start+len`: their f32 logits.
    fn logits(rows: &Tensor, w: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        rows.narrow(0, start, len)?
            .matmul(&w.t()?)?
            .to_dtype(DType::F32)
    }

    fn chunks(&self, n: usize) -> impl Iterator<Item = (usize, usize)> {
        let chunk = self.chunk.max(1);
        (0..n).step_by(chunk).map(move |s| (s, chunk.min(n - s)))
    }
}

impl TensorOp for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "generic-linear-cross-entropy"
    }

    fn forward(&self, xs: &[Tensor]) -> Result<Tensor> {
        let (rows, w) = (&xs[0], &xs[1]);
        let mut lses = Vec::new();
        let mut losses = Vec::new();
        let mut entropies = Vec::new();
        let mut total = Tensor::zeros((), DType::F32, rows.device())?;
        for (start, len) in self.chunks(rows.dim(0)?) {
            let z = Self::logits(rows, w, start, len)?;
            let lse = r::logsumexp_rows(&z)?;
            if self.entropies.is_some() {
                // H = lse − Σ softmax(z)·z.
                let p = z.broadcast_sub(&lse.unsqueeze(1)?)?.exp()?;
                entropies.push((&lse - p.mul(&z)?.sum(1)?)?);
            }
            let labels = self.labels.narrow(0, start, len)?.unsqueeze(1)?;
            let picked = z.gather(&labels.contiguous()?, 1)?.squeeze(1)?;
            let loss = (&lse - picked)?;
            if self.per_row {
                losses.push(loss);
            } else {
                total = (total + loss.sum_all()?)?;
            }
            lses.push(lse);
        }
        *lock(&self.lse) = Some(Tensor::cat(&lses, 0)?);
        if let Some(out) = &self.entropies {
            *lock(out) = Some(Tensor::cat(&entropies, 0)?);
        }
        if self.per_row {
            Tensor::cat(&losses, 0)
        } else {
            Ok(total)
        }
    }

    fn backward(&self, xs: &[Tensor], _out: &Tensor, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let (rows, w) = (&xs[0], &xs[1]);
        let Some(lse) = lock(&self.lse).take() else {
            bail!("generic-linear-cross-entropy: backward without forward (internal error)")
        };
        let grad = grad.to_dtype(DType::F32)?;
        let mut d_rows = Vec::new();
        let mut d_w: Option<Tensor> = None;
        for (start, len) in self.chunks(rows.dim(0)?) {
            // d loss / d logits = softmax − onehot(label), times the incoming scalar gradient.
            // Each step replaces the previous `[len × vocab]` tensor, so at most two exist at
            // once (the logits are gone once the probabilities exist).
            let p = Self::logits(rows, w, start, len)?
                .broadcast_sub(&lse.narrow(0, start, len)?.unsqueeze(1)?)?
                .exp()?;
            let labels = self.labels.narrow(0, start, len)?.unsqueeze(1)?;
            let minus_one = Tensor::full(-1f32, (len, 1), rows.device())?;
            let dz = p.scatter_add(&labels.contiguous()?, &minus_one, 1)?;
            drop(p);
            let scaled = if self.per_row {
                dz.broadcast_mul(&grad.narrow(0, start, len)?.unsqueeze(1)?)?
            } else {
                dz.broadcast_mul(&grad)?
            };
            drop(dz);
            let dz = scaled.to_dtype(w.dtype())?;
            drop(scaled);
            d_rows.push(dz.matmul(w)?);
            if self.w_grad {
                let r = rows.narrow(0, start, len)?;
                let g = dz.t()?.matmul(&r)?;
                d_w = Some(match d_w {
                    Some(acc) => (acc + g)?,
                    None => g,
                });
            }
        }
        Ok(vec![Some(Tensor::cat(&d_rows, 0)?), d_w])
    }
}

/// The summed cross-entropy of every row of `rows @ wᵀ` (`rows`: `[n, hidden]`, `w`:
/// `[vocab, hidden]`) against `labels` (`[n]` u32), as an f32 scalar.
pub(crate) fn linear_cross_entropy(
    rows: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    chunk: usize,
    w_trainable: bool,
) -> Result<Tensor> {
    apply_linear_cross_entropy(rows, w, labels, chunk, w_trainable, false, None)
}

/// [`linear_cross_entropy`] row by row: `[n]` f32, each row differentiable on its own; with
/// `entropies`, the forward also writes each row's entropy `[n]` there (detached).
pub(crate) fn linear_cross_entropy_rows(
    rows: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    chunk: usize,
    w_trainable: bool,
    entropies: Option<std::sync::Arc<Mutex<Option<Tensor>>>>,
) -> Result<Tensor> {
    apply_linear_cross_entropy(rows, w, labels, chunk, w_trainable, true, entropies)
}

/// The op of [`linear_cross_entropy`] (`per_row` false) and [`linear_cross_entropy_rows`].
fn apply_linear_cross_entropy(
    rows: &Tensor,
    w: &Tensor,
    labels: &Tensor,
    chunk: usize,
    w_trainable: bool,
    per_row: bool,
    entropies: Option<std::sync::Arc<Mutex<Option<Tensor>>>>,
) -> Result<Tensor> {
    if rows.dim(0)? != labels.dim(0)? {
        bail!(
            "linear cross-entropy: {} rows but {} labels",
            rows.dim(0)?,
            labels.dim(0)?
        )
    }
    let op = LinearCrossEntropy {
        labels: labels.detach(),
        chunk,
        per_row,
        w_grad: w_trainable,
        lse: Mutex::new(None),
        entropies,
    };
    apply2(op, &rows.contiguous()?, w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The analytic `silu_mul` backward against candle's autograd on `silu(g) · u`, in f32
    /// and bf16, and its gradients untracked.
    #[test]
    fn silu_mul_backward_matches_autograd() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
            let dev = Device::Cpu;
            let g0 = (Tensor::randn(0f32, 2.0, (5, 7), &dev).unwrap())
                .to_dtype(dtype)
                .unwrap();
            let u0 = (Tensor::randn(0f32, 1.0, (5, 7), &dev).unwrap())
                .to_dtype(dtype)
                .unwrap();
            let w = Tensor::randn(0f32, 1.0, (5, 7), &dev).unwrap();
            let grads = |f: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>| {
                let (g, u) = (
                    Var::from_tensor(&g0).unwrap(),
                    Var::from_tensor(&u0).unwrap(),
                );
                let out = f(g.as_tensor(), u.as_tensor()).unwrap();
                let loss = (out.to_dtype(DType::F32).unwrap() * &w)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                let store = loss.backward().unwrap();
                let dg = store.get(g.as_tensor()).unwrap().clone();
                let du = store.get(u.as_tensor()).unwrap().clone();
                (dg, du)
            };
            let (dg, du) = grads(&|g, u| silu_mul(g, u));
            let (rg, ru) = grads(&|g, u| r::silu_mul(g, u));
            for (a, b) in [(&dg, &rg), (&du, &ru)] {
                assert_eq!(a.dtype(), dtype);
                assert!(!a.track_op());
                let a = a.to_dtype(DType::F32).unwrap();
                let b = b.to_dtype(DType::F32).unwrap();
                let err = (a - &b).unwrap().abs().unwrap().max_all().unwrap();
                let scale = b
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                let err = err.to_scalar::<f32>().unwrap();
                assert!(
                    err <= tol * scale.max(1.0),
                    "{dtype:?}: {err} > {tol} × {scale}"
                );
            }
        }
    }
}
