//! The token-embedding lookup as one CPU op whose backward adds the looked-up rows' gradients
//! straight into the side-table gradient of the embedding matrix.
//!
//! Through candle's `index_select` the backward allocates a zeroed `vocab × hidden` matrix,
//! `index_add`s into a copy of it and adds that to the gradient store (where a tied lm-head's
//! gradient already sits): three passes over a 113 MB matrix for SmolLM2's 49,152 × 576
//! embeddings, to add 256 rows. Here the lm-head's gradient (handed to the side table by the
//! fused loss) is updated in place, row by row.

use super::native_layer::SideGrads;
use super::ops::contiguous_slice;
use candle_core::{bail, CpuStorage, CustomOp1, DType, InplaceOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const OP: &str = "native embedding";

/// Whether `weight` (the embedding parameter) can use [`embedding`]: a dense `f32` CPU matrix.
pub(crate) fn applies(weight: &Tensor) -> bool {
    weight.dtype() == DType::F32
        && weight.device().is_cpu()
        && weight.is_contiguous()
        && weight.rank() == 2
}

/// Rows `ids` of `weight` (`[vocab, hidden]`) as `[ids.len(), hidden]`; backward adds the
/// gradient into the side-table entry `name` (creating it when absent) and reports no gradient
/// to the graph. `ids` must be below `vocab` (the model checks them first).
pub(crate) fn embedding(
    weight: &Tensor,
    ids: Vec<u32>,
    name: &str,
    side: &SideGrads,
) -> Result<Tensor> {
    let (vocab, _) = weight.dims2()?;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        bail!("{OP}: token id {bad} is outside the vocabulary of {vocab} (internal error: ids are checked first)");
    }
    weight.apply_op1(Embedding {
        ids,
        name: name.to_string(),
        side: side.clone(),
    })
}

struct Embedding {
    ids: Vec<u32>,
    name: String,
    side: SideGrads,
}

impl CustomOp1 for Embedding {
    fn name(&self) -> &'static str {
        "native-embedding"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, h) = layout.shape().dims2()?;
        let w = contiguous_slice::<f32>(storage, layout, OP)?;
        let mut out = vec![0f32; self.ids.len() * h];
        out.par_chunks_mut(h.max(1))
            .zip(self.ids.par_iter())
            .with_min_len(64)
            .for_each(|(row, &id)| {
                let at = id as usize * h;
                row.copy_from_slice(&w[at..at + h]);
            });
        Ok((CpuStorage::F32(out), Shape::from((self.ids.len(), h))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (vocab, h) = arg.dims2()?;
        let g = grad.to_dtype(DType::F32)?.contiguous()?;
        let mut side = super::decoder::lock(&self.side);
        let scatter = ScatterAddRows {
            ids: &self.ids,
            rows: &g,
            hidden: h,
        };
        match side.remove(&self.name) {
            // The tied lm-head's gradient, freshly made by the loss: add in place.
            Some(prev) if applies(&prev) && prev.dims() == [vocab, h] => {
                prev.inplace_op1(&scatter)?;
                side.insert(self.name.clone(), prev);
            }
            prev => {
                let fresh = Tensor::zeros((vocab, h), DType::F32, arg.device())?;
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

/// `dst[ids[i]] += rows[i]` on a row-major `[vocab, hidden]` `f32` matrix, in the order of
/// `ids` (repeated ids accumulate as `index_add` does).
struct ScatterAddRows<'a> {
    ids: &'a [u32],
    rows: &'a Tensor,
    hidden: usize,
}

impl InplaceOp1 for ScatterAddRows<'_> {
    fn name(&self) -> &'static str {
        "native-embedding-scatter-add"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let h = self.hidden;
        let (rs, rl) = self.rows.storage_and_layout();
        let candle_core::Storage::Cpu(rows) = &*rs else {
            bail!("{OP}: gradient is not on the CPU (internal error)")
        };
        let rows = contiguous_slice::<f32>(rows, rl, OP)?;
        let CpuStorage::F32(dst) = storage else {
            bail!("{OP}: gradient matrix is not f32 (internal error)")
        };
        let Some(dst) = dst.get_mut(layout.start_offset()..) else {
            bail!("{OP}: gradient layout out of bounds (internal error)")
        };
        for (&id, row) in self.ids.iter().zip(rows.chunks_exact(h.max(1))) {
            let at = id as usize * h;
            let Some(d) = dst.get_mut(at..at + h) else {
                bail!("{OP}: token id {id} outside the gradient matrix (internal error)")
            };
            for (d, r) in d.iter_mut().zip(row) {
                *d += r;
            }
        }
        Ok(())
    }
}
