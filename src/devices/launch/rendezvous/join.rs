//! A joining rank's side of the rendezvous: reach rank 0 (retrying until the timeout), say
//! who it is, and wait for the id.

use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::env::WorldSpec;
use super::super::wire::{self, Frame, Hello};
use super::super::LaunchError;
use super::{remaining, resolve, DataChannel, Peer, Rendezvous, Shared, CONNECT_PAUSE, WRITE_WAIT};

/// A rank other than 0: connects to rank 0 (retrying until the timeout), says hello, and
/// waits for the id.
pub(super) fn join_rank0(
    spec: &WorldSpec,
    timeout: Duration,
    host: String,
) -> Result<Rendezvous, LaunchError> {
    let deadline = Instant::now() + timeout;
    let at = format!("{}:{}", spec.master_addr, spec.master_port);
    let mut stream = connect(spec, &at, timeout, deadline)?;
    let io = |what: &str, e: std::io::Error| {
        LaunchError::Rendezvous(format!(
            "rank {} lost the connection to rank 0 at {at} while {what}: {e}",
            spec.rank
        ))
    };
    stream
        .set_write_timeout(Some(WRITE_WAIT))
        .map_err(|e| io("setting it up", e))?;
    let hello = Hello {
        version: wire::VERSION,
        rank: spec.rank,
        world_size: spec.world_size,
        local_rank: spec.local_rank,
        host: host.clone(),
    };
    wire::write_hello(&mut stream, &hello).map_err(|e| io("saying hello", e))?;
    // Rank 0 was listening when this connection was made, so it answers within its own
    // timeout from then; the margin covers a rank 0 started with a longer timeout's tail.
    stream
        .set_read_timeout(Some(timeout + Duration::from_secs(10)))
        .map_err(|e| io("setting it up", e))?;
    let (id, hosts, data_port) = match wire::read_frame(&mut stream) {
        Ok(Frame::Welcome {
            id,
            hosts,
            data_port,
        }) if hosts.len() == spec.world_size => (id, hosts, data_port),
        Ok(Frame::Welcome { hosts, .. }) => {
            return Err(LaunchError::Rendezvous(format!(
                "rank 0 at {at} runs a world of {} ranks, this rank {} one of {}: every process \
                 needs the same WORLD_SIZE",
                hosts.len(),
                spec.rank,
                spec.world_size
            )))
        }
        Ok(Frame::Abort(reason)) => return Err(LaunchError::Aborted(reason)),
        Ok(Frame::Done) | Err(_) => {
            return Err(LaunchError::Rendezvous(format!(
                "rank 0 at {at} closed the rendezvous without handing out the id (it failed or \
                 was stopped; see rank 0's log)"
            )))
        }
    };
    let _ = stream.set_read_timeout(None);
    let peer = Peer {
        rank: 0,
        host: hosts[0].clone(),
        stream: Mutex::new(stream),
        done: AtomicBool::new(false),
    };
    Ok(Rendezvous {
        spec: spec.clone(),
        id,
        hosts,
        notes: Vec::new(),
        shared: Arc::new(Shared {
            rank: spec.rank,
            host,
            peers: vec![peer],
            settled: AtomicBool::new(false),
        }),
        timeout,
        data: DataChannel::Port(data_port),
    })
}

/// Connects to rank 0, retrying while it is not up yet (ranks start in any order).
fn connect(
    spec: &WorldSpec,
    at: &str,
    timeout: Duration,
    deadline: Instant,
) -> Result<TcpStream, LaunchError> {
    let mut last = String::from("no attempt");
    loop {
        match resolve(spec) {
            Ok(addrs) => {
                for addr in addrs {
                    match TcpStream::connect_timeout(
                        &addr,
                        remaining(deadline).min(Duration::from_secs(5)),
                    ) {
                        Ok(stream) => return Ok(stream),
                        Err(e) => last = e.to_string(),
                    }
                }
            }
            Err(e) => last = e,
        }
        if Instant::now() >= deadline {
            return Err(LaunchError::Rendezvous(format!(
                "rank {} (of {}) could not reach rank 0's rendezvous at {at} within {} s ({last}): \
                 check that rank 0 was started, that MASTER_ADDR is rank 0's host as this machine \
                 reaches it, and that MASTER_PORT is open between the machines",
                spec.rank,
                spec.world_size,
                timeout.as_secs()
            )));
        }
        std::thread::sleep(CONNECT_PAUSE.min(remaining(deadline)));
    }
}
