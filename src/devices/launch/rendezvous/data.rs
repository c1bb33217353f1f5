//! The process group's connections, opened once the rendezvous is done: every other rank
//! connects to the port rank 0 sent in its welcome and says who it is, with the run's id so
//! a rank of another run (or another program) is never taken for one of this run's.
//!
//! They are connections of their own rather than the control channel: the control channel
//! is read by [`Rendezvous::watch`]'s threads, and an abort sent on it must never wait behind
//! a gradient of hundreds of megabytes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::super::LaunchError;
use super::{remaining, resolve, DataChannel, Rendezvous, CONNECT_PAUSE};
use crate::devices::parallel::process_group::{GroupPeer, GroupPlace, ProcessGroup};

/// The first bytes of a process-group hello: "tunestudio data connection".
const MAGIC: [u8; 4] = *b"TSDC";
/// How long rank 0 waits for one connection's hello (a live rank sends it at once).
const HELLO_WAIT: Duration = Duration::from_secs(5);

impl Rendezvous {
    /// Opens this rank's connections of the run's process group (rank 0: one from every other
    /// rank; others: one to rank 0), waiting at most the rendezvous's timeout for the other
    /// ranks; each collective then waits at most `collective_timeout` for a rank. Once per
    /// run: rank 0's listener is closed when every rank has connected.
    pub fn process_group(&self, collective_timeout: Duration) -> Result<ProcessGroup, LaunchError> {
        let spec = &self.spec;
        let place = GroupPlace {
            rank: spec.rank,
            local_rank: spec.local_rank,
            world_size: spec.world_size,
        };
        let deadline = Instant::now() + self.timeout;
        let peers = match &self.data {
            _ if spec.world_size == 1 => Vec::new(),
            DataChannel::Listener(listener) => {
                let listener =
                    listener
                        .lock()
                        .ok()
                        .and_then(|mut l| l.take())
                        .ok_or_else(|| {
                            LaunchError::Rendezvous("the process group was already opened".into())
                        })?;
                self.accept_group(&listener, deadline)?
            }
            DataChannel::Port(port) => vec![self.connect_group(*port, deadline)?],
        };
        ProcessGroup::new(place, self.id, peers, collective_timeout)
            .map_err(|e| LaunchError::Rendezvous(e.to_string()))
    }

    /// Rank 0: every other rank's connection, in rank order.
    fn accept_group(
        &self,
        listener: &TcpListener,
        deadline: Instant,
    ) -> Result<Vec<GroupPeer>, LaunchError> {
        let world = self.spec.world_size;
        let fail = |m: String| LaunchError::Rendezvous(m);
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(format!("rank 0 cannot poll its process-group port: {e}")))?;
        let mut joined: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        while joined.iter().skip(1).any(Option::is_none) {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = (1..world)
                            .filter(|&r| joined[r].is_none())
                            .map(|r| format!("rank {r} on {}", self.hosts[r]))
                            .collect();
                        return Err(fail(format!(
                            "{} (of {world}) did not open the process group's connection to \
                             rank 0 within {} s: check that rank 0's machine accepts connections \
                             on any port from the other ranks' machines",
                            missing.join(", "),
                            self.timeout.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) => {
                    return Err(fail(format!(
                        "rank 0 stopped accepting its process group: {e}"
                    )))
                }
            };
            // A connection that is not one of this run's ranks is dropped, as the rendezvous
            // drops one.
            let Some((rank, stream)) = self.read_group_hello(stream, deadline) else {
                continue;
            };
            if rank == 0 || rank >= world || joined[rank].is_some() {
                return Err(fail(format!(
                    "a process on another connection joined the process group as rank {rank}, \
                     which is taken or outside 1..{world}"
                )));
            }
            joined[rank] = Some(stream);
        }
        Ok(joined
            .into_iter()
            .enumerate()
            .filter_map(|(rank, s)| s.map(|s| GroupPeer::new(rank, self.hosts[rank].clone(), s)))
            .collect())
    }

    /// The rank a connection says it is, when it carries this run's id.
    fn read_group_hello(&self, stream: TcpStream, deadline: Instant) -> Option<(usize, TcpStream)> {
        let mut stream = stream;
        stream.set_nonblocking(false).ok()?;
        stream
            .set_read_timeout(Some(HELLO_WAIT.min(remaining(deadline))))
            .ok()?;
        let mut hello = [0u8; 4 + 4 + 128];
        stream.read_exact(&mut hello).ok()?;
        if hello[..4] != MAGIC || hello[8..] != self.id[..] {
            return None;
        }
        let mut rank = [0u8; 4];
        rank.copy_from_slice(&hello[4..8]);
        Some((u32::from_be_bytes(rank) as usize, stream))
    }

    /// Another rank: its connection to rank 0's process-group port, retried until `deadline`
    /// (rank 0 listens from before its welcome, so a refusal is a network problem).
    fn connect_group(&self, port: u16, deadline: Instant) -> Result<GroupPeer, LaunchError> {
        let spec = &self.spec;
        let at = format!("{}:{port}", spec.master_addr);
        let mut last = String::from("no attempt");
        let mut stream = loop {
            let addrs = resolve(spec).map_err(LaunchError::Rendezvous)?;
            let attempt = addrs.iter().find_map(|addr| {
                let addr = std::net::SocketAddr::new(addr.ip(), port);
                TcpStream::connect_timeout(&addr, remaining(deadline).min(Duration::from_secs(5)))
                    .map_err(|e| last = e.to_string())
                    .ok()
            });
            if let Some(stream) = attempt {
                break stream;
            }
            if Instant::now() >= deadline {
                return Err(LaunchError::Rendezvous(format!(
                    "rank {} (of {}) could not open the process group's connection to rank 0 at \
                     {at} within {} s ({last}): check that rank 0's machine accepts connections \
                     on any port from this one",
                    spec.rank,
                    spec.world_size,
                    self.timeout.as_secs()
                )));
            }
            std::thread::sleep(CONNECT_PAUSE.min(remaining(deadline)));
        };
        let rank = u32::try_from(spec.rank)
            .map_err(|_| LaunchError::Rendezvous("a rank above 2^32".into()))?;
        let mut hello = Vec::with_capacity(4 + 4 + 128);
        hello.extend_from_slice(&MAGIC);
        hello.extend_from_slice(&rank.to_be_bytes());
        hello.extend_from_slice(&self.id);
        stream.write_all(&hello).map_err(|e| {
            LaunchError::Rendezvous(format!(
                "rank {} lost its process-group connection to rank 0 at {at}: {e}",
                spec.rank
            ))
        })?;
        Ok(GroupPeer::new(0, self.hosts[0].clone(), stream))
    }
}
