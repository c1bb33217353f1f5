//! Cross-entropy losses with backward: on logits (`cross_entropy_rows`) and fused with the lm-head
//! projection so the full `[n, vocab]` logits never exist at once (`linear_cross_entropy`).

use super::kernel_path;
use super::matmul::{sgemm, sgemm_new, MatRef};
use super::simd::narrow_par;
use super::{
    composite, contiguous_slice, cpu_storage_to_tensor, dispatch_float, exp_shift_sum,
    exp_shift_sum_dot, exp_shift_sum_in_place, fast_exp, min_rows_per_task, row_max, use_fused,
    with_cpu, Elem,
};
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// Label value whose row is ignored (no loss, no gradient), as in PyTorch / transformers.
/// The crate's one definition: the loss gives it its meaning; `model::IGNORE_INDEX` and
/// `data::IGNORE_INDEX` (the label masks that produce it) re-export it.
pub const IGNORE_INDEX: i64 = -100;

/// Checks labels against the vocabulary; returns the indices of the rows that count.
fn active_rows(labels: &[i64], vocab: usize, op: &str) -> Result<Vec<usize>> {
    let mut active = Vec::with_capacity(labels.len());
    for (row, &l) in labels.iter().enumerate() {
        if l == IGNORE_INDEX {
            continue;
        }
        if l < 0 || l as u64 >= vocab as u64 {
            bail!(
                "{op}: label {l} at row {row} is outside the vocabulary [0, {vocab}); use {IGNORE_INDEX} to ignore a position"
            );
        }
        active.push(row);
    }
    Ok(active)
}

/// Log-sum-exp of an `f32` row; `-inf` for a fully `-inf` row.
#[inline]
fn logsumexp(row: &[f32]) -> f32 {
    let max = row_max(row);
    if max == f32::NEG_INFINITY || max.is_nan() {
        return max;
    }
    let sum = exp_shift_sum(row, max);
    max + sum.ln()
}

// ---------------------------------------------------------------------------------------------
// cross_entropy_rows
// ---------------------------------------------------------------------------------------------

/// Per-row cross-entropy `logsumexp(logits[r]) - logits[r, labels[r]]` as an `f32` tensor `[n]`,
/// `0` for rows labelled [`IGNORE_INDEX`] (-100). `logits`: `[n, v]`, any float dtype (computed in
/// `f32`). Differentiable w.r.t. `logits`: `grad[r] = g[r] * (softmax(logits[r]) - onehot(label))`.
pub fn cross_entropy_rows(logits: &Tensor, labels: &[i64]) -> Result<Tensor> {
    let (n, v) = logits.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "cross_entropy_rows: logits must be [rows, vocab], got shape {:?}; flatten batch and time first",
            logits.dims()
        ))
    })?;
    if labels.len() != n {
        bail!(
            "cross_entropy_rows: {} labels for {n} rows of logits; pass one label per row",
            labels.len()
        );
    }
    active_rows(labels, v, "cross_entropy_rows")?;
    if !use_fused(&[logits]) {
        return composite::cross_entropy_rows(logits, labels);
    }
    logits.contiguous()?.apply_op1(CrossEntropyRows {
        labels: labels.to_vec(),
    })
}

struct CrossEntropyRows {
    labels: Vec<i64>,
}

impl CustomOp1 for CrossEntropyRows {
    fn name(&self) -> &'static str {
        "cross_entropy_rows"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = layout.shape().dims2()?;
        fn run<T: Elem>(s: &CpuStorage, l: &Layout, labels: &[i64], v: usize) -> Result<Vec<f32>> {
            let x = contiguous_slice::<T>(s, l, "cross_entropy_rows")?;
            let mut loss = vec![0f32; labels.len()];
            if v == 0 {
                return Ok(loss);
            }
            let rows_per_task = min_rows_per_task(v);
            loss.par_chunks_mut(rows_per_task)
                .zip(x.par_chunks(rows_per_task * v))
                .zip(labels.par_chunks(rows_per_task))
                .for_each_init(
                    || vec![0f32; v],
                    |buf, ((lo, xr), lab)| {
                        for ((lo, row), &label) in lo.iter_mut().zip(xr.chunks_exact(v)).zip(lab) {
                            if label == IGNORE_INDEX {
                                continue;
                            }
                            for (b, x) in buf.iter_mut().zip(row) {
                                *b = x.f();
                            }
                            *lo = logsumexp(buf) - buf[label as usize];
                        }
                    },
                );
            Ok(loss)
        }
        let loss = dispatch_float!(
            storage,
            "cross_entropy_rows",
            run::<T>(storage, layout, &self.labels, v)
        )?;
        Ok((CpuStorage::F32(loss), Shape::from(n)))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F32)?.contiguous()?.to_vec1::<f32>()?;
        let (_, v) = arg.dims2()?;
        let gx = with_cpu(arg, "cross_entropy_rows", |s, l| {
            fn run<T: Elem>(
                s: &CpuStorage,
                l: &Layout,
                labels: &[i64],
                g: &[f32],
                v: usize,
            ) -> Result<CpuStorage> {
                let x = contiguous_slice::<T>(s, l, "cross_entropy_rows")?;
                let mut out = vec![T::ZERO; x.len()];
                if v == 0 {
                    return Ok(T::to_cpu_storage_owned(out));
                }
                let rows_per_task = min_rows_per_task(v);
                out.par_chunks_mut(rows_per_task * v)
                    .zip(x.par_chunks(rows_per_task * v))
                    .zip(labels.par_chunks(rows_per_task))
                    .zip(g.par_chunks(rows_per_task))
                    .for_each_init(
                        || vec![0f32; v],
                        |buf, (((o, xr), lab), gr)| {
                            for (((o, row), &label), &gv) in o
                                .chunks_exact_mut(v)
                                .zip(xr.chunks_exact(v))
                                .zip(lab)
                                .zip(gr)
                            {
                                if label == IGNORE_INDEX || gv == 0.0 {
                                    continue;
                                }
                                for (b, x) in buf.iter_mut().zip(row) {
                                    *b = x.f();
                                }
                                let lse = logsumexp(buf);
                                for (o, &b) in o.iter_mut().zip(buf.iter()) {
                                    *o = T::of(gv * fast_exp(b - lse));
                                }
                                let li = label as usize;
                                o[li] = T::of(gv * (fast_exp(buf[li] - lse) - 1.0));
                            }
                        },
                    );
                Ok(T::to_cpu_storage_owned(out))
            }
            dispatch_float!(s, "cross_entropy_rows", run::<T>(s, l, &self.labels, &g, v))
        })?;
        Ok(Some(cpu_storage_to_tensor(gx, arg.shape())?))
    }
}

// ---------------------------------------------------------------------------------------------
// linear_cross_entropy
// ---------------------------------------------------------------------------------------------

/// Fused lm-head projection + cross-entropy.
///
/// `hidden`: `[n, h]` final hidden states (already shifted so row `r` predicts `labels[r]`),
/// `weight`: `[v, h]` (the lm-head / tied embedding matrix; a transposed view of an `[h, v]`
/// tensor works without a copy), `labels`: one per row, [`IGNORE_INDEX`] (-100) to skip a row.
///
/// Returns `(sum, per_row)`: the `f32` scalar sum of the row losses and the `[n]` `f32` per-row
/// losses (0 for ignored rows). Both are differentiable w.r.t. `hidden` and `weight`.
///
/// Memory: the logits are produced `chunk_rows` rows at a time (`chunk_rows × v` `f32`), and only
/// for rows that are not ignored (prompt tokens masked with -100 cost nothing). Between forward
/// and backward the op keeps the per-row log-sum-exp (`n` `f32`), the labels, and the softmax of
/// the LAST chunk (≤ `chunk_rows × v` `f32`, so backward need not recompute that chunk; with
/// `n ≤ chunk_rows` nothing is recomputed). The graph also holds `hidden` and `weight`, which the
/// caller has anyway. Backward recomputes the logits of the other chunks one at a time and
/// accumulates `grad_weight` in place (no per-chunk gradient tensors). Half-precision inputs are
/// converted to `f32` copies first (the copy of `weight` lives until backward).
///
/// Choosing `chunk_rows`: each chunk's `grad_weight` update re-reads and re-writes the whole
/// `v × h` `f32` gradient, and small chunks make thin, memory-bound matmuls, so prefer 256–1024
/// rows (256 rows × 49,152 vocab = 50 MB of logits) over small chunks.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[i64],
    chunk_rows: usize,
) -> Result<(Tensor, Tensor)> {
    linear_cross_entropy_with_sink(hidden, weight, labels, chunk_rows, None)
}

/// Receives the weight gradient of [`linear_cross_entropy_with_sink`] instead of candle's
/// gradient store (the model adds it to its side table of parameter gradients).
pub(crate) type WeightGradSink = Box<dyn Fn(Tensor) -> Result<()> + Send + Sync>;

/// [`linear_cross_entropy`]; with a `sink`, the fused CPU kernel hands the weight gradient to
/// it and reports none to the graph, which saves the store's zero-fill-then-add of a
/// `vocab × hidden` matrix. The sink is only used when the weight is a row-major `[v, h]`
/// tensor (the parameter itself); it gets the gradient in the weight's dtype (a half-precision
/// weight's rounded as the cast's backward rounds it). Otherwise the gradient flows as usual.
pub(crate) fn linear_cross_entropy_with_sink(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[i64],
    chunk_rows: usize,
    sink: Option<WeightGradSink>,
) -> Result<(Tensor, Tensor)> {
    linear_cross_entropy_fused(hidden, weight, labels, chunk_rows, sink, None)
}

/// Where the fused op writes each row's entropy of `softmax(hidden @ weightᵀ)` (0 for an
/// ignored row), computed in the forward's pass over the logits: GRPO's `entropy` metric,
/// without a second pass over the head.
pub(crate) type EntropySink = Arc<Mutex<Option<Vec<f32>>>>;

/// [`linear_cross_entropy_with_sink`], also writing each row's entropy to `entropies` when
/// the fused kernel runs (the composite fallback leaves it `None`).
pub(crate) fn linear_cross_entropy_fused(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[i64],
    chunk_rows: usize,
    sink: Option<WeightGradSink>,
    entropies: Option<EntropySink>,
) -> Result<(Tensor, Tensor)> {
    let (n, h) = hidden.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "linear_cross_entropy: hidden must be [rows, hidden_size], got shape {:?}; flatten batch and time first",
            hidden.dims()
        ))
    })?;
    let (v, wh) = weight.dims2().map_err(|_| {
        candle_core::Error::Msg(format!(
            "linear_cross_entropy: weight must be [vocab, hidden_size], got shape {:?}",
            weight.dims()
        ))
    })?;
    if wh != h {
        bail!(
            "linear_cross_entropy: hidden size {h} does not match the weight's [{v}, {wh}]; pass the lm-head weight as [vocab, hidden]"
        );
    }
    if labels.len() != n {
        bail!(
            "linear_cross_entropy: {} labels for {n} hidden rows; pass one label per row",
            labels.len()
        );
    }
    if chunk_rows == 0 {
        bail!("linear_cross_entropy: chunk_rows is 0; use at least 1 (e.g. 256)");
    }
    let active = active_rows(labels, v, "linear_cross_entropy")?;
    if !hidden.device().same_device(weight.device())
        || !hidden.device().is_cpu()
        || !use_fused(&[hidden, weight])
    {
        return composite::linear_cross_entropy(hidden, weight, labels, chunk_rows);
    }
    // The sink takes the gradient in the weight's own dtype (rounded as the cast's backward
    // would), so half-precision heads use it too. It needs a row-major [v, h] weight (the
    // backward writes a transposed one's gradient column-major).
    let row_major = weight.is_contiguous() && (v <= 1 || weight.stride()[0] != 1);
    let sink = sink.filter(|_| row_major);
    let weight_dtype = weight.dtype();
    let hidden = hidden.to_dtype(DType::F32)?.contiguous()?;
    // A bf16 head is multiplied as it is where a bf16 kernel is this CPU's fastest path
    // (`kernel_path`), when its gradient goes to the sink (or it has none); otherwise the head
    // is cast on every thread (see `cast`).
    let bf16_head = weight_dtype == DType::BF16
        && kernel_path::bf16_products()
        && row_major
        && (sink.is_some() || !weight.track_op());
    let mut weight = if bf16_head {
        weight.clone()
    } else {
        super::to_f32(weight)?
    };
    if sink.is_some() {
        // The gradient goes to the sink, never to the graph: a tracked cast would be a node
        // without a gradient, which candle's backward refuses.
        weight = weight.detach();
    }
    // A contiguous [v, h] or a transposed view of a contiguous [h, v] are used in place.
    if !(weight.is_contiguous() || weight.t()?.is_contiguous()) {
        weight = weight.contiguous()?;
    }
    let per_row = hidden.apply_op2(
        &weight,
        LinearCrossEntropy {
            labels: labels.to_vec(),
            active,
            chunk_rows,
            saved: Mutex::new(None),
            sink,
            weight_dtype,
            entropies,
        },
    )?;
    let sum = per_row.sum_all()?;
    Ok((sum, per_row))
}

/// What forward leaves for backward.
struct Saved {
    /// Log-sum-exp per row (0 for ignored rows).
    lse: Vec<f32>,
    /// Softmax of the last chunk: (index of the chunk's first entry in `active`, probabilities).
    last_chunk: Option<(usize, Vec<f32>)>,
}

struct LinearCrossEntropy {
    labels: Vec<i64>,
    /// Rows whose label is not ignored, ascending.
    active: Vec<usize>,
    chunk_rows: usize,
    saved: Mutex<Option<Saved>>,
    /// Where the weight gradient goes instead of the graph (see `linear_cross_entropy_with_sink`).
    sink: Option<WeightGradSink>,
    /// The dtype of the weight the caller passed (the op computes on its f32 cast, or on the
    /// bf16 weight itself on a bf16 kernel's path).
    weight_dtype: DType,
    /// Where the forward writes each row's entropy, when asked.
    entropies: Option<EntropySink>,
}

/// The `[v, h]` weight as a strided view (contiguous or transposed-contiguous storage).
fn weight_view<'a, T>(data: &'a [T], layout: &Layout) -> Result<MatRef<'a, T>> {
    let (v, h) = layout.shape().dims2()?;
    let stride = layout.stride();
    let start = layout.start_offset();
    let len = v * h;
    let Some(slice) = data.get(start..start + len) else {
        bail!("linear_cross_entropy: weight layout out of bounds")
    };
    let (row_stride, col_stride) = (stride[0], stride[1]);
    let dense = (row_stride == h && col_stride == 1) || (row_stride == 1 && col_stride == v);
    if !dense && v > 1 && h > 1 {
        bail!("linear_cross_entropy: weight strides {stride:?} are neither row- nor column-major (internal error: make it contiguous)");
    }
    Ok(MatRef {
        data: slice,
        rows: v,
        cols: h,
        row_stride: if v > 1 { row_stride } else { h },
        col_stride: if h > 1 { col_stride } else { 1 },
    })
}

/// The lm-head weight the op multiplies: `f32`, or bf16 where a bf16 kernel is the chosen path
/// (`kernel_path`; the products round their other operand to bf16, as autocast does).
#[derive(Clone, Copy)]
enum Head<'a> {
    F32(MatRef<'a>),
    Bf16(MatRef<'a, bf16>),
}

impl<'a> Head<'a> {
    /// The weight of a CPU storage as a `[v, h]` view.
    fn of(storage: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        Ok(match storage {
            CpuStorage::BF16(data) => Head::Bf16(weight_view(data, layout)?),
            other => Head::F32(weight_view(other.as_slice::<f32>()?, layout)?),
        })
    }

    /// Vocabulary size (rows of the weight).
    fn vocab(self) -> usize {
        match self {
            Head::F32(w) => w.rows,
            Head::Bf16(w) => w.rows,
        }
    }

    /// `logits[c, v] = hidden_chunk @ Wᵀ` as a new buffer.
    fn logits(self, hc: &[f32], c: usize, h: usize) -> Result<Vec<f32>> {
        let hm = MatRef::row_major(hc, c, h);
        match self {
            Head::F32(w) => sgemm_new(hm, w.t()),
            Head::Bf16(w) => kernel_path::gemm_new(hm, w.t()),
        }
    }

    /// `dst[c, h] = d @ W`.
    fn input_grad(self, dst: &mut [f32], h: usize, d: MatRef<'_>) -> Result<()> {
        match self {
            Head::F32(w) => sgemm(dst, h, 1, false, d, w),
            Head::Bf16(w) => kernel_path::gemm(dst, h, false, d, w),
        }
    }

    /// `dW = dᵀ @ hidden_chunk` as a new row-major `[v, h]` buffer.
    fn new_weight_grad(self, d: MatRef<'_>, hm: MatRef<'_>) -> Result<Vec<f32>> {
        match self {
            Head::F32(_) => sgemm_new(d.t(), hm),
            Head::Bf16(_) => kernel_path::gemm_new(d.t(), hm),
        }
    }

    /// `dW (+)= dᵀ @ hidden_chunk` into `gw` (`accumulate`), row stride `rs`, column stride
    /// `cs`; a bf16 head's gradient (always row-major) rounds its operands like its products.
    fn weight_grad(
        self,
        gw: &mut [f32],
        (rs, cs): (usize, usize),
        accumulate: bool,
        d: MatRef<'_>,
        hm: MatRef<'_>,
    ) -> Result<()> {
        match self {
            Head::Bf16(_) if cs == 1 => kernel_path::gemm(gw, rs, accumulate, d.t(), hm),
            _ => sgemm(gw, rs, cs, accumulate, d.t(), hm),
        }
    }
}

impl LinearCrossEntropy {
    /// The hidden rows of one chunk as a dense `[c, h]` matrix: borrowed when the rows are
    /// consecutive, gathered into `buf` otherwise.
    fn chunk_hidden<'a>(
        hidden: &'a [f32],
        rows: &[usize],
        h: usize,
        buf: &'a mut Vec<f32>,
    ) -> &'a [f32] {
        let (first, last) = (rows[0], rows[rows.len() - 1]);
        if last - first + 1 == rows.len() {
            return &hidden[first * h..(last + 1) * h];
        }
        buf.clear();
        for &r in rows {
            buf.extend_from_slice(&hidden[r * h..(r + 1) * h]);
        }
        buf
    }
}

impl CustomOp2 for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "linear_cross_entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, h) = l1.shape().dims2()?;
        let hidden = contiguous_slice::<f32>(s1, l1, "linear_cross_entropy")?;
        let w = Head::of(s2, l2)?;
        let v = w.vocab();
        let mut loss = vec![0f32; n];
        let mut lse = vec![0f32; n];
        let want_entropy = self.entropies.is_some();
        let mut entropy = if want_entropy {
            vec![0f32; n]
        } else {
            Vec::new()
        };
        let mut last_chunk = None;
        if !self.active.is_empty() && v > 0 {
            let c_max = self.chunk_rows.min(self.active.len());
            let mut hbuf = Vec::new();
            let n_chunks = self.active.len().div_ceil(c_max);
            for (ci, rows) in self.active.chunks(c_max).enumerate() {
                let c = rows.len();
                let hc = Self::chunk_hidden(hidden, rows, h, &mut hbuf);
                let mut logits = w.logits(hc, c, h)?;
                let keep = ci + 1 == n_chunks;
                // Per row: lse, loss; for the kept chunk turn the logits into probabilities.
                let results: Vec<(f32, f32, f32)> = logits[..c * v]
                    .par_chunks_mut(v)
                    .with_min_len(min_rows_per_task(v))
                    .zip(rows.par_iter())
                    .map(|(row, &r)| {
                        let label = self.labels[r] as usize;
                        let target = row[label];
                        let max = row_max(row);
                        let (sum, dot) = if want_entropy {
                            exp_shift_sum_dot(row, max, keep)
                        } else if keep {
                            (exp_shift_sum_in_place(row, max), 0.0)
                        } else {
                            (exp_shift_sum(row, max), 0.0)
                        };
                        if keep {
                            let inv = 1.0 / sum;
                            for x in row.iter_mut() {
                                *x *= inv;
                            }
                        }
                        let l = max + sum.ln();
                        (l, l - target, sum.ln() - dot / sum)
                    })
                    .collect();
                for (&r, (l, lo, h)) in rows.iter().zip(results) {
                    lse[r] = l;
                    loss[r] = lo;
                    if want_entropy {
                        entropy[r] = h;
                    }
                }
                if keep {
                    last_chunk = Some((ci * c_max, logits));
                }
            }
        }
        if let Some(sink) = &self.entropies {
            if let Ok(mut out) = sink.lock() {
                *out = Some(entropy);
            }
        }
        if let Ok(mut saved) = self.saved.lock() {
            *saved = Some(Saved { lse, last_chunk });
        }
        Ok((CpuStorage::F32(loss), Shape::from(n)))
    }

    fn bwd(
        &self,
        hidden_t: &Tensor,
        weight_t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, h) = hidden_t.dims2()?;
        let (v, _) = weight_t.dims2()?;
        let g = grad.to_dtype(DType::F32)?.contiguous()?.to_vec1::<f32>()?;
        let saved = match self.saved.lock() {
            Ok(mut s) => match s.as_mut() {
                // Keep lse for a second backward over the same graph; hand the cached chunk over.
                Some(s) => Some((s.lse.clone(), s.last_chunk.take())),
                None => None,
            },
            Err(_) => None,
        };
        let Some((lse, mut last_chunk)) = saved else {
            bail!("linear_cross_entropy backward: forward state missing (internal error)")
        };
        // grad_weight keeps the weight's storage order (row- or column-major), so a transposed
        // [h, v] parameter gets a contiguous gradient after the transpose backward.
        let w_transposed = weight_t.stride()[0] == 1 && v > 1;
        // A frozen head (LoRA) gets no weight gradient: skipping it saves one of the head's
        // three `rows × vocab × hidden` products and a `vocab × hidden` f32 buffer (113 MB on
        // SmolLM2-135M) that candle would otherwise keep in its store until backward returns.
        let want_w = weight_t.track_op() || self.sink.is_some();
        let mut grad_h = vec![0f32; n * h];
        // Written by the first chunk's product (zeroed only when no row counts).
        let mut grad_w: Option<Vec<f32>> = None;
        let (gw_rs, gw_cs) = if w_transposed { (1, v) } else { (h, 1) };
        with_cpu(hidden_t, "linear_cross_entropy", |hs, hl| {
            with_cpu(weight_t, "linear_cross_entropy", |ws, wl| {
                let hidden = contiguous_slice::<f32>(hs, hl, "linear_cross_entropy")?;
                let w = Head::of(ws, wl)?;
                if self.active.is_empty() || v == 0 {
                    return Ok(());
                }
                let c_max = self.chunk_rows.min(self.active.len());
                let mut hbuf = Vec::new();
                let mut gh_chunk = vec![0f32; c_max * h];
                let starts: Vec<usize> = (0..self.active.len()).step_by(c_max).collect();
                // Last chunk first: it may still be cached from forward.
                for &start in starts.iter().rev() {
                    let rows = &self.active[start..(start + c_max).min(self.active.len())];
                    let c = rows.len();
                    let cached = match last_chunk.take() {
                        Some((s, p)) if s == start && p.len() == c * v => Some(p),
                        _ => None,
                    };
                    let hc = Self::chunk_hidden(hidden, rows, h, &mut hbuf);
                    let have_probs = cached.is_some();
                    let mut probs = match cached {
                        Some(p) => p,
                        None => w.logits(hc, c, h)?,
                    };
                    // d = g_r * (softmax - onehot(label)), in place.
                    probs[..c * v]
                        .par_chunks_mut(v)
                        .with_min_len(min_rows_per_task(v))
                        .zip(rows.par_iter())
                        .for_each(|(row, &r)| {
                            let gr = g[r];
                            let label = self.labels[r] as usize;
                            if have_probs {
                                for x in row.iter_mut() {
                                    *x *= gr;
                                }
                            } else {
                                let l = lse[r];
                                for x in row.iter_mut() {
                                    *x = gr * fast_exp(*x - l);
                                }
                            }
                            row[label] -= gr;
                        });
                    let d = MatRef::row_major(&probs[..c * v], c, v);
                    // grad_hidden rows = d @ W
                    w.input_grad(&mut gh_chunk[..c * h], h, d)?;
                    for (i, &r) in rows.iter().enumerate() {
                        grad_h[r * h..(r + 1) * h].copy_from_slice(&gh_chunk[i * h..(i + 1) * h]);
                    }
                    // grad_W (+)= d^T @ hidden_chunk
                    if !want_w {
                        continue;
                    }
                    let hm = MatRef::row_major(hc, c, h);
                    match grad_w.as_mut() {
                        Some(gw) => w.weight_grad(gw, (gw_rs, gw_cs), true, d, hm)?,
                        None if w_transposed => {
                            let mut gw = vec![0f32; v * h];
                            w.weight_grad(&mut gw, (gw_rs, gw_cs), false, d, hm)?;
                            grad_w = Some(gw);
                        }
                        None => grad_w = Some(w.new_weight_grad(d, hm)?),
                    }
                }
                Ok(())
            })
        })?;
        let dev = hidden_t.device();
        let gh = Tensor::from_vec(grad_h, (n, h), dev)?;
        if !want_w {
            return Ok((Some(gh), None));
        }
        let grad_w = grad_w.unwrap_or_else(|| vec![0f32; v * h]);
        Ok((
            Some(gh),
            self.weight_grad(grad_w, (v, h), w_transposed, dev)?,
        ))
    }
}

impl LinearCrossEntropy {
    /// The `[v, h]` weight gradient for the graph, or `None` once the sink has it (in the
    /// weight's dtype).
    fn weight_grad(
        &self,
        grad_w: Vec<f32>,
        (v, h): (usize, usize),
        w_transposed: bool,
        dev: &candle_core::Device,
    ) -> Result<Option<Tensor>> {
        if let (Some(sink), false) = (&self.sink, w_transposed) {
            sink(match self.weight_dtype {
                DType::BF16 => Tensor::from_vec(narrow_par::<bf16>(&grad_w), (v, h), dev)?,
                DType::F16 => Tensor::from_vec(narrow_par::<f16>(&grad_w), (v, h), dev)?,
                _ => Tensor::from_vec(grad_w, (v, h), dev)?,
            })?;
            return Ok(None);
        }
        Ok(Some(if w_transposed {
            Tensor::from_vec(grad_w, (h, v), dev)?.t()?
        } else {
            Tensor::from_vec(grad_w, (v, h), dev)?
        }))
    }
}
