//! Rank 0's side of the rendezvous: listen, take every other rank's hello, check that the
//! world fits together, make the id and hand it out with every rank's host.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::env::WorldSpec;
use super::super::wire::{self, Frame, Hello, ID_BYTES};
use super::super::LaunchError;
use super::{remaining, resolve, DataChannel, Peer, Rendezvous, Shared, CONNECT_PAUSE, WRITE_WAIT};

/// How long rank 0 keeps trying to bind a port another process holds: a previous run on the
/// same port may still be exiting.
const BIND_RETRY: Duration = Duration::from_secs(10);
/// How long rank 0 waits for one connection's hello: a live rank sends it at once, so a
/// connection that says nothing is not a rank and must not hold up the others.
const HELLO_WAIT: Duration = Duration::from_secs(5);

/// Rank 0: listens, takes every other rank's hello, checks the world, makes the id and
/// hands it out.
pub(super) fn host_rendezvous(
    spec: &WorldSpec,
    timeout: Duration,
    host: String,
    make_id: impl FnOnce() -> Result<[u8; ID_BYTES], LaunchError>,
) -> Result<Rendezvous, LaunchError> {
    let deadline = Instant::now() + timeout;
    let mut notes = Vec::new();
    let mut joined: Vec<Option<(Hello, TcpStream)>> = (0..spec.world_size).map(|_| None).collect();
    let mut data = None;
    if spec.world_size > 1 {
        let listener = listen(spec, &host, deadline, &mut notes)?;
        data = Some(listen_for_data(&listener, &host)?);
        accept_ranks(spec, timeout, &host, &listener, deadline, &mut joined)?;
    }
    let data_port = match &data {
        Some(listener) => listener
            .local_addr()
            .map_err(|e| LaunchError::Rendezvous(format!("rank 0 on {host}: {e}")))?
            .port(),
        None => 0,
    };
    let connected: Vec<(Hello, TcpStream)> = joined.into_iter().flatten().collect();
    let id = match make_id() {
        Ok(id) => id,
        Err(e) => {
            let message = format!("rank 0 on {host} could not make the run's id: {e}");
            tell_all(&connected, &Frame::Abort(message.clone()));
            return Err(LaunchError::Rendezvous(message));
        }
    };
    let mut hosts = vec![host.clone(); spec.world_size];
    let mut peers = Vec::with_capacity(connected.len());
    for (hello, stream) in connected {
        hosts[hello.rank] = hello.host.clone();
        peers.push(Peer {
            rank: hello.rank,
            host: hello.host,
            stream: Mutex::new(stream),
            done: AtomicBool::new(false),
        });
    }
    let shared = Arc::new(Shared {
        rank: 0,
        host,
        peers,
        settled: AtomicBool::new(false),
    });
    let welcome = Frame::Welcome {
        id,
        hosts: hosts.clone(),
        data_port,
    };
    for peer in &shared.peers {
        let sent = peer
            .stream
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))
            .and_then(|mut s| wire::write_frame(&mut *s, &welcome));
        if let Err(e) = sent {
            let message = format!(
                "rank {} on {} dropped its connection before it received the id ({e})",
                peer.rank, peer.host
            );
            shared.settled.store(true, Ordering::SeqCst);
            shared.send_all(&Frame::Abort(message.clone()), Some(peer.rank));
            return Err(LaunchError::Rendezvous(message));
        }
    }
    Ok(Rendezvous {
        spec: spec.clone(),
        id,
        hosts,
        notes,
        shared,
        timeout,
        data: DataChannel::Listener(Mutex::new(data)),
    })
}

/// The process group's listener: a port the system chooses, on the rendezvous's address,
/// sent to every rank in the welcome. A port of the system's choosing never collides with
/// another job on the machine, as `MASTER_PORT + 1` could (NCCL's bootstrap does the same,
/// so a cluster that runs NCCL lets such ports through).
fn listen_for_data(rendezvous: &TcpListener, host: &str) -> Result<TcpListener, LaunchError> {
    rendezvous
        .local_addr()
        .and_then(|at| TcpListener::bind((at.ip(), 0)))
        .map_err(|e| {
            LaunchError::Rendezvous(format!(
                "rank 0 on {host} cannot open a port for the ranks' process group: {e}"
            ))
        })
}

fn tell_all(streams: &[(Hello, TcpStream)], frame: &Frame) {
    for (_, stream) in streams {
        let _ = wire::write_frame(&mut &*stream, frame);
    }
}

/// Binds `MASTER_ADDR:MASTER_PORT`, retrying briefly while the port is taken.
fn listen(
    spec: &WorldSpec,
    host: &str,
    deadline: Instant,
    notes: &mut Vec<String>,
) -> Result<TcpListener, LaunchError> {
    let at = format!("{}:{}", spec.master_addr, spec.master_port);
    let addrs = resolve(spec).map_err(LaunchError::Rendezvous)?;
    let give_up = (Instant::now() + BIND_RETRY).min(deadline);
    loop {
        let error = match TcpListener::bind(&addrs[..]) {
            Ok(listener) => return Ok(listener),
            Err(e) => e,
        };
        match error.kind() {
            std::io::ErrorKind::AddrInUse if Instant::now() < give_up => {
                std::thread::sleep(CONNECT_PAUSE);
            }
            // MASTER_ADDR names this machine by an address it does not own (a NAT'd or
            // load-balanced name): listen on every interface, as torchrun's store does.
            std::io::ErrorKind::AddrNotAvailable => {
                let any = TcpListener::bind(("0.0.0.0", spec.master_port)).map_err(|e| {
                    LaunchError::Rendezvous(format!(
                        "rank 0 on {host} cannot listen on port {} ({e}): choose another MASTER_PORT",
                        spec.master_port
                    ))
                })?;
                notes.push(format!(
                    "MASTER_ADDR={} is not an address of {host}: rank 0 listens on every interface, port {}",
                    spec.master_addr, spec.master_port
                ));
                return Ok(any);
            }
            std::io::ErrorKind::AddrInUse => {
                return Err(LaunchError::Rendezvous(format!(
                    "rank 0 on {host} cannot listen on {at}: the port is in use (another job, \
                     or a previous run still exiting): choose another MASTER_PORT"
                )))
            }
            _ => {
                return Err(LaunchError::Rendezvous(format!(
                    "rank 0 on {host} cannot listen on {at}: {error}; set MASTER_ADDR to an \
                     address of rank 0's machine and MASTER_PORT to a free port"
                )))
            }
        }
    }
}

/// Rank 0 takes hellos until every rank has joined, or names the ones that did not.
fn accept_ranks(
    spec: &WorldSpec,
    timeout: Duration,
    host: &str,
    listener: &TcpListener,
    deadline: Instant,
    joined: &mut [Option<(Hello, TcpStream)>],
) -> Result<(), LaunchError> {
    let at = format!("{}:{}", spec.master_addr, spec.master_port);
    listener
        .set_nonblocking(true)
        .map_err(|e| LaunchError::Rendezvous(format!("rank 0 cannot poll {at}: {e}")))?;
    let fail =
        |joined: &mut [Option<(Hello, TcpStream)>], message: String, extra: Option<TcpStream>| {
            let frame = Frame::Abort(message.clone());
            for (_, stream) in joined.iter_mut().flatten() {
                let _ = wire::write_frame(stream, &frame);
            }
            if let Some(mut stream) = extra {
                let _ = wire::write_frame(&mut stream, &frame);
            }
            LaunchError::Rendezvous(message)
        };
    while joined.iter().skip(1).any(Option::is_none) {
        let (stream, _) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..spec.world_size)
                        .filter(|&r| joined[r].is_none())
                        .collect();
                    let message = not_joined(&missing, spec.world_size, &at, timeout);
                    return Err(fail(joined, message, None));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                let message = format!("rank 0 on {host} stopped accepting ranks at {at}: {e}");
                return Err(fail(joined, message, None));
            }
        };
        let Some((hello, stream)) = read_hello(stream, deadline) else {
            continue;
        };
        if let Err(message) = check_hello(spec, host, &hello, joined) {
            return Err(fail(joined, message, Some(stream)));
        }
        let rank = hello.rank;
        joined[rank] = Some((hello, stream));
    }
    Ok(())
}

/// A connection's hello, or `None` for one that is not a rank (another program, a port
/// scanner, a rank that died mid-hello): those are dropped rather than failing the run; a
/// rank that never says hello is named when the wait ends.
fn read_hello(stream: TcpStream, deadline: Instant) -> Option<(Hello, TcpStream)> {
    let mut stream = stream;
    stream.set_nonblocking(false).ok()?;
    stream
        .set_read_timeout(Some(HELLO_WAIT.min(remaining(deadline))))
        .ok()?;
    stream.set_write_timeout(Some(WRITE_WAIT)).ok()?;
    let hello = wire::read_hello(&mut stream).ok()?;
    stream.set_read_timeout(None).ok()?;
    Some((hello, stream))
}

/// Whether `hello` fits the world rank 0 was started with.
fn check_hello(
    spec: &WorldSpec,
    host: &str,
    hello: &Hello,
    joined: &[Option<(Hello, TcpStream)>],
) -> Result<(), String> {
    let w = spec.world_size;
    if hello.version != wire::VERSION {
        return Err(format!(
            "rank {} on {} speaks rendezvous protocol {}, rank 0 on {host} speaks {}: run the \
             same tunestudio build on every machine",
            hello.rank,
            hello.host,
            hello.version,
            wire::VERSION
        ));
    }
    if hello.world_size != w {
        return Err(format!(
            "rank {} on {} was started in a world of {} ranks, rank 0 on {host} in one of {w}: \
             every process needs the same WORLD_SIZE (SLURM_NTASKS)",
            hello.rank, hello.host, hello.world_size
        ));
    }
    if hello.rank == 0 || hello.rank >= w {
        return Err(format!(
            "a process on {} joined as rank {}, but rank 0 is on {host} and the other ranks are \
             1..{}: give every process its own rank below the world size",
            hello.host,
            hello.rank,
            w - 1
        ));
    }
    if let Some((first, _)) = &joined[hello.rank] {
        return Err(format!(
            "rank {} joined twice, from {} and from {}: give every process its own rank",
            hello.rank, first.host, hello.host
        ));
    }
    Ok(())
}

fn not_joined(missing: &[usize], world_size: usize, at: &str, timeout: Duration) -> String {
    let ranks: Vec<String> = missing.iter().map(usize::to_string).collect();
    let noun = if missing.len() == 1 { "rank" } else { "ranks" };
    format!(
        "{noun} {} (of {world_size}) did not join the rendezvous at {at} within {} s: check \
         that every rank was started, with MASTER_ADDR:MASTER_PORT reachable from its machine \
         (or raise {})",
        ranks.join(", "),
        timeout.as_secs(),
        super::super::env::RENDEZVOUS_TIMEOUT_ENV
    )
}
