//! The token-embedding lookup as one CPU op whose backward adds the looked-up rows' gradients
//! straight into the side-table gradient of the embedding matrix.
//!
//! Through candle's `index_select` the backward allocates a zeroed `vocab × hidden` matrix,
//! `index_add`s into a copy of it and adds that to the gradient store (where a tied lm-head's
//! gradient already sits): three passes over a 113 MB matrix for SmolLM2's 49,152 × 576
//! embeddings, to add 256 rows. Here the lm-head's gradient (handed to the side table by the
//! fused loss) is updated in place, row by row.
//!
//! In half precision the sums are rounded as the graph's are (`index_add` into a zero matrix
//! rounds after each row, the sum with the head's gradient once more), so both paths give
//! the same bits; in f32 a repeated id is added straight into the head's gradient.

use super::ops::{contiguous_slice, fused_dtype, Elem};
use super::side_grads::SideGrads;
use candle_core::{bail, CpuStorage, CustomOp1, InplaceOp1, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

const OP: &str = "native embedding";

/// Whether `weight` (the embedding parameter) can use [`embedding`]: a dense `f32`, `bf16` or
/// `f16` CPU matrix.
pub(crate) fn applies(weight: &Tensor) -> bool {
    fused_dtype(weight.dtype())
        && weight.device().is_cpu()
        && weight.is_contiguous()
        && weight.rank() == 2
}

/// Rows `ids` of `weight` (`[vocab, hidden]`) as `[ids.len(), hidden]`; backward adds the
/// gradient into the side-table entry `name` (creating it when absent) and reports no gradient
/// to the graph. `ids` must be below `vocab` (the model checks them first). Rows looked up
/// for `padding_idx` add nothing (torch's `nn.Embedding(padding_idx=…)`).
pub(crate) fn embedding(
    weight: &Tensor,
    ids: Vec<u32>,
    padding_idx: Option<u32>,
    name: &str,
    side: &SideGrads,
) -> Result<Tensor> {
    let (vocab, _) = weight.dims2()?;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("{OP}: token id {bad} is outside the vocabulary of {vocab} (internal error: ids are checked first)");
    }
    weight.apply_op1(Embedding {
        ids,
        padding_idx,
        name: name.to_string(),
        side: side.clone(),
    })
}

struct Embedding {
    ids: Vec<u32>,
    padding_idx: Option<u32>,
    name: String,
    side: SideGrads,
}

impl Embedding {
    /// The looked-up rows of a `[vocab, h]` matrix of `T`.
    fn rows<T: Elem>(&self, storage: &CpuStorage, layout: &Layout, h: usize) -> Result<Vec<T>> {
        let w = contiguous_slice::<T>(storage, layout, OP)?;
        let mut out = vec![T::ZERO; self.ids.len() * h];
        out.par_chunks_mut(h.max(1))
            .zip(self.ids.par_iter())
            .with_min_len(64)
            .for_each(|(row, &id)| {
                let at = id as usize * h;
                row.copy_from_slice(&w[at..at + h]);
            });
        Ok(out)
    }
}

impl CustomOp1 for Embedding {
    fn name(&self) -> &'static str {
        "native-embedding"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, h) = layout.shape().dims2()?;
        let out = match storage {
            CpuStorage::F32(_) => CpuStorage::F32(self.rows::<f32>(storage, layout, h)?),
            CpuStorage::BF16(_) => CpuStorage::BF16(self.rows::<bf16>(storage, layout, h)?),
            CpuStorage::F16(_) => CpuStorage::F16(self.rows::<f16>(storage, layout, h)?),
            _ => bail!("{OP}: expected f32, bf16 or f16 weights (internal error)"),
        };
        Ok((out, Shape::from((self.ids.len(), h))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (vocab, h) = arg.dims2()?;
        let g = grad.to_dtype(arg.dtype())?.contiguous()?;
        let mut side = self.side.grads();
        let scatter = ScatterAddRows {
            ids: &self.ids,
            skip: self.padding_idx,
            rows: &g,
            hidden: h,
        };
        match side.remove(&self.name) {
            // The tied lm-head's gradient, freshly made by the loss: add in place.
            Some(prev)
                if applies(&prev) && prev.dtype() == arg.dtype() && prev.dims() == [vocab, h] =>
            {
                prev.inplace_op1(&scatter)?;
                side.insert(self.name.clone(), prev);
            }
            prev => {
                let fresh = Tensor::zeros((vocab, h), arg.dtype(), arg.device())?;
                fresh.inplace_op1(&scatter)?;
                let total = match prev {
                    Some(p) => (p + fresh)?,
                    None => fresh,
                };
                side.insert(self.name.clone(), total);
            }
        }
        Ok(None)
    }
}

/// `dst[ids[i]] += rows[i]` on a row-major `[vocab, hidden]` matrix, in the order of `ids`
/// (repeated ids accumulate as `index_add` does; see the module's doc for half precision),
/// except for the id `skip` (the padding index).
struct ScatterAddRows<'a> {
    ids: &'a [u32],
    skip: Option<u32>,
    rows: &'a Tensor,
    hidden: usize,
}

impl InplaceOp1 for ScatterAddRows<'_> {
    fn name(&self) -> &'static str {
        "native-embedding-scatter-add"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let (rs, rl) = self.rows.storage_and_layout();
        let candle_core::Storage::Cpu(rows) = &*rs else {
            bail!("{OP}: gradient is not on the CPU (internal error)")
        };
        let start = layout.start_offset();
        match storage {
            CpuStorage::F32(dst) => self.add_f32(dst, start, contiguous_slice(rows, rl, OP)?),
            CpuStorage::BF16(dst) => self.add_rounded(dst, start, contiguous_slice(rows, rl, OP)?),
            CpuStorage::F16(dst) => self.add_rounded(dst, start, contiguous_slice(rows, rl, OP)?),
            _ => bail!("{OP}: gradient matrix is not a float matrix (internal error)"),
        }
    }
}

impl ScatterAddRows<'_> {
    /// The row of `dst` (from `start`) that token `id` owns.
    fn dst_row<'d, T>(&self, dst: &'d mut [T], start: usize, id: u32) -> Result<&'d mut [T]> {
        let at = start + id as usize * self.hidden;
        match dst.get_mut(at..at + self.hidden) {
            Some(d) => Ok(d),
            None => bail!("{OP}: token id {id} outside the gradient matrix (internal error)"),
        }
    }

    fn add_f32(&self, dst: &mut [f32], start: usize, rows: &[f32]) -> Result<()> {
        for (&id, row) in self.ids.iter().zip(rows.chunks_exact(self.hidden.max(1))) {
            if Some(id) == self.skip {
                continue;
            }
            for (d, r) in self.dst_row(dst, start, id)?.iter_mut().zip(row) {
                *d += r;
            }
        }
        Ok(())
    }

    /// Half precision: each id's rows summed first, rounding after each (what `index_add` into
    /// a zero matrix does), then added to `dst` with one more rounding (the graph's sum of the
    /// head's gradient and the embedding's).
    fn add_rounded<T: Elem>(&self, dst: &mut [T], start: usize, rows: &[T]) -> Result<()> {
        let h = self.hidden.max(1);
        if rows.len() != self.ids.len() * h {
            bail!(
                "{OP}: {} gradient values for {} ids (internal error)",
                rows.len(),
                self.ids.len()
            );
        }
        let mut order: Vec<usize> = (0..self.ids.len()).collect();
        order.sort_by_key(|&i| self.ids[i]); // stable: each id's rows stay in their order
        let mut acc = vec![0f32; h];
        for group in order.chunk_by(|&a, &b| self.ids[a] == self.ids[b]) {
            if Some(self.ids[group[0]]) == self.skip {
                continue;
            }
            acc.fill(0.0);
            for &i in group {
                for (a, r) in acc.iter_mut().zip(&rows[i * h..(i + 1) * h]) {
                    *a = T::of(*a + r.f()).f();
                }
            }
            for (d, a) in self
                .dst_row(dst, start, self.ids[group[0]])?
                .iter_mut()
                .zip(&acc)
            {
                *d = T::of(d.f() + a);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::side_grads::SideTable;
    use candle_core::{DType, Device};
    use std::collections::HashMap;

    /// In bf16 the native backward gives the graph's bits: `index_add` of every occurrence into
    /// a zero matrix (rounding after each row), then the sum with the tied head's gradient.
    #[test]
    fn half_precision_backward_rounds_like_the_graph() {
        let dev = Device::Cpu;
        let (vocab, h) = (11usize, 5usize);
        let ids: Vec<u32> = vec![3, 7, 3, 3, 10, 0, 7, 3];
        let values = |n: usize, seed: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 * 0.37 + seed).sin() * 3.1).powi(3))
                .collect()
        };
        let bf = |v: Vec<f32>, shape: (usize, usize)| {
            Tensor::from_vec(v, shape, &dev)
                .and_then(|t| t.to_dtype(DType::BF16))
                .unwrap()
        };
        let weight = bf(values(vocab * h, 0.1), (vocab, h));
        let head = bf(values(vocab * h, 0.7), (vocab, h));
        let rows = bf(values(ids.len() * h, 1.3), (ids.len(), h));

        let index = Tensor::new(ids.as_slice(), &dev).unwrap();
        let zeros = Tensor::zeros((vocab, h), DType::BF16, &dev).unwrap();
        let graph = (&head + zeros.index_add(&index, &rows, 0).unwrap()).unwrap();

        let side: SideGrads = SideTable::with(HashMap::from([("w".to_string(), head)]));
        let op = Embedding {
            ids,
            padding_idx: None,
            name: "w".into(),
            side: side.clone(),
        };
        let out = weight.apply_op1_no_bwd(&op).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        assert!(op.bwd(&weight, &out, &rows).unwrap().is_none());
        let native = side.grads().remove("w").unwrap();
        let bits = |t: &Tensor| -> Vec<u16> {
            t.flatten_all()
                .unwrap()
                .to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        assert_eq!(bits(&native), bits(&graph));
    }

    /// The padding index's lookups add nothing, in f32 and in bf16 (its row keeps the tied
    /// head's gradient), and the other rows are added as without it.
    #[test]
    fn the_padding_index_gets_no_lookup_gradient() {
        let dev = Device::Cpu;
        let (vocab, h) = (6usize, 3usize);
        let ids: Vec<u32> = vec![2, 4, 2, 0, 4];
        let head: Vec<f32> = (0..vocab * h).map(|i| i as f32 * 0.5).collect();
        let rows: Vec<f32> = (0..ids.len() * h).map(|i| 1.0 + i as f32).collect();
        let mut want = head.clone();
        for (&id, row) in ids.iter().zip(rows.chunks_exact(h)) {
            if id != 2 {
                for (w, r) in want[id as usize * h..][..h].iter_mut().zip(row) {
                    *w += r;
                }
            }
        }
        for dtype in [DType::F32, DType::BF16] {
            let t = |v: &[f32], shape: (usize, usize)| {
                Tensor::from_slice(v, shape, &dev)
                    .and_then(|x| x.to_dtype(dtype))
                    .unwrap()
            };
            let weight = t(&vec![0.0; vocab * h], (vocab, h));
            let side: SideGrads =
                SideTable::with(HashMap::from([("w".to_string(), t(&head, (vocab, h)))]));
            let op = Embedding {
                ids: ids.clone(),
                padding_idx: Some(2),
                name: "w".into(),
                side: side.clone(),
            };
            let out = weight.apply_op1_no_bwd(&op).unwrap();
            assert!(op
                .bwd(&weight, &out, &t(&rows, (ids.len(), h)))
                .unwrap()
                .is_none());
            let got = side.grads().remove("w").unwrap();
            let got = got
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert_eq!(got, want, "{dtype:?}");
        }
    }
}
