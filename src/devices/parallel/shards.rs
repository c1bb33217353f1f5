//! Sharded data parallel's collectives (DeepSpeed ZeRO, FSDP): every trainable tensor is
//! divided over the ranks as contiguous ranges of its flattened elements, a micro-step's
//! gradients are reduce-scattered (rank r receives the sum of every rank's gradient on its
//! range only) and the ranks' updated ranges are all-gathered back into whole weights.
//!
//! These are the host implementations, staged through each receiving rank's device with
//! [`Placed::to`] (so the placement rule checks them on logical CPU devices too). They sum
//! the ranks in rank order, as [`super::HostReducer`]'s all-reduce does, so a sharded step's
//! gradient is the data-parallel one bit for bit.

use std::ops::Range;

use candle_core::{Device, Tensor};

use super::DevicesError;
use crate::model::{Gradients, Home, Placed};

/// The range of a tensor of `elems` elements that `rank` of `ranks` owns: contiguous, in
/// rank order, as even as possible (earlier ranks take the one extra element), as
/// `torch.chunk`-style partitions do. Rank 0 is the fullest.
pub fn shard_range(elems: usize, ranks: usize, rank: usize) -> Range<usize> {
    let ranks = ranks.max(1);
    let base = elems / ranks;
    let extra = elems % ranks;
    let start = rank * base + rank.min(extra);
    let len = base + usize::from(rank < extra);
    start..start + len
}

/// One trainable tensor's division over the ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorShards {
    /// The parameter's name (the gradients' and the optimizer state's key).
    pub name: String,
    /// Its shape, whole.
    pub dims: Vec<usize>,
    /// Each rank's range of its flattened elements (possibly empty for a tensor with fewer
    /// elements than ranks).
    pub ranges: Vec<Range<usize>>,
}

/// How every trainable tensor of a model is divided over `ranks` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    ranks: usize,
    tensors: Vec<TensorShards>,
}

impl ShardLayout {
    /// The layout of `tensors` (name, shape), in model order, over `ranks` ranks.
    pub fn new<'a>(
        tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>,
        ranks: usize,
    ) -> Self {
        let ranks = ranks.max(1);
        let tensors = tensors
            .into_iter()
            .map(|(name, dims)| {
                let elems = dims.iter().product();
                TensorShards {
                    name: name.to_string(),
                    dims: dims.to_vec(),
                    ranges: (0..ranks).map(|r| shard_range(elems, ranks, r)).collect(),
                }
            })
            .collect();
        ShardLayout { ranks, tensors }
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Every tensor's division, in model order.
    pub fn tensors(&self) -> &[TensorShards] {
        &self.tensors
    }

    /// The division of the tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorShards> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// `rank`'s range of the tensor `name`.
    pub fn range(&self, name: &str, rank: usize) -> Option<Range<usize>> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .and_then(|t| t.ranges.get(rank).cloned())
    }

    /// Elements `rank` owns over every tensor.
    pub fn rank_elems(&self, rank: usize) -> usize {
        self.tensors
            .iter()
            .filter_map(|t| t.ranges.get(rank))
            .map(|r| r.len())
            .sum()
    }
}

/// The homes of `devices`, by rank.
pub fn homes(devices: &[Device]) -> Vec<Home> {
    devices
        .iter()
        .enumerate()
        .map(|(index, device)| Home {
            index,
            device: device.clone(),
        })
        .collect()
}

/// Reduce-scatter (sum) on the host, into running sums: `per_rank[k]` holds rank k's whole
/// gradients (on its device); rank r's `sums[r]` (its ranges, flat, on `outputs[r]`; empty
/// before a step's first micro-step) gains the sum over k of rank k's gradient on r's range of
/// each tensor. Tensor by tensor: each rank's whole gradient of a tensor is freed as soon as
/// every rank has its range, and a range is added into the running sum as it arrives, so a
/// rank holds at most one incoming range besides its sums (what the plan counts). A tensor no
/// rank computed a gradient for is left out, as an all-reduce leaves it out.
pub fn host_reduce_scatter_into(
    mut per_rank: Vec<Gradients>,
    layout: &ShardLayout,
    outputs: &[Device],
    sums: &mut [Gradients],
) -> Result<(), DevicesError> {
    if per_rank.len() != layout.ranks()
        || outputs.len() != layout.ranks()
        || sums.len() != layout.ranks()
    {
        return Err(DevicesError::Input(format!(
            "a reduce-scatter over {} ranks got gradients of {} ranks, {} devices and {} sums",
            layout.ranks(),
            per_rank.len(),
            outputs.len(),
            sums.len()
        )));
    }
    let homes = homes(outputs);
    for t in layout.tensors() {
        let whole: Vec<Option<Placed>> = per_rank
            .iter_mut()
            .enumerate()
            .map(|(k, g)| g.remove(&t.name).map(|g| Placed::new(g, k)))
            .collect();
        if whole.iter().all(Option::is_none) {
            continue;
        }
        for (r, home) in homes.iter().enumerate() {
            let range = &t.ranges[r];
            if range.is_empty() {
                continue;
            }
            // What rank r receives is rank r's, for the per-rank memory accounting.
            let _rank = crate::mem::ranks::RankGuard::enter(r);
            let mut sum: Option<Placed> = sums[r].remove(&t.name).map(|s| Placed::new(s, r));
            for g in whole.iter().flatten() {
                sum = Some(add_range(sum, g, range, home)?);
            }
            if let Some(sum) = sum {
                sums[r].insert(&t.name, sum.into_tensor());
            }
        }
    }
    Ok(())
}

/// `sum` (rank `home`'s running sum of one tensor's range, `None` before the first
/// contribution) plus `g`'s elements in `range`, moved to `home` first.
fn add_range(
    sum: Option<Placed>,
    g: &Placed,
    range: &Range<usize>,
    home: &Home,
) -> Result<Placed, DevicesError> {
    let range_of_g = Placed::new(
        g.tensor()
            .flatten_all()?
            .narrow(0, range.start, range.len())?,
        g.owner(),
    );
    let shares = range_of_g.transfer_shares_storage(home);
    let part = range_of_g.to(home)?;
    Ok(match sum {
        Some(s) => s.add(&part, "the sharded gradient sum")?,
        // A view would keep the whole gradient alive: copy its elements only (`Tensor::copy`
        // would clone the whole storage; a transfer has already made a copy).
        None if shares => Placed::new(part.tensor().force_contiguous()?, home.index),
        None => part,
    })
}

/// The reduce-scatter of one contribution, as it is produced: rank `from`'s gradient `g` of
/// the tensor `t` added, range by range, into every rank's running sum (`sums[r]`, rank r's,
/// on `outputs[r]`, locked one at a time). Summing a tensor's contributions as they arrive is
/// [`host_reduce_scatter_into`]'s sum in arrival order: on logical CPU devices, whose ranks run
/// in turn, that is rank order, the same bits.
pub fn host_scatter_add(
    g: Tensor,
    from: usize,
    t: &TensorShards,
    outputs: &[Device],
    sums: &[std::sync::Mutex<Gradients>],
) -> Result<(), DevicesError> {
    if outputs.len() != t.ranges.len() || sums.len() != t.ranges.len() {
        return Err(DevicesError::Input(format!(
            "a reduce-scatter of `{}` over {} ranks got {} devices and {} sums",
            t.name,
            t.ranges.len(),
            outputs.len(),
            sums.len()
        )));
    }
    let g = Placed::new(g, from);
    for (r, home) in homes(outputs).iter().enumerate() {
        let range = &t.ranges[r];
        if range.is_empty() {
            continue;
        }
        let _rank = crate::mem::ranks::RankGuard::enter(r);
        let mut sums = sums[r]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sum = sums.remove(&t.name).map(|s| Placed::new(s, r));
        let sum = add_range(sum, &g, range, home)?;
        sums.insert(&t.name, sum.into_tensor());
    }
    Ok(())
}

/// All-gather on the host: the ranks' ranges of one tensor (`parts[k]` flat, owned by rank
/// k; empty ranges are `None`) joined into the whole tensor of shape `dims` on `home`.
pub fn host_all_gather(
    parts: &[Option<&Tensor>],
    dims: &[usize],
    home: &Home,
) -> Result<Tensor, DevicesError> {
    let moved: Vec<Tensor> = parts
        .iter()
        .enumerate()
        .filter_map(|(k, p)| p.map(|p| (k, p)))
        .map(|(k, p)| Ok(Placed::new(p.clone(), k).to(home)?.into_tensor()))
        .collect::<Result<_, DevicesError>>()?;
    let whole = Tensor::cat(&moved, 0)?;
    Ok(whole.reshape(dims)?)
}

/// NCCL's reduce-scatter and all-gather move equal slots, one per rank: this many elements
/// of the tensor `t` (its fullest range, rank 0's). A rank's range sits at the start of its
/// slot, the rest of the slot is zeros.
pub fn slot_elems(t: &TensorShards) -> usize {
    t.ranges.iter().map(|r| r.len()).max().unwrap_or(0)
}

/// `part` (a range of `t`, flat; `None` for an empty one) zero-padded to one slot of `t`.
pub fn pad_to_slot(
    part: Option<&Tensor>,
    t: &TensorShards,
    dtype: candle_core::DType,
    device: &Device,
) -> Result<Tensor, DevicesError> {
    let slot = slot_elems(t);
    let len = part.map_or(0, |p| p.elem_count());
    let zeros = |n: usize| Tensor::zeros(n, dtype, device);
    Ok(match part {
        Some(p) if len == slot => p.flatten_all()?.contiguous()?,
        Some(p) => Tensor::cat(&[&p.flatten_all()?, &zeros(slot - len)?], 0)?,
        None => zeros(slot)?,
    })
}

/// A whole gradient of `t` laid out as a reduce-scatter's send buffer: every rank's range
/// in its own slot, in rank order (`slot_elems × ranks` elements).
pub fn pack_slots(whole: &Tensor, t: &TensorShards) -> Result<Tensor, DevicesError> {
    let flat = whole.flatten_all()?;
    let slots = t
        .ranges
        .iter()
        .map(|range| {
            let part = (!range.is_empty())
                .then(|| flat.narrow(0, range.start, range.len()))
                .transpose()?;
            pad_to_slot(part.as_ref(), t, whole.dtype(), whole.device())
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::cat(&slots, 0)?)
}

/// What an all-gather of `t`'s slots gives (`slot_elems × ranks` elements, rank order) as the
/// whole tensor: each slot's range joined, in `t`'s shape.
pub fn unpack_slots(gathered: &Tensor, t: &TensorShards) -> Result<Tensor, DevicesError> {
    let slot = slot_elems(t);
    let parts = t
        .ranges
        .iter()
        .enumerate()
        .filter(|(_, range)| !range.is_empty())
        .map(|(r, range)| gathered.narrow(0, r * slot, range.len()))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::cat(&parts, 0)?.reshape(t.dims.as_slice())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_every_element_once_with_the_extra_on_the_first_ranks() {
        for elems in [0usize, 1, 2, 5, 7, 64, 1001] {
            for ranks in 1..=4 {
                let ranges: Vec<_> = (0..ranks).map(|r| shard_range(elems, ranks, r)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[ranks - 1].end, elems);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len());
                    assert!(w[0].len() - w[1].len() <= 1);
                }
            }
        }
        assert_eq!(shard_range(7, 3, 0), 0..3);
        assert_eq!(shard_range(7, 3, 2), 5..7);
    }

    /// NCCL's collectives move equal slots: packing each rank's whole gradient into slots,
    /// summing slot r over the ranks (what `ncclReduceScatter` hands rank r) and keeping its
    /// range's length is the host reduce-scatter; padding each range to a slot, joining the
    /// slots (`ncclAllGather`) and unpacking is the host all-gather. Uneven ranges (7 elements
    /// over 3 ranks: 3, 2, 2) and a rank with an empty range (2 elements over 3) included.
    #[test]
    fn slots_carry_the_uneven_ranges_as_the_host_collectives_do() {
        let device = Device::Cpu;
        for (dims, ranks) in [
            (vec![7usize], 3usize),
            (vec![2, 3], 4),
            (vec![2], 3),
            (vec![4, 2], 2),
        ] {
            let n: usize = dims.iter().product();
            let layout = ShardLayout::new([("w", &dims[..])], ranks);
            let t = layout.tensor("w").unwrap();
            let grads: Vec<Tensor> = (0..ranks)
                .map(|k| {
                    let v: Vec<f32> = (0..n).map(|i| (i * 10 + k) as f32).collect();
                    Tensor::from_vec(v, dims.as_slice(), &device).unwrap()
                })
                .collect();
            let mut host = vec![Gradients::new(); ranks];
            let per_rank = grads
                .iter()
                .map(|g| {
                    let mut s = Gradients::new();
                    s.insert("w", g.clone());
                    s
                })
                .collect();
            host_reduce_scatter_into(per_rank, &layout, &vec![device.clone(); ranks], &mut host)
                .unwrap();
            let slot = slot_elems(t);
            let packed: Vec<Tensor> = grads.iter().map(|g| pack_slots(g, t).unwrap()).collect();
            let mut sliced = Vec::new();
            for (r, range) in t.ranges.iter().enumerate() {
                let mut sum = packed[0].narrow(0, r * slot, slot).unwrap();
                for p in &packed[1..] {
                    sum = (sum + p.narrow(0, r * slot, slot).unwrap()).unwrap();
                }
                let mine = sum.narrow(0, 0, range.len()).unwrap();
                let want: Vec<f32> = match host[r].get("w") {
                    Some(h) => h.to_vec1().unwrap(),
                    None => Vec::new(),
                };
                assert_eq!(mine.to_vec1::<f32>().unwrap(), want, "rank {r} of {ranks}");
                sliced.push(mine);
            }
            let padded: Vec<Tensor> = sliced
                .iter()
                .map(|m| {
                    let part = (m.elem_count() > 0).then_some(m);
                    pad_to_slot(part, t, candle_core::DType::F32, &device).unwrap()
                })
                .collect();
            let gathered = Tensor::cat(&padded, 0).unwrap();
            let parts: Vec<Option<&Tensor>> = sliced
                .iter()
                .map(|m| (m.elem_count() > 0).then_some(m))
                .collect();
            let whole = unpack_slots(&gathered, t).unwrap();
            let host_whole = host_all_gather(&parts, &dims, &Home::single(&device)).unwrap();
            assert_eq!(whole.dims(), dims.as_slice());
            assert_eq!(
                whole.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                host_whole.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            );
        }
    }

    /// Reduce-scatter then all-gather is the all-reduce: the sum of every rank's gradient.
    #[test]
    fn reduce_scatter_then_all_gather_is_the_sum() {
        let device = Device::Cpu;
        let dims = [3usize, 5];
        let layout = ShardLayout::new([("w", &dims[..])], 2);
        let per_rank: Vec<Gradients> = (0..2)
            .map(|k| {
                let values: Vec<f32> = (0..15).map(|i| (i * (k + 1)) as f32).collect();
                let mut g = Gradients::new();
                g.insert("w", Tensor::from_vec(values, &dims[..], &device).unwrap());
                g
            })
            .collect();
        let mut shards = vec![Gradients::new(); 2];
        host_reduce_scatter_into(
            per_rank,
            &layout,
            &[device.clone(), device.clone()],
            &mut shards,
        )
        .expect("reduce-scatter");
        assert_eq!(shards[0].get("w").unwrap().dims(), &[8]);
        assert_eq!(shards[1].get("w").unwrap().dims(), &[7]);
        let parts = [shards[0].get("w"), shards[1].get("w")];
        let whole = host_all_gather(&parts, &dims, &Home::single(&device)).expect("all-gather");
        let got: Vec<f32> = whole.flatten_all().unwrap().to_vec1().unwrap();
        let want: Vec<f32> = (0..15).map(|i| (3 * i) as f32).collect();
        assert_eq!(got, want);
    }
}
