//! Attention inside the native layer: the rotary embedding on token-major rows, and causal
//! softmax attention of every (batch, head) over strided views of the projections, forward
//! and backward, in blocks of query rows that skip the keys the causal mask hides.

use super::super::ops::matmul::{sgemm_on, MatRef};
use super::super::ops::{exp_shift_sum_in_place, min_rows_per_task, row_max};
use super::dims::LayerDims;
use candle_core::Result;
use rayon::prelude::*;

/// Rotates (or, with `backward`, un-rotates) every head of token-major rows `[n, heads, d]`.
pub(super) fn rope_rows(
    x: &mut [f32],
    heads: usize,
    d: usize,
    t: usize,
    cos: &[f32],
    sin: &[f32],
    backward: bool,
) {
    let half = d / 2;
    let width = heads * d;
    if width == 0 {
        return;
    }
    x.par_chunks_mut(width)
        .with_min_len(min_rows_per_task(width))
        .enumerate()
        .for_each(|(row, xr)| {
            let pos = row % t;
            let (c, s) = (&cos[pos * d..(pos + 1) * d], &sin[pos * d..(pos + 1) * d]);
            let (c1, c2) = c.split_at(half);
            let (s1, s2) = s.split_at(half);
            for head in xr.chunks_exact_mut(d) {
                let (x1, x2) = head.split_at_mut(half);
                for j in 0..half {
                    let (a, b) = (x1[j], x2[j]);
                    if backward {
                        x1[j] = a * c1[j] + b * s2[j];
                        x2[j] = b * c2[j] - a * s1[j];
                    } else {
                        x1[j] = a * c1[j] - b * s1[j];
                        x2[j] = b * c2[j] + a * s2[j];
                    }
                }
            }
        });
}

/// Query rows per block of the causal attention: block `[r0, r1)` only meets keys `< r1`
/// (the mask always hides later keys), which skips about 40 % of the score matrix at t = 256.
const CAUSAL_BLOCK: usize = 64;

/// The keys each causal block of each batch row attends to: `r1` normally; all `t` when a
/// query row of the block is fully masked (left padding), because its softmax is then uniform
/// over every key, as in transformers (all scores equal the mask's minimum).
fn block_key_cols(d: &LayerDims, mask: &[f32], mask_rows: usize) -> Vec<usize> {
    let t = d.t;
    let mut cols = Vec::new();
    for bi in 0..d.b {
        let m = &mask[(if mask_rows == 1 { 0 } else { bi }) * t * t..][..t * t];
        for r0 in (0..t).step_by(CAUSAL_BLOCK) {
            let r1 = (r0 + CAUSAL_BLOCK).min(t);
            let fully_masked =
                (r0..r1).any(|i| m[i * t..=i * t + i].iter().all(|&x| x <= f32::MIN / 2.0));
            cols.push(if fully_masked { t } else { r1 });
        }
    }
    cols
}

/// What the attention's forward keeps for its backward.
pub(super) struct SavedAttention {
    /// Rotated queries `[n, heads·head_dim]`, rotated keys and values `[n, kv_heads·head_dim]`.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention probabilities `[b, heads, t, t]`.
    probs: Vec<f32>,
    /// Keys per causal block (see [`block_key_cols`]).
    key_cols: Vec<usize>,
}

/// Causal softmax attention of the rotated `q`, `k` and `v` under the additive `mask`
/// (`mask_rows` of them): returns the output `[n, heads·head_dim]` and what backward needs
/// (which keeps `q`, `k` and `v`).
pub(super) fn forward(
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d: &LayerDims,
    mask: &[f32],
    mask_rows: usize,
) -> Result<(Vec<f32>, SavedAttention)> {
    let key_cols = block_key_cols(d, mask, mask_rows);
    let (probs, o) = softmax_attention(&q, &k, &v, d, mask, mask_rows, &key_cols)?;
    let saved = SavedAttention {
        q,
        k,
        v,
        probs,
        key_cols,
    };
    Ok((o, saved))
}

/// Softmax attention of every (batch, head): returns probabilities `[b, heads, t, t]` (zero
/// above the diagonal blocks) and the output `[n, heads·head_dim]`.
fn softmax_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: &LayerDims,
    mask: &[f32],
    mask_rows: usize,
    key_cols: &[usize],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (t, hd) = (d.t, d.head_dim);
    let (qd, kvd) = (d.q_dim(), d.kv_dim());
    let rep = d.heads / d.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut probs = vec![0f32; d.b * d.heads * t * t];
    let outs: Vec<Vec<f32>> = probs
        .par_chunks_mut(t * t)
        .enumerate()
        .map(|(bh, p)| -> Result<Vec<f32>> {
            let (bi, hi) = (bh / d.heads, bh % d.heads);
            let kvh = hi / rep;
            let m = &mask[(if mask_rows == 1 { 0 } else { bi }) * t * t..][..t * t];
            let mut oh = vec![0f32; t * hd];
            let blocks = t.div_ceil(CAUSAL_BLOCK);
            for (blk, r0) in (0..t).step_by(CAUSAL_BLOCK).enumerate() {
                let rows = (r0 + CAUSAL_BLOCK).min(t) - r0;
                let r1 = key_cols[bi * blocks + blk];
                let qb = block_view(q, d, bi, r0, rows, hi * hd, qd);
                let kb = block_view(k, d, bi, 0, r1, kvh * hd, kvd);
                let vb = block_view(v, d, bi, 0, r1, kvh * hd, kvd);
                let pb = &mut p[r0 * t..];
                sgemm_on(pb, t, 1, false, qb, kb.t(), false)?;
                for (i, row) in pb.chunks_mut(t).take(rows).enumerate() {
                    let row = &mut row[..r1];
                    for (s, m) in row.iter_mut().zip(&m[(r0 + i) * t..]) {
                        *s = *s * scale + m;
                    }
                    let max = row_max(row);
                    if max == f32::NEG_INFINITY {
                        row.fill(0.0);
                        continue;
                    }
                    let inv = 1.0 / exp_shift_sum_in_place(row, max);
                    for s in row.iter_mut() {
                        *s *= inv;
                    }
                }
                let pm = prob_block(&p[r0 * t..], rows, r1, t);
                sgemm_on(&mut oh[r0 * hd..], hd, 1, false, pm, vb, false)?;
            }
            Ok(oh)
        })
        .collect::<Result<_>>()?;
    let mut o = vec![0f32; d.n * qd];
    for (bh, oh) in outs.iter().enumerate() {
        let (bi, hi) = (bh / d.heads, bh % d.heads);
        for (i, src) in oh.chunks_exact(hd).enumerate() {
            let at = (bi * t + i) * qd + hi * hd;
            o[at..at + hd].copy_from_slice(src);
        }
    }
    Ok((probs, o))
}

/// Rows `[r0, r0 + rows)` of one head of token-major rows of width `width`.
fn block_view<'a>(
    data: &'a [f32],
    d: &LayerDims,
    batch: usize,
    r0: usize,
    rows: usize,
    col: usize,
    width: usize,
) -> MatRef<'a> {
    MatRef {
        data: &data[(batch * d.t + r0) * width + col..],
        rows,
        cols: d.head_dim,
        row_stride: width,
        col_stride: 1,
    }
}

/// The `rows × cols` top-left block of a row-major matrix with `stride` columns.
fn prob_block(data: &[f32], rows: usize, cols: usize, stride: usize) -> MatRef<'_> {
    MatRef {
        data,
        rows,
        cols,
        row_stride: stride,
        col_stride: 1,
    }
}

/// Gradients of [`forward`] w.r.t. the rotated queries, keys and values, given the output's
/// gradient `d_o`.
pub(super) fn backward(
    s: &SavedAttention,
    d_o: &[f32],
    d: &LayerDims,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (t, hd) = (d.t, d.head_dim);
    let (qd, kvd) = (d.q_dim(), d.kv_dim());
    let rep = d.heads / d.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    // Per (batch, head): dq of the head and its contributions to dk and dv of its kv head.
    let parts: Vec<[Vec<f32>; 3]> = (0..d.b * d.heads)
        .into_par_iter()
        .map(|bh| -> Result<[Vec<f32>; 3]> {
            let (bi, hi) = (bh / d.heads, bh % d.heads);
            let kvh = hi / rep;
            let p = &s.probs[bh * t * t..][..t * t];
            let mut dp = vec![0f32; CAUSAL_BLOCK.min(t) * t];
            let mut dq = vec![0f32; t * hd];
            let mut dk = vec![0f32; t * hd];
            let mut dv = vec![0f32; t * hd];
            let blocks = t.div_ceil(CAUSAL_BLOCK);
            for (blk, r0) in (0..t).step_by(CAUSAL_BLOCK).enumerate() {
                let rows = (r0 + CAUSAL_BLOCK).min(t) - r0;
                let r1 = s.key_cols[bi * blocks + blk];
                let dob = block_view(d_o, d, bi, r0, rows, hi * hd, qd);
                let qb = block_view(&s.q, d, bi, r0, rows, hi * hd, qd);
                let kb = block_view(&s.k, d, bi, 0, r1, kvh * hd, kvd);
                let vb = block_view(&s.v, d, bi, 0, r1, kvh * hd, kvd);
                let pm = prob_block(&p[r0 * t..], rows, r1, t);
                // dP = dO Vᵀ and dV += Pᵀ dO.
                sgemm_on(&mut dp, r1, 1, false, dob, vb.t(), false)?;
                sgemm_on(&mut dv, hd, 1, true, pm.t(), dob, false)?;
                // Softmax backward, then the 1/√d scaling of the scores.
                for (i, dr) in dp.chunks_exact_mut(r1).take(rows).enumerate() {
                    let pr = &p[(r0 + i) * t..][..r1];
                    let dot: f32 = dr.iter().zip(pr).map(|(a, b)| a * b).sum();
                    for (g, &y) in dr.iter_mut().zip(pr) {
                        *g = y * (*g - dot) * scale;
                    }
                }
                let ds = MatRef::row_major(&dp[..rows * r1], rows, r1);
                // dQ = dS K and dK += dSᵀ Q.
                sgemm_on(&mut dq[r0 * hd..], hd, 1, false, ds, kb, false)?;
                sgemm_on(&mut dk, hd, 1, true, ds.t(), qb, false)?;
            }
            Ok([dq, dk, dv])
        })
        .collect::<Result<_>>()?;
    let mut dq = vec![0f32; d.n * qd];
    let mut dk = vec![0f32; d.n * kvd];
    let mut dv = vec![0f32; d.n * kvd];
    for (bh, [pq, pk, pv]) in parts.iter().enumerate() {
        let (bi, hi) = (bh / d.heads, bh % d.heads);
        let kvh = hi / rep;
        for i in 0..t {
            let row = bi * t + i;
            let src = i * hd..(i + 1) * hd;
            let qa = row * qd + hi * hd;
            dq[qa..qa + hd].copy_from_slice(&pq[src.clone()]);
            let ka = row * kvd + kvh * hd;
            for ((k, v), (a, b)) in dk[ka..ka + hd]
                .iter_mut()
                .zip(&mut dv[ka..ka + hd])
                .zip(pk[src.clone()].iter().zip(&pv[src]))
            {
                *k += a;
                *v += b;
            }
        }
    }
    Ok((dq, dk, dv))
}
