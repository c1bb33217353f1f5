//! Sums across processes over TCP: the role PyTorch's Gloo backend plays for a data-parallel
//! run whose ranks are processes (on the CPU, or on GPUs without NCCL between them).
//!
//! Every collective is a gather to rank 0, a sum in rank order (rank 0's values, plus rank
//! 1's, plus rank 2's, …), and a broadcast of that sum, so every rank ends with the same bits
//! whatever order the messages arrived in; a ring all-reduce would move less data but sums in
//! an order that depends on the rank. The connections are opened by the rendezvous
//! (`devices::launch::Rendezvous::process_group`), one from each rank to rank 0.
//!
//! A rank that closes its connection (it failed or was killed) or sends nothing within the
//! timeout fails the collective with its rank and host named, never a hang.

use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use super::shards::{ShardLayout, TensorShards};
use super::GradientReducer;
use crate::devices::DevicesError;
use crate::model::{Gradients, Home};

mod frames;
use frames::ReadError;
pub use frames::{Element, NamedValues};

/// How long a collective waits for a rank by default: PyTorch's default for its process
/// groups (30 minutes), long enough for the slowest rank's step on a large model.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// One rank's place in a process group and its connections (rank 0: one to every other rank,
/// in rank order; any other rank: one to rank 0).
pub struct ProcessGroup {
    rank: usize,
    local_rank: usize,
    world_size: usize,
    run_id: [u8; 128],
    peers: Vec<GroupPeer>,
    timeout: Duration,
    /// Collectives done so far: every message carries it, so ranks out of step are named.
    collectives: AtomicU64,
}

/// A connection to another rank.
pub struct GroupPeer {
    /// Its global rank.
    pub rank: usize,
    /// Its host, for messages.
    pub host: String,
    stream: Mutex<TcpStream>,
}

impl GroupPeer {
    /// A connected peer.
    pub fn new(rank: usize, host: String, stream: TcpStream) -> Self {
        GroupPeer {
            rank,
            host,
            stream: Mutex::new(stream),
        }
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("local_rank", &self.local_rank)
            .field("world_size", &self.world_size)
            .field(
                "peers",
                &self.peers.iter().map(|p| p.rank).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// Where a rank stands in the world, as the launcher gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPlace {
    /// Global rank.
    pub rank: usize,
    /// Rank on its machine (its GPU's ordinal).
    pub local_rank: usize,
    /// Ranks in the world.
    pub world_size: usize,
}

impl ProcessGroup {
    /// A group over connected `peers` (rank 0: every other rank; others: rank 0), each read
    /// and written with `timeout`; `run_id` is the rendezvous's id (NCCL's in a build with
    /// it), kept for a reducer that needs it.
    pub fn new(
        place: GroupPlace,
        run_id: [u8; 128],
        peers: Vec<GroupPeer>,
        timeout: Duration,
    ) -> Result<Self, DevicesError> {
        let expected = if place.rank == 0 {
            place.world_size.saturating_sub(1)
        } else {
            1
        };
        if peers.len() != expected {
            return Err(DevicesError::Collective(format!(
                "rank {} of {} needs {expected} connections, got {}",
                place.rank,
                place.world_size,
                peers.len()
            )));
        }
        for peer in &peers {
            let stream = peer.stream.lock().map_err(|_| poisoned())?;
            let set = stream
                .set_read_timeout(Some(timeout))
                .and_then(|()| stream.set_write_timeout(Some(timeout)))
                .and_then(|()| stream.set_nodelay(true));
            set.map_err(|e| {
                DevicesError::Collective(format!(
                    "cannot set up the connection to rank {}: {e}",
                    peer.rank
                ))
            })?;
        }
        Ok(ProcessGroup {
            rank: place.rank,
            local_rank: place.local_rank,
            world_size: place.world_size,
            run_id,
            peers,
            timeout,
            collectives: AtomicU64::new(0),
        })
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This process's rank on its machine.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Ranks in the world.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The rendezvous's id (NCCL's unique id in a build with NCCL).
    pub fn run_id(&self) -> &[u8; 128] {
        &self.run_id
    }

    /// Sums `values` over every rank, in rank order; every rank gets the same sum.
    pub fn all_reduce_f64(&self, what: &str, values: &[f64]) -> Result<Vec<f64>, DevicesError> {
        let mut tensors = vec![NamedValues {
            name: what.to_string(),
            dims: vec![values.len()],
            values: values.to_vec(),
        }];
        self.all_reduce(what, &mut tensors)?;
        Ok(tensors.pop().map(|t| t.values).unwrap_or_default())
    }

    /// Sums every rank's `tensors` (the same names and shapes, in the same order, on every
    /// rank) in place, in rank order; every rank ends with the same bits.
    pub fn all_reduce<T: Element>(
        &self,
        what: &str,
        tensors: &mut [NamedValues<T>],
    ) -> Result<(), DevicesError> {
        let collective = self.collectives.fetch_add(1, Ordering::SeqCst);
        if self.world_size == 1 {
            return Ok(());
        }
        let layouts = frames::layouts(tensors);
        if self.rank == 0 {
            // Rank order: rank 0's values are the start of the sum, then each peer's in turn.
            for peer in &self.peers {
                let mut stream = peer.stream.lock().map_err(|_| poisoned())?;
                frames::read_message(&mut *stream, collective, &layouts, |i, at, theirs: &[T]| {
                    for (sum, v) in tensors[i].values[at..at + theirs.len()]
                        .iter_mut()
                        .zip(theirs)
                    {
                        *sum += *v;
                    }
                })
                .map_err(|e| self.failed(peer, what, e))?;
            }
            for peer in &self.peers {
                let mut stream = peer.stream.lock().map_err(|_| poisoned())?;
                frames::write_message(&mut *stream, collective, tensors)
                    .map_err(|e| self.failed(peer, what, ReadError::Io(e)))?;
            }
            return Ok(());
        }
        let peer = &self.peers[0];
        let mut stream = peer.stream.lock().map_err(|_| poisoned())?;
        frames::write_message(&mut *stream, collective, tensors)
            .map_err(|e| self.failed(peer, what, ReadError::Io(e)))?;
        frames::read_message(&mut *stream, collective, &layouts, |i, at, sum: &[T]| {
            tensors[i].values[at..at + sum.len()].copy_from_slice(sum);
        })
        .map_err(|e| self.failed(peer, what, e))
    }

    fn failed(&self, peer: &GroupPeer, what: &str, error: ReadError) -> DevicesError {
        let whom = format!(
            "rank {} (of {}) on {}",
            peer.rank, self.world_size, peer.host
        );
        DevicesError::Collective(match error {
            ReadError::Mismatch(m) => {
                format!("{whom} does not fit rank {} in the {what}: {m}", self.rank)
            }
            ReadError::Io(e) => describe_io(&whom, what, &e, self.timeout),
        })
    }
}

/// Sums one process's gradients with every other rank's. A launched rank trains on one
/// device, so `per_rank` holds one set; the sum comes back on `outputs[0]` in each gradient's
/// own dtype (summed in f32: the wire carries f32).
impl GradientReducer for ProcessGroup {
    fn all_reduce_sum(
        &self,
        per_rank: Vec<Gradients>,
        outputs: &[Device],
    ) -> Result<Vec<Gradients>, DevicesError> {
        let (Ok([grads]), Some(device)) = (<[Gradients; 1]>::try_from(per_rank), outputs.first())
        else {
            return Err(DevicesError::Input(
                "a rank of a launched run trains on one device: list one device in `[devices]`"
                    .into(),
            ));
        };
        // Sorted by name: every rank lists the same gradients in the same order, whatever
        // order its backward produced them in.
        let mut pairs: Vec<(String, Tensor)> = grads.into_pairs().collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut dtypes = Vec::with_capacity(pairs.len());
        let mut tensors = Vec::with_capacity(pairs.len());
        for (name, g) in pairs {
            dtypes.push(g.dtype());
            let dims = g.dims().to_vec();
            let values = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            tensors.push(NamedValues { name, dims, values });
        }
        self.all_reduce("gradient all-reduce", &mut tensors)?;
        let mut sum = Gradients::new();
        for (t, dtype) in tensors.into_iter().zip(dtypes) {
            let g = Tensor::from_vec(t.values, t.dims, device)?.to_dtype(dtype)?;
            sum.insert(&t.name, g);
        }
        Ok(vec![sum])
    }

    /// Sharded data parallel across processes, tensor by tensor in model order: the whole
    /// gradient summed over the processes (rank 0 gathers and sums in rank order, as the
    /// all-reduce does), of which this rank keeps its range. The TCP group has no cheaper
    /// reduce-scatter: each process holds one summed tensor at a time, never the whole
    /// gradient's sum. Every rank must give every tensor (zeros where it computed none).
    fn reduce_scatter_into(
        &self,
        mut per_rank: Vec<Gradients>,
        layout: &ShardLayout,
        outputs: &[Device],
        sums: &mut [Gradients],
    ) -> Result<(), DevicesError> {
        let (Some(grads), Some(device), [sums]) = (per_rank.first_mut(), outputs.first(), sums)
        else {
            return Err(one_device());
        };
        if layout.ranks() != self.world_size {
            return Err(DevicesError::Input(format!(
                "a reduce-scatter over {} ranks in a world of {}",
                layout.ranks(),
                self.world_size
            )));
        }
        for t in layout.tensors() {
            let g = grads.remove(&t.name).ok_or_else(|| {
                DevicesError::Input(format!(
                    "rank {} has no gradient of `{}` to reduce-scatter (internal error)",
                    self.rank, t.name
                ))
            })?;
            let dtype = g.dtype();
            let values = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            drop(g);
            let mut tensors = [NamedValues {
                name: t.name.clone(),
                dims: t.dims.clone(),
                values,
            }];
            self.all_reduce("gradient reduce-scatter", &mut tensors)?;
            let range = &t.ranges[self.rank];
            if range.is_empty() {
                continue;
            }
            let [summed] = tensors;
            let mine = Tensor::from_slice(&summed.values[range.clone()], range.len(), device)?
                .to_dtype(dtype)?;
            sums.add(&t.name, mine)?;
        }
        Ok(())
    }

    /// The whole tensor from every process's range: each gives its range in place and zeros
    /// elsewhere, and the sum over the processes (exact: every element is one rank's value
    /// plus zeros) is the whole.
    fn all_gather(
        &self,
        t: &TensorShards,
        parts: &[Option<&Tensor>],
        dtype: DType,
        homes: &[Home],
    ) -> Result<Vec<Tensor>, DevicesError> {
        let ([part], [home]) = (parts, homes) else {
            return Err(one_device());
        };
        let elems: usize = t.dims.iter().product();
        let mut values = vec![0f32; elems];
        if let Some(part) = part {
            let range = &t.ranges[self.rank];
            let mine = part.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            if mine.len() != range.len() {
                return Err(DevicesError::Input(format!(
                    "rank {} gives {} elements of `{}`, its range holds {}",
                    self.rank,
                    mine.len(),
                    t.name,
                    range.len()
                )));
            }
            values[range.clone()].copy_from_slice(&mine);
        }
        let mut tensors = [NamedValues {
            name: t.name.clone(),
            dims: t.dims.clone(),
            values,
        }];
        self.all_reduce("all-gather", &mut tensors)?;
        let [whole] = tensors;
        Ok(vec![Tensor::from_vec(
            whole.values,
            t.dims.as_slice(),
            &home.device,
        )?
        .to_dtype(dtype)?])
    }

    fn name(&self) -> &'static str {
        "tcp"
    }
}

fn one_device() -> DevicesError {
    DevicesError::Input(
        "a rank of a launched run trains on one device: list one device in `[devices]`".into(),
    )
}

fn poisoned() -> DevicesError {
    DevicesError::Collective("a process-group connection was poisoned by a panic".into())
}

/// What a failed read or write on `whom`'s connection means, in words.
fn describe_io(whom: &str, what: &str, e: &std::io::Error, timeout: Duration) -> String {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
            "{whom} sent nothing for {} s during the {what}: it is stuck or far slower than this \
             rank (raise {} if its steps are that slow)",
            timeout.as_secs(),
            crate::devices::launch::COLLECTIVE_TIMEOUT_ENV
        ),
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe => format!(
            "{whom} closed its connection during the {what} (it failed, or its process or \
             machine went away; see that rank's log)"
        ),
        _ => format!("the connection to {whom} failed during the {what}: {e}"),
    }
}

#[cfg(test)]
mod tests;
