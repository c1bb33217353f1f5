//! Sharded data parallel's optimizer (`[devices] strategy = "sharded"`, ZeRO-2): every rank
//! keeps its range of each trainable tensor (`devices::parallel::shards`) with AdamW's
//! moments for that range only, steps it with its range of the reduce-scattered gradient, and
//! the updated ranges are all-gathered into every rank's whole weights.
//!
//! Under mixed precision the range a rank keeps *is* its fp32 master: AdamW updates it as an
//! fp32 parameter (the arithmetic of its master path, value for value) and the all-gather
//! rounds it to the weights' dtype as AdamW's own master→weight write does (round to nearest
//! even). A second copy of the range in the weights' dtype would be a copy of the master's
//! rounding: 2 bytes a trained parameter over the rank's share (6.75 GiB a rank for DictaLM 7B
//! on two GPUs, issue #57's founding case).
//!
//! AdamW is elementwise, so stepping the ranges is stepping the whole: the run equals data
//! parallel's (and one device's) step for step. Checkpoints hold the optimizer state whole,
//! under the names one device writes, so a run resumes on any number of devices.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};

use crate::devices::parallel::shards::{host_all_gather, ShardLayout};
use crate::devices::GradientReducer;
use crate::mem::ranks::RankGuard;
use crate::model::{AdamW, CausalLm, Gradients, Home, ModelError, NamedParam, StateSource};

use super::super::checkpoint;
use super::super::error::TrainError;

/// Every rank's optimizer over its ranges of the trainable tensors.
pub(super) struct ShardedOptimizer {
    /// Every trained tensor's division over the run's ranks: this process's, or, for a launched
    /// run, every process's (one rank each).
    layout: ShardLayout,
    /// The layout's rank of this process's first rank (`ranks[i]` is rank `first_rank + i`):
    /// 0 in one process, a launched rank's own.
    first_rank: usize,
    /// Each of this process's ranks' device.
    devices: Vec<Device>,
    /// ZeRO-3: the trained tensors the ranks keep in ranges only (the decoder layers', which
    /// each rank gathers as it runs them, `super::sharded_layers`); the all-gather after the
    /// update leaves them out.
    kept_sliced: HashSet<String>,
    ranks: Vec<RankShard>,
    /// The tensors whose ranges are fp32 masters of half-precision weights: the all-gather
    /// rounds them to the weights' dtype and a checkpoint names them `master.<name>`.
    masters: HashSet<String>,
}

/// Where a rank keeps its ranges of half-precision weights under mixed precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MasterRanges {
    /// No master weights: every range in its parameter's dtype, on the rank's device.
    None,
    /// The fp32 master of each half-precision range on the rank's device.
    OnRank,
    /// The fp32 master of each half-precision range in host RAM (`optimizer_offload =
    /// "host"`, where AdamW keeps a master it offloads).
    InHostRam,
}

/// One rank's share of the training state.
struct RankShard {
    /// AdamW over `ranges` (its moments are the range's only).
    optimizer: AdamW,
    /// The rank's range of each trainable tensor, flat: what its optimizer updates and the
    /// all-gather reads. In the parameter's dtype on the rank's device, or, for a tensor of
    /// `ShardedOptimizer::masters`, the fp32 master (where [`MasterRanges`] says). Keyed by
    /// the parameter's name (the optimizer state's key too, so a checkpoint names it as one
    /// device does).
    ranges: HashMap<String, Var>,
}

/// The optimizer-state keys of a parameter, as `AdamW` writes them.
const STATE_PREFIXES: [&str; 3] = ["exp_avg.", "exp_avg_sq.", MASTER_PREFIX];
/// The key prefix of a parameter's fp32 master weights.
const MASTER_PREFIX: &str = "master.";

/// Rank `rank`'s range of `whole`, flat, copied (so it holds no view of the whole tensor, nor
/// a graph back to it: `whole` is detached first).
fn range_of(whole: &Tensor, range: &std::ops::Range<usize>) -> Result<Tensor, ModelError> {
    Ok(whole
        .detach()
        .flatten_all()?
        .narrow(0, range.start, range.len())?
        .force_contiguous()?)
}

/// The trainable parameters of `model` by name.
fn trainable_vars(model: &CausalLm) -> HashMap<&str, &NamedParam> {
    model
        .params()
        .iter()
        .filter(|p| p.trainable)
        .map(|p| (p.name.as_str(), p))
        .collect()
}

impl ShardedOptimizer {
    /// Divides the trainable tensors of `models` (one per rank, rank 0 first) over the
    /// ranks, keeping half-precision ranges as fp32 masters where `masters` says;
    /// `optimizer` builds a rank's AdamW over its ranges (the run's settings and state
    /// placement).
    /// `world`: this process's rank and the ranks of a launched run (whose process trains one
    /// rank); `None` for a run in one process, whose `models` are every rank.
    pub(super) fn new(
        models: &[&CausalLm],
        masters: MasterRanges,
        world: Option<(usize, usize)>,
        optimizer: impl Fn(&[NamedParam]) -> Result<AdamW, TrainError>,
    ) -> Result<Self, TrainError> {
        let Some(first) = models.first() else {
            return Err(TrainError::Data {
                context: "sharded data parallel".into(),
                message: "no rank to shard over: choose devices in `[devices] devices`".into(),
            });
        };
        let trainable = || first.params().iter().filter(|p| p.trainable);
        let (first_rank, total_ranks) = world.unwrap_or((0, models.len()));
        let layout = ShardLayout::new(
            trainable().map(|p| (p.name.as_str(), p.var.dims())),
            total_ranks,
        );
        // As AdamW: an fp32 parameter needs no master.
        let master_names: HashSet<String> = match masters {
            MasterRanges::None => HashSet::new(),
            MasterRanges::OnRank | MasterRanges::InHostRam => trainable()
                .filter(|p| p.var.dtype() != DType::F32)
                .map(|p| p.name.clone())
                .collect(),
        };
        let mut ranks = Vec::with_capacity(models.len());
        for (rank, model) in models.iter().enumerate() {
            let _rank = RankGuard::enter(rank);
            let params = trainable_vars(model);
            let mut named = Vec::new();
            let mut ranges = HashMap::new();
            for t in layout.tensors() {
                let range = &t.ranges[first_rank + rank];
                let param = params.get(t.name.as_str()).ok_or_else(|| {
                    shard_error(format!("rank {rank}'s model has no trainable `{}`", t.name))
                })?;
                if range.is_empty() {
                    continue;
                }
                let master = master_names.contains(&t.name);
                let kept = range_of(param.var.as_tensor(), range)
                    .and_then(|r| match (master, masters) {
                        (true, MasterRanges::InHostRam) => {
                            Ok(r.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)
                        }
                        (true, _) => Ok(r.to_dtype(DType::F32)?),
                        (false, _) => Ok(r),
                    })
                    .and_then(|r| Ok(Var::from_tensor(&r)?))
                    .map_err(|cause| {
                        model_error(
                            format!("cannot take rank {rank}'s range of `{}`", t.name),
                            cause,
                        )
                    })?;
                named.push(NamedParam {
                    name: t.name.clone(),
                    var: kept.clone(),
                    trainable: true,
                    weight_decay: param.weight_decay,
                });
                ranges.insert(t.name.clone(), kept);
            }
            ranks.push(RankShard {
                optimizer: optimizer(&named)?,
                ranges,
            });
        }
        Ok(ShardedOptimizer {
            layout,
            first_rank,
            devices: models.iter().map(|m| m.device().clone()).collect(),
            kept_sliced: HashSet::new(),
            ranks,
            masters: master_names,
        })
    }

    /// Reduce-scatters one micro-step's whole gradients (`per_rank[k]`, rank k's) into the
    /// ranks' running sums `acc` (each rank's ranges, on its device), dropping each whole
    /// gradient as soon as every rank has its range.
    pub(super) fn reduce_scatter_into(
        &self,
        per_rank: Vec<Gradients>,
        acc: &mut Vec<Gradients>,
        devices: &[Device],
        reducer: &dyn GradientReducer,
    ) -> Result<(), TrainError> {
        if acc.is_empty() {
            *acc = vec![Gradients::new(); self.ranks.len()];
        }
        reducer
            .reduce_scatter_into(per_rank, &self.layout, devices, acc)
            .map_err(|e| shard_error(format!("{} reduce-scatter: {e}", reducer.name())))
    }

    /// The L2 norm of the whole gradient from its ranges (`shards[r]`, rank r's).
    pub(super) fn global_norm(shards: &[Gradients]) -> Result<f64, ModelError> {
        let mut sum_sq = 0.0;
        for g in shards {
            let n = g.global_norm()?;
            sum_sq += n * n;
        }
        Ok(sum_sq.sqrt())
    }

    /// One AdamW step on every rank's ranges with its gradient ranges (`shards[r]`), then the
    /// updated ranges all-gathered into every rank's whole weights (`models`, rank 0 first).
    pub(super) fn step(
        &mut self,
        shards: &[Gradients],
        lr: f64,
        grad_multiplier: f64,
        models: &[&CausalLm],
        reducer: &dyn GradientReducer,
    ) -> Result<(), ModelError> {
        for (index, (rank, grads)) in self.ranks.iter_mut().zip(shards).enumerate() {
            let _rank = RankGuard::enter(index);
            rank.optimizer.step(grads, lr, grad_multiplier)?;
        }
        self.gather_into(models, reducer)
    }

    /// The whole gradient, on the host, from its ranges (`shards[r]`, rank r's): for tests
    /// and diagnostics.
    pub(super) fn gather_gradients(&self, shards: &[Gradients]) -> Result<Gradients, ModelError> {
        let host = Home::single(&Device::Cpu);
        let mut whole = Gradients::new();
        for t in self.layout.tensors() {
            let parts: Vec<Option<&Tensor>> = shards.iter().map(|g| g.get(&t.name)).collect();
            if parts.iter().all(Option::is_none) {
                continue;
            }
            let joined = host_all_gather(&parts, &t.dims, &host)
                .map_err(|e| ModelError::Optimizer(format!("all-gather of `{}`: {e}", t.name)))?;
            whole.insert(&t.name, joined);
        }
        Ok(whole)
    }

    /// Every rank's whole trainable weights from the ranks' ranges (the all-gather). A master
    /// range is rounded to the weights' dtype first, where it lives (candle's cast rounds to
    /// nearest even, as AdamW's master→weight write does), once for every home.
    fn gather_into(
        &self,
        models: &[&CausalLm],
        reducer: &dyn GradientReducer,
    ) -> Result<(), ModelError> {
        let params: Vec<_> = models.iter().map(|m| trainable_vars(m)).collect();
        for t in self.layout.tensors() {
            if self.kept_sliced.contains(&t.name) {
                continue;
            }
            let targets = params
                .iter()
                .enumerate()
                .map(|(rank, p)| {
                    p.get(t.name.as_str()).copied().ok_or_else(|| {
                        ModelError::Optimizer(format!("rank {rank}'s model has no `{}`", t.name))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let Some(dtype) = targets.first().map(|p| p.var.dtype()) else {
                continue;
            };
            let rounded: Vec<Option<Tensor>> = self
                .ranks
                .iter()
                .map(|r| match r.ranges.get(&t.name) {
                    Some(range) if range.dtype() != dtype => {
                        range.as_tensor().to_dtype(dtype).map(Some)
                    }
                    _ => Ok(None),
                })
                .collect::<Result<_, _>>()?;
            let parts: Vec<Option<&Tensor>> = self
                .ranks
                .iter()
                .zip(&rounded)
                .map(|(r, rounded)| {
                    rounded
                        .as_ref()
                        .or_else(|| r.ranges.get(&t.name).map(Var::as_tensor))
                })
                .collect();
            let homes: Vec<Home> = targets
                .iter()
                .enumerate()
                .map(|(index, p)| Home {
                    index,
                    device: p.var.device().clone(),
                })
                .collect();
            let wholes = reducer.all_gather(t, &parts, dtype, &homes).map_err(|e| {
                ModelError::Optimizer(format!(
                    "{} all-gather of `{}`: {e}",
                    reducer.name(),
                    t.name
                ))
            })?;
            for (index, (param, whole)) in targets.iter().zip(wholes).enumerate() {
                let _rank = RankGuard::enter(index);
                param.var.set(&whole)?;
            }
        }
        Ok(())
    }

    /// Takes every rank's ranges from its model again (after a checkpoint's weights were
    /// loaded into the models); a master range becomes the weights' values in fp32, until a
    /// saved master replaces it (`load_state_from`).
    pub(super) fn refresh_from(&self, models: &[&CausalLm]) -> Result<(), TrainError> {
        for (rank, (shard, model)) in self.ranks.iter().zip(models).enumerate() {
            let params = trainable_vars(model);
            for t in self.layout.tensors() {
                let (Some(var), Some(param)) =
                    (shard.ranges.get(&t.name), params.get(t.name.as_str()))
                else {
                    continue;
                };
                range_of(param.var.as_tensor(), &t.ranges[self.first_rank + rank])
                    .and_then(|part| {
                        let part = part.to_dtype(var.dtype())?.to_device(var.device())?;
                        Ok(var.set(&part)?)
                    })
                    .map_err(|cause| {
                        model_error(
                            format!("cannot refresh rank {rank}'s range of `{}`", t.name),
                            cause,
                        )
                    })?;
            }
        }
        Ok(())
    }

    /// Rank `rank`'s range of the trained tensor `name` (flat; the fp32 master under mixed
    /// precision), sharing its storage: what the rank's optimizer updates in place.
    pub(super) fn range(&self, rank: usize, name: &str) -> Option<Tensor> {
        self.ranks
            .get(rank)?
            .ranges
            .get(name)
            .map(|v| v.as_tensor().clone())
    }

    /// How the trained tensors are divided over the ranks.
    pub(super) fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// ZeRO-3: from now on the all-gather after the update leaves `names` out (the ranks
    /// keep them in ranges only).
    pub(super) fn keep_sliced<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) {
        self.kept_sliced
            .extend(names.into_iter().map(str::to_string));
    }

    /// Optimizer steps taken (every rank steps together).
    pub(super) fn steps_taken(&self) -> u64 {
        self.ranks.first().map_or(0, |r| r.optimizer.steps_taken())
    }

    /// Bytes `rank` holds for its share: AdamW's moments of its ranges and the ranges
    /// themselves (the fp32 masters under mixed precision).
    pub(super) fn rank_state_bytes(&self, rank: usize) -> u64 {
        self.ranks.get(rank).map_or(0, |r| {
            let ranges: u64 = r
                .ranges
                .values()
                .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
                .sum();
            r.optimizer.state_bytes() + ranges
        })
    }

    /// Writes the optimizer state whole, under one device's names and shapes (the ranks'
    /// ranges joined), so any number of devices can resume from it. Costs a host copy of the
    /// state while the file is written. A launched run's ranges are spread over its
    /// processes: every process calls this at the same step (the join is a collective through
    /// `reducer`), and the one that writes passes `path`, the others `None`.
    pub(super) fn save_state(
        &self,
        path: Option<&Path>,
        reducer: &dyn GradientReducer,
    ) -> Result<(), TrainError> {
        let per_rank = self
            .ranks
            .iter()
            .map(|r| r.optimizer.state_tensors())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|cause| {
                model_error("cannot read the sharded optimizer state".into(), cause)
            })?;
        let host = Home::single(&Device::Cpu);
        let across_processes = self.ranks.len() < self.layout.ranks();
        let homes = crate::devices::parallel::shards::homes(&self.devices);
        let mut whole = HashMap::new();
        for t in self.layout.tensors() {
            for prefix in STATE_PREFIXES {
                let key = format!("{prefix}{}", t.name);
                // A master range is the rank's range itself (AdamW holds no master of it).
                let master = prefix == MASTER_PREFIX && self.masters.contains(&t.name);
                let parts: Vec<Option<&Tensor>> = if master {
                    self.ranks
                        .iter()
                        .map(|r| r.ranges.get(&t.name).map(Var::as_tensor))
                        .collect()
                } else {
                    per_rank.iter().map(|s| s.get(&key)).collect()
                };
                let joined = if across_processes {
                    // Every process takes part for every key the optimizer keeps (a rank with
                    // an empty range too), in the same order.
                    if !master && (prefix == MASTER_PREFIX || self.steps_taken() == 0) {
                        continue;
                    }
                    let dtype = parts.iter().flatten().map(|p| p.dtype()).next();
                    let gathered = reducer
                        .all_gather(t, &parts, dtype.unwrap_or(DType::F32), &homes)
                        .map_err(|e| shard_error(format!("cannot join `{key}`: {e}")))?;
                    match gathered.into_iter().next() {
                        Some(g) => g.to_device(&Device::Cpu).map_err(|cause| {
                            model_error(format!("cannot copy `{key}` to the host"), cause.into())
                        })?,
                        None => continue,
                    }
                } else {
                    if parts.iter().all(Option::is_none) {
                        continue;
                    }
                    host_all_gather(&parts, &t.dims, &host)
                        .map_err(|e| shard_error(format!("cannot join `{key}`: {e}")))?
                };
                whole.insert(key, joined);
            }
        }
        match path {
            Some(path) => checkpoint::save_tensors(path, &whole),
            None => Ok(()),
        }
    }

    /// Reads a whole optimizer state (any device count wrote it) into every rank's ranges:
    /// AdamW's moments, and a saved master into each master range (a state without one, as
    /// AdamW does, keeps the weights' values `refresh_from` took).
    pub(super) fn load_state_from(
        &mut self,
        source: &dyn StateSource,
        steps_taken: u64,
    ) -> Result<(), ModelError> {
        // Checked before anything changes, as AdamW checks its own keys.
        for t in self.layout.tensors() {
            let key = format!("{MASTER_PREFIX}{}", t.name);
            match source.dims(&key) {
                Some(found) if self.masters.contains(&t.name) && found != t.dims => {
                    return Err(ModelError::Optimizer(format!(
                        "optimizer state `{key}` has shape {found:?}, the parameter {:?}",
                        t.dims
                    )));
                }
                _ => {}
            }
        }
        for (rank, shard) in self.ranks.iter_mut().enumerate() {
            let ranged = RankSource {
                source,
                layout: &self.layout,
                rank: self.first_rank + rank,
            };
            shard.optimizer.load_state_from(&ranged, steps_taken)?;
            for (name, range) in &shard.ranges {
                let key = format!("{MASTER_PREFIX}{name}");
                if !self.masters.contains(name) || source.dims(&key).is_none() {
                    continue;
                }
                let values = ranged.load_f32(&key)?;
                let len = values.len();
                range.set(&Tensor::from_vec(values, len, range.device())?)?;
            }
        }
        Ok(())
    }
}

/// A whole saved optimizer state seen through one rank's ranges.
struct RankSource<'a> {
    source: &'a dyn StateSource,
    layout: &'a ShardLayout,
    rank: usize,
}

impl RankSource<'_> {
    /// The range of `key`'s parameter, when the saved tensor has the parameter's shape.
    fn range(&self, key: &str) -> Option<std::ops::Range<usize>> {
        let name = STATE_PREFIXES.iter().find_map(|p| key.strip_prefix(p))?;
        let t = self.layout.tensors().iter().find(|t| t.name == name)?;
        (self.source.dims(key)? == t.dims).then(|| t.ranges[self.rank].clone())
    }
}

impl StateSource for RankSource<'_> {
    fn dims(&self, key: &str) -> Option<Vec<usize>> {
        match self.range(key) {
            Some(range) => Some(vec![range.len()]),
            // Absent, or saved with another shape: the optimizer reports it by key.
            None => self.source.dims(key),
        }
    }

    fn load_f32(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        let range = self
            .range(key)
            .ok_or_else(|| ModelError::Optimizer(format!("the optimizer state has no `{key}`")))?;
        let whole = self.source.load_f32(key)?;
        whole
            .get(range.clone())
            .map(<[f32]>::to_vec)
            .ok_or_else(|| {
                ModelError::Optimizer(format!(
                    "optimizer state `{key}` has {} values, fewer than its shape says",
                    whole.len()
                ))
            })
    }
}

fn shard_error(message: String) -> TrainError {
    TrainError::Data {
        context: "sharded data parallel".into(),
        message,
    }
}

fn model_error(context: String, cause: ModelError) -> TrainError {
    TrainError::Model { context, cause }
}
