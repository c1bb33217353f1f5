//! The TCP rendezvous that starts a multi-process run: rank 0 listens on
//! `MASTER_ADDR:MASTER_PORT`, every other rank connects and says who it is, and once all have
//! joined rank 0 hands each the same 128-byte id (NCCL's unique id) and every rank's host.
//!
//! The connections stay open afterwards as a control channel, so that no rank hangs when
//! another fails: NCCL's collectives wait forever for a rank that died, so a failing rank
//! sends an abort (relayed by rank 0 to all), a rank that vanishes is noticed by its closed
//! connection, and [`Rendezvous::watch`] hands either to the front end, which stops its
//! process. A rank that finishes says so first, so its closing is not taken for a failure.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::env::WorldSpec;
use super::wire::{self, Frame, ID_BYTES};
use super::LaunchError;

mod data;
mod host;
mod join;
use host::host_rendezvous;
use join::join_rank0;

/// Bounds every write: the peer is a rank whose socket buffer takes a few hundred bytes at
/// once, so a write that blocks this long means the peer is gone.
const WRITE_WAIT: Duration = Duration::from_secs(10);
/// Between two connection attempts of a joining rank.
const CONNECT_PAUSE: Duration = Duration::from_millis(250);

/// One joined run: this rank's place, the shared id, every rank's host, and the
/// connections kept as a control channel (rank 0: one per other rank; other ranks: one to
/// rank 0).
pub struct Rendezvous {
    spec: WorldSpec,
    id: [u8; ID_BYTES],
    hosts: Vec<String>,
    notes: Vec<String>,
    shared: Arc<Shared>,
    /// How long the ranks wait for each other to join (also the process group's connections).
    timeout: Duration,
    /// Where the process group's connections go: rank 0's listener (taken by
    /// [`Rendezvous::process_group`]), the port every other rank connects to.
    data: DataChannel,
}

/// Rank 0's process-group listener, or the port another rank connects to.
enum DataChannel {
    Listener(Mutex<Option<TcpListener>>),
    Port(u16),
}

struct Shared {
    rank: usize,
    host: String,
    peers: Vec<Peer>,
    /// This side finished or is stopping: a peer closing its connection now is expected,
    /// and a second reason to stop is not reported.
    settled: AtomicBool,
}

struct Peer {
    rank: usize,
    host: String,
    stream: Mutex<TcpStream>,
    /// The peer said it finished: its connection closing is not a failure.
    done: AtomicBool,
}

impl Shared {
    /// Sends `frame` to every peer but `skip`, ignoring peers already gone (this is how the
    /// others learn to stop; one that cannot be told is stopping anyway).
    fn send_all(&self, frame: &Frame, skip: Option<usize>) {
        for peer in self.peers.iter().filter(|p| Some(p.rank) != skip) {
            if let Ok(mut stream) = peer.stream.lock() {
                let _ = wire::write_frame(&mut *stream, frame);
            }
        }
    }
}

impl Rendezvous {
    /// Joins the run `spec` describes, waiting at most `timeout` for the others. Rank 0 makes
    /// the id with `make_id` once every rank has joined. A world of one rank has no one to
    /// wait for and listens on no port (so single-rank jobs on one machine never collide on
    /// the default port).
    pub fn join(
        spec: &WorldSpec,
        timeout: Duration,
        make_id: impl FnOnce() -> Result<[u8; ID_BYTES], LaunchError>,
    ) -> Result<Rendezvous, LaunchError> {
        let host = super::hostname();
        if spec.rank == 0 {
            host_rendezvous(spec, timeout, host, make_id)
        } else {
            join_rank0(spec, timeout, host)
        }
    }

    /// This rank's place in the run.
    pub fn spec(&self) -> &WorldSpec {
        &self.spec
    }

    /// The id rank 0 handed out (the same on every rank).
    pub fn id(&self) -> &[u8; ID_BYTES] {
        &self.id
    }

    /// Each rank's host, in rank order.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// What the rendezvous chose on its own that a user may want to know (e.g. listening on
    /// every interface because `MASTER_ADDR` is not one of this machine's addresses).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Hands a reason to stop to `on_stop` (on a thread of its own) when another rank
    /// aborts or its connection closes before it finished. Rank 0 first relays the reason
    /// to every other rank. The front end's `on_stop` reports it and ends the process: a
    /// rank blocked in an NCCL collective can be stopped no other way.
    pub fn watch(
        &self,
        on_stop: impl Fn(String) + Send + Sync + 'static,
    ) -> Result<(), LaunchError> {
        let on_stop: Arc<dyn Fn(String) + Send + Sync> = Arc::new(on_stop);
        for index in 0..self.shared.peers.len() {
            let reader = self.shared.peers[index]
                .stream
                .lock()
                .map_err(|_| {
                    LaunchError::Rendezvous("a rendezvous connection was poisoned".into())
                })?
                .try_clone()
                .map_err(|e| {
                    LaunchError::Rendezvous(format!("cannot watch the rendezvous connections: {e}"))
                })?;
            let shared = self.shared.clone();
            let on_stop = on_stop.clone();
            std::thread::Builder::new()
                .name(format!(
                    "rendezvous-watch-{}",
                    self.shared.peers[index].rank
                ))
                .spawn(move || watch_peer(&shared, index, reader, &*on_stop))
                .map_err(|e| {
                    LaunchError::Rendezvous(format!("cannot start the rendezvous watcher: {e}"))
                })?;
        }
        Ok(())
    }

    /// Tells every other rank to stop because this one failed with `reason` (rank 0 tells
    /// them all; another rank tells rank 0, which relays it). Their message names this rank
    /// and its host.
    pub fn abort(&self, reason: &str) {
        if self.shared.settled.swap(true, Ordering::SeqCst) {
            return;
        }
        let message = format!(
            "rank {} (of {}) on {} failed: {reason}",
            self.spec.rank, self.spec.world_size, self.shared.host
        );
        self.shared.send_all(&Frame::Abort(message), None);
    }

    /// Says this rank finished normally, so its connections closing stop nobody.
    pub fn finish(&self) {
        if self.shared.settled.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.send_all(&Frame::Done, None);
    }

    /// [`Self::finish`] that also waits, at most `timeout`, until every rank has finished
    /// (rank 0 answers once all have): a check that the control channel works both ways.
    /// Not for use after [`Self::watch`], whose threads read the same connections.
    pub fn finish_together(&self, timeout: Duration) -> Result<(), LaunchError> {
        let deadline = Instant::now() + timeout;
        if self.spec.rank != 0 {
            self.finish();
        }
        for peer in &self.shared.peers {
            let mut stream = peer.stream.lock().map_err(|_| {
                LaunchError::Rendezvous("a rendezvous connection was poisoned".into())
            })?;
            let _ = stream.set_read_timeout(Some(remaining(deadline)));
            match wire::read_frame(&mut *stream) {
                Ok(Frame::Done) => peer.done.store(true, Ordering::SeqCst),
                Ok(Frame::Abort(reason)) => return Err(LaunchError::Aborted(reason)),
                Ok(Frame::Welcome { .. }) | Err(_) => {
                    return Err(LaunchError::Rendezvous(format!(
                        "rank {} on {} did not finish the rendezvous within {} s",
                        peer.rank,
                        peer.host,
                        timeout.as_secs()
                    )))
                }
            }
        }
        if self.spec.rank == 0 {
            self.finish();
        }
        Ok(())
    }
}

/// Reads `peers[index]`'s frames until it finishes, or hands `on_stop` why this rank must stop.
fn watch_peer(
    shared: &Shared,
    index: usize,
    mut reader: TcpStream,
    on_stop: &(dyn Fn(String) + Send + Sync),
) {
    let peer = &shared.peers[index];
    let _ = reader.set_read_timeout(None);
    let reason = loop {
        match wire::read_frame(&mut reader) {
            Ok(Frame::Done) => {
                peer.done.store(true, Ordering::SeqCst);
                return;
            }
            Ok(Frame::Abort(reason)) => break reason,
            // Only sent during the join; nothing to act on.
            Ok(Frame::Welcome { .. }) => continue,
            Err(_) if shared.settled.load(Ordering::SeqCst) => return,
            Err(_) => {
                break format!(
                    "rank {} on {} closed its connection without finishing (it exited or its \
                     machine went away; see that rank's log)",
                    peer.rank, peer.host
                )
            }
        }
    };
    if shared.settled.swap(true, Ordering::SeqCst) {
        return;
    }
    if shared.rank == 0 {
        shared.send_all(&Frame::Abort(reason.clone()), Some(peer.rank));
    }
    on_stop(reason);
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn resolve(spec: &WorldSpec) -> Result<Vec<SocketAddr>, String> {
    (spec.master_addr.as_str(), spec.master_port)
        .to_socket_addrs()
        .map(Iterator::collect)
        .map_err(|e| format!("MASTER_ADDR={} does not resolve: {e}", spec.master_addr))
}

#[cfg(test)]
mod tests;
